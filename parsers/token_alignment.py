"""Character spans of a caption -> positions of open_clip BPE tokens, exactly.

open_clip's ``SimpleTokenizer`` cleans a caption (ftfy, html unescape, whitespace collapse, lowercase) before it
splits the text into words and BPE-encodes each word, so token offsets cannot be read off the cleaned string.
This module replays the tokenizer's own steps - its ``basic_clean``, its word regex ``tokenizer.pat`` and its
``tokenizer.bpe`` - while carrying, for every character of the working text, the span of the original caption
it came from. The token ids it produces are therefore those of ``tokenizer.encode(caption)``, and a token's span
is the union of the spans of the characters (UTF-8 bytes, for BPE) it covers.

How origins are carried:

* Printable-ASCII captions without ``&`` (nearly every COCO caption) take a fast path: ftfy and html unescape
  leave them unchanged and ASCII lowercasing keeps positions, so the tokenizer's regex runs on the lowercased
  caption itself and positions are the original ones.
* Otherwise html character references are first replaced as ``html.unescape`` does, each replacement taking
  the span of its whole reference ("&amp;" -> "&" comes from all five characters). The rest of ``basic_clean``
  (mostly ftfy: curly quotes, full-width letters, ligatures, NFC, mojibake, control characters) is replayed
  word by word: each whitespace-separated word is cleaned on its own and aligned with a character diff, and the
  cleaned words must add up to ``basic_clean(caption)``. Every block the diff rewrites must split into the
  shortest pieces that clean on their own ("e" + U+0301 + "’" -> "é'" is two pieces), so a piece maps one to
  one, or one character expands ("ﬁ" -> "fi"), or several collapse into one ("Ã©" -> "é").
* Lowercasing is tracked per character ("İ" -> "i̇" keeps the origin of "İ" for both characters).

Conservative cases. Where the origin of single characters is not known, a token's span is a superset of its
origin and is marked inexact; ``spans_to_token_mask`` flags such a token only when that span lies entirely
inside one requested span, never on a mere overlap, so no wrong token is flagged:

* a piece that cleans several characters into a different number of others: the piece is the span;
* a word whose rewrite does not split into pieces (e.g. "İΟΣ": the dotted I expands and the final sigma needs
  context): the word is the span of each of its tokens;
* cleaning that is not word by word (ftfy judged mojibake on the whole line, or it left references alone on a
  line holding "<" while a word on its own gets them unescaped): the whole caption is the span.
"""
from __future__ import annotations

import html
import os
import re
from difflib import SequenceMatcher
from functools import lru_cache
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
from open_clip.tokenizer import SimpleTokenizer, basic_clean, get_clean_fn

# (start, end, exact): the [start, end) span of the original caption a character or token came from; exact is
# False when the span is only known to contain the true origin (see the module docstring).
_Origin = Tuple[int, int, bool]

# Characters outside printable ASCII + tab/newline, or '&': ftfy and html unescape may rewrite text holding any
# of these, and on these characters the tokenizer's regex `\s` agrees with str.split() (it does not on \x1c-\x1f).
_NEEDS_TRACKING = re.compile(r"[^\t\n\x20-\x25\x27-\x7e]")
# Python's whitespace, as used by whitespace_clean's str.split().
_CHUNK = re.compile(r"\S+")
# The character references html.unescape replaces (the standard library's own pattern, HTML5 syntax).
_CHARREF = re.compile(r"&(#[0-9]+;?|#[xX][0-9a-fA-F]+;?|[^\t\n\f <&#;]{1,32};?)")
# Origin given to whitespace, which never becomes part of a token.
_NO_ORIGIN: _Origin = (0, 0, False)
# Longest input piece one cleaning rewrite consumes (double-encoded UTF-8 mojibake is up to 4-6 characters).
_MAX_REWRITE = 8
_END_OF_WORD = "</w>"
# Alignments are small (well under 1 kB); these bound the per-process caches to tens of MB.
_CAPTION_CACHE_SIZE = 16384
_WORD_CACHE_SIZE = 65536


class TokenAlignment(NamedTuple):
    """BPE tokens of a caption (no SOT/EOT, before truncation) and where each came from.

    Attributes:
        ids: token ids, equal to ``tokenizer.encode(caption)``.
        origins: one ``(start, end, exact)`` per token: its span ``[start, end)`` in the original caption, and
            False where that span is only known to contain the token's origin (see the module docstring).
    """

    ids: Tuple[int, ...]
    origins: Tuple[_Origin, ...]


