"""scripts/recipes/*.yaml: each recipe names its trainer on its first line and its model's real-config preset on its
second (``# model: flux-dev-config``, ``sd3.5-medium-config``, ...), parses with that trainer's --config, validates for
8 ranks, plans within 80 GB per GPU on that preset's configs (the trainer's own --dry_run, run in two worker processes),
states that plan in its header, holds no machine-specific paths, names its source repository, and cites a source (or
"ours") for every value."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fastvideo import objectives as O
from test_memory import RECIPE as DANCE_FULL_FT

REPO = Path(__file__).resolve().parents[1]
RECIPE_DIR = REPO / "scripts" / "recipes"
RECIPES = sorted(RECIPE_DIR.glob("*.yaml"))
WORLD = 8
DEVICE_GB = 80.0

# trainer script -> (parse, validate)
TRAINERS = {
    "train_grpo_flux.py": (O.parse_grpo_args, O.validate_grpo),
    "train_dpo.py": (O.parse_dpo_args, O.validate_dpo),
    "train_nft.py": (O.parse_nft_args, O.validate_nft),
}
# flags whose values depend on the machine: they go on the command line, never in a recipe
MACHINE_KEYS = {"pretrained_model_name_or_path", "data_json_path", "output_dir", "device", "hps_checkpoint",
                "hps_model", "pickscore_model", "pickscore_processor", "clip_checkpoint", "aesthetic_checkpoint",
                "aesthetic_clip_checkpoint", "eval_data_json_path", "eval_prompts", "preference_file",
                "latent_cache_dir", "resume_from", "record_dir", "replay_dir", "dry_run", "dry_run_world_size",
                "dry_run_device_memory_gb", "config"}
KEY_LINE = re.compile(r"^([A-Za-z_]\w*)\s*:")
# A value's source, in the recipes' convention: "ours" (our own choice), or a pointer into the source it reproduces:
# a URL, an arXiv id, a flag of its launch script (--h 720), a file of its repository (base.py, scripts/train_flux.py),
# a config key or attribute (config.train.beta, actor.optim.lr, EMAModuleWrapper.get_current_decay), an assignment in
# its code or script (r=64, seed=714) or an identifier of its code (train_one_step, FSDP_EMA). Prose alone is none.
CITATION = re.compile(r"\bours\b|https?://\S+|\barXiv:?\s?\d{4}\.\d{4,5}|(?<![\w-])--[a-z]\w*|[\w/-]+\.(?:py|sh|yaml)\b"
                      r"|\b[A-Za-z_]\w+(?:\.[A-Za-z_]\w*)+|\b[A-Za-z_]\w*=(?!=)|\b[A-Za-z][A-Za-z0-9]*_\w+")
# the header names the source repository and a file in it: "owner/name path/to/file.py"
HEADER_SOURCE = re.compile(r"\b[\w-]+/[\w.-]+ [\w./-]+\.(?:py|sh|yaml)\b")
HEADER_PLAN = re.compile(r"Memory \(--dry_run --dry_run_world_size 8[^)]*\): (\d+(?:\.\d+)?) GiB per GPU, fits")
PEAK_LINE = re.compile(r"peak per rank = persistent \+ \w+\s+(\d+(?:\.\d+)?)")
# the real-config presets a recipe may plan on (fastvideo.tiny.build_preset) -> the transformer size its plan prints
# (the model's parameters plus the LoRA adapters): FLUX.1-dev 11.9B, SD3.5-Medium 2.24B, Qwen-Image 20.4B,
# FLUX.2-klein-4B 3.88B, FLUX.1-Kontext-dev 11.9B
PRESET_PARAMS = {
    "flux-dev-config": r"1[12]\.\d+B",
    "sd3.5-medium-config": r"2\.\d+B",
    "qwen-image-config": r"20\.\d+B",
    "flux2-klein-4b-config": r"[34]\.\d+B",
    "wan2.1-t2v-14b-config": r"14\.\d+B",
    "flux-kontext-dev-config": r"1[12]\.\d+B",
    "qwen-image-edit-config": r"20\.\d+B",
}


# Planned with the recipes, in the same two workers (one place in the slow tier plans FLUX.1-dev): a recipe (or none)
# with flags on top -> name: (recipe file or None, trainer, preset, flags)
PLAN_VARIANTS = {
    # the DPO launcher's MODEL_PATH recipe as a full fine-tune whose reference is refreshed every 10 steps
    "dpo+full+ref_refresh": ("dpo.yaml", "train_dpo.py", "flux-dev-config",
                             ["--lora_rank", "0", "--ref_update_interval", "10"]),
    # the NFT launcher's MODEL_PATH recipe as a full fine-tune: the old policy is a second transformer
    "nft+full": ("nft.yaml", "train_nft.py", "flux-dev-config", ["--lora_rank", "0", "--train_batch_size", "2"]),
    # DanceGRPO's full fine-tune at 720^2 with a KL term: the frozen reference
    "dancegrpo+full+kl": (None, "train_grpo_flux.py", "flux-dev-config", [*DANCE_FULL_FT, "--kl_beta", "0.04"]),
    # sequence parallelism at 1024^2: the same batch with --sp_size 1 and 4
    **{f"grpo+1024+sp{sp}": (None, "train_grpo_flux.py", "flux-dev-config",
                              ["--h", "1024", "--w", "1024", "--num_generations", "8", "--prompts_per_step", "4",
                               "--train_batch_size", "1", "--gradient_checkpointing", "--sp_size", str(sp)])
       for sp in (1, 4)},
}


def _extra_flags(recipe: Path, pairs: Path) -> list[str]:
    """Machine-specific flags a recipe needs besides the model and data: an offline DPO recipe's pair file."""
    return ["--preference_file", str(pairs)] if "offline" in recipe.stem else []


