"""Flag layers (--config files under the command line) and errors a user can act on: every pair of flags the
validators refuse together is refused on one command line, and across layers the lower layer's value yields with a
note; a bad flag or input is one line and exit status 2, before anything loads."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fastvideo import config as C
from fastvideo import evaluation
from fastvideo import objectives as O

REPO = Path(__file__).resolve().parents[1]

PARSERS = {"grpo": (O.grpo_parser, O.validate_grpo), "dpo": (O.dpo_parser, O.validate_dpo),
           "nft": (O.nft_parser, O.validate_nft)}
PAIRS = "pairs.jsonl"  # a stand-in --preference_file, made in the test's folder

# (parser, flag a with its clashing value, flag b with its clashing value, the validator's message, which side may be
# the user's): every config.EXCLUSIONS pair. After the pair's flag (first), a side may hold helper flags that make it
# valid on its own (a window for a window range, the SDE sampler for --eta); they travel with it in the same layer.
# A side is left out of "yields" where the other flag's default clashes with it too (DPO's default sampler is ode,
# so a user's --eta under a recipe's --sampler ode stays an error after the recipe's value yields: the user must pass
# --sampler sde, as the message says).
CASES = [
    ("grpo", {"sde_window_size": 2}, {"timestep_fraction": 1.0}, "does nothing with --sde_window_size", "ab"),
    ("grpo", {"sde_window_size": 0}, {"sde_window_range": [0, 4]}, "does nothing without --sde_window_size", "a"),
    ("grpo", {"last_step": "ode"}, {"sde_window_range": [4, 8], "sde_window_size": 2}, "includes the last step", "ab"),
    ("grpo", {"kl_beta": 0.01}, {"sde_window_range": [4, 8], "sde_type": "cps", "sde_window_size": 2},
     "the last step has zero noise", "ab"),
    ("grpo", {"lr_scheduler": "constant"}, {"lr_warmup_steps": 5}, "does nothing with --lr_scheduler constant", "ab"),
    ("grpo", {"fsdp_version": 1}, {"gradient_sync": "step"}, "does nothing with --fsdp_version 1", "ab"),
    ("grpo", {"fsdp_version": 1}, {"sp_size": 2}, "needs --fsdp_version 2", "ab"),
    ("dpo", {"sampler": "ode"}, {"eta": 0.5}, "does nothing with --sampler ode", "a"),
    ("dpo", {"sampler": "ode"}, {"sde_window_size": 2}, "needs --sampler sde", "a"),
    ("dpo", {"sampler": "ode"}, {"init_same_noise": True}, "samples the same image for every member", "a"),
    *(("dpo", {"preference_file": PAIRS}, values, message, "ab") for values, message in (
        ({"num_generations": 4}, "would do nothing"), ({"reward": "jpeg_compressibility:1.0"}, "would do nothing"),
        ({"min_reward_gap": 0.1}, "would do nothing"), ({"sampler": "sde"}, "would do nothing"),
        ({"eta": 0.5, "sampler": "sde"}, "would do nothing"), ({"sde_type": "cps"}, "would do nothing"),
        ({"sde_window_size": 2, "sampler": "sde"}, "would do nothing"),
        ({"sde_window_range": [0, 4], "sde_window_size": 2, "sampler": "sde"}, "would do nothing"),
        ({"sde_window_schedule": "sliding", "sde_window_size": 2, "sampler": "sde"}, "would do nothing"),
        ({"sde_window_shift_interval": 5, "sde_window_schedule": "sliding", "sde_window_size": 2, "sampler": "sde"},
         "would do nothing"),
        ({"sde_window_stride": 2, "sde_window_schedule": "sliding", "sde_window_size": 2, "sampler": "sde"},
         "would do nothing"),
        ({"init_same_noise": True, "sampler": "sde"}, "would do nothing"), ({"decode_x0": True}, "would do nothing"),
        ({"last_step": "ode"}, "would do nothing"), ({"reward_overlap": True}, "would do nothing"),
        ({"replay_images": True}, "--replay_images takes the images of a recording"))),  # (checked first)
    ("sample", {"lora_path": "LORA"}, {"transformer_path": "TRANSFORMER"}, "exclude each other", "ab"),
]
BASE = {"sampling_steps": 8, "lora_rank": 4}  # a window range of 8 steps; LoRA, which --gradient_sync step needs

SLOW_FLAG = pytest.mark.slow(cover="test_flag_layers.py::test_a_bad_flag_is_one_line_and_exit_status_2", cost_s=3)


def _ids(case) -> str:
    return f"{case[0]}-{next(iter(case[1]))}-{next(iter(case[2]))}"


def _setup(tmp_path: Path, tiny_flux_dir: Path, tiny_data: Path, which: str):
    """The parser (a fresh one) and validator of ``which``, its base flags (the tiny model and data), and a function
    resolving the case's placeholder values to real paths."""
    (tmp_path / PAIRS).write_text("")
    (tmp_path / "lora").mkdir(exist_ok=True)
    (tmp_path / "lora" / "adapter.safetensors").write_bytes(b"")  # validate_sample only looks for one
    paths = {PAIRS: str(tmp_path / PAIRS), "LORA": str(tmp_path / "lora"),
             "TRANSFORMER": str(tiny_flux_dir / "transformer")}

    def real(values: dict) -> dict:
        return {k: paths.get(v, v) if isinstance(v, str) else v for k, v in values.items()}

    if which == "sample":
        from sample import build_sample_parser

        base = {"pretrained_model_name_or_path": str(tiny_flux_dir), "prompts": str(tiny_data), "h": 64, "w": 64,
                "output_dir": str(tmp_path / "samples")}
        return build_sample_parser, lambda args, world: evaluation.validate_sample(args), base, real
    parser, validate = PARSERS[which]
    base = {"pretrained_model_name_or_path": str(tiny_flux_dir), "data_json_path": str(tiny_data), "h": 64, "w": 64,
            "output_dir": str(tmp_path / "out"), **BASE}
    return parser, validate, base, real


