"""A user's reward by name (``--reward package.module:factory[:WEIGHT]`` with ``--reward_options KEY=VALUE``): the
spec grammar and its errors, and docs/rewards.md's worked example (examples/warmth_reward.py: a weight file and a flag)
trained for 2 steps and served by ``python -m fastvideo.rewards.serve`` with the scores the local reward gives."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from helpers import REPO, run_torchrun

from fastvideo.rewards import build_reward, parse_reward_items, reward_identity

EXAMPLES = REPO / "examples"
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")]))}
PROMPTS = ["a red cube", "a blue ball", "a green cone", "a white box"]


@pytest.fixture(scope="module")
def warmth_weights(tmp_path_factory):
    """The example's weight file, written by the example itself (``python examples/warmth_reward.py W``)."""
    import subprocess

    path = tmp_path_factory.mktemp("warmth") / "warmth.safetensors"
    subprocess.run([sys.executable, str(EXAMPLES / "warmth_reward.py"), str(path)], check=True, timeout=120)
    return path


@pytest.fixture
def on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


def test_spec_grammar_and_scores(on_path, warmth_weights):
    """The plugin item is named after its factory, keeps its weight beside built-in rewards, and scores
    scale x mean(pixels x rgb) as the example defines it."""
    items = parse_reward_items("warmth_reward:warmth:0.5,jpeg_compressibility:1.0")
    assert [(i.name, i.family, i.weight, i.target) for i in items] == [
        ("warmth", "plugin", 0.5, "warmth_reward:warmth"), ("jpeg_compressibility", "jpeg_compressibility", 1.0, None)]
    assert reward_identity("warmth_reward:warmth:0.5") == "warmth_reward:warmth:0.5"
    reward = build_reward("warmth_reward:warmth:0.5", "cpu", reward_options=[f"weights={warmth_weights}", "scale=2.0"])
    images = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    out = reward(images, PROMPTS)
    expected = 2.0 * (images * torch.tensor([1.0, 0.25, -1.0]).view(1, 3, 1, 1)).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out["warmth"], expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out["total"], 0.5 * expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec, options, match", [
    ("no_such_pkg_xyz.mod:f", None, "cannot import 'no_such_pkg_xyz.mod'"),
    ("warmth_reward:nothing_here", None, "warmth_reward defines no 'nothing_here'"),
    ("warmth_reward:Path", None, "returned a PosixPath, not a scorer"),
    ("warmth_reward:warmth:x", None, "malformed weight 'x'"),
    ("warmth_reward:warmth", ["weights"], "is not KEY=VALUE"),
    ("warmth_reward:warmth", ["weights=/no/such/file.safetensors"], "no such file"),
    ("warmth_reward:warmth", ["gamma=1"], "does not take these --reward_options"),
])
def test_bad_plugin_specs_name_the_fix(on_path, spec, options, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        build_reward(spec, "cpu", reward_options=options)


def test_the_example_trains_two_steps_and_is_served(tiny_flux_dir, tiny_data, warmth_weights, tmp_path):
    """docs/rewards.md's commands on the tiny FLUX: GRPO for 2 steps on the example reward (its component logged as
    reward_warmth, its options in config.json), then the same reward behind ``python -m fastvideo.rewards.serve``
    returns the scores the local reward gives."""
    from fastvideo.rewards.serve import launch

    out = tmp_path / "run"
    options = ["--reward_options", f"weights={warmth_weights}", "scale=2.0"]
    run_torchrun(["train_grpo_flux.py", "--pretrained_model_name_or_path", str(tiny_flux_dir), "--data_json_path",
                  str(tiny_data), "--output_dir", str(out), "--device", "cpu", "--h", "64", "--w", "64",
                  "--sampling_steps", "4", "--num_generations", "4", "--prompts_per_step", "2",
                  "--rollout_batch_size", "4", "--train_batch_size", "4", "--timestep_fraction", "0.5",
                  "--max_train_steps", "2", "--lora_rank", "4", "--learning_rate", "1e-3", "--no-progress_bar",
                  "--reward", "warmth_reward:warmth:1.0", *options], nproc=1, env=ENV)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("reward_warmth" in r for r in rows)
    assert all(torch.isfinite(torch.tensor([r["reward_warmth"], r["loss"]])).all() for r in rows)
    assert json.loads((out / "config.json").read_text())["reward_options"] == options[1:]

    sys.path.insert(0, str(EXAMPLES))
    try:
        local = build_reward("warmth_reward:warmth", "cpu", reward_options=options[1:])
        with launch(["--reward", "warmth_reward:warmth", *options, "--device", "cpu"], env=ENV) as server:
            remote = build_reward(f"remote:{server.url}")
            images = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
            got, want = remote(images, PROMPTS), local(images, PROMPTS)
    finally:
        sys.path.remove(str(EXAMPLES))
    torch.testing.assert_close(got["remote_warmth"], want["warmth"], rtol=0, atol=1e-6)
