"""Derivative rules of the neural-network ops outside the convolution, pooling and
normalization families that reach dispatch undecomposed: softmax, the losses (ctc_loss's
forward mode is ours only) and grid_sampler_3d. Every vjp is written in ordinary
differentiable, batchable ops, so backward passes compose with vmap and higher-order
derivatives (ctc_loss's vjp is torch's kernel, which has no derivative: second order raises)."""

from __future__ import annotations

import torch

from ._registry import register_jvp_rule, register_vjp_rule

aten = torch.ops.aten


@register_jvp_rule(aten._softmax.default)
def softmax_jvp_rule(primals, tangents, kwargs):
    """d softmax = y * (t - <t, y>)"""
    dim = primals[1]
    y = aten._softmax.default(*primals)
    t = tangents[0]
    return y, None if t is None else y * (t - (t * y).sum(dim, keepdim=True))


@register_vjp_rule(aten._softmax.default)
def softmax_vjp_rule(ct, primals, kwargs, out, needs):
    dim = primals[1]
    y = out.conj() if out.is_complex() else out
    return y * (ct - (ct * y).sum(dim, keepdim=True)), None, None


@register_jvp_rule(aten._safe_softmax.default)
def safe_softmax_jvp_rule(primals, tangents, kwargs):
    """softmax whose fully masked (all -inf) rows are 0, not NaN: the same formula with the
    op's own output (0 there), so no NaN reaches the derivative."""
    dim = primals[1]
    y = aten._safe_softmax.default(*primals, **kwargs)
    t = tangents[0]
    if t is None:
        return y, None
    t = t.to(y.dtype)
    return y, y * (t - (t * y).sum(dim, keepdim=True))


@register_vjp_rule(aten._safe_softmax.default)
def safe_softmax_vjp_rule(ct, primals, kwargs, out, needs):
    dim = primals[1]
    y = out.conj() if out.is_complex() else out
    g = y * (ct - (ct * y).sum(dim, keepdim=True))
    return (g.to(primals[0].dtype),) + (None,) * (len(primals) - 1)


@register_jvp_rule(aten._log_softmax.default)
def log_softmax_jvp_rule(primals, tangents, kwargs):
    """d log_softmax = t - <t, softmax>"""
    dim = primals[1]
    y = aten._log_softmax.default(*primals)
    t = tangents[0]
    return y, None if t is None else t - (t * y.exp()).sum(dim, keepdim=True)


@register_vjp_rule(aten._log_softmax.default)
def log_softmax_vjp_rule(ct, primals, kwargs, out, needs):
    dim = primals[1]
    return ct - out.exp() * ct.sum(dim, keepdim=True), None, None


def _nll_weights(x, target, weight, ignore_index):
    """The one-hot selection matrix scaled by class weights: d loss_i / d x[i, c]."""
    C = x.shape[-1] if x.dim() == 1 else x.shape[1]
    classes = torch.arange(C, device=x.device)
    if x.dim() == 1:
        sel = (classes == target).to(x.dtype)
    else:
        shape = [1] * x.dim()
        shape[1] = C
        sel = (classes.reshape(shape) == target.unsqueeze(1)).to(x.dtype)
    keep = (target != ignore_index).to(x.dtype)
    w = keep if weight is None else keep * weight[target.clamp(0, C - 1)]
    return sel, w


@register_jvp_rule(aten.nll_loss_forward.default)
def nll_loss_jvp_rule(primals, tangents, kwargs):
    x, target, weight, reduction, ignore_index = primals
    out, total = aten.nll_loss_forward.default(*primals)
    t = tangents[0]
    if t is None:
        return (out, total), None
    sel, w = _nll_weights(x, target, weight, ignore_index)
    picked = -(t * sel).sum(1 if x.dim() > 1 else 0) * w
    if reduction == 0:
        return (out, total), (picked, None)
    s = picked.sum()
    return (out, total), ((s / total if reduction == 1 else s), None)


@register_vjp_rule(aten.nll_loss_forward.default)
def nll_loss_vjp_rule(cts, primals, kwargs, out, needs):
    x, target, weight, reduction, ignore_index = primals
    ct = cts[0]
    if ct is None:
        return (None,) * 5
    sel, w = _nll_weights(x, target, weight, ignore_index)
    if reduction == 1:
        ct = ct / out[1]
    if reduction == 0:
        g = -sel * (ct * w).unsqueeze(1 if x.dim() > 1 else 0)
    else:
        g = -sel * (ct * w).unsqueeze(1 if x.dim() > 1 else 0) if x.dim() > 1 else -sel * ct * w
    return g, None, None, None, None


def _reduce(v, reduction):
    return v if reduction == 0 else (v.mean() if reduction == 1 else v.sum())


