"""COCO captions: one (image, caption) sample per caption annotation, with optional NegCLIP hard negatives.

Three annotation formats are read: a COCO captions JSON (COCO 2017 `captions_*.json`; an annotation may carry
a `neg_captions` list), Karpathy's `dataset_coco.json` (the splits named by `karpathy_splits`) and, when the
path ends in `.tsv`, the NegCLIP training TSV (`title`, `filepath`, `neg_caption`, `neg_image`). Hard negatives
are drawn at every access as NegCLIP's training code draws them (see datamodules/hard_negatives.py): K
hard-negative captions of the sample and, with `hard_negative_images`, one `neg_image` neighbour with its own
caption and hard captions. Bad input never becomes silent wrong numbers: missing images, empty captions and unreadable
images either raise, naming the file, or (with `on_bad_image="skip"`) are dropped or substituted, counted and
logged. Images are decoded by `parsers.images.rgb_image` (16-bit grayscale scaled to 8 bits, not clipped to
white), and an image whose geometry makes its boxes meaningless counts as unreadable: another size than the
annotations record, sides shorter than the patch grid (with masks), an extreme aspect ratio
(`parsers.images.image_shape_problem`). Captions longer than the context length are truncated by the
tokenizer, counted and flagged per sample. With `caption_sentences="random_prefix"` (SmartCLIP's long-caption
training) each access reads the caption's first k sentences, k drawn at random, and tokenises them then.

Captions are tokenised once, at construction, into numpy arrays: forked DataLoader workers share numpy
buffers copy-on-write, whereas a list of Python objects is copied page by page as reference counts change.
"""
from __future__ import annotations

import json
import logging
import os
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Sequence, Set, Tuple

import lightning as L
import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from core.config import per_device_batch_size
from datamodules.annotations import (KARPATHY_TRAIN_SPLITS, CaptionRecord, existing_path, image_path_candidates,
                                     read_annotation_file)
from datamodules.cache import CacheError
from datamodules.hard_negatives import (NEIGHBOUR_STREAM, NegativeCaptions, NeighbourCounts, NeighbourTable,
                                        build_neighbour_table, draw_generator, stream_seed)
from datamodules.loader_workers import init_loader_worker
from datamodules.masks import CaptionMasks, PatchGeometry
from datamodules.transforms import CropResize, seeded_generator, with_generator
from datamodules.word_vocabulary import WordVocabulary
from parsers.images import IMAGE_ERRORS, image_shape_problem, read_rgb_file

logger = logging.getLogger(__name__)

BAD_IMAGE_POLICIES = ("error", "skip")
# Consecutive unreadable images that "skip" steps over before giving up: more means a broken folder.
MAX_SUBSTITUTE_TRIES = 10
# Missing file names listed in the "skip" warning (the count is always given in full).
NAMES_IN_WARNING = 5
# Captions per tokenizer call: bounds the transient int64 tensor, not the result.
TOKENIZE_CHUNK = 8192
# SmartCLIP's sentence boundary: its training splits a ShareGPT4V caption at ". " and joins a prefix back.
SENTENCE_SEPARATOR = ". "
CAPTION_SENTENCES = ("all", "random_prefix")
# An image size the annotations do not record.
_UNKNOWN_SIZE = (-1, -1)

ImageTransform = Callable[[Image.Image], torch.Tensor]


class CaptionTokenizer(Protocol):
    """An open_clip text tokenizer (`open_clip.get_tokenizer(name)`, a `SimpleTokenizer`)."""

    def __call__(self, texts: List[str]) -> torch.Tensor:
        """Token ids [N, L], zero-padded; over-long captions truncated with EOT kept last."""

    def encode(self, text: str) -> List[int]:
        """BPE ids of `text` without SOT/EOT and without truncation."""


class UnreadableImageError(RuntimeError):
    """An image file that exists but cannot be decoded (`path`)."""

    def __init__(self, message: str, path: Optional[str] = None):
        super().__init__(message)
        self.path = path


# ----- tokenisation -------------------------------------------------------------------------------------
def tokenize_captions(tokenizer: CaptionTokenizer, captions: Sequence[str]) -> np.ndarray:
    """Token ids int32 [N, L] of `captions`, exactly as `tokenizer(captions)` gives them."""
    # At least one call, so that an empty list still yields [0, L].
    chunks = [tokenizer(list(captions[start:start + TOKENIZE_CHUNK])).numpy().astype(np.int32)
              for start in range(0, max(len(captions), 1), TOKENIZE_CHUNK)]
    return np.concatenate(chunks)


