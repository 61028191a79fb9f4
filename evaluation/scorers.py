"""Scorers: what a benchmark asks a model for, `score(images, texts) -> similarity matrix`.

`ClipScorer` (the default) is the global cosine of an open_clip model. It encodes each unique image and text
once per run, in batches, and keeps the embeddings, so a benchmark that reuses an image across many items
(COCO-Order: 5 captions per image; SugarCrepe: up to 7 subsets per image) pays for it once. Other scorers
(structure-guided inference, the TFLocal aligner) implement `score`, and `prepare` when they can precompute.
A text is keyed by its token ids (`TokenKeys`), not its string: texts the tokenizer maps to the same ids are
embedded once and tie exactly.

Text cost [ours, exact up to float rounding]: for a CLIP text tower (causal attention, EOS pooling) `ClipScorer`
sorts the texts by token count and runs each batch only up to its longest text's EOS: the positions after it
cannot reach the EOS output through causal attention. SugarCrepe's 11,844 distinct texts (7.6 per distinct
image) have 14.7 tokens on average (EOS included), and sorted batches of 128 run 14.9 positions on average
instead of 77.
"""
from __future__ import annotations

import hashlib
import logging
from abc import abstractmethod
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Dict, Hashable, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from core.cli import AUTOCAST, autocast_dtype, check_precision
from evaluation.benchmarks.base import ImageRef, Scorer, unique
from evaluation.benchmarks.images import load_image, member_bytes

log = logging.getLogger(__name__)

# Lightning's precision names a scorer implements -> the dtype it autocasts to (None: float32).
PRECISIONS = {name: autocast_dtype(name) for name in AUTOCAST}


class FunctionScorer(Scorer):
    """A scorer from a plain function `similarity(image_ref, text) -> float` (tests, quick experiments)."""

    def __init__(self, similarity: Callable[[ImageRef, str], float]):
        self.similarity = similarity

    def score_unique(self, images: Sequence[ImageRef], texts: Sequence[str]) -> np.ndarray:
        return np.array([[self.similarity(image, text) for text in texts] for image in images], dtype=np.float64)