def _trainer(recipe: Path) -> str:
    first = recipe.read_text().splitlines()[0]
    match = re.fullmatch(r"# trainer: (\S+)", first.strip())
    assert match, f"{recipe.name}: the first line must be '# trainer: <script>.py', got {first!r}"
    assert match.group(1) in TRAINERS, f"{recipe.name}: unknown trainer {match.group(1)} (one of {sorted(TRAINERS)})"
    return match.group(1)


def _preset(recipe: Path) -> str:
    """The real-config preset a recipe plans on: its second line, ``# model: <preset>``."""
    lines = recipe.read_text().splitlines()
    second = lines[1] if len(lines) > 1 else ""
    match = re.fullmatch(r"# model: (\S+)", second.strip())
    assert match, f"{recipe.name}: the second line must be '# model: <preset>', got {second!r}"
    assert match.group(1) in PRESET_PARAMS, \
        f"{recipe.name}: unknown model preset {match.group(1)} (one of {sorted(PRESET_PARAMS)})"
    return match.group(1)


# Runs the trainers' own --dry_run for the recipes, each on the folder of the preset its "# model:" line names. Two
# workers share the work from the two ends of the preset-sorted lists: each claims the next unbuilt preset and writes
# its folder, then the next unplanned recipe, waiting for its preset's folder; working through one model's plans at a
# time, a worker's in-process trace memo (memory._TRACE_MEMO) serves the plans that repeat a trace. A preset that
# fails to build fails only its recipes.
WORKER = r"""
import contextlib, importlib.util, io, json, os, sys, time, traceback
from pathlib import Path

model_root, out_dir, world, device_gb, worker, presets, *jobs = sys.argv[1:]
presets = json.loads(presets)
if worker == "1":  # the second worker works from the other end of the preset-sorted list
    presets, jobs = presets[::-1], jobs[::-1]


def claim(path):
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


for preset in presets:
    folder = Path(model_root, preset)
    if claim(str(folder) + ".claim"):
        try:
            from fastvideo.tiny import build_preset

            build_preset(folder, preset)
        except BaseException:
            Path(str(folder) + ".failed").write_text(traceback.format_exc())
import diffusers, fastvideo.memory  # noqa: F401 (warm the imports while the other worker writes a folder)


def wait_for(preset):
    folder = Path(model_root, preset)
    deadline = time.time() + 300
    while not (folder / "model_index.json").is_file():
        failed = Path(str(folder) + ".failed")
        if failed.exists():
            raise RuntimeError(f"building the {preset} preset failed:\n" + failed.read_text())
        if time.time() > deadline:
            raise TimeoutError(f"the other worker did not write the {preset} preset")
        time.sleep(0.1)
    return str(folder)


for job in jobs:
    name, recipe, script, preset, extra = job.split("::", 4)
    out = str(Path(out_dir) / name)
    if not claim(out + ".claim"):
        continue  # the other worker took it
    buf = io.StringIO()
    try:
        model = wait_for(preset)
        spec = importlib.util.spec_from_file_location(Path(script).stem + "_dry_run", script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # registered first, as importlib's recipe does (dataclasses look it up)
        spec.loader.exec_module(module)
        with contextlib.redirect_stdout(buf):  # no --data_json_path: a plan needs no embeddings (512 text tokens)
            module.main([*(["--config", recipe] if recipe else []), "--pretrained_model_name_or_path", model,
                         "--output_dir", out + ".out", "--device", "cuda", "--dry_run", "--dry_run_world_size", world,
                         "--dry_run_device_memory_gb", device_gb, *json.loads(extra)])
        error = None
    except BaseException:
        error = traceback.format_exc()
    wrote = Path(out + ".out").exists()  # a dry run writes nothing
    Path(out + ".json").write_text(json.dumps({"error": error, "stdout": buf.getvalue(), "wrote": wrote}))
"""


