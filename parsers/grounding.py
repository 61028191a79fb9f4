"""Phrase grounding behind a registry, and boxes -> ViT patch masks (MACCO image masking).

A grounder turns (image, phrases) requests into boxes in ORIGINAL image pixels, xyxy, with a score:

- `groundingdino`: GroundingDINO, one prompt per phrase ("<phrase> ."; `prompt="per_phrase"`, the default, as
  MACCO's preprocessing is described: the prompt is the phrase text), several (image, phrase) pairs per forward
  pass; or [ours] `prompt="joint"`: all distinct phrases of an image in one prompt ("<p1> . <p2> . ... ."),
  split into several prompts where they exceed BERT's 256 tokens, boxes handed to each phrase by its token
  span (see `joint_prompts` and `select_boxes`); one forward per image instead of one per phrase;
- `annotations`: ground-truth boxes (the best-matching gt phrase, and/or COCO instances by category name);
- `none`: no boxes.

Every grounder decodes each request's image, also those that need no pixels, so that a broken file is found
here rather than in a training DataLoader and the count does not depend on the grounder: the paths it could
not read, or whose geometry makes boxes meaningless (`parsers.images.image_shape_problem`: not the size the
annotations record, an extreme aspect ratio), go to `unreadable_images`, logged with the reason, and their
phrases get empty box lists (never an exception). Images are decoded by `parsers.images.rgb_image`, which
scales 16-bit grayscale to 8 bits (PIL's own conversion turns it white).
`settings()` returns everything that changes a grounder's output, for the preprocessing cache key.

`boxes_to_patch_mask` and `random_rectangle_mask` build the per-sample patch masks in the DataLoader, so they
are plain numpy.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from functools import cached_property, lru_cache
from importlib import metadata
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Protocol, Sequence, Tuple

import numpy as np
import torch
from PIL import Image

from parsers.grounding_inputs import GrounderInputError, default_groundingdino_config, groundingdino_input_problems
from parsers.images import IMAGE_DECODING, IMAGE_ERRORS, image_shape_problem, read_rgb_file

log = logging.getLogger(__name__)

Box = Tuple[float, float, float, float, float]  # x0, y0, x1, y1 in original image pixels, score

# GroundingDINO's eval transform: shorter side 800, longer side at most 1333 (the ratio keeps for other sizes).
_MAX_SIZE_RATIO = 1333 / 800
_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)
_RANDOM_INIT_SEED = 0
# The two-stage encoder selects 900 query proposals among its multi-scale tokens (strides 8..64); a square
# image needs a side of about 208 px to have that many, so smaller inputs crash inside GroundingDINO.
MIN_IMAGE_SIZE = 224


@dataclass
class GroundingRequest:
    """One image and the phrases to ground in it.

    Attributes:
        image_path: path of the image file.
        phrases: the phrases; each becomes its own prompt.
        image_id: dataset image id (the `annotations` grounder looks up COCO instances with it).
        caption_id: dataset caption id (bookkeeping only).
        gt_phrases: ground-truth phrases `[{"text": str, "boxes": [[x0, y0, x1, y1], ...]}]` for the
            `annotations` grounder; with `"char_span": [start, end]` (the shapes world) they can be matched by
            position, see `phrase_mentions`.
        phrase_mentions: per phrase, the character spans of the objects it names (their head nouns), in the
            one caption that `gt_phrases` annotate: the `annotations` grounder then grounds each named object
            in the tightest gt phrase around it instead of matching words (see `mention_boxes`).
        annotated_size: (width, height) the annotations record for the image, the frame of `gt_phrases`; an
            image file of another size is not grounded (None: not recorded, not checked).
    """

    image_path: str
    phrases: List[str]
    image_id: int = 0
    caption_id: int = 0
    gt_phrases: Optional[List[dict]] = None
    phrase_mentions: Optional[List[List[Tuple[int, int]]]] = None
    annotated_size: Optional[Tuple[int, int]] = None


class Grounder(Protocol):
    """What the preprocessing job needs of a grounder."""

    unreadable_images: List[str]  # paths of request images that could not be decoded or used, in request order

    def prepare(self) -> None:
        """Load the model, if any: a checkpoint that does not fit is refused here, before any shard's work."""

    def ground(self, requests: Sequence[GroundingRequest]) -> List[List[List[Box]]]:
        """Boxes per request, per phrase (possibly empty)."""

    def settings(self) -> dict:
        """JSON-serialisable description of everything that changes the output (a cache key)."""


# ----- content hashes for settings() -------------------------------------------------------------------
# Settings hold content hashes, not paths or mtimes, so that a checkpoint copied to a node's local scratch
# still hits the same cache. Hashing a 700 MB checkpoint takes a few seconds, once per grounder.
def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _directory_sha256(directory: str) -> Dict[str, str]:
    """sha256 of each file directly inside a directory, by name."""
    files = sorted(p for p in Path(directory).iterdir() if p.is_file())
    return {p.name: _file_sha256(str(p)) for p in files}


def _package_version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# ----- images ------------------------------------------------------------------------------------------
def _read_rgb(path: str) -> Optional[Image.Image]:
    """The decoded 8-bit RGB image, or None when the file is missing, truncated or not an image."""
    try:
        return read_rgb_file(path)
    except IMAGE_ERRORS as error:
        log.warning("unreadable image %s: %s", path, error)
        return None


