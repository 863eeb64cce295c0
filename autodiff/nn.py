"""Derivative rules of the neural-network ops outside the convolution, pooling and
normalization families that reach dispatch undecomposed: softmax, the losses (ctc_loss's
forward mode is ours only) and grid_sampler_3d. Every vjp is written in ordinary
differentiable, batchable ops, so backward passes compose with vmap and higher-order
derivatives. ctc_loss's and grid_sampler_3d's vjps call torch's backward kernels (12-16x faster
than ours); differentiating those kernels runs our differentiable formulations of them
(Note [Differentiable backward kernels])."""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F

from functransforms._core.decomp import override

from ._registry import JVP_RULES, VJP_RULES, register_jvp_rule, register_vjp_rule
from ._util import logsumexp_jvp, unbroadcast

aten = torch.ops.aten


@register_jvp_rule(aten._softmax.default)
def softmax_jvp_rule(primals, tangents, kwargs):
    """d softmax = y * (t - <t, y>), as torch writes it: y * (t - logsumexp_jvp(x, t))."""
    x, dim = primals[0], primals[1]
    y = aten._softmax.default(*primals)
    t = tangents[0]
    return y, None if t is None else y * (t - logsumexp_jvp(x, t, [dim], True))


_HALF = (torch.float16, torch.bfloat16)


def _accumulate_in_float(ct, out):
    """torch's softmax backward kernels read half-precision values into float32 and round
    once at the end; the same formula in float16/bfloat16 ops rounds every step (a bfloat16
    log_softmax gradient was 1 ulp off functorch's). Returns the operands and the dtype to
    round to (None: compute as they are)."""
    if out.dtype in _HALF or ct.dtype in _HALF:
        return ct.float(), out.float(), out.dtype
    return ct, out, None


@register_vjp_rule(aten._softmax.default)
def softmax_vjp_rule(ct, primals, kwargs, out, needs):
    dim = primals[1]
    ct, y, half = _accumulate_in_float(ct, out.conj() if out.is_complex() else out)
    g = y * (ct - (ct * y).sum(dim, keepdim=True))
    return g if half is None else g.to(half), None, None


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
    """d log_softmax = t - <t, softmax>, as torch writes it: t - logsumexp_jvp(x, t)."""
    x, dim = primals[0], primals[1]
    y = aten._log_softmax.default(*primals)
    t = tangents[0]
    return y, None if t is None else t - logsumexp_jvp(x, t, [dim], True)


@register_vjp_rule(aten._log_softmax.default)
def log_softmax_vjp_rule(ct, primals, kwargs, out, needs):
    dim = primals[1]
    ct, y, half = _accumulate_in_float(ct, out)
    g = ct - y.exp() * ct.sum(dim, keepdim=True)
    return g if half is None else g.to(half), None, None


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
        """torch's kernel; its derivatives: Note [Differentiable backward kernels]."""
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
# separately, which is contracted with the grid tangent: one kernel call. Second order:
# Note [Differentiable backward kernels].
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


# -- second order through the backward kernels ---------------------------------------------------
# Note [Differentiable backward kernels]
#     The first-order vjps (and grid_sampler_3d's jvp in the grid) call torch's backward kernels
#     `grid_sampler_3d_backward` and `_ctc_loss_backward`, which have no derivative in torch.
#     They stay the first-order path: equal to torch by construction, and 12x (grid_sampler_3d)
#     and 16x (ctc_loss, whose recursions here are a Python loop over time) faster in CPU time
#     than the formulations below (docs/design/derivative-rules.md). When a backward kernel
#     itself meets a transform's wrappers (jvp of a vjp, grad of grad, jvp of jvp), the
#     interpreters find no
#     rule for it and fall back to its decomposition (Note [Decomposition fallback],
#     functransforms/_core/decomp.py): the formulations below, which compute the kernels' numbers
#     with ordinary differentiable ops. This is how grid_sampler_2d gets its second order
#     (torch's decomposition of it). Batching keeps its own rules for both kernels
#     (batching/nn.py), so vmap of a first-order backward never reaches them.


