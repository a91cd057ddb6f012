"""An OpenAI-compatible chat-completions server for a local transformers VLM folder (what ``vlm_judge:URL`` talks to).

``add_chat_routes(app, model_dir=..., device=...)`` mounts, in the shape vLLM's and SGLang's OpenAI servers answer:

- ``GET /v1/models``: ``{"object": "list", "data": [{"id": <served name>, "object": "model", ...}]}``;
- ``POST /v1/chat/completions``: ``messages`` whose content is a string or a list of ``{"type": "text", "text"}`` and
  ``{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}`` parts (images only as data URIs: the
  server fetches nothing), ``max_tokens`` / ``max_completion_tokens``, ``temperature`` (0 = greedy), ``top_p``,
  ``seed``, ``logprobs`` + ``top_logprobs`` (at most 20, vLLM's default ``--max-logprobs``). The reply has
  ``choices[0].message.content`` and, when asked, ``choices[0].logprobs.content[i] = {"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...]}`` for every generated token, log-probabilities of the model's
  raw logits (vLLM's default ``raw_logprobs``), tokens decoded one by one as vLLM does.

The model is any folder ``AutoProcessor`` + ``AutoModelForImageTextToText`` load (Qwen2-VL / Qwen2.5-VL and the like;
``fastvideo.rewards.tiny_vlm`` builds a tiny one): the processor's chat template renders the messages (an image part
becomes the template's image placeholder), the processor encodes text and images, and ``generate`` decodes one request
at a time. Errors are OpenAI-style ``{"error": {"message", "type", "code"}}``: 400 for a malformed request (the message
says what to fix), 401 without the bearer token when one is set, 404 for another model name.

Standalone: ``python -m fastvideo.rewards.chat_server --model DIR [--port 8000] [--host 127.0.0.1] [--token T]
[--served_name NAME] [--device cuda]`` (the token defaults to ``$FASTVIDEO_REWARD_TOKEN``); it adds ``GET /health``.
"""

import argparse
import base64
import binascii
import hmac
import io
import json
import os
import re
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import torch

from fastvideo.rewards.http import TOKEN_ENV, is_loopback

MAX_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs
DEFAULT_MAX_TOKENS = 256
MAX_TOKENS_LIMIT = 8192
_DATA_URI = re.compile(r"data:image/[\w.+-]+;base64,(.*)", re.DOTALL)
# request limits: body size, images per request, characters of text per request, pixels per image
MAX_BODY_MB = 32.0
MAX_IMAGES = 8
MAX_TEXT_CHARS = 20000
MAX_IMAGE_PIXELS = 4096 * 4096


class ChatRequestError(ValueError):
    """A request the server cannot answer: ``status`` is the HTTP status, the message says what to fix."""

    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


def decode_image(url: str) -> Any:
    """A ``data:image/...;base64,...`` URI -> an RGB PIL image (ChatRequestError for anything else)."""
    from PIL import Image, UnidentifiedImageError  # heavy

    match = _DATA_URI.fullmatch(url.strip())
    if match is None:
        raise ChatRequestError(f"image_url {url[:60]!r} is not a base64 data URI (data:image/png;base64,...): this "
                               "server fetches no URLs; send the image inline")
    try:
        image = Image.open(io.BytesIO(base64.b64decode(match.group(1), validate=True)))
        if image.width * image.height > MAX_IMAGE_PIXELS:  # checked on the header, before the pixels are decoded
            raise ChatRequestError(f"image_url holds a {image.width}x{image.height} image, over this server's "
                                   f"{MAX_IMAGE_PIXELS} pixels; send a smaller image")
        return image.convert("RGB")
    except (binascii.Error, ValueError, UnidentifiedImageError, OSError, Image.DecompressionBombError) as err:
        if isinstance(err, ChatRequestError):
            raise

        raise ChatRequestError(f"image_url data URI does not decode to an image ({err}); send base64 PNG or "
                               "JPEG bytes") from None


