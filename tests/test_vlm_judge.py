"""The ``vlm_judge:URL`` reward end to end against a real local chat server serving a tiny real Qwen2-VL.

A tiny Qwen2-VL folder (``fastvideo.rewards.tiny_vlm``) is served by the project's server mode (``python -m
fastvideo.rewards.serve --chat_model DIR``, whose chat routes are ``fastvideo.rewards.chat_server``'s) in a subprocess
on 127.0.0.1 (bearer token on): real HTTP, real PNG data URIs, the processor's chat template, ``generate``
and the OpenAI logprobs format. The in-process references run the same folder through transformers' own
``apply_chat_template(..., tokenize=True)`` path with the PIL image built straight from the uint8 pixels. The parsers
and the edit distance are pure functions, checked on exact values.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
import torch

from helpers import REPO, free_port

from fastvideo.rewards import build_reward, http, vlm_judge
from fastvideo.rewards.http import RewardServerError
from fastvideo.rewards.tiny_vlm import JUDGE_WORDS

TOKEN = "judge-secret"
SERVED = "tiny-judge"


# ------------------------------------------------------------------------------------------------ pure functions
def _reference_distance(a: str, b: str) -> int:
    """Levenshtein distance by its recursive definition (an independent check of the dynamic programme)."""
    @functools.lru_cache(maxsize=None)
    def d(i: int, j: int) -> int:
        if i == 0 or j == 0:
            return i + j
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))
    return d(len(a), len(b))


def test_levenshtein_exact_values():
    cases = {("kitten", "sitting"): 3, ("flaw", "lawn"): 2, ("", "abc"): 3, ("abc", ""): 3, ("", ""): 0,
             ("same", "same"): 0, ("abc", "cba"): 2, ("héllo", "hello"): 1, ("ab", "ba"): 2}
    for (a, b), want in cases.items():
        assert vlm_judge.levenshtein(a, b) == want == vlm_judge.levenshtein(b, a), (a, b)
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        a, b = ("".join("abc"[i] for i in torch.randint(0, 3, (int(n),), generator=g))
                for n in torch.randint(0, 7, (2,), generator=g))
        assert vlm_judge.levenshtein(a, b) == _reference_distance(a, b), (a, b)


def test_ocr_score_follows_verl_omni():
    # whitespace and case do not count; a target inside a longer transcript scores 1
    assert vlm_judge.ocr_score("Hello   World", "hello world") == 1.0
    assert vlm_judge.ocr_score("A sign: HELLOWORLD!", "Hello World") == 1.0
    assert vlm_judge.ocr_score("helo world", "Hello World") == pytest.approx(1 - 1 / 10)  # one deletion
    assert vlm_judge.ocr_score("OPNE", "open") == pytest.approx(1 - 2 / 4)
    assert vlm_judge.ocr_score("something else entirely", "open") == 0.0  # distance clamped to len(target)
    assert vlm_judge.ocr_score("", "open") == 0.0
    assert vlm_judge.ocr_score("", " ") == 1.0 and vlm_judge.ocr_score("x", "") == 0.0  # empty target
    assert vlm_judge.ocr_target('New York Skyline with "Hello World" written with fireworks') == "Hello World"
    assert vlm_judge.ocr_target('a "first" and a "second"') == "first"
    with pytest.raises(ValueError, match="no quoted text"):
        vlm_judge.ocr_target("a cat on a mat")
    vlm_judge.check_prompts(['a sign that says "OPEN"'], "ocr")
    vlm_judge.check_prompts(["a cat on a mat"], "yes_no")
    with pytest.raises(ValueError, match="1 of 2 prompts have no quoted text.*'a cat on a mat'"):
        vlm_judge.check_prompts(['a sign that says "OPEN"', "a cat on a mat"], "ocr")


def test_number_and_yes_no_parsers():
    assert vlm_judge.parse_number("7", 10) == pytest.approx(0.7)
    assert vlm_judge.parse_number("Score: 8/10", 10) == pytest.approx(0.8)
    assert vlm_judge.parse_number("3.5 out of 10", 10) == pytest.approx(0.35)
    assert vlm_judge.parse_number("I'd say 12", 10) == 1.0 and vlm_judge.parse_number("-3", 10) == 0.0
    assert vlm_judge.parse_number("4", 5) == pytest.approx(0.8)
    assert math.isnan(vlm_judge.parse_number("no idea", 10))
    assert vlm_judge.yes_no_from_text("Yes.") == 1.0 and vlm_judge.yes_no_from_text("no, it does not") == 0.0
    assert vlm_judge.yes_no_from_text("The answer is YES") == 1.0 and vlm_judge.yes_no_from_text("Nope") == 0.5
    top = [{"token": "Yes", "logprob": math.log(0.5)}, {"token": " yes", "logprob": math.log(0.1)},
           {"token": "No", "logprob": math.log(0.2)}, {"token": "Maybe", "logprob": math.log(0.1)},
           {"token": "none", "logprob": math.log(0.05)}]
    assert vlm_judge.yes_no_from_logprobs(top) == pytest.approx(0.6 / 0.8)
    assert vlm_judge.yes_no_from_logprobs(top[3:]) is None and vlm_judge.yes_no_from_logprobs([]) is None


def test_yes_no_falls_back_to_the_text_once_announced(capsys):
    judge = vlm_judge.VLMJudge(urls=["http://judge.example:8000/v1/chat/completions"], model="m",
                               template=vlm_judge.TEMPLATES["yes_no"])
    assert judge.score("Yes, it does.", None, "a cat") == (1.0, False)
    no_only = [{"token": "No", "logprob": -0.1}, {"token": "Maybe", "logprob": -3.0}]
    assert judge.score("No", no_only, "a cat") == (0.0, True)  # read from the logprobs: P(yes) = 0
    assert judge.score("Hmm.", [{"token": "Hmm", "logprob": -0.1}], "a cat") == (0.5, False)
    assert capsys.readouterr().out.count("gave no yes/no among the first token's top_logprobs") == 1


def test_reply_reading_and_garbage():
    url = "http://judge.example:8000/v1/chat/completions"
    reply = {"choices": [{"message": {"role": "assistant", "content": "No"},
                          "logprobs": {"content": [{"token": "No", "logprob": -0.1, "top_logprobs": [
                              {"token": "No", "logprob": -0.1}, {"token": "Yes", "logprob": -2.4}]}]}}]}
    text, top = vlm_judge.read_reply(reply, url)
    assert text == "No" and [t["token"] for t in top] == ["No", "Yes"]
    assert vlm_judge.read_reply({"choices": [{"message": {"content": None}}]}, url) == ("", None)
    for garbage in ({}, {"choices": []}, {"error": {"message": "boom"}}, "text", [1], {"choices": [{"text": "x"}]}):
        with pytest.raises(RewardServerError, match="judge.example:8000"):
            vlm_judge.read_reply(garbage, url)


def test_urls_templates_and_flags_fail_early(tmp_path):
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/",
                "http://h:8000/v1/chat/completions"):
        assert vlm_judge.api_base(url) == "http://h:8000/v1"
    assert vlm_judge.api_base("https://judge.internal/openai/v1") == "https://judge.internal/openai/v1"
    with pytest.raises(ValueError, match="http://"):
        vlm_judge.api_base("127.0.0.1:8000")
    with pytest.raises(FileNotFoundError, match="--judge_template"):
        vlm_judge.build("http://127.0.0.1:1/v1", "cpu", judge_template=str(tmp_path / "missing.txt"))
    no_prompt = tmp_path / "t.txt"
    no_prompt.write_text("Is this a good image? Answer yes or no.\n")
    with pytest.raises(ValueError, match=r"no \{prompt\} placeholder"):
        vlm_judge.build("http://127.0.0.1:1/v1", "cpu", judge_template=str(no_prompt))
    leaks = tmp_path / "ocr.txt"
    leaks.write_text("Read the text; it should be {prompt}")
    with pytest.raises(ValueError, match="must not contain"):
        vlm_judge.build("http://127.0.0.1:1/v1", "cpu", judge_template=str(leaks), judge_score="ocr")
    for flags, flag in (({"judge_score": "stars"}, "--judge_score"), ({"judge_max_score": 0}, "--judge_max_score"),
                        ({"judge_max_concurrency": 0}, "--judge_max_concurrency")):
        with pytest.raises(ValueError, match=flag):
            vlm_judge.build("http://127.0.0.1:1/v1", "cpu", **flags)
    assert vlm_judge.render("{x} {prompt} / {max_score}", "a cat", 10.0) == "{x} a cat / 10"


def test_server_down_names_the_url():
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    with pytest.raises(RewardServerError, match=f"{url}/models.*failed 1 time"):
        vlm_judge.build(url, "cpu", reward_retries=0, reward_timeout_s=5)
    judge = vlm_judge.VLMJudge(urls=[f"{url}/chat/completions"], model="m", template=vlm_judge.TEMPLATES["yes_no"],
                               retries=0, timeout_s=5)
    with pytest.raises(RewardServerError, match=f"{url}/chat/completions"):
        judge(torch.rand(2, 3, 32, 32), ["a cat", "a dog"])


# --------------------------------------------------------------------------------------------- the tiny VLM server
@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory) -> Path:
    """The tiny Qwen2-VL folder, built by its CLI entry point (seed 0)."""
    from fastvideo.rewards import tiny_vlm

    out = tmp_path_factory.mktemp("tiny-vlm") / "model"
    tiny_vlm.main([str(out)])
    return out


@pytest.fixture(scope="module")
def server(tiny_vlm, tmp_path_factory) -> Iterator[str]:
    """The project's server mode, ``python -m fastvideo.rewards.serve --chat_model DIR``, serving the tiny VLM on a
    port the OS picks (token on): its base URL, from the 'serving ... on URL' line it prints once it answers."""
    log = tmp_path_factory.mktemp("chat-server") / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop(http.TOKEN_ENV, None)
    cmd = [sys.executable, "-m", "fastvideo.rewards.serve", "--chat_model", str(tiny_vlm), "--chat_served_name",
           SERVED, "--port", "0", "--token", TOKEN, "--device", "cpu"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while (ready := re.search(r"serving .* on (http://127\.0\.0\.1:\d+)", log.read_text())) is None:
            assert proc.poll() is None, f"the chat server exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"the chat server did not come up:\n{log.read_text()[-4000:]}"
            time.sleep(0.2)
        yield ready.group(1)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def local(tiny_vlm):
    """The same folder loaded in this process: (processor, model)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_vlm, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm, local_files_only=True, dtype=torch.float32).eval()
    return processor, model


