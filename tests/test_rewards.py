"""Rewards: registry/spec parsing, JPEG rewards, HPS v2 (tiny checkpoint), CLIP score, aesthetic, PickScore."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch

from fastvideo.rewards import REWARD_NAMES, build_reward, parse_reward_spec

PROMPTS = ["a red fox in the snow", "a bowl of ramen", "an astronaut riding a horse"]


def _smooth_images(n: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    """(n,3,h,w) in [0,1]: upsampled low-resolution noise, i.e. image-like content."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, 6, 6, generator=g)
    return torch.nn.functional.interpolate(low, size=(h, w), mode="bilinear", align_corners=False)


def _to_pil(image: torch.Tensor):
    from PIL import Image

    return Image.fromarray((image.permute(1, 2, 0) * 255).round().clamp(0, 255).to(torch.uint8).numpy())


# ----------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tiny_hps(tmp_path_factory):
    """(checkpoint path, config JSON path) of the tiny HPS model."""
    from fastvideo.rewards.hpsv2 import TINY_CHECKPOINT, TINY_CONFIG, build_tiny_hps

    out = build_tiny_hps(tmp_path_factory.mktemp("hps-tiny"), seed=0)
    return out / TINY_CHECKPOINT, out / TINY_CONFIG


@pytest.fixture(scope="module")
def hps_fn(tiny_hps):
    ckpt, cfg = tiny_hps
    return build_reward("hpsv2", "cpu", hps_checkpoint=str(ckpt), hps_model=str(cfg))


@pytest.fixture(scope="module")
def tiny_hf_clip(tmp_path_factory):
    """(model dir, processor dir) of a tiny transformers CLIPModel with a byte-level CLIP tokenizer."""
    from open_clip.tokenizer import bytes_to_unicode
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    root = tmp_path_factory.mktemp("tiny-hf-clip")
    chars = list(bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(tokens)}
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[])
    processor = CLIPProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=tokenizer)
    processor.save_pretrained(root / "processor")
    special = dict(bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"],
                   pad_token_id=vocab["<|endoftext|>"])
    config = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=77, **special),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=16),
        projection_dim=16)
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(root / "model")
    return root / "model", root / "processor"


