"""Stand-in files for VisMin: the hub's parquet conversion of `mair-lab/vismin-bench` and the first evaluation
kit's `solutions/sim_solution.csv`.

Rows come in the release's order (object, attribute, relation, counting blocks, in proportion to its 579 / 294 /
622 / 589 items) with `id` restarting at 0 in each category, in two shards of the converted layout
(`default/test/0000.parquet`, `0001.parquet`). About half the items are marked swapped (text_1 describes image_0)
in the solution file, whose relation strings are written out as the real file spells them.
"""
from __future__ import annotations

import random
from pathlib import Path

from testkit.standin.images import encoded_pool
from testkit.standin.two_by_two import _image_struct, _write_parquet, pool_index, swapped_captions

RELEASE_SIZES = (("object", 579), ("attribute", 294), ("relation", 622), ("counting", 589))
FEATURES = {"id": "int64", "image_0": "Image", "text_0": "string", "image_1": "Image", "text_1": "string",
            "category": "string"}
ALIGNED_RELATIONS = "T0_I0 > T1_I0 & T1_I1 > T0_I1,T0_I0 > T0_I1 & T1_I1 > T1_I0"
SWAPPED_RELATIONS = "T1_I0 > T0_I0 & T0_I1 > T1_I1,T0_I1 > T0_I0 & T1_I0 > T1_I1"


def category_sizes(n_items: int) -> list[tuple[str, int]]:
    """`n_items` split over the categories in the release's proportions (largest remainders get the rest)."""
    total = sum(size for _, size in RELEASE_SIZES)
    shares = [n_items * size / total for _, size in RELEASE_SIZES]
    sizes = [int(share) for share in shares]
    by_remainder = sorted(range(len(shares)), key=lambda k: sizes[k] - shares[k])
    for k in by_remainder[:n_items - sum(sizes)]:
        sizes[k] += 1
    return [(category, size) for (category, _), size in zip(RELEASE_SIZES, sizes)]


def write_vismin(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """Two parquet shards with embedded PNGs and the matching sim_solution.csv; no options are needed."""
    root, pool, rng = Path(root), encoded_pool(seed, ".png"), random.Random(seed)
    rows, solution = [], ["idx,Text,Image,category"]
    for category, size in category_sizes(n_items):
        for idx in range(size):
            index = len(rows)
            text_0, text_1 = swapped_captions(index)
            rows.append({"id": idx, "text_0": text_0, "text_1": text_1, "category": category,
                         **{f"image_{k}": _image_struct(pool[pool_index(index, k, len(pool))], f"{index}_{k}.png")
                            for k in (0, 1)}})
            solution.append(f"{idx},{SWAPPED_RELATIONS if rng.random() < 0.5 else ALIGNED_RELATIONS},{category}")
    half = (len(rows) + 1) // 2
    for shard, part in enumerate((rows[:half], rows[half:])):
        columns = {name: [row[name] for row in part] for name in FEATURES}
        _write_parquet(root / "default" / "test" / f"{shard:04d}.parquet", columns, FEATURES)
    (root / "solutions").mkdir(parents=True, exist_ok=True)
    (root / "solutions" / "sim_solution.csv").write_text("\n".join(solution) + "\n")
    return {}
