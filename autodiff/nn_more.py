"""Derivative rules of NN ops outside the layer families: bilinear (``_trilinear``), pairwise
distances (``_cdist_forward``, ``_pdist_forward``), ``ctc_loss``, ``embedding_bag`` and the
antialiased upsampling kernels. Forward mode for cdist, pdist, ctc_loss and embedding_bag is
ours only (torch has none); tests/autodiff/test_ad_misc.py checks it by finite differences."""

from __future__ import annotations

import torch

from ._registry import register_jvp_rule, register_vjp_rule
from ._util import unbroadcast
from .reductions import _norm_weight

aten = torch.ops.aten


def _cphys(t):
    return torch.conj_physical(t) if t.is_complex() else t


# -- _trilinear: out = sum_{sumdim} i1[expand1] * i2[expand2] * i3[expand3] ----------------------
def _expanded(t, dims):
    for d in sorted(dims):
        t = t.unsqueeze(d)
    return t


def _sum_dims(t, dims):
    return t.sum(sorted(dims)) if dims else t


@register_jvp_rule(aten._trilinear.default)
def trilinear_jvp_rule(primals, tangents, kwargs):
    """Multilinear: the sum of the op with one argument replaced by its tangent."""
    out = aten._trilinear.default(*primals, **kwargs)
    t = None
    for k in range(3):
        if tangents[k] is None:
            continue
        args = list(primals)
        args[k] = tangents[k]
        tk = aten._trilinear.default(*args, **kwargs)
        t = tk if t is None else t + tk
    return out, t


@register_vjp_rule(aten._trilinear.default)
def trilinear_vjp_rule(ct, primals, kwargs, out, needs):
    ins, expands, sumdim = primals[:3], primals[3:6], primals[6]
    full = [_expanded(x, e) for x, e in zip(ins, expands)]
    ct_full = _expanded(ct, sumdim)
    grads = []
    for k in range(3):
        if not needs[k]:
            grads.append(None)
            continue
        others = [full[j] for j in range(3) if j != k]
        g = ct_full * _cphys(others[0] * others[1])
        g = unbroadcast(g, full[k].shape) if g.shape != full[k].shape else g
        grads.append(g.reshape(ins[k].shape))
    return tuple(grads) + (None,) * (len(primals) - 3)


# -- cdist / pdist ------------------------------------------------------------------------------
# d_ij = ||x1_i - x2_j||_p: d d_ij = <w_ij, dx1_i - dx2_j> with w the derivative of the p-norm
# (reductions._norm_weight: zero at d = 0, the p = inf ties split, p = 0 piecewise constant).
def _pair_weights(diff, d, p):
    return _norm_weight(diff, d.unsqueeze(-1), -1, (diff, p), {})


@register_jvp_rule(aten._cdist_forward.default)
def cdist_jvp_rule(primals, tangents, kwargs):
    """Ours only: d d_ij = <w_ij, dx1_i - dx2_j>."""
    x1, x2, p = primals[:3]
    out = aten._cdist_forward.default(*primals, **kwargs)
    t1, t2 = tangents[0], tangents[1]
    if t1 is None and t2 is None:
        return out, None
    w = _pair_weights(x1.unsqueeze(-2) - x2.unsqueeze(-3), out, p)
    dt = 0
    if t1 is not None:
        dt = dt + t1.unsqueeze(-2)
    if t2 is not None:
        dt = dt - t2.unsqueeze(-3)
    return out, (w * dt).sum(-1)


@register_vjp_rule(aten._cdist_forward.default)
def cdist_vjp_rule(ct, primals, kwargs, out, needs):
    x1, x2, p = primals[:3]
    w = _pair_weights(x1.unsqueeze(-2) - x2.unsqueeze(-3), out, p)
    cw = ct.unsqueeze(-1) * w
    g1 = unbroadcast(cw.sum(-2), x1.shape) if needs[0] else None
    g2 = unbroadcast(-cw.sum(-3), x2.shape) if needs[1] else None
    return (g1, g2) + (None,) * (len(primals) - 2)