# ----------------------------------------------------------------------------------------------- registry
def test_import_is_light():
    code = ("import sys, fastvideo.rewards, fastvideo.rewards.hpsv2, fastvideo.rewards.pickscore, "
            "fastvideo.rewards.aesthetic, fastvideo.rewards.clipscore, fastvideo.rewards.jpeg; "
            "print(sorted(m for m in ('open_clip', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_parse_reward_spec():
    assert parse_reward_spec("hpsv2:1.0,jpeg_compressibility:0.5") == [("hpsv2", 1.0), ("jpeg_compressibility", 0.5)]
    assert parse_reward_spec(" pickscore , aesthetic: -2e-1 ") == [("pickscore", 1.0), ("aesthetic", -0.2)]
    assert set(REWARD_NAMES) == {"hpsv2", "pickscore", "clipscore", "aesthetic", "jpeg_compressibility",
                                 "jpeg_incompressibility", "toyworld"}


@pytest.mark.parametrize("spec, match", [
    ("hps:1.0", "unknown reward 'hps'.*valid names: hpsv2, pickscore"),
    ("hpsv2:abc", "malformed weight 'abc'.*valid names"),
    ("hpsv2:", "malformed weight ''"),
    ("hpsv2:nan", "must be finite"),
    ("hpsv2,hpsv2:2", "appears twice"),
    ("", "empty reward spec"),
    ("jpeg_compressibility:1,", "unknown reward ''"),
])
def test_bad_specs_are_value_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        build_reward(spec, "cpu")


@pytest.mark.parametrize("spec, flag", [
    ("hpsv2", "--hps_checkpoint"),
    ("clipscore", "--clip_checkpoint"),
    ("pickscore", "--pickscore_model"),
    ("aesthetic", "--aesthetic_checkpoint"),
    ("jpeg_compressibility,aesthetic", "--aesthetic_checkpoint"),
])
def test_missing_checkpoint_names_the_flag(spec, flag):
    with pytest.raises(FileNotFoundError, match=flag):
        build_reward(spec, "cpu")


def test_missing_paths_name_the_flag(tmp_path, tiny_hps):
    ckpt, _ = tiny_hps
    with pytest.raises(FileNotFoundError, match="--hps_checkpoint.*nope.pt"):
        build_reward("hpsv2", "cpu", hps_checkpoint=str(tmp_path / "nope.pt"))
    with pytest.raises(FileNotFoundError, match="--hps_model"):
        build_reward("hpsv2", "cpu", hps_checkpoint=str(ckpt), hps_model=str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="--pickscore_processor"):
        build_reward("pickscore", "cpu", pickscore_model=str(tmp_path))
    with pytest.raises(ValueError, match="--hps_model 'ViT-Nope'"):
        build_reward("hpsv2", "cpu", hps_checkpoint=str(ckpt), hps_model="ViT-Nope")


def test_bad_inputs():
    fn = build_reward("jpeg_compressibility", "cpu")
    with pytest.raises(ValueError, match="one prompt per image"):
        fn(torch.rand(2, 3, 8, 8), ["only one"])
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        fn(torch.rand(2, 8, 8), ["a", "b"])


# ----------------------------------------------------------------------------------------------- JPEG
def test_jpeg_rewards_rank_flat_above_noise():
    flat = torch.full((1, 3, 64, 64), 0.5)
    noise = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    images, prompts = torch.cat([flat, noise]), ["flat", "noise"]
    comp = build_reward("jpeg_compressibility", "cpu")(images, prompts)["jpeg_compressibility"]
    incomp = build_reward("jpeg_incompressibility", "cpu")(images, prompts)["jpeg_incompressibility"]
    assert comp[0] > comp[1] and incomp[0] < incomp[1]
    torch.testing.assert_close(comp, -incomp)


def test_jpeg_value_is_size_over_500_kb():
    import io

    images = _smooth_images(3, 48, 80)
    sizes = []
    for image in images:
        buffer = io.BytesIO()
        _to_pil(image).save(buffer, format="JPEG", quality=95)
        sizes.append(buffer.tell() / 1000 / 500)
    out = build_reward("jpeg_incompressibility", "cpu")(images, PROMPTS)
    torch.testing.assert_close(out["jpeg_incompressibility"], torch.tensor(sizes, dtype=torch.float32))


def test_jpeg_thread_pool_matches_serial(monkeypatch):
    from fastvideo.rewards import jpeg
    from fastvideo.rewards.jpeg import JpegSizeScorer

    monkeypatch.setattr(jpeg, "_PARALLEL_MIN_PIXELS", 0)
    images = torch.rand(3, 3, 40, 40, generator=torch.Generator().manual_seed(1))
    pooled = JpegSizeScorer(-1.0, max_workers=2)(images, PROMPTS)
    serial = JpegSizeScorer(-1.0, max_workers=1)(images, PROMPTS)
    assert torch.equal(pooled, serial)


def test_weighted_sum_and_components():
    images = torch.cat([torch.full((1, 3, 32, 32), 0.3), torch.rand(2, 3, 32, 32)])
    fn = build_reward("jpeg_compressibility:2.0,jpeg_incompressibility:0.5", "cpu")
    out = fn(images, PROMPTS)
    assert list(out) == ["total", "jpeg_compressibility", "jpeg_incompressibility"]
    for value in out.values():
        assert value.shape == (3,) and value.dtype == torch.float32 and value.device.type == "cpu"
    expected = 2.0 * out["jpeg_compressibility"] + 0.5 * out["jpeg_incompressibility"]
    torch.testing.assert_close(out["total"], expected)
    assert fn.weights == {"jpeg_compressibility": 2.0, "jpeg_incompressibility": 0.5}


def test_nan_image_names_reward_and_prompt():
    images = torch.rand(3, 3, 16, 16)
    images[1, 0, 3, 3] = float("nan")
    with pytest.raises(ValueError, match="'jpeg_compressibility'.*'a bowl of ramen'.*NaN"):
        build_reward("jpeg_compressibility", "cpu")(images, PROMPTS)


# ----------------------------------------------------------------------------------------------- HPS v2
def test_tiny_hps_is_small_and_deterministic(tmp_path, tiny_hps):
    from fastvideo.rewards.hpsv2 import TINY_CHECKPOINT, build_tiny_hps

    ckpt, cfg = tiny_hps
    assert ckpt.stat().st_size < 5e6
    assert set(json.loads(cfg.read_text())) >= {"embed_dim", "vision_cfg", "text_cfg"}
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    assert digest(build_tiny_hps(tmp_path / "again", seed=0) / TINY_CHECKPOINT) == digest(ckpt)
    assert digest(build_tiny_hps(tmp_path / "other", seed=1) / TINY_CHECKPOINT) != digest(ckpt)
    state = torch.load(ckpt, weights_only=True)
    assert list(state) == ["state_dict"]  # HPS's checkpoint format, ViT-H-14's key layout
    keys = state["state_dict"].keys()
    assert {"visual.conv1.weight", "visual.proj", "token_embedding.weight", "text_projection", "logit_scale"} <= keys


def test_hps_scores_finite_deterministic_batch_invariant(hps_fn):
    images = _smooth_images(3, 64, 96)
    scores = hps_fn(images, PROMPTS)["hpsv2"]
    assert torch.isfinite(scores).all() and scores.abs().max() <= 1.0
    torch.testing.assert_close(hps_fn(images, PROMPTS)["hpsv2"], scores, rtol=0, atol=0)
    single = torch.cat([hps_fn(images[i:i + 1], PROMPTS[i:i + 1])["hpsv2"] for i in range(3)])
    torch.testing.assert_close(single, scores, rtol=0, atol=1e-5)
    swapped = hps_fn(images, PROMPTS[::-1])["hpsv2"]
    assert not torch.allclose(swapped, scores)  # the prompt matters
    assert hps_fn(images[:1], PROMPTS[:1])["total"].item() == pytest.approx(scores[0].item(), abs=1e-5)


def test_hps_preprocess_pads_rather_than_crops():
    from fastvideo.rewards._common import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
    from fastvideo.rewards.hpsv2 import hps_preprocess, hps_resize_max_size

    images = 0.2 + 0.6 * _smooth_images(2, 64, 128)  # content never 0
    resized = hps_resize_max_size(images, 224)
    assert resized.shape == (2, 3, 224, 224)
    assert (resized[:, :, :56] == 0).all() and (resized[:, :, 168:] == 0).all()  # 112 rows of content, centred
    assert (resized[:, :, 56:168] > 0).all()
    tall = hps_resize_max_size(images.transpose(2, 3), 224)
    assert (tall[..., :56] == 0).all() and (tall[..., 168:] == 0).all() and (tall[..., 56:168] > 0).all()
    normalized = hps_preprocess(images)
    assert normalized.dtype == torch.float32
    pad_value = -torch.tensor(OPENAI_CLIP_MEAN) / torch.tensor(OPENAI_CLIP_STD)
    torch.testing.assert_close(normalized[0, :, 0, 0], pad_value)


def _hps_reference(image: torch.Tensor) -> torch.Tensor:
    """HPS v2's preprocess_val on one image, in plain torchvision (hpsv2 1.2.0, src/open_clip/transform.py).

    image_transform(224, is_train=False, resize_longest_max=True): ToTensor() of the uint8 PIL image, then
    ResizeMaxSize(224, fill=0): scale = 224 / max(h, w); new_size = round(dim * scale); F.resize(tensor,
    new_size, BICUBIC) (antialias=True, torchvision's default since 0.17); F.pad([pad_w//2, pad_h//2,
    pad_w - pad_w//2, pad_h - pad_h//2], fill=0); then Normalize(OPENAI_DATASET_MEAN, OPENAI_DATASET_STD).
    HPS guards resize and pad with ``if scale != 1.0`` (a 224x150 image stays 224x150); we pad it anyway.
    """
    import torchvision.transforms.functional as TF
    from torchvision.transforms import InterpolationMode

    tensor = TF.to_tensor(_to_pil(image))
    h, w = tensor.shape[1:]
    scale = 224 / float(max(h, w))
    new_size = [round(dim * scale) for dim in (h, w)]
    tensor = TF.resize(tensor, new_size, interpolation=InterpolationMode.BICUBIC, antialias=True)
    pad_h, pad_w = 224 - new_size[0], 224 - new_size[1]
    tensor = TF.pad(tensor, [pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2], fill=0)
    return TF.normalize(tensor, (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))


@pytest.mark.parametrize("h, w", [
    (64, 64),  # upscaled noise
    (512, 384), (384, 512),  # downscaled, both orientations
    (64, 128), (128, 64), (37, 53),  # upscaled non-square, odd padding
    (224, 150), (150, 224),  # longer side already 224: HPS leaves these unpadded, we pad
])
def test_hps_preprocess_matches_hps_torchvision_transform(h, w):
    from fastvideo.rewards.hpsv2 import hps_preprocess

    g = torch.Generator().manual_seed(h * 1000 + w)
    edges = torch.zeros(1, 3, h, w)
    edges[..., w // 3:2 * w // 3] = 1.0  # hard edges, where bicubic overshoots [0, 1]
    images = torch.cat([torch.rand(2, 3, h, w, generator=g), _smooth_images(1, h, w), edges])
    ours = hps_preprocess(images)
    reference = torch.stack([_hps_reference(image) for image in images])
    assert ours.shape == reference.shape == (4, 3, 224, 224) and ours.dtype == torch.float32
    assert (ours - reference).abs().max().item() < 1e-5
    if max(h, w) == 224:  # unpadded by HPS: the content is the input itself, centred in zero padding
        pad_h, pad_w = 224 - h, 224 - w
        core = ours[..., pad_h // 2:pad_h // 2 + h, pad_w // 2:pad_w // 2 + w]
        std = torch.tensor((0.26862954, 0.26130258, 0.27577711)).view(1, 3, 1, 1)
        mean = torch.tensor((0.48145466, 0.4578275, 0.40821073)).view(1, 3, 1, 1)
        torch.testing.assert_close(core * std + mean, (images * 255).round() / 255, rtol=0, atol=1e-6)


def test_hps_preprocess_differs_from_open_clip_pil_transform():
    """open_clip's PIL path (two uint8 passes, rounded and clipped) is what HPS's own transform is not."""
    from open_clip.transform import image_transform

    from fastvideo.rewards.hpsv2 import hps_preprocess

    transform = image_transform(224, is_train=False, resize_mode="longest", fill_color=0)
    images = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))  # noise, upscaled 3.5x
    pil_path = transform(_to_pil(images[0]))[None]
    std = torch.tensor((0.26862954, 0.26130258, 0.27577711)).view(1, 3, 1, 1)
    grey_levels = (hps_preprocess(images) - pil_path).abs() * std * 255
    assert grey_levels.max() > 10  # ~45 levels measured
    torch.testing.assert_close(hps_preprocess(images), _hps_reference(images[0])[None], rtol=0, atol=1e-5)


def test_hps_loader_accepts_module_prefix(tmp_path, tiny_hps, hps_fn):
    ckpt, cfg = tiny_hps
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    prefixed = tmp_path / "ddp.pt"
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}, "epoch": 3}, prefixed)
    images = _smooth_images(2, 64, 64)
    fn = build_reward("hpsv2", "cpu", hps_checkpoint=str(prefixed), hps_model=str(cfg))
    torch.testing.assert_close(fn(images, PROMPTS[:2])["hpsv2"], hps_fn(images, PROMPTS[:2])["hpsv2"])


