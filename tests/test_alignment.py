"""Cross-device alignment: determinism of identical runs, record -> replay -> compare for GRPO, DPO and NFT, the
replay's checks, reward scoring of a fixed image set, and compare's stage detection."""
from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO, run_in_one_job, run_torchrun
from helpers import comparable as comparable_row

from fastvideo import compare, record
from fastvideo.logging import read_metrics
from fastvideo.seeding import NoiseSource

COMMON = ("--device", "cpu", "--h", "64", "--w", "64", "--sampling_steps", "4", "--rollout_batch_size", "4",
          "--no-progress_bar", "--max_train_steps", "2", "--lora_rank", "4", "--sample_every", "1")
TRAINERS = {
    "grpo": ("train_grpo_flux.py", "--num_generations", "4", "--prompts_per_step", "2", "--train_batch_size", "2",
             "--timestep_fraction", "0.7", "--learning_rate", "3e-2", "--seed", "3", "--kl_beta", "0.04"),
    "dpo": ("train_dpo.py", "--num_generations", "2", "--prompts_per_step", "3", "--train_batch_size", "1",
            "--learning_rate", "3e-2", "--seed", "5"),
    "nft": ("train_nft.py", "--num_generations", "2", "--prompts_per_step", "3", "--train_batch_size", "1",
            "--learning_rate", "3e-2", "--seed", "5", "--solver", "dpm2", "--old_decay_schedule", "linear"),
}

NFT_REPLAY = "test_alignment.py::test_identical_runs_are_bit_identical_and_replay_exactly[nft]"  # the slow tests' cover


