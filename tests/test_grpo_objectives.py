"""GRPO's policy-loss variants (--policy_loss guard | dppo), MixGRPO's moving SDE window (--sde_window_schedule) and
the reference-parity switches (--drop_zero_advantage, --shuffle_micro_batches, --timestep_selection first,
--group_std population, --kl_form) end to end on the tiny preset (2 ranks, gloo, CPU): on-policy at the first update,
their own metrics, exact resume; (slow) each raises the toy world's training reward over an lr-0 control."""
from __future__ import annotations

import math
import os

import pytest

from helpers import assert_resume_matches, make_embeddings, run_torchrun

from fastvideo.logging import read_metrics


def grpo_args(model, data, out, *extra: str) -> list[str]:
    return ["train_grpo_flux.py", "--pretrained_model_name_or_path", str(model), "--data_json_path", str(data),
            "--output_dir", str(out), "--device", "cpu", "--h", "64", "--w", "64", "--sampling_steps", "6",
            "--num_generations", "4", "--prompts_per_step", "2", "--rollout_batch_size", "4", "--train_batch_size",
            "2", "--reward", "jpeg_compressibility:1.0", "--learning_rate", "1e-3", "--sample_every", "0",
            "--checkpointing_steps", "2", "--seed", "3", "--no-progress_bar", "--lora_rank", "4", *extra]


# guard + the sliding window + both micro-batch switches + the reference KL form on cps-free flow_sde;
# dppo + Flow-GRPO's first-K timesteps + the population group std + dance_sde's reference KL
VARIANTS = {
    "guard+sliding+shuffle+drop": ("--policy_loss", "guard", "--clip_range", "2e-6", "--sde_window_size", "2",
                                   "--sde_window_range", "0", "5", "--sde_window_schedule", "sliding",
                                   "--sde_window_shift_interval", "1", "--sde_window_stride", "2",
                                   "--shuffle_micro_batches", "--drop_zero_advantage",
                                   "--gradient_accumulation_steps", "1", "--kl_beta", "0.04"),
    "dppo+first+population+dance_kl": ("--policy_loss", "dppo", "--sde_type", "dance_sde", "--timestep_selection",
                                       "first", "--timestep_fraction", "0.5", "--group_std", "population",
                                       "--kl_beta", "0.04", "--kl_form", "reference",
                                       "--gradient_accumulation_steps", "1"),
}


@pytest.fixture(scope="session")  # once per session: the slow or evidence tier reads it too
def data(tiny_flux_dir, tmp_path_factory):
    return make_embeddings(tiny_flux_dir, tmp_path_factory.mktemp("emb"), 8, "--max_sequence_length", "32")


def _check_rows(rows: list[dict], name: str) -> None:
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
        assert row["ratio_first_update_max_dev"] < 1e-5 and row["clipfrac_first_update"] == 0.0  # on-policy
    if name.startswith("guard"):
        # the sliding window: steps 0-1, 2-3, then back to 0 (range [0, 5), window 2, stride 2, one step each)
        assert [r["window_start"] for r in rows] == [0, 2, 0]
        assert all(r["trained_timesteps"] == 2 for r in rows)
        # >= 0 by construction; > 0: the second optimizer step of each rollout replays a moved mean
        assert all(r["guard_bias_mean"] > 0 for r in rows)
        assert all(0 < r["kept_frac"] <= 1 for r in rows)
    else:
        assert all(r["trained_timesteps"] == 3 for r in rows)  # int(6 x 0.5), steps 0..2 in order
        assert all(0 <= r["dppo_masked_frac"] <= 1 and r["dppo_divergence_mean"] >= 0 for r in rows)
        assert all(r["dppo_divergence_mean"] > 0 for r in rows)  # the second optimizer step replays a moved mean


# slow for the default suite's time: by default GRPO-Guard and Flow-DPPO train end to end in test_families.py (two
# optimizer steps per rollout, every family), the sliding window and both micro-batch switches run through
# update_policy in the pretend-CUDA trace (test_fake_cuda.py), and their orders are unit-tested here
@pytest.mark.slow(
    cover="test_families.py::test_grpo_lora_with_cfg_is_on_policy_and_exports_a_lora_the_pipeline_loads[flux2]", cost_s=40)
