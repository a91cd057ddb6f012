"""GRPO vs DPO vs DiffusionNFT on the toy world: held-out prompt-following accuracy for a fixed CPU-time budget.

    python benchmarks/algorithms.py --out outputs/algorithms            # tune, then 2 settings x 3 algorithms x seeds
    python benchmarks/algorithms.py --out outputs/algorithms --plot_only   # redraw the table and plot from the runs

Every run starts from the same pretrained toy FLUX and goes through the demo launchers
(``scripts/finetune_flux_{grpo,dpo,nft}.sh``, toy-world default) with flags added, so it trains exactly what a user
runs. Each algorithm gets two settings:

- ``published``: its paper's / reference code's defaults, scaled down only where the toy world forces it (batch
  sizes, sampling steps, image size) -- see ``PUBLISHED``;
- ``tuned``: the best of the same number of candidates per algorithm (``CANDIDATES``), each run once for
  ``--tune_budget_s`` on a tuning seed and judged by accuracy on *training* prompts (the held-out prompts are only
  for the final table).

Each final run trains for ``--budget_s`` seconds of training (``--max_train_seconds``; evaluation excluded) and is
evaluated on ``--eval_prompts`` held-out prompts every ``--eval_every`` steps (Euler ODE, fixed noise). Runs that
already finished are reused, so the script can be re-run after an interruption. Writes ``results.json``,
``table.md`` and ``algorithms.png`` (held-out strict accuracy and score vs training seconds and vs samples; mean over
seeds with the min-max band) to ``--out``. One CPU process per run (1 rank, OMP_NUM_THREADS from the environment, default 2):
absolute seconds are this machine's, so compare runs made on one machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
LAUNCHERS = {"grpo": "scripts/finetune_flux_grpo.sh", "dpo": "scripts/finetune_flux_dpo.sh",
             "nft": "scripts/finetune_flux_nft.sh"}
METRIC = "eval/reward_toyworld_strict"
SCORE = "eval/reward_toyworld"

# The published defaults, scaled down. Flags not named here are the toy-world demo's (launcher) values.
PUBLISHED: dict[str, dict[str, str]] = {
    # DanceGRPO FLUX: lr 1e-5, clip 1e-4, timestep fraction 0.6, adv clip 5, eta 0.3 (dance_sde); 12 per group
    "grpo": {"--learning_rate": "1e-5", "--clip_range": "1e-4", "--timestep_fraction": "0.6", "--sde_type": "dance_sde",
             "--eta": "0.3", "--num_generations": "12", "--prompts_per_step": "4", "--rollout_batch_size": "48",
             "--train_batch_size": "12", "--max_grad_norm": "0.01"},
    # Diffusion-DPO (online best-vs-worst as verl-omni): beta 2000 (FLUX), lr 1e-5 (scaled to our batch), ODE samples
    "dpo": {"--learning_rate": "1e-5", "--beta_dpo": "2000", "--sampler": "ode", "--eta": "0"},
    # DiffusionNFT: beta 1, kl 1e-4, lr 3e-4, dpm2 solver, linear old-policy decay, timestep fraction 0.99
    "nft": {"--learning_rate": "3e-4", "--nft_beta": "1.0", "--kl_beta": "1e-4", "--solver": "dpm2",
            "--old_decay_schedule": "linear", "--timestep_fraction": "0.99"},
}
# The same number of candidates for each algorithm: the tuning budget is equal by construction.
CANDIDATES: dict[str, list[dict[str, str]]] = {
    algo: [{"--learning_rate": lr} for lr in ("1e-4", "3e-4")] for algo in ("grpo", "dpo", "nft")
}
TUNE_SEED = 100


def run_dir(out: Path, algo: str, setting: str, seed: int) -> Path:
    """Where a final run of (algorithm, setting, seed) lives."""
    return out / "runs" / f"{algo}-{setting}-seed{seed}"


def launch(algo: str, flags: dict[str, str], output_dir: Path, *, seed: int, budget_s: float, eval_every: int,
           eval_prompts: int, data_dir: Path, eval_json: Path | None = None, max_steps: int | None = None,
           nproc: int = 1, demo: str = "toyworld") -> Path:
    """One training run through the algorithm's launcher (skipped if it already finished); returns its folder.
    ``max_steps``: a fixed number of steps instead of the ``budget_s`` seconds; ``nproc``: ranks (torchrun); ``demo``:
    the launchers' DEMO (toyworld, jpeg)."""
    if (output_dir / "final").exists():
        return output_dir
    extra = [x for k, v in flags.items() for x in (k, *v.split())]  # "--flag": "a b" passes two values
    length = (["--max_train_steps", str(max_steps)] if max_steps else
              ["--max_train_seconds", str(budget_s), "--max_train_steps", "100000"])
    evaluation = (["--eval_every", str(eval_every), "--eval_max_prompts", str(eval_prompts)] if demo == "toyworld"
                  else [])  # the JPEG demo has no held-out prompts
    args = [*extra, "--seed", str(seed), *length, *evaluation, "--sample_every", "0", "--checkpointing_steps",
            "100000", "--no-progress_bar"]
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable), "DATA_DIR": str(data_dir),
           "OUTPUT_DIR": str(output_dir), "DEMO": demo,
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "NPROC_PER_NODE": str(nproc)}
    env.pop("MODEL_PATH", None)
    if eval_json is not None:
        env["EVAL_JSON"] = str(eval_json)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    log = output_dir.parent / f"{output_dir.name}.log"
    print(f"[{algo}] {output_dir.name}: {' '.join(extra)} ({budget_s:g} s)", flush=True)
    with open(log, "w") as fh:
        proc = subprocess.run(["bash", LAUNCHERS[algo], *args], cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{algo} run {output_dir} failed (exit {proc.returncode}); see {log}")
    return output_dir


def curve(output_dir: Path) -> dict[str, list[float]]:
    """Evaluation points of a run: step, training seconds, samples drawn, strict accuracy and mean score."""
    config = json.loads((output_dir / "config.json").read_text())
    per_step = config["batch_arithmetic"]["samples_per_step"]
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if METRIC in r]
    return {"step": [r["step"] for r in rows], "seconds": [r.get("time_elapsed", 0.0) for r in rows],
            "samples": [r["step"] * per_step for r in rows], "strict": [r[METRIC] for r in rows],
            "score": [r[SCORE] for r in rows]}