def parse_messages(messages: Any) -> tuple[list[dict], list[Any]]:
    """OpenAI chat messages -> (messages for the processor's chat template, the images in order of appearance);
    at most MAX_IMAGES images and MAX_TEXT_CHARS characters of text in all."""
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    texts = [m.get("content") if isinstance(m.get("content"), str) else part.get("text", "")
             for m in messages if isinstance(m, dict)
             for part in ([{}] if isinstance(m.get("content"), str) else m.get("content") or [])
             if isinstance(part, dict)]
    chars = sum(len(t) for t in texts if isinstance(t, str))
    if chars > MAX_TEXT_CHARS:
        raise ChatRequestError(f"the messages hold {chars} characters of text, over this server's {MAX_TEXT_CHARS}")
    count = sum(1 for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
                for part in m["content"] if isinstance(part, dict) and part.get("type") == "image_url")
    if count > MAX_IMAGES:
        raise ChatRequestError(f"the messages hold {count} images, over this server's {MAX_IMAGES} per request")
    rendered, images = [], []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
            raise ChatRequestError(f"messages[{i}] needs a 'role' of system, user or assistant and a 'content'")
        content = message.get("content")
        if isinstance(content, str):
            rendered.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise ChatRequestError(f"messages[{i}].content must be a string or a list of content parts")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                image_url = part.get("image_url")
                url = image_url.get("url") if isinstance(image_url, dict) else image_url
                if not isinstance(url, str):
                    raise ChatRequestError(f"messages[{i}].content[{j}] needs image_url: {{\"url\": \"data:...\"}}")
                images.append(decode_image(url))
                parts.append({"type": "image"})
            else:
                raise ChatRequestError(f"messages[{i}].content[{j}] has type {kind!r}: this server takes 'text' "
                                       "(with a string 'text') and 'image_url' parts")
        rendered.append({"role": message["role"], "content": parts})
    return rendered, images


def _int_field(body: dict, key: str, default: int, low: int, high: int) -> int:
    """``body[key]`` as an int in [low, high] (``default`` when absent)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ChatRequestError(f"'{key}' must be an integer in [{low}, {high}], got {value!r}")
    return value


def _float_field(body: dict, key: str, default: float, low: float, high: float) -> float:
    """``body[key]`` as a float in [low, high] (``default`` when absent)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ChatRequestError(f"'{key}' must be a number in [{low:g}, {high:g}], got {value!r}")
    return float(value)


