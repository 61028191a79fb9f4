"""open_clip <-> transformers CLIPModel folders: the same features in both libraries, bit-identical round trips,
the tokenizer's ids, and every mapping or config error refused."""
from __future__ import annotations

import copy
import json
import logging
from typing import Optional

import open_clip
import pytest
import torch
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from safetensors.torch import load_file, save_file
from transformers import CLIPConfig, CLIPModel, CLIPProcessor, CLIPTokenizer, CLIPTokenizerFast

from modeling.checkpoints import CheckpointMismatch
from modeling.encoders import register_model_configs
from modeling.export import export_model, load_export, read_export_metadata
from modeling.hf_clip import UnsupportedModel, hf_preprocess_cfg, hf_to_open_clip, open_clip_to_hf
from tolerance import assert_scaled_close, scaled_close

# The same float32 towers run by two libraries' kernels: ~1e-6 of the largest feature apart (a wrong tensor
# moves them by 1e-2 or more, see test_a_wrong_mapping_changes_the_features).
RTOL = 1e-5
TINY = "ViT-Tiny-16-64"
# Captions of different lengths: the shorter ones are padded with 0 after their EOS.
CAPTIONS = ["a dog", "A Photo of TWO cats on a mat, next to a red ball!", "café au lait", "x"]
LONG = "a very long caption " * 30  # longer than any context: truncated, ending in the EOS
# Punctuation, case, spacing, apostrophes, accents, emoji and CJK; "!" is id 0, the pad token, in some contexts.
TOKENIZER_CAPTIONS = ["a dog", "Wow! A DOG!!", "two  dogs,   one cat.", "café naïve résumé", "emoji 🐶 and 日本語",
                      "it's the cat's toy; don't", "! ! !", LONG]


def tiny_config(**text_cfg) -> dict:
    register_model_configs("configs/models")
    config = copy.deepcopy(open_clip.get_model_config(TINY))
    config["text_cfg"].update(text_cfg)
    return config


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter moved off its initialisation: zero biases and unit LayerNorm weights would hide a
    swapped bias or norm."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator))
    return model.eval()


def build(config: dict, seed: int = 0) -> open_clip.CLIP:
    torch.manual_seed(seed)
    return perturbed(open_clip.CLIP(**config), seed)


def inputs(model: open_clip.CLIP):
    ids = open_clip.tokenize(CAPTIONS, context_length=model.context_length)
    size = model.visual.image_size[0]
    return ids, torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))


def load_hf(folder) -> CLIPModel:
    """CLIPModel.from_pretrained, refusing any missing, unexpected or misshapen tensor."""
    model, info = CLIPModel.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    return model.eval()


def assert_same_features(hf: CLIPModel, model: open_clip.CLIP, ids=None) -> None:
    default_ids, images = inputs(model)
    ids = default_ids if ids is None else ids
    with torch.no_grad():
        assert_scaled_close(hf.get_text_features(input_ids=ids), model.encode_text(ids), RTOL)
        assert_scaled_close(hf.get_image_features(pixel_values=images), model.encode_image(images), RTOL)


def assert_bit_identical(state: dict, expected: dict) -> None:
    assert sorted(state) == sorted(expected)
    for name, tensor in expected.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name


@pytest.mark.parametrize("quick_gelu", [False, True])
def test_tiny_model_gives_the_same_features_in_transformers(tmp_path, quick_gelu):
    config = {**tiny_config(), "quick_gelu": quick_gelu}
    model = build(config)
    hf = load_hf(open_clip_to_hf(model, config, tmp_path / "hf"))
    assert hf.config.text_config.hidden_act == hf.config.vision_config.hidden_act == (
        "quick_gelu" if quick_gelu else "gelu")
    assert hf.config.text_config.eos_token_id == 49407  # pooled at the first EOS (not the legacy id 2)
    assert_same_features(hf, model)


