"""Open-vocabulary detectors and the CLIP colour head behind the GenEval-style scores, from local transformers folders.

GenEval detects with Mask2Former (mmdet) and names colours with CLIP ViT-L/14 zero-shot on each object's crop. Here
the detector is an open-vocabulary one that ``transformers`` loads (no mmdet/mmcv), picked by the folder's
``config.json`` ``model_type``:

- ``owlv2`` (``Owlv2ForObjectDetection``, e.g. google/owlv2-large-patch14-ensemble): every image is queried with all
  80 GenEval classes ("a photo of a {class}"), each box takes its best class (a closed-set detector's answer, as
  Mask2Former gives); boxes are relative to OWLv2's padded square input, so they are scaled by max(H, W).
- ``grounding-dino`` (``GroundingDinoForObjectDetection``, e.g. IDEA-Research/grounding-dino-base): the text is the
  record's classes ("cat. dog.", the model reads at most 256 tokens, so not all 80); a box's score for a class is
  the mean sigmoid over that class's tokens (mmdet's positive-map reading), and it takes its best class.

Neither gives masks, so a colour crop is the box alone (GenEval's is the mask on #999 grey, then the box). The colour
head (``ClipColours``) is GenEval's: per class, the three templates per colour, each text embedding L2-normalised,
averaged, renormalised; the crop's normalised image embedding; the colour of the largest ``100 * image @ text``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch

from fastvideo.bench.geneval_rules import COLORS, OBJECTS, Detection

DETECTORS: tuple[str, ...] = ("owlv2", "grounding-dino")
_MODEL_TYPES = {"owlv2": "owlv2", "grounding-dino": "grounding-dino"}  # config.json model_type -> detector
COLOUR_TEMPLATES = ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}", "a photo of a {c} object")
OWL_QUERY = "a photo of a {cls}"
GREY = (153, 153, 153)  # GenEval's #999 background behind a masked crop


def detector_kind(path: str | Path, flag: str = "--detector_path") -> str:
    """``owlv2`` or ``grounding-dino``, from the folder's config.json (FileNotFoundError / ValueError naming ``flag``
    and the fix)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{flag} {path}: no config.json there; pass a local transformers folder of OWLv2 "
                                "(google/owlv2-large-patch14-ensemble) or Grounding DINO (IDEA-Research/"
                                "grounding-dino-base); docs/benchmarks.md says how to get one")
    model_type = json.loads(config.read_text()).get("model_type")
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"{flag} {path} holds a {model_type!r} model; pass an OWLv2 ('owlv2') or Grounding DINO "
                         "('grounding-dino') transformers folder")
    return _MODEL_TYPES[model_type]


def parameter_count(path: str | Path) -> int:
    """Parameters of the detector or CLIP model in ``path``, from its config.json alone (built on the meta device):
    what the memory plan counts for the ``geneval`` reward; 0 when the folder has no readable config."""
    from transformers import AutoConfig, CLIPModel, GroundingDinoForObjectDetection, Owlv2ForObjectDetection

    classes = {"owlv2": Owlv2ForObjectDetection, "grounding-dino": GroundingDinoForObjectDetection,
               "clip": CLIPModel}
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        return 0
    if config.model_type not in classes:
        return 0
    with torch.device("meta"):
        model = classes[config.model_type](config)
    return sum(p.numel() for p in model.parameters())


def check_clip_path(path: str | Path | None, flag: str = "--clip_path") -> Path:
    """The CLIP folder of the colour head (FileNotFoundError naming ``flag`` and the fix)."""
    if path is None or not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"{flag} {path}: pass a local transformers CLIP folder for the colour head "
                                "(openai/clip-vit-large-patch14, GenEval's colour model); docs/benchmarks.md")
    return Path(path)


def cpu_images(images: torch.Tensor) -> list[torch.Tensor]:
    """(B, 3, H, W) in [0, 1] -> B float32 CPU images on the 1/255 grid (what a saved PNG holds): the processors'
    input and the colour crops' source."""
    x = images.detach().float().clamp(0, 1).mul(255).round().div(255).cpu()
    return list(x)