def _source_index(coord, size, padding, align):
    """The kernel's sampling coordinate of normalized ``coord`` along an axis of ``size``, and
    its derivative in ``coord`` (piecewise constant: GridSampler.h's ``*_set_grad``)."""
    if align:
        ix, scale = (coord + 1) / 2 * (size - 1), (size - 1) / 2
    else:
        ix, scale = ((coord + 1) * size - 1) / 2, size / 2
    d = torch.full_like(ix, scale)
    if padding == 2:  # reflection about the borders, as GridSampler.h's reflect_coordinates
        lo, span = (0.0, size - 1.0) if align else (-0.5, float(size))
        if span <= 0:
            ix, d = ix * 0, d * 0
        else:
            shifted = ix - lo
            d = torch.where(shifted < 0, -d, d)
            shifted = shifted.abs()
            span_t = torch.tensor(span, dtype=ix.dtype, device=ix.device)  # fmod.Scalar: no rule
            extra = torch.fmod(shifted, span_t)
            even = (shifted / span).floor().remainder(2) == 0
            ix = torch.where(even, extra + lo, span - extra + lo)
            d = torch.where(even, d, -d)
    if padding != 0:  # border and reflection clip to the edge pixels, where d = 0
        inside = (ix > 0) & (ix < size - 1)
        ix, d = ix.clamp(0, size - 1), torch.where(inside, d, 0)
    return ix, d


def _grid_sampler_3d_backward(grad_out, x, grid, mode, padding, align, output_mask):
    """(d input, d grid) of ``grid_sampler_3d`` for modes bilinear (0) and nearest (1), in ops
    that have derivatives: the input's is a scatter-add of the trilinear (or nearest) weights,
    the grid's the gathered corner values times the weights' derivatives (zero for nearest)."""
    if mode not in (0, 1):
        raise NotImplementedError(f"grid_sampler_3d_backward: interpolation mode {mode}")
    N, C, D, H, W = x.shape
    P = grid.shape[1] * grid.shape[2] * grid.shape[3]
    g = grid.reshape(N, P, 3)
    go = grad_out.reshape(N, C, P)
    flat = x.reshape(N, C, D * H * W)
    axes = [_source_index(g[..., k], n, padding, align) for k, n in enumerate((W, H, D))]
    if mode == 1:  # nearest: round half to even like the kernel's nearbyint
        corners = [(None, [i.round() for i, _ in axes], None)]
    else:  # the kernel's weights: (base + 1 - i) on the low corner, (i - base) on the high one
        base = [i.floor() for i, _ in axes]
        lo = [b + 1 - i for (i, _), b in zip(axes, base)]
        hi = [i - b for (i, _), b in zip(axes, base)]
        corners = [
            (
                offs,
                [b + o for b, o in zip(base, offs)],
                [h if o else w for w, h, o in zip(lo, hi, offs)],
            )
            for offs in itertools.product((0, 1), repeat=3)
        ]
    gx = torch.zeros_like(flat) if output_mask[0] else None
    dgrid = [0, 0, 0]
    for offs, pos, ws in corners:
        inb = functools.reduce(
            torch.logical_and, [(p >= 0) & (p <= n - 1) for p, n in zip(pos, (W, H, D))]
        )
        ix, iy, iz = (torch.where(inb, p, 0).long() for p in pos)
        idx = ((iz * H + iy) * W + ix).unsqueeze(1).expand(N, C, P)
        w = inb.to(x.dtype) if ws is None else torch.where(inb, ws[0] * ws[1] * ws[2], 0)
        if gx is not None:
            gx = gx.scatter_add(2, idx, go * w.unsqueeze(1))
        if output_mask[1] and ws is not None:
            s = torch.where(inb, (go * flat.gather(2, idx)).sum(1), 0)  # [N, P]
            for k in range(3):  # d w / d i_k: the other two weights, signed by the corner side
                other = ws[(k + 1) % 3] * ws[(k + 2) % 3]
                dgrid[k] = dgrid[k] + (s * other if offs[k] else -s * other)
    if gx is not None:
        gx = gx.reshape(x.shape)
    gg = None
    if output_mask[1]:
        if mode == 1:
            gg = torch.zeros_like(grid)
        else:
            gg = torch.stack([dg * axes[k][1] for k, dg in enumerate(dgrid)], -1)
            gg = gg.reshape(grid.shape)
    return gx, gg