def test_vit_b_32_quickgelu_gives_the_same_features_in_transformers(tmp_path):
    torch.manual_seed(0)
    model = perturbed(open_clip.create_model("ViT-B-32-quickgelu", pretrained=None))
    config = open_clip.get_model_config("ViT-B-32-quickgelu")
    hf = load_hf(open_clip_to_hf(model, config, tmp_path / "hf"))
    assert (hf.config.vision_config.num_attention_heads, hf.config.vision_config.patch_size) == (12, 32)
    assert_same_features(hf, model)


@pytest.mark.parametrize("safe_serialization", [True, False])
def test_round_trip_is_bit_identical(tmp_path, safe_serialization):
    config = tiny_config()
    model = build(config)
    folder = open_clip_to_hf(model, config, tmp_path / "hf", safe_serialization=safe_serialization)
    assert (folder / ("model.safetensors" if safe_serialization else "pytorch_model.bin")).is_file()
    back, state = hf_to_open_clip(folder)
    assert back == config
    assert_bit_identical(state, model.state_dict())
    open_clip.CLIP(**back).load_state_dict(state, strict=True)


@pytest.mark.parametrize("safe_serialization", [True, False])
def test_a_sharded_transformers_save_reads_back(tmp_path, safe_serialization):
    config = tiny_config()
    model = build(config)
    hf = load_hf(open_clip_to_hf(model, config, tmp_path / "hf"))
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="2MB", safe_serialization=safe_serialization)
    index = tmp_path / "sharded" / ("model.safetensors.index.json" if safe_serialization
                                    else "pytorch_model.bin.index.json")
    assert len(set(json.loads(index.read_text())["weight_map"].values())) > 1
    back, state = hf_to_open_clip(tmp_path / "sharded")
    assert back == config
    assert_bit_identical(state, model.state_dict())


def small_hf_config(text: Optional[dict] = None, vision: Optional[dict] = None) -> CLIPConfig:
    """A CLIPConfig unlike the tiny open_clip one: mlp ratio 3 (text), 3 heads of 32 (vision), QuickGELU."""
    text = {"vocab_size": 49408, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
            "num_attention_heads": 2, "max_position_embeddings": 77, "hidden_act": "quick_gelu",
            "bos_token_id": 49406, "eos_token_id": 49407, "pad_token_id": 0, **(text or {})}
    vision = {"hidden_size": 96, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 3,
              "image_size": 32, "patch_size": 8, "hidden_act": "quick_gelu", **(vision or {})}
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=48)


# HF pools at the argmax id for the legacy eos_token_id 2, else at the first EOS: with a vocabulary grown
# past the EOS id (an added token in the caption), that is open_clip's 'eos' pooling, not its argmax.
@pytest.mark.parametrize("vocab_size, eos_token_id", [(49408, 49407), (49408, 2), (49500, 49407)])
def test_a_transformers_model_converts_to_open_clip(tmp_path, vocab_size, eos_token_id):
    torch.manual_seed(0)
    hf = perturbed(CLIPModel(small_hf_config({"vocab_size": vocab_size, "eos_token_id": eos_token_id})))
    hf.save_pretrained(tmp_path / "hf")
    config, state = hf_to_open_clip(tmp_path / "hf")
    assert config["quick_gelu"] and config["text_cfg"]["mlp_ratio"] == 3.0
    assert config["vision_cfg"]["width"] // config["vision_cfg"]["head_width"] == 3
    model = open_clip.CLIP(**config)
    model.load_state_dict(state, strict=True)
    ids, _ = inputs(model.eval())
    if vocab_size > 49408:
        ids[0, 1] = vocab_size - 1
    assert_same_features(hf, model, ids)