def test_hps_architecture_mismatch_names_model_flag(tmp_path, tiny_hps):
    from fastvideo.rewards.hpsv2 import TINY_MODEL_CONFIG

    ckpt, _ = tiny_hps
    other = json.loads(json.dumps(TINY_MODEL_CONFIG))
    other["vision_cfg"]["width"] = 48
    path = tmp_path / "other.json"
    path.write_text(json.dumps(other))
    with pytest.raises(ValueError, match="--hps_checkpoint.*does not fit.*--hps_model"):
        build_reward("hpsv2", "cpu", hps_checkpoint=str(ckpt), hps_model=str(path))


def test_hps_nan_image_names_reward_and_prompt(hps_fn):
    images = _smooth_images(3, 32, 32)
    images[2] = float("nan")
    with pytest.raises(ValueError, match="'hpsv2'.*'an astronaut riding a horse'"):
        hps_fn(images, PROMPTS)


def test_hps_combined_with_jpeg(tiny_hps, hps_fn):
    ckpt, cfg = tiny_hps
    images = _smooth_images(3, 64, 64)
    fn = build_reward("hpsv2:1.0,jpeg_compressibility:0.5", "cpu", hps_checkpoint=str(ckpt), hps_model=str(cfg))
    out = fn(images, PROMPTS)
    torch.testing.assert_close(out["hpsv2"], hps_fn(images, PROMPTS)["hpsv2"])
    torch.testing.assert_close(out["total"], out["hpsv2"] + 0.5 * out["jpeg_compressibility"])


