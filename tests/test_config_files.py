"""--config FILE (YAML or JSON, keys are flag names, the command line overrides) and config.json round trips."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastvideo import config as C
from fastvideo import objectives as O
from fastvideo.resume import run_config


def _stub(tmp_path: Path) -> list[str]:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "model_index.json").write_text("{}")
    data = tmp_path / "manifest.json"
    data.write_text("{}")
    return ["--pretrained_model_name_or_path", str(model), "--data_json_path", str(data)]


def _round_trip(tmp_path: Path, parse, validate, flags: list[str], world: int = 2) -> None:
    """validate(parse(flags)) -> config.json -> validate(parse(--config config.json)) gives the same config."""
    args = parse([*_stub(tmp_path), *flags])
    config = run_config(args, validate(args, world))
    path = tmp_path / "config.json"
    C.save_config(config, path)
    again = parse(["--config", str(path)])
    config2 = run_config(again, validate(again, world))
    assert again.config == [str(path)]
    assert json.loads(json.dumps({**config2, "config": None}, default=str)) == \
        json.loads(json.dumps({**config, "config": None}, default=str))


@pytest.mark.parametrize("flags", [
    [],
    ["--sde_window_size", "2", "--sde_window_range", "0", "6", "--sampling_steps", "8", "--kl_beta", "0.04",
     "--lora_rank", "4", "--lora_target_modules", "to_q", "to_v", "--no-progress_bar", "--log_to", "jsonl",
     "tensorboard"],
    ["--sde_type", "dance_sde", "--shift", "3", "--timestep_fraction", "0.5", "--init_same_noise"],
])
def test_grpo_config_json_round_trip(tmp_path, flags):
    _round_trip(tmp_path, O.parse_grpo_args, O.validate_grpo, flags)


def test_dpo_and_nft_config_json_round_trip(tmp_path):
    _round_trip(tmp_path, O.parse_dpo_args, O.validate_dpo, [])  # online, ODE sampler: eta resolved to 0
    _round_trip(tmp_path, O.parse_dpo_args, O.validate_dpo, ["--sampler", "sde", "--eta", "0.5"])
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("")
    _round_trip(tmp_path, O.parse_dpo_args, O.validate_dpo, ["--preference_file", str(pairs)])  # offline
    _round_trip(tmp_path, O.parse_nft_args, O.validate_nft, ["--solver", "dpm2", "--num_generations", "4"])


def test_yaml_values_and_command_line_override(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("# a recipe\nlearning_rate: 1e-5   # YAML reads this as a string; argparse converts it\n"
                    "sampling_steps: 8\nsde_window_range: [1, 5]\nsde_window_size: 2\nuse_ema: true\n"
                    "progress_bar: false\nlora_target_modules: [to_q, to_k]\nshift: null\n"
                    "reward: 'jpeg_compressibility:1'\n")
    args = O.parse_grpo_args(["--config", str(path), "--sampling_steps", "10"])
    assert args.learning_rate == 1e-5 and isinstance(args.learning_rate, float)
    assert args.sampling_steps == 10  # the command line wins
    assert args.sde_window_range == [1, 5] and args.sde_window_size == 2
    assert args.use_ema is True and args.progress_bar is False
    assert args.lora_target_modules == ["to_q", "to_k"] and args.shift is None
    assert args.reward == "jpeg_compressibility:1"
    late = O.parse_grpo_args(["--sampling_steps", "12", "--config", str(path)])  # position of --config is irrelevant
    assert late.sampling_steps == 12
    (tmp_path / "c.json").write_text(json.dumps({"clip_range": 0.0002, "log_to": ["jsonl", "wandb"]}))
    args = O.parse_grpo_args(["--config", str(tmp_path / "c.json")])
    assert args.clip_range == 2e-4 and args.log_to == ["jsonl", "wandb"]


def test_config_errors_name_the_fix(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="no such file"):
        O.parse_grpo_args(["--config", str(tmp_path / "missing.yaml")])
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rat: 1e-5\nclip_range: 1e-4\n")
    with pytest.raises(ValueError, match=r"learning_rat \(did you mean learning_rate"):
        O.parse_grpo_args(["--config", str(bad)])
    bad.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="mapping of flag name"):
        O.parse_grpo_args(["--config", str(bad)])
    bad.write_text("use_ema: 3\n")
    with pytest.raises(ValueError, match="use_ema is a switch"):
        O.parse_grpo_args(["--config", str(bad)])
    bad.write_text("learning_rate: [1, 2]\n")
    with pytest.raises(ValueError, match="takes one value"):
        O.parse_grpo_args(["--config", str(bad)])
    bad.write_text("key: [unclosed\n")
    with pytest.raises(ValueError, match="does not parse"):
        O.parse_grpo_args(["--config", str(bad)])
    (tmp_path / "dpo.json").write_text(json.dumps({"algorithm": "dpo", "beta_dpo": 2000}))
    with pytest.raises(ValueError, match="written by the DPO trainer"):
        O.parse_grpo_args(["--config", str(tmp_path / "dpo.json")])
    bad.write_text("sde_type: flow\n")  # argparse checks choices of file values like command-line ones
    with pytest.raises(SystemExit):
        O.parse_grpo_args(["--config", str(bad)])
    assert "invalid choice: 'flow'" in capsys.readouterr().err
