"""Structure-Guided Inference (SGI): a training-free scorer on a frozen CLIP (docs/methods.md#sgi; the crops of
the predecessor paper, Miranda et al., "Adding simple structure at inference improves Vision-Language
Compositionality", arXiv 2506.09691).

An image is cut into a multi-scale set of crops, each crop encoded on its own by the CLIP image encoder. A
caption is cut into scene-graph segments (`parsers.scene_graph`): one per entity with its attributes ("red
cube") and one per relation triplet ("red cube to the left of blue ball"), each encoded by the CLIP text
encoder. The score is the mean over segments of the best cosine over crops,

    sgi(image, caption) = mean_s max_c cos(crop_c, segment_s),

mixed with the global cosine as `global_weight * global + (1 - global_weight) * sgi`. A caption without any
segment (the parser found no object) is scored by the global cosine alone; those are counted in `describe()`.

Crop sets (`grids`; `CROP_SETS` names them):
- `paper` (default) [paper]: at a 224 px input, 32 / 56 / 112 / 224 px squares and 56 x 112 / 112 x 56 px
  (w x h) rectangles, tiled without overlap: 49 + 16 + 4 + 1 + 8 + 8 = 86 crops.
- `paper_overlap` [paper]: the same sizes moved by half their side along each axis (stride 16 px for the 32 px
  squares, 28 x 56 px for the 56 x 112 rectangles): 169 + 49 + 9 + 1 + 21 + 21 = 270 crops.
- `ours18` [ours]: the full image, 2x2, 3x3 and the four overlapping halves (1 + 4 + 9 + 4 = 18 crops).
A custom set is a comma list of tilings: `n` (n x n cells), `CxR` (C columns by R rows, so at 224 px "4x2" is
the 56 x 112 px rectangles), either with `:overlap` (windows of one cell moved by half a cell), and `halves`.

How a crop box maps to the model input and to the image. Every crop size of the paper is a whole fraction of the
224 px input (32 = 224/7, 56 = 224/4, 112 = 224/2), so a crop set is a set of tilings of the input: "32 px
squares" are the cells of a 7 x 7 tiling, "56 x 112 rectangles" those of 4 columns by 2 rows. At an input of S px
every length scales by S/224 and the crops stay the same fractions of the input. [our reading for images that are
not S x S:] the input view is the whole image resized to S x S (each axis on its own), so a box (x0, y0, x1, y1)
in 224 px units is the image box (floor(x0 W / 224), floor(y0 H / 224), floor(x1 W / 224), floor(y1 H / 224)) of a
W x H image: each crop is the same fraction of the image's width and of its height (on a 640 x 480 image the 56x112
rectangle at (56, 0) is the 160 x 240 px box (160, 0, 320, 240)); the tiling covers the whole image, never
only its centre square. For a tiling of C columns the x edges are floor(k W / C) (cells) or the half-cell edges
floor(k W / 2C) (overlapping windows span two half-cells); rows likewise with H. So at W = H = 224 the boxes are
exactly the paper's pixels, at W = H = S they are the paper's crops scaled to S, and a crop is never empty (an
image smaller than a tiling repeats 1 px crops). [our reading where the paper is silent: the crop is cut from the
decoded image at its own resolution, not from an S px copy, which keeps detail in small crops.]

Each crop then goes to the encoder whole, resized to the S x S input ([paper]: each crop is resized to the input;
whether a rectangle is stretched or padded is not stated in what we could read of it, so the default is our
reading): `resize="stretch"` (default) resizes it to S x S with the model's interpolation, so a 56 x 112 rectangle
is stretched 2x horizontally and every one of its pixels reaches the encoder; `resize="pad"` [ours] keeps its
aspect and pads the short side with black (open_clip's own letterbox, `resize_mode="longest"`). The model's own
preprocess (shortest side to S, then a centre crop) would show only the middle square of a rectangle, as this
scorer did before (its "halves" lost half their content). Stretch is the default because it is the plain reading
of "resized to the input", a square crop of a square image (the common case) is then exactly the model's own
preprocess, and padding would spend up to half the input on black. The global cosine uses the model's own
preprocess of the whole image, as `ClipScorer` does, so `global_weight=1` is exactly the global cosine.

Everything is encoded once per run: each unique image is decoded once and its distinct crops and its global
view encoded in one batch (cached by `(ImageRef, crop box)` and `ImageRef`), each unique caption parsed once,
each unique segment text and caption embedded once (the wrapped `ClipScorer`'s text cache). `score` is then a
few matrix products. Cost: an image costs 1 + (distinct crops) image encodes instead of 1 (87 with `paper`,
271 with `paper_overlap`, 19 with `ours18`); `describe()` counts the crops encoded, and `python -m
evaluation.evaluate --scorer sgi` times the global cosine of the same model on the same benchmarks
beside it (seconds per item of each).
"""
from __future__ import annotations