# ----------------------------------------------------------------------------------------------- CLIP score
def test_clipscore_on_tiny_open_clip(tiny_hps, hps_fn):
    ckpt, cfg = tiny_hps
    fn = build_reward("clipscore", "cpu", clip_checkpoint=str(ckpt), clip_model=str(cfg))
    square = _smooth_images(3, 224, 224)
    scores = fn(square, PROMPTS)["clipscore"]
    assert torch.isfinite(scores).all() and scores.abs().max() <= 1.0
    # At the input size neither crops, pads nor resizes (CLIP's PIL-style and HPS's tensor resize differ
    # elsewhere), so the same weights give HPS's cosine.
    torch.testing.assert_close(scores, hps_fn(square, PROMPTS)["hpsv2"], rtol=0, atol=1e-5)
    wide = _smooth_images(3, 64, 128)
    assert not torch.allclose(fn(wide, PROMPTS)["clipscore"], hps_fn(wide, PROMPTS)["hpsv2"], atol=1e-4)


# ----------------------------------------------------------------------------------------------- aesthetic
def _random_laion_mlp(path, input_size: int):
    from fastvideo.rewards.aesthetic import AestheticMLP

    torch.manual_seed(0)
    state = AestheticMLP(input_size).state_dict()
    assert sorted(state) == sorted(f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias"))
    torch.save(state, path)
    return path


def test_aesthetic_open_clip(tmp_path, tiny_hps):
    from fastvideo.rewards._common import load_open_clip
    from fastvideo.rewards.aesthetic import load_aesthetic_mlp
    from open_clip.transform import image_transform

    ckpt, cfg = tiny_hps
    mlp_path = _random_laion_mlp(tmp_path / "mlp.pth", 32)
    fn = build_reward("aesthetic", "cpu", aesthetic_checkpoint=str(mlp_path), aesthetic_clip_checkpoint=str(ckpt),
                      aesthetic_clip_model=str(cfg))
    images = _smooth_images(3, 80, 64)
    scores = fn(images, PROMPTS)["aesthetic"]
    assert scores.shape == (3,) and torch.isfinite(scores).all()
    # Reference: the PIL CLIP transform, normalised image embedding, LAION MLP.
    clip, _, _ = load_open_clip(str(cfg), ckpt, torch.device("cpu"), model_flag="-", checkpoint_flag="-",
                                reward="aesthetic")
    pixels = torch.stack([image_transform(224, is_train=False)(_to_pil(image)) for image in images])
    with torch.no_grad():
        emb = torch.nn.functional.normalize(clip.encode_image(pixels), dim=-1)
        expected = load_aesthetic_mlp(mlp_path)(emb).squeeze(-1)
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-3)


