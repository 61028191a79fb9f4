"""ImageCoDe: the validation file and image sets in the authors' layout, the first-argmax rule with exact ties, the
video / static split, and parity with the authors' `baselines/clip/evaluate_clip.py`."""
from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from evaluation.benchmarks.base import OTHER, MissingBenchmarkData
from evaluation.benchmarks.imagecode import VALID_FILE, ImageCoDe, first_argmax_scores
from evaluation.scorers import ClipScorer, FunctionScorer
from testkit.standin.imagecode import PooledFiles, frame_names, write_imagecode
from testkit.standin.images import encoded_pool

FIXTURE = Path(__file__).resolve().parent / "data" / "benchmarks" / "imagecode"


def hashed(image_path: str, text: str) -> float:
    """A value in {0.0, 0.1, ..., 1.0} from an image (set folder and file) and a text: full of exact ties."""
    image = "/".join(Path(image_path).parts[-2:])
    digest = hashlib.sha256(f"{image}\x1f{text}".encode()).digest()
    return round(digest[0] / 255, 1)


def hash_scorer() -> FunctionScorer:
    return FunctionScorer(lambda ref, text: hashed(ref.path, text))


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b)


def _write_sets(images: Path, set_names, seed: int = 0) -> None:
    """Ten small JPEGs per set under the authors' names (frame numbers for video sets)."""
    rng, files = random.Random(seed), PooledFiles(encoded_pool(seed, ".jpg", count=10))
    for set_name in set_names:
        (images / set_name).mkdir(parents=True, exist_ok=True)
        for position, name in enumerate(frame_names(set_name, rng)):
            files.write(images / set_name / name, position)


def _fixture_copy(tmp_path: Path) -> Path:
    shutil.copytree(FIXTURE / "data", tmp_path / "data")
    _write_sets(tmp_path / "data" / "image-sets", json.loads((FIXTURE / VALID_FILE).read_text()))
    return tmp_path


# ---------------------------------------------------------------- loading


def test_standin_reads_back_ids_descriptions_gold_kinds_and_frame_order(tmp_path):
    benchmark = ImageCoDe(tmp_path, **write_imagecode(tmp_path, n_items=30, seed=1))
    sets = json.loads((tmp_path / VALID_FILE).read_text())
    items = benchmark.items()
    expected = [(f"{s}/{gold}", [text.strip()], {"set": s, "gold": int(gold),
                 "kind": "static" if s.startswith("open-images") else "video"})
                for s, descriptions in sets.items() for gold, text in descriptions.items()]
    assert [(item.id, item.texts, item.meta) for item in items] == expected
    assert {item.meta["kind"] for item in items} == {"static", "video"}
    video = next(item for item in items if item.meta["kind"] == "video")
    numbers = [int(Path(ref.path).stem[3:]) for ref in video.images]
    assert numbers == sorted(numbers) and numbers != list(range(10))  # position i is the i-th frame, not img<i>
    assert all(Path(ref.path).parent == tmp_path / "data" / "image-sets" / video.meta["set"] for ref in video.images)
    assert ImageCoDe(tmp_path).items()[0].images == items[0].images  # default images folder
    assert {benchmark.image_origin(ref).source for ref in benchmark.image_refs()} == {OTHER}


def test_standin_writes_thousands_of_items(tmp_path):
    benchmark = ImageCoDe(tmp_path, **write_imagecode(tmp_path, n_items=3000))
    assert len(benchmark.items()) == 3000 and len({item.id for item in benchmark.items()}) == 3000


def test_the_real_sample_reads_every_description_and_sorts_images_by_number(tmp_path):
    root = _fixture_copy(tmp_path)
    items = ImageCoDe(root).items()
    assert len(items) == 101 and len({item.meta["set"] for item in items}) == 48
    assert sum(item.meta["kind"] == "static" for item in items) == 32
    first = items[0]
    assert (first.id, first.meta["gold"], first.meta["kind"]) == ("open-images-1815_f91d6f546e63f20d/5", 5, "static")
    assert first.texts == ["A deer head is mounted horizontally next to a painting"]
    stripped = next(item for item in items if item.id == "open-images-1815_f91d6f546e63f20d/7")
    assert stripped.texts[0].endswith("flowers.")  # the file's trailing space is dropped, as zero_shot.py does
    assert [Path(ref.path).name for ref in first.images] == [f"img{k}.jpg" for k in range(10)]


def test_sets_unpacked_straight_into_data_are_found_and_the_images_option_wins(tmp_path):
    shutil.copytree(FIXTURE / "data", tmp_path / "data")
    sets = json.loads((FIXTURE / VALID_FILE).read_text())
    _write_sets(tmp_path / "data", sets)
    assert ImageCoDe(tmp_path).images == tmp_path / "data"
    assert len(ImageCoDe(tmp_path).items()) == 101
    _write_sets(tmp_path / "elsewhere", sets)
    benchmark = ImageCoDe(tmp_path, images=tmp_path / "elsewhere")
    assert Path(benchmark.items()[0].images[0].path).parent.parent == tmp_path / "elsewhere"