def _pdist_pairs(x):
    n = x.shape[0]
    i, j = torch.triu_indices(n, n, 1, device=x.device)
    return i, j


@register_jvp_rule(aten._pdist_forward.default)
def pdist_jvp_rule(primals, tangents, kwargs):
    """Ours only: the pairs i < j of cdist(x, x), row-major."""
    x = primals[0]
    p = primals[1] if len(primals) > 1 else kwargs.get("p", 2.0)
    out = aten._pdist_forward.default(*primals, **kwargs)
    t = tangents[0]
    if t is None:
        return out, None
    i, j = _pdist_pairs(x)
    w = _pair_weights(x[i] - x[j], out, p)
    return out, (w * (t[i] - t[j])).sum(-1)


@register_vjp_rule(aten._pdist_forward.default)
def pdist_vjp_rule(ct, primals, kwargs, out, needs):
    x = primals[0]
    p = primals[1] if len(primals) > 1 else kwargs.get("p", 2.0)
    i, j = _pdist_pairs(x)
    cw = ct.unsqueeze(-1) * _pair_weights(x[i] - x[j], out, p)
    g = torch.zeros(x.shape, dtype=cw.dtype, device=cw.device)
    return (g.index_add(0, i, cw).index_add(0, j, -cw),) + (None,) * (len(primals) - 1)


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


# -- embedding_bag ---------------------------------------------------------------------------------
def _bags(indices, offsets, include_last_offset, n_bags):
    """The bag of each index (indices 1-d with offsets)."""
    pos = torch.arange(indices.shape[0], device=indices.device)
    starts = offsets[:n_bags]
    return (starts.unsqueeze(-1) <= pos).sum(0) - 1


def _embedding_bag_parts(primals):
    weight, indices, offsets = primals[:3]
    mode = primals[4] if len(primals) > 4 else 0
    psw = primals[6] if len(primals) > 6 else None
    include_last = primals[7] if len(primals) > 7 else False
    padding_idx = primals[8] if len(primals) > 8 else -1
    if indices.dim() == 2:  # fixed-size bags, no offsets
        n_bags, size = indices.shape
        bag = torch.arange(n_bags, device=indices.device).repeat_interleave(size)
        indices = indices.reshape(-1)
        if psw is not None:
            psw = psw.reshape(-1)
    else:
        n_bags = offsets.shape[0] - (1 if include_last else 0)
        bag = _bags(indices, offsets, include_last, n_bags)
    keep = indices != padding_idx if padding_idx is not None and padding_idx >= 0 else None
    return weight, indices, bag, n_bags, mode, psw, keep


def _bag_scale(bag, n_bags, keep, dtype):
    """1 / (members of each bag), for mode='mean' (empty bags: 0)."""
    ones = torch.ones(bag.shape, dtype=dtype, device=bag.device)
    if keep is not None:
        ones = ones * keep
    count = torch.zeros(n_bags, dtype=dtype, device=bag.device).index_add(0, bag, ones)
    return torch.where(count > 0, 1 / count.clamp_min(1), torch.zeros_like(count))


def _embedding_bag_linear(primals, out, tw, tpsw):
    """d out for weight tangent tw and per-sample-weights tangent tpsw (sum/mean: linear in
    weight and in psw; max: the selected rows)."""
    weight, indices, bag, n_bags, mode, psw, keep = _embedding_bag_parts(primals)
    if mode == 2:  # the selected rows; an empty bag's max_indices are filler (bag_size 0)
        if tw is None:
            return None
        return tw.gather(0, out[3]) * (out[2] > 0).unsqueeze(-1)
    rows = 0
    if tw is not None:
        rows = tw[indices] if psw is None else tw[indices] * psw.unsqueeze(-1)
    if tpsw is not None:
        rows = rows + weight[indices] * tpsw.unsqueeze(-1)
    if keep is not None:
        rows = rows * keep.unsqueeze(-1)
    res = torch.zeros((n_bags, weight.shape[1]), dtype=out[0].dtype, device=weight.device)
    res = res.index_add(0, bag, rows)
    if mode == 1:
        res = res * _bag_scale(bag, n_bags, keep, res.dtype).unsqueeze(-1)
    return res


