"""Derivative rules of the normalization kernels: layer, group and batch norm.

Note [Normalization derivatives]
    Every kernel computes ``out = xhat * w + b`` with ``xhat = (x - mean) * rstd``, the statistics
    taken over some dims of a reshaped view ``xr`` of ``x`` (layer norm: the trailing dims; group
    norm: ``x.reshape(N, G, -1)``'s last dim; batch norm in training: every dim but the
    channels), and returns ``(out, mean, rstd)``. With ``n`` the number of reduced elements and
    ``<.>`` their mean::

        d xhat = rstd (dx - <dx> - xhat <xhat dx>)        d mean = <dx>
        d rstd = -rstd^2 <xhat dx>

    so the vjp of all three outputs is ``rstd (g - <g> - xhat <g xhat>) + ct_mean / n
    - ct_rstd rstd^2 xhat / n`` with ``g = ct_out * w``: the cotangents of ``mean`` and ``rstd``
    count (they are outputs; the second derivative of a norm needs them). Batch norm in eval
    mode uses the running statistics, which torch does not differentiate, so ``d xhat = rstd dx``.
    The forward runs torch's kernel on the primal values, which also updates the running
    statistics in place as torch does (outside the derivative: they are buffers, not outputs).
    The derivatives are ordinary ops (mean, sum, mul), so every order and vmap composes; the
    rules are real-only, as the kernels.
"""

from __future__ import annotations

import math

import torch

from ._registry import register_jvp_rule, register_vjp_rule
from ._torch_graph import torch_differentiates

aten = torch.ops.aten


class _Geometry:
    """How one call normalizes: ``to_r``/``from_r`` between ``x`` and the view the statistics
    broadcast against, the reduced dims of that view, ``n``, the statistics as stored in the
    view, and where the per-channel affine parameters broadcast."""

    __slots__ = ("xshape", "rshape", "dims", "n", "mean", "rstd", "wshape", "wdims", "train")

    def to_r(self, t):
        return t if self.rshape is None else t.reshape(self.rshape)

    def from_r(self, t):
        return t if self.rshape is None else t.reshape(self.xshape)


def _layer_geometry(primals, out):
    x, shape = primals[0], primals[1]
    g = _Geometry()
    k = len(shape)
    g.xshape, g.rshape = x.shape, None
    g.dims = list(range(x.dim() - k, x.dim()))
    g.n = math.prod(shape)
    g.mean, g.rstd = out[1], out[2]
    g.wshape = None
    g.wdims = list(range(x.dim() - k))
    g.train = True
    return g


def _group_geometry(primals, out):
    x, N, group = primals[0], primals[3], primals[6]
    g = _Geometry()
    g.xshape, g.rshape = x.shape, (N, group, -1)
    g.dims = [2]
    g.n = x.numel() // max(N * group, 1)
    g.mean, g.rstd = out[1].unsqueeze(-1), out[2].unsqueeze(-1)
    g.wshape = (-1,) + (1,) * (x.dim() - 2)
    g.wdims = [0] + list(range(2, x.dim()))
    g.train = True
    return g


def _batch_geometry(x, out, running_mean, running_var, training, eps):
    g = _Geometry()
    g.xshape, g.rshape = x.shape, None
    g.dims = [0] + list(range(2, x.dim()))
    g.n = x.numel() // max(x.shape[1], 1)
    bshape = (1, -1) + (1,) * (x.dim() - 2)
    g.train = training or running_mean is None
    if g.train:
        g.mean, g.rstd = out[1].reshape(bshape), out[2].reshape(bshape)
    else:
        g.mean = running_mean.reshape(bshape)
        g.rstd = (running_var + eps).rsqrt().reshape(bshape)
    g.wshape = (-1,) + (1,) * (x.dim() - 2)
    g.wdims = g.dims
    return g


def _batch_norm_geometry(primals, out):
    """native_batch_norm / _native_batch_norm_legit(x, w, b, rm, rv, training, momentum, eps)."""
    x, _, _, rm, rv, training, _, eps = primals
    return _batch_geometry(x, out, rm, rv, training, eps)


