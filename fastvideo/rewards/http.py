"""The one HTTP client of the rewards that run outside the training process (``remote:URL``, ``vlm_judge:URL``).

Standard library only (``urllib``), so a trainer needs no serving package. Every call has a per-attempt timeout and a
bounded number of retries with exponential backoff; whatever goes wrong ends in a ``RewardServerError`` naming the URL
and what happened (refused connection, timeout, HTTP status with the server's own message, a reply that is not JSON),
never a hang: one call takes at most ``(retries + 1) * timeout_s + backoff_s * (2**retries - 1)`` seconds (the
timeout bounds the connection and each wait for bytes of the reply). Proxies from the environment are not used: reward
servers sit on the cluster's own network.
"""
from __future__ import annotations

import http.client
import json
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Sequence

TOKEN_ENV = "FASTVIDEO_REWARD_TOKEN"  # the bearer token: read by the server (default of --token) and by every client
RETRY_STATUSES = (429, 502, 503, 504)  # busy / restarting / behind a proxy that lost it: worth another try
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class RewardServerError(RuntimeError):
    """A reward server could not score: the message names the URL, what happened and what to check.

    ``status`` is the HTTP status of a refusal (None when no usable reply came); ``transient`` is True when every try
    failed to get a reply (refused connection, timeout, 429/502/503/504): another replica of the server may do better.
    """

    def __init__(self, message: str, *, url: str = "", status: int | None = None, transient: bool = False) -> None:
        super().__init__(message)
        self.url, self.status, self.transient = url, status, transient


def token_from_env() -> str | None:
    """The bearer token of ``FASTVIDEO_REWARD_TOKEN`` (None when unset or empty)."""
    return os.environ.get(TOKEN_ENV) or None


def split_urls(text: str, what: str = "reward server") -> list[str]:
    """The base URLs of ``URL|URL|...`` (replicas of one server), each ``http(s)://HOST[:PORT][/PATH]`` without a
    trailing slash; ValueError saying what is malformed."""
    urls = [u.strip().rstrip("/") for u in text.split("|")]
    for url in urls:
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port  # noqa: B018 -- raises ValueError for a port that is not a number in 0..65535
        except ValueError as err:
            raise ValueError(f"{what} URL {url!r} is malformed ({err}); write http://HOST:PORT") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{what} URL {url!r} is malformed: write http://HOST:PORT (or https://...), several "
                             "replicas as http://A:PORT|http://B:PORT")
        if parts.query or parts.fragment:
            raise ValueError(f"{what} URL {url!r}: drop the ?query / #fragment (give the server's base URL)")
    return urls


def request(url: str, *, body: bytes | None = None, content_type: str = "application/json",
            token: str | None = None, timeout_s: float = 60.0, retries: int = 2, backoff_s: float = 0.5,
            what: str = "reward server") -> Any:
    """POST ``body`` (GET when None) to ``url`` and return the reply's parsed JSON.

    Retries refused/reset connections, timeouts and HTTP 429/502/503/504 up to ``retries`` times (waiting
    ``backoff_s * 2**attempt``); any other HTTP error is raised at once with the server's message (401: the token,
    413: the size limit). ``RewardServerError`` names ``what`` and ``url``."""
    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = content_type
    if token:
        headers["Authorization"] = f"Bearer {token}"
    last = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        req = urllib.request.Request(url, data=body, headers=headers, method="POST" if body is not None else "GET")
        try:
            with _OPENER.open(req, timeout=timeout_s) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as err:
            detail = _detail(err)
            if err.code in RETRY_STATUSES:
                last = f"HTTP {err.code}: {detail}"
                continue
            raise RewardServerError(f"{what} {url} refused the request: HTTP {err.code}: {detail}"
                                    f"{_hint(err.code)}", url=url, status=err.code) from None
        except http.client.HTTPException as err:  # not HTTP at all (BadStatusLine), or a reply cut short
            last = f"a broken HTTP reply ({type(err).__name__}: {err})"
            continue
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError, OSError) as err:
            reason = getattr(err, "reason", err)
            last = (f"no reply within {timeout_s:g} s" if isinstance(reason, (socket.timeout, TimeoutError))
                    else f"cannot connect ({reason})")
            continue
        try:
            return json.loads(raw)
        except ValueError:
            raise RewardServerError(f"{what} {url} answered with something that is not JSON ({len(raw)} bytes, "
                                    f"starting {raw[:120]!r}); is the URL a fastvideo reward server / an "
                                    "OpenAI-compatible endpoint?", url=url) from None
    raise RewardServerError(f"{what} {url} failed {retries + 1} time(s), last: {last}; check that the server is "
                            f"running and reachable from this node (GET its /health), or raise --reward_timeout_s / "
                            f"--reward_retries", url=url, transient=True)


