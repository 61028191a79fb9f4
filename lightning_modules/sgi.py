"""Structure-Guided Inference (SGI): a training-free scorer on a frozen CLIP (METHODS.md, "TFLocal / TFGlobal
aligners and SGI").

An image is cut into a multi-scale grid of crops (full image, 2x2, 3x3 and the four overlapping halves by
default), each crop encoded on its own by the CLIP image encoder. A caption is cut into scene-graph segments
(`parsers.scene_graph`): one per entity with its attributes ("red cube") and one per relation triplet
("red cube to the left of blue ball"), each encoded by the CLIP text encoder. The score is the mean over
segments of the best cosine over crops,

    sgi(image, caption) = mean_s max_c cos(crop_c, segment_s),

mixed with the global cosine as `global_weight * global + (1 - global_weight) * sgi`. A caption without any
segment (the parser found no object) is scored by the global cosine alone; those are counted in `describe()`.

Everything is encoded once per run: each unique image is decoded once and all its crops encoded in one batch
(cached by `(ImageRef, crop box)`), each unique caption parsed once, each unique segment text and caption
embedded once (the wrapped `ClipScorer`'s text cache). `score` is then a few matrix products.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from datamodules.benchmarks.base import ImageRef, unique
from datamodules.benchmarks.images import load_image
from lightning_modules.scorers import PRECISIONS, ClipScorer, EmbeddingTable, Scorer
from parsers.scene_graph import SceneGraph, SceneGraphParser, Span

log = logging.getLogger(__name__)

# A crop in PIL's convention: (left, top, right, bottom) in pixels of the decoded image, right/bottom exclusive.
Box = Tuple[int, int, int, int]
HALVES = "halves"
DEFAULT_GRIDS = "1,2,3,halves"
# Default: the score as METHODS.md defines it (no global term), so the SGI number is the method's own and the
# global mix is an explicit ablation (`--scorer-option global_weight=0.5`).
DEFAULT_GLOBAL_WEIGHT = 0.0
# Elements of one [images, crops, segments] similarity block: bounds the memory of a retrieval-sized `score`.
SIMILARITY_BLOCK = 1 << 24


# ----- crops --------------------------------------------------------------------------------------------
def parse_grids(spec: Union[str, int, Sequence[Union[str, int]]]) -> Tuple[Union[int, str], ...]:
    """`"1,2,3,halves"` (or a YAML list, or one int) -> (1, 2, 3, "halves"): n means an n x n grid (1 = the
    full image), "halves" the left, right, top and bottom halves."""
    tokens = spec.split(",") if isinstance(spec, str) else [spec] if isinstance(spec, int) else list(spec)
    grids: List[Union[int, str]] = []
    for token in (str(t).strip().lower() for t in tokens):
        if token == HALVES:
            grids.append(HALVES)
        elif token.isdigit() and int(token) > 0:
            grids.append(int(token))
        else:
            raise ValueError(f"grid spec {spec!r}: {token!r} is neither a positive grid size nor {HALVES!r}")
    if not grids:
        raise ValueError("grid spec is empty; give e.g. '1,2,3,halves'")
    return tuple(unique(grids))


def _intervals(size: int, n: int) -> List[Tuple[int, int]]:
    """`n` equal cells along a side of `size` pixels (integer edges k*size//n); a cell is never empty, so an
    image smaller than the grid still yields valid (repeated) crops."""
    return [(k * size // n, max((k + 1) * size // n, k * size // n + 1)) for k in range(n)]


def crop_boxes(width: int, height: int, grids: Sequence[Union[int, str]]) -> List[Box]:
    """Every crop of a `width` x `height` image, grid by grid, each grid row-major (top-left first)."""
    boxes: List[Box] = []
    for grid in grids:
        if grid == HALVES:
            # Overlapping halves: they straddle the 2x2 cells, so an object cut by a grid line is whole in one.
            mid_x, mid_y = max(width // 2, 1), max(height // 2, 1)
            boxes += [(0, 0, mid_x, height), (min(mid_x, width - 1), 0, width, height),
                      (0, 0, width, mid_y), (0, min(mid_y, height - 1), width, height)]
        else:
            boxes += [(left, top, right, bottom) for top, bottom in _intervals(height, grid)
                      for left, right in _intervals(width, grid)]
    return boxes


def crops_per_image(grids: Sequence[Union[int, str]]) -> int:
    return sum(4 if grid == HALVES else grid * grid for grid in grids)


# ----- segments -----------------------------------------------------------------------------------------
def entity_texts(graph: SceneGraph) -> List[str]:
    """Each entity with its attributes: the parser's attribute phrase when it has attributes (it puts a
    predicate adjective before the noun: "the car is red" -> "red car"), else its noun words as written."""
    described = {phrase.entities[0]: phrase.text for phrase in graph.phrases if phrase.kind == "attribute"}
    return [described.get(e, graph.caption[entity.words[0].start:entity.head.end])
            for e, entity in enumerate(graph.entities)]


def relation_text(graph: SceneGraph, words: Sequence[Span]) -> str:
    """The relation words as written ("to the left of") when no entity word lies between them, else the
    words alone ("picking up" from "picking the ball up")."""
    start, end = words[0].start, words[-1].end
    inside = [s for entity in graph.entities for s in entity.words + entity.attributes
              if start <= s.start and s.end <= end]
    return graph.caption[start:end] if not inside else " ".join(word.text for word in words)


def caption_segments(graph: SceneGraph) -> List[str]:
    """SGI's segments of one caption, distinct, in order: every entity, then every relation triplet
    "subject relation object" between two different entities (subject and object with their attributes)."""
    entities = entity_texts(graph)
    relations = [f"{entities[r.subject]} {relation_text(graph, r.words)} {entities[r.object]}"
                 for r in graph.relations if r.subject != r.object]
    return unique(entities + relations)


# ----- image crops as a dataset -------------------------------------------------------------------------
class _CroppedImage(NamedTuple):
    index: int
    size: Tuple[int, int]  # (width, height) of the decoded image
    boxes: List[Box]  # distinct boxes, in the order of `pixels`
    pixels: Tensor  # [len(boxes), 3, H, W]


class _ImageCrops(Dataset):
    """Decodes each image once and returns every distinct crop, preprocessed."""

    def __init__(self, refs: Sequence[ImageRef], grids: Sequence[Union[int, str]], preprocess):
        self.refs, self.grids, self.preprocess = list(refs), grids, preprocess

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, index: int) -> _CroppedImage:
        image = load_image(self.refs[index])
        boxes = unique(crop_boxes(*image.size, self.grids) + [full_box(*image.size)])
        return _CroppedImage(index, image.size, boxes, torch.stack([self.preprocess(image.crop(box)) for box in boxes]))


def full_box(width: int, height: int) -> Box:
    return (0, 0, width, height)


def _as_list(samples: list) -> list:
    """DataLoader collate: images have different numbers of distinct crops, so they are not stacked here."""
    return samples


@dataclass(frozen=True)
class _Layout:
    """Where one image's embeddings are in the crop table."""

    grid: Tuple[Tuple[ImageRef, Box], ...]  # one key per crop of the grid spec (repeats for tiny images)
    full: Tuple[ImageRef, Box]  # the whole image: the global embedding


