"""Shared pieces of the C1 torchrun check scripts (parallel/checkpoint/lora): tiny model, data, a check log."""
from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, so `fastvideo` imports uninstalled
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from fastvideo import distributed  # noqa: E402


def load_transformer(model_dir: str | Path):
    """The tiny folder's transformer, float32, train mode."""
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(Path(model_dir) / "transformer", local_files_only=True,
                                                   torch_dtype=torch.float32)
    return model.train()


def make_batch(config, batch_size: int = 4, seed: int = 0, tokens: int = 16, text_tokens: int = 8) -> dict:
    """A global batch of transformer inputs and a regression target (identical on every rank)."""
    g = torch.Generator().manual_seed(seed)
    c = config
    return {
        "hidden_states": torch.randn(batch_size, tokens, c.in_channels, generator=g),
        "encoder_hidden_states": torch.randn(batch_size, text_tokens, c.joint_attention_dim, generator=g),
        "pooled_projections": torch.randn(batch_size, c.pooled_projection_dim, generator=g),
        "timestep": torch.rand(batch_size, generator=g),
        "guidance": torch.full((batch_size,), 3.5) if c.guidance_embeds else None,
        "target": torch.randn(batch_size, tokens, c.out_channels or c.in_channels, generator=g),
        "img_ids": torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(tokens / 4),
                                              indexing="ij"), -1).reshape(-1, 3),
        "txt_ids": torch.zeros(text_tokens, 3),
    }


def local_slice(batch: dict, rank: int, world: int) -> dict:
    """This rank's contiguous share of the batched tensors (ids are shared)."""
    n = batch["hidden_states"].shape[0] // world
    return {k: (v[rank * n:(rank + 1) * n] if v is not None and k not in ("img_ids", "txt_ids") else v)
            for k, v in batch.items()}


def forward(model, batch: dict) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "target"}
    return model(**inputs, return_dict=False)[0]


def loss_of(model, batch: dict) -> torch.Tensor:
    return (forward(model, batch).float() - batch["target"]).square().mean()


def randomize_lora_b(model, seed: int = 1, scale: float = 0.05) -> None:
    """Make lora_B non-zero (identically on every rank) so adapters change the output and lora_A gets gradients."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


class Checks:
    """Collects named checks; rank 0 prints `CHECK <name> OK|FAIL`, and `finish()` exits non-zero on any failure."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def run(self, name: str, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            out = fn(*args, **kwargs)
            ok = True
        except Exception:  # noqa: BLE001  (report, keep going so one run shows every failure)
            out, ok = None, False
            self.failures.append(f"{name} [rank {distributed.get_rank()}]\n{traceback.format_exc()}")
            print(f"FAILURE {self.failures[-1]}", file=sys.stderr, flush=True)  # now: a later hang hides it
        oks = distributed.all_gather_object(ok)
        if distributed.is_main_process():
            print(f"CHECK {name} {'OK' if all(oks) else 'FAIL'} ({time.perf_counter() - start:.1f}s)", flush=True)
        return out

    def finish(self) -> None:
        any_fail = any(distributed.all_gather_object(bool(self.failures)))
        distributed.cleanup()
        sys.exit(1 if any_fail else 0)
