"""Reward registry: ``build_reward("hpsv2:1.0,jpeg_compressibility:0.5", device, **paths)`` -> RewardFn.

A RewardFn maps (images (B,3,H,W) float in [0,1], prompts: list[str]) to a dict of (B,) float32 CPU
tensors: ``"total"`` (the weighted sum) and one entry per reward name (unweighted, for logging). A scorer may return a
dict instead of a tensor: its ``"score"`` entry is the component's value, every other entry ``key`` is logged as
``"<name>_<key>"`` (e.g. ``toyworld_strict``) and is not added to the total.
Each family lives in its own module and imports open_clip/transformers only when built, so importing
this package is cheap. Models are loaded once, in eval mode, without grad, on the given device; every
path is local (nothing is downloaded) and a missing one is a FileNotFoundError naming its flag.

Families and their flags (keyword arguments of ``build_reward`` carry the flag names):
  hpsv2                   --hps_checkpoint, --hps_model (open_clip name or config JSON; ViT-H-14)
  pickscore               --pickscore_model, --pickscore_processor (transformers folders)
  clipscore               --clip_checkpoint, --clip_model (open_clip name or config JSON; ViT-H-14)
  aesthetic               --aesthetic_checkpoint, --aesthetic_clip_checkpoint, --aesthetic_clip_model
  jpeg_compressibility    (no weights) -size_kB/500 at JPEG quality 95
  jpeg_incompressibility  (no weights) +size_kB/500
  toyworld                (no weights) toy-world prompt following by pixel analysis: score = mean of colour, shape,
                          count and position checks; also logs toyworld_strict/_color/_shape/_count/_position
  toyworld_strict         (no weights) the strict check alone as a reward: 1 when all four checks pass, else 0 (logged
                          as toyworld_strict, the key toyworld logs it under; the GRPO toy-world demo trains on it
                          with toyworld:0 beside it, a weight of 0 logging a reward without training on it)
  toyworld_motion         (no weights) videos of the toy world in time (fastvideo.toyworld.motion): every frame's
                          colour, shape and count, and the motion; score = their mean; also logs
                          toyworld_motion_strict/_color/_shape/_count/_motion
  toyworld_motion_strict  (no weights) its strict check alone: 1 when every frame and the motion are right
  toyworld_edit           (no weights) edits of toy-world scenes (fastvideo.toyworld.edit_world; an edit run: it
                          compares each edit with its source): score = mean of the instruction check and the
                          preservation check (nothing else changed); also logs toyworld_edit_strict/_instruction/_preserve
  toyworld_edit_strict    (no weights) its strict check alone: 1 when the instruction is carried out and nothing else
                          changed
  geneval                 --geneval_detector_path, --geneval_clip_path: Flow-GRPO's GenEval reward on GenEval-template
                          prompts (fastvideo.rewards.geneval): score = the partial score; also logs geneval_strict and
                          geneval_correct
  toyworld_clean          (no weights) toy-world cleanliness, whatever the prompt (what toyworld does not see):
                          score = mean of background fidelity, stray pixels and colour purity; also logs
                          toyworld_clean_background/_stray/_purity (fastvideo.toyworld.clean); for --eval_reward

Rewards scored by a server over HTTP take a URL instead of paths: ``FAMILY[.LABEL]:URL[:WEIGHT]``, where URL is
``http://HOST:PORT[/PATH]`` or replicas ``http://A:PORT|http://B:PORT``; a trailing ``:WEIGHT`` is read as the weight
only after an explicit port or path (``remote:http://h:8000:0.5``; ``remote:http://h:8000`` has weight 1). The
component is logged as ``FAMILY[.LABEL]`` (a label tells two servers of one family apart: ``remote.hps:URL``).
  remote                  a reward server (``python -m fastvideo.rewards.serve``; fastvideo.rewards.remote): logs the
                          server's total as its value and each server component as remote_<component>;
                          --remote_batch_size, --remote_max_concurrency, --reward_timeout_s, --reward_retries
  vlm_judge               a vision-language model behind an OpenAI-compatible chat server (fastvideo.rewards.vlm_judge):
                          --judge_model, --judge_template, --judge_score, --judge_max_score, --judge_max_concurrency,
                          --reward_timeout_s, --reward_retries
  geneval_vqa             GenEval 2's Soft-TIFA on GenEval-template prompts through that chat server
                          (fastvideo.rewards.geneval): --judge_model, --judge_max_concurrency, --reward_timeout_s,
                          --reward_retries; score = Soft-TIFA AM over the atom questions, also logs geneval_vqa_gm
Their bearer token comes from the environment variable FASTVIDEO_REWARD_TOKEN only (flags are written to config.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from fastvideo.options import opt
from fastvideo.plugins import MODULE_PATH
from fastvideo.rewards.plugin import build_plugin, load_plugin, parse_reward_options

Scorer = Callable[[torch.Tensor, Sequence[str]], torch.Tensor | dict[str, torch.Tensor]]

@dataclass(frozen=True)
class BuiltinReward:
    """A reward this package computes in the process, declared in one place: its factory
    (``module.factory(device, **paths) -> Scorer``), the files it requires (flag, "file" | "dir" | "any", what the
    flag names), the architecture flag that may hold a config JSON instead of a model name, the function that refuses
    prompts it cannot score (``module.prompt_check(prompts, name)``, run on the training and evaluation prompts before
    any model loads), and how the progress bar shows it (label, factor: label=value*factor, in its own units)."""

    module: str
    factory: str = "build"
    paths: tuple[tuple[str, str, str], ...] = ()
    arch_flag: str | None = None
    prompt_check: str | None = None
    display: tuple[str, float] | None = None


REWARDS: dict[str, BuiltinReward] = {
    "hpsv2": BuiltinReward("fastvideo.rewards.hpsv2", arch_flag="hps_model",
                           paths=(("hps_checkpoint", "file", "HPS_v2_compressed.pt or HPS_v2.1_compressed.pt"),)),
    "pickscore": BuiltinReward("fastvideo.rewards.pickscore",
                               paths=(("pickscore_model", "dir", "a local folder of yuvalkirstain/PickScore_v1"),
                                      ("pickscore_processor", "dir",
                                       "a local folder of laion/CLIP-ViT-H-14-laion2B-s32B-b79K"))),
    "clipscore": BuiltinReward("fastvideo.rewards.clipscore", arch_flag="clip_model",
                               paths=(("clip_checkpoint", "file",
                                       "an open_clip checkpoint (open_clip_pytorch_model.bin)"),)),
    "aesthetic": BuiltinReward("fastvideo.rewards.aesthetic", arch_flag="aesthetic_clip_model",
                               paths=(("aesthetic_checkpoint", "file", "LAION's sac+logos+ava1-l14-linearMSE.pth"),
                                      ("aesthetic_clip_checkpoint", "any",
                                       "a CLIP ViT-L/14 transformers folder or open_clip file"))),
    "jpeg_compressibility": BuiltinReward("fastvideo.rewards.jpeg", "build_compressibility",
                                          display=("jpeg_kB", -500.0)),  # the JPEG size in kB, not -kB/500
    "jpeg_incompressibility": BuiltinReward("fastvideo.rewards.jpeg", "build_incompressibility",
                                            display=("jpeg_kB", 500.0)),
    "toyworld": BuiltinReward("fastvideo.rewards.toyworld", prompt_check="check_prompts"),
    "toyworld_clean": BuiltinReward("fastvideo.rewards.toyworld", "build_clean"),
    "toyworld_strict": BuiltinReward("fastvideo.rewards.toyworld", "build_strict", prompt_check="check_prompts"),
    "toyworld_motion": BuiltinReward("fastvideo.rewards.toyworld", "build_motion", prompt_check="check_motion_prompts"),
    "toyworld_motion_strict": BuiltinReward("fastvideo.rewards.toyworld", "build_motion_strict",
                                            prompt_check="check_motion_prompts"),
    "toyworld_edit": BuiltinReward("fastvideo.rewards.toyworld", "build_edit", prompt_check="check_edit_prompts"),
    "toyworld_edit_strict": BuiltinReward("fastvideo.rewards.toyworld", "build_edit_strict",
                                          prompt_check="check_edit_prompts"),
    "geneval": BuiltinReward("fastvideo.rewards.geneval", prompt_check="check_prompts",
                             paths=(("geneval_detector_path", "dir", "an OWLv2 or Grounding DINO transformers folder"),
                                    ("geneval_clip_path", "dir", "a transformers CLIP folder, "
                                                                 "openai/clip-vit-large-patch14"))),
}
# What every RewardFn result adds beside the rewards, logged and never trained on: a video's frame-to-frame change
# (``score_video``) and an edit's distance from its source (``score_edits``).
WATCH_KEYS: tuple[str, ...] = ("frame_change", "source_distance")
# Rewards scored over HTTP: family -> (module, factory, the build_reward options it takes); each factory is
# build(url, device, **options) -> Scorer, url as written in the spec (replicas joined by "|").
_URL_REGISTRY: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "remote": ("fastvideo.rewards.remote", "build",
               ("remote_batch_size", "remote_max_concurrency", "reward_timeout_s", "reward_retries")),
    "vlm_judge": ("fastvideo.rewards.vlm_judge", "build",
                  ("judge_model", "judge_template", "judge_score", "judge_max_score", "judge_max_concurrency",
                   "reward_timeout_s", "reward_retries")),
    "geneval_vqa": ("fastvideo.rewards.geneval", "build_vqa",
                    ("judge_model", "judge_max_concurrency", "reward_timeout_s", "reward_retries")),
}
REWARD_NAMES: tuple[str, ...] = tuple(REWARDS)  # the rewards computed in this process
URL_REWARD_NAMES: tuple[str, ...] = tuple(_URL_REGISTRY)
JUDGE_SCORES = ("yes_no", "number", "ocr")  # --judge_score: how a vlm_judge reads the chat model's answer
_URL_NAME = re.compile(r"(?P<family>[a-z_]+)(?:\.(?P<label>[A-Za-z0-9_]+))?")



def display_values(metrics: dict[str, float]) -> dict[str, str]:
    """Progress-bar entries of the ``reward_<component>`` means in ``metrics``: each component in its own units
    (``BuiltinReward.display``), 4 significant digits; per-check extras such as ``reward_toyworld_color`` are left out (the
    strict check, ``reward_toyworld_strict``, is a reward of its own and shown)."""
    shown = {}
    for name in REWARD_NAMES:
        if f"reward_{name}" in metrics:
            label, factor = REWARDS[name].display or (name, 1.0)
            shown[label] = f"{float(metrics[f'reward_{name}']) * factor:.4g}"
    urls = [key[len("reward_"):] for key in metrics if key.startswith("reward_")
            and (match := _URL_NAME.fullmatch(key[len("reward_"):])) and match["family"] in _URL_REGISTRY]
    for name in urls:  # URL rewards (remote, remote.hps, vlm_judge): their totals, not their parts (name_key)
        if not any(name.startswith(f"{other}_") for other in urls if other != name):
            shown[name] = f"{float(metrics[f'reward_{name}']):.4g}"
    return shown


# Every reward option flag a trainer passes to ``build_reward``, as the rewards declare them: the built-in rewards'
# files and architecture flags, the URL rewards' options, a user's reward factory's keyword arguments, and how videos
# are scored.
REWARD_PATH_FLAGS: tuple[str, ...] = tuple(dict.fromkeys([
    *(flag for reward in REWARDS.values() for flag, _, _ in reward.paths),
    *(reward.arch_flag for reward in REWARDS.values() if reward.arch_flag),
    *(option for _, _, options in _URL_REGISTRY.values() for option in options),
    "reward_options", "frame_reduce", "reward_frames"]))


@dataclass(frozen=True)
class RewardItem:
    """One reward of a spec: ``name`` (its component, as logged), registry ``family``, ``weight``, and the server
    ``url`` of a URL reward (None for the others)."""

    name: str
    family: str
    weight: float
    url: str | None = None
    target: str | None = None  # a user's reward: "package.module:factory" (family "plugin")


def parse_reward_items(spec: str) -> list[RewardItem]:
    """Parse ``"name[:weight],..."`` (weight defaults to 1.0; URL rewards: ``FAMILY[.LABEL]:URL[:WEIGHT]``, see the
    module docstring) into RewardItems; ValueError naming the item and the fix."""
    from .http import split_urls

    valid = ", ".join((*REWARD_NAMES, *(f"{name}:URL" for name in URL_REWARD_NAMES)))
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty reward spec {spec!r}; use e.g. 'hpsv2:1.0,jpeg_compressibility:0.5' "
                         f"with names from: {valid}")
    parsed: list[RewardItem] = []
    for item in spec.split(","):
        name, sep, weight_text = (part.strip() for part in item.partition(":"))
        url_name = _URL_NAME.fullmatch(name)
        family, url, target = name, None, None
        factory = weight_text.partition(":")[0].strip()
        if (name not in REWARDS and name.split(".")[0] not in _URL_REGISTRY and factory.isidentifier()
                and (MODULE_PATH.fullmatch(name) or name.isidentifier())):  # package.module:factory[:WEIGHT]
            _, sep, weight_text = (part.strip() for part in weight_text.partition(":"))
            target, family = f"{name}:{factory}", "plugin"
            load_plugin(target)  # importable and callable: checked before anything loads
            name = factory
        elif url_name and url_name["family"] in _URL_REGISTRY:
            family = url_name["family"]
            grammar = f"{family}[.LABEL]:http://HOST:PORT[:WEIGHT] (a weight only after an explicit port or path)"
            if not weight_text:
                raise ValueError(f"reward {name!r} in spec {spec!r} needs its server's URL: {grammar}")
            url, weight_text = _split_url_weight(weight_text)
            sep = ":" if weight_text is not None else ""
            try:
                split_urls(url, what=f"reward {name!r}")
            except ValueError as err:
                raise ValueError(f"{err}, in spec {spec!r}; write {grammar}") from None
        elif name.split(".")[0] in _URL_REGISTRY:
            raise ValueError(f"reward {name!r} in spec {spec!r}: a label is letters, digits and _ "
                             f"({name.split('.')[0]}.LABEL:URL)")
        elif name not in REWARDS:
            raise ValueError(f"unknown reward {name!r} in spec {spec!r}; valid names: {valid}")
        weight = 1.0
        if sep:
            try:
                weight = float(weight_text)
            except ValueError:
                raise ValueError(f"malformed weight {weight_text!r} for reward {name!r} in spec {spec!r}; "
                                 f"write name:weight with a number, e.g. {name}:1.0 (valid names: {valid})") from None
            if not math.isfinite(weight):
                raise ValueError(f"weight of reward {name!r} must be finite, got {weight_text!r} in spec {spec!r}")
        if name in (r.name for r in parsed):
            label = f" (two servers of one family need labels: {family}.a:URL,{family}.b:URL)" if url else ""
            raise ValueError(f"reward {name!r} appears twice in spec {spec!r}; give each reward once{label}")
        parsed.append(RewardItem(name, family, weight, url, target))
    return parsed


def _split_url_weight(text: str) -> tuple[str, str | None]:
    """``URL[:WEIGHT]`` -> (URL, weight text or None): a last ``:W`` is the weight only when W is a number and the
    URL before it has an explicit port or path (``http://h:8000:0.5``, ``http://h/:2``); ``http://h:8000`` is a URL."""
    head, sep, tail = text.rpartition(":")
    try:
        float(tail)
        last = urllib.parse.urlsplit(head.split("|")[-1].strip())
        explicit = last.port is not None or bool(last.path)
    except ValueError:  # no number after the last colon, or no valid URL before it
        return text, None
    return (head.strip(), tail) if sep and last.hostname and explicit else (text, None)


def parse_reward_spec(spec: str) -> list[tuple[str, float]]:
    """Parse ``"name[:weight],name[:weight],..."`` (weight defaults to 1.0) into [(name, weight)] (URL rewards:
    ``parse_reward_items``)."""
    return [(r.name, r.weight) for r in parse_reward_items(spec)]


def check_reward_options(*, reward_timeout_s: float = 120.0, reward_retries: int = 2, remote_batch_size: int = 0,
                         remote_max_concurrency: int = 4, judge_score: str = "yes_no", judge_max_score: float = 10.0,
                         judge_max_concurrency: int = 8, **_: object) -> None:
    """ValueError naming the flag of an out-of-range option of the URL rewards (keyword names = the flags)."""
    checks = ((reward_timeout_s > 0, f"--reward_timeout_s must be > 0 seconds, got {reward_timeout_s}"),
              (reward_retries >= 0, f"--reward_retries must be >= 0, got {reward_retries}"),
              (remote_batch_size >= 0, f"--remote_batch_size must be >= 0 (0 = a reward call's images in one "
                                       f"request), got {remote_batch_size}"),
              (remote_max_concurrency >= 1, f"--remote_max_concurrency must be >= 1, got {remote_max_concurrency}"),
              (judge_score in JUDGE_SCORES, f"--judge_score must be one of {', '.join(JUDGE_SCORES)}, got "
                                            f"{judge_score!r}"),
              (judge_max_score > 0, f"--judge_max_score must be > 0, got {judge_max_score}"),
              (judge_max_concurrency >= 1, f"--judge_max_concurrency must be >= 1, got {judge_max_concurrency}"))
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def parse_eval_reward_spec(spec: str | None, reward: str | None) -> list[tuple[str, float]]:
    """The extra rewards of ``--eval_reward`` (``parse_reward_spec``'s syntax; [] when unset or empty), which the
    held-out evaluation logs beside --reward's as ``eval/<name>`` and ``eval/<name>_<key>`` (``sample.py``: columns
    ``<name>``, ``<name>_<key>``). ValueError naming --eval_reward for a bad spec or a reward that ``reward`` (the
    --reward spec, None for none) scores already: its values are logged as ``eval/reward_<name>`` then."""
    if spec is None or not spec.strip():
        return []
    try:
        parsed = parse_reward_spec(spec)
    except ValueError as err:
        raise ValueError(f"--eval_reward: {err}") from None
    both = [name for name, _ in parsed if reward and name in dict(parse_reward_spec(reward))]
    if both:
        raise ValueError(f"--eval_reward {spec!r}: {', '.join(map(repr, both))} {'is' if len(both) == 1 else 'are'} "
                         f"scored by --reward {reward!r} already (logged as eval/reward_{both[0]}); drop it from "
                         "--eval_reward, which takes extra rewards only")
    return parsed


def check_reward_paths(spec: str, **paths: str | None) -> None:
    """FileNotFoundError naming the flag (keyword names = the flags, as ``build_reward`` takes them) of a path that a
    reward of ``spec`` requires and that is missing; loads nothing."""
    from ._common import looks_like_path, require_path

    for item in parse_reward_items(spec):
        name = item.name
        entry = REWARDS.get(name)
        for key, kind, what in entry.paths if entry else ():
            require_path(paths.get(key), f"--{key}", name, what, kind=kind)
        arch = entry.arch_flag if entry else None
        if arch and paths.get(arch) and looks_like_path(str(paths[arch])):
            require_path(paths[arch], f"--{arch}", name, "an open_clip model-config JSON")
        if item.family == "vlm_judge" and paths.get("judge_template"):
            require_path(paths["judge_template"], "--judge_template", name, "a text file with {prompt} in it")


def check_reward_prompts(spec: str, prompts: Sequence[str], source: str, *, judge_score: str = "yes_no") -> None:
    """Raise ValueError (naming ``source``, e.g. the manifest's flag) if a reward of ``spec`` cannot score some of
    ``prompts`` (the toyworld reward reads only its grammar; a ``vlm_judge`` with --judge_score ocr needs quoted text),
    so a run fails before loading models, not at step 1."""
    for item in parse_reward_items(spec):
        try:
            entry = REWARDS.get(item.family)
            if entry is not None and entry.prompt_check:
                getattr(importlib.import_module(entry.module), entry.prompt_check)(prompts, item.family)  # names it
            elif item.family == "vlm_judge":
                from .vlm_judge import check_prompts

                check_prompts(prompts, judge_score)
            elif item.family == "geneval_vqa":
                from fastvideo.bench.geneval import check_prompts as check_geneval

                check_geneval(prompts, item.name)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None


def reward_identity(spec: str) -> str:
    """``spec`` as a checkpoint's fingerprint records it: a URL reward's server address left out (``remote:<url>``,
    weights and labels kept), so a run resumes when its reward servers moved (a requeued job's new nodes) but not when
    the rewards or their weights changed. A spec without URL rewards is returned unchanged."""
    items = parse_reward_items(spec)
    if all(item.url is None for item in items):
        return spec
    return ",".join(f"{item.target or item.name}:{'<url>:' if item.url is not None else ''}{item.weight:g}"
                    for item in items)


@dataclass
class RewardFn:
    """Weighted sum of reward components; ``fn(images, prompts) -> {"total": (B,), name: (B,), ...}``."""

    components: list[tuple[str, float, Scorer]]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    batch_size: int = 0  # images per scorer call (0 = the whole batch at once); bounds a large reward model's memory
    # a non-finite score: "error" raises ValueError naming the reward and prompt here; "keep" returns it for the caller
    # to handle (the trainers' --nonfinite_reward drop: Run.gather_rewards drops the sample on every rank alike)
    nonfinite: str = "error"
    # videos (B, F, 3, H, W): every component scores ``reward_frames`` evenly spaced frames (0 = all), reduced per
    # video by ``frame_reduce`` (mean | min: over those frames; first | last: that frame only)
    frame_reduce: str = "mean"
    reward_frames: int = 0

    @property
    def names(self) -> list[str]:
        """Component names in spec order."""
        return [name for name, _, _ in self.components]

    @property
    def weights(self) -> dict[str, float]:
        """Component name -> weight."""
        return {name: weight for name, weight, _ in self.components}

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], sources: torch.Tensor | None = None
                 ) -> dict[str, torch.Tensor]:
        """Score a batch; all outputs are detached (B,) float32 CPU tensors, "total" = sum of weight * component
        (a dict-returning scorer adds its extra entries as ``name_key``, outside the total). Videos (B, F, 3, H, W):
        ``score_video``. ``sources`` (B, 3, h, w) in [0, 1]: an edit's source images (docs/editing.md): a scorer that
        declares ``takes_sources`` receives them (``sources=``; one that ``needs_sources`` refuses a batch without),
        and ``source_distance`` (``source_distance``) is logged beside the total, never added to it."""
        if sources is not None:
            return self.score_edits(images, prompts, sources)
        if torch.is_tensor(images) and images.ndim == 5 and images.shape[2] == 3:
            return self.score_video(images, prompts)
        if not torch.is_tensor(images) or images.ndim != 4 or images.shape[1] != 3:
            shape = tuple(images.shape) if torch.is_tensor(images) else type(images).__name__
            raise ValueError(f"rewards take images of shape (B, 3, H, W) or videos (B, F, 3, H, W) in [0, 1], got "
                             f"{shape}")
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if len(prompts) != images.shape[0]:
            raise ValueError(f"got {images.shape[0]} images but {len(prompts)} prompts; pass one prompt per image")
        out: dict[str, torch.Tensor] = {}
        total = torch.zeros(images.shape[0], dtype=torch.float32)
        step = self.batch_size or images.shape[0]
        with torch.no_grad():
            for name, weight, scorer in self.components:
                if getattr(scorer, "needs_sources", False):
                    raise ValueError(f"reward {name!r} compares an edit with its source image: it scores edit runs "
                                     "only (a store made with preprocess_embeddings.py --edit_file; docs/editing.md)")
                chunks = [scorer(images[i:i + step], prompts[i:i + step]) for i in range(0, images.shape[0], step)]
                result = chunks[0] if len(chunks) == 1 else _concat(chunks)
                out.update(self._entries(name, result, images, prompts))
                total = total + weight * out[name]
        return {"total": total, **out}

    def score_video(self, videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Videos (B, F, 3, H, W): each component on the frames ``frame_index`` picks (one batch of B x N images, the
        prompt repeated per frame), reduced per video by ``frame_reduce``; a scorer that judges whole videos
        (``scores_videos``: the VLM judge, the toy world's motion check) gets each video's frames together instead:
        ``reward_frames`` evenly spaced ones, else its own ``video_frames`` (0: all). "total" = the weighted sum of
        the components; plus ``frame_change``, the mean absolute change between consecutive frames (all F), logged
        beside the reward and never trained on: a flicker or a frozen video shows in its curve."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        B, F = videos.shape[:2]
        if len(prompts) != B:
            raise ValueError(f"got {B} videos but {len(prompts)} prompts; pass one prompt per video")
        whole = [c for c in self.components if getattr(c[2], "scores_videos", False)]
        framewise = [c for c in self.components if c not in whole]
        out: dict[str, torch.Tensor] = {}
        if framewise:
            index = frame_index(F, self.reward_frames, self.frame_reduce)
            N = len(index)
            frames = torch.stack([videos[:, i] for i in index.tolist()], dim=1).flatten(0, 1)  # no CPU index on a GPU
            scored = dataclasses.replace(self, components=framewise)(frames, [p for p in prompts for _ in range(N)])
            reduce = {"mean": lambda v: v.mean(dim=1), "min": lambda v: v.min(dim=1).values}.get(
                self.frame_reduce, lambda v: v[:, 0])
            out.update({key: reduce(value.view(B, N)) for key, value in scored.items() if key != "total"})
        step = self.batch_size or B
        for name, _, scorer in whole:  # their own frames: --reward_frames, else the scorer's video_frames (0: all)
            index = frame_index(F, self.reward_frames or getattr(scorer, "video_frames", 0), "mean")
            clips = torch.stack([videos[:, i] for i in index.tolist()], dim=1)  # (B, N, 3, H, W)
            with torch.no_grad():
                chunks = [scorer.score_videos(clips[i:i + step], prompts[i:i + step]) for i in range(0, B, step)]
            result = chunks[0] if len(chunks) == 1 else _concat(chunks)
            out.update(self._entries(name, result, clips[:, 0], prompts))
        total = torch.zeros(B, dtype=torch.float32)
        for name, weight, _ in self.components:
            total = total + weight * out[name]
        change = (videos[:, 1:] - videos[:, :-1]).abs().float().mean(dim=(1, 2, 3, 4)) if F > 1 else torch.zeros(B)
        return {"total": total, **{n: out.pop(n) for n in self.names}, **out,
                "frame_change": change.detach().to("cpu", torch.float32)}

    def score_edits(self, images: torch.Tensor, prompts: Sequence[str], sources: torch.Tensor
                    ) -> dict[str, torch.Tensor]:
        """Edits (B, 3, H, W) of ``sources`` (B, 3, h, w): the scorers that take sources get them, the others score
        the edits alone; plus ``source_distance``, the edit's mean absolute pixel difference from its source (resized
        to the edit's size where they differ): the reward-hacking watch of an edit run, near 0 when the model returns
        its source unchanged, large when it ignores the source."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not torch.is_tensor(images) or images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"edit rewards take images of shape (B, 3, H, W) in [0, 1], got "
                             f"{tuple(images.shape) if torch.is_tensor(images) else type(images).__name__}")
        if sources.ndim != 4 or sources.shape[:2] != images.shape[:2]:
            raise ValueError(f"got {tuple(sources.shape)} sources for {tuple(images.shape)} edits; pass one (3, h, w) "
                             "source per edit")
        if len(prompts) != images.shape[0]:
            raise ValueError(f"got {images.shape[0]} images but {len(prompts)} prompts; pass one prompt per image")
        sources = sources.to(images.device, images.dtype)
        plain = [c for c in self.components if not getattr(c[2], "takes_sources", False)]
        out = dataclasses.replace(self, components=plain)(images, prompts) if plain else {}
        out.pop("total", None)
        step = self.batch_size or images.shape[0]
        with torch.no_grad():
            for name, _, scorer in self.components:
                if not getattr(scorer, "takes_sources", False):
                    continue  # scored above, on the edits alone
                chunks = [scorer(images[i:i + step], prompts[i:i + step], sources=sources[i:i + step])
                          for i in range(0, images.shape[0], step)]
                out.update(self._entries(name, chunks[0] if len(chunks) == 1 else _concat(chunks), images, prompts))
        total = torch.zeros(images.shape[0], dtype=torch.float32)
        for name, weight, _ in self.components:
            total = total + weight * out[name]
        return {"total": total, **{n: out.pop(n) for n in self.names}, **out,
                "source_distance": source_distance(images, sources)}

    def _entries(self, name: str, result: Any, images: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        """One component's outputs as detached (B,) float32 CPU tensors: the score as ``name`` (a dict's "score"),
        a dict's other entries as ``name_key``; non-finite values refused here when ``nonfinite`` is "error"."""
        if isinstance(result, dict):  # "score" is the component; the rest are logged as name_key
            assert "score" in result, f"reward {name!r} returned a dict without 'score': {sorted(result)}"
            entries = {name: result["score"], **{f"{name}_{k}": v for k, v in result.items() if k != "score"}}
        else:
            entries = {name: result}
        out = {}
        for key, value in entries.items():
            value = value.detach().to("cpu", torch.float32).reshape(-1)
            if self.nonfinite == "error":
                _check_finite(key, value, images, prompts)
            out[key] = value
        return out

    def __repr__(self) -> str:
        spec = ",".join(f"{n}:{w:g}" for n, w, _ in self.components)
        return f"RewardFn({spec!r}, device={self.device})"


FRAME_REDUCES = ("mean", "min", "first", "last")


def source_distance(images: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
    """(B,) float32 CPU: the mean absolute pixel difference of each edit (B, 3, H, W) from its source (B, 3, h, w),
    both in [0, 1]; a source of another size is resized to the edit's (bilinear, antialiased) first."""
    if sources.shape[-2:] != images.shape[-2:]:
        sources = torch.nn.functional.interpolate(sources.float(), size=images.shape[-2:], mode="bilinear",
                                                  antialias=True, align_corners=False)
    return (images.float() - sources.float()).abs().mean(dim=(1, 2, 3)).detach().to("cpu", torch.float32)


def frame_index(frames: int, reward_frames: int = 0, frame_reduce: str = "mean") -> torch.Tensor:
    """The frames of an F-frame video a reward scores: ``first`` / ``last`` that frame; else ``reward_frames``
    evenly spaced ones, first and last included (0 or >= F: all)."""
    if frame_reduce not in FRAME_REDUCES:
        raise ValueError(f"--frame_reduce must be one of {', '.join(FRAME_REDUCES)}, got {frame_reduce!r}")
    if reward_frames < 0:
        raise ValueError(f"--reward_frames must be >= 0 (0 = every frame), got {reward_frames}")
    if frame_reduce in ("first", "last"):
        return torch.tensor([0 if frame_reduce == "first" else frames - 1])
    if reward_frames == 0 or reward_frames >= frames:
        return torch.arange(frames)
    return torch.linspace(0, frames - 1, reward_frames).round().long()


def _concat(chunks: list) -> torch.Tensor | dict[str, torch.Tensor]:
    """One scorer's results over micro-batches, joined: (B,) tensors, or dicts of them."""
    if isinstance(chunks[0], dict):
        return {k: torch.cat([c[k].reshape(-1) for c in chunks]) for k in chunks[0]}
    return torch.cat([c.reshape(-1) for c in chunks])


def _check_finite(name: str, scores: torch.Tensor, images: torch.Tensor, prompts: list[str]) -> None:
    """Raise ValueError naming the reward and the prompt of the first non-finite score."""
    assert scores.shape[0] == len(prompts), f"reward {name!r} returned {scores.shape[0]} scores for {len(prompts)}"
    bad = (~torch.isfinite(scores)).nonzero().flatten()
    if bad.numel() == 0:
        return
    i = int(bad[0])
    cause = (" (the image itself has NaN/inf pixels: check the rollout and VAE decode, e.g. bf16 overflow)"
             if not bool(torch.isfinite(images[i]).all()) else "")
    raise ValueError(f"reward {name!r} is not finite ({scores[i].item()}) for sample {i} with prompt "
                     f"{prompts[i]!r}{cause}; {bad.numel()} of {len(prompts)} samples affected")


def build_reward(spec: str, device: str | torch.device = "cpu", *, hps_checkpoint: str | None = None,
                 hps_model: str = "ViT-H-14",
                 pickscore_model: str | None = None, pickscore_processor: str | None = None,
                 clip_checkpoint: str | None = None, clip_model: str = "ViT-H-14",
                 aesthetic_checkpoint: str | None = None, aesthetic_clip_checkpoint: str | None = None,
                 aesthetic_clip_model: str = "ViT-L-14-quickgelu", geneval_detector_path: str | None = None,
                 geneval_clip_path: str | None = None, batch_size: int = 0,
                 reward_timeout_s: float = 120.0, reward_retries: int = 2, remote_batch_size: int = 0,
                 remote_max_concurrency: int = 4, judge_model: str | None = None, judge_template: str | None = None,
                 judge_score: str = "yes_no", judge_max_score: float = 10.0, judge_max_concurrency: int = 8,
                 reward_options: Sequence[str] | dict | None = None, frame_reduce: str = "mean",
                 reward_frames: int = 0) -> RewardFn:
    """Build the weighted reward of ``spec``; every path and option is validated before any model is loaded (a URL
    reward asks its server's /health as it is built: RewardServerError naming the URL when it does not answer).

    Keyword names equal the trainer's flags (``hps_model`` takes an open_clip name or a model-config JSON;
    ``reward_options``: --reward_options KEY=VALUE, the keyword arguments of every user reward's factory;
    ``frame_reduce`` / ``reward_frames``: how videos are scored, ``RewardFn.score_video``).
    """
    items = parse_reward_items(spec)
    frame_index(2, reward_frames, frame_reduce)  # the video flags, checked before anything loads
    if batch_size < 0:
        raise ValueError(f"--reward_batch_size must be >= 0 (0 = the whole batch in one call), got {batch_size}")
    url_options = dict(reward_timeout_s=reward_timeout_s, reward_retries=reward_retries,
                       remote_batch_size=remote_batch_size, remote_max_concurrency=remote_max_concurrency,
                       judge_model=judge_model, judge_template=judge_template, judge_score=judge_score,
                       judge_max_score=judge_max_score, judge_max_concurrency=judge_max_concurrency)
    check_reward_options(**url_options)
    device = torch.device(device)
    paths = dict(hps_checkpoint=hps_checkpoint, hps_model=hps_model,
                 pickscore_model=pickscore_model, pickscore_processor=pickscore_processor,
                 clip_checkpoint=clip_checkpoint, clip_model=clip_model,
                 aesthetic_checkpoint=aesthetic_checkpoint, aesthetic_clip_checkpoint=aesthetic_clip_checkpoint,
                 aesthetic_clip_model=aesthetic_clip_model, geneval_detector_path=geneval_detector_path,
                 geneval_clip_path=geneval_clip_path)
    check_reward_paths(spec, judge_template=judge_template, **paths)  # fail fast, before loading anything heavy
    built: list[tuple[str, float, Scorer]] = []
    options = parse_reward_options(reward_options)
    for item in items:
        if item.target is not None:
            scorer = build_plugin(item.target, device, options)
        elif item.url is None:
            entry = REWARDS[item.family]
            scorer = getattr(importlib.import_module(entry.module), entry.factory)(device, **paths)
        else:
            module_name, factory, option_names = _URL_REGISTRY[item.family]
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as err:
                if err.name != module_name:
                    raise
                raise ValueError(f"reward {item.name!r} needs {module_name}, which this installation lacks; update "
                                 "the fastvideo package") from None
            scorer = getattr(module, factory)(item.url, device, **{k: url_options[k] for k in option_names})
        built.append((item.name, item.weight, scorer))
    return RewardFn(built, device, batch_size, frame_reduce=frame_reduce, reward_frames=reward_frames)


__all__ = ["JUDGE_SCORES", "REWARD_NAMES", "URL_REWARD_NAMES", "RewardFn", "RewardItem", "Scorer", "build_reward",
           "check_reward_options", "check_reward_paths", "parse_eval_reward_spec", "parse_reward_items",
           "parse_reward_spec", "reward_identity"]


@dataclass
class RewardOptions:
    reward: str = opt("hpsv2:1.0", "weighted rewards, e.g. 'hpsv2:1.0,jpeg_compressibility:0.5' "
                                   "(hpsv2, pickscore, clipscore, aesthetic, jpeg_compressibility, "
                                   "jpeg_incompressibility, toyworld, toyworld_strict, toyworld_clean, "
                                   "toyworld_motion, toyworld_motion_strict, toyworld_edit, toyworld_edit_strict, "
                                   "geneval; "
                                   "weight 0 "
                                   "logs a reward without training on it; over HTTP: "
                                   "remote:http://HOST:PORT[:WEIGHT], a reward server (python -m "
                                   "fastvideo.rewards.serve), vlm_judge:http://HOST:PORT[:WEIGHT], a chat model "
                                   "as judge, and geneval_vqa:http://HOST:PORT[:WEIGHT], GenEval 2's Soft-TIFA by "
                                   "one; replicas http://A:PORT|http://B:PORT, a second server of one kind "
                                   "remote.LABEL:URL; token: the FASTVIDEO_REWARD_TOKEN variable; "
                                   "docs/reward-serving.md; your own: package.module:factory[:WEIGHT], "
                                   "docs/rewards.md)")
    reward_options: list[str] | None = opt(
        None, "KEY=VALUE options of the package.module:factory rewards in --reward: each factory is called with them "
        "as keyword arguments (values read as JSON where they parse: numbers, true, lists; else kept as strings, "
        "e.g. paths); docs/rewards.md (default: none)", nargs="+")
    eval_reward: str | None = opt(None, "extra rewards the held-out evaluation (--eval_prompts) also scores, beside "
                                        "--reward, to watch what the training reward does not see (e.g. "
                                        "'toyworld_clean:1.0' under --reward toyworld): same syntax as --reward, "
                                        "rewards --reward does not hold; each is logged on its own (weights do not "
                                        "matter) as eval/<name> and eval/<name>_<check>. Evaluation only: no "
                                        "training number, checkpoint or recording changes (default: none)")
    reward_batch_size: int = opt(0, "images per reward-model call (0 = all of a rank's images in one call); lower it "
                                    "when a large reward model (HPS ViT-H) runs out of memory (scores do not change)")
    reward_timeout_s: float = opt(120.0, "seconds a remote:URL / vlm_judge:URL reward waits for a server's reply, per "
                                         "attempt (connection and each wait for bytes)")
    reward_retries: int = opt(2, "retries of a remote:URL / vlm_judge:URL request that got no reply (refused, timed "
                                 "out, HTTP 429/502/503/504), 0.5 s backoff doubling; then the next replica, then the "
                                 "run stops naming the URL")
    remote_batch_size: int = opt(0, "images per request of a remote:URL reward (0 = a reward call's images in one "
                                    "request, split only to fit the server's --max_request_mb); a call's requests "
                                    "run concurrently, spread over the URL's replicas")
    remote_max_concurrency: int = opt(4, "requests of a remote:URL reward in flight at once, per process")
    judge_model: str | None = opt(None, "model name a vlm_judge:URL reward asks for in its chat requests (default: the "
                                        "server's first /v1/models entry)")
    judge_template: str | None = opt(None, "text file with the question a vlm_judge:URL reward asks about each image, "
                                           "{prompt} marking the prompt (default: a built-in question)")
    judge_score: str = opt("yes_no", "how a vlm_judge:URL reward reads the answer: yes_no (P(yes)), number (a score "
                                     "out of --judge_max_score, scaled to [0, 1]) or ocr (the prompt's quoted text "
                                     "found in the image)", choices=("yes_no", "number", "ocr"))
    judge_max_score: float = opt(10.0, "top of the scale a vlm_judge:URL reward's --judge_score number asks for")
    judge_max_concurrency: int = opt(8, "chat requests of a vlm_judge:URL reward in flight at once, per process")
    hps_checkpoint: str | None = opt(None, "HPS v2/v2.1 checkpoint (.pt with 'state_dict') for the hpsv2 reward")
    hps_model: str = opt("ViT-H-14", "open_clip architecture name or model-config JSON for the HPS checkpoint")
    pickscore_model: str | None = opt(None, "local PickScore CLIPModel folder for the pickscore reward")
    pickscore_processor: str | None = opt(None, "local CLIP-H processor folder for the pickscore reward")
    clip_checkpoint: str | None = opt(None, "open_clip checkpoint for the clipscore reward")
    clip_model: str = opt("ViT-H-14", "open_clip architecture name or model-config JSON for clipscore")
    aesthetic_checkpoint: str | None = opt(None, "LAION aesthetic MLP weights for the aesthetic reward")
    aesthetic_clip_checkpoint: str | None = opt(
        None, "CLIP ViT-L/14 for the aesthetic reward: a transformers CLIP folder or an open_clip checkpoint")
    geneval_detector_path: str | None = opt(None, "the geneval reward's detector: a local OWLv2 or Grounding DINO "
                                                  "transformers folder (docs/benchmarks.md)")
    geneval_clip_path: str | None = opt(None, "the geneval reward's colour head: a local transformers CLIP folder "
                                              "(openai/clip-vit-large-patch14, GenEval's)")
    frame_reduce: str = opt("mean", "videos: how a reward's per-frame scores become the video's: mean | min over the "
                                    "--reward_frames frames, or first | last (that frame only); every image reward "
                                    "scores frames as images (docs/video.md)", choices=FRAME_REDUCES)
    reward_frames: int = opt(0, "videos: frames each reward scores, evenly spaced with the first and last (0 = every "
                                "frame; fewer frames, cheaper rewards)")
    nonfinite_reward: str = opt(
        "error", "a NaN/inf reward: 'error' stops the run naming the reward and prompt; 'drop' drops the sample (its "
        "group's advantages are computed without it, it trains nothing) and counts it (dropped_samples)",
        choices=("error", "drop"))
    aesthetic_clip_model: str = opt("ViT-L-14-quickgelu", "open_clip architecture of --aesthetic_clip_checkpoint "
                                                          "(when it is an open_clip file)")
    reward_overlap: bool = opt(
        False, "score each rollout micro-batch (--rollout_batch_size images) on a reward thread (on a GPU/NPU on its "
        "own stream) as soon as it is decoded, while the next one samples: the step waits only for what is left "
        "after the rollout (time_reward; the scorer's own seconds: time_reward_busy). Scores are computed per "
        "micro-batch (each split by --reward_batch_size), so they equal a sequential run's with --reward_batch_size "
        "= --rollout_batch_size: identical for rewards that score each image alone (toyworld, jpeg_*, a remote "
        "server), within the kernels' batch-size effects for reward models. Sequential anyway with --replay_images "
        "(the recorded images exist only after the rollout)")


def check_url_reward_flags(args: argparse.Namespace) -> None:
    """--reward_timeout_s, --reward_retries, --remote_* and --judge_* in range (ValueError naming the flag)."""
    check_reward_options(**{k: getattr(args, k) for k in REWARD_PATH_FLAGS if hasattr(args, k)})
