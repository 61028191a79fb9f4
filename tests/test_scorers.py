"""Scorers: each unique image and text is encoded once; scores equal a direct computation; prompt ensembles."""
from __future__ import annotations

import json
from typing import Sequence

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from evaluation.benchmarks.base import ImageRef
from evaluation.benchmarks.images import load_image
from testkit.standin.images import write_image
from evaluation.scorers import ClipScorer, EmbeddingScorer, FunctionScorer, Scorer


class CountingScorer(EmbeddingScorer):
    """Embeddings from fixed tables; records every batch it is asked to embed."""

    def __init__(self, image_table: dict, text_table: dict):
        super().__init__()
        self.image_table, self.text_table = image_table, text_table
        self.image_calls, self.text_calls = [], []

    def embed_images(self, refs: Sequence[ImageRef], progress: bool) -> torch.Tensor:
        self.image_calls.append(list(refs))
        return torch.stack([self.image_table[ref.path] for ref in refs])

    def embed_texts(self, texts: Sequence[str], progress: bool) -> torch.Tensor:
        self.text_calls.append(list(texts))
        return torch.stack([self.text_table[text] for text in texts])


def tables():
    images = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([1.0, 1.0])}
    texts = {"x": torch.tensor([1.0, 0.0]), "y": torch.tensor([0.0, 2.0]), "z": torch.tensor([1.0, 1.0])}
    return images, texts


