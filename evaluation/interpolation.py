"""`python -m evaluation.interpolation --run RUN --alphas 0.5[,0.8] --out DIR`: WiSE-FT exports of a run.

Weight-space ensembling (WiSE-FT, Wortsman et al., CVPR 2022) scores a fine-tuned model at

    theta(alpha) = (1 - alpha) theta_pretrained + alpha theta_finetuned,   0 <= alpha <= 1,

every floating-point tensor of the state dict interpolated entry by entry (in float64, stored as the fine-tuned
tensor's dtype); alpha 0 and 1 are the two end models themselves, bit for bit. The fine-tuned end is the run's
export (LoRA adapters already merged into it); the pretrained end is the backbone the run started from, rebuilt
from what the export records (`model.json` `backbone`: the run's `model` section without its adapters, a
Long-CLIP stretch included), or from the run's `config.yaml` for an export made before that record, or an
explicit `--pretrained` (an export folder, a checkpoint file or an open_clip tag, built as the fine-tuned model).
Two ends of different architectures (model config, state-dict keys or shapes) are refused before anything is
interpolated or written.

This command writes `DIR/alpha-<alpha>/` for each alpha: an export like fit's (`open_clip.pt`, `model.json` with a
`wise_ft` record, `model_configs/`). To score an interpolation without writing it, give `--alphas` to
`python -m evaluation.evaluate --run RUN`; `python -m study.tradeoff` traces the whole path for several runs.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

import torch
from omegaconf import OmegaConf
from torch import Tensor

from core.cli import add_output
from modeling.encoders import HF_PREFIX, ZOO_PREFIX, BuiltModel, build_model, resolve_path
from modeling.published import load_zoo_base
from modeling.export import MODEL_CONFIGS_DIR, export_model, load_export, read_export_metadata
from evaluation.aligner import is_aligner_export
from evaluation.provenance import ProvenanceError, export_provenance, run_export_dir
from modeling.backbone import build_backbone

ALPHA_FOLDER = "alpha-{alpha:g}"


class InterpolationError(ValueError):
    """Two models that cannot be interpolated, or a run whose pretrained end cannot be found (one line)."""


def parse_alphas(text: str) -> List[float]:
    """`0,0.25,1` -> [0.0, 0.25, 1.0]: distinct values in [0, 1], in the order given."""
    try:
        alphas = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--alphas {text!r}: comma-separated numbers, e.g. 0,0.5,1") from None
    bad = [alpha for alpha in alphas if not (math.isfinite(alpha) and 0 <= alpha <= 1)]
    if bad or not alphas:
        raise argparse.ArgumentTypeError(f"--alphas {text!r}: each alpha in [0, 1] (0 = pretrained, 1 = fine-tuned)")
    if len(set(alphas)) != len(alphas):
        raise argparse.ArgumentTypeError(f"--alphas {text!r}: an alpha is repeated")
    return alphas


def alpha_folder(alpha: float) -> str:
    return ALPHA_FOLDER.format(alpha=alpha)


# ----- the two ends ---------------------------------------------------------------------------------------------
@dataclass
class Endpoints:
    """The pretrained and fine-tuned models of one run, with what identifies each (`record`)."""

    pretrained: BuiltModel
    finetuned: BuiltModel
    record: Dict[str, object]


def recorded_backbone(export_dir: Path) -> Dict[str, object]:
    """The `model` section the run started from: the export's `backbone` record, else the run's config.yaml."""
    metadata = read_export_metadata(export_dir)
    if metadata.get("backbone") is not None:
        return dict(metadata["backbone"])
    config = Path(export_dir).parent / "config.yaml"
    if not config.is_file():
        raise InterpolationError(f"{export_dir} records no backbone and has no run config.yaml beside it: give the "
                                 f"pretrained model with --pretrained")
    model = OmegaConf.to_container(OmegaConf.load(config).model, resolve=True)
    model.pop("lora", None)
    return model


def pretrained_end(export_dir: Path, pretrained: Optional[str] = None) -> tuple[BuiltModel, Dict[str, object]]:
    """The pretrained end: `pretrained` (built under the fine-tuned model's name) or the recorded backbone."""
    if pretrained is not None:
        name = read_export_metadata(export_dir)["model"]
        path = resolve_path(pretrained)
        if path.is_dir() and (path / "model.json").is_file():
            return load_export(path), {"pretrained": str(path)}
        argument = str(path) if path.exists() else pretrained
        return build_model(name, argument, str(Path(export_dir) / MODEL_CONFIGS_DIR)), {"pretrained": pretrained}
    backbone = recorded_backbone(export_dir)
    if not backbone.get("pretrained"):
        raise InterpolationError(f"the run of {export_dir} started from random weights (model.pretrained=null): "
                                 f"there is no pretrained model to interpolate with; give one with --pretrained")
    if str(backbone["pretrained"]).startswith((ZOO_PREFIX, HF_PREFIX)):  # a published checkpoint, read by its format
        built, _ = build_backbone(backbone)
        return built, {"backbone": backbone}
    source = resolve_path(str(backbone["pretrained"]))
    looks_local = "/" in str(backbone["pretrained"]) or str(backbone["pretrained"]).endswith((".pt", ".bin"))
    if looks_local and not source.exists():
        raise InterpolationError(f"the run of {export_dir} started from {backbone['pretrained']}, which is not there "
                                 f"from {Path.cwd()}: run from the folder it was trained in, or give --pretrained")
    backbone["pretrained"] = str(source) if source.exists() else backbone["pretrained"]
    built, _ = build_backbone(backbone)
    return built, {"backbone": backbone}


def load_endpoints(export_dir: Path, pretrained: Optional[str] = None) -> Endpoints:
    """Both ends of a run's export, refused (`InterpolationError`) when their architectures differ."""
    export_dir = Path(export_dir)
    if is_aligner_export(export_dir):
        raise InterpolationError(f"{export_dir} is a TFLocal / TFGlobal export: its backbone was never fine-tuned "
                                 f"(the aligner is the trained part), so there is nothing to interpolate")
    finetuned = load_export(export_dir)
    start, start_record = pretrained_end(export_dir, pretrained)
    check_same_architecture(start, finetuned)
    record = {"finetuned": str(export_dir), **start_record}
    return Endpoints(start, finetuned, record)


def zoo_endpoints(name: str, weights: str, base: Optional[str] = None) -> Endpoints:
    """Both ends of a published checkpoint (`core.zoo`): the model it was fine-tuned from (the entry's base tag, or
    `base`: a tag, an export folder or an open_clip checkpoint file), built as the checkpoint is, and the checkpoint
    read by its format."""
    from core.zoo import zoo_entry

    entry = zoo_entry(name)
    finetuned = build_model(f"zoo:{entry.name}", weights)
    start = load_zoo_base(entry, base)
    check_same_architecture(start, finetuned)
    return Endpoints(start, finetuned, {"finetuned": f"zoo:{entry.name}:{weights}", "pretrained": base or entry.base})


def check_same_architecture(first: BuiltModel, second: BuiltModel) -> None:
    """Refuse two models whose open_clip configs, state-dict keys or tensor shapes differ, naming the first
    difference (QuickGELU is part of the config: another activation is another function)."""
    configs = [_flat(json.loads(json.dumps(built.config))) for built in (first, second) if built.config is not None]
    if len(configs) == 2 and configs[0] != configs[1]:
        differing = next(key for key in sorted(set(configs[0]) | set(configs[1]))
                         if configs[0].get(key) != configs[1].get(key))
        raise InterpolationError(f"different architectures: {first.name} has {differing}="
                                 f"{configs[0].get(differing)!r}, {second.name} has {configs[1].get(differing)!r}; "
                                 f"only two models of one architecture interpolate")
    a, b = first.model.state_dict(), second.model.state_dict()
    if list(a) != list(b):
        only = sorted(set(a) ^ set(b))
        raise InterpolationError(f"different architectures: {first.name} and {second.name} differ in "
                                 f"{only[:3] or 'the order of their tensors'}; only two models of one architecture "
                                 f"interpolate")
    for key in a:
        if a[key].shape != b[key].shape or a[key].dtype.is_floating_point != b[key].dtype.is_floating_point:
            raise InterpolationError(f"different architectures: {key} is {tuple(a[key].shape)} in {first.name} and "
                                     f"{tuple(b[key].shape)} in {second.name}; only two models of one architecture "
                                     f"interpolate")


def _flat(config: Mapping, prefix: str = "") -> Dict[str, object]:
    flat: Dict[str, object] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# ----- the interpolation ----------------------------------------------------------------------------------------
def interpolate_state(pretrained: Mapping[str, Tensor], finetuned: Mapping[str, Tensor],
                      alpha: float) -> Dict[str, Tensor]:
    """(1 - alpha) pretrained + alpha finetuned for every floating-point tensor (computed in float64, stored in the
    fine-tuned dtype); other tensors must agree and are kept. alpha 0 and 1 return the ends' own values."""
    state = {}
    for key, end in finetuned.items():
        start = pretrained[key]
        if not end.dtype.is_floating_point:
            if not torch.equal(start, end):
                raise InterpolationError(f"{key} ({end.dtype}) differs between the two models and cannot be "
                                         f"interpolated")
            state[key] = end.clone()
        elif alpha == 0:
            state[key] = start.to(end.dtype).clone()
        elif alpha == 1:
            state[key] = end.clone()
        else:
            mixed = (1 - alpha) * start.double() + alpha * end.double()
            state[key] = mixed.to(end.dtype)
    return state


def interpolated_model(endpoints: Endpoints, alpha: float) -> BuiltModel:
    """The fine-tuned model (transforms, tokenizer, config) with the weights theta(alpha), in memory."""
    model = copy.deepcopy(endpoints.finetuned.model)
    state = interpolate_state(endpoints.pretrained.model.state_dict(), endpoints.finetuned.model.state_dict(), alpha)
    model.load_state_dict(state)
    built = copy.copy(endpoints.finetuned)
    built.model = model
    return built


def wise_ft_record(endpoints: Endpoints, alpha: float) -> Dict[str, object]:
    """What an interpolated model's results and export record about it."""
    return {"wise_ft": {"alpha": alpha, **endpoints.record}}


def export_interpolated(endpoints: Endpoints, alpha: float, export_dir: Path,
                        extra: Optional[Mapping[str, object]] = None) -> Path:
    """Write theta(alpha) as a fit-style export (loads with `modeling.export.load_export` or plain open_clip)."""
    built = interpolated_model(endpoints, alpha)
    return export_model(built.model, built.name, export_dir, {**(extra or {}), **wise_ft_record(endpoints, alpha)},
                        built.config)


# ----- command line ---------------------------------------------------------------------------------------------
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--run", type=Path, required=True, help="a training run directory (its export/ is the "
                        "fine-tuned end)")
    parser.add_argument("--alphas", type=parse_alphas, required=True,
                        help="comma-separated weights of the fine-tuned end in [0, 1], e.g. 0.5 or 0,0.25,0.5")
    parser.add_argument("--pretrained", help="the pretrained end instead of the run's own backbone: an export "
                        "folder, a checkpoint file or an open_clip tag")
    add_output(parser, "folder", required=True, help="writes DIR/alpha-<alpha>/ per alpha, each an export")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> List[Path]:
    args = parse_args(argv)
    try:
        export_dir = run_export_dir(args.run)
        provenance = export_provenance(export_dir)
        endpoints = load_endpoints(export_dir, args.pretrained)
        provenance.check_unchanged()
    except (InterpolationError, ProvenanceError, FileNotFoundError) as err:
        raise SystemExit(str(err)) from None
    finetuned = read_export_metadata(export_dir)
    extra = {"method": finetuned.get("method"), "global_step": finetuned.get("global_step"),
             "finetuned_sha256": provenance.record["weights_sha256"]}
    written = []
    for alpha in args.alphas:
        out = args.out / alpha_folder(alpha)
        written.append(export_interpolated(endpoints, alpha, out, extra))
        print(f"alpha {alpha:g}: {out}", flush=True)
    return written



if __name__ == "__main__":
    main()