import logging
import re
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from open_clip.transform import CenterCropOrPad, ResizeKeepRatio
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import CenterCrop, Compose, Normalize, Resize
from tqdm import tqdm

from evaluation.benchmarks.base import ImageRef, unique
from evaluation.benchmarks.images import load_image
from evaluation.scorers import PRECISIONS, ClipScorer, EmbeddingTable, Scorer
from parsers.scene_graph import SceneGraph, SceneGraphParser, Span

log = logging.getLogger(__name__)

# A crop in PIL's convention: (left, top, right, bottom) in pixels of the decoded image, right/bottom exclusive.
Box = Tuple[int, int, int, int]
HALVES = "halves"
OVERLAP = "overlap"
# Named crop sets (module docstring). Tilings are "columns x rows" of the input; at 224 px, 7 = 32 px squares,
# 4 = 56 px, 2 = 112 px, 1 = the full 224 px input, 4x2 = 56 x 112 (w x h) and 2x4 = 112 x 56 rectangles.
CROP_SETS = {
    "paper": "7,4,2,1,4x2,2x4",  # [paper] grid variant: 49 + 16 + 4 + 1 + 8 + 8 = 86 crops
    "paper_overlap": "7:overlap,4:overlap,2:overlap,1:overlap,4x2:overlap,2x4:overlap",  # [paper] 270 crops
    "ours18": "1,2,3,halves",  # [ours] the earlier default: full, 2x2, 3x3, four overlapping halves = 18 crops
}
DEFAULT_GRIDS = "paper"
# How a crop becomes the model input: "stretch" [paper: resized to the input] or "pad" [ours: letterbox].
RESIZE_MODES = ("stretch", "pad")
DEFAULT_RESIZE = "stretch"
# Default: the score as docs/methods.md#sgi defines it (no global term), so the SGI number is the method's own
# and the global mix is an explicit ablation (`scorer.global_weight=0.5`).
DEFAULT_GLOBAL_WEIGHT = 0.0
# Elements of one [images, crops, segments] similarity block: bounds the memory of a retrieval-sized `score`.
SIMILARITY_BLOCK = 1 << 24


# ----- crops --------------------------------------------------------------------------------------------
class Tiling(NamedTuple):
    """`columns` x `rows` equal cells over the image; with `overlap`, windows of one cell moved by half a
    cell along each axis ((2 columns - 1) x (2 rows - 1) of them) instead of the cells."""

    columns: int
    rows: int
    overlap: bool = False

    def __str__(self) -> str:
        size = str(self.columns) if self.columns == self.rows else f"{self.columns}x{self.rows}"
        return f"{size}:{OVERLAP}" if self.overlap else size


Grid = Union[Tiling, str]  # a tiling or HALVES
_TILING = re.compile(rf"^(\d+)(?:x(\d+))?(:{OVERLAP})?$")


def parse_grids(spec: Union[str, int, Sequence[Union[str, int]]]) -> Tuple[Grid, ...]:
    """A crop set: a name of `CROP_SETS`, or a comma list (or YAML list, or one int) of tilings.

    `"ours18"` = `"1,2,3,halves"` -> (Tiling(1, 1), Tiling(2, 2), Tiling(3, 3), "halves"); `"4x2:overlap"` ->
    (Tiling(4, 2, overlap=True),): n is an n x n tiling, CxR one of C columns by R rows, `:overlap` its
    half-cell-stride windows, "halves" the left, right, top and bottom halves.
    """
    if isinstance(spec, str) and spec.strip().lower() in CROP_SETS:
        spec = CROP_SETS[spec.strip().lower()]
    tokens = spec.split(",") if isinstance(spec, str) else [spec] if isinstance(spec, int) else list(spec)
    grids: List[Grid] = []
    for token in (str(t).strip().lower() for t in tokens):
        match = _TILING.match(token)
        if token == HALVES:
            grids.append(HALVES)
        elif match and int(match[1]) > 0 and int(match[2] or match[1]) > 0:
            grids.append(Tiling(int(match[1]), int(match[2] or match[1]), bool(match[3])))
        else:
            raise ValueError(f"grid spec {spec!r}: {token!r} is none of a crop set ({', '.join(CROP_SETS)}), "
                             f"a tiling (n, CxR, optionally with :{OVERLAP}) or {HALVES!r}")
    if not grids:
        raise ValueError(f"grid spec is empty; give a crop set ({', '.join(CROP_SETS)}) or e.g. '1,2,3,halves'")
    return tuple(unique(grids))


