"""Plain-torch building blocks that training, evaluation and the study share (no Lightning, no data loading).

- `encoders.py`: open_clip model construction (`build_model`) and `CLIPEncoders`, which runs a CLIP's own
  submodules explicitly: the methods train it, the feature cache runs it frozen, the scorers score with it.
- `export.py`: the exported model (`export/open_clip.pt`, `model.json`, and the Hugging Face copy `hf/`).
- `checkpoints.py`: reading published checkpoint formats strictly; `hf_clip.py`: open_clip <-> Hugging Face
  `CLIPModel`; `published.py`: zoo entries (`core/zoo.py`) and `hf:` folders as open_clip models.

- `losses.py`: CLIP's contrastive loss across processes, NegCLIP's hard-negative columns, masked means.
- `modular_losses.py`: the masked and modular terms the methods add to it (MACCO, SmartCLIP).
- `long_context.py`: text encoders with a longer context than the pretrained 77 tokens.
- `attribution.py`: per-token text attribution (attention, GradCAM, perturbation, gradient) and Grad-ECLIP image
  maps, selected by name through `ATTRIBUTIONS`; CLIP-CAE's losses and the attribution monitor read it.
- `aligner.py`: the TFLocal / TFGlobal aligner module.
- `backbone.py`: the backbone a run starts from, as its config's `model` section describes it.
- `lora.py`: LoRA adapters on the CLIP towers through peft, their checks and their merge.
"""
