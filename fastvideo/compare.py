"""Compare two training runs, two recordings (``--record_dir``) or two reward score files, and say where they part.

    python -m fastvideo.compare OUT_A OUT_B [--metrics reward_mean loss ...] [--reward_rtol 0.05 ...] [--plot c.png]
    python -m fastvideo.compare REC_A REC_B [--reward_rtol 0.05 --image_psnr_min 30 ...] [--plot compare.png]
    python -m fastvideo.compare scores_a.jsonl scores_b.jsonl [--reward_rtol 0.05]

What it compares depends on what it is given (both arguments must be of one kind; exit 2 otherwise):

    run folder   a trainer's --output_dir (metrics.jsonl, no manifest.json): the logged metrics, step by step
    recording    a --record_dir folder (manifest.json): every stage of every recorded step (below)
    score file   a python -m fastvideo.rewards.score output (JSON lines): every reward component, image by image

For two run folders it prints, for every step both metrics.jsonl files hold, both runs' values of the compared
metrics and their relative difference: by default those of reward_mean, eval/reward_mean (eval steps only), loss,
grad_norm and ratio_mean that both runs log; --metrics K [K ...] picks others, --metrics all every shared metric but
the timing and memory readings. It says how many steps each run logged and which metrics only one run logs, names
the first step where a compared metric differs beyond its tolerance (--reward_rtol for reward_mean and eval/*,
--loss_rtol for loss and *_loss, --grad_norm_rtol for grad_norm, --metric_rtol for the rest) and, with --plot PNG,
draws both reward curves and the relative differences.

For recordings it prints a per-step table (step-mean reward of both runs and their relative difference, the worst
image's max-abs pixel difference and the step's PSNR, the largest old-log-prob, loss and grad-norm relative
differences), writes a PNG with both reward curves and the per-step differences, names the first step and stage where
the runs diverge beyond tolerance, checking the stages in the order a step runs them:

    rollout  images (PSNR of the step's pooled pixel MSE < --image_psnr_min) or old log-probs (> --logprob_rtol)
    reward   the step's mean reward (> --reward_rtol; default 5%, the cross-device acceptance practice)
    train    the step's loss (> --loss_rtol) or mean grad norm (> --grad_norm_rtol)

A relative difference is ``|a - b| / max(|a|, |b|, floor)``; the floor of the loss and grad norm (and, for run
folders, of every metric but the rewards) is their median magnitude over run A, so a loss that crosses zero is not
flagged for a tiny absolute gap (for the loss, the larger of that and the per-update losses' median magnitude, or for
run folders the advantages' (adv_abs_mean): GRPO's step loss is ~0 by construction). Rewards have no floor. Every
comparison exits 1 when a tolerance is exceeded, 0 when the inputs agree, 2 for unusable input. For score files
(``fastvideo.rewards.score``) it matches images by name and compares every reward component.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file

from fastvideo.plot import read_rows
from fastvideo.record import load_image, read_jsonl

STAGES = ("rollout", "reward", "train")


def rel_diff(a: float, b: float, floor: float = 1e-12) -> float:
    """``|a - b| / max(|a|, |b|, floor)``; 0 when both are NaN (a sample both runs dropped), inf when one is."""
    if math.isnan(a) and math.isnan(b):
        return 0.0
    if math.isnan(a) or math.isnan(b):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), floor)


def psnr(mse: float) -> float:
    """PSNR in dB of images in [0, 1] (inf for identical images)."""
    return math.inf if mse <= 0 else 10 * math.log10(1.0 / mse)


@dataclass
class Recording:
    """What ``compare`` reads of a recording folder."""

    root: Path
    manifest: dict
    steps: dict[int, dict]
    samples: dict[tuple[int, int, int], dict]  # (step, prompt id, sample index) -> row
    log_probs: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)  # -> (S,)
    update_losses: list[float] = field(default_factory=list)  # every rank's per-update losses

    @classmethod
    def load(cls, root: str | Path) -> "Recording":
        root = Path(root)
        if not (root / "manifest.json").is_file():
            raise FileNotFoundError(f"{root}: no manifest.json; pass a folder written with --record_dir (or two score "
                                    "files from python -m fastvideo.rewards.score)")
        steps = {int(r["step"]): r for r in read_jsonl(root / "steps.jsonl")} if (root / "steps.jsonl").exists() else {}
        samples = {(int(r["step"]), int(r["prompt_id"]), int(r["sample_index"])): r
                   for path in sorted(root.glob("samples-rank*.jsonl")) for r in read_jsonl(path)}
        log_probs = {}
        for path in sorted(root.glob("step-*/tensors-rank*.safetensors")):
            tensors = load_file(str(path))
            if "old_log_probs" in tensors:
                step = int(path.parent.name.split("-")[1])
                for p, s, row in zip(tensors["prompt_ids"].tolist(), tensors["sample_indices"].tolist(),
                                     tensors["old_log_probs"]):
                    log_probs[(step, int(p), int(s))] = row
        update_losses = [float(r["loss"]) for path in sorted(root.glob("updates-rank*.jsonl"))
                         for r in read_jsonl(path) if "loss" in r]
        return cls(root, json.loads((root / "manifest.json").read_text()), steps, samples, log_probs, update_losses)

    @property
    def name(self) -> str:
        device = self.manifest.get("device", {})
        return f"{self.root.name} ({device.get('type', '?')}, {self.manifest.get('compute_dtype', '?')})"


@dataclass
class StepDiff:
    step: int
    reward_a: float
    reward_b: float
    reward: float  # relative differences ...
    logprob: float
    loss: float
    grad_norm: float
    image_max_abs: float  # the worst image's max |pixel difference| (pixels in [0, 1])
    image_psnr: float  # PSNR of the step's pooled pixel MSE (dB)
    image_psnr_min: float  # the worst single image's PSNR
    stage: str | None = None  # the first stage beyond tolerance
    why: str = ""
    images: list[dict] = field(default_factory=list)  # per image: prompt_id, sample_index, max_abs, psnr


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _metric(rec: Recording, step: int, key: str) -> float:
    value = rec.steps.get(step, {}).get(key)
    return float(value) if isinstance(value, (int, float)) else math.nan


def _floor(values: Sequence[float]) -> float:
    """The median magnitude of the finite ``values`` (1e-12 without any)."""
    finite = [abs(v) for v in values if math.isfinite(v)]
    return max(statistics.median(finite), 1e-12) if finite else 1e-12


def compare_recordings(a: Recording, b: Recording, args: argparse.Namespace) -> list[StepDiff]:
    """One ``StepDiff`` per step both recordings hold; ``stage`` set where a tolerance is exceeded."""
    common = sorted(set(a.steps) & set(b.steps))
    if not common:
        raise ValueError(f"{a.root} and {b.root} have no recorded step in common (A: {sorted(a.steps)[:8]}, "
                         f"B: {sorted(b.steps)[:8]})")
    # a step's loss can sit near 0 by construction (GRPO's on-policy loss is -mean(advantage) = 0): its scale is the
    # per-update losses' magnitude as much as its own
    loss_floor = max(_floor([_metric(a, s, "loss") for s in a.steps]), _floor(a.update_losses))
    grad_floor = _floor([_metric(a, s, "grad_norm") for s in a.steps])
    out = []
    for step in common:
        keys_a = {k for k in a.samples if k[0] == step}
        keys_b = {k for k in b.samples if k[0] == step}
        if keys_a != keys_b:
            only = sorted(keys_a ^ keys_b)[:4]
            raise ValueError(f"step {step}: the recordings hold different samples (e.g. (step, prompt, sample) "
                             f"{only}); "
                             "they did not sample the same prompts: compare runs of the same data, --seed and batch "
                             "flags, or a recording with its replay")
        keys = sorted(keys_a)
        if keys:
            reward_a = _mean([float(a.samples[k]["rewards"]["total"]) for k in keys])
            reward_b = _mean([float(b.samples[k]["rewards"]["total"]) for k in keys])
        else:  # offline DPO samples nothing: its logged means are all there is
            reward_a, reward_b = _metric(a, step, "reward_mean"), _metric(b, step, "reward_mean")
        worst_abs, mses, per_image = 0.0, [], []
        for k in keys:
            pa, pb = a.root / a.samples[k]["image"], b.root / b.samples[k]["image"]
            if pa.is_file() and pb.is_file():
                da, db = load_image(pa), load_image(pb)
                if da.shape != db.shape:
                    raise ValueError(f"step {step}: image {pa.name} is {tuple(da.shape)} in A but {tuple(db.shape)} "
                                     "in B; compare runs of the same --h/--w")
                diff = (da - db).abs()
                worst_abs = max(worst_abs, float(diff.max()))
                mses.append(float(diff.pow(2).mean()))
                per_image.append({"prompt_id": k[1], "sample_index": k[2], "max_abs": float(diff.max()),
                                  "psnr": psnr(mses[-1])})
        logprob = max((float(((a.log_probs[k] - b.log_probs[k]).abs() /
                             torch.maximum(torch.maximum(a.log_probs[k].abs(), b.log_probs[k].abs()),
                                           torch.tensor(1e-6))).max())
                       for k in keys if k in a.log_probs and k in b.log_probs), default=0.0)
        d = StepDiff(step=step, reward_a=reward_a, reward_b=reward_b,
                     reward=rel_diff(reward_a, reward_b) if keys or math.isfinite(reward_a) else 0.0,
                     logprob=logprob,
                     loss=rel_diff(_metric(a, step, "loss"), _metric(b, step, "loss"), loss_floor),
                     grad_norm=rel_diff(_metric(a, step, "grad_norm"), _metric(b, step, "grad_norm"), grad_floor),
                     image_max_abs=worst_abs, image_psnr=psnr(_mean(mses)) if mses else math.inf,
                     image_psnr_min=min((psnr(m) for m in mses), default=math.inf), images=per_image)
        checks = (("rollout", d.image_psnr < args.image_psnr_min,
                   f"image PSNR {d.image_psnr:.1f} dB < --image_psnr_min {args.image_psnr_min:g}"),
                  ("rollout", d.logprob > args.logprob_rtol,
                   f"old log-prob relative difference {d.logprob:.3g} > --logprob_rtol {args.logprob_rtol:g}"),
                  ("reward", d.reward > args.reward_rtol,
                   f"mean reward relative difference {d.reward:.3g} > --reward_rtol {args.reward_rtol:g}"),
                  ("train", d.loss > args.loss_rtol, f"loss relative difference {d.loss:.3g} > --loss_rtol "
                                                     f"{args.loss_rtol:g}"),
                  ("train", d.grad_norm > args.grad_norm_rtol,
                   f"grad norm relative difference {d.grad_norm:.3g} > --grad_norm_rtol {args.grad_norm_rtol:g}"))
        for stage, failed, why in checks:
            if failed:
                d.stage, d.why = stage, why
                break
        out.append(d)
    return out


def _fmt(value: float, spec: str = ".3g") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def print_table(a: Recording, b: Recording, diffs: list[StepDiff], per_image: bool = False) -> None:
    print(f"A: {a.name}\nB: {b.name}")
    header = (f"{'step':>5} {'reward A':>11} {'reward B':>11} {'Δreward':>9} {'PSNR dB':>8} {'min PSNR':>8} "
              f"{'max|Δpx|':>8} {'Δlogprob':>9} {'Δloss':>9} {'Δgrad':>9}  stage")
    print(header)
    for d in diffs:
        print(f"{d.step:>5} {_fmt(d.reward_a, '.5g'):>11} {_fmt(d.reward_b, '.5g'):>11} {_fmt(d.reward):>9} "
              f"{_fmt(d.image_psnr, '.1f'):>8} {_fmt(d.image_psnr_min, '.1f'):>8} {_fmt(d.image_max_abs, '.3f'):>8} "
              f"{_fmt(d.logprob):>9} {_fmt(d.loss):>9} {_fmt(d.grad_norm):>9}  {d.stage or 'ok'}")
        for image in d.images if per_image else ():
            name = f"p{image['prompt_id']}-s{image['sample_index']}"
            print(f"{'':>5}   image {name}: PSNR {_fmt(image['psnr'], '.1f')} dB, max|Δpx| {image['max_abs']:.3f}")


def plot(a: Recording, b: Recording, diffs: list[StepDiff], path: Path, args: argparse.Namespace) -> None:
    """Reward curves of both runs, the per-step relative differences (log scale) and the images' PSNR."""
    import matplotlib  # heavy

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy

    steps = [d.step for d in diffs]
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    axes[0].plot(steps, [d.reward_a for d in diffs], label=f"A: {a.name}")
    axes[0].plot(steps, [d.reward_b for d in diffs], "--", label=f"B: {b.name}")
    axes[0].set_ylabel("mean reward")
    axes[0].legend(fontsize=8)
    for key, label, tol in (("reward", "reward", args.reward_rtol), ("loss", "loss", args.loss_rtol),
                            ("grad_norm", "grad norm", args.grad_norm_rtol), ("logprob", "old log-prob", None)):
        values = [max(getattr(d, key), 1e-16) for d in diffs]
        line, = axes[1].plot(steps, values, label=label)
        if tol is not None:
            axes[1].axhline(tol, color=line.get_color(), linestyle=":", linewidth=0.8)
    axes[1].set_yscale("log")
    axes[1].set_ylabel("relative difference")
    axes[1].legend(fontsize=8)
    axes[2].plot(steps, [min(d.image_psnr, 150.0) for d in diffs], label="pooled")
    axes[2].plot(steps, [min(d.image_psnr_min, 150.0) for d in diffs], label="worst image")
    axes[2].axhline(args.image_psnr_min, color="red", linestyle=":", label="--image_psnr_min")
    axes[2].set_ylabel("image PSNR (dB; 150 = identical)")
    axes[2].set_xlabel("step")
    axes[2].legend(fontsize=8)
    first = next((d for d in diffs if d.stage), None)
    fig.suptitle(f"first divergence: step {first.step}, {first.stage}" if first else "runs agree within tolerance")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ run folders
