"""Derivative rules of the FFT primitives. Each is linear, so the jvp is the op applied to the
tangent and the vjp is its adjoint for the real inner product Re <u, v> (docs/complex.md).

``normalization`` scales by the same factor in both directions (0: none, 1: 1/sqrt(n),
2: 1/n), so the adjoint of a c2c transform is the c2c transform of the other direction with
the same ``normalization``.
"""

from __future__ import annotations

import torch

from ._registry import register_jvp_rule, register_vjp_rule

aten = torch.ops.aten


def def_fft(op, adjoint, linear=None):
    """``op(x, *params)`` linear in x (``linear(t, *params)``, the op itself unless it is
    affine); ``adjoint(ct, x, *params)`` is the adjoint of that linear map."""
    linear = linear or op

    def fft_jvp_rule(primals, tangents, kwargs):
        out = op(*primals, **kwargs)
        t = tangents[0]
        return out, None if t is None else linear(t, *primals[1:], **kwargs)

    def fft_vjp_rule(ct, primals, kwargs, out, needs):
        return (adjoint(ct, *primals, **kwargs),) + (None,) * (len(primals) - 1)

    register_jvp_rule(op)(fft_jvp_rule)
    register_vjp_rule(op)(fft_vjp_rule)


def _r2c_adjoint(ct, x, dim, normalization, onesided):
    """r2c = the c2c transform of a real signal, keeping the first n//2 + 1 bins of the last
    dim when onesided: the adjoint zero-pads the dropped bins, inverts, keeps the real part."""
    if onesided:
        d, n = dim[-1], x.shape[dim[-1]]
        missing = n - ct.shape[d]
        if missing:
            shape = list(ct.shape)
            shape[d] = missing
            ct = torch.cat([ct, torch.zeros(shape, dtype=ct.dtype, device=ct.device)], d)
    return aten._fft_c2c.default(ct, dim, normalization, False).real


def _c2r_adjoint(ct, x, dim, normalization, last_dim_size):
    """c2r fills the missing half of the last dim by conjugate symmetry, inverts and keeps the
    real part; its adjoint is the onesided r2c transform with the bins that stand for two (all
    but the first, and the last when n is even) doubled."""
    g = aten._fft_r2c.default(ct, dim, normalization, True)
    d = dim[-1]
    doubled = last_dim_size - g.shape[d]
    if doubled > 0:
        rest = g.shape[d] - 1 - doubled
        g = torch.cat(
            [g.narrow(d, 0, 1), 2 * g.narrow(d, 1, doubled), g.narrow(d, 1 + doubled, rest)], d
        )
    return g


def_fft(aten._fft_r2c.default, _r2c_adjoint)
def_fft(aten._fft_c2r.default, _c2r_adjoint)
def_fft(
    aten._fft_c2c.default,
    lambda ct, x, dim, normalization, forward: aten._fft_c2c.default(
        ct, dim, normalization, not forward
    ),
)


# torch.fft's n= pads the signal with constant_pad_nd (as in batching/fft.py). Padding by
# (l, r) with a constant is affine in x; its linear part pads with 0, and the adjoint of that
# crops by (l, r): a padding by (-l, -r).
def_fft(
    aten.constant_pad_nd.default,
    lambda ct, x, pad, value=0: aten.constant_pad_nd.default(ct, [-p for p in pad]),
    linear=lambda t, pad, value=0: aten.constant_pad_nd.default(t, pad),
)
