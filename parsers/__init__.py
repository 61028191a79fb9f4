"""Text and image parsing for the composition masks: the bottom layer beside `core`, importing neither.

- `scene_graph.py`: the spaCy scene-graph parser (objects, attributes, relations, and their character spans).
- `token_alignment.py`: character spans to CLIP BPE token positions.
- `grounding.py` (+ `grounding_inputs.py`): GroundingDINO or ground-truth boxes per phrase, and boxes to patch masks.
"""
