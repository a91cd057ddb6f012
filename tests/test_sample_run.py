"""sample.py --run_dir OUT and python -m fastvideo.rewards.score --run_dir OUT: a real one-step run (full fine-tune
and LoRA) sampled with the run's settings gives the bytes the explicit flags give; flags given win; --base samples the
base model; bad inputs fail before anything loads."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, load_script

H = W = 64
STEPS = 3


def _train(model: Path, data: Path, out: Path, *flags: str) -> subprocess.Popen:
    """Start one GRPO step of the tiny model on one process (no torchrun: the world-size-1 case), with held-out
    evaluation, a static shift and a non-default guidance, so that every setting sample.py takes is visible."""
    cmd = [sys.executable, "train_grpo_flux.py", "--pretrained_model_name_or_path", str(model), "--data_json_path",
           str(data), "--output_dir", str(out), "--device", "cpu", "--h", str(H), "--w", str(W), "--sampling_steps",
           str(STEPS), "--shift", "2", "--guidance_scale", "2.5", "--num_generations", "2", "--prompts_per_step", "1",
           "--rollout_batch_size", "2", "--train_batch_size", "2", "--timestep_fraction", "0.5", "--reward",
           "jpeg_compressibility:1.0", "--learning_rate", "1e-2", "--max_train_steps", "1", "--sample_every", "0",
           "--seed", "3", "--no-progress_bar", *flags]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def heldout(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("heldout") / "heldout.txt"
    path.write_text("".join(line + "\n" for line in (REPO / "assets" / "prompts.txt").read_text().splitlines()[20:23]))
    return path


@pytest.fixture(scope="module")
def runs(tiny_flux_dir, tiny_data, heldout, tmp_path_factory) -> dict[str, Path]:
    """Two finished runs, trained side by side: "full", a full fine-tune whose --eval_prompts is a prompt file
    (sample.py encodes it with the run's text length), and "lora", a LoRA run whose --eval_prompts is a manifest,
    evaluated on its first 2 prompts, 2 images each, and also with --eval_reward toyworld_clean."""
    root = tmp_path_factory.mktemp("runs")
    jobs = {"full": _train(tiny_flux_dir, tiny_data, root / "full", "--eval_prompts", str(heldout)),
            "lora": _train(tiny_flux_dir, tiny_data, root / "lora", "--lora_rank", "4", "--eval_prompts",
                           str(tiny_data), "--eval_max_prompts", "2", "--eval_num_images", "2", "--eval_reward",
                           "toyworld_clean:1.0")}
    for name, proc in jobs.items():
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name} run failed:\n{output[-4000:]}"
    return {name: root / name for name in jobs}


@pytest.fixture(scope="module")
def full_run(runs) -> Path:
    return runs["full"]


@pytest.fixture(scope="module")
def lora_run(runs) -> Path:
    return runs["lora"]


@pytest.fixture(scope="module")
def full_sampled(full_run) -> Path:
    """`sample.py --run_dir OUT` with the flags in sys.argv, as a launcher passes them (in this process: the models
    load in a second, a subprocess takes ten): OUT/sampled/final."""
    from unittest import mock

    argv = ["sample.py", "--run_dir", str(full_run)]
    # torchrun's own parser passes --run_dir on to the script (it refuses --run: ambiguous with its --run_path)
    from torch.distributed.run import get_args_parser

    assert get_args_parser().parse_args(["--nproc_per_node", "2", *argv]).training_script_args == argv[1:]
    with mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(io.StringIO()) as stdout:
        _sample_module().main()
    assert f"--run_dir {full_run}: full fine-tune {full_run / 'final'}" in stdout.getvalue()
    assert "64x64, 3 steps, shift 2, guidance 2.5" in stdout.getvalue()
    return full_run / "sampled" / "final"


def _sample_module():
    return load_script(REPO / "sample.py", "sample_script")


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "index.jsonl").read_text().splitlines()]


def _assert_same_images(a: Path, b: Path, count: int) -> None:
    rows = _rows(a)
    assert len(rows) == count and rows == _rows(b)  # prompts, seeds, paths and reward scores
    for r in rows:
        assert (a / r["path"]).read_bytes() == (b / r["path"]).read_bytes(), r["path"]


def test_run_full_finetune_equals_the_explicit_flags(full_sampled, full_run, tiny_flux_dir, heldout, tmp_path):
    explicit = tmp_path / "explicit"
    _sample_module().main(["--pretrained_model_name_or_path", str(tiny_flux_dir), "--transformer_path",
                           str(full_run / "final"), "--prompts", str(heldout), "--h", "64", "--w", "64",
                           "--num_inference_steps", "3", "--shift", "2", "--guidance_scale", "2.5",
                           "--max_sequence_length", "32", "--device", "cpu", "--reward", "jpeg_compressibility:1.0",
                           "--output_dir", str(explicit)])
    _assert_same_images(full_sampled, explicit, 3)
    config = json.loads((full_sampled / "config.json").read_text())
    assert config["transformer_path"] == str(full_run / "final") and config["lora_path"] is None
    assert config["seed"] == 42  # sample.py's own seed, not the run's (3)


def test_run_lora_equals_the_explicit_flags_and_given_flags_win(lora_run, tiny_flux_dir, tiny_data, tmp_path,
                                                                capsys):
    sample = _sample_module()
    via_run = tmp_path / "via-run"
    sample.main(["--run_dir", str(lora_run), "--seed=7", "--h", "32", "--w", "32", "--output_dir", str(via_run)])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("--run_dir"))
    assert line.startswith(f"--run_dir {lora_run}: LoRA {lora_run / 'final'}") and "32x32" in line, line
    assert "(first 2, 2 images each)" in line and line.endswith(f"given here: --h, --w -> {via_run}"), line
    assert "reward jpeg_compressibility:1.0, eval reward toyworld_clean:1.0, device" in line, line
    explicit = tmp_path / "explicit"
    sample.main(["--pretrained_model_name_or_path", str(tiny_flux_dir), "--lora_path", str(lora_run / "final"),
                 "--prompts", str(tiny_data), "--max_prompts", "2", "--num_images_per_prompt", "2", "--h", "32", "--w",
                 "32", "--num_inference_steps", "3", "--shift", "2", "--guidance_scale", "2.5", "--seed", "7",
                 "--device", "cpu", "--reward", "jpeg_compressibility:1.0", "--eval_reward", "toyworld_clean:1.0",
                 "--output_dir", str(explicit)])
    _assert_same_images(via_run, explicit, 4)
    # --eval_reward: its reward and checks are columns of their own, outside --reward's total, and summarised
    clean = ["toyworld_clean", "toyworld_clean_background", "toyworld_clean_stray", "toyworld_clean_purity"]
    for row in _rows(explicit):
        assert list(row)[5:] == ["total", "jpeg_compressibility", *clean], list(row)
        assert row["total"] == row["jpeg_compressibility"] and all(0.0 <= row[k] <= 1.0 for k in clean), row
    summary = json.loads((explicit / "summary.json").read_text())["rewards"]
    assert list(summary) == ["total", "jpeg_compressibility", *clean]
    assert "toyworld_clean" in capsys.readouterr().out  # the printed summary


def test_eval_reward_is_logged_beside_the_training_reward(lora_run):
    """The LoRA run's --eval_reward toyworld_clean: eval/toyworld_clean and eval/toyworld_clean_<check> in [0, 1] at
    every evaluation (step 0 and the last), beside the unchanged eval/reward_* keys; plots get a panel for it."""
    from fastvideo.logging import read_metrics
    from fastvideo.plot import available_panels

    evals = [r for r in read_metrics(lora_run / "metrics.jsonl") if "eval/reward_mean" in r]
    assert [r["step"] for r in evals] == [0, 1]
    clean = {f"eval/toyworld_clean{s}" for s in ("", "_background", "_stray", "_purity")}
    for row in evals:
        assert clean <= set(row) and all(0.0 <= row[k] <= 1.0 for k in clean), row
        assert {k for k in row if k.startswith("eval/reward")} == {
            "eval/reward_mean", "eval/reward_std", "eval/reward_ci95_low", "eval/reward_ci95_high",
            "eval/reward_jpeg_compressibility"}
    assert json.loads((lora_run / "config.json").read_text())["eval_reward"] == "toyworld_clean:1.0"
    assert available_panels([lora_run])[-1] == "eval/toyworld_clean"


def test_base_equals_the_base_model_and_compares_with_the_run(full_sampled, full_run, tiny_flux_dir, heldout,
                                                              tmp_path):
    sample = _sample_module()
    sample.main(["--run_dir", str(full_run), "--base"])
    base = full_run / "sampled" / "base"
    explicit = tmp_path / "explicit-base"
    sample.main(["--pretrained_model_name_or_path", str(tiny_flux_dir), "--prompts", str(heldout), "--h", "64", "--w",
                 "64", "--num_inference_steps", "3", "--shift", "2", "--guidance_scale", "2.5",
                 "--max_sequence_length", "32", "--device", "cpu", "--reward", "jpeg_compressibility:1.0",
                 "--output_dir", str(explicit)])
    _assert_same_images(base, explicit, 3)
    assert any((base / r["path"]).read_bytes() != (full_sampled / r["path"]).read_bytes() for r in _rows(base))
    compared = tmp_path / "compared"  # the README's second command (here into a fresh folder)
    sample.main(["--run_dir", str(full_run), "--compare", str(base), "--output_dir", str(compared)])
    assert set(json.loads((compared / "compare.json").read_text())["rewards"]) == {"total", "jpeg_compressibility"}
    assert (compared / "compare.png").is_file()


def test_score_run_scores_the_run_samples_with_the_run_reward(full_sampled, full_run, tmp_path, capsys):
    from fastvideo.rewards import score

    assert score.main(["--run_dir", str(full_run)]) == 0
    rows = [json.loads(line) for line in (full_sampled / "scores.jsonl").read_text().splitlines()]
    assert [(r["image"], r["prompt"], r["total"]) for r in rows] == \
        [(r["path"], r["prompt"], r["total"]) for r in _rows(full_sampled)]
    out = tmp_path / "other.jsonl"  # a flag given wins over the run's reward
    assert score.main(["--run_dir", str(full_run), "--reward", "jpeg_incompressibility", "--out", str(out)]) == 0
    assert [json.loads(line)["total"] for line in out.read_text().splitlines()] == \
        pytest.approx([-r["total"] for r in rows])
    unfinished = tmp_path / "unsampled"
    unfinished.mkdir()
    shutil.copy(full_run / "config.json", unfinished / "config.json")
    capsys.readouterr()
    assert score.main(["--run_dir", str(unfinished)]) == 2
    assert f"run `python sample.py --run_dir {unfinished}` first, or pass --images" in capsys.readouterr().err


def _fake_run(tmp_path: Path, source: Path, name: str, final: bool = True, **changes) -> Path:
    """A copy of ``source``'s config.json (with ``changes``) and, when ``final``, a link to its final/."""
    run = tmp_path / name
    run.mkdir()
    config = {**json.loads((source / "config.json").read_text()), **changes}
    (run / "config.json").write_text(json.dumps(config))
    if final:
        (run / "final").symlink_to(source / "final")
    return run


def test_bad_inputs_fail_before_anything_loads(full_run, heldout, tmp_path):
    from fastvideo.evaluation import validate_sample
    from fastvideo.runs import explicit_flags

    sample = _sample_module()
    sample_dir = tmp_path / "a-sampling"
    sample_dir.mkdir()
    (sample_dir / "config.json").write_text(json.dumps({"seed": 42, "num_inference_steps": 3}))
    no_final = _fake_run(tmp_path, full_run, "no-final", final=False)
    no_eval = _fake_run(tmp_path, full_run, "no-eval", eval_prompts=None)
    moved = _fake_run(tmp_path, full_run, "moved", pretrained_model_name_or_path=str(tmp_path / "gone"),
                      eval_prompts=str(tmp_path / "gone.txt"), data_json_path=str(tmp_path / "gone.json"))
    cases = [
        (["--run_dir", str(tmp_path / "nothing")], FileNotFoundError, "no config.json there; pass a training run's"),
        (["--run_dir", str(sample_dir)], ValueError, "is not a trainer's"),
        (["--run_dir", str(no_final)], FileNotFoundError, "no final export .* or pass --base"),
        (["--run_dir", str(full_run), "--lora_path", str(full_run / "final")], ValueError, "drop --lora_path"),
        (["--run_dir", str(no_eval)], ValueError, "had no --eval_prompts: pass --prompts"),
        (["--run_dir", str(moved)], FileNotFoundError, "pass --pretrained_model_name_or_path"),
        (["--run_dir", str(moved), "--pretrained_model_name_or_path", str(json.loads(
            (full_run / "config.json").read_text())["pretrained_model_name_or_path"])], FileNotFoundError,
         "its --eval_prompts .* pass --prompts"),
        (["--base", "--pretrained_model_name_or_path", "x", "--prompts", "y"], ValueError, "pass --run_dir OUT too"),
        (["--run_dir", str(full_run), "--num_inference_steps", "0", "--output_dir", str(tmp_path / "o")], ValueError,
         "--num_inference_steps must be >= 1"),
        (["--run_dir", str(full_run), "--eval_reward", "clean", "--output_dir", str(tmp_path / "o")], ValueError,
         "--eval_reward: unknown reward 'clean'.*valid names: .*toyworld_clean"),
        (["--run_dir", str(full_run), "--eval_reward", "jpeg_compressibility", "--output_dir", str(tmp_path / "o")],
         ValueError, "scored by --reward 'jpeg_compressibility:1.0' already.*drop it from --eval_reward"),
    ]
    for flags, error, message in cases:
        with pytest.raises(error, match=message):
            validate_sample(sample.parse_args(flags))
    # the text length of a moved run's embeddings is unknown: a prompt file then needs --max_sequence_length
    text_flags = ["--run_dir", str(moved), "--pretrained_model_name_or_path", str(json.loads(
        (full_run / "config.json").read_text())["pretrained_model_name_or_path"]), "--prompts", str(heldout)]
    with pytest.raises(ValueError, match="pass --max_sequence_length"):
        sample.parse_args(text_flags)
    assert sample.parse_args([*text_flags, "--max_sequence_length", "32"]).max_sequence_length == 32
    # what is allowed: --base on an unfinished run, and a given --prompts on a run without --eval_prompts
    args = sample.parse_args(["--run_dir", str(no_final), "--base"])
    assert args.output_dir == str(no_final / "sampled" / "base") and args.transformer_path is None
    validate_sample(args)
    assert sample.parse_args(["--run_dir", str(no_eval), "--prompts", str(heldout)]).prompts == str(heldout)
    # flags given in any spelling, or in a --config file, count as given; others take the run's values
    config = tmp_path / "flags.yaml"
    config.write_text("h: 32\nseed: 5\n")
    parser = sample.build_sample_parser()
    assert explicit_flags(parser, ["--run_dir", "R", "--w=32", "--num_inf", "5", "--config", str(config)],
                          [str(config)]) == {"run_dir", "w", "num_inference_steps", "h", "seed"}
    args = sample.parse_args(["--run_dir", str(full_run), "--config", str(config), "--output_dir", str(tmp_path / "c")])
    assert (args.h, args.w, args.seed, args.num_inference_steps) == (32, 64, 5, 3)


def test_geneval_bench_on_a_run_and_its_base(lora_run, tmp_path, capsys):
    """``python -m fastvideo.bench geneval --run_dir OUT [--base]``: the run's export and settings (its size, sampler
    and text length; not its reward) into OUT/geneval/final, the base model into OUT/geneval/base, and --compare
    pairs them image by image (tiny random detector: the plumbing, not the scores)."""
    from fastvideo.bench import cli
    from fastvideo.bench.tiny_detectors import build_clip_tiny, build_owlv2_tiny

    flags = ["--detector_path", str(build_owlv2_tiny(tmp_path / "owl")), "--clip_path",
             str(build_clip_tiny(tmp_path / "clip")), "--per_task", "1", "--num_images_per_prompt", "1"]
    try:
        cli.main(["geneval", "--run_dir", str(lora_run), "--base", *flags])
        cli.main(["geneval", "--run_dir", str(lora_run), *flags, "--compare", str(lora_run / "geneval" / "base")])
        base, final = lora_run / "geneval" / "base", lora_run / "geneval" / "final"
        configs = [json.loads((d / "samples" / "config.json").read_text()) for d in (base, final)]
        assert configs[0]["lora_path"] is None and configs[1]["lora_path"] == str(lora_run / "final")
        assert all(c["h"] == c["w"] == 64 and c["num_inference_steps"] == 3 and c["shift"] == 2 and
                   c["reward"] is None for c in configs)
        assert len(_rows(final / "samples")) == 6 and (final / "summary.json").is_file()
        paired = json.loads((final / "compare.json").read_text())
        assert paired["base"] == str(base) and "overall" in paired["tasks"]
        assert f"--run_dir {lora_run}: LoRA" in capsys.readouterr().out
    finally:
        shutil.rmtree(lora_run / "geneval", ignore_errors=True)  # the module's run stays as the other tests expect
