"""study.relation_text_probe: the oracle image code on hand-made scenes, and a short real run end to end."""
from __future__ import annotations

import json

import pytest
import torch

from datamodules.shapes import generate, load_swap_items
from study.relation_text_probe import (CODE_WIDTH, main, oracle_code, oracle_embeddings, swap_set, training_set,
                                      two_way_accuracy)


def obj(color: str, shape: str, x0: int, y0: int = 0, size: str = "small") -> dict:
    return {"color": color, "shape": shape, "size": size, "bbox": [x0, y0, x0 + 10, y0 + 10]}


def test_the_oracle_code_holds_identity_and_a_linear_position_per_colour_and_shape():
    code = oracle_code([obj("red", "square", 0), obj("blue", "circle", 44, 30, "large")], 64)
    assert code.shape == (CODE_WIDTH,) and code.dtype == torch.float64
    # one-hot (colour, shape): red square is entry 0 (red first, square first); blue circle is 2 * 4 + 1
    assert code[0] == 1 and code[2 * 4 + 1] == 1 and code[:24].sum() == 2
    assert code[24:26].tolist() == [1.0, 1.0]  # one small, one large
    # red's (x, y): centre (5, 5) of 64 -> 5/64 - 1/2
    assert torch.allclose(code[26:28], torch.tensor([5 / 64 - 0.5, 5 / 64 - 0.5], dtype=torch.float64))
    # blue's (x, y): colour index 2; circle's (x, y): shape index 1, after the 12 colour entries
    assert torch.allclose(code[26 + 4:26 + 6], torch.tensor([49 / 64 - 0.5, 35 / 64 - 0.5], dtype=torch.float64))
    assert torch.allclose(code[38 + 2:38 + 4], torch.tensor([49 / 64 - 0.5, 35 / 64 - 0.5], dtype=torch.float64))


def test_swapping_two_objects_moves_the_code_so_relation_direction_is_linear():
    left = oracle_code([obj("red", "square", 0), obj("blue", "circle", 40)], 64)
    right = oracle_code([obj("red", "square", 40), obj("blue", "circle", 0)], 64)
    # "red left of blue": the direction x_blue - x_red, i.e. +1 on blue's x and -1 on red's x
    direction = torch.zeros(CODE_WIDTH, dtype=torch.float64)
    direction[26 + 4], direction[26] = 1.0, -1.0
    assert float(left @ direction) > 0 > float(right @ direction)
    assert torch.equal(left[:26], right[:26])  # same objects: only positions differ


def test_two_way_accuracy_counts_each_image_against_the_other_caption():
    images = torch.eye(4)  # two items, each [image 0, image 1]
    text = torch.eye(4)[[0, 1, 3, 2]]  # item 0: captions match their images; item 1: swapped
    assert two_way_accuracy(text, images, ["relation", "attribute"]) == {"attribute": 0.0, "relation": 1.0}


def test_oracle_embeddings_are_unit_vectors_of_the_requested_width():
    codes = torch.randn(5, CODE_WIDTH, dtype=torch.float64)
    embedded = oracle_embeddings(codes, 16, seed=0)
    assert embedded.shape == (5, 16) and embedded.dtype == torch.float32
    assert torch.allclose(embedded.norm(dim=-1), torch.ones(5), rtol=1e-5)
    assert torch.equal(embedded, oracle_embeddings(codes, 16, seed=0))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    generate(root, n_train=12, n_val=6, image_size=64, seed=0)
    return root


def test_the_swap_set_has_two_scenes_and_two_captions_per_item(world):
    items = load_swap_items(world, "val")
    swap = swap_set(world, "val")
    assert len(swap["codes"]) == len(swap["captions"]) == 2 * len(items) == 2 * len(swap["types"])


def test_a_short_probe_trains_the_text_tower_and_reports_its_history(world, tmp_path):
    out = tmp_path / "probe.json"
    history = main(["--data-root", str(world), "--model", "ViT-Tiny-16-64", "--steps", "4", "--eval-every", "2",
                    "--batch-size", "8", "--out", str(out)])
    assert [entry["step"] for entry in history] == [2, 4]
    assert all(entry["loss"] > 0 and set(entry["two_way"]) <= {"attribute", "relation", "object"}
               for entry in history)
    assert all(0.0 <= value <= 1.0 for entry in history for value in entry["two_way"].values())
    assert json.loads(out.read_text())["history"] == history


def test_more_negatives_than_the_world_has_is_an_error_not_a_smaller_training_set(world):
    assert len(training_set(world, "train", 3)["negatives"][0]) == 3
    with pytest.raises(ValueError, match="fewer than --negatives 4"):
        training_set(world, "train", 4)
