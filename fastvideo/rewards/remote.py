"""The ``remote:URL`` reward: score images on a reward server (``python -m fastvideo.rewards.serve``) over HTTP.

Spec: ``remote[.LABEL]:URL[:WEIGHT]`` (``fastvideo.rewards.parse_reward_items``); URL is the server's base
``http://HOST:PORT[/PATH]``, or replicas ``http://A:PORT|http://B:PORT``. The component logs the server's total as
its value (``remote``) and each server component as ``remote_<component>`` (``remote_hpsv2``,
``remote_toyworld_strict``).

Wire format (one POST ``URL/score`` per request; ``encode_request`` / ``decode_request``): the body is a safetensors
file holding ``images`` (B, 3, H, W) with metadata ``prompts`` (a JSON list of B strings) and ``dtype`` (the images'
own dtype, restored by the server); an edit run's request also holds ``sources`` (B, 3, h, w), each image's source
image, in the same dtype (the server's reward compares them: ``RewardFn(images, prompts, sources)``). The images travel
in bfloat16 when every value survives bfloat16 exactly (decoded
images in a bf16 run always do), else in their own dtype: lossless either way, so a server scores exactly the tensor
a local reward would. The reply is JSON ``{"scores": {"total": [B floats], "<component>": [B floats], ...},
"batch": {"id", "images", "requests"}}``; JSON carries float32 values exactly. Remote scores therefore equal the local
reward's bit for bit wherever the reward scores each image alone (toyworld, jpeg_*) or the server's batch is the
local one (a model's kernels may round differently at another batch size).

A reward call is cut into requests of --remote_batch_size images (0: one request; cut further to fit the server's
--max_request_mb), up to --remote_max_concurrency in flight, spread round-robin over the replicas (rank r of a job
starts at replica r, so the ranks' simultaneous calls spread too). Each request has --reward_timeout_s and
--reward_retries (``fastvideo.rewards.http.request``); a request that gets no reply from one replica goes to the next.
Whatever fails raises ``RewardServerError`` naming the URL and what happened, never a hang.
The bearer token is the environment variable FASTVIDEO_REWARD_TOKEN (never a flag: flags are saved in config.json).
"""
from __future__ import annotations

import itertools
import json
import sys
import threading
import time
from .http import RewardServerError, request, request_replicas, split_urls, token_from_env
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, Sequence

import torch
from safetensors.torch import load, save

from fastvideo.distributed import launch_env

WIRE_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                                       "float32": torch.float32, "float64": torch.float64}
_HEADER_SLACK = 64 * 1024  # bytes of a request besides its pixels (safetensors header, prompts) assumed when cutting


def to_wire(images: torch.Tensor) -> torch.Tensor:
    """``images`` (contiguous, on the CPU) as they travel: in bfloat16 when every value survives bfloat16 exactly
    (for float32: the low 16 bits of every value are zero, checked in one pass), else unchanged."""
    images = images.detach().to("cpu").contiguous()
    if images.dtype == torch.float32:
        halves = images.view(torch.int16).view(-1, 2)  # each float32 as (low, high) 16-bit halves in memory order
        low = halves[:, 0 if sys.byteorder == "little" else 1]
        return images.to(torch.bfloat16) if int(torch.count_nonzero(low)) == 0 else images
    if images.dtype in (torch.float16, torch.float64):
        wire = images.to(torch.bfloat16)
        return wire if torch.equal(wire.to(images.dtype), images) else images
    return images


def wire_dtype(images: torch.Tensor) -> torch.dtype:
    """The dtype ``images`` travel in (``to_wire``): bfloat16 when that is lossless, else their own."""
    return to_wire(images).dtype


def encode_request(images: torch.Tensor, prompts: Sequence[str], sources: torch.Tensor | None = None) -> bytes:
    """The body of a /score request: safetensors bytes of ``images`` (B,3,H,W) (lossless, see ``to_wire``) with
    the prompts and the images' dtype in its metadata; an edit's ``sources`` (B,3,h,w) travel beside them, cast to
    the images' dtype."""
    name = next((k for k, v in WIRE_DTYPES.items() if v == images.dtype), None)
    if name is None:
        raise ValueError(f"remote rewards take float images in [0, 1], got dtype {images.dtype}")
    tensors = {"images": to_wire(images)}
    if sources is not None:
        tensors["sources"] = to_wire(sources.to(images.dtype))
    return save(tensors, metadata={"prompts": json.dumps(list(prompts)), "dtype": name})