@pytest.fixture(scope="session")  # once per session: the slow or evidence tier reads it too
def dry_runs(tmp_path_factory) -> dict[str, dict]:
    """recipe stem (or PLAN_VARIANTS name) -> {"error", "stdout", "wrote"} of `<trainer> --config RECIPE [FLAGS]
    --dry_run --dry_run_world_size 8` on the real configs of the recipe's model (its ``# model:`` preset, built with
    fastvideo.tiny.build_preset: no weights)."""
    root = tmp_path_factory.mktemp("recipe-plans")
    models = root / "models"
    models.mkdir()
    pairs = root / "pairs.jsonl"
    pairs.write_text("")
    presets = sorted({_preset(recipe) for recipe in RECIPES} | {v[2] for v in PLAN_VARIANTS.values()})
    jobs = [f"{recipe.stem}::{recipe}::{REPO / _trainer(recipe)}::{_preset(recipe)}::"
            f"{json.dumps(_extra_flags(recipe, pairs))}" for recipe in RECIPES]
    jobs += [f"{name}::{RECIPE_DIR / recipe if recipe else ''}::{REPO / script}::{preset}::{json.dumps(flags)}"
             for name, (recipe, script, preset, flags) in PLAN_VARIANTS.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    jobs.sort(key=lambda job: job.split("::")[3])  # by preset: each worker's plans of one model share its traces
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(models), str(root), str(WORLD), str(DEVICE_GB),
                                 str(i), json.dumps(presets), *jobs], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [w.communicate(timeout=600)[0] for w in workers]
    results = {}
    for name in [recipe.stem for recipe in RECIPES] + list(PLAN_VARIANTS):
        path = root / f"{name}.json"
        assert path.is_file(), f"no plan for {name}; worker output:\n" + "\n".join(logs)[-6000:]
        results[name] = json.loads(path.read_text())
    return results


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"dancegrpo_hps.yaml", "flow_grpo.yaml", "flow_grpo_fast.yaml", "mixgrpo.yaml", "dpo.yaml",
            "dpo_offline.yaml", "nft.yaml", "flow_grpo_sd3_geneval.yaml", "flow_grpo_sd3_ocr.yaml",
            "flow_grpo_sd3_pickscore.yaml", "flow_grpo_fast_sd3.yaml", "nft_sd3.yaml", "verl_omni_qwen_image_ocr.yaml",
            "flux2_klein_grpo.yaml", "awm_flux.yaml", "awm_sd3_pickscore.yaml", "awm_sd3_geneval.yaml",
            "awm_sd3_ocr.yaml", "grpo_guard_qwen_image_ocr.yaml", "flow_dppo_qwen_image_ocr.yaml",
            "grpo_guard_sd3.yaml", "grpo_guard_flux.yaml", "flow_dppo_sd3.yaml", "flow_grpo_wan.yaml"} <= names, names
    assert not [p.name for p in RECIPE_DIR.iterdir() if p.suffix != ".yaml"], "scripts/recipes/ holds only YAMLs"


