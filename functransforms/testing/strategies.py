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

from functransforms import _compat


def shapes(min_dims=0, max_dims=3, min_side=1, max_side=4):
    """Tensor shapes: tuples of ``min_dims..max_dims`` sizes in ``min_side..max_side``."""
    return st.lists(st.integers(min_side, max_side), min_size=min_dims, max_size=max_dims).map(
        tuple
    )


def dtypes(include_complex=True, include_float32=True, include_half=False):
    """Floating dtypes (float64 always; float32, the complex dtypes and float16/bfloat16
    optionally)."""
    choices = [torch.float64]
    if include_float32:
        choices.append(torch.float32)
    if include_half:
        choices += [torch.float16, torch.bfloat16]
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


LAYOUTS = ("contiguous", "transposed", "strided", "expanded", "channels_last", "conj", "neg")


@st.composite
def laid_out(draw, tensor, kinds=LAYOUTS):
    """``tensor`` (a tensor or a strategy of tensors) in a drawn memory layout, among ``kinds``
    that apply to it; the values are the tensor's, except for ``"expanded"``.

    - ``"contiguous"``: a contiguous copy;
    - ``"transposed"``: column-major in the last two dims (``x.mT.contiguous().mT``);
    - ``"strided"``: every other element of a buffer twice as wide (a step-2 slice);
    - ``"expanded"``: one dim is the first slice broadcast (stride 0; the values change);
    - ``"channels_last"``: 4-d only;
    - ``"conj"``: an unresolved conjugate view (``is_conj()``), complex only;
    - ``"neg"``: an unresolved negative view (``torch._neg_view``, ``is_neg()``), floating and
      complex only.

    The layout drawn is recorded with ``hypothesis.note``, so a failing example says which.

    Example:
        >>> import torch
        >>> from hypothesis import given
        >>> from functransforms.testing import strategies as fts
        >>> @given(fts.laid_out(fts.tensors(shape=(2, 3)), kinds=("transposed",)))
        ... def test_column_major(x):                # x: [2, 3], strides (1, 2)
        ...     assert x.stride() == (1, 2)
        >>> test_column_major()
    """
    from hypothesis import note

    x = draw(tensor) if isinstance(tensor, st.SearchStrategy) else tensor
    floating = x.dtype.is_floating_point or x.dtype.is_complex
    fits = {
        "contiguous": True,
        "transposed": x.dim() >= 2,
        "strided": x.dim() >= 1,
        "expanded": any(s > 1 for s in x.shape),
        "channels_last": x.dim() == 4,
        "conj": x.dtype.is_complex,
        "neg": floating,
    }
    kind = draw(st.sampled_from([k for k in kinds if fits[k]] or ["contiguous"]))
    note(f"layout: {kind}")
    if kind == "transposed":
        return x.mT.contiguous().mT
    if kind == "strided":
        buffer = x.new_zeros((*x.shape[:-1], 2 * x.shape[-1]))
        out = buffer[..., ::2]
        out.copy_(x)
        return out
    if kind == "expanded":
        dim = draw(st.sampled_from([d for d, s in enumerate(x.shape) if s > 1]))
        return x.narrow(dim, 0, 1).expand(x.shape)
    if kind == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if kind == "conj":
        return torch.conj_physical(x).conj()
    if kind == "neg":
        return _compat.neg_view(-x)
    return x.clone()


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


# -- misuse: the wrong values users pass to a transform --------------------------------------
# For property tests of a transform's argument checks (tests/api/test_errors_properties.py): each
# call either computes what torch.func computes or raises a clear error at the API edge.


def non_tensors():
    """Python values that are not tensors: None, bools, ints, floats, complex numbers, strings
    and small containers of ints."""
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-3, 3),
        st.floats(-3.0, 3.0, allow_nan=False),
        st.complex_numbers(max_magnitude=3.0, allow_nan=False, allow_infinity=False),
        st.sampled_from(["x", ""]),
        st.lists(st.integers(0, 2), max_size=2),
    )


def dim_specs(entries=None, max_rank=3, depth=2):
    """``in_dims`` / ``out_dims`` values, right and wrong: ints in and out of range for a tensor
    of up to ``max_rank`` dims, None, and, less often, bools, floats, strings, lists, and tuples
    (of ``entries`` entries when given, else 0 to 3) nesting these ``depth`` levels deep."""
    leaf = st.one_of(
        st.integers(-max_rank - 2, max_rank + 1),
        st.none(),
        st.sampled_from([True, False, 0.0, 1.5, "0"]),
    )
    if depth <= 0:
        return leaf
    inner = dim_specs(None, max_rank, depth - 1)
    size = st.integers(0, 3) if entries is None else st.just(entries)
    return st.one_of(
        leaf,
        size.flatmap(lambda n: st.tuples(*[inner] * n)),
        st.lists(leaf, min_size=1, max_size=2),
    )


def argnums_specs(num_args):
    """``argnums`` values, right and wrong, for a function of ``num_args`` positional inputs:
    ints in and out of range, tuples (empty, repeated, out of range), bools, floats, lists."""
    index = st.integers(-num_args - 1, num_args)
    return st.one_of(
        index,
        st.lists(index, min_size=0, max_size=3).map(tuple),
        st.sampled_from([True, False, 0.0, [0], "0"]),
    )
