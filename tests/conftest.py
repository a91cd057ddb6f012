"""Shared fixtures: tiny FLUX folders are built once per test session in a temp dir."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers.py
from suite_rules import (pytest_addoption, pytest_collection_modifyitems,  # noqa: E402,F401
                         pytest_runtest_makereport, pytest_sessionfinish,
                         pytest_terminal_summary)  # tiers, covers, evidence shards, timeouts, undeclared skips, FLAKY
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory) -> Path:
    """A `tiny` preset FLUX folder (seed 0), built once."""
    from fastvideo.tiny import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("tiny-flux") / "model", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_data(tiny_flux_dir, tmp_path_factory) -> Path:
    """Embeddings of the first 16 prompts of assets/prompts.txt for `tiny_flux_dir` (32 T5 tokens): the manifest."""
    from helpers import make_embeddings

    return make_embeddings(tiny_flux_dir, tmp_path_factory.mktemp("tiny-emb"), 16, "--max_sequence_length", "32")


@pytest.fixture(scope="session")
def hps_flags(tmp_path_factory) -> tuple[str, ...]:
    """Trainer flags for the tiny HPS reward: smooth in the pixels, so runs that differ only in reduction order rank
    images alike."""
    from fastvideo.rewards.hpsv2 import TINY_CHECKPOINT, TINY_CONFIG, build_tiny_hps

    hps = build_tiny_hps(tmp_path_factory.mktemp("hps") / "hps-tiny", seed=0)
    return ("--reward", "hpsv2:1.0", "--hps_checkpoint", str(hps / TINY_CHECKPOINT), "--hps_model",
            str(hps / TINY_CONFIG))


@pytest.fixture(scope="session")
def toy_world(tmp_path_factory) -> dict[str, Path]:
    """The one toy world of the test run, built once (~15 s) and read-only to tests: the toy-world FLUX built from
    the shipped weights, its prompt files, and embeddings (16 T5 tokens) of every training prompt, of the first 64
    held-out prompts (a seeded random subset) and of every held-out prompt: ``{"model", "prompts", "train",
    "heldout", "heldout_all"}`` paths (``prompts``: the folder of train.txt and heldout.txt)."""
    from helpers import make_embeddings

    from fastvideo.toyworld.scenes import write_prompt_files
    from fastvideo.toyworld.pretrain import build_from_shipped

    root = tmp_path_factory.mktemp("toyworld")
    model = build_from_shipped(root / "model")
    files = write_prompt_files(root / "prompts")
    out = {"model": model, "prompts": root / "prompts"}
    for split, source, n in (("train", "train", 100_000), ("heldout", "heldout", 64),
                             ("heldout_all", "heldout", 100_000)):
        (root / split).mkdir()
        out[split] = make_embeddings(model, root / split, n, "--max_sequence_length", "16", prompt_file=files[source])
    return out

