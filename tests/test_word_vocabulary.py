"""CLIP-CAE's replacement vocabulary: word kinds from cache records, the table, exact conditional draws, the
checkpoint form, and the attribute / relation split of the token masks."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import open_clip
import pytest

from datamodules.masks import CaptionMasks
from datamodules.word_vocabulary import (ATTRIBUTE, OBJECT, RELATION, WordVocabulary, count_words,
                                         record_word_kinds)
from parsers.scene_graph import SceneGraphParser

TOKENIZER = open_clip.get_tokenizer("ViT-B-32")
CAPTIONS = ["A man riding a brown horse", "two dogs next to a red car", "a dog on the grass"]


@pytest.fixture(scope="module")
def records():
    """Cache records as datamodules.preprocess writes them (spans, phrases, graph) for real parses."""
    rows = []
    for caption, graph in zip(CAPTIONS, SceneGraphParser().parse(CAPTIONS)):
        rows.append({"caption": caption, "obj_spans": [[s.start, s.end] for s in graph.object_spans()],
                     "comp_spans": [[s.start, s.end] for s in graph.composition_spans()], "phrases": [],
                     "graph": graph.to_dict()})
    return rows


def test_counts_per_kind_from_real_parses(records):
    counts = count_words(records)
    assert counts[OBJECT] == Counter({"man": 1, "horse": 1, "dogs": 1, "car": 1, "dog": 1, "grass": 1})
    assert counts[ATTRIBUTE] == Counter({"brown": 1, "two": 1, "red": 1})
    assert {"riding", "next", "to", "on"} <= set(counts[RELATION])


def test_a_word_of_two_kinds_takes_object_then_relation_then_attribute():
    record = {"caption": "big on top", "obj_spans": [[7, 10]],
              "graph": {"entities": [{"attributes": [[0, 3], [4, 6], [7, 10]]}],
                        "relations": [{"words": [[4, 6]]}]}}
    assert record_word_kinds(record) == {(7, 10): OBJECT, (4, 6): RELATION, (0, 3): ATTRIBUTE}


def vocabulary(objects: dict) -> WordVocabulary:
    return WordVocabulary.from_counts({OBJECT: Counter(objects), ATTRIBUTE: Counter({"red": 1, "small": 1}),
                                       RELATION: Counter({"on": 1, "next to": 2})}, TOKENIZER)


def test_table_merges_words_with_the_same_tokens_and_orders_by_text():
    table = vocabulary({"dog": 2, "Dog": 3, "cat": 1, "traffic light": 4}).tables[OBJECT]
    assert table.texts == ["Dog", "cat", "traffic light"]  # "Dog" and "dog" are one entry (lower-cased BPE)
    assert table.counts.tolist() == [5, 1, 4]
    assert table.ids == [tuple(TOKENIZER.encode(text)) for text in table.texts]
    assert len(table.ids[2]) == 2


def draw_frequencies(vocab: WordVocabulary, word: str, draws: int = 60000) -> dict:
    table = vocab.tables[OBJECT]
    drawn = vocab.draw(OBJECT, tuple(TOKENIZER.encode(word)), np.random.default_rng(0), draws)
    counts = Counter(table.texts[table.index[ids]] for ids in drawn)
    return {text: counts[text] / draws for text in table.texts}


def test_draws_follow_the_counts_without_the_word_itself():
    vocab = vocabulary({"ant": 1, "bee": 2, "cat": 3, "dog": 4})
    frequencies = draw_frequencies(vocab, "cat")
    assert frequencies["cat"] == 0
    # 60000 draws: the standard error of a frequency is below 0.002
    for text, expected in {"ant": 1 / 7, "bee": 2 / 7, "dog": 4 / 7}.items():
        assert frequencies[text] == pytest.approx(expected, abs=0.01), text
    unseen = draw_frequencies(vocab, "zebra")  # not a training word: the whole table
    for text, expected in {"ant": 0.1, "bee": 0.2, "cat": 0.3, "dog": 0.4}.items():
        assert unseen[text] == pytest.approx(expected, abs=0.01), text


def test_draws_repeat_with_the_seed():
    vocab = vocabulary({"ant": 1, "bee": 2, "cat": 3, "dog": 4})
    word = tuple(TOKENIZER.encode("cat"))
    first = vocab.draw(OBJECT, word, np.random.default_rng([1, 2]), 20)
    assert first == vocab.draw(OBJECT, word, np.random.default_rng([1, 2]), 20)
    assert first != vocab.draw(OBJECT, word, np.random.default_rng([1, 3]), 20)


def test_checkpoint_form_round_trips_through_json():
    vocab = vocabulary({"ant": 1, "traffic light": 2})
    restored = WordVocabulary.from_dict(json.loads(json.dumps(vocab.to_dict())))
    assert restored == vocab
    word = tuple(TOKENIZER.encode("ant"))
    assert restored.draw(OBJECT, word, np.random.default_rng(0), 5) == vocab.draw(OBJECT, word,
                                                                                   np.random.default_rng(0), 5)


def test_a_kind_with_fewer_than_two_words_is_refused():
    with pytest.raises(ValueError, match="1 distinct object word"):
        vocabulary({"ant": 5})


@pytest.mark.parametrize("rule", ["every_occurrence", "first_bpe_match"])
def test_caption_masks_split_composition_into_attributes_and_relations(records, rule):
    masks = CaptionMasks(records, TOKENIZER, 77, rule)
    for index, record in enumerate(records):
        token = masks.sample_token_masks(index, 77)
        assert np.array_equal(token["attr_mask"] | token["rel_mask"], token["comp_mask"])
        assert not (token["attr_mask"] & token["rel_mask"]).any()
        ids = TOKENIZER([record["caption"]])[0].numpy()
        words = lambda mask: {TOKENIZER.decoder[int(i)].removesuffix("</w>") for i in ids[mask]}  # noqa: E731
        assert words(token["attr_mask"]) <= {"brown", "two", "red"}
        assert words(token["rel_mask"]) <= {"riding", "next", "to", "on"} and words(token["rel_mask"])
    assert masks.word_counts == count_words(records)