# A finite stand-in for log 0 in the recursions below: logsumexp over entries that are all -inf
# has a NaN derivative; over this value it has a finite one, and exp() of it is exactly 0.
_LOG0 = -1e30


def _ctc_lengths(lengths, device):
    return (
        torch.as_tensor(lengths, device=device) if isinstance(lengths, (list, tuple)) else lengths
    )


def _ctc_loss_backward(
    grad,
    log_probs,
    targets,
    input_lengths,
    target_lengths,
    nll,
    log_alpha,
    blank,
    zero_infinity=False,
):
    """d nll / d log_probs as torch's kernel computes it: ``(exp(lp) - gamma) * grad`` with the
    posterior ``gamma[t, c] = sum_{s: l'(s) = c} exp(log_alpha + log_beta + nll - lp)`` of the
    extended labels l' (blanks between the targets), zero from each input length on. The alpha
    and beta recursions are redone here in ordinary ops (the kernel's ``log_alpha`` and ``nll``
    are outputs without derivatives of their own); ``nll`` is read only for its infinities."""
    T, B, C = log_probs.shape
    dev = log_probs.device
    il = _ctc_lengths(input_lengths, dev)
    tl = _ctc_lengths(target_lengths, dev)
    if isinstance(target_lengths, (list, tuple)):  # the padded width: a Python int is needed
        L = max(target_lengths, default=0)
    elif type(target_lengths) is torch.Tensor and target_lengths.numel():
        L = int(target_lengths.max())
    else:  # a transform's wrapper: a bound read from the shapes
        L = targets.shape[-1]
    j = torch.arange(L, device=dev)
    if targets.dim() == 1:  # concatenated targets: example b's start at sum(tl[:b])
        start = tl.cumsum(0) - tl
        at = (start.unsqueeze(1) + j).clamp(max=max(targets.shape[0] - 1, 0))
        labels = targets[at] if targets.numel() else torch.zeros_like(at)
    else:
        labels = targets[:, :L]
    labels = torch.where(j < tl.unsqueeze(1), labels, blank)
    S = 2 * L + 1
    s = torch.arange(S, device=dev)
    blanks = torch.full_like(labels, blank)
    ext = torch.stack([blanks, labels], 2).reshape(B, 2 * L)  # l': blank, l1, blank, l2, ...
    ext = torch.cat([ext, blanks[:, :1] if L else labels.new_full((B, 1), blank)], 1)
    valid = s < 2 * tl.unsqueeze(1) + 1  # [B, S]
    prev2 = torch.cat([ext.new_full((B, 2), blank), ext[:, :-2]], 1)
    skip = (s >= 2) & (ext != blank) & (ext != prev2)  # alpha may come from s - 2
    skip_next = torch.cat([skip[:, 2:], skip.new_zeros(B, 2)], 1)  # beta may come from s + 2
    lp = log_probs.gather(2, ext.unsqueeze(0).expand(T, B, S))  # [T, B, S]: lp[t, b, l'(s)]

    def shift(a, k):  # a[:, s - k], log 0 where s < k (k < 0: a[:, s + |k|], log 0 past the end)
        pad = a.new_full((B, abs(k)), _LOG0)
        return torch.cat([pad, a[:, :-k]], 1) if k > 0 else torch.cat([a[:, -k:], pad], 1)

    def lse3(a, b, c):
        return torch.logsumexp(torch.stack([a, b, c]), 0)

    t0 = s < 2  # alpha starts on the first blank and the first label
    alphas = [torch.where(t0 & valid, lp[0], _LOG0)]
    for t in range(1, T):
        a = alphas[-1]
        a = lse3(a, shift(a, 1), torch.where(skip, shift(a, 2), _LOG0)) + lp[t]
        alphas.append(torch.where(valid, a, _LOG0))
    alpha = torch.stack(alphas)  # [T, B, S]
    last = (il - 1).clamp(min=0)
    tail = (s == 2 * tl.unsqueeze(1)) | (s == 2 * tl.unsqueeze(1) - 1)  # the two end states
    end = alpha.gather(0, last.view(1, B, 1).expand(1, B, S))[0]
    dead = nll == float("inf")  # an impossible alignment: no finite posterior to compute
    loss = torch.where(dead, 0, -torch.logsumexp(torch.where(tail, end, _LOG0), 1))  # [B]
    betas = []
    b_next = None
    for t in reversed(range(T)):
        start = (t == il - 1).unsqueeze(1)
        init = torch.where(tail & valid, lp[t], _LOG0)
        if b_next is None:
            b = torch.where(start, init, _LOG0)
        else:
            b = lse3(b_next, shift(b_next, -1), torch.where(skip_next, shift(b_next, -2), _LOG0))
            b = torch.where(start, init, torch.where((t < il - 1).unsqueeze(1), b + lp[t], _LOG0))
        b_next = torch.where(valid, b, _LOG0)
        betas.append(b_next)
    beta = torch.stack(betas[::-1])
    post = torch.exp(alpha + beta + loss.view(1, B, 1) - lp)  # [T, B, S]
    onehot = (ext.unsqueeze(-1) == torch.arange(C, device=dev)).to(post.dtype)  # [B, S, C]
    gamma = torch.einsum("tbs,bsc->tbc", post, onehot)
    g = (log_probs.exp() - gamma) * grad.view(1, B, 1)
    # an impossible alignment: the kernel's 0 under zero_infinity, else its NaN (before each
    # input length only)
    g = torch.where(dead.view(1, B, 1), 0.0 if zero_infinity else float("nan"), g)
    live = torch.arange(T, device=dev).unsqueeze(1) < il  # [T, B]
    return torch.where(live.unsqueeze(-1), g, 0)


