"""Regenerate the MACCO-CLIP parity fixture (`tests/data/parity/macco`) by running the official code.

    python -m testkit.parity.macco --official /path/to/MACCO --out tests/data/parity/macco

`--official` is a checkout of github.com/hiker-lw/MACCO at commit 97fbae1 (MIT; a clone or a `git archive` of it,
the large data TSVs are not needed); the files whose code runs are checked against that commit's git blob ids.
The checkout's `src/` goes on `sys.path` and its classes run unchanged: the forked open_clip's `create_model`
and `CLIP`, `MACCO_CLIP_text_image` (both predictors), the loss `macco_clip_loss_text_image`, and the mask rules of
`CsvDataset_mask_text_image` (its word -> token rule and its random rectangle). The arguments they read come from
the official `src/config/MACCO_CLIP.yaml`. Nothing of that code is in this file. The official package imports
pandas, webdataset and braceexpand at module level for its CSV and tar loaders, which never run here: each one that
is not installed is replaced by a stand-in module that raises if it is used.

The model is the smallest the official class accepts on which every path of `tests/test_macco_parity.py` runs
(README "Model"); CPU, float32, one thread, fixed seeds: two runs write identical bytes. The written README.md
explains every file.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.machinery
import json
import math
import random
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import yaml
from safetensors.torch import save_file
from torch import Tensor, nn

from core import cli

REPOSITORY = "hiker-lw/MACCO"
COMMIT = "97fbae1"
COMMIT_ID = "97fbae1416e30eba84cc0b8209d9cb6bdedfe6ae"
# git blob ids at that commit of the files whose code or data the fixture runs: a checkout that differs is refused.
OFFICIAL_FILES = {
    "src/open_clip_code/MACCO_variant/MACCO_text_image.py": "6a11a964881f296e8ec1e9991c8a8529e4aa2a10",
    "src/open_clip_code/loss_fn/MACCO_CLIP_loss_text_image_raw_space.py": "6ff5a84728d8016d2a9e43336d39e65997617a9d",
    "src/open_clip_code/model.py": "c96d9191fda3eb0cb0af9f6ee1dcd9c2189bed2d",
    "src/open_clip_code/factory.py": "e14d65830b4718c429100149d05e0877361a60f0",
    "src/open_clip_code/tokenizer.py": "fb8e0e1eb5de19c96c9c01830cd612119ae944bf",
    "src/open_clip_code/bpe_simple_vocab_16e6.txt.gz": "7b5088a527f720063f044eb928eee315f63b2fc0",
    "src/training/data_macco.py": "fd68fc074ec1bb15c72af4965af5c4528f41388a",
    "src/config/MACCO_CLIP.yaml": "5b3b2e74015a75a8cf089b583693f0577087aefe",
}
# Imported at module level by the official files, used only by their CSV / webdataset loaders (never run here).
LOADER_ONLY_MODULES = ("pandas", "webdataset", "webdataset.filters", "webdataset.tariterators", "braceexpand")
COMMAND = "python -m testkit.parity.macco --official /path/to/MACCO --out tests/data/parity/macco"

INIT_SEED, WEIGHT_SEED, IMAGE_SEED, ROW_SEED, RECTANGLE_SEED = 0, 1, 3, 4, 0
# The 2-D tensors with at least this many values are stored as exact int8 low-rank factors of this rank.
LOW_RANK_MIN_SIZE, LOW_RANK, FACTOR_STD = 65_536, 8, 40.0
RECTANGLE_DRAWS = 10_000
VOCABULARY_HEAD, PIXEL_HEAD = "prediction_text.linear.weight", "prediction_image.proj.1.weight"
RANDOM_ROWS = {VOCABULARY_HEAD: 16, PIXEL_HEAD: 30}
# The official loss's keys of the four unweighted terms.
TERMS = {"L_mca": "contrast_loss", "L_mir": "intra_modal_contrast_loss", "L_mlm": "mask_loss_text",
         "L_mim": "mask_loss_image"}
WEIGHT_ARGS = {"L_mca": "contrast_loss_w", "L_mir": "intra_modal_contrast_loss_w", "L_mlm": "mask_text_loss_w",
               "L_mim": "mask_image_loss_w"}
TERM_GRADIENTS = ("text_mask_token", "img_mask_token", "logit_scale",
                  "CLIP.visual.transformer.resblocks.0.attn.in_proj_weight",
                  "CLIP.transformer.resblocks.0.attn.in_proj_weight")
TOTAL_GRADIENTS = TERM_GRADIENTS + ("prediction_text.linear.bias", "prediction_text.ln.weight",
                                    "prediction_image.proj.1.bias", "prediction_image.proj.0.weight",
                                    "prediction_image.proj.0.bias", "prediction_image.ln.weight",
                                    "prediction_image.ln.bias")
NO_COUNTERPART = "no project counterpart"
# Official name -> the project's MaccoCLIP parameter name, applied in order.
PROJECT_NAMES = ((r"^CLIP\.", "encoders.model."), (r"^logit_scale$", "encoders.model.logit_scale"),
                 (r"^prediction_text\.", "text_predictor."), (r"^prediction_image\.", "image_predictor."),
                 (r"\.cross_attn_blocks\.", ".blocks."), (r"(\.blocks\.\d+)\.ln_post\.", r"\1.ln_mlp."),
                 (r"^text_predictor\.linear\.", "text_predictor.head."),
                 (r"^image_predictor\.decoder_embed\.", "image_predictor.embed."),
                 (r"^image_predictor\.ln\.", "image_predictor.ln_post."),
                 (r"^image_predictor\.proj\.0\.", "image_predictor.ln."),
                 (r"^image_predictor\.proj\.1\.", "image_predictor.head."))


@dataclass(frozen=True)
class TinyMacco:
    """The fixture model: B-32 geometry (forced by the official class) with the smallest towers (README "Model")."""

    name: str = "MACCO-Tiny-32-224"
    embed_dim: int = 512  # the official predictors' width for ViT-B-32, whatever the towers
    image_size: int = 224  # the official image predictor's grid is (224 / patch)^2
    patch_size: int = 32
    vision_width: int = 16
    vision_head_width: int = 8  # 2 heads
    vision_layers: int = 2  # block 0's gradients are stored: a block runs after it
    text_width: int = 16
    text_heads: int = 2
    text_layers: int = 2
    context_length: int = 77  # every position is a key of the image predictor
    vocab_size: int = 49408  # the official text predictor's head is Linear(width, 49408)

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    def open_clip_config(self) -> dict:
        return {"embed_dim": self.embed_dim, "quick_gelu": True,
                "vision_cfg": {"image_size": self.image_size, "layers": self.vision_layers,
                               "width": self.vision_width, "patch_size": self.patch_size,
                               "head_width": self.vision_head_width},
                "text_cfg": {"context_length": self.context_length, "vocab_size": self.vocab_size,
                             "width": self.text_width, "heads": self.text_heads, "layers": self.text_layers}}


@dataclass(frozen=True)
class Sample:
    """One caption with the words the official rule masks in it, and the masked patches (row-major)."""

    caption: str
    relation_words: Tuple[str, ...]
    attribute_words: Tuple[str, ...]
    masked_patches: Tuple[int, ...]


# Three samples: each loss averages over the samples with a non-empty mask, so each mask is empty in one sample
# (a different one for text and image) and the two non-empty ones have different counts. Corner patches 0 and 48
# pin the CLS offset of the [B, 50] image mask.
BATCH = (
    Sample("a red cube to the left of a blue ball", ("to", "the", "left", "of"), ("red", "blue"), ()),
    Sample("a man riding a horse on a beach on a sunny day", ("riding", "on", "on"), ("sunny",), (18, 19, 25, 26)),
    Sample("a dog", (), (), (0, 6, 16, 17, 24, 42, 48)),
)
# The word -> token rule's cases: (caption, relation words, attribute words), each for one of its consequences.
TEXT_MASK_CASES = (
    ("a man on a horse on a beach", ("on", "on"), ()),
    ("a white dog and a black cat on a white sofa", ("on",), ("white", "black", "white")),
    ("a cat sitting in the middle of the road", ("sitting", "in", "the", "middle", "of"), ()),
    ("the man in a red shirt is standing in the kitchen", ("in", "standing", "in"), ("red",)),
    ("two red cubes to the left of a small blue ball", ("to the left of",), ("red", "small", "blue")),
    ("A Red Car parked next to a tree", ("parked", "next to"), ("Red",)),
    ("a dog, running on the grass.", ("running", "on"), ()),
    ("a multicolored kite and a red ball", (), ("red",)),
    ("an onion on a plate", ("on", "under"), ()),
    ("The dog is under the table near a skateboarder", ("The", "under", "near"), ("wooden", "boarder")),
)


# ----- the official code ----------------------------------------------------------------------------------
def git_blob_id(data: bytes) -> str:
    """The id git gives a file's content (`git hash-object`)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def check_checkout(root: Path) -> None:
    """Refuse a checkout whose files are not those of the pinned commit."""
    for name, blob in OFFICIAL_FILES.items():
        path = root / name
        if not path.is_file():
            raise SystemExit(f"{path} not found: --official must be a checkout of {REPOSITORY} @ {COMMIT}")
        if git_blob_id(path.read_bytes()) != blob:
            raise SystemExit(f"{path} is not the file of {REPOSITORY} @ {COMMIT} (git blob {blob})")


