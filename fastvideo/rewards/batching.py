"""The reward server's queue: admission control and dynamic batching (``fastvideo.rewards.serve`` owns the HTTP side).

A request is admitted only while fewer than ``max_queue`` requests wait (else ``Busy``: HTTP 429 with Retry-After);
queued requests with the same image size and dtype are merged into one reward call of up to ``max_batch_size``
images, waiting at most ``max_wait_s`` after the oldest; one worker thread runs the reward, so calls never overlap.
A request whose deadline passes while it waits, or whose client went away, is cancelled and never scored (a batch
already running finishes). ``consecutive_failures`` counts reward calls that crashed in a row (``/health``'s
"degraded").
"""
from __future__ import annotations

import asyncio
import collections
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import torch


class Busy(Exception):
    """The queue is full: the client should retry after ``retry_after_s``."""

    def __init__(self, waiting: int, retry_after_s: int) -> None:
        super().__init__(f"{waiting} requests are waiting (this server's --max_queue); retry after "
                         f"{retry_after_s} s")
        self.retry_after_s = retry_after_s


class Expired(Exception):
    """The request waited past its deadline (--request_timeout_s) and was dropped unscored."""


class Gone(Exception):
    """The client disconnected before its request was scored; it was dropped."""


@dataclass
class _Pending:
    """A request waiting in the queue: its images, prompts, the future its handler awaits, and an edit's sources."""

    images: torch.Tensor
    prompts: list[str]
    future: asyncio.Future
    arrived: float
    sources: torch.Tensor | None = None

    @property
    def key(self) -> tuple:
        """What requests must share to be merged: image size and dtype, and the sources' size (None: no sources)."""
        return (tuple(self.images.shape[1:]), self.images.dtype,
                None if self.sources is None else tuple(self.sources.shape[1:]))


