"""The flux-dev-config preset: FLUX.1-dev's real configs with no weights, instantiable on the meta device at
full size (11.9B-param transformer, 16-channel VAE with scale factor 8, CLIP-L and T5-XXL encoders)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fastvideo import tiny
from fastvideo.models import flux
from fastvideo.tiny import FLUX_DEV_CONFIG_PRESET, INFO_FILE, build_tiny_flux, main, write_flux_dev_config


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory) -> Path:
    return write_flux_dev_config(tmp_path_factory.mktemp("flux-dev-config") / "model")


def _n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_layout_without_weights(config_dir):
    assert flux.check_model_folder(config_dir) == config_dir  # every component, tokenizer_2 included
    files = [f for f in config_dir.rglob("*") if f.is_file()]
    assert not [f for f in files if f.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf")]
    assert sum(f.stat().st_size for f in files) < 20e6
    assert not list(config_dir.parent.glob(".*tmp*"))  # atomic write left no temp folder
    assert json.loads((config_dir / "model_index.json").read_text()) == tiny._model_index()
    info = json.loads((config_dir / INFO_FILE).read_text())
    assert info["weights"] is False and info["preset"] == FLUX_DEV_CONFIG_PRESET
    assert "NOT FLUX.1-dev" in (config_dir / "tokenizer_2" / "README.txt").read_text()
    sched = json.loads((config_dir / "scheduler" / "scheduler_config.json").read_text())
    assert sched["_class_name"] == "FlowMatchEulerDiscreteScheduler"
    assert {k: sched[k] for k in tiny.FLUX_SCHEDULER_CONFIG} == tiny.FLUX_SCHEDULER_CONFIG


def test_transformer_is_flux_dev_size(config_dir):
    from diffusers import FluxTransformer2DModel

    config = FluxTransformer2DModel.load_config(config_dir / "transformer")
    assert config["_class_name"] == "FluxTransformer2DModel" and config["out_channels"] is None
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(config)
    assert model.inner_dim == 3072 == 24 * 128
    assert (len(model.transformer_blocks), len(model.single_transformer_blocks)) == (19, 38)
    assert model.config.guidance_embeds and model.config.in_channels == 64
    assert abs(_n_params(model) - 11.9e9) < 0.01e9


def test_vae_geometry_and_size(config_dir):
    from diffusers import AutoencoderKL

    geometry = flux.latent_geometry(config_dir, 720, 720)
    assert geometry.vae_scale_factor == 8 and geometry.latent_channels == 16
    assert geometry.seq_len == 2025 and geometry.packed_shape == (2025, 64)
    config = AutoencoderKL.load_config(config_dir / "vae")
    assert (config["scaling_factor"], config["shift_factor"]) == (0.3611, 0.1159)
    with torch.device("meta"):
        vae = AutoencoderKL.from_config(config)
    assert abs(_n_params(vae) - 83.8e6) < 0.1e6


def test_text_encoders_are_flux_dev_size(config_dir):
    from transformers import AutoConfig, CLIPTextModel, T5EncoderModel

    clip_config = AutoConfig.from_pretrained(config_dir / "text_encoder")
    t5_config = AutoConfig.from_pretrained(config_dir / "text_encoder_2")
    assert clip_config.architectures == ["CLIPTextModel"] and t5_config.architectures == ["T5EncoderModel"]
    assert (clip_config.hidden_size, clip_config.num_hidden_layers, clip_config.vocab_size) == (768, 12, 49408)
    assert (t5_config.d_model, t5_config.num_layers, t5_config.vocab_size) == (4096, 24, 32128)
    assert t5_config.is_gated_act and t5_config.dense_act_fn == "gelu_new"
    assert clip_config.dtype == t5_config.dtype == torch.bfloat16
    with torch.device("meta"):
        clip = CLIPTextModel(clip_config)
        t5 = T5EncoderModel(t5_config)
    assert abs(_n_params(clip) - 123.06e6) < 0.1e6
    assert abs(_n_params(t5) - 4.76e9) < 0.01e9


def test_cli_and_build_tiny_flux_guard(tmp_path, capsys):
    out = tmp_path / "cfg"
    main(["--preset", FLUX_DEV_CONFIG_PRESET, "--out", str(out)])
    assert f"wrote {out}" in capsys.readouterr().out
    assert json.loads((out / INFO_FILE).read_text())["weights"] is False
    assert (out / "transformer" / "config.json").is_file() and not list(out.rglob("*.safetensors"))
    with pytest.raises(FileExistsError):
        write_flux_dev_config(out)
    with pytest.raises(ValueError, match="write_flux_dev_config"):
        build_tiny_flux(tmp_path / "tiny", preset=FLUX_DEV_CONFIG_PRESET)
