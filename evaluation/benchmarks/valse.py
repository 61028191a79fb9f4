"""VALSE (Parcalabescu et al., ACL 2022): 11 foiling pieces over 7 linguistic phenomena.

Official files (`Heidelberg-NLP/VALSE`, `data/`): `<root>/<piece>.json`, each a JSON object keyed by example id
(`"existence_visual7w_2371044"`, `"relations:coco_2017:212732"`, `"actions_test_0"`, ...; the two action pieces
reuse the same keys, so item ids are `<piece>/<key>`). Each record holds `dataset`, `image_file`, `caption`,
`foil` and `mturk{caption, foil, other}` (3 annotators) plus piece-specific fields that are not read here.

Only valid records count: `mturk["caption"] >= 2` (the VALSE README; the official scripts skip the others).
The invalid ones are dropped, as the protocol says, and counted per piece in the aggregates. The caption and foil
of every record, valid or not, must be non-empty (the official files hold none empty): an empty one is a damaged
file, refused.

Images come from the origin datasets, named by the record's `dataset` value, which is not uniform:
`visual7w` (existence, counting), `coco2017` (plurals) and `coco_2017` (relations, both COCO val2017 file
names), `SWiG` (the action pieces, `images_512`), `VisDial_v1.0` (coreference; the standard piece names COCO
train2014 *and* val2014 files, the hard piece `VisualDialog_val2018_*` files) and `"FOIL dataset"` (foil-it,
COCO val2014). Option `images` maps a dataset value to a folder, or to a list of folders searched in order
(the VisDial value needs one folder holding both kinds of files, or a list of them).

Scoring is the pairwise `acc_r` of the paper for contrastive models: an item is correct iff
s(image, caption) > s(image, foil), strictly (a tie is wrong; CE-CLIP's script thresholds a softmax at
0.5, which also makes a tie wrong). Three averages circulate and all are reported: `macro_pieces`, the mean
over the pieces (CE-CLIP Table 1, 65.3 for CLIP ViT-B/32); `macro_phenomena`, the mean over the 7
phenomena, each the mean of its pieces (vl_compo, 67.53); and `micro`, over all valid items.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path

import numpy as np

from evaluation.benchmarks.annotations import read_json, require, required_text
from evaluation.benchmarks.base import ImageRef, Item, ItemBenchmark, Outcome, percent
from evaluation.benchmarks.sources import DataSource, github_file, published

PHENOMENA: dict[str, tuple] = {
    "existence": ("existence",),
    "plurality": ("plurals",),
    "counting": ("counting-hard", "counting-small-quant", "counting-adversarial"),
    "relations": ("relations",),
    "actions": ("action-replacement", "actant-swap"),
    "coreference": ("coreference-standard", "coreference-hard"),
    "foil-it": ("foil-it",),
}
PIECES = tuple(piece for pieces in PHENOMENA.values() for piece in pieces)
# The `dataset` values of the official files (read from each piece), for the default image folders.
DATASETS = ("visual7w", "coco2017", "coco_2017", "SWiG", "VisDial_v1.0", "FOIL dataset")
VALID_VOTES = 2  # "at least two out of three annotators identified the caption, but not the foil"

Folders = str | Path | Sequence[str | Path]


# The annotation files at the commit this loader was written against (Heidelberg-NLP/VALSE, data/).
REPOSITORY, COMMIT = "Heidelberg-NLP/VALSE", "2152d90d4aecd11f7f74cf03420abcb63efff9c5"
FILES = (
    ("existence", "b20fca52eba86c544083d423345a2e28e60e601ef61c56c9ac1c73a95a3a6d18", 420403),
    ("plurals", "43760db7fc8c6f2a21d3536d52f81539cb101f3370e8d2effb09de43d91486a3", 1097122),
    ("counting-hard", "2cc83615653675fb50914ce2d8ab4041cce1278eed7ac0abf6f319dbce5c967a", 537197),
    ("counting-small-quant", "ca0645885b05738f6c6df2dffec70c669aaff64114017f33425821faab4bc374", 534996),
    ("counting-adversarial", "0d23529308449c98b37a91048a865a5f377325eceb9accd73f2947bc512d12b0", 407394),
    ("relations", "061fc557459c318ccd6734d07c21cfa5bf5ae87aa6b1110b8f5ec3d6b2911043", 664587),
    ("action-replacement", "336ba134f29a3475d0508809067218909a6bd30f079c59309d19244eccb7917f", 664129),
    ("actant-swap", "915294ac3ade7c4c067b1c6841d0db93b60cb8a61ac8e2fb6b125c2a1c0ca93a", 503017),
    ("coreference-standard", "dae1d9eb018acb54e29a1c4983f3563f86ec3b6beb4037a261564270b0473e95", 592329),
    ("coreference-hard", "ef54d8d971d9e0f264e07de08d9915c6e3d6129a2f239888f2b938f5c2eb4139", 95649),
    ("foil-it", "6f6f0d7494271ed28f6e6f075c3ba36ba1bc45d00ecf7403920f060915130460", 538911),
)


class Valse(ItemBenchmark):
    """VALSE pairwise accuracy over the valid items.

    Args:
        root: folder holding the official `<piece>.json` files.
        images: `{dataset value: folder or [folders]}`; entries override the default
            `<root>/images/<dataset value>` for each of the six official values. With a list, an image is
            taken from the first folder that holds it (else the first folder, so the missing-image check
            names it).
        pieces: the pieces to read (file stems; default all 11). Averages then cover only these pieces.
    """

    name = "valse"
    headline = ("macro_pieces", "macro_phenomena", "micro")
    description = "VALSE: pairwise accuracy acc_r (caption > foil) on the valid items, per piece and averaged (%)"
    data_source = DataSource(
        home="https://github.com/Heidelberg-NLP/VALSE", licence="MIT (annotations); images: each source's terms",
        size="11 JSON files, 6 MB; images from six datasets (about 40 GB in all, a few thousand used)",
        downloads=tuple(github_file(REPOSITORY, COMMIT, f"data/{piece}.json", sha256, size)
                        for piece, sha256, size in FILES),
        by_hand="images from their datasets, one folder per `dataset` value under <root>/images/ (Visual7W, COCO "
                "2017, SWiG images_512, VisDial v1.0 and val2018, FOIL's COCO val2014): see the VALSE README")
    published = published({"macro_phenomena": 67.53}, "vl_compo")

    def __init__(self, root: str | Path, images: Mapping[str, Folders] | None = None,
                 pieces: Sequence[str] | None = None):
        self.pieces = _checked_pieces(pieces)
        super().__init__(root)
        self.images = {value: _folder_list(self.root / "images" / value) for value in DATASETS}
        self.images.update({value: _folder_list(folders) for value, folders in (images or {}).items()})

    def required_files(self) -> list[str]:
        return [f"{piece}.json" for piece in self.pieces]

    def items(self) -> list[Item]:
        return self._items

    @cached_property
    def _items(self) -> list[Item]:
        return [item for piece in self.pieces for item in self._piece_items(piece)]

    def _piece_items(self, piece: str) -> list[Item]:
        path = self.root / f"{piece}.json"
        records = read_json(path)
        require(isinstance(records, dict),
                f"{path}: expected a JSON object keyed by example id, got {type(records).__name__}")
        texts = {key: _texts(path, key, record) for key, record in records.items()}
        valid = {key: record for key, record in records.items() if _caption_votes(path, key, record) >= VALID_VOTES}
        invalid = len(records) - len(valid)
        return [Item(id=f"{piece}/{key}", images=[self._image(path, key, record)], texts=texts[key],
                     meta={"piece": piece, "invalid_in_piece": invalid})
                for key, record in valid.items()]

    def _image(self, path: Path, key: str, record: dict) -> ImageRef:
        dataset, image_file = _text(path, key, record, "dataset"), _text(path, key, record, "image_file")
        require(dataset in self.images,
                f"{path}: record {key!r} has dataset {dataset!r}, which the `images` option does not map to a "
                f"folder (mapped: {', '.join(sorted(self.images))}); pass images={{{dataset!r}: FOLDER}}")
        folders = self.images[dataset]
        if len(folders) > 1:  # only a list of folders needs a look at the disk
            folders = [folder for folder in folders if (folder / image_file).is_file()] or folders
        return ImageRef(str(folders[0] / image_file))

    def outcome(self, item: Item, similarity: np.ndarray) -> Outcome:
        caption, foil = float(similarity[0, 0]), float(similarity[0, 1])
        return {"id": item.id, "piece": item.meta["piece"], "correct": caption > foil, "tie": caption == foil,
                "invalid_in_piece": item.meta["invalid_in_piece"]}

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        """Per piece, per phenomenon (`phenomenon/<name>`), the three averages, and item counts.

        Pieces and phenomena without outcomes (the `pieces` option) are left out of the averages.
        """
        by_piece = {p: [o for o in outcomes if o["piece"] == p] for p in PIECES}
        by_piece = {p: rows for p, rows in by_piece.items() if rows}
        result = {piece: percent([o["correct"] for o in rows]) for piece, rows in by_piece.items()}
        for phenomenon, pieces in PHENOMENA.items():
            present = [result[p] for p in pieces if p in result]
            if present:
                result[f"phenomenon/{phenomenon}"] = float(np.mean(present))
        result["macro_pieces"] = float(np.mean([result[p] for p in by_piece])) if by_piece else float("nan")
        phenomena = [v for k, v in result.items() if k.startswith("phenomenon/")]
        result["macro_phenomena"] = float(np.mean(phenomena)) if phenomena else float("nan")
        result["micro"] = percent([o["correct"] for o in outcomes])
        result["valid_items"] = len(outcomes)
        result["ties"] = sum(bool(o["tie"]) for o in outcomes)
        invalid = {piece: int(rows[0]["invalid_in_piece"]) for piece, rows in by_piece.items()}
        result["invalid_items"] = sum(invalid.values())
        result.update({f"invalid_items/{piece}": count for piece, count in invalid.items()})
        return result


def _checked_pieces(pieces: Sequence[str] | None) -> tuple:
    if pieces is None:
        return PIECES
    unknown = [piece for piece in pieces if piece not in PIECES]
    if unknown or not pieces:
        raise ValueError(f"valse: unknown pieces {unknown or '(none given)'}; valid: {', '.join(PIECES)}")
    return tuple(piece for piece in PIECES if piece in pieces)  # official order, no duplicates


def _folder_list(folders: Folders) -> list[Path]:
    return [Path(folders)] if isinstance(folders, (str, Path)) else [Path(folder) for folder in folders]


def _caption_votes(path: Path, key: str, record: object) -> int:
    mturk = record.get("mturk") if isinstance(record, dict) else None
    votes = mturk.get("caption") if isinstance(mturk, dict) else None
    require(isinstance(votes, int) and not isinstance(votes, bool),
            f"{path}: record {key!r} lacks an integer mturk.caption vote count")
    return votes


def _texts(path: Path, key: str, record: object) -> list[str]:
    """[caption, foil] of a record."""
    require(isinstance(record, dict), f"{path}: record {key!r} is not a JSON object")
    return [required_text(record.get(field), f"{path}: record {key!r}", field) for field in ("caption", "foil")]


def _text(path: Path, key: str, record: dict, field: str) -> str:
    value = record.get(field)
    require(isinstance(value, str) and value != "", f"{path}: record {key!r} lacks a non-empty string field {field!r}")
    return value