def _tokens(parser, values: dict) -> list[str]:
    """Command-line tokens for a mapping of flag values (what a --config file of it gives)."""
    return C.config_tokens(parser, values, "test")


def test_the_cases_cover_every_exclusion():
    """Every pair the validators refuse together (config.EXCLUSIONS) has a case here, and no case is stale."""
    declared = {(ex.a, ex.b) for ex in C.EXCLUSIONS}
    tested = {(next(iter(a)), next(iter(b))) for _, a, b, _, _ in CASES}
    assert tested == declared


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_a_pair_on_one_command_line_is_refused(case, tmp_path, tiny_flux_dir, tiny_data):
    """Both flags of a pair in one layer (the command line): the validator refuses them, naming both."""
    which, a, b, message, _ = case
    parser, validate, base, real = _setup(tmp_path, tiny_flux_dir, tiny_data, which)
    args = C.parse_with_config(parser(), _tokens(parser(), {**base, **real(a), **real(b)}))
    with pytest.raises(ValueError, match=message):
        validate(args, 2)


YIELDS = [(case, side) for case in CASES for side in case[4]]


@pytest.mark.parametrize("case, user_side", YIELDS, ids=[f"{side}-{_ids(case)}" for case, side in YIELDS])
def test_a_config_value_yields_to_a_conflicting_command_line_flag(case, user_side, tmp_path, tiny_flux_dir,
                                                                  tiny_data, capsys):
    """A demo's or recipe's value (a --config file) that conflicts with a flag appended on the command line is reset
    to its default with a note naming both; the run validates (a replay of recorded images still needs its
    recording). Either side of each pair may be the user's."""
    which, a, b, _, _ = case
    parser, validate, base, real = _setup(tmp_path, tiny_flux_dir, tiny_data, which)
    mine, theirs = (a, b) if user_side == "a" else (b, a)
    demo = tmp_path / "demo.yaml"
    demo.write_text(yaml.safe_dump(real(theirs)))
    args = C.parse_with_config(parser(), ["--config", str(demo), *_tokens(parser(), {**base, **real(mine)})])
    dropped = next(iter(theirs))
    assert getattr(args, dropped) == parser().get_default(dropped)
    for key, value in real(mine).items():
        got = getattr(args, key)
        assert (list(got) if isinstance(got, tuple) else got) == value
    note = capsys.readouterr().err
    assert f"--{dropped}" in note and f"--config {demo}" in note and "dropped" in note
    if "replay_images" in mine:
        with pytest.raises(ValueError, match="pass --replay_dir"):  # the pair resolved; a replay needs a recording
            validate(args, 2)
    else:
        validate(args, 2)


