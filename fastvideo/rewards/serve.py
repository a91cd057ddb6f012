"""A reward server: any reward of the registry behind HTTP, with dynamic batching of concurrent requests.

    python -m fastvideo.rewards.serve --reward hpsv2 --hps_checkpoint HPS_v2.1_compressed.pt [--host 0.0.0.0]
        [--port 8000] [--device cuda:0] [--max_batch_size 64] [--max_wait_ms 10] [--token T]

Trainers and sample.py score with it through ``--reward remote:http://HOST:PORT`` (``fastvideo.rewards.remote``,
which also holds the wire format). Endpoints: ``POST /score`` (a safetensors body of images and prompts -> JSON
scores; ``Authorization: Bearer TOKEN`` when the server has a token) and ``GET /health`` (no token: spec, components,
device, counters, limits). Requests queued together with the same image size and dtype are merged into one reward
call of up to --max_batch_size images, waiting at most --max_wait_ms after the first; the reward runs on one worker
thread (one model, called serially) and each request gets its own slice of the scores back. Built on FastAPI +
uvicorn (``pip install -e '.[serve]'``); docs/reward-serving.md has every flag, the errors and measured overheads.
"""
# no ``from __future__ import annotations``: FastAPI reads the endpoints' annotations (Request) at definition time
import argparse
import asyncio
import collections
import hmac
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import traceback
from .http import TOKEN_ENV, request
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch

from fastvideo.config import build_parser as build_options_parser
from fastvideo.config import parse_with_config
from fastvideo.distributed import pick_device_type
from fastvideo.rewards import REWARD_PATH_FLAGS, RewardOptions, build_reward, check_reward_prompts, parse_reward_spec

if TYPE_CHECKING:
    from fastapi import FastAPI  # optional

PROG = "python -m fastvideo.rewards.serve"
READY_LINE = re.compile(r"^serving .* on (http://\S+)$")  # what main prints once the port answers


# ----------------------------------------------------------------------------------------------------- batching
@dataclass
class _Pending:
    """A request waiting in the queue: its images, prompts and the future its handler awaits."""

    images: torch.Tensor
    prompts: list[str]
    future: asyncio.Future
    arrived: float

    @property
    def key(self) -> tuple:
        """What requests must share to be merged: image size and dtype."""
        return tuple(self.images.shape[1:]), self.images.dtype


@dataclass
class Batcher:
    """Merges queued requests into reward calls of up to ``max_batch_size`` images (a larger request runs alone),
    waiting at most ``max_wait_s`` after the oldest; one worker thread runs the reward, so calls never overlap."""

    reward_fn: Any
    max_batch_size: int
    max_wait_s: float
    counters: dict[str, int] = field(default_factory=lambda: dict(requests=0, batches=0, images=0,
                                                                  largest_batch_requests=0))
    _queue: collections.deque = field(default_factory=collections.deque)
    _arrived: asyncio.Event | None = None
    _worker: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="reward"))

    async def score(self, images: torch.Tensor, prompts: list[str]) -> dict:
        """Queue one request and wait for its reply (``{"scores": ..., "batch": ...}``; the reward's error raised)."""
        loop = asyncio.get_running_loop()
        pending = _Pending(images, prompts, loop.create_future(), loop.time())
        self._queue.append(pending)
        self._event().set()
        return await pending.future

    async def run(self) -> None:
        """The batching loop (one task for the server's lifetime)."""
        while True:
            await self._execute(await self._collect())

    def _event(self) -> asyncio.Event:
        """The 'a request arrived' event, made in the running loop."""
        if self._arrived is None:
            self._arrived = asyncio.Event()
        return self._arrived

    async def _wait_arrival(self, timeout_s: float | None) -> bool:
        """Wait until the queue is non-empty (False when ``timeout_s`` passed first)."""
        while not self._queue:
            self._event().clear()
            try:
                await asyncio.wait_for(self._event().wait(), timeout_s)
            except asyncio.TimeoutError:
                return bool(self._queue)
        return True

    async def _collect(self) -> list[_Pending]:
        """The next batch: the oldest request, then those queued behind it with its key while they fit, until
        ``max_batch_size`` images or ``max_wait_s`` after the oldest arrived."""
        await self._wait_arrival(None)
        loop = asyncio.get_running_loop()
        batch = [self._queue.popleft()]
        size, key, deadline = batch[0].images.shape[0], batch[0].key, batch[0].arrived + self.max_wait_s
        while size < self.max_batch_size:
            if not self._queue and not await self._wait_arrival(max(deadline - loop.time(), 0.0)):
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
        live = [p for p in batch if not p.future.done()]  # a client that went away cancelled its future
        if not live:
            return
        parts = [p.images for p in live]
        prompts = [prompt for p in live for prompt in p.prompts]
        self.counters["batches"] += 1
        batch_id = self.counters["batches"]
        started = time.perf_counter()
        try:
            scores = await asyncio.get_running_loop().run_in_executor(self._worker, self._call, parts, prompts)
        except Exception as err:  # noqa: BLE001 -- handed to the request(s), which answer 400/500
            if len(live) > 1:
                for p in live:
                    await self._execute([p])
                return
            if not live[0].future.done():
                live[0].future.set_exception(err)
            return
        seconds = round(time.perf_counter() - started, 6)
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

    def _call(self, parts: list[torch.Tensor], prompts: list[str]) -> dict[str, list[float]]:
        """The reward of the requests' images joined, on the worker thread: scores as lists of floats (exact float32
        values)."""
        images = parts[0] if len(parts) == 1 else torch.cat(parts)
        scores = self.reward_fn(images.to(self.reward_fn.device), prompts)
        return {key: value.tolist() for key, value in scores.items()}


