"""fastvideo.parallel: option validation, the world-size-1 path, and 2-rank FSDP2/FSDP1 runs vs a reference."""
from __future__ import annotations

import pytest
import torch

from fastvideo.parallel import (autocast, clip_grad_norm, fsdp_version_of, full_state_dict, shard_model,
                                transformer_blocks, unwrap_config, unwrap_model, validate_parallel_options)


def tiny_transformer():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                  num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                  guidance_embeds=True, axes_dims_rope=(4, 6, 6))


@pytest.mark.parametrize("kwargs, flag", [
    (dict(fsdp_version=3), "--fsdp_version"),
    (dict(sharding_strategy="zero3"), "--fsdp_sharding_strategy"),
    (dict(mixed_precision="fp16"), "--mixed_precision"),
])
def test_invalid_options_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        shard_model(torch.nn.Linear(2, 2), **kwargs)
    with pytest.raises(ValueError, match=flag):
        validate_parallel_options(**{"fsdp_version": 2, "sharding_strategy": "full", "mixed_precision": "fp32",
                                     **kwargs})


def test_world_size_one_is_the_same_model():
    model = tiny_transformer()
    assert shard_model(model, fsdp_version=1, sharding_strategy="hybrid_full", mixed_precision="bf16",
                       cpu_offload=True) is model
    assert fsdp_version_of(model) == 0 and unwrap_model(model) is model and unwrap_config(model).in_channels == 16
    assert len(transformer_blocks(model)) == 2
    assert not model.gradient_checkpointing
    assert shard_model(model, gradient_checkpointing=True) is model and model.gradient_checkpointing


def test_world_size_one_helpers_match_torch():
    model = tiny_transformer()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    grads = [p.grad.clone() for p in model.parameters()]
    expected = torch.cat([g.flatten() for g in grads]).double().norm().item()
    norm = clip_grad_norm(model, 0.5)
    assert norm == pytest.approx(expected, rel=1e-6)
    clipped = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
    assert clipped == pytest.approx(0.5, rel=1e-4)

    sd = full_state_dict(model)
    assert set(sd) == set(model.state_dict())
    key = next(iter(sd))
    sd[key].add_(1.0)  # a copy, not a view of the live weights
    assert not torch.equal(sd[key], model.state_dict()[key])
    model.x_embedder.requires_grad_(False)
    assert set(full_state_dict(model, trainable_only=True)) == set(sd) - {"x_embedder.weight", "x_embedder.bias"}


def test_nonfinite_norm_is_returned_not_raised():
    model = torch.nn.Linear(2, 2)
    model.weight.grad = torch.full_like(model.weight, float("nan"))
    model.bias.grad = torch.zeros_like(model.bias)
    assert clip_grad_norm(model, 1.0) != clip_grad_norm(model, 1.0)  # nan


def test_autocast_context():
    assert not torch.is_autocast_enabled("cpu")
    with autocast("bf16", "cpu"):
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    with autocast("fp32", "cpu"):
        assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(ValueError, match="--mixed_precision"):
        autocast("fp16", "cpu")


@pytest.fixture(scope="module")
def dist(tiny_flux_dir, tmp_path_factory):
    from dist_scripts.c1_launch import dist_results

    return dist_results(tiny_flux_dir, tmp_path_factory)


def test_sharded_training_matches_single_process(dist):
    """torchrun 2 ranks (CPU/gloo): FSDP2 and FSDP1 in every sharding strategy, full fine-tune and LoRA, with
    gradient checkpointing / CPU offload / bf16 variants: outputs, clip_grad_norm, clipped gradients and the
    parameters after one AdamW step equal a single-process run on the whole batch; full_state_dict gives rank 0
    the full CPU weights and {} elsewhere (see tests/dist_scripts/parallel_checks.py)."""
    names = dist.assert_section_ok("parallel", expected=17)  # the 15 CONFIGS + no_shard-lora-rejected + clip check
    assert any("fsdp1" in n for n in names) and any("fsdp2" in n for n in names)
