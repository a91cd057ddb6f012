"""``python -m fastvideo.compare OUT_A OUT_B`` on two trainers' --output_dir folders: the per-step metrics table, the
first step beyond tolerance, one-sided steps and metrics, and the inputs it refuses (exit 2)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from fastvideo import compare
from fastvideo.logging import MetricsLogger

STEPS = (1, 2, 3, 4)


def grpo_rows(reward: dict[int, float] | None = None, drop: tuple[str, ...] = (), extra: dict | None = None,
              steps: tuple[int, ...] = STEPS) -> dict[int, dict]:
    """A GRPO run's metrics as the trainer hands them to the logger: a step-0 evaluation, then per step the rollout's
    reward, the update's loss (~0 by construction), grad norm and ratio, timings and memory; the last step also
    evaluates. ``reward`` overrides reward_mean at some steps; ``drop`` leaves keys out; ``extra`` adds keys."""
    rows = {0: {"eval/reward_mean": 0.42, "eval/reward_std": 0.2, "eval/reward_jpeg_compressibility": 0.42,
                "time_eval": 1.5}}
    for step in steps:
        rows[step] = {"reward_mean": torch.tensor(0.5 + 0.01 * step), "reward_std": 0.2, "adv_abs_mean": 0.8,
                      "reward_jpeg_compressibility": 0.5 + 0.01 * step, "loss": (-1) ** step * 2e-9 * step,
                      "kl": 0.0, "clipfrac": 0.0, "ratio_mean": torch.tensor(1.0), "grad_norm": 0.02 + 0.001 * step,
                      "trained_timesteps": 3, "time_step": 0.3 * step, "samples_per_s": 12.0, "mfu": 0.01,
                      "lr": 1e-3, "skipped_updates": 0, "peak_memory_gb": 0.9, "time_elapsed": 0.3 * step}
        rows[step].update((extra or {}).get(step, {}))
    rows[steps[-1]].update({"eval/reward_mean": 0.46, "eval/reward_std": 0.2, "eval/reward_jpeg_compressibility": 0.46,
                            "time_eval": 1.4})
    for step, value in (reward or {}).items():
        rows[step]["reward_mean"] = value
    return {s: {k: v for k, v in row.items() if k not in drop} for s, row in rows.items()}


def write_run(root: Path, rows: dict[int, dict], algorithm: str = "grpo", **flags) -> Path:
    """A trainer's --output_dir: metrics.jsonl written by the trainers' own logger, and config.json's flags."""
    logger = MetricsLogger(root, enabled=True)
    for step, metrics in rows.items():
        logger.log(step, metrics)
    logger.close()
    (root / "config.json").write_text(json.dumps({"algorithm": algorithm, "seed": 3, "record_dir": None, **flags}))
    return root


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = compare.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def line_of(out: str, step: int) -> list[str]:
    """The table row of ``step``, split into cells."""
    return next(line.split() for line in out.splitlines() if re.match(rf"\s*{step}\s", line))


def test_identical_runs_agree_and_print_the_default_metrics(tmp_path, capsys):
    a, b = write_run(tmp_path / "a", grpo_rows()), write_run(tmp_path / "b", grpo_rows())
    code, out, err = run(capsys, a, b)
    assert code == 0, err
    assert "A: a (grpo): 5 steps (0..4)" in out and "B: b (grpo): 5 steps (0..4)" in out
    assert "compared: 5 steps (0..4) both runs logged\n" in out
    header = out.splitlines()[3].split()
    assert header == ["reward_mean", "eval/reward_mean", "loss", "grad_norm", "ratio_mean"]  # no timings, no extras
    # step 0 evaluated only: its eval reward is compared, every other cell is '-'
    assert line_of(out, 0) == ["0", "-", "-", "-", "0.42", "0.42", "0"] + ["-"] * 9 + ["ok"]
    assert line_of(out, 3) == ["3", "0.53", "0.53", "0", "-", "-", "-", "-6e-09", "-6e-09", "0", "0.023", "0.023", "0",
                               "1", "1", "0", "ok"]
    assert line_of(out, 4)[4:7] == ["0.46", "0.46", "0"]
    assert "agree: 5 steps within tolerance (every compared value identical)" in out
    assert "metrics only" not in out and not (b / "compare.png").exists()  # no plot unless asked for


def test_a_reward_departing_at_step_3_is_named(tmp_path, capsys):
    a = write_run(tmp_path / "a", grpo_rows())
    # 1% off at step 2 (within --reward_rtol 0.05), 20% off at step 3, back on track at step 4
    b = write_run(tmp_path / "b", grpo_rows(reward={2: 0.52 * 1.01, 3: 0.53 * 1.2}))
    code, out, _ = run(capsys, a, b)
    assert code == 1
    assert line_of(out, 2)[1:4] == ["0.52", "0.5252", "0.0099"] and line_of(out, 2)[-1] == "ok"
    assert line_of(out, 3)[1:4] == ["0.53", "0.636", "0.167"] and line_of(out, 3)[-1] == "reward_mean"
    assert line_of(out, 4)[-1] == "ok"
    assert ("DIVERGED at step 3: reward_mean relative difference 0.167 > --reward_rtol 0.05 (A 0.53, B 0.636)"
            in out)
    # a looser tolerance accepts it, and says what the largest difference was
    code, out, _ = run(capsys, a, b, "--reward_rtol", "0.2")
    assert code == 0 and "largest relative difference 0.167: reward_mean at step 3" in out