# ----------------------------------------------------------------------------------------------------- the app
def create_app(reward_fn: Any, spec: str | None, *, device: str, token: str | None = None, max_batch_size: int = 64,
               max_wait_ms: float = 10.0, max_request_mb: float = 256.0, max_image_side: int = 4096,
               delay_ms: float = 0.0, chat: dict[str, Any] | None = None) -> "FastAPI":
    """The FastAPI app: ``POST /score`` (when ``reward_fn`` is given), ``GET /health``, and the chat routes of
    ``fastvideo.rewards.chat_server`` when ``chat`` holds its keyword arguments (model_dir, served_name)."""
    from fastapi import FastAPI, HTTPException, Request, Response  # optional

    from .remote import decode_request

    def read(body: list[bytes]) -> tuple[torch.Tensor, list[str]]:
        """The request's images and prompts (ValueError saying what is wrong), off the event loop: 24 MiB take
        ~40 ms to join and decode."""
        images, prompts = decode_request(b"".join(body), max_image_side)
        check_reward_prompts(spec, prompts, "the request's prompts")
        return images, prompts

    batcher = Batcher(reward_fn, max_batch_size, max_wait_ms / 1000) if reward_fn is not None else None
    max_bytes = int(max_request_mb * 2**20)
    limits = dict(max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, max_request_mb=max_request_mb,
                  max_image_side=max_image_side, delay_ms=delay_ms)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(batcher.run()) if batcher is not None else None
        yield
        if task is not None:
            task.cancel()

    app = FastAPI(title="fastvideo reward server", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def authorized(request: Request) -> bool:
        """True when the server has no token or the request carries it (constant-time comparison)."""
        if token is None:
            return True
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())

    @app.get("/health")
    async def health(request: Request) -> dict:
        """Liveness and description, without a token (load balancers); ``authorized`` tells a client whether its
        own token (if it sent one) would be accepted."""
        return {"status": "ok", "spec": spec, "components": list(reward_fn.names) if reward_fn is not None else [],
                "device": device, "token_required": token is not None, "authorized": authorized(request),
                "counters": dict(batcher.counters) if batcher is not None else {}, "limits": limits,
                "chat_model": (chat or {}).get("served_name")}

    @app.post("/score")
    async def score(request: Request) -> Response:
        """Score the images of a safetensors body (``fastvideo.rewards.remote.encode_request``)."""
        if batcher is None:
            raise HTTPException(404, "this server serves no reward (started with --chat_model only); restart it "
                                     "with --reward SPEC")
        if not authorized(request):
            what = "a wrong" if request.headers.get("authorization") else "no"
            raise HTTPException(401, f"{what} bearer token: this server needs 'Authorization: Bearer TOKEN' with its "
                                     f"--token; clients read it from {TOKEN_ENV}",
                                headers={"WWW-Authenticate": "Bearer"})
        too_big = f"the request body is over this server's --max_request_mb {max_request_mb:g}"
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise HTTPException(413, f"{too_big} ({int(declared)} bytes)")
        chunks, size = [], 0
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                raise HTTPException(413, f"{too_big} (more than {max_bytes} bytes)")
        if delay_ms:
            await asyncio.sleep(delay_ms / 1000)
        try:
            images, prompts = await asyncio.to_thread(read, chunks)
        except ValueError as err:
            raise HTTPException(400, str(err)) from None
        batcher.counters["requests"] += 1
        try:
            reply = await batcher.score(images, prompts)
        except ValueError as err:  # the reward's own message: a prompt it cannot score, a non-finite score
            raise HTTPException(400, str(err)) from None
        except Exception as err:  # noqa: BLE001 -- the reward crashed: 500 with its message, traceback in the log
            traceback.print_exception(err)
            raise HTTPException(500, f"the reward failed: {type(err).__name__}: {err}") from None
        return Response(json.dumps(reply), media_type="application/json")

    if chat is not None:
        _add_chat_routes(app, token=token, device=device, **chat)
    return app


