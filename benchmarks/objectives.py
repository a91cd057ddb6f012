"""GRPO-Guard, Flow-DPPO, MixGRPO's sliding window and AWM beside GRPO: each one's training-reward gain over an lr-0
control, and its step time relative to GRPO's (the evidence docs/algorithms.md reports).

    OMP_NUM_THREADS=1 python benchmarks/objectives.py --out outputs/objectives            # JPEG world, 3 seeds
    OMP_NUM_THREADS=1 python benchmarks/objectives.py --out outputs/objectives --world toyworld   # 100 steps, ~75 min

Every run goes through a demo launcher (``scripts/finetune_flux_grpo.sh`` / ``finetune_flux_nft.sh``; ``--world``:
``jpeg`` = DEMO=jpeg, the tiny FLUX made JPEG-compressible, where GRPO itself learns within 40 steps; ``toyworld`` =
the default demo (prompt following of the toy FLUX), with GRPO's SDE window on the first 2 of 8 steps, 100 steps) on
2 ranks (run it with OMP_NUM_THREADS=1 on a 2-core machine) with the flags of ``WORLDS[world]`` added, for
``--steps`` steps. The GRPO variants take two optimizer steps per rollout (toyworld: 2 micro-batches of 16 per rank,
``--gradient_accumulation_steps 1``): with one, every replay is on-policy and GRPO-Guard's bias and Flow-DPPO's
divergence are 0. Gain = mean training reward (training prompts; ``GAIN_KEY``: toyworld's ``reward_toyworld``, jpeg's
``reward_mean``) of the last 10 steps minus that of the lr-0 control with the same sampler and seed (clip, guard and
dppo share one control: at lr 0 they sample the same images; a toyworld control trains the least, ``CONTROL``); for
``jpeg`` also as the JPEG size change in kB (reward = -size/500). Step time = the mean ``time_step`` after step 1,
relative to GRPO (clip) in the same seed. Runs that finished are reused. Writes ``results.json`` and ``table.md`` to
``--out``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from algorithms import NFT_SIGMAS, TRAIN_REWARD, launch


def _objectives(grpo: dict[str, str], one_step: str, guard_clip: str, awm: dict[str, str], sliding: dict[str, str],
                ) -> dict[str, tuple[str, dict, str]]:
    """name -> (launcher, flags over the demo's, control): GRPO, its two new losses, the sliding window, AWM."""
    return {
        "grpo": ("grpo", grpo, "grpo"),
        # the same samples in one optimizer step per rollout (every replay on-policy): what the clip costs GRPO
        "grpo_1step": ("grpo", {**grpo, "--gradient_accumulation_steps": "0", "--train_batch_size": one_step}, "grpo"),
        # GRPO-Guard's log-ratio is the plain one times the step's std: the demo's clip range times the median std of
        # the trained steps (verl-omni's 2e-6 is for Qwen-Image's scale)
        "guard": ("grpo", {**grpo, "--policy_loss": "guard", "--clip_range": guard_clip}, "grpo"),
        "dppo": ("grpo", {**grpo, "--policy_loss": "dppo"}, "grpo"),
        # MixGRPO: a window of 2 of the 8 steps sliding by one step every few training steps (``sliding``)
        "sliding": ("grpo", {**grpo, "--sde_window_size": "2", "--sde_window_schedule": "sliding", **sliding},
                    "sliding"),
        "awm": ("nft", {"--objective": "awm", "--awm_timesteps": "4", **awm}, "awm"),
    }


# the demo's values plus these (jpeg: eta 0.9, the trainers' default, as tests/test_train_grpo.py's learning test);
# guard's clip: the demo's times the median std of the trained steps (the guard's log-ratio is the plain one times
# it): jpeg 1e-4 x 0.49 (eta 0.9, FLUX's shift at 16 tokens), toyworld 1e-3 x ~0.94 (eta 1, steps 0-1 of 8 at shift 1)
# toyworld: lr 1e-4 and the toyworld reward (the mean of the checks) for every objective, whatever the demos' own;
# AWM's strata span 7 of the 8 sigmas (the NFT demo's own --timestep_fraction is 0.25);
# GRPO trains a window of the first 2 of 8 steps (the rest ODE), where the scene's layout is decided; with every step
# stochastic and trained its training reward did not rise within 60 steps (docs/toy-world.md); the sliding window
# moves over steps 0-3, one step every 10 training steps
WORLDS: dict[str, dict[str, tuple[str, dict, str]]] = {
    "jpeg": _objectives({"--eta": "0.9", "--train_batch_size": "8", "--gradient_accumulation_steps": "1"}, "16",
                        "5e-5", {}, {"--sde_window_range": "0 7", "--sde_window_shift_interval": "5"}),
    "toyworld": _objectives({"--sde_window_size": "2", "--sde_window_range": "0 2", "--learning_rate": "1e-4",
                             "--gradient_accumulation_steps": "1", **TRAIN_REWARD}, "32", "1e-3",
                            {"--learning_rate": "1e-4", **TRAIN_REWARD, **NFT_SIGMAS},
                            {"--sde_window_range": "0 4", "--sde_window_shift_interval": "10"}),
}
STEPS = {"jpeg": 40, "toyworld": 100}
# A toyworld lr-0 control, by launcher, also trains as little as it can while it samples the same images (rewards equal
# to an lr-0 run's bit for bit: nothing it trains at lr 0 reaches the rollouts). GRPO: nothing (at reward weight 0 every
# advantage is 0 and --drop_zero_advantage drops every sample: no forward, no optimizer step), its reward logged at
# weight 0 as reward_toyworld, the column every toyworld gain compares (``GAIN_KEY``; = reward_mean at TRAIN_REWARD's
# weight 1). NFT (AWM): one sigma per sample instead of 4 strata over 7 (its ODE rollouts do not depend on them).
# About half the step either way.
CONTROL = {"grpo": {"--reward": "toyworld:0.0", "--drop_zero_advantage": ""},
           "nft": {"--awm_timesteps": "1", "--timestep_fraction": "0.125"}}
GAIN_KEY = {"jpeg": "reward_mean", "toyworld": "reward_toyworld"}


def run(out: Path, world: str, name: str, seed: int, steps: int, data_dir: Path, control: bool = False) -> Path:
    """One run (the objective's, or its lr-0 control) through its launcher."""
    launcher, flags, control_name = WORLDS[world][name]
    if control:
        flags = {**flags, "--learning_rate": "0", **(CONTROL[launcher] if world == "toyworld" else {})}
    folder = out / world / (f"control-{control_name}-seed{seed}" if control else f"{name}-seed{seed}")
    return launch(launcher, flags, folder, seed=seed, budget_s=0, eval_every=0, eval_prompts=16, data_dir=data_dir,
                  max_steps=steps, nproc=2, demo=world)


def rows(folder: Path) -> list[dict]:
    return [r for r in (json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line)
            if r.get("step", 0) >= 1 and "reward_mean" in r]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/objectives"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--world", choices=list(WORLDS), default="jpeg")
    parser.add_argument("--steps", type=int, default=0, help="steps per run (0 = the world's: jpeg 40, toyworld 100)")
    parser.add_argument("--objectives", nargs="+", default=list(WORLDS["jpeg"]), choices=list(WORLDS["jpeg"]))
    parser.add_argument("--data_dir", type=Path, default=Path("data"), help="the demos' DATA_DIR")
    args = parser.parse_args(argv)
    results: dict = {}
    steps = args.steps or STEPS[args.world]
    for seed in args.seeds:
        for name in args.objectives:
            trained, control = (rows(run(args.out, args.world, name, seed, steps, args.data_dir, control=c))
                                for c in (False, True))
            key = GAIN_KEY[args.world]
            gain = np.mean([r[key] for r in trained[-10:]]) - np.mean([r[key] for r in control[-10:]])
            step_s = float(np.mean([r["time_step"] for r in trained[1:]]))
            results.setdefault(name, {})[seed] = {"gain": float(gain), "step_s": step_s,
                                                  "first10": float(np.mean([r[key] for r in trained[:10]])),
                                                  "last10": float(np.mean([r[key] for r in trained[-10:]]))}
            kb = f" ({-500 * gain:+.3f} kB of JPEG)" if args.world == "jpeg" else ""
            print(f"{name} seed {seed}: gain {gain:+.5f}{kb} over lr 0, {step_s:.2f} s/step", flush=True)
    unit = "JPEG kB" if args.world == "jpeg" else "reward"
    lines = [f"| objective | change vs lr 0 per seed ({unit}, last 10 of {steps} steps) | mean | step time vs GRPO |",
             "| --- | --- | --- | --- |"]
    show = (lambda g: -500 * g) if args.world == "jpeg" else (lambda g: g)  # noqa: E731
    for name, per_seed in results.items():
        gains = [show(v["gain"]) for v in per_seed.values()]
        ratio = np.mean([v["step_s"] / results["grpo"][s]["step_s"] for s, v in per_seed.items()
                         if s in results.get("grpo", {})]) if "grpo" in results else float("nan")
        lines.append(f"| {name} | {', '.join(f'{g:+.4f}' for g in gains)} | {np.mean(gains):+.4f} | {ratio:.2f}x |")
    out = args.out / args.world
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
