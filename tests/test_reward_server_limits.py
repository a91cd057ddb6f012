"""The reward server on a shared network (issue 52): closed by default, admission control (429 with Retry-After, the
per-request image cap, a server-side deadline, disconnected clients not scored), honest errors both ways (a real 413
through the real client in one try, no redirects followed, strict JSON), input checks, /health without the token
saying only its status, one log line per refusal. Real server processes on 127.0.0.1 (``serve.launch``); the waits
are counted, not timed: a batch held open by --max_wait_ms keeps the next request queued. Default tier, ~40 s; the
load test is slow."""
from __future__ import annotations

import http.client
import http.server
import json
import os
import threading
import time
from typing import Iterator

import pytest
import torch
from helpers import free_port

from fastvideo.rewards import build_reward
from fastvideo.rewards.http import TOKEN_ENV, RewardServerError, request
from fastvideo.rewards.remote import RemoteScorer, encode_request
from fastvideo.rewards.serve import json_reply, launch, main
from fastvideo.toyworld.scenes import all_prompts

pytest.importorskip("fastapi")

TOKEN = "limits-secret"
ENV = {"OMP_NUM_THREADS": "1"}
PROMPTS = list(all_prompts())


def images(n: int, side: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, side, side, generator=torch.Generator().manual_seed(seed))


def raw_post(url: str, body: bytes, token: str | None = TOKEN, timeout: float = 30) -> tuple[int, dict, dict]:
    """One POST /score without retries: (status, JSON reply, headers)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    headers = {"Content-Type": "application/octet-stream", **({"Authorization": f"Bearer {token}"} if token else {})}
    conn.request("POST", "/score", body=body, headers=headers)
    reply = conn.getresponse()
    raw = reply.read()
    conn.close()
    return reply.status, (json.loads(raw) if raw else {}), dict(reply.headers)


def counters(url: str) -> dict:
    return request(f"{url}/health", token=TOKEN, retries=0)["counters"]


def until(check, what: str, timeout_s: float = 30.0):
    """Poll ``check()`` (every 20 ms) until it returns something true, and return that; fail naming ``what`` after
    ``timeout_s``: the tests order requests by the server's counters, never by sleeping."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.02)
    return value


