"""Float comparisons of the tests: relative tolerances that scale with the values compared.

Two computations of the same float32 quantity by different paths (a per-head reference against a fused
kernel, a batch against one item at a time, 2 ranks against 1 process, another thread count or CPU) differ
by rounding: about 1e-7 relative per operation, 1e-6 after a forward pass of a small tower. An entry near 0
of such a tensor is a sum or difference of terms of the tensor's own size, so its rounding error is relative
to that size, not to the entry. Hence `|actual - expected| <= rtol * (|expected| + max |expected|)`: the
elementwise rtol, plus an atol of rtol times the tensor's largest magnitude. Choose rtol from the
computation at each call (a real bug moves values by 1e-3 or more, far beyond any of them).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch


def _scale(expected) -> float:
    """The largest finite |expected| (0 for an empty or all-infinite tensor)."""
    values = np.abs(np.asarray(expected.detach().double().cpu() if isinstance(expected, torch.Tensor) else expected,
                               dtype=np.float64))
    finite = values[np.isfinite(values)]
    return float(finite.max()) if finite.size else 0.0


def scaled_close(actual, expected, rtol: float) -> bool:
    """True when every entry is within rtol of itself or of the largest |expected| (see the module)."""
    if isinstance(actual, torch.Tensor) or isinstance(expected, torch.Tensor):
        actual, expected = torch.as_tensor(actual).detach().double(), torch.as_tensor(expected).detach().double()
        return torch.allclose(actual, expected, rtol=rtol, atol=rtol * _scale(expected))
    return bool(np.allclose(actual, expected, rtol=rtol, atol=rtol * _scale(expected)))


def assert_scaled_close(actual, expected, rtol: float, msg: Optional[str] = None) -> None:
    """Assert `scaled_close`, with torch's or numpy's report of the largest differences."""
    if isinstance(actual, torch.Tensor) or isinstance(expected, torch.Tensor):
        actual, expected = torch.broadcast_tensors(torch.as_tensor(actual).detach(), torch.as_tensor(expected).detach())
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * _scale(expected), check_dtype=False,
                                   msg=None if msg is None else lambda report: f"{msg}\n{report}")
    else:
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * _scale(expected),
                                   err_msg="" if msg is None else msg)
