# The README's commands. `make demo` and `make test` install everything first (idempotent: the venv is
# reused while requirements.txt and setup.cfg are unchanged).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SHAPES := data/shapes
# Everything runs offline: a hub call fails fast instead of hanging.
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# pytest marker expression; `make test PYTEST_MARK=""` also runs the tests marked slow.
PYTEST_MARK ?= not slow

.PHONY: setup demo test perf clean-demo

setup: $(STAMP)

$(STAMP): requirements.txt setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

$(SHAPES)/annotations/swap_val.json: | $(STAMP)
	$(PY) -m datamodules.shapes --out $(SHAPES) --n-train 4000 --n-val 500 --image-size 64 --seed 0

demo: setup $(SHAPES)/annotations/swap_val.json
	$(PY) -m datamodules.preprocess --config configs/demo/pretrain.yaml
	$(PY) -m lightning_modules.fit --config configs/demo/pretrain.yaml
	$(PY) -m lightning_modules.fit --config configs/demo/clip_ft.yaml
	$(PY) -m lightning_modules.fit --config configs/demo/cae.yaml
	$(PY) -m lightning_modules.fit --config configs/demo/macco.yaml
	$(PY) -m lightning_modules.fit --config configs/demo/smartclip.yaml
	$(PY) -m datamodules.features --config configs/demo/tflocal.yaml
	$(PY) -m lightning_modules.fit --config configs/demo/tflocal.yaml
	$(PY) -m lightning_modules.demo --data $(SHAPES) --out runs/demo_results.json \
		--run pretrained=runs/demo_pretrain --run clip_ft=runs/demo_clip_ft --run cae_attention=runs/demo_cae \
		--run macco=runs/demo_macco --run smartclip=runs/demo_smartclip --run tflocal=runs/demo_tflocal \
		--run sgi_pretrained=runs/demo_pretrain@sgi

test: setup
	$(PY) -m pytest -m "$(PYTEST_MARK)"

perf: setup
	$(PY) -m perf.step --out runs/perf_step.json
	$(PY) -m perf.preprocess --out runs/perf_preprocess.json
	$(PY) -m perf.loader --out runs/perf_loader.json

clean-demo:
	rm -rf runs/demo_pretrain runs/demo_clip_ft runs/demo_cae runs/demo_macco runs/demo_smartclip runs/demo_tflocal \
		runs/demo_results.json cache