@pytest.mark.parametrize("name", ["guard+sliding+shuffle+drop", "dppo+first+population+dance_kl"])
def test_variant_is_on_policy_and_resumes_exactly(tiny_flux_dir, data, tmp_path, name):
    """3 steps on 2 ranks, then the same run resumed from its step-2 checkpoint logs the same step 3 (the window
    position, the shuffle, the dropped samples, the guard's rollout means are all functions of the step or restored)."""
    straight = tmp_path / "straight"
    run_torchrun(grpo_args(tiny_flux_dir, data, straight, "--max_train_steps", "3", *VARIANTS[name]))
    _check_rows(read_metrics(straight / "metrics.jsonl"), name)
    assert_resume_matches(straight, tmp_path / "resumed", 2,
                          grpo_args(tiny_flux_dir, data, tmp_path / "resumed", "--max_train_steps", "3",
                                    *VARIANTS[name]))


# slow (~30 s): what makes the objectives' toy-world controls below cheap (benchmarks/objectives.py's CONTROL)
@pytest.mark.slow(cover="test_grpo_objectives.py::test_training_order_is_world_size_invariant", cost_s=25)
def test_a_run_at_reward_weight_0_with_drop_trains_nothing_and_samples_as_lr_0(tiny_flux_dir, data, tmp_path):
    """An lr-0 control at the cost of its rollouts: at reward weight 0 every advantage is 0 and --drop_zero_advantage
    trains no sample (no forward, no optimizer step), and its rollouts are the lr-0 run's, reward for reward."""
    rows = {}
    for name, extra in (("lr0", ()), ("nothing", ("--reward", "jpeg_compressibility:0.0", "--drop_zero_advantage"))):
        out = tmp_path / name
        run_torchrun(grpo_args(tiny_flux_dir, data, out, "--max_train_steps", "3", "--learning_rate", "0", *extra))
        rows[name] = [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r]
    rewards = {name: [r["reward_jpeg_compressibility"] for r in rows[name]] for name in rows}
    assert len(rewards["lr0"]) == 3 and rewards["nothing"] == rewards["lr0"]
    assert len(set(rewards["lr0"])) == 3  # the steps sample different prompts and noise
    assert all(r["kept_frac"] == 0 and r["reward_mean"] == 0 and r["grad_norm"] == 0 for r in rows["nothing"])
    assert all(r["grad_norm"] > 0 for r in rows["lr0"])  # at lr 0 the other run does compute its gradients


@pytest.mark.parametrize("flags,match", [
    (("--policy_loss", "guard", "--sde_type", "cps"), "cps's log_prob drops the 1/"),
    (("--policy_loss", "dppo", "--sde_type", "cps", "--sde_window_size", "2", "--sde_window_range", "2", "4",
      "--sampling_steps", "4"), "divergence is undefined"),
    (("--policy_loss", "dppo", "--dppo_threshold", "0"), "--dppo_threshold must be > 0"),
    (("--timestep_selection", "first", "--timestep_fraction", "1.0", "--last_step", "ode"), "fraction below 1"),
    (("--timestep_selection", "first", "--timestep_fraction", "1.0", "--sde_type", "cps"), "cps has no noise"),
    (("--sde_window_schedule", "sliding"), "--sde_window_size"),
])
def test_bad_objective_flags_are_refused_with_the_fix(tmp_path, flags, match):
    """What a policy loss or switch cannot do is refused before anything loads, naming the reason and the fix."""
    from helpers import validate_flags

    from fastvideo import objectives as O

    with pytest.raises(ValueError, match=match):
        validate_flags(tmp_path, O.parse_grpo_args, O.validate_grpo, *flags)
    counts = validate_flags(tmp_path, O.parse_grpo_args, O.validate_grpo, "--timestep_selection", "first",
                            "--timestep_fraction", "0.5", "--sampling_steps", "8")
    assert counts["trained_timesteps"] == 4  # Flow-GRPO's int(S x f) of all S steps


def _order(adv_all, rank: int, world: int, *, drop: bool, shuffle: bool, tbs: int = 2, steps: int = 2):
    """``training.training_order`` for one rank of ``world`` (the run's pieces it reads, as a namespace)."""
    from types import SimpleNamespace

    from fastvideo.seeding import NoiseSource
    from fastvideo.training import training_order

    n = len(adv_all) // world
    accum = n // tbs // steps
    run = SimpleNamespace(args=SimpleNamespace(train_batch_size=tbs, drop_zero_advantage=drop,
                                               shuffle_micro_batches=shuffle),
                          counts={"gradient_accumulation_steps": accum, "optimizer_steps_per_rollout": steps},
                          dist=SimpleNamespace(dp_rank=rank, dp_size=world), noise=NoiseSource(5))
    return training_order(run, n, adv_all, step=3)