def test_a_conflict_within_one_config_file_is_left_to_the_validator(tmp_path, tiny_flux_dir, tiny_data):
    """One layer holding both flags of a pair is the file's own mistake: nothing is dropped, the validator refuses."""
    parser, validate, base, _ = _setup(tmp_path, tiny_flux_dir, tiny_data, "grpo")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"sde_window_size": 2, "timestep_fraction": 1.0}))
    args = C.parse_with_config(parser(), ["--config", str(bad), *_tokens(parser(), base)])
    assert args.timestep_fraction == 1.0
    with pytest.raises(ValueError, match="drop one of them"):
        validate(args, 1)


def test_a_value_reset_by_a_drop_makes_its_partner_yield(tmp_path, tiny_flux_dir, tiny_data, capsys):
    """The GRPO toy-world demo's window (--sde_window_size 2 --sde_window_range 0 2) under the user's
    --timestep_fraction: the size yields, and the range, which needs a size, yields after it (one note each); the run
    validates instead of refusing a range the user never passed."""
    parser, validate, base, _ = _setup(tmp_path, tiny_flux_dir, tiny_data, "grpo")
    demo = tmp_path / "demo.yaml"
    demo.write_text(yaml.safe_dump({"sde_window_size": 2, "sde_window_range": [0, 2], "learning_rate": 5e-5}))
    args = C.parse_with_config(parser(), ["--config", str(demo), *_tokens(parser(), base),
                                          "--timestep_fraction", "0.5"])
    assert (args.sde_window_size, args.sde_window_range, args.timestep_fraction, args.learning_rate) == (
        0, parser().get_default("sde_window_range"), 0.5, 5e-5)
    notes = capsys.readouterr().err.strip().splitlines()
    assert notes == [f"note: --sde_window_size 2 (from --config {demo}) dropped: --timestep_fraction 0.5 (from the "
                     "command line) excludes it",
                     f"note: --sde_window_range 0 2 (from --config {demo}) dropped: --sde_window_size 0 (reset above) "
                     "excludes it"]
    validate(args, 1)


def test_later_config_files_override_earlier_ones(tmp_path, tiny_flux_dir, tiny_data):
    """--config is repeatable: a later file's value wins, the command line wins over both, and a later file's flag
    makes an earlier file's conflicting value yield."""
    parser, _, base, _ = _setup(tmp_path, tiny_flux_dir, tiny_data, "grpo")
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text(yaml.safe_dump({"learning_rate": 1e-3, "clip_range": 0.1, "timestep_fraction": 0.5}))
    second.write_text(yaml.safe_dump({"learning_rate": 2e-3, "sde_window_size": 2}))
    args = C.parse_with_config(parser(), ["--config", str(first), "--config", str(second), *_tokens(parser(), base),
                                          "--clip_range", "0.2"])
    assert (args.learning_rate, args.clip_range, args.timestep_fraction, args.sde_window_size) == (2e-3, 0.2, None, 2)
    assert args.config == [str(first), str(second)]