def find_truncated(tokenizer: CaptionTokenizer, captions: Sequence[str], tokens: np.ndarray) -> np.ndarray:
    """bool [N]: the captions whose untruncated length (BPE tokens + SOT + EOT) exceeds the context length."""
    context_length = tokens.shape[1]
    # open_clip pads with 0, so only a row without padding at the end can have been truncated: the second,
    # untruncated encoding runs on a handful of captions instead of all of them.
    full_rows = np.flatnonzero(tokens[:, -1] != 0)
    truncated = np.zeros(len(captions), dtype=bool)
    for row in full_rows:
        truncated[row] = len(tokenizer.encode(captions[row])) + 2 > context_length
    return truncated


def random_sentence_prefix(caption: str, rng: np.random.Generator) -> str:
    """SmartCLIP's training caption: the first k sentences (split at ". "), k uniform in 1..n, joined back.

    The caption is split as it is, not stripped first (as SmartCLIP's data code): a caption ending in ". " has
    an empty last sentence, so its whole text and the text without its final period are both drawn.
    """
    sentences = caption.split(SENTENCE_SEPARATOR)
    return SENTENCE_SEPARATOR.join(sentences[: int(rng.integers(1, len(sentences) + 1))])


class PackedTexts:
    """Strings in one numpy byte buffer with end offsets: forked workers share it (see the module doc)."""

    def __init__(self, texts: Sequence[str]):
        encoded = [text.encode("utf-8") for text in texts]
        self._bytes = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        self._ends = np.cumsum([len(e) for e in encoded], dtype=np.int64)

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, index: int) -> str:
        start = int(self._ends[index - 1]) if index > 0 else 0
        return self._bytes[start:int(self._ends[index])].tobytes().decode("utf-8")


def cycled_negative_rows(counts: np.ndarray, num_negatives: int) -> np.ndarray:
    """int64 [N, K] rows into the flat list of every sample's negatives, each sample cycling its own.

    A fixed choice (the first K, cycled), for the frozen-feature cache (datamodules/features.py), which encodes
    each sample's negatives once. The COCO dataset draws them at random at every access, as NegCLIP does.

    Args:
        counts: int [N], how many negatives sample i contributed to the flat list (all >= 1).
        num_negatives: K, the negatives per sample.
    """
    starts = np.cumsum(counts) - counts
    return starts[:, None] + np.arange(num_negatives)[None, :] % counts[:, None]


