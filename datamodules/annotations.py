"""Caption annotation files -> `CaptionRecord`s: COCO captions JSON, Karpathy `dataset_coco.json`, NegCLIP TSV.

Shared by the DataModule and the offline preprocessing job, so both see the same records in the same order.
"""
from __future__ import annotations

import ast
import csv
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

NEGCLIP_COLUMNS = ("title", "filepath", "neg_caption")
# Karpathy's split: train on train + restval (113,287 images), validate on val, test on test.
KARPATHY_TRAIN_SPLITS = ("train", "restval")


@dataclass(frozen=True)
class CaptionRecord:
    """One caption annotation as read from disk, before images are resolved or captions tokenised.

    Attributes:
        caption_id: the annotation id (JSON) or the data-row index (TSV).
        image_id: the COCO image id.
        file_name: the image path relative to the image folder.
        caption: the caption, stripped of surrounding whitespace.
        neg_captions: hard-negative captions, stripped (possibly none).
    """

    caption_id: int
    image_id: int
    file_name: str
    caption: str
    neg_captions: Tuple[str, ...] = ()


# ----- reading annotation files -------------------------------------------------------------------------
def read_annotation_file(path: str, karpathy_splits: Sequence[str] = KARPATHY_TRAIN_SPLITS) -> List[CaptionRecord]:
    """Caption records from a COCO captions JSON, a Karpathy `dataset_coco.json`, or a NegCLIP `.tsv`.

    Args:
        path: the annotation file.
        karpathy_splits: for a Karpathy file, the `split` values to keep (e.g. train + restval).

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: the file is not in a known format (the message names the path).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"annotation file not found: {path}")
    if path.endswith(".tsv"):
        return read_negclip_tsv(path)
    document = _load_json(path)
    if _is_karpathy(document):
        return karpathy_records(path, document, karpathy_splits)
    return coco_records(path, document)


def read_coco_json(path: str) -> List[CaptionRecord]:
    """Caption records from a COCO captions JSON (`images` with `id`/`file_name`, `annotations`)."""
    return coco_records(path, _load_json(path))


def coco_records(path: str, document: Dict[str, Any]) -> List[CaptionRecord]:
    if not isinstance(document, dict) or not {"images", "annotations"} <= document.keys():
        raise ValueError(f"annotation file {path} is not a COCO captions file: it needs 'images' and "
                         f"'annotations' at the top level (or 'images' with 'sentences', Karpathy's format)")
    file_names = {image["id"]: image["file_name"] for image in document["images"]}
    return [_coco_record(path, annotation, file_names) for annotation in document["annotations"]]


def _is_karpathy(document: Any) -> bool:
    images = document.get("images") if isinstance(document, dict) else None
    return "annotations" not in document and bool(images) and "sentences" in images[0]


def karpathy_records(path: str, document: Dict[str, Any], splits: Sequence[str]) -> List[CaptionRecord]:
    """Records of the images whose `split` is in `splits`; the image id is `cocoid` (else `imgid`)."""
    known = {image.get("split") for image in document["images"]}
    if not set(splits) & known:
        raise ValueError(f"{path}: none of the splits {list(splits)} occurs; the file has {sorted(map(str, known))}")
    return [_karpathy_record(image, sentence) for image in document["images"] if image.get("split") in splits
            for sentence in image["sentences"]]


def _karpathy_record(image: Dict[str, Any], sentence: Dict[str, Any]) -> CaptionRecord:
    file_name = os.path.join(image.get("filepath", ""), image["filename"])
    return CaptionRecord(caption_id=int(sentence["sentid"]), image_id=int(image.get("cocoid", image["imgid"])),
                         file_name=file_name, caption=sentence["raw"].strip())


def _load_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        raise ValueError(f"annotation file {path} is not valid JSON: {err}") from err


def _coco_record(path: str, annotation: Dict[str, Any], file_names: Dict[int, str]) -> CaptionRecord:
    image_id = annotation["image_id"]
    if image_id not in file_names:
        raise ValueError(f"{path}: annotation {annotation['id']} refers to image {image_id}, which is not "
                         f"listed in 'images'")
    return CaptionRecord(caption_id=int(annotation["id"]), image_id=int(image_id),
                         file_name=file_names[image_id], caption=annotation["caption"].strip(),
                         neg_captions=_stripped(annotation.get("neg_captions", ())))


def read_negclip_tsv(path: str) -> List[CaptionRecord]:
    """Caption records from the NegCLIP training TSV; the caption id is the data-row index.

    The file is pandas `to_csv(sep="\\t")` output: an unnamed index column first, and quoted fields that
    may hold quotes and newlines, so it is read with the csv module rather than split into lines.
    """
    with open(path, encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle, delimiter="\t")
        missing = [column for column in NEGCLIP_COLUMNS if column not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path} is not a NegCLIP TSV: it lacks the column(s) {', '.join(missing)}")
        return [_negclip_record(path, row_index, row) for row_index, row in enumerate(reader)]


def _negclip_record(path: str, row_index: int, row: Dict[str, str]) -> CaptionRecord:
    file_name = row["filepath"]
    return CaptionRecord(caption_id=row_index, image_id=image_id_from_file_name(file_name),
                         file_name=file_name, caption=row["title"].strip(),
                         neg_captions=_parse_caption_list(path, row_index, row["neg_caption"]))


def _parse_caption_list(path: str, row_index: int, literal: str) -> Tuple[str, ...]:
    try:
        captions = ast.literal_eval(literal)
    except (ValueError, SyntaxError) as err:
        raise ValueError(f"{path}: row {row_index} has a neg_caption that is not a Python list") from err
    if not isinstance(captions, (list, tuple)) or not all(isinstance(c, str) for c in captions):
        raise ValueError(f"{path}: row {row_index} has a neg_caption that is not a list of strings")
    return _stripped(captions)


def image_id_from_file_name(file_name: str) -> int:
    """The COCO image id in a file name: its last run of digits (`COCO_val2014_000000391895.jpg` -> 391895)."""
    stem = os.path.splitext(os.path.basename(file_name))[0]
    digits = re.findall(r"\d+", stem)
    if not digits:
        raise ValueError(f"no image id (digits) in the image file name {file_name!r}")
    return int(digits[-1])


def _stripped(captions: Iterable[str]) -> Tuple[str, ...]:
    return tuple(caption.strip() for caption in captions)


def image_path_candidates(image_dir: str, file_name: str) -> Tuple[str, ...]:
    """Where an image may be: `<image_dir>/<file_name>`, else `<image_dir>/<basename(file_name)>`.

    The fallback lets NegCLIP's `coco/val2014/...` paths point into a flat image folder.
    """
    full = os.path.join(image_dir, file_name)
    flat = os.path.join(image_dir, os.path.basename(file_name))
    return (full,) if flat == full else (full, flat)


def existing_path(candidates: Sequence[str]) -> Optional[str]:
    return next((path for path in candidates if os.path.exists(path)), None)


