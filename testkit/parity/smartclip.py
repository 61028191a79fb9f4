"""Regenerate the SmartCLIP parity fixture by running the official SmartCLIP code.

    python -m testkit.parity.smartclip --official /path/to/checkout --out tests/data/parity/smartclip

`--official` is a checkout of reyuyu/SAID @ 729c5a6, a repository carrying the official SmartCLIP code (its README
calls it the official implementation and points to the authors' MidPush/SmartCLIP). Its `model/model_longclip.py`
is imported as it is, and `train/train.py` is read (not run) for the loss weights.

The official `CLIP.forward` runs unchanged: the official `CLIP` (so the official `MaskNetwork` with its own
initialisation, `width // 64` heads as the official `build_model`), whose two encoders are overridden in a subclass
to return given tensors. That keeps the mask network and losses, which the fixture checks, as they are, and makes
the image and pooled text features leaves whose gradients can be read. The inputs come from official blocks too:
the image features from the official `VisionTransformer`, the per-token features from the official text
`Transformer` weights run with a causal mask over the fixture's few positions (the official `encode_text` is tied
to Long-CLIP's 248 positions), then the official `ln_final` and `text_projection`.

Sizes (why each is the smallest that exercises every path `tests/test_smartclip_parity.py` checks):
- width = D = 128: the official mask has the text width and multiplies the D-dim image features, so width = D;
  128 is the smallest width with 2 heads under the `width // 64` rule, and one head would leave the head split,
  and a wrong head count, unseen;
- 4 positions: one caption fills them all (start, two words, end), the other ends early and leaves a padding
  position, which the official network attends to and pools over;
- 2 captions: the fewest for which sidm and dism (cross-entropies over the batch) are not 0 and a mix-up of
  which index carries the mask changes them.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import importlib.util
import json
import tempfile
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Dict, Iterator, List, Optional, Sequence

import open_clip
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor, nn

from core import cli

OFFICIAL_REPOSITORY = "reyuyu/SAID"
OFFICIAL_COMMIT = "729c5a6acdaa0d51797c094095f5868cc5c4c7f8"
MODEL_FILE = "model/model_longclip.py"
TRAIN_FILE = "train/train.py"
COMMAND = "python -m testkit.parity.smartclip --official /path/to/checkout --out tests/data/parity/smartclip"

WIDTH = 128  # text width = D (module docstring)
HEADS = WIDTH // 64  # the official build_model's rule for the text tower, whose head count the mask network takes
CONTEXT = 4
CAPTIONS = ("a man riding a horse on the beach", "people")  # truncated to fill all 4 positions; 1 padding position
VOCAB = 49408  # CLIP's BPE vocabulary
IMAGE_RESOLUTION, PATCH, VISION_WIDTH = 16, 8, 64  # a 2 x 2-patch ViT: the image features' source only
TEMPERATURE = 100.0  # written into the official CLIP.forward (`100 * sidm_sim`, `100 * dism_sim`)
SEED = 0  # torch's global generator: the official initialisations, the images
PERTURB_SEED = 1
POOL_BIAS = 0.37

# Checks that the fixture can tell a right port from a wrong one (`check_informative`).
MIN_LOGIT_MARGIN = 1e-4  # every |logit| far above fp32 rounding (~1e-6), so every hard bit is decided
MIN_CONTRASTIVE_LOSS = 1e-2  # sidm and dism not saturated to ~0, where rounding is no longer relative

POOL_BIAS_NAME = "mask_net.attn_pool.attention.bias"
MAPPING = {
    **{f"mask_net.resblocks.0.{name}": f"mask_net.block.{name}"
       for name in ("attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight", "attn.out_proj.bias",
                    "ln_1.weight", "ln_1.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight",
                    "mlp.c_proj.bias", "ln_2.weight", "ln_2.bias")},
    "mask_net.attn_pool.attention.weight": "mask_net.pool_score.weight",
    POOL_BIAS_NAME: "no project counterpart: the project's pool score has no bias, because a shift added to "
                    "every position's score cancels in the softmax over positions",
    "(project only) mask_net.to_logits": "Identity when width == D, as here; the official has no such layer "
                                         "(its mask has the text width)",
}
GRADIENT_PARAMETERS = ("resblocks.0.attn.in_proj_weight", "attn_pool.attention.weight", "attn_pool.attention.bias")


@dataclass
class Features:
    """The encoders' outputs that the official forward reads: ids [B, L], per-token features [B, L, W] (after
    ln_final, before text_projection), image features [B, D] and pooled text features [B, D], both unnormalised."""

    token_ids: Tensor
    token_features: Tensor
    image_features: Tensor
    text_features: Tensor


@dataclass
class OfficialRun:
    """What one official forward and backward gave: mask logits, masks, loss terms, total and gradients."""

    logits: Tensor
    soft_mask: Tensor
    hard_mask: Tensor
    terms: Dict[str, float]
    total: float
    grads: Dict[str, Tensor]


def load_official(checkout: Path) -> ModuleType:
    """The official `model/model_longclip.py`, imported from its file.

    By its file, not as the package `model`: the package's `__init__` imports the tokenizer and image transforms
    (torchvision, PIL, a BPE file), which the mask network and losses do not use.
    """
    path = checkout / MODEL_FILE
    if not path.is_file():
        raise SystemExit(f"{path} not found: --official must be a checkout of {OFFICIAL_REPOSITORY}")
    spec = importlib.util.spec_from_file_location("smartclip_official_model_longclip", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def argparse_defaults(source: str, flags: Sequence[str]) -> Dict[str, object]:
    """The `default=` of each `parser.add_argument(flag, ...)` in a script's source, read without running it."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
                and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in flags):
            default = next(k.value for k in node.keywords if k.arg == "default")
            found[node.args[0].value] = ast.literal_eval(default)
    missing = set(flags) - set(found)
    if missing:
        raise SystemExit(f"{TRAIN_FILE} defines no {sorted(missing)}: not the official training script")
    return found


