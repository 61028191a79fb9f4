"""Generated stand-in data in each benchmark's exact official file format (tests and `perf.evaluate`).

The real benchmark files are not redistributable (or not reachable from here); these writers produce the
same schema with small generated images, so loaders, scorers and the CLI run end to end. Each family module
exposes `write_<benchmark>(root, n_items, seed) -> options`, where `options` are the keyword arguments
`build_benchmark(name, root, **options)` needs (for example an images folder outside the root).
`STANDINS` maps every registered benchmark name to its writer (a test checks that none is missing).
"""
from __future__ import annotations

from typing import Callable, Dict

from testkit.standin import aro, retrieval, sts, sugarcrepe, two_by_two, valse, vlchecklist, whatsup, zeroshot

STANDINS: Dict[str, Callable[..., dict]] = {
    "sugarcrepe": sugarcrepe.write_sugarcrepe,
    "aro_vg_relation": aro.write_aro_vg_relation,
    "aro_vg_attribution": aro.write_aro_vg_attribution,
    "aro_coco_order": aro.write_aro_coco_order,
    "aro_flickr_order": aro.write_aro_flickr_order,
    "valse": valse.write_valse,
    "vl_checklist": vlchecklist.write_vl_checklist,
    "whatsup_a": whatsup.write_whatsup_a,
    "whatsup_b": whatsup.write_whatsup_b,
    "whatsup_coco_one": whatsup.write_whatsup_coco_one,
    "whatsup_coco_two": whatsup.write_whatsup_coco_two,
    "whatsup_gqa_one": whatsup.write_whatsup_gqa_one,
    "whatsup_gqa_two": whatsup.write_whatsup_gqa_two,
    "winoground": two_by_two.write_winoground,
    "bivlc": two_by_two.write_bivlc,
    "biscor_ctrl": two_by_two.write_biscor_ctrl,
    "shapes_swap": two_by_two.write_shapes_swap,
    "coco_retrieval": retrieval.write_coco_retrieval,
    "flickr30k_retrieval": retrieval.write_flickr30k_retrieval,
    "zeroshot": zeroshot.write_zeroshot,
    "shapes_zeroshot": zeroshot.write_shapes_zeroshot,
    "sickr": sts.write_sickr,
    "stsb": sts.write_stsb,
}
