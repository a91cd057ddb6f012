"""fastvideo.lora: peft adapters on the FLUX transformer, the reference policy, and exports that stock diffusers
loads (FluxPipeline.load_lora_weights, FluxTransformer2DModel.from_pretrained)."""
from __future__ import annotations

import pytest
import torch

from dist_scripts.sharding_common import randomize_lora_b
from fastvideo.lora import (add_lora, disable_adapters, lora_config, lora_state_dict, save_lora_for_diffusers,
                            save_transformer_for_diffusers)
from fastvideo.models.flux import LORA_TARGET_MODULES

LORA_RANK, LORA_ALPHA = 4, 8  # alpha != rank: the export must carry alpha for diffusers to scale correctly


def load_transformer(model_dir):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel.from_pretrained(model_dir / "transformer", local_files_only=True)


def inputs(config, batch: int = 2, tokens: int = 16, text: int = 8) -> dict:
    g = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(batch, tokens, config.in_channels, generator=g),
                encoder_hidden_states=torch.randn(batch, text, config.joint_attention_dim, generator=g),
                pooled_projections=torch.randn(batch, config.pooled_projection_dim, generator=g),
                timestep=torch.rand(batch, generator=g), guidance=torch.full((batch,), 3.5),
                img_ids=torch.zeros(tokens, 3), txt_ids=torch.zeros(text, 3), return_dict=False)


@torch.no_grad()
def run(model, x):
    return model(**x)[0]


