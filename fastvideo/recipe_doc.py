"""docs/recipes.md from scripts/recipes/*.yaml: per recipe its trainer, model preset, the header (the source run,
repository, files and the differences), and a table of every value with the source comment written above it in the
file. The page is generated so it cannot drift from the files: ``python -m fastvideo.recipe_doc`` rewrites it and
``tests/test_recipes.py`` checks it is current."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
RECIPE_DIR = REPO / "scripts" / "recipes"
PAGE = REPO / "docs" / "recipes.md"
_KEY = re.compile(r"^([A-Za-z_]\w*)\s*:")

INTRO = """# Recipes: every value and its source

Generated from `scripts/recipes/*.yaml` by `python -m fastvideo.recipe_doc` (a test keeps this page equal to the
files): each recipe's header (the run it reproduces, the source repository, files and commit where the header names
one, and what differs), then every value it sets with the comment written above it in the file: the source's value
(a config key, a script flag, a file and line) and, where ours differs, why. "ours" marks a value with no counterpart
in the source. How to run a recipe, and their memory plans: [Config files and recipes](config.md#recipes).
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").strip()


def render_recipe(path: Path) -> str:
    """One recipe's section: header paragraph and the value table."""
    lines = path.read_text().splitlines()
    values = yaml.safe_load(path.read_text()) or {}
    trainer = lines[0].removeprefix("# trainer:").strip()
    preset = lines[1].removeprefix("# model:").strip()
    header: list[str] = []  # paragraphs; an indented comment line (a command) is kept as inline code
    i = 2
    while i < len(lines) and lines[i].startswith("#") and not lines[i].startswith("# ----"):
        raw = lines[i][1:]
        if raw.startswith("   ") and raw.strip():
            command = raw.strip().removesuffix("\\").strip()
            header.append(f"`{command}`" if not header or not header[-1].startswith("`")
                          else header.pop()[:-1] + " " + command + "`")
        else:
            header.append(raw.strip())
        i += 1
    rows: list[str] = []
    comment: list[str] = []
    for line in lines[i:]:
        if line.startswith("# ----"):
            comment = []
            rows.append(f"| **{_cell(line.strip('# -'))}** | | |")
        elif line.startswith("#"):
            comment.append(line[1:].strip())
        elif _KEY.match(line):
            key = _KEY.match(line).group(1)
            value = values[key]
            shown = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
            rows.append(f"| `{key}` | `{_cell(shown)}` | {_cell(' '.join(comment))} |")
            comment = []
        elif not line.strip():
            comment = []
    paragraphs = "\n".join(header).strip().split("\n\n")
    text = "\n\n".join(" ".join(line.strip() for line in p.splitlines() if line.strip()) for p in paragraphs
                       if p.strip())
    return (f"## {path.name}\n\nTrainer `{trainer}`, planned on the `{preset}` preset.\n\n{text}\n\n"
            "| flag | value | source and notes |\n| --- | --- | --- |\n" + "\n".join(rows) + "\n")


def render(recipe_dir: Path = RECIPE_DIR) -> str:
    """The whole page."""
    recipes = sorted(recipe_dir.glob("*.yaml"))
    index = "\n".join(f"- [{p.name}](#{p.stem}yaml)" for p in recipes)
    return INTRO + "\n" + index + "\n\n" + "\n".join(render_recipe(p) for p in recipes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write docs/recipes.md from scripts/recipes/*.yaml.")
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/recipes.md is not current")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        raise SystemExit(0 if PAGE.is_file() and PAGE.read_text() == page else 1)
    PAGE.write_text(page)
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
