"""Compare two recordings (``--record_dir``) step by step, or two reward score files, and say where they part.

    python -m fastvideo.compare RUN_A RUN_B [--reward_rtol 0.05 --image_psnr_min 30 ...] [--plot compare.png]
    python -m fastvideo.compare scores_a.jsonl scores_b.jsonl [--reward_rtol 0.05]

For recordings it prints a per-step table (step-mean reward of both runs and their relative difference, the worst
image's max-abs pixel difference and the step's PSNR, the largest old-log-prob, loss and grad-norm relative
differences), writes a PNG with both reward curves and the per-step differences, names the first step and stage where
the runs diverge beyond tolerance, checking the stages in the order a step runs them:

    rollout  images (PSNR of the step's pooled pixel MSE < --image_psnr_min) or old log-probs (> --logprob_rtol)
    reward   the step's mean reward (> --reward_rtol; default 5%, the cross-device acceptance practice)
    train    the step's loss (> --loss_rtol) or mean grad norm (> --grad_norm_rtol)

and exits 1 when a tolerance is exceeded (0 when the runs agree, 2 for unusable input). A relative difference is
``|a - b| / max(|a|, |b|, floor)``; the floor of the loss and grad norm is their median magnitude over run A, so a
loss that crosses zero is not flagged for a tiny absolute gap (for the loss, the larger of that and the per-update
losses' median magnitude: GRPO's step loss is ~0 by construction). For score files (``fastvideo.rewards.score``) it
matches images by name and compares every reward component.
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
        from safetensors.torch import load_file

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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

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
    parser = argparse.ArgumentParser(prog="python -m fastvideo.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a", help="a --record_dir folder, or a score file (JSON lines)")
    parser.add_argument("run_b", help="the folder or score file to compare with RUN_A")
    parser.add_argument("--reward_rtol", type=float, default=0.05,
                        help="step-mean (or per-image, for score files) reward relative difference allowed "
                             "(default: 0.05, the 5%% cross-device practice)")
    parser.add_argument("--image_psnr_min", type=float, default=30.0,
                        help="lowest PSNR in dB of a step's images (pooled MSE) that counts as the same rollout "
                             "(default: 30)")
    parser.add_argument("--logprob_rtol", type=float, default=0.01,
                        help="largest relative difference of a recorded old log-prob (default: 0.01)")
    parser.add_argument("--loss_rtol", type=float, default=0.05,
                        help="step loss relative difference allowed (floor: its median magnitude; default: 0.05)")
    parser.add_argument("--grad_norm_rtol", type=float, default=0.05,
                        help="step mean grad norm relative difference allowed (default: 0.05)")
    parser.add_argument("--plot", type=Path, default=None,
                        help="PNG to write (default for recordings: RUN_B/compare.png; score files: none)")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the per-step table (with every image's PSNR and max |Δpx|) as JSON here")
    parser.add_argument("--per_image", action="store_true",
                        help="print every image's PSNR and max |Δpx| under its step")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    a_path, b_path = Path(args.run_a), Path(args.run_b)
    try:
        for path in (a_path, b_path):
            if not path.exists():
                raise FileNotFoundError(f"{path} does not exist; pass two --record_dir folders or two score files")
        if a_path.is_file() and b_path.is_file():
            return compare_scores(a_path, b_path, args)
        if a_path.is_file() != b_path.is_file():
            raise ValueError("pass two --record_dir folders or two score files, not one of each")
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
