"""Caption annotation files -> `CaptionRecord`s: COCO captions JSON, Karpathy `dataset_coco.json`, NegCLIP TSV,
ShareGPT4V JSON (long captions, as SmartCLIP and Long-CLIP train).

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
# SmartCLIP and Long-CLIP validate on a ShareGPT4V file's first 1000 records and train on the rest.
SHAREGPT4V_VAL_RECORDS = 1000


@dataclass(frozen=True)
class CaptionRecord:
    """One caption annotation as read from disk, before images are resolved or captions tokenised.

    Attributes:
        caption_id: the annotation id (JSON) or the data-row index (TSV).
        image_id: the COCO image id.
        file_name: the image path relative to the image folder.
        caption: the caption, stripped of surrounding whitespace.
        neg_captions: hard-negative captions, stripped (possibly none).
        neg_image_rows: NegCLIP TSV `neg_image`: data-row indices (caption ids) of the same file whose images
            are this sample's hard-negative images, as written (unchecked; possibly none).
        raw_caption: the caption as the file gives it (ShareGPT4V: newlines as spaces), before stripping; None
            when that is `caption`. SmartCLIP splits this text into sentences: a trailing ". " is one more.
        annotated_size: (width, height) of the image as a COCO-style JSON records it
            (`images[].width/height`), the frame of any box annotated on it; None when the file does not record it.
    """

    caption_id: int
    image_id: int
    file_name: str
    caption: str
    neg_captions: Tuple[str, ...] = ()
    neg_image_rows: Tuple[int, ...] = ()
    raw_caption: Optional[str] = None
    annotated_size: Optional[Tuple[int, int]] = None

    @property
    def unstripped_caption(self) -> str:
        return self.caption if self.raw_caption is None else self.raw_caption


# ----- reading annotation files -------------------------------------------------------------------------
def read_annotation_file(path: str, karpathy_splits: Sequence[str] = KARPATHY_TRAIN_SPLITS,
                         caption_field: str = "caption") -> List[CaptionRecord]:
    """Caption records from a COCO captions JSON, a Karpathy `dataset_coco.json`, a NegCLIP `.tsv` or a
    ShareGPT4V JSON.

    Args:
        path: the annotation file.
        karpathy_splits: for a Karpathy file, the `split` values to keep (e.g. train + restval); for a
            ShareGPT4V file "val" (its first 1000 records) and / or "train" (the rest).
        caption_field: the annotation key of the caption in a COCO captions JSON (e.g. a long-caption key).

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: the file is not in a known format (the message names the path).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"annotation file not found: {path}")
    document = None if path.endswith(".tsv") else _load_json(path)
    if caption_field != "caption" and not _is_coco(document):
        raise ValueError(f"{path}: data.caption_field={caption_field!r} applies to COCO captions JSON files only")
    if path.endswith(".tsv"):
        return read_negclip_tsv(path)
    if _is_sharegpt4v(document):
        return sharegpt4v_records(path, document, karpathy_splits)
    if _is_karpathy(document):
        return karpathy_records(path, document, karpathy_splits)
    return coco_records(path, document, caption_field)


def read_coco_json(path: str) -> List[CaptionRecord]:
    """Caption records from a COCO captions JSON (`images` with `id`/`file_name`, `annotations`)."""
    return coco_records(path, _load_json(path))


def _is_coco(document: Any) -> bool:
    return isinstance(document, dict) and {"images", "annotations"} <= document.keys()


def coco_records(path: str, document: Dict[str, Any], caption_field: str = "caption") -> List[CaptionRecord]:
    if not _is_coco(document):
        raise ValueError(f"annotation file {path} is not a COCO captions file: it needs 'images' and "
                         f"'annotations' at the top level (or 'images' with 'sentences', Karpathy's format)")
    file_names = {image["id"]: image["file_name"] for image in document["images"]}
    sizes = {image["id"]: _recorded_size(image) for image in document["images"]}
    return [_coco_record(path, annotation, file_names, caption_field, sizes)
            for annotation in document["annotations"]]


def _recorded_size(image: Dict[str, Any]) -> Optional[Tuple[int, int]]:
    """(width, height) of a COCO `images` entry, when it records both."""
    width, height = image.get("width"), image.get("height")
    return (int(width), int(height)) if width is not None and height is not None else None


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
                         file_name=file_name, caption=sentence["raw"].strip(), raw_caption=sentence["raw"])


def _load_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        raise ValueError(f"annotation file {path} is not valid JSON: {err}") from err


