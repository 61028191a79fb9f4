"""The model zoo: every published checkpoint loads by its format into its architecture, strictly; evaluation,
training, interpolation and the trade-off take zoo models; docs/zoo.md is what the table generates."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import open_clip
import pytest
import torch

from modeling import checkpoints
from modeling.encoders import build_model, register_model_configs
from modeling.published import load_zoo_base, load_zoo_model
from core.zoo import ENTRIES, SOURCES, ZOO, ZooEntry, markdown, zoo_entry

REPO = Path(__file__).resolve().parents[1]
TINY = "ViT-Tiny-16-64"


@pytest.fixture(autouse=True)
def tiny_configs():
    register_model_configs(str(REPO / "configs" / "models"))


def tiny_entry(**changes) -> ZooEntry:
    """A zoo entry of the tiny test architecture (the real ones are ViT-B models)."""
    fields = dict(name="tiny", title="Tiny", paper="p", code="c", weights="w", format="open_clip",
                  architecture=TINY, base="none")
    return ZooEntry(**{**fields, **changes})


def random_model(seed: int, **kwargs):
    torch.manual_seed(seed)
    return open_clip.create_model(TINY, pretrained=None, **kwargs).eval()


def features(model, context_length: int = 77):
    torch.manual_seed(123)
    images = torch.randn(2, 3, 64, 64)
    texts = open_clip.tokenize(["a red cube left of a blue ball", "a dog"], context_length=context_length)
    with torch.no_grad():
        return model.encode_image(images), model.encode_text(texts)


def assert_same_features(first, second, context_length: int = 77):
    for a, b in zip(features(first, context_length), features(second, context_length)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ----- the table -------------------------------------------------------------------------------------------------
def test_the_zoo_lists_every_published_checkpoint_with_its_source():
    names = {"negclip", "ce_clip", "gnm_clip", "clove", "dac_llm", "dac_sam", "tsvlc_rb", "tsvlc_rb_llm", "fsc_clip",
             "fsc_clip_lora", "clip_cae", "macco_clip", "smartclip"}
    assert names <= set(ZOO)
    for entry in ENTRIES:
        assert entry.paper and entry.code and entry.weights, entry.name
        assert entry.format is None or entry.format in checkpoints.FORMATS, entry.name
        assert all(r.source in SOURCES for r in entry.reported), entry.name
        if entry.base == "openai":  # fine-tuned from OpenAI's weights: QuickGELU, as they were trained
            assert entry.architecture.endswith("-quickgelu"), entry.name
        assert open_clip.get_model_config(entry.architecture) is not None, entry.name
    assert ZOO["clove"].context_length == 64 and ZOO["dac_llm"].lora_scale == 0.25


def test_unknown_and_unreleased_checkpoints_are_refused_by_name():
    with pytest.raises(KeyError, match="unknown zoo checkpoint 'negclp'; the zoo holds: negclip"):
        zoo_entry("zoo:negclp")
    with pytest.raises(ValueError, match="zoo:smartclip .*cannot be loaded: no released CLIP weights"):
        zoo_entry("smartclip")


def test_the_zoo_page_is_what_the_table_generates():
    page = REPO / "docs" / "zoo.md"
    assert page.read_text(encoding="utf-8") == markdown(), "docs/zoo.md is out of date: python -m core.zoo"


# ----- loading ---------------------------------------------------------------------------------------------------
def test_a_training_checkpoint_loads_by_its_entry_and_a_wrong_key_is_named(tmp_path):
    original = random_model(1)
    path = tmp_path / "negclip.pth"
    torch.save({"epoch": 5, "name": "negclip", "state_dict": original.state_dict(), "optimizer": {}}, path)
    built = load_zoo_model(tiny_entry(), str(path))
    assert built.name == TINY
    assert_same_features(built.model, original)
    state = original.state_dict()
    state["visual.extra.weight"] = torch.zeros(1)
    torch.save({"state_dict": state}, path)
    with pytest.raises(checkpoints.CheckpointMismatch, match="visual.extra.weight"):
        load_zoo_model(tiny_entry(), str(path))
    with pytest.raises(FileNotFoundError, match="download it from w"):
        load_zoo_model(tiny_entry(), str(tmp_path / "absent.pth"))


def test_a_64_token_context_is_kept_and_named_and_the_wise_ft_patch_is_applied(tmp_path):
    """CLoVe: its file has 64 positions; the published model is 0.4 base + 0.6 file, the base cut to 64."""
    base = random_model(2)
    fine = random_model(3, force_context_length=64)
    path = tmp_path / "clove.pt"
    torch.save({"state_dict": {f"module.{k}": v for k, v in fine.state_dict().items()}}, path)
    entry = tiny_entry(context_length=64, wise_ft=0.6, format="wrappers")
    built = load_zoo_model(entry, str(path), base_state=base.state_dict())
    assert built.name == f"{TINY}-ctx64" and built.config["text_cfg"]["context_length"] == 64
    assert built.model.positional_embedding.shape[0] == 64
    assert built.tokenizer(["a cube"]).shape == (1, 64)
    expected = (0.4 * base.positional_embedding.detach()[:64].double()
                + 0.6 * fine.positional_embedding.detach().double())
    torch.testing.assert_close(built.model.positional_embedding.detach().double(), expected, rtol=1e-6, atol=1e-6)
    unpatched = load_zoo_model(tiny_entry(context_length=64, format="wrappers"), str(path))
    assert_same_features(unpatched.model, fine, context_length=64)


def test_a_lora_file_merges_and_a_delta_only_file_takes_its_base(tmp_path):
    base = random_model(4)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    width = base.transformer.width
    torch.manual_seed(5)
    a, b = torch.randn(4, width), torch.randn(width * 4, 4)
    state["transformer.resblocks.0.mlp.c_fc.lora_A"], state["transformer.resblocks.0.mlp.c_fc.lora_B"] = a, b
    path = tmp_path / "dac.pt"
    torch.save({"state_dict": state}, path)
    built = load_zoo_model(tiny_entry(format="lora", lora_scale=0.25), str(path))
    merged = base.transformer.resblocks[0].mlp.c_fc.weight.detach().double() + 0.25 * (b.double() @ a.double())
    torch.testing.assert_close(built.model.transformer.resblocks[0].mlp.c_fc.weight.detach().double(), merged,
                               rtol=1e-6, atol=1e-6)


def test_build_model_takes_zoo_specs_and_checks_the_model_name(tmp_path, monkeypatch):
    original = random_model(6)
    path = tmp_path / "model.pt"
    torch.save(original.state_dict(), path)
    monkeypatch.setitem(ZOO, "tiny", tiny_entry())
    assert_same_features(build_model("zoo:tiny", str(path)).model, original)
    assert_same_features(build_model(TINY, f"zoo:tiny:{path}").model, original)
    with pytest.raises(ValueError, match=f"zoo:tiny loads into {TINY}, but the model name is 'ViT-B-32'"):
        build_model("ViT-B-32", f"zoo:tiny:{path}")
    with pytest.raises(ValueError, match="expected zoo:NAME:FILE"):
        build_model(TINY, "zoo:tiny")


def test_the_zoo_base_is_the_interpolation_start_built_as_the_checkpoint(tmp_path):
    base, fine = random_model(7), random_model(8, force_context_length=64)
    base_file = tmp_path / "base.pt"
    torch.save(base.state_dict(), base_file)
    start = load_zoo_base(tiny_entry(context_length=64), str(base_file))
    assert start.name == f"{TINY}-ctx64"
    torch.testing.assert_close(start.model.positional_embedding, base.positional_embedding[:64])
    del fine


def test_evaluate_scores_a_zoo_model_and_records_which(tmp_path, monkeypatch):
    from evaluation import evaluate
    from testkit.standin import STANDINS

    original = random_model(9)
    path = tmp_path / "negclip.pth"
    torch.save({"state_dict": original.state_dict()}, path)
    monkeypatch.setitem(ZOO, "tiny", tiny_entry())
    STANDINS["sugarcrepe"](tmp_path / "bench" / "sugarcrepe", n_items=14, seed=0)
    out = tmp_path / "eval"
    evaluate.main(["--model", "zoo:tiny", "--pretrained", str(path), "--benchmarks", "sugarcrepe", "--data-root",
                   str(tmp_path / "bench"), "--out", str(out), "--num-workers", "0", "--no-progress"])
    metadata = json.loads((out / "sugarcrepe" / "metadata.json").read_text())["metadata"]
    assert metadata["zoo"] == "tiny" and metadata["model"] == TINY and len(metadata["weights_sha256"]) == 64


def test_evaluate_interpolates_a_zoo_model_with_its_base(tmp_path, monkeypatch):
    from evaluation import evaluate
    from testkit.standin import STANDINS

    base, fine = random_model(10), random_model(11)
    base_file, path = tmp_path / "base.pt", tmp_path / "fine.pt"
    torch.save(base.state_dict(), base_file)
    torch.save(fine.state_dict(), path)
    monkeypatch.setitem(ZOO, "tiny", tiny_entry(base=str(base_file)))
    STANDINS["sugarcrepe"](tmp_path / "bench" / "sugarcrepe", n_items=14, seed=0)
    out = tmp_path / "eval"
    evaluate.main(["--model", "zoo:tiny", "--pretrained", str(path), "--alphas", "0,1", "--benchmarks", "sugarcrepe",
                   "--data-root", str(tmp_path / "bench"), "--out", str(out), "--num-workers", "0", "--no-progress"])
    scored = {alpha: json.loads((out / f"alpha-{alpha}" / "aggregates.json").read_text()) for alpha in ("0", "1")}
    assert scored["0"]["metadata"]["wise_ft"]["pretrained"] == str(base_file)
    from evaluation.scorers import ClipScorer
    from evaluation.harness import run_benchmark
    from evaluation.benchmarks import build_benchmark

    for alpha, model in (("0", base), ("1", fine)):  # each end scores as that model itself
        built = build_model(TINY, None)
        built.model = copy.deepcopy(model)
        direct = run_benchmark(build_benchmark("sugarcrepe", tmp_path / "bench" / "sugarcrepe"),
                               ClipScorer.from_built(built))
        assert scored[alpha]["benchmarks"]["sugarcrepe"]["aggregates"]["overall_micro"] == \
            pytest.approx(direct.aggregates["overall_micro"])


# ----- Hugging Face CLIPModel folders -----------------------------------------------------------------------------
def test_an_hf_folder_builds_as_the_named_model_or_under_its_shape_and_a_wrong_name_is_refused(tmp_path):
    from modeling.hf_clip import open_clip_to_hf

    original = random_model(12)
    folder = open_clip_to_hf(original, open_clip.get_model_config(TINY), tmp_path / "hf")
    named = build_model(TINY, f"hf:{folder}")
    assert named.name == TINY
    assert_same_features(named.model, original)
    texts = ["a red cube", "two dogs!"]
    assert torch.equal(named.tokenizer(texts), open_clip.get_tokenizer(TINY)(texts))
    derived = build_model("hf", f"hf:{folder}")
    assert derived.name == "HF-ViT-2x128-p16-64-text-2x64-ctx77"
    assert_same_features(derived.model, original)
    with pytest.raises(ValueError, match=r"is not a ViT-B-32: .*vision_cfg.layers: 12 -> 2"):
        build_model("ViT-B-32", f"hf:{folder}")


def test_evaluate_scores_an_hf_folder_and_records_its_weights_hash(tmp_path):
    from modeling.hf_clip import open_clip_to_hf
    from evaluation import evaluate
    from testkit.standin import STANDINS

    folder = open_clip_to_hf(random_model(13), open_clip.get_model_config(TINY), tmp_path / "hf")
    STANDINS["sugarcrepe"](tmp_path / "bench" / "sugarcrepe", n_items=14, seed=0)
    out = tmp_path / "eval"
    evaluate.main(["--model", TINY, "--pretrained", f"hf:{folder}", "--benchmarks", "sugarcrepe", "--data-root",
                   str(tmp_path / "bench"), "--out", str(out), "--num-workers", "0", "--no-progress"])
    metadata = json.loads((out / "sugarcrepe" / "metadata.json").read_text())["metadata"]
    assert metadata["weights_folder"] == str(folder) and len(metadata["weights_sha256"]) == 64


def test_a_run_export_holds_an_hf_folder_and_a_run_can_start_from_a_zoo_checkpoint(tmp_path, monkeypatch):
    """Training takes `model.pretrained=zoo:NAME:FILE`: the run starts from the checkpoint's weights."""
    from modeling.backbone import build_backbone

    original = random_model(14)
    path = tmp_path / "negclip.pth"
    torch.save({"epoch": 1, "state_dict": original.state_dict()}, path)
    monkeypatch.setitem(ZOO, "tiny", tiny_entry())
    built, _ = build_backbone({"name": TINY, "pretrained": f"zoo:tiny:{path}", "config_dir": None})
    assert_same_features(built.model, original)


