"""Per-sample text and patch masks from the preprocessing cache, in compact numpy form.

Token masks (`obj_mask`, `comp_mask`, and `comp_mask` split into `attr_mask` / `rel_mask`) are computed once per
caption when the dataset is built (the spans are fixed), together with the counts of the parsed words per kind
(CLIP-CAE's replacement vocabulary, datamodules/word_vocabulary.py). `comp_mask` follows `data.comp_mask_rule`:
"every_occurrence" [ours, default] masks the tokens of the exact character spans of every composition word the
parser found; "first_bpe_match" is MACCO's original rule (`parsers.token_alignment.first_bpe_match_mask`, given
the words of the cached scene graph by `composition_words`). The patch mask is drawn per sample: with probability
`random_rectangle_prob` a random rectangle of the patch grid (MACCO's distribution,
`parsers.grounding.random_rectangle_mask`), otherwise the boxes of one phrase of the caption, sampled uniformly,
mapped through the sample's crop by `PatchGeometry.out_of_crop_boxes`: "clamp" (MACCO's original rule,
`clamped_boxes_patch_mask`) pulls every edge that leaves the crop back onto it, so a box the crop cut away still
masks the border patches next to it; "drop" [ours] clips the boxes to the crop and masks the patches they overlap
there, so such a box masks nothing. Everything is stored in flat numpy arrays indexed by offsets, so forked
DataLoader workers share it instead of copying Python objects.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from datamodules.word_vocabulary import RELATION, count_words, record_word_kinds
from parsers.grounding import boxes_to_patch_mask, random_rectangle_mask
from parsers.token_alignment import caption_masks, first_bpe_match_mask, spans_to_token_mask

COMP_MASK_RULES = ("every_occurrence", "first_bpe_match")
# Text the parser leaves between the words of one relation that MACCO's relation strings contain: "to the
# left of" is the relation "to left of" of the cached graph, and one string, "the" included, in the original.
_RELATION_GAP = re.compile(r"\s+(?:the\s+)?", re.IGNORECASE)
OUT_OF_CROP_BOXES = ("clamp", "drop")
# MACCO's box -> patch rule takes this much (network-input pixels) off a box's right and bottom edges, so that an
# edge lying on a patch boundary does not reach into the next patch.
_EDGE_EPSILON = 1e-5


@dataclass
class PatchGeometry:
    """Where a sample's pixels land on the ViT patch grid.

    `out_of_crop_boxes`: "clamp" (MACCO's original) or "drop" [ours], see the module. `min_overlap` > 0 [ours]
    belongs to "drop": the original masks every patch a box touches.
    """

    image_size: int
    grid_size: int
    min_overlap: float = 0.0
    random_rectangle_prob: float = 0.1
    out_of_crop_boxes: str = "clamp"

    def __post_init__(self):
        if self.out_of_crop_boxes not in OUT_OF_CROP_BOXES:
            raise ValueError(f"data.out_of_crop_boxes={self.out_of_crop_boxes!r} is not one of "
                             f"{', '.join(OUT_OF_CROP_BOXES)}")
        if self.min_overlap > 0 and self.out_of_crop_boxes == "clamp":
            raise ValueError(f"data.patch_mask_min_overlap={self.min_overlap} needs data.out_of_crop_boxes=drop: the "
                             f"original's clamping rule masks every patch a box touches (set it to 0, or use drop)")


class CaptionMasks:
    """Masks of the dataset's samples, in dataset order.

    Args:
        records: cache records of the kept samples, in dataset order (caption, obj/comp spans, phrases, graph).
        tokenizer: the model's open_clip tokenizer.
        context_length: L of the token masks.
        comp_mask_rule: "every_occurrence" [ours] or "first_bpe_match" (MACCO's original), see the module.
    """

    def __init__(self, records: Sequence[dict], tokenizer, context_length: int,
                 comp_mask_rule: str = "every_occurrence"):
        if comp_mask_rule not in COMP_MASK_RULES:
            raise ValueError(f"comp_mask_rule {comp_mask_rule!r} is not one of {', '.join(COMP_MASK_RULES)}")
        self.obj, self.comp, self.rel = self._token_masks(records, tokenizer, context_length, comp_mask_rule)
        self.phrase_offsets, self.box_offsets, self.boxes = _flatten_phrase_boxes(records)
        self.word_counts = count_words(records)  # kind code -> Counter of the parsed words' texts

    @staticmethod
    def _token_masks(records: Sequence[dict], tokenizer, context_length: int,
                     comp_mask_rule: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        obj = np.zeros((len(records), context_length), dtype=bool)
        comp, rel = np.zeros_like(obj), np.zeros_like(obj)
        for row, record in enumerate(records):
            caption = record["caption"]
            obj[row], comp[row] = caption_masks(caption, [tuple(s) for s in record["obj_spans"]],
                                                [tuple(s) for s in record["comp_spans"]], tokenizer, context_length)
            if comp_mask_rule == "first_bpe_match":
                comp[row] = first_bpe_match_mask(caption, composition_words(record), tokenizer, context_length)
                relations = first_bpe_match_mask(caption, relation_words(record), tokenizer, context_length)
            else:
                spans = [span for span, kind in record_word_kinds(record).items() if kind == RELATION]
                relations = spans_to_token_mask(caption, spans, tokenizer, context_length)
            rel[row] = comp[row] & relations  # relation tokens; the other composition tokens are attributes
        return np.packbits(obj, axis=1), np.packbits(comp, axis=1), np.packbits(rel, axis=1)

    def token_masks(self, index: int, context_length: int) -> Tuple[np.ndarray, np.ndarray]:
        """(obj_mask, comp_mask), bool [context_length]."""
        return _unpack(self.obj[index], context_length), _unpack(self.comp[index], context_length)

    def sample_token_masks(self, index: int, context_length: int) -> Dict[str, np.ndarray]:
        """obj_mask, comp_mask and comp_mask's split into attr_mask / rel_mask (bool [context_length])."""
        obj, comp = self.token_masks(index, context_length)
        rel = _unpack(self.rel[index], context_length)
        return {"obj_mask": obj, "comp_mask": comp, "attr_mask": comp & ~rel, "rel_mask": rel}

    def phrase_boxes(self, index: int, phrase: int) -> np.ndarray:
        """Boxes [K, 4] (original pixels, xyxy) of the caption's `phrase`-th phrase."""
        flat = self.phrase_offsets[index] + phrase
        return self.boxes[self.box_offsets[flat]:self.box_offsets[flat + 1]]

    def num_phrases(self, index: int) -> int:
        return int(self.phrase_offsets[index + 1] - self.phrase_offsets[index])

    def draw_phrase_boxes(self, index: int, rng: np.random.Generator, geometry: PatchGeometry) -> Optional[np.ndarray]:
        """Boxes of one uniformly sampled phrase; None means "use a random rectangle" (prob. 0.1 in MACCO)."""
        if rng.random() < geometry.random_rectangle_prob:
            return None
        count = self.num_phrases(index)
        return self.phrase_boxes(index, int(rng.integers(count))) if count else np.zeros((0, 4), np.float32)

    @staticmethod
    def patch_mask(boxes: Optional[np.ndarray], crop, rng: np.random.Generator, geometry: PatchGeometry) -> np.ndarray:
        """Bool [grid * grid]: a random rectangle (`boxes` None), else the patches of the boxes in the crop."""
        if boxes is None:
            return random_rectangle_mask(rng, geometry.grid_size)
        return BOX_PATCH_RULES[geometry.out_of_crop_boxes](boxes, crop, geometry)


def clamped_boxes_patch_mask(boxes: np.ndarray, crop: Sequence[float], output_size: int, grid: int) -> np.ndarray:
    """MACCO's original box -> patch rule [code]: bool [grid * grid], row-major.

    Each box (original pixels, xyxy) moves into the crop (top, left, height, width) with every edge clamped on its
    own side only: the left / top edge to >= 0, the right / bottom edge to <= the crop's width / height; then it
    is scaled to the output_size x output_size network input. The patches masked are the rows and columns from
    floor(lo / patch) to floor((hi - 1e-5) / patch), each index clamped into 0..grid-1. A box wholly beyond one
    side of the crop thus lands on the border row or column on that side; a box touching a patch boundary does not
    reach the next patch.
    """
    xyxy = np.asarray([box[:4] for box in boxes], dtype=np.float64).reshape(-1, 4)
    top, left, height, width = (float(v) for v in crop)
    scale_x, scale_y = output_size / width, output_size / height
    x0 = np.maximum(xyxy[:, 0] - left, 0.0) * scale_x
    y0 = np.maximum(xyxy[:, 1] - top, 0.0) * scale_y
    x1 = np.minimum(xyxy[:, 2] - left, width) * scale_x
    y1 = np.minimum(xyxy[:, 3] - top, height) * scale_y
    patch = output_size / grid
    columns = _clamped_patch_span(x0, x1, patch, grid)  # [N, G]
    rows = _clamped_patch_span(y0, y1, patch, grid)
    return (rows[:, :, None] & columns[:, None, :]).any(axis=0).reshape(-1)


def _clamped_patch_span(lo: np.ndarray, hi: np.ndarray, patch: float, grid: int) -> np.ndarray:
    """[N, G]: patch indices first..last, first = floor(lo / patch), last = floor((hi - eps) / patch), both clamped
    into the grid (Python's float floor division, as the original)."""
    first = np.clip(np.floor_divide(lo, patch), 0, grid - 1)
    last = np.clip(np.floor_divide(hi - _EDGE_EPSILON, patch), 0, grid - 1)
    index = np.arange(grid)
    return (index >= first[:, None]) & (index <= last[:, None])


def _clamp_rule(boxes: np.ndarray, crop, geometry: PatchGeometry) -> np.ndarray:
    return clamped_boxes_patch_mask(boxes, crop, geometry.image_size, geometry.grid_size)


def _drop_rule(boxes: np.ndarray, crop, geometry: PatchGeometry) -> np.ndarray:
    """[ours] The boxes clipped to the crop; a patch is masked when one overlaps it (by `min_overlap` of its area)."""
    return boxes_to_patch_mask(boxes, crop, geometry.image_size, geometry.grid_size, geometry.min_overlap)


# data.out_of_crop_boxes -> (boxes [K, 4], crop, geometry) -> bool [grid * grid]
BOX_PATCH_RULES: Dict[str, Callable[[np.ndarray, Sequence[float], PatchGeometry], np.ndarray]] = {
    "clamp": _clamp_rule,
    "drop": _drop_rule,
}


def _unpack(bits: np.ndarray, context_length: int) -> np.ndarray:
    return np.unpackbits(bits, count=context_length).astype(bool)


def _flatten_phrase_boxes(records: Iterable[dict]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    phrase_counts: List[int] = []
    box_counts: List[int] = []
    boxes: List[List[float]] = []
    for record in records:
        phrase_counts.append(len(record["phrases"]))
        for phrase in record["phrases"]:
            box_counts.append(len(phrase["boxes"]))
            boxes.extend(box[:4] for box in phrase["boxes"])
    phrase_offsets = np.concatenate([[0], np.cumsum(phrase_counts)]).astype(np.int64)
    box_offsets = np.concatenate([[0], np.cumsum(box_counts)]).astype(np.int64)
    return phrase_offsets, box_offsets, np.asarray(boxes, dtype=np.float32).reshape(-1, 4)


def composition_words(record: dict) -> List[str]:
    """The relation strings, then the attribute words, of a cache record's scene graph, as MACCO's original
    lists give them to its word -> token rule.

    A relation's words (caption order) form one string per run of words separated only by whitespace or by
    " the ": the graph's "to left of" is "to the left of", "next to" stays one string, and a verb with a
    particle after its object ("holding a sign up") gives "holding" and "up".
    """
    caption, graph = record["caption"], record["graph"]
    return relation_words(record) + [caption[start:end] for entity in graph["entities"]
                                     for start, end in entity["attributes"]]


def relation_words(record: dict) -> List[str]:
    """The relation strings of a cache record's scene graph (see `composition_words`)."""
    caption = record["caption"]
    return [text for relation in record["graph"]["relations"] for text in _relation_strings(caption, relation["words"])]


def _relation_strings(caption: str, spans: Sequence[Sequence[int]]) -> List[str]:
    runs: List[List[int]] = []
    for start, end in sorted(tuple(span) for span in spans):
        if runs and _RELATION_GAP.fullmatch(caption[runs[-1][1]:start]):
            runs[-1][1] = end
        else:
            runs.append([start, end])
    return [caption[start:end] for start, end in runs]
