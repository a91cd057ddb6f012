"""The one HTTP client of the rewards that run outside the training process (``remote:URL``, ``vlm_judge:URL``).

Standard library only (``urllib``), so a trainer needs no serving package. Every call has a per-attempt timeout and a
bounded number of retries with jittered exponential backoff (HTTP 429/503 wait the server's Retry-After); whatever goes
wrong ends in a ``RewardServerError`` naming the URL and what happened (refused connection, timeout, HTTP status with
the server's own message, a reply that is not JSON or is too large), never a hang: the whole call ends within
``(retries + 1) * timeout_s + 1.5 * backoff_s * (2**retries - 1)`` seconds, a deadline on the call, not per read.
Redirects are not followed (the bearer token would go to another host), replies are read up to ``MAX_REPLY_BYTES``,
a token sent over plain ``http://`` to another machine is warned about once per URL, and proxies from the environment
are not used: reward servers sit on the cluster's own network.
"""
from __future__ import annotations

import http.client
import ipaddress
import json
import os
import random
import select
import socket
import sys
import time
import urllib.parse
from typing import Any, Sequence

TOKEN_ENV = "FASTVIDEO_REWARD_TOKEN"  # the bearer token: read by the server (default of --token) and by every client
RETRY_STATUSES = (429, 502, 503, 504)  # busy / restarting / behind a proxy that lost it: worth another try
MAX_REPLY_BYTES = 64 * 2**20  # a reply larger than this is an error, not read (scores are a few KiB)
_CHUNK = 64 * 1024


EXPECT_CONTINUE_BYTES = 2**20  # a POST body larger than this asks "Expect: 100-continue" first: a server refusing it
# (413 / 401) answers before it is sent, and the answer is never lost to a reset; smaller bodies go at once (the
# handshake costs one round trip, ~45 ms against uvicorn on loopback, measured)
CONTINUE_WAIT_S = 1.0  # at most this (and a quarter of the try's timeout) a POST waits for "100 Continue" or an early
# refusal before it sends its body anyway (a server without 100-continue support costs that once per request)


