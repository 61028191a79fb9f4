"""Grounders (GroundingDINO offline with random weights, gt annotations, none) and boxes -> patch masks."""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image
from tolerance import scaled_close

from parsers.grounding import (
    GROUNDERS,
    GrounderInputError,
    MIN_IMAGE_SIZE,
    GroundingRequest,
    boxes_to_patch_mask,
    build_grounder,
    groundingdino_image_tensor,
    joint_prompts,
    mention_boxes,
    phrase_prompt,
    random_rectangle_mask,
    rectangle_shapes,
    select_boxes,
    span_token_masks,
)
from parsers.images import IMAGE_DECODING

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # any accidental hub call fails fast
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

IMAGE_SIZE = 256  # smallest input with comfortable margin over GroundingDINO's 900 proposals
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "?", "a", "the", "red", "car", "dog", "on", "grass",
         "small", "cat", "man", "riding", "horse"]


# ----- GroundingDINO, offline -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A tiny random BERT with a WordPiece vocabulary, saved like a hub checkpoint (no download)."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    directory = tmp_path_factory.mktemp("bert")
    (directory / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    BertTokenizerFast(vocab_file=str(directory / "vocab.txt")).save_pretrained(directory)
    config = BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        BertModel(config).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def image_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    paths = {"wide": directory / "wide.png", "tall": directory / "tall.jpg", "missing": directory / "missing.jpg",
             "corrupt": directory / "corrupt.jpg", "truncated": directory / "truncated.jpg"}
    Image.fromarray(rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)).save(paths["wide"])
    Image.fromarray(rng.integers(0, 256, (300, 200, 3), dtype=np.uint8)).save(paths["tall"])
    paths["corrupt"].write_bytes(b"this is not an image")
    encoded = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(encoded, format="JPEG")
    paths["truncated"].write_bytes(encoded.getvalue()[: len(encoded.getvalue()) // 2])
    return {name: str(path) for name, path in paths.items()}


def groundingdino(bert_dir, checkpoint=None, **options):
    """Without a checkpoint: seeded random weights, which the grounder accepts only when told it is a test."""
    return build_grounder("groundingdino", checkpoint=checkpoint, text_encoder=bert_dir, image_size=IMAGE_SIZE,
                          allow_random_weights=checkpoint is None, **options)


@pytest.fixture(scope="module")
def grounder(bert_dir):
    return groundingdino(bert_dir, batch_size=2)


@pytest.fixture(scope="module")
def requests_(image_files):
    return [
        GroundingRequest(image_files["wide"], ["red car", "a dog on the grass", "small cat"], image_id=1),
        GroundingRequest(image_files["missing"], ["red car", "dog"], image_id=2),
        GroundingRequest(image_files["tall"], ["man riding a horse", "dog"], image_id=3),
        GroundingRequest(image_files["corrupt"], ["cat"], image_id=4),
        GroundingRequest(image_files["truncated"], ["horse"], image_id=5),
    ]


@pytest.fixture(scope="module")
def grounded(grounder, requests_):
    return grounder.ground(requests_)


READABLE = {0: (320, 240), 2: (200, 300)}  # request index -> original (width, height)


def test_output_structure(grounded, requests_):
    assert len(grounded) == len(requests_)
    for request, per_phrase in zip(requests_, grounded):
        assert len(per_phrase) == len(request.phrases)
        for boxes in per_phrase:
            assert isinstance(boxes, list)
            assert all(len(box) == 5 and all(isinstance(v, float) for v in box) for box in boxes)


def test_boxes_in_original_pixels_with_scores_above_threshold(grounded, grounder):
    for index, (width, height) in READABLE.items():
        assert any(grounded[index]), "seeded random weights give boxes at the default thresholds"
        for x0, y0, x1, y1, score in (box for boxes in grounded[index] for box in boxes):
            assert 0 <= x0 <= x1 <= width and 0 <= y0 <= y1 <= height
            assert grounder.box_threshold < score <= 1.0


def test_unreadable_images_give_empty_lists_and_are_recorded(grounded, grounder, requests_, image_files):
    for index in (1, 3, 4):
        assert grounded[index] == [[] for _ in requests_[index].phrases]
    assert grounder.unreadable_images == [image_files["missing"], image_files["corrupt"], image_files["truncated"]]


def test_matches_groundingdino_predict(bert_dir, image_files):
    """One pair per forward (no padding) must reproduce the package's own predict(), in original pixels."""
    from groundingdino.util.inference import predict

    permissive = groundingdino(bert_dir, box_threshold=0.0, text_threshold=0.0, batch_size=1)
    ours = permissive.ground([GroundingRequest(image_files["wide"], ["Red car"])])[0][0]
    with Image.open(image_files["wide"]) as image:
        tensor = groundingdino_image_tensor(image.convert("RGB"), IMAGE_SIZE, permissive.max_size)
    boxes, scores, _ = predict(permissive.model, tensor, "red car", box_threshold=0.0, text_threshold=0.0,
                               device="cpu")
    cx, cy, w, h = boxes.double().unbind(-1)
    expected = torch.stack([(cx - w / 2) * 320, (cy - h / 2) * 240, (cx + w / 2) * 320, (cy + h / 2) * 240],
                           dim=-1).clamp_min(0)
    expected = torch.minimum(expected, torch.tensor([320.0, 240.0, 320.0, 240.0], dtype=torch.float64))
    assert len(ours) == len(boxes) > 0
    # float32 fractions of the 320 x 240 image: coordinates (0 among them) round relative to the image size
    assert scaled_close(torch.tensor(ours, dtype=torch.float64)[:, :4], expected, 1e-5)
    assert scaled_close(torch.tensor(ours, dtype=torch.float64)[:, 4], scores.double(), 1e-5)


def test_box_threshold_above_one_gives_nothing(bert_dir, image_files):
    strict = groundingdino(bert_dir, box_threshold=1.01, batch_size=1)
    assert strict.ground([GroundingRequest(image_files["tall"], ["dog"])]) == [[[]]]
    assert strict.unreadable_images == []


def test_settings_json_and_sensitive_to_thresholds(grounder, bert_dir):
    settings = grounder.settings()
    assert json.loads(json.dumps(settings)) == settings
    assert settings["checkpoint"] is None and settings["random_init_seed"] == 0
    assert settings["config"] == "GroundingDINO_SwinT_OGC.py" and len(settings["config_sha256"]) == 64
    assert settings["image_decoding"] == IMAGE_DECODING  # boxes found on differently decoded pixels are not reused
    assert {"vocab.txt", "config.json", "model.safetensors"} <= set(settings["text_encoder_sha256"])
    assert groundingdino(bert_dir, box_threshold=0.3, batch_size=2).settings() == dict(settings, box_threshold=0.3)
    assert groundingdino(bert_dir, text_threshold=0.2, batch_size=2).settings() == dict(settings, text_threshold=0.2)


# ----- checkpoints --------------------------------------------------------------------------------------
def constant_state(model_state: dict, value: float = 0.125) -> dict:
    """Every key of a GroundingDINO state dict at its shape and dtype, each one broadcast constant (saved as a
    single element: a few kB instead of the 250 MB of the real tensors)."""
    return {key: torch.tensor(value).to(tensor.dtype).expand(tensor.shape) for key, tensor in model_state.items()}


def save_checkpoint(path, state: dict, ddp: bool = True) -> str:
    """As GroundingDINO's training saves it: under "model", keys prefixed with "module." by DDP."""
    torch.save({"model": {("module." if ddp else "") + key: value for key, value in state.items()}}, path)
    return str(path)


@pytest.fixture(scope="module")
def model_state(grounder):
    """The keys, shapes and dtypes a checkpoint must have: those of the model the grounder builds."""
    return grounder.model.state_dict()


def test_complete_checkpoint_from_ddp_loads_every_weight_and_is_hashed(bert_dir, tmp_path, model_state):
    state = constant_state(model_state)
    state["feat_map.weight"] = torch.full(model_state["feat_map.weight"].shape, 0.5)  # BERT 32 -> 256 wide
    # What the released checkpoints carry beyond the inference model, and the official loader ignores.
    state["label_enc.weight"] = torch.zeros(2001, 256)
    state["bert.embeddings.position_ids"] = torch.arange(512).view(1, -1)
    path = save_checkpoint(tmp_path / "groundingdino.pth", state)
    loaded = groundingdino(bert_dir, checkpoint=path)
    loaded.prepare()
    assert all(torch.equal(value, state[key]) for key, value in loaded.model.state_dict().items())
    settings = loaded.settings()
    assert settings["checkpoint"] == "groundingdino.pth" and settings["random_init_seed"] is None
    assert settings["checkpoint_sha256"] == hashlib.sha256((tmp_path / "groundingdino.pth").read_bytes()).hexdigest()


def without(state: dict, prefix: str) -> dict:
    return {key: value for key, value in state.items() if not key.startswith(prefix)}


@pytest.mark.parametrize("change, expected", [
    (lambda s: without(s, "backbone."), r"\d+ missing keys \(e.g. backbone\.0\."),  # a checkpoint without Swin
    (lambda s: {**s, "head.extra.weight": torch.ones(3)}, r"1 unexpected keys \(e.g. head\.extra\.weight\)"),
    (lambda s: {**s, "feat_map.weight": torch.ones(256, 768)}, r"1 keys of another shape \(e.g. feat_map\.weight"),
    (lambda s: {"image_encoder.weight": torch.ones(3)}, r"762 missing keys .*1 unexpected keys"),  # another model
])
def test_checkpoint_that_does_not_fit_is_refused_naming_the_file(bert_dir, tmp_path, model_state, change, expected):
    path = save_checkpoint(tmp_path / "wrong.pth", change(constant_state(model_state)), ddp=False)
    grounder = groundingdino(bert_dir, checkpoint=path)
    with pytest.raises(GrounderInputError, match=expected) as refused:
        grounder.prepare()
    assert path in str(refused.value) and "GroundingDINO_SwinT_OGC.py" in str(refused.value)


def test_file_that_is_no_checkpoint_is_refused_naming_it(bert_dir, tmp_path):
    path = tmp_path / "notes.pth"
    path.write_bytes(b"these are not weights")
    with pytest.raises(GrounderInputError, match=f"{path} cannot be read as a torch checkpoint"):
        groundingdino(bert_dir, checkpoint=str(path)).prepare()


def test_preprocessing_refuses_a_partial_checkpoint_before_any_work(bert_dir, tmp_path, model_state):
    """The CLI: exit status 1, one message naming the file and what is missing, no traceback, no cache."""
    from core.config import REPO_ROOT
    from datamodules.shapes import generate

    generate(tmp_path / "shapes", n_train=2, n_val=0, image_size=64, seed=0)
    checkpoint = save_checkpoint(tmp_path / "partial.pth", without(constant_state(model_state), "transformer."))
    overrides = [f"data.root={tmp_path / 'shapes'}", "data.train_annotations=annotations/captions_train.json",
                 "data.train_images=images/train", "data.val_annotations=", f"preprocess.cache_root={tmp_path / 'c'}",
                 "preprocess.grounder=groundingdino", f"preprocess.groundingdino_checkpoint={checkpoint}",
                 f"preprocess.text_encoder={bert_dir}", f"preprocess.grounding_image_size={IMAGE_SIZE}",
                 "preprocess.device=cpu"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    # The bound only guards against a hang; the refusal comes once the model is built (seconds).
    cli = subprocess.run([sys.executable, "-m", "datamodules.preprocess", *overrides], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert cli.returncode == 1, cli.stderr
    assert "Traceback" not in cli.stderr
    assert re.search(rf"error: preprocessing cannot start:\n  - GroundingDINO checkpoint {re.escape(checkpoint)} "
                     rf"does not fit .*: \d+ missing keys \(e\.g\. transformer\.", cli.stderr), cli.stderr
    assert not (tmp_path / "c").exists()


def test_too_small_image_size_is_rejected(bert_dir):
    with pytest.raises(ValueError, match="image_size"):
        build_grounder("groundingdino", checkpoint=None, text_encoder=bert_dir, image_size=MIN_IMAGE_SIZE - 1)


# ----- select_boxes on hand-made tensors --------------------------------------------------------------
def test_select_boxes_thresholds_and_conversion():
    # 3 queries, 4 text positions: [CLS] phrase phrase [SEP]
    probs = torch.tensor([[0.9, 0.1, 0.2, 0.0],    # best token is [CLS]; phrase tokens below text threshold
                          [0.1, 0.5, 0.3, 0.0],    # kept: 0.5 > 0.35 and phrase token 0.5 > 0.25
                          [0.1, 0.3, 0.2, 0.0]])   # dropped: best 0.3 <= 0.35
    boxes = torch.tensor([[0.5, 0.5, 1.0, 1.0], [0.25, 0.5, 0.5, 0.2], [0.5, 0.5, 0.1, 0.1]])
    phrase_tokens = torch.tensor([False, True, True, False])
    kept = select_boxes(probs, boxes, phrase_tokens, 0.35, 0.25, width=200, height=100)
    assert kept == [pytest.approx((0.0, 40.0, 100.0, 60.0, 0.5))]
    # text_threshold 0.15: query 0's phrase token 0.2 now passes, its score is its best token (predict's max)
    kept = select_boxes(probs, boxes, phrase_tokens, 0.35, 0.15, width=200, height=100)
    assert [box[4] for box in kept] == pytest.approx([0.9, 0.5])


def test_select_boxes_clips_to_image():
    probs = torch.tensor([[0.0, 0.9, 0.0]])
    boxes = torch.tensor([[0.95, 0.05, 0.2, 0.2]])  # sticks out of the top-right corner
    (box,) = select_boxes(probs, boxes, torch.tensor([False, True, False]), 0.35, 0.25, width=100, height=50)
    assert box == pytest.approx((85.0, 0.0, 100.0, 7.5, 0.9))


# ----- annotations and registry -----------------------------------------------------------------------
GT_PHRASES = [{"text": "car", "boxes": [[0, 0, 5, 5]]},
              {"text": "red car", "boxes": [[1, 2, 3, 4], [5, 6, 7, 8]]},
              {"text": "a big dog on the grass", "boxes": [[10, 10, 20, 20]]}]


def test_annotations_best_word_coverage(image_files):
    grounder = build_grounder("annotations")
    request = GroundingRequest(image_files["wide"], ["The red car", "dog", "blue sky", "red dog"],
                               gt_phrases=GT_PHRASES)
    red_car, dog, sky, red_dog = grounder.ground([request])[0]
    assert red_car == [(1.0, 2.0, 3.0, 4.0, 1.0), (5.0, 6.0, 7.0, 8.0, 1.0)]  # covers 2/3 vs 1/3 for "car"
    assert dog == [(10.0, 10.0, 20.0, 20.0, 1.0)]  # a terse phrase fully inside a written one
    assert sky == []
    assert red_dog == []  # half its words in "red car", half in the dog phrase: below 0.6 either way
    strict = build_grounder("annotations", min_overlap=0.9)
    assert strict.ground([request])[0][0] == []
    assert grounder.ground([GroundingRequest(image_files["wide"], ["red car"])]) == [[[]]]  # no gt phrases


# "a large red square placed left of a small blue circle": two object phrases and the relation phrase.
CAPTION_GT = [{"text": "large red square", "char_span": [2, 18], "boxes": [[0, 0, 10, 10]]},
              {"text": "small blue circle", "char_span": [36, 53], "boxes": [[30, 0, 40, 10]]},
              {"text": "large red square placed left of a small blue circle", "char_span": [2, 53],
               "boxes": [[0, 0, 10, 10], [30, 0, 40, 10]]}]
SQUARE, CIRCLE = (12, 18), (47, 53)   # head nouns


def test_mention_boxes_take_each_objects_own_phrase():
    assert mention_boxes([SQUARE], CAPTION_GT) == [(0.0, 0.0, 10.0, 10.0, 1.0)]   # not the relation phrase's two
    assert mention_boxes([SQUARE, CIRCLE], CAPTION_GT) == [(0.0, 0.0, 10.0, 10.0, 1.0), (30.0, 0.0, 40.0, 10.0, 1.0)]
    assert mention_boxes([CIRCLE, SQUARE], CAPTION_GT)[0] == (30.0, 0.0, 40.0, 10.0, 1.0)   # in the phrase's order
    assert mention_boxes([(19, 25)], CAPTION_GT) == [(0.0, 0.0, 10.0, 10.0, 1.0), (30.0, 0.0, 40.0, 10.0, 1.0)]
    assert mention_boxes([SQUARE, (60, 65)], CAPTION_GT) == []   # an object no gt phrase knows: no boxes at all


def test_annotations_match_by_position_where_the_request_names_the_objects(image_files):
    grounder = build_grounder("annotations")
    request = GroundingRequest(image_files["wide"], ["red square placed", "square placed left of circle"],
                               gt_phrases=CAPTION_GT, phrase_mentions=[[SQUARE], [SQUARE, CIRCLE]])
    attribute, relation = grounder.ground([request])[0]
    assert attribute == [(0.0, 0.0, 10.0, 10.0, 1.0)]
    assert relation == [(0.0, 0.0, 10.0, 10.0, 1.0), (30.0, 0.0, 40.0, 10.0, 1.0)]
    by_words = GroundingRequest(image_files["wide"], ["red square placed"], gt_phrases=CAPTION_GT)
    assert len(grounder.ground([by_words])[0][0]) == 2   # words alone pick the relation phrase: why positions


def test_annotations_coco_instances_by_category_name(tmp_path, image_files):
    instances = {
        "categories": [{"id": 1, "name": "dog"}, {"id": 10, "name": "traffic light"}, {"id": 3, "name": "car"}],
        "annotations": [{"image_id": 5, "category_id": 1, "bbox": [10, 20, 30, 40]},
                        {"image_id": 5, "category_id": 10, "bbox": [0, 0, 4, 8]},
                        {"image_id": 5, "category_id": 1, "bbox": [50, 50, 1, 1]},
                        {"image_id": 6, "category_id": 3, "bbox": [1, 1, 1, 1]}],
    }
    path = tmp_path / "instances.json"
    path.write_text(json.dumps(instances))
    grounder = build_grounder("annotations", instances_json=str(path))
    phrases = ["two dogs near a traffic light", "a light", "car", "hotdog"]
    dogs_light, light, car, hotdog = grounder.ground([GroundingRequest(image_files["wide"], phrases, image_id=5)])[0]
    assert dogs_light == [(10.0, 20.0, 40.0, 60.0, 1.0), (0.0, 0.0, 4.0, 8.0, 1.0), (50.0, 50.0, 51.0, 51.0, 1.0)]
    assert light == [] and car == [] and hotdog == []  # whole words only; the car is in another image
    request = GroundingRequest(image_files["tall"], ["red car"], image_id=6, gt_phrases=GT_PHRASES)
    both = grounder.ground([request])[0][0]
    assert both == [(1.0, 2.0, 3.0, 4.0, 1.0), (5.0, 6.0, 7.0, 8.0, 1.0), (1.0, 1.0, 2.0, 2.0, 1.0)]
    assert grounder.settings()["instances_sha256"] != build_grounder("annotations").settings()["instances_sha256"]


def test_registry_unknown_name_lists_valid_ones():
    assert set(GROUNDERS) == {"groundingdino", "annotations", "none"}
    with pytest.raises(ValueError) as error:
        build_grounder("grounding-dino")
    assert all(name in str(error.value) for name in GROUNDERS)


def test_none_grounder(image_files):
    grounder = build_grounder("none")
    requests = [GroundingRequest(image_files["wide"], ["x", "y"]), GroundingRequest(image_files["tall"], [])]
    assert grounder.ground(requests) == [[[], []], []]
    assert grounder.settings() == {"name": "none"} and grounder.unreadable_images == []


@pytest.mark.parametrize("name", ["annotations", "none"])
def test_grounders_without_pixels_still_record_unreadable_images(name, image_files):
    """The unreadable count must not depend on the grounder: broken files would fail later, in training."""
    grounder = build_grounder(name)
    requests = [GroundingRequest(image_files["wide"], ["red car"], gt_phrases=GT_PHRASES),
                GroundingRequest(image_files["truncated"], ["red car"], gt_phrases=GT_PHRASES),
                GroundingRequest(image_files["missing"], [])]
    grounded = grounder.ground(requests)
    assert grounded[1:] == [[[]], []]
    assert grounder.unreadable_images == [image_files["truncated"], image_files["missing"]]
    assert (grounded[0] != [[]]) == (name == "annotations")


def test_a_16_bit_png_is_grounded_as_its_8_bit_version(tmp_path, grounder):
    gray = np.random.default_rng(0).integers(0, 256, (30, 40), dtype=np.uint8)
    Image.fromarray(gray).save(tmp_path / "eight.png")
    Image.fromarray(gray.astype(np.uint16) * 257).save(tmp_path / "sixteen.png")
    eight, sixteen = (grounder._read(GroundingRequest(str(tmp_path / name), ["x"])) for name in ("eight.png",
                                                                                                 "sixteen.png"))
    assert np.array_equal(np.asarray(sixteen), np.asarray(eight))  # PIL's own conversion gives white


@pytest.mark.parametrize("name", ["annotations", "none"])
def test_images_whose_boxes_would_be_meaningless_are_not_grounded(name, tmp_path, image_files, caplog):
    """A sliver (the detector cannot see it whole, the crop would miss its boxes) and a file of another size than
    the annotations record (their boxes are in another frame) are logged and counted with the unreadable ones."""
    Image.new("RGB", (10000, 10)).save(tmp_path / "sliver.png")
    grounder = build_grounder(name)
    requests = [GroundingRequest(image_files["wide"], ["red car"], gt_phrases=GT_PHRASES,
                                 annotated_size=(320, 240)),
                GroundingRequest(str(tmp_path / "sliver.png"), ["red car"], gt_phrases=GT_PHRASES),
                GroundingRequest(image_files["tall"], ["red car"], gt_phrases=GT_PHRASES,
                                 annotated_size=(300, 200))]
    grounded = grounder.ground(requests)
    assert grounded[1:] == [[[]], [[]]] and (grounded[0] != [[]]) == (name == "annotations")
    assert grounder.unreadable_images == [str(tmp_path / "sliver.png"), image_files["tall"]]
    assert "aspect ratio" in caplog.text and "the file is 200x300 but the annotations record 300x200" in caplog.text


# ----- boxes -> patch masks ---------------------------------------------------------------------------
FULL = (0, 0, 224, 224)  # identity crop for a 224 x 224 image; 7 x 7 grid of 32-pixel patches


def masked(boxes, crop=FULL, min_overlap=0.0, output_size=224, grid=7):
    mask = boxes_to_patch_mask(boxes, crop, output_size, grid, min_overlap)
    assert mask.shape == (grid * grid,) and mask.dtype == bool
    return set(np.flatnonzero(mask).tolist())


def test_box_covering_exactly_one_patch():
    assert masked([(0, 0, 32, 32)]) == {0}
    assert masked([(32, 32, 64, 64, 0.9)]) == {8}  # a 5-tuple: the score is ignored


def test_edge_on_patch_border_does_not_mask_the_neighbour():
    assert masked([(10, 10, 64, 40)]) == {0, 1, 7, 8}  # x ends on the col 1/2 border, y inside row 1
    assert masked([(64, 0, 64.5, 1)]) == {2}
    # (32.2 - 2.2) * 224 / 70 = 96.00000000000001: float noise past the border must not mask column 3
    assert masked([(2.2, 0, 32.2, 10)], crop=(0, 2.2, 70, 70)) == {0, 1, 2}


def test_boxes_partly_or_entirely_outside_the_crop():
    assert masked([(200, 200, 280, 280)]) == {48}  # clipped to the crop
    assert masked([(-50, -50, 10, 10)]) == {0}
    assert masked([(250, 250, 300, 300)]) == set()
    assert masked([(0, 0, 90, 90)], crop=(0, 100, 112, 112)) == set()  # left of the crop


def test_empty_and_degenerate_boxes():
    assert masked([]) == set()
    assert masked(np.zeros((0, 4), np.float32)) == set()
    assert masked([(40, 40, 40, 90)]) == set()  # zero width


def test_scaled_crops():
    assert masked([(16, 16, 32, 32)], crop=(0, 0, 112, 112)) == {8}  # half the image: coordinates doubled
    assert masked([(116, 66, 132, 82)], crop=(50, 100, 112, 112)) == {8}  # shifted crop
    assert masked([(32, 16, 64, 32)], crop=(0, 0, 112, 224)) == {8}  # only y doubled
    assert masked(np.array([[16, 16, 32, 32]], np.float32), crop=(0, 0, 112, 112)) == {8}


def test_min_overlap_is_per_box_fraction_of_patch_area():
    box = [(0, 0, 48, 48)]  # covers patch 0 fully, patches 1 and 7 by half, patch 8 by a quarter
    assert masked(box) == {0, 1, 7, 8}
    assert masked(box, min_overlap=0.25) == {0, 1, 7, 8}
    assert masked(box, min_overlap=0.5) == {0, 1, 7}
    assert masked(box, min_overlap=0.6) == {0}
    halves = [(0, 0, 16, 32), (16, 0, 32, 32)]  # together they cover patch 0, each only half of it
    assert masked(halves, min_overlap=0.6) == set()


def reference_patch_mask(boxes, crop, output_size, grid, min_overlap):
    """One patch and one box at a time, in plain Python."""
    top, left, height, width = crop
    patch = output_size / grid
    mask = []
    for row in range(grid):
        for col in range(grid):
            hit = False
            for x0, y0, x1, y1 in boxes:
                bx0, bx1 = [min(max((x - left) * output_size / width, 0), output_size) for x in (x0, x1)]
                by0, by1 = [min(max((y - top) * output_size / height, 0), output_size) for y in (y0, y1)]
                ox = max(0.0, min(bx1, (col + 1) * patch) - max(bx0, col * patch))
                oy = max(0.0, min(by1, (row + 1) * patch) - max(by0, row * patch))
                hit |= ox * oy >= min_overlap * patch * patch if min_overlap > 0 else ox * oy > 0
            mask.append(hit)
    return np.array(mask)


def test_patch_mask_matches_reference_on_random_cases():
    rng = np.random.default_rng(0)
    for _ in range(200):
        image_w, image_h = rng.uniform(50, 600, size=2)
        height, width = rng.uniform(0.3, 1.0) * image_h, rng.uniform(0.3, 1.0) * image_w
        crop = (rng.uniform(0, image_h - height), rng.uniform(0, image_w - width), height, width)
        corners = rng.uniform(-0.2, 1.2, size=(int(rng.integers(0, 4)), 2, 2)) * [image_w, image_h]
        boxes = [(*c.min(axis=0), *c.max(axis=0)) for c in corners]
        grid, min_overlap = int(rng.choice([7, 14])), float(rng.choice([0.0, 0.3, 0.7]))
        expected = reference_patch_mask(boxes, crop, 224, grid, min_overlap)
        assert np.array_equal(boxes_to_patch_mask(boxes, crop, 224, grid, min_overlap), expected)


# ----- random rectangles ------------------------------------------------------------------------------
def rectangle_of(mask, grid):
    rows, cols = np.nonzero(mask.reshape(grid, grid))
    return rows.min(), rows.max(), cols.min(), cols.max()


def reference_shapes(grid, ratio=0.75, tolerance=0.25):
    """The original's acceptance test, written out: h, w in 1..grid, |h w - round(ratio grid^2)| <= max(1, tol r)."""
    target = round(ratio * grid * grid)
    return {(h, w) for h in range(1, grid + 1) for w in range(1, grid + 1)
            if abs(h * w - target) <= max(1, tolerance * target)}


@pytest.mark.parametrize("grid", [4, 7, 14, 16])
def test_random_rectangle_is_one_accepted_rectangle(grid):
    rng = np.random.default_rng(1)
    shapes = reference_shapes(grid)
    assert set(rectangle_shapes(grid)) == shapes
    seen = set()
    for _ in range(300):
        mask = random_rectangle_mask(rng, grid)
        assert mask.shape == (grid * grid,) and mask.dtype == bool
        top, bottom, left, right = rectangle_of(mask, grid)
        assert mask.reshape(grid, grid)[top:bottom + 1, left:right + 1].all()  # one filled rectangle
        assert mask.sum() == (bottom - top + 1) * (right - left + 1)
        seen.add((bottom - top + 1, right - left + 1))
    assert seen <= shapes and len(seen) >= min(len(shapes), 3)  # random shapes, only accepted ones
    assert not (grid > 1 and (grid, grid) in shapes)  # at ratio 0.75 the whole grid is never masked


def test_random_rectangle_shapes_on_seven_by_seven_and_other_ratios():
    # r = round(36.75) = 37, tolerance 9.25: areas 28, 30, 35, 36, 42 (docs/methods.md#what-is-masked)
    assert sorted(h * w for h, w in rectangle_shapes(7)) == [28, 28, 30, 30, 35, 35, 36, 42, 42]
    assert set(rectangle_shapes(4, ratio=0.5)) == reference_shapes(4, ratio=0.5) == {
        (2, 3), (3, 2), (2, 4), (4, 2), (3, 3)}  # r = 8, tolerance max(1, 2) = 2: areas 6..10
    assert rectangle_shapes(7, ratio=1.0) == ((6, 7), (7, 6), (7, 7))  # r = 49, tolerance 12.25
    assert rectangle_shapes(1) == ((1, 1),)
    with pytest.raises(ValueError, match="ratio"):
        rectangle_shapes(7, ratio=0.0)
    with pytest.raises(ValueError, match="no rectangle"):
        rectangle_shapes(7, ratio=47 / 49, tolerance=0.0)  # r = 47: 46 and 48 have no factors <= 7 either


def test_random_rectangle_positions_are_uniform_and_seeded():
    rng = np.random.default_rng(2)
    tops = Counter()
    for _ in range(2000):
        mask = random_rectangle_mask(rng, 4, ratio=0.5, tolerance=0.0)  # r = 8, tolerance 1: areas 7..9
        top, bottom, left, right = rectangle_of(mask, 4)
        if (bottom - top + 1, right - left + 1) == (2, 4):
            tops[top] += 1
    assert set(tops) == {0, 1, 2} and min(tops.values()) > 0.2 * sum(tops.values())  # 3 positions, ~1/3 each
    first = [random_rectangle_mask(np.random.default_rng(3), 14) for _ in range(2)]
    assert np.array_equal(*first)
    draws = [random_rectangle_mask(np.random.default_rng(seed), 14) for seed in range(5)]
    assert len({d.tobytes() for d in draws}) > 1


# ----- joint prompts: all phrases of an image in one caption ------------------------------------------
def test_joint_prompts_pack_distinct_phrases_under_the_token_limit():
    words = lambda text: len(text.split())  # noqa: E731  (the tests' vocabulary: one token per word)
    phrases = ["Red car.", "dog", "red car", "", "a small cat on the grass", "dog", "man riding a horse"]
    prompts, representative = joint_prompts(phrases, words, max_tokens=12)  # 10 tokens between [CLS] and [SEP]
    assert [p.text for p in prompts] == ["red car . dog .", "a small cat on the grass .", "man riding a horse ."]
    assert [p.phrases for p in prompts] == [[0, 1], [4], [6]]
    assert representative == [0, 1, 0, None, 4, 1, 6]  # repeats point at their first occurrence, "" at nothing
    for prompt in prompts:
        expected = [phrase_prompt(phrases[i])[:-2] for i in prompt.phrases]
        assert [prompt.text[s:e] for s, e in prompt.char_spans] == expected
        assert sum(words(prompt.text[s:e]) + 1 for s, e in prompt.char_spans) <= 10
    # a phrase longer than a whole caption gets one of its own (GroundingDINO truncates it, as alone)
    long = " ".join(["dog"] * 20)
    prompts, _ = joint_prompts(["cat", long, "car"], words, max_tokens=12)
    assert [p.text for p in prompts] == ["cat .", f"{long} .", "car ."]


# "red car . car . small cat . a dog on the grass ." in the tiny vocabulary, one token per word:
# [CLS]=0 red=1 car=2 .=3 car=4 .=5 small=6 cat=7 .=8 a=9 dog=10 on=11 the=12 grass=13 .=14 [SEP]=15
JOINT_PHRASES = ["red car", "car", "Red car", "small cat", "a dog on the grass"]
JOINT_SPANS = {0: [1, 2], 1: [4], 3: [6, 7], 4: [9, 10, 11, 12, 13]}


def test_span_token_masks_are_each_phrases_own_positions(grounder):
    tokenizer = grounder.model.tokenizer
    (prompt,), _ = joint_prompts(JOINT_PHRASES, lambda t: len(tokenizer(t, add_special_tokens=False)["input_ids"]))
    assert prompt.text == "red car . car . small cat . a dog on the grass ."
    masks = span_token_masks(tokenizer, prompt, grounder.model.specical_tokens, 256)
    assert masks.shape == (4, 256)
    for mask, phrase in zip(masks, prompt.phrases):
        assert mask.nonzero().flatten().tolist() == JOINT_SPANS[phrase]


def test_joint_prompt_gives_each_phrase_exactly_its_own_boxes(grounder, bert_dir, image_files, monkeypatch):
    """Constructed logits (no detector run): each query fires on chosen token positions of the joint prompt."""
    joint = groundingdino(bert_dir, batch_size=2, prompt="joint")
    joint.__dict__["model"] = grounder.model  # the same (tokenizer, special tokens); _forward is replaced below
    probs = torch.zeros(7, 256)
    probs[0, [1, 2]] = 0.9             # "red car": only that phrase, though "car" shares its word
    probs[1, 4] = 0.8                  # "car"
    probs[2, 10], probs[2, 13] = 0.7, 0.3  # "a dog on the grass"
    probs[3, 3] = 0.9                  # only the "." after "red car": a box about no phrase
    probs[4, :16] = 0.3                # below box_threshold (0.35) everywhere: dropped
    probs[5, 2], probs[5, 4] = 0.6, 0.5    # label tokens in two phrases: the box goes to both
    probs[6, 5], probs[6, 7] = 0.5, 0.2    # kept (0.5 on a "."), but "cat" is below text_threshold (0.25)
    boxes = torch.tensor([[0.1 * (q + 1), 0.5, 0.1, 0.2] for q in range(7)])
    seen = []

    def forward(tensors, prompts):
        seen.append(list(prompts))
        return probs.expand(len(prompts), -1, -1), boxes.expand(len(prompts), -1, -1)

    monkeypatch.setattr(joint, "_forward", forward)
    (result,) = joint.ground([GroundingRequest(image_files["wide"], JOINT_PHRASES)])
    assert seen == [["red car . car . small cat . a dog on the grass ."]]  # one forward, one prompt
    centres = [[round(box[0] + (box[2] - box[0]) / 2) for box in phrase_boxes] for phrase_boxes in result]
    query = lambda q: round(0.1 * (q + 1) * 320)  # noqa: E731  (box centre x in the 320 px wide image)
    assert centres == [[query(0), query(5)], [query(1), query(5)], [query(0), query(5)], [], [query(2)]]
    assert [box[4] for box in result[0]] == pytest.approx([0.9, 0.6])  # predict's score: the best token
    assert result[2] == result[0] and result[2] is not result[0]  # a repeated phrase: equal boxes, own list


def test_joint_prompts_split_past_256_tokens(grounder, bert_dir, image_files, monkeypatch):
    joint = groundingdino(bert_dir, batch_size=2, prompt="joint")
    joint.__dict__["model"] = grounder.model
    phrases = [f"{w} {v} {u}" for w in ("red", "small") for v in ("car", "dog", "cat", "man", "horse")
               for u in ("on", "a", "the", "grass", "riding", "car", "dog", "cat", "man", "horse")]
    phrases += [f"the {p}" for p in phrases[:40]]  # 100 + 40 distinct phrases: 4-5 tokens each, ~600 in all
    seen = []

    def forward(tensors, prompts):
        seen.extend(prompts)
        return torch.zeros(len(prompts), 900, 256), torch.full((len(prompts), 900, 4), 0.5)

    monkeypatch.setattr(joint, "_forward", forward)
    joint.ground([GroundingRequest(image_files["wide"], phrases)])
    tokenizer = grounder.model.tokenizer
    assert len(seen) >= 3
    assert all(len(tokenizer(prompt)["input_ids"]) <= 256 for prompt in seen)
    assert [p for prompt in seen for p in prompt[:-2].split(" . ")] == phrases  # each phrase once, in order


def test_joint_equals_per_phrase_for_a_single_phrase(grounder, bert_dir, image_files):
    """One phrase: the joint caption is the per-phrase prompt and its span the phrase tokens, so the boxes agree."""
    joint = groundingdino(bert_dir, batch_size=2, prompt="joint")
    joint.__dict__["model"] = grounder.model
    request = [GroundingRequest(image_files["wide"], ["a dog on the grass"])]
    expected = grounder.ground(request)
    assert expected[0][0]
    assert joint.ground(request) == expected


def test_joint_settings_differ_only_in_the_prompt(grounder, bert_dir):
    per_phrase = grounder.settings()
    joint = groundingdino(bert_dir, batch_size=2, prompt="joint").settings()
    assert per_phrase["prompt"] == "{phrase} ." and "prompt_max_tokens" not in per_phrase
    assert joint["prompt"] == "{phrase} . {phrase} . ... ." and joint["prompt_max_tokens"] == 256
    assert {k: v for k, v in joint.items() if k not in ("prompt", "prompt_max_tokens", "phrase_boxes")} == \
        {k: v for k, v in per_phrase.items() if k != "prompt"}
    with pytest.raises(ValueError, match="prompt"):
        groundingdino(bert_dir, prompt="together")


def test_grounding_prompt_is_a_config_choice_that_reaches_the_grounder():
    from datamodules.preprocess import grounder_options
    from core.config import REPO_ROOT, ConfigError, load_config

    macco = REPO_ROOT / "configs" / "macco.yaml"
    assert load_config([macco]).preprocess.grounding_prompt == "per_phrase"  # the paper recipe
    cfg = load_config([macco], ["preprocess.grounding_prompt=joint"])
    name, options = grounder_options(cfg.data, cfg.preprocess)
    assert name == "groundingdino" and options["prompt"] == "joint"
    with pytest.raises(ConfigError, match="grounding_prompt"):
        load_config([macco], ["preprocess.grounding_prompt=together"])