# compared by default, in this order, where both runs log them: the curves a run is watched by
DEFAULT_METRICS = ("reward_mean", "eval/reward_mean", "loss", "grad_norm", "ratio_mean")
# readings of the machine's speed and memory, not of the computation: left out of --metrics all
MACHINE_KEYS = ("time_", "samples_per_s", "peak_memory_gb", "memory_baseline_gb", "tflops_", "mfu")


def _number(value: object) -> float | None:
    """A metrics.jsonl value as a float, or None when it is not a number (a list, a string, a bool, null)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass
class RunLog:
    """What ``compare`` reads of a trainer's ``--output_dir``: the numeric metrics of metrics.jsonl by step, and
    config.json's flags when present."""

    root: Path
    steps: dict[int, dict[str, float]]  # step -> metric -> value (NaN kept: a run that logged NaN)
    config: dict

    @classmethod
    def load(cls, root: str | Path) -> "RunLog":
        root = Path(root)
        steps: dict[int, dict[str, float]] = {}
        for row in read_rows(root):  # a resumed run's log holds each step once; a repeated step's last line wins
            values = {k: _number(v) for k, v in row.items() if k != "step"}
            steps.setdefault(int(row["step"]), {}).update({k: v for k, v in values.items() if v is not None})
        if not steps:
            raise ValueError(f"{root / 'metrics.jsonl'} holds no step; pass the --output_dir of a run that logged one")
        config_path = root / "config.json"
        try:
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        except ValueError:
            config = {}
        return cls(root, steps, config if isinstance(config, dict) else {})

    @property
    def name(self) -> str:
        algorithm = self.config.get("algorithm")
        return f"{self.root.name} ({algorithm})" if algorithm else self.root.name

    @property
    def keys(self) -> set[str]:
        """Every numeric metric the run logged at some step."""
        return {k for row in self.steps.values() for k in row}


