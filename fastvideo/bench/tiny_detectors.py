"""Tiny random transformers folders of the benchmark's models, for tests without weights: ``python -m fastvideo.tiny
--preset owlv2-tiny | grounding-dino-tiny | clip-tiny --out DIR``.

Each is the stock class (``Owlv2ForObjectDetection``, ``GroundingDinoForObjectDetection``, ``CLIPModel``) with its
processor, a few thousand to a few million random parameters, loaded by ``from_pretrained`` exactly as the real
checkpoints are. Their detections and colours are noise: they prove plumbing, batching, devices and files, not scores.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from fastvideo.bench.geneval_rules import OBJECTS


_SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)  # each tower


def _clip_tokenizer(max_length: int):
    """The real CLIP BPE tokenizer (``fastvideo.tiny.save_clip_tokenizer``) read back with ``max_length``; the
    processor that holds it saves it beside the model."""
    from transformers import CLIPTokenizer

    from fastvideo.tiny import save_clip_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        save_clip_tokenizer(tmp)
        return CLIPTokenizer.from_pretrained(tmp, model_max_length=max_length)


def _write_owlv2(out: Path, seed: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    from transformers import Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessor, Owlv2Processor

    torch.manual_seed(seed)
    config = Owlv2Config(text_config={**_SMALL, "max_position_embeddings": 16},
                         vision_config={**_SMALL, "image_size": 64, "patch_size": 16}, projection_dim=32)
    Owlv2ForObjectDetection(config).save_pretrained(out)
    Owlv2Processor(image_processor=Owlv2ImageProcessor(size={"height": 64, "width": 64}),
                   tokenizer=_clip_tokenizer(16)).save_pretrained(out)


def _write_grounding_dino(out: Path, seed: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    from transformers import (BertConfig, BertTokenizerFast, GroundingDinoConfig, GroundingDinoForObjectDetection,
                              GroundingDinoImageProcessor, GroundingDinoProcessor, SwinConfig)

    words = sorted({w for name in OBJECTS for w in name.split()} | {"a", "photo", "of"})
    (out / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ","] + words) + "\n")
    tokenizer = BertTokenizerFast(str(out / "vocab.txt"), do_lower_case=True)
    torch.manual_seed(seed)
    config = GroundingDinoConfig(
        backbone_config=SwinConfig(embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2], window_size=4,
                                   image_size=64, out_features=["stage2", "stage3", "stage4"]),
        text_config=BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=2, intermediate_size=64, max_position_embeddings=256),
        num_queries=20, encoder_layers=1, decoder_layers=2,  # the box heads tie layer 0 to the others: >= 2
        encoder_ffn_dim=32, decoder_ffn_dim=32, encoder_attention_heads=2, decoder_attention_heads=2, d_model=32,
        num_feature_levels=3, encoder_n_points=2, decoder_n_points=2)
    GroundingDinoForObjectDetection(config).save_pretrained(out)
    GroundingDinoProcessor(image_processor=GroundingDinoImageProcessor(size={"shortest_edge": 64,
                                                                              "longest_edge": 64}),
                           tokenizer=tokenizer).save_pretrained(out)


def _write_clip(out: Path, seed: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    torch.manual_seed(seed)
    config = CLIPConfig(text_config={**_SMALL, "max_position_embeddings": 77},
                        vision_config={**_SMALL, "image_size": 32, "patch_size": 8}, projection_dim=32)
    CLIPModel(config).save_pretrained(out)
    CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                     crop_size={"height": 32, "width": 32}),
                  tokenizer=_clip_tokenizer(77)).save_pretrained(out)


def build_owlv2_tiny(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """A tiny random OWLv2 (64 px input, the real CLIP tokenizer) in ``out_dir``."""
    from fastvideo.tiny import write_atomically

    return write_atomically(out_dir, lambda tmp: _write_owlv2(tmp, seed))


def build_grounding_dino_tiny(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """A tiny random Grounding DINO (Swin backbone, a BERT over the class words) in ``out_dir``."""
    from fastvideo.tiny import write_atomically

    return write_atomically(out_dir, lambda tmp: _write_grounding_dino(tmp, seed))


def build_clip_tiny(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """A tiny random CLIP (32 px input, the real CLIP tokenizer) for the colour head, in ``out_dir``."""
    from fastvideo.tiny import write_atomically

    return write_atomically(out_dir, lambda tmp: _write_clip(tmp, seed))
