"""NegCLIP's hard negatives, drawn at every access: hard-negative captions and the `neg_image` neighbour.

What NegCLIP's training code does (vinid/neg_clip, `src/training/data.py`, `CsvDataset.__getitem__`) [code]:
- one hard caption is drawn uniformly at random from the sample's `neg_caption` list at every access;
- one row is drawn uniformly at random from the sample's `neg_image` list (row indices of the same TSV); that
  row's image, its own caption and one hard caption drawn from its own `neg_caption` list join the sample, so a
  batch of B rows holds 2B images and 4B texts.

Here every draw comes from a generator seeded by the sampler's per-sample augmentation seed (a function of
(seed, epoch, index)), so any number of workers and a run resumed mid-epoch see the draws of the uninterrupted
run [ours: NegCLIP draws from Python's unseeded `random` in each worker]. K > 1 captions per sample [ours;
NegCLIP uses one]: a random permutation of the sample's negatives, cycled when it has fewer than K.

Everything is stored as flat numpy arrays with offsets, so forked DataLoader workers share it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import numpy as np

from datamodules.annotations import CaptionRecord

logger = logging.getLogger(__name__)

# Streams derived from a sample's augmentation seed: its random choices (hard captions, neighbour) and its
# neighbour's augmentation (crop, and sentence prefix in that mode). The sample's own crop keeps the
# augmentation seed itself; its sentence prefix uses [seed, 1] (datamodules/coco.py).
DRAW_STREAM = 2
NEIGHBOUR_STREAM = 3
# Rows named in an error or warning (the count is always given in full).
ROWS_IN_MESSAGE = 5


def stream_seed(seed: Optional[int], stream: int) -> Optional[int]:
    """A seed for one purpose, derived from a sample's augmentation seed; None (no seed) stays None."""
    if seed is None:
        return None
    return int(np.random.SeedSequence([seed, stream]).generate_state(1)[0])


def draw_generator(seed: Optional[int]) -> np.random.Generator:
    """The generator of a sample's random choices: from its augmentation seed, or fresh entropy without one."""
    return np.random.default_rng(stream_seed(seed, DRAW_STREAM))


def draw_positions(rng: np.random.Generator, count: int, k: int) -> np.ndarray:
    """k positions in [0, count): a uniform random permutation, cycled when count < k (k = 1: one uniform choice)."""
    return rng.permutation(count)[np.arange(k) % count]


def offsets(counts: np.ndarray) -> np.ndarray:
    """Start of each sample's block in a flat array holding `counts[i]` entries per sample."""
    return np.cumsum(counts) - counts


class NegativeCaptions:
    """Every sample's hard-negative captions, tokenised once; K of them drawn at random at each access.

    Args:
        tokens: int32 [total, L], every sample's negatives one after another, in dataset order.
        counts: int [N], how many negatives each sample has (all >= 1).
        num_negatives: K, negatives per access.
    """

    def __init__(self, tokens: np.ndarray, counts: np.ndarray, num_negatives: int):
        self.tokens, self.counts, self.num_negatives = tokens, counts, num_negatives
        self.starts = offsets(counts)

    @classmethod
    def from_records(cls, records: Sequence[CaptionRecord], tokenize: Callable[[List[str]], np.ndarray],
                     num_negatives: int, source: str) -> "NegativeCaptions":
        """Tokenise every record's `neg_captions`; an annotation without any is an error (naming `source`)."""
        lacking = sum(1 for record in records if not record.neg_captions)
        if lacking:
            raise ValueError(f"{source}: {lacking} of {len(records)} annotations have no neg_captions, but "
                             f"method.hard_negatives.captions={num_negatives}")
        counts = np.array([len(record.neg_captions) for record in records], dtype=np.int64)
        return cls(tokenize([c for record in records for c in record.neg_captions]), counts, num_negatives)

    def draw(self, row: int, rng: np.random.Generator) -> np.ndarray:
        """int64 [K, L]: K of sample `row`'s negatives, drawn with `rng`."""
        positions = draw_positions(rng, int(self.counts[row]), self.num_negatives)
        return self.tokens[self.starts[row] + positions].astype(np.int64)