def _coco_record(path: str, annotation: Dict[str, Any], file_names: Dict[int, str], caption_field: str = "caption",
                 sizes: Optional[Dict[int, Optional[Tuple[int, int]]]] = None) -> CaptionRecord:
    image_id = annotation["image_id"]
    if image_id not in file_names:
        raise ValueError(f"{path}: annotation {annotation['id']} refers to image {image_id}, which is not "
                         f"listed in 'images'")
    if not isinstance(annotation.get(caption_field), str):
        raise ValueError(f"{path}: annotation {annotation['id']} has no caption text under "
                         f"data.caption_field={caption_field!r}")
    return CaptionRecord(caption_id=int(annotation["id"]), image_id=int(image_id),
                         file_name=file_names[image_id], caption=annotation[caption_field].strip(),
                         neg_captions=_stripped(annotation.get("neg_captions", ())),
                         raw_caption=annotation[caption_field], annotated_size=(sizes or {}).get(image_id))


def _is_sharegpt4v(document: Any) -> bool:
    return (isinstance(document, list) and bool(document) and isinstance(document[0], dict)
            and {"image", "conversations"} <= document[0].keys())


def sharegpt4v_records(path: str, document: List[Dict[str, Any]], splits: Sequence[str]) -> List[CaptionRecord]:
    """Records of a ShareGPT4V JSON (`share-captioner_coco_lcs_sam_1246k_1107.json`): one per entry.

    As SmartCLIP and Long-CLIP read it: the caption is the answer, `conversations[1]["value"]`, with newlines
    as spaces; the first 1000 entries are split "val", the others "train". The caption id is the entry's
    index; the image id is the COCO id for images under a `coco/` folder, else -(index + 1), which no COCO
    image has (so that COCO leakage checks see only real COCO images).
    """
    known = {"val", "train"}
    if not set(splits) & known:
        raise ValueError(f"{path}: none of the splits {list(splits)} occurs; a ShareGPT4V file has 'val' (its "
                         f"first {SHAREGPT4V_VAL_RECORDS} records) and 'train'")
    return [_sharegpt4v_record(path, index, entry) for index, entry in enumerate(document)
            if ("val" if index < SHAREGPT4V_VAL_RECORDS else "train") in splits]


def _sharegpt4v_record(path: str, index: int, entry: Dict[str, Any]) -> CaptionRecord:
    try:
        caption = entry["conversations"][1]["value"]
    except (KeyError, IndexError, TypeError) as err:
        raise ValueError(f"{path}: entry {index} has no answer in conversations[1]['value']") from err
    file_name = entry["image"]
    is_coco = "coco" in file_name.replace("\\", "/").lower().split("/")[:-1]
    image_id = image_id_from_file_name(file_name) if is_coco else -(index + 1)
    caption = caption.replace("\n", " ")
    return CaptionRecord(caption_id=index, image_id=image_id, file_name=file_name, caption=caption.strip(),
                         raw_caption=caption)


def read_negclip_tsv(path: str) -> List[CaptionRecord]:
    """Caption records from the NegCLIP training TSV; the caption id is the data-row index.

    The optional `neg_image` column (a list of data-row indices) becomes `neg_image_rows`.

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
                         file_name=file_name, caption=row["title"].strip(), raw_caption=row["title"],
                         neg_captions=_parse_caption_list(path, row_index, row["neg_caption"]),
                         neg_image_rows=_parse_row_list(path, row_index, row.get("neg_image")))


def _parse_caption_list(path: str, row_index: int, literal: str) -> Tuple[str, ...]:
    try:
        captions = ast.literal_eval(literal)
    except (ValueError, SyntaxError) as err:
        raise ValueError(f"{path}: row {row_index} has a neg_caption that is not a Python list") from err
    if not isinstance(captions, (list, tuple)) or not all(isinstance(c, str) for c in captions):
        raise ValueError(f"{path}: row {row_index} has a neg_caption that is not a list of strings")
    return _stripped(captions)


def _parse_row_list(path: str, row_index: int, literal: Optional[str]) -> Tuple[int, ...]:
    if literal is None:  # the file has no neg_image column
        return ()
    try:
        rows = ast.literal_eval(literal)
    except (ValueError, SyntaxError) as err:
        raise ValueError(f"{path}: row {row_index} has a neg_image that is not a Python list") from err
    if not isinstance(rows, (list, tuple)) or not all(isinstance(r, int) and not isinstance(r, bool) for r in rows):
        raise ValueError(f"{path}: row {row_index} has a neg_image that is not a list of row indices")
    return tuple(rows)


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