def _unavailable(module: str):
    def attribute(name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def used(*args, **kwargs):
            raise RuntimeError(f"{module}.{name} is not installed; the fixture's paths should never use it")

        return type(name, (), {"__init__": used, "__call__": used})

    return attribute


def stand_in_for_loader_modules() -> None:
    """A module that raises when used, for each loader-only dependency of the official files not installed."""
    import torchvision  # noqa: F401  # its import probes optional packages: before any stand-in exists
    for name in LOADER_ONLY_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            module = types.ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
            module.__getattr__ = _unavailable(name)
            sys.modules[name] = module


def import_official(root: Path) -> SimpleNamespace:
    """The official modules, imported from the checkout's `src/`."""
    sys.path.insert(0, str(root / "src"))
    stand_in_for_loader_modules()
    return SimpleNamespace(open_clip=importlib.import_module("open_clip_code"),
                           tokenizer=importlib.import_module("open_clip_code.tokenizer"),
                           model=importlib.import_module("open_clip_code.MACCO_variant.MACCO_text_image"),
                           loss=importlib.import_module("open_clip_code.loss_fn.MACCO_CLIP_loss_text_image_raw_space"),
                           data=importlib.import_module("training.data_macco"))


def official_args(root: Path) -> SimpleNamespace:
    """The official training config (`model: ViT-B-32`, predictor depths, loss weights, mask ratios)."""
    return SimpleNamespace(**yaml.safe_load((root / "src" / "config" / "MACCO_CLIP.yaml").read_text()))


def official_dataset(official: SimpleNamespace, args: SimpleNamespace, relations: Sequence[Sequence[str]] = (),
                     attributes: Sequence[Sequence[str]] = ()):
    """`CsvDataset_mask_text_image` without its CSV (its constructor reads the training TSV): only the word lists
    and the args that its mask rules read."""
    dataset_class = official.data.CsvDataset_mask_text_image
    dataset = dataset_class.__new__(dataset_class)
    dataset.args = args
    dataset.relation_word_list = [list(words) for words in relations]
    dataset.adjective_word_list = [list(words) for words in attributes]
    dataset.noun_list = [[] for _ in relations]
    return dataset


def official_text_masks(official: SimpleNamespace, args: SimpleNamespace, captions: Sequence[str],
                        relations: Sequence[Sequence[str]], attributes: Sequence[Sequence[str]]
                        ) -> Tuple[Tensor, Tensor]:
    """Token ids [N, 77] of the captions and the official composition-token masks [N, 77]."""
    ids = official.open_clip.tokenize(list(captions))
    dataset = official_dataset(official, args, relations, attributes)
    masks = torch.stack([dataset.get_text_mask_token_flag(i, ids[i])[0] for i in range(len(captions))])
    return ids, masks


# ----- the model and its weights ----------------------------------------------------------------------------
def build_model(official: SimpleNamespace, args: SimpleNamespace, config: TinyMacco, config_dir: Path) -> nn.Module:
    """The official MACCO_CLIP_text_image over the forked open_clip's CLIP, with the official init (seed 0)."""
    config_dir.mkdir(parents=True, exist_ok=True)
    path = config_dir / f"{config.name}.json"
    path.write_text(json.dumps(config.open_clip_config(), indent=4) + "\n")
    official.open_clip.add_model_config(path)
    torch.manual_seed(INIT_SEED)
    clip = official.open_clip.create_model(config.name, force_quick_gelu=True)
    return official.model.MACCO_CLIP_text_image(clip, args).train()


def low_rank(shape: Sequence[int], std: float, generator: torch.Generator) -> Tuple[Tensor, Tensor, int]:
    """int8 factors u [m, r], v [r, n] and e with (u @ v) 2^-e near the given std. Exact in float32 in any
    summation order: every partial sum is an integer below 2^24 (r 127^2 << 2^24)."""
    def factor(rows: int, cols: int) -> Tensor:
        values = torch.randn(rows, cols, generator=generator) * FACTOR_STD
        return values.round().clamp(-127, 127).to(torch.int8)

    u, v = factor(shape[0], LOW_RANK), factor(LOW_RANK, shape[1])
    exponent = round(math.log2((u.float() @ v.float()).std().item() / std))
    return u, v, exponent


def set_weights(model: nn.Module) -> Tuple[Dict[str, Tensor], Dict[str, dict]]:
    """Perturb the official init so that every LayerNorm affine and bias counts, and replace each large matrix
    by an exact low-rank one. Returns the tensors to store (factors as `<name>::u`, `<name>::v`) and, per
    low-rank tensor, its exponent, rank and stds."""
    generator = torch.Generator().manual_seed(WEIGHT_SEED)
    norms = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    stored, low_rank_info, seen = {}, {}, {}
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if id(tensor) in seen:  # logit_scale: one Parameter under two names
                stored[name] = stored[seen[id(tensor)]].clone()
                continue
            seen[id(tensor)] = name
            if id(tensor) in norms:
                base, scale = (1.0, 0.1) if name.endswith("weight") else (0.0, 0.05)
                tensor.copy_(base + scale * torch.randn(tensor.shape, generator=generator))
            elif name.endswith("bias"):
                tensor.copy_(0.02 * torch.randn(tensor.shape, generator=generator))
            elif tensor.dim() == 2 and tensor.numel() >= LOW_RANK_MIN_SIZE:
                official_std = tensor.std().item()
                u, v, exponent = low_rank(tensor.shape, official_std, generator)
                tensor.copy_((u.float() @ v.float()) * 2.0 ** -exponent)
                stored[f"{name}::u"], stored[f"{name}::v"] = u, v
                low_rank_info[name] = {"shape": list(tensor.shape), "rank": LOW_RANK, "exponent": exponent,
                                       "official_init_std": round(official_std, 6),
                                       "std": round(tensor.std().item(), 6)}
                continue
            stored[name] = tensor.detach().clone()
    return stored, low_rank_info


def rebuilt_weights(stored: Dict[str, Tensor], low_rank_info: Dict[str, dict]) -> Dict[str, Tensor]:
    """The state dict from the stored tensors, as the test rebuilds it."""
    weights = {name: value for name, value in stored.items() if "::" not in name}
    for name, info in low_rank_info.items():
        weights[name] = (stored[f"{name}::u"].float() @ stored[f"{name}::v"].float()) * 2.0 ** -info["exponent"]
    return weights


def check_reload(model: nn.Module, stored: Dict[str, Tensor], low_rank_info: Dict[str, dict]) -> None:
    """The stored tensors give back every value of the model bit for bit (strict load)."""
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    model.load_state_dict(rebuilt_weights(stored, low_rank_info), strict=True)
    for name, tensor in model.state_dict().items():
        if not torch.equal(tensor, state[name]):
            raise AssertionError(f"{name}: the stored weights do not rebuild the model's values")


def project_mapping(names: Sequence[str]) -> Dict[str, str]:
    """Official name -> the project's MaccoCLIP parameter (or why there is none)."""
    mapping = {}
    for official in names:
        if official == "prediction_image.pos_embedding":
            mapping[official] = (f"{NO_COUNTERPART}: the fixed 2-D sin-cos table (requires_grad=False), recomputed "
                                 "by the project as the non-persistent buffer image_predictor.positions")
            continue
        name = official
        for pattern, replacement in PROJECT_NAMES:
            name = re.sub(pattern, replacement, name)
        mapping[official] = name
    return mapping


# ----- the batch and the official run -----------------------------------------------------------------------
def make_batch(official: SimpleNamespace, args: SimpleNamespace, config: TinyMacco) -> Dict[str, Tensor]:
    ids, text_mask = official_text_masks(official, args, [s.caption for s in BATCH],
                                         [s.relation_words for s in BATCH], [s.attribute_words for s in BATCH])
    patch_mask = torch.zeros(len(BATCH), config.grid ** 2, dtype=torch.bool)
    for row, sample in enumerate(BATCH):
        patch_mask[row, list(sample.masked_patches)] = True
    generator = torch.Generator().manual_seed(IMAGE_SEED)
    images = torch.randn(len(BATCH), 3, config.image_size, config.image_size, generator=generator)
    return {"images": images, "text_ids": ids, "text_mask": text_mask, "patch_mask": patch_mask}


def gradients(loss: Tensor, parameters: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """d loss / d parameter; exact zeros where the loss does not reach a parameter."""
    grads = torch.autograd.grad(loss, list(parameters.values()), retain_graph=True, allow_unused=True)
    return {name: torch.zeros_like(p) if g is None else g for (name, p), g in zip(parameters.items(), grads)}


def run_official(official: SimpleNamespace, model: nn.Module, args: SimpleNamespace, batch: Dict[str, Tensor]
                 ) -> dict:
    """One official forward, loss and the backward passes on the batch."""
    image_mask = torch.cat([torch.zeros(len(batch["images"]), 1, dtype=torch.bool), batch["patch_mask"]], dim=1)
    out = model(batch["images"], batch["text_ids"], image_mask, batch["text_mask"])
    losses = official.loss.macco_clip_loss_text_image(args)(out)
    parameters = dict(model.named_parameters(remove_duplicate=False))
    total_names = TOTAL_GRADIENTS + tuple(RANDOM_ROWS)
    return {"out": out, "losses": losses,
            "grad_total": gradients(losses["total_loss"], {n: parameters[n] for n in total_names}),
            "grad_terms": {term: gradients(losses[key], {n: parameters[n] for n in TERM_GRADIENTS})
                           for term, key in TERMS.items()}}


def row_ids(name: str, size: int, always: Sequence[int]) -> Tensor:
    """The stored rows of a gradient too large to keep whole: `always`, the two ends and random ones."""
    generator = torch.Generator().manual_seed(ROW_SEED)
    random_rows = torch.randperm(size, generator=generator)[:RANDOM_ROWS[name]].tolist()
    return torch.tensor(sorted(set(always) | {0, size - 1} | set(random_rows)), dtype=torch.int64)


def expected_tensors(run: dict, batch: Dict[str, Tensor]) -> Dict[str, Tensor]:
    out, text_mask, patch_mask = run["out"], batch["text_mask"], batch["patch_mask"]
    log_probs = out["pred_text"].detach()[text_mask]  # [M, V] at the masked positions, row-major
    targets = batch["text_ids"][text_mask]
    argmax = log_probs.argmax(dim=-1)
    tensors = {
        "out/image_cls_normalized": out["img_feat_cls_token"], "out/text_eos_normalized": out["text_feat_cls_token"],
        "out/masked_image_cls_normalized": out["masked_image_feat_cls_token"],
        "out/masked_text_eos_normalized": out["masked_text_feat_cls_token"],
        "out/text_target_logprob_at_masked": log_probs.gather(1, targets[:, None])[:, 0],
        "out/text_argmax_at_masked": argmax,
        "out/text_logsumexp_check_at_masked": log_probs.logsumexp(dim=-1),
        "out/pixel_predictions_at_masked": out["pred_image"][patch_mask],
    }
    for name in TOTAL_GRADIENTS:
        tensors[f"grad_total/{name}"] = run["grad_total"][name]
    always = {VOCABULARY_HEAD: targets.tolist() + argmax.tolist() + [49406, 49407], PIXEL_HEAD: []}
    for name, grad in ((n, run["grad_total"][n]) for n in RANDOM_ROWS):
        rows = row_ids(name, grad.shape[0], always[name])
        tensors.update({f"grad_total/{name}@rows": grad[rows], f"grad_total/{name}@row_ids": rows,
                        f"grad_total/{name}@row_l2_norms": grad.norm(dim=1)})
    for term, grads in run["grad_terms"].items():
        tensors.update({f"grad_{term}/{name}": grad for name, grad in grads.items()})
    return {name: tensor.detach().contiguous() for name, tensor in tensors.items()}


def expected_scalars(run: dict, args: SimpleNamespace, batch: Dict[str, Tensor], model: nn.Module) -> dict:
    frobenius = {f"grad_total_frobenius/{name}": grad.double().norm().item()
                 for name, grad in run["grad_total"].items()}
    losses = {term: run["losses"][key].item() for term, key in TERMS.items()}
    return {**frobenius, **losses, "total": run["losses"]["total_loss"].item(),
            "weights": {term: float(getattr(args, key)) for term, key in WEIGHT_ARGS.items()},
            "masked_text_tokens_per_sample": batch["text_mask"].sum(dim=1).tolist(),
            "masked_patches_per_sample": batch["patch_mask"].sum(dim=1).tolist(),
            "logit_scale_value": model.logit_scale.item()}


# ----- the mask rules ---------------------------------------------------------------------------------------
def rectangle_draws(official: SimpleNamespace, args: SimpleNamespace, grid: int) -> Dict[str, Tensor]:
    """RECTANGLE_DRAWS official random rectangles after `random.seed(0)`: each draw's shape and corner (read from
    the mask the official rule returns) and how often each patch was masked."""
    dataset = official_dataset(official, args)
    random.seed(RECTANGLE_SEED)  # the official rule draws from Python's global `random`
    masks = torch.stack([dataset.generate_random_rectangular_mask_image(
        mask_ratio=args.random_rectangular_mask_image_ratio) for _ in range(RECTANGLE_DRAWS)])
    if masks[:, 0].any():
        raise AssertionError("the official rectangle masked the CLS slot")
    cells = masks[:, 1:].reshape(-1, grid, grid)
    rows, cols = cells.any(dim=2), cells.any(dim=1)
    heights, widths = rows.sum(dim=1), cols.sum(dim=1)
    areas = cells.sum(dim=(1, 2))
    if not torch.equal(areas, heights * widths):
        raise AssertionError("an official mask is not one rectangle")
    as_bytes = {"areas": areas, "heights": heights, "widths": widths, "tops": rows.int().argmax(dim=1),
                "lefts": cols.int().argmax(dim=1)}
    return {**{name: value.to(torch.uint8) for name, value in as_bytes.items()},
            "patch_counts": cells.reshape(-1, grid * grid).sum(dim=0).to(torch.int64)}


def bpe_tokens(official: SimpleNamespace, ids: Sequence[int]) -> List[str]:
    return [official.tokenizer._tokenizer.decoder[i] for i in ids]


def text_mask_cases(official: SimpleNamespace, args: SimpleNamespace) -> dict:
    captions, relations, attributes = zip(*TEXT_MASK_CASES)
    ids, masks = official_text_masks(official, args, captions, relations, attributes)
    cases = []
    for caption, relation, attribute, row, mask in zip(captions, relations, attributes, ids, masks):
        length = int(row.argmax()) + 1  # up to EOS
        positions = mask.nonzero()[:, 0].tolist()
        tokens = bpe_tokens(official, row[:length].tolist())
        cases.append({"caption": caption, "relation_words": list(relation), "attribute_words": list(attribute),
                      "token_ids": row[:length].tolist(), "tokens": tokens, "official_masked_positions": positions,
                      "official_masked_tokens": [f"{tokens[p]}@{p}" for p in positions]})
    return {"source": "official training/data_macco.py CsvDataset_mask_text_image.get_text_mask_token_flag, "
                      "relation_list and attribute_list as given, object list empty", "cases": cases}


# ----- writing ----------------------------------------------------------------------------------------------
def write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=1) + "\n")