# ----- the scorer ---------------------------------------------------------------------------------------
class SGIScorer(Scorer):
    """Structure-guided inference on a frozen CLIP.

    Args:
        clip: the CLIP scorer whose model, preprocess, device and precision are used; its text cache holds
            the caption and segment embeddings.
        grids: the crops (see `parse_grids`); default full image, 2x2, 3x3 and the four halves (18 crops).
        global_weight: weight of the global cosine in the score, in [0, 1]; 0 (default) is pure SGI.
        parser: the scene-graph parser (default `SceneGraphParser()`, loaded on first use).
    """

    OPTIONS = ("grids", "global_weight")  # what `--scorer-option KEY=VALUE` may set

    def __init__(self, clip: ClipScorer, grids: Union[str, Sequence] = DEFAULT_GRIDS,
                 global_weight: float = DEFAULT_GLOBAL_WEIGHT, parser: Optional[SceneGraphParser] = None):
        if not 0.0 <= float(global_weight) <= 1.0:
            raise ValueError(f"global_weight must be in [0, 1], got {global_weight}")
        self.clip, self.grids, self.global_weight = clip, parse_grids(grids), float(global_weight)
        self.parser = parser or SceneGraphParser()
        self.crops = EmbeddingTable()
        self.layouts: Dict[ImageRef, _Layout] = {}
        self.segments: Dict[str, List[str]] = {}
        self.fallback_captions: Set[str] = set()

    @classmethod
    def from_pretrained(cls, name: str, pretrained: Optional[str], config_dir: Optional[str] = "configs/models",
                        grids: Union[str, Sequence] = DEFAULT_GRIDS, global_weight: float = DEFAULT_GLOBAL_WEIGHT,
                        **clip_kwargs) -> "SGIScorer":
        """SGI on open_clip `name` with weights `pretrained` (see `ClipScorer.from_pretrained`)."""
        return cls(ClipScorer.from_pretrained(name, pretrained, config_dir, **clip_kwargs), grids, global_weight)

    @classmethod
    def from_export(cls, export_dir: Path, grids: Union[str, Sequence] = DEFAULT_GRIDS,
                    global_weight: float = DEFAULT_GLOBAL_WEIGHT, **clip_kwargs) -> "SGIScorer":
        """SGI on the CLIP of a `fit` export."""
        return cls(ClipScorer.from_export(export_dir, **clip_kwargs), grids, global_weight)

    def describe(self) -> Dict[str, object]:
        return {**self.clip.describe(), "scorer": type(self).__name__,
                "sgi_grids": ",".join(map(str, self.grids)), "sgi_crops": crops_per_image(self.grids),
                "sgi_global_weight": self.global_weight, "sgi_captions": len(self.segments),
                "sgi_fallback_captions": len(self.fallback_captions)}

    # --- precomputation ---
    def prepare(self, images: Sequence[ImageRef], texts: Sequence[str], progress: bool = False) -> None:
        self._parse(texts, progress)
        self._encode_crops([ref for ref in unique(images) if ref not in self.layouts], progress)
        segments = [segment for text in unique(texts) for segment in self.segments[text]]
        self.clip.prepare([], unique(list(texts) + segments), progress)

    def _parse(self, texts: Sequence[str], progress: bool = False) -> None:
        todo = [text for text in unique(texts) if text not in self.segments]
        if not todo:
            return
        # In the parser's own batches (~1,000 captions/s: a retrieval set's 25k captions take half a minute).
        step = self.parser.batch_size
        for start in tqdm(range(0, len(todo), step), desc="parse captions", unit="batch", disable=not progress):
            batch = todo[start:start + step]
            for text, graph in zip(batch, self.parser.parse(batch)):
                self.segments[text] = caption_segments(graph)
                if not self.segments[text]:
                    self.fallback_captions.add(text)
        log.info("SGI: %d of %d captions so far have no scene-graph segment and are scored by the global cosine",
                 len(self.fallback_captions), len(self.segments))

    @torch.no_grad()
    def _encode_crops(self, refs: Sequence[ImageRef], progress: bool) -> None:
        """Every crop of every image in `refs`, in batches of about `clip.batch_size` crops."""
        if not refs:
            return
        images_per_batch = max(1, self.clip.batch_size // (crops_per_image(self.grids) + 1))
        loader = DataLoader(_ImageCrops(refs, self.grids, self.clip.preprocess), batch_size=images_per_batch,
                            num_workers=self.clip.num_workers, collate_fn=_as_list)
        for samples in tqdm(loader, desc="image crops", unit="batch", disable=not progress):
            embeddings = self._encode_pixels(torch.cat([sample.pixels for sample in samples]))
            keys = [(refs[sample.index], box) for sample in samples for box in sample.boxes]
            self.crops.add(keys, embeddings)
            for sample in samples:
                self.layouts[refs[sample.index]] = self._layout(refs[sample.index], *sample.size)

    def _layout(self, ref: ImageRef, width: int, height: int) -> _Layout:
        grid = crop_boxes(width, height, self.grids)
        return _Layout(tuple((ref, box) for box in grid), (ref, full_box(width, height)))

    def _encode_pixels(self, pixels: Tensor) -> Tensor:
        dtype = PRECISIONS[self.clip.precision]
        device = self.clip.device
        with torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext():
            embeddings = self.clip.model.encode_image(pixels.to(device))
        return F.normalize(embeddings.float().cpu(), dim=-1)

    # --- scoring ---
    def score_unique(self, images: Sequence[ImageRef], texts: Sequence[str]) -> np.ndarray:
        if not len(images) or not len(texts):
            return np.zeros((len(images), len(texts)), dtype=np.float32)
        self.prepare(images, texts)  # only what is missing: a lookup when the benchmark prepared everything
        layouts = [self.layouts[ref] for ref in images]
        full = self.crops.lookup([layout.full for layout in layouts])  # [I, D]
        captions = self.clip.text_embeddings(texts)  # [T, D]
        global_cosine = full @ captions.T
        local, has_segments = self._segment_scores(layouts, texts)
        mixed = self.global_weight * global_cosine + (1.0 - self.global_weight) * local
        return torch.where(has_segments[None, :], mixed, global_cosine).numpy()

    def _segment_scores(self, layouts: Sequence[_Layout], texts: Sequence[str]) -> Tuple[Tensor, Tensor]:
        """[I, T] mean over each text's segments of the best crop cosine, and [T] whether a text has any."""
        counts = [len(self.segments[text]) for text in texts]
        has_segments = torch.tensor(counts) > 0
        if not any(counts):
            return torch.zeros(len(layouts), len(texts)), has_segments
        segments = self.clip.text_embeddings([s for text in texts for s in self.segments[text]])  # [M, D]
        # averaging matrix [M, T]: column t holds 1/count_t on the rows of text t's segments
        owner = [t for t, count in enumerate(counts) for _ in range(count)]
        average = torch.zeros(len(segments), len(texts))
        average[range(len(segments)), owner] = torch.tensor([1.0 / counts[t] for t in owner])
        best = self._best_crop_cosines(layouts, segments)  # [I, M]
        return (best @ average.to(best.device)).cpu(), has_segments

    def _best_crop_cosines(self, layouts: Sequence[_Layout], segments: Tensor) -> Tensor:
        """[I, M] max over each image's grid crops of the cosine with each segment, on the model's device, in
        blocks of images so that a retrieval-sized call stays within `SIMILARITY_BLOCK` elements."""
        device, n_crops = self.clip.device, len(layouts[0].grid)
        segments = segments.to(device)
        step = max(1, SIMILARITY_BLOCK // (n_crops * len(segments)))
        blocks = []
        for start in range(0, len(layouts), step):
            keys = [key for layout in layouts[start:start + step] for key in layout.grid]
            crops = self.crops.lookup(keys).to(device)  # [i * K, D]
            blocks.append((crops @ segments.T).view(-1, n_crops, len(segments)).amax(dim=1))
        return torch.cat(blocks)