def align_tokens(caption: str, tokenizer: SimpleTokenizer) -> TokenAlignment:
    """Align every BPE token of ``caption`` with the characters of ``caption`` it came from.

    Results are cached per (caption, tokenizer), so building several masks for one caption aligns it once.

    Args:
        caption: the raw caption, as passed to the tokenizer.
        tokenizer: an open_clip ``SimpleTokenizer`` with clean='lower' (the default) or 'whitespace' and no
            reduction_mask.

    Returns:
        The token ids and their character spans (tuples, as they are shared through the cache).

    Raises:
        TypeError: for other tokenizers (HF tokenizers, reduction masks that drop tokens at random).
        ValueError: for the 'canonicalize' cleaning, whose punctuation removal is not replayed here.
    """
    return _cached_alignment(caption, tokenizer, _lowercases(tokenizer))


def token_char_spans(caption: str, tokenizer: SimpleTokenizer) -> List[Tuple[int, int]]:
    """Character span in ``caption`` of every BPE token, in order, without SOT/EOT and before truncation.

    Args:
        caption: the raw caption.
        tokenizer: an open_clip ``SimpleTokenizer`` (see ``align_tokens``).

    Returns:
        One ``(start, end)`` per token of ``tokenizer.encode(caption)``; ``caption[start:end]`` is the text the
        token was cleaned and encoded from (a superset of it for inexact tokens, see the module docstring).
    """
    return [(start, end) for start, end, _ in align_tokens(caption, tokenizer).origins]


def spans_to_token_mask(
    caption: str, spans: Sequence[Any], tokenizer: SimpleTokenizer, context_length: int = 77
) -> np.ndarray:
    """Mark the sequence positions of the tokens that come from the given character spans.

    Args:
        caption: the raw caption.
        spans: ``(start, end)`` tuples or objects with ``.start``/``.end`` (e.g. the scene-graph parser's
            ``Span``), character offsets into ``caption``.
        tokenizer: an open_clip ``SimpleTokenizer`` (see ``align_tokens``).
        context_length: length of the tokenized sequence.

    Returns:
        bool [context_length], True at the position (SOT at 0, first BPE token at 1) of every token whose span
        overlaps a given span (inexact tokens: lies inside one). SOT, EOT, padding and tokens cut by the
        tokenizer's truncation (it keeps positions 1 .. context_length - 2) are never True.
    """
    return _token_mask(align_tokens(caption, tokenizer), spans, context_length)


def caption_masks(
    caption: str,
    object_spans: Sequence[Any],
    composition_spans: Sequence[Any],
    tokenizer: SimpleTokenizer,
    context_length: int = 77,
) -> Tuple[np.ndarray, np.ndarray]:
    """Token masks of a caption's object words and of its composition words (attributes, relations).

    Args:
        caption: the raw caption.
        object_spans: character spans of the objects.
        composition_spans: character spans of the compositional words.
        tokenizer: an open_clip ``SimpleTokenizer`` (see ``align_tokens``).
        context_length: length of the tokenized sequence.

    Returns:
        ``(obj_mask, comp_mask)``, each bool [context_length] as in ``spans_to_token_mask``.
    """
    alignment = align_tokens(caption, tokenizer)
    obj_mask = _token_mask(alignment, object_spans, context_length)
    comp_mask = _token_mask(alignment, composition_spans, context_length)
    return obj_mask, comp_mask


def first_bpe_match_mask(caption: str, words: Sequence[str], tokenizer: SimpleTokenizer,
                         context_length: int = 77) -> np.ndarray:
    """MACCO's original word -> token rule [code] (`data.comp_mask_rule=first_bpe_match`).

    Each word (or multi-word relation such as "to the left of") is BPE-encoded on its own, lower-cased and
    without SOT/EOT; words equal to "the" (any case) are skipped. The first contiguous occurrence of its ids
    in the caption's `context_length` ids, searched from position 0, is masked; nothing when there is none.
    Unlike `caption_masks` (ours: the exact character spans of every listed occurrence), a repeated word
    masks the same first occurrence again, a multi-word relation is matched as one sequence (its "the"
    included), and matching is on BPE tokens, not words ("red" hits the last piece of "multicolored").

    Args:
        caption: the raw caption.
        words: the relation words, then the attribute words, as strings (order does not change the mask).
        tokenizer: an open_clip ``SimpleTokenizer``.
        context_length: length of the tokenized sequence.

    Returns:
        bool [context_length].
    """
    ids = tokenizer([caption])[0].tolist()
    if len(ids) != context_length:
        raise ValueError(f"the tokenizer gives {len(ids)} ids per caption, expected {context_length}")
    mask = np.zeros(context_length, dtype=bool)
    for word in words:
        if word.lower() == "the":
            continue
        found = _first_occurrence(ids, tokenizer.encode(word.lower()))
        if found is not None:
            mask[found[0]:found[1]] = True
    return mask


