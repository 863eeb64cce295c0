"""Helpers shared by derivative rules."""

from __future__ import annotations

import torch


def unbroadcast(ct, shape):
    """Sum ``ct`` down to ``shape`` (the adjoint of broadcasting)."""
    if ct.shape == shape:
        return ct
    lead = ct.dim() - len(shape)
    dims = list(range(lead))
    for i, s in enumerate(shape):
        if s == 1 and ct.shape[lead + i] != 1:
            dims.append(lead + i)
    if dims:
        ct = ct.sum(dims, keepdim=True)
    return ct.reshape(shape) if lead or ct.shape != shape else ct


def match_dtype(ct, x):
    """A cotangent for ``x`` has x's dtype: the real part for a real ``x`` (docs/complex.md)."""
    if ct.dtype == x.dtype:
        return ct
    if ct.is_complex() and not x.is_complex():
        ct = ct.real
    return ct.to(x.dtype)


def is_tensor(x):
    return isinstance(x, torch.Tensor)
