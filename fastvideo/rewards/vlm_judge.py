"""``vlm_judge:URL``: score images with a vision-language model behind the OpenAI-compatible chat-completions API.

The judge runs in its own server (vLLM's or SGLang's OpenAI server, or ``fastvideo.rewards.chat_server`` for a local
transformers folder); the trainer only sends HTTP requests through ``fastvideo.rewards.http`` (standard library, bearer
token ``$FASTVIDEO_REWARD_TOKEN`` = vLLM's ``--api-key``). ``URL`` is the server's base, ``http://host:8000`` or
``http://host:8000/v1`` (``.../v1/chat/completions`` is accepted too), or replicas ``URL|URL`` (requests spread
round-robin, rank r starting at replica r; one that gets no reply moves to the next replica). At build time
``GET /v1/models`` checks that every replica answers and serves the judge model (``--judge_model``, default the first
model the first replica lists).

One request per image, up to ``--judge_max_concurrency`` in flight: one user message holding the image (PNG of the
uint8 image, what the VLM's processor reads anyway, as a ``data:image/png;base64`` ``image_url`` part) and then the
text of the template with ``{prompt}`` replaced by the image's prompt (and ``{max_score}`` by ``--judge_max_score``);
``temperature`` 0 (greedy: the same image and prompt get the same score), a few ``max_tokens`` (``MAX_TOKENS``).
On an edit run (``docs/editing.md``) the message holds two images, the source and then the edit, and the question is
``EDIT_TEMPLATES``' (was the instruction ``{prompt}`` carried out, the rest unchanged?), or --judge_template's; OCR
reads the edit alone.

Score modes (``--judge_score``; each has a built-in template, ``TEMPLATES``, or pass ``--judge_template FILE``):
  yes_no  P(yes) / (P(yes) + P(no)) of the first generated token, each summed over the spellings among its
          ``top_logprobs`` (20 asked: "Yes", " yes", "YES", ...), as VQAScore reads a VLM. When the server gives no
          logprobs, or neither word is among them, the reply text decides: 1 for yes, 0 for no, 0.5 for neither; the
          extra entry ``logprob_used`` (logged as ``vlm_judge_logprob_used``) is 1 where the logprobs were read.
  number  the first number in the reply / --judge_max_score, clamped to [0, 1]. A reply without a number scores NaN:
          the trainer's --nonfinite_reward then stops the run naming the prompt (error) or drops the sample (drop).
  ocr     text rendering, as flow_grpo's and verl-omni's OCR rewards: the target is the text between the first pair
          of double quotes in the prompt; the judge transcribes the image (the template must not show it the prompt);
          reply and target lose all whitespace and case; score = 1 if the target occurs in the reply, else
          1 - min(Levenshtein distance, len(target)) / len(target) (verl-omni ``genrm_ocr._levenshtein_score``).

A server that cannot be reached or answers something that is not a chat completion raises ``RewardServerError``
naming the URL (``fastvideo.rewards.http``: per-request ``--reward_timeout_s``, ``--reward_retries``).
"""
from __future__ import annotations

import base64
import io
import itertools
import json
import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from fastvideo.distributed import launch_env
from fastvideo.rewards import JUDGE_SCORES, http
from fastvideo.rewards._common import to_grey_levels