@dataclass
class RunStepDiff:
    step: int
    values: dict[str, tuple[float | None, float | None, float | None]]  # metric -> (A, B, relative difference)
    over: list[str] = field(default_factory=list)  # the compared metrics beyond tolerance at this step
    why: str = ""


def tolerance(key: str, args: argparse.Namespace) -> tuple[float, str]:
    """(relative tolerance, its flag) of a run-folder metric."""
    if key == "reward_mean" or key.startswith("eval/"):
        return args.reward_rtol, "--reward_rtol"
    if key == "loss" or key.endswith("_loss"):
        return args.loss_rtol, "--loss_rtol"
    if key == "grad_norm":
        return args.grad_norm_rtol, "--grad_norm_rtol"
    return args.metric_rtol, "--metric_rtol"


def select_metrics(a: RunLog, b: RunLog, requested: Sequence[str] | None) -> list[str]:
    """The metrics to compare: ``requested`` (``["all"]``: every shared metric but the machine readings; default:
    the ``DEFAULT_METRICS`` both runs log); ValueError naming what a run lacks or what could be asked for."""
    shared = a.keys & b.keys
    if not shared:
        raise ValueError(f"{a.root} and {b.root} share no numeric metric in metrics.jsonl; compare runs of one trainer")
    if requested in (None, []):
        chosen = [k for k in DEFAULT_METRICS if k in shared]
        if not chosen:
            raise ValueError(f"the runs share none of {', '.join(DEFAULT_METRICS)}; pass --metrics with some of "
                             f"{', '.join(sorted(shared))}")
        return chosen
    if list(requested) == ["all"]:
        rest = sorted(k for k in shared if k not in DEFAULT_METRICS and not k.startswith(MACHINE_KEYS))
        return [k for k in DEFAULT_METRICS if k in shared] + rest
    for key in requested:
        if key not in shared:
            lacking = " and ".join(f"{run.root} ({label})" for run, label in ((a, "A"), (b, "B"))
                                   if key not in run.keys)
            raise ValueError(f"--metrics {key}: not logged by {lacking}; pass metrics both runs log, e.g. "
                             f"{', '.join(sorted(shared)[:12])}{' ...' if len(shared) > 12 else ''} (or 'all')")
    return list(dict.fromkeys(requested))