def _add_chat_routes(app: "FastAPI", **kwargs: Any) -> None:
    """Mount the OpenAI-compatible chat routes of ``fastvideo.rewards.chat_server`` (ValueError when it is absent)."""
    try:
        from fastvideo.rewards import chat_server
    except ModuleNotFoundError as err:
        if err.name != "fastvideo.rewards.chat_server":
            raise
        raise ValueError("--chat_model needs fastvideo.rewards.chat_server, which this installation lacks; update "
                         "the fastvideo package or serve the chat model with vLLM / SGLang") from None
    chat_server.add_chat_routes(app, **kwargs)


# ----------------------------------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    """The server's flags: the reward flags of the trainers (RewardOptions) and the serving ones."""
    parser = build_options_parser(
        (RewardOptions,), __doc__.split("\n\n")[0], exclude=("eval_reward", "nonfinite_reward", "reward_overlap"),
        default_overrides={"reward": None},
        help_overrides={"reward": "the reward to serve, as trainers write it (e.g. 'hpsv2' or "
                                  "'hpsv2:1.0,jpeg_compressibility:0.5'; clients get the total and every component); "
                                  "required unless --chat_model",
                        "reward_batch_size": "images per reward-model call inside a merged batch (0 = the whole "
                                             "batch); bounds the reward model's memory"})
    parser.prog = PROG
    serving = parser.add_argument_group("serving")
    serving.add_argument("--host", default="127.0.0.1",
                         help="address to listen on: 127.0.0.1 = this machine only, 0.0.0.0 = every interface "
                              "(then set --token) (default: 127.0.0.1)")
    serving.add_argument("--port", type=int, default=8000, help="TCP port; 0 = any free port, printed in the "
                                                                "'serving ... on URL' line (default: 8000)")
    serving.add_argument("--device", default=None,
                         help="device of the reward models: cuda, cuda:1, npu, cpu (default: first available of "
                              "cuda, npu, cpu)")
    serving.add_argument("--max_batch_size", type=int, default=64,
                         help="images per merged reward call; a larger request is scored alone (default: 64)")
    serving.add_argument("--max_wait_ms", type=float, default=10.0,
                         help="milliseconds a batch waits after its first request for others to merge (0 = merge "
                              "only what is already queued) (default: 10)")
    serving.add_argument("--max_request_mb", type=float, default=256.0,
                         help="largest request body in MiB: larger ones get HTTP 413 before they are read; clients "
                              "split their requests to fit (default: 256)")
    serving.add_argument("--max_image_side", type=int, default=4096,
                         help="largest image height or width in pixels: larger get HTTP 400 (default: 4096)")
    serving.add_argument("--token", default=os.environ.get(TOKEN_ENV) or None,
                         help=f"bearer token every /score request must carry (HTTP 401 otherwise); default: the "
                              f"{TOKEN_ENV} variable, else none (prefer the variable: a flag shows in `ps`)")
    serving.add_argument("--delay_ms", type=float, default=0.0,
                         help="artificial latency added to every /score request, in milliseconds, for benchmarks of "
                              "a slow reward (default: 0)")
    serving.add_argument("--chat_model", default=None, metavar="DIR",
                         help="also serve this local chat model (a vision-language judge) on OpenAI-compatible "
                              "/v1/chat/completions and /v1/models routes (fastvideo.rewards.chat_server), for "
                              "vlm_judge:URL rewards; --reward becomes optional")
    serving.add_argument("--chat_served_name", default=None,
                         help="model name the chat routes answer to (default: --chat_model as given, as vLLM)")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag of a serving flag out of range (before any model loads)."""
    if args.reward is None and args.chat_model is None:
        raise ValueError("--reward SPEC is required (e.g. --reward hpsv2 --hps_checkpoint FILE), unless --chat_model "
                         "DIR serves a chat model only")
    if args.reward is not None:
        parse_reward_spec(args.reward)
    checks = ((0 <= args.port <= 65535, f"--port must be in 0..65535 (0 = any free port), got {args.port}"),
              (args.max_batch_size >= 1, f"--max_batch_size must be >= 1, got {args.max_batch_size}"),
              (args.max_wait_ms >= 0, f"--max_wait_ms must be >= 0, got {args.max_wait_ms}"),
              (args.max_request_mb > 0, f"--max_request_mb must be > 0, got {args.max_request_mb}"),
              (args.max_image_side >= 1, f"--max_image_side must be >= 1, got {args.max_image_side}"),
              (args.delay_ms >= 0, f"--delay_ms must be >= 0, got {args.delay_ms}"),
              (args.reward_batch_size >= 0, f"--reward_batch_size must be >= 0, got {args.reward_batch_size}"),
              (args.token is None or args.token.strip() == args.token != "",
               "--token must be non-empty without surrounding spaces"))
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def listen(host: str, port: int) -> socket.socket:
    """A bound socket for ``host:port`` (ValueError naming --host/--port when the address is taken or wrong)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(f"cannot listen on --host {host} --port {port} ({err.strerror or err}); choose a free "
                         "--port (0 = any) or an address of this machine") from None
    return sock