def _first_occurrence(ids: Sequence[int], pattern: Sequence[int]) -> Optional[Tuple[int, int]]:
    """[start, end) of the first contiguous occurrence of ``pattern`` in ``ids``; None if absent or empty."""
    width = len(pattern)
    if not width:
        return None
    for start in range(len(ids) - width + 1):
        if ids[start] == pattern[0] and list(ids[start:start + width]) == list(pattern):
            return start, start + width
    return None


def _lowercases(tokenizer: SimpleTokenizer) -> bool:
    """Whether the tokenizer lowercases; rejects tokenizers whose positions cannot be replayed."""
    if not isinstance(tokenizer, SimpleTokenizer) or tokenizer.reduction_fn is not None:
        raise TypeError("token alignment needs an open_clip SimpleTokenizer that truncates (no reduction_mask)")
    if tokenizer.clean_fn is get_clean_fn("lower"):
        return True
    if tokenizer.clean_fn is get_clean_fn("whitespace"):
        return False
    raise ValueError("token alignment supports the tokenizer cleanings 'lower' and 'whitespace' only")


@lru_cache(maxsize=_CAPTION_CACHE_SIZE)
def _cached_alignment(caption: str, tokenizer: SimpleTokenizer, lower: bool) -> TokenAlignment:
    if _NEEDS_TRACKING.search(caption) is None:
        ids, origins = _ascii_tokens(caption, tokenizer, lower)
    else:
        ids, origins = _tracked_tokens(caption, tokenizer, lower)
    return TokenAlignment(tuple(ids), tuple(origins))


def _ascii_tokens(caption: str, tokenizer: SimpleTokenizer, lower: bool) -> Tuple[List[int], List[_Origin]]:
    """Fast path: cleaning keeps every position, and bytes_to_unicode maps '!'..'~' to themselves, so an ASCII
    word is its own BPE input and each BPE symbol is one character."""
    ids: List[int] = []
    origins: List[_Origin] = []
    for word in tokenizer.pat.finditer(caption.lower() if lower else caption):
        start = word.start()
        for token_id, length in _bpe_pieces(tokenizer, word.group()):
            ids.append(token_id)
            origins.append((start, start + length, True))
            start += length
    return ids, origins


def _tracked_tokens(caption: str, tokenizer: SimpleTokenizer, lower: bool) -> Tuple[List[int], List[_Origin]]:
    """General path: clean with origins carried along, then encode word by word.

    html references are replaced first (twice, as ``basic_clean`` does), with exact origins, so that replaying
    ``basic_clean`` word by word leaves the diff only ftfy's rewrites; ftfy, which runs first in
    ``basic_clean``, would otherwise unescape the references itself and the diff could only guess their origin.
    """
    text, origins = _track_unescape(caption, [(i, i + 1, True) for i in range(len(caption))])
    text, origins = _track(*_track_unescape(text, origins), basic_clean(caption), _clean_word)
    if lower:
        text, origins = _track_lower(text, origins)
    ids: List[int] = []
    token_origins: List[_Origin] = []
    for word in _words(text, tokenizer):
        for token_id, origin in _word_tokens(word.group(), origins[word.start() : word.end()], tokenizer):
            ids.append(token_id)
            token_origins.append(origin)
    return ids, token_origins


def _words(text: str, tokenizer: SimpleTokenizer) -> Iterator[Any]:
    """The tokenizer's regex words of ``text`` after whitespace_clean, with positions in ``text``.

    Collapsing whitespace only joins chunks with single spaces and no alternative of the regex matches a space,
    so matching chunk by chunk gives the words of the collapsed text without building it.
    """
    for chunk in _CHUNK.finditer(text):
        yield from tokenizer.pat.finditer(text, chunk.start(), chunk.end())