def compare_runs(a: RunLog, b: RunLog, metrics: Sequence[str], args: argparse.Namespace) -> list[RunStepDiff]:
    """One ``RunStepDiff`` per step both runs logged; a metric is compared at a step where both runs logged it, its
    ``over`` set where the relative difference exceeds its ``tolerance``. Floors: none for the rewards; otherwise
    the metric's median magnitude over run A (for the loss at least that of adv_abs_mean: GRPO's loss ~0)."""
    common = sorted(set(a.steps) & set(b.steps))
    if not common:
        raise ValueError(f"{a.root} and {b.root} have no logged step in common (A: {_steps_text(a.steps)}, "
                         f"B: {_steps_text(b.steps)})")
    floors = {}
    for key in metrics:
        if tolerance(key, args)[1] == "--reward_rtol":
            floors[key] = 1e-12
        else:
            floors[key] = _floor([row[key] for row in a.steps.values() if key in row])
    if "loss" in floors:  # a mean of +-advantage * ratio terms: the terms' size is the loss's scale
        floors["loss"] = max(floors["loss"], _floor([row["adv_abs_mean"] for row in a.steps.values()
                                                     if "adv_abs_mean" in row]))
    out = []
    for step in common:
        row_a, row_b = a.steps[step], b.steps[step]
        d = RunStepDiff(step, {})
        reasons = []
        for key in metrics:
            va, vb = row_a.get(key), row_b.get(key)
            rel = rel_diff(va, vb, floors[key]) if va is not None and vb is not None else None
            d.values[key] = (va, vb, rel)
            rtol, flag = tolerance(key, args)
            if rel is not None and rel > rtol:
                d.over.append(key)
                reasons.append(f"{key} relative difference {rel:.3g} > {flag} {rtol:g} (A {va:.6g}, B {vb:.6g})")
        d.why = "; ".join(reasons)
        out.append(d)
    return out


