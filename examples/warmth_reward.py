"""A user's reward for fastvideo, the worked example of docs/rewards.md ("Adding a reward"): how warm an image is,
read through a weight file (per-channel weights) and scaled by a flag. Trains with
``--reward warmth_reward:warmth --reward_options weights=W.safetensors scale=2.0`` (this folder on PYTHONPATH)."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def warmth(weights: str, scale: float = 1.0, device: str | torch.device = "cpu"):
    """The factory: ``weights`` a safetensors file holding a (3,) ``rgb`` tensor, ``scale`` a number; returns the
    scorer. A missing file is refused here, when the trainer builds its rewards, before any training step."""
    path = Path(weights)
    if not path.is_file():
        raise FileNotFoundError(f"--reward_options weights={weights}: no such file; write one with "
                                "`python examples/warmth_reward.py W.safetensors`")
    rgb = load_file(path)["rgb"].to(device=device, dtype=torch.float32)

    def score(images: torch.Tensor, prompts: list[str], **context) -> torch.Tensor:
        """(B, 3, H, W) in [0, 1] -> (B,): the scaled per-channel weighted mean of the pixels."""
        return scale * (images.float() * rgb.view(1, 3, 1, 1)).mean(dim=(1, 2, 3))

    return score


if __name__ == "__main__":  # the example's weight file: red counts, blue counts against
    import argparse

    parser = argparse.ArgumentParser(description="write the example reward's weight file")
    parser.add_argument("out", help="the safetensors file to write (its parent folder is made)")
    out = Path(parser.parse_args().out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({"rgb": torch.tensor([1.0, 0.25, -1.0])}, out)
