"""The methods, one file each on the shared base (`lightning_modules/base.py`): to change one method, read its file.

- `clip_ft.py`: contrastive fine-tuning of CLIP; NegCLIP with its hard-negative captions and images (`clip_ft`);
- `clip_cae.py`: CLIP-CAE, composition-aware attribution losses (`clip_cae`);
- `macco.py`: MACCO-CLIP, learnable mask tokens over the composition (`macco`);
- `smartclip.py`: SmartCLIP, text-conditioned binary masks over the image embedding (`smartclip`);
- `tflocal.py`: the TFLocal / TFGlobal aligners on a frozen CLIP (`tflocal`, `tfglobal`); the aligner network,
  its export and its benchmark scorer are in `evaluation/aligner.py`.

Each module overrides `compute_terms(batch)`; `lightning_modules.METHODS` registers them by `method.name`. Losses
shared by several methods are in `lightning_modules/losses.py` and `modular_losses.py`.
"""
