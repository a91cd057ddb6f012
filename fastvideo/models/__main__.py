"""``python -m fastvideo.models``: what the launchers ask about a model folder without loading it.

    python -m fastvideo.models family MODEL_PATH            # the family name (--model_family auto's choice)
    python -m fastvideo.models recipe TRAINER MODEL_PATH    # the family's default recipe for TRAINER
                                                            # (grpo | dpo | dpo_offline | nft)
"""
from __future__ import annotations

import argparse
import sys

from fastvideo import models


def main(argv: list[str] | None = None) -> int:
    """Print the answer on stdout; a folder no family serves, or a family without a recipe for the trainer, is one
    line on stderr naming the fix, exit status 2."""
    parser = argparse.ArgumentParser(prog="python -m fastvideo.models", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    family_cmd = sub.add_parser("family", help="the model family of a folder (from its model_index.json)")
    family_cmd.add_argument("model_path")
    family_cmd.add_argument("--model_family", default="auto", help="auto | a family name | package.module:Class")
    recipe_cmd = sub.add_parser("recipe", help="the family's default recipe for a trainer")
    recipe_cmd.add_argument("trainer", choices=("grpo", "dpo", "dpo_offline", "nft"))
    recipe_cmd.add_argument("model_path")
    recipe_cmd.add_argument("--model_family", default="auto", help="auto | a family name | package.module:Class")
    args = parser.parse_args(argv)
    try:
        family = models.resolve(args.model_family, args.model_path)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.command == "family":
        print(family.name)
        return 0
    recipe = family.recipes.get(args.trainer)
    if recipe is None:
        have = ", ".join(f"{k}: {v}" for k, v in family.recipes.items()) or "none"
        print(f"error: the {family.name} family has no default {args.trainer} recipe (it has {have}); pass "
              "RECIPE=scripts/recipes/FILE.yaml (any recipe of the trainer, with --model_family set) or your own "
              "--config", file=sys.stderr)
        return 2
    print(recipe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