SCORE_MODES = JUDGE_SCORES  # --judge_score (the registry holds the choices)
TEMPLATES = {
    # VQAScore's question (Lin et al. 2024, "Evaluating Text-to-Visual Generation with Image-to-Text Generation").
    "yes_no": 'Does this figure show "{prompt}"? Please answer yes or no.',
    "number": 'How well does this image match the description "{prompt}"? Rate it from 0 (not at all) to {max_score} '
              "(perfectly). Answer with the number only.",
    # verl-omni's generative OCR reward prompt (verl_omni/utils/reward_score/genrm_ocr.py, DEFAULT_GRM_PROMPT).
    "ocr": "Please output only the text content from the image without any additional descriptions or formatting.",
}
# A video's frames go to the judge as one request: the frames in order as image parts, then this text ({frames}:
# how many). The same questions as TEMPLATES, about the video; OCR reads single frames (it has no video template).
VIDEO_TEMPLATES = {
    "yes_no": 'These are {frames} frames of a video, in order. Does this video show "{prompt}"? Please answer yes or '
              "no.",
    "number": 'These are {frames} frames of a video, in order. How well does this video match the description '
              '"{prompt}"? Rate it from 0 (not at all) to {max_score} (perfectly). Answer with the number only.',
}
# An edit: the source image, then the edited one, then this text ({prompt}: the edit instruction).
EDIT_TEMPLATES = {
    "yes_no": 'The first image is the original; the second is the original edited with the instruction "{prompt}". '
              "Was the instruction carried out, with everything else left unchanged? Please answer yes or no.",
    "number": 'The first image is the original; the second is the original edited with the instruction "{prompt}". '
              "How well was the instruction carried out, with everything else left unchanged? Rate it from 0 (not "
              "at all) to {max_score} (perfectly). Answer with the number only.",
}
VIDEO_FRAMES = 8  # frames per video request when --reward_frames is 0 (servers cap images per request: vLLM's
# --limit-mm-per-prompt, fastvideo.rewards.chat_server's MAX_IMAGES 8)
MAX_TOKENS = {"yes_no": 4, "number": 16, "ocr": 128}  # generated tokens per request: an answer, a rating, a transcript
TOP_LOGPROBS = 20  # what vLLM allows by default (--max-logprobs 20)
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def api_base(url: str) -> str:
    """The server's ``.../v1`` base for ``url`` (``http://host:port``, ``.../v1`` or ``.../v1/chat/completions``)."""
    base = url.strip().rstrip("/")
    if not re.match(r"https?://[^/\s]+", base):
        raise ValueError(f"vlm_judge:{url}: the judge URL needs http:// or https:// and a host, e.g. "
                         "vlm_judge:http://127.0.0.1:8000/v1 (the base of an OpenAI-compatible server)")
    if base.endswith("/chat/completions"):
        base = base[: -len("/chat/completions")]
    return base if base.endswith("/v1") else base + "/v1"


def load_template(path: str | None, mode: str) -> str:
    """The user text template of ``mode``: ``TEMPLATES[mode]``, or the text file ``path`` (--judge_template)."""
    if path is None:
        return TEMPLATES[mode]
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"--judge_template {path!r} is not a file; pass a text file holding the judge's "
                                "question (with {prompt} where the image's prompt goes) or leave it out for the "
                                f"built-in {mode} template")
    text = file.read_text(encoding="utf-8").strip()
    if mode == "ocr" and "{prompt}" in text:
        raise ValueError(f"--judge_template {path}: an ocr template must not contain {{prompt}}: the prompt holds the "
                         "target text, and a judge that sees it can copy it instead of reading the image")
    if mode != "ocr" and "{prompt}" not in text:
        raise ValueError(f"--judge_template {path} has no {{prompt}} placeholder: add {{prompt}} where the image's "
                         f"prompt goes (--judge_score {mode} asks about the prompt)")
    return text


def render(template: str, prompt: str, max_score: float, frames: int | None = None) -> str:
    """The template's text for one prompt (plain replacement, so other braces in a template stay as they are);
    ``frames``: a video's frame count for ``{frames}``."""
    text = template.replace("{prompt}", prompt).replace("{max_score}", f"{max_score:g}")
    return text if frames is None else text.replace("{frames}", str(frames))