class ChatModel:
    """A transformers VLM folder, loaded once, answering chat-completion bodies one at a time."""

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu") -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor  # heavy

        path = Path(model_dir).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"chat model {str(model_dir)!r} is not a transformers model folder (no "
                                    "config.json): pass a local VLM folder (e.g. Qwen2.5-VL-7B-Instruct) or build a "
                                    "tiny one with `python -m fastvideo.rewards.tiny_vlm DIR`")
        self.device = torch.device(device)
        self.processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        dtype = torch.float32 if self.device.type == "cpu" else "auto"  # bf16 checkpoints stay bf16 on accelerators
        self.model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True, dtype=dtype)
        self.model.to(self.device).eval().requires_grad_(False)
        self.tokenizer = self.processor.tokenizer
        eos = self.model.generation_config.eos_token_id
        self.stop_ids = set([eos] if isinstance(eos, int) else eos or [])
        self.lock = threading.Lock()  # one generate at a time: requests queue here

    def _token(self, token_id: int, logprob: float) -> dict:
        """One token's ``{"token", "logprob", "bytes"}`` in the OpenAI / vLLM shape."""
        text = self.tokenizer.decode([token_id])
        return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode("utf-8"))}

    def _entry(self, token_id: int, logits: torch.Tensor, top: int) -> dict:
        """The logprobs entry of one generated token from its step's raw logits (V,): itself and its ``top`` best."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        best = logprobs.topk(top)
        return {**self._token(token_id, float(logprobs[token_id])),
                "top_logprobs": [self._token(i, v) for v, i in zip(best.values.tolist(), best.indices.tolist())]}

    def complete(self, body: Any, served_name: str) -> dict:
        """Answer one chat-completions request body (ChatRequestError for a malformed one)."""
        if not isinstance(body, dict):
            raise ChatRequestError("the body must be a JSON object with 'messages'")
        if body.get("model") not in (None, served_name):
            raise ChatRequestError(f"The model `{body['model']}` does not exist (this server serves "
                                   f"{served_name!r}).", 404, "NotFoundError")
        if body.get("stream"):
            raise ChatRequestError("'stream' is not supported: send stream: false")
        _int_field(body, "n", 1, 1, 1)
        max_tokens = _int_field(body, "max_completion_tokens", _int_field(body, "max_tokens", DEFAULT_MAX_TOKENS, 1,
                                                                          MAX_TOKENS_LIMIT), 1, MAX_TOKENS_LIMIT)
        temperature = _float_field(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _float_field(body, "top_p", 1.0, 1e-6, 1.0)
        want_logprobs = bool(body.get("logprobs"))
        top = _int_field(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
        if top and not want_logprobs:
            raise ChatRequestError("'top_logprobs' needs 'logprobs': true")
        seed = _int_field(body, "seed", -1, 0, 2**63 - 1)
        messages, images = parse_messages(body.get("messages"))  # images decoded outside the lock
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else \
            dict(do_sample=False)
        # One request at a time from here: a fast tokenizer must not be used from two threads at once.
        with self.lock, torch.inference_mode():
            text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            inputs = self.processor(text=[text], images=images or None, return_tensors="pt")
            inputs = inputs.to(self.device, dtype=self.model.dtype)  # floating inputs (pixels) in the model's dtype
            if seed >= 0:
                torch.manual_seed(seed)
            out = self.model.generate(**inputs, max_new_tokens=max_tokens, output_logits=True,
                                      return_dict_in_generate=True, **sampling)
            prompt_tokens = inputs["input_ids"].shape[1]
            new = out.sequences[0, prompt_tokens:].tolist()
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": self.tokenizer.decode(new, skip_special_tokens=True)},
                "logprobs": {"content": [self._entry(token_id, logits[0], top)
                                         for token_id, logits in zip(new, out.logits)]} if want_logprobs else None,
                "finish_reason": "stop" if new and new[-1] in self.stop_ids else "length",
            }
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": served_name, "choices": [choice],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(new),
                          "total_tokens": prompt_tokens + len(new)}}


def _error(message: str, status: int, kind: str) -> Any:
    """An OpenAI-style error response."""
    from fastapi.responses import JSONResponse  # optional

    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                        status_code=status)


def add_chat_routes(app: Any, *, model_dir: str, device: str, served_name: str | None = None,
                    token: str | None = None) -> None:
    """Load the VLM folder ``model_dir`` on ``device`` and mount ``GET /v1/models`` and ``POST /v1/chat/completions``
    on the FastAPI ``app``; ``served_name`` is the model id (default: ``model_dir`` as given, like vLLM), ``token`` the
    bearer token both routes require (None: open)."""
    from fastapi import Request  # optional
    from starlette.concurrency import run_in_threadpool

    engine = ChatModel(model_dir, device)
    name = served_name or str(model_dir)
    created = int(time.time())

    def refused(request: Request) -> Any:
        """A 401 response when ``token`` is set and the request does not carry it, else None."""
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if token and not (scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())):
            return _error("Unauthorized: send the server's token as 'Authorization: Bearer <token>'", 401,
                          "Unauthorized")
        return None

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        """The one served model, in the OpenAI list shape."""
        return refused(request) or {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "fastvideo", "root": str(model_dir),
             "parent": None, "max_model_len": getattr(engine.model.config.get_text_config(),
                                                      "max_position_embeddings", None)}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        """One chat completion (OpenAI / vLLM format)."""
        denied = refused(request)
        if denied is not None:
            return denied
        declared = request.headers.get("content-length")
        limit = int(MAX_BODY_MB * 2**20)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return _error(f"the body is over this server's {MAX_BODY_MB:g} MiB", 413, "RequestTooLarge")
        chunks, size = [], 0
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                return _error(f"the body is over this server's {MAX_BODY_MB:g} MiB", 413, "RequestTooLarge")
        try:
            body = json.loads(b"".join(chunks))
        except ValueError:
            return _error("the body is not JSON: send a chat-completions request object", 400, "BadRequestError")
        try:
            return await run_in_threadpool(engine.complete, body, name)
        except ChatRequestError as err:
            return _error(str(err), err.status, err.kind)
        except Exception as err:  # noqa: BLE001 -- the model failed: 500 with its message, traceback in the log
            traceback.print_exception(err)
            return _error(f"the model failed: {type(err).__name__}: {err}", 500, "InternalServerError")


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: serve a VLM folder over the chat-completions API with uvicorn."""
    import uvicorn  # optional
    from fastapi import FastAPI  # optional

    parser = argparse.ArgumentParser(description="Serve a local transformers VLM folder over the OpenAI-compatible "
                                                 "chat-completions API (a stand-in for vLLM / SGLang)")
    parser.add_argument("--model", required=True, help="VLM folder (AutoProcessor + AutoModelForImageTextToText)")
    parser.add_argument("--served_name", default=None, help="model id clients send (default: --model as given)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    parser.add_argument("--token", default=os.environ.get(TOKEN_ENV) or None,
                        help=f"bearer token clients must send (default: ${TOKEN_ENV}); required unless --host is a "
                             "loopback address or --insecure_no_token")
    parser.add_argument("--insecure_no_token", action="store_true",
                        help="serve a non-loopback --host without a token (warned at start and in /health)")
    args = parser.parse_args(argv)
    if args.token is None and not is_loopback(args.host) and not args.insecure_no_token:
        parser.error(f"--host {args.host} serves other machines, and this server has no token: set {TOKEN_ENV} (or "
                     "--token), or pass --insecure_no_token to serve anyone who reaches the port")
    warning = None if args.token else ("anyone who reaches this port can use this server" if args.insecure_no_token
                                       else "any process on this machine can use this server")
    app = FastAPI(title="fastvideo chat server")
    add_chat_routes(app, model_dir=args.model, device=args.device, served_name=args.served_name, token=args.token)

    @app.get("/health")
    def health() -> dict:
        """Liveness probe (and the no-token warning)."""
        return {"status": "ok", **({"warning": f"no token: {warning}"} if warning else {})}

    if warning:
        print(f"warning: no token: {warning}", flush=True)

    print(f"serving {args.model} as {args.served_name or args.model!r} on http://{args.host}:{args.port}/v1",
          flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
