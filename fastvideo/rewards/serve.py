"""A reward server: any reward of the registry behind HTTP, with dynamic batching of concurrent requests.

    python -m fastvideo.rewards.serve --reward hpsv2 --hps_checkpoint HPS_v2.1_compressed.pt [--host 0.0.0.0]
        [--port 8000] [--device cuda:0] [--max_batch_size 64] [--max_wait_ms 10] [--token T]

Trainers and sample.py score with it through ``--reward remote:http://HOST:PORT`` (``fastvideo.rewards.remote``,
which also holds the wire format). Endpoints: ``POST /score`` (a safetensors body of images and prompts -> JSON
scores; ``Authorization: Bearer TOKEN`` when the server has a token) and ``GET /health`` (``{"status"}`` for anyone;
with the token: spec, components, device, counters, limits). A non-loopback --host needs a token (or
--insecure_no_token); admission control (``fastvideo.rewards.batching``): --max_queue (429), --request_timeout_s (503),
--max_images_per_request and --max_request_mb (413). Requests queued together with the same image size and dtype are merged into one reward
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
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch

from fastvideo.config import build_parser as build_options_parser
from fastvideo.config import parse_with_config
from fastvideo.distributed import pick_device_type
from fastvideo.rewards import REWARD_PATH_FLAGS, RewardOptions, build_reward, check_reward_prompts, parse_reward_spec
from fastvideo.rewards.batching import Batcher, Busy, Expired, Gone
from fastvideo.rewards.http import TOKEN_ENV, is_loopback, request

if TYPE_CHECKING:
    from fastapi import FastAPI  # optional

PROG = "python -m fastvideo.rewards.serve"
READY_LINE = re.compile(r"^serving .* on (https?://\S+)$")  # what main prints once the port answers


# ----------------------------------------------------------------------------------------------------- the app
# the server's limits: (flag, default) -- what /health reports to a client with the token
LIMIT_DEFAULTS = {"max_batch_size": 64, "max_wait_ms": 10.0, "max_request_mb": 64.0, "max_image_side": 4096,
                  "max_images_per_request": 256, "max_queue": 64, "request_timeout_s": 100.0,
                  "max_prompt_chars": 2000, "delay_ms": 0.0, "reward_delay_ms": 0.0}
LIMIT_HELP = {
    "max_batch_size": "images per merged reward call; a larger request is scored alone",
    "max_wait_ms": "milliseconds a batch waits after its first request for others to merge (0 = merge only what is "
                   "already queued)",
    "max_request_mb": "largest request body in MiB: larger ones get HTTP 413 before they are read; clients split "
                      "their requests to fit",
    "max_image_side": "largest image height or width in pixels: larger get HTTP 400",
    "max_images_per_request": "most images in one request: more get HTTP 413; clients split their requests to fit",
    "max_queue": "requests that may wait to be scored; one more gets HTTP 429 with Retry-After, which clients retry "
                 "with jittered backoff",
    "request_timeout_s": "a request not scored this many seconds after it arrived is dropped unscored and answered "
                         "503; keep it below the clients' --reward_timeout_s (120)",
    "max_prompt_chars": "longest prompt in characters: longer get HTTP 400",
    "delay_ms": "artificial latency added to every /score request, in milliseconds, for benchmarks of a slow reward",
    "reward_delay_ms": "artificial latency added to every reward call on the server's one worker, in milliseconds: a "
                       "slow reward model that requests queue behind",
}
PIXEL_TOLERANCE = 1e-3  # how far outside [0, 1] a pixel may lie (rounding of a clamp in another dtype) before a 400


def log_line(client: str, status: int, reason: str) -> None:
    """One line on stderr for a refused or failed request: time, client, status, reason (never the token)."""
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {client} {status} {reason}", file=sys.stderr, flush=True)


def check_pixels(images: torch.Tensor, max_prompt_chars: int, prompts: list[str], what: str = "image") -> None:
    """ValueError naming the first image (``what``: or source) with a non-finite pixel or one outside [0, 1] (beyond
    PIXEL_TOLERANCE), or the first prompt over ``max_prompt_chars``."""
    flat = images.flatten(1)
    bad = (~torch.isfinite(flat)).any(1).nonzero()
    if len(bad):
        raise ValueError(f"{what} {int(bad[0])} has NaN or infinite pixels; send finite images in [0, 1]")
    outside = ((flat < -PIXEL_TOLERANCE) | (flat > 1 + PIXEL_TOLERANCE)).any(1).nonzero()
    if len(outside):
        i = int(outside[0])
        raise ValueError(f"{what} {i} has pixels outside [0, 1] (min {float(flat[i].min()):g}, max "
                         f"{float(flat[i].max()):g}); send images in [0, 1] (clamp them)")
    long = next((i for i, p in enumerate(prompts) if len(p) > max_prompt_chars), None)
    if long is not None:
        raise ValueError(f"prompt {long} has {len(prompts[long])} characters, over this server's --max_prompt_chars "
                         f"{max_prompt_chars}")


def json_reply(reply: dict) -> str:
    """The reply as strict JSON: a non-finite score (kept for the client's --nonfinite_reward) travels as null."""
    scores = {k: [v if v == v and abs(v) != float("inf") else None for v in values]
              for k, values in reply["scores"].items()}
    return json.dumps({**reply, "scores": scores}, allow_nan=False)


def create_app(reward_fn: Any, spec: str | None, *, device: str, token: str | None = None,
               insecure: bool = False, degraded_after: int = 3, chat: dict[str, Any] | None = None,
               **limits: Any) -> "FastAPI":
    """The FastAPI app: ``POST /score`` (when ``spec`` is given), ``GET /health``, and the chat routes of
    ``fastvideo.rewards.chat_server`` when ``chat`` holds its keyword arguments (model_dir, served_name);
    ``limits``: any of ``LIMIT_DEFAULTS``. ``reward_fn`` None with a ``spec``: the reward is still loading (/score
    answers 503 with Retry-After, /health "loading") until ``app.state.loaded(reward_fn)``."""
    from fastapi import FastAPI, HTTPException, Request, Response  # optional
    from fastapi.responses import JSONResponse  # optional

    from .remote import decode_request

    unknown = set(limits) - set(LIMIT_DEFAULTS)
    if unknown:
        raise TypeError(f"create_app: unknown limits {sorted(unknown)}")
    limits = {**LIMIT_DEFAULTS, **limits}
    max_bytes = int(limits["max_request_mb"] * 2**20)

    def read(body: list[bytes]) -> tuple[torch.Tensor, list[str], torch.Tensor | None]:
        """The request's images, prompts and an edit's sources (ValueError saying what is wrong), off the event loop:
        24 MiB take ~40 ms to join and decode. Images never widen past float32 (a float64 'dtype' in the metadata
        would double the server's memory for the same scores)."""
        images, prompts, sources = decode_request(b"".join(body), limits["max_image_side"], widest=torch.float32)
        if images.shape[0] > limits["max_images_per_request"]:
            raise OverflowError(f"{images.shape[0]} images in one request, over this server's "
                                f"--max_images_per_request {limits['max_images_per_request']}; send at most that "
                                "many per request (--remote_batch_size)")
        check_pixels(images, limits["max_prompt_chars"], prompts)
        if sources is not None:
            check_pixels(sources, limits["max_prompt_chars"], prompts, what="source")
        check_reward_prompts(spec, prompts, "the request's prompts")
        return images, prompts, sources

    batcher = (Batcher(reward_fn, limits["max_batch_size"], limits["max_wait_ms"] / 1000, limits["max_queue"],
                       limits["reward_delay_ms"] / 1000) if spec is not None else None)
    refusals: collections.Counter = collections.Counter()  # HTTP status -> refusals answered (counters' http_NNN)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(batcher.run()) if batcher is not None else None
        yield
        if task is not None:
            task.cancel()

    app = FastAPI(title="fastvideo reward server", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def client_of(request: Request) -> str:
        return f"{request.client.host}:{request.client.port}" if request.client else "?"

    @app.exception_handler(HTTPException)
    async def refused(request: Request, err: HTTPException) -> JSONResponse:
        """Every refusal and failure: logged in one line, answered as FastAPI does ({"detail": ...})."""
        log_line(client_of(request), err.status_code, f"{request.method} {request.url.path}: {err.detail}")
        refusals[err.status_code] += 1
        return JSONResponse({"detail": err.detail}, status_code=err.status_code, headers=err.headers)

    def authorized(request: Request) -> bool:
        """True when the server has no token or the request carries it (constant-time comparison)."""
        if token is None:
            return True
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())

    def loaded(fn: Any) -> None:
        """The reward has loaded: /score serves."""
        batcher.reward_fn = fn

    app.state.loaded = loaded

    def loading() -> bool:
        return batcher is not None and batcher.reward_fn is None

    def status() -> str:
        failing = batcher is not None and batcher.consecutive_failures >= degraded_after
        return "loading" if loading() else "degraded" if failing else "ok"

    @app.get("/health")
    async def health(request: Request) -> dict:
        """Liveness for anyone: ``{"status": "ok" | "degraded"}`` (degraded after --degraded_after reward calls
        failed in a row); the description (spec, components, device, counters, limits) only with the token, or
        from a server that has none (loopback, or --insecure_no_token: then with a warning)."""
        if not authorized(request):
            return {"status": status()}
        names = batcher.reward_fn.names if batcher is not None and batcher.reward_fn is not None else []
        details = {"status": status(), "spec": spec, "components": list(names),
                   "device": device, "token_required": token is not None,
                   "counters": ({**batcher.counters, "waiting": batcher.waiting(),
                                 **{f"http_{code}": n for code, n in sorted(refusals.items())}}
                                if batcher is not None else {}), "limits": limits,
                   "chat_model": (chat or {}).get("served_name")}
        if token is None:
            details["warning"] = ("no token: anyone who reaches this port can use this server" if insecure else
                                  "no token: any process on this machine can use this server")
        return details

    @app.post("/score")
    async def score(request: Request) -> Response:
        """Score the images of a safetensors body (``fastvideo.rewards.remote.encode_request``)."""
        if batcher is None:
            raise HTTPException(404, "this server serves no reward (started with --chat_model only); restart it "
                                     "with --reward SPEC")
        if loading():
            raise HTTPException(503, "the reward model is still loading; retry shortly (GET /health says 'ok' once "
                                     "it serves)", headers={"Retry-After": "5"})
        if not authorized(request):
            what = "a wrong" if request.headers.get("authorization") else "no"
            raise HTTPException(401, f"{what} bearer token: this server needs 'Authorization: Bearer TOKEN' with its "
                                     f"--token; clients read it from {TOKEN_ENV}",
                                headers={"WWW-Authenticate": "Bearer"})
        too_big = f"the request body is over this server's --max_request_mb {limits['max_request_mb']:g}"
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise HTTPException(413, f"{too_big} ({int(declared)} bytes)", headers={"Connection": "close"})
        chunks, size = [], 0
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                raise HTTPException(413, f"{too_big} (more than {max_bytes} bytes)", headers={"Connection": "close"})
        if limits["delay_ms"]:
            await asyncio.sleep(limits["delay_ms"] / 1000)
        try:
            images, prompts, sources = await asyncio.to_thread(read, chunks)
        except OverflowError as err:
            raise HTTPException(413, str(err)) from None
        except ValueError as err:
            raise HTTPException(400, str(err)) from None
        del chunks
        if await request.is_disconnected():  # a client that gave up (timed out) while the body was read or delayed
            batcher.counters["disconnected"] += 1
            log_line(client_of(request), 499, "POST /score: the client disconnected; dropped unscored")
            return Response(status_code=499)
        try:
            pending = batcher.admit(images, prompts, sources)
        except Busy as err:
            raise HTTPException(429, str(err), headers={"Retry-After": str(err.retry_after_s)}) from None
        try:
            reply = await batcher.wait(pending, limits["request_timeout_s"], request.is_disconnected)
        except Expired:
            raise HTTPException(503, f"not scored within this server's --request_timeout_s "
                                     f"{limits['request_timeout_s']:g}: dropped (a request still queued is never "
                                     "scored); the server is overloaded: retry later or add replicas",
                                headers={"Retry-After": "1"}) from None
        except Gone:
            log_line(client_of(request), 499, "POST /score: the client disconnected; dropped unscored")
            return Response(status_code=499)
        except ValueError as err:  # the reward's own message: a prompt it cannot score, a non-finite score
            raise HTTPException(400, str(err)) from None
        except Exception as err:  # noqa: BLE001 -- the reward crashed: 500 with its message, traceback in the log
            traceback.print_exception(err)
            raise HTTPException(500, f"the reward failed: {type(err).__name__}: {err}") from None
        return Response(json_reply(reply), media_type="application/json")

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
                              "(then a token is required, or --insecure_no_token) (default: 127.0.0.1)")
    serving.add_argument("--port", type=int, default=8000, help="TCP port; 0 = any free port, printed in the "
                                                                "'serving ... on URL' line (default: 8000)")
    serving.add_argument("--device", default=None,
                         help="device of the reward models: cuda, cuda:1, npu, cpu (default: first available of "
                              "cuda, npu, cpu)")
    for name, text in LIMIT_HELP.items():
        kind = type(LIMIT_DEFAULTS[name])
        serving.add_argument(f"--{name}", type=kind, default=LIMIT_DEFAULTS[name],
                             help=f"{text} (default: {LIMIT_DEFAULTS[name]:g})")
    serving.add_argument("--degraded_after", type=int, default=3,
                         help="/health says 'degraded' after this many reward calls failed in a row (default: 3)")
    serving.add_argument("--token", default=os.environ.get(TOKEN_ENV) or None,
                         help=f"bearer token every /score request must carry (HTTP 401 otherwise); default: the "
                              f"{TOKEN_ENV} variable (prefer it: a flag shows in `ps`). Required unless --host is a "
                              "loopback address or --insecure_no_token")
    serving.add_argument("--insecure_no_token", action="store_true",
                         help="serve a non-loopback --host without a token: anyone who reaches the port can score "
                              "(warned at start and in /health)")
    serving.add_argument("--ssl_keyfile", default=None, help="TLS private key (PEM): serve https:// (with "
                                                             "--ssl_certfile)")
    serving.add_argument("--ssl_certfile", default=None, help="TLS certificate chain (PEM), with --ssl_keyfile")
    serving.add_argument("--chat_model", default=None, metavar="DIR",
                         help="also serve this local chat model (a vision-language judge) on OpenAI-compatible "
                              "/v1/chat/completions and /v1/models routes (fastvideo.rewards.chat_server), for "
                              "vlm_judge:URL rewards; --reward becomes optional")
    serving.add_argument("--chat_served_name", default=None,
                         help="model name the chat routes answer to (default: --chat_model as given, as vLLM)")
    return parser


