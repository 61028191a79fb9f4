"""The one-number summaries of the field's evaluation suites, each over its own list of benchmarks.

- `vl_compo_comp_avg`: vl_compo's `comp_avg` (Oh et al., CVPRW 2024), the plain mean of 12 benchmark headlines as
  its results tables give them (results.csv): ARO (mean of its 4 sets), ColorSwap group, CREPE (mean of atom, swap,
  negate), EqBen (mean group over 5 sources), ImageCoDe (pooled), MMVP-VLM (mean group over 9 patterns),
  SugarCrepe (macro over 7 subsets), SVO-Probes (mean of 3 types), VALSE (macro over 7 phenomena), VL-CheckList
  (mean of Object, Attribute, Relation), What'sUp (mean of 6 sets), Winoground group. 41.15 for OpenAI ViT-B/32.
- `fsc_clip_comp`: fsc-clip's `Comp` (Oh et al., EMNLP 2024; assets/extended_results.csv), the mean of 11: vl_compo's
  list less ColorSwap and MMVP-VLM, plus SPEC (mean of image-to-text and text-to-image over its 6 subsets). Its
  paper's OpenAI ViT-B/32 row is not in a source this repository can cite, so no reference is attached.

Each is NaN until every part was scored (`combined.Composite`), and the results table names the benchmarks it lacks.
"""
from __future__ import annotations

from evaluation.benchmarks.combined import Composite
from evaluation.benchmarks.sources import published

# (part, key): the number each suite takes from a benchmark (or from an earlier combined number).
ARO = ("aro", "mean")
CREPE = ("crepe", "mean")
EQBEN = ("eqben", "group_mean")
IMAGECODE = ("imagecode", "accuracy")
SUGARCREPE = ("sugarcrepe", "overall_macro")
SVO_PROBES = ("svo_probes", "mean")
VALSE = ("valse", "macro_phenomena")
VL_CHECKLIST = ("vl_checklist", "average")
WHATSUP = ("whatsup_six_sets", "accuracy")
WINOGROUND = ("winoground", "group")
COLORSWAP = ("colorswap", "group")
MMVP = ("mmvp_vlm", "group")
SPEC = ("spec", "mean")

VL_COMPO = Composite(
    "vl_compo_comp_avg", "vl_compo's comp_avg: mean of its 12 compositionality headlines (%)",
    (ARO, COLORSWAP, CREPE, EQBEN, IMAGECODE, MMVP, SUGARCREPE, SVO_PROBES, VALSE, VL_CHECKLIST, WHATSUP, WINOGROUND),
    published({"mean": 41.15}, "vl_compo"))

FSC_CLIP = Composite(
    "fsc_clip_comp", "fsc-clip's Comp: mean of its 11 compositionality headlines (%)",
    (ARO, CREPE, EQBEN, IMAGECODE, SUGARCREPE, SVO_PROBES, VALSE, VL_CHECKLIST, WHATSUP, WINOGROUND, SPEC))

SUITES = (VL_COMPO, FSC_CLIP)
