"""Batching rules for the FFT primitives (``torch.fft.*`` decomposes into these three) and for
the zero padding that ``n=`` / ``s=`` adds before them.

Note [Batching FFTs]
    ``_fft_r2c``, ``_fft_c2r`` and ``_fft_c2c`` transform along an explicit list of dims and
    act independently on every other dim, so the vmap dim stays where it is: each logical dim
    in the list is mapped to its physical position (past the vmap dim). Sizes (``onesided``,
    ``last_dim_size``) and the normalization refer to the transformed dims only, and pass
    through unchanged.
"""

from __future__ import annotations

import torch

from ._registry import register_vmap_rule
from ._util import to_front, wrap_dim

aten = torch.ops.aten


def _physical_dims(dims, x, bdim):
    """Logical dims (possibly negative) -> physical dims of ``x``, whose vmap dim is ``bdim``."""
    n = x.dim() - 1
    out = []
    for d in dims:
        d = wrap_dim(d, n)
        out.append(d + 1 if d >= bdim else d)
    return out


def def_fft(op):
    """``op(x, dim, normalization, <onesided | last_dim_size | forward>)``."""

    def fft_vmap_rule(interp, args, bdims, kwargs):
        x, bdim = args[0], bdims[0]
        return op(x, _physical_dims(args[1], x, bdim), *args[2:], **kwargs), bdim

    register_vmap_rule(op)(fft_vmap_rule)


def_fft(aten._fft_r2c.default)  # (x, dim, normalization, onesided)
def_fft(aten._fft_c2r.default)  # (x, dim, normalization, last_dim_size)
def_fft(aten._fft_c2c.default)  # (x, dim, normalization, forward)


@register_vmap_rule(aten.constant_pad_nd.default)
def constant_pad_nd_vmap_rule(interp, args, bdims, kwargs):
    """pad(x, pad, value): ``pad`` names the last ``len(pad) // 2`` logical dims, so the vmap dim
    goes in front, out of their reach. (``torch.fft.*(x, n=)`` pads with it; torch's
    decomposition writes into a fresh unbatched buffer, which vmap cannot batch.)"""
    x, pad = args[0], args[1]
    n = x.dim() - 1
    if len(pad) // 2 > n:
        raise RuntimeError(
            "Length of pad should be no more than twice the number of dimensions of the input. "
            f"Pad length is {len(pad)} while the input has {n} dimensions."
        )
    return aten.constant_pad_nd.default(to_front(x, bdims[0]), pad, *args[2:], **kwargs), 0