def _comment_of(lines: list[str], i: int) -> str:
    """Key line ``i``'s own ``# ...`` and the comment lines right above it (a ``# ----`` header documents a section)."""
    above = []
    for line in reversed(lines[:i]):
        stripped = line.strip()
        if not stripped.startswith("#") or stripped.startswith("# ----"):
            break
        above.insert(0, stripped.lstrip("#").strip())
    value = lines[i].split(":", 1)[1]
    return " ".join(above + ([value.split("#", 1)[1].strip()] if "#" in value else []))


def _citations(comment: str, own_names: set[str]) -> list[str]:
    """The CITATIONs in ``comment``, but for bare names of our own keys and values (they point at no source)."""
    return [m.group(0) for m in CITATION.finditer(comment) if m.group(0) not in own_names]


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_value_cites_its_source(recipe):
    """The header names the source repository and a file in it; every key line's comment (same line or the comment
    lines directly above) cites where its value comes from (CITATION: a flag, file, config key or identifier of the
    source, a URL / arXiv id, or "ours"); every non-comment line is a key line or the continuation of one (a multi-line
    list), so no value escapes the rule."""
    text = recipe.read_text()
    lines = text.splitlines()
    data = yaml.safe_load(text)
    assert isinstance(data, dict) and data, f"{recipe.name}: not a mapping"
    header = " ".join(line.lstrip("#").strip() for line in lines[:next(i for i, line in enumerate(lines)
                                                                          if not line.startswith("#"))])
    assert HEADER_SOURCE.search(header), f"{recipe.name}: the header must name its source ('owner/repo path/file.py')"
    assert re.search(r"\bat commit [0-9a-f]{40}\b", header), \
        f"{recipe.name}: the header must name the source's commit ('at commit <40 hex digits>')"
    own_names = set(data) | {str(v) for v in data.values() if not isinstance(v, list)}
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
        comment = _comment_of(lines, i)
        assert _citations(comment, own_names), \
            f"{recipe.name}:{i + 1}: {match.group(1)}'s comment cites no source (a flag, file, config key or " \
            f"identifier of the source, a URL, or 'ours'): {comment!r}"
    assert keys == list(data), f"{recipe.name}: key lines {keys} do not match the YAML keys {list(data)}"
    assert len(set(keys)) == len(keys), f"{recipe.name}: duplicate keys"
    leaked = MACHINE_KEYS & set(keys)
    assert not leaked, f"{recipe.name}: machine-specific keys {sorted(leaked)} belong on the command line"


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_parses_and_validates(recipe, tmp_path):
    """The recipe with stub model/data flags parses with its trainer (no unknown keys, every value arrives as written)
    and validates for 8 ranks."""
    parse, validate = TRAINERS[_trainer(recipe)]
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text("{}")
    manifest = tmp_path / "manifest.json"
    manifest.write_text('{"negative": {"prompt": "", "file": "negative.safetensors"}}')  # CFG recipes need it
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("")
    args = parse(["--config", str(recipe), "--pretrained_model_name_or_path", str(model), "--data_json_path",
                  str(manifest), *_extra_flags(recipe, pairs)])
    assert args.config == [str(recipe)]
    for key, value in yaml.safe_load(recipe.read_text()).items():  # a null keeps the parser's default
        if value is not None:
            got = list(getattr(args, key)) if isinstance(value, list) else getattr(args, key)
            assert got == value, f"{recipe.name}: {key} parsed as {got!r}, the file says {value!r}"
    counts = validate(args, WORLD)
    assert counts["world_size"] == WORLD


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_names_its_model_preset(recipe, tmp_path):
    """The second line names a real-config preset (``# model: <preset>``) that fastvideo.tiny builds, and a recipe that
    sets --model_family names the family that ``auto`` picks for that preset's folder (FLUX.1's recipes leave it to
    auto)."""
    from fastvideo import models, tiny

    preset = _preset(recipe)
    assert preset == tiny.FLUX_DEV_CONFIG_PRESET or preset in tiny.FAMILY_PRESETS, preset
    family = yaml.safe_load(recipe.read_text()).get("model_family")
    if preset == tiny.FLUX_DEV_CONFIG_PRESET:
        assert family in (None, "auto", "flux1"), f"{recipe.name}: model_family {family!r} on {preset}"
    else:
        folder = tiny.build_preset(tmp_path / "config", preset)  # configs only: no weights
        found = models.resolve("auto", folder).name
        assert family == found, f"{recipe.name}: model_family {family!r}, but {preset}'s folder is {found!r}"