def _steps_text(steps: Sequence[int] | dict) -> str:
    """'31 steps (0..30)' or '1 step (4)'."""
    steps = sorted(steps)
    if not steps:
        return "no step"
    span = f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else f"{steps[0]}"
    return f"{len(steps)} step{'s' if len(steps) != 1 else ''} ({span})"


def _list_text(items: Sequence, limit: int = 12) -> str:
    items = list(items)
    return ", ".join(str(i) for i in items[:limit]) + (f", ... ({len(items)} in all)" if len(items) > limit else "")


def print_run_table(a: RunLog, b: RunLog, metrics: Sequence[str], diffs: list[RunStepDiff]) -> None:
    """The runs, their steps and one-sided metrics, then one line per common step: A, B and Δ (relative) of each
    compared metric ('-' where a run did not log it at that step) and the metrics beyond tolerance."""
    print(f"A: {a.name}: {_steps_text(a.steps)} in {a.root / 'metrics.jsonl'}")
    print(f"B: {b.name}: {_steps_text(b.steps)} in {b.root / 'metrics.jsonl'}")
    only_a, only_b = sorted(set(a.steps) - set(b.steps)), sorted(set(b.steps) - set(a.steps))
    note = "; ".join(f"steps only {label} logged: {_list_text(only)}" for label, only in (("A", only_a), ("B", only_b))
                     if only)
    print(f"compared: {_steps_text([d.step for d in diffs])} both runs logged" + (f" ({note})" if note else ""))
    for label, run, other in (("A", a, b), ("B", b, a)):
        lacking = sorted(run.keys - other.keys)
        if lacking:
            print(f"metrics only {label} logs (not compared): {_list_text(lacking)}")
    value_w, diff_w = 11, 9
    group_w = 2 * value_w + diff_w + 2
    print((f"{'':>5}  " + "  ".join(f"{k[:group_w]:<{group_w}}" for k in metrics)).rstrip())
    print(f"{'step':>5}  " + "  ".join(f"{'A':>{value_w}} {'B':>{value_w}} {'Δ':>{diff_w}}" for _ in metrics)
          + "  status")
    for d in diffs:
        cells = []
        for key in metrics:
            va, vb, rel = d.values[key]
            cells.append(f"{_fmt(va, '.5g'):>{value_w}} {_fmt(vb, '.5g'):>{value_w}} {_fmt(rel):>{diff_w}}")
        print(f"{d.step:>5}  " + "  ".join(cells) + f"  {', '.join(d.over) or 'ok'}")