@pytest.fixture
def token(monkeypatch):
    """The server's token in the environment, where every client reads it."""
    monkeypatch.setenv(http.TOKEN_ENV, TOKEN)


def _images() -> torch.Tensor:
    """Six (3, 64, 64) images in [0, 1]: noise, a red square, white, a gradient."""
    images = torch.rand(6, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    images[3] = 0.0
    images[3, 0, 16:48, 16:48] = 1.0
    images[4] = 1.0
    images[5] = torch.linspace(0, 1, 64).expand(3, 64, 64)
    return images


PROMPTS = ["a red cube", "two dogs playing on a beach", "a photo of a cat", "a red square on black",
           "a white wall", "a grey gradient"]


def _pixels(images: torch.Tensor) -> torch.Tensor:
    """(B, H, W, 3) uint8, what the judge encodes."""
    return (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1)


def _inputs(local, pixels: torch.Tensor, text: str) -> dict:
    """The model inputs of one image + text through transformers' own one-call chat path (PIL straight from uint8)."""
    from PIL import Image

    processor, _ = local
    messages = [{"role": "user", "content": [{"type": "image", "image": Image.fromarray(pixels.numpy())},
                                             {"type": "text", "text": text}]}]
    return processor.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True,
                                         return_tensors="pt")


def _generate(local, pixels: torch.Tensor, text: str, max_new_tokens: int) -> str:
    """Greedy reply of the in-process model."""
    processor, model = local
    inputs = _inputs(local, pixels, text)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def _post(server: str, body: dict, token: str | None = TOKEN) -> dict:
    """POST a chat-completions body (RewardServerError with the server's message on an HTTP error)."""
    return http.request(f"{server}/v1/chat/completions", body=json.dumps(body).encode(), token=token, retries=0,
                        timeout_s=60)