def test_a_wrong_mapping_changes_the_features(tmp_path):
    """The feature comparison catches a mapping error: q and k swapped in one block of either tower, or the
    (square) text projection left untransposed."""
    config = tiny_config()
    model = build(config)
    folder = open_clip_to_hf(model, config, tmp_path / "hf")
    tensors = load_file(folder / "model.safetensors")
    ids, images = inputs(model)

    def swap(tensors: dict, first: str, second: str) -> dict:
        return {**tensors, first: tensors[second], second: tensors[first]}

    text_block, vision_block = "text_model.encoder.layers.1.self_attn.", "vision_model.encoder.layers.0.self_attn."
    assert tensors["text_projection.weight"].shape == (64, 64)
    broken = {"text": [swap(tensors, text_block + "q_proj.weight", text_block + "k_proj.weight"),
                       {**tensors, "text_projection.weight": tensors["text_projection.weight"].t().contiguous()}],
              "image": [swap(tensors, vision_block + "q_proj.weight", vision_block + "k_proj.weight")]}
    for tower, variants in broken.items():
        for variant in variants:
            save_file(variant, folder / "model.safetensors", metadata={"format": "pt"})
            hf = load_hf(folder)
            with torch.no_grad():
                ours, theirs = ((model.encode_text(ids), hf.get_text_features(input_ids=ids)) if tower == "text"
                                else (model.encode_image(images), hf.get_image_features(pixel_values=images)))
            assert not scaled_close(theirs, ours, 1e-3)


def test_missing_unexpected_and_misshapen_tensors_are_named(tmp_path):
    config = tiny_config()
    folder = open_clip_to_hf(build(config), config, tmp_path / "hf")
    tensors = load_file(folder / "model.safetensors")
    tensors["text_model.final_layernorm.weight"] = tensors.pop("text_model.final_layer_norm.weight")
    tensors["visual_projection.weight"] = tensors["visual_projection.weight"].t().contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatch) as error:
        hf_to_open_clip(folder)
    message = str(error.value)
    assert "1 missing: text_model.final_layer_norm.weight" in message
    assert "1 unexpected: text_model.final_layernorm.weight" in message
    assert "1 of another shape: visual_projection.weight (found [128, 64], expected [64, 128])" in message


@pytest.mark.parametrize("text, vision, named", [
    ({"layer_norm_eps": 1e-6}, {}, "text_config.layer_norm_eps=1e-06"),
    ({"hidden_act": "gelu_new"}, {"hidden_act": "gelu_new"}, "hidden_act='gelu_new'"),
    ({}, {"hidden_act": "gelu"}, "one activation in both towers"),
    ({}, {"num_channels": 1}, "num_channels=1"),
])
def test_configs_open_clip_cannot_express_are_refused(tmp_path, text, vision, named):
    small_hf_config(text, vision).save_pretrained(tmp_path / "hf")
    with pytest.raises(UnsupportedModel, match=named):
        hf_to_open_clip(tmp_path / "hf")


