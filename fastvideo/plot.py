"""Training curves (reward, eval reward, loss, clipfrac, KL, grad norm, ratio, lr, and one panel per --eval_reward
reward: ``eval/<name>``) of one or several runs in one PNG, read from each trainer ``--output_dir``'s metrics.jsonl, so
runs can be checked and compared at a glance.

    python -m fastvideo.plot OUT [OUT2 ...] [--out FILE.png] [--names NAME ...]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Sequence

from fastvideo.record import read_jsonl
from fastvideo.rewards import REWARD_NAMES

# (panel title, metric keys); eval keys (logged at step 0 = the baseline, then every N steps) are drawn dashed.
PLOTTED: tuple[tuple[str, list[str]], ...] = (
    ("reward", ["reward_mean", "eval/reward_mean", "eval_total"]),
    ("loss", ["loss"]),
    ("clipfrac", ["clipfrac"]),
    ("kl", ["kl"]),
    ("grad_norm", ["grad_norm"]),
    ("ratio_mean", ["ratio_mean"]),
    ("lr", ["lr"]),
)
EVAL_KEYS = ("eval/reward_mean", "eval_total")  # eval_total: legacy name of eval/reward_mean
COLUMNS = 4


def read_rows(run_dir: str | Path) -> list[dict]:
    """Rows of ``RUN/metrics.jsonl``; lines that do not parse (a torn last line of a killed run) are skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: pass a trainer's --output_dir")

    return [r for r in read_jsonl(path) if isinstance(r, dict) and isinstance(r.get("step"), (int, float))]


def series(rows: Sequence[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of ``key`` over ``rows``, dropping rows without it and NaN/inf/null/non-numeric values."""
    steps, values = [], []
    for row in rows:
        v = row.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(row["step"])
            values.append(float(v))
    return steps, values


def panels(rows_by_run: Sequence[Sequence[dict]]) -> list[tuple[str, list[str]]]:
    """(title, keys) of the ``PLOTTED`` panels that have data in at least one run, then one panel per --eval_reward
    reward logged (``eval/<name>``, titled so; drawn as eval keys)."""
    shown = [(title, keys) for title, keys in PLOTTED if any(series(rows, k)[0] for rows in rows_by_run for k in keys)]
    extra = [f"eval/{name}" for name in REWARD_NAMES]
    return shown + [(key, [key]) for key in extra if any(series(rows, key)[0] for rows in rows_by_run)]


def panels_for(rows_by_run: Sequence[Sequence[dict]]) -> list[str]:
    """Titles of the panels (``panels``) that have data in at least one run."""
    return [title for title, _ in panels(rows_by_run)]


def available_panels(run_dirs: Sequence[str | Path]) -> list[str]:
    """Titles of the panels ``plot_runs`` would draw for these run folders."""
    return panels_for([read_rows(d) for d in run_dirs])


def run_names(run_dirs: Sequence[str | Path]) -> list[str]:
    """Each run folder's name, or its last two path parts where names collide."""
    paths = [Path(d).resolve() for d in run_dirs]
    names = [p.name for p in paths]
    return [str(Path(*p.parts[-2:])) if names.count(n) > 1 else n for p, n in zip(paths, names)]


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path, names: Sequence[str] | None = None) -> Path:
    """Write one PNG with a grid of metric-vs-step panels, the runs overlaid one colour each; return its path."""
    if names is not None and len(names) != len(run_dirs):
        raise ValueError(f"{len(names)} names for {len(run_dirs)} runs: pass one name per run")
    rows_by_run = [read_rows(d) for d in run_dirs]
    names = list(names) if names is not None else run_names(run_dirs)
    keys_of = dict(panels(rows_by_run))
    titles = list(keys_of)
    if not titles:
        plotted = sorted({k for _, keys in PLOTTED for k in keys})
        raise ValueError(f"no run in {[str(d) for d in run_dirs]} has any of the plotted metrics {plotted}")
    import matplotlib  # heavy

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy

    ncols = min(COLUMNS, len(titles))
    nrows = math.ceil(len(titles) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.5 * ncols, 3.5 * nrows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, title in zip(axes.flat, titles):
        for i, (rows, name) in enumerate(zip(rows_by_run, names)):
            color = colors[i % len(colors)]
            for key in keys_of[title]:
                steps, values = series(rows, key)
                if not steps:
                    continue
                if key in EVAL_KEYS or key.startswith("eval/"):  # eval/<name>: an --eval_reward reward
                    ax.plot(steps, values, "--o", color=color, markersize=4, label=f"{name} eval")
                else:
                    ax.plot(steps, values, "-", color=color, label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(titles):]:
        ax.set_visible(False)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI: plot the runs, print the PNG's path."""
    parser = argparse.ArgumentParser(prog="python -m fastvideo.plot", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="OUT", help="a trainer's --output_dir (holds metrics.jsonl)")
    parser.add_argument("--out", default=None,
                        help="PNG to write (default: OUT/plots.png for one run, ./plots.png for several)")
    parser.add_argument("--names", nargs="+", default=None, help="legend name of each run (one per run)")
    args = parser.parse_args(argv)
    if args.names is not None and len(args.names) != len(args.runs):
        parser.error(f"--names got {len(args.names)} names for {len(args.runs)} runs: pass one name per run")
    out = args.out or (Path(args.runs[0]) / "plots.png" if len(args.runs) == 1 else Path("plots.png"))
    try:
        print(plot_runs(args.runs, out, args.names))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
