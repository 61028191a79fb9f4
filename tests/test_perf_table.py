"""`perf.table`'s data: benchmarks that draw on one image collection share image contents, and the table run embeds
each shared content once (what the floor is measured against)."""
from __future__ import annotations

from pathlib import Path

import torch

from evaluation.scorers import ClipScorer
from perf import table


def test_shared_pools_give_the_same_bytes_across_benchmarks_and_the_table_embeds_them_once(tmp_path):
    args = table.parse_args(["--benchmarks", "sugarcrepe,sugarcrepe_pp,whatsup_gqa_one", "--items", "9",
                             "--image-size", "32", "--data-root", str(tmp_path)])
    benchmarks = table.prepare_data(args)
    contents = {}
    for name in ("sugarcrepe", "sugarcrepe_pp"):
        for ref in benchmarks[name].image_refs():
            contents.setdefault(table.pooled_key(benchmarks[name], ref.path), set()).add(Path(ref.path).read_bytes())
    shared = [key for key in contents if key.startswith("coco:")]
    assert shared and all(len(contents[key]) == 1 for key in shared)  # one content per pooled COCO image
    gqa = benchmarks["whatsup_gqa_one"]
    assert all(table.pooled_key(gqa, ref.path).startswith("vg:") for ref in gqa.image_refs())

    torch.manual_seed(0)
    base = ClipScorer.from_pretrained("ViT-Tiny-16-64", None, batch_size=32)
    report = table.measure(benchmarks, lambda: ClipScorer(base.model, base.tokenizer, base.preprocess, batch_size=32))
    refs = sum(len(b.image_refs()) for b in benchmarks.values())
    distinct = len({Path(ref.path).read_bytes() for b in benchmarks.values() for ref in b.image_refs()})
    assert report["image_refs"] == refs and report["images_embedded"] == distinct < refs
    assert set(report["per_benchmark_table"]) == set(benchmarks)