# ----- the dataset --------------------------------------------------------------------------------------
class CocoCaptions(Dataset):
    """One sample per caption annotation: image, tokenised caption, ids, optional hard negatives.

    A sample is a dict: `image` float [3, H, W] (from `transform`), `text` long [L], `image_id` and
    `caption_id` int, `truncated` bool (the caption was longer than the context length), `bad_image` bool
    (this sample stands in for one whose image could not be read), and with `num_hard_negatives` K > 0
    `neg_text` long [K, L]: K of the annotation's negatives drawn at random at this access (distinct while it
    has >= K). With `hard_negative_images`, also the sample's `neg_image` neighbour, drawn at random from its
    list: `neg_image` float [3, H, W], `neg_image_text` long [L] (the neighbour's own caption),
    `neg_image_id` int, and with K > 0 `neg_image_neg_text` long [K, L] (drawn from the neighbour's own
    negatives). The draws are a function of the sampler's augmentation seed (`(index, seed)` keys). With masks
    (the preprocessing cache), also bool [L] `obj_mask`, `comp_mask` (attribute and relation tokens), its split
    into `attr_mask` / `rel_mask`, and `patch_mask` over the patch grid.

    Args:
        annotations: a COCO captions JSON, or a NegCLIP TSV when the path ends in `.tsv`.
        image_dir: the folder that image file names are relative to.
        tokenizer: the model's open_clip tokenizer.
        transform: the model's open_clip image transform (PIL RGB image -> tensor).
        num_hard_negatives: K, negatives per sample (0 = none); every annotation must then have some.
        hard_negative_images: add each sample's NegCLIP `neg_image` neighbour (needs the NegCLIP TSV). Indices
            outside the file are bad input (`on_bad_image`); indices of rows the dataset does not hold
            (excluded images, rows beyond max_samples, dropped rows) are never drawn; samples left without a
            neighbour are not trained on. All are counted.
        on_bad_image: "error" raises on a missing image, an empty caption or an unreadable image; "skip"
            drops missing images and empty captions at construction and substitutes the next sample for an
            unreadable image, counting and logging each. An image counts as unreadable also when it is not the
            size the annotations record, is narrower than the patch grid (with masks) or has an extreme aspect
            ratio (`parsers.images.image_shape_problem`).
        max_samples: keep only the first N annotations of the file (before dropping any).
        comp_mask_rule: with `mask_records`, how composition words become `comp_mask` tokens
            (`datamodules.masks`: "every_occurrence" [ours] or "first_bpe_match", MACCO's original).
        caption_field: the annotation key of the caption in a COCO captions JSON (e.g. long captions).
        caption_sentences: "all", or "random_prefix": each access reads the caption's first k sentences, k
            uniform in 1..n (SmartCLIP's long-caption training), seeded by the sampler's augmentation seed.

    Attributes:
        num_images: distinct images among the kept rows.
        num_missing_images: distinct image files that were not found.
        num_empty_captions: captions that were empty after stripping.
        num_truncated_captions: kept captions longer than the context length.
        neighbour_counts: with `hard_negative_images`, what became of the `neg_image` indices.
        context_length: L.
    """

    def __init__(self, annotations: str | os.PathLike, image_dir: str | os.PathLike,
                 tokenizer: CaptionTokenizer, transform: ImageTransform, *, num_hard_negatives: int = 0,
                 hard_negative_images: bool = False, on_bad_image: str = "error", max_samples: Optional[int] = None,
                 karpathy_splits: Sequence[str] = KARPATHY_TRAIN_SPLITS,
                 exclude_image_ids: Optional[Set[int]] = None, mask_records: Optional[Dict[int, dict]] = None,
                 geometry: Optional[PatchGeometry] = None, comp_mask_rule: str = "every_occurrence",
                 caption_field: str = "caption", caption_sentences: str = "all"):
        _check_options(tokenizer, num_hard_negatives, on_bad_image, max_samples)
        _check_caption_sentences(caption_sentences, mask_records)
        self.annotations = os.fspath(annotations)
        self.image_dir = os.fspath(image_dir)
        self.transform = transform
        # The crop draws from a per-sample generator (datamodules/transforms.py); CropResize takes one itself.
        self._transform_drawing = with_generator(transform) if mask_records is None else transform
        self.num_hard_negatives = num_hard_negatives
        self.on_bad_image = on_bad_image
        self.geometry = geometry
        self.comp_mask_rule = comp_mask_rule
        file_records = read_annotation_file(self.annotations, karpathy_splits, caption_field)
        records = self._drop_excluded_images(file_records[:max_samples], exclude_image_ids or set())
        records = self._drop_empty_captions(records)
        records = self._resolve_images(records)
        self._store_ids(records)
        if caption_sentences == "random_prefix":
            self._keep_texts(tokenizer, records)
        else:
            self._tokenize(tokenizer, records)
        self._negatives = (NegativeCaptions.from_records(records, lambda c: tokenize_captions(tokenizer, c),
                                                         num_hard_negatives, self.annotations)
                           if num_hard_negatives > 0 else None)
        self._neighbours: Optional[NeighbourTable] = None
        self.neighbour_counts: Optional[NeighbourCounts] = None
        if hard_negative_images:
            self._neighbours, self.neighbour_counts = build_neighbour_table(records, len(file_records),
                                                                            on_bad_image, self.annotations)
        # The rows trained on (None: every row); rows without a neighbour stay available as neighbours.
        self._anchor_rows = self._neighbours.anchor_rows if self._neighbours is not None else None
        self.masks = self._build_masks(records, mask_records, tokenizer) if mask_records is not None else None
        self._reported_bad_files: Set[str] = set()

    def __len__(self) -> int:
        return len(self._anchor_rows) if self._anchor_rows is not None else len(self._caption_ids)

    def _row(self, index: int) -> int:
        """The row (kept annotation) of sample `index`."""
        return int(self._anchor_rows[index]) if self._anchor_rows is not None else index

    def __getitem__(self, key: int | Tuple[int, int]) -> Dict[str, Any]:
        """Sample `key`, or `(index, augmentation_seed)` as yielded by `SeededDistributedSampler`."""
        index, augmentation_seed = key if isinstance(key, tuple) else (key, None)
        draws = draw_generator(augmentation_seed)  # hard captions and neighbour, apart from the crops
        source, pil_image, neighbour = self._images_or_substitute(index, draws)
        row = self._row(source)
        crops = crop_generator(augmentation_seed)
        if self.masks is None:
            sample = {"image": self._transform_drawing(pil_image, crops)}
        else:
            sample = self._image_and_masks(row, pil_image, np.random.default_rng(augmentation_seed), crops)
        sample.update(self._caption_fields(row, augmentation_seed, draws))
        sample["bad_image"] = source != index
        if neighbour is not None:
            sample.update(self._neighbour_fields(*neighbour, stream_seed(augmentation_seed, NEIGHBOUR_STREAM),
                                                 draws))
        return sample

    def _caption_fields(self, row: int, seed: Optional[int], draws: np.random.Generator) -> Dict[str, Any]:
        fields = {**self._caption(row, seed), "image_id": int(self._image_ids[row]),
                  "caption_id": int(self._caption_ids[row])}
        if self._negatives is not None:
            fields["neg_text"] = torch.from_numpy(self._negatives.draw(row, draws))
        return fields

    def _neighbour_fields(self, row: int, pil_image: Image.Image, seed: Optional[int],
                          draws: np.random.Generator) -> Dict[str, Any]:
        """The neighbour's image (its own crop), its own caption and its own drawn hard captions."""
        crops = crop_generator(seed)
        pixels = (self._transform_drawing(pil_image, crops) if self.masks is None
                  else self._transform_drawing(pil_image, (), crops)[0])
        fields = {"neg_image": pixels, "neg_image_text": self._caption(row, seed)["text"],
                  "neg_image_id": int(self._image_ids[row])}
        if self._negatives is not None:
            fields["neg_image_neg_text"] = torch.from_numpy(self._negatives.draw(row, draws))
        return fields

    def image_path(self, index: int) -> str:
        """The image file of sample `index`."""
        return self._row_image_path(self._row(index))

    def _row_image_path(self, row: int) -> str:
        return str(self._image_paths[self._image_rows[row]])

    def summary(self) -> str:
        """One line: samples, images, missing images, truncated and empty captions, and the source file."""
        truncated = ("truncation counted per drawn caption" if self._texts is not None
                     else f"{self.num_truncated_captions} truncated captions")
        neighbours = "" if self.neighbour_counts is None else (
            f", neg_image: {self.neighbour_counts.out_of_range} out-of-range and "
            f"{self.neighbour_counts.unavailable} unavailable indices, {self.neighbour_counts.without_neighbour} "
            f"samples without a neighbour")
        return (f"{len(self)} samples, {self.num_images} images, {self.num_excluded_images} excluded images, "
                f"{self.num_missing_images} missing images, {truncated}, {self.num_empty_captions} empty "
                f"captions{neighbours} ({self.annotations})")

    # ----- construction ---------------------------------------------------------------------------------
    def _drop_excluded_images(self, records: List[CaptionRecord], excluded: Set[int]) -> List[CaptionRecord]:
        kept = [record for record in records if record.image_id not in excluded]
        self.num_excluded_captions = len(records) - len(kept)
        self.num_excluded_images = len({r.image_id for r in records} - {r.image_id for r in kept})
        if excluded:
            logger.info("%s: removed %d captions of %d excluded images (data.exclude_image_ids)",
                        self.annotations, self.num_excluded_captions, self.num_excluded_images)
        return kept

    def _build_masks(self, records: List[CaptionRecord], mask_records: Dict[int, dict],
                     tokenizer: CaptionTokenizer) -> CaptionMasks:
        missing = [r.caption_id for r in records if r.caption_id not in mask_records]
        if missing:
            raise CacheError(f"{len(missing)} captions of {self.annotations} are not in the preprocessing cache "
                             f"(e.g. id {missing[0]}); rerun python -m datamodules.preprocess")
        if self.geometry is None:
            raise ValueError("masks need a PatchGeometry (image size and patch grid)")
        return CaptionMasks([mask_records[r.caption_id] for r in records], tokenizer, self.context_length,
                            self.comp_mask_rule)

    def _drop_empty_captions(self, records: List[CaptionRecord]) -> List[CaptionRecord]:
        empty = [record.caption_id for record in records if not record.caption]
        self.num_empty_captions = len(empty)
        if empty and self.on_bad_image == "error":
            raise ValueError(f"{self.annotations}: annotation {empty[0]} has an empty caption ({len(empty)} "
                             f"empty in all); set data.on_bad_image=skip to drop them")
        if empty:
            logger.warning("%s: dropped %d empty captions (annotation ids %s)", self.annotations, len(empty),
                           empty[:NAMES_IN_WARNING])
        return [record for record in records if record.caption]

    def _resolve_images(self, records: List[CaptionRecord]) -> List[CaptionRecord]:
        """Find every image once (one stat per distinct file); drop or reject samples whose image is missing."""
        candidates = {record.file_name: image_path_candidates(self.image_dir, record.file_name)
                      for record in records}
        found = {name: existing_path(paths) for name, paths in candidates.items()}
        missing = [" or ".join(candidates[name]) for name, path in found.items() if path is None]
        self.num_missing_images = len(missing)
        if missing:
            self._report_missing(missing)
        kept = [record for record in records if found[record.file_name] is not None]
        image_paths = list(dict.fromkeys(found[record.file_name] for record in kept))
        row_of_path = {path: row for row, path in enumerate(image_paths)}
        # Fixed-width numpy strings, not a list of str: see the module docstring on forked workers.
        self._image_paths = np.array(image_paths, dtype=np.str_)
        sizes = {found[r.file_name]: r.annotated_size for r in reversed(kept) if r.annotated_size is not None}
        self._annotated_sizes = np.array([sizes.get(path, _UNKNOWN_SIZE) for path in image_paths],
                                         dtype=np.int32).reshape(-1, 2)
        self._image_rows = np.array([row_of_path[found[r.file_name]] for r in kept], dtype=np.int32)
        self.num_images = len(image_paths)
        return kept

    def _report_missing(self, missing: List[str]) -> None:
        if self.on_bad_image == "error":
            raise FileNotFoundError(f"{len(missing)} image file(s) referenced by {self.annotations} are "
                                    f"missing; the first: {missing[0]} (set data.on_bad_image=skip to drop "
                                    f"their captions)")
        logger.warning("%s: %d image files are missing, their captions are dropped; e.g. %s",
                       self.annotations, len(missing), ", ".join(missing[:NAMES_IN_WARNING]))

    def _store_ids(self, records: List[CaptionRecord]) -> None:
        self._image_ids = np.array([record.image_id for record in records], dtype=np.int64)
        self._caption_ids = np.array([record.caption_id for record in records], dtype=np.int64)

    def _keep_texts(self, tokenizer: CaptionTokenizer, records: List[CaptionRecord]) -> None:
        """Random sentence prefixes: keep the caption texts as read (unstripped), tokenised at each access."""
        self._texts, self._tokenizer = PackedTexts([record.unstripped_caption for record in records]), tokenizer
        self.context_length = tokenize_captions(tokenizer, []).shape[1]
        self.num_truncated_captions = 0  # counted per access (the sample's `truncated`)

    def _tokenize(self, tokenizer: CaptionTokenizer, records: List[CaptionRecord]) -> None:
        self._texts = None
        captions = [record.caption for record in records]
        self._tokens = tokenize_captions(tokenizer, captions)
        self.context_length = self._tokens.shape[1]
        self._truncated = find_truncated(tokenizer, captions, self._tokens)
        self.num_truncated_captions = int(self._truncated.sum())
        if self.num_truncated_captions:
            logger.warning("%s: %d captions are longer than the context length %d and were truncated",
                           self.annotations, self.num_truncated_captions, self.context_length)

    # ----- loading --------------------------------------------------------------------------------------
    def _caption(self, row: int, seed: Optional[int]) -> Dict[str, Any]:
        """`text` [L] and `truncated` of row `row`: stored, or a random sentence prefix tokenised now."""
        if self._texts is None:
            return {"text": torch.from_numpy(self._tokens[row].astype(np.int64)),
                    "truncated": bool(self._truncated[row])}
        # Its own stream of the sample's seed: independent of the image crop's draws.
        rng = np.random.default_rng(None if seed is None else [seed, 1])
        caption = random_sentence_prefix(self._texts[row], rng)
        tokens = tokenize_captions(self._tokenizer, [caption])
        return {"text": torch.from_numpy(tokens[0].astype(np.int64)),
                "truncated": bool(find_truncated(self._tokenizer, [caption], tokens)[0])}

    def _images_or_substitute(self, index: int, draws: np.random.Generator
                              ) -> Tuple[int, Image.Image, Optional[Tuple[int, Image.Image]]]:
        """(the sample index actually used, its image, its neighbour's (row, image) or None): `index` itself
        unless its image or its drawn neighbour's image is unreadable."""
        if self.on_bad_image == "error":
            return (index, *self._sample_images(index, draws))
        # A substitute rather than a dropped sample keeps batch sizes equal on every DDP rank.
        last_bad = None
        for step in range(MAX_SUBSTITUTE_TRIES + 1):
            source = (index + step) % len(self)
            try:
                return (source, *self._sample_images(source, draws))
            except UnreadableImageError as err:
                self._warn_once(err)
                last_bad = err.path
        raise UnreadableImageError(f"{MAX_SUBSTITUTE_TRIES + 1} consecutive unreadable images from sample "
                                   f"{index} on, the last {last_bad}; is {self.image_dir} intact?")

    def _sample_images(self, index: int, draws: np.random.Generator
                       ) -> Tuple[Image.Image, Optional[Tuple[int, Image.Image]]]:
        row = self._row(index)
        image = self._load_image(row)
        if self._neighbours is None:
            return image, None
        neighbour = self._neighbours.draw(row, draws)
        return image, (neighbour, self._load_image(neighbour))

    def _load_image(self, row: int) -> Image.Image:
        path = self._row_image_path(row)
        try:
            image = read_rgb_file(path)  # decodes every byte, so a truncated file fails here
        except IMAGE_ERRORS as err:
            raise UnreadableImageError(f"cannot read image {path}: {err}", path) from err
        problem = image_shape_problem(image.size, self._annotated_size(row), self._min_image_side())
        if problem is not None:
            raise UnreadableImageError(f"unusable image {path}: {problem}", path)
        return image

    def _annotated_size(self, row: int) -> Optional[Tuple[int, int]]:
        width, height = (int(v) for v in self._annotated_sizes[self._image_rows[row]])
        return None if (width, height) == _UNKNOWN_SIZE else (width, height)

    def _min_image_side(self) -> int:
        """With patch masks, one pixel per patch of the grid at least; else any image."""
        return self.geometry.grid_size if self.masks is not None else 1

    def _image_and_masks(self, row: int, image: Image.Image, rng: np.random.Generator,
                         crops: Optional[torch.Generator]) -> Dict[str, Any]:
        """The training crop of the image (drawn from `crops`), the patch mask of one sampled phrase, and the token
        masks."""
        boxes = self.masks.draw_phrase_boxes(row, rng, self.geometry)
        pixels, crop = self._transform_drawing(image, boxes if boxes is not None else (), crops)
        token_masks = self.masks.sample_token_masks(row, self.context_length)
        patch_mask = self.masks.patch_mask(boxes, crop, rng, self.geometry)
        return {"image": pixels, **{name: torch.from_numpy(mask) for name, mask in token_masks.items()},
                "patch_mask": torch.from_numpy(patch_mask)}

    def _warn_once(self, err: UnreadableImageError) -> None:
        path = err.path
        if path not in self._reported_bad_files:
            self._reported_bad_files.add(path)
            logger.warning("%s; its samples are replaced by the next readable ones (bad_image=True)", err)


