"""`perf.preprocess` prompt-mode helpers: real captions grouped by image, forwards per image, the GPU-hour estimate."""
from __future__ import annotations

import json

import pytest

from perf.preprocess import coco_caption_groups, gpu_hours_estimate, image_phrase_sets, phrase_set_stats


def test_caption_groups_are_an_images_first_distinct_captions(tmp_path):
    entries = {"0": {"filename": "a.jpg", "caption": "c3 ", "negative_caption": "n"},
               "1": {"filename": "a.jpg", "caption": "c1", "negative_caption": "n"},
               "2": {"filename": "b.jpg", "caption": "only one", "negative_caption": "n"}}
    (tmp_path / "replace_obj.json").write_text(json.dumps(entries))
    (tmp_path / "add_att.json").write_text(json.dumps({"7": {"filename": "a.jpg", "caption": "c3",
                                                             "negative_caption": "m"},
                                                       "8": {"filename": "a.jpg", "caption": "c2",
                                                             "negative_caption": "m"}}))
    assert coco_caption_groups(tmp_path, per_image=2) == [["c1", "c2"]]  # "c3 " and "c3" are one caption
    assert coco_caption_groups(tmp_path, per_image=3) == [["c1", "c2", "c3"]]


def test_phrase_sets_hold_each_images_distinct_phrases_and_count_joint_prompts():
    sets = image_phrase_sets([["a brown dog on the grass", "a brown dog runs"], ["a red car"]])
    assert sets[0].count("brown dog") == 1 and "red car" in sets[1]
    words = lambda text: len(text.split())  # noqa: E731
    stats = phrase_set_stats([["a b", "c"], ["d e f"]], phrases_per_caption=1.5, token_count=words)
    assert stats["distinct_phrases_per_image"] == 1.5 and stats["joint_prompts_per_image"] == 1
    assert stats["joint_prompt_tokens_max"] == len("a b . c .".split()) + 2  # with [CLS] and [SEP]


def test_gpu_hours_are_images_times_forwards_times_flops_over_the_assumed_rate():
    hours = gpu_hours_estimate(3600, {"per_phrase": 10.0, "joint": 1.0}, {"per_phrase": 2e12, "joint": 3e12}, 4.0)
    assert hours == pytest.approx({"per_phrase": 3600 * 10 * 2e12 / 4e12 / 3600, "joint": 3600 * 3e12 / 4e12 / 3600})