# slow for the default suite's time: the planner on FLUX.1-dev configs runs in the default suite through the launcher
# (test_launchers.py::test_grpo_launcher_dry_run_plans_the_flux_recipe); each recipe's flags parse and validate in
# test_recipe_parses_and_validates
@pytest.mark.slow(cover="test_recipes.py::test_recipe_parses_and_validates", cost_s=8)
@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_plan_fits_8x80gb(recipe, dry_runs):
    """The trainer's --dry_run for 8 ranks on its model preset's configs plans the recipe within 80 GiB per GPU (on
    that model: its transformer's size), and the recipe's header states that plan on that preset."""
    result = dry_runs[recipe.stem]
    assert result["error"] is None, f"{recipe.name}: --dry_run failed:\n{result['error']}"
    out = result["stdout"]
    assert f"world size {WORLD}" in out, out
    preset = _preset(recipe)
    if preset == "flux-dev-config":
        assert re.search(r"transformer 1[12]\.\d+B params", out), out  # FLUX.1-dev's 11.9B (+ LoRA adapters)
    assert re.search(rf"transformer {PRESET_PARAMS[preset]} params", out), out
    peak = float(PEAK_LINE.search(out).group(1))
    assert f"fits in {DEVICE_GB:g} GiB per device" in out and peak <= DEVICE_GB, out
    header = HEADER_PLAN.search(recipe.read_text())
    assert header, f"{recipe.name}: the header must state the plan ('Memory (--dry_run --dry_run_world_size 8 ...): " \
                   "X GiB per GPU, fits ...')"
    assert f"on the {preset} preset" in header.group(0), \
        f"{recipe.name}: the header's plan must name the preset it was measured on ({preset}): {header.group(0)!r}"
    assert abs(float(header.group(1)) - peak) <= 0.5, \
        f"{recipe.name}: the header says {header.group(1)} GiB per GPU, the plan now says {peak:.2f}; update it"
    assert not result["wrote"], f"{recipe.name}: the dry run wrote its --output_dir"
    # a guided rollout (true CFG: --cfg_scale > 1) plans its doubled batch
    guided = float(yaml.safe_load(recipe.read_text()).get("cfg_scale", 1.0)) > 1.0
    assert ("x 2 (CFG)" in out) == guided, (recipe.name, guided)


def _plan(dry_runs: dict, name: str) -> str:
    result = dry_runs[name]
    assert result["error"] is None, f"{name}: --dry_run failed:\n{result['error']}"
    assert not result["wrote"], f"{name}: the dry run wrote its --output_dir"
    return result["stdout"]