def _check_caption_sentences(caption_sentences: str, mask_records: Optional[Dict[int, dict]]) -> None:
    if caption_sentences not in CAPTION_SENTENCES:
        raise ValueError(f"caption_sentences={caption_sentences!r} is not one of {', '.join(CAPTION_SENTENCES)}")
    if caption_sentences != "all" and mask_records is not None:
        raise ValueError("data.train_caption_sentences=random_prefix changes the caption at every access, so the "
                         "cached token masks of whole captions (data.masks=true) do not apply")


def _check_options(tokenizer: CaptionTokenizer, num_hard_negatives: int, on_bad_image: str,
                   max_samples: Optional[int]) -> None:
    if on_bad_image not in BAD_IMAGE_POLICIES:
        raise ValueError(f"on_bad_image={on_bad_image!r} is not one of {', '.join(BAD_IMAGE_POLICIES)}")
    if num_hard_negatives < 0 or (max_samples is not None and max_samples < 0):
        raise ValueError(f"num_hard_negatives ({num_hard_negatives}) and max_samples ({max_samples}) must "
                         f"not be negative")
    if not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(f"{type(tokenizer).__name__} has no encode(text) method, so truncated captions "
                        f"cannot be counted; use an open_clip SimpleTokenizer")


def crop_generator(seed: Optional[int]) -> Optional[torch.Generator]:
    """The generator of a sample's image crop: seeded by its augmentation seed, its draws those of torch's global
    generator after `torch.manual_seed(seed)`; None (the global generator, as a plain transform) without a seed."""
    return None if seed is None else seeded_generator(seed)