def test_missing_and_malformed_image_sets_are_named(tmp_path):
    with pytest.raises(MissingBenchmarkData, match=r"lacks data/valid_data\.json"):
        ImageCoDe(tmp_path)
    root = _fixture_copy(tmp_path)
    image_sets = root / "data" / "image-sets"
    shutil.rmtree(image_sets / "YouCook-video0037-shot3_0")
    shutil.rmtree(image_sets / "open-images-411_480d72ee0f97da49")
    with pytest.raises(MissingBenchmarkData, match=r"2 of 48 image sets are missing under .*image-sets \(e\.g\. "
                                                   r"open-images-411_480d72ee0f97da49, YouCook-video0037"):
        ImageCoDe(root).items()
    _write_sets(image_sets, ["YouCook-video0037-shot3_0", "open-images-411_480d72ee0f97da49"])
    victim = image_sets / "MSR-VTT-videoTestVideo_video7047-shot1_0"
    extra = victim / "frame.jpg"
    extra.write_bytes(b"")
    with pytest.raises(ValueError, match=r"video7047-shot1_0: image names must be img<number>\.jpg, found frame\.jpg"):
        ImageCoDe(root).items()
    extra.unlink()
    sorted(victim.glob("*.jpg"))[0].unlink()
    with pytest.raises(ValueError, match=r"video7047-shot1_0: an image set holds 10 images, found 9"):
        ImageCoDe(root).items()


@pytest.mark.parametrize("content, message", [
    ({"open-images-1_a": {"10": "a dog"}}, r"set 'open-images-1_a': gold index must be 0\.\.9, found '10'"),
    ({"open-images-1_a": {"03": "a dog"}}, r"set 'open-images-1_a': gold index must be 0\.\.9, found '03'"),
    ({"open-images-1_a": {"3": "  "}}, r"set 'open-images-1_a', index 3: the description is empty"),
    ({"open-images-1_a": {}}, r"set 'open-images-1_a': expected \{gold index: description\}"),
    ([["open-images-1_a", {"3": "a dog"}]], r"expected a JSON object of image sets, found list"),
])
def test_malformed_annotations_name_the_file_and_set(tmp_path, content, message):
    (tmp_path / "data").mkdir()
    (tmp_path / VALID_FILE).write_text(json.dumps(content))
    with pytest.raises(ValueError, match=r"valid_data\.json: " + message):
        ImageCoDe(tmp_path).items()