def main(argv: Sequence[str] | None = None) -> int:
    """Check the flags, load the reward, listen, print 'serving SPEC on URL' once the port answers, serve until
    SIGINT/SIGTERM; a bad flag or path: one line and exit status 2."""
    try:
        parser = build_parser()
        args = parse_with_config(parser, argv)
        check_args(args)
        device = args.device if args.device else pick_device_type(None)
        pick_device_type(device)  # ValueError for a device this machine lacks
        sock = listen(args.host, args.port)
        reward_fn = None
        if args.reward is not None:
            reward_fn = build_reward(args.reward, device, batch_size=args.reward_batch_size,
                                     **{k: getattr(args, k) for k in REWARD_PATH_FLAGS})
            reward_fn.nonfinite = "keep"  # a NaN score travels (JSON NaN): the client's --nonfinite_reward decides
        chat = None
        if args.chat_model is not None:  # the chat model's name defaults to the folder as given, as vLLM's does
            chat = {"model_dir": args.chat_model, "served_name": args.chat_served_name or args.chat_model}
        app = create_app(reward_fn, args.reward, device=device, token=args.token, max_batch_size=args.max_batch_size,
                         max_wait_ms=args.max_wait_ms, max_request_mb=args.max_request_mb,
                         max_image_side=args.max_image_side, delay_ms=args.delay_ms, chat=chat)
    except (ValueError, FileNotFoundError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
        return 2
    host = f"[{args.host}]" if ":" in args.host else args.host
    what = args.reward or "no reward"
    if chat is not None:
        what += f" + chat model {chat['served_name']}"
    try:
        asyncio.run(_serve(app, sock, f"serving {what} on http://{host}:{sock.getsockname()[1]}"))
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, after a clean shutdown
        pass
    return 0


async def _serve(app: "FastAPI", sock: socket.socket, ready_line: str) -> None:
    """Run uvicorn on ``sock`` and print ``ready_line`` once it accepts connections."""
    import uvicorn  # optional

    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started:
        print(ready_line, flush=True)
    await task


# ----------------------------------------------------------------------------------------------------- for tests
@dataclass
class Launched:
    """A server started by ``launch``: its base ``url``, process, and output so far (``output()``)."""

    url: str
    proc: subprocess.Popen
    lines: list[str]

    def output(self) -> str:
        """Everything the server printed so far."""
        return "".join(self.lines)


@contextmanager
def launch(args: Sequence[str], *, timeout_s: float = 120.0, env: dict[str, str] | None = None
           ) -> Iterator[Launched]:
    """Start ``python -m fastvideo.rewards.serve ARGS`` (on a free port unless ARGS has --port) as a subprocess, wait
    until its /health answers, yield it, and stop it on exit (SIGTERM, then SIGKILL after 10 s); RuntimeError with
    the server's output when it exits or stays silent for ``timeout_s``. For tests and benchmarks."""
    args = list(args)
    cmd = [sys.executable, "-m", PROG.split()[-1], *args, *([] if "--port" in args else ["--port", "0"])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env={**os.environ, **(env or {})})
    lines: list[str] = []
    ready = threading.Event()
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            match = READY_LINE.match(line.strip())
            if match and not found:
                found.append(match[1])
                ready.set()
        ready.set()  # the process ended

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not ready.wait(timeout_s) or not found:
            raise RuntimeError(f"reward server did not start within {timeout_s:g} s (exit status {proc.poll()}): "
                               f"{' '.join(cmd)}\n{''.join(lines)[-4000:]}")
        request(f"{found[0]}/health", timeout_s=10, retries=3)
        yield Launched(found[0], proc, lines)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(5)


if __name__ == "__main__":
    sys.exit(main())