# ----- loaders ------------------------------------------------------------------------------------------


class SeededDistributedSampler(DistributedSampler):
    """A DistributedSampler that yields `(index, augmentation_seed)` pairs, and can start an epoch mid-way.

    The seed is a function of (sampler seed, epoch, index) only, so a sample's random crop is the same
    whatever the number of workers, and a run resumed from a checkpoint sees exactly the augmentations that
    the uninterrupted run would have seen (worker RNG streams are not part of a checkpoint). `resume_at`
    makes the next pass start after the samples an interrupted run already trained on in that epoch.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._skip_next = 0

    def resume_at(self, epoch: int, samples_done: int) -> None:
        """The next pass is epoch `epoch`, without its first `samples_done` samples of this rank."""
        self.set_epoch(epoch)
        self._skip_next = samples_done

    def __iter__(self) -> Iterator[Tuple[int, int]]:
        skip, self._skip_next = self._skip_next, 0
        for position, index in enumerate(super().__iter__()):
            if position >= skip:
                yield index, int(np.random.SeedSequence([self.seed, self.epoch, index]).generate_state(1)[0])


EpochPosition = Callable[[], Tuple[int, int]]


class ResumableLoader(DataLoader):
    """The training loader, whose position in its epoch is part of every checkpoint.

    Lightning stores `state_dict()` of a training loader in each checkpoint (last, best, SLURM `hpc_ckpt`) and
    calls `load_state_dict` before it iterates the loader again on resume. The position comes from the trainer
    (`position()`: epoch and batches the training loop has processed in it), not from counting what the
    iterator handed out, which runs ahead of training by the prefetched batches. On resume the sampler skips
    exactly the batches already trained on, so a run stopped at any step and resumed sees the batches (and
    augmentations) of the uninterrupted run.
    """

    def __init__(self, *args, position: Optional[EpochPosition] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.position = position

    def state_dict(self) -> Dict[str, int]:
        epoch, batches_done = self.position() if self.position is not None else (0, 0)
        return {"epoch": int(epoch), "batches_done": int(batches_done)}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        epoch, batches_done = int(state["epoch"]), int(state["batches_done"])
        if batches_done >= len(self):  # saved after the epoch's last batch: the next epoch starts afresh
            epoch, batches_done = epoch + 1, 0
        self.sampler.resume_at(epoch, batches_done * self.batch_size)


def trainer_epoch_position(trainer: Any) -> EpochPosition:
    """(epoch, batches processed in it) of a trainer's fit loop, read when a checkpoint is written.

    The epoch is the last one started, not `trainer.current_epoch`: after a stop mid-epoch (max_steps, a
    callback) Lightning counts the unfinished epoch as completed at `on_train_end`.
    """
    def position() -> Tuple[int, int]:
        fit_loop = trainer.fit_loop
        return max(0, fit_loop.epoch_progress.total.started - 1), fit_loop.epoch_loop.batch_progress.current.processed

    return position


def check_enough_samples(num_samples: int, batch_size: int, world_size: int) -> None:
    """Raise unless the training set fills one global batch: with drop_last it would train on nothing."""
    if num_samples < batch_size * world_size:
        raise ValueError(f"the training set has {num_samples} samples, fewer than one global batch "
                         f"(batch_size {batch_size} x world size {world_size}); with drop_last=True there "
                         f"would be no training batch at all")


def build_dataloader(dataset: Dataset, *, batch_size: int, num_workers: int, world_size: int, rank: int,
                     train: bool, seed: int = 0, position: Optional[EpochPosition] = None) -> DataLoader:
    """A loader over this rank's shard of `dataset`.

    Training: shuffled by (seed, epoch) via `sampler.set_epoch`, which Lightning calls every epoch, and
    `drop_last` in both sampler and loader so every rank runs the same number of equal-sized batches (the
    distributed contrastive loss gathers them); a `ResumableLoader` whose epoch `position` is checkpointed.
    Evaluation: in order, nothing dropped; DistributedSampler pads the last shard by repeating a few samples
    so ranks stay in step.
    Workers ignore the stop signals a scheduler sends to the whole job (loader_workers.py): the training process
    stops at a step boundary and shuts them down itself.
    """
    options = dict(batch_size=batch_size, drop_last=train, num_workers=num_workers,
                   persistent_workers=num_workers > 0, pin_memory=torch.cuda.is_available(),
                   worker_init_fn=partial(init_loader_worker, rank=rank) if num_workers > 0 else None)
    if not train:
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
        return DataLoader(dataset, sampler=sampler, **options)
    sampler = SeededDistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                       drop_last=True)
    return ResumableLoader(dataset, sampler=sampler, position=position, **options)


class CocoDataModule(L.LightningDataModule):
    """Train/val `CocoCaptions` splits and their DDP-sharded loaders.

    The trainer must be built with `use_distributed_sampler=False`: the loaders bring their own
    `DistributedSampler`, whose (seed, epoch) order makes runs reproducible and resumable.

    Args:
        data: the `data` section of the config (fields of `core.config.DataConfig`).
        tokenizer: the model's open_clip tokenizer.
        train_transform: the model's training image transform (used when `data.train_augment`).
        val_transform: the model's evaluation image transform.
        seed: the shuffling seed of the training sampler.
        hard_negatives: the `method.hard_negatives` section (`captions` per training sample, neighbour `images`);
            None = none.
    """

    def __init__(self, data: Any, tokenizer: CaptionTokenizer, train_transform: ImageTransform,
                 val_transform: ImageTransform, seed: int = 0, preprocess: Any = None,
                 image_config: Optional[dict] = None, grid_size: Optional[int] = None, hard_negatives: Any = None):
        super().__init__()
        if data.masks and (preprocess is None or image_config is None or grid_size is None):
            raise ValueError("data.masks=true needs the preprocess config, the model's image config and patch grid")
        self.data = data
        self.hard_negatives = hard_negatives
        self.preprocess = preprocess
        self.image_config = image_config
        self.grid_size = grid_size
        self.tokenizer = tokenizer
        self.train_transform = train_transform
        self.val_transform = val_transform
        self.seed = seed
        self.train_dataset: Optional[CocoCaptions] = None
        self.val_dataset: Optional[CocoCaptions] = None
        self._replacement_vocabulary: Optional[WordVocabulary] = None

    def setup(self, stage: str) -> None:
        """Build the training split for "fit" and the validation split for "fit" and "validate"."""
        if stage == "fit" and self.train_dataset is None:
            self.train_dataset = self._build_split("train")
        if stage in ("fit", "validate") and self.val_dataset is None and self.data.val_annotations:
            self.val_dataset = self._build_split("val")

    @property
    def replacement_vocabulary(self) -> Optional[WordVocabulary]:
        """CLIP-CAE's replacement words: the parsed words of the kept training captions, per kind (built once,
        deterministically, from the cache records of `setup('fit')`); None without `data.masks`."""
        masks = self.train_dataset.masks if self.train_dataset is not None else None
        if self._replacement_vocabulary is None and masks is not None:
            self._replacement_vocabulary = WordVocabulary.from_counts(masks.word_counts, self.tokenizer)
            logger.info("replacement vocabulary (training captions' words): %s", self._replacement_vocabulary.sizes())
        return self._replacement_vocabulary

    def train_dataloader(self) -> DataLoader:
        """Shuffled, sharded over ranks, full batches only."""
        dataset = _built(self.train_dataset, "train", "setup('fit')")
        world_size, rank = self._world_size_and_rank()
        batch_size = per_device_batch_size(self.data)
        check_enough_samples(len(dataset), batch_size, world_size)
        return build_dataloader(dataset, batch_size=batch_size, num_workers=self.data.num_workers,
                                world_size=world_size, rank=rank, train=True, seed=self.seed,
                                position=trainer_epoch_position(self.trainer) if self.trainer else None)

    def val_dataloader(self) -> DataLoader:
        """In order, sharded over ranks, last batch kept."""
        dataset = _built(self.val_dataset, "val", "setup('fit') or setup('validate')")
        world_size, rank = self._world_size_and_rank()
        return build_dataloader(dataset, batch_size=per_device_batch_size(self.data, validation=True),
                                num_workers=self.data.num_workers, world_size=world_size, rank=rank,
                                train=False)

    def _build_split(self, split: str) -> CocoCaptions:
        data = self.data
        augment = split == "train" and data.train_augment
        dataset = CocoCaptions(
            os.path.join(data.root, getattr(data, f"{split}_annotations")),
            os.path.join(data.root, getattr(data, f"{split}_images")),
            self.tokenizer, self._transform(augment),
            # Validation reports the plain contrastive loss, comparable across methods and runs.
            num_hard_negatives=self.hard_negatives.captions if self.hard_negatives and split == "train" else 0,
            hard_negative_images=bool(self.hard_negatives and self.hard_negatives.images and split == "train"),
            on_bad_image=data.on_bad_image,
            max_samples=getattr(data, f"max_{split}_samples"),
            karpathy_splits=tuple(getattr(data, f"{split}_karpathy_splits")),
            caption_field=data.caption_field,
            # Validation reads whole captions (SmartCLIP validates on full ShareGPT4V captions too).
            caption_sentences=data.train_caption_sentences if split == "train" else "all",
            exclude_image_ids=read_image_ids(data.exclude_image_ids) if split == "train" else None,
            **self._mask_options(split))
        logger.info("%s split: %s", split, dataset.summary())
        return dataset

    def _transform(self, augment: bool):
        if not self.data.masks:
            return self.train_transform if augment else self.val_transform
        return CropResize.from_open_clip(self.image_config, train=augment, scale=self.data.crop_scale,
                                         box_aware=self.data.box_aware_crop)

    def _mask_options(self, split: str) -> Dict[str, Any]:
        """Cache records and patch geometry for `data.masks`; the cache is read, never built, here."""
        if not self.data.masks:
            return {}
        from datamodules.preprocess import mask_records  # the parser/grounder settings locate the cache

        geometry = PatchGeometry(CropResize.from_open_clip(self.image_config, train=False).size, self.grid_size,
                                 self.data.patch_mask_min_overlap, self.data.random_rectangle_prob,
                                 self.data.out_of_crop_boxes)
        return {"mask_records": mask_records(self.data, self.preprocess, split), "geometry": geometry,
                "comp_mask_rule": self.data.comp_mask_rule}

    def _world_size_and_rank(self) -> Tuple[int, int]:
        if self.trainer is None:
            return 1, 0
        return self.trainer.world_size, self.trainer.global_rank


def read_image_ids(path: Optional[str]) -> Set[int]:
    """Image ids from a file: a JSON list, or one id per line (blank lines and # comments ignored)."""
    if not path:
        return set()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data.exclude_image_ids: no such file {path}")
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    if text.lstrip().startswith("["):
        return {int(i) for i in json.loads(text)}
    lines = (line.split("#")[0].strip() for line in text.splitlines())
    return {int(line) for line in lines if line}


def _built(dataset: Optional[CocoCaptions], split: str, setup_call: str) -> CocoCaptions:
    if dataset is None:
        raise RuntimeError(f"the {split} split is not built; call {setup_call} first")
    return dataset