@register_jvp_rule(aten.mse_loss.default)
def mse_loss_jvp_rule(primals, tangents, kwargs):
    x, y = primals[0], primals[1]
    reduction = primals[2] if len(primals) > 2 else 1
    out = aten.mse_loss.default(*primals)
    tx, ty = tangents[0], tangents[1]
    if tx is None and ty is None:
        return out, None
    d = (tx if tx is not None else 0) - (ty if ty is not None else 0)
    return out, _reduce(2 * (x - y) * d, reduction)


@register_vjp_rule(aten.mse_loss.default)
def mse_loss_vjp_rule(ct, primals, kwargs, out, needs):
    x, y = primals[0], primals[1]
    reduction = primals[2] if len(primals) > 2 else 1
    g = 2 * (x - y) * ct
    if reduction == 1:
        g = g / max(torch.broadcast_shapes(x.shape, y.shape).numel(), 1)
    from ._util import unbroadcast

    gx = unbroadcast(g, x.shape) if needs[0] else None
    gy = unbroadcast(-g, y.shape) if needs[1] else None
    return gx, gy, None


# -- ctc_loss --------------------------------------------------------------------------------------
def def_ctc_loss(op, backward):
    def ctc_grad(primals, out, grad):
        log_probs, targets, input_lengths, target_lengths = primals[:4]
        blank = primals[4] if len(primals) > 4 else 0
        zero_infinity = primals[5] if len(primals) > 5 else False
        return backward(
            grad, log_probs, targets, input_lengths, target_lengths, out[0], out[1], blank,
            zero_infinity,
        )  # fmt: skip

    def ctc_loss_jvp_rule(primals, tangents, kwargs):
        """Ours only: d nll_b = <G_b, d log_probs_b>, G = torch's backward kernel at grad 1."""
        out = op(*primals, **kwargs)
        t = tangents[0]
        if t is None:
            return out, None
        nll = out[0]
        G = ctc_grad(primals, out, torch.ones_like(nll))  # (T, B, C) or (T, C)
        dnll = (G * t).sum((0, 2)) if G.dim() == 3 else (G * t).sum()
        return out, (dnll.reshape(nll.shape), None)

    def ctc_loss_vjp_rule(cts, primals, kwargs, out, needs):
        """torch's kernel, which has no derivative of its own: second order raises naming it."""
        ct = cts[0]
        if ct is None:
            return (None,) * len(primals)
        return (ctc_grad(primals, out, ct),) + (None,) * (len(primals) - 1)

    register_jvp_rule(op)(ctc_loss_jvp_rule)
    register_vjp_rule(op)(ctc_loss_vjp_rule)


def_ctc_loss(aten._ctc_loss.Tensor, aten._ctc_loss_backward.Tensor)
def_ctc_loss(aten._ctc_loss.default, aten._ctc_loss_backward.default)


# -- grid_sampler_3d ------------------------------------------------------------------------------
# Linear in the input (the jvp is the op on the tangent, the vjp torch's backward kernel). The
# jvp in the grid (ours only) comes from the same kernel: with the channels moved into the batch
# and a cotangent of ones, its grid gradient is d out[n, c, p] / d grid[n, p, :] for each channel
# separately, which is contracted with the grid tangent: one kernel call.
@register_jvp_rule(aten.grid_sampler_3d.default)
def grid_sampler_3d_jvp_rule(primals, tangents, kwargs):
    x, grid, mode, padding, align = primals
    out = aten.grid_sampler_3d.default(*primals)
    tx, tg = tangents[0], tangents[1]
    t = None
    if tx is not None:
        t = aten.grid_sampler_3d.default(tx, grid, mode, padding, align)
    if tg is not None:
        N, C = x.shape[:2]
        xs = x.reshape((N * C, 1) + tuple(x.shape[2:]))
        gs = grid.repeat_interleave(C, 0)
        ones = torch.ones((N * C, 1) + tuple(out.shape[2:]), dtype=out.dtype, device=out.device)
        _, dgrid = aten.grid_sampler_3d_backward.default(
            ones, xs, gs, mode, padding, align, [False, True]
        )
        t2 = (dgrid * tg.repeat_interleave(C, 0)).sum(-1).reshape(out.shape)
        t = t2 if t is None else t + t2
    return out, t


@register_vjp_rule(aten.grid_sampler_3d.default)
def grid_sampler_3d_vjp_rule(ct, primals, kwargs, out, needs):
    x, grid, mode, padding, align = primals
    gx, gg = aten.grid_sampler_3d_backward.default(
        ct, x, grid, mode, padding, align, [bool(needs[0]), bool(needs[1])]
    )
    return (gx if needs[0] else None, gg if needs[1] else None, None, None, None)
