"""The toyworld_clean reward (fastvideo.toyworld.clean) and --eval_reward: ground-truth renders score 1; each
corruption -- specks, a tinted background, blur, colour-mixed edges, noise -- scores lower by a clear margin in the
component that sees it, while the training reward's verifier (toyworld strict) still passes every image; the extra
evaluation rewards are logged under their own names, leave eval/reward_* as they were and change no run fingerprint;
a bad --eval_reward is refused naming the fix."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import REPO

from fastvideo.rewards import REWARD_NAMES, build_reward, parse_eval_reward_spec
from fastvideo.toyworld import scenes, verify
from fastvideo.toyworld.clean import CLEAN_KEYS, clean_batch, clean_image

SIZES = (32, 48, 64)
_BG = torch.tensor(scenes.BACKGROUND, dtype=torch.float32).view(1, 3, 1, 1) / 255


def _prompts(n: int, seed: int = 0) -> list[str]:
    everything = scenes.all_prompts()
    return [everything[i] for i in np.random.default_rng(seed).choice(len(everything), n, replace=False)]


def _background(x: torch.Tensor) -> torch.Tensor:
    """(B,1,H,W) bool: pixels of a render that are exactly the background colour."""
    return ((x - _BG).abs().amax(1, keepdim=True) < 1e-6)


def specks(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Salt-and-pepper: 0.25% of the pixels (10 at 64 px, 3 at 32 px), drawn on the background, white or black."""
    g = torch.Generator().manual_seed(seed)
    x = x.clone()
    B, _, H, W = x.shape
    count = round(0.0025 * H * W)
    for b in range(B):
        free = _background(x[b:b + 1]).flatten().nonzero().flatten()
        idx = free[torch.randperm(len(free), generator=g)[:count]]
        x[b, :, idx // W, idx % W] = (torch.rand(count, generator=g) < 0.5).float()
    return x


def tint(x: torch.Tensor, rgb: tuple[int, int, int] = (0, 0, 12)) -> torch.Tensor:
    """The background shifted by ``rgb`` (0..255 units): (235, 235, 247) for the default."""
    return torch.where(_background(x), (x + torch.tensor(rgb).view(1, 3, 1, 1) / 255).clamp(0, 1), x)


def blur(x: torch.Tensor, sigma: float = 1.0) -> torch.Tensor:
    """Separable Gaussian blur (edges replicated)."""
    r = int(np.ceil(3 * sigma))
    t = torch.arange(-r, r + 1, dtype=torch.float32)
    k = torch.exp(-t ** 2 / (2 * sigma ** 2))
    k = k / k.sum()
    B, C, H, W = x.shape
    y = F.conv2d(F.pad(x.reshape(B * C, 1, H, W), (r, r, 0, 0), mode="replicate"), k.view(1, 1, 1, -1))
    y = F.conv2d(F.pad(y, (0, 0, r, r), mode="replicate"), k.view(1, 1, -1, 1))
    return y.reshape(B, C, H, W)


def mixed_edges(x: torch.Tensor) -> torch.Tensor:
    """Every object pixel with a background 4-neighbour replaced by the half-half mix with the background."""
    obj = (~_background(x)).float()
    pad = F.pad(obj, (1, 1, 1, 1))
    inner = torch.minimum(torch.minimum(pad[..., :-2, 1:-1], pad[..., 2:, 1:-1]),
                          torch.minimum(pad[..., 1:-1, :-2], pad[..., 1:-1, 2:]))
    return torch.where((obj > 0) & (inner == 0), 0.5 * x + 0.5 * _BG, x)


def noise(x: torch.Tensor, std: float = 0.03, seed: int = 0) -> torch.Tensor:
    """Gaussian pixel noise of ``std`` (in [0, 1] units; 7.65 in 0..255), clamped."""
    g = torch.Generator().manual_seed(seed)
    return (x + std * torch.randn(x.shape, generator=g)).clamp(0, 1)


@pytest.fixture(scope="module")
def renders() -> dict[int, tuple[list[str], torch.Tensor]]:
    """48 random prompts rendered at 32, 48 and 64 px (one seed per prompt)."""
    prompts = _prompts(48)
    return {size: (prompts, scenes.render_batch(prompts, size, seeds=list(range(len(prompts))))) for size in SIZES}


def test_ground_truth_renders_are_clean(renders):
    """Measured on all 2628 prompts x {32, 48, 64} px x seeds {0, 1}: every component exactly 1. Here 48 prompts per
    size, and 8-bit images (what sample.py writes) score the same."""
    for size, (_, x) in renders.items():
        scores = clean_batch(x)
        assert set(scores) == set(CLEAN_KEYS)
        for key, value in scores.items():
            assert value.shape == (len(x),) and value.dtype == np.float64
            assert value.mean() >= 0.97 and value.min() >= 0.999, (size, key, value.min())
        as_uint8 = (x * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
        assert clean_batch(as_uint8)["score"].min() >= 0.999
    assert clean_image(renders[64][1][0])["score"] >= 0.999


# corruption -> (the component that sees it, its mean at most, the score's mean at most). Measured means here (48
# prompts; 32/48/64 px): specks stray 0.79/0.81/0.81, score 0.930/0.935/0.937; tinted background: background 0.800,
# score 0.933; blur (sigma 1 px): purity 0.26/0.40/0.50, score 0.67/0.75/0.80; mixed edges: purity 0.73/0.77/0.80,
# score 0.91/0.92/0.93; noise (std 0.03): background 0.795, score 0.91. Every image scored at most 0.96 (ground
# truth: 1), and toyworld strict was 1 on every image of every case.
CORRUPTIONS = {
    "specks": (specks, "stray", 0.9, 0.96),
    "tinted_background": (tint, "background", 0.85, 0.95),
    "blur": (blur, "purity", 0.6, 0.85),
    "mixed_edges": (mixed_edges, "purity", 0.85, 0.95),
    "noise": (noise, "background", 0.85, 0.95),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_each_corruption_lowers_the_score_where_toyworld_sees_nothing(name, renders):
    corrupt, component, component_max, score_max = CORRUPTIONS[name]
    for size, (prompts, x) in renders.items():
        y = corrupt(x)
        scores = clean_batch(y)
        assert scores[component].mean() <= component_max, (size, scores[component].mean())
        assert scores["score"].mean() <= score_max, (size, scores["score"].mean())
        assert scores["score"].max() < 0.99, (size, scores["score"].max())  # every image, not just on average
        assert ((scores["score"] >= 0) & (scores["score"] <= 1)).all()
        # the training reward's verifier passes every corrupted image: only the cleanliness reward sees the damage
        assert verify.score_batch(y, prompts)["strict"].min() == 1.0, size


def test_reward_registry_entry_and_speed():
    """``toyworld_clean`` is a weight-free reward of any prompts, returning its score and components (logged as
    toyworld_clean_<key>); 64 images of 64 px take well under 100 ms (measured ~60 ms on a loaded 2-core CPU)."""
    assert "toyworld_clean" in REWARD_NAMES
    fn = build_reward("toyworld_clean:1.0", "cpu")
    prompts = _prompts(64, seed=1)
    x = scenes.render_batch(prompts, 64, seeds=0)
    x[1] = noise(x[1:2], 0.1)[0]
    out = fn(x, ["not a toy-world prompt"] * 64)  # the prompts are not read
    assert set(out) == {"total", "toyworld_clean", "toyworld_clean_background", "toyworld_clean_stray",
                        "toyworld_clean_purity"}
    assert torch.equal(out["total"], out["toyworld_clean"]) and out["total"][0] == 1.0 and out["total"][1] < 0.8
    assert all(((v >= 0) & (v <= 1)).all() for v in out.values())
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        clean_batch(x)
        best = min(best, time.perf_counter() - t0)
    assert best < 0.5, f"{best * 1e3:.0f} ms for 64 images of 64 px"  # generous: the CPU is shared in CI
    bad = x[:2].clone()
    bad[0, 0, 0, 0] = float("nan")
    assert np.isnan(clean_batch(bad)["score"][0]) and not np.isnan(clean_batch(bad)["score"][1])


def test_eval_metric_names_cannot_collide():
    """--eval_reward's metrics are eval/<name> and eval/<name>_<key>: no reward name starts with "reward" (nor is
    "samples", the evaluation grid's key), so they never meet eval/reward_*; the extras' "total" is not logged."""
    from fastvideo.evaluation import eval_metrics, extra_eval_metrics, extra_scores, reward_summary

    assert not [n for n in REWARD_NAMES if n.startswith("reward") or n == "samples"]
    ids = torch.arange(4)
    main = {"total": torch.rand(4), "toyworld": torch.rand(4), "toyworld_strict": torch.ones(4)}
    extra = {"total": torch.rand(4), "toyworld_clean": torch.rand(4), "toyworld_clean_stray": torch.rand(4)}
    logged = extra_eval_metrics(reward_summary(extra_scores(extra, main), ids))
    assert logged == {"eval/toyworld_clean": pytest.approx(float(extra["toyworld_clean"].double().mean())),
                      "eval/toyworld_clean_stray": pytest.approx(float(extra["toyworld_clean_stray"].double().mean()))}
    assert not set(logged) & set(eval_metrics(reward_summary(main, ids)))
    with pytest.raises(ValueError, match="would overwrite --reward's entries"):
        extra_scores({"total": torch.rand(4), "toyworld": torch.rand(4)}, main)
    # an edit or video run: both RewardFns add the watch (source_distance / frame_change), the same numbers; it is
    # logged once, with --reward's (the edit demo's --eval_reward toyworld_clean stopped on this clash)
    watched = {**main, "source_distance": torch.rand(4)}
    assert set(extra_scores({**extra, "source_distance": watched["source_distance"]}, watched)) == {
        "toyworld_clean", "toyworld_clean_stray"}


def test_bad_eval_reward_specs_name_the_fix(tmp_path):
    from helpers import validate_flags

    from fastvideo.objectives import parse_grpo_args, validate_grpo

    assert parse_eval_reward_spec(None, "toyworld") == [] and parse_eval_reward_spec(" ", "toyworld") == []
    assert parse_eval_reward_spec("toyworld_clean:1.0", "toyworld") == [("toyworld_clean", 1.0)]
    with pytest.raises(ValueError, match="--eval_reward: unknown reward 'toyworld_cleen'.*valid names: .*clean"):
        parse_eval_reward_spec("toyworld_cleen", "toyworld")
    with pytest.raises(ValueError, match="--eval_reward: malformed weight 'x'"):
        parse_eval_reward_spec("toyworld_clean:x", None)
    with pytest.raises(ValueError, match="'toyworld' is scored by --reward 'toyworld:1.0' already "
                                         ".*eval/reward_toyworld.*drop it from --eval_reward"):
        parse_eval_reward_spec("toyworld_clean,toyworld", "toyworld:1.0")
    prompts = tmp_path / "heldout.txt"
    prompts.write_text("a red circle\n")
    base = ("--reward", "toyworld", "--eval_prompts", str(prompts))
    with pytest.raises(ValueError, match="--eval_reward: unknown reward 'nope'"):
        validate_flags(tmp_path, parse_grpo_args, validate_grpo, *base, "--eval_reward", "nope")
    with pytest.raises(ValueError, match="pass --eval_prompts too, or drop --eval_reward"):
        validate_flags(tmp_path, parse_grpo_args, validate_grpo, "--eval_reward", "toyworld_clean")
    validate_flags(tmp_path, parse_grpo_args, validate_grpo, *base, "--eval_reward", "toyworld_clean:1.0")


def test_bad_eval_reward_is_one_line_before_anything_loads(tmp_path, tiny_flux_dir, tiny_data):
    """What the launchers run first (--check_only): exit status 2, one line naming the flag and the valid names."""
    proc = subprocess.run([sys.executable, str(REPO / "train_nft.py"), "--pretrained_model_name_or_path",
                           str(tiny_flux_dir), "--data_json_path", str(tiny_data), "--output_dir",
                           str(tmp_path / "out"), "--h", "64", "--w", "64", "--device", "cpu", "--reward",
                           "jpeg_compressibility", "--eval_prompts", str(tiny_data), "--eval_reward", "clean",
                           "--check_only"],
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("train_nft.py: error: --eval_reward: unknown reward 'clean'") and "toyworld_clean" in \
        lines[0]
    assert not (tmp_path / "out").exists()


def test_eval_reward_changes_no_fingerprint():
    """An evaluation-only flag: the checkpoint's resume fingerprint and the recording's draw-deciding flags are the
    same with and without it."""
    from fastvideo.record import REPLAY_KEYS
    from fastvideo.resume import resume_keys, run_identity

    config = {"algorithm": "grpo", "reward": "toyworld:1.0", "seed": 0, "eval_prompts": "heldout.txt"}
    assert run_identity({**config, "eval_reward": "toyworld_clean:1.0"}) == run_identity(config)
    assert "eval_reward" not in resume_keys(config) and "eval_reward" not in REPLAY_KEYS


def test_evaluation_logs_the_extra_rewards_and_keeps_eval_reward(tiny_flux_dir, tiny_data, tmp_path):
    """``Run.evaluate`` on the tiny model (in process): with an --eval_reward fn it adds eval/toyworld_clean and its
    components in [0, 1], and every other key -- eval/reward_* -- has exactly the value it has without."""
    from types import SimpleNamespace

    from helpers import build_run

    from fastvideo import models
    from fastvideo.objectives import parse_grpo_args, validate_grpo
    from fastvideo.data import EmbeddingDataset
    from fastvideo.rollout import RolloutConfig
    from fastvideo.models import flux

    (tmp_path / "manifest.json").write_text("{}")
    args = parse_grpo_args(["--pretrained_model_name_or_path", str(tiny_flux_dir), "--data_json_path",
                            str(tmp_path / "manifest.json"), "--output_dir", str(tmp_path / "out"), "--h", "32", "--w",
                            "32", "--device", "cpu", "--mixed_precision", "fp32", "--sampling_steps", "3",
                            "--num_generations", "2", "--prompts_per_step", "1", "--train_batch_size", "2",
                            "--reward", "jpeg_compressibility", "--eval_prompts", str(tiny_data), "--eval_reward",
                            "toyworld_clean:1.0", "--eval_max_prompts", "2", "--eval_num_images", "2"])
    run = build_run(args, validate_grpo, need_reference=False)
    run.vae = flux.load_vae(tiny_flux_dir, dtype=torch.float32, device=run.device)
    run.geometry = flux.latent_geometry(tiny_flux_dir, 32, 32)
    run.rollout_cfg = RolloutConfig.from_args(args)  # as Run.sampling_inputs builds it
    run.eval_dataset = EmbeddingDataset(tiny_data).use(models.family_for(args), negative=False)
    run.reward_fn = build_reward(args.reward, run.device)
    run.logger = SimpleNamespace(log_image=lambda *a, **k: None)
    without = run.evaluate(0)
    run.eval_reward_fn = build_reward(args.eval_reward, run.device)
    with_extra = run.evaluate(0)
    added = {f"eval/toyworld_clean{suffix}" for suffix in ("", "_background", "_stray", "_purity")}
    assert set(with_extra) == set(without) | added
    assert all(0.0 <= with_extra[k] <= 1.0 for k in added), {k: with_extra[k] for k in added}
    assert {k: v for k, v in with_extra.items() if k != "time_eval"} == \
        {k: v for k, v in without.items() if k != "time_eval"} | {k: with_extra[k] for k in added}
