"""Model families (fastvideo.models): --model_family auto/name/package.module:Class resolution and its errors, the
transformer's family through wrappers, FLUX.1's adapter covering the whole interface, and a user's adapter outside
this package driving a GRPO run end to end (bit-identical metrics to the built-in adapter it extends)."""
from __future__ import annotations

import inspect
import json
import re
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import comparable, run_torchrun
from test_train_grpo import common_args

from fastvideo import models
from fastvideo.logging import read_metrics
from fastvideo.models.base import ModelFamily
from fastvideo.models.flux import Flux1

# A user's adapter: FLUX.1's, with a marker file per rank proving the trainer reached the family through it.
USER_ADAPTER = textwrap.dedent('''
    import os
    from pathlib import Path

    from fastvideo.models.flux import Flux1


    class MarkedFlux(Flux1):
        name = "marked-flux"

        def _mark(self, what):
            path = Path(os.environ["MARK_DIR"]) / f"{what}-{os.environ.get('RANK', '0')}"
            path.touch()

        def build_transformer(self, path, dtype=None):
            self._mark("build")
            return super().build_transformer(path, dtype)

        def predict_velocity(self, transformer, latents, sigma, cond, shared):
            self._mark("velocity")
            return super().predict_velocity(transformer, latents, sigma, cond, shared)
''')


def test_auto_reads_model_index(tiny_flux_dir, tmp_path):
    assert json.loads((tiny_flux_dir / "model_index.json").read_text())["_class_name"] == "FluxPipeline"
    family = models.resolve("auto", tiny_flux_dir)
    assert isinstance(family, Flux1) and family is models.resolve("flux1") and "flux1" in models.names()
    assert models.resolve("auto", tmp_path) is family  # no model_index.json: FLUX.1, the layout before families


def test_unserved_pipeline_names_the_fix(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(ValueError, match="names 'StableDiffusionXLPipeline', which no model family serves") as err:
        models.resolve("auto", tmp_path)
    assert "--model_family package.module:Class" in str(err.value) and "docs/model-families.md" in str(err.value)


@pytest.mark.parametrize("spec, message", [
    ("nonsense", "neither 'auto', a family (flux1, sd3, qwen-image, flux2, wan, flux-kontext, qwen-image-edit, "
                 "qwen-image-edit-plus) nor 'package.module:Class'"),
    ("no_such_package_xyz:Family", "cannot import 'no_such_package_xyz'"),
    ("fastvideo.models.flux:LatentGeometry", "has no ModelFamily subclass 'LatentGeometry'"),
])
def test_bad_model_family_is_one_clear_error(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        models.resolve(spec)


def test_bad_model_family_stops_the_trainer_before_loading(tiny_flux_dir, tiny_data, tmp_path):
    """The flag check (before torchrun and before any model loads): one line, exit status 2, nothing written."""
    import subprocess
    import sys

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "train_grpo_flux.py", *common_args(tiny_flux_dir, tiny_data, out)[1:],
                           "--model_family", "nonsense", "--check_only"], cwd=Path(__file__).parents[1],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "error: --model_family 'nonsense' is neither" in proc.stderr
    assert not out.exists()


def test_family_of_through_tags_and_classes(tiny_flux_dir):
    from diffusers import FluxTransformer2DModel

    family = models.resolve("flux1")
    built = family.build_transformer(tiny_flux_dir)
    assert models.family_of(built) is family
    config = FluxTransformer2DModel.load_config(tiny_flux_dir / "transformer")
    plain = FluxTransformer2DModel.from_config(config)  # built by diffusers directly: found by its class
    assert models.family_of(plain) is family
    with pytest.raises(ValueError, match="belongs to no registered model family"):
        models.family_of(torch.nn.Linear(2, 2))


def test_flux1_implements_the_whole_interface():
    """Every method the interface leaves to the adapter (it raises NotImplementedError there) is FLUX.1's own, and
    the class attributes the trainers read are set."""
    edit_only = {"encode_edits"}  # an image editor's (FluxKontext's: tests/test_family_flux_kontext.py)
    required = [name for name, fn in vars(ModelFamily).items()
                if inspect.isfunction(fn) and "self._missing(" in inspect.getsource(fn)]
    assert len(required) >= 15 and edit_only <= set(required), required
    assert not [name for name in required if getattr(Flux1, name) is getattr(ModelFamily, name)
                and name not in edit_only]
    from fastvideo.models.flux_kontext import FluxKontext

    assert FluxKontext.encode_edits is not ModelFamily.encode_edits
    for attribute in ("name", "pipeline_classes", "transformer_classes", "text_components", "embedding_keys",
                      "lora_target_modules"):
        assert getattr(Flux1, attribute), attribute
    assert Flux1.defaults.steps == 28 and Flux1.defaults.guidance == 3.5


def test_missing_method_names_the_adapter_and_the_docs():
    class Half(ModelFamily):
        name = "half"

    with pytest.raises(NotImplementedError, match=r"does not implement predict_velocity.*docs/model-families.md"):
        Half().predict_velocity(None, torch.zeros(1), 0.5, {}, {})


# slow for the default suite's time (~25 s): every default trainer test reaches the model through the family interface
# (Flux1), and package.module:Class resolution runs in test_bad_model_family_is_one_clear_error
@pytest.mark.slow(cover="test_models.py::test_bad_model_family_stops_the_trainer_before_loading", cost_s=25)
def test_user_adapter_trains_grpo_bit_identically(tiny_flux_dir, tiny_data, tmp_path):
    """``--model_family mypkg.families:MarkedFlux`` (a module outside this package, on PYTHONPATH): both ranks build
    through it and every velocity goes through it, and the run's metrics equal the built-in adapter's exactly."""
    package = tmp_path / "site" / "mypkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "families.py").write_text(USER_ADAPTER)
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {"PYTHONPATH": str(tmp_path / "site"), "MARK_DIR": str(marks)}
    flags = ("--max_train_steps", "1", "--lora_rank", "4", "--checkpointing_steps", "100")
    run_torchrun(common_args(tiny_flux_dir, tiny_data, tmp_path / "builtin", *flags), env=env)
    assert not list(marks.iterdir())
    run_torchrun(common_args(tiny_flux_dir, tiny_data, tmp_path / "user", *flags, "--model_family",
                             "mypkg.families:MarkedFlux"), env=env)
    assert sorted(p.name for p in marks.iterdir()) == ["build-0", "build-1", "velocity-0", "velocity-1"]
    a, b = (read_metrics(tmp_path / run / "metrics.jsonl") for run in ("builtin", "user"))
    assert len(a) == 1 and [comparable(r) for r in a] == [comparable(r) for r in b]
    assert json.loads((tmp_path / "user" / "config.json").read_text())["model_family"] == "mypkg.families:MarkedFlux"
    shutil.rmtree(tmp_path / "site")