def plot_run_diffs(a: RunLog, b: RunLog, metrics: Sequence[str], diffs: list[RunStepDiff], path: Path,
                   args: argparse.Namespace) -> None:
    """Both runs' reward curves (train solid, eval dashed) and the compared metrics' relative differences (log scale,
    their tolerances dotted)."""
    import matplotlib  # heavy

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy

    fig, axes = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for run, label, style in ((a, "A", "-"), (b, "B", "--")):
        for key, marker in (("reward_mean", ""), ("eval/reward_mean", "o")):
            steps = [s for s in sorted(run.steps) if key in run.steps[s]]
            if steps:
                axes[0].plot(steps, [run.steps[s][key] for s in steps], style, marker=marker or None, markersize=4,
                             label=f"{label}: {run.name} {key}")
    axes[0].set_ylabel("reward")
    axes[0].legend(fontsize=8)
    for key in metrics:
        points = [(d.step, d.values[key][2]) for d in diffs if d.values[key][2] is not None]
        if not points:
            continue
        line, = axes[1].plot([s for s, _ in points], [min(max(r, 1e-16), 1e3) for _, r in points], marker=".",
                             label=key)
        axes[1].axhline(tolerance(key, args)[0], color=line.get_color(), linestyle=":", linewidth=0.8)
    axes[1].set_yscale("log")
    axes[1].set_ylabel("relative difference")
    axes[1].set_xlabel("step")
    axes[1].legend(fontsize=8)
    first = next((d for d in diffs if d.over), None)
    fig.suptitle(f"first divergence: step {first.step}, {', '.join(first.over)}" if first
                 else "runs agree within tolerance")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_comparison(a_path: Path, b_path: Path, args: argparse.Namespace) -> int:
    """Compare two run folders: table, optional plot and JSON; 1 beyond tolerance, 0 when they agree (ValueError /
    FileNotFoundError for unusable input, which ``main`` turns into exit 2)."""
    a, b = RunLog.load(a_path), RunLog.load(b_path)
    metrics = select_metrics(a, b, args.metrics)
    diffs = compare_runs(a, b, metrics, args)
    print_run_table(a, b, metrics, diffs)
    if args.plot:
        plot_run_diffs(a, b, metrics, diffs, args.plot, args)
        print(f"plot: {args.plot}")
    if args.json:
        args.json.write_text(json.dumps([{"step": d.step, "over": d.over, "why": d.why,
                                          "metrics": {k: dict(zip(("a", "b", "rel"), v)) for k, v in d.values.items()}}
                                         for d in diffs], indent=1) + "\n")
    first = next((d for d in diffs if d.over), None)
    if first is None:
        compared = [(rel, key, d.step) for d in diffs for key, (_, _, rel) in d.values.items() if rel is not None]
        if not compared:
            raise ValueError(f"no step logs any of {', '.join(metrics)} in both runs; pick others with --metrics")
        rel, key, step = max(compared)
        print(f"agree: {len(diffs)} steps within tolerance (" +
              (f"largest relative difference {rel:.3g}: {key} at step {step})" if rel > 0
               else "every compared value identical)"))
        return 0
    print(f"DIVERGED at step {first.step}: {first.why}")
    return 1


