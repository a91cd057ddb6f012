"""A training run's folder as sampling and scoring settings: what ``sample.py --run_dir OUT`` and
``python -m fastvideo.rewards.score --run_dir OUT`` take from ``OUT/config.json``, in one place.

A trainer's ``OUT/config.json`` holds every flag it ran with (``config.save_config``) and ``OUT/final`` its export
(a diffusers LoRA or a full transformer folder, ``policy.export_final``). From them a sampling takes the base model,
the export, the image size, the sampler (``--sampling_steps`` -> ``--num_inference_steps``, ``--shift``,
``--guidance_scale``, ``--noise_device``), the text length and embedding dtype of the run's training embeddings, the
held-out prompts of the run's evaluation (``--eval_prompts``, ``--eval_max_prompts``, ``--eval_num_images``), the
reward and ``--eval_reward`` with their path flags, ``--device`` and ``--mixed_precision``. A flag given on the command
line (or in a ``--config`` file) always wins over the run's value. Paths in config.json are as the trainer was given
them: run from the folder the run was started in, or override them.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from fastvideo.config import RECORDED_KEYS, flags_given, read_config_file
from fastvideo.data import is_manifest
from fastvideo.rewards import REWARD_PATH_FLAGS

# sample.py flag <- the trainer flag it is taken from (the same name unless listed)
_SAMPLE_FROM_RUN = {"h": "h", "w": "w", "num_frames": "num_frames", "fps": "fps",
                    "num_inference_steps": "sampling_steps", "shift": "shift",
                    "guidance_scale": "guidance_scale", "cfg_scale": "cfg_scale", "noise_device": "noise_device", "device": "device",
                    "mixed_precision": "mixed_precision", "model_family": "model_family"}


@dataclass
class Run:
    """A training run folder: ``config`` (its config.json), ``export`` ("lora" | "full" | None: no OUT/final yet)."""

    path: Path
    config: dict[str, Any]
    export: str | None

    @property
    def final(self) -> Path:
        return self.path / "final"

    def get(self, key: str, default: Any = None) -> Any:
        return self.config.get(key, default)


def read_run(path: str | Path) -> Run:
    """The run in ``path`` (a trainer's --output_dir); FileNotFoundError / ValueError naming the fix when it is not
    one. Reads two small files only."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"--run_dir {path}: no config.json there; pass a training run's --output_dir (the "
                                "folder with config.json, metrics.jsonl and final/, e.g. outputs/grpo-toyworld)")
    try:
        config = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"--run_dir {path}: config.json does not parse ({err}); pass a training run's "
                         "--output_dir") from None
    if not isinstance(config, dict) or "sampling_steps" not in config or "pretrained_model_name_or_path" not in config:
        raise ValueError(f"--run_dir {path}: its config.json is not a trainer's (no --sampling_steps / "
                         "--pretrained_model_name_or_path; a sample.py --output_dir?); pass the trainer's --output_dir")
    final = path / "final"
    export = ("full" if (final / "config.json").is_file()
              else "lora" if final.is_dir() and any(final.glob("*.safetensors")) else None)
    return Run(path=path, config=config, export=export)


def explicit_flags(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                   config_files: str | Sequence[str] | None = None) -> set[str]:
    """The flags (dest names) the user gave: on the command line ``argv`` (default sys.argv), however spelled
    (``--h 64``, ``--h=64``, an unambiguous prefix: ``config.flags_given``), or as keys of the ``--config`` file(s)."""
    found = flags_given(parser, list(sys.argv[1:] if argv is None else argv))
    files = [config_files] if isinstance(config_files, (str, Path)) else list(config_files or ())
    for file in files:
        found |= {k.lstrip("-") for k in read_config_file(file) if k not in RECORDED_KEYS}
    return found - {"config"}


def _manifest(path: Any) -> dict[str, Any] | None:
    """An embedding manifest (or its folder) as a dict, or None when there is none to read."""
    if not path:
        return None
    path = Path(path)
    path = path / "manifest.json" if path.is_dir() else path
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def text_settings(run: Run) -> tuple[int | None, str | None]:
    """``(max_sequence_length, embedding dtype)`` of the run's text embeddings: its --data_json_path manifest's (its
    evaluation prompts were encoded with them), else its OUT/eval_embeddings'; (None, None) when neither is there."""
    for manifest in (_manifest(run.get("data_json_path")), _manifest(run.path / "eval_embeddings")):
        if isinstance(manifest, dict) and "max_sequence_length" in manifest:
            return int(manifest["max_sequence_length"]), manifest.get("dtype")
    return None, None


def run_reward(run: Run) -> str | None:
    """The reward spec the run scored with (None for an offline DPO run without --eval_prompts: it scored nothing)."""
    if run.get("algorithm") == "dpo" and run.get("preference_file") and not run.get("eval_prompts"):
        return None
    return run.get("reward")


def _take(args: argparse.Namespace, explicit: set[str], values: dict[str, Any]) -> None:
    for key, value in values.items():
        if key not in explicit:
            setattr(args, key, value)


def _shift(value: Any) -> str:
    return "dynamic shift" if value is None else f"shift {value:g}"


