"""The TFLocal / TFGlobal aligner as a benchmark scorer, and the aligner's export format.

`TokenAligner` (modeling/aligner.py) is the plain `nn.Module` that lightning_modules/methods/tflocal.py trains.
`export_aligner` writes `export/aligner.pt` + `export/aligner.json` beside the backbone's
`open_clip.pt`; `AlignerScorer.from_export` loads both and scores benchmark candidates directly, or re-ranks the
frozen-CLIP top-k for retrieval (`rerank_k`; see `AlignerScorer` for why the ranks stay right).
"""
from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader
from tqdm import tqdm

from core.cli import check_precision
from modeling.encoders import CLIPEncoders, build_model
from modeling.export import WEIGHTS_FILE, load_export
from core.files import atomic_write_bytes, atomic_write_text
from datamodules.features import backbone_fingerprint, frozen_image_features, frozen_text_features, length_mask
from evaluation.benchmarks.base import ImageRef, Scorer, unique
from evaluation.scorers import PRECISIONS, EmbeddingTable, ImageFiles, TokenKeys
from modeling.aligner import IMAGE, TEXT, TokenAligner

log = logging.getLogger(__name__)

ALIGNER_WEIGHTS = "aligner.pt"
ALIGNER_METADATA = "aligner.json"


# ----- export / import ----------------------------------------------------------------------------------------
def export_aligner(aligner: TokenAligner, kind: str, backbone: dict, export_dir: Path,
                   extra: Optional[dict] = None) -> Path:
    """`aligner.pt` (fp32 state dict) and `aligner.json` (kind, aligner shape, backbone), written atomically."""
    export_dir = Path(export_dir)
    export_dir.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save({k: v.detach().float().cpu() for k, v in aligner.state_dict().items()}, buffer)
    atomic_write_bytes(export_dir / ALIGNER_WEIGHTS, buffer.getvalue())
    metadata = {"kind": kind, "aligner": aligner.config, "backbone": backbone, "weights": ALIGNER_WEIGHTS,
                **(extra or {})}
    atomic_write_text(export_dir / ALIGNER_METADATA, json.dumps(metadata, indent=2, sort_keys=True))
    return export_dir / ALIGNER_WEIGHTS


def is_aligner_export(export_dir: Path) -> bool:
    return (Path(export_dir) / ALIGNER_METADATA).is_file()


def load_aligner(export_dir: Path) -> Tuple[TokenAligner, dict]:
    """The exported aligner (eval mode) and its metadata."""
    export_dir = Path(export_dir)
    if not is_aligner_export(export_dir):
        raise FileNotFoundError(f"no {ALIGNER_METADATA} in {export_dir}: not a TFLocal / TFGlobal export")
    metadata = json.loads((export_dir / ALIGNER_METADATA).read_text())
    aligner = TokenAligner(**metadata["aligner"])
    aligner.load_state_dict(torch.load(export_dir / metadata["weights"], weights_only=True))
    return aligner.eval(), metadata


def load_backbone(export_dir: Path, backbone: dict):
    """The frozen CLIP of an aligner export: its `open_clip.pt` when present, else the recorded name and
    weights; refused when its weights differ from those the aligner was trained on."""
    if (Path(export_dir) / WEIGHTS_FILE).is_file():
        built = load_export(export_dir)
    else:
        built = build_model(backbone["model"], backbone["pretrained"], backbone.get("config_dir"))
    if backbone_fingerprint(built.model) != backbone["weights_sha256"]:
        raise ValueError(f"the backbone loaded for {export_dir} ({backbone['model']}, {backbone['pretrained']}) "
                         f"is not the frozen CLIP the aligner was trained on")
    return built


# ----- the scorer ---------------------------------------------------------------------------------------------
# Re-ranked pairs get squash(aligner score) in (-1, 1); the others get the frozen cosine minus RERANK_SHIFT, in
# [-4, -2]: every re-ranked pair is above every other, in any call, so ranks read across calls stay right.
RERANK_SHIFT = 3.0


def squash(scores: np.ndarray) -> np.ndarray:
    """A strictly increasing map of the real line onto (-1, 1): order-preserving, bounded, float64-exact enough
    (s / (1 + |s|) separates scores 1e-9 apart up to |s| ~ 1e3)."""
    scores = np.asarray(scores, dtype=np.float64)
    return scores / (1.0 + np.abs(scores))


