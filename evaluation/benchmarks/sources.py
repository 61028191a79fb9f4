"""Where each benchmark's files come from, and the numbers published for the reference model.

Every benchmark class carries a `data_source` (`DataSource`: the authors' release, its licence, how large it is, the
public files `python -m evaluation.fetch` can download and check by sha256, and what must be fetched by hand) and
`published`: its headline numbers for OpenAI CLIP ViT-B/32 as printed by a named publication (`PUBLICATIONS`), shown
beside a model's own numbers in every results table so that a wrong setup is seen at a glance.

A `Download` is pinned: its URL names a fixed revision (a git commit, a dataset revision, a versioned archive) and
its sha256 and size are those of that revision's file, so a fetched file is the file the loader was written for.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Mapping, Tuple

# The model every `published` number describes.
REFERENCE_MODEL = "OpenAI CLIP ViT-B/32"
# Images several benchmarks take from other datasets (what a `by_hand` text points to).
COCO_VAL2017 = "http://images.cocodataset.org/zips/val2017.zip, 5,000 images, 788 MB"


@dataclass(frozen=True)
class Download:
    """One public file of a benchmark's release.

    Attributes:
        url: where it is published, at a fixed revision.
        target: its path under the benchmark's root (the layout the loader reads).
        sha256: hex digest of the file as published.
        size: its size in bytes.
        unpack: "" (keep the file as it is), "zip" or "tar": extract the archive into the folder of `target`
            after it is checked, then delete it.
    """

    url: str
    target: str
    sha256: str
    size: int
    unpack: str = ""

    def __post_init__(self) -> None:
        if self.unpack not in ("", "zip", "tar"):
            raise ValueError(f"{self.target}: unpack must be '', 'zip' or 'tar', got {self.unpack!r}")
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"{self.target}: sha256 must be 64 lower-case hex digits, got {self.sha256!r}")
        if self.size <= 0:
            raise ValueError(f"{self.target}: size must be positive, got {self.size}")


@dataclass(frozen=True)
class DataSource:
    """Where a benchmark's files come from.

    Attributes:
        home: the authors' release (repository, dataset page).
        licence: the licence of the annotations (and of the images, where it differs).
        size: how large the files are, annotations and images (text for `--list`).
        downloads: the public files `python -m evaluation.fetch NAME` downloads into the root, checked by sha256.
        by_hand: what cannot be fetched that way (gated data, sign-up forms, images from other datasets) and how
            to get it; empty when `downloads` is everything.
    """

    home: str
    licence: str
    size: str
    downloads: Tuple[Download, ...] = ()
    by_hand: str = ""

    def __post_init__(self) -> None:
        if not (self.home and self.licence and self.size):
            raise ValueError("a data source names its home, licence and size")
        if not (self.downloads or self.by_hand):
            raise ValueError(f"{self.home}: a data source says how to get its files (downloads or by_hand)")
        targets = [download.target for download in self.downloads]
        if len(set(targets)) != len(targets):
            raise ValueError(f"{self.home}: two downloads share a target")

    @property
    def download_bytes(self) -> int:
        return sum(download.size for download in self.downloads)


@dataclass(frozen=True)
class Published:
    """A number published for `REFERENCE_MODEL`: its value (percent unless the aggregate says otherwise) and
    the key of the publication that prints it (`PUBLICATIONS`)."""

    value: float
    source: str

    def __post_init__(self) -> None:
        if self.source not in PUBLICATIONS:
            raise ValueError(f"unknown publication {self.source!r}; known: {', '.join(PUBLICATIONS)}")


# Every publication a `Published` number may cite; docs/evaluation.md ("Reference numbers") describes each.
PUBLICATIONS: Mapping[str, str] = {
    "vl_compo": "Oh et al., Exploring the Spectrum of Visio-Linguistic Compositionality and Recognition, CVPRW "
                "2024: individual_results.csv of ytaek-oh/vl_compo (commit 43e2eae), row ViT-B-32 / openai",
    "fsc_clip": "Oh et al., Preserving Multi-Modal Capabilities of Pre-trained VLMs for Improving "
                "Vision-Linguistic Compositionality, EMNLP 2024 (ytaek-oh/fsc-clip)",
    "sugarcrepe": "Hsieh et al., SugarCrepe, NeurIPS 2023 (RAIVNLab/sugar-crepe; per-item outcomes released by the "
                  "BiVLC authors)",
    "bivlc": "Miranda et al., BiVLC, NeurIPS 2024 Datasets and Benchmarks (IMirandaM/BiVLC)",
    "clip_benchmark": "LAION-AI/CLIP_benchmark, benchmark/benchmark.csv (ViT-B-32, openai)",
    # The benchmarks' own papers (each benchmark's module says which table).
    "sugarcrepe_pp": "Dumpala et al., SugarCrepe++, NeurIPS 2024 Datasets and Benchmarks (Sri-Harsha/scpp)",
    "cola": "Ray et al., Cola, NeurIPS 2023 (arijitray1993/COLA)",
    "imagecode": "Krojer et al., ImageCoDe, ACL 2022 (McGill-NLP/imagecode)",
    "vismin": "Awal et al., VisMin, NeurIPS 2024 (rabiulcste/vismin)",
    "mmvp": "Tong et al., Eyes Wide Shut? (MMVP, MMVP-VLM), CVPR 2024 (tsb0601/MMVP)",
    "colorswap": "Burapacheep et al., ColorSwap, 2024 (Top34051/colorswap)",
    "spec": "Peng et al., SPEC, CVPR 2024 (wjpoom/SPEC)",
    "svo_probes": "Hendricks and Nematzadeh, Probing Image-Language Transformers for Verb Understanding, Findings "
                  "of ACL 2021 (deepmind/svo_probes)",
    "crepe": "Ma et al., CREPE, CVPR 2023 (RAIVNLab/CREPE)",
    "eqben": "Wang et al., Equivariant Similarity for Vision-Language Foundation Models (EqBen), ICCV 2023 "
             "(Wangt-CN/EqBen)",
    "coco_counterfactuals": "Le et al., COCO-Counterfactuals, NeurIPS 2023 Datasets and Benchmarks "
                            "(Intel/COCO-Counterfactuals); zero-shot CLIP row of coco-cfs-evaluation/"
                            "evaluate_coco_cfs_clip.csv in IntelLabs/multimodal_cognitive_ai, commit 860cd01",
    "elevater": "Li et al., ELEVATER, NeurIPS 2022 Datasets and Benchmarks "
                "(Computer-Vision-in-the-Wild/Elevater_Toolkit_IC)",
}


def github_file(repository: str, commit: str, path: str, sha256: str, size: int, target: str = "",
                unpack: str = "") -> Download:
    """A file of a GitHub repository at `commit` (`owner/name`), saved as `target` (default: its base name)."""
    return Download(f"https://raw.githubusercontent.com/{repository}/{commit}/{path}",
                    target or PurePosixPath(path).name, sha256, size, unpack)


def published(values: Mapping[str, float], source: str) -> Mapping[str, Published]:
    """`{key: Published(value, source)}` for numbers of one publication."""
    return {key: Published(float(value), source) for key, value in values.items()}


def merge(*tables: Mapping[str, Published]) -> Mapping[str, Published]:
    """Several publications' numbers for one benchmark; a key printed by two is an error (choose one)."""
    merged: dict = {}
    for table in tables:
        clash = sorted(set(merged) & set(table))
        if clash:
            raise ValueError(f"two publications give {', '.join(clash)}")
        merged.update(table)
    return merged


__all__ = ["COCO_VAL2017", "DataSource", "Download", "PUBLICATIONS", "Published", "REFERENCE_MODEL", "github_file",
           "merge", "published"]
