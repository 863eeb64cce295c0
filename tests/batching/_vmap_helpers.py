"""Helpers of the batching tests: build inputs for an in_dims mix, compare with torch.vmap."""

import itertools
import warnings

import optree
import torch
from functransforms.batching import _tensor

import functransforms as ft
from functransforms.errors import FallbackWarning

B = 3
DT = torch.float64


def floats(*shape):
    """A float tensor argument of this shape (drawn by ``build``)."""
    return ("f", shape)


def ints(high, *shape):
    """An integer tensor argument with values in ``[0, high)``."""
    return ("i", shape, high)


def masks(*shape):
    """A boolean tensor argument."""
    return ("b", shape)


def is_spec(a):
    return isinstance(a, tuple) and len(a) >= 2 and a[0] in ("f", "i", "b")


def make(spec, d, gen):
    kind, shape = spec[0], spec[1]
    full = list(shape)
    if d is not None:
        full.insert(d % (len(shape) + 1), B)
    if kind == "f":
        return torch.randn(full, dtype=DT, generator=gen)
    if kind == "i":
        return torch.randint(0, spec[2], full, generator=gen)
    return torch.rand(full, generator=gen) > 0.5


def mixes(specs, choices=(0, -1, None), extra=(1,)):
    """Every mix of ``choices`` per tensor argument (not all None), plus one mix per ``extra``."""
    pos = [k for k, s in enumerate(specs) if is_spec(s)]
    out = []
    for combo in itertools.product(choices, repeat=len(pos)):
        if all(c is None for c in combo):
            continue
        out.append(_fill(specs, pos, combo))
    for e in extra:
        combo = [e if len(specs[k][1]) >= e else 0 for k in pos]
        out.append(_fill(specs, pos, combo))
    return out


def _fill(specs, pos, combo):
    dims = [None] * len(specs)
    for k, c in zip(pos, combo):
        dims[k] = c
    return tuple(dims)


def build(specs, in_dims, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [make(s, d, gen) if is_spec(s) else s for s, d in zip(specs, in_dims)]


def assert_tree_close(a, b, **kw):
    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    assert sa == sb, (sa, sb)
    for x, y in zip(la, lb):
        torch.testing.assert_close(x, y, **kw)


def check(fn, in_dims, *args, out_dims=0, chunk_size=None, allow_fallback=False, **kw):
    """functransforms.vmap(fn) == torch.vmap(fn), with no per-example fallback by default."""
    ref = torch.vmap(fn, in_dims, out_dims, chunk_size=chunk_size)(*args)
    with warnings.catch_warnings():
        if not allow_fallback:
            saved = _tensor._WARNED
            _tensor._WARNED = set()
            warnings.simplefilter("error", FallbackWarning)
        try:
            ours = ft.vmap(fn, in_dims, out_dims, chunk_size=chunk_size)(*args)
        finally:
            if not allow_fallback:
                _tensor._WARNED = saved
    assert_tree_close(ours, ref, **kw)
    return ours


def loop_oracle(fn, in_dims, *args):
    """The stacked per-example loop: the definition of vmap (out_dims=0)."""
    n = next(a.shape[d] for a, d in zip(args, in_dims) if d is not None)
    outs = [
        fn(*[a if d is None else a.select(d, k) for a, d in zip(args, in_dims)]) for k in range(n)
    ]
    return optree.tree_map(lambda *xs: torch.stack(xs), *outs)


def check_loop(fn, in_dims, *args, **kw):
    with warnings.catch_warnings():
        saved = _tensor._WARNED
        _tensor._WARNED = set()
        warnings.simplefilter("error", FallbackWarning)
        try:
            ours = ft.vmap(fn, in_dims)(*args)
        finally:
            _tensor._WARNED = saved
    assert_tree_close(ours, loop_oracle(fn, in_dims, *args), **kw)