def _chat(image_uri: str, text: str, **params) -> dict:
    """A one-image chat-completions body."""
    return {"model": SERVED, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_uri}}, {"type": "text", "text": text}]}], **params}


def test_tiny_vlm_folder_loads_with_stock_classes(tiny_vlm, local):
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    processor, model = local
    assert isinstance(processor, Qwen2VLProcessor) and isinstance(model, Qwen2VLForConditionalGeneration)
    assert Qwen2VLForConditionalGeneration.from_pretrained(tiny_vlm, local_files_only=True).config.model_type == \
        "qwen2_vl"
    tok = AutoTokenizer.from_pretrained(tiny_vlm, local_files_only=True)
    assert all(len(tok.tokenize(w)) == 1 for w in JUDGE_WORDS)
    size = sum(p.stat().st_size for p in tiny_vlm.iterdir())
    assert size < 3e6, f"the tiny VLM folder is {size / 1e6:.1f} MB"
    inputs = _inputs(local, _pixels(_images()[:1])[0], "Describe it.")
    ids = inputs["input_ids"][0].tolist()
    n_image = ids.count(model.config.image_token_id)
    assert n_image == int(inputs["image_grid_thw"].prod()) // 4 > 0  # 2x2 merge of 14-pixel patches
    assert "<|vision_start|>" in processor.decode(ids) and "<|im_start|>assistant\n" in processor.decode(ids)