@pytest.mark.parametrize("vision_cfg, text_cfg, named", [
    ({"ls_init_value": 0.1}, {}, "layer scale"),
    ({"attentional_pool": True}, {}, "attentional pooler"),
    ({"pool_type": "avg"}, {}, "pool_type='avg'"),
    ({"no_ln_pre": True}, {}, "no_ln_pre"),
    ({"qk_norm": True}, {}, "CustomResidualAttentionBlock"),
    ({"norm_kwargs": {"eps": 1e-6}}, {}, "eps=1e-06"),
    ({}, {"proj_bias": True}, "text projection Linear"),
    ({}, {"no_causal_mask": True}, "causal"),
    ({}, {"vocab_size": 1000}, "vocab_size 1000"),
])
def test_open_clip_models_transformers_cannot_express_are_refused(tmp_path, vision_cfg, text_cfg, named):
    config = tiny_config(**text_cfg)
    config["vision_cfg"].update(vision_cfg)
    with pytest.raises(UnsupportedModel, match=named):
        open_clip_to_hf(open_clip.CLIP(**config), config, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_config_that_disagrees_on_quickgelu_is_refused(tmp_path):
    config = tiny_config()
    with pytest.raises(UnsupportedModel, match="quick_gelu=True but the model runs GELU"):
        open_clip_to_hf(open_clip.CLIP(**config), {**config, "quick_gelu": True}, tmp_path / "hf")


def test_tokenizer_and_processor_files_give_open_clip_ids(tmp_path):
    config = tiny_config()
    preprocess = {"mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25)}
    folder = open_clip_to_hf(build(config), {**config, "preprocess_cfg": preprocess}, tmp_path / "hf")
    expected = open_clip.tokenize(TOKENIZER_CAPTIONS).tolist()
    for tokenizer_class in (CLIPTokenizer, CLIPTokenizerFast):
        tokenizer = tokenizer_class.from_pretrained(folder)
        assert tokenizer.model_max_length == 77
        assert tokenizer(TOKENIZER_CAPTIONS, padding="max_length", truncation=True)["input_ids"] == expected
    # HTML entities: the slow tokenizer unescapes them as open_clip does (ftfy), the fast one does not.
    html = ["fish &amp; chips"]
    assert CLIPTokenizer.from_pretrained(folder)(html)["input_ids"][0] == [
        i for i in open_clip.tokenize(html)[0].tolist() if i]
    processor = CLIPProcessor.from_pretrained(folder)
    assert processor(text=TOKENIZER_CAPTIONS, padding="max_length", truncation=True)["input_ids"] == expected
    image_processor = processor.image_processor
    assert image_processor.crop_size == {"height": 64, "width": 64} and image_processor.size == {"shortest_edge": 64}
    assert (image_processor.image_mean, image_processor.image_std) == ([0.5] * 3, [0.25] * 3)
    assert hf_preprocess_cfg(folder) == {"size": 64, "mean": (0.5,) * 3, "std": (0.25,) * 3,
                                         "interpolation": "bicubic", "resize_mode": "shortest"}


def test_the_default_image_processor_uses_openai_mean_and_std(tmp_path):
    config = tiny_config()
    folder = open_clip_to_hf(build(config), config, tmp_path / "hf")
    processor = CLIPProcessor.from_pretrained(folder).image_processor
    assert (processor.image_mean, processor.image_std) == (list(OPENAI_DATASET_MEAN), list(OPENAI_DATASET_STD))


def test_a_64_token_context_round_trips(tmp_path):
    config = tiny_config(context_length=64)
    model = build(config)
    folder = open_clip_to_hf(model, config, tmp_path / "hf")
    hf = load_hf(folder)
    assert hf.config.text_config.max_position_embeddings == 64
    assert_same_features(hf, model)
    tokenizer = CLIPTokenizer.from_pretrained(folder)
    assert tokenizer.model_max_length == 64
    assert tokenizer([LONG, "a dog"], padding="max_length", truncation=True)["input_ids"] == open_clip.tokenize(
        [LONG, "a dog"], context_length=64).tolist()
    back, state = hf_to_open_clip(folder)
    assert back == config
    assert_bit_identical(state, model.state_dict())


def test_export_writes_a_transformers_folder_with_the_same_features(tmp_path):
    config = tiny_config()
    export_dir = tmp_path / "export"
    export_model(build(config, seed=0), TINY, export_dir)
    export_model(build(config, seed=1), TINY, export_dir)  # the second export replaces the first's folder
    assert read_export_metadata(export_dir)["hf"] == "hf"
    assert not [path.name for path in export_dir.iterdir() if path.name.startswith(".")]  # no staging left
    exported = load_export(export_dir).model.eval()
    assert torch.equal(exported.logit_scale, build(config, seed=1).logit_scale)
    assert_same_features(load_hf(export_dir / "hf"), exported)
    assert CLIPProcessor.from_pretrained(export_dir / "hf").tokenizer.model_max_length == 77


def test_export_of_a_model_transformers_cannot_express_has_no_folder(tmp_path, caplog):
    config = tiny_config()
    export_dir = tmp_path / "export"
    export_model(build(config), TINY, export_dir)
    config["vision_cfg"]["ls_init_value"] = 0.1
    with caplog.at_level(logging.WARNING, logger="modeling.export"):
        export_model(open_clip.CLIP(**config), TINY, export_dir, model_config=config)
    assert "hf" not in read_export_metadata(export_dir) and not (export_dir / "hf").exists()
    assert "layer scale" in caplog.text
