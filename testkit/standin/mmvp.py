"""Stand-in files for MMVP-VLM: `Questions.csv` and `MLLM_VLM Images/<Type>/<id>.jpg`, as `MMVP/MMVP_VLM` has them.

Pairs take question ids (1, 2), (3, 4), ... and the pattern folders in the release's order, 15 pairs each; some
statements hold a comma, so the CSV quotes them. The release has 135 pairs, so at most 135 are written.
"""
from __future__ import annotations

import csv
from pathlib import Path

from testkit.standin.images import encoded_pool
from testkit.standin.two_by_two import pool_index, swapped_captions

# The dataset's image folders, in the order of the official pattern list (15 pairs each).
TYPE_FOLDERS = ("Orientation", "Presence", "State", "Quantity", "Spatial", "Color", "Structural Character", "Text",
                "Camera Perspective")
PAIRS_PER_TYPE = 15


def write_mmvp_vlm(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """`n_items` pairs (at most the release's 135) with pooled JPEG images; no options are needed."""
    root, pool = Path(root), encoded_pool(seed, ".jpg")
    pairs = min(n_items, PAIRS_PER_TYPE * len(TYPE_FOLDERS))
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "Questions.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["Question ID", "Type", "Statement"])
        for pair in range(pairs):
            folder = TYPE_FOLDERS[pair // PAIRS_PER_TYPE]
            statements = swapped_captions(pair)
            if pair % 4 == 1:
                statements = tuple(f"{statement}, seen from the side" for statement in statements)
            for which, statement in enumerate(statements):
                qid = 2 * pair + which + 1
                writer.writerow([qid, folder, statement])
                image = root / "MLLM_VLM Images" / folder / f"{qid}.jpg"
                image.parent.mkdir(parents=True, exist_ok=True)
                image.write_bytes(pool[pool_index(pair, which, len(pool))])
    return {}