class _Reply:
    """One HTTP exchange's outcome: status, headers and the bounded body."""

    def __init__(self, status: int, headers: Any, body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body


def _peek_status(sock: socket.socket, wait_s: float) -> bytes | None:
    """The first bytes of the server's answer to our headers, left unread (None when nothing came in ``wait_s``)."""
    end = time.monotonic() + wait_s
    head = b""
    while len(head) < 12:
        remaining = end - time.monotonic()
        if remaining <= 0 or not select.select([sock], [], [], remaining)[0]:
            return head or None
        head = sock.recv(12, socket.MSG_PEEK)
        if not head:  # closed
            return head
        if len(head) < 12:
            time.sleep(0.005)
    return head


def _send_after_continue(conn: http.client.HTTPConnection, body: bytes, wait_s: float) -> None:
    """``Expect: 100-continue``: send ``body`` once the server said 100 (consumed here) or stayed silent for
    ``wait_s``; not at all when it already answered (a 401 / 413 refusal, read by ``getresponse``), so the
    refusal arrives intact instead of as a connection reset."""
    head = _peek_status(conn.sock, wait_s)
    if head and head[:12] in (b"HTTP/1.1 100", b"HTTP/1.0 100"):
        seen = b""
        while not seen.endswith(b"\r\n\r\n"):
            byte = conn.sock.recv(1)
            if not byte:
                raise ConnectionResetError("the server closed the connection after 100 Continue")
            seen += byte
    elif head:
        return  # a final answer came first: do not send the body
    try:
        conn.send(body)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed while we wrote: getresponse reads its answer if it is there


def _exchange(url: str, body: bytes | None, headers: dict[str, str], timeout_s: float, deadline: float,
              what: str) -> _Reply:
    """One request on its own connection (http.client: no proxies from the environment, no redirects followed):
    a POST over EXPECT_CONTINUE_BYTES announces ``Expect: 100-continue`` over plain http; the reply is read
    within ``deadline`` and up to
    MAX_REPLY_BYTES."""
    parts = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname, parts.port, timeout=timeout_s)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        if body is None:
            conn.request("GET", path, headers=headers)
        else:
            conn.putrequest("POST", path, skip_accept_encoding=True)
            expect = parts.scheme == "http" and len(body) > EXPECT_CONTINUE_BYTES  # a TLS socket cannot be peeked
            for key, value in {**headers, "Content-Length": str(len(body)),
                               **({"Expect": "100-continue"} if expect else {})}.items():
                conn.putheader(key, value)
            conn.endheaders()
            if expect:
                _send_after_continue(conn, body, min(CONTINUE_WAIT_S, timeout_s / 4))
            else:
                try:
                    conn.send(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the server answered and closed while we wrote: getresponse reads its answer if it is there
        reply = conn.getresponse()
        return _Reply(reply.status, reply.headers, _read_bounded(reply, deadline, url, what))
    finally:
        conn.close()


_WARNED: set[str] = set()  # the URLs whose token over plain http was warned about


def is_loopback(host: str) -> bool:
    """True for a loopback address or name (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _warn_plain_token(url: str) -> None:
    """Once per URL: the bearer token goes unencrypted to another machine."""
    parts = urllib.parse.urlsplit(url)
    base = f"{parts.scheme}://{parts.netloc}"
    if parts.scheme == "http" and not is_loopback(parts.hostname or "") and base not in _WARNED:
        _WARNED.add(base)
        print(f"warning: the reward token goes to {base} over plain http (readable on the network); serve it with "
              "--ssl_keyfile/--ssl_certfile and use https://", file=sys.stderr, flush=True)


def _read_bounded(reply: Any, deadline: float, url: str, what: str) -> bytes:
    """The reply's body, in chunks, within the call's deadline and ``MAX_REPLY_BYTES``."""
    declared = reply.headers.get("Content-Length")
    if declared and declared.isdigit() and int(declared) > MAX_REPLY_BYTES:
        raise RewardServerError(f"{what} {url} announced a {int(declared)}-byte reply, over {MAX_REPLY_BYTES} "
                                "bytes: not a reward reply", url=url)
    parts, size = [], 0
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError("the reply did not finish within the call's deadline")
        chunk = reply.read(_CHUNK)
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)
        size += len(chunk)
        if size > MAX_REPLY_BYTES:
            raise RewardServerError(f"{what} {url} sent a reply over {MAX_REPLY_BYTES} bytes: not a reward reply",
                                    url=url)


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
    ``backoff_s * 2**attempt`` times a random factor in [0.5, 1.5), so that ranks do not retry in step, or the
    server's Retry-After when it sent one), all within the call's deadline; any other HTTP error is raised at once
    with the server's message (401: the token, 413: the size limit). ``RewardServerError`` names ``what`` and
    ``url``."""
    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = content_type
    if token:
        headers["Authorization"] = f"Bearer {token}"
        _warn_plain_token(url)
    deadline = time.monotonic() + (retries + 1) * timeout_s + 1.5 * backoff_s * (2 ** retries - 1)
    last, wait_s, tries = "", 0.0, 0
    for attempt in range(retries + 1):
        if attempt:
            wait_s = wait_s or backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5)
            if time.monotonic() + wait_s >= deadline:
                break
            time.sleep(wait_s)
        wait_s = 0.0
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        tries += 1
        try:
            reply = _exchange(url, body, headers, min(timeout_s, remaining), deadline, what)
            if reply.status >= 300:
                detail = _detail(reply.body, reply.status)
                if reply.status in RETRY_STATUSES:
                    last = f"HTTP {reply.status}: {detail}"
                    after = reply.headers.get("Retry-After", "") or ""
                    wait_s = min(float(after), timeout_s) if after.isdigit() else 0.0
                    continue
                raise RewardServerError(f"{what} {url} refused the request: HTTP {reply.status}: {detail}"
                                        f"{_hint(reply.status)}", url=url, status=reply.status)
            raw = reply.body
        except http.client.HTTPException as err:  # not HTTP at all (BadStatusLine), or a reply cut short
            last = f"a broken HTTP reply ({type(err).__name__}: {err})"
            continue
        except (ConnectionError, socket.timeout, TimeoutError, OSError) as err:
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
    raise RewardServerError(f"{what} {url} failed {tries} time(s), last: {last}; check that the server is "
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
    """Wait until ``GET <url>/health`` answers, and not "loading", for every URL (servers still loading their
    models), polling every
    ``poll_s``; RewardServerError naming the URLs still silent after ``timeout_s``. What a launcher runs before it
    starts the trainers that score remotely."""
    deadline = time.monotonic() + timeout_s
    pending = [u.rstrip("/") for u in urls]
    while pending:
        still = []
        for url in pending:
            try:
                health = request(f"{url}/health", timeout_s=min(poll_s * 5, 30.0), retries=0)
            except RewardServerError:
                still.append(url)
                continue
            if isinstance(health, dict) and health.get("status") == "loading":  # answering, its model not up yet
                still.append(url)
        pending = still
        if pending and time.monotonic() > deadline:
            raise RewardServerError(f"reward server(s) {', '.join(pending)} not healthy after {timeout_s:g} s; see "
                                    "their logs (the model may still be loading, or the port is taken)")
        if pending:
            time.sleep(poll_s)


def _detail(raw: bytes, status: int) -> str:
    """The server's error message: FastAPI's ``{"detail": ...}``, OpenAI's ``{"error": {"message"}}`` or the start of
    the body."""
    try:
        parsed = json.loads(raw)
        if isinstance(parsed, dict):
            detail = parsed.get("detail", parsed.get("error", parsed))
            if isinstance(detail, dict) and "message" in detail:  # OpenAI-style {"error": {"message": ...}}
                detail = detail["message"]
            return str(detail)
    except ValueError:
        pass
    return raw[:300].decode("utf-8", "replace") or http.client.responses.get(status, "")


def _hint(status: int) -> str:
    """What to do about a status the client does not retry."""
    if status in (401, 403):
        return f"; set {TOKEN_ENV} to the server's --token on every node"
    if status == 413:
        return "; lower --remote_batch_size (images per request) or raise the server's --max_request_mb"
    if 300 <= status < 400:
        return "; redirects are not followed (the token would go elsewhere): give the final URL"
    if status == 429:
        return "; the server's queue stayed full: add replicas or raise its --max_queue"
    if status == 404:
        return "; check the URL's path (a fastvideo reward server scores at /score, a chat server at " \
               "/v1/chat/completions)"
    return ""


__all__ = ["MAX_REPLY_BYTES", "RETRY_STATUSES", "RewardServerError", "TOKEN_ENV", "is_loopback", "request",
           "split_urls", "token_from_env", "wait_healthy"]


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
