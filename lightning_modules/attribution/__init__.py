"""Attribution together: the library, the training-time monitor and the heat-map CLI.

- `library.py`: per-token text attribution (attention, Chefer gradcam, perturbation) and Grad-ECLIP image maps,
  plain torch (no Lightning), selected by name through `ATTRIBUTIONS`; CLIP-CAE's losses read it.
- `monitor.py`: the attribution-gap monitor, a callback that measures during training whether attribution moves
  from object words to composition words.
- `explain.py`: `python -m lightning_modules.attribution.explain`, heat maps and token attributions of
  image-text pairs of a run or any open_clip model.
"""