def test_truncated_and_non_utf8_files_name_the_file(tmp_path):
    (tmp_path / "data").mkdir()
    original = (FIXTURE / VALID_FILE).read_bytes()
    for broken in (original[: len(original) // 2], original.replace(b"deer", "d\u00e9er".encode("latin-1"), 1)):
        (tmp_path / VALID_FILE).write_bytes(broken)
        with pytest.raises(ValueError, match=r"valid_data\.json: not a (UTF-8 text|whole JSON) file"):
            ImageCoDe(tmp_path).items()


def test_download_is_pinned_and_published_numbers_are_vl_compos():
    (download,) = ImageCoDe.data_source.downloads
    assert download.target == VALID_FILE and download.size == 321098
    assert download.url == ("https://raw.githubusercontent.com/McGill-NLP/imagecode/"
                            "609f07611aed2599f946c30d730f40a41af1079b/data/valid_data.json")
    assert "zenodo.org/record/6518944/files/image-sets.zip" in ImageCoDe.data_source.by_hand
    assert {key: number.value for key, number in ImageCoDe.published.items()} == \
        {"accuracy": 21.72024327, "video": 15.064102564102564, "static": 50.697674418604656}
    assert {number.source for number in ImageCoDe.published.values()} == {"vl_compo"}


# ---------------------------------------------------------------- the rule


def test_first_argmax_rule_on_hand_made_scores_with_exact_ties():
    scores = np.array([0.1, 0.5, 0.2, 0.5, 0.0, 0.1, 0.3, 0.2, 0.4, 0.5])
    # gold first among the tied maxima: right under argmax, not strictly, and a tie
    assert first_argmax_scores(scores, 1) == {"predicted": 1, "correct": True, "strict": False, "tie": True}
    # gold tied at the top but not first: wrong
    assert first_argmax_scores(scores, 3) == {"predicted": 1, "correct": False, "strict": False, "tie": True}
    # gold below a tied top: wrong, and no tie of gold's
    assert first_argmax_scores(scores, 6) == {"predicted": 1, "correct": False, "strict": False, "tie": False}
    # gold tied with another image below the top: not a tie that decides anything
    assert first_argmax_scores(scores, 0)["tie"] is False
    unique = np.array([0.1, 0.2, 0.9, 0.3, 0.0, 0.1, 0.3, 0.2, 0.4, 0.5])
    assert first_argmax_scores(unique, 2) == {"predicted": 2, "correct": True, "strict": True, "tie": False}


def official_evaluate_clip(descriptions: dict, img_dirs: Path, similarity) -> tuple[dict, dict]:
    """`baselines/clip/evaluate_clip.py` (McGill-NLP/imagecode 609f076), step by step: every (set, gold, text) in
    file order; the set's `*.jpg` sorted by the number after "img"; logits over the 10 images; `torch.argmax`;
    counters overall and by `'open-images' in img_dir`.

    Returns ({"<set>/<gold>": correct}, {"overall", "video", "static"} as the printed fractions).
    """
    valid = [(img_dir, img_idx, text) for img_dir, data in descriptions.items() for img_idx, text in data.items()]
    correct = vid_correct = vid_total = img_correct = img_total = 0
    per_item = {}
    for img_dir, img_idx, text in valid:
        img_idx = int(img_idx)
        img_files = list((Path(img_dirs) / img_dir).glob("*.jpg"))
        img_files = sorted(img_files, key=lambda x: int(str(x).split('/')[-1].split('.')[0][3:]))
        logits = torch.tensor([similarity(str(path), text.strip()) for path in img_files])
        pred = torch.argmax(logits).squeeze()
        per_item[f"{img_dir}/{img_idx}"] = bool(img_idx == pred)
        correct += int(img_idx == pred)
        if "open-images" in img_dir:
            img_total += 1
            img_correct += int(img_idx == pred)
        else:
            vid_total += 1
            vid_correct += int(img_idx == pred)
    return per_item, {"overall": correct / len(valid), "video": vid_correct / vid_total,
                      "static": img_correct / img_total}


@pytest.mark.parametrize("source", ["fixture", "standin"])
def test_official_rule_equals_ours_on_every_item(tmp_path, source):
    root = _fixture_copy(tmp_path) if source == "fixture" else tmp_path
    options = write_imagecode(tmp_path, n_items=400, seed=2) if source == "standin" else {}
    benchmark = ImageCoDe(root, **options)
    outcomes = benchmark.outcomes(hash_scorer())
    descriptions = json.loads((root / VALID_FILE).read_text())
    per_item, official = official_evaluate_clip(descriptions, benchmark.images, hashed)
    assert [o["id"] for o in outcomes] == list(per_item)
    assert {o["id"]: o["correct"] for o in outcomes} == per_item
    result = ImageCoDe.aggregate(outcomes)
    assert result["accuracy"] == pytest.approx(100 * official["overall"])
    assert result["video"] == pytest.approx(100 * official["video"])
    assert result["static"] == pytest.approx(100 * official["static"])
    # ties at the top decide outcomes both ways here; the test must see both
    assert any(o["tie"] and o["correct"] for o in outcomes) and any(o["tie"] and not o["correct"] for o in outcomes)
    assert all(o["correct"] == (o["strict"] or (o["tie"] and o["predicted"] == o["gold"])) for o in outcomes)


def test_aggregates_by_hand_pool_the_descriptions():
    def outcome(kind, correct, strict=None, tie=False):
        return {"kind": kind, "correct": correct, "strict": correct if strict is None else strict, "tie": tie}

    outcomes = [outcome("video", True), outcome("video", False), outcome("video", False, tie=True),
                outcome("static", True, strict=False, tie=True)]
    result = ImageCoDe.aggregate(outcomes)
    assert (result["accuracy"], result["static"]) == (50.0, 100.0) and result["video"] == pytest.approx(100 / 3)
    assert (result["accuracy_strict"], result["ties"], result["n"]) == (25.0, 2.0, 4.0)
    assert (result["n_video"], result["n_static"]) == (3.0, 1.0)
    assert math.isnan(ImageCoDe.aggregate(outcomes[:3])["static"])


def test_vl_compos_numbers_are_282_of_1872_video_and_218_of_430_static_pooled():
    outcomes = ([{"kind": "video", "correct": k < 282, "strict": k < 282, "tie": False} for k in range(1872)]
                + [{"kind": "static", "correct": k < 218, "strict": k < 218, "tie": False} for k in range(430)])
    result = ImageCoDe.aggregate(outcomes)
    for key, number in ImageCoDe.published.items():
        assert result[key] == pytest.approx(number.value, abs=1e-8), key  # pooled, not the mean of the two


def test_aggregates_recompute_from_json_round_tripped_outcomes(tmp_path):
    benchmark = ImageCoDe(tmp_path, **write_imagecode(tmp_path, n_items=50, seed=3))
    stored = benchmark.outcomes(hash_scorer())
    again = ImageCoDe.aggregate([json.loads(json.dumps(o)) for o in stored])
    original = ImageCoDe.aggregate(stored)
    assert again.keys() == original.keys() and all(same(again[k], original[k]) for k in again)


def test_tiny_clip_outcomes_follow_its_own_similarities(tmp_path):
    benchmark = ImageCoDe(tmp_path, **write_imagecode(tmp_path, n_items=12, seed=4))
    torch.manual_seed(0)
    scorer = ClipScorer.from_pretrained("ViT-Tiny-16-64", None, batch_size=64)
    outcomes = benchmark.outcomes(scorer)
    assert len(outcomes) == 12
    for item, outcome in zip(benchmark.items(), outcomes):
        scores = torch.as_tensor(scorer.score(item.images, item.texts)[:, 0])
        assert outcome["predicted"] == int(torch.argmax(scores)), item.id
        assert outcome["correct"] == (outcome["predicted"] == item.meta["gold"])