def apply_to_sample(args: argparse.Namespace, explicit: set[str]) -> str:
    """Fill sample.py's ``args`` from the run ``args.run_dir`` wherever a flag was not given (``explicit``), in place;
    returns the line that tells what is sampled. Raises before anything loads: FileNotFoundError for a folder that is
    no run, a run without OUT/final (unless --base) or a base model / prompt source that is not where the run had it;
    ValueError for --lora_path / --transformer_path with --run_dir, and for a run without --eval_prompts and no
    --prompts."""
    run = read_run(args.run_dir)
    given = sorted(f"--{k}" for k in explicit & {"lora_path", "transformer_path"})
    if given:
        raise ValueError(f"--run_dir {run.path} samples the run's own export ({run.final}; with --base its base "
                         f"model): drop {' and '.join(given)}, or drop --run_dir and pass every flag to sample another "
                         "model")
    if not args.base and run.export is None:
        raise FileNotFoundError(
            f"--run_dir {run.path}: no final export (final/) yet, so the run has not finished (its checkpoints/ hold "
            "training state, which sample.py does not load): let it finish or resume it (its command again, with "
            "--resume_from latest), or pass --base to sample its base model")
    values: dict[str, Any] = {"pretrained_model_name_or_path": run.get("pretrained_model_name_or_path"),
                              **{k: run.get(src) for k, src in _SAMPLE_FROM_RUN.items() if src in run.config}}
    if not args.base:
        values["lora_path" if run.export == "lora" else "transformer_path"] = str(run.final)
    length, dtype = text_settings(run)
    if length is not None:
        values["max_sequence_length"] = length
    if dtype is not None:
        values["embedding_dtype"] = dtype
    if "prompts" not in explicit:  # the run's evaluation set: the same prompts, prompt count and images per prompt
        if not run.get("eval_prompts"):
            raise ValueError(f"--run_dir {run.path} had no --eval_prompts: pass --prompts (a prompt file, one per "
                             "line, or an embeddings manifest) with the prompts to sample")
        values.update(prompts=run.get("eval_prompts"), max_prompts=run.get("eval_max_prompts", 0),
                      num_images_per_prompt=run.get("eval_num_images", 1))
    reward = run_reward(run)
    values.update(reward=reward, eval_reward=run.get("eval_reward"),
                  **{k: run.get(k) for k in REWARD_PATH_FLAGS if k in run.config})
    values["output_dir"] = str(run.path / "sampled" / ("base" if args.base else "final"))
    _take(args, explicit, values)

    where = "the folder the run was started in"
    model = Path(args.pretrained_model_name_or_path)
    if "pretrained_model_name_or_path" not in explicit and not (model / "model_index.json").is_file():
        raise FileNotFoundError(f"--run_dir {run.path}: its base model {model} is not there (paths in its config.json "
                                f"are relative to {where}); run from there or pass --pretrained_model_name_or_path")
    if "prompts" not in explicit and not Path(args.prompts).exists():
        raise FileNotFoundError(f"--run_dir {run.path}: its --eval_prompts {args.prompts} is not there (paths in its "
                                f"config.json are relative to {where}); run from there or pass --prompts")
    if "max_sequence_length" not in explicit and length is None and not is_manifest(args.prompts):
        raise ValueError(f"--run_dir {run.path}: its training embeddings ({run.get('data_json_path')}) are not "
                         "there, so the text length is unknown; pass --max_sequence_length (the run's preprocess "
                         "value)")

    kind = "base model" if args.base else f"{'LoRA' if run.export == 'lora' else 'full fine-tune'} {run.final}"
    count = (f"first {args.max_prompts}, " if args.max_prompts else "") + \
        f"{args.num_images_per_prompt} image{'s' * (args.num_images_per_prompt != 1)} each"
    line = (f"--run_dir {run.path}: {kind} (base {args.pretrained_model_name_or_path}), {args.h}x{args.w}, "
            f"{args.num_inference_steps} steps, {_shift(args.shift)}, guidance {args.guidance_scale:g}, prompts "
            f"{args.prompts} ({count}), reward {args.reward or 'none'}"
            + (f", eval reward {args.eval_reward}" if args.eval_reward else "") + f", device {args.device or 'auto'}")
    overrides = sorted(explicit & (set(values) - {"output_dir"}))
    if overrides:
        line += "; given here: " + ", ".join(f"--{k}" for k in overrides)
    return line + f" -> {args.output_dir}"


def apply_to_score(args: argparse.Namespace, explicit: set[str]) -> str:
    """Fill ``python -m fastvideo.rewards.score``'s ``args`` from the run ``args.run_dir`` where not given: the reward
    and its path flags, --device; --images defaults to OUT/sampled/final (``sample.py --run_dir OUT``'s output; its
    index.jsonl gives the prompts) and then --out to OUT/sampled/final/scores.jsonl. Returns the line that tells what
    is scored; FileNotFoundError / ValueError naming the fix."""
    run = read_run(args.run_dir)
    reward = run_reward(run)
    if reward is None and "reward" not in explicit:
        raise ValueError(f"--run_dir {run.path} scored no images (an offline DPO run without --eval_prompts): pass "
                         "--reward")
    values = {"reward": reward, "device": run.get("device"),
              **{k: run.get(k) for k in REWARD_PATH_FLAGS if k in run.config}}
    _take(args, explicit, values)
    if "images" not in explicit:
        args.images = run.path / "sampled" / "final"
        if not (args.images / "index.jsonl").is_file():
            raise FileNotFoundError(f"--run_dir {run.path}: no sample.py output in {args.images} yet; run `python "
                                    f"sample.py --run_dir {run.path}` first, or pass --images")
        if "out" not in explicit:
            args.out = args.images / "scores.jsonl"
    if args.out is None:
        raise ValueError("--out is required (the scores.jsonl to write) unless --run_dir scores its OUT/sampled/final")
    return (f"--run_dir {run.path}: reward {args.reward}, device {args.device or 'auto'}, images {args.images}"
            + (f"; given here: {', '.join(f'--{k}' for k in sorted(explicit & set(values)))}"
               if explicit & set(values) else ""))
