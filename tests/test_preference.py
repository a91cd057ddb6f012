"""Offline DPO inputs: flux.encode, the pair-file checks (all problems in one error), the resumable latent
cache, and the demo pair maker, on the tiny FLUX model."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import make_embeddings

from fastvideo.models import flux
from fastvideo.preference import LatentCache, PreferencePair, load_images, main, read_preference_file

H = W = 64  # tiny preset's default size
PROMPTS = ["a red cube", "a cat in the snow", "a red cube", "two birds"]  # a repeat: the first id wins


@pytest.fixture(scope="module")
def vae(tiny_flux_dir):
    return flux.load_vae(tiny_flux_dir)


@pytest.fixture(scope="module")
def geometry(vae):
    return flux.latent_geometry(vae, H, W)


def _png(path, seed, size=(W, H)):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def _pair_file(folder, records):
    path = folder / "pairs.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _good_pairs(folder, n):
    """A pair file of ``n`` valid pairs (cycling through PROMPTS[:2] and 'two birds')."""
    prompts = ["a red cube", "a cat in the snow", "two birds"]
    records = []
    for i in range(n):
        _png(folder / "images" / f"{i}-c.png", 2 * i)
        _png(folder / "images" / f"{i}-r.png", 2 * i + 1)
        records.append({"prompt": prompts[i % 3], "chosen": f"images/{i}-c.png", "rejected": f"images/{i}-r.png"})
    return read_preference_file(_pair_file(folder, records), PROMPTS, H, W)


# ---------------------------------------------------------------------------------------------- encode
def test_encode_is_the_posterior_mean_packed_like_decode_unpacks(vae, geometry):
    images = torch.rand(3, 3, H, W, generator=torch.Generator().manual_seed(0))
    latents = flux.encode(vae, images, geometry)
    assert latents.shape == (3, *geometry.packed_shape) and latents.dtype == torch.float32
    assert torch.equal(latents, flux.encode(vae, images, geometry))  # deterministic: the mean, no sampling
    torch.testing.assert_close(flux.encode(vae, images, geometry, micro_batch=2), latents, rtol=0, atol=1e-5)
    config = vae.config
    with torch.no_grad():
        mean = vae.encode(images * 2 - 1).latent_dist.mean
    expected = flux.pack_latents((mean - config.shift_factor) * config.scaling_factor)
    torch.testing.assert_close(latents, expected, rtol=0, atol=1e-6)
    # decode feeds the VAE decoder exactly this posterior mean back (the random tiny VAE itself does not
    # reconstruct: encode(decode(z)) differs from z by about |z|, so only the transforms are compared)
    torch.testing.assert_close(flux.unpack_latents(latents, geometry) / config.scaling_factor + config.shift_factor,
                               mean, rtol=0, atol=1e-6)
    assert flux.decode(vae, latents, geometry).shape == images.shape
    with pytest.raises(ValueError, match=r"\(B, 3, 64, 64\).*got \(2, 3, 32, 64\)"):
        flux.encode(vae, images[:2, :, :32], geometry)


def test_vae_fingerprint_follows_the_vae_only(tiny_flux_dir, tmp_path):
    import shutil

    fingerprint = flux.vae_fingerprint(tiny_flux_dir)
    assert len(fingerprint) == 64 and flux.vae_fingerprint(tiny_flux_dir) == fingerprint
    copy = tmp_path / "model"
    shutil.copytree(tiny_flux_dir / "vae", copy / "vae")
    assert flux.vae_fingerprint(copy) == fingerprint
    config = copy / "vae" / "config.json"
    config.write_text(config.read_text().replace('"scaling_factor": 0.3611', '"scaling_factor": 0.5'))
    assert flux.vae_fingerprint(copy) != fingerprint
    with pytest.raises(FileNotFoundError, match="missing vae"):
        flux.vae_fingerprint(tmp_path)


# ------------------------------------------------------------------------------------------- pair file
def test_reads_valid_pairs(tmp_path):
    _png(tmp_path / "a.png", 0)
    _png(tmp_path / "sub" / "b.png", 1)
    path = _pair_file(tmp_path, [
        {"prompt": "  a red cube ", "chosen": "a.png", "rejected": "sub/b.png", "score": 3},
        "",
        "   ",
        {"prompt": "two birds", "chosen": "sub/../sub/b.png", "rejected": "./a.png"},
    ])
    pairs = read_preference_file(path, PROMPTS, H, W)
    assert pairs == [
        PreferencePair(1, "a red cube", 0, (tmp_path / "a.png").resolve(), (tmp_path / "sub" / "b.png").resolve()),
        PreferencePair(4, "two birds", 3, (tmp_path / "sub" / "b.png").resolve(), (tmp_path / "a.png").resolve()),
    ]


def test_every_problem_is_listed_in_one_error(tmp_path):
    run = tmp_path / "run"
    _png(run / "ok.png", 0)
    _png(run / "ok2.png", 1)
    _png(run / "small.png", 2, size=(32, 48))
    (run / "text.png").write_text("not an image")
    _png(tmp_path / "outside.png", 3)
    (run / "link.png").symlink_to(tmp_path / "outside.png")
    good = {"prompt": "a red cube", "chosen": "ok.png", "rejected": "ok2.png"}
    path = _pair_file(run, [
        good,                                                   # 1: fine
        {**good, "chosen": "missing.png"},                      # 2
        {**good, "rejected": "text.png"},                       # 3
        {**good, "chosen": "small.png"},                        # 4
        {**good, "chosen": "../outside.png"},                   # 5
        {**good, "rejected": str(run / "ok.png")},              # 6
        {**good, "prompt": "a dog on the moon"},                # 7
        '{"prompt": "a red cube", "chosen": ',                  # 8
        '["a red cube", "ok.png", "ok2.png"]',                  # 9
        {"prompt": "a red cube", "chosen": "ok.png"},           # 10
        {**good, "chosen": "link.png"},                         # 11
        {**good, "rejected": "ok.png"},                         # 12
    ])
    with pytest.raises(ValueError) as info:
        read_preference_file(path, PROMPTS, H, W)
    message = str(info.value)
    assert message.startswith(f"--preference_file {path}: 11 problems (fix them, then re-run):")
    expected = {
        2: "chosen missing.png: not found",
        3: "rejected text.png: unreadable (cannot identify image file",
        4: "chosen small.png: is 32x48, expected --w x --h = 64x64",
        5: "chosen ../outside.png: resolves to",
        6: f"rejected {run / 'ok.png'}: is an absolute path",
        7: "prompt 'a dog on the moon' is not in the embedding manifest",
        8: "not valid JSON",
        9: "not a JSON object",
        10: "missing key 'rejected'",
        11: "chosen link.png: resolves to",
        12: "chosen and rejected are the same image",
    }
    for lineno, text in expected.items():
        assert f"pairs.jsonl:{lineno}: {text}" in message, (lineno, message)
    assert "pairs.jsonl:1:" not in message
    assert "re-run preprocess_embeddings.py with a --prompt_file that includes it" in message
    assert message.rstrip().endswith("Missing: 'a dog on the moon'")


def test_problem_list_is_capped_with_a_count(tmp_path):
    path = _pair_file(tmp_path, [{"prompt": f"prompt {i}", "chosen": "a.png", "rejected": "b.png"}
                                 for i in range(30)])
    with pytest.raises(ValueError) as info:
        read_preference_file(path, PROMPTS, H, W)
    message = str(info.value)
    assert ": 90 problems" in message and "... and 40 more" in message
    assert "30 prompts are not in the embedding manifest" in message and "and 10 more" in message.splitlines()[-1]


def test_empty_and_missing_pair_files(tmp_path):
    with pytest.raises(ValueError, match="contains no pairs"):
        read_preference_file(_pair_file(tmp_path, ["", "  "]), PROMPTS, H, W)
    with pytest.raises(FileNotFoundError, match="nope.jsonl does not exist.*fastvideo.preference"):
        read_preference_file(tmp_path / "nope.jsonl", PROMPTS, H, W)


# ---------------------------------------------------------------------------------------- latent cache
def _cache(folder, pairs, fingerprint="vae-a"):
    return LatentCache(folder / "cache", pairs, vae_fingerprint=fingerprint, height=H, width=W, chunk_size=2)


def _encoded(vae, geometry, pairs):
    chosen = flux.encode(vae, load_images([p.chosen for p in pairs], H, W), geometry)
    rejected = flux.encode(vae, load_images([p.rejected for p in pairs], H, W), geometry)
    return chosen, rejected


def test_cache_builds_resumes_and_invalidates(tmp_path, vae, geometry, capsys):
    pairs = _good_pairs(tmp_path, 5)
    cache = _cache(tmp_path, pairs)
    assert cache.missing_chunks() == [0, 1, 2]
    assert cache.build(vae, geometry, device="cpu", batch_size=3) == 3
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        "cache.json", "chunk-00000.safetensors", "chunk-00001.safetensors", "chunk-00002.safetensors"]
    chosen, rejected = cache.load([4, 0, 3, 3])
    ref_chosen, ref_rejected = _encoded(vae, geometry, pairs)
    assert chosen.shape == (4, *geometry.packed_shape) and chosen.dtype == torch.float32
    torch.testing.assert_close(chosen, ref_chosen[[4, 0, 3, 3]], rtol=0, atol=1e-5)
    torch.testing.assert_close(rejected, ref_rejected[[4, 0, 3, 3]], rtol=0, atol=1e-5)

    assert _cache(tmp_path, pairs).build(vae, geometry, device="cpu") == 0  # resumable: nothing re-encoded
    (tmp_path / "cache" / "chunk-00001.safetensors").unlink()
    again = _cache(tmp_path, pairs)
    assert again.missing_chunks() == [1]
    assert again.build(vae, geometry, device="cpu") == 1
    torch.testing.assert_close(again.load([2, 3])[0], ref_chosen[2:4], rtol=0, atol=1e-5)
    capsys.readouterr()

    _png(pairs[2].rejected, 99)  # other pixels: the pair list's fingerprint changes
    changed = _cache(tmp_path, pairs)
    changed.prepare()
    out = capsys.readouterr().out
    assert "another pairs_sha256 (the pair list or an image changed): re-encoding all 3 chunks" in out
    assert changed.missing_chunks() == [0, 1, 2]
    assert changed.build(vae, geometry, device="cpu") == 3
    torch.testing.assert_close(changed.load([2])[1], _encoded(vae, geometry, pairs[2:3])[1], rtol=0, atol=1e-5)

    other_vae = _cache(tmp_path, pairs, fingerprint="vae-b")
    other_vae.prepare()
    assert "another vae_fingerprint" in capsys.readouterr().out and other_vae.missing_chunks() == [0, 1, 2]


def test_two_ranks_write_disjoint_chunks(tmp_path, vae, geometry):
    pairs = _good_pairs(tmp_path, 5)
    cache = _cache(tmp_path, pairs)
    with pytest.raises(RuntimeError, match="call prepare"):
        cache.build(vae, geometry, device="cpu", rank=1, world_size=2)
    cache.prepare()  # rank 0, then a barrier
    folder = tmp_path / "cache"
    assert cache.build(vae, geometry, device="cpu", rank=0, world_size=2) == 2
    assert sorted(p.name for p in folder.glob("chunk-*")) == ["chunk-00000.safetensors", "chunk-00002.safetensors"]
    assert cache.missing_chunks() == [1]
    assert cache.build(vae, geometry, device="cpu", rank=1, world_size=2) == 1
    assert cache.missing_chunks() == []
    torch.testing.assert_close(cache.load(range(5))[0], _encoded(vae, geometry, pairs)[0], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="geometry is 32x32"):
        cache.build(vae, flux.latent_geometry(vae, 32, 32), device="cpu")


# ------------------------------------------------------------------------------------------ demo pairs
def test_demo_pairs_are_valid_and_ranked(tiny_flux_dir, tmp_path):
    from fastvideo.data import EmbeddingDataset
    from fastvideo.rewards import build_reward

    manifest = make_embeddings(tiny_flux_dir, tmp_path, 3, "--max_sequence_length", "32")
    out = tmp_path / "demo"
    path = main(["--model_path", str(tiny_flux_dir), "--data_json_path", str(manifest), "--output_dir", str(out),
                 "--num_pairs", "2", "--num_generations", "3", "--sampling_steps", "2", "--device", "cpu"])
    assert path == out / "pairs.jsonl"
    dataset = EmbeddingDataset(manifest)
    pairs = read_preference_file(path, dataset.prompts, H, W)
    assert [p.prompt_id for p in pairs] == [0, 1] and [p.prompt for p in pairs] == dataset.prompts[:2]
    records = [json.loads(line) for line in path.read_text().splitlines()]
    reward_fn = build_reward("jpeg_compressibility:1.0")
    for pair, record in zip(pairs, records):
        assert record["chosen"] == f"images/{pair.prompt_id:05d}-chosen.png"
        assert record["chosen_reward"] >= record["rejected_reward"]
        scores = reward_fn(load_images([pair.chosen, pair.rejected], H, W), [pair.prompt] * 2)["total"]
        assert scores.tolist() == pytest.approx([record["chosen_reward"], record["rejected_reward"]])
    with pytest.raises(ValueError, match="--num_generations must be >= 2"):
        main(["--model_path", str(tiny_flux_dir), "--data_json_path", str(manifest), "--output_dir", str(out),
              "--num_pairs", "1", "--num_generations", "1"])
    assert not list(out.glob(".*.tmp.*"))
