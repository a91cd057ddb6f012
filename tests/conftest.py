"""Shared fixtures: tiny FLUX folders are built once per test session in a temp dir."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers.py
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory) -> Path:
    """A `tiny` preset FLUX folder (seed 0), built once."""
    from fastvideo.tiny import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("tiny-flux") / "model", preset="tiny", seed=0)