def test_loss_and_grad_norm_tolerances_and_floors(tmp_path, capsys):
    a = write_run(tmp_path / "a", grpo_rows())
    # GRPO's loss is ~0: a sign flip of 2e-9 is nothing next to the advantages' size (adv_abs_mean 0.8)
    b = write_run(tmp_path / "b", grpo_rows(extra={1: {"loss": 2e-9}, 2: {"grad_norm": 0.022 * 1.1}}))
    code, out, _ = run(capsys, a, b)
    assert code == 1
    assert line_of(out, 1)[7:10] == ["-2e-09", "2e-09", "5e-09"]  # 4e-9 / floor 0.8
    assert line_of(out, 2)[10:13] == ["0.022", "0.0242", "0.0909"]
    assert "DIVERGED at step 2: grad_norm relative difference 0.0909 > --grad_norm_rtol 0.05" in out
    code, out, _ = run(capsys, a, b, "--grad_norm_rtol", "0.1")
    assert code == 0 and "largest relative difference 0.0909: grad_norm at step 2" in out
    # DPO: no advantages; its loss's floor is its own median magnitude
    dpo = {s: {"reward_mean": 0.1, "loss": 0.69 + 0.01 * s, "grad_norm": 20.0, "implicit_acc": 0.5} for s in STEPS}
    dpo_b = {s: {**row, "loss": row["loss"] * (1.1 if s == 4 else 1.0)} for s, row in dpo.items()}
    a, b = write_run(tmp_path / "dpo_a", dpo, "dpo"), write_run(tmp_path / "dpo_b", dpo_b, "dpo")
    code, out, _ = run(capsys, a, b, "--metrics", "loss", "implicit_acc")
    assert code == 1 and out.splitlines()[3].split() == ["loss", "implicit_acc"]
    assert "DIVERGED at step 4: loss relative difference 0.0909 > --loss_rtol 0.05 (A 0.73, B 0.803)" in out


def test_one_sided_steps_and_metrics_are_reported(tmp_path, capsys):
    a = write_run(tmp_path / "a", grpo_rows())
    b = write_run(tmp_path / "b", grpo_rows(drop=("ratio_mean",), extra={s: {"old_decay": 0.5} for s in range(7)},
                                            steps=(1, 2, 3, 4, 5, 6)), "nft")
    code, out, _ = run(capsys, a, b)
    assert code == 0
    assert "A: a (grpo): 5 steps (0..4)" in out and "B: b (nft): 7 steps (0..6)" in out
    assert "compared: 5 steps (0..4) both runs logged (steps only B logged: 5, 6)" in out
    assert "metrics only A logs (not compared): ratio_mean\n" in out
    assert "metrics only B logs (not compared): old_decay\n" in out
    assert out.splitlines()[5].split() == ["reward_mean", "eval/reward_mean", "loss", "grad_norm"]
    # step 4 evaluates in A only (B's last step is 6): the eval reward is not compared there
    assert line_of(out, 4)[4:7] == ["0.46", "-", "-"]
    # asking for a metric one run lacks names the run and what both log
    code, _, err = run(capsys, a, b, "--metrics", "reward_mean", "ratio_mean")
    assert code == 2 and f"--metrics ratio_mean: not logged by {b} (B)" in err and "eval/reward_mean" in err
    # all: every shared metric but timings and memory, the defaults first
    code, out, _ = run(capsys, a, b, "--metrics", "all")
    header = out.splitlines()[5].split()
    assert header[:4] == ["reward_mean", "eval/reward_mean", "loss", "grad_norm"] and "kl" in header
    assert "lr" in header and not any(k.startswith(compare.MACHINE_KEYS) for k in header)


def test_unusable_inputs_exit_2_naming_what_to_pass(tmp_path, capsys):
    a = write_run(tmp_path / "a", grpo_rows(), record_dir=str(tmp_path / "rec"))
    rec = tmp_path / "rec"
    rec.mkdir()
    (rec / "manifest.json").write_text(json.dumps({"format": 1}))
    (rec / "steps.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
    code, out, err = run(capsys, a, rec)
    assert code == 2 and out == ""
    assert (f"A {a} is a training run folder (metrics.jsonl, a trainer's --output_dir); B {rec} is a recording "
            "(manifest.json, a --record_dir folder): pass two run folders (--output_dir), two recordings "
            f"(--record_dir) or two score files, not one of each ({a} recorded to --record_dir {rec})") in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run(capsys, a, empty)
    assert code == 2 and f"{empty} holds neither metrics.jsonl (a trainer's --output_dir) nor manifest.json" in err
    scores = tmp_path / "scores.jsonl"
    scores.write_text(json.dumps({"image": "x.png", "total": 1.0}) + "\n")
    code, _, err = run(capsys, scores, a)
    assert code == 2 and "is a score file" in err and "not one of each" in err
    code, _, err = run(capsys, a, write_run(tmp_path / "late", {7: {"reward_mean": 0.5}}))
    assert code == 2 and "have no logged step in common (A: 5 steps (0..4), B: 1 step (7))" in err
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "metrics.jsonl").write_text('{"step": 1, "rew')  # a run killed while writing its first line
    code, _, err = run(capsys, a, tmp_path / "torn")
    assert code == 2 and "holds no step" in err


def test_plot_and_json_of_two_runs(tmp_path, capsys):
    a = write_run(tmp_path / "a", grpo_rows())
    b = write_run(tmp_path / "b", grpo_rows(reward={3: 0.53 * 1.2}))
    code, out, _ = run(capsys, a, b, "--plot", tmp_path / "c.png", "--json", tmp_path / "c.json")
    assert code == 1 and f"plot: {tmp_path / 'c.png'}" in out and (tmp_path / "c.png").stat().st_size > 0
    rows = json.loads((tmp_path / "c.json").read_text())
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and rows[3]["over"] == ["reward_mean"]
    assert rows[3]["metrics"]["reward_mean"]["rel"] == pytest.approx(0.2 / 1.2)
    assert rows[0]["metrics"]["loss"] == {"a": None, "b": None, "rel": None}