def decode_request(body: bytes, max_image_side: int = 0, widest: torch.dtype | None = None
                   ) -> tuple[torch.Tensor, list[str], torch.Tensor | None]:
    """``(images in their original dtype, prompts, sources or None)`` of a /score body; ValueError saying what is wrong
    with it (not safetensors, no ``images`` (B,3,H,W) float tensor, ``sources`` not one (3,h,w) per image, prompts
    missing or not one per image, an image side over ``max_image_side`` when > 0). ``widest``: restore no wider than
    this dtype (the server: float32)."""
    fix = "send what fastvideo.rewards.remote.encode_request writes"
    if len(body) < 8:
        raise ValueError(f"the body ({len(body)} bytes) is not a safetensors file; {fix}")
    size = int.from_bytes(body[:8], "little")
    try:
        if size > len(body) - 8:
            raise ValueError("header longer than the body")
        header = json.loads(body[8:8 + size])
        tensors = load(body)
    except Exception as err:  # json.JSONDecodeError, safetensors' own error: both mean a malformed body
        raise ValueError(f"the body ({len(body)} bytes) is not a safetensors file ({err}); {fix}") from None
    meta = header.get("__metadata__") or {}
    if set(tensors) not in ({"images"}, {"images", "sources"}):
        raise ValueError(f"the body holds tensors {sorted(tensors)}; it must hold 'images' (and an edit's 'sources') "
                         f"only; {fix}")
    images, sources = tensors["images"], tensors.get("sources")
    for key, value in (("images", images), ("sources", sources)):
        if value is None:
            continue
        if value.ndim != 4 or value.shape[1] != 3 or value.shape[0] < 1 or 0 in value.shape:
            raise ValueError(f"'{key}' must have shape (B, 3, H, W) with B >= 1, got {tuple(value.shape)}")
        if value.dtype not in WIRE_DTYPES.values():
            raise ValueError(f"'{key}' must be a float tensor ({', '.join(WIRE_DTYPES)}), got {value.dtype}")
        if max_image_side and max(value.shape[2:]) > max_image_side:
            raise ValueError(f"{key} of {value.shape[2]}x{value.shape[3]} exceed this server's --max_image_side "
                             f"{max_image_side}; resize them or restart the server with a larger --max_image_side")
    if sources is not None and sources.shape[0] != images.shape[0]:
        raise ValueError(f"got {images.shape[0]} images but {sources.shape[0]} sources; send one source per image")
    try:
        prompts = json.loads(meta["prompts"])
    except (KeyError, ValueError):
        raise ValueError(f"the body's metadata lacks 'prompts' (a JSON list of strings, one per image); "
                         f"{fix}") from None
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError("metadata 'prompts' must be a JSON list of strings, one per image")
    if len(prompts) != images.shape[0]:
        raise ValueError(f"got {images.shape[0]} images but {len(prompts)} prompts; send one prompt per image")
    dtype = meta.get("dtype", "float32")
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"metadata 'dtype' {dtype!r} is not one of {', '.join(WIRE_DTYPES)}")
    restored = WIRE_DTYPES[dtype]
    if widest is not None and restored.itemsize > widest.itemsize:
        restored = widest
    return images.to(restored), prompts, None if sources is None else sources.to(restored)


