"""Caption character spans -> open_clip BPE token positions, checked against the real ViT-B-32 tokenizer.

The property tests build captions from units (words, punctuation, contractions) chosen so that no two units
merge into one regex word of the tokenizer; then the tokens of a caption are the tokens of its units encoded one
by one, which gives an independent oracle for which sequence positions each target unit must flag.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import List, NamedTuple, Tuple

import numpy as np
import open_clip
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from open_clip.tokenizer import SimpleTokenizer

from parsers.token_alignment import (align_tokens, caption_masks, first_bpe_match_mask, spans_to_token_mask,
                                     token_char_spans)
from testkit.fixtures import fixture

CONTEXT = 77
KEPT = CONTEXT - 2  # BPE tokens that survive truncation (SOT first, EOT last)
# Module level rather than a fixture: hypothesis re-runs a test body many times within one fixture instance.
TOKENIZER = open_clip.get_tokenizer("ViT-B-32")

ASCII_CORES = ["a", "dog", "cat", "next", "to", "red", "the", "skateboarding", "photobombing",
               "antidisestablishmentarianism", "xylophonist", "zzyzx", "x", "7", "42", "1999"]
# accents (multi-byte BPE), combining accent (NFC), full width, ligature: ftfy or lowercasing rewrites these
UNICODE_CORES = ["café", "naïve", "Éclair", "ＤＯＧ", "ﬁsh", "cafe\u0301"]
# never glued to other units: html entity, punctuation runs, curly quotes, final sigma, dotted capital I
STANDALONE = ["&amp;", "&", "-", "...", "“quoted”", "ΟΔΟΣ", "İstanbul"]
PREFIXES = ["(", '"', "“"]
SUFFIXES = [",", ".", "!", "?", ")", "'s", "’s", "”"]
SEPARATORS = [" ", "  ", "\t", "\n", " \n\t ", "\u00a0", "\u3000"]


class Case(NamedTuple):
    caption: str
    units: List[Tuple[int, int, str]]  # (start, end, text) of every unit in the caption
    targets: List[int]  # indices into units


@dataclass
class Span:
    """Stand-in for the scene-graph parser's span type."""

    start: int
    end: int
    text: str


@st.composite
def chunks(draw) -> List[str]:
    """Units of one whitespace-free chunk: a standalone symbol, or an optional prefix + core + optional suffix."""
    if draw(st.integers(0, 5)) == 0:
        return [draw(st.sampled_from(STANDALONE))]
    core = draw(st.sampled_from(ASCII_CORES + UNICODE_CORES))
    if core in ASCII_CORES:
        core = draw(st.sampled_from([str.lower, str.upper, str.title]))(core)
    prefix = draw(st.sampled_from([""] * 3 + PREFIXES))
    suffix = draw(st.sampled_from([""] * 3 + SUFFIXES))
    return [unit for unit in (prefix, core, suffix) if unit]


@st.composite
def cases(draw) -> Case:
    """A caption with odd whitespace (leading/trailing too), long enough at times to be truncated."""
    chunk_list = draw(st.lists(chunks(), min_size=1, max_size=70))
    gaps = draw(st.lists(st.sampled_from([""] + SEPARATORS), min_size=2, max_size=2))
    separators = [gaps[0]] + draw(st.lists(st.sampled_from(SEPARATORS), min_size=len(chunk_list) - 1,
                                           max_size=len(chunk_list) - 1)) + [gaps[1]]
    caption, units = "", []
    for separator, chunk in zip(separators, chunk_list):
        caption += separator
        for unit in chunk:
            units.append((len(caption), len(caption) + len(unit), unit))
            caption += unit
    caption += separators[-1]
    targets = sorted(draw(st.sets(st.integers(0, len(units) - 1))))
    return Case(caption, units, targets)


def token_owners(case: Case) -> List[int]:
    """Unit index of every token of the caption, from encoding the units one by one."""
    unit_ids = [TOKENIZER.encode(text) for _, _, text in case.units]
    # the oracle holds only if the units stay apart in the caption, which the vocabulary is chosen to ensure
    assert [i for ids in unit_ids for i in ids] == TOKENIZER.encode(case.caption)
    return [k for k, ids in enumerate(unit_ids) for _ in ids]


def token_bytes(token_id: int) -> bytes:
    """UTF-8 bytes of one token (a token may hold part of a character, so decode() would show U+FFFD)."""
    symbols = TOKENIZER.decoder[token_id].removesuffix("</w>")
    return bytes(TOKENIZER.byte_decoder[symbol] for symbol in symbols)


def flagged(mask: np.ndarray) -> List[int]:
    return np.flatnonzero(mask).tolist()


def target_spans(case: Case) -> List[Tuple[int, int]]:
    return [case.units[k][:2] for k in case.targets]


@settings(max_examples=150, deadline=None)
@given(cases())
def test_mask_flags_exactly_the_tokens_of_the_target_units(case):
    owners = token_owners(case)
    mask = spans_to_token_mask(case.caption, target_spans(case), TOKENIZER)
    kept = min(len(owners), KEPT)
    assert flagged(mask) == [t + 1 for t in range(kept) if owners[t] in case.targets]