class Owlv2Detector:
    """OWLv2 over all 80 classes: ``detector(images, classes) -> [{class: [Detection, ...]}, ...]`` (``classes`` is
    ignored: every image is asked for every class)."""

    kind = "owlv2"

    def __init__(self, path: str | Path, device: torch.device, batch_size: int = 8):
        from transformers import Owlv2ForObjectDetection, Owlv2Processor  # heavy

        self.device, self.batch_size = torch.device(device), batch_size
        self.processor = Owlv2Processor.from_pretrained(path, local_files_only=True)
        self.model = Owlv2ForObjectDetection.from_pretrained(path, local_files_only=True).to(self.device).eval()
        self.queries = [OWL_QUERY.format(cls=c) for c in OBJECTS]

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, classes: Sequence[Sequence[str]] | None = None
                 ) -> list[dict[str, list[Detection]]]:
        out: list[dict[str, list[Detection]]] = []
        pictures = cpu_images(images)
        for start in range(0, len(pictures), self.batch_size):
            chunk = pictures[start:start + self.batch_size]
            inputs = self.processor(text=[self.queries] * len(chunk), images=chunk, return_tensors="pt",
                                    do_rescale=False, input_data_format="channels_first").to(self.device)
            outputs = self.model(**inputs)
            side = max(chunk[0].shape[-2:])  # boxes are relative to the padded square
            results = self.processor.post_process_grounded_object_detection(
                outputs, threshold=0.0, target_sizes=[(side, side)] * len(chunk))
            for r in results:
                found: dict[str, list[Detection]] = {}
                for box, score, label in zip(r["boxes"].tolist(), r["scores"].tolist(), r["labels"].tolist()):
                    found.setdefault(OBJECTS[label], []).append(Detection(tuple(box), float(score)))
                out.append(found)
        return out


class GroundingDinoDetector:
    """Grounding DINO queried with each record's classes: ``detector(images, classes) -> [{class: [Detection]}]``."""

    kind = "grounding-dino"

    def __init__(self, path: str | Path, device: torch.device, batch_size: int = 8):
        from transformers import GroundingDinoForObjectDetection, GroundingDinoProcessor  # heavy

        self.device, self.batch_size = torch.device(device), batch_size
        self.processor = GroundingDinoProcessor.from_pretrained(path, local_files_only=True)
        self.model = GroundingDinoForObjectDetection.from_pretrained(path, local_files_only=True).to(
            self.device).eval()

    def _spans(self, names: Sequence[str]) -> tuple[str, list[list[int]]]:
        """The text "a. b." and, per class, the token positions its words take (offsets from the tokenizer)."""
        text, where = "", []
        for name in names:
            where.append((len(text), len(text) + len(name)))
            text += f"{name}. "
        encoded = self.processor.tokenizer(text.strip(), return_offsets_mapping=True)
        spans = [[i for i, (a, b) in enumerate(encoded["offset_mapping"]) if b > a and a >= lo and b <= hi]
                 for lo, hi in where]
        return text.strip(), spans

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, classes: Sequence[Sequence[str]]) -> list[dict[str, list[Detection]]]:
        out: list[dict[str, list[Detection]]] = []
        pictures = cpu_images(images)
        for start in range(0, len(pictures), self.batch_size):
            chunk, names = pictures[start:start + self.batch_size], [list(dict.fromkeys(c))
                                                                     for c in classes[start:start + self.batch_size]]
            texts, spans = zip(*(self._spans(n) for n in names))
            inputs = self.processor(images=chunk, text=list(texts), return_tensors="pt", padding=True,
                                    do_rescale=False, input_data_format="channels_first").to(self.device)
            outputs = self.model(**inputs)
            probs = outputs.logits.sigmoid().float().cpu()  # (b, queries, text tokens)
            boxes = outputs.pred_boxes.float().cpu()  # (b, queries, 4): cx, cy, w, h relative to the image
            for j, picture in enumerate(chunk):
                h, w = picture.shape[-2:]
                per_class = torch.stack([probs[j][:, s].mean(dim=1) if s else torch.zeros(probs.shape[1])
                                         for s in spans[j]], dim=1)  # (queries, classes)
                score, label = per_class.max(dim=1)
                cx, cy, bw, bh = boxes[j].unbind(-1)
                xyxy = torch.stack([(cx - bw / 2) * w, (cy - bh / 2) * h, (cx + bw / 2) * w, (cy + bh / 2) * h], -1)
                found: dict[str, list[Detection]] = {}
                for box, s, k in zip(xyxy.tolist(), score.tolist(), label.tolist()):
                    found.setdefault(names[j][k], []).append(Detection(tuple(box), float(s)))
                out.append(found)
        return out