def inputs_json(official: SimpleNamespace, batch: Dict[str, Tensor]) -> dict:
    ids = batch["text_ids"]
    return {"captions": [s.caption for s in BATCH],
            "relation_words": [list(s.relation_words) for s in BATCH],
            "attribute_words": [list(s.attribute_words) for s in BATCH],
            "tokens": [bpe_tokens(official, row[:int(row.argmax()) + 1].tolist()) for row in ids],
            "text_mask_positions": {str(i): m.nonzero()[:, 0].tolist() for i, m in enumerate(batch["text_mask"])},
            "patch_mask_positions": {str(i): m.nonzero()[:, 0].tolist() for i, m in enumerate(batch["patch_mask"])}}


def write_fixture(out: Path, config: TinyMacco, root: Path) -> None:
    official, args = import_official(root), official_args(root)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(official, args, config, out / "model_configs")
    stored, low_rank_info = set_weights(model)
    check_reload(model, stored, low_rank_info)
    batch = make_batch(official, args, config)
    run = run_official(official, model, args, batch)
    scalars = expected_scalars(run, args, batch, model)

    save_file(stored, out / "weights.safetensors", metadata={"model": config.name})
    write_json(out / "lowrank.json", {"rule": "value = (u.float32 @ v.float32) * 2**-exponent, exact in fp32",
                                      "tensors": low_rank_info})
    write_json(out / "mapping.json", project_mapping(list(stored_names(stored))))
    save_file(batch, out / "inputs.safetensors")
    write_json(out / "inputs.json", inputs_json(official, batch))
    save_file(expected_tensors(run, batch), out / "expected.safetensors")
    write_json(out / "expected.json", scalars)
    save_file(rectangle_draws(official, args, config.grid), out / "rectangles.safetensors")
    write_json(out / "text_mask_cases.json", text_mask_cases(official, args))
    (out / "README.md").write_text(readme(config, args, batch, scalars, stored, low_rank_info))