def official_loss_weights(checkout: Path) -> Dict[str, float]:
    """The training script's default weights: `lambda_sparse * sparsity + lambda_align * (sidm + dism)`.

    Its default `--soft_mask 0` is the hard mask (the forward's `soft=` flag): checked, since the fixture's
    gradients are the hard mask's.
    """
    defaults = argparse_defaults((checkout / TRAIN_FILE).read_text(), ("--lambda_sparse", "--lambda_align",
                                                                      "--soft_mask"))
    if defaults["--soft_mask"] != 0:
        raise SystemExit(f"{TRAIN_FILE}: the default mask is no longer the hard one")
    align = float(defaults["--lambda_align"])
    return {"sparsity": float(defaults["--lambda_sparse"]), "sidm": align, "dism": align}


def git_blob_id(path: Path) -> str:
    """The file's git object id, what `git rev-parse <commit>:<path>` prints for the same bytes."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def feature_input_clip(official: ModuleType) -> type:
    """A subclass of the official `CLIP` whose encoders return `given` (a `Features`), for `CLIP.forward`."""

    class FeatureInputCLIP(official.CLIP):
        given: Optional[Features] = None

        def encode_image(self, image: Tensor) -> Tensor:
            return self.given.image_features

        def encode_text(self, text: Tensor, return_full: bool = False, return_pool: bool = False):
            assert return_full and not return_pool, "the forward asks for (pooled, per-token)"
            return self.given.text_features, self.given.token_features

    return FeatureInputCLIP


def build_clip(official: ModuleType) -> nn.Module:
    """The official CLIP at the fixture's sizes, official initialisation (seeded), mask network perturbed."""
    torch.manual_seed(SEED)
    clip = feature_input_clip(official)(
        embed_dim=WIDTH, image_resolution=IMAGE_RESOLUTION, vision_layers=1, vision_width=VISION_WIDTH,
        vision_patch_size=PATCH, context_length=CONTEXT, vocab_size=VOCAB, transformer_width=WIDTH,
        transformer_heads=HEADS, transformer_layers=1, load_from_clip=False)
    perturb_mask_network(clip.mask_net)
    return clip


