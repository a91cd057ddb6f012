"""Benchmarks a user installs with the package: GenEval's prompt suite and rules (``geneval_rules``), to be scored
with an open-vocabulary detector from ``transformers`` instead of mmdet."""