def tune(algo: str, args: argparse.Namespace, train_eval: Path) -> dict[str, str]:
    """The candidate with the best final training-prompt score after --tune_budget_s (one seed)."""
    best, best_flags = -1.0, None
    results = []
    for i, cand in enumerate(CANDIDATES[algo]):
        d = launch(algo, cand, args.out / "tune" / f"{algo}-cand{i}", seed=TUNE_SEED, budget_s=args.tune_budget_s,
                   eval_every=0, eval_prompts=args.eval_prompts, data_dir=args.data_dir, eval_json=train_eval)
        final = curve(d)["score"][-1]
        results.append({"flags": cand, "train_score": final})
        if final > best:
            best, best_flags = final, cand
    (args.out / "tune" / f"{algo}.json").write_text(json.dumps(results, indent=2) + "\n")
    return best_flags


def summarise(out: Path, algos: list[str], seeds: list[int]) -> dict:
    """Per "algo/setting": its flags, every seed's curve, and start/end means (strict: also sd, min, max) over seeds."""
    summary: dict = {}
    for algo in algos:
        for setting in ("published", "tuned"):
            curves = [curve(run_dir(out, algo, setting, s)) for s in seeds if (run_dir(out, algo, setting, s) /
                                                                               "metrics.jsonl").exists()]
            if not curves:
                continue
            flags_file = out / "settings.json"
            flags = json.loads(flags_file.read_text()).get(algo, {}).get(setting, {}) if flags_file.exists() else {}
            first = np.array([c["strict"][0] for c in curves])
            last = np.array([c["strict"][-1] for c in curves])
            summary[f"{algo}/{setting}"] = {
                "flags": flags, "seeds": len(curves), "curves": curves,
                "steps": float(np.mean([c["step"][-1] for c in curves])),
                "samples": float(np.mean([c["samples"][-1] for c in curves])),
                "strict_start": float(first.mean()), "strict_end": float(last.mean()),
                "strict_end_sd": float(last.std(ddof=1)) if len(last) > 1 else 0.0,
                "strict_end_min": float(last.min()), "strict_end_max": float(last.max()),
                "score_start": float(np.mean([c["score"][0] for c in curves])),
                "score_end": float(np.mean([c["score"][-1] for c in curves])),
            }
    return summary