def request_replicas(urls: Sequence[str], first: int, path: str = "", **kwargs: Any) -> tuple[Any, str]:
    """``request(url + path, **kwargs)`` to replica ``first`` of ``urls`` and, while a replica gives no reply (a
    transient failure), to each next one in turn: the parsed reply and the URL that gave it. A refusal (HTTP 4xx/5xx
    other than 429/502/503/504) is raised at once; ``RewardServerError`` listing every failure when none replied."""
    failures: list[str] = []
    for k in range(len(urls)):
        url = urls[(first + k) % len(urls)]
        try:
            return request(f"{url}{path}", **kwargs), url
        except RewardServerError as err:
            if not err.transient or len(urls) == 1:
                raise
            failures.append(str(err))
    raise RewardServerError(f"every replica of {'|'.join(urls)} failed: " + "; ".join(failures), url=urls[0],
                            transient=True)


def wait_healthy(urls: list[str], timeout_s: float = 600.0, poll_s: float = 2.0) -> None:
    """Wait until ``GET <url>/health`` answers for every URL (servers still loading their models), polling every
    ``poll_s``; RewardServerError naming the URLs still silent after ``timeout_s``. What a launcher runs before it
    starts the trainers that score remotely."""
    deadline = time.monotonic() + timeout_s
    pending = [u.rstrip("/") for u in urls]
    while pending:
        still = []
        for url in pending:
            try:
                request(f"{url}/health", timeout_s=min(poll_s * 5, 30.0), retries=0)
            except RewardServerError:
                still.append(url)
        pending = still
        if pending and time.monotonic() > deadline:
            raise RewardServerError(f"reward server(s) {', '.join(pending)} not healthy after {timeout_s:g} s; see "
                                    "their logs (the model may still be loading, or the port is taken)")
        if pending:
            time.sleep(poll_s)


def _detail(err: urllib.error.HTTPError) -> str:
    """The server's error message: FastAPI's ``{"detail": ...}`` or the start of the body."""
    try:
        raw = err.read()
    except OSError:
        return err.reason or ""
    try:
        parsed = json.loads(raw)
        if isinstance(parsed, dict):
            detail = parsed.get("detail", parsed.get("error", parsed))
            if isinstance(detail, dict) and "message" in detail:  # OpenAI-style {"error": {"message": ...}}
                detail = detail["message"]
            return str(detail)
    except ValueError:
        pass
    return raw[:300].decode("utf-8", "replace")


def _hint(status: int) -> str:
    """What to do about a status the client does not retry."""
    if status in (401, 403):
        return f"; set {TOKEN_ENV} to the server's --token on every node"
    if status == 413:
        return "; lower --remote_batch_size (images per request) or raise the server's --max_request_mb"
    if status == 404:
        return "; check the URL's path (a fastvideo reward server scores at /score, a chat server at " \
               "/v1/chat/completions)"
    return ""


__all__ = ["RETRY_STATUSES", "RewardServerError", "TOKEN_ENV", "request", "split_urls", "token_from_env",
           "wait_healthy"]


def main(argv: list[str] | None = None) -> None:
    """``python -m fastvideo.rewards.http --wait URL [URL ...] [--timeout_s S]``: exit 0 once every server is healthy,
    1 with the reason otherwise (the Slurm example waits for its reward servers with it)."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m fastvideo.rewards.http", description=main.__doc__)
    p.add_argument("--wait", nargs="+", required=True, metavar="URL", help="reward server base URLs")
    p.add_argument("--timeout_s", type=float, default=600.0, help="give up after this many seconds (default 600)")
    args = p.parse_args(argv)
    try:
        wait_healthy(args.wait, args.timeout_s)
    except RewardServerError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"healthy: {' '.join(args.wait)}", flush=True)


if __name__ == "__main__":
    main()