def read_scores(reply: Any, url: str, count: int) -> dict[str, torch.Tensor]:
    """The ``scores`` of a /score reply as (count,) float32 tensors; RewardServerError naming ``url`` when the reply
    is not ``{"scores": {"total": [count numbers], ...}}``."""
    scores = reply.get("scores") if isinstance(reply, dict) else None
    problem = None
    if not isinstance(scores, dict) or "total" not in scores:
        problem = "no 'scores' object with a 'total'"
    else:
        for key, values in scores.items():
            if not isinstance(values, list) or len(values) != count or \
                    not all(v is None or isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                problem = f"'scores.{key}' is not a list of {count} numbers (null: not finite)"
                break
    if problem:
        raise RewardServerError(f"reward server {url}/score answered JSON that is not a reward reply ({problem}; "
                                f"starting {json.dumps(reply)[:160]}); is it a fastvideo reward server (GET "
                                f"{url}/health)?", url=url)
    return {key: torch.tensor([float("nan") if v is None else v for v in values], dtype=torch.float32)
            for key, values in scores.items()}


def check_server(url: str, token: str | None, timeout_s: float, retries: int) -> dict:
    """``GET URL/health``: the server's description (spec, components, limits); RewardServerError naming the URL
    when it does not answer, is no fastvideo reward server, serves no reward, or will refuse this client's token."""
    health = request(f"{url}/health", token=token, timeout_s=timeout_s, retries=retries)
    deadline = time.monotonic() + 10 * timeout_s
    while isinstance(health, dict) and health.get("status") == "loading":  # up, its reward model not yet
        if time.monotonic() > deadline:
            raise RewardServerError(f"reward server {url} is still loading its reward after {10 * timeout_s:g} s; "
                                    f"wait for it (python -m fastvideo.rewards.http --wait {url})", url=url,
                                    transient=True)
        time.sleep(1.0)
        health = request(f"{url}/health", token=token, timeout_s=timeout_s, retries=retries)
    if isinstance(health, dict) and set(health) == {"status"}:  # a server with a token tells others nothing more
        how = "is wrong" if token else "is not set"
        raise RewardServerError(f"reward server {url} requires a bearer token and FASTVIDEO_REWARD_TOKEN {how}; set "
                                "FASTVIDEO_REWARD_TOKEN to the server's --token on every node", url=url, status=401)
    if not isinstance(health, dict) or "limits" not in health or "spec" not in health:
        raise RewardServerError(f"{url}/health answered {json.dumps(health)[:160]}, not a fastvideo reward server's "
                                "health; point remote:URL at `python -m fastvideo.rewards.serve`", url=url)
    if not health["spec"]:
        raise RewardServerError(f"reward server {url} serves no reward (started without --reward); restart it with "
                                "--reward SPEC", url=url)
    return health


class RemoteScorer:
    """``(images (B,3,H,W), prompts) -> {"score": the server's total, <component>: ...}`` scored by reward servers;
    an edit run's ``sources`` travel with their images (``takes_sources``)."""

    takes_sources = True

    def __init__(self, urls: list[str], *, batch_size: int = 0, max_concurrency: int = 4, timeout_s: float = 120.0,
                 retries: int = 2, token: str | None = None, max_request_bytes: int = 0,
                 max_image_side: int = 0, max_images: int = 0, first_replica: int = 0) -> None:
        self.urls, self.batch_size, self.max_concurrency = urls, batch_size, max_concurrency
        self.timeout_s, self.retries, self.token = timeout_s, retries, token
        self.max_request_bytes, self.max_image_side, self.max_images = max_request_bytes, max_image_side, max_images
        self.last_batches: list[dict] = []  # the servers' "batch" replies of the last call (merging, for tests)
        self._next = itertools.count(first_replica)  # round-robin position over the replicas, across calls
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RemoteScorer({'|'.join(self.urls)!r})"

    def requests_for(self, images: torch.Tensor, sources: torch.Tensor | None = None) -> int:
        """Images per request: --remote_batch_size (0 = all), lowered to fit the server's --max_request_mb and
        --max_images_per_request."""
        per_request = self.batch_size or images.shape[0]
        if self.max_images:
            per_request = min(per_request, self.max_images)
        if self.max_request_bytes:
            per_image = (images[0].numel() + (0 if sources is None else sources[0].numel())) * images.element_size()
            fits = (self.max_request_bytes - _HEADER_SLACK) // per_image
            if fits < 1:
                raise ValueError(f"reward server {self.urls[0]}: one {images.shape[2]}x{images.shape[3]} image "
                                 f"({per_image / 2**20:.1f} MiB) exceeds its --max_request_mb "
                                 f"{self.max_request_bytes / 2**20:g}; restart the server with a larger "
                                 "--max_request_mb")
            per_request = min(per_request, fits)
        return per_request

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], sources: torch.Tensor | None = None
                 ) -> dict[str, torch.Tensor]:
        """Score a batch: one request per --remote_batch_size images (each with its sources), concurrently, results
        in order."""
        if self.max_image_side and max(images.shape[2:]) > self.max_image_side:
            raise ValueError(f"reward server {self.urls[0]} takes images up to {self.max_image_side} px a side "
                             f"(its --max_image_side), got {images.shape[2]}x{images.shape[3]}; restart it with a "
                             "larger --max_image_side")
        prompts = list(prompts)
        step = self.requests_for(images, sources)
        starts = range(0, images.shape[0], step)
        first = next(self._next)
        jobs = [(images[s:s + step], prompts[s:s + step], (first + i) % len(self.urls),
                 None if sources is None else sources[s:s + step]) for i, s in enumerate(starts)]
        if len(jobs) == 1:
            replies = [self._score(*jobs[0])]
        else:
            futures = [self._executor().submit(self._score, *job) for job in jobs]
            _, pending = wait(futures, return_when=FIRST_EXCEPTION)
            for future in futures:
                if future.done() and future.exception() is not None:
                    for other in pending:
                        other.cancel()  # not started yet; running ones end within their timeout
                    raise future.exception()  # type: ignore[misc]
            replies = [f.result() for f in futures]
        keys = set(replies[0][0])
        for scores, _ in replies[1:]:
            if set(scores) != keys:
                raise RewardServerError(f"the replicas of {'|'.join(self.urls)} serve different rewards (components "
                                        f"{sorted(keys)} vs {sorted(scores)}); start every replica with the same "
                                        "--reward", url=self.urls[0])
        self.last_batches = [batch for _, batch in replies]
        joined = {key: torch.cat([scores[key] for scores, _ in replies]) for key in replies[0][0]}
        return {"score": joined.pop("total"), **joined}

    def _executor(self) -> ThreadPoolExecutor:
        """The request threads, started on first use (--remote_max_concurrency of them)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="remote-reward")
            return self._pool

    def _score(self, images: torch.Tensor, prompts: list[str], replica: int, sources: torch.Tensor | None = None
               ) -> tuple[dict[str, torch.Tensor], dict]:
        """One request, to replica ``replica`` first and, when it gives no reply, to each other replica in turn."""
        reply, url = request_replicas(self.urls, replica, "/score", body=encode_request(images, prompts, sources),
                                      content_type="application/octet-stream", token=self.token,
                                      timeout_s=self.timeout_s, retries=self.retries)
        batch = reply.get("batch") if isinstance(reply, dict) else None
        return read_scores(reply, url, len(prompts)), batch if isinstance(batch, dict) else {}


def build(url: str, device: torch.device, *, remote_batch_size: int = 0, remote_max_concurrency: int = 4,
          reward_timeout_s: float = 120.0, reward_retries: int = 2, **_: object) -> RemoteScorer:
    """Registry factory of ``remote:URL``: asks every replica's /health first (fails here, before any training, when
    one does not answer, serves no reward or refuses the token), and takes the strictest of their size limits."""
    urls = split_urls(url)
    token = token_from_env()
    health = [check_server(u, token, min(reward_timeout_s, 30.0), reward_retries) for u in urls]
    limits = [h["limits"] for h in health]
    max_bytes = min((int(lim.get("max_request_mb", 0) * 2**20) for lim in limits if lim.get("max_request_mb")),
                    default=0)
    max_side = min((int(lim["max_image_side"]) for lim in limits if lim.get("max_image_side")), default=0)
    max_images = min((int(lim["max_images_per_request"]) for lim in limits if lim.get("max_images_per_request")),
                     default=0)

    return RemoteScorer(urls, batch_size=remote_batch_size, max_concurrency=remote_max_concurrency,
                        timeout_s=reward_timeout_s, retries=reward_retries, token=token, max_request_bytes=max_bytes,
                        max_image_side=max_side, max_images=max_images, first_replica=launch_env()[0])  # rank r starts at replica r


__all__ = ["RemoteScorer", "WIRE_DTYPES", "build", "check_server", "decode_request", "encode_request", "read_scores",
           "to_wire", "wire_dtype"]
