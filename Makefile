# The README's commands. `make demo` and `make test` install everything first (idempotent: the venv is
# reused while requirements.txt and setup.cfg are unchanged).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SHAPES := data/shapes
# The method study's world: its own seed (the held-out combinations follow it). The committed bundle is the world
# of seed 1 (data/study, runs/study, results/study); `make study STUDY_SEED=3` studies the world of seed 3 in folders
# of its own (data/study-world-3, runs/study-world-3, cache/study-world-3, results/study-world-3) with the study's
# configs copied for them (`python -m study.world`, STUDY_CONFIGS).
STUDY_SEED ?= 1
STUDY_NAME := $(if $(filter 1,$(STUDY_SEED)),study,study-world-$(STUDY_SEED))
STUDY := data/$(STUDY_NAME)
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

# The demo: the method study's world, its preprocessing cache and its carried backbone (shared with `make study`),
# checked against the bundle; every fine-tuning method from that backbone at one small budget
# (configs/sweeps/demo.yaml: runs/demo/method-*); the table, each row against the backbone (runs/demo/results.json).
demo: setup $(STUDY)/annotations/heldout.json
	$(PY) -m datamodules.preprocess --config configs/study/finetune.yaml
	$(PY) -m study.restore --bundle $(STUDY_BUNDLE)
	$(PY) -m study.demo --check --bundle $(STUDY_BUNDLE) --data-root $(STUDY) \
		runs.pretrained=runs/study/backbones/seed-0
	$(PY) -m slurm.sweep configs/sweeps/demo.yaml --local --jobs 2
	$(PY) -m study.demo --bundle $(STUDY_BUNDLE) --data-root $(STUDY) --out runs/demo/results.json \
		runs.pretrained=runs/study/backbones/seed-0 runs.clip_ft=runs/demo/method-clip_ft \
		runs.cae_attention=runs/demo/method-cae_attention runs.macco=runs/demo/method-macco \
		runs.smartclip=runs/demo/method-smartclip

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
# as missing). `make clean-study` starts over (it keeps the bundle). Another world (STUDY_SEED) gets its own bundle
# and page (runs/study-world-N/study_results.md); the README and docs/study.md stay the committed world's.
STUDY_ONLY ?=
STUDY_COMMITTED := $(filter study,$(STUDY_NAME))
STUDY_CONFIGS := $(if $(STUDY_COMMITTED),configs,runs/$(STUDY_NAME)/configs)
STUDY_BUNDLE := results/$(STUDY_NAME)
STUDY_PAGE := $(if $(STUDY_COMMITTED),docs/study_results.md --readme README.md --doc docs/study.md,\
	runs/$(STUDY_NAME)/study_results.md)

study: setup $(STUDY)/annotations/heldout.json
	$(if $(STUDY_COMMITTED),,$(PY) -m study.world --seed $(STUDY_SEED) --out $(STUDY_CONFIGS))
	$(PY) -m datamodules.preprocess --config $(STUDY_CONFIGS)/study/finetune.yaml
	$(PY) -m study.restore --bundle $(STUDY_BUNDLE) --data-root $(STUDY)
	$(PY) -m slurm.sweep $(STUDY_CONFIGS)/sweeps/study_backbones.yaml --local --jobs $(STUDY_JOBS)
	$(PY) -m datamodules.features --config $(STUDY_CONFIGS)/study/finetune.yaml \
		--config $(STUDY_CONFIGS)/study/with_negatives.yaml --config $(STUDY_CONFIGS)/study/tflocal.yaml
	$(PY) -m slurm.sweep $(STUDY_CONFIGS)/sweeps/study.yaml --local --jobs $(STUDY_JOBS) $(STUDY_ONLY)
	$(PY) -m slurm.sweep $(STUDY_CONFIGS)/sweeps/study_checks.yaml --local --jobs $(STUDY_JOBS)
	$(PY) -m study --sweep runs/$(STUDY_NAME)/sweep --mechanism-limit 64 --mechanism-splits test \
		--bundle $(STUDY_BUNDLE)
	$(PY) -m study.page --bundle $(STUDY_BUNDLE) --out $(STUDY_PAGE)

# The world where relation direction is learnable: relations stated one way in the captions, 32 px images.
$(STUDY)/annotations/heldout.json: | $(STAMP)
	$(PY) -m datamodules.shapes --out $(STUDY) --n-train 4000 --n-val 500 --image-size 32 --seed $(STUDY_SEED) \
		--relations one-way

clean-study:
	rm -rf $(STUDY) runs/$(STUDY_NAME) cache/$(STUDY_NAME) cache/$(STUDY_NAME)_features

# The demo's runs (runs/demo; runs/demo_* of the demo before it) and the caches of the shapes-world recipes
# (configs/demo/*.yaml: cache/<key>, cache/features/<key>), found by the hash of a shapes-world annotation file that
# their settings.json records. The study's caches (cache/study*, which the demo reads) and a COCO cache stay.
clean-demo:
	rm -rf runs/demo runs/demo_pretrain runs/demo_clip_ft runs/demo_cae runs/demo_macco runs/demo_smartclip \
		runs/demo_tflocal runs/demo_results.json
	for annotations in $(SHAPES)/annotations/captions_train.json $(SHAPES)/annotations/captions_val.json; do \
		test -f $$annotations || continue; \
		sha=$$(sha256sum < $$annotations | cut -c1-64); \
		for settings in cache/*/settings.json cache/features/*/settings.json; do \
			if grep -qs "\"annotations_sha256\": \"$$sha\"" "$$settings"; then rm -rf "$${settings%/settings.json}"; fi; \
		done; \
	done