def grids_spec(grids: Sequence[Grid]) -> str:
    """The comma spec of parsed grids (parses back to the same grids)."""
    return ",".join(map(str, grids))


def crop_set_name(grids: Sequence[Grid]) -> str:
    """The `CROP_SETS` name of these grids, or "custom"."""
    return next((name for name, spec in CROP_SETS.items() if parse_grids(spec) == tuple(grids)), "custom")


def _intervals(size: int, n: int) -> List[Tuple[int, int]]:
    """`n` equal cells along a side of `size` pixels (integer edges k*size//n); a cell is never empty, so an
    image smaller than the grid still yields valid (repeated) crops."""
    return [(k * size // n, max((k + 1) * size // n, k * size // n + 1)) for k in range(n)]


def _windows(size: int, n: int) -> List[Tuple[int, int]]:
    """The 2n - 1 windows of one cell of an n-cell side moved by half a cell: with half-cell edges
    e_k = k*size//(2n), window k spans (e_k, e_{k+2}); never empty. Window 2k is cell k of `_intervals`."""
    edges = [k * size // (2 * n) for k in range(2 * n + 1)]
    return [(edges[k], max(edges[k + 2], edges[k] + 1)) for k in range(2 * n - 1)]


def crop_boxes(width: int, height: int, grids: Sequence[Grid]) -> List[Box]:
    """Every crop of a `width` x `height` image, grid by grid, each grid row-major (top-left first).

    With `width = height = 224` these are the paper's pixel boxes; see the module docstring for the mapping.
    """
    boxes: List[Box] = []
    for grid in grids:
        if grid == HALVES:
            # Overlapping halves [ours]: they straddle the 2x2 cells, so an object cut by a grid line is whole.
            mid_x, mid_y = max(width // 2, 1), max(height // 2, 1)
            boxes += [(0, 0, mid_x, height), (min(mid_x, width - 1), 0, width, height),
                      (0, 0, width, mid_y), (0, min(mid_y, height - 1), width, height)]
        else:
            spans = _windows if grid.overlap else _intervals
            boxes += [(left, top, right, bottom) for top, bottom in spans(height, grid.rows)
                      for left, right in spans(width, grid.columns)]
    return boxes


def crops_per_image(grids: Sequence[Grid]) -> int:
    """How many crops `crop_boxes` returns for any image size (86 for `paper`, 270 for `paper_overlap`)."""
    def count(grid: Grid) -> int:
        if grid == HALVES:
            return 4
        return (2 * grid.columns - 1) * (2 * grid.rows - 1) if grid.overlap else grid.columns * grid.rows

    return sum(count(grid) for grid in grids)


def uncut_transform(preprocess: Callable, resize: str = DEFAULT_RESIZE) -> Compose:
    """The model's validation transform with its resize + centre crop replaced by a resize of the whole crop
    to the input size: "stretch" (each axis on its own) or "pad" (aspect kept, black bars, as open_clip's
    `resize_mode="longest"`). Interpolation, colour conversion and normalisation stay the model's own."""
    if resize not in RESIZE_MODES:
        raise ValueError(f"resize must be one of {', '.join(RESIZE_MODES)}, got {resize!r}")
    steps = list(getattr(preprocess, "transforms", []))
    resizer = next((s for s in steps if isinstance(s, (Resize, ResizeKeepRatio))), None)
    cropper = next((s for s in steps if isinstance(s, (CenterCrop, CenterCropOrPad))), None)
    if resizer is None or not any(isinstance(s, Normalize) for s in steps):
        raise ValueError(f"SGI needs the model's validation transform as a torchvision Compose with a Resize "
                         f"and a Normalize (open_clip's preprocess_val), got {preprocess!r}")
    size = cropper.size if cropper is not None else resizer.size
    size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
    size = size * 2 if len(size) == 1 else size
    if resize == "stretch":
        head = [Resize(size, interpolation=resizer.interpolation)]
    else:
        head = [ResizeKeepRatio(size, longest=1, interpolation=resizer.interpolation),
                CenterCropOrPad(size, fill=0)]
    return Compose(head + [step for step in steps if step is not resizer and step is not cropper])


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
    pixels: Tensor  # [len(boxes) + 1, 3, S, S]: each crop resized whole, then the global view


class _ImageCrops(Dataset):
    """Decodes each image once and returns its distinct crops (each resized whole to the input by
    `crop_transform`) followed by the whole image under the model's own `preprocess` (the global view)."""

    def __init__(self, refs: Sequence[ImageRef], grids: Sequence[Grid], crop_transform: Callable,
                 preprocess: Callable):
        self.refs, self.grids = list(refs), grids
        self.crop_transform, self.preprocess = crop_transform, preprocess

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, index: int) -> _CroppedImage:
        image = load_image(self.refs[index])
        boxes = unique(crop_boxes(*image.size, self.grids))
        crops = [self.crop_transform(image.crop(box)) for box in boxes]
        return _CroppedImage(index, image.size, boxes, torch.stack(crops + [self.preprocess(image)]))


def _as_list(samples: list) -> list:
    """DataLoader collate: images have different numbers of distinct crops, so they are not stacked here."""
    return samples


@dataclass(frozen=True)
class _Layout:
    """Where one image's crop embeddings are in the crop table."""

    grid: Tuple[Tuple[ImageRef, Box], ...]  # one key per crop of the grid spec (repeats for tiny images)


# ----- the scorer ---------------------------------------------------------------------------------------
class SGIScorer(Scorer):
    """Structure-guided inference on a frozen CLIP.

    Args:
        clip: the CLIP scorer whose model, preprocess, device and precision are used; its text cache holds
            the caption and segment embeddings.
        grids: the crop set (see `parse_grids`, `CROP_SETS`); default "paper", the predecessor paper's 86
            non-overlapping multi-scale crops; "paper_overlap" its 270 overlapping ones; "ours18" our 18.
        global_weight: weight of the global cosine in the score, in [0, 1]; 0 (default) is pure SGI.
        resize: how a crop becomes the model input: "stretch" (default, the paper's resize to the input) or
            "pad" (aspect kept, letterboxed); never the centre crop of the model's own preprocess.
        parser: the scene-graph parser (default `SceneGraphParser()`, loaded on first use).
    """

    OPTIONS = ("grids", "global_weight", "resize")  # what `scorer.OPTION=VALUE` may set

    def __init__(self, clip: ClipScorer, grids: Union[str, Sequence] = DEFAULT_GRIDS,
                 global_weight: float = DEFAULT_GLOBAL_WEIGHT, resize: str = DEFAULT_RESIZE,
                 parser: Optional[SceneGraphParser] = None):
        if not 0.0 <= float(global_weight) <= 1.0:
            raise ValueError(f"global_weight must be in [0, 1], got {global_weight}")
        self.clip, self.grids, self.global_weight = clip, parse_grids(grids), float(global_weight)
        self.resize, self.crop_transform = resize, uncut_transform(clip.preprocess, resize)
        self.parser = parser or SceneGraphParser()
        self.crops = EmbeddingTable()  # (ImageRef, Box) -> crop embedding
        self.wholes = EmbeddingTable()  # ImageRef -> global embedding (the model's own preprocess)
        self.layouts: Dict[ImageRef, _Layout] = {}
        self.segments: Dict[str, List[str]] = {}
        self.fallback_captions: Set[str] = set()
        self._text_keys: Dict[str, tuple] = {}

    @classmethod
    def from_pretrained(cls, name: str, pretrained: Optional[str], config_dir: Optional[str] = "configs/models",
                        grids: Union[str, Sequence] = DEFAULT_GRIDS, global_weight: float = DEFAULT_GLOBAL_WEIGHT,
                        resize: str = DEFAULT_RESIZE, **clip_kwargs) -> "SGIScorer":
        """SGI on open_clip `name` with weights `pretrained` (see `ClipScorer.from_pretrained`)."""
        clip = ClipScorer.from_pretrained(name, pretrained, config_dir, **clip_kwargs)
        return cls(clip, grids, global_weight, resize)

    @classmethod
    def from_export(cls, export_dir: Path, grids: Union[str, Sequence] = DEFAULT_GRIDS,
                    global_weight: float = DEFAULT_GLOBAL_WEIGHT, resize: str = DEFAULT_RESIZE,
                    **clip_kwargs) -> "SGIScorer":
        """SGI on the CLIP of a `fit` export."""
        return cls(ClipScorer.from_export(export_dir, **clip_kwargs), grids, global_weight, resize)

    @classmethod
    def from_built(cls, built, metadata: Optional[Dict[str, object]] = None,
                   grids: Union[str, Sequence] = DEFAULT_GRIDS, global_weight: float = DEFAULT_GLOBAL_WEIGHT,
                   resize: str = DEFAULT_RESIZE, **clip_kwargs) -> "SGIScorer":
        """SGI on a CLIP already built (`modeling.encoders.BuiltModel`), e.g. a weight interpolation in memory."""
        return cls(ClipScorer.from_built(built, metadata, **clip_kwargs), grids, global_weight, resize)

    def global_cosine_twin(self) -> ClipScorer:
        """The global cosine of the same model, preprocess, device, precision and batching, with empty caches:
        what SGI's cost is compared with."""
        clip = self.clip
        return ClipScorer(clip.model, clip.tokenizer, clip.preprocess, device=str(clip.device),
                          precision=clip.precision, batch_size=clip.batch_size, num_workers=clip.num_workers,
                          metadata=clip.metadata)

    def describe(self) -> Dict[str, object]:
        crops_encoded = len(self.crops.row)
        images = len(self.layouts)
        return {**self.clip.describe(), "scorer": type(self).__name__,
                "sgi_crop_set": crop_set_name(self.grids), "sgi_grids": grids_spec(self.grids),
                "sgi_crops": crops_per_image(self.grids), "sgi_resize": self.resize,
                "sgi_global_weight": self.global_weight, "sgi_captions": len(self.segments),
                "sgi_fallback_captions": len(self.fallback_captions),
                # cost: image encodes per image = distinct crops + the global view (global cosine: 1)
                "sgi_images_encoded": images, "sgi_crops_encoded": crops_encoded,
                "sgi_image_encodes_per_image": round(1 + crops_encoded / images, 2) if images else None}

    # --- precomputation ---
    def prepare(self, images: Sequence[ImageRef], texts: Sequence[str], progress: bool = False) -> None:
        self._parse(texts, progress)
        self._encode_crops([ref for ref in unique(images) if ref not in self.layouts], progress)
        segments = [segment for text in unique(texts) for segment in self.segments[text]]
        self.clip.prepare([], unique(list(texts) + segments), progress)

    def text_keys(self, texts: Sequence[str]) -> List[tuple]:
        """What SGI's model sees of a caption: its token ids and those of its segments. Two captions with the
        same token ids tie exactly when the parser also cut them into token-identical segments (spaCy sees the
        string, so spacing can in principle change the parse, and with it the score)."""
        todo = [text for text in unique(texts) if text not in self._text_keys]
        if todo:
            self._parse(todo)
            segment_keys = iter(self.clip.text_keys([s for text in todo for s in self.segments[text]]))
            captions = self.clip.text_keys(todo)
            for text, caption in zip(todo, captions):
                self._text_keys[text] = (caption, tuple(next(segment_keys) for _ in self.segments[text]))
        return [self._text_keys[text] for text in texts]

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
        """Every crop and the global view of every image in `refs`, in batches of about `clip.batch_size`
        inputs (at least one image's: 87 with the paper's crops, 271 with its overlapping ones)."""
        if not refs:
            return
        images_per_batch = max(1, self.clip.batch_size // (crops_per_image(self.grids) + 1))
        dataset = _ImageCrops(refs, self.grids, self.crop_transform, self.clip.preprocess)
        loader = DataLoader(dataset, batch_size=images_per_batch, num_workers=self.clip.num_workers,
                            collate_fn=_as_list)
        for samples in tqdm(loader, desc="image crops", unit="batch", disable=not progress):
            embeddings = self._encode_pixels(torch.cat([sample.pixels for sample in samples]))
            wholes = np.cumsum([len(sample.pixels) for sample in samples]) - 1  # each sample's last row
            crops = np.setdiff1d(np.arange(len(embeddings)), wholes)
            self.crops.add([(refs[s.index], box) for s in samples for box in s.boxes], embeddings[crops])
            self.wholes.add([refs[s.index] for s in samples], embeddings[wholes])
            for sample in samples:
                self.layouts[refs[sample.index]] = self._layout(refs[sample.index], *sample.size)

    def _layout(self, ref: ImageRef, width: int, height: int) -> _Layout:
        return _Layout(tuple((ref, box) for box in crop_boxes(width, height, self.grids)))

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
        full = self.wholes.lookup(list(images))  # [I, D]
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
