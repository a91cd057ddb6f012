"""Scoring beside sampling (--reward_overlap): each decoded rollout micro-batch is scored on a worker thread while the
caller samples the next one.

``OverlapScorer(reward_fn, device)`` keeps one worker thread (a reward model is used by one call at a time, as in the
sequential path) and, on a GPU/NPU, a stream of its own. ``submit(images, prompts)`` records an event on the caller's
current stream and returns at once; the worker queues the reward's device work on its stream behind that event (the
decode that made the images), so it never reads unfinished images and the sampling loop never waits for it (no host
sync); the images stay alive, and their memory reserved for the scorer's stream, until they are scored. ``join()``
waits for every submitted micro-batch and returns the scores concatenated per key in submission order: what one
``reward_fn`` call on all the images returns for a reward that scores each image on its own (a batch-dependent reward
model sees the micro-batches as --reward_batch_size would cut them). After a micro-batch failed, the rest of the
rollout's are skipped and ``join`` raises that failure.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

from fastvideo import devices

RewardCall = Callable[[torch.Tensor, Sequence[str]], dict[str, torch.Tensor]]


class OverlapScorer:
    """A reward (``RewardFn``-like: images, prompts -> {key: (b,) CPU tensor}) run on one worker thread, micro-batch
    by micro-batch, in submission order."""

    def __init__(self, reward_fn: RewardCall, device: torch.device | str) -> None:
        self.reward_fn = reward_fn
        self.stream = devices.new_stream(device)  # None on the CPU
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastvideo-reward")
        self._pending: list[Future] = []
        self._failed = False  # a micro-batch of the current rollout failed: skip the rest (join raises it)

    def submit(self, images: torch.Tensor, prompts: Sequence[str], sources: torch.Tensor | None = None) -> None:
        """Queue ``images`` (b, 3, H, W) in [0, 1] and their ``prompts`` (an edit run: and ``sources``) for scoring;
        returns at once."""
        ready = devices.record_event(images.device)  # the decode is queued on the caller's stream before this
        self._pending.append(self._pool.submit(self._score, images, list(prompts), ready, sources))

    def _score(self, images: torch.Tensor, prompts: list[str], ready: Any, sources: torch.Tensor | None = None
               ) -> tuple[dict[str, torch.Tensor], float]:
        """On the worker thread: one micro-batch's scores and the seconds they took (nothing after a failure)."""
        if self._failed:
            return {}, 0.0
        t0 = time.perf_counter()
        try:
            with devices.on_stream(self.stream, after=ready, tensors=(images,)):
                scores = (self.reward_fn(images, prompts) if sources is None
                          else self.reward_fn(images, prompts, sources=sources))
        except BaseException:
            self._failed = True
            raise
        return scores, time.perf_counter() - t0

    def join(self) -> tuple[dict[str, torch.Tensor], float]:
        """Wait for every submitted micro-batch; their scores per key in submission order, and the worker's busy
        seconds on them. Raises the first micro-batch's failure once none is left running."""
        pending, self._pending = self._pending, []
        results, error = [], None
        for future in pending:
            try:
                results.append(future.result())
            except Exception as err:  # noqa: BLE001  (the reward's own error, raised below once all are done)
                error = error or err
        self._failed = False
        if error is not None:
            raise error
        parts = [scores for scores, _ in results]
        joined = {key: torch.cat([part[key] for part in parts]) for key in (parts[0] if parts else {})}
        return joined, sum(seconds for _, seconds in results)

    def close(self) -> None:
        """Stop the worker thread (after the micro-batches already running)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