@pytest.mark.parametrize("drop,shuffle", [(True, False), (False, True), (True, True)])
def test_training_order_is_world_size_invariant(drop, shuffle):
    """The samples of each optimizer step and their loss weights (divided by the world size: FSDP averages the ranks'
    gradients) are the same on 1, 2 and 4 ranks; every rank of a world runs the same number of forwards; a rank trains
    only its own samples; without the switches the order is today's (group order, no weights)."""
    import torch

    adv = torch.tensor([0.0, 1.0, -1.0, 0.0, 2.0, 0.0, -0.5, 0.5, 0.0, 1.5, -2.0, 0.0, 0.3, 0.0, 0.0, -0.3])
    per_world = {}
    for world in (1, 2, 4):
        n = len(adv) // world
        seen: list[dict[int, float]] = []
        for rank in range(world):
            steps, kept = _order(adv, rank, world, drop=drop, shuffle=shuffle)
            assert kept == (float((adv != 0).float().mean()) if drop else 1.0)
            for c, micro in enumerate(steps):
                while len(seen) <= c:
                    seen.append({})
                for idx, w in micro:
                    assert ((idx >= 0) & (idx < n)).all()  # local indices of this rank's own samples
                    for i, wi in zip((idx + rank * n).tolist(), w.tolist()):
                        if wi > 0:
                            seen[c][i] = seen[c].get(i, 0.0) + wi / world
        for c in range(2):  # FSDP: every rank runs the same number of forwards in each optimizer step
            assert len({sum(len(i) for i, _ in _order(adv, r, world, drop=drop, shuffle=shuffle)[0][c])
                        for r in range(world)}) == 1
        per_world[world] = seen
        if drop:
            assert all(adv[i] != 0 for step in seen for i in step)
    for world in (2, 4):
        assert [sorted(s) for s in per_world[world]] == [sorted(s) for s in per_world[1]]
        for a, b in zip(per_world[world], per_world[1]):
            assert all(abs(a[i] - b[i]) < 1e-6 for i in a)
    assert all(abs(sum(s.values()) - 1.0) < 1e-6 for s in per_world[1])  # each step: the mean over its samples
    default, kept = _order(adv, 1, 2, drop=False, shuffle=False)
    assert kept == 1.0 and [[i.tolist() for i, w in m if w is None] for m in default] == [[[0, 1], [2, 3]],
                                                                                            [[4, 5], [6, 7]]]
    none, kept = _order(torch.zeros(16), 0, 2, drop=True, shuffle=shuffle)
    assert kept == 0.0 and none == [[], []]  # nothing to train: no forward, no optimizer step on any rank


@pytest.fixture(scope="session")  # once per session: the slow or evidence tier reads it too
def objective_runs(toy_world, tmp_path_factory):
    """benchmarks/objectives.py's toy-world runs for seed 0 (2 ranks, through the demo launchers, on the session's
    toy world): a function ``runs(name, steps) -> (trained rows, control rows)``; each run is made once and reused
    (clip, guard and dppo share one control folder: give them the same ``steps``)."""
    import sys

    from helpers import REPO, toy_data_dir

    sys.path.insert(0, str(REPO / "benchmarks"))
    import objectives

    root = tmp_path_factory.mktemp("objectives")
    data = toy_data_dir(toy_world, root)

    def runs(name: str, steps: int):
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # as the benchmark that chose the margins ran (thread count: rounding)
        try:
            return tuple(objectives.rows(objectives.run(root / "out", "toyworld", name, 0, steps, data,
                                                        control=c)) for c in (False, True))
        finally:
            os.environ.pop("OMP_NUM_THREADS") if saved is None else os.environ.__setitem__("OMP_NUM_THREADS", saved)
    return runs