def _run(script: str, *flags: str, cwd: Path = REPO, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, script, *flags], cwd=cwd, env=environ, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("flags, message", [
    (["--learning_rate", "-1"], "--learning_rate must be >= 0"),
    (["--bogus_flag", "1"], "unrecognized arguments: --bogus_flag"),
    # slow (suite time, 3 s each): the same one-line path as the two above; test_flag_layers' in-process cases check
    # these messages in the default suite
    pytest.param(["--sde_window_size", "2", "--timestep_fraction", "0.5"], "drop one of them", marks=SLOW_FLAG),
    pytest.param(["--config", "no/such.yaml"], "--config no/such.yaml: no such file", marks=SLOW_FLAG),
])
def test_a_bad_flag_is_one_line_and_exit_status_2(flags, message, tmp_path, tiny_flux_dir, tiny_data):
    """A flag error is one line `PROG: error: ...` naming the fix, exit status 2, no traceback: for argparse's own
    errors, a config file's, and the validators'; --check_only (what the launchers run first) passes good flags."""
    base = ["--pretrained_model_name_or_path", str(tiny_flux_dir), "--data_json_path", str(tiny_data),
            "--output_dir", str(tmp_path / "out"), "--h", "64", "--w", "64", "--device", "cpu"]
    proc = _run(str(REPO / "train_grpo_flux.py"), *base, *flags, "--check_only", cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("train_grpo_flux.py: error: ") and message in lines[0]
    assert proc.stdout == ""
    good = _run(str(REPO / "train_grpo_flux.py"), *base, "--check_only", cwd=tmp_path)
    assert good.returncode == 0 and good.stderr == "", good.stderr


def test_a_usage_error_under_torchrun_is_printed_once(tmp_path, tiny_flux_dir, tiny_data):
    """At 2 ranks every rank raises the same input error (here the reward spec, checked after the process group
    starts): it is printed once, as one line without the rank's traceback, and the ranks exit with status 2."""
    from helpers import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "train_grpo_flux.py", "--pretrained_model_name_or_path",
           str(tiny_flux_dir), "--data_json_path", str(tiny_data), "--output_dir", str(tmp_path / "out"), "--h", "64",
           "--w", "64", "--device", "cpu", "--reward", "no_such_reward:1.0"]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line and "no_such_reward" in line]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("train_grpo_flux.py: error: ")
    assert proc.stderr.count("Traceback") <= 1  # torchrun's own ChildFailedError, none from a rank
    assert proc.stderr.count("exitcode  : 2") == 2, proc.stderr[-2000:]  # both ranks


@pytest.mark.parametrize("script, flags, message", [
    ("sample.py", ["--prompts", "no/prompts.txt"], "--prompts no/prompts.txt"),
    ("sample.py", ["--run_dir", "no/run"], "--run_dir no/run"),
    ("preprocess_embeddings.py", ["--prompt_file", "no/prompts.txt", "--output_dir", "emb"], "--prompt_file"),
])
def test_sample_and_preprocess_report_a_bad_input_in_one_line(script, flags, message, tmp_path, tiny_flux_dir):
    """sample.py and preprocess_embeddings.py: a bad path is one line naming it, exit status 2, nothing written."""
    model = "--model_path" if script.startswith("preprocess") else "--pretrained_model_name_or_path"
    proc = _run(str(REPO / script), model, str(tiny_flux_dir), *flags, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{script}: error: ") and message in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_check_only_refuses_an_unknown_reward_before_torchrun(tmp_path, tiny_flux_dir, tiny_data):
    """The launchers' check catches a bad --reward spec too, so a launch with it never starts torchrun."""
    proc = _run(str(REPO / "train_grpo_flux.py"), "--pretrained_model_name_or_path", str(tiny_flux_dir),
                "--data_json_path", str(tiny_data), "--output_dir", str(tmp_path / "out"), "--h", "64", "--w", "64",
                "--device", "cpu", "--reward", "no_such_reward:1.0", "--check_only", cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "no_such_reward" in lines[0], proc.stderr