override(aten.grid_sampler_3d_backward.default)(_grid_sampler_3d_backward)
override(aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor)(_ctc_loss_backward)


# -- LSTM on CPU ---------------------------------------------------------------------------------
# Note [LSTM through oneDNN]
#     On CPU, nn.LSTM's composite kernel runs each layer and direction as aten.mkldnn_rnn_layer,
#     a fused oneDNN kernel whose only derivative in torch is its backward kernel (no forward
#     mode, no second order, no batching rule). We differentiate and batch it through this
#     decomposition instead: the input projection as one matmul over all time steps, then the
#     recurrence one step at a time (gates i, f, g, o as torch orders them), so grad, jvp,
#     second order and vmap (per-sample gradients of an LSTM, which PyTorch cannot batch)
#     all come from the rules of ordinary ops. torch hands the kernel a sequence-first input
#     [T, B, I] whatever its batch_first flag says (it transposes before the call). Under a
#     transform nn.LSTM itself no longer gets here (aten::lstm is a kernel of ours: Note
#     [Composite kernels of ours], functransforms/_core/composites.py); direct calls of the op do.
def _mkldnn_rnn_layer(
    input, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, batch_sizes, mode, hidden_size, *rest
):
    has_biases = rest[1] if len(rest) > 1 else True
    if batch_sizes:
        raise NotImplementedError(
            "LSTM with packed sequences (batch_sizes) under a transform: not supported. "
            "Do: pad the sequences (torch.nn.utils.rnn.pad_packed_sequence) instead."
        )
    gx = torch.matmul(input, w_ih.t())  # [T, B, 4H]
    if has_biases:
        gx = gx + b_ih + b_hh
    h, c = hx, cx
    T = input.shape[0]
    outs = [None] * T
    for t in range(T - 1, -1, -1) if reverse else range(T):
        i, f, g, o = (gx[t] + torch.matmul(h, w_hh.t())).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outs[t] = h
    out = torch.stack(outs) if T else input.new_zeros((0,) + tuple(hx.shape))
    return out, h, c, torch.empty(0, dtype=torch.uint8, device=input.device)