def perturb_mask_network(mask_net: nn.Module) -> None:
    """Give the official initialisation's unit LayerNorms and zero biases distinct values.

    At weight 1 and bias 0, two LayerNorms (or biases) are interchangeable: a port that swapped or dropped one
    would still match. The pool bias gets a large value, to show that it cancels in the softmax over positions.
    """
    generator = torch.Generator().manual_seed(PERTURB_SEED)
    with torch.no_grad():
        for name, parameter in mask_net.named_parameters():
            if name.startswith("attn_pool.") or not (".ln_" in name or name.endswith("bias")):
                continue
            noise = torch.randn(parameter.shape, generator=generator)
            if ".ln_" in name:
                parameter.copy_(1 + 0.1 * noise if name.endswith("weight") else 0.05 * noise)
            else:
                parameter.copy_(0.02 * noise)
        mask_net.attn_pool.attention.bias.fill_(POOL_BIAS)


@torch.no_grad()
def make_features(official: ModuleType, clip: nn.Module, captions: Sequence[str]) -> Features:
    """The inputs: captions through the official text blocks, random images through the official ViT."""
    ids = open_clip.tokenize(list(captions), context_length=CONTEXT).long()  # truncated ones end with EOS
    tokens, pooled = text_tower(official, clip, ids)
    images = torch.randn(len(captions), 3, IMAGE_RESOLUTION, IMAGE_RESOLUTION)
    image_features = official.CLIP.encode_image(clip, images)  # the official encoder, not the override
    return Features(ids, tokens, image_features, pooled)


def text_tower(official: ModuleType, clip: nn.Module, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token features [B, L, W] and pooled text features [B, D] of `ids` [B, L].

    The official CLIP's own text transformer weights, in an official `Transformer` whose causal mask has the
    fixture's L positions (the CLIP's own mask has 248); then its ln_final, and the EOS row @ text_projection.
    """
    length = ids.shape[1]
    causal = torch.full((length, length), float("-inf")).triu_(1)
    tower = official.Transformer(WIDTH, layers=1, heads=HEADS, attn_mask=causal)
    tower.load_state_dict(clip.transformer.state_dict())
    x = clip.token_embedding(ids) + clip.positional_embedding[:length]  # = the official mask1 term for L <= 20
    tokens = clip.ln_final(tower(x.permute(1, 0, 2)).permute(1, 0, 2))
    pooled = tokens[torch.arange(len(ids)), ids.argmax(dim=-1)] @ clip.text_projection
    return tokens, pooled


def run_official(clip: nn.Module, features: Features, weights: Dict[str, float], soft: bool) -> OfficialRun:
    """The official forward (hard or soft mask), the training script's total, and its gradients."""
    clip.zero_grad(set_to_none=True)
    images = features.image_features.clone().requires_grad_()
    texts = features.text_features.clone().requires_grad_()
    clip.given = replace(features, image_features=images, text_features=texts)
    captured: List[Tensor] = []

    def keep_logits(module: nn.Module, args: tuple, logits: Tensor) -> None:
        logits.retain_grad()
        captured.append(logits)

    handle = clip.mask_net.register_forward_hook(keep_logits)
    try:
        # The forward reads only the batch size and device of its image argument besides encoding it.
        terms = clip(images, features.token_ids, 0, soft=soft)
    finally:
        handle.remove()
    total = weights["sparsity"] * terms["loss_sparsity"] + weights["sidm"] * (terms["loss_sidm"] + terms["loss_dism"])
    total.backward()
    (logits,) = captured
    with torch.no_grad():
        _, hard_mask = clip.compute_smart_image_feature(images, features.token_features, soft=False)
    grads = {"image_features": images.grad, "text_features": texts.grad, "mask_logits": logits.grad,
             **{f"mask_net.{name}": clip.mask_net.get_parameter(name).grad for name in GRADIENT_PARAMETERS}}
    return OfficialRun(logits.detach(), torch.sigmoid(logits).detach(), hard_mask.detach(),
                       {name: terms[f"loss_{name}"].item() for name in ("sidm", "dism", "sparsity")},
                       total.item(), {name: grad.detach().clone() for name, grad in grads.items()})


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """A one-process gloo group (the official forward gathers with `torch.distributed.nn.all_gather`)."""
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def check_informative(features: Features, hard: OfficialRun) -> None:
    """Refuse a fixture that could not tell a right port from a wrong one (see the constants)."""
    eos = features.token_ids.argmax(dim=-1)
    problems = []
    if not ((eos == CONTEXT - 1).any() and (eos < CONTEXT - 1).any()):
        problems.append("it needs a caption filling every position and one followed by padding")
    if hard.logits.abs().min() < MIN_LOGIT_MARGIN:
        problems.append(f"a mask logit is within {MIN_LOGIT_MARGIN} of 0, so its hard bit is a coin toss")
    active = hard.hard_mask.sum(dim=1)
    if not ((active > 0) & (active < WIDTH)).all():
        problems.append("a hard mask keeps no dimension or every one")
    if min(hard.terms["sidm"], hard.terms["dism"]) < MIN_CONTRASTIVE_LOSS:
        problems.append("sidm or dism is saturated")
    if problems:
        raise SystemExit("the fixture would not be informative: " + "; ".join(problems) + ". Change a seed.")