def _no_stats_geometry(primals, out):
    """_native_batch_norm_legit.no_stats(x, w, b, training, momentum, eps)."""
    return _batch_geometry(primals[0], out, None, None, True, primals[5])


def _no_training_geometry(primals, out):
    """_native_batch_norm_legit_no_training(x, w, b, rm, rv, momentum, eps)."""
    x, _, _, rm, rv, _, eps = primals
    return _batch_geometry(x, out, rm, rv, False, eps)


def _with_update_geometry(primals, out):
    """_batch_norm_with_update(x, w, b, rm, rv, momentum, eps): training mode, the running
    statistics updated by torch's kernel on the primal values."""
    x, _, _, rm, rv, _, eps = primals
    return _batch_geometry(x, out, rm, rv, True, eps)


def _sum(t, dims):
    """``t`` summed over ``dims`` (none: ``t`` itself; torch's ``sum([])`` sums everything)."""
    return t.sum(dims) if dims else t


def _affine(t, g):
    return t if g.wshape is None else t.reshape(g.wshape)


def _batch_norm_kernel_vjp(ct, primals, out, needs, g):
    """torch's fused backward kernel, for the common case (only ``out`` has a cotangent): one
    pass instead of about ten elementwise ops. Its own derivatives and batching come from
    torch's decomposition of it (ordinary ops), so higher orders still compose."""
    x, w, b = primals[0], primals[1], primals[2]
    rm, rv = (primals[3], primals[4]) if len(primals) > 6 else (None, None)
    mask = [bool(needs[0]), w is not None and bool(needs[1]), b is not None and bool(needs[2])]
    # torch's double-backward formula of the kernel takes the saved statistics for constants
    # and accounts for their dependence on x itself: plain ones go in detached (torch would
    # refuse to differentiate them), and those of our levels stay (our decomposition of the
    # kernel differentiates through them)
    mean, rstd = (s.detach() if type(s) is torch.Tensor else s for s in out[1:3])
    gx, gw, gb = aten.native_batch_norm_backward.default(
        ct, x, w, rm, rv, mean, rstd, g.train, primals[-1], mask
    )
    return (gx, gw, gb) + (None,) * (len(primals) - 3)


def _kernel_differentiable(ct, x, out):
    """Can torch's backward kernel run here without losing a derivative? When torch
    differentiates the statistics (Note [Outputs torch leaves without a graph]), only the
    kernel itself on plain values accounts for them (its double-backward formula, with the
    statistics passed detached); batched or wrapped, the kernel runs as a rule or torch's
    decomposition, which would take detached statistics for constants."""
    if not any(torch_differentiates(s) for s in out[1:3]):
        return True
    return all(type(t) is torch.Tensor for t in (ct, x, out[1], out[2]))