override(aten.mkldnn_rnn_layer.default)(_mkldnn_rnn_layer)


def _pack_padded_sequence(input, lengths, batch_first):
    """torch's packing (``PackedSequence.cpp``) as slices and one cat: each run of time steps
    that keeps the same sequences, ``input[t0:t1, :b]``, flattened to rows.
    torch's kernel has a backward kernel only (no forward mode, no batching rule). The
    batch sizes, and every check of ``lengths`` with torch's message, come from torch's
    kernel run on a plain stand-in of the input's first two dims (a constant: integers)."""
    from functransforms._core.composites import read_sizes

    x = input.transpose(0, 1) if batch_first else input
    # on the CPU whatever the default device: torch's kernel takes CPU lengths
    lengths = torch.tensor(read_sizes(lengths, "pack_padded_sequence: the lengths"), device="cpu")
    # an empty or 1-d input keeps its shape: torch's kernel raises as on the real input
    shape = x.shape[:2] if x.dim() >= 2 and x.numel() else x.shape
    stand_in = torch.zeros(shape, dtype=torch.int8, device="cpu")
    _, batch_sizes = aten._pack_padded_sequence.default(stand_in, lengths, False)
    sizes = batch_sizes.tolist()
    steps, t0 = [], 0
    for t1 in range(1, len(sizes) + 1):
        if t1 == len(sizes) or sizes[t1] != sizes[t0]:
            steps.append(x[t0:t1, : sizes[t0]].reshape((-1,) + tuple(x.shape[2:])))
            t0 = t1
    return torch.cat(steps), batch_sizes


override(aten._pack_padded_sequence.default)(_pack_padded_sequence)


# -- nn.MultiheadAttention's fast path ---------------------------------------------------------
# In eval mode with parameters that do not require grad, nn.MultiheadAttention calls the fused
# aten._native_multi_head_attention when no argument has a __torch_function__ and none requires
# grad: the values inside jvp (jvp/jacfwd of a frozen attention layer reach it, and functorch
# computes them, so it needs rules here). Its math, checked against the kernel
# for every mask type, bool and float masks, need_weights and average_attn_weights
# (tests/interop/test_autograd_both_sides.py); a row with every key masked is NaN, as the kernel's.
def _native_multi_head_attention(
    query,
    key,
    value,
    embed_dim,
    num_head,
    qkv_weight,
    qkv_bias,
    proj_weight,
    proj_bias,
    mask=None,
    need_weights=True,
    average_attn_weights=True,
    mask_type=None,
):
    B, L, _ = query.shape
    S = key.shape[1]
    hd = embed_dim // num_head
    (wq, wk, wv), (bq, bk, bv) = qkv_weight.chunk(3), qkv_bias.chunk(3)
    q = F.linear(query, wq, bq).view(B, L, num_head, hd).transpose(1, 2)  # [B, H, L, hd]
    k = F.linear(key, wk, bk).view(B, S, num_head, hd).transpose(1, 2)
    v = F.linear(value, wv, bv).view(B, S, num_head, hd).transpose(1, 2)
    scores = (q / hd**0.5) @ k.transpose(-2, -1)  # [B, H, L, S]
    if mask is not None:  # 0: [L, S]; 1: key padding [B, S]; 2: [B, H, L, S]
        m = (
            mask.view(B, 1, 1, S)
            if mask_type == 1
            else mask.view(1, 1, L, S)
            if mask_type == 0
            else mask
        )
        scores = scores.masked_fill(m, float("-inf")) if m.dtype == torch.bool else scores + m
    weights = scores.softmax(-1)
    out = F.linear((weights @ v).transpose(1, 2).reshape(B, L, embed_dim), proj_weight, proj_bias)
    if not need_weights:
        return out, None
    return out, weights.mean(1) if average_attn_weights else weights


