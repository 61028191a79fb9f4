# The README's commands. `make demo` and `make test` install everything first (idempotent: the venv is
# reused while requirements.txt and setup.cfg are unchanged).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SHAPES := data/shapes
# The method study's world: its own seed (the held-out combinations follow it). `make study STUDY_SEED=3`.
STUDY := data/study
STUDY_SEED ?= 1
STUDY_JOBS ?= 2
# Everything runs offline: a hub call fails fast instead of hanging.
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo study test lint perf gpu-check gpu-prepare clean-demo clean-study

setup: $(STAMP)

$(STAMP): requirements.txt setup.cfg setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# The generator writes annotations/heldout.json last: its presence means the whole world is there.
$(SHAPES)/annotations/heldout.json: | $(STAMP)
	$(PY) -m datamodules.shapes --out $(SHAPES) --n-train 4000 --n-val 500 --image-size 64 --seed 0

demo: setup $(SHAPES)/annotations/heldout.json
	$(PY) -m datamodules.preprocess --config configs/demo/pretrain.yaml
	$(PY) -m lightning_modules.fit --config configs/demo/pretrain.yaml
	$(PY) -m lightning_modules.fit --config configs/demo/clip_ft.yaml
	$(PY) -m lightning_modules.fit --config configs/demo/cae.yaml
	$(PY) -m lightning_modules.fit --config configs/demo/macco.yaml
	$(PY) -m lightning_modules.fit --config configs/demo/smartclip.yaml
	$(PY) -m datamodules.features --config configs/demo/tflocal.yaml
	$(PY) -m lightning_modules.fit --config configs/demo/tflocal.yaml
	$(PY) -m study.demo --data-root $(SHAPES) --out runs/demo_results.json \
		runs.pretrained=runs/demo_pretrain runs.clip_ft=runs/demo_clip_ft runs.cae_attention=runs/demo_cae \
		runs.macco=runs/demo_macco runs.smartclip=runs/demo_smartclip runs.tflocal=runs/demo_tflocal \
		runs.sgi_pretrained=runs/demo_pretrain@sgi

test: setup
	$(PY) -m pytest

# ruff (pinned in requirements.txt; rules in pyproject.toml) over every Python file git does not ignore.
lint: setup
	$(VENV)/bin/ruff check .

perf: setup
	$(PY) -m perf.step --out runs/perf_step.json
	$(PY) -m perf.preprocess --out runs/perf_preprocess.json
	$(PY) -m perf.loader --out runs/perf_loader.json

# The GPU node check (docs/gpu.md): one command on a node with one CUDA GPU and no package index, at most 8 minutes,
# results in $(GPU_OUT).json / .md / .log. It needs no venv: the node's python3 brings torch and Lightning, and the
# bundle that `make gpu-prepare` wrote brings the rest (its first stage installs the wheels into $(GPU_PREP)/site).
GPU_PYTHON ?= python3
GPU_OUT ?= runs/gpu_check
gpu-check:
	$(GPU_PYTHON) -m gpucheck --bundle $(GPU_PREP) --out $(GPU_OUT)

# The check's bundle, made where a package index and spaCy are, into $(GPU_PREP)/ (git-ignored; it travels with the
# checkout): the wheels of GPU_WHEELS for the node's Python (GPU_PLATFORM), a small shapes world with its
# preprocessing cache, and the throughput batch's caption records. The default wheels are what a node image with
# Python 3.12, torch, torchvision, Lightning, timm, numpy, pillow, tensorboard, matplotlib, pyarrow and PyYAML lacks
# (GroundingDINO needs transformers 4; pycocotools is groundingdino-py's own dependency: the wheels install with
# --no-deps). `make gpu-prepare GPU_MAX_MIB=N` refuses a bundle over N MiB with the tracked files (default: the size
# is only reported).
GPU_PREP := .gpu
GPU_MAX_MIB ?=
GPU_WHEELS ?= open-clip-torch==3.3.0 ftfy==6.3.1 wcwidth==0.9.4 omegaconf==2.4.0 addict==2.4.0 yapf==0.43.0 \
	platformdirs==4.14.9 pycocotools==2.0.11 transformers==4.57.6 tokenizers==0.22.2 huggingface-hub==0.36.2 \
	peft==0.21.2 accelerate==1.16.0 psutil==7.2.2
GPU_PLATFORM ?= --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
	--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64

gpu-prepare: setup
	rm -rf $(GPU_PREP)/whl $(GPU_PREP)/site && mkdir -p $(GPU_PREP)/whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: $(GPU_PLATFORM) -d $(GPU_PREP)/whl $(GPU_WHEELS)
	$(PY) -m pip wheel -q --no-deps -w $(GPU_PREP)/whl groundingdino-py==0.4.0
	$(PY) -m gpucheck.bundle --out $(GPU_PREP) $(if $(GPU_MAX_MIB),--max-mib $(GPU_MAX_MIB))

# The controlled method study (docs/study.md), the framework's headline experiment: world, preprocessing
# cache, three backbones, the frozen features of the aligner methods, the sweep of every method x condition x lr x
# seed (72 runs: 3.5 hours on a fast 2-core machine, 8 on a slow one), its one-seed checks (10 runs), the report,
# the results bundle (results/study: commit it) and the page made from it (docs/study_results.md). Every step
# resumes: finished runs are skipped, and so are the runs whose results the bundle holds (a clean clone continues
# where the bundle stopped from the backbone the bundle carries: `study.restore` puts it back before the backbones
# sweep, which then skips it).
# STUDY_ONLY runs part of the grid, e.g. `make study STUDY_ONLY="only.method=clip_ft"` (the report lists the rest
# as missing). `make clean-study` starts over (it keeps the bundle).
STUDY_ONLY ?=
STUDY_BUNDLE := results/study

study: setup $(STUDY)/annotations/heldout.json
	$(PY) -m datamodules.preprocess --config configs/study/finetune.yaml
	$(PY) -m study.restore --bundle $(STUDY_BUNDLE)
	$(PY) -m slurm.sweep configs/sweeps/study_backbones.yaml --local --jobs $(STUDY_JOBS)
	$(PY) -m datamodules.features --config configs/study/finetune.yaml --config configs/study/with_negatives.yaml \
		--config configs/study/tflocal.yaml
	$(PY) -m slurm.sweep configs/sweeps/study.yaml --local --jobs $(STUDY_JOBS) $(STUDY_ONLY)
	$(PY) -m slurm.sweep configs/sweeps/study_checks.yaml --local --jobs $(STUDY_JOBS)
	$(PY) -m study --sweep runs/study/sweep --mechanism-limit 64 --mechanism-splits test --bundle $(STUDY_BUNDLE)
	$(PY) -m study.page --bundle $(STUDY_BUNDLE) --out docs/study_results.md --readme README.md

# The world where relation direction is learnable: relations stated one way in the captions, 32 px images.
$(STUDY)/annotations/heldout.json: | $(STAMP)
	$(PY) -m datamodules.shapes --out $(STUDY) --n-train 4000 --n-val 500 --image-size 32 --seed $(STUDY_SEED) \
		--relations one-way

clean-study:
	rm -rf $(STUDY) runs/study cache/study cache/study_features

clean-demo:
	rm -rf runs/demo_pretrain runs/demo_clip_ft runs/demo_cae runs/demo_macco runs/demo_smartclip runs/demo_tflocal \
		runs/demo_results.json cache