def test_aesthetic_transformers_clip_and_dim_check(tmp_path, tiny_hf_clip, tiny_hps):
    model_dir, processor_dir = tiny_hf_clip
    from transformers import CLIPImageProcessor

    CLIPImageProcessor.from_pretrained(processor_dir).save_pretrained(model_dir)  # HF CLIP folders ship one
    fn = build_reward("aesthetic", "cpu", aesthetic_checkpoint=str(_random_laion_mlp(tmp_path / "m.pth", 16)),
                      aesthetic_clip_checkpoint=str(model_dir))
    scores = fn(_smooth_images(2, 40, 40), PROMPTS[:2])["aesthetic"]
    assert torch.isfinite(scores).all()
    ckpt, cfg = tiny_hps  # a 32-dim CLIP with a 16-dim MLP
    with pytest.raises(ValueError, match="embeds to 32 dims but the MLP expects 16"):
        build_reward("aesthetic", "cpu", aesthetic_checkpoint=str(tmp_path / "m.pth"),
                     aesthetic_clip_checkpoint=str(ckpt), aesthetic_clip_model=str(cfg))


# ----------------------------------------------------------------------------------------------- PickScore
def test_pickscore_tiny_transformers_clip(tiny_hf_clip):
    from transformers import CLIPModel, CLIPProcessor

    model_dir, processor_dir = tiny_hf_clip
    fn = build_reward("pickscore", "cpu", pickscore_model=str(model_dir), pickscore_processor=str(processor_dir))
    images = _smooth_images(3, 48, 64)
    scores = fn(images, PROMPTS)["pickscore"]
    assert torch.isfinite(scores).all()
    single = torch.cat([fn(images[i:i + 1], PROMPTS[i:i + 1])["pickscore"] for i in range(3)])
    torch.testing.assert_close(single, scores, rtol=0, atol=1e-4)
    # Reference: PickScore's own recipe on PIL images.
    processor = CLIPProcessor.from_pretrained(processor_dir)
    model = CLIPModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        image_inputs = processor(images=[_to_pil(i) for i in images], return_tensors="pt")
        text_inputs = processor(text=PROMPTS, padding=True, truncation=True, max_length=77, return_tensors="pt")
        img = model.get_image_features(**image_inputs)
        txt = model.get_text_features(**text_inputs)
        img, txt = (getattr(t, "pooler_output", t) for t in (img, txt))
        img, txt = img / img.norm(dim=-1, keepdim=True), txt / txt.norm(dim=-1, keepdim=True)
        expected = model.logit_scale.exp() * (img * txt).sum(-1)
    torch.testing.assert_close(scores, expected, rtol=0, atol=0.05)