def png_data_uri(image: torch.Tensor) -> str:
    """A (H, W, 3) uint8 CPU image -> ``data:image/png;base64,...`` (lossless: the judge sees these exact pixels)."""
    from PIL import Image  # heavy

    buffer = io.BytesIO()
    Image.fromarray(image.numpy()).save(buffer, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _word(token: Any) -> str:
    """A candidate token as a bare lower-case word (" Yes" -> "yes")."""
    return token.strip().strip(".,:;!*\"'").lower() if isinstance(token, str) else ""


def answer_mass(candidates: Sequence[Any], words: Sequence[str]) -> dict[str, float]:
    """The probability of each of ``words`` (lower case) among ``[{"token", "logprob"}, ...]``, every spelling summed
    (" Yes", "yes." -> "yes"). A log-probability that is not a finite number <= 0 (a broken server) is a ValueError
    naming it."""
    mass = {w: 0.0 for w in words}
    for entry in candidates:
        if isinstance(entry, dict) and _word(entry.get("token")) in mass and \
                isinstance(entry.get("logprob"), (int, float)) and not isinstance(entry.get("logprob"), bool):
            logprob = float(entry["logprob"])
            if not (math.isfinite(logprob) or logprob == -math.inf) or logprob > 1e-6:
                raise ValueError(f"the judge's reply gives token {entry['token']!r} the log-probability {logprob!r}; a "
                                 "log-probability is a finite number <= 0: is the server a chat-completions server?")
            mass[_word(entry["token"])] += math.exp(min(logprob, 0.0))
    return mass


def yes_no_from_logprobs(candidates: Sequence[Any]) -> float | None:
    """P(yes) / (P(yes) + P(no)) over ``[{"token", "logprob"}, ...]`` (``answer_mass``); None when neither word is
    among them."""
    mass = answer_mass(candidates, ("yes", "no"))
    total = mass["yes"] + mass["no"]
    return mass["yes"] / total if total > 0 else None


def yes_no_from_text(reply: str) -> float:
    """1.0 if the first yes/no word of ``reply`` is yes, 0.0 if it is no, 0.5 when it has neither."""
    match = _YES_NO.search(reply)
    return 0.5 if match is None else float(match.group(1).lower() == "yes")


def parse_number(reply: str, max_score: float) -> float:
    """The first number in ``reply`` divided by ``max_score``, clamped to [0, 1]; NaN when there is none."""
    match = _NUMBER.search(reply)
    return float("nan") if match is None else min(max(float(match.group()) / max_score, 0.0), 1.0)


def ocr_target(prompt: str) -> str:
    """The text to render: what stands between the prompt's first pair of double quotes (``prompt.split('"')[1]``,
    as flow_grpo's and verl-omni's OCR data)."""
    parts = prompt.split('"')
    if len(parts) < 3:
        raise ValueError(f"--judge_score ocr reads the text to render between double quotes in the prompt, but "
                         f"{prompt!r} has no quoted text; use OCR prompts such as 'a sign that says \"OPEN\"' "
                         "(flow_grpo's dataset/ocr) or another --judge_score")
    return parts[1]


def check_prompts(prompts: Sequence[str], judge_score: str = "yes_no") -> None:
    """ValueError naming the first prompt --judge_score cannot score (ocr: one without quoted text), so a run fails
    before any model loads; the other modes take every prompt."""
    if judge_score == "ocr":
        bad = [p for p in prompts if len(p.split('"')) < 3]
        if bad:
            raise ValueError(f"{len(bad)} of {len(prompts)} prompts have no quoted text to render, e.g. {bad[0]!r}: "
                             "--judge_score ocr reads the target between double quotes (flow_grpo's dataset/ocr "
                             "prompts: 'a sign that says \"OPEN\"')")


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each) between ``a`` and ``b``."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_score(reply: str, target: str) -> float:
    """verl-omni's normalised OCR score in [0, 1]: whitespace-free, case-free; 1 when the target is in the reply."""
    text, want = re.sub(r"\s+", "", reply).lower(), re.sub(r"\s+", "", target).lower()
    if not want:
        return 1.0 if not text else 0.0
    if want in text:
        return 1.0
    return 1.0 - min(levenshtein(text, want), len(want)) / len(want)