def stored_names(stored: Dict[str, Tensor]) -> Dict[str, None]:
    """The official state-dict names, in order, from the stored keys (factors `<name>::u` give `<name>`)."""
    return dict.fromkeys(name.split("::")[0] for name in stored)


def readme(config: TinyMacco, args: SimpleNamespace, batch: Dict[str, Tensor], scalars: dict,
           stored: Dict[str, Tensor], low_rank_info: Dict[str, dict]) -> str:
    text_counts, patch_counts = scalars["masked_text_tokens_per_sample"], scalars["masked_patches_per_sample"]
    return README.format(
        repository=REPOSITORY, commit=COMMIT, commit_id=COMMIT_ID, command=COMMAND,
        name=config.name, embed=config.embed_dim, size=config.image_size, patch=config.patch_size, grid=config.grid,
        patches=config.grid ** 2, patches_1=config.grid ** 2 + 1, vision_width=config.vision_width,
        vision_heads=config.vision_width // config.vision_head_width, vision_layers=config.vision_layers,
        text_width=config.text_width, text_heads=config.text_heads, text_layers=config.text_layers,
        ctx=config.context_length, vocab=config.vocab_size, tensors=len(stored_names(stored)),
        n_low_rank=len(low_rank_info), n_plain=len(stored_names(stored)) - len(low_rank_info), rank=LOW_RANK,
        min_size=LOW_RANK_MIN_SIZE, text_depth=args.text_predictor_cross_attn_layers,
        image_depth=args.image_predictor_cross_attn_layers, b=len(BATCH), init_seed=INIT_SEED,
        weight_seed=WEIGHT_SEED, image_seed=IMAGE_SEED, row_seed=ROW_SEED, draws_text=f"{RECTANGLE_DRAWS:,}",
        n_files=len(OFFICIAL_FILES),
        total_formula=" + ".join(f"{scalars['weights'][t]:g} {t}" for t in TERMS),
        text_counts=", ".join(map(str, text_counts)), patch_counts=", ".join(map(str, patch_counts)),
        m=sum(text_counts), p=sum(patch_counts), vocab_rows=RANDOM_ROWS[VOCABULARY_HEAD],
        pixel_rows=RANDOM_ROWS[PIXEL_HEAD], pixel_out=config.patch_size ** 2 * 3,
        weights=" / ".join(f"{scalars['weights'][t]:g}" for t in TERMS),
        losses=", ".join(f"{t} {scalars[t]:.8g}" for t in TERMS), total=f"{scalars['total']:.8g}",
        ratio=args.random_rectangular_mask_image_ratio, prob=args.random_rectangular_mask_prob,
        captions="\n".join(f"| {i} | \"{s.caption}\" | {', '.join(s.relation_words) or '-'} | "
                           f"{', '.join(s.attribute_words) or '-'} | {text_counts[i]} | "
                           f"{', '.join(map(str, s.masked_patches)) or '-'} |" for i, s in enumerate(BATCH)))