def test_add_lora_freezes_base_and_starts_at_base(tiny_flux_dir):
    from peft.tuners.lora import LoraLayer

    base = load_transformer(tiny_flux_dir)
    model = add_lora(load_transformer(tiny_flux_dir), rank=LORA_RANK, alpha=LORA_ALPHA, init_seed=0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    wrapped = [n for n, m in model.named_modules() if isinstance(m, LoraLayer)]
    # 1 double block: 12 targets; each single block: attn.to_q/k/v
    assert len(wrapped) == 12 * base.config.num_layers + 3 * base.config.num_single_layers
    assert set(LORA_TARGET_MODULES) == {n.split(".", 2)[2] for n in wrapped if n.startswith("transformer_")}
    x = inputs(base.config)
    assert torch.equal(run(model, x), run(base, x))  # lora_B starts at zero
    again = add_lora(load_transformer(tiny_flux_dir), rank=LORA_RANK, alpha=LORA_ALPHA, init_seed=0)
    assert all(torch.equal(a, b) for a, b in zip(lora_state_dict(model).values(), lora_state_dict(again).values()))


def test_add_lora_errors(tiny_flux_dir):
    with pytest.raises(ValueError, match="--lora_rank"):
        add_lora(load_transformer(tiny_flux_dir), rank=0, alpha=1)
    with pytest.raises(ValueError, match="--lora_target_modules"):
        add_lora(load_transformer(tiny_flux_dir), rank=2, alpha=2, target_modules=["no_such_layer"])
    with pytest.raises(ValueError, match="no LoRA adapters"):
        with disable_adapters(load_transformer(tiny_flux_dir)):
            pass


def test_disable_adapters_is_the_base_model(tiny_flux_dir):
    base = load_transformer(tiny_flux_dir)
    model = add_lora(load_transformer(tiny_flux_dir), rank=LORA_RANK, alpha=LORA_ALPHA, init_seed=0)
    randomize_lora_b(model)
    x = inputs(base.config)
    adapted, reference = run(model, x), run(base, x)
    assert (adapted - reference).abs().max() > 1e-3
    flags = [p.requires_grad for p in model.parameters()]
    with disable_adapters(model):
        assert torch.equal(run(model, x), reference)
    assert torch.equal(run(model, x), adapted)
    assert [p.requires_grad for p in model.parameters()] == flags
    with pytest.raises(RuntimeError, match="boom"), disable_adapters(model):
        raise RuntimeError("boom")
    assert torch.equal(run(model, x), adapted)  # restored after an error too


def test_lora_state_dict_matches_peft(tiny_flux_dir):
    from peft import get_peft_model_state_dict

    model = add_lora(load_transformer(tiny_flux_dir), rank=LORA_RANK, alpha=LORA_ALPHA, init_seed=0)
    randomize_lora_b(model)
    ours, theirs = lora_state_dict(model), get_peft_model_state_dict(model)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def pipeline_image(model_dir, transformer=None, lora_dir=None):
    from diffusers import FluxPipeline

    from fastvideo.tiny import PRESETS

    extra = {"transformer": transformer} if transformer is not None else {}
    pipe = FluxPipeline.from_pretrained(model_dir, local_files_only=True, **extra)
    if lora_dir is not None:
        pipe.load_lora_weights(lora_dir)
    preset = PRESETS["tiny"]
    out = pipe("a red cube on a table", height=preset.height, width=preset.width, num_inference_steps=2,
               guidance_scale=3.5, max_sequence_length=32, generator=torch.Generator().manual_seed(0),
               output_type="pt")
    return out.images


def test_lora_export_loads_into_stock_pipeline(tiny_flux_dir, tmp_path):
    model = add_lora(load_transformer(tiny_flux_dir), rank=LORA_RANK, alpha=LORA_ALPHA, init_seed=0)
    randomize_lora_b(model, scale=0.5)
    out = save_lora_for_diffusers(model, tmp_path / "lora")
    assert (out / "pytorch_lora_weights.safetensors").is_file()

    base_image = pipeline_image(tiny_flux_dir)
    lora_image = pipeline_image(tiny_flux_dir, lora_dir=out)
    ours_image = pipeline_image(tiny_flux_dir, transformer=model.eval())
    assert (lora_image - base_image).abs().max() > 1e-3, "the LoRA must change the pipeline's output"
    # stock loading reproduces our adapted transformer exactly (so alpha/rank scaling survived the export)
    torch.testing.assert_close(lora_image, ours_image, atol=1e-5, rtol=1e-5)

    # a bare state dict needs its config: without it diffusers assumes alpha == rank (a different adapter)
    with pytest.warns(UserWarning, match="alpha"):
        bare = save_lora_for_diffusers(lora_state_dict(model), tmp_path / "bare")
    assert (pipeline_image(tiny_flux_dir, lora_dir=bare) - ours_image).abs().max() > 1e-4
    with_config = save_lora_for_diffusers(lora_state_dict(model), tmp_path / "cfg", config=lora_config(model))
    torch.testing.assert_close(pipeline_image(tiny_flux_dir, lora_dir=with_config), ours_image, atol=1e-5, rtol=1e-5)

    with pytest.raises(ValueError, match="lora_state_dict"):
        save_lora_for_diffusers({"x_embedder.weight": torch.zeros(1)}, tmp_path / "bad")


def test_full_finetune_export_roundtrip(tiny_flux_dir, tmp_path):
    from diffusers import FluxTransformer2DModel

    model = load_transformer(tiny_flux_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # "trained" weights differ from the folder's
    out = save_transformer_for_diffusers(model, None, tmp_path / "transformer")
    loaded = FluxTransformer2DModel.from_pretrained(out, local_files_only=True)
    assert loaded.config.num_single_layers == model.config.num_single_layers
    expected, got = model.state_dict(), loaded.state_dict()
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)

    half = save_transformer_for_diffusers(model.state_dict(), model.config, tmp_path / "bf16", dtype=torch.bfloat16)
    from safetensors.torch import load_file

    stored = {k: v for f in half.glob("*.safetensors") for k, v in load_file(f).items()}
    assert stored.keys() == expected.keys() and all(v.dtype == torch.bfloat16 for v in stored.values())
    loaded_half = FluxTransformer2DModel.from_pretrained(half, local_files_only=True, torch_dtype=torch.bfloat16)
    got_half = loaded_half.state_dict()
    assert got_half.keys() == expected.keys()
    for k, v in expected.items():  # diffusers loads exactly what was saved: the trained weights rounded to bf16
        assert got_half[k].dtype == torch.bfloat16 and torch.equal(got_half[k], v.to(torch.bfloat16)), k

    lora_model = add_lora(load_transformer(tiny_flux_dir), rank=2, alpha=2)
    with pytest.raises(ValueError, match="save_lora_for_diffusers"):
        save_transformer_for_diffusers(lora_model, None, tmp_path / "nope")


@pytest.fixture(scope="module")
def dist(tiny_flux_dir, tmp_path_factory):
    from dist_scripts.c1_launch import dist_results

    return dist_results(tiny_flux_dir, tmp_path_factory)


def test_lora_under_fsdp(dist, tiny_flux_dir):
    """torchrun 2 ranks, FSDP2 and FSDP1: disable_adapters gives the base model's output and leaves requires_grad
    alone, lora_state_dict gathers the unsharded adapter to rank 0 ({} elsewhere), and the export written from the
    sharded model loads into a stock FluxPipeline with the same result as an unsharded export
    (tests/dist_scripts/lora_checks.py)."""
    from safetensors import safe_open

    dist.assert_section_ok("lora", expected=2)  # lora-under-fsdp2, lora-under-fsdp1
    model = add_lora(load_transformer(tiny_flux_dir), rank=LORA_RANK, alpha=LORA_ALPHA, init_seed=0)
    randomize_lora_b(model)  # the same adapter the torchrun script built (seed 1, scale 0.05)
    unsharded = save_lora_for_diffusers(model, dist.work_dir / "lora-unsharded") / "pytorch_lora_weights.safetensors"

    def read(path):
        with safe_open(str(path), framework="pt") as f:
            return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}

    meta, expected = read(unsharded)
    for version in (2, 1):
        got_meta, got = read(dist.work_dir / f"lora-fsdp{version}" / "pytorch_lora_weights.safetensors")
        assert got_meta == meta and got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    image = pipeline_image(tiny_flux_dir, lora_dir=dist.work_dir / "lora-fsdp2")
    torch.testing.assert_close(image, pipeline_image(tiny_flux_dir, transformer=model.eval()), atol=1e-5, rtol=1e-5)


