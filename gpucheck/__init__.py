"""The GPU node check: does the real training path work on a CUDA node, and how fast is it there?

A GPU node often has no package index (compute nodes are offline) and an image that holds torch and Lightning but
not the rest of what the framework imports, nor spaCy. So everything the check needs beyond the node's own Python
travels with the checkout as a bundle of wheels and data, prepared where an index and spaCy are:

- `bundle.py`: `python -m gpucheck.bundle --out .gpu` (`make gpu-prepare`): a small shapes world, its
  preprocessing cache, the throughput batch's caption records and a manifest, beside the wheels `make` downloads;
  on the node, the wheels installed into the bundle's own folder.
- `stages.py`: `python -m gpucheck.stages STAGE ...`: one stage (environment, fit, numerics) as its own process.
- `check.py` (also `__main__.py`): `python -m gpucheck` (`make gpu-check`): every stage in turn, each under its
  own hard timeout, the throughput stage being the timing benchmark `python -m perf.gpu`; the results rewritten
  after every finished part.

It sits beside `slurm` and `perf`: it runs `perf.gpu` as a command and imports neither of them. docs/gpu.md.
"""
