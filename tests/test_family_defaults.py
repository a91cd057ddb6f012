"""Each family's stock sampler defaults are the trainers' defaults (issue 51, point 5): an unset --h/--w,
--sampling_steps, --cfg_scale or --guidance_scale takes the value the family's diffusers pipeline uses (read here from
the pipeline's own ``__call__`` signature, not from our table), the start-up note says which values came from the
family, and a flag or recipe value wins. Preprocessing stores the family's negative prompt where that pipeline guides
with CFG, and a CFG default without negative embeddings is refused before anything loads. Default tier, ~6 s (the
real-config presets are configs only)."""
from __future__ import annotations

import inspect
import json

import diffusers
import pytest

from fastvideo import models, objectives, options, rollout

# preset -> (stock pipeline class, the __call__ parameter that is its CFG scale, or None: no CFG by default)
STOCK = {
    "flux-dev-config": ("FluxPipeline", "true_cfg_scale"),
    "sd3.5-medium-config": ("StableDiffusion3Pipeline", "guidance_scale"),
    "qwen-image-config": ("QwenImagePipeline", "true_cfg_scale"),
    "flux2-klein-4b-config": ("Flux2KleinPipeline", None),  # step-distilled: the pipeline skips CFG (is_distilled)
    "flux2-dev-tiny": ("Flux2Pipeline", None),  # guidance-distilled: guidance_scale is the embedded guidance
}
# the pipelines' distilled guidance input (the others have none)
GUIDANCE = {"FluxPipeline": "guidance_scale", "Flux2Pipeline": "guidance_scale"}


def _call_default(pipeline: str, name: str):
    return inspect.signature(getattr(diffusers, pipeline).__call__).parameters[name].default


@pytest.fixture(scope="module")
def folders(tiny_preset):
    return {preset: tiny_preset(preset) for preset in STOCK}


@pytest.mark.parametrize("preset", list(STOCK))
def test_unset_sampler_flags_take_the_stock_pipelines_defaults(preset, folders):
    pipeline, cfg_param = STOCK[preset]
    args = objectives.parse_grpo_args(["--pretrained_model_name_or_path", str(folders[preset])])
    options.take_default_notes()
    rollout.fill_family_sampling(args)
    note = " ".join(options.take_default_notes())
    # every family pipeline here samples 1024 x 1024 by default (default_sample_size 128 x VAE factor 8)
    assert (args.h, args.w) == (1024, 1024)
    assert args.sampling_steps == _call_default(pipeline, "num_inference_steps")
    assert args.cfg_scale == (_call_default(pipeline, cfg_param) if cfg_param else 1.0)
    if pipeline in GUIDANCE:
        assert args.guidance_scale == _call_default(pipeline, GUIDANCE[pipeline])
        assert f"--guidance_scale {args.guidance_scale:g}" in note
    else:
        assert args.guidance_scale == rollout.UNUSED_GUIDANCE and "--guidance_scale" not in note
    family = models.family_for(args).name
    assert f"--h 1024 --w 1024 --sampling_steps {args.sampling_steps} --cfg_scale {args.cfg_scale:g}" in note
    assert f"the {family} pipeline's defaults" in note, note


def test_flags_win_and_are_not_said(folders):
    args = objectives.parse_grpo_args(["--pretrained_model_name_or_path", str(folders["sd3.5-medium-config"]),
                                       "--h", "512", "--w", "512", "--cfg_scale", "4.5"])
    options.take_default_notes()
    rollout.fill_family_sampling(args)
    note = " ".join(options.take_default_notes())
    assert (args.h, args.w, args.cfg_scale, args.sampling_steps) == (512, 512, 4.5, 28)
    assert note.startswith("--sampling_steps 28:") and "--h" not in note and "--cfg_scale" not in note


def test_a_cfg_default_without_negative_embeddings_is_refused_before_loading(folders, tmp_path):
    """SD3.5's stock CFG (7) needs the negative prompt's rows: a store without them is refused by validation with
    both fixes named; with them, or with --cfg_scale 1, validation passes."""
    manifest = tmp_path / "manifest.json"
    manifest.write_text("{}")
    base = ["--pretrained_model_name_or_path", str(folders["sd3.5-medium-config"]), "--data_json_path",
            str(manifest), "--h", "256", "--w", "256", "--num_generations", "8", "--prompts_per_step", "1"]
    with pytest.raises(ValueError, match=r"--cfg_scale 7 .*negative_prompt .*or pass --cfg_scale 1"):
        objectives.validate_grpo(objectives.parse_grpo_args(base), 1)
    objectives.validate_grpo(objectives.parse_grpo_args([*base, "--cfg_scale", "1"]), 1)
    manifest.write_text(json.dumps({"negative": {"prompt": "", "file": "negative.safetensors"}}))
    args = objectives.parse_grpo_args(base)
    objectives.validate_grpo(args, 1)
    assert args.cfg_scale == 7.0


@pytest.mark.parametrize("preset, negative", [("sd3.5-medium-config", ""), ("qwen-image-config", " "),
                                              ("flux-dev-config", None), ("flux2-klein-4b-config", None)])
def test_preprocessing_stores_the_negative_prompt_of_a_cfg_pipeline(preset, negative, folders):
    """preprocess_embeddings.py's unset --negative_prompt: the family's where its pipeline guides with CFG (Qwen-Image's
    model card passes " "), none where it does not."""
    import preprocess_embeddings

    args = preprocess_embeddings.parse_args(["--model_path", str(folders[preset]), "--prompt_file", "p.txt",
                                             "--output_dir", "out"])
    preprocess_embeddings.fill_family_text_defaults(args)
    assert args.negative_prompt == negative
    assert args.max_sequence_length == models.resolve("auto", folders[preset]).defaults.max_sequence_length