def read_reply(reply: Any, url: str) -> tuple[str, list | None]:
    """(the reply's text, its first token's top_logprobs or None) of a chat completion; RewardServerError naming
    ``url`` when ``reply`` is not one."""
    try:
        choice = reply["choices"][0]
        content = choice["message"].get("content")
    except (KeyError, IndexError, TypeError, AttributeError):
        raise http.RewardServerError(f"VLM judge {url} answered without choices[0].message ({str(reply)[:200]}); "
                                     "is the URL an OpenAI-compatible chat-completions server (vLLM, SGLang, "
                                     "fastvideo.rewards.chat_server)?", url=url) from None
    if content is not None and not isinstance(content, str):
        raise http.RewardServerError(f"VLM judge {url} answered with non-text content {str(content)[:200]}", url=url)
    logprobs = choice.get("logprobs")
    entries = logprobs.get("content") if isinstance(logprobs, dict) else None
    first = entries[0] if isinstance(entries, list) and entries and isinstance(entries[0], dict) else None
    top = None if first is None else (first.get("top_logprobs") or [first])
    return content or "", top


@dataclass
class VLMJudge:
    """The ``vlm_judge`` scorer: ``judge(images, prompts) -> {"score": (B,), ...}`` (see the module docstring)."""

    urls: list[str]  # the replicas' .../v1/chat/completions
    model: str
    template: str
    mode: str = "yes_no"
    max_score: float = 10.0
    concurrency: int = 8
    timeout_s: float = 120.0
    retries: int = 2
    token: str | None = None
    first_replica: int = 0  # where this process's round-robin over the replicas starts (its rank)
    video_template: str | None = None  # a video's question (VIDEO_TEMPLATES, or --judge_template's); None: frames
    edit_template: str | None = None  # an edit's question (EDIT_TEMPLATES, or --judge_template's); None: the edit alone
    _next: Any = field(default=None, init=False, repr=False)  # the round-robin position, across calls
    _warned: bool = field(default=False, init=False, repr=False)  # the text fallback was announced

    def __post_init__(self) -> None:
        self._next = itertools.count(self.first_replica)

    video_frames = VIDEO_FRAMES  # frames per video request when --reward_frames is 0
    takes_sources = True  # an edit run's sources: shown to the judge before the edit (``edit_template``)

    @property
    def scores_videos(self) -> bool:
        """Whether a video goes to the judge whole (its frames in one request: ``score_videos``) rather than frame by
        frame (``RewardFn.score_video`` reads this)."""
        return self.video_template is not None

    def body(self, image_uri: str | list[str], prompt: str, edit: bool = False) -> dict:
        """The chat-completions request for one image (or a video's frames, in order; ``edit``: the source and the
        edit) and its prompt."""
        uris = [image_uri] if isinstance(image_uri, str) else list(image_uri)
        text = (render(self.template, prompt, self.max_score) if isinstance(image_uri, str) else
                render(self.edit_template, prompt, self.max_score) if edit else
                render(self.video_template, prompt, self.max_score, frames=len(uris)))
        content = [*({"type": "image_url", "image_url": {"url": uri}} for uri in uris), {"type": "text", "text": text}]
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "temperature": 0.0,
                "max_tokens": MAX_TOKENS[self.mode], "n": 1}
        if self.mode == "yes_no":
            body.update(logprobs=True, top_logprobs=TOP_LOGPROBS)
        return body

    def ask(self, image: torch.Tensor, prompt: str, replica: int = 0, source: torch.Tensor | None = None
            ) -> tuple[str, list | None]:
        """One request, to replica ``replica`` first and to the next ones when it gets no reply: the judge's reply
        text and its first token's top_logprobs (None when not given). ``image``: (H, W, 3) uint8, or a video's
        frames (N, H, W, 3); ``source``: an edit's source (h, w, 3) uint8, shown first."""
        uri = png_data_uri(image) if image.ndim == 3 else [png_data_uri(frame) for frame in image]
        if source is not None:
            uri = [png_data_uri(source), uri]
        body = json.dumps(self.body(uri, prompt, edit=source is not None)).encode("utf-8")
        reply, url = http.request_replicas(self.urls, replica, body=body, token=self.token, timeout_s=self.timeout_s,
                                           retries=self.retries, what="VLM judge")
        return read_reply(reply, url)

    def score(self, reply: str, top: list | None, prompt: str) -> tuple[float, bool]:
        """(score, whether logprobs decided it) of one reply."""
        if self.mode == "number":
            return parse_number(reply, self.max_score), False
        if self.mode == "ocr":
            return ocr_score(reply, ocr_target(prompt)), False
        from_logprobs = None if top is None else yes_no_from_logprobs(top)
        if from_logprobs is not None:
            return from_logprobs, True
        if not self._warned:
            self._warned = True
            print(f"warning: VLM judge {'|'.join(self.urls)} gave no yes/no among the first token's top_logprobs; "
                  "scoring from the reply text (1 yes / 0 no / 0.5 neither) where that happens (logged as "
                  "vlm_judge_logprob_used = 0). vLLM and SGLang return logprobs when asked.", flush=True)
        return yes_no_from_text(reply), False

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], sources: torch.Tensor | None = None
                 ) -> dict[str, torch.Tensor]:
        """Score a batch (B, 3, H, W) in [0, 1]: one request per image, ``concurrency`` in flight, spread
        round-robin over the replicas; with an edit's ``sources`` (B, 3, h, w) and an ``edit_template``, each request
        shows the source and then the edit."""
        pixels = to_grey_levels(images.detach()).to(torch.uint8).permute(0, 2, 3, 1).cpu()  # (B, H, W, 3)
        if sources is None or self.edit_template is None:
            return self._score(pixels, list(prompts))
        before = to_grey_levels(sources.detach()).to(torch.uint8).permute(0, 2, 3, 1).cpu()
        return self._score(pixels, list(prompts), list(before))

    def score_videos(self, videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Score videos (B, N, 3, H, W) in [0, 1]: one request per video with its N frames in order and the video
        template (``VIDEO_TEMPLATES``); the same score modes and outputs as images."""
        if not self.scores_videos:
            raise ValueError(f"the {self.mode} judge reads single frames; it has no video template")
        pixels = to_grey_levels(videos.detach().flatten(0, 1)).to(torch.uint8).permute(0, 2, 3, 1).cpu()
        return self._score(pixels.view(*videos.shape[:2], *pixels.shape[1:]), list(prompts))

    def replies(self, pixels: Sequence[torch.Tensor], prompts: list[str],
                sources: list[torch.Tensor] | None = None) -> list[tuple[str, list | None]]:
        """One request per (uint8 image, prompt), ``concurrency`` in flight, spread round-robin over the replicas:
        each reply's text and its first token's top_logprobs (None when not given), in order."""
        replicas = [next(self._next) % len(self.urls) for _ in prompts]
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(prompts))),
                                thread_name_prefix="vlm-judge") as pool:
            return list(pool.map(self.ask, pixels, prompts, replicas, sources or [None] * len(prompts)))

    def _score(self, pixels: torch.Tensor, prompts: list[str], sources: list[torch.Tensor] | None = None
               ) -> dict[str, torch.Tensor]:
        check_prompts(prompts, self.mode)  # every OCR target is readable before a request goes out
        replies = self.replies(pixels, prompts, sources)
        scored = [self.score(reply, top, prompt) for (reply, top), prompt in zip(replies, prompts)]
        out = {"score": torch.tensor([s for s, _ in scored], dtype=torch.float32)}
        if self.mode == "yes_no":
            out["logprob_used"] = torch.tensor([float(used) for _, used in scored], dtype=torch.float32)
        return out


def served_models(base: str, token: str | None, timeout_s: float, retries: int) -> list[str]:
    """The model ids ``GET base/models`` lists (RewardServerError naming the URL when it lists none)."""
    listing = http.request(f"{base}/models", token=token, timeout_s=timeout_s, retries=retries, what="VLM judge")
    data = listing.get("data") if isinstance(listing, dict) else None
    served = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)] \
        if isinstance(data, list) else []
    if not served:
        raise http.RewardServerError(f"VLM judge {base}/models lists no model ({str(listing)[:200]}); is the URL an "
                                     "OpenAI-compatible server (vLLM, SGLang, fastvideo.rewards.chat_server)?",
                                     url=f"{base}/models")
    return served


def build(url: str, device: str | torch.device | None = None, *, judge_model: str | None = None,
          judge_template: str | None = None, judge_score: str = "yes_no", judge_max_score: float = 10.0,
          judge_max_concurrency: int = 8, reward_timeout_s: float = 120.0, reward_retries: int = 2,
          **_: Any) -> VLMJudge:
    """The ``vlm_judge:URL`` scorer (``URL`` or replicas ``URL|URL``); checks the flags and the template, then that
    every replica answers ``GET /v1/models`` and serves the judge model (``device`` is unused: the judge runs in its
    server)."""
    if judge_score not in SCORE_MODES:
        raise ValueError(f"--judge_score {judge_score!r}: choose one of {', '.join(SCORE_MODES)}")
    if not (math.isfinite(judge_max_score) and judge_max_score > 0):
        raise ValueError(f"--judge_max_score must be a positive number (the top of the judge's scale), got "
                         f"{judge_max_score}")
    if judge_max_concurrency < 1:
        raise ValueError(f"--judge_max_concurrency must be >= 1 (requests in flight), got {judge_max_concurrency}")
    if not reward_timeout_s > 0 or reward_retries < 0:
        raise ValueError(f"--reward_timeout_s must be > 0 and --reward_retries >= 0, got {reward_timeout_s} and "
                         f"{reward_retries}")
    bases = [api_base(u) for u in url.split("|")]
    http.split_urls("|".join(bases), what="VLM judge")  # ValueError for a malformed host, port or ?query
    template = load_template(judge_template, judge_score)
    # a video's question: the built-in one, or --judge_template's own text (it may say {frames}); OCR reads frames
    video_template = None if judge_score == "ocr" else (template if judge_template else VIDEO_TEMPLATES[judge_score])
    # an edit's question (the source, then the edit): built in, or --judge_template's text; OCR reads the edit alone
    edit_template = None if judge_score == "ocr" else (template if judge_template else EDIT_TEMPLATES[judge_score])
    token = http.token_from_env()
    served = {base: served_models(base, token, reward_timeout_s, reward_retries) for base in bases}
    model = judge_model or served[bases[0]][0]
    for base, names in served.items():
        if model not in names:
            which = f"--judge_model {model!r}" if judge_model else f"the judge model {model!r} (served by {bases[0]})"
            raise ValueError(f"{which} is not served by {base} (it serves {names}); pass one of those as "
                             "--judge_model (every replica must serve it), or leave --judge_model out to use the "
                             "first")

    return VLMJudge(urls=[f"{base}/chat/completions" for base in bases], model=model, template=template,
                    mode=judge_score, max_score=float(judge_max_score), concurrency=int(judge_max_concurrency),
                    timeout_s=float(reward_timeout_s), retries=int(reward_retries), token=token,
                    first_replica=launch_env()[0],  # rank r starts at replica r: the ranks' requests spread
                    video_template=video_template, edit_template=edit_template)


__all__ = ["SCORE_MODES", "TEMPLATES", "VIDEO_FRAMES", "VIDEO_TEMPLATES", "VLMJudge", "answer_mass", "api_base", "build",
           "check_prompts", "levenshtein", "load_template", "ocr_score", "ocr_target", "parse_number", "read_reply", "served_models",
           "yes_no_from_logprobs", "yes_no_from_text"]
