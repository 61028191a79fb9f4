"""`python -m gpucheck`: the GPU node check (`check.py`)."""
from gpucheck.check import main

if __name__ == "__main__":
    raise SystemExit(main())