def _word_tokens(word: str, origins: List[_Origin], tokenizer: SimpleTokenizer) -> Iterator[Tuple[int, _Origin]]:
    """BPE tokens of one word with their origins; BPE works on the word's UTF-8 bytes (one symbol per byte), so a
    token's byte range is mapped back to the characters it touches."""
    char_of_byte = [index for index, char in enumerate(word) for _ in range(len(char.encode("utf-8")))]
    symbols = "".join(tokenizer.byte_encoder[byte] for byte in word.encode("utf-8"))
    first = 0
    for token_id, length in _bpe_pieces(tokenizer, symbols):
        last = first + length
        yield token_id, _union(origins[char_of_byte[first] : char_of_byte[last - 1] + 1])
        first = last


@lru_cache(maxsize=_WORD_CACHE_SIZE)
def _bpe_pieces(tokenizer: SimpleTokenizer, symbols: str) -> Tuple[Tuple[int, int], ...]:
    """``(id, number of byte symbols)`` of each BPE token of one word, given as byte symbols.

    Cached on top of the tokenizer's own BPE cache, which still leaves splitting and vocabulary lookups per call.
    """
    pieces = tokenizer.bpe(symbols).split(" ")
    return tuple((tokenizer.encoder[piece], len(piece.removesuffix(_END_OF_WORD))) for piece in pieces)


def _track_unescape(text: str, origins: List[_Origin]) -> Tuple[str, List[_Origin]]:
    """html.unescape carrying origins: a reference's replacement comes from the whole reference, except the text
    a reference without ';' leaves unconsumed ("&ampxyz" -> "&xyz"), which keeps its own origins."""
    if "&" not in text:
        return text, origins
    pieces: List[str] = []
    carried: List[_Origin] = []
    done = 0
    for reference in _CHARREF.finditer(text):
        start, end = reference.span()
        replacement = html.unescape(reference.group())
        # longest common tail, leaving the replacement's first character to the reference itself
        tail = len(os.path.commonprefix([reference.group()[::-1], replacement[:0:-1]]))
        pieces += [text[done:start], replacement]
        carried += origins[done:start]
        carried += [_union(origins[start : end - tail])] * (len(replacement) - tail) + origins[end - tail : end]
        done = end
    unescaped = "".join(pieces) + text[done:]
    if unescaped != html.unescape(text):
        # a standard library whose unescaping differs from this replay: leave it to the word-by-word cleaning
        return text, origins
    return unescaped, carried + origins[done:]


def _track(
    old: str, origins: List[_Origin], new: str, clean: Callable[[str], str]
) -> Tuple[str, List[_Origin]]:
    """Carry per-character origins from ``old`` to ``new`` = ``clean(old)`` by cleaning ``old`` word by word.

    Cleaning each word on its own keeps a diff from pairing characters of different words (a diff of the whole
    text pairs "&amp; &amp;" -> "& &" wrongly). If the cleaned words do not add up to ``new`` (ftfy judged the
    whole line), every character is only known to come from somewhere in ``old``.
    """
    produced: List[Tuple[str, _Origin]] = []
    for word in _CHUNK.finditer(old):
        cleaned = clean(word.group())
        word_origins = _word_origins(word.group(), origins[word.start() : word.end()], cleaned, clean)
        produced += [(char, origin) for char, origin in zip(cleaned, word_origins) if not char.isspace()]
    solid = [index for index, char in enumerate(new) if not char.isspace()]
    if [char for char, _ in produced] != [new[index] for index in solid]:
        return new, _unknown_origins(origins, len(new))
    # whitespace never becomes part of a token, so it needs no origin
    carried = [_NO_ORIGIN] * len(new)
    for index, (_, origin) in zip(solid, produced):
        carried[index] = origin
    return new, carried


def _word_origins(word: str, origins: List[_Origin], cleaned: str, clean: Callable[[str], str]) -> List[_Origin]:
    """Origins of the characters of ``cleaned`` = ``clean(word)``, from a character diff whose rewritten blocks
    must each split into pieces that clean on their own; otherwise only the word is known as their origin."""
    if cleaned == word:
        return origins
    carried: List[_Origin] = []
    for tag, i1, i2, j1, j2 in SequenceMatcher(None, word, cleaned, autojunk=False).get_opcodes():
        if tag == "equal":
            carried += origins[i1:i2]
            continue
        pieces = _rewrite_pieces(word[i1:i2], cleaned[j1:j2], clean)
        if pieces is None:
            return _unknown_origins(origins, len(cleaned))
        for start, end, n_out in pieces:
            carried += _piece_origins(origins[i1 + start : i1 + end], n_out)
    return carried