@settings(max_examples=150, deadline=None)
@given(cases())
def test_flagged_tokens_come_from_their_targets_and_match_the_sequence(case):
    owners = token_owners(case)
    mask = spans_to_token_mask(case.caption, target_spans(case), TOKENIZER)
    sequence = TOKENIZER([case.caption])[0].numpy()
    eot = min(len(owners), KEPT) + 1
    assert sequence[eot] == TOKENIZER.eot_token_id
    assert not mask[0] and not mask[eot:].any()
    for position in flagged(mask):
        unit_text = case.units[owners[position - 1]][2]
        assert token_bytes(int(sequence[position])) in TOKENIZER.clean_fn(unit_text).encode("utf-8")
    for k in case.targets:
        kept_tokens = [t for t, owner in enumerate(owners[:KEPT]) if owner == k]
        assert all(mask[t + 1] for t in kept_tokens)
        assert kept_tokens or k in owners[KEPT:], "a target unit before the cut has at least one token"


@settings(max_examples=100, deadline=None)
@given(cases())
def test_token_spans_lie_inside_the_unit_they_encode(case):
    owners = token_owners(case)
    spans = token_char_spans(case.caption, TOKENIZER)
    assert len(spans) == len(owners)
    for (start, end), owner in zip(spans, owners):
        unit_start, unit_end, _ = case.units[owner]
        assert unit_start <= start < end <= unit_end


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_ids_are_the_tokenizers_on_any_text(text):
    alignment = align_tokens(text, TOKENIZER)
    assert list(alignment.ids) == TOKENIZER.encode(text)
    assert all(0 <= start <= end <= len(text) for start, end, _ in alignment.origins)
    mask = spans_to_token_mask(text, [(0, len(text))], TOKENIZER)
    assert not mask[0] and not mask[min(len(alignment.ids), KEPT) + 1 :].any()


ASCII_TEXT = st.text(st.sampled_from([chr(c) for c in range(0x20, 0x7F) if chr(c) != "&"] + ["\t", "\n"]))


@settings(max_examples=200, deadline=None)
@given(ASCII_TEXT)
def test_ascii_fast_path_agrees_with_the_tracked_path(text):
    # a trailing " é" sends the caption through ftfy and the diff, and cannot change the tokens before it
    fast = align_tokens(text, TOKENIZER)
    tracked = align_tokens(text + " é", TOKENIZER)
    assert tracked.ids[: len(fast.ids)] == fast.ids
    assert tracked.origins[: len(fast.origins)] == fast.origins


def mask_of(caption: str, *words: str, occurrence: int = 0) -> List[int]:
    """Flagged positions for the given words, each at its ``occurrence``-th appearance in the caption."""
    spans = []
    for word in words:
        start = -1
        for _ in range(occurrence + 1):
            start = caption.index(word, start + 1)
        spans.append((start, start + len(word)))
    return flagged(spans_to_token_mask(caption, spans, TOKENIZER))


def test_repeated_word_flags_only_the_requested_occurrence():
    caption = "a dog next to a dog"
    assert mask_of(caption, "dog") == [2]
    assert mask_of(caption, "dog", occurrence=1) == [6]


def test_case_punctuation_and_double_spaces():
    caption = "A  Dog,  next to a DOG."  # tokens: a dog , next to a dog .
    assert mask_of(caption, "Dog") == [2]
    assert mask_of(caption, "Dog,") == [2, 3]
    assert mask_of(caption, "DOG") == [7]
    assert mask_of(caption, "A  Dog") == [1, 2]


def test_truncation_cuts_targets_past_the_last_kept_position():
    caption = " ".join(["red"] * 100)  # one token per word: word k sits at position k + 1
    words = [(4 * k, 4 * k + 3) for k in range(100)]
    assert token_char_spans(caption, TOKENIZER) == words
    assert TOKENIZER([caption])[0][CONTEXT - 1] == TOKENIZER.eot_token_id
    assert flagged(spans_to_token_mask(caption, [words[74]], TOKENIZER)) == [75]
    assert not spans_to_token_mask(caption, [words[75], words[99]], TOKENIZER).any()
    assert flagged(spans_to_token_mask(caption, [words[3], words[8]], TOKENIZER, context_length=6)) == [4]


def test_word_split_into_several_bpe_tokens_is_flagged_whole():
    caption = "kids skateboarding past antidisestablishmentarianism"
    assert mask_of(caption, "skateboarding") == [2]  # one token in the CLIP vocabulary
    assert mask_of(caption, "antidisestablishmentarianism") == [4, 5, 6, 7, 8, 9]


def test_html_entity():
    assert mask_of("salt &amp; pepper", "&amp;") == [2]
    assert mask_of("salt &amp; pepper", "pepper") == [3]
    assert mask_of("salt&amp;pepper", "salt") == [1]
    assert mask_of("salt&amp;pepper", "&amp;") == [2]