# slow for the default suite's time, as the recipes' plans (the same fixture)
@pytest.mark.slow(cover="test_launchers.py::test_grpo_launcher_dry_run_plans_the_flux_recipe", cost_s=2)
def test_dpo_plans_online_lora_and_a_refreshed_reference(dry_runs):
    """The DPO launcher's recipe on FLUX.1-dev (LoRA 64, 16 prompts x 16 images over 8 ranks, 512 px) fits 80 GiB;
    a full fine-tune with a refreshed reference plans the fp32 snapshot and the weights set aside while it is
    swapped in."""
    lora = _plan(dry_runs, "dpo")
    assert "samples_per_rank=32" in lora and "pairs_per_rank=2" in lora and "fits in 80 GiB" in lora
    assert "micro-batch 4 x (1024 image" in lora and "clean latents of the step" in lora
    assert "reference snapshot" not in lora
    full = _plan(dry_runs, "dpo+full+ref_refresh")
    assert "reference snapshot (fp32, sharded)" in full and "set aside in the swap" in full


@pytest.mark.slow(cover="test_launchers.py::test_grpo_launcher_dry_run_plans_the_flux_recipe", cost_s=2)
def test_nft_plans_the_old_policy_as_an_adapter_or_a_second_transformer(dry_runs):
    """The NFT launcher's recipe on FLUX.1-dev fits 80 GiB with the old adapter; a full fine-tune plans the second
    fp32 transformer and the frozen reference."""
    lora = _plan(dry_runs, "nft")
    assert "samples_per_rank=144" in lora and "fits in 80 GiB" in lora
    assert "old policy: adapter 'old' (fp32, sharded)" in lora and "old-policy forward (no grad)" in lora
    full = _plan(dry_runs, "nft+full")
    assert "old policy: second transformer (fp32 master, sharded)" in full
    assert "reference policy (frozen, compute dtype)" in full and "fits in 80 GiB" in full


@pytest.mark.slow(cover="test_memory.py::test_plan_arithmetic_for_flux_dev", cost_s=2)
def test_dry_run_plans_the_frozen_reference_of_a_full_fine_tune_in_bf16(dry_runs):
    """DanceGRPO's full fine-tune (720^2, 8 ranks) with --kl_beta on FLUX.1-dev: the frozen reference is planned in
    the compute dtype, loaded once and never copied."""
    out = _plan(dry_runs, "dancegrpo+full+kl")
    ref_line = next(line for line in out.splitlines() if "reference policy (frozen" in line)
    assert " 2.77 " in ref_line, ref_line  # bf16: 2 B x 11.9B params / 8 ranks = 2.77 GiB, loaded, never a copy
    assert "fits in 80 GiB" in out


@pytest.mark.slow(cover="test_sequence_parallel.py::test_sp_validation_before_loading", cost_s=2)
def test_dry_run_plans_sequence_parallel_activations(dry_runs):
    """The planner at FLUX.1-dev's widths: --sp_size 4 at 1024² holds about a third of the activations."""
    def activations(out: str) -> float:
        line = next(line for line in out.splitlines() if "activations, micro-batch" in line)
        return float(line[2 + 56 + 12:2 + 56 + 12 + 11])  # the device GiB column

    out1, out4 = _plan(dry_runs, "grpo+1024+sp1"), _plan(dry_runs, "grpo+1024+sp4")
    act1, act4 = activations(out1), activations(out4)
    assert 0.2 * act1 < act4 < 0.4 * act1  # measured 0.33: the sequence-independent part stays
    assert "--sp_size 4: 1024 + 128 tokens per rank" in out4
    assert "world_size=8, dp_size=2, sp_size=4" in out4


def test_recipes_md_equals_the_recipe_files():
    """docs/recipes.md is ``python -m fastvideo.recipe_doc``'s rendering of the recipe files as they are now: every
    value with its source comment, every recipe's header (rerun the command after editing a recipe)."""
    from fastvideo import recipe_doc

    page = (REPO / "docs" / "recipes.md").read_text()
    assert page == recipe_doc.render(), "docs/recipes.md is stale: run python -m fastvideo.recipe_doc"
    for recipe in RECIPES:
        values = yaml.safe_load(recipe.read_text())
        section = page.split(f"## {recipe.name}\n", 1)[1].split("\n## ", 1)[0]
        assert all(f"| `{key}` |" in section for key in values), recipe.name
