"""One torchrun launch for all C1 checks (parallel/, checkpoint/, lora/): imports cost more than the checks.

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/c1_checks.py MODEL_DIR WORK_DIR
Prints `CHECK <section>/<name> OK|FAIL (<s>)` per check (rank 0) and `FAILURE ...` tracebacks on stderr;
WORK_DIR receives checkpoints and LoRA exports that the pytest side inspects afterwards.
"""
from __future__ import annotations

import sys
from pathlib import Path

import checkpoint_checks
import lora_checks
import parallel_checks
from sharding_common import Checks

from fastvideo import distributed

if __name__ == "__main__":
    distributed.init_distributed("cpu")
    model_dir, work_dir = sys.argv[1], Path(sys.argv[2])
    checks = Checks()
    parallel_checks.run(checks, model_dir)
    checkpoint_checks.run(checks, model_dir, work_dir)
    lora_checks.run(checks, model_dir, work_dir)
    checks.finish()
