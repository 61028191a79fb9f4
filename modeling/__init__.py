"""Plain-torch building blocks that training, evaluation and the study share (no Lightning, no data loading).

- `losses.py`: CLIP's contrastive loss across processes, NegCLIP's hard-negative columns, masked means.
- `modular_losses.py`: the masked and modular terms the methods add to it (MACCO, SmartCLIP).
- `long_context.py`: text encoders with a longer context than the pretrained 77 tokens.
- `attribution.py`: per-token text attribution (attention, GradCAM, perturbation, gradient) and Grad-ECLIP image
  maps, selected by name through `ATTRIBUTIONS`; CLIP-CAE's losses and the attribution monitor read it.
- `aligner.py`: the TFLocal / TFGlobal aligner module.
- `backbone.py`: the backbone a run starts from, as its config's `model` section describes it.
- `lora.py`: LoRA adapters on the CLIP towers through peft, their checks and their merge.
"""