@dataclass
class Batcher:
    """The queue and the batching loop (``run``, one task for the server's lifetime)."""

    reward_fn: Any
    max_batch_size: int
    max_wait_s: float
    max_queue: int = 64
    call_delay_s: float = 0.0  # added to every reward call on the worker: a slow reward model (tests, benchmarks)
    counters: dict[str, int] = field(default_factory=lambda: dict(
        requests=0, batches=0, images=0, largest_batch_requests=0, refused_busy=0, expired=0, disconnected=0,
        failed_batches=0))
    consecutive_failures: int = 0
    _queue: collections.deque = field(default_factory=collections.deque)
    _arrived: asyncio.Event | None = None
    _worker: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="reward"))
    _last_call_s: float = 0.0

    def waiting(self) -> int:
        """Requests queued and not cancelled."""
        return sum(not p.future.done() for p in self._queue)

    def admit(self, images: torch.Tensor, prompts: list[str], sources: torch.Tensor | None = None) -> _Pending:
        """Queue one request (``Busy`` when ``max_queue`` already wait)."""
        waiting = self.waiting()
        if waiting >= self.max_queue:
            self.counters["refused_busy"] += 1
            raise Busy(waiting, max(1, round(self.max_wait_s + self._last_call_s + 0.5)))
        loop = asyncio.get_running_loop()
        pending = _Pending(images, prompts, loop.create_future(), loop.time(), sources)
        self._queue.append(pending)
        self.counters["requests"] += 1
        self._event().set()
        return pending

    async def wait(self, pending: _Pending, timeout_s: float,
                   disconnected: Callable[[], Awaitable[bool]] | None = None, poll_s: float = 0.05) -> dict:
        """The request's reply (``{"scores": ..., "batch": ...}``; the reward's error raised), or ``Expired`` after
        ``timeout_s`` / ``Gone`` once ``disconnected()`` says so; either cancels it if it is not being scored."""
        deadline = pending.arrived + timeout_s
        loop = asyncio.get_running_loop()
        while True:
            done, _ = await asyncio.wait({pending.future}, timeout=max(min(poll_s, deadline - loop.time()), 0))
            if done:
                return pending.future.result()
            if disconnected is not None and await disconnected():
                pending.future.cancel()
                self.counters["disconnected"] += 1
                raise Gone()
            if loop.time() >= deadline:
                pending.future.cancel()
                self.counters["expired"] += 1
                raise Expired()

    async def score(self, images: torch.Tensor, prompts: list[str], timeout_s: float = 3600.0) -> dict:
        """``admit`` then ``wait`` (no disconnect check): for callers inside the server process."""
        return await self.wait(self.admit(images, prompts), timeout_s)

    async def run(self) -> None:
        """The batching loop."""
        while True:
            await self._execute(await self._collect())

    def _event(self) -> asyncio.Event:
        """The 'a request arrived' event, made in the running loop."""
        if self._arrived is None:
            self._arrived = asyncio.Event()
        return self._arrived

    def _drop_cancelled(self) -> None:
        while self._queue and self._queue[0].future.done():
            self._queue.popleft()

    async def _wait_arrival(self, timeout_s: float | None) -> bool:
        """Wait until a live request heads the queue (False when ``timeout_s`` passed first)."""
        self._drop_cancelled()
        while not self._queue:
            self._event().clear()
            try:
                await asyncio.wait_for(self._event().wait(), timeout_s)
            except asyncio.TimeoutError:
                self._drop_cancelled()
                return bool(self._queue)
            self._drop_cancelled()
        return True

    async def _collect(self) -> list[_Pending]:
        """The next batch: the oldest live request, then those queued behind it with its key while they fit, until
        ``max_batch_size`` images or ``max_wait_s`` after the oldest arrived."""
        await self._wait_arrival(None)
        loop = asyncio.get_running_loop()
        batch = [self._queue.popleft()]
        size, key, deadline = batch[0].images.shape[0], batch[0].key, batch[0].arrived + self.max_wait_s
        while size < self.max_batch_size:
            if not await self._wait_arrival(max(deadline - loop.time(), 0.0)):
                break
            head = self._queue[0]
            if head.key != key or size + head.images.shape[0] > self.max_batch_size:
                break  # it heads the next batch
            batch.append(self._queue.popleft())
            size += head.images.shape[0]
        return batch

    async def _execute(self, batch: list[_Pending]) -> None:
        """Score ``batch`` in one reward call and hand each request its slice; when a merged call fails, each request
        is scored alone, so an error reaches only the request that caused it."""
        live = [p for p in batch if not p.future.done()]  # expired or disconnected: cancelled, not scored
        if not live:
            return
        parts = [p.images for p in live]
        sources = None if live[0].sources is None else [p.sources for p in live]  # one key: all or none have them
        prompts = [prompt for p in live for prompt in p.prompts]
        self.counters["batches"] += 1
        batch_id = self.counters["batches"]
        started = time.perf_counter()
        try:
            scores = await asyncio.get_running_loop().run_in_executor(self._worker, self._call, parts, prompts,
                                                                      sources)
        except Exception as err:  # noqa: BLE001 -- handed to the request(s), which answer 400/500
            if len(live) > 1:
                for p in live:
                    await self._execute([p])
                return
            if not isinstance(err, ValueError):  # the reward crashed (a ValueError is the request's own fault)
                self.counters["failed_batches"] += 1
                self.consecutive_failures += 1
            if not live[0].future.done():
                live[0].future.set_exception(err)
            return
        seconds = round(time.perf_counter() - started, 6)
        self._last_call_s, self.consecutive_failures = seconds, 0
        self.counters["images"] += len(prompts)
        self.counters["largest_batch_requests"] = max(self.counters["largest_batch_requests"], len(live))
        start = 0
        for p in live:
            n = p.images.shape[0]
            if not p.future.done():
                p.future.set_result({"scores": {k: v[start:start + n] for k, v in scores.items()},
                                     "batch": {"id": batch_id, "images": len(prompts), "requests": len(live),
                                               "reward_s": seconds}})
            start += n

    def _call(self, parts: list[torch.Tensor], prompts: list[str], sources: list[torch.Tensor] | None = None
              ) -> dict[str, list[float]]:
        """The reward of the requests' images joined (with their sources), on the worker thread: scores as lists of
        floats (exact float32 values)."""
        images = parts[0] if len(parts) == 1 else torch.cat(parts)
        if self.call_delay_s:
            time.sleep(self.call_delay_s)
        if sources is None:
            scores = self.reward_fn(images.to(self.reward_fn.device), prompts)
        else:
            scores = self.reward_fn(images.to(self.reward_fn.device), prompts,
                                    torch.cat(sources).to(self.reward_fn.device))
        return {key: value.tolist() for key, value in scores.items()}