def test_embedding_scorer_encodes_each_unique_input_once_and_scores_cosines():
    images, texts = tables()
    scorer = CountingScorer(images, texts)
    a, b = ImageRef("a"), ImageRef("b")
    scorer.prepare([a, b, a], ["x", "y", "x"])
    first = scorer.score([a, b], ["x", "y"])
    again = scorer.score([b, a, a], ["y", "x"])
    scorer.score([a], ["z"])  # a new text is embedded on demand, alone
    assert scorer.image_calls == [[a, b]] and scorer.text_calls == [["x", "y"], ["z"]]
    s = 2 ** -0.5
    # float32 cosines: rounding ~1e-7 of |a| |b| = 1 whatever the cosine's size (0 among them), so atol = rtol
    np.testing.assert_allclose(first, [[1.0, 0.0], [s, s]], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(again, [[s, s], [0.0, 1.0], [0.0, 1.0]], rtol=1e-6, atol=1e-6)


def test_prompt_ensemble_is_the_renormalised_mean_embedding():
    images, texts = tables()
    scorer = CountingScorer(images, texts)
    result = scorer.score_groups([ImageRef("b")], [["x", "y"], ["z"]])
    mean = F.normalize((F.normalize(texts["x"], dim=0) + F.normalize(texts["y"], dim=0)) / 2, dim=0)
    expected = float(F.normalize(images["b"], dim=0) @ mean)
    np.testing.assert_allclose(result, [[expected, 1.0]], rtol=1e-6, atol=1e-6)  # float32 cosines
    assert expected == pytest.approx(1.0)  # b is at 45 degrees, as is the mean of x and y


def test_function_scorer_and_its_group_average():
    scorer = FunctionScorer(lambda ref, text: len(text) * (2.0 if ref.path == "a" else 1.0))
    np.testing.assert_array_equal(scorer.score([ImageRef("a"), ImageRef("b")], ["x", "yy"]), [[2, 4], [1, 2]])
    np.testing.assert_array_equal(scorer.score_groups([ImageRef("a")], [["x", "yyy"], ["yy"]]), [[4, 4]])
    with pytest.raises(NotImplementedError, match="STS needs an embedding scorer"):
        scorer.text_similarity(["a"], ["b"])


def test_text_similarity_is_the_pairwise_cosine():
    images, texts = tables()
    np.testing.assert_allclose(CountingScorer(images, texts).text_similarity(["x", "x"], ["y", "z"]),
                               [0.0, 2 ** -0.5], rtol=1e-6, atol=1e-6)  # float32 cosines, one of them 0


def test_clip_scorer_equals_open_clip_features(tmp_path):
    torch.manual_seed(0)
    scorer = ClipScorer.from_pretrained("ViT-Tiny-16-64", None, batch_size=2)
    refs = [ImageRef(str(write_image(tmp_path / f"{i}.png", seed=i))) for i in range(3)]
    refs.append(ImageRef(refs[0].path, box=(4, 4, 20, 16)))  # a crop is a different image
    texts = ["a red square", "a blue circle", "two dogs"]
    result = scorer.score(refs, texts)
    with torch.no_grad():
        pixels = torch.stack([scorer.preprocess(load_image(ref)) for ref in refs])
        image = F.normalize(scorer.model.encode_image(pixels), dim=-1)
        text = F.normalize(scorer.model.encode_text(scorer.tokenizer(texts)), dim=-1)
    # cosines of features encoded in other batches (batch_size=2): rounding ~1e-6 of |a| |b| = 1, not of the
    # cosine (those of a random-init model are ~0.02-0.2), hence atol = rtol
    np.testing.assert_allclose(result, (image @ text.T).numpy(), rtol=1e-5, atol=1e-5)
    assert not np.allclose(result[0], result[3])
    assert load_image(refs[3]).size == (20, 16)
    assert scorer.describe()["activation"] == "gelu" and scorer.describe()["precision"] == "32-true"


def test_openai_weights_are_scored_with_quickgelu(monkeypatch):
    """The QuickGELU trap: an OpenAI-derived name is built as -quickgelu (weights are not downloaded here)."""
    from modeling.encoders import canonical_model_name

    assert canonical_model_name("ViT-B-32", "openai") == "ViT-B-32-quickgelu"
    import open_clip

    model = open_clip.create_model("ViT-B-32-quickgelu")
    scorer = ClipScorer(model, open_clip.get_tokenizer("ViT-B-32-quickgelu"), lambda image: image)
    assert scorer.describe()["activation"] == "quickgelu"


def test_unknown_precision_is_rejected_and_a_renamed_one_names_lightnings():
    with pytest.raises(ValueError, match="precision"):
        ClipScorer(torch.nn.Linear(1, 1), None, None, precision="fp8")
    with pytest.raises(ValueError, match="'fp32' was renamed: use 32-true"):
        ClipScorer(torch.nn.Linear(1, 1), None, None, precision="fp32")


class RecordingScorer(Scorer):
    """Scores from a function of (image, text); records what reaches `score_unique` / `score_unique_groups`."""

    def __init__(self):
        self.calls, self.group_calls = [], []

    def score_unique(self, images, texts):
        self.calls.append((list(images), list(texts)))
        return np.array([[len(image.path) * 10.0 + len(text) for text in texts] for image in images])

    def score_unique_groups(self, images, text_groups):
        self.group_calls.append((list(images), [tuple(group) for group in text_groups]))
        return super().score_unique_groups(images, text_groups)


def test_duplicates_are_scored_once_and_indexed_back_in_order():
    scorer = RecordingScorer()
    a, b = ImageRef("a"), ImageRef("bb")
    result = scorer.score([b, a, b], ["xyz", "x", "xyz", "xy"])
    assert scorer.calls[0] == ([b, a], ["xyz", "x", "xy"])  # distinct values only, first-seen order
    np.testing.assert_array_equal(result, [[23, 21, 23, 22], [13, 11, 13, 12], [23, 21, 23, 22]])
    groups = scorer.score_groups([a, a], [["x", "xy"], ["xyz"], ["x", "xy"]])
    assert scorer.group_calls == [([a], [("x", "xy"), ("xyz",)])]
    np.testing.assert_array_equal(groups, [[11.5, 13, 11.5], [11.5, 13, 11.5]])
    assert scorer.score([], ["x"]).shape == (0, 1)


def random_refs(folder, count: int) -> list:
    return [ImageRef(str(write_image(folder / f"{i}.png", seed=i))) for i in range(count)]


def test_clip_scorer_gives_identical_candidates_bit_identical_scores(tmp_path):
    """Identical texts (images) are ties, exactly: one distinct text per column of the matrix product."""
    torch.manual_seed(0)
    scorer = ClipScorer.from_pretrained("ViT-Tiny-16-64", None, batch_size=3)
    refs = random_refs(tmp_path, 3)
    texts = ["a red square", "a red square", "a blue circle", "a red square"]
    images = [refs[0], refs[1], refs[0], refs[2]]
    scorer.prepare(images, texts)
    result = scorer.score(images, texts)
    assert (result[:, 0] == result[:, 1]).all() and (result[:, 0] == result[:, 3]).all()
    assert (result[0] == result[2]).all()
    prompts = [["a photo of a {}.".format(name)] for name in ("cat", "dog", "cat")]  # a repeated class name
    groups = scorer.score_groups(refs, prompts)
    assert (groups[:, 0] == groups[:, 2]).all() and not (groups[:, 0] == groups[:, 1]).all()


def test_identical_candidates_are_ties_and_wrong_through_real_benchmarks(tmp_path):
    """SugarCrepe / VL-CheckList items whose negative equals the positive, and a COCO-Order item with a
    perturbation equal to the caption, scored by the real CLIP scorer: ties, so never correct (strict `>`)."""
    from dataclasses import replace

    from evaluation.benchmarks.aro import COCOOrder
    from testkit.standin.aro import write_aro_coco_order
    from testkit.standin.sugarcrepe import write_sugarcrepe
    from testkit.standin.vlchecklist import write_vl_checklist
    from evaluation.benchmarks.sugarcrepe import SugarCrepe
    from evaluation.benchmarks.vlchecklist import VLCheckList

    torch.manual_seed(0)
    scorer = ClipScorer.from_pretrained("ViT-Tiny-16-64", None)
    root = tmp_path / "sugarcrepe"
    write_sugarcrepe(root, n_items=14)
    for subset in ("replace_obj", "swap_att"):  # every negative made equal to its caption
        path = root / f"{subset}.json"
        entries = json.loads(path.read_text())
        path.write_text(json.dumps({k: {**e, "negative_caption": e["caption"]} for k, e in entries.items()}))
    outcomes = SugarCrepe(root).outcomes(scorer)
    identical = [o for o in outcomes if o["subset"] in ("replace_obj", "swap_att")]
    assert identical and not any(o["correct"] for o in identical) and all(o["tie"] for o in identical)
    assert SugarCrepe.aggregate(outcomes)["ties"] == len(identical)

    checklist = VLCheckList(tmp_path / "vlc", **write_vl_checklist(tmp_path / "vlc", n_items=2))
    for item in checklist.items()[:20]:
        tie = checklist.outcome(item, scorer.score(item.images, [item.texts[0], item.texts[0]]))
        assert tie["tie"] is True and tie["correct"] is False

    order = COCOOrder(tmp_path / "aro", **write_aro_coco_order(tmp_path / "aro", n_items=6))
    for item in order.items():
        same = replace(item, texts=[item.texts[0]] * 2 + item.texts[2:])
        similarity = scorer.score(same.images, same.texts)
        assert similarity[0, 0] == similarity[0, 1] and order.outcome(same, similarity)["correct"] is False


def test_trimmed_text_tower_equals_open_clip_on_mixed_lengths():
    """Texts sorted by length, each batch cut after its last EOS: the embeddings of the full 77-position tower."""
    torch.manual_seed(0)
    scorer = ClipScorer.from_pretrained("ViT-Tiny-16-64", None, batch_size=2)
    assert scorer.trimmed_text is not None
    texts = ["a dog", " ".join(["red"] * 100), "two cats on a mat next to a small red car", "x",
             "a man riding a horse on the beach at sunset", "a dog"[::-1]]  # one text past the 77-token context
    lengths = []
    scorer.trimmed_text.model.token_embedding.register_forward_hook(lambda m, i, o: lengths.append(i[0].shape[1]))
    trimmed = scorer.embed_texts(texts, False)
    with torch.no_grad():
        full = scorer.model.encode_text(scorer.tokenizer(texts))
    assert lengths == sorted(lengths) and lengths[0] < 10 and lengths[-1] == 77  # short batches first
    torch.testing.assert_close(trimmed, full, rtol=1e-5, atol=1e-5 * full.abs().max().item())
    untrimmed = ClipScorer(scorer.model, scorer.tokenizer, scorer.preprocess, batch_size=2, trim_text=False)
    assert untrimmed.trimmed_text is None
    torch.testing.assert_close(untrimmed.embed_texts(texts, False), full, rtol=1e-6,
                               atol=1e-6 * full.abs().max().item())


def test_text_towers_that_are_not_clips_are_not_trimmed():
    assert ClipScorer(torch.nn.Linear(1, 1), None, None).trimmed_text is None


# Captions with punctuation that BLIP's pre_caption keeps (",", "'s", "&", "-", "?"); an ARO-Order perturbation
# re-joins spaCy's tokens with spaces, so its text differs from the caption's only around them.
PUNCTUATED = ["A plate of vegetables, chicken and rice.", "A man's dog, a cat and a bird on a bench.",
              "Fish & chips, with peas, on a table.", "A black-and-white photo of a bus, parked.",
              "What is that? A giraffe, eating leaves.", "Two cats, one dog, three birds and a horse."]


def spaced(text: str) -> str:
    """The text with its punctuation re-joined as separate tokens, as the perturbations write them."""
    text = text.replace("'s", " 's")  # spaCy's clitic token
    for mark in (",", "&", "-", "?"):
        text = text.replace(mark, f" {mark} ")
    return " ".join(text.split())


def test_a_perturbation_differing_only_in_spaces_around_punctuation_is_a_counted_tie(tmp_path):
    """COCO-Order items, each with one perturbation that is the caption re-spaced around its punctuation (the
    CLIP tokenizer gives both the same ids), scored by the real CLIP scorer: every one is a tie, exactly, so
    none is correct, and the aggregate counts them."""
    import hashlib

    from evaluation.benchmarks.aro import COCOOrder, pre_caption
    from testkit.standin.aro import write_aro_coco_order

    root = tmp_path / "aro"
    options = write_aro_coco_order(root, n_items=2 * len(PUNCTUATED))
    annotation = root / COCOOrder.annotation_file
    records = json.loads(annotation.read_text())
    captions = iter(PUNCTUATED * 2)
    records = [{**record, "caption": [next(captions) for _ in record["caption"]]} for record in records]
    annotation.write_text(json.dumps(records))
    benchmark = COCOOrder(root, **options)
    texts = []
    for index, caption in enumerate(PUNCTUATED * 2):
        clean = pre_caption(caption)
        # Other strings with the caption's token ids (the tokenizer collapses and strips whitespace), so that a
        # tie is also the best of the negatives: the re-spaced copy visits each of the 4 negative columns.
        others = [clean + " ", "  " + clean, clean.replace(" ", "  ", 1)]
        others.insert(index % 4, spaced(clean))
        texts.append([clean] + others)
    raw = [caption for record in records for caption in record["caption"]]
    benchmark.cache_path.write_text(json.dumps({"captions_sha1": hashlib.sha1(json.dumps(raw).encode()).hexdigest(),
                                                "texts": texts}))
    torch.manual_seed(0)
    scorer = ClipScorer.from_pretrained("ViT-Tiny-16-64", None)
    for options_of_item in texts:
        assert len(set(options_of_item)) == 5  # five strings,
        assert all(torch.equal(scorer.tokenizer([text]), scorer.tokenizer(options_of_item[:1]))
                   for text in options_of_item)  # one sequence of token ids

    outcomes = benchmark.outcomes(scorer)
    assert [item.texts for item in benchmark.items()] == texts
    assert len(scorer.texts.row) == len(PUNCTUATED)  # one embedding per token sequence, not per string
    assert all(o["tie"] and not o["correct"] for o in outcomes), [o for o in outcomes if not o["tie"]]
    assert not any(o["perturbation_equals_caption"] for o in outcomes)  # the strings differ
    aggregate = COCOOrder.aggregate(outcomes)
    assert aggregate["ties"] == len(texts) and aggregate["precision_at_1"] == 0.0
    assert scorer.text_keys([texts[0][0]]) == scorer.text_keys([spaced(texts[0][0])])


def test_an_image_is_embedded_once_per_content_whatever_its_path_or_container(tmp_path):
    """Benchmarks take the same photos from other datasets, each from its own folder or container (a COCO image
    under SugarCrepe's and What'sUp's folders, inside BiVLC's parquet): one embedding per content and crop."""
    import zipfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    photo = write_image(tmp_path / "sugarcrepe" / "val2017" / "000000000139.jpg", seed=1)
    other = write_image(tmp_path / "other.png", seed=2)
    copy = tmp_path / "whatsup" / "val2017" / "000000000139.jpg"
    copy.parent.mkdir(parents=True)
    copy.write_bytes(photo.read_bytes())
    table = pa.table({"image": [{"bytes": photo.read_bytes(), "path": "000000000139.jpg"}]})
    pq.write_table(table, tmp_path / "bivlc.parquet")
    with zipfile.ZipFile(tmp_path / "test.zip", "w") as archive:
        archive.writestr("images/a.jpg", photo.read_bytes())
    refs = [ImageRef(str(photo)), ImageRef(str(copy)), ImageRef(str(tmp_path / "bivlc.parquet"), member="image:0"),
            ImageRef(str(tmp_path / "test.zip"), member="images/a.jpg"), ImageRef(str(other)),
            ImageRef(str(photo), box=(0, 0, 20, 20))]
    embedded = []

    class Recording(EmbeddingScorer):
        def embed_images(self, batch, progress):
            embedded.extend(batch)
            return torch.stack([torch.tensor(np.asarray(load_image(ref), dtype=np.float32).mean(axis=(0, 1)))
                                for ref in batch])

        def embed_texts(self, texts, progress):
            return torch.ones(len(texts), 3)

    scorer = Recording()
    scorer.prepare(refs[:3], ["a cat"])
    scorer.prepare(refs, ["a cat"])  # a second benchmark: only new contents are embedded
    assert embedded == [refs[0], refs[4], refs[5]]  # the photo once, the other image, the crop of the photo
    assert scorer.embedded == {"images": 3, "texts": 1, "image_refs": 9}
    similarity = scorer.score(refs, ["a cat"])[:, 0]
    assert similarity[0] == similarity[1] == similarity[2] == similarity[3]
    assert similarity[4] != similarity[0] and similarity[5] != similarity[0]