# (steps, margin) per objective. Gain = the mean over the last GAIN_STEPS steps of the per-step difference in toy-world
# reward (training prompts) between the run and its lr-0 control (the same prompts and noise), measured on the current
# base model with `OMP_NUM_THREADS=1 python benchmarks/objectives.py --world toyworld --objectives guard dppo sliding
# awm` (2 ranks; seed 0 as this test's own longer runs, seeds 1 and 2 with --steps 50; a run's first steps are those of
# a longer one: constant lr, nothing depends on --max_train_steps). Steps 11-40, seeds 0 / 1 / 2: guard +0.0215 /
# +0.0173 / +0.0160, dppo +0.0195 / +0.0157 / +0.0158, sliding +0.0163 / +0.0154 / +0.0187, awm +0.0178 / +0.0221 /
# +0.0249 (steps 21-50: +0.015 to +0.036, no more robust); GRPO's window on the first 2 of 8 steps, two optimizer steps
# per rollout. Each margin is half the smallest gain over the seeds; a loss with the wrong sign or no gradient gives
# about 0 (the control's own rollouts). 40 steps each keeps the slow tier inside CI's time (the previous base model
# needed 60-100 steps for every seed to gain 0.01: 80 / 80 / 100 / 60).
LEARN: dict[str, tuple[int, float]] = {"guard": (40, 0.0080), "dppo": (40, 0.0078), "sliding": (40, 0.0077),
                                       "awm": (40, 0.0089)}
GAIN_STEPS = 30


@pytest.mark.evidence(cover="test_algorithms_study.py::test_smoke_runs_grpo_and_awm", cost_s=110)
@pytest.mark.parametrize("name", ["guard", "dppo", "sliding", "awm"])
def test_objective_learns(objective_runs, name):
    """Each new objective raises the toy world's training reward (prompt following of the pretrained toy FLUX) above
    its lr-0 control (seed 0) by the margin chosen over 3 seeds; each stays on-policy at its first update (the GRPO
    variants' first-update ratio, AWM's ratio)."""
    import objectives  # benchmarks/, put on sys.path by the fixture

    steps, margin = LEARN[name]
    trained, control = objective_runs(name, steps)
    assert [r["step"] for r in trained] == [r["step"] for r in control] == list(range(1, steps + 1))
    key = objectives.GAIN_KEY["toyworld"]  # the GRPO controls log the reward at weight 0 (objectives.CONTROL)
    assert all(t[key] == t["reward_mean"] for t in trained)
    if name != "awm":  # the controls train the least (objectives.CONTROL): GRPO's nothing, AWM's one sigma
        assert all(c["kept_frac"] == 0 and c["reward_mean"] == 0 for c in control)
    else:
        assert all(c["trained_timesteps"] == 1 for c in control) and trained[0]["trained_timesteps"] == 4
    gain = sum(t[key] - c[key] for t, c in zip(trained[-GAIN_STEPS:], control[-GAIN_STEPS:]))
    gain /= GAIN_STEPS
    print(f"{name}: training reward {gain:+.4f} vs lr 0 over steps {steps - GAIN_STEPS + 1}-{steps} (margin {margin})")
    assert gain > margin, f"{name}: training reward {gain:+.4f} vs its lr-0 control (must be > {margin})"
    if name == "awm":  # on-policy, one optimizer step per rollout: every ratio is against theta itself
        assert max(abs(r["ratio_mean"] - 1) for r in trained) < 1e-5
    else:
        assert max(r["ratio_first_update_max_dev"] for r in trained) < 1e-5


def test_checkpoints_from_before_the_new_flags_still_resume():
    """The run-defining flags added with the new objectives keep an older checkpoint's fingerprint where they do not
    act (their earlier value, or a setting they do not change: --kl_form on flow_sde); a run that uses one differs,
    and the refusal names the flag."""
    from fastvideo import resume

    old = {"algorithm": "grpo", "seed": 3, "sde_type": "flow_sde", "kl_beta": 0.04, "global_std": False}
    new = {**old, "sde_window_schedule": "random", "sde_window_shift_interval": 25, "sde_window_stride": 1,
           "group_std": "unbiased", "timestep_selection": "random", "policy_loss": "clip", "dppo_threshold": 1e-5,
           "kl_form": "reference", "drop_zero_advantage": False, "shuffle_micro_batches": False}
    assert resume.run_identity(new)["config_fingerprint"] == resume.run_identity(old)["config_fingerprint"]
    resume.check_resume_config(new, old)  # nothing differs
    for key, value in (("policy_loss", "guard"), ("sde_window_schedule", "sliding"), ("drop_zero_advantage", True)):
        changed = {**new, key: value}
        assert resume.run_identity(changed)["config_fingerprint"] != resume.run_identity(old)["config_fingerprint"]
        with pytest.raises(ValueError, match=f"--{key}: checkpoint"):
            resume.check_resume_config(changed, old)
    cps = {**old, "sde_type": "cps"}  # --kl_form acts on cps with a KL: the old form was per_unit_time
    with pytest.raises(ValueError, match="--kl_form: checkpoint 'per_unit_time' vs now 'reference'"):
        resume.check_resume_config({**cps, "kl_form": "reference"}, cps)