# ------------------------------------------------------------------------------------------------ score files
def read_scores(path: Path) -> dict[str, dict]:
    """image name -> row of a ``fastvideo.rewards.score`` output file."""
    rows = read_jsonl(path)
    if not rows or "image" not in rows[0]:
        raise ValueError(f"{path} is not a score file (JSON lines with 'image' and reward entries); write one with "
                         "python -m fastvideo.rewards.score")
    return {r["image"]: r for r in rows}


def compare_scores(path_a: Path, path_b: Path, args: argparse.Namespace) -> int:
    """Per reward component: max abs / max relative / mean relative difference over the images both files score;
    exit status 1 when the total's max relative difference exceeds --reward_rtol."""
    a, b = read_scores(path_a), read_scores(path_b)
    names = sorted(set(a) & set(b))
    if not names:
        raise ValueError(f"{path_a} and {path_b} score no image in common; score the same image set on both devices")
    if len(names) < max(len(a), len(b)):
        print(f"note: {len(names)} images in common ({len(a)} in A, {len(b)} in B)")
    components = [k for k in a[names[0]] if k not in ("image", "prompt") and isinstance(a[names[0]][k], (int, float))]
    print(f"{len(names)} images\n{'reward':<24} {'max |Δ|':>11} {'max rel':>11} {'mean rel':>11}")
    worst_total = 0.0
    for comp in components:
        pairs = [(float(a[n][comp]), float(b[n].get(comp, math.nan))) for n in names]
        rels = [rel_diff(x, y) for x, y in pairs]
        worst_abs = max(abs(x - y) for x, y in pairs)
        print(f"{comp:<24} {worst_abs:>11.4g} {max(rels):>11.4g} {sum(rels) / len(rels):>11.4g}")
        if comp == "total":
            worst_total = max(rels)
    if args.plot:
        import matplotlib  # heavy

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # heavy

        fig, ax = plt.subplots(figsize=(5, 5))
        xs, ys = [float(a[n]["total"]) for n in names], [float(b[n]["total"]) for n in names]
        ax.scatter(xs, ys, s=8)
        lo, hi = min(xs + ys), max(xs + ys)
        ax.plot([lo, hi], [lo, hi], "k:", linewidth=0.8)
        ax.set_xlabel(f"A: {path_a.name}")
        ax.set_ylabel(f"B: {path_b.name}")
        ax.set_title(f"total reward, max rel diff {worst_total:.3g}")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        plt.close(fig)
    if worst_total > args.reward_rtol:
        print(f"DIVERGED: the total reward differs by up to {worst_total:.3g} (relative) > --reward_rtol "
              f"{args.reward_rtol:g}")
        return 1
    print(f"agree: total reward within {worst_total:.3g} relative (--reward_rtol {args.reward_rtol:g})")
    return 0