def write_table(summary: dict, path: Path, budget_s: float) -> str:
    """The markdown table of ``summary`` (written to ``path`` and returned)."""
    lines = ["| algorithm | setting | steps | samples | held-out strict: start -> end (sd; min-max) | held-out score: "
             "start -> end | flags |", "|---|---|---|---|---|---|---|"]
    for key, r in summary.items():
        algo, setting = key.split("/")
        flags = " ".join(f"{k} {v}" for k, v in r["flags"].items())
        lines.append(f"| {algo.upper()} | {setting} | {r['steps']:.0f} | {r['samples']:.0f} | {r['strict_start']:.3f} "
                     f"-> **{r['strict_end']:.3f}** ({r['strict_end_sd']:.3f}; {r['strict_end_min']:.3f}-"
                     f"{r['strict_end_max']:.3f}) | {r['score_start']:.3f} -> {r['score_end']:.3f} | `{flags}` |")
    text = (f"Held-out strict accuracy (all checks right) after {budget_s:g} s of training per run; mean over "
            f"{max((r['seeds'] for r in summary.values()), default=0)} seeds.\n\n" + "\n".join(lines) + "\n")
    path.write_text(text)
    return text


def plot(summary: dict, path: Path) -> None:
    """2 x 2 PNG: held-out strict accuracy and score vs training seconds and vs samples, seed mean and min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"grpo": "tab:blue", "dpo": "tab:orange", "nft": "tab:green"}
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharey="row")
    for key, r in summary.items():
        algo, setting = key.split("/")
        style = "-" if setting == "tuned" else "--"
        for row, ykey in enumerate(("strict", "score")):
            for col, xkey in enumerate(("seconds", "samples")):
                ax = axes[row, col]
                # evaluation points are at the same steps across seeds only up to the shortest run
                n = min(len(c[xkey]) for c in r["curves"])
                x = np.mean([c[xkey][:n] for c in r["curves"]], axis=0)
                ys = np.array([c[ykey][:n] for c in r["curves"]])
                ax.plot(x, ys.mean(0), style, color=colors[algo], label=f"{algo.upper()} {setting}")
                ax.fill_between(x, ys.min(0), ys.max(0), color=colors[algo], alpha=0.12)
    axes[1, 0].set_xlabel("training seconds (2 CPU threads)")
    axes[1, 1].set_xlabel("samples generated")
    axes[0, 0].set_ylabel("held-out strict accuracy")
    axes[1, 0].set_ylabel("held-out score (mean of the 4 checks)")
    axes[0, 1].legend(fontsize=8)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.suptitle("Toy world: GRPO vs DPO vs DiffusionNFT from the same pretrained toy FLUX")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("outputs/algorithms"), help="results folder")
    p.add_argument("--data_dir", type=Path, default=Path("data"), help="DATA_DIR of the launchers (toy model, data)")
    p.add_argument("--algos", nargs="+", default=["grpo", "dpo", "nft"], choices=list(LAUNCHERS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="seeds of the final runs")
    p.add_argument("--budget_s", type=float, default=120.0, help="training seconds per final run")
    p.add_argument("--tune_budget_s", type=float, default=45.0, help="training seconds per tuning candidate")
    p.add_argument("--eval_every", type=int, default=5, help="steps between held-out evaluations")
    p.add_argument("--eval_prompts", type=int, default=128, help="held-out prompts per evaluation")
    p.add_argument("--plot_only", action="store_true", help="only redraw table and plot from existing runs")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    if not args.plot_only:
        # the launchers build the toy model and data on first use; the tuning set is the train prompts' embeddings
        settings_file = args.out / "settings.json"
        settings = json.loads(settings_file.read_text()) if settings_file.exists() else {}
        train_eval = args.data_dir / "toyworld-train" / "manifest.json"
        for algo in args.algos:
            entry = settings.setdefault(algo, {"published": PUBLISHED[algo]})
            if "tuned" not in entry:
                if not train_eval.exists():  # first launch builds the data: one short run
                    launch(algo, PUBLISHED[algo], args.out / "warmup", seed=0, budget_s=1, eval_every=0,
                           eval_prompts=8, data_dir=args.data_dir)
                entry["tuned"] = tune(algo, args, train_eval)
                settings_file.write_text(json.dumps(settings, indent=2) + "\n")
        for algo in args.algos:
            for setting in ("published", "tuned"):
                for seed in args.seeds:
                    launch(algo, settings[algo][setting], run_dir(args.out, algo, setting, seed), seed=seed,
                           budget_s=args.budget_s, eval_every=args.eval_every, eval_prompts=args.eval_prompts,
                           data_dir=args.data_dir)

    summary = summarise(args.out, args.algos, args.seeds)
    (args.out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(write_table(summary, args.out / "table.md", args.budget_s))
    plot(summary, args.out / "algorithms.png")
    print(f"table: {args.out / 'table.md'}\nplot:  {args.out / 'algorithms.png'}")


if __name__ == "__main__":
    sys.exit(main())