def test_tiny_vlm_is_seeded(tiny_vlm, tmp_path):
    from fastvideo.rewards.tiny_vlm import build_tiny_vlm

    again = build_tiny_vlm(tmp_path / "again", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "processor_config.json"):
        assert (again / name).read_bytes() == (tiny_vlm / name).read_bytes(), name
    with pytest.raises(FileExistsError):
        build_tiny_vlm(again)


def test_server_replies_like_generate_in_process(server, local):
    pixels = _pixels(_images())
    for i in (0, 3):
        text = vlm_judge.render(vlm_judge.TEMPLATES["yes_no"], PROMPTS[i], 10)
        reply = _post(server, _chat(vlm_judge.png_data_uri(pixels[i]), text, temperature=0, max_tokens=12))
        assert reply["object"] == "chat.completion" and reply["model"] == SERVED
        choice = reply["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": _generate(local, pixels[i], text, 12)}
        assert choice["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 12
        assert reply["usage"]["prompt_tokens"] == _inputs(local, pixels[i], text)["input_ids"].shape[1]


def test_models_listing_and_token(server, token):
    listing = http.request(f"{server}/v1/models", token=TOKEN, retries=0)
    assert listing["object"] == "list" and [m["id"] for m in listing["data"]] == [SERVED]
    assert listing["data"][0]["object"] == "model"
    for wrong in (None, "not-the-token"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            request = urllib.request.Request(f"{server}/v1/models",
                                             headers={"Authorization": f"Bearer {wrong}"} if wrong else {})
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 401
        with pytest.raises(RewardServerError, match=f"HTTP 401.*{http.TOKEN_ENV}"):
            _post(server, _chat("data:image/png;base64,", "hi"), token=wrong)
    judge = vlm_judge.build(f"{server}/v1", "cpu")  # the token from FASTVIDEO_REWARD_TOKEN
    assert judge.model == SERVED and judge.token == TOKEN
    assert vlm_judge.build(server, "cpu", judge_model=SERVED).model == SERVED
    with pytest.raises(ValueError, match=f"--judge_model 'other' is not served.*{SERVED}"):
        vlm_judge.build(server, "cpu", judge_model="other")
    with pytest.raises(RewardServerError, match=f"{server}/elsewhere/v1/models refused the request: HTTP 404"):
        vlm_judge.build(f"{server}/elsewhere", "cpu", reward_retries=0)


def test_server_rejects_bad_requests_clearly(server):
    uri = vlm_judge.png_data_uri(_pixels(_images()[:1])[0])
    cases = [({"messages": []}, "non-empty list"),
             (_chat("https://example.com/cat.png", "hi"), "fetches no URLs"),
             (_chat("data:image/png;base64,bm90IGFuIGltYWdl", "hi"), "does not decode to an image"),
             (_chat(uri, "hi", logprobs=True, top_logprobs=21), r"top_logprobs' must be an integer in \[0, 20\]"),
             (_chat(uri, "hi", top_logprobs=5), "needs 'logprobs': true"),
             (_chat(uri, "hi", stream=True), "stream"),
             ({"model": SERVED, "messages": [{"role": "user", "content": [{"type": "audio_url"}]}]}, "'audio_url'")]
    for body, message in cases:
        with pytest.raises(RewardServerError, match=f"HTTP 400: .*{message}"):
            _post(server, body)
    with pytest.raises(RewardServerError, match="HTTP 404: The model `gpt-4o` does not exist"):
        _post(server, {**_chat(uri, "hi"), "model": "gpt-4o"})


def test_logprobs_in_vllm_format(server, local):
    pixels = _pixels(_images())[0]
    text = vlm_judge.render(vlm_judge.TEMPLATES["yes_no"], PROMPTS[0], 10)
    reply = _post(server, _chat(vlm_judge.png_data_uri(pixels), text, temperature=0, max_tokens=3, logprobs=True,
                                top_logprobs=5))
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode()) and len(entry["top_logprobs"]) == 5
        values = [t["logprob"] for t in entry["top_logprobs"]]
        assert values == sorted(values, reverse=True) and entry["top_logprobs"][0] == {
            k: entry[k] for k in ("token", "logprob", "bytes")}  # greedy: the chosen token is the top one
    assert "".join(e["token"] for e in content) == reply["choices"][0]["message"]["content"]
    _, model = local
    with torch.no_grad():
        logits = model(**_inputs(local, pixels, text)).logits[0, -1]
    expected = torch.log_softmax(logits.float(), -1).topk(5)
    assert [t["logprob"] for t in content[0]["top_logprobs"]] == pytest.approx(expected.values.tolist(), abs=1e-5)
    plain = _post(server, _chat(vlm_judge.png_data_uri(pixels), text, temperature=0, max_tokens=2))
    assert plain["choices"][0]["logprobs"] is None


def _reference_top(local, pixels, text: str) -> list[tuple[str, float]]:
    """The model's 20 most likely first tokens in this process, as (lower-case word, probability)."""
    processor, model = local
    with torch.no_grad():
        logits = model(**_inputs(local, pixels, text)).logits[0, -1]
    top = torch.log_softmax(logits.float(), -1).topk(20)
    words = [processor.tokenizer.decode([i]).strip().lower() for i in top.indices.tolist()]
    return [(w, math.exp(v)) for w, v in zip(words, top.values.tolist())]


def _reference_p_yes(local, pixels, text: str) -> float:
    """P(yes) / (P(yes) + P(no)) of the model's first token in this process, over its 20 most likely tokens."""
    top = _reference_top(local, pixels, text)
    p = {w: sum(v for x, v in top if x == w) for w in ("yes", "no")}
    assert p["yes"] > 0 and p["no"] > 0
    return p["yes"] / (p["yes"] + p["no"])


def test_judge_yes_no_equals_the_models_own_probability(server, local, token):
    images = _images()
    judge = vlm_judge.build(f"{server}/v1", "cpu", judge_score="yes_no")
    out = judge(images, PROMPTS)
    assert set(out) == {"score", "logprob_used"} and out["score"].dtype == torch.float32
    assert out["logprob_used"].tolist() == [1.0] * 6
    expected = [_reference_p_yes(local, pixels, vlm_judge.TEMPLATES["yes_no"].replace("{prompt}", prompt))
                for pixels, prompt in zip(_pixels(images), PROMPTS)]
    assert out["score"].tolist() == pytest.approx(expected, abs=1e-5)
    assert max(expected) - min(expected) > 0.05  # the image and the prompt move the score
    reward = build_reward(f"vlm_judge:{server}/v1:2.0,jpeg_compressibility:0", "cpu")  # the registry's way in
    scored = reward(images, PROMPTS)
    assert torch.equal(scored["vlm_judge"], out["score"]) and torch.equal(scored["total"], 2 * out["score"])
    assert torch.equal(scored["vlm_judge_logprob_used"], out["logprob_used"])


def test_judge_number_end_to_end(server, local, token):
    images = _images()
    judge = vlm_judge.build(server, "cpu", judge_score="number", judge_max_score=10)
    scores = judge(images, PROMPTS)["score"]
    replies = [_generate(local, pixels, vlm_judge.render(vlm_judge.TEMPLATES["number"], prompt, 10),
                         vlm_judge.MAX_TOKENS["number"]) for pixels, prompt in zip(_pixels(images), PROMPTS)]
    expected = [vlm_judge.parse_number(reply, 10) for reply in replies]
    assert all(math.isfinite(e) and 0 <= e <= 1 for e in expected), replies  # every reply of these has a number
    assert scores.tolist() == pytest.approx(expected, abs=1e-6)


def test_judge_ocr_end_to_end(server, local, token):
    images = _images()[:3]
    pixels = _pixels(images)
    replies = [_generate(local, p, vlm_judge.TEMPLATES["ocr"], vlm_judge.MAX_TOKENS["ocr"]) for p in pixels]
    prompts = [f'a neon sign that says "{replies[0][2:9]}"',  # text the judge reads: 1
               'a shop sign that says "OPEN 24 HOURS"',
               f'a poster with "{replies[2][:5]}x" on it']
    judge = vlm_judge.build(server, "cpu", judge_score="ocr")
    scores = judge(images, prompts)["score"].tolist()
    expected = [vlm_judge.ocr_score(r, vlm_judge.ocr_target(p)) for r, p in zip(replies, prompts)]
    assert expected[0] == 1.0 and all(0 <= e <= 1 for e in expected)
    assert scores == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match="no quoted text"):
        judge(images[:1], ["a shop sign"])


