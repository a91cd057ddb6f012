"""Generate (and score) images from a base model, a trained LoRA or a full fine-tune, for a prompt set: the script of
``fastvideo.sampling`` (its docstring and ``python sample.py --help`` tell every flag and file).

    python sample.py --run_dir OUT [--base] [--compare OUT/sampled/base] [--flag value ...]
"""
from __future__ import annotations

from typing import Sequence

from fastvideo import distributed as D
from fastvideo import errors
from fastvideo.evaluation import validate_sample
from fastvideo.sampling import build_sample_parser, load_model, parse_args, parse_run_args, sample


def main(argv: Sequence[str] | None = None) -> None:
    """Check every flag and path before anything loads (a bad one: one line, exit status 2), then ``sample``."""
    with errors.exit_on_usage_error(), errors.checking():  # a bad flag or input: one line, exit status 2
        args, taken = parse_run_args(argv)  # --run_dir OUT: the run's settings where no flag was given
        base = validate_sample(args)  # every flag and path, the output folder, the --compare folder: nothing loaded
        sample(args, taken, base)
    D.cleanup()


__all__ = ["build_sample_parser", "load_model", "main", "parse_args", "parse_run_args", "sample"]


if __name__ == "__main__":
    main()