def test_a_64_token_context_survives_export_and_its_hf_copy(tmp_path):
    """CLoVe's context is kept through the export (its own config and name) and the Hugging Face copy."""
    from transformers import CLIPModel

    from modeling.export import export_model, load_export

    fine = random_model(15, force_context_length=64)
    path = tmp_path / "clove.pt"
    torch.save(fine.state_dict(), path)
    built = load_zoo_model(tiny_entry(context_length=64), str(path))
    export_model(built.model, built.name, tmp_path / "export", model_config=built.config)
    again = load_export(tmp_path / "export")
    assert again.name == f"{TINY}-ctx64" and again.model.positional_embedding.shape[0] == 64
    assert again.tokenizer(["a cube"]).shape == (1, 64)
    assert_same_features(again.model, fine, context_length=64)
    hf = CLIPModel.from_pretrained(tmp_path / "export" / "hf")
    assert hf.config.text_config.max_position_embeddings == 64
    tokens = open_clip.tokenize(["a red cube left of a blue ball"], context_length=64)
    with torch.no_grad():
        torch.testing.assert_close(hf.get_text_features(input_ids=tokens), fine.encode_text(tokens),
                                   rtol=1e-5, atol=1e-5)


def test_a_plain_checkpoint_file_is_read_strictly_never_resized(tmp_path):
    """open_clip's own loader would stretch a 64-position text embedding to 77 without a word (the CLoVe trap);
    a checkpoint file given as pretrained is read strictly instead, wrappers understood."""
    fine = random_model(16, force_context_length=64)
    path = tmp_path / "clove.pt"
    torch.save({"state_dict": fine.state_dict()}, path)
    with pytest.raises(checkpoints.CheckpointMismatch, match="force_context_length=64"):
        build_model(TINY, str(path))
    plain = random_model(17)
    torch.save({"state_dict": {f"module.{k}": v for k, v in plain.state_dict().items()}}, path)
    assert_same_features(build_model(TINY, str(path)).model, plain)
