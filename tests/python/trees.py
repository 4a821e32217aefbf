"""Comparing state trees, for the tests and the ranks they start (ranks.py)."""

import numpy as np
import torch


def same(a, b, path="") -> None:
    """Bit-exact equality of two trees with the same types (tuples stay tuples, int keys ints)."""
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), \
        f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        as_bytes = [t.detach().reshape(-1).contiguous().view(torch.uint8) for t in (a, b)]
        assert torch.equal(*as_bytes), f"{path}: values differ"  # bits: NaN payloads and -0.0 too
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), f"{path}: arrays differ"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a.keys())} != {list(b.keys())}"
        for k in a:
            same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and a != a:
        assert b != b, f"{path}: nan != {b}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