def test_concurrency_limit(server, token, monkeypatch):
    real, lock, state = http.request, threading.Lock(), {"now": 0, "max": 0}

    def counted(*args, **kwargs):
        with lock:
            state["now"] += 1
            state["max"] = max(state["max"], state["now"])
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                state["now"] -= 1

    images, prompts = _images(), PROMPTS
    serial = vlm_judge.build(server, "cpu", judge_max_concurrency=1)
    monkeypatch.setattr(http, "request", counted)
    first = serial(images, prompts)["score"]
    assert state["max"] == 1
    parallel = vlm_judge.build(server, "cpu", judge_max_concurrency=3)
    state["max"] = 0
    assert torch.equal(parallel(images, prompts)["score"], first)  # same scores, same order
    assert state["max"] == 3


def test_replicas_share_and_fail_over(server, token):
    images, prompts = _images()[:4], PROMPTS[:4]
    single = vlm_judge.build(server, "cpu")(images, prompts)["score"]
    both = vlm_judge.build(f"{server}/v1|{server}", "cpu")
    assert both.urls == [f"{server}/v1/chat/completions"] * 2
    assert torch.equal(both(images, prompts)["score"], single)
    dead = f"http://127.0.0.1:{free_port()}/v1/chat/completions"  # a replica that went down after the start
    judge = vlm_judge.VLMJudge(urls=[dead, f"{server}/v1/chat/completions"], model=SERVED,
                               template=vlm_judge.TEMPLATES["yes_no"], retries=0, timeout_s=5, token=TOKEN)
    assert torch.equal(judge(images, prompts)["score"], single)  # every request starting at the dead one moved on
    with pytest.raises(RewardServerError, match="every replica of .* failed: VLM judge"):
        vlm_judge.VLMJudge(urls=[dead, dead], model=SERVED, template=vlm_judge.TEMPLATES["yes_no"], retries=0,
                           timeout_s=5)(images[:1], prompts[:1])