# ------------------------------------------------------------------------------------------------ entry point
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m fastvideo.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_a", help="a trainer's --output_dir (metrics.jsonl), a --record_dir folder, or a score "
                                      "file (JSON lines)")
    parser.add_argument("run_b", help="the folder or score file to compare with RUN_A (of the same kind)")
    parser.add_argument("--reward_rtol", type=float, default=0.05,
                        help="step-mean (or per-image, for score files; reward_mean and eval/* for run folders) "
                             "reward relative difference allowed (default: 0.05, the 5%% cross-device practice)")
    parser.add_argument("--image_psnr_min", type=float, default=30.0,
                        help="lowest PSNR in dB of a step's images (pooled MSE) that counts as the same rollout "
                             "(default: 30)")
    parser.add_argument("--logprob_rtol", type=float, default=0.01,
                        help="largest relative difference of a recorded old log-prob (default: 0.01)")
    parser.add_argument("--loss_rtol", type=float, default=0.05,
                        help="step loss (run folders: loss and *_loss) relative difference allowed (floor: its median "
                             "magnitude; default: 0.05)")
    parser.add_argument("--grad_norm_rtol", type=float, default=0.05,
                        help="step mean grad norm relative difference allowed (default: 0.05)")
    parser.add_argument("--metric_rtol", type=float, default=0.05,
                        help="run folders: relative difference allowed for every other compared metric (floor: its "
                             "median magnitude in RUN_A; default: 0.05)")
    parser.add_argument("--metrics", nargs="+", default=None, metavar="KEY",
                        help="run folders: the metrics.jsonl keys to compare, or 'all' (every shared metric but "
                             "timings and memory; default: " + ", ".join(DEFAULT_METRICS) + ", where both runs log "
                             "them)")
    parser.add_argument("--plot", type=Path, default=None,
                        help="PNG to write (default for recordings: RUN_B/compare.png; run folders and score files: "
                             "none)")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the per-step table (recordings: with every image's PSNR and max |Δpx|) as "
                             "JSON here")
    parser.add_argument("--per_image", action="store_true",
                        help="print every image's PSNR and max |Δpx| under its step")
    return parser.parse_args(argv)


KINDS = {"run": "a training run folder (metrics.jsonl, a trainer's --output_dir)",
         "recording": "a recording (manifest.json, a --record_dir folder)",
         "scores": "a score file (python -m fastvideo.rewards.score)"}
PASS = "pass two run folders (--output_dir), two recordings (--record_dir) or two score files"


def input_kind(path: Path) -> str:
    """'scores' (a file), 'recording' (a folder with manifest.json) or 'run' (a folder with metrics.jsonl);
    FileNotFoundError naming what to pass otherwise."""
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; {PASS}")
    if path.is_file():
        return "scores"
    if (path / "manifest.json").is_file():
        return "recording"
    if (path / "metrics.jsonl").is_file():
        return "run"
    raise FileNotFoundError(f"{path} holds neither metrics.jsonl (a trainer's --output_dir) nor manifest.json (a "
                            f"--record_dir recording); {PASS}")


def _mixed_kinds(paths: Sequence[Path], kinds: Sequence[str]) -> ValueError:
    """The error for two inputs of different kinds, pointing at the run folder's own recording where it has one."""
    said = "; ".join(f"{label} {path} is {KINDS[kind]}" for label, path, kind in zip("AB", paths, kinds))
    hint = ""
    for path, kind in zip(paths, kinds):
        if kind == "run":
            try:
                record_dir = json.loads((path / "config.json").read_text()).get("record_dir")
            except (OSError, ValueError, AttributeError):
                record_dir = None
            if record_dir:
                hint += f" ({path} recorded to --record_dir {record_dir})"
    return ValueError(f"{said}: {PASS}, not one of each{hint}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    a_path, b_path = Path(args.run_a), Path(args.run_b)
    try:
        kinds = [input_kind(a_path), input_kind(b_path)]
        if kinds[0] != kinds[1]:
            raise _mixed_kinds((a_path, b_path), kinds)
        if kinds[0] == "scores":
            return compare_scores(a_path, b_path, args)
        if kinds[0] == "run":
            return run_comparison(a_path, b_path, args)
        a, b = Recording.load(a_path), Recording.load(b_path)
        diffs = compare_recordings(a, b, args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print_table(a, b, diffs, per_image=args.per_image)
    plot_path = args.plot or b_path / "compare.png"
    plot(a, b, diffs, plot_path, args)
    if args.json:
        args.json.write_text(json.dumps([vars(d) for d in diffs], indent=1, default=str) + "\n")
    first = next((d for d in diffs if d.stage), None)
    print(f"plot: {plot_path}")
    if first is None:
        worst = max(d.reward for d in diffs)
        print(f"agree: {len(diffs)} steps within tolerance (largest mean-reward difference {worst:.3g})")
        return 0
    print(f"DIVERGED at step {first.step}, stage {first.stage}: {first.why}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