def top_k_columns(scores: np.ndarray, k: int) -> np.ndarray:
    """bool mask of each row's k highest entries (all of a row with <= k entries; ties broken arbitrarily)."""
    chosen = np.zeros(scores.shape, dtype=bool)
    if scores.shape[1] <= k:
        chosen[:] = True
        return chosen
    columns = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    np.put_along_axis(chosen, columns, True, axis=1)
    return chosen


class AlignerScorer(Scorer):
    """A TFLocal / TFGlobal aligner as a benchmark scorer.

    Each unique image and text is encoded once by the frozen CLIP (tokens and global embedding kept), and
    each requested (image, text) pair is scored once by the aligner (scores are kept, so the retrieval
    benchmark's second pass costs nothing and is bit-identical). Texts with the same token ids are one candidate
    (`text_keys`): scored once, they tie exactly.

    With `rerank_k=None` every requested pair gets its aligner score (compositional benchmarks: a handful
    of candidates per item). With `rerank_k=k` (retrieval), a pair is re-ranked when the text is among the
    image's k best texts of the call by frozen cosine, or the image is among the text's k best images of the
    gallery (the images of the last `prepare`, else of the call) -- the frozen-CLIP top-k of both retrieval
    directions, as the harness scores image chunks against all captions. Re-ranked pairs get
    `squash(aligner score)` in (-1, 1), the others `cosine - 3` in [-4, -2]. Both maps are increasing, so
    (a) within each set the order is the aligner's, resp. frozen CLIP's, and (b) every re-ranked candidate
    of a query outranks every other, whichever chunk produced it: a query's R@K for K <= k is that of
    re-ranking its frozen top-k (its candidate set can only be larger: the union of both directions).
    Items with at most k texts are therefore scored directly in both modes.

    Args:
        model: the frozen open_clip CLIP; aligner: the trained `TokenAligner`; kind: "local" or "global".
        tokenizer, preprocess: the CLIP's tokenizer and evaluation transform.
        pair_batch: aligner forwards per batch.
    """

    def __init__(self, model: nn.Module, aligner: TokenAligner, kind: str, tokenizer: Callable, preprocess: Callable,
                 device: str = "cpu", precision: str = "32-true", batch_size: int = 256, pair_batch: int = 2048,
                 rerank_k: Optional[int] = None, num_workers: int = 0, metadata: Optional[dict] = None):
        if rerank_k is not None and rerank_k < 1:
            raise ValueError(f"rerank_k must be positive or None, got {rerank_k}")
        self.device = torch.device(device)
        self.encoders = CLIPEncoders(model).to(self.device).eval()
        self.aligner = aligner.to(self.device).eval()
        self.kind, self.tokenizer, self.preprocess = kind, tokenizer, preprocess
        self.token_keys = TokenKeys(tokenizer)
        self.precision = check_precision(precision, tuple(PRECISIONS))
        self.batch_size, self.pair_batch = batch_size, pair_batch
        self.rerank_k, self.num_workers = rerank_k, num_workers
        self.metadata = dict(metadata or {})
        self.image_tokens, self.image_global, self.text_global = EmbeddingTable(), EmbeddingTable(), EmbeddingTable()
        self.text_tokens: Dict[str, Tensor] = {}
        self.pair_scores: Dict[Tuple[Hashable, str], float] = {}
        self.gallery: Optional[List[ImageRef]] = None
        self.progress = False  # set by `prepare`: whether the caller wants progress bars
        self._gallery_top: Dict[str, np.ndarray] = {}  # text -> its k best gallery positions

    @classmethod
    def from_export(cls, export_dir: Path, **kwargs) -> "AlignerScorer":
        """A TFLocal / TFGlobal run's export (`runs/<experiment>/export`); `rerank_k` defaults to the run's
        `method.rerank_k`."""
        aligner, metadata = load_aligner(export_dir)
        built = load_backbone(export_dir, metadata["backbone"])
        kwargs.setdefault("rerank_k", metadata.get("rerank_k"))
        return cls(built.model, aligner, metadata["kind"], built.tokenizer, built.preprocess_val,
                   metadata={"model": built.name, "aligner": str(export_dir), "kind": metadata["kind"]}, **kwargs)

    def describe(self) -> Dict[str, object]:
        return {**super().describe(), **self.metadata, "rerank_k": self.rerank_k, "precision": self.precision,
                "device": str(self.device)}

    def text_keys(self, texts: Sequence[str]) -> List[bytes]:
        """The token ids the frozen text tower reads: token-identical texts are scored once and tie exactly."""
        return self.token_keys.keys(texts)

    # ----- encoding (once per unique image / text) -----------------------------------------------------------
    def prepare(self, images: Sequence[ImageRef], texts: Sequence[str], progress: bool = False) -> None:
        # The benchmark's choice also holds for the aligner scoring of the `score` calls that follow.
        self.progress = progress
        self._encode_images(self.image_global.missing(images), progress)
        self._encode_texts(self.text_global.missing(texts), progress)
        if images:  # a new gallery for the image side of re-ranking (STS prepares texts only)
            self.gallery, self._gallery_top = unique(images), {}

    def _autocast(self):
        dtype = PRECISIONS[self.precision]
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    @torch.no_grad()
    def _encode_images(self, refs: List[ImageRef], progress: bool = False) -> None:
        if not refs:
            return
        loader = DataLoader(ImageFiles(refs, self.preprocess), batch_size=self.batch_size, num_workers=self.num_workers)
        tokens, pooled = [], []
        for pixels in tqdm(loader, desc="images", unit="batch", disable=not progress):
            with self._autocast():
                image_tokens, image_global = frozen_image_features(self.encoders, pixels.to(self.device))
            tokens.append(image_tokens.float())
            pooled.append(image_global.float())
        self.image_tokens.add(refs, torch.cat(tokens))
        self.image_global.add(refs, torch.cat(pooled))

    @torch.no_grad()
    def _encode_texts(self, texts: List[str], progress: bool = False) -> None:
        if not texts:
            return
        for start in tqdm(range(0, len(texts), self.batch_size), desc="texts", unit="batch", disable=not progress):
            chunk = texts[start:start + self.batch_size]
            with self._autocast():
                ids = self.token_keys.ids(chunk).to(self.device)
                tokens, lengths, pooled = frozen_text_features(self.encoders, ids)
            for text, row, length in zip(chunk, tokens.float(), lengths.tolist()):
                self.text_tokens[text] = row[:length].clone()
            self.text_global.add(chunk, pooled.float())

    # ----- scoring ----------------------------------------------------------------------------------------------
    def score_unique(self, images: Sequence[ImageRef], texts: Sequence[str]) -> np.ndarray:
        images, texts = list(images), list(texts)
        self._encode_images(self.image_global.missing(images))
        self._encode_texts(self.text_global.missing(texts))
        if self.rerank_k is None:
            rows, columns = np.indices((len(images), len(texts))).reshape(2, -1)
            return self.pair_values(images, texts, rows, columns).reshape(len(images), len(texts))
        cosine = self.cosine(images, texts)
        chosen = self.rerank_candidates(images, texts, cosine)
        result = cosine - RERANK_SHIFT
        rows, columns = np.nonzero(chosen)
        result[rows, columns] = squash(self.pair_values(images, texts, rows, columns))
        return result

    def score_unique_groups(self, images: Sequence[ImageRef], text_groups: Sequence[Sequence[str]]) -> np.ndarray:
        """A group (a class's prompts) scores the mean aligner score over its texts; with `rerank_k`, only each
        image's k best groups by the frozen prompt-ensemble cosine are scored so (the rest: cosine - 3)."""
        images = list(images)
        if self.rerank_k is None:
            return super().score_unique_groups(images, text_groups)
        self._encode_images(self.image_global.missing(images))
        self._encode_texts(self.text_global.missing([t for group in text_groups for t in group]))
        ensembles = torch.stack([F.normalize(self.text_global.lookup(list(g)), dim=-1).mean(0) for g in text_groups])
        cosine = (F.normalize(self.image_global.lookup(images), dim=-1) @ F.normalize(ensembles, dim=-1).T)
        result = cosine.double().cpu().numpy() - RERANK_SHIFT
        for row, column in zip(*np.nonzero(top_k_columns(result, self.rerank_k))):
            group = list(text_groups[column])
            values = self.pair_values([images[row]], group, np.zeros(len(group), dtype=int), np.arange(len(group)))
            result[row, column] = squash(values.mean())
        return result

    def text_similarity(self, first: Sequence[str], second: Sequence[str]) -> np.ndarray:
        """The frozen CLIP's text cosine: the aligner leaves the text encoder untouched, so STS is the backbone's."""
        self._encode_texts(self.text_global.missing(list(first) + list(second)))
        a = F.normalize(self.text_global.lookup(list(first)), dim=-1)
        b = F.normalize(self.text_global.lookup(list(second)), dim=-1)
        return (a * b).sum(dim=-1).cpu().numpy()

    def cosine(self, images: Sequence[ImageRef], texts: Sequence[str]) -> np.ndarray:
        """Frozen global cosine [len(images), len(texts)], float64."""
        image = F.normalize(self.image_global.lookup(images), dim=-1)
        text = F.normalize(self.text_global.lookup(texts), dim=-1)
        return (image @ text.T).double().cpu().numpy()

    def rerank_candidates(self, images: List[ImageRef], texts: List[str], cosine: np.ndarray) -> np.ndarray:
        """bool [images, texts]: each image's k best texts of the call, and each text's k best gallery images."""
        chosen = top_k_columns(cosine, self.rerank_k)
        if not images or not texts:
            return chosen
        gallery = self.gallery if self.gallery is not None else unique(images)
        position = {ref: p for p, ref in enumerate(gallery)}
        row_of_position = np.full(len(gallery), -1)
        for row, ref in enumerate(images):
            if ref in position:
                row_of_position[position[ref]] = row
        best = self._best_gallery_images(gallery, texts)  # [texts, <= k] gallery positions
        rows = row_of_position[best]
        columns = np.broadcast_to(np.arange(len(texts))[:, None], rows.shape)
        present = rows >= 0
        chosen[rows[present], columns[present]] = True
        return chosen

    def _best_gallery_images(self, gallery: List[ImageRef], texts: List[str]) -> np.ndarray:
        """[texts, min(k, gallery)] positions of each text's best gallery images, cached per text and gallery."""
        cache = self._gallery_top if gallery is self.gallery else {}
        todo = [t for t in unique(texts) if t not in cache]
        if todo:
            gallery_embeddings = F.normalize(self.image_global.lookup(gallery), dim=-1)
            k = min(self.rerank_k, len(gallery))
            for start in range(0, len(todo), self.batch_size * 16):
                chunk = todo[start:start + self.batch_size * 16]
                similarity = gallery_embeddings @ F.normalize(self.text_global.lookup(chunk), dim=-1).T
                best = similarity.topk(k, dim=0).indices.T.cpu().numpy()
                cache.update(zip(chunk, best))
        return np.stack([cache[t] for t in texts])

    def pair_values(self, images: Sequence[ImageRef], texts: Sequence[str], rows: np.ndarray,
                    columns: np.ndarray) -> np.ndarray:
        """Aligner scores (float64) of the pairs (images[rows[n]], texts[columns[n]]), each computed once."""
        keys = [(images[r], texts[c]) for r, c in zip(rows.tolist(), columns.tolist())]
        todo = unique(key for key in keys if key not in self.pair_scores)
        starts = range(0, len(todo), self.pair_batch)
        # A bar only for calls of several aligner batches (a retrieval chunk), not for each small benchmark item.
        for start in tqdm(starts, desc="aligner pairs", unit="batch", leave=False,
                          disable=not self.progress or len(starts) < 2):
            chunk = todo[start:start + self.pair_batch]
            self.pair_scores.update(zip(chunk, self._aligner_scores(chunk).tolist()))
        return np.array([self.pair_scores[key] for key in keys], dtype=np.float64)

    @torch.no_grad()
    def _aligner_scores(self, pairs: List[Tuple[ImageRef, str]]) -> np.ndarray:
        images, texts = unique(p[0] for p in pairs), unique(p[1] for p in pairs)
        image_row = {ref: row for row, ref in enumerate(images)}
        text_row = {text: row for row, text in enumerate(texts)}
        image_index = torch.tensor([image_row[p[0]] for p in pairs], device=self.device)
        text_index = torch.tensor([text_row[p[1]] for p in pairs], device=self.device)
        image_tokens, text_tokens, text_mask = self._token_sets(images, texts)
        with self._autocast():
            image = self.aligner.embed(image_tokens, IMAGE)
            text = self.aligner.embed(text_tokens, TEXT)
            scores = self.aligner.score_pairs(text, text_mask, image, text_index, image_index)
        return scores.float().cpu().numpy()

    def _token_sets(self, images: List[ImageRef], texts: List[str]) -> Tuple[Tensor, Tensor, Tensor]:
        """(image tokens [I, T_i, D], text tokens [J, T_t, D], text mask [J, T_t]) as the module reads them."""
        if self.kind == "global":
            mask = torch.ones(len(texts), 1, dtype=torch.bool, device=self.device)
            return self.image_global.lookup(images)[:, None], self.text_global.lookup(texts)[:, None], mask
        rows = [self.text_tokens[text] for text in texts]
        lengths = torch.tensor([len(row) for row in rows], device=self.device)
        text = pad_sequence(rows, batch_first=True)
        return self.image_tokens.lookup(images), text, length_mask(lengths, text.shape[1])
