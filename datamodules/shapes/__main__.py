"""The shapes world generator's command line: `python -m datamodules.shapes --out DIR ...`."""

from __future__ import annotations

import argparse
import json

from core.cli import add_output
from datamodules.shapes.files import generate
from datamodules.shapes.world import CAPTION_RELATIONS, DEFAULT_CAPTION_RELATIONS


def main(argv: list[str] | None = None) -> None:
    """Command line entry point: generate the dataset and print the counts as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output(parser, "folder", required=True, help="the world's folder")
    parser.add_argument("--n-train", type=int, required=True)
    parser.add_argument("--n-val", type=int, required=True)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--captions-per-image", type=int, default=2)
    parser.add_argument("--n-swap", type=int, default=None,
                        help="swap items per split (default: a tenth of the images for train, as many for the others)")
    parser.add_argument("--n-test", type=int, default=None, help="in-distribution test images (default: n-val)")
    parser.add_argument("--n-test-unseen", type=int, default=None,
                        help="test images of held-out combinations and colour pairs (default: n-val)")
    parser.add_argument("--relations", choices=sorted(CAPTION_RELATIONS), default=DEFAULT_CAPTION_RELATIONS,
                        help='the relations captions state: "both" either way ("X left of Y", "Y right of X"), '
                             '"one-way" only "left of" and "above"')
    args = parser.parse_args(argv)
    counts = generate(args.out, args.n_train, args.n_val, args.image_size, args.seed,
                      args.captions_per_image, args.n_swap, args.n_test, args.n_test_unseen, args.relations)
    print(json.dumps(counts, sort_keys=True))


if __name__ == "__main__":
    main()
