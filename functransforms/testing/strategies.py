"""Hypothesis strategies for tensors, shapes, dtypes, pytrees and devices.

Importing this module imports hypothesis (the ``test`` extra); ``import functransforms`` and
``import functransforms.testing`` never do.

Example:
    >>> from hypothesis import given
    >>> from functransforms.testing import strategies as fts
    >>> @given(fts.tensors(shape=(2, 3)))
    ... def test_shape(x):                      # x: [2, 3] float64
    ...     assert x.shape == (2, 3)
    >>> test_shape()
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st


def shapes(min_dims=0, max_dims=3, min_side=1, max_side=4):
    """Tensor shapes: tuples of ``min_dims..max_dims`` sizes in ``min_side..max_side``."""
    return st.lists(st.integers(min_side, max_side), min_size=min_dims, max_size=max_dims).map(
        tuple
    )


def dtypes(include_complex=True, include_float32=True):
    """Floating dtypes (float64 always; float32 and the complex dtypes optionally)."""
    choices = [torch.float64]
    if include_float32:
        choices.append(torch.float32)
    if include_complex:
        choices.append(torch.complex128)
        if include_float32:
            choices.append(torch.complex64)
    return st.sampled_from(choices)


def devices():
    """'cpu', and 'cuda' when it is available."""
    return st.sampled_from(["cpu"] + (["cuda"] if torch.cuda.is_available() else []))


@st.composite
def tensors(
    draw,
    shape=None,
    dtype=torch.float64,
    device="cpu",
    min_value=-3.0,
    max_value=3.0,
    elements=None,
):
    """Tensors with finite, bounded values.

    Args:
        shape: a tuple, a strategy of tuples, or None for :func:`shapes`.
        dtype: a dtype or a strategy of dtypes (complex: real and imaginary parts are bounded).
        device: a device or a strategy of devices.
        min_value, max_value: bounds of each (real / imaginary part of each) element.
        elements: a strategy of Python numbers overriding the bounds.
    """
    shape = draw(shapes()) if shape is None else shape
    shape = draw(shape) if isinstance(shape, st.SearchStrategy) else tuple(shape)
    dtype = draw(dtype) if isinstance(dtype, st.SearchStrategy) else dtype
    device = draw(device) if isinstance(device, st.SearchStrategy) else device
    n = 1
    for s in shape:
        n *= s
    if dtype.is_floating_point or dtype.is_complex:
        real = dtype.to_real() if dtype.is_complex else dtype
        lo, hi = _inward(min_value, real, up=True), _inward(max_value, real, up=False)
        el = elements or st.floats(lo, hi, allow_nan=False, allow_infinity=False)
    elif dtype == torch.bool:
        el = elements or st.booleans()
    else:
        info = torch.iinfo(dtype)  # uint8 would wrap -3 to 253: the bounds are the dtype's too
        lo, hi = max(math.ceil(min_value), info.min), min(math.floor(max_value), info.max)
        el = elements or st.integers(lo, hi)
    if dtype.is_complex:
        re = draw(st.lists(el, min_size=n, max_size=n))
        im = draw(st.lists(el, min_size=n, max_size=n))
        real_dtype = torch.float32 if dtype == torch.complex64 else torch.float64
        t = torch.complex(torch.tensor(re, dtype=real_dtype), torch.tensor(im, dtype=real_dtype))
    else:
        t = torch.tensor(draw(st.lists(el, min_size=n, max_size=n)), dtype=dtype)
    return t.reshape(shape).to(device)


def _inward(bound, dtype, up):
    """``bound`` rounded into ``dtype`` toward the inside of the interval: drawn float64 values
    between two representable bounds round to values between them, so a float32/float16 tensor
    stays within ``[min_value, max_value]`` (before, float32 bounds such as 0.1 raised in
    hypothesis and float16 values could round past them)."""
    t = torch.tensor(bound, dtype=dtype)
    if up and float(t) < bound:
        t = torch.nextafter(t, torch.tensor(math.inf, dtype=dtype))
    elif not up and float(t) > bound:
        t = torch.nextafter(t, torch.tensor(-math.inf, dtype=dtype))
    return float(t)


def pytrees_of_tensors(leaves=None, max_leaves=4):
    """Nested tuples / lists / dicts (string keys) of tensors drawn from ``leaves``."""
    leaves = leaves if leaves is not None else tensors(shape=shapes(max_dims=2, max_side=3))
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.tuples(children, children),
            st.lists(children, min_size=1, max_size=3),
            st.dictionaries(st.sampled_from(["a", "b", "c"]), children, min_size=1, max_size=3),
        ),
        max_leaves=max_leaves,
    )
