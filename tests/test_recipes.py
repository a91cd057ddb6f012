"""scripts/recipes/*.yaml: each recipe names its trainer on its first line, parses with that trainer's --config,
validates for 8 ranks, plans within 80 GB per GPU on FLUX.1-dev's configs (the trainer's own --dry_run, in process),
states that plan in its header, holds no machine-specific paths, and cites a source for every value."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from fastvideo import config as C

REPO = Path(__file__).resolve().parents[1]
RECIPE_DIR = REPO / "scripts" / "recipes"
RECIPES = sorted(RECIPE_DIR.glob("*.yaml"))
WORLD = 8
DEVICE_GB = 80.0

# trainer script -> (parse, validate)
TRAINERS = {
    "train_grpo_flux.py": (C.parse_grpo_args, C.validate_grpo),
    "train_dpo.py": (C.parse_dpo_args, C.validate_dpo),
    "train_nft.py": (C.parse_nft_args, C.validate_nft),
}
# flags whose values depend on the machine: they go on the command line, never in a recipe
MACHINE_KEYS = {"pretrained_model_name_or_path", "data_json_path", "output_dir", "device", "hps_checkpoint",
                "hps_model", "pickscore_model", "pickscore_processor", "clip_checkpoint", "aesthetic_checkpoint",
                "aesthetic_clip_checkpoint", "eval_data_json_path", "preference_file", "latent_cache_dir",
                "resume_from", "record_dir", "replay_dir", "dry_run", "dry_run_world_size", "dry_run_device_memory_gb",
                "config"}
KEY_LINE = re.compile(r"^([A-Za-z_]\w*)\s*:")
HEADER_PLAN = re.compile(r"Memory \(--dry_run --dry_run_world_size 8[^)]*\): (\d+(?:\.\d+)?) GiB per GPU, fits")
PEAK_LINE = re.compile(r"peak per rank = persistent \+ \w+\s+(\d+(?:\.\d+)?)")


def _trainer(recipe: Path) -> str:
    first = recipe.read_text().splitlines()[0]
    match = re.fullmatch(r"# trainer: (\S+)", first.strip())
    assert match, f"{recipe.name}: the first line must be '# trainer: <script>.py', got {first!r}"
    assert match.group(1) in TRAINERS, f"{recipe.name}: unknown trainer {match.group(1)} (one of {sorted(TRAINERS)})"
    return match.group(1)


def _load_trainer(script: str):
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py") + "_under_test", REPO / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory) -> tuple[Path, Path]:
    """FLUX.1-dev's real configs without weights, and a stub embeddings manifest (validation only checks it exists;
    a plan assumes 512 text tokens)."""
    from fastvideo.tiny import write_flux_dev_config

    root = tmp_path_factory.mktemp("recipes")
    manifest = root / "emb" / "manifest.json"
    manifest.parent.mkdir()
    manifest.write_text("{}")
    return write_flux_dev_config(root / "flux-dev"), manifest


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"dancegrpo_hps.yaml", "flow_grpo.yaml", "flow_grpo_fast.yaml", "mixgrpo.yaml", "dpo.yaml",
            "nft.yaml"} <= names, names
    assert not [p.name for p in RECIPE_DIR.iterdir() if p.suffix != ".yaml"], "scripts/recipes/ holds only YAMLs"


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_value_cites_its_source(recipe):
    """Every key line carries a comment on the same line or on the comment line(s) directly above it; every
    non-comment line is a key line or the continuation of one (a multi-line list), so no value escapes the rule."""
    lines = recipe.read_text().splitlines()
    data = yaml.safe_load(recipe.read_text())
    assert isinstance(data, dict) and data, f"{recipe.name}: not a mapping"
    keys = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        match = KEY_LINE.match(line)
        if match is None:
            assert line.startswith((" ", "\t")) and keys, \
                f"{recipe.name}:{i + 1}: neither a key line nor a continuation of one: {line!r}"
            continue
        keys.append(match.group(1))
        same_line = "#" in line.split(":", 1)[1]
        above = i > 0 and lines[i - 1].strip().startswith("#")
        assert same_line or above, f"{recipe.name}:{i + 1}: {match.group(1)} has no source comment: {line!r}"
    assert keys == list(data), f"{recipe.name}: key lines {keys} do not match the YAML keys {list(data)}"
    assert len(set(keys)) == len(keys), f"{recipe.name}: duplicate keys"
    leaked = MACHINE_KEYS & set(keys)
    assert not leaked, f"{recipe.name}: machine-specific keys {sorted(leaked)} belong on the command line"


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_parses_validates_and_fits(recipe, flux_dev, capsys):
    """The recipe with the model/data flags parses with its trainer (no unknown keys), validates for 8 ranks, and the
    trainer's --dry_run plans it within 80 GiB per GPU on FLUX.1-dev's configs; the header states that plan."""
    script = _trainer(recipe)
    parse, validate = TRAINERS[script]
    model, manifest = flux_dev
    stub = ["--pretrained_model_name_or_path", str(model), "--data_json_path", str(manifest)]

    args = parse(["--config", str(recipe), *stub])
    data = yaml.safe_load(recipe.read_text())
    for key, value in data.items():  # the file's values arrive as written (a null keeps the parser's default)
        if value is not None:
            got = list(getattr(args, key)) if isinstance(value, list) else getattr(args, key)
            assert got == value, f"{recipe.name}: {key} parsed as {got!r}, the file says {value!r}"
    counts = validate(args, WORLD)
    assert counts["world_size"] == WORLD

    capsys.readouterr()
    # no --data_json_path: a plan needs no embeddings (it assumes 512 text tokens)
    _load_trainer(script).main(["--config", str(recipe), *stub[:2], "--device", "cuda", "--dry_run",
                                "--dry_run_world_size", str(WORLD), "--dry_run_device_memory_gb", str(DEVICE_GB)])
    out = capsys.readouterr().out
    assert f"world size {WORLD}" in out, out
    assert "transformer 11.9" in out or "transformer 12.0" in out, out  # FLUX.1-dev's 11.9B (+ LoRA)
    peak = float(PEAK_LINE.search(out).group(1))
    assert f"fits in {DEVICE_GB:g} GiB per device" in out and peak <= DEVICE_GB, out
    header = HEADER_PLAN.search(recipe.read_text())
    assert header, f"{recipe.name}: the header must state the plan ('Memory (--dry_run --dry_run_world_size 8 ...): " \
                   "X GiB per GPU, fits ...')"
    assert abs(float(header.group(1)) - peak) <= 0.5, \
        f"{recipe.name}: the header says {header.group(1)} GiB per GPU, the plan now says {peak:.2f}; update it"
