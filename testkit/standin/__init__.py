"""Generated stand-in data in each benchmark's exact official file format (tests and `perf.evaluate`).

The real benchmark files are not redistributable (or not reachable from here); these writers produce the
same schema with small generated images, so loaders, scorers and the CLI run end to end. Each family module
exposes `write_<benchmark>(root, n_items, seed) -> options`, where `options` are the keyword arguments
`build_benchmark(name, root, **options)` needs (for example an images folder outside the root).
`STANDINS` maps every registered benchmark name to its writer (a test checks that none is missing).
"""
from __future__ import annotations

from typing import Callable, Dict

from testkit.standin import (aro, coco_counterfactuals, cola, colorswap, crepe, elevater, eqben, imagecode, mmvp,
                             retrieval, spec, sts, sugarcrepe, sugarcrepe_pp, svo_probes, two_by_two, valse, vismin,
                             vlchecklist, whatsup, zeroshot)

STANDINS: Dict[str, Callable[..., dict]] = {
    "sugarcrepe": sugarcrepe.write_sugarcrepe,
    "sugarcrepe_pp": sugarcrepe_pp.write_sugarcrepe_pp,
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
    "vismin": vismin.write_vismin,
    "mmvp_vlm": mmvp.write_mmvp_vlm,
    "colorswap": colorswap.write_colorswap,
    "eqben": eqben.write_eqben,
    "crepe": crepe.write_crepe,
    "spec": spec.write_spec,
    "svo_probes": svo_probes.write_svo_probes,
    "cola_multi_object": cola.write_cola_multi_object,
    "cola_single_object": cola.write_cola_single_object,
    "imagecode": imagecode.write_imagecode,
    "coco_retrieval": retrieval.write_coco_retrieval,
    "flickr30k_retrieval": retrieval.write_flickr30k_retrieval,
    "coco_counterfactuals": coco_counterfactuals.write_coco_counterfactuals,
    "coco_counterfactuals_test": coco_counterfactuals.write_coco_counterfactuals_test,
    "zeroshot": zeroshot.write_zeroshot,
    "elevater": elevater.write_elevater,
    "shapes_zeroshot": zeroshot.write_shapes_zeroshot,
    "sickr": sts.write_sickr,
    "stsb": sts.write_stsb,
}
