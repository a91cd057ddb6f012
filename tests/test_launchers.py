"""The launchers as a user runs them: env vars in, "$@" passed through to the scripts."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, free_port, toy_data_dir
from test_docs import doc_workspace

LAUNCHERS = ("scripts/finetune_flux_grpo.sh", "scripts/finetune_flux_dpo.sh", "scripts/finetune_flux_nft.sh")
# each launcher's FLUX.1 recipe, given as RECIPE where a test is about something else: the default-recipe lookup (a
# python process importing torch, ~1.3 s) then runs only in the tests of the recipes themselves
FLUX_RECIPES = {"scripts/finetune_flux_grpo.sh": "scripts/recipes/dancegrpo_hps.yaml",
                "scripts/finetune_flux_dpo.sh": "scripts/recipes/dpo.yaml",
                "scripts/finetune_flux_nft.sh": "scripts/recipes/nft.yaml"}


@pytest.fixture(scope="session")  # once per session: the slow or evidence tier reads it too
def demo_data_dir(toy_world, tmp_path_factory) -> Path:
    """One DATA_DIR for the demo launchers of this module: links to the session's toy world (built once for the test
    run; the README's GRPO demo builds it from an empty data/, test_docs.py), and room for what a launcher writes
    (the tiny FLUX, the offline demo's pairs)."""
    return toy_data_dir(toy_world, tmp_path_factory.mktemp("demo-data"))


def _demo_env(tmp_path: Path, data_dir: Path, out: str = "out", **extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHON": sys.executable, "DATA_DIR": str(data_dir), "OUTPUT_DIR": str(tmp_path / out),
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "2", **extra}
    env.pop("MODEL_PATH", None)
    return env


# The README's demo commands run once, as documented, in test_docs.py (a workspace with an empty data/); these tests
# check what they wrote (doc_workspace runs a block first if test_docs.py has not).
@pytest.mark.slow(cover="test_launchers.py::test_grpo_launcher_jpeg_demo", cost_s=1)
def test_grpo_launcher_builds_the_toy_world_and_trains(tmp_path_factory):
    """README's GRPO demo (2 steps): the toy FLUX (shipped weights), the prompt splits and their embeddings are built
    in data/; held-out accuracy is evaluated before step 1 and after the last step."""
    workspace, output = doc_workspace("grpo-demo", tmp_path_factory)
    data, out = workspace / "data", workspace / "outputs" / "grpo-toyworld"
    assert (data / "toy-flux" / "toyworld.json").is_file()
    for split, count in (("train", 1956), ("heldout", 672)):
        manifest = json.loads((data / f"toyworld-{split}" / "manifest.json").read_text())
        assert manifest["num_prompts"] == count and manifest["max_sequence_length"] == 16
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # the appended flag won over the launcher's default
    assert "eval/reward_toyworld_strict" in rows[0] and "eval/reward_toyworld_strict" in rows[2]
    assert "eval/reward_toyworld_strict" not in rows[1] and "reward_toyworld_strict" in rows[1]
    config = json.loads((out / "config.json").read_text())
    assert config["reward"] == "toyworld:0.0,toyworld_strict:1.0" and config["device"] == "cpu"
    # trained on the strict check alone, the mean of the four checks logged beside it
    assert rows[1]["reward_mean"] == rows[1]["reward_toyworld_strict"] and "reward_toyworld" in rows[1]
    assert rows[0]["eval/reward_mean"] == rows[0]["eval/reward_toyworld_strict"] and "eval/reward_toyworld" in rows[0]
    assert (out / "samples" / "eval-step-000000.png").is_file()
    assert (out / "samples" / "eval-step-000002.png").is_file()
    assert (out / "final" / "diffusion_pytorch_model.safetensors").is_file()
    assert "metrics: " in output and "export: " in output
    # no UserWarning from the run's checkpoints (DCP's single-process notice is silenced at its source)
    assert "assuming the intent is to save in a single process" not in output and "checkpoint/" not in output


@pytest.mark.slow(cover="test_toyworld_pretrain_video.py::test_shipped_folder_loads_in_wanpipeline_and_the_cli_builds_"
                        "it", cost_s=1)
def test_grpo_launcher_video_demo(tmp_path_factory):
    """docs/video.md's DEMO=video block (2 steps): the toy Wan (shipped weights), the motion prompt splits and their
    embeddings built in data/; GRPO on the motion reward, held-out motion accuracy evaluated before step 1 and after
    the last step, the export written."""
    workspace, output = doc_workspace("video-demo", tmp_path_factory)
    data, out = workspace / "data", workspace / "outputs" / "grpo-toyworld-video"
    assert (data / "toy-wan" / "toyworld.json").is_file()
    for split, count in (("train", 188), ("heldout", 64)):
        manifest = json.loads((data / f"toyworld-motion-{split}" / "manifest.json").read_text())
        assert manifest["num_prompts"] == count and manifest["max_sequence_length"] == 16
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/reward_toyworld_motion_strict" in rows[0] and "eval/reward_toyworld_motion_strict" in rows[2]
    config = json.loads((out / "config.json").read_text())
    assert config["reward"] == "toyworld_motion:1.0,toyworld_motion_strict:0.0" and config["num_frames"] == 5
    assert abs(rows[1]["reward_mean"] - rows[1]["reward_toyworld_motion"]) < 1e-6 and "reward_frame_change" in rows[1]
    assert abs(rows[1]["ratio_mean"] - 1.0) < 1e-4  # on-policy at the first update
    assert (out / "final" / "diffusion_pytorch_model.safetensors").is_file() and "metrics: " in output


def test_grpo_launcher_jpeg_demo(tmp_path_factory):
    """README's DEMO=jpeg block (2 steps, then the plot): the tiny FLUX and its embeddings built in an empty data/,
    GRPO run to completion through the launcher (its flag check, torchrun, training, export), its curves drawn."""
    workspace, output = doc_workspace("jpeg-demo", tmp_path_factory)
    data, out = workspace / "data", workspace / "outputs" / "grpo-tiny"
    assert (data / "tiny-flux" / "model_index.json").is_file()
    manifest = json.loads((data / "tiny-flux-embeddings" / "manifest.json").read_text())
    assert manifest["num_prompts"] == len([l for l in (REPO / "assets" / "prompts.txt").read_text().splitlines()
                                            if l.strip()])
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    assert "UserWarning" not in output, [line for line in output.splitlines() if "Warning" in line]
    config = json.loads((out / "config.json").read_text())
    assert config["reward"] == "jpeg_compressibility:1.0" and config["eval_prompts"] is None
    assert (out / "final" / "diffusion_pytorch_model.safetensors").is_file()
    assert (out / "plots.png").stat().st_size > 10_000 and "metrics: " in output


def test_launchers_refuse_an_unknown_demo(tmp_path, demo_data_dir):
    for script in LAUNCHERS:
        proc = subprocess.run(["bash", script], cwd=REPO, env=_demo_env(tmp_path, demo_data_dir, DEMO="jpg"),
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and "DEMO=toyworld (default), DEMO=jpeg, DEMO=video or DEMO=edit (GRPO)" in \
            proc.stderr
    for script in ("scripts/finetune_flux_dpo.sh", "scripts/finetune_flux_nft.sh"):  # the video and edit demos: GRPO's
        for demo in ("video", "edit"):
            proc = subprocess.run(["bash", script], cwd=REPO, env=_demo_env(tmp_path, demo_data_dir, DEMO=demo),
                                  capture_output=True, text=True, timeout=60)
            assert proc.returncode != 0 and f"DEMO={demo} bash scripts/finetune_flux_grpo.sh" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_grpo_launcher_with_model_path_needs_embeddings(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "MODEL_PATH": str(tmp_path / "FLUX.1-dev"),
           "DATA_DIR": str(tmp_path / "data")}
    proc = subprocess.run(["bash", "scripts/finetune_flux_grpo.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    assert "preprocess_flux_embeddings.sh" in proc.stderr


def test_grpo_launcher_dry_run_plans_the_flux_recipe(tmp_path_factory):
    """docs/memory.md's block: `MODEL_PATH=data/flux-dev-config bash scripts/finetune_flux_grpo.sh --dry_run --device
    cuda` on a folder of FLUX.1-dev configs (no weights, embeddings, torchrun or GPU): DanceGRPO's recipe planned for 8
    ranks within 80 GiB per GPU, every item of the plan listed, nothing written (the default tier's one FLUX.1-dev dry
    run; the slow tier plans every recipe on its preset once, test_recipes.py)."""
    workspace, output = doc_workspace("dry-run", tmp_path_factory)
    assert "world_size=8" in output and "samples_per_rank=24" in output
    assert "batch arithmetic: prompts_per_step=16, samples_per_step=192, samples_per_rank=24" in output
    assert "transformer 11.901B params" in output
    peak = float(re.search(r"^\s+peak per rank.*?\s+([\d.]+)\s+[\d.]+\s*$", output, re.M).group(1))
    assert 25 < peak <= 80, output  # 4 B params + 4 B grads + 8 B Adam + 4 B EMA / 8 alone: 27.7 GiB
    assert "world size 8" in output and "fits in 80 GiB" in output
    for item in ("parameters (fp32 master, sharded)", "gradients (fp32, sharded)", "AdamW state", "EMA (fp32",
                 "gathered parameters", "activations, micro-batch of 2", "(the same without gradient checkpointing)",
                 "rollout forward (no grad)", "rollout buffers: latents B x (S+1) x L x C", "text embeddings",
                 "VAE (bf16, frozen)", "VAE decode, batch of 4", "bf16, no grad", "reward model hpsv2"):
        assert item in output, item
    assert not (workspace / "outputs").exists()  # a dry run writes nothing


def test_flux_recipe_matches_dance_grpo_8gpu_script(tmp_path):
    """The MODEL_PATH recipe passes DanceGRPO's 8-GPU values (scripts/finetune/finetune_flux_grpo_8gpus.sh): a stub
    PYTHON records what the launcher would hand to torchrun, parsed with the trainer's own parser."""
    from fastvideo.objectives import parse_grpo_args

    argv = launcher_argv(tmp_path, "scripts/finetune_flux_grpo.sh")
    args = parse_grpo_args(argv[argv.index("train_grpo_flux.py") + 1:])
    expected = dict(h=720, w=720, sampling_steps=16, sde_type="dance_sde", eta=0.3, shift=3.0, guidance_scale=3.5,
                    decode_x0=True, init_same_noise=True, num_generations=12, prompts_per_step=16, train_batch_size=2,
                    gradient_accumulation_steps=6, timestep_fraction=0.6, clip_range=1e-4, adv_clip_max=5.0,
                    adv_eps=1e-8, global_std=False, learning_rate=1e-5, lr_warmup_steps=0, weight_decay=1e-4,
                    max_grad_norm=0.01, use_ema=True, ema_decay=0.997497, max_train_steps=300, checkpointing_steps=40,
                    seed=42, reward="hpsv2:1.0", mixed_precision="bf16", gradient_checkpointing=True,
                    fsdp_sharding_strategy="full", resume_from="latest")
    assert {k: getattr(args, k) for k in expected} == expected


def test_another_family_runs_its_own_recipe(tmp_path):
    """MODEL_PATH of an SD3.5 folder: the GRPO and NFT launchers pass that family's recipes (Flow-GRPO's PickScore
    SD3.5 config, DiffusionNFT's), the DPO launcher (no SD3 DPO recipe) stops naming RECIPE, and RECIPE wins."""
    model = tmp_path / "sd35"
    model.mkdir()
    (model / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))

    def config_of(script: str, **env: str) -> str:
        argv = launcher_argv(tmp_path, script, MODEL_PATH=str(model), **env)
        return argv[argv.index("--config") + 1]

    assert config_of("scripts/finetune_flux_grpo.sh") == "scripts/recipes/flow_grpo_sd3_pickscore.yaml"
    assert config_of("scripts/finetune_flux_nft.sh") == "scripts/recipes/nft_sd3.yaml"
    assert config_of("scripts/finetune_flux_grpo.sh", RECIPE="scripts/recipes/flow_grpo_sd3_ocr.yaml") == \
        "scripts/recipes/flow_grpo_sd3_ocr.yaml"
    env = {**os.environ, "PYTHON": sys.executable, "MODEL_PATH": str(model), "DATA_DIR": str(tmp_path / "data")}
    proc = subprocess.run(["bash", "scripts/finetune_flux_dpo.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "the sd3 family has no default dpo recipe" in proc.stderr
    assert "RECIPE=scripts/recipes/FILE.yaml" in proc.stderr


ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def launcher_argv(tmp_path: Path, script: str, **env_vars: str | None) -> list[str]:
    """What ``MODEL_PATH=... bash script`` hands to torchrun: a stub PYTHON records its arguments (argv.json) and the
    allocator variables it sees (env.json); ``python -m fastvideo.models`` (the family's recipe) runs for real. An
    ``env_vars`` value of None removes that variable."""
    record, seen = tmp_path / "argv.json", tmp_path / "env.json"
    stub = tmp_path / "python"
    stub.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    # the launcher's model-family question (family_recipe) is answered by the real interpreter
                    f"if sys.argv[1:3] == ['-m', 'fastvideo.models']: os.execv({sys.executable!r}, "
                    f"[{sys.executable!r}, *sys.argv[1:]])\n"
                    f"open({str(record)!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
                    f"open({str(seen)!r}, 'w').write(json.dumps({{k: os.environ.get(k) for k in {ALLOC_VARS!r}}}))\n")
    stub.chmod(0o755)
    manifest = tmp_path / "data" / "embeddings" / "manifest.json"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text("{}")
    env = {**os.environ, "PYTHON": str(stub), "MODEL_PATH": str(tmp_path / "FLUX.1-dev"),
           "DATA_DIR": str(tmp_path / "data"), **env_vars}
    env = {k: v for k, v in env.items() if v is not None}
    proc = subprocess.run(["bash", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    argv = json.loads(record.read_text())
    assert argv[:2] == ["-m", "torch.distributed.run"] and "--nproc_per_node" in argv
    return argv


@pytest.mark.parametrize("script", [*LAUNCHERS, "scripts/preprocess_flux_embeddings.sh"])
def test_launchers_default_to_expandable_segments_unless_set(tmp_path, script):
    """Every launcher that starts torchrun exports PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True when the user set
    neither it nor PYTORCH_ALLOC_CONF (torch's newer name), and leaves a user's value of either alone."""
    def seen(**env_vars: str | None) -> dict[str, str | None]:
        launcher_argv(tmp_path, script, RECIPE=FLUX_RECIPES.get(script),
                      **{**dict.fromkeys(ALLOC_VARS), **env_vars})
        return json.loads((tmp_path / "env.json").read_text())

    assert seen() == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": None}
    mine = "max_split_size_mb:512"
    assert seen(PYTORCH_CUDA_ALLOC_CONF=mine) == {"PYTORCH_CUDA_ALLOC_CONF": mine, "PYTORCH_ALLOC_CONF": None}
    assert seen(PYTORCH_ALLOC_CONF=mine) == {"PYTORCH_CUDA_ALLOC_CONF": None, "PYTORCH_ALLOC_CONF": mine}


def test_dpo_flux_recipes_parse_to_their_cited_values(tmp_path):
    """The MODEL_PATH recipe of scripts/finetune_flux_dpo.sh (verl-omni's online DPO values, FLUX.1-dev's from
    Flow-GRPO), online and offline, parsed and validated by the trainer's own parser."""
    from fastvideo.objectives import parse_dpo_args

    online = launcher_argv(tmp_path, "scripts/finetune_flux_dpo.sh")
    args = parse_dpo_args(online[online.index("train_dpo.py") + 1:])
    expected = dict(h=512, w=512, guidance_scale=3.5, sampling_steps=28, beta_dpo=100.0, lora_rank=64,
                    lora_alpha=128.0, learning_rate=3e-4, lr_scheduler="constant", weight_decay=1e-4, max_grad_norm=1.0,
                    max_train_steps=600, mixed_precision="bf16", gradient_checkpointing=True, sampler="ode",
                    num_generations=16, prompts_per_step=16, train_batch_size=2, min_reward_gap=0.0,
                    ref_update_interval=0, reward="hpsv2:1.0", preference_file=None, resume_from="latest")
    assert {k: getattr(args, k) for k in expected} == expected
    pairs = tmp_path / "pairs.jsonl"
    offline = launcher_argv(tmp_path, "scripts/finetune_flux_dpo.sh", PREFERENCE_FILE=str(pairs))
    args = parse_dpo_args(offline[offline.index("train_dpo.py") + 1:])
    assert args.preference_file == str(pairs) and args.prompts_per_step == 64 and args.lora_rank == 64
    assert args.reward == "hpsv2:1.0" and args.num_generations == 12, "offline must not pass online-only flags"


@pytest.mark.slow(cover="test_launchers.py::test_grpo_launcher_jpeg_demo", cost_s=45)
def test_dpo_launcher_demo_online_and_offline(tmp_path, tmp_path_factory, demo_data_dir):
    """The DPO demo as a user runs it: online on the toy world (the default; README's block, run once in
    test_docs.py), then offline on a pair file made from the tiny model's own samples (PREFERENCE_FILE=demo, JPEG
    reward; run here: no page runs it)."""
    workspace, _ = doc_workspace("other-demos", tmp_path_factory)
    env = _demo_env(tmp_path, demo_data_dir, "outdemo", PREFERENCE_FILE="demo")
    proc = subprocess.run(["bash", "scripts/finetune_flux_dpo.sh", "--max_train_steps", "2", "--eval_max_prompts",
                           "8"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for out, online in ((workspace / "outputs" / "dpo-toyworld", True), (tmp_path / "outdemo", False)):
        rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
        train_rows = [r for r in rows if r["step"] > 0]
        assert [r["step"] for r in train_rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in train_rows)
        assert (out / "final" / "diffusion_pytorch_model.safetensors").is_file()
        assert ("reward_mean" in train_rows[0]) == online
        assert ("eval/reward_toyworld_strict" in rows[-1]) == online
    pairs = (demo_data_dir / "tiny-flux-pairs" / "pairs.jsonl").read_text().splitlines()
    assert len(pairs) == 64 and (tmp_path / "outdemo" / "preference_latents" / "cache.json").is_file()


@pytest.mark.slow(cover="test_train_grpo.py::test_resume_with_other_flags_is_refused_before_loading", cost_s=40)
def test_readme_second_demo_command_works_after_the_demo(tmp_path, tmp_path_factory):
    """docs/demos.md: after the demo (README's, run once in test_docs.py), the same launcher with `--lora_rank 8` into
    the demo's OUTPUT_DIR is refused with a message naming OUTPUT_DIR, and into a new OUTPUT_DIR starts a new run."""
    workspace, _ = doc_workspace("grpo-demo", tmp_path_factory)

    def launch(out: Path, *flags: str) -> subprocess.CompletedProcess:
        env = _demo_env(tmp_path, workspace / "data", OUTPUT_DIR=str(out))
        return subprocess.run(["bash", "scripts/finetune_flux_grpo.sh", *flags], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)

    demo = workspace / "outputs" / "grpo-toyworld"
    before = sorted(p.name for p in demo.rglob("*"))
    refused = launch(demo, "--max_train_steps", "2", "--eval_max_prompts", "16", "--lora_rank", "8")  # README's + 1
    assert refused.returncode != 0 and "--lora_rank: checkpoint 0 vs now 8" in refused.stderr
    assert "OUTPUT_DIR" in refused.stderr
    assert sorted(p.name for p in demo.rglob("*")) == before  # the demo's folder untouched
    lora = launch(tmp_path / "demo-lora8", "--max_train_steps", "1", "--lora_rank", "8", "--sample_every", "0",
                  "--eval_max_prompts", "4")
    assert lora.returncode == 0, lora.stderr[-2000:]
    assert (tmp_path / "demo-lora8" / "final" / "pytorch_lora_weights.safetensors").is_file()


def test_nft_flux_recipe_parses_to_its_cited_values(tmp_path):
    """The MODEL_PATH recipe of scripts/finetune_flux_nft.sh (DiffusionNFT's SD3.5 values, FLUX.1-dev's sampling),
    parsed and validated by the trainer's own parser for 8 ranks."""
    from fastvideo.objectives import parse_nft_args, validate_nft

    argv = launcher_argv(tmp_path, "scripts/finetune_flux_nft.sh")
    args = parse_nft_args(argv[argv.index("train_nft.py") + 1:])
    expected = dict(h=512, w=512, sampling_steps=10, solver="dpm2", guidance_scale=3.5, num_generations=24,
                    prompts_per_step=48, train_batch_size=9, nft_beta=1.0, kl_beta=1e-4, adv_mode="all",
                    adv_clip_max=5.0, global_std=True, timestep_fraction=0.99, old_decay_schedule="linear",
                    old_update_interval=1, lora_rank=32, lora_alpha=64.0, learning_rate=3e-4,
                    lr_scheduler="constant", weight_decay=1e-4, max_grad_norm=1.0, reward="hpsv2:1.0",
                    mixed_precision="bf16", gradient_checkpointing=True, seed=42, resume_from="latest")
    assert {k: getattr(args, k) for k in expected} == expected
    (tmp_path / "FLUX.1-dev").mkdir()
    (tmp_path / "FLUX.1-dev" / "model_index.json").write_text("{}")
    counts = validate_nft(args, 8)
    assert counts["samples_per_rank"] == 144 and counts["trained_timesteps"] == 9
    assert counts["optimizer_steps_per_rollout"] == 1


@pytest.mark.slow(cover="test_launchers.py::test_grpo_launcher_jpeg_demo", cost_s=1)
def test_nft_launcher_demo(tmp_path_factory):
    """The NFT demo as a user runs it (README's block, 2 steps, run once in test_docs.py): its outputs and the demo's
    reward and sigma fraction. The recipe's plan: test_recipes.py::test_nft_plans_the_old_policy_as_an_adapter_or_a_
    second_transformer."""
    workspace, _ = doc_workspace("other-demos", tmp_path_factory)
    out = workspace / "outputs" / "nft-toyworld"
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and all(math.isfinite(r["loss"]) for r in rows[1:])
    config = json.loads((out / "config.json").read_text())
    # trained on the strict check, over 2 of the 8 sigmas (scripts/demos/nft_toyworld.yaml)
    assert config["reward"] == "toyworld:0.0,toyworld_strict:1.0" and config["timestep_fraction"] == 0.25
    assert rows[1]["reward_mean"] == rows[1]["reward_toyworld_strict"] and "reward_toyworld" in rows[1]
    assert (out / "final" / "diffusion_pytorch_model.safetensors").is_file()


@pytest.mark.slow(cover="test_flag_layers.py::test_a_bad_flag_is_one_line_and_exit_status_2", cost_s=25)
def test_appended_flags_win_over_the_demo_and_bad_flags_stop_before_torchrun(tmp_path, demo_data_dir):
    """Appending a flag that excludes one of the demo's values (the demo's --sde_window_size 2 under
    --timestep_fraction 0.5, and then its --sde_window_range, which needs a size) trains, the demo values dropped with
    a note each; a bad flag is one line, exit status 2, from the launcher's check before torchrun starts (no torchrun
    output, no traceback)."""
    env = _demo_env(tmp_path, demo_data_dir)
    proc = subprocess.run(["bash", "scripts/finetune_flux_grpo.sh", "--sde_type", "cps", "--timestep_fraction", "0.5",
                           "--max_train_steps", "1", "--eval_max_prompts", "4", "--sample_every", "0"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "note: --sde_window_size 2 (from --config scripts/demos/grpo_toyworld.yaml) dropped" in proc.stderr
    assert "note: --sde_window_range 0 2 (from --config scripts/demos/grpo_toyworld.yaml) dropped" in proc.stderr
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["sde_type"], config["sde_window_size"], config["timestep_fraction"]) == ("cps", 0, 0.5)
    assert config["config"] == ["scripts/demos/toyworld.yaml", "scripts/demos/grpo_toyworld.yaml"]

    bad = subprocess.run(["bash", "scripts/finetune_flux_grpo.sh", "--clip_range", "0"], cwd=REPO,
                         env=_demo_env(tmp_path, demo_data_dir, "bad"), capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and bad.stdout == "", bad.stdout[-2000:]
    assert bad.stderr.strip().splitlines() == ["train_grpo_flux.py: error: --clip_range must be > 0, got 0.0"]


RENDEZVOUS = """import os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.ones(1)
dist.all_reduce(x)
time.sleep(3)  # both jobs hold their rendezvous at once
dist.barrier()
open(os.environ["OUT"], "w").write(f"{int(x.item())} {os.environ['MASTER_PORT']}")
dist.destroy_process_group()
"""


@pytest.mark.slow(cover="test_launchers.py::test_launchers_rendezvous_flags", cost_s=11)
def test_two_single_node_launches_at_once_pick_their_own_ports(tmp_path):
    """Without MASTER_PORT a single-node launch rendezvouses on a free port (torchrun --standalone): two jobs started
    together on one machine with the launcher's own torchrun arguments (its rendezvous flags, 2 ranks each) both form
    their process groups, on two different ports (with the fixed port of before, the second died with EADDRINUSE)."""
    argv = launcher_argv(tmp_path, "scripts/finetune_flux_nft.sh", MASTER_PORT=None, NPROC_PER_NODE="2")
    script = next(i for i, a in enumerate(argv) if a.endswith(".py"))  # torchrun's own arguments come before it
    assert "--standalone" in argv[:script]
    job = tmp_path / "rendezvous.py"
    job.write_text(RENDEZVOUS)
    procs = [subprocess.Popen([sys.executable, *argv[:script], str(job)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "OUT": str(tmp_path / f"{name}.txt")})
             for name in ("a", "b")]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-2000:] + err[-3000:]
    (world_a, port_a), (world_b, port_b) = ((tmp_path / f"{n}.txt").read_text().split() for n in "ab")
    assert world_a == world_b == "2" and port_a != port_b


def test_launchers_rendezvous_flags(tmp_path):
    """One node without MASTER_PORT: --standalone; MASTER_PORT given, or several nodes: the address and port."""
    for env_vars, expected in (({"MASTER_PORT": None}, ["--standalone"]),
                               ({"MASTER_PORT": "29555"}, ["--master_port", "29555"]),
                               ({"MASTER_PORT": None, "NNODES": "2", "MASTER_ADDR": "10.0.0.1"},
                                ["--master_addr", "10.0.0.1", "--master_port", "29500"])):
        for script in (*LAUNCHERS, "scripts/preprocess_flux_embeddings.sh"):
            argv = launcher_argv(tmp_path, script, RECIPE=FLUX_RECIPES.get(script), **env_vars)
            joined = " ".join(argv)
            assert " ".join(expected) in joined, (script, env_vars, argv)
            assert ("--standalone" in argv) == (expected == ["--standalone"])


DEMOS = [  # (trainer, the launcher's --config files, the data: the toy world or the tiny FLUX)
    ("grpo", ["toyworld.yaml", "grpo_toyworld.yaml"], "toy"), ("dpo", ["toyworld.yaml", "dpo_toyworld.yaml"], "toy"),
    ("nft", ["toyworld.yaml", "nft_toyworld.yaml"], "toy"), ("grpo", ["grpo_jpeg.yaml"], "tiny"),
    ("dpo", ["dpo_jpeg.yaml"], "tiny"), ("dpo", ["dpo_jpeg_offline.yaml"], "pairs"), ("nft", ["nft_jpeg.yaml"], "tiny")]


@pytest.mark.parametrize("trainer, files, data", DEMOS, ids=[f[-1].removesuffix(".yaml") for _, f, _ in DEMOS])
def test_demo_configs_validate(trainer, files, data, toy_world, tiny_flux_dir, tiny_data, tmp_path):
    """Every demo's values (scripts/demos/*.yaml, as its launcher layers them under the paths) parse and validate
    for the demo's one rank, and the launcher passes exactly these files."""
    from fastvideo import objectives as O

    launcher = (REPO / "scripts" / f"finetune_flux_{trainer}.sh").read_text() + \
        (REPO / "scripts" / "_training_common.sh").read_text()
    for name in files:
        assert f"--config scripts/demos/{name}" in launcher
    parse, validate = {"grpo": (O.parse_grpo_args, O.validate_grpo), "dpo": (O.parse_dpo_args, O.validate_dpo),
                       "nft": (O.parse_nft_args, O.validate_nft)}[trainer]
    if data == "toy":
        paths = ["--pretrained_model_name_or_path", str(toy_world["model"]), "--data_json_path", str(toy_world["train"]),
                 "--eval_prompts", str(toy_world["heldout"])]
    else:
        paths = ["--pretrained_model_name_or_path", str(tiny_flux_dir), "--data_json_path", str(tiny_data)]
    if data == "pairs":
        (tmp_path / "pairs.jsonl").write_text("")
        paths += ["--preference_file", str(tmp_path / "pairs.jsonl")]
    configs = [token for name in files for token in ("--config", str(REPO / "scripts" / "demos" / name))]
    args = parse([*configs, *paths, "--output_dir", str(tmp_path / "out"), "--resume_from", "latest"])
    counts = validate(args, 1)
    assert counts["world_size"] == 1 and args.device == "cpu" and args.h == (32 if data == "toy" else 64)