README = """# MACCO-CLIP parity fixture

Numbers computed by the official MACCO code, `{repository}` @ `{commit}` (MIT; commit {commit_id}), for
`tests/test_macco_parity.py`. Written by

```
{command}
```

where `--official` is a checkout of that commit: the {n_files} official files the script runs are checked against
that commit's git blob ids (`OFFICIAL_FILES` in `testkit/parity/macco.py`). The script imports the official classes
from the checkout and runs them; none of that code is stored here. CPU, float32, one thread, fixed seeds: a second
run on the same machine writes the same bytes (another CPU may round the last bits of a float differently). Do not
edit these files by hand; regenerate them.

Official code that runs: the forked open_clip (`open_clip_code`: `create_model`, `CLIP`, `tokenize`),
`MACCO_variant/MACCO_text_image.py:MACCO_CLIP_text_image`, the loss
`loss_fn/MACCO_CLIP_loss_text_image_raw_space.py:macco_clip_loss_text_image`, and the mask rules of
`training/data_macco.py:CsvDataset_mask_text_image` (`get_text_mask_token_flag`,
`generate_random_rectangular_mask_image`). Their arguments are the official `src/config/MACCO_CLIP.yaml`:
`model: ViT-B-32`, {text_depth} text and {image_depth} image cross-attention predictor layers and no self-attention
layers, loss weights {weights}.

## Model: `model_configs/{name}.json`

The official class fixes most of the size, whatever the towers:
- the predictor width and patch size come from `args.model`, one of ViT-B-32, ViT-B-16 and ViT-L-14: width 512
  for the first two, 768 for L-14, so the joint embedding must be 512 (B-32's patch 32 is the smallest model);
- the image predictor's grid is (224 / patch)^2, so images are 224 px;
- the text predictor's head is Linear(width, 49408): the vocabulary is open_clip's whole one.

Hence B-32 geometry with the smallest towers (`create_model("{name}", force_quick_gelu=True)`):

| part | value |
|---|---|
| joint embedding | {embed}, QuickGELU |
| images | {size} px, patch {patch}: {patches} patches |
| vision tower | width {vision_width}, {vision_heads} heads, {vision_layers} layers |
| text tower | width {text_width}, {text_heads} heads, {text_layers} layers, {ctx} positions, vocabulary {vocab} |
| predictors | width 512, 8 heads; {text_depth} text and {image_depth} image cross-attention blocks (official config) |

Why no smaller:
- 2 heads per tower: a head split or merge in the wrong order shows only with more than one head;
- 2 layers per tower and the official predictor depths: the stored gradients of block 0 flow through a later block,
  and a block order or a block index of the name mapping that is wrong shows only with two or more blocks; the
  predictor depths are the official config's (`configs/macco.yaml` builds the same);
- {b} samples: L_mlm and L_mim average per sample over the samples with a non-empty mask, so the batch has an
  empty text mask and an empty patch mask in two different samples, and two non-empty masks with different counts
  for each loss (otherwise a mean over all masked tokens, or over all samples, would give the same number);
- {draws_text} random rectangles: the test compares their distribution with the project's at thresholds set for
  that many draws a side;
- the tower widths, the ranks of the large matrices, the number of masked tokens and patches, and which rows of the
  two heads' gradients are kept change no path, only the size.

The project builds the same model with `model.name={name}`, `model.config_dir=<this folder>/model_configs`,
`model.pretrained=null` and `configs/macco.yaml` (predictor depths 2 and 3, 8 heads).

## Weights: `weights.safetensors`, `lowrank.json`, `mapping.json`

The official `state_dict()`, {tensors} entries under the official names (`CLIP.*`, `prediction_text.*`,
`prediction_image.*`, `text_mask_token`, `img_mask_token`, `logit_scale`). `CLIP.logit_scale` and `logit_scale`
are one Parameter registered twice by the official module: both keys, one value.

Values: the official init (`torch.manual_seed({init_seed})` before `create_model`), then, from a generator seeded
{weight_seed}, in state-dict order: every LayerNorm weight 1 + 0.1 N(0,1) and bias 0.05 N(0,1), every other bias
0.02 N(0,1), and each 2-D tensor of at least {min_size} values replaced by an exact low-rank one. The perturbation
makes every LayerNorm affine and bias count: at (1, 0) a missing LayerNorm would not show.

Storage: {n_plain} tensors as float32; the {n_low_rank} low-rank ones (every predictor matrix, the 49408-row
vocabulary head and token embedding, the 3072-row pixel head) as two int8 tensors `<name>::u` [m, {rank}] and
`<name>::v` [{rank}, n] with an exponent e in `lowrank.json`: value = (u.float32 @ v.float32) * 2^-e. This is
exact in float32 whatever the summation order (every partial sum is an integer below 2^24), and e puts the std
near the official init's (both are listed). The script checks that loading the rebuilt {tensors} entries into the
official model with `strict=True` gives back every value bit for bit.

`mapping.json` gives each official name's `MaccoCLIP` parameter: `CLIP.` -> `encoders.model.`;
`cross_attn_blocks.i.{{attn, ln_x, ln_y, mlp, ln_post}}` -> `blocks.i.{{attn, ln_x, ln_y, mlp, ln_mlp}}`; text
predictor `linear` -> `head`; image predictor `decoder_embed` -> `embed`, `ln` -> `ln_post`, `proj.0` -> `ln`,
`proj.1` -> `head`. `prediction_image.pos_embedding` (the fixed sin-cos table) has no counterpart: the project
computes the same values as a buffer.

## Inputs: `inputs.safetensors`, `inputs.json`

- `images` [{b}, 3, {size}, {size}] f32: N(0,1) pixels (generator seeded {image_seed}), taken as already normalised;
- `text_ids` [{b}, {ctx}] i64: the official tokenizer's ids of the captions;
- `text_mask` [{b}, {ctx}] bool: the official word -> token rule on the words below ({text_counts} tokens);
- `patch_mask` [{b}, {patches}] bool: masked patches, row-major on the {grid}x{grid} grid ({patch_counts}); the
  official model gets [{b}, {patches_1}], with a False CLS column first.

| sample | caption | relation words | attribute words | masked tokens | masked patches |
|---|---|---|---|---|---|
{captions}

Sample 1's repeated "on" masks its first occurrence twice (the official rule); patches 0 and 48 are the grid's
corners, next to the CLS slot and at the end.

## Expected values: `expected.json`, `expected.safetensors`

`expected.json`: the four unweighted terms and the total ({losses}, total {total}), the loss weights, the masked
tokens and patches per sample, `logit_scale_value`, and under `grad_total_frobenius/<name>` the float64 Frobenius
norm of each total-loss gradient stored below (the two row-sampled ones included).

- `grad_total/<name>`: d total / d parameter for `text_mask_token`, `img_mask_token`, `logit_scale`, both towers'
  `resblocks.0.attn.in_proj_weight`, `prediction_text.linear.bias`, `prediction_text.ln.weight`,
  `prediction_image.proj.1.bias`, `prediction_image.proj.0.{{weight,bias}}` and `prediction_image.ln.{{weight,bias}}`.
- `grad_total/<head>@rows` [k, 512], `@row_ids` [k] i64, `@row_l2_norms` [rows]: the gradients of the two heads,
  too large to keep whole (vocabulary head 49408x512, pixel head {pixel_out}x512), as k of their rows and the L2 norm
  of every row. Vocabulary rows: every masked target id and argmax id, SOT 49406, EOT 49407 (the last row), id 0
  and {vocab_rows} random ids; pixel rows: the first, the last and {pixel_rows} random ones (random ids from a
  generator seeded {row_seed}).
- `grad_L_mca/<name>`, `grad_L_mir/...`, `grad_L_mlm/...`, `grad_L_mim/...`: each unweighted term's gradient for the
  two mask tokens, `logit_scale` and both towers' block-0 `in_proj_weight`. The stop-gradients show as exact zeros:
  L_mlm and L_mim never reach the image side, L_mim not `text_mask_token`.
- `out/{{image_cls,text_eos,masked_image_cls,masked_text_eos}}_normalized` [{b}, 512]: the L2-normalised global
  features, full and masked.
- `out/text_target_logprob_at_masked`, `out/text_argmax_at_masked`, `out/text_logsumexp_check_at_masked` [{m}]: at
  the {m} masked positions, row-major, the true token's log-prob, the argmax id and the logsumexp of the log-probs
  (about 0).
- `out/pixel_predictions_at_masked` [{p}, {pixel_out}]: the image predictor's output at the {p} masked patches,
  row-major over `patch_mask`.

## What the official code computes

B samples, s = exp(logit_scale), N(.) = L2 normalisation.

Towers: each runs the full and the masked copy as one 2B batch.
- Text: at masked positions the token embedding is replaced by `text_mask_token` before the positional embedding;
  causal transformer, `ln_final`, and every one of the {ctx} outputs times `text_projection`. The global feature is
  the row at EOS (the argmax id).
- Image: after `conv1` and the prepended CLS token, masked patch embeddings are replaced by `img_mask_token`
  before the positional embedding and `ln_pre` (CLS is never masked); transformer, `ln_post`, every token times
  `proj`. CLS is the global feature, tokens 1..{patches} the patches.

Text predictor: queries (masked-text tokens + masked-text EOS) / 2 at all {ctx} positions; keys and values
(full-image patches + full-image CLS) / 2, detached, not normalised; {text_depth} blocks x <- x + MHA_8(LN(x), LN(y),
LN(y)), x <- x + MLP_GELU(LN(x)), no attention mask; then LN, Linear(512 -> 49408), log-softmax.

Image predictor: queries (masked-image patches + masked-image CLS) / 2, detached, through Linear(512 -> 512) plus
the fixed 2-D sin-cos table; keys and values (full-text tokens + full-text EOS) / 2 over all {ctx} positions,
padding included, not detached, no key padding mask; {image_depth} such blocks; then LayerNorm `ln`, LayerNorm
`proj.0`, Linear `proj.1` (512 -> {pixel_out}).

Losses:
- L_mca: I2 = [N(I); N(I~)], T2 = [N(T); N(T~)] (2B x 512); the mean of the cross-entropies both ways of s I2 T2^T
  with labels (0..B-1, 0..B-1).
- L_mir = (clip(N(T~), N(T)) + clip(N(I~), N(I))) / 2, clip(a, b) = (CE(s a b^T, arange) + CE(s b a^T, arange)) / 2.
- L_mlm: the negative log-prob of the true id at each position times `text_mask`; per sample, the sum over
  max(1, its masked count); the mean over the samples with a masked token (0 if none).
- L_mim: targets are the images patchified with p = {patch} in (row in patch, column in patch, channel) order
  (`nchpwq -> nhwpqc`, [B, {patches}, {pixel_out}]), each patch normalised as (x - mean) / sqrt(var + 1e-6) with
  the unbiased variance; the per-patch mean squared error; per sample, the sum over masked patches divided by
  clamp(count, 1e-8); the sum over samples with a masked patch divided by (their number + 1e-8).
- total = {total_formula}.

## Mask rules: `rectangles.safetensors`, `text_mask_cases.json`

Random rectangle (`generate_random_rectangular_mask_image(mask_ratio={ratio})`, the config's
`random_rectangular_mask_image_ratio`; the dataset uses it with probability {prob} in place of a phrase's boxes):
the target area is round(49 x {ratio}) = 37 with tolerance max(1, 0.25 x 37); h = randint(1, 7) then w =
randint(1, 7) (Python's `random`, inclusive) until |h w - 37| <= 9.25; then top = randint(0, 7 - h), left =
randint(0, 7 - w). Nine shapes pass (4x7, 7x4, 5x6, 6x5, 5x7, 7x5, 6x6, 6x7, 7x6): areas 28, 30, 35, 36, 42 with
probabilities 2/9, 2/9, 2/9, 1/9, 2/9. The file holds {draws_text} official draws after `random.seed(0)`: `areas`,
`heights`, `widths`, `tops`, `lefts` (uint8, one per draw, read from the returned mask) and `patch_counts` [49]
i64, how often each patch was masked. CPython's `random` with the same seed and call order gives the same draws.

Word -> token (`get_text_mask_token_flag`, relation words first, then attribute words): a word whose lower case is
"the" is skipped; each other word is BPE-encoded alone (lower case, no SOT/EOT) and its first contiguous match in
the caption's {ctx} ids, searched from position 0, is masked; no match masks nothing. So a repeated word masks the
same first occurrence again, a multi-word relation ("to the left of") is one sequence with its "the", and a word
can hit the sub-tokens of another ("red" the end of "multicolored", "boarder" of "skateboarder").
`text_mask_cases.json` holds 10 cases: the caption, the words, the ids and BPE tokens up to EOS and the official
masked positions.
"""


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--official", type=Path, required=True, metavar="DIR",
                        help=f"a checkout of {REPOSITORY} @ {COMMIT}")
    cli.add_output(parser, "folder", "the fixture folder to write", required=True)
    args = parser.parse_args(argv)
    check_checkout(args.official)
    torch.set_num_threads(1)  # one reduction order: identical bytes on every run
    write_fixture(args.out, TinyMacco(), args.official)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
