"""`python -m study.term_gradients --config A.yaml [--config B.yaml ...] [key=value ...] [--batches N] [--out FILE]`:
which loss term drives which tower?

A method's loss is a weighted sum of terms (`compute_terms`). AdamW divides every parameter's update by the running
size of its gradient, so a term's absolute weight does not set the step size; what it sets is the term's share of
each parameter's gradient, and with it the direction the tower moves in. This tool builds the run's module and
training data exactly as `lightning_modules.fit` does (same configs, same overrides), takes `--batches` training
batches, and for every weighted term prints the norm of its gradient over the text tower, the image tower and the
rest (the method's head and logit_scale), and the cosine between that gradient and the sum over all terms (the
direction a step takes). No optimizer step is taken.

Measured for MACCO in the method study: docs/study.md#maccos-deficit, with the command.
"""
from __future__ import annotations

import argparse
import json
from typing import Dict, List, Optional, Sequence

import torch

from core.cli import add_key_values, add_output, refuse_renamed
from lightning_modules import load_run_config_or_exit
from lightning_modules.fit import build_datamodule, build_module

# "other": the method's head (predictors, mask tokens, aligners) and CLIP's logit_scale.
TOWERS = ("text", "image", "other")


def towers_of(module) -> Dict[int, str]:
    """Parameter id -> the part it belongs to: the CLIP image tower, the CLIP text tower, or "other"."""
    image = {id(p) for p in module.clip.visual.parameters()}
    text = {id(p) for p in module.clip.parameters() if id(p) not in image and p is not module.clip.logit_scale}
    return {id(p): "image" if id(p) in image else "text" if id(p) in text else "other"
            for p in module.parameters()}


def flat_gradients(module, loss: torch.Tensor, tower: Dict[int, str]) -> Dict[str, torch.Tensor]:
    """The gradient of `loss` per tower (`towers_of`), flattened (zeros where the term does not reach), in float64."""
    params = [p for p in module.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    parts: Dict[str, List[torch.Tensor]] = {name: [] for name in TOWERS}
    for p, g in zip(params, grads):
        parts[tower[id(p)]].append((torch.zeros_like(p) if g is None else g).detach().double().flatten())
    return {name: torch.cat(vectors) if vectors else torch.zeros(0, dtype=torch.float64)
            for name, vectors in parts.items()}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    denominator = a.norm() * b.norm()
    return float(a @ b / denominator) if denominator > 0 else 0.0


def term_report(module, batch: dict) -> Dict[str, Dict[str, Dict[str, float]]]:
    """Per weighted term and tower: the gradient norm and its cosine with the total gradient, for one batch."""
    terms, _ = module.compute_terms(batch)
    bad = [name for name, value in terms.items() if not torch.isfinite(value)]
    if bad:
        raise FloatingPointError(f"non-finite loss terms {bad} on this batch: their gradients would be meaningless")
    tower = towers_of(module)
    per_term = {name: flat_gradients(module, value, tower) for name, value in terms.items()}
    total = {name: sum(grads[name] for grads in per_term.values()) for name in TOWERS}
    return {name: {part: {"norm": float(grads[part].norm()), "cos_total": cosine(grads[part], total[part])}
                   for part in TOWERS}
            for name, grads in per_term.items()}


def mean_reports(reports: Sequence[Dict[str, Dict[str, Dict[str, float]]]]) -> Dict[str, Dict[str, Dict[str, float]]]:
    first = reports[0]
    return {term: {tower: {key: sum(r[term][tower][key] for r in reports) / len(reports)
                           for key in first[term][tower]}
                   for tower in TOWERS}
            for term in first}


def print_table(report: Dict[str, Dict[str, Dict[str, float]]]) -> None:
    header = " | ".join(f"{tower} norm | {tower} cos" for tower in TOWERS)
    print(f"| term | {header} |")
    print("|---" * (1 + 2 * len(TOWERS)) + "|")
    for term, towers in report.items():
        cells = " | ".join(f"{towers[t]['norm']:.3g} | {towers[t]['cos_total']:+.2f}" for t in TOWERS)
        print(f"| {term} | {cells} |")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", default=[], help="config files, merged in order (as fit)")
    parser.add_argument("--batches", type=int, default=4, help="training batches to average over")
    add_output(parser, "file", help="also write the table here (JSON)")
    add_key_values(parser, help="config overrides (as fit), e.g. method.name=macco")
    refuse_renamed(parser, {"--json": "--out FILE"})
    # Options and overrides may interleave (`--config a.yaml k=v --config b.yaml k2=v2`); every --config file
    # still merges before every override, each in the order given.
    return parser.parse_intermixed_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    if args.batches < 1:
        raise SystemExit("--batches must be at least 1")
    cfg = load_run_config_or_exit(args.config, args.overrides)
    torch.manual_seed(cfg.seed)
    module = build_module(cfg)
    data = build_datamodule(cfg, module)
    data.setup("fit")
    module.train()
    reports = []
    for index, batch in enumerate(data.train_dataloader()):
        if index == args.batches:
            break
        reports.append(term_report(module, batch))
    if not reports:
        raise SystemExit("the training data gave no batch: check data.train_annotations and data.batch_size")
    report = mean_reports(reports)
    print(f"gradient per weighted term, mean over {len(reports)} batches of {cfg.data.batch_size}")
    print_table(report)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"batches": len(reports), "terms": report}, handle, indent=2)


if __name__ == "__main__":
    main()
