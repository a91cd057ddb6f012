"""The tiny FLUX builder: stock FluxPipeline loads and runs the folder, builds are byte-identical per seed,
the CLIP tokenizer is open_clip's BPE, the T5 tokenizer has T5's special ids."""
from __future__ import annotations

import hashlib
import sys
import types
from pathlib import Path

import pytest
import torch

from fastvideo import tiny
from fastvideo.tiny import PRESETS, build_tiny_flux

PROMPTS = [
    "a photo of a cat",
    "An astronaut riding a horse on Mars, 4k, highly-detailed!!",
    "It's the dog's bone; 123 apples & two pears",
    "a red cube to the left of a blue sphere",
]


def _tree_hashes(folder: Path) -> dict[str, str]:
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def pipe(tiny_flux_dir):
    from diffusers import FluxPipeline

    return FluxPipeline.from_pretrained(tiny_flux_dir, local_files_only=True)


def test_folder_has_flux_dev_layout(tiny_flux_dir):
    import json

    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"):
        assert (tiny_flux_dir / name).is_dir(), name
    index = json.loads((tiny_flux_dir / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline"
    assert index["tokenizer_2"] == ["transformers", "T5TokenizerFast"]
    for name in ("vocab.json", "merges.txt", "tokenizer.json"):
        assert (tiny_flux_dir / "tokenizer" / name).is_file()


def test_stock_pipeline_loads_and_generates(pipe):
    p = PRESETS["tiny"]
    assert pipe.vae_scale_factor == p.vae_scale_factor == 4
    assert pipe.transformer.config.guidance_embeds
    assert pipe.transformer.config.in_channels == 16
    sched = pipe.scheduler.config
    assert sched.use_dynamic_shifting and (sched.base_shift, sched.max_shift) == (0.5, 1.15)
    assert (sched.base_image_seq_len, sched.max_image_seq_len) == (256, 4096)
    assert not pipe.text_encoder.training and not pipe.text_encoder_2.training
    assert pipe.text_encoder.config.dropout == 0.0 and pipe.text_encoder_2.config.dropout_rate == 0.0

    generator = torch.Generator().manual_seed(0)
    images = pipe(PROMPTS[:2], height=p.height, width=p.width, num_inference_steps=2, guidance_scale=3.5,
                  max_sequence_length=32, generator=generator, output_type="pt").images
    assert images.shape == (2, 3, 64, 64)
    assert torch.isfinite(images).all() and images.min() >= 0 and images.max() <= 1
    assert images.std() > 0.05  # not a flat image

    np_images = pipe(PROMPTS[:1], height=64, width=64, num_inference_steps=2, max_sequence_length=32,
                     generator=torch.Generator().manual_seed(0), output_type="np").images
    assert np_images.shape == (1, 64, 64, 3)


def test_images_vary_with_noise_and_prompt(pipe):
    kwargs = dict(height=64, width=64, num_inference_steps=4, max_sequence_length=32, output_type="pt")
    noise = torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(1))
    same_noise = noise[:1].repeat(2, 1, 1)
    by_prompt = pipe(PROMPTS[:2], latents=same_noise, **kwargs).images
    by_noise = pipe([PROMPTS[0]] * 2, latents=noise, **kwargs).images
    assert (by_noise[0] - by_noise[1]).abs().mean() > 0.05
    assert (by_prompt[0] - by_prompt[1]).abs().mean() > 0.005


def test_same_seed_gives_identical_files(tiny_flux_dir, tmp_path):
    again = build_tiny_flux(tmp_path / "again", preset="tiny", seed=0)
    assert _tree_hashes(again) == _tree_hashes(tiny_flux_dir)
    other = _tree_hashes(build_tiny_flux(tmp_path / "seed1", preset="tiny", seed=1))
    reference = _tree_hashes(tiny_flux_dir)
    assert other["transformer/diffusion_pytorch_model.safetensors"] != \
        reference["transformer/diffusion_pytorch_model.safetensors"]
    assert other["tokenizer/tokenizer.json"] == reference["tokenizer/tokenizer.json"]


def test_build_does_not_touch_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_flux(tmp_path / "m", seed=3)
    assert torch.equal(torch.rand(3), expected)


def test_build_errors(tmp_path):
    with pytest.raises(ValueError, match="bench"):
        build_tiny_flux(tmp_path / "x", preset="huge")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("x")
    with pytest.raises(FileExistsError, match="remove it"):
        build_tiny_flux(tmp_path / "full")


def test_clip_tokenizer_matches_open_clip(pipe):
    from open_clip.tokenizer import SimpleTokenizer

    reference = SimpleTokenizer()
    tok = pipe.tokenizer
    assert tok.model_max_length == 77 and len(tok) == 49408
    assert (tok.bos_token_id, tok.eos_token_id) == (reference.sot_token_id, reference.eot_token_id)
    for prompt in PROMPTS:
        assert tok(prompt, add_special_tokens=False).input_ids == reference.encode(prompt), prompt
        ids = tok(prompt).input_ids
        assert ids[0] == reference.sot_token_id and ids[-1] == reference.eot_token_id
    # open_clip's padded batch equals ours up to the pad id (open_clip pads with 0, CLIP/FLUX with eot)
    ours = tok(PROMPTS, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    theirs = reference(PROMPTS)
    mask = theirs != 0
    assert torch.equal(ours[mask], theirs[mask])


def test_t5_tokenizer_special_ids(pipe):
    from transformers import AutoTokenizer

    for tok in (pipe.tokenizer_2, AutoTokenizer.from_pretrained(pipe.config._name_or_path, subfolder="tokenizer_2")):
        assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
        assert tok.eos_token == "</s>" and tok.model_max_length == 512
        ids = tok(PROMPTS[0], padding="max_length", max_length=16).input_ids
        assert ids[:6] == tok(PROMPTS[0]).input_ids and ids[5] == 1 and ids[6:] == [0] * 10
        assert tok.decode(tok(PROMPTS[1]).input_ids, skip_special_tokens=True) == PROMPTS[1]
        assert pipe.text_encoder_2.config.vocab_size >= len(tok)


def test_presets_and_param_counts(tiny_flux_dir):
    from diffusers import FluxTransformer2DModel

    tiny_t = FluxTransformer2DModel.from_pretrained(tiny_flux_dir / "transformer")
    assert 50_000 < sum(p.numel() for p in tiny_t.parameters()) < 150_000
    bench = PRESETS["bench"]
    assert (bench.height, bench.width, bench.vae_scale_factor, bench.latent_channels) == (256, 256, 8, 16)
    assert bench.seq_len == 256 and PRESETS["tiny"].seq_len == 64
    with torch.device("meta"), torch.random.fork_rng(devices=[]):
        bench_t = tiny._build_components(bench, 0)["transformer"]
    assert 8_000_000 < sum(p.numel() for p in bench_t.parameters()) < 12_000_000


def test_cli(tmp_path, monkeypatch, capsys):
    tiny.main(["--preset", "tiny", "--out", str(tmp_path / "cli"), "--seed", "0"])
    assert (tmp_path / "cli" / "model_index.json").is_file()
    calls = []
    fake = types.ModuleType("fastvideo.rewards.hpsv2")
    fake.build_tiny_hps = lambda out, seed=0: calls.append((out, seed)) or Path(out)
    monkeypatch.setitem(sys.modules, "fastvideo.rewards.hpsv2", fake)
    tiny.main(["--preset", "hps-tiny", "--out", str(tmp_path / "hps"), "--seed", "7"])
    assert calls == [(str(tmp_path / "hps"), 7)]