def check_token(host: str, token: str | None, insecure: bool) -> str | None:
    """Closed by default: ValueError for a non-loopback ``host`` without a token (unless ``insecure``); the warning
    to print at start for a server without one, else None. The chat server shares it."""
    if token is not None:
        if insecure:
            raise ValueError("--insecure_no_token with a --token: drop one of them")
        return None
    if not is_loopback(host) and not insecure:
        raise ValueError(f"--host {host} serves other machines, and this server has no token: set "
                         f"{TOKEN_ENV} (or --token) to a secret and give it to the clients, or pass "
                         "--insecure_no_token to serve anyone who reaches the port")
    return ("warning: --insecure_no_token: anyone who reaches this port can use this server" if insecure else
            "warning: no token: any process on this machine can use this server (set " + TOKEN_ENV + " to close it)")


def check_args(args: argparse.Namespace) -> str | None:
    """ValueError naming the flag of a serving flag out of range (before any model loads); returns the start-up
    warning of ``check_token``."""
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
              (args.max_images_per_request >= 1, f"--max_images_per_request must be >= 1, got "
                                                 f"{args.max_images_per_request}"),
              (args.max_queue >= 1, f"--max_queue must be >= 1, got {args.max_queue}"),
              (args.request_timeout_s > 0, f"--request_timeout_s must be > 0, got {args.request_timeout_s}"),
              (args.max_prompt_chars >= 1, f"--max_prompt_chars must be >= 1, got {args.max_prompt_chars}"),
              (args.degraded_after >= 1, f"--degraded_after must be >= 1, got {args.degraded_after}"),
              (args.delay_ms >= 0, f"--delay_ms must be >= 0, got {args.delay_ms}"),
              (args.reward_delay_ms >= 0, f"--reward_delay_ms must be >= 0, got {args.reward_delay_ms}"),
              (args.reward_batch_size >= 0, f"--reward_batch_size must be >= 0, got {args.reward_batch_size}"),
              (args.token is None or args.token.strip() == args.token != "",
               "--token must be non-empty without surrounding spaces"),
              ((args.ssl_keyfile is None) == (args.ssl_certfile is None),
               "--ssl_keyfile and --ssl_certfile go together: pass both, or neither"))
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    for flag in ("ssl_keyfile", "ssl_certfile"):
        path = getattr(args, flag)
        if path is not None and not os.path.isfile(path):
            raise FileNotFoundError(f"--{flag} {path}: no such file")
    return check_token(args.host, args.token, args.insecure_no_token)


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
        warning = check_args(args)
        device = args.device if args.device else pick_device_type(None)
        pick_device_type(device)  # ValueError for a device this machine lacks
        sock = listen(args.host, args.port)
        if args.reward is not None:  # every path the reward reads, before serving (the model loads while serving)
            from fastvideo.rewards import check_reward_paths
            check_reward_paths(args.reward, **{k: getattr(args, k) for k in REWARD_PATH_FLAGS})
        chat = None
        if args.chat_model is not None:  # the chat model's name defaults to the folder as given, as vLLM's does
            chat = {"model_dir": args.chat_model, "served_name": args.chat_served_name or args.chat_model}
        app = create_app(None, args.reward, device=device, token=args.token, insecure=args.insecure_no_token,
                         degraded_after=args.degraded_after, chat=chat,
                         **{k: getattr(args, k) for k in LIMIT_DEFAULTS})
    except (ValueError, FileNotFoundError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
        return 2
    host = f"[{args.host}]" if ":" in args.host else args.host
    what = args.reward or "no reward"
    if chat is not None:
        what += f" + chat model {chat['served_name']}"
    if warning:
        print(warning, flush=True)
    scheme = "https" if args.ssl_certfile else "http"
    ssl = {"ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile} if args.ssl_certfile else {}
    def load() -> Any:
        """The reward, built while the port already answers (503 'loading' until it is up)."""
        if args.reward is None:
            return None
        reward_fn = build_reward(args.reward, device, batch_size=args.reward_batch_size,
                                 **{k: getattr(args, k) for k in REWARD_PATH_FLAGS})
        reward_fn.nonfinite = "keep"  # a NaN score travels (JSON null): the client's --nonfinite_reward decides
        return reward_fn

    try:
        return asyncio.run(_serve(app, sock, f"serving {what} on {scheme}://{host}:{sock.getsockname()[1]}", load,
                                  limit_concurrency=4 * args.max_queue + 16, **ssl))
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, after a clean shutdown
        return 0


async def _serve(app: "FastAPI", sock: socket.socket, ready_line: str, load: Any, **config: Any) -> int:
    """Run uvicorn on ``sock`` (``config``: more uvicorn settings: the connection cap, TLS), load the reward with
    ``load()`` in a thread meanwhile (/score answers 503 until then), and print ``ready_line`` once both are up;
    a reward that fails to load stops the server (one line, exit status 2). Refused and failed requests are logged by
    the app, one line each. SIGTERM / SIGINT: no new connections (clients fail over to another replica), requests in
    flight finish (5 s)."""
    import uvicorn  # optional

    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                                           **config))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        reward_fn = await asyncio.to_thread(load)
    except (ValueError, FileNotFoundError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
        server.should_exit = True
        await task
        return 2
    if reward_fn is not None:
        app.state.loaded(reward_fn)
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started:
        print(ready_line, flush=True)
    await task
    return 0


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