def fixture_tensors(features: Features, hard: OfficialRun) -> Dict[str, Tensor]:
    """`fixture.safetensors`: the inputs, the official logits and masks, and the hard total's gradients."""
    tensors = {"token_ids": features.token_ids, "token_features": features.token_features,
               "image_features": features.image_features, "text_features": features.text_features,
               "mask_logits": hard.logits, "soft_mask": hard.soft_mask, "hard_mask": hard.hard_mask}
    tensors.update({f"grad_total/{name}": grad for name, grad in hard.grads.items()})
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


def expected_values(features: Features, hard: OfficialRun, soft: OfficialRun, weights: Dict[str, float],
                    sources: Dict[str, str]) -> dict:
    """`expected.json`: loss terms for both masks, the recipe, the sizes, the captions and the source."""
    return {"hard": {**hard.terms, "total": hard.total,
                     "active_dims_per_sample": hard.hard_mask.sum(dim=1).tolist()},
            "soft": {**soft.terms, "total": soft.total},
            "weights": weights, "temperature": TEMPERATURE, "width": WIDTH, "heads": HEADS, "embed_dim": WIDTH,
            "batch": len(CAPTIONS), "context_length": CONTEXT,
            "eos_positions": features.token_ids.argmax(dim=-1).tolist(), "captions": list(CAPTIONS),
            "official": {"repository": OFFICIAL_REPOSITORY, "commit": OFFICIAL_COMMIT, "git_blob_ids": sources}}


def readme(expected: dict) -> str:
    """The fixture's README.md."""
    hard, soft, sources = expected["hard"], expected["soft"], expected["official"]["git_blob_ids"]
    blob_lines = "\n".join(f"- `{path}`: git blob `{blob}`" for path, blob in sources.items())
    terms = "sidm {sidm:.7g}, dism {dism:.7g}, sparsity {sparsity:.7g}, total {total:.7g}"
    return README.format(repository=OFFICIAL_REPOSITORY, commit=OFFICIAL_COMMIT, short=OFFICIAL_COMMIT[:7],
                         command=COMMAND, blobs=blob_lines, batch=expected["batch"], context=CONTEXT, width=WIDTH,
                         heads=HEADS, captions=", ".join(f'"{c}"' for c in CAPTIONS), eos=expected["eos_positions"],
                         hard=terms.format(**hard), soft=terms.format(**soft), active=hard["active_dims_per_sample"],
                         torch=torch.__version__.split("+")[0])


def write_fixture(out: Path, clip: nn.Module, features: Features, hard: OfficialRun, soft: OfficialRun,
                  weights: Dict[str, float], sources: Dict[str, str]) -> None:
    """Write the five files into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    state = {f"mask_net.{name}": tensor.contiguous() for name, tensor in clip.mask_net.state_dict().items()}
    save_file(state, out / "weights.safetensors")
    save_file(fixture_tensors(features, hard), out / "fixture.safetensors")
    expected = expected_values(features, hard, soft, weights, sources)
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    (out / "mapping.json").write_text(json.dumps(MAPPING, indent=1) + "\n")
    (out / "README.md").write_text(readme(expected))


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--official", type=Path, required=True,
                        help=f"a checkout of {OFFICIAL_REPOSITORY} (@ {OFFICIAL_COMMIT[:7]})")
    cli.add_output(parser, "folder", "the fixture folder to write", required=True)
    args = parser.parse_args(argv)
    # One thread, deterministic kernels: two runs on one machine write the same bytes.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    # The official loss gathers with torch.distributed.nn.all_gather, which newer torch calls deprecated.
    warnings.filterwarnings("ignore", "torch.distributed.nn.functional.all_gather is deprecated", FutureWarning)
    official = load_official(args.official)
    weights = official_loss_weights(args.official)
    sources = {name: git_blob_id(args.official / name) for name in (MODEL_FILE, TRAIN_FILE)}
    with single_process_group():
        clip = build_clip(official)
        features = make_features(official, clip, CAPTIONS)
        hard = run_official(clip, features, weights, soft=False)
        soft = run_official(clip, features, weights, soft=True)
    check_informative(features, hard)
    write_fixture(args.out, clip, features, hard, soft, weights, sources)
    print(f"wrote {args.out}: hard total {hard.total:.7g}, soft total {soft.total:.7g}")


README = """\
# SmartCLIP parity fixture: the official mask network and loss