def load_detector(path: str | Path, device: torch.device, batch_size: int = 8, kind: str | None = None,
                  flag: str = "--detector_path") -> Owlv2Detector | GroundingDinoDetector:
    """The detector in ``path`` (its kind from config.json; ``kind``, when given, must agree: ValueError naming
    ``--detector``)."""
    found = detector_kind(path, flag)
    if kind is not None and kind != found:
        raise ValueError(f"--detector {kind} but {flag} {path} holds a {found} model; pass --detector {found} or "
                         f"a {kind} folder")
    return (Owlv2Detector if found == "owlv2" else GroundingDinoDetector)(path, device, batch_size)


class ClipColours:
    """GenEval's colour head on a transformers CLIP: ``colours(crops, class names) -> colour names``
    (djghosh13/geneval evaluation/evaluate_images.py at 16f1681: colours l.76, templates l.114-116, the classifier
    and its argmax l.109-127; GenEval's model is open_clip ViT-L-14 "openai", l.66-68)."""

    def __init__(self, path: str | Path, device: torch.device, batch_size: int = 64):
        from transformers import CLIPModel, CLIPProcessor  # heavy

        self.device, self.batch_size = torch.device(device), batch_size
        self.processor = CLIPProcessor.from_pretrained(path, local_files_only=True)
        self.model = CLIPModel.from_pretrained(path, local_files_only=True).to(self.device).eval()
        self._classifiers: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def classifier(self, cls: str) -> torch.Tensor:
        """(D, 10) unit colour vectors of one class: each colour's three template embeddings normalised, averaged,
        renormalised (clip_benchmark's zero_shot_classifier, as GenEval builds it); cached per class."""
        if cls not in self._classifiers:
            texts = [t.format(c=c, cls=cls) for c in COLORS for t in COLOUR_TEMPLATES]
            tokens = self.processor.tokenizer(texts, padding=True, return_tensors="pt").to(self.device)
            emb = _features(self.model.get_text_features(**tokens)).float()
            emb = torch.nn.functional.normalize(emb, dim=-1).view(len(COLORS), len(COLOUR_TEMPLATES), -1).mean(1)
            self._classifiers[cls] = torch.nn.functional.normalize(emb, dim=-1).T
        return self._classifiers[cls]

    @torch.no_grad()
    def __call__(self, crops: Sequence[torch.Tensor], classes: Sequence[str]) -> list[str]:
        """The colour name of each crop (3, h, w) in [0, 1] of its class."""
        names: list[str] = []
        for start in range(0, len(crops), self.batch_size):
            chunk = list(crops[start:start + self.batch_size])
            pixels = self.processor.image_processor(images=chunk, return_tensors="pt", do_rescale=False,
                                                   input_data_format="channels_first")
            image = _features(self.model.get_image_features(pixel_values=pixels["pixel_values"].to(self.device)))
            image = torch.nn.functional.normalize(image.float(), dim=-1)
            for k, cls in enumerate(classes[start:start + self.batch_size]):
                names.append(COLORS[int((100 * image[k] @ self.classifier(cls)).argmax())])
        return names


def _features(output: Any) -> torch.Tensor:
    """A CLIP projection's tensor (transformers 5 returns a model output holding ``pooler_output``)."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def crop(image: torch.Tensor, detection: Detection) -> torch.Tensor:
    """GenEval's colour crop (evaluate_images.py l.94-106) of a (3, H, W) image in [0, 1]: a mask, when the detector
    gives one, keeps the object's pixels on #999 grey; then the box, rounded as PIL's crop rounds it (at least 1 px)."""
    if detection.mask is not None:
        mask = torch.as_tensor(detection.mask, dtype=torch.bool, device=image.device)
        grey = torch.tensor(GREY, dtype=image.dtype, device=image.device).view(3, 1, 1) / 255
        image = torch.where(mask, image, grey)
    h, w = image.shape[-2:]
    x1, y1, x2, y2 = (round(v) for v in detection.box)
    x1, y1 = min(max(x1, 0), w - 1), min(max(y1, 0), h - 1)
    x2, y2 = min(max(x2, x1 + 1), w), min(max(y2, y1 + 1), h)
    return image[:, y1:y2, x1:x2]