def def_normalization(op, geometry, affine_pos=(1, 2), kernel_vjp=None):
    """``op(x, ..., weight, bias, ...) -> (out, mean, rstd)`` (Note [Normalization
    derivatives]); ``geometry(primals, out)`` describes the call; ``kernel_vjp``: a faster vjp
    for the case where only ``out`` has a cotangent."""
    wi, bi = affine_pos

    def normalization_jvp_rule(primals, tangents, kwargs):
        out = op(*primals, **kwargs)
        x, w = primals[0], primals[wi]
        tx, tw, tb = tangents[0], tangents[wi], tangents[bi]
        if tx is None and tw is None and tb is None:
            return out, None
        g = geometry(primals, out)
        centered = g.to_r(x) - g.mean
        xhat = centered * g.rstd
        t = tmean = trstd = None
        if tx is not None:
            txr = g.to_r(tx)
            if g.train:
                # torch's layer_norm_jvp / batch_norm_jvp, op for op and in its association
                # (bit-identical results; the order read from its dispatched ops):
                # d rstd = sum((-rstd^3 (dx - <dx>)) (x - mean)) / n,
                # d xhat = (dx - <dx>) rstd + (x - mean) d rstd
                dmean = txr.mean(g.dims, keepdim=True)
                dc = txr - dmean
                drstd = ((-g.rstd.pow(3) * dc) * centered).sum(g.dims, keepdim=True) / g.n
                dxhat = dc * g.rstd + centered * drstd
                tmean = dmean.reshape(out[1].shape)
                trstd = drstd.reshape(out[2].shape)
            else:
                dxhat = g.rstd * txr
            t = g.from_r(dxhat)
            if w is not None:
                t = t * _affine(w, g)
        if tw is not None:
            t2 = g.from_r(xhat) * _affine(tw, g)
            t = t2 if t is None else t + t2
        if tb is not None:
            tb = _affine(tb, g)
            t = tb.expand(out[0].shape) if t is None else t + tb
        # _batch_norm_with_update's fourth output (a workspace) has no tangent
        return out, (t, tmean, trstd) + (None,) * (len(out) - 3)

    def normalization_vjp_rule(cts, primals, kwargs, out, needs):
        ct, ct_mean, ct_rstd = cts[0], cts[1], cts[2]
        x, w = primals[0], primals[wi]
        res = [None] * len(primals)
        g = geometry(primals, out)
        if (
            kernel_vjp is not None
            and ct is not None
            and (ct_mean is None or not ct_mean.numel())
            and (ct_rstd is None or not ct_rstd.numel())
            and _kernel_differentiable(ct, x, out)
        ):
            return kernel_vjp(ct, primals, out, needs, g)
        xhat = (g.to_r(x) - g.mean) * g.rstd
        if needs[0]:
            gx = None
            if ct is not None:
                gr = g.to_r(ct if w is None else ct * _affine(w, g))
                if g.train:
                    gx = g.rstd * (
                        gr
                        - gr.mean(g.dims, keepdim=True)
                        - xhat * (gr * xhat).mean(g.dims, keepdim=True)
                    )
                else:
                    gx = g.rstd * gr
            if g.train and ct_mean is not None and ct_mean.numel():
                c = (ct_mean.reshape(g.mean.shape) / g.n).expand(xhat.shape)
                gx = c if gx is None else gx + c
            if g.train and ct_rstd is not None and ct_rstd.numel():
                c = -(ct_rstd.reshape(g.rstd.shape) * g.rstd * g.rstd / g.n) * xhat
                gx = c if gx is None else gx + c
            if gx is not None:
                res[0] = g.from_r(gx)
        if ct is not None and w is not None and needs[wi]:
            gw = _sum(ct * g.from_r(xhat), g.wdims)
            res[wi] = gw.reshape(w.shape)
        if ct is not None and primals[bi] is not None and needs[bi]:
            res[bi] = _sum(ct, g.wdims).reshape(primals[bi].shape)
        return tuple(res)

    def half_vjp_rule(cts, primals, kwargs, out, needs):
        """torch's backward kernels read float16/bfloat16 values into float32 and round once;
        the formula in half-precision ops rounds every step (a bfloat16 layer norm's gradient
        was off functorch's by 1-3 ulp in most entries). The batch-norm kernel path rounds as
        torch does already."""
        x = primals[0]
        if x.dtype not in _HALF or (kernel_vjp is not None and cts[0] is not None):
            return normalization_vjp_rule(cts, primals, kwargs, out, needs)
        up = [_float(p) for p in primals]
        res = normalization_vjp_rule(
            [_float(c) for c in cts], up, kwargs, [_float(o) for o in out], needs
        )
        return tuple(r if r is None else r.to(p.dtype) for r, p in zip(res, primals))

    register_jvp_rule(op)(normalization_jvp_rule)
    register_vjp_rule(op)(half_vjp_rule)


_HALF = (torch.float16, torch.bfloat16)


def _float(t):
    return t.float() if isinstance(t, torch.Tensor) and t.dtype in _HALF else t


def_normalization(aten.native_layer_norm.default, _layer_geometry, (2, 3))
def_normalization(aten.native_group_norm.default, _group_geometry)
for _op, _geometry in (
    (aten.native_batch_norm.default, _batch_norm_geometry),
    (aten._native_batch_norm_legit.default, _batch_norm_geometry),
    (aten._native_batch_norm_legit.no_stats, _no_stats_geometry),
    (aten._native_batch_norm_legit_no_training.default, _no_training_geometry),
    (aten._batch_norm_with_update.default, _with_update_geometry),
):
    def_normalization(_op, _geometry, kernel_vjp=_batch_norm_kernel_vjp)