def test_chat_server_limits(server):
    """The chat routes' own limits (issue 52): a body over 32 MiB is refused from its Content-Length (413, never
    read), more than 8 images or 20,000 characters of text per request and an image over 4096^2 pixels (checked on
    its header, before its pixels are decoded) are 400s naming the limit."""
    import base64
    import io

    import http.client as client
    from PIL import Image

    from fastvideo.rewards import chat_server

    host, port = server.removeprefix("http://").split(":")
    conn = client.HTTPConnection(host, int(port), timeout=10)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Authorization", f"Bearer {TOKEN}")
    conn.putheader("Content-Length", str(33 * 2**20))  # announced, never sent
    conn.endheaders()
    reply = conn.getresponse()
    assert reply.status == 413 and "32 MiB" in json.loads(reply.read())["error"]["message"]
    conn.close()
    small = io.BytesIO()
    Image.new("RGB", (8, 8)).save(small, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(small.getvalue()).decode()
    nine = {"model": SERVED, "messages": [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": uri}} for _ in range(9)), {"type": "text", "text": "hi"}]}]}
    with pytest.raises(RewardServerError, match="HTTP 400: the messages hold 9 images, over this server's 8"):
        _post(server, nine)
    with pytest.raises(RewardServerError, match="HTTP 400: the messages hold 20001 characters of text"):
        _post(server, _chat(uri, "a" * 20001))
    big = io.BytesIO()
    Image.new("L", (4097, 4096)).save(big, format="PNG")
    with pytest.raises(RewardServerError, match="HTTP 400: image_url holds a 4097x4096 image, over this server's"):
        _post(server, _chat("data:image/png;base64," + base64.b64encode(big.getvalue()).decode(), "hi"))
    assert chat_server.MAX_IMAGE_PIXELS == 4096 * 4096


def test_absurd_logprobs_are_the_judges_own_error():
    """A log-probability above 0 (e.g. 800: exp overflows) or NaN from a broken server is a ValueError naming it,
    not an OverflowError."""
    for bad in (800.0, 0.5, float("nan")):
        with pytest.raises(ValueError, match="log-probability is a finite number <= 0"):
            vlm_judge.yes_no_from_logprobs([{"token": "Yes", "logprob": bad}])
    assert vlm_judge.yes_no_from_logprobs([{"token": "Yes", "logprob": float("-inf")},
                                           {"token": "No", "logprob": 0.0}]) == 0.0


def _yes_probability(local, images: list, text: str) -> float:
    """The tiny judge's own P(yes) / (P(yes) + P(no)) for one user message of ``images`` (PIL) then ``text``, read in
    process through transformers' chat template (the reference a multi-image judge request must equal)."""
    processor, model = local
    messages = [{"role": "user", "content": [*({"type": "image", "image": i} for i in images),
                                             {"type": "text", "text": text}]}]
    inputs = processor.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True,
                                           return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits[0, -1]
    top = torch.log_softmax(logits.float(), -1).topk(20)
    words = [processor.tokenizer.decode([i]).strip().lower() for i in top.indices.tolist()]
    p = {w: sum(math.exp(v) for v, x in zip(top.values.tolist(), words) if x == w) for w in ("yes", "no")}
    return p["yes"] / (p["yes"] + p["no"])


def test_judge_sees_an_edits_source_then_the_edit(server, local, token):
    """On an edit run the judge's request shows the source and then the edit with the edit question, and the score is
    the model's own P(yes) for that two-image message; OCR reads the edit alone."""
    from PIL import Image

    edits = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    sources = torch.rand(2, 3, 24, 24, generator=torch.Generator().manual_seed(6))  # another size: sent as it is
    prompts = ["make the square red", "remove the circle"]
    scored = build_reward(f"vlm_judge:{server}/v1:1.0", "cpu")(edits, prompts, sources)
    expected = [_yes_probability(local, [Image.fromarray(_pixels(x[None])[0].numpy()) for x in (source, edit)],
                                 vlm_judge.render(vlm_judge.EDIT_TEMPLATES["yes_no"], prompt, 10))
                for edit, source, prompt in zip(edits, sources, prompts)]
    assert scored["vlm_judge"].tolist() == pytest.approx(expected, abs=1e-5)
    assert scored["vlm_judge"].tolist() != pytest.approx(build_reward(f"vlm_judge:{server}/v1:1.0", "cpu")(
        edits, prompts)["vlm_judge"].tolist(), abs=1e-5)  # the source changed what the judge saw
    assert vlm_judge.build(f"{server}/v1", "cpu", judge_score="ocr").edit_template is None


def test_judge_sees_a_videos_frames_in_one_request(server, local, token):
    """A video reward through the judge: RewardFn sends each video's --reward_frames frames (in order) in one request
    with the video template, and the score is the model's own P(yes) for that multi-image message; OCR has no video
    template (it reads frames one by one)."""
    from PIL import Image

    videos = torch.rand(2, 5, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    videos[1, :, :, 8:24, 8:24] = torch.tensor([1.0, 0.0, 0.0]).view(1, 3, 1, 1)
    prompts = ["a red square", "noise on a screen"]
    reward = build_reward(f"vlm_judge:{server}/v1:1.0", "cpu")
    reward.reward_frames = 3
    scored = reward(videos, prompts)
    assert set(scored) == {"total", "vlm_judge", "vlm_judge_logprob_used", "frame_change"}
    expected = [_yes_probability(local, [Image.fromarray(_pixels(video[i:i + 1])[0].numpy()) for i in (0, 2, 4)],
                                 vlm_judge.render(vlm_judge.VIDEO_TEMPLATES["yes_no"], prompt, 10, frames=3))
                for video, prompt in zip(videos, prompts)]
    assert scored["vlm_judge"].tolist() == pytest.approx(expected, abs=1e-5)
    assert scored["total"].tolist() == scored["vlm_judge"].tolist()
    assert "These are 3 frames of a video, in order." in vlm_judge.render(
        vlm_judge.VIDEO_TEMPLATES["number"], "x", 10, frames=3)
    ocr = vlm_judge.build(f"{server}/v1", "cpu", judge_score="ocr")
    assert not ocr.scores_videos


def test_geneval_vqa_is_soft_tifa_over_the_atom_questions(server, local, token):
    """``geneval_vqa:URL`` (GenEval 2's Soft-TIFA): each image's atom questions (count, colour, object, position)
    asked with " Answer in one word."; an atom scores the model's probability of the right answer's first token
    (every spelling: "yes"/" Yes"; "two"/"2"), equal to the model's own in this process; the reward is the mean
    (AM), ``geneval_vqa_gm`` the geometric mean."""
    from fastvideo.bench import geneval as G
    from fastvideo.bench import geneval_rules as R

    images = _images()[:3]
    prompts = ["a photo of two dogs", "a photo of a red cup and a blue clock", "a photo of a cat left of a dog"]
    out = build_reward(f"geneval_vqa:{server}/v1:1.0", "cpu")(images, prompts)
    questions = [G.atoms(R.parse_prompt(p)) for p in prompts]
    assert [[k for k, _, _ in q] for q in questions] == [["count", "object"], ["count", "attribute", "object"] * 2,
                                                         ["count", "object", "count", "object", "position"]]
    assert questions[0][0][1:] == ("How many dogs are in the image?", ("two", "2"))
    assert questions[2][4][1] == "Is the cat to the left of the dog?" and G.english_plural("person") == "people"
    seen = 0.0
    for j, (pixels, q) in enumerate(zip(_pixels(images), questions)):
        p = [sum(v for w, v in _reference_top(local, pixels, G.QUESTION.replace("{prompt}", text)) if w in answers)
             for _, text, answers in q]
        seen += sum(p)
        assert out["geneval_vqa"][j].item() == pytest.approx(sum(p) / len(p), abs=1e-5)
        assert out["geneval_vqa_gm"][j].item() == pytest.approx(math.prod(p) ** (1 / len(p)), abs=1e-5)
    assert seen > 0.1  # the right answers are among the tiny judge's likely tokens: the scores are not all 0


def test_bench_scores_soft_tifa_through_the_server(server, token, tiny_flux_dir, tmp_path):
    """``python -m fastvideo.bench geneval --scorer vqa:URL``: the same files as the detector's, Soft-TIFA per image
    and per atom type."""
    from fastvideo.bench import cli
    from fastvideo.bench import geneval_rules as R

    summary = cli.main(["geneval", "--pretrained_model_name_or_path", str(tiny_flux_dir), "--output_dir",
                        str(tmp_path / "vqa"), "--scorer", f"vqa:{server}/v1", "--per_task", "1",
                        "--num_images_per_prompt", "1", "--num_inference_steps", "2", "--h", "64", "--w", "64"])
    rows = [json.loads(line) for line in (tmp_path / "vqa" / "results.jsonl").read_text().splitlines()]
    assert [r["tag"] for r in rows] == list(R.TASKS) and summary["scorer"] == "vqa"
    for row in rows:
        p = [a["p"] for a in row["atoms"]]
        assert row["soft_tifa"] == pytest.approx(sum(p) / len(p), abs=1e-6) and 0 <= row["soft_tifa"] <= 1
    assert summary["overall"]["score"] == pytest.approx(sum(r["soft_tifa"] for r in rows) / 6)
    assert set(summary["atoms"]) == {"count", "attribute", "object", "position"}
    assert (tmp_path / "vqa" / "failures.png").is_file()