@dataclass
class NeighbourCounts:
    """What became of the `neg_image` indices of a dataset's samples.

    Attributes:
        out_of_range: indices outside the file's data rows (bad input; ignored with on_bad_image=skip).
        unavailable: indices of rows that are not in the dataset (excluded images, beyond max_samples, dropped
            for a missing image or an empty caption); never drawn, so an excluded image cannot come back.
        without_neighbour: samples left without a usable index; they are not trained on as anchors (they can
            still be the neighbour of another sample).
    """

    out_of_range: int = 0
    unavailable: int = 0
    without_neighbour: int = 0


class NeighbourTable:
    """For every dataset row, the rows of its usable hard-negative images; one is drawn per access.

    Args:
        neighbours: per row, the dataset rows it may draw (possibly none).
    """

    def __init__(self, neighbours: Sequence[Sequence[int]]):
        self.counts = np.array([len(rows) for rows in neighbours], dtype=np.int64)
        self.starts = offsets(self.counts)
        self.rows = np.array([row for rows in neighbours for row in rows], dtype=np.int64)

    @property
    def anchor_rows(self) -> np.ndarray:
        """The rows with at least one usable neighbour: the samples that are trained on."""
        return np.flatnonzero(self.counts > 0)

    def draw(self, row: int, rng: np.random.Generator) -> int:
        """One of `row`'s neighbours, uniformly (NegCLIP's `random.choice(self.hard_images[idx])`)."""
        return int(self.rows[self.starts[row] + rng.integers(self.counts[row])])


def build_neighbour_table(records: Sequence[CaptionRecord], file_rows: int, on_bad_image: str,
                          source: str) -> tuple[NeighbourTable, NeighbourCounts]:
    """The neighbour table of the kept `records` (dataset order), from their `neg_image_rows`.

    `neg_image` holds data-row indices of the whole file (`file_rows` rows), which are the TSV records'
    caption ids; rows the dataset does not hold are dropped from the lists, counted.

    Raises:
        ValueError: a record without `neg_image` (not the NegCLIP TSV), an index outside the file with
            on_bad_image="error", or no sample left with a usable neighbour.
    """
    lacking = [record.caption_id for record in records if not record.neg_image_rows]
    if lacking:
        raise ValueError(f"{source}: {len(lacking)} of {len(records)} annotations have no neg_image (e.g. row "
                         f"{lacking[0]}), but method.hard_negatives.images=true needs the NegCLIP TSV's neg_image "
                         f"column (lists of row indices)")
    out_of_range = [(record.caption_id, index) for record in records for index in record.neg_image_rows
                    if not 0 <= index < file_rows]
    _report_out_of_range(out_of_range, file_rows, on_bad_image, source)
    row_of_caption = {record.caption_id: row for row, record in enumerate(records)}
    neighbours = [[row_of_caption[i] for i in record.neg_image_rows if i in row_of_caption] for record in records]
    listed = sum(len(record.neg_image_rows) for record in records)
    counts = NeighbourCounts(out_of_range=len(out_of_range),
                             unavailable=listed - len(out_of_range) - sum(map(len, neighbours)),
                             without_neighbour=sum(1 for rows in neighbours if not rows))
    table = NeighbourTable(neighbours)
    _report_counts(counts, len(records), source)
    if not len(table.anchor_rows):
        raise ValueError(f"{source}: no sample has a usable neg_image neighbour ({counts.unavailable} indices "
                         f"point at rows the dataset does not hold: excluded images, rows beyond "
                         f"data.max_*_samples, or dropped rows)")
    return table, counts


def _report_out_of_range(out_of_range: list, file_rows: int, on_bad_image: str, source: str) -> None:
    if not out_of_range:
        return
    shown = ", ".join(f"row {row} lists {index}" for row, index in out_of_range[:ROWS_IN_MESSAGE])
    if on_bad_image == "error":
        raise ValueError(f"{source}: {len(out_of_range)} neg_image indices lie outside the file's {file_rows} "
                         f"data rows ({shown}); set data.on_bad_image=skip to ignore them")
    logger.warning("%s: ignored %d neg_image indices outside the file's %d data rows (%s)", source,
                   len(out_of_range), file_rows, shown)


def _report_counts(counts: NeighbourCounts, num_records: int, source: str) -> None:
    if counts.unavailable:
        logger.info("%s: %d neg_image indices point at rows the dataset does not hold (excluded images, rows "
                    "beyond max_samples, dropped rows); they are never drawn", source, counts.unavailable)
    if counts.without_neighbour:
        logger.warning("%s: %d of %d samples have no usable neg_image neighbour left and are not trained on "
                       "(they can still be another sample's neighbour)", source, counts.without_neighbour,
                       num_records)