class EmbeddingTable:
    """Embeddings by key, appended in chunks, looked up as one matrix."""

    def __init__(self) -> None:
        self.row: Dict[Hashable, int] = {}
        self._chunks: List[Tensor] = []
        self._matrix: Optional[Tensor] = None

    def missing(self, keys: Sequence[Hashable]) -> list:
        return [key for key in unique(keys) if key not in self.row]

    def add(self, keys: Sequence[Hashable], embeddings: Tensor) -> None:
        for key in keys:
            self.row[key] = len(self.row)
        self._chunks.append(embeddings)
        self._matrix = None

    def lookup(self, keys: Sequence[Hashable]) -> Tensor:
        if self._matrix is None:
            self._matrix = torch.cat(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
            self._chunks = [self._matrix]
        return self._matrix[[self.row[key] for key in keys]]


class TokenKeys:
    """Each text's token ids as the tokenizer gives them (tokenized once per distinct string), and as bytes: the
    key under which a scorer tells texts apart. Strings differing only where the tokenizer does not look
    (spaces around punctuation, runs of whitespace, case for CLIP's) share a key."""

    CHUNK = 4096  # texts per tokenizer call

    def __init__(self, tokenizer: Callable):
        self.tokenizer = tokenizer
        self._keys: Dict[str, bytes] = {}
        self._dtype: Optional[np.dtype] = None

    def keys(self, texts: Sequence[str]) -> List[bytes]:
        todo = [text for text in unique(texts) if text not in self._keys]
        for start in range(0, len(todo), self.CHUNK):
            chunk = todo[start:start + self.CHUNK]
            tokens = torch.as_tensor(self.tokenizer(chunk)).cpu().numpy()
            self._dtype = tokens.dtype
            self._keys.update(zip(chunk, (row.tobytes() for row in tokens)))
        return [self._keys[text] for text in texts]

    def ids(self, texts: Sequence[str]) -> Tensor:
        """Token ids [len(texts), context], from the keys (no second tokenization)."""
        keys = self.keys(texts)
        return torch.from_numpy(np.stack([np.frombuffer(key, dtype=self._dtype) for key in keys]))


class ImageKeys:
    """Each image's content key: a digest of its encoded bytes (a file's, or a parquet cell's) and its crop box.

    Benchmarks take the same photos from other datasets (COCO val2017 under SugarCrepe, SugarCrepe++ and What'sUp;
    Visual Genome under ARO, Cola and CREPE), each from its own folder or container. Keyed by content, an image
    is embedded once per scorer whichever benchmark, folder or file name it comes under; the same bytes decode to
    the same pixels, so nothing but the work changes. Each distinct reference is read and hashed once.
    """

    def __init__(self) -> None:
        self._keys: Dict[ImageRef, tuple] = {}
        self._file_digests: Dict[tuple, str] = {}

    def keys(self, refs: Sequence[ImageRef]) -> List[tuple]:
        for ref in unique(refs):
            if ref not in self._keys:
                self._keys[ref] = (self._digest(ref), ref.box)
        return [self._keys[ref] for ref in refs]

    def _digest(self, ref: ImageRef) -> str:
        if ref.member is not None:
            return hashlib.blake2b(member_bytes(ref.path, ref.member), digest_size=16).hexdigest()
        where = (ref.path, None)  # one digest per file, whatever crops of it are asked for
        if where not in self._file_digests:
            try:
                with open(ref.path, "rb") as handle:
                    self._file_digests[where] = hashlib.file_digest(handle, lambda: hashlib.blake2b(digest_size=16)
                                                                    ).hexdigest()
            except OSError:  # left to the decoder, whose error names the benchmark image
                self._file_digests[where] = f"unreadable:{ref.path}"
        return self._file_digests[where]


class EmbeddingScorer(Scorer):
    """Cosine similarity of L2-normalised embeddings, each unique image and text embedded once: an image once per
    content (`ImageKeys`: across benchmarks too), a text once per `text_keys` key (the first string seen with it
    standing for the others). `embedded` counts what was encoded, and the references asked for."""

    def __init__(self, batch_size: int = 256):
        self.batch_size = batch_size
        self.images = EmbeddingTable()
        self.texts = EmbeddingTable()
        self.image_keys = ImageKeys()
        self.embedded = {"images": 0, "texts": 0, "image_refs": 0}

    @abstractmethod
    def embed_images(self, refs: Sequence[ImageRef], progress: bool) -> Tensor:
        """Embeddings [len(refs), D] (any scale; they are normalised here)."""

    @abstractmethod
    def embed_texts(self, texts: Sequence[str], progress: bool) -> Tensor:
        """Embeddings [len(texts), D]."""

    def prepare(self, images: Sequence[ImageRef], texts: Sequence[str], progress: bool = False) -> None:
        self.embedded["image_refs"] += len(unique(images))
        self._fill_images(images, progress)
        self._fill_texts(texts, progress)

    def _fill_images(self, refs: Sequence[ImageRef], progress: bool) -> list:
        """The content keys of `refs`, after embedding one reference of each key the table lacks."""
        keys = self.image_keys.keys(refs)
        todo: Dict[Hashable, ImageRef] = {}
        for key, ref in zip(keys, refs):
            if key not in self.images.row:
                todo.setdefault(key, ref)
        if todo:
            embeddings = self.embed_images(list(todo.values()), progress)
            self.images.add(list(todo), F.normalize(embeddings.float().cpu(), dim=-1))
            self.embedded["images"] += len(todo)
        return keys

    def _fill_texts(self, texts: Sequence[str], progress: bool) -> list:
        """The keys of `texts`, after embedding one text of each key the table lacks."""
        keys = self.text_keys(texts)
        todo: Dict[Hashable, str] = {}
        for key, text in zip(keys, texts):
            if key not in self.texts.row:
                todo.setdefault(key, text)
        if todo:
            embeddings = self.embed_texts(list(todo.values()), progress)
            self.texts.add(list(todo), F.normalize(embeddings.float().cpu(), dim=-1))
            self.embedded["texts"] += len(todo)
        return keys

    def image_embeddings(self, refs: Sequence[ImageRef]) -> Tensor:
        return self.images.lookup(self._fill_images(refs, False))

    def text_embeddings(self, texts: Sequence[str]) -> Tensor:
        return self.texts.lookup(self._fill_texts(texts, False))

    def score_unique(self, images: Sequence[ImageRef], texts: Sequence[str]) -> np.ndarray:
        return (self.image_embeddings(images) @ self.text_embeddings(texts).T).numpy()

    def score_unique_groups(self, images: Sequence[ImageRef], text_groups: Sequence[Sequence[str]]) -> np.ndarray:
        """CLIP's prompt ensembling: the normalised mean of a group's normalised embeddings."""
        groups = torch.stack([self.text_embeddings(list(group)).mean(dim=0) for group in text_groups])
        return (self.image_embeddings(images) @ F.normalize(groups, dim=-1).T).numpy()

    def text_similarity(self, first: Sequence[str], second: Sequence[str]) -> np.ndarray:
        return (self.text_embeddings(first) * self.text_embeddings(second)).sum(dim=-1).numpy()


class ImageFiles(Dataset):
    """Decoded, preprocessed benchmark images for a DataLoader (workers decode in parallel)."""

    def __init__(self, refs: Sequence[ImageRef], preprocess: Callable):
        self.refs, self.preprocess = list(refs), preprocess

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, index: int) -> Tensor:
        return self.preprocess(load_image(self.refs[index]))