def def_embedding_bag(op):
    def embedding_bag_jvp_rule(primals, tangents, kwargs):
        """Ours only."""
        out = op(*primals, **kwargs)
        tw = tangents[0]
        tpsw = tangents[6] if len(tangents) > 6 else None
        if tw is None and tpsw is None:
            return out, None
        return out, (_embedding_bag_linear(primals, out, tw, tpsw), None, None, None)

    def embedding_bag_vjp_rule(cts, primals, kwargs, out, needs):
        ct = cts[0]
        res = [None] * len(primals)
        if ct is None:
            return tuple(res)
        weight, indices, bag, n_bags, mode, psw, keep = _embedding_bag_parts(primals)
        if mode == 2:
            if needs[0]:
                g = torch.zeros(weight.shape, dtype=ct.dtype, device=ct.device)
                res[0] = g.scatter_add(0, out[3], ct * (out[2] > 0).unsqueeze(-1))
            return tuple(res)
        if mode == 1:
            ct = ct * _bag_scale(bag, n_bags, keep, ct.dtype).unsqueeze(-1)
        per_index = ct[bag]
        if keep is not None:
            per_index = per_index * keep.unsqueeze(-1)
        if needs[0]:
            rows = per_index if psw is None else per_index * psw.unsqueeze(-1)
            g = torch.zeros(weight.shape, dtype=ct.dtype, device=ct.device)
            res[0] = g.index_add(0, indices, rows)
        if len(primals) > 6 and psw is not None and needs[6]:
            res[6] = (per_index * weight[indices]).sum(-1).reshape(primals[6].shape)
        return tuple(res)

    register_jvp_rule(op)(embedding_bag_jvp_rule)
    register_vjp_rule(op)(embedding_bag_vjp_rule)


def_embedding_bag(aten._embedding_bag_forward_only.default)
def_embedding_bag(aten._embedding_bag.default)


# -- antialiased upsampling: linear in the input, with torch's backward kernel as the transpose ----
def def_upsample_aa(op, backward):
    def upsample_aa_jvp_rule(primals, tangents, kwargs):
        out = op(*primals, **kwargs)
        t = tangents[0]
        return out, None if t is None else op(t, *primals[1:], **kwargs)

    def upsample_aa_vjp_rule(ct, primals, kwargs, out, needs):
        x, output_size, align_corners = primals[:3]
        scales = list(primals[3:]) + [None] * (5 - len(primals))
        scales_h = kwargs.get("scales_h", scales[0])
        scales_w = kwargs.get("scales_w", scales[1])
        g = backward(ct, output_size, list(x.shape), align_corners, scales_h, scales_w)
        return (g,) + (None,) * (len(primals) - 1)

    def backward_jvp_rule(primals, tangents, kwargs):
        out = backward(*primals, **kwargs)
        t = tangents[0]
        return out, None if t is None else backward(t, *primals[1:], **kwargs)

    def backward_vjp_rule(ct, primals, kwargs, out, needs):
        _, output_size, input_size, align_corners = primals[:4]
        rest = list(primals[4:]) + [None] * (6 - len(primals))
        scales_h = kwargs.get("scales_h", rest[0])
        scales_w = kwargs.get("scales_w", rest[1])
        return (op(ct, output_size, align_corners, scales_h, scales_w),) + (None,) * (
            len(primals) - 1
        )

    register_jvp_rule(op)(upsample_aa_jvp_rule)
    register_vjp_rule(op)(upsample_aa_vjp_rule)
    register_jvp_rule(backward)(backward_jvp_rule)
    register_vjp_rule(backward)(backward_vjp_rule)


def_upsample_aa(aten._upsample_bilinear2d_aa.default, aten._upsample_bilinear2d_aa_backward.default)
def_upsample_aa(aten._upsample_bicubic2d_aa.default, aten._upsample_bicubic2d_aa_backward.default)


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