Written by `testkit/parity/smartclip.py`, which runs the official SmartCLIP code from a checkout of it:

```bash
{command}
```

## Source

The official code is the one carried by [{repository}](https://github.com/{repository}) @ `{short}`
(`{commit}`), whose README presents it as the official SmartCLIP implementation.
The script imports `model/model_longclip.py` from the checkout and reads the default loss weights out of
`train/train.py`. That code states no licence, and none of it is in this repository: this folder holds what it
computed (tensors and JSON) and this text. The files it read (compare with `git rev-parse {short}:<path>`):

{blobs}

What ran is the official `CLIP.forward`, unchanged: the official `CLIP` built at the sizes below (so the official
`MaskNetwork`, its initialisation and its loss code), in a subclass whose `encode_image` and `encode_text` return
the tensors stored here. The mask network's LayerNorms and biases were then moved off their initial values
(LayerNorm weights 1 + 0.1 N(0, 1), LayerNorm biases 0.05 N(0, 1), other biases 0.02 N(0, 1), pool bias 0.37), so
that no two of them are interchangeable. The total is the training script's: `lambda_sparse * sparsity +
lambda_align * (sidm + dism)` at its defaults. CPU, fp32, one thread, a one-process gloo group (the loss gathers
across ranks); torch {torch}.

The inputs come from official modules too: image features from the official `VisionTransformer` (random images),
per-token features from the official CLIP's text transformer weights with a causal mask over {context} positions,
its `ln_final`, and the pooled text features as the EOS row times `text_projection`.

## Sizes, the smallest that exercise every path the test checks

- width W = D = {width}, {heads} heads: the official mask has the text width and multiplies the D-dim image
  features, so W = D; the head count is W // 64 (the official rule), and {width} is the smallest W with more than
  one head, without which the split into heads, and a wrong head count, would go unseen;
- L = {context} positions: one caption fills them all (start, two words, end), the other leaves a padding
  position, which the official network attends to and pools over;
- B = {batch} captions: sidm and dism are cross-entropies over the batch, 0 for a single caption.

Captions: {captions} (the first truncated to L, ending with EOS).
EOS positions: {eos}.

## Files

- `weights.safetensors`: the official `mask_net.*` parameters, under their official names.
- `mapping.json`: official name -> the project's name (`mask_net.resblocks.0.X` -> `mask_net.block.X`, the pool
  score's weight -> `mask_net.pool_score.weight`); the pool bias has no project counterpart.
- `fixture.safetensors` (f32, `token_ids` i64):
  - inputs: `token_ids` [B, L], `token_features` [B, L, W] (every position, padding included),
    `image_features` [B, D] and `text_features` [B, D] (both unnormalised);
  - official outputs: `mask_logits`, `soft_mask` (the sigmoid), `hard_mask` (the sigmoid thresholded at 0.5),
    all [B, D];
  - `grad_total/...`: gradients of the hard-mask total w.r.t. `image_features`, `text_features`, `mask_logits`,
    and the mask network's `resblocks.0.attn.in_proj_weight`, `attn_pool.attention.weight` and
    `attn_pool.attention.bias`.
- `expected.json`: the loss terms for both masks, the weights, the temperature, the sizes, the EOS positions,
  the captions, and the source above.

Official values:
- hard mask: {hard};
  active dimensions per caption {active};
- soft mask: {soft}.
"""


if __name__ == "__main__":
    main()