class ClipScorer(EmbeddingScorer):
    """Global cosine of an open_clip model (`encode_image` / `encode_text`), the standard protocol.

    Args:
        model: an open_clip CLIP; put in eval mode here.
        tokenizer: open_clip tokenizer (truncates to the context length, so over-long texts are cut, not
            rejected, as the published numbers were computed).
        preprocess: the validation image transform.
        trim_text: run the text tower only up to each batch's last EOS, batches of texts sorted by length
            (exact for a causal, EOS-pooled CLIP text tower; ignored for any other text tower).
        precision: "32-true" (default; the published open_clip numbers), "bf16-mixed" or "16-mixed" (autocast).
        num_workers: image-decoding processes.
    """

    def __init__(self, model: nn.Module, tokenizer: Callable, preprocess: Callable, device: str = "cpu",
                 precision: str = "32-true", batch_size: int = 256, num_workers: int = 0,
                 metadata: Optional[Dict[str, object]] = None, trim_text: bool = True):
        super().__init__(batch_size)
        check_precision(precision, tuple(PRECISIONS))
        self.device, self.precision, self.num_workers = torch.device(device), precision, num_workers
        self.model = model.to(self.device).eval()  # the inputs go to `device`, so the weights must be there too
        self.trimmed_text = _trimmable_text_tower(self.model) if trim_text else None
        self.tokenizer, self.preprocess = tokenizer, preprocess
        self.token_keys = TokenKeys(tokenizer)
        self.metadata = dict(metadata or {})

    @classmethod
    def from_pretrained(cls, name: str, pretrained: Optional[str], config_dir: Optional[str] = "configs/models",
                        **kwargs) -> "ClipScorer":
        """open_clip `name` with weights `pretrained` (a tag or a file; None = random init); OpenAI-derived
        weights get QuickGELU. `config_dir` registers extra model configs (the repo's tiny test models)."""
        from modeling.encoders import build_model

        built = build_model(name, pretrained, config_dir)
        return cls(built.model, built.tokenizer, built.preprocess_val,
                   metadata={"model": built.name, "pretrained": pretrained}, **kwargs)

    @classmethod
    def from_export(cls, export_dir: Path, **kwargs) -> "ClipScorer":
        """A model exported by `fit` (`runs/<experiment>/export`)."""
        from modeling.export import load_export

        return cls.from_built(load_export(export_dir), {"pretrained": str(export_dir)}, **kwargs)

    @classmethod
    def from_built(cls, built, metadata: Optional[Dict[str, object]] = None, **kwargs) -> "ClipScorer":
        """A model already built (`modeling.encoders.BuiltModel`), e.g. a weight interpolation held in memory."""
        return cls(built.model, built.tokenizer, built.preprocess_val,
                   metadata={"model": built.name, **(metadata or {})}, **kwargs)

    def text_keys(self, texts: Sequence[str]) -> List[bytes]:
        """The token ids the text tower reads (see `Scorer.text_keys`)."""
        return self.token_keys.keys(texts)

    def describe(self) -> Dict[str, object]:
        activation = "quickgelu" if _uses_quickgelu(self.model) else "gelu"
        return {**super().describe(), **self.metadata, "precision": self.precision, "activation": activation,
                "device": str(self.device)}

    def _autocast(self):
        dtype = PRECISIONS[self.precision]
        return torch.autocast(self.device.type, dtype=dtype) if dtype is not None else nullcontext()

    @torch.no_grad()
    def embed_images(self, refs: Sequence[ImageRef], progress: bool) -> Tensor:
        loader = DataLoader(ImageFiles(refs, self.preprocess), batch_size=self.batch_size,
                            num_workers=self.num_workers)
        chunks = []
        for pixels in tqdm(loader, desc="images", unit="batch", disable=not progress):
            with self._autocast():
                chunks.append(self.model.encode_image(pixels.to(self.device)).float().cpu())
        return torch.cat(chunks)

    @torch.no_grad()
    def embed_texts(self, texts: Sequence[str], progress: bool) -> Tensor:
        if self.trimmed_text is None:
            return self._embed_texts_full(texts, progress)
        tokens = self.token_keys.ids(texts)
        lengths = tokens.argmax(dim=-1) + 1  # the EOS (CLIP's largest token id) and what precedes it
        order = torch.argsort(lengths, stable=True)
        embeddings: Optional[Tensor] = None
        starts = range(0, len(texts), self.batch_size)
        for start in tqdm(starts, desc="texts", unit="batch", disable=not progress):
            rows = order[start:start + self.batch_size]
            batch = tokens[rows, : int(lengths[rows].max())].to(self.device)
            with self._autocast():
                pooled = self.trimmed_text.encode_text(batch).pooled.float().cpu()
            if embeddings is None:
                embeddings = pooled.new_empty(len(texts), pooled.shape[-1])
            embeddings[rows] = pooled
        return embeddings

    def _embed_texts_full(self, texts: Sequence[str], progress: bool) -> Tensor:
        chunks = []
        starts = range(0, len(texts), self.batch_size)
        for start in tqdm(starts, desc="texts", unit="batch", disable=not progress):
            tokens = self.token_keys.ids(texts[start:start + self.batch_size]).to(self.device)
            with self._autocast():
                chunks.append(self.model.encode_text(tokens).float().cpu())
        return torch.cat(chunks)


def _trimmable_text_tower(model: nn.Module):
    """`CLIPEncoders` of `model` when its text tower may be cut after the EOS (an open_clip CLIP with a causal
    mask and argmax pooling: the EOS is the largest token id), else None."""
    from modeling.encoders import CLIPEncoders

    causal = getattr(model, "attn_mask", None) is not None and getattr(model, "text_pool_type", None) == "argmax"
    if not (causal and hasattr(model, "token_embedding")):
        return None
    try:
        return CLIPEncoders(model)
    except ValueError:  # a vision tower CLIPEncoders does not take (it is not used here, but it refuses)
        return None


def _uses_quickgelu(model: nn.Module) -> bool:
    from open_clip.transformer import QuickGELU

    return any(isinstance(module, QuickGELU) for module in model.modules())