override(aten._native_multi_head_attention.default)(_native_multi_head_attention)


# -- binary_cross_entropy -------------------------------------------------------------------------
# Derivative rules of losses whose derivatives at the edges of their domain are torch's
# conventions, not a decomposition's: binary_cross_entropy at probabilities 0 and 1.
#
# Note [binary_cross_entropy at 0 and 1]
#     torch clamps the log of the loss at -100 and divides its derivative by
#     ``max(x (1 - x), 1e-12)``: at x = 0 or 1 (a float32 sigmoid saturates there) the gradient
#     is finite, (x - target) / 1e-12. torch's decomposition, which ran before these rules,
#     differentiates ``max(log x, -100)``: 0 * inf = nan. So the vjp is torch's kernel
#     ``binary_cross_entropy_backward``, the target's derivative torch's ``-logit(x)``, and the
#     jvp torch's forward formula, built from the same two.
def _bce_args(primals):
    x, target = primals[0], primals[1]
    weight = primals[2] if len(primals) > 2 else None
    reduction = primals[3] if len(primals) > 3 else 1
    return x, target, weight, reduction


def _target_backward(g, x, target, weight, reduction):
    """torch's binary_cross_entropy_target_backward: d loss / d target = -logit(x)."""
    gt = -torch.logit(x) * g
    if weight is not None:
        gt = gt * weight
    return gt / max(target.numel(), 1) if reduction == 1 else gt


@register_jvp_rule(aten.binary_cross_entropy.default)
def binary_cross_entropy_jvp_rule(primals, tangents, kwargs):
    x, target, weight, reduction = _bce_args(primals)
    out = aten.binary_cross_entropy.default(*primals, **kwargs)
    tx, tt = tangents[0], tangents[1]
    if tx is None and tt is None:
        return out, None
    t = 0
    if tx is not None:
        t = aten.binary_cross_entropy_backward(tx, x, target, weight, 0)
    if tt is not None:
        t = t + _target_backward(tt, x, target, weight, 0)
    return out, t if reduction == 0 else (t.mean() if reduction == 1 else t.sum())


@register_vjp_rule(aten.binary_cross_entropy.default)
def binary_cross_entropy_vjp_rule(ct, primals, kwargs, out, needs):
    x, target, weight, reduction = _bce_args(primals)
    res = [None] * len(primals)
    if needs[0]:
        gx = aten.binary_cross_entropy_backward(ct, x, target, weight, reduction)
        res[0] = unbroadcast(gx, x.shape)
    if needs[1]:
        res[1] = unbroadcast(_target_backward(ct, x, target, weight, reduction), target.shape)
    return tuple(res)


_EPS = 1e-12  # torch's EPSILON of binary_cross_entropy's derivatives


def _weighted(v, x, weight, reduction):
    if weight is not None:
        v = v * weight
    return v / max(x.numel(), 1) if reduction == 1 else v


def _double_backward_self(g, ct, x, target, weight, reduction):
    """torch's binary_cross_entropy_double_backward (its eps, not the kernel's clamp)."""
    num = x * x - 2 * x * target + target
    gi = num / ((x + _EPS).pow(2) * (1 - x + _EPS).pow(2)) * (ct * g)
    return _weighted(gi, x, weight, reduction)


def _double_backward_target(g, ct, x, weight, reduction):
    """torch's binary_cross_entropy_double_backward_target."""
    gt = -ct * g / (x * (1 - x)).clamp_min(_EPS)
    return _weighted(gt, x, weight, reduction)