class ImageReader:
    """Reads request images and keeps the paths that could not be used (shared by all grounders)."""

    def __init__(self):
        self.unreadable_images: List[str] = []

    def prepare(self) -> None:
        """Load what grounding needs (nothing here; a detector's weights), so bad inputs fail before any work."""

    def _read(self, request: GroundingRequest) -> Optional[Image.Image]:
        """The request's image, or None (recorded in `unreadable_images`) when it is unreadable or unusable."""
        image = _read_rgb(request.image_path)
        problem = image_shape_problem(image.size, request.annotated_size) if image is not None else None
        if problem is not None:
            log.warning("unusable image %s: %s; its phrases get no boxes", request.image_path, problem)
            image = None
        if image is None:
            self.unreadable_images.append(request.image_path)
        return image


def resized_size(width: int, height: int, image_size: int, max_size: int) -> Tuple[int, int]:
    """(width, height) with the shorter side `image_size`, the longer side at most `max_size`."""
    scale = min(image_size / min(width, height), max_size / max(width, height))
    return max(1, round(width * scale)), max(1, round(height * scale))


def groundingdino_image_tensor(image: Image.Image, image_size: int, max_size: int) -> torch.Tensor:
    """GroundingDINO's eval preprocessing: bilinear resize, [0, 1], ImageNet normalisation; [3, H, W]."""
    resized = image.resize(resized_size(*image.size, image_size, max_size), Image.BILINEAR)
    pixels = torch.from_numpy(np.asarray(resized, dtype=np.float32) / 255.0).permute(2, 0, 1)
    mean = torch.tensor(_IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(_IMAGENET_STD).view(3, 1, 1)
    return (pixels - mean) / std


# ----- GroundingDINO -----------------------------------------------------------------------------------
PROMPT_MODES = ("per_phrase", "joint")
# GroundingDINO's `max_text_len`: its forward keeps the first 256 text positions ([CLS] and [SEP] included).
MAX_TEXT_TOKENS = 256


def phrase_prompt(phrase: str) -> str:
    """GroundingDINO's caption convention: lowercase, ending with " ."."""
    return phrase.lower().strip().rstrip(".").strip() + " ."


@dataclass
class JointPrompt:
    """One GroundingDINO caption holding several phrases, and where each phrase sits in it.

    Attributes:
        text: the caption, e.g. "red dog . dog on grass ." (each phrase in `phrase_prompt` form).
        phrases: indices (into the phrase list given to `joint_prompts`) of the phrases in the caption; a
            repeated phrase is in it once, under its first index.
        char_spans: per phrase, its [start, end) characters in `text` (the trailing " ." excluded).
    """

    text: str
    phrases: List[int]
    char_spans: List[Tuple[int, int]]


def joint_prompts(phrases: Sequence[str], token_count: Callable[[str], int],
                  max_tokens: int = MAX_TEXT_TOKENS) -> Tuple[List[JointPrompt], List[Optional[int]]]:
    """Distinct phrases packed, in order, into " . "-separated captions of at most `max_tokens` tokens.

    A phrase is never split between captions; one that does not fit into an empty caption gets one of its own
    (GroundingDINO then truncates it, as it would the same phrase on its own). Phrases are compared after
    `phrase_prompt` normalisation (lowercase, no trailing "."), so "A dog." and "a dog" are one phrase; empty
    phrases are left out (no boxes, as one-prompt-per-phrase gives them).

    Args:
        phrases: the phrases of one image.
        token_count: BERT tokens of a text without [CLS] / [SEP] (WordPiece splits at spaces and punctuation,
            so a caption's count is the sum of its phrases' and separators').
        max_tokens: the text length GroundingDINO keeps, [CLS] and [SEP] included.

    Returns:
        The captions, and per input phrase the index of the phrase that stands for it (itself, or its first
        repetition), None for an empty phrase.
    """
    owner: Dict[str, int] = {}
    representative: List[Optional[int]] = []
    for index, phrase in enumerate(phrases):
        text = phrase_prompt(phrase)[:-2]
        representative.append(owner.setdefault(text, index) if text else None)
    prompts: List[JointPrompt] = []
    budget = max_tokens - 2  # [CLS] ... [SEP]
    used = budget + 1        # forces a first caption
    for text, index in owner.items():
        cost = token_count(text) + 1  # the phrase and its " ."
        if used + cost > budget:
            prompts.append(JointPrompt("", [], []))
            used = 0
        prompt = prompts[-1]
        start = len(prompt.text) + (1 if prompt.text else 0)
        prompt.text = f"{prompt.text} {text} ." if prompt.text else f"{text} ."
        prompt.phrases.append(index)
        prompt.char_spans.append((start, start + len(text)))
        used += cost
    return prompts, representative


def span_token_masks(tokenizer, prompt: JointPrompt, special_ids: Sequence[int], width: int) -> torch.Tensor:
    """Bool [len(prompt.phrases), width]: the text positions of each phrase's own tokens in the caption.

    A token belongs to a phrase when its characters lie inside the phrase's span (the tokenizer's offset
    mapping, as GroundingDINO's `create_positive_map_from_span` reads spans through `char_to_token`); [CLS],
    [SEP], padding and the separators "." / "?" (GroundingDINO's special tokens) belong to none. Positions past
    `width` (GroundingDINO's 256) are cut, as the model cuts them.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("joint grounding prompts need a fast (Rust) tokenizer for character offsets")
    tokens = tokenizer(prompt.text, return_offsets_mapping=True)
    ids = torch.tensor(tokens["input_ids"][:width])
    offsets = torch.tensor(tokens["offset_mapping"][:width]).view(-1, 2)
    own = (offsets[:, 1] > offsets[:, 0]) & ~torch.isin(ids, torch.tensor(list(special_ids)))
    starts = torch.tensor([start for start, _ in prompt.char_spans]).view(-1, 1)
    ends = torch.tensor([end for _, end in prompt.char_spans]).view(-1, 1)
    inside = own & (offsets[:, 0] >= starts) & (offsets[:, 1] <= ends)
    return torch.nn.functional.pad(inside, (0, width - inside.shape[1]), value=False)


def _build_groundingdino(config_file: str, text_encoder: str, device: str) -> torch.nn.Module:
    # Imported here: slow to import, and only this grounder needs it.
    from groundingdino.models import build_model
    from groundingdino.util.slconfig import SLConfig

    args = SLConfig.fromfile(config_file)
    args.text_encoder_type = text_encoder
    args.device = device
    # Activation checkpointing only saves memory in a backward pass; we never run one.
    args.use_checkpoint = False
    args.use_transformer_ckpt = False
    # A fixed seed makes random-weight runs (tests) reproducible without touching the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_RANDOM_INIT_SEED)
        return build_model(args)


# Keys in which a released checkpoint and the model built here legitimately differ, in either direction;
# GroundingDINO's own loader (`load_model`, `strict=False`) ignores every difference, and these are the ones
# the released SwinT / SwinB checkpoints show: `label_enc.weight`, the label embedding of the denoising
# queries used only in training (the inference model has none), and BERT's `position_ids`, a constant arange
# buffer that the released checkpoints hold but transformers >= 4.31 leaves out of the state dict (older
# versions keep it), so either side may lack it.
IGNORED_CHECKPOINT_KEYS = frozenset({"label_enc.weight", "bert.embeddings.position_ids"})
# Key names quoted per kind of difference in the refusal.
_KEYS_IN_MESSAGE = 5


def _read_state_dict(checkpoint: str) -> Dict[str, torch.Tensor]:
    """The checkpoint's tensors by key ("model" entry or the whole file, DDP's "module." prefix removed)."""
    try:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    except Exception as err:  # a file that is no checkpoint fails in many ways (pickle, zip, EOF, ...)
        raise GrounderInputError(f"GroundingDINO checkpoint {checkpoint} cannot be read as a torch checkpoint: "
                                 f"{type(err).__name__}: {err}") from err
    state = state.get("model", state) if isinstance(state, dict) else state
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise GrounderInputError(f"GroundingDINO checkpoint {checkpoint} holds no state dict of tensors (at the top "
                                 f"level or under 'model')")
    # Checkpoints saved from DistributedDataParallel prefix every key with "module.".
    return {key.removeprefix("module."): value for key, value in state.items()}


def checkpoint_mismatch(model_state: Dict[str, torch.Tensor], state: Dict[str, torch.Tensor]) -> Dict[str, List[str]]:
    """How a checkpoint's state dict differs from the model's: "missing", "unexpected" and "shape" keys
    (each sorted; `IGNORED_CHECKPOINT_KEYS` left out)."""
    missing = sorted(model_state.keys() - state.keys() - IGNORED_CHECKPOINT_KEYS)
    unexpected = sorted(state.keys() - model_state.keys() - IGNORED_CHECKPOINT_KEYS)
    shape = sorted(key for key in model_state.keys() & state.keys() if model_state[key].shape != state[key].shape)
    return {"missing": missing, "unexpected": unexpected, "shape": shape}


def _mismatch_message(checkpoint: str, config_file: str, mismatch: Dict[str, List[str]], total: int) -> str:
    kinds = {"missing": "missing keys", "unexpected": "unexpected keys", "shape": "keys of another shape"}
    found = "; ".join(f"{len(keys)} {kinds[kind]} (e.g. {', '.join(keys[:_KEYS_IN_MESSAGE])})"
                      for kind, keys in mismatch.items() if keys)
    return (f"GroundingDINO checkpoint {checkpoint} does not fit the model of {os.path.basename(config_file)} "
            f"({total} keys): {found}. Without those weights it would ground with random ones; give the checkpoint "
            f"of this config's variant (groundingdino_swint_ogc.pth for GroundingDINO_SwinT_OGC.py) and the text "
            f"encoder it was trained with")


def _load_checkpoint(model: torch.nn.Module, checkpoint: str, config_file: str) -> None:
    """Load every weight of `model` from `checkpoint`, or refuse (GrounderInputError) if it does not fit."""
    state = _read_state_dict(checkpoint)
    model_state = model.state_dict()
    mismatch = checkpoint_mismatch(model_state, state)
    if any(mismatch.values()):
        raise GrounderInputError(_mismatch_message(checkpoint, config_file, mismatch, len(model_state)))
    model.load_state_dict(state, strict=False)  # only IGNORED_CHECKPOINT_KEYS can differ now


def _phrase_token_mask(tokenizer, prompts: Sequence[str], special_ids: Sequence[int], width: int) -> torch.Tensor:
    """Bool [N, width]: which text positions of each prompt are phrase tokens (not [CLS]/[SEP]/"."/padding).

    Tokenised exactly like GroundingDINO's forward (padding "longest"), so positions line up with the logits.
    """
    tokens = tokenizer(list(prompts), padding="longest", return_tensors="pt")
    ids = tokens["input_ids"][:, :width]
    mask = tokens["attention_mask"][:, :width].bool() & ~torch.isin(ids, torch.tensor(list(special_ids)))
    return torch.nn.functional.pad(mask, (0, width - mask.shape[1]), value=False)


def select_boxes(probs: torch.Tensor, boxes: torch.Tensor, phrase_tokens: torch.Tensor, box_threshold: float,
                 text_threshold: float, width: int, height: int) -> List[Box]:
    """GroundingDINO's `predict` semantics for one (image, phrase) pair.

    A query is kept when its best token probability (over the whole prompt, as in `predict`) exceeds
    `box_threshold` AND at least one of the phrase's own tokens (not [CLS]/[SEP]/".") exceeds
    `text_threshold`. `predict` uses the text threshold to pick a query's label tokens
    (`get_phrases_from_posmap(logit > text_threshold)`); with one prompt per phrase the only question left is
    whether the query is about the phrase at all. In a joint prompt `phrase_tokens` is the phrase's span:
    the phrase gets exactly the kept queries whose label would contain one of its tokens, so a query whose
    label spans two phrases goes to both, and one whose tokens pass the threshold in no phrase (only on "."
    or [CLS]) goes to none. The score is the best token probability over the prompt (`predict`'s).

    Args:
        probs: [Q, T] sigmoid token probabilities (padding positions 0).
        boxes: [Q, 4] normalised cx, cy, w, h relative to the unpadded image.
        phrase_tokens: [T] bool, the phrase's token positions.
        box_threshold: minimum (exclusive) best-token probability.
        text_threshold: minimum (exclusive) probability of some phrase token.
        width: original image width in pixels.
        height: original image height in pixels.

    Returns:
        Boxes in original pixels, xyxy, clipped to the image, with scores; in query order.
    """
    scores = probs.max(dim=1).values
    phrase_best = probs[:, phrase_tokens].max(dim=1).values if phrase_tokens.any() else torch.zeros_like(scores)
    keep = (scores > box_threshold) & (phrase_best > text_threshold)
    cx, cy, w, h = boxes[keep].double().unbind(-1)
    x0 = ((cx - w / 2) * width).clamp(0, width)
    x1 = ((cx + w / 2) * width).clamp(0, width)
    y0 = ((cy - h / 2) * height).clamp(0, height)
    y1 = ((cy + h / 2) * height).clamp(0, height)
    rows = torch.stack([x0, y0, x1, y1, scores[keep].double()], dim=-1).tolist()
    return [tuple(row) for row in rows]


class GroundingDinoGrounder(ImageReader):
    """GroundingDINO with one prompt per phrase, `batch_size` images per forward pass.

    Each image is paired with each of its phrases; all pairs of `batch_size` images go through one forward
    pass (GroundingDINO pads them to a common size and masks the padding).

    Args:
        checkpoint: path of a GroundingDINO checkpoint (e.g. `groundingdino_swint_ogc.pth`). None (random,
            seeded weights: meaningless boxes) is refused unless `allow_random_weights`; so is, when the model
            is built (`prepare` or first use), a checkpoint that does not set every weight of the model
            (missing, unexpected or reshaped keys other than `IGNORED_CHECKPOINT_KEYS`).
        allow_random_weights: accept `checkpoint=None`; for tests and speed measurements only.
        config_file: GroundingDINO config; default the SwinT OGC config shipped inside the package.
        text_encoder: hub name or local directory of the BERT text encoder (tokenizer + config; with a
            checkpoint its BERT weights are overwritten by the checkpoint's).
        box_threshold: keep a box when its best token probability exceeds this.
        text_threshold: ... and one of the phrase's tokens exceeds this.
        image_size: shorter side of the network input (at least `MIN_IMAGE_SIZE`).
        max_size: longer side cap; default `image_size * 1333 / 800` (1333 at 800, as GroundingDINO).
        device: "cpu" or "cuda".
        batch_size: images per forward pass.
        prompt: "per_phrase" (one prompt per (image, phrase) pair; the default) or "joint" (all distinct
            phrases of an image in one " . "-separated prompt, several where they exceed 256 tokens; each
            phrase gets the boxes `select_boxes` keeps for its token span; [ours], for throughput: one
            forward per image instead of one per phrase, but the phrases now share GroundingDINO's 900
            queries, so the boxes are not the same).
    """

    def __init__(self, *, checkpoint: Optional[str], config_file: Optional[str] = None,
                 text_encoder: str = "bert-base-uncased", box_threshold: float = 0.35,
                 text_threshold: float = 0.25, image_size: int = 800, max_size: Optional[int] = None,
                 device: str = "cpu", batch_size: int = 4, allow_random_weights: bool = False,
                 prompt: str = "per_phrase"):
        if prompt not in PROMPT_MODES:
            raise ValueError(f"prompt must be one of {PROMPT_MODES}, got {prompt!r}")
        if image_size < MIN_IMAGE_SIZE:
            raise ValueError(f"image_size {image_size} < {MIN_IMAGE_SIZE}: too few encoder tokens for 900 queries")
        # Checked here, not when the model is first used: that is after the first shard's parsing, and a
        # wrong path must not cost a model build (or a hub download that hangs offline) to find.
        problems = groundingdino_input_problems(config_file, checkpoint, text_encoder, allow_random_weights)
        if problems:
            raise GrounderInputError("GroundingDINO cannot be built:\n  - " + "\n  - ".join(problems))
        super().__init__()
        self.checkpoint = checkpoint
        self.config_file = config_file or default_groundingdino_config()
        self.text_encoder = text_encoder
        self.box_threshold = box_threshold
        self.text_threshold = text_threshold
        self.image_size = image_size
        self.max_size = max_size or round(image_size * _MAX_SIZE_RATIO)
        self.device = device
        self.batch_size = batch_size
        self.prompt = prompt

    @cached_property
    def model(self) -> torch.nn.Module:
        """Loaded on first use, so `settings()` (the cache key) is cheap to compute."""
        return self._load_model()

    def _load_model(self) -> torch.nn.Module:
        model = _build_groundingdino(self.config_file, self.text_encoder, self.device)
        if self.checkpoint is None:
            log.warning("GroundingDINO has RANDOM WEIGHTS (checkpoint=None): boxes are meaningless; "
                        "this is for tests only, pass checkpoint=<path to groundingdino_swint_ogc.pth>")
        else:
            _load_checkpoint(model, self.checkpoint, self.config_file)
        return model.to(self.device).eval().requires_grad_(False)

    def prepare(self) -> None:
        """Build the model and load its checkpoint now (refused if it does not fit), not at the first images."""
        _ = self.model  # the cached property builds and loads it

    @cached_property
    def _input_hashes(self) -> dict:
        local_encoder = os.path.isdir(self.text_encoder)
        return {
            "config_sha256": _file_sha256(self.config_file),
            "checkpoint_sha256": _file_sha256(self.checkpoint) if self.checkpoint else None,
            "text_encoder_sha256": _directory_sha256(self.text_encoder) if local_encoder else None,
        }

    def settings(self) -> dict:
        """Everything that changes the boxes (file names for reading, content hashes for identity).

        `batch_size` is included because images of different sizes are padded together, and the Swin
        backbone sees the padding, so the boxes of an image depend (slightly) on its batch mates.
        """
        # The per-phrase settings are those of caches written before the joint mode existed: unchanged.
        prompt = ({"prompt": phrase_prompt("{phrase}")} if self.prompt == "per_phrase" else
                  {"prompt": "{phrase} . {phrase} . ... .", "prompt_max_tokens": MAX_TEXT_TOKENS,
                   "phrase_boxes": "span token > text_threshold"})
        return {
            "name": "groundingdino", **prompt,
            "config": os.path.basename(self.config_file),
            "checkpoint": os.path.basename(self.checkpoint) if self.checkpoint else None,
            "random_init_seed": None if self.checkpoint else _RANDOM_INIT_SEED,
            "text_encoder": os.path.basename(os.path.normpath(self.text_encoder)), **self._input_hashes,
            "box_threshold": self.box_threshold, "text_threshold": self.text_threshold,
            "image_size": self.image_size, "max_size": self.max_size, "batch_size": self.batch_size,
            "image_decoding": IMAGE_DECODING,
            "groundingdino_py": _package_version("groundingdino-py"),
            "transformers": _package_version("transformers"),
        }

    def ground(self, requests: Sequence[GroundingRequest]) -> List[List[List[Box]]]:
        """Boxes per request, per phrase; unreadable images give empty lists and go to `unreadable_images`."""
        results: List[List[List[Box]]] = [[[] for _ in r.phrases] for r in requests]
        for start in range(0, len(requests), self.batch_size):
            chunk = range(start, min(start + self.batch_size, len(requests)))
            images = {i: self._read(requests[i]) for i in chunk}
            readable = [i for i, image in images.items() if image is not None and requests[i].phrases]
            if readable:
                ground = self._ground_images if self.prompt == "per_phrase" else self._ground_images_jointly
                ground([requests[i] for i in readable], [images[i] for i in readable], [results[i] for i in readable])
        return results

    def _ground_images(self, requests: Sequence[GroundingRequest], images: Sequence[Image.Image],
                       results: Sequence[List[List[Box]]]) -> None:
        """One forward pass over every (image, phrase) pair of these images; fills `results` in place."""
        pairs = [(k, p) for k, request in enumerate(requests) for p in range(len(request.phrases))]
        tensors = [groundingdino_image_tensor(image, self.image_size, self.max_size) for image in images]
        prompts = [phrase_prompt(requests[k].phrases[p]) for k, p in pairs]
        probs, boxes = self._forward([tensors[k] for k, _ in pairs], prompts)
        phrase_tokens = _phrase_token_mask(self.model.tokenizer, prompts, self.model.specical_tokens,
                                           probs.shape[-1])
        for row, (k, p) in enumerate(pairs):
            width, height = images[k].size
            results[k][p] = select_boxes(probs[row], boxes[row], phrase_tokens[row], self.box_threshold,
                                         self.text_threshold, width, height)

    def _ground_images_jointly(self, requests: Sequence[GroundingRequest], images: Sequence[Image.Image],
                               results: Sequence[List[List[Box]]]) -> None:
        """One forward pass over every (image, joint prompt) pair of these images; fills `results` in place."""
        tokenizer = self.model.tokenizer
        count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
        planned = [joint_prompts(request.phrases, count) for request in requests]
        pairs = [(k, prompt) for k, (prompts, _) in enumerate(planned) for prompt in prompts]
        if not pairs:
            return
        tensors = [groundingdino_image_tensor(image, self.image_size, self.max_size) for image in images]
        probs, boxes = self._forward([tensors[k] for k, _ in pairs], [prompt.text for _, prompt in pairs])
        found: List[Dict[int, List[Box]]] = [{} for _ in requests]
        for row, (k, prompt) in enumerate(pairs):
            width, height = images[k].size
            spans = span_token_masks(tokenizer, prompt, self.model.specical_tokens, probs.shape[-1])
            for phrase, span in zip(prompt.phrases, spans):
                found[k][phrase] = select_boxes(probs[row], boxes[row], span, self.box_threshold,
                                                self.text_threshold, width, height)
        for k, (_, representative) in enumerate(planned):
            for p, owner in enumerate(representative):
                results[k][p] = list(found[k][owner]) if owner is not None else []

    @torch.no_grad()
    def _forward(self, tensors: List[torch.Tensor], prompts: List[str]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Token probabilities [N, Q, T] and normalised cxcywh boxes [N, Q, 4], on the CPU in fp32."""
        from groundingdino.util.misc import nested_tensor_from_tensor_list

        samples = nested_tensor_from_tensor_list(tensors).to(self.device)
        outputs = self.model(samples, captions=prompts)
        return outputs["pred_logits"].float().sigmoid().cpu(), outputs["pred_boxes"].float().cpu()


# ----- ground-truth annotations ------------------------------------------------------------------------
def _words(text: str) -> List[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def word_jaccard(a: str, b: str) -> float:
    """Jaccard similarity of the lowercased word sets of two texts (0 when both are empty)."""
    left, right = set(_words(a)), set(_words(b))
    union = left | right
    return len(left & right) / len(union) if union else 0.0


def _xyxy_with_score(box: Sequence[float]) -> Box:
    x0, y0, x1, y1 = (float(v) for v in box[:4])
    return (x0, y0, x1, y1, 1.0)


def phrase_coverage(phrase: str, gt_text: str) -> float:
    """Fraction of `phrase`'s distinct words that occur in `gt_text` (0 for an empty phrase)."""
    words = set(_words(phrase))
    return len(words & set(_words(gt_text))) / len(words) if words else 0.0


def best_gt_boxes(phrase: str, gt_phrases: Sequence[dict], min_overlap: float) -> List[Box]:
    """Boxes (score 1) of the gt phrase that best covers `phrase`, if the coverage reaches `min_overlap`.

    Coverage (the share of the phrase's words found in the gt phrase) rather than Jaccard, because parsed
    phrases are terser than written ones: "square left of circle" is fully inside "a large red square to the
    left of a small blue circle". Ties go to the higher word Jaccard (the tighter gt phrase), then the first.
    """
    if not gt_phrases:
        return []
    scores = [(phrase_coverage(phrase, gt["text"]), word_jaccard(phrase, gt["text"])) for gt in gt_phrases]
    best = max(range(len(scores)), key=lambda i: (scores[i], -i))
    if scores[best][0] < min_overlap:
        return []
    return [_xyxy_with_score(box) for box in gt_phrases[best]["boxes"]]


def _tightest_gt_phrase(mention: Tuple[int, int], gt_phrases: Sequence[dict]) -> Optional[dict]:
    """The shortest gt phrase whose `char_span` contains the character span `mention`, or None."""
    start, end = mention
    around = [gt for gt in gt_phrases
              if "char_span" in gt and gt["char_span"][0] <= start and end <= gt["char_span"][1]]
    return min(around, key=lambda gt: gt["char_span"][1] - gt["char_span"][0], default=None)


def mention_boxes(mentions: Sequence[Tuple[int, int]], gt_phrases: Sequence[dict]) -> List[Box]:
    """Boxes (score 1) of the objects a phrase names, matched by position in the caption.

    Each mention (the character span of a named object's head noun) takes the boxes of the tightest gt phrase
    around it: its own object's noun phrase ("large red square"), not the relation phrase that also contains
    it. Word matching cannot be exact here: the parsed "red square placed" is closest in words to the gt
    relation phrase "red square placed left of a blue circle", and the same words in two captions of one
    image may name different objects. A phrase naming an object that no gt phrase contains gets no boxes at
    all: part of a relation's boxes would mask the wrong region as confidently as a full match.
    """
    boxes: List[Box] = []
    for mention in mentions:
        owner = _tightest_gt_phrase(mention, gt_phrases)
        if owner is None:
            return []
        boxes.extend(box for box in map(_xyxy_with_score, owner["boxes"]) if box not in boxes)
    return boxes


def _name_forms(name: str) -> List[Tuple[str, ...]]:
    """A category name as a word sequence, with naive plurals of its last word ("dogs", "buses")."""
    words = tuple(_words(name))
    return [words, words[:-1] + (words[-1] + "s",), words[:-1] + (words[-1] + "es",)] if words else []


def _contains_sequence(words: Sequence[str], sequence: Sequence[str]) -> bool:
    n = len(sequence)
    return any(tuple(words[i:i + n]) == tuple(sequence) for i in range(len(words) - n + 1))


def mentions_category(phrase: str, name: str) -> bool:
    """Whether the phrase contains the category name as whole words (multi-word names, naive plurals)."""
    words = _words(phrase)
    return any(_contains_sequence(words, form) for form in _name_forms(name))


def load_coco_instances(path: str) -> Dict[int, List[Tuple[str, Box]]]:
    """COCO instances file -> {image_id: [(category name, xyxy box with score 1)]}."""
    document = json.loads(Path(path).read_text())
    names = {category["id"]: category["name"] for category in document["categories"]}
    instances: Dict[int, List[Tuple[str, Box]]] = {}
    for annotation in document["annotations"]:
        x, y, w, h = annotation["bbox"]
        box = _xyxy_with_score((x, y, x + w, y + h))
        instances.setdefault(annotation["image_id"], []).append((names[annotation["category_id"]], box))
    return instances


class AnnotationGrounder(ImageReader):
    """Ground-truth boxes instead of a detector.

    A phrase's boxes are the union of (1) the boxes of the request's gt phrases: by position where the request
    has `phrase_mentions` (each named object's own gt phrase, see `mention_boxes`), else those of the gt
    phrase that best covers its words (coverage >= `min_overlap`, see `best_gt_boxes`), and (2) with
    `instances_json`, every COCO instance of the image whose category name the phrase mentions. All scores
    are 1.

    Args:
        min_overlap: minimum share of the phrase's words found in the matched gt phrase. Above 0.5, so
            "red square" never takes the boxes of "red circle".
        instances_json: optional COCO instances file (categories + annotations with xywh `bbox`).
    """

    def __init__(self, min_overlap: float = 0.6, instances_json: Optional[str] = None):
        super().__init__()
        self.min_overlap = min_overlap
        self.instances_json = instances_json
        self.instances = load_coco_instances(instances_json) if instances_json else {}

    def settings(self) -> dict:
        instances = self.instances_json
        # "gt_matching" names how phrases meet gt phrases: a change of that rule must not reuse old caches.
        return {"name": "annotations", "min_overlap": self.min_overlap, "gt_matching": "positions-or-words",
                "instances_json": os.path.basename(instances) if instances else None,
                "instances_sha256": _file_sha256(instances) if instances else None}

    def ground(self, requests: Sequence[GroundingRequest]) -> List[List[List[Box]]]:
        return [self._request_boxes(request) for request in requests]

    def _request_boxes(self, request: GroundingRequest) -> List[List[Box]]:
        if self._read(request) is None:
            return [[] for _ in request.phrases]
        mentions = request.phrase_mentions or [None] * len(request.phrases)
        return [self._phrase_boxes(request, phrase, named) for phrase, named in zip(request.phrases, mentions)]

    def _phrase_boxes(self, request: GroundingRequest, phrase: str,
                      mentions: Optional[Sequence[Tuple[int, int]]] = None) -> List[Box]:
        gt_phrases = request.gt_phrases or []
        if mentions is not None:
            boxes = mention_boxes(mentions, gt_phrases)
        else:
            boxes = best_gt_boxes(phrase, gt_phrases, self.min_overlap)
        instances = self.instances.get(request.image_id, [])
        return boxes + [box for name, box in instances if mentions_category(phrase, name)]


class NoGrounder(ImageReader):
    """No boxes at all (text-only methods, or image masking by random rectangles only).

    Images are still decoded, to count the unreadable ones.
    """

    def settings(self) -> dict:
        return {"name": "none"}

    def ground(self, requests: Sequence[GroundingRequest]) -> List[List[List[Box]]]:
        for request in requests:
            self._read(request)
        return [[[] for _ in request.phrases] for request in requests]


GROUNDERS: Dict[str, Callable[..., Grounder]] = {
    "groundingdino": GroundingDinoGrounder,
    "annotations": AnnotationGrounder,
    "none": NoGrounder,
}


def build_grounder(name: str, **options) -> Grounder:
    """The registered grounder `name`, constructed with `options`.

    Raises:
        ValueError: `name` is not registered (the message lists the valid names).
    """
    if name not in GROUNDERS:
        raise ValueError(f"unknown grounder {name!r}; valid: {sorted(GROUNDERS)}")
    return GROUNDERS[name](**options)


# ----- patch masks -------------------------------------------------------------------------------------
# Overlaps below this fraction of a patch side count as zero: a box edge on a patch border, moved by float
# rounding of the crop rescale, must not mask the neighbour.
_EDGE_TOLERANCE = 1e-6


def _boxes_in_output(boxes: Iterable[Sequence[float]], crop: Sequence[float], output_size: int) -> np.ndarray:
    """[N, 4] boxes mapped from original pixels into the resized crop, clipped to [0, output_size]."""
    xyxy = np.asarray([box[:4] for box in boxes], dtype=np.float64).reshape(-1, 4)
    top, left, height, width = (float(v) for v in crop)
    scale = np.array([output_size / width, output_size / height] * 2)
    offset = np.array([left, top] * 2)
    return np.clip((xyxy - offset) * scale, 0.0, output_size)


def _axis_overlap(lo: np.ndarray, hi: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """[N, G] length of [lo, hi] inside each patch interval [edges[g], edges[g + 1]]."""
    inside = np.minimum(hi[:, None], edges[None, 1:]) - np.maximum(lo[:, None], edges[None, :-1])
    return np.maximum(inside, 0.0)


def boxes_to_patch_mask(boxes: Iterable[Sequence[float]], crop: Sequence[float], output_size: int, grid: int,
                        min_overlap: float = 0.0) -> np.ndarray:
    """Patches of a resized crop touched by any box.

    Args:
        boxes: boxes in original pixels, xyxy (4-tuples, or 5-tuples whose score is ignored; an [N, 4] array).
        crop: (top, left, height, width) of the crop in original pixels (torchvision
            `RandomResizedCrop.get_params`); the crop is resized to `output_size` x `output_size`.
        output_size: side of the network input in pixels.
        grid: patches per side (patch side = output_size / grid).
        min_overlap: 0 (MACCO): a patch is masked when a box overlaps it with positive area (touching along
            an edge does not count). > 0: a patch is masked when a single box covers at least this fraction
            of the patch's area (boxes are not unioned).

    Returns:
        Bool [grid * grid], row-major (row = y).
    """
    xyxy = _boxes_in_output(boxes, crop, output_size)
    patch = output_size / grid
    edges = np.arange(grid + 1) * patch
    overlap_x = _axis_overlap(xyxy[:, 0], xyxy[:, 2], edges)  # [N, G] columns
    overlap_y = _axis_overlap(xyxy[:, 1], xyxy[:, 3], edges)  # [N, G] rows
    if min_overlap > 0:
        covered = overlap_y[:, :, None] * overlap_x[:, None, :] >= min_overlap * patch * patch
    else:
        tolerance = _EDGE_TOLERANCE * patch
        covered = (overlap_y[:, :, None] > tolerance) & (overlap_x[:, None, :] > tolerance)
    return covered.any(axis=0).reshape(-1)


@lru_cache(maxsize=64)  # called per sample in the DataLoader, with the same few settings
def rectangle_shapes(grid: int, ratio: float = 0.75, tolerance: float = 0.25) -> Tuple[Tuple[int, int], ...]:
    """The (height, width) pairs, in patches, that MACCO's random rectangle accepts on a grid x grid grid.

    The original draws h and w uniformly in 1..grid and keeps them when |h w - r| <= max(1, tolerance r), with
    r = round(ratio grid^2) (Python's rounding). On 7 x 7 at ratio 0.75: r = 37, nine shapes, areas 28-42.
    """
    if not 0 < ratio <= 1:
        raise ValueError(f"random rectangle ratio must lie in (0, 1], got {ratio}")
    if tolerance < 0:
        raise ValueError(f"random rectangle tolerance must be >= 0, got {tolerance}")
    target = round(ratio * grid * grid)
    slack = max(1.0, tolerance * target)
    shapes = [(h, w) for h in range(1, grid + 1) for w in range(1, grid + 1) if abs(h * w - target) <= slack]
    if not shapes:
        raise ValueError(f"no rectangle on a {grid} x {grid} grid has an area within {slack} of {target} "
                         f"(ratio {ratio}, tolerance {tolerance})")
    return tuple(shapes)


def random_rectangle_mask(rng: np.random.Generator, grid: int, ratio: float = 0.75,
                          tolerance: float = 0.25) -> np.ndarray:
    """MACCO's random image mask: one axis-aligned rectangle of about `ratio` of the patch grid [code].

    The shape is uniform over `rectangle_shapes(grid, ratio, tolerance)`: the same distribution as the
    original's loop, which redraws h and w uniformly in 1..grid until the area is accepted, but in bounded
    time. Then top and left are uniform over the positions where the rectangle fits. On a 7 x 7 grid the areas
    are 28, 30, 35, 36 and 42 with probabilities 2/9, 2/9, 2/9, 1/9 and 2/9; the whole grid is never masked.
    With tolerance >= 0.25 some shape is always accepted: some h x w lies within max(1, r / 4) of any r in
    0..grid^2 (a smaller tolerance can leave none, which is an error).

    Args:
        rng: numpy random generator.
        grid: patches per side.
        ratio: target masked fraction of the grid (0.75 in MACCO's config).
        tolerance: accepted relative deviation of the area from the target (0.25 in the original code).

    Returns:
        Bool [grid * grid], row-major.
    """
    shapes = rectangle_shapes(grid, ratio, tolerance)
    height, width = shapes[int(rng.integers(len(shapes)))]
    top = int(rng.integers(grid - height + 1))
    left = int(rng.integers(grid - width + 1))
    mask = np.zeros((grid, grid), dtype=bool)
    mask[top:top + height, left:left + width] = True
    return mask.reshape(-1)
