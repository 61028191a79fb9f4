"""Scorers: each unique image and text is encoded once; scores equal a direct computation; prompt ensembles."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from datamodules.benchmarks.base import ImageRef
from datamodules.benchmarks.images import load_image
from datamodules.benchmarks.standin.images import write_image
from lightning_modules.scorers import ClipScorer, EmbeddingScorer, FunctionScorer


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
    np.testing.assert_allclose(first, [[1.0, 0.0], [s, s]], atol=1e-6)
    np.testing.assert_allclose(again, [[s, s], [0.0, 1.0], [0.0, 1.0]], atol=1e-6)


def test_prompt_ensemble_is_the_renormalised_mean_embedding():
    images, texts = tables()
    scorer = CountingScorer(images, texts)
    result = scorer.score_groups([ImageRef("b")], [["x", "y"], ["z"]])
    mean = F.normalize((F.normalize(texts["x"], dim=0) + F.normalize(texts["y"], dim=0)) / 2, dim=0)
    expected = float(F.normalize(images["b"], dim=0) @ mean)
    np.testing.assert_allclose(result, [[expected, 1.0]], atol=1e-6)
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
                               [0.0, 2 ** -0.5], atol=1e-6)


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
    np.testing.assert_allclose(result, (image @ text.T).numpy(), atol=1e-5)
    assert not np.allclose(result[0], result[3])
    assert load_image(refs[3]).size == (20, 16)
    assert scorer.describe()["activation"] == "gelu" and scorer.describe()["precision"] == "fp32"


def test_openai_weights_are_scored_with_quickgelu(monkeypatch):
    """The QuickGELU trap: an OpenAI-derived name is built as -quickgelu (weights are not downloaded here)."""
    from lightning_modules.encoders import canonical_model_name

    assert canonical_model_name("ViT-B-32", "openai") == "ViT-B-32-quickgelu"
    import open_clip

    model = open_clip.create_model("ViT-B-32-quickgelu")
    scorer = ClipScorer(model, open_clip.get_tokenizer("ViT-B-32-quickgelu"), lambda image: image)
    assert scorer.describe()["activation"] == "quickgelu"


def test_unknown_precision_is_rejected():
    with pytest.raises(ValueError, match="precision"):
        ClipScorer(torch.nn.Linear(1, 1), None, None, precision="fp8")