def trainer_args(algo: str, model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    script, *flags = TRAINERS[algo]
    return [script, "--pretrained_model_name_or_path", str(model), "--data_json_path", str(data), "--output_dir",
            str(out / "run"), *COMMON, *flags, *extra]


def comparable(rows: list[dict]) -> list[dict]:
    return [comparable_row(row) for row in rows]


def run_compare(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastvideo.compare", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def files_of(root: Path, pattern: str) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.glob(pattern))}


# ------------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="session")  # once per session: the slow or evidence tier reads it too
def grpo_alignment(tiny_flux_dir, tiny_data, hps_flags, tmp_path_factory) -> dict[str, Path]:
    """A 2-rank GRPO recording, its replay on 1 rank, its replay by a transformer with perturbed weights, and a plain
    1-rank run."""
    from safetensors.torch import load_file, save_file

    base = tmp_path_factory.mktemp("grpo-align")
    perturbed = base / "perturbed-model"
    shutil.copytree(tiny_flux_dir, perturbed)
    weights = next((perturbed / "transformer").glob("*.safetensors"))
    state = load_file(str(weights))
    w = state["proj_out.weight"]
    state["proj_out.weight"] = w + 0.5 * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(0))
    save_file(state, str(weights), metadata={"format": "pt"})
    runs = {name: base / name for name in ("two", "replay", "perturbed", "one")}
    run_torchrun(trainer_args("grpo", tiny_flux_dir, tiny_data, runs["two"], *hps_flags,
                              "--record_dir", str(runs["two"] / "rec")))
    one_rank = [trainer_args("grpo", model, tiny_data, runs[name], *hps_flags, "--replay_dir",
                             str(runs["two"] / "rec"), "--record_dir", str(runs[name] / "rec"))
                for name, model in (("replay", tiny_flux_dir), ("perturbed", perturbed))]
    one_rank.append(trainer_args("grpo", tiny_flux_dir, tiny_data, runs["one"], *hps_flags, "--record_dir",
                                 str(runs["one"] / "rec")))
    run_in_one_job([(args[0], args[1:]) for args in one_rank], base, nproc=1)  # the three 1-rank runs, one start-up
    return runs


# slow for the default suite's time: a recording and its replay run in the default suite in
# test_identical_runs_are_bit_identical_and_replay_exactly[nft]
@pytest.mark.slow(cover=NFT_REPLAY, cost_s=45)
def test_recording_holds_every_stage(grpo_alignment):
    from safetensors.torch import load_file

    rec = grpo_alignment["two"] / "rec"
    manifest = json.loads((rec / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["algorithm"] == "grpo" and manifest["format"] == record.FORMAT
    assert manifest["device"]["type"] == "cpu" and manifest["compute_dtype"] == "float32"
    assert {"torch", "diffusers", "python"} <= set(manifest["versions"]) and manifest["flags"]["seed"] == 3
    assert [r["step"] for r in record.read_jsonl(rec / "steps.jsonl")] == [1, 2]
    samples = [r for rank in (0, 1) for r in record.read_jsonl(rec / f"samples-rank{rank}.jsonl")]
    assert len(samples) == 2 * 8 and all((rec / r["image"]).is_file() for r in samples)
    assert {"total", "hpsv2"} <= set(samples[0]["rewards"])
    draws = load_file(str(rec / "step-000001" / "draws-rank0.safetensors"))
    purposes = {key.split("|")[1] for key in draws}
    assert purposes == {"init", "sde", "timesteps"}, purposes
    assert draws[next(k for k in draws if k.startswith("randn|sde|"))].shape == (4, 64, 16)  # (S, L, C)
    tensors = load_file(str(rec / "step-000001" / "tensors-rank1.safetensors"))
    assert tensors["old_log_probs"].shape == (4, 4) and tensors["trace/loss"].shape == (2, 2)  # (B, S), (mb, K)
    updates = record.read_jsonl(rec / "updates-rank0.jsonl")
    assert {"loss", "timestep_slot"} <= set(updates[0]) and any("grad_norm" in r for r in updates)


# slow for the default suite's time: a recording and its replay run in the default suite in
# test_identical_runs_are_bit_identical_and_replay_exactly[nft]
@pytest.mark.slow(cover=NFT_REPLAY, cost_s=3)
def test_two_rank_recording_replays_on_one_rank(grpo_alignment):
    rec, replay = grpo_alignment["two"] / "rec", grpo_alignment["replay"] / "rec"
    a = compare.Recording.load(rec)
    b = compare.Recording.load(replay)
    assert set(a.samples) == set(b.samples) and len(a.samples) == 16
    assert files_of(rec, "step-000001/images/*.png") == files_of(replay, "step-000001/images/*.png")
    for key, row in a.samples.items():
        # step 1: the same draws and weights, so the same images; the rewards differ only by the reward model's batch
        # (8 images instead of 4: measured 5e-8 apart). Step 2 samples weights updated by a 2-rank vs a 1-rank
        # reduction (1-ulp gradient differences, which Adam's first step turns into full-size ones on near-zero
        # gradients; measured 2.3e-6 apart, 9e-6 relative)
        tolerance = 1e-6 if key[0] == 1 else 1e-5
        assert b.samples[key]["rewards"]["total"] == pytest.approx(row["rewards"]["total"], rel=0, abs=tolerance), key
    # the replay drew nothing itself: its recorded draws are the recording's, byte for byte (the 2 ranks' files merged)
    from safetensors.torch import load_file

    for step in (1, 2):
        recorded = {k: v for r in (0, 1)
                    for k, v in load_file(str(rec / f"step-00000{step}/draws-rank{r}.safetensors")).items()}
        replayed = load_file(str(replay / f"step-00000{step}/draws-rank0.safetensors"))
        assert set(recorded) == set(replayed)
        assert all(torch.equal(recorded[k], replayed[k]) for k in recorded)
    out = run_compare(str(rec), str(replay), "--plot", str(grpo_alignment["replay"] / "c.png"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "agree: 2 steps within tolerance" in out.stdout


# slow for the default suite's time: a recording and its replay run in the default suite in
# test_identical_runs_are_bit_identical_and_replay_exactly[nft]
@pytest.mark.slow(cover=NFT_REPLAY, cost_s=1)
def test_grpo_runs_are_bit_identical(grpo_alignment):
    """A 1-rank run that draws its noise and a 1-rank run that reads it from the 2-rank recording, same flags: the same
    metrics (timings aside), sample grids, recorded images and draws, bit for bit (every draw is a function of its
    key, so drawing twice and replaying are the same thing)."""
    one, replay = grpo_alignment["one"], grpo_alignment["replay"]
    first = read_metrics(one / "run" / "metrics.jsonl")
    assert len(first) == 2 and comparable(first) == comparable(read_metrics(replay / "run" / "metrics.jsonl"))
    for pattern in ("rec/step-*/images/*.png", "rec/step-*/draws-rank0.safetensors", "run/samples/*.png"):
        found = files_of(one, pattern)
        assert found and found == files_of(replay, pattern), pattern


# slow for the default suite's time: a recording and its replay run in the default suite in
# test_identical_runs_are_bit_identical_and_replay_exactly[nft]
@pytest.mark.slow(cover=NFT_REPLAY, cost_s=3)
def test_a_perturbed_transformer_diverges_at_the_rollout(grpo_alignment, tmp_path):
    out = run_compare(str(grpo_alignment["two"] / "rec"), str(grpo_alignment["perturbed"] / "rec"),
                      "--plot", str(tmp_path / "c.png"), "--json", str(tmp_path / "c.json"), "--per_image")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "DIVERGED at step 1, stage rollout: image PSNR" in out.stdout
    assert (tmp_path / "c.png").stat().st_size > 10_000
    table = json.loads((tmp_path / "c.json").read_text())
    assert table[0]["stage"] == "rollout" and table[0]["image_psnr"] < 30
    assert len(table[0]["images"]) == 8 and min(i["psnr"] for i in table[0]["images"]) == table[0]["image_psnr_min"]
    assert out.stdout.count("   image p") == 16  # --per_image: every image of both steps
    assert table[0]["logprob"] < 1e-5  # the log-prob of the recorded noise does not depend on the model


# NFT's variant is the default one: it also replays with --replay_images (scoring a recording's images), which no
# other default test reaches. DPO's is opt-in (-m slow; suite time): the determinism it checks lives in the shared
# scaffold (noise source, Run, recorder) that NFT's variant runs, and DPO's replay is tested in test_train_dpo.py.
@pytest.mark.parametrize("algo", [pytest.param("dpo", marks=pytest.mark.slow(cover=NFT_REPLAY, cost_s=25)), "nft"])
def test_identical_runs_are_bit_identical_and_replay_exactly(algo, tiny_flux_dir, tiny_data, hps_flags, tmp_path):
    """Two runs with the same seed and flags: the same metrics (timings aside), images and draws, bit for bit. NFT: a
    replay of the first that scores its recorded images (--replay_images) agrees with it (compare exits 0); DPO's
    replay is tested offline (test_train_dpo.py), GRPO's across world sizes above."""
    runs = {name: tmp_path / name for name in ("a", "b", "replay")}

    def run(name: str, *extra: str) -> None:
        run_torchrun(trainer_args(algo, tiny_flux_dir, tiny_data, runs[name], *hps_flags, *extra, "--record_dir",
                                  str(runs[name] / "rec")), nproc=1)

    # one rank each with one thread (run_torchrun's OMP_NUM_THREADS=1): the two runs share the 2 cores side by side
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        for done in [pool.submit(run, "a"), pool.submit(run, "b")]:
            done.result()
    if algo == "nft":
        run("replay", "--replay_dir", str(runs["a"] / "rec"), "--replay_images")
    first = read_metrics(runs["a"] / "run" / "metrics.jsonl")
    assert len(first) == 2 and comparable(first) == comparable(read_metrics(runs["b"] / "run" / "metrics.jsonl"))
    for pattern in ("rec/step-*/images/*.png", "rec/step-*/draws-rank0.safetensors", "run/samples/*.png"):
        found = files_of(runs["a"], pattern)
        assert found and found == files_of(runs["b"], pattern), pattern
    if algo == "nft":  # the replay scored the recorded 8-bit images: rewards within their quantisation
        # (measured <= 3e-6 apart; the tiny HPS reward's spread over a step is ~0.15)
        assert files_of(runs["a"], "rec/step-*/images/*.png") == files_of(runs["replay"], "rec/step-*/images/*.png")
        a, replay = (compare.Recording.load(runs[name] / "rec") for name in ("a", "replay"))
        assert set(a.samples) == set(replay.samples) and a.samples
        for key, row in a.samples.items():
            assert replay.samples[key]["rewards"]["total"] == pytest.approx(row["rewards"]["total"], abs=1e-4), key
        out = run_compare(str(runs["a"] / "rec"), str(runs["replay"] / "rec"), "--plot", str(tmp_path / "c.png"))
        assert out.returncode == 0 and "agree" in out.stdout, out.stdout + out.stderr


# ------------------------------------------------------------------------------------------------ replay checks
def _recording(root: Path, steps: int = 1) -> Path:
    """A small synthetic recording: two draws per step of two samples, written by Recorder + RecordingNoise."""
    rec = record.Recorder(root, rank=0)
    rec.start({"format": record.FORMAT, "flags": {"algorithm": "grpo", "seed": 1}}, resume_step=0)
    noise = record.RecordingNoise(NoiseSource(1), rec)
    for step in range(1, steps + 1):
        noise.batch_randn((3, 2), step=step, prompt_ids=[7, 7], sample_indices=[0, 1], purpose="init")
        noise.randperm(5, step=step, prompt_id=7, sample_index=0, purpose="timesteps")
        rec.end_step(step, {"loss": 0.5}, None, [1.0])
    return root


def test_replay_serves_the_recorded_draws_and_names_every_mismatch(tmp_path):
    root = _recording(tmp_path / "rec")
    replay = record.Replay(root)
    noise = record.ReplayNoise(NoiseSource(999), replay)  # another seed: the draws still come from the recording
    expected = NoiseSource(1).batch_randn((3, 2), step=1, prompt_ids=[7, 7], sample_indices=[0, 1], purpose="init")
    assert torch.equal(noise.batch_randn((3, 2), step=1, prompt_ids=[7, 7], sample_indices=[0, 1], purpose="init"),
                       expected)
    with pytest.raises(ValueError, match=r"used 2 of the 3 draws .*randperm\|timesteps\|p7\|s0"):
        replay.check_step(1)  # the permutation was recorded but not asked for
    with pytest.raises(ValueError, match=r"asks for draw 'randn\|init\|p8\|s0'.*its prompts at this step: \[7\]"):
        noise.randn((3, 2), step=1, prompt_id=8, sample_index=0, purpose="init")
    with pytest.raises(ValueError, match=r"has shape \(3, 2\) but this run asks for \(4, 2\)"):
        noise.randn((4, 2), step=1, prompt_id=7, sample_index=0, purpose="init")
    with pytest.raises(ValueError, match="no draws for step 2"):
        noise.randn((3, 2), step=2, prompt_id=7, sample_index=0, purpose="init")


def test_replay_flags_and_steps_are_checked_before_loading(tmp_path):
    root = _recording(tmp_path / "rec", steps=2)
    config = {"algorithm": "grpo", "seed": 1}
    record.check_replay(root, config, 1, 2)
    with pytest.raises(ValueError, match="--seed: recorded 1 vs now 2"):
        record.check_replay(root, {**config, "seed": 2}, 1, 2)
    with pytest.raises(ValueError, match=r"no draws for step\(s\) 3 .*--max_train_steps 2"):
        record.check_replay(root, config, 1, 3)
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        record.check_replay(tmp_path, config, 1, 1)
    with pytest.raises(ValueError, match="is not empty and not this run's recording"):
        record.check_record_dir(root, None, fingerprint="abc")
    with pytest.raises(ValueError, match="the same folder"):
        record.check_record_dir(root, str(root), fingerprint=None)
    manifest = json.loads((root / "manifest.json").read_text())
    (root / "manifest.json").write_text(json.dumps({**manifest, "config_fingerprint": "abc"}))
    record.check_record_dir(root, None, fingerprint="abc")  # its own recording: a restarted run continues it
    record.check_record_dir(tmp_path / "new", None, fingerprint="abc")
    # continuing from step 1 forgets what was recorded after it, so the recording reads as one run
    record.Recorder(root, rank=0).start(manifest, resume_step=1)
    assert [r["step"] for r in record.read_jsonl(root / "steps.jsonl")] == [1]
    assert (root / "step-000001").is_dir() and not (root / "step-000002").exists()


def test_replay_flags_are_refused_by_the_trainer_before_loading(tiny_flux_dir, tiny_data, tmp_path):
    from helpers import validate_flags

    from fastvideo.objectives import parse_grpo_args, validate_grpo

    with pytest.raises(ValueError, match="--replay_images takes the images of a recording"):
        validate_flags(tmp_path, parse_grpo_args, validate_grpo, "--replay_images")
    with pytest.raises(ValueError, match="--record_every must be >= 1"):
        validate_flags(tmp_path, parse_grpo_args, validate_grpo, "--record_every", "0")


# ------------------------------------------------------------------------------------------------ scoring, compare
def test_score_a_folder_of_images_batched_and_compare_two_score_files(tmp_path):
    from fastvideo.rewards import build_reward

    images = torch.rand(5, 3, 32, 48, generator=torch.Generator().manual_seed(0))
    folder = tmp_path / "images"
    folder.mkdir()
    for i, image in enumerate(images):
        record.save_png(image, folder / f"img{i}.png")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(5)))
    cli = [sys.executable, "-m", "fastvideo.rewards.score", "--reward", "jpeg_compressibility", "--images",
           str(folder), "--prompts", str(prompts), "--batch_size", "2", "--device", "cpu"]
    out = subprocess.run([*cli, "--out", str(tmp_path / "a.jsonl")], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rows = record.read_jsonl(tmp_path / "a.jsonl")
    expected = build_reward("jpeg_compressibility")(torch.stack([record.load_image(folder / f"img{i}.png")
                                                                 for i in range(5)]), ["p"] * 5)["total"]
    assert [r["image"] for r in rows] == [f"img{i}.png" for i in range(5)] and rows[3]["prompt"] == "prompt 3"
    assert [r["total"] for r in rows] == pytest.approx(expected.tolist(), rel=1e-7)
    changed = [{**r, "total": r["total"] * (1.2 if r["image"] == "img2.png" else 1.0)} for r in rows]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in changed))
    same = run_compare(str(tmp_path / "a.jsonl"), str(tmp_path / "a.jsonl"))
    assert same.returncode == 0 and "agree" in same.stdout
    differ = run_compare(str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--plot", str(tmp_path / "s.png"))
    assert differ.returncode == 1 and "DIVERGED" in differ.stdout and (tmp_path / "s.png").stat().st_size > 0
    prompts.write_text("only one prompt\n")
    bad = subprocess.run([*cli, "--out", str(tmp_path / "c.jsonl")], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "has 1 prompts but --images" in bad.stderr


def _fake_recording(root: Path, rewards: list[float], losses: list[float]) -> compare.Recording:
    steps = {s + 1: {"step": s + 1, "loss": loss, "grad_norm": 1.0} for s, loss in enumerate(losses)}
    samples = {(s + 1, 0, 0): {"rewards": {"total": r}, "image": "missing.png"} for s, r in enumerate(rewards)}
    return compare.Recording(root, {}, steps, samples, update_losses=[0.5])


@pytest.mark.parametrize("reward_b, loss_b, stage, step", [
    ([1.0, 1.0, 1.0], [0.5, 0.5, 0.5], None, None),
    ([1.0, 1.2, 1.0], [0.5, 0.5, 0.5], "reward", 2),
    ([1.0, 1.0, 1.0], [0.5, 0.5, 0.9], "train", 3),
])
def test_compare_names_the_first_stage_beyond_tolerance(tmp_path, reward_b, loss_b, stage, step):
    args = compare.parse_args(["a", "b"])
    a = _fake_recording(tmp_path, [1.0, 1.0, 1.0], [0.5, 0.5, 0.5])
    diffs = compare.compare_recordings(a, _fake_recording(tmp_path, reward_b, loss_b), args)
    first = next((d for d in diffs if d.stage), None)
    assert (first.stage, first.step) == (stage, step) if stage else first is None
    assert compare.rel_diff(1.0, 1.2) == pytest.approx(0.2 / 1.2)