def _rewrite_pieces(old: str, new: str, clean: Callable[[str], str]) -> Optional[List[Tuple[int, int, int]]]:
    """Split a diff's rewrite block into the shortest pieces that clean on their own (the diff merges neighbouring
    rewrites, e.g. of an accent and a curly quote), as ``(start, end, output length)`` in ``old``; None when the
    pieces do not produce ``new``."""
    pieces: List[Tuple[int, int, int]] = []
    start, produced = 0, 0
    while start < len(old):
        for end in range(start + 1, min(start + _MAX_REWRITE, len(old)) + 1):
            cleaned = clean(old[start:end])
            if new.startswith(cleaned, produced):
                break
        else:
            return None
        pieces.append((start, end, len(cleaned)))
        start, produced = end, produced + len(cleaned)
    return pieces if produced == len(new) else None


def _piece_origins(piece: List[_Origin], n_out: int) -> List[_Origin]:
    """Origins of the ``n_out`` characters one piece cleans into: one character expanding (ligature), or several
    collapsing into one (mojibake, NFC), has that known origin; many into many is known only as a whole."""
    if not n_out:
        return []
    start, end, exact = _union(piece)
    return [(start, end, exact and (len(piece) == 1 or n_out == 1))] * n_out


def _unknown_origins(origins: List[_Origin], n_out: int) -> List[_Origin]:
    """``n_out`` characters known only to come from somewhere in ``origins``."""
    start, end, _ = _union(origins) if origins else _NO_ORIGIN
    return [(start, end, False)] * n_out


@lru_cache(maxsize=_WORD_CACHE_SIZE)
def _clean_word(word: str) -> str:
    """``basic_clean`` of a word or piece, skipping ftfy where the fast path shows it is the identity; cached,
    as the same few rewritten pieces (quotes, accented letters) recur across captions."""
    return word if _NEEDS_TRACKING.search(word) is None else basic_clean(word)


def _track_lower(text: str, origins: List[_Origin]) -> Tuple[str, List[_Origin]]:
    """Lowercase ``text`` carrying origins; each character keeps its origin, also when it expands ("İ")."""
    lowered = text.lower()
    if len(lowered) == len(text):
        # str.lower maps every character to at least one, so equal length means one to one
        return lowered, origins
    pieces = [char.lower() for char in text]
    if "".join(pieces) != lowered:
        # the final-sigma rule makes lowercasing context dependent
        return _track(text, origins, lowered, str.lower)
    return lowered, [origin for piece, origin in zip(pieces, origins) for _ in piece]


def _union(origins: Sequence[_Origin]) -> _Origin:
    """Smallest span containing all ``origins``; exact only if all of them are."""
    starts, ends, exact = zip(*origins)
    return min(starts), max(ends), all(exact)


def _bounds(span: Any) -> Tuple[int, int]:
    """``(start, end)`` of a pair or of an object with ``.start``/``.end`` (the scene-graph parser's ``Span``)."""
    if hasattr(span, "end"):
        return span.start, span.end
    start, end = span
    return start, end


def _token_mask(alignment: TokenAlignment, spans: Sequence[Any], context_length: int) -> np.ndarray:
    """Positions of the kept tokens whose origin matches one of ``spans``."""
    bounds = [_bounds(span) for span in spans]
    mask = np.zeros(context_length, dtype=bool)
    # The tokenizer keeps SOT + the first context_length - 2 tokens and puts EOT in the last slot.
    for position, origin in enumerate(alignment.origins[: max(context_length - 2, 0)], start=1):
        if _matches(origin, bounds):
            mask[position] = True
    return mask


def _matches(origin: _Origin, bounds: List[Tuple[int, int]]) -> bool:
    """Exact origins match on overlap; inexact ones (supersets) only when inside a span, to stay conservative."""
    start, end, exact = origin
    if start >= end:
        # an empty span overlaps nothing
        return False
    for bound_start, bound_end in bounds:
        if (start < bound_end and bound_start < end) if exact else (bound_start <= start and end <= bound_end):
            return True
    return False