def in_thread(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    thread.start()
    return thread, out


@pytest.fixture(scope="module")
def capped_server() -> Iterator[object]:
    """toyworld with 4 images per request, 1 MiB bodies and 200-character prompts."""
    with launch(["--reward", "toyworld", "--device", "cpu", "--token", TOKEN, "--max_images_per_request", "4",
                 "--max_request_mb", "1", "--max_prompt_chars", "200"], env=ENV) as server:
        yield server


# ----------------------------------------------------------------------------------------------------- closed by default
def test_an_open_address_without_a_token_is_refused_before_loading(capsys, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert main(["--reward", "toyworld", "--device", "cpu", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert f"--host 0.0.0.0 serves other machines, and this server has no token: set {TOKEN_ENV}" in err
    assert "--insecure_no_token" in err
    assert main(["--reward", "toyworld", "--device", "cpu", "--token", "x", "--insecure_no_token"]) == 2
    assert "drop one of them" in capsys.readouterr().err
    from fastvideo.rewards import chat_server
    with pytest.raises(SystemExit):
        chat_server.main(["--model", "nowhere", "--host", "0.0.0.0"])
    assert "has no token" in capsys.readouterr().err


def test_a_server_without_a_token_warns_at_start_and_in_health(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    with launch(["--reward", "toyworld", "--device", "cpu", "--host", "0.0.0.0", "--insecure_no_token"],
                env={**env, **ENV}) as server:
        assert "warning: --insecure_no_token: anyone who reaches this port" in server.output()
        health = request(f"{server.url}/health", retries=0)
        assert health["warning"].startswith("no token: anyone") and health["limits"]["max_queue"] == 64


# ----------------------------------------------------------------------------------------------------- /health, logs
def test_health_without_the_token_is_only_the_status_and_refusals_are_logged(capped_server):
    url = capped_server.url
    assert request(f"{url}/health", retries=0) == {"status": "ok"}
    assert request(f"{url}/health", token="wrong", retries=0) == {"status": "ok"}  # no token oracle
    detailed = request(f"{url}/health", token=TOKEN, retries=0)
    assert detailed["spec"] == "toyworld" and "authorized" not in detailed and "warning" not in detailed
    status, reply, _ = raw_post(url, encode_request(images(1, 16), PROMPTS[:1]), token="wrong")
    assert status == 401 and counters(url)["http_401"] == 1  # counted before it was answered
    lines = until(lambda: [line for line in capped_server.output().splitlines()
                           if " 401 POST /score: a wrong bearer token" in line], "the 401's log line")
    assert len(lines) == 1 and TOKEN not in capped_server.output() and "wrong" not in lines[0].split(" 401 ")[0]


# ----------------------------------------------------------------------------------------------------- inputs
@pytest.mark.parametrize("change, status, match", [
    (lambda x, p: (x.index_fill_(0, torch.tensor([1]), float("nan")), p), 400, "image 1 has NaN or infinite pixels"),
    (lambda x, p: (x.index_fill_(0, torch.tensor([0]), 1.5), p), 400, r"image 0 has pixels outside \[0, 1\]"),
    (lambda x, p: (x, [p[0], "a" * 201]), 400, "prompt 1 has 201 characters, over this server's --max_prompt_chars"),
    (lambda x, p: (torch.rand(5, 3, 8, 8), PROMPTS[:5]), 413, "5 images in one request, over this server's "
                                                                "--max_images_per_request 4"),
])
def test_bad_inputs_are_refused_naming_the_image(capped_server, change, status, match):
    x, prompts = change(images(2, 16), PROMPTS[:2])
    got, reply, _ = raw_post(capped_server.url, encode_request(x, prompts))
    assert got == status and __import__("re").search(match, reply["detail"]), reply


def test_the_client_cuts_requests_to_the_image_cap_and_scores_like_the_local_reward(capped_server, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    remote = build_reward(f"remote:{capped_server.url}")
    scorer = remote.components[0][2]
    x, prompts = images(10, 16, seed=3), PROMPTS[:10]
    assert scorer.requests_for(x) == 4
    scored = remote(x, prompts)
    assert len(scorer.last_batches) == 3  # 4 + 4 + 2 images
    assert torch.equal(scored["remote"], build_reward("toyworld")(x, prompts)["total"])


def test_a_real_413_reaches_the_real_client_in_one_try(capped_server):
    scorer = RemoteScorer([capped_server.url], token=TOKEN, retries=2)  # no size limit known: the body goes out whole
    before = counters(capped_server.url).get("http_413", 0)
    with pytest.raises(RewardServerError, match=r"HTTP 413: the request body is over this server's --max_request_mb 1"
                                                r".*lower --remote_batch_size"):
        scorer(images(4, 256), PROMPTS[:4])  # 4 x 3 x 256 x 256 float32 = 3 MiB
    # one try: the server answered one 413 (each refusal is counted before it is answered), not retries + 1
    assert counters(capped_server.url)["http_413"] - before == 1
    until(lambda: any(" 413 POST /score: the request body" in line for line in capped_server.output().splitlines()),
          "the 413's log line")


# ----------------------------------------------------------------------------------------------------- admission
def test_a_full_queue_answers_429_and_the_deadline_drops_work_unscored():
    """A reward call of 2 s (--reward_delay_ms), one image per batch, one waiting place, a 1 s deadline: A is being
    scored; B waits (the queue's one place); C finds the queue full: 429 with Retry-After, at once. B passes its
    deadline while A's call runs: 503, dropped; once A's call is done, no other batch runs (B was never scored)."""
    with launch(["--reward", "toyworld", "--device", "cpu", "--token", TOKEN, "--reward_delay_ms", "2000",
                 "--max_batch_size", "1", "--max_queue", "1", "--request_timeout_s", "1"], env=ENV) as server:
        url = server.url
        body = encode_request(images(1, 16), PROMPTS[:1])
        a, a_out = in_thread(raw_post, url, body)
        until(lambda: counters(url)["batches"] == 1, "A's reward call to start")
        b, b_out = in_thread(raw_post, url, body)
        until(lambda: counters(url)["requests"] == 2, "B to be queued")
        status, reply, headers = raw_post(url, body)
        assert status == 429 and "--max_queue" in reply["detail"] and int(headers["retry-after"]) >= 1, reply
        a.join(10), b.join(10)
        for out in (a_out, b_out):  # A's call outlived its deadline too: its reply is dropped, its batch ran
            assert out[0][0] == 503 and "--request_timeout_s 1: dropped" in out[0][1]["detail"], out
        # A's call is over once its image is counted; the loop then takes the next live request at once (no await
        # between), so a kept B would now be waiting or counted as a second batch
        c = until(lambda: (c := counters(url))["images"] == 1 and c, "A's reward call to end")
        assert (c["refused_busy"], c["expired"], c["batches"], c["waiting"]) == (1, 2, 1, 0), c


def test_a_client_that_gave_up_is_not_scored():
    """The review's probe: a client timing out at 0.3 s, with 2 retries, against a server 1.5 s slow. Each try's
    request is dropped once the client has gone: no batch runs (before: 3 extra batches were scored)."""
    with launch(["--reward", "toyworld", "--device", "cpu", "--token", TOKEN, "--delay_ms", "1500"],
                env=ENV) as server:
        with pytest.raises(RewardServerError, match="failed 3 time.*no reply within 0.3 s"):
            RemoteScorer([server.url], token=TOKEN, timeout_s=0.3, retries=2)(images(2, 16), PROMPTS[:2])
        # each try is checked after its 1.5 s delay: the third is dropped last
        c = until(lambda: (c := counters(server.url))["disconnected"] == 3 and c, "the three tries to be dropped")
        assert (c["batches"], c["images"], c["waiting"]) == (0, 0, 0), c


# ----------------------------------------------------------------------------------------------------- the client
class _Redirect(http.server.BaseHTTPRequestHandler):
    """POST /score: 307 to ``target``; POST /final: records the Authorization it got (a followed redirect's)."""
    target = ""
    seen: list = []

    def do_POST(self):  # noqa: N802
        if self.path == "/final":
            self.seen.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")
            return
        self.send_response(307)
        self.send_header("Location", self.target)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_redirects_are_not_followed_and_the_token_stays_home():
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _Redirect) for _ in range(2)]
    _Redirect.target = f"http://127.0.0.1:{servers[1].server_address[1]}/final"
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        with pytest.raises(RewardServerError, match="HTTP 307.*redirects are not followed"):
            request(f"http://127.0.0.1:{servers[0].server_address[1]}/score", body=b"x", token=TOKEN, retries=0)
        assert _Redirect.seen == []
    finally:
        for s in servers:
            s.shutdown()


def test_a_token_over_plain_http_to_another_machine_is_warned_once(capsys):
    from fastvideo.rewards import http as client

    client._warn_plain_token("http://127.0.0.1:8000/score")
    assert capsys.readouterr().err == ""
    for _ in range(2):
        client._warn_plain_token("http://10.1.2.3:8000/score")
    assert capsys.readouterr().err.count("over plain http") == 1


def test_non_finite_scores_travel_as_json_null():
    text = json_reply({"scores": {"total": [1.0, float("nan"), float("inf")]}, "batch": {}})
    assert json.loads(text)["scores"]["total"] == [1.0, None, None]
    from fastvideo.rewards.remote import read_scores
    got = read_scores(json.loads(text), "http://x", 3)["total"]
    assert got[0] == 1.0 and torch.isnan(got[1:]).all()


# ----------------------------------------------------------------------------------------------------- load
@pytest.mark.slow(cover="test_reward_server_limits.py::test_a_full_queue_answers_429_and_the_deadline_drops_work_"
                        "unscored", cost_s=6)
def test_load_8_clients_50_requests_against_a_queue_of_4():
    """8 clients x 50 single-try requests of 2 images against --max_queue 4 and a 20 ms reward call (batches of up to
    2 images, one request): every request ends 200 or 429, each
    200 scored exactly once (the server's image count equals 2 x the 200s), and the server's peak RSS stays bounded.
    The figures are printed for the notes."""
    with launch(["--reward", "toyworld", "--device", "cpu", "--token", TOKEN, "--max_queue", "4",
                 "--max_batch_size", "2", "--max_wait_ms", "5", "--reward_delay_ms", "20"], env=ENV) as server:
        body = encode_request(images(2, 32), PROMPTS[:2])
        statuses: list[int] = []
        lock = threading.Lock()

        def client() -> None:
            for _ in range(50):
                status, _, _ = raw_post(server.url, body)
                with lock:
                    statuses.append(status)

        threads = [threading.Thread(target=client) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        c = counters(server.url)
        with open(f"/proc/{server.proc.pid}/status") as f:
            peak_kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    served, refused = statuses.count(200), statuses.count(429)
    print(f"load: {served} served, {refused} refused (429), {c['batches']} batches, peak RSS {peak_kib / 1024:.0f} MiB")
    assert len(statuses) == 400 and served + refused == 400 and served > 0 and refused > 0
    assert c["images"] == 2 * served and c["refused_busy"] == refused
    assert peak_kib < 2 * 2**20  # 2 GiB: the bound is the queue (4 requests of 24 KiB), not the load


CRASHING_REWARD = '''
import torch


def build(**options):
    def score(images, prompts, **context):
        if any("crash" in p for p in prompts):
            raise RuntimeError("the reward model ran out of memory (pretend)")
        return torch.zeros(images.shape[0])
    return score
'''


def test_health_is_degraded_after_failed_calls_in_a_row_and_recovers(tmp_path):
    """A reward whose calls crash (HTTP 500 each): after --degraded_after 2 failures in a row /health says
    'degraded' to anyone; one good call makes it 'ok' again."""
    (tmp_path / "crashing_reward.py").write_text(CRASHING_REWARD)
    env = {**ENV, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with launch(["--reward", "crashing_reward:build", "--device", "cpu", "--token", TOKEN, "--degraded_after", "2",
                 "--max_wait_ms", "0"], env=env) as server:
        bad, good = encode_request(images(1, 8), ["crash please"]), encode_request(images(1, 8), ["fine"])
        states = []
        for body in (bad, bad, good):
            status, reply, _ = raw_post(server.url, body)
            states.append((status, request(f"{server.url}/health", retries=0)["status"]))
        assert states == [(500, "ok"), (500, "degraded"), (200, "ok")], states
        assert "the reward failed: RuntimeError: the reward model ran out of memory" in server.output()


def test_tls_serves_https_and_the_client_verifies_it(tmp_path, monkeypatch):
    """--ssl_keyfile/--ssl_certfile: the ready line says https://, and the client scores over it, verifying the
    certificate against the CA file it is given (here the self-signed certificate itself)."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:  # the CI image has it; a machine without it cannot make the certificate
        pytest.fail("openssl is needed to make the test certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with launch(["--reward", "toyworld", "--device", "cpu", "--ssl_keyfile", str(key), "--ssl_certfile", str(cert)],
                env={**ENV, "SSL_CERT_FILE": str(cert)}) as server:
        assert server.url.startswith("https://127.0.0.1:")
        x, prompts = images(2, 16), PROMPTS[:2]
        assert torch.equal(build_reward(f"remote:{server.url}")(x, prompts)["remote"],
                           build_reward("toyworld")(x, prompts)["total"])


SLOW_LOADING_REWARD = '''
import time

import torch


def build(fail="no", **options):
    time.sleep(3)  # a large model loading
    if fail == "yes":
        raise ValueError("the checkpoint is not a reward model (pretend)")
    return lambda images, prompts, **context: torch.ones(images.shape[0])
'''


def test_the_port_answers_while_the_reward_loads_and_a_failed_load_exits_2(tmp_path):
    """The server listens before its reward is built: /health says 'loading' and /score answers 503 with Retry-After
    until the model is up, then 'ok' and scores; a reward that fails to load ends the server with one line and exit
    status 2."""
    import subprocess
    import sys

    (tmp_path / "slow_reward.py").write_text(SLOW_LOADING_REWARD)
    env = {**os.environ, **ENV, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "fastvideo.rewards.serve", "--reward", "slow_reward:build", "--device", "cpu",
           "--token", TOKEN, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        seen, deadline = [], time.monotonic() + 60
        while time.monotonic() < deadline and "ok" not in seen:
            try:
                state = request(f"{url}/health", retries=0, timeout_s=2)["status"]
            except RewardServerError:
                time.sleep(0.1)
                continue
            if state == "loading" and "loading" not in seen:
                status, reply, headers = raw_post(url, encode_request(images(1, 8), ["x"]))
                assert status == 503 and "still loading" in reply["detail"] and headers["retry-after"] == "5"
            if not seen or seen[-1] != state:
                seen.append(state)
            time.sleep(0.1)
        assert seen == ["loading", "ok"], seen
        assert raw_post(url, encode_request(images(2, 8), ["x", "y"]))[1]["scores"]["total"] == [1.0, 1.0]
    finally:
        proc.terminate()
        proc.wait(10)
    failed = subprocess.run([*cmd, "--reward_options", "fail=yes", "--port", str(free_port())], env=env,
                            capture_output=True, text=True, timeout=60)
    assert failed.returncode == 2
    assert "error: " in failed.stderr and "the checkpoint is not a reward model (pretend)" in failed.stderr