def test_export_dtype_is_the_base_models_stored_dtype(tiny_flux_dir, tmp_path):
    """--export_dtype auto reads the transformer safetensors' headers: fp32 for the tiny model; a folder storing most
    elements in bf16 (FLUX.1-dev) exports bf16. The flag's other values map directly."""
    from safetensors.torch import save_file

    from fastvideo.lora import export_dtype
    from fastvideo.weights import stored_dtype

    assert export_dtype("auto", tiny_flux_dir) == torch.float32
    assert [export_dtype(c, tiny_flux_dir) for c in ("bf16", "fp16", "fp32")] == [torch.bfloat16, torch.float16,
                                                                                  torch.float32]
    with pytest.raises(ValueError, match="--export_dtype"):
        export_dtype("int8", tiny_flux_dir)
    folder = tmp_path / "transformer"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    save_file({"a.weight": torch.zeros(64, 64, dtype=torch.bfloat16), "b.scale": torch.zeros(8),
               "c.index": torch.zeros(4096, dtype=torch.int64)}, str(folder / "model.safetensors"))
    assert stored_dtype(folder) == torch.bfloat16 and export_dtype("auto", tmp_path) == torch.bfloat16


def test_export_casts_one_tensor_at_a_time(tiny_flux_dir, tmp_path, monkeypatch):
    """cast_floating_ releases each fp32 tensor as its bf16 copy is made (never a second full copy of the model on
    rank 0; FSDP2's gather is cast so), full_state_dict(dtype=) casts while copying (one process, FSDP1), and a LoRA
    exported in bf16 stores bf16 and leaves the caller's state dict as it was."""
    import weakref

    from safetensors.torch import load_file

    from fastvideo.parallel import cast_floating_, full_state_dict

    state = {f"w{i}": torch.randn(32, 32) for i in range(4)}
    refs = [weakref.ref(v) for v in state.values()]
    alive_at_cast: list[int] = []
    to = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        alive_at_cast.append(sum(r() is not None for r in refs))
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    cast_floating_(state, torch.bfloat16)
    monkeypatch.undo()
    assert alive_at_cast == [4, 3, 2, 1] and all(v.dtype == torch.bfloat16 for v in state.values())

    base = load_transformer(tiny_flux_dir)
    half = full_state_dict(base, dtype=torch.bfloat16)  # cast while copying: no fp32 copy at all
    assert all(torch.equal(half[k], v.to(torch.bfloat16)) for k, v in base.state_dict().items())
    model = add_lora(base, rank=LORA_RANK, alpha=LORA_ALPHA, init_seed=0)
    adapters = lora_state_dict(model)
    out = save_lora_for_diffusers(adapters, tmp_path / "lora", config=lora_config(model), dtype=torch.bfloat16)
    stored = load_file(out / "pytorch_lora_weights.safetensors")
    assert len(stored) == len(adapters) and {v.dtype for v in stored.values()} == {torch.bfloat16}
    assert {v.dtype for v in adapters.values()} == {torch.float32}