def test_curly_quotes_accents_and_mojibake():
    caption = "the “red” dog’s ball"  # tokens: the " red " dog 's ball
    assert mask_of(caption, "dog") == [5]
    assert mask_of(caption, "dog’s") == [5, 6]
    assert mask_of(caption, "“red”") == [2, 3, 4]
    assert mask_of(caption, "red") == [3]
    assert mask_of("Éclair and café crème", "café") == [4]
    assert mask_of("a cafÃ© au lait", "cafÃ©") == [2]  # ftfy repairs the mojibake to "café"


def test_ligatures_map_one_by_one():
    assert mask_of("ﬁﬂ dog", "ﬁ") == [1]  # BPE "fi" + "fl"
    assert mask_of("ﬁﬂ dog", "ﬂ") == [2]


def test_unresolvable_rewrite_is_flagged_only_when_contained():
    # "İΟΣ" lowercases to "i̇ος": the I expands and the final sigma needs context, so no per-character origin
    caption = "İΟΣ dog"
    assert all(not exact for _, _, exact in align_tokens(caption, TOKENIZER).origins[:-1])
    assert mask_of(caption, "İΟΣ") == [1, 2, 3, 4, 5, 6]
    assert mask_of(caption, "İ") == []
    assert mask_of(caption, "dog") == [7]


def test_empty_spans_and_span_objects():
    caption = "a red dog on a green mat"
    assert not spans_to_token_mask(caption, [], TOKENIZER).any()
    obj_mask, comp_mask = caption_masks(caption, [Span(6, 9, "dog"), Span(21, 24, "mat")], [(2, 5), (15, 20)],
                                        TOKENIZER)
    assert flagged(obj_mask) == [3, 7] and flagged(comp_mask) == [2, 6]
    assert obj_mask.dtype == bool and obj_mask.shape == (CONTEXT,)


def test_tokenizer_without_lowercasing_and_unsupported_ones():
    tokenizer = SimpleTokenizer(clean="whitespace")
    alignment = align_tokens("A Dog  on a mat", tokenizer)
    assert list(alignment.ids) == tokenizer.encode("A Dog  on a mat")
    sequence = tokenizer(["A Dog  on a mat"])[0].tolist()
    positions = flagged(spans_to_token_mask("A Dog  on a mat", [(2, 5)], tokenizer))
    assert b"".join(token_bytes(sequence[p]) for p in positions) == b"Dog"  # cased BPE: "D" + "og"
    with pytest.raises(ValueError):
        align_tokens("a dog", SimpleTokenizer(clean="canonicalize"))
    with pytest.raises(TypeError):
        align_tokens("a dog", SimpleTokenizer(reduction_mask="random"))


def test_every_word_of_real_captions_is_recovered_from_its_tokens():
    swap_att = fixture("sugarcrepe/swap_att.json")
    captions = [item["caption"] for item in json.loads(swap_att.read_text()).values()][:200]
    for caption in captions:
        spans = token_char_spans(caption, TOKENIZER)
        sequence = TOKENIZER([caption])[0].tolist()
        for start, end, word in _words(caption):
            mask = spans_to_token_mask(caption, [(start, end)], TOKENIZER)
            text = b"".join(token_bytes(sequence[p]) for p in flagged(mask)).decode("utf-8")
            if spans and start >= spans[min(len(spans), KEPT) - 1][1]:
                assert text == ""  # past the cut
            else:
                assert text == TOKENIZER.clean_fn(word).replace(" ", "")


def _words(caption: str) -> List[Tuple[int, int, str]]:
    """Whitespace-separated words of a caption with their spans."""
    words, start = [], 0
    for word in caption.split():
        start = caption.index(word, start)
        words.append((start, start + len(word), word))
        start += len(word)
    return words


# ----- MACCO's original word -> token rule --------------------------------------------------------------------
def test_first_bpe_match_rule_on_hand_cases():
    """Each word BPE-encoded alone, "the" skipped, the first contiguous id match masked (case-insensitive)."""
    caption = "The dog on a multicolored mat on the floor"  # SOT the dog on a multic olo red mat on the floor EOT
    assert TOKENIZER.encode("multicolored")[-1] == TOKENIZER.encode("red")[0]
    rule = lambda *words: flagged(first_bpe_match_mask(caption, list(words), TOKENIZER, CONTEXT))  # noqa: E731
    assert rule("on") == rule("on", "on") == [3]  # the first "on" only, however often listed
    assert rule("red") == [7]  # a sub-token of "multicolored"
    assert rule("The", "the", "THE") == []  # always skipped
    assert rule("on the floor") == [9, 10, 11]  # one sequence, its "the" included
    assert rule("Dog") == [2] and rule("under") == [] and rule("") == []
    # ours flags the character spans of every listed occurrence, whole words only
    assert flagged(caption_masks(caption, [], [(8, 10), (30, 32)], TOKENIZER)[1]) == [3, 9]
