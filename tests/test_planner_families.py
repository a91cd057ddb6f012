"""The planner's activation bytes on each family's real-config preset (FLUX.1-dev, SD3.5-Medium, Qwen-Image,
FLUX.2-klein-4B; configs only, meta device) against a full meta trace of all blocks: within 3% (SD3.5-M's 13
dual-attention and 10 plain blocks are different kinds, extrapolated per kind), training without gradient
checkpointing and the no-grad forward."""
from __future__ import annotations

import pytest
import torch

from fastvideo import memory, models
from fastvideo.tiny import build_preset

PRESETS = ["flux-dev-config", "sd3.5-medium-config", "qwen-image-config", "flux2-klein-4b-config"]
BATCH, IMAGE_TOKENS, TEXT_TOKENS = 1, 256, 64  # small sequences: the op count, not the size, sets the trace's time


@pytest.fixture(scope="module", params=PRESETS)
def meta_model(request, tmp_path_factory):
    folder = build_preset(tmp_path_factory.mktemp(request.param) / "model", request.param)
    family = models.resolve("auto", folder)
    model = memory._cast_quietly(family.build_transformer(folder, dtype=torch.float32), torch.bfloat16)
    return request.param, model


# evidence (a planner number against a measurement, ~14 s for the four presets): by default the extrapolation equals
# the full trace on a small FLUX.1 (test_memory.py::test_activation_extrapolation_equals_the_full_trace); with gradient
# checkpointing the planner traces every block (a max of two moments, not linear), so only these two cases extrapolate
@pytest.mark.evidence(cover="test_memory.py::test_activation_extrapolation_equals_the_full_trace", cost_s=14)
@pytest.mark.parametrize("train", [True, False], ids=["train", "no-grad"])
def test_plan_is_within_3_percent_of_the_full_trace(meta_model, train):
    """Measured: 0.0% on all four at 1 x 256 image tokens (SD3.5-M at 512^2, B = 1: 7.23 GiB planned = traced; the
    extrapolation over the first blocks of one list, before block kinds, planned 8.09 GiB there)."""
    preset, model = meta_model
    model.disable_gradient_checkpointing()
    args = (model, BATCH, IMAGE_TOKENS, TEXT_TOKENS, torch.bfloat16)
    planned = memory.transformer_activation_bytes(*args, train=train)
    full = memory._traced_activation_bytes(*args, train=train)
    assert abs(planned - full) <= 0.03 * full, (preset, planned / 2**20, full / 2**20)


@pytest.mark.evidence(cover="test_memory.py::test_activation_extrapolation_equals_the_full_trace", cost_s=2)
def test_sd35_medium_has_three_block_kinds():
    """The case the per-kind extrapolation exists for: dual-attention, plain and the context-pre-only last block."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_preset(Path(tmp) / "model", "sd3.5-medium-config")
        model = models.resolve("auto", folder).build_transformer(folder, dtype=torch.float32)
    kinds = [memory._block_kind(b) for b in model.transformer_blocks]
    first = {k: kinds.index(k) for k in kinds}
    assert sorted(kinds.count(k) for k in first) == [1, 10, 13] and kinds[-1] != kinds[-2]