@register_jvp_rule(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward_jvp_rule(primals, tangents, kwargs):
    g, x, target = primals[:3]
    weight = primals[3] if len(primals) > 3 else None
    reduction = primals[4] if len(primals) > 4 else 1
    out = aten.binary_cross_entropy_backward.default(*primals, **kwargs)
    tg, tx, tt = tangents[:3]
    t = None
    for part in (
        None
        if tg is None
        else aten.binary_cross_entropy_backward(tg, x, target, weight, reduction),
        None if tx is None else _double_backward_self(g, tx, x, target, weight, reduction),
        None if tt is None else _double_backward_target(g, tt, x, weight, reduction),
    ):
        if part is not None:
            t = part if t is None else t + part
    return out, None if t is None else t.expand(out.shape)


@register_vjp_rule(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward_vjp_rule(ct, primals, kwargs, out, needs):
    g, x, target = primals[:3]
    weight = primals[3] if len(primals) > 3 else None
    reduction = primals[4] if len(primals) > 4 else 1
    res = [None] * len(primals)
    if needs[0]:
        gg = aten.binary_cross_entropy_backward(ct, x, target, weight, reduction)
        res[0] = unbroadcast(gg, g.shape)
    if needs[1]:
        res[1] = unbroadcast(_double_backward_self(g, ct, x, target, weight, reduction), x.shape)
    if needs[2]:
        gt = _double_backward_target(g, ct, x, weight, reduction)
        res[2] = unbroadcast(gt, target.shape)
    return tuple(res)


# -- F.linear_cross_entropy's chunked custom ops ---------------------------------------------
# Note [Derivatives of linear_cross_entropy]
#     torch_nn::_linear_cross_entropy_batch_chunked (mean / sum) returns (loss, grad_input,
#     grad_weight, grad_bias), the gradients precomputed in its forward when the compute_*
#     flags say so (torch's autograd scales them by the cotangent); the _no_reduction op
#     returns per-row losses. Neither has a forward-mode formula in torch (functorch's jvp
#     returns a zero tangent for the loss: torch_func_differences.md 37). Both rules use
#     dL/dz = s_n (softmax(z_n) - onehot(t_n)) for the logits z = x W^T + b (Note [Batching
#     linear_cross_entropy], batching/nn.py), in ordinary ops, so they compose; the
#     precomputed gradient outputs are not differentiated (no caller reads them but torch's
#     backward, which these rules replace).
_LCE_NAMES = (
    "torch_nn::_linear_cross_entropy_batch_chunked.default",
    "torch_nn::_linear_cross_entropy_batch_chunked_no_reduction.default",
)
_LCE_MODULE = "torch.nn.modules.linear_cross_entropy"


def _lce_dz(x, W, t, b, w, reduction, ignore_index, acc_dtype):
    """(dL/dz, dL/dt) in acc_dtype, dL/dt None for class-index targets; reduction None for
    per-row losses (row n holds dL_n/dz_n). Probability targets (torch 2.15: float [N, C]):
    L_n = -sum_c w_c t_nc log_softmax(z_n)_c, 'mean' divides by N."""
    z = x.to(acc_dtype) @ W.to(acc_dtype).mT
    if b is not None:
        z = z + b.to(acc_dtype)
    if t.is_floating_point():
        wt = t.to(acc_dtype) if w is None else t.to(acc_dtype) * w.to(acc_dtype)
        scale = 1 / z.shape[-2] if reduction == "mean" else 1
        G = scale * (wt.sum(-1, keepdim=True) * torch.softmax(z, -1) - wt)
        lsm = torch.log_softmax(z, -1)
        return G, -scale * (lsm if w is None else w.to(acc_dtype) * lsm)
    keep = t != ignore_index
    safe_t = torch.where(keep, t, 0)
    s = keep.to(acc_dtype)
    if w is not None:
        s = torch.where(keep, w.to(acc_dtype).gather(-1, safe_t), 0)
    if reduction == "mean":
        d = s.sum(-1)
        s = s / torch.where(d == 0, torch.nan, d)  # nan when every row is ignored, as the op
    onehot = F.one_hot(safe_t, z.shape[-1]).to(z.dtype)
    return s.unsqueeze(-1) * (torch.softmax(z, -1) - onehot), None


def _lce_parts(primals):
    """(x, W, t, b, w, reduction, ignore_index, acc_dtype) of either op."""
    x, W, t, b, w = primals[:5]
    if len(primals) == 9:  # _no_reduction: (..., ignore_index, chunk, policy, acc_dtype)
        return x, W, t, b, w, None, primals[5], primals[8]
    return x, W, t, b, w, primals[5], primals[6], primals[10]


def _lce_jvp_rule(op_index):
    def lce_jvp_rule(primals, tangents, kwargs):
        """dL = sum_n <dL/dz_n, dx_n W^T + x_n dW^T + db> + <dL/dt_n, dt_n>."""
        out = _lce(op_index)(*primals, **kwargs)
        tx, tW, tt, tb = tangents[:4]
        if tx is None and tW is None and tt is None and tb is None:
            return out, None
        x, W, t, b, w, reduction, ignore_index, acc = _lce_parts(primals)
        G, Gt = _lce_dz(x, W, t, b, w, reduction, ignore_index, acc)
        dz = 0
        if tx is not None:
            dz = dz + tx.to(acc) @ W.to(acc).mT
        if tW is not None:
            dz = dz + x.to(acc) @ tW.to(acc).mT
        if tb is not None:
            dz = dz + tb.to(acc)
        dloss = (G * dz).sum(-1)
        if tt is not None and Gt is not None:
            dloss = dloss + (Gt * tt.to(acc)).sum(-1)
        if reduction is None:
            return out, dloss.to(out.dtype)
        return out, (dloss.sum().to(out[0].dtype), None, None, None)

    return lce_jvp_rule


def _lce_vjp_rule(op_index):
    def lce_vjp_rule(cts, primals, kwargs, out, needs):
        """dx = ct G W, dW = ct G^T x, db = ct sum_n G_n (G = dL/dz); dt = ct dL/dt."""
        ct = cts if op_index == 1 else cts[0]
        if op_index == 0 and any(c is not None for c in cts[1:]):
            raise NotImplementedError(
                "linear_cross_entropy: the gradients precomputed by "
                "torch_nn._linear_cross_entropy_batch_chunked were differentiated; only its "
                "loss has a derivative rule (Note [Derivatives of linear_cross_entropy])."
            )
        res = [None] * len(primals)
        if ct is None:
            return tuple(res)
        x, W, t, b, w, reduction, ignore_index, acc = _lce_parts(primals)
        G, Gt = _lce_dz(x, W, t, b, w, reduction, ignore_index, acc)
        scale = ct.to(acc).unsqueeze(-1) if reduction is None else ct.to(acc)
        G = G * scale
        if needs[0]:
            res[0] = (G @ W.to(acc)).to(x.dtype)
        if needs[1]:
            res[1] = (G.mT @ x.to(acc)).to(W.dtype)
        if needs[2] and Gt is not None:
            res[2] = (Gt * scale).to(t.dtype)
        if needs[3] and b is not None:
            res[3] = G.sum(-2).to(b.dtype)
        return tuple(res)

    return lce_vjp_rule


def _lce(i):
    """The op ``_LCE_NAMES[i]`` (defined by now: its rule is running)."""
    name = _LCE_NAMES[i].partition("::")[2].partition(".")[0]
    return getattr(torch.ops.torch_nn, name).default


for _i, _name in enumerate(_LCE_NAMES):
    JVP_RULES.register_when_defined(_name, _lce_jvp_rule(_i), _LCE_MODULE)
    VJP_RULES.register_when_defined(_name, _lce_vjp_rule(_i), _LCE_MODULE)
