"""Batching rules for the neural-network ops that reach the dispatcher undecomposed: losses,
softmax and its backward ops, grid_sampler_3d (convolution, pooling and normalization: files of
those names).

Note [Batching losses]
    A loss with ``reduction='mean'|'sum'`` reduces over every logical dim, so the per-example
    value is the reduction of the unreduced loss over all dims but the batch dim: the rule runs
    the op with ``reduction='none'`` on batch-aligned arguments and reduces dims ``1..``.
"""

from __future__ import annotations

import torch

from ._registry import VMAP_RULES, register_vmap_rule
from ._util import expand_front, flat_batch, merge_dims, pad_to, split_dim, to_front, wrap_dim
from .reductions import def_dim

aten = torch.ops.aten

_NONE, _MEAN, _SUM = 0, 1, 2


def _reduce(loss, reduction):
    """Per-example mean/sum of an unreduced loss with the batch dim in front."""
    if reduction == _NONE:
        return loss
    flat = flat_batch(loss)
    return flat.mean(1) if reduction == _MEAN else flat.sum(1)


def _expanded_to_common_front(interp, tensors, bdims):
    """Batched tensors get their batch dim in front and all tensors get expanded to the
    common physical shape ``[B, *broadcast(logical shapes)]``."""
    B = interp.batch_size
    shapes = [
        t.shape[:b] + t.shape[b + 1 :] if b is not None else t.shape for t, b in zip(tensors, bdims)
    ]
    logical = torch.broadcast_shapes(*shapes)
    out = []
    for t, b in zip(tensors, bdims):
        t = t.unsqueeze(0) if b is None else pad_to(to_front(t, b), len(logical))
        out.append(t.expand((B, *logical)))
    return out


def def_loss(op, reduction_pos, tensor_pos=(0, 1)):
    """``op(self, target, ..., reduction, ...)``: Note [Batching losses]."""

    def loss_vmap_rule(interp, args, bdims, kwargs):
        a = list(args)
        reduction = a[reduction_pos] if len(a) > reduction_pos else kwargs.get("reduction", _MEAN)
        fronted = _expanded_to_common_front(
            interp, [a[k] for k in tensor_pos], [bdims[k] for k in tensor_pos]
        )
        for k, t in zip(tensor_pos, fronted):
            a[k] = t
        nd = fronted[0].dim() - 1
        for k in range(len(a)):  # optional extra tensors (weight, pos_weight)
            if k not in tensor_pos and isinstance(a[k], torch.Tensor) and bdims[k] is not None:
                a[k] = pad_to(to_front(a[k], bdims[k]), nd)
        kw = dict(kwargs)
        if len(a) > reduction_pos:
            a[reduction_pos] = _NONE
        else:
            kw["reduction"] = _NONE
        return _reduce(op(*a, **kw), reduction), 0

    register_vmap_rule(op)(loss_vmap_rule)


def_loss(aten.mse_loss.default, 2)
def_loss(aten.smooth_l1_loss.default, 2)
def_loss(aten.huber_loss.default, 2)
def_loss(aten.soft_margin_loss.default, 2)
def_loss(aten.binary_cross_entropy.default, 3)
def_loss(aten.binary_cross_entropy_with_logits.default, 4)


@register_vmap_rule(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward_vmap_rule(interp, args, bdims, kwargs):
    """binary_cross_entropy_backward(grad, x, target, weight, reduction): the kernel on
    batch-aligned operands with reduction 'none' (grad broadcast over the example), divided by
    the example's size for 'mean'. Its decomposition would reach an outer jvp in place of the
    kernel's rule (Note [binary_cross_entropy at 0 and 1], autodiff/nn.py): at x = 0 or 1 the
    hessian of F.binary_cross_entropy was the decomposition's clamp, not torch's formula."""
    a = list(args)
    reduction = a[4] if len(a) > 4 else kwargs.get("reduction", _MEAN)
    weight = a[3] if len(a) > 3 else kwargs.get("weight")
    wb = bdims[3] if len(a) > 3 else None
    tensors = [a[0], a[1], a[2]] + ([weight] if weight is not None else [])
    tb = [bdims[0], bdims[1], bdims[2]] + ([wb] if weight is not None else [])
    fronted = _expanded_to_common_front(interp, tensors, tb)
    g, x, t = fronted[:3]
    w = fronted[3] if weight is not None else None
    out = aten.binary_cross_entropy_backward.default(g, x, t, w, _NONE)
    if reduction == _MEAN:
        out = out / max(x[0].numel(), 1)
    return out, 0


@register_vmap_rule(aten.nll_loss_forward.default)
def nll_loss_forward_vmap_rule(interp, args, bdims, kwargs):
    """nll_loss(x, t, weight, reduction, ignore_index) -> (loss, total_weight), as an
    unreduced loss and per-example weights ``weight[t]`` (0 where ``t == ignore_index``)."""
    x, t, weight, reduction, ignore_index = args
    B = interp.batch_size
    if weight is not None and bdims[2] is not None:
        weight = to_front(weight, bdims[2])
        x = expand_front(x, bdims[0], B)
        t = expand_front(t, bdims[1], B)
        wl = weight.unsqueeze(1) if x.dim() == 3 else weight
        x = x * wl  # nll_loss(x, t, w) = nll_loss(x * w, t) up to the total weight
        w_elem_src = weight
    else:
        x = expand_front(x, bdims[0], B)
        t = expand_front(t, bdims[1], B)
        w_elem_src = None
    C = x.shape[-1]
    loss, total = aten.nll_loss_forward.default(
        x.reshape(-1, C),
        t.reshape(-1),
        weight if w_elem_src is None else None,
        _NONE,
        ignore_index,
    )
    loss = loss.reshape(t.shape)
    if reduction == _NONE:
        return (loss, total), (0, None)
    ignored = t == ignore_index
    safe_t = torch.where(ignored, 0, t)
    if w_elem_src is not None:
        w_elem = w_elem_src.gather(1, flat_batch(safe_t)).reshape(t.shape)
    elif weight is not None:
        w_elem = weight[safe_t]
    else:
        w_elem = torch.ones_like(loss)
    w_elem = torch.where(ignored, 0, w_elem).to(loss.dtype)
    total = flat_batch(w_elem).sum(1)  # flat_batch: also over an empty batch
    summed = flat_batch(loss).sum(1)
    if reduction == _SUM:
        return (summed, total), (0, 0)
    return (summed / total, total), (0, 0)


def def_softmax_backward(op):
    """(grad_output, output, dim, input_dtype): both aligned, dim shifted."""

    def softmax_backward_vmap_rule(interp, args, bdims, kwargs):
        g, y = _expanded_to_common_front(interp, args[:2], bdims[:2])
        n = g.dim() - 1
        if n == 0:
            return op(g[:, None], y[:, None], 1, *args[3:], **kwargs)[:, 0], 0
        return op(g, y, wrap_dim(args[2], n) + 1, *args[3:], **kwargs), 0

    register_vmap_rule(op)(softmax_backward_vmap_rule)


def_softmax_backward(aten._softmax_backward_data.default)
def_softmax_backward(aten._log_softmax_backward_data.default)


def def_fold_both(op):
    """``op(input [N, ...], grid [N, ...], ...)`` per sample of N (grid_sampler_3d): the batch
    dim of both folds into N."""

    def fold_both_vmap_rule(interp, args, bdims, kwargs):
        B = interp.batch_size
        x, g = expand_front(args[0], bdims[0], B), expand_front(args[1], bdims[1], B)
        out = op(x.flatten(0, 1), g.flatten(0, 1), *args[2:], **kwargs)
        return out.unflatten(0, (B, -1)), 0

    register_vmap_rule(op)(fold_both_vmap_rule)


def_fold_both(aten.grid_sampler_3d.default)


# softmax along one dim: (op, position of dim)
for _op, _pos in (
    (aten._softmax.default, 1),
    (aten._log_softmax.default, 1),
    # its own kernel, not torch's decomposition: the decomposition's where() over a row of
    # -inf gives torch's autograd nan gradients through the vmapped result
    (aten._safe_softmax.default, 1),
):
    def_dim(_op, _pos)


# -- grid sampling backward (vmap of its vjp) ----------------------------------------------
@register_vmap_rule(aten.grid_sampler_3d_backward.default)
def grid_sampler_3d_backward_vmap_rule(interp, args, bdims, kwargs):
    """(grad_output, input, grid, ...) -> (grad_input, grad_grid), all per sample of N: the
    batch dim folds into N (an unbatched input or grid is expanded, as its per-example gradient
    is per example)."""
    B = interp.batch_size
    folded = [merge_dims(expand_front(a, b, B), 0) for a, b in zip(args[:3], bdims[:3])]
    outs = aten.grid_sampler_3d_backward.default(*folded, *args[3:], **kwargs)
    outs = tuple(None if o is None else split_dim(o, 0, B) for o in outs)
    return outs, tuple(None if o is None else 0 for o in outs)


# -- F.linear_cross_entropy's chunked custom ops --------------------------------------------
# Note [Batching linear_cross_entropy]
#     torch_nn::_linear_cross_entropy_batch_chunked[_no_reduction] compute
#     cross_entropy(input @ W^T + bias, target, weight) over rows in chunks, never holding the
#     [N, C] logits (PyTorch's own rule loops over the examples). Per-row losses of examples
#     that share W, bias and the class weight are rows of one big call: the 'none' op folds the
#     batch dim into N and keeps the chunking. Otherwise (a batched W, or the mean/sum op, whose
#     reduction and precomputed gradients are per example) the rule evaluates the same formula
#     with batched matmuls, in acc_dtype: loss_n = w[t_n] (logsumexp(z_n) - z_n[t_n]), 0 where
#     t_n == ignore_index; 'mean' divides by sum_n w[t_n] (nan when 0, as the op); the gradients
#     use dL/dz_n = s_n (softmax(z_n) - onehot(t_n)) with s_n the row's weight (/ d for mean).
def _lce_rows(interp, args, bdims, acc_dtype, ignore_index):
    """Batch-front values, the logits and per-row (loss, target weight): a class-index target
    weighs its row by w[t_n] (0 where t_n == ignore_index); a probability target (torch 2.15:
    float [N, C]) gives loss_n = -sum_c w_c t_nc log_softmax(z_n)_c, weight 1."""
    B = interp.batch_size
    x, W, t, b, w = (
        None if a is None else expand_front(a, d, B) for a, d in zip(args[:5], bdims[:5])
    )
    z = torch.matmul(x.to(acc_dtype), W.to(acc_dtype).mT)
    if b is not None:
        z = z + b.to(acc_dtype).unsqueeze(-2)
    if t.is_floating_point():
        p = t.to(acc_dtype) if w is None else t.to(acc_dtype) * w.to(acc_dtype).unsqueeze(-2)
        loss = -(p * torch.log_softmax(z, -1)).sum(-1)
        return (x, W, t, b), z, torch.ones_like(loss), p, loss
    keep = t != ignore_index
    safe_t = torch.where(keep, t, 0)
    wt = keep.to(acc_dtype)
    if w is not None:
        wt = torch.where(keep, w.to(acc_dtype).gather(-1, safe_t), 0)
    z_t = z.gather(-1, safe_t.unsqueeze(-1)).squeeze(-1)
    # the row weight at the target class (scatter, not one_hot: one_hot checks the values on
    # the host, which a batched target cannot answer)
    p = torch.zeros_like(z).scatter(-1, safe_t.unsqueeze(-1), wt.unsqueeze(-1).to(z.dtype))
    return (x, W, t, b), z, wt, p, wt * (torch.logsumexp(z, -1) - z_t)


# torch defines the two ops when F.linear_cross_entropy first imports their module (~7 ms, ~750
# objects): the rules are registered by name, for when the ops exist (Registry
# .register_when_defined), so importing functransforms does not import it.
_LCE_NAMES = (
    "torch_nn::_linear_cross_entropy_batch_chunked.default",
    "torch_nn::_linear_cross_entropy_batch_chunked_no_reduction.default",
)


def _lce(i):
    """The op ``_LCE_NAMES[i]`` (defined by now: its rule is running)."""
    name = _LCE_NAMES[i].partition("::")[2].partition(".")[0]
    return getattr(torch.ops.torch_nn, name).default


def _lce_no_reduction_vmap_rule(interp, args, bdims, kwargs):
    x, W, t, b, w, ignore_index, chunk, policy, acc_dtype = args
    if bdims[1] is None and bdims[3] is None and bdims[4] is None:
        B = interp.batch_size
        xf, tf = expand_front(x, bdims[0], B), expand_front(t, bdims[2], B)
        out = _lce(1)(merge_dims(xf, 0), W, merge_dims(tf, 0), b, w, *args[5:], **kwargs)
        return split_dim(out, 0, B), 0
    vals, _, _, _, loss = _lce_rows(interp, args, bdims, acc_dtype, ignore_index)
    return loss.to(vals[0].dtype), 0


def _lce_vmap_rule(interp, args, bdims, kwargs):
    reduction, ignore_index, smoothing, acc_dtype = args[5], args[6], args[7], args[10]
    need_gx, need_gw, need_gb = args[12], args[13], args[14]
    if smoothing > 0.0 or reduction not in ("mean", "sum"):
        raise NotImplementedError(  # the op's own checks, before any work
            f"linear_cross_entropy does not support label_smoothing={smoothing} / "
            f"reduction={reduction!r} (the chunked op takes label_smoothing=0, mean or sum)"
        )
    (x, W, t, b), z, wt, p, loss = _lce_rows(interp, args, bdims, acc_dtype, ignore_index)
    B, dtype = x.shape[0], x.dtype
    total, d = loss.sum(-1), None
    if reduction == "mean":  # by the weights of the rows (N for probability targets)
        d = wt.sum(-1)
        d = torch.where(d == 0, torch.nan, d)
        total = total / d
    gx = gW = gb = None
    if need_gx or need_gw or need_gb:
        # dL/dz_n = sum_c p_nc softmax(z_n) - p_n, p_n the row's weighted one-hot/probabilities
        G = p.sum(-1, keepdim=True) * torch.softmax(z, -1) - p  # [B, N, C]
        if d is not None:
            G = G / d.unsqueeze(-1).unsqueeze(-1)
        if need_gx:
            gx = (G @ W.to(z.dtype)).to(dtype)
        if need_gw:
            gW = (G.mT @ x.to(z.dtype)).to(dtype)
        if need_gb:
            gb = G.sum(-2).to(dtype)
    empty = lambda *s: torch.empty((B, *s), dtype=dtype, device=x.device)  # noqa: E731
    outs = (
        total.to(dtype),
        empty(0, 0) if gx is None else gx,
        empty(0, 0) if gW is None else gW,
        empty(0) if gb is None else gb,
    )
    return outs, (0, 0, 0, 0)


_LCE_MODULE = "torch.nn.modules.linear_cross_entropy"
VMAP_RULES.register_when_defined(_LCE_NAMES[0], _lce_vmap_rule, _LCE_MODULE)
VMAP_RULES.register_when_defined(_LCE_NAMES[1], _lce_no_reduction_vmap_rule, _LCE_MODULE)


# Note [Batching ctc_loss]
#     torch's ctc kernels are batched over N already: the vmap batch folds into N, and the
#     problem of B examples of N sequences is one problem of B * N sequences (an unbatched
#     example, log_probs (T, C), is one sequence). Targets become the padded 2-d layout (B * N,
#     S): concatenated 1-d targets are gathered at their offsets (padded to S, the length of
#     the whole row, with no data-dependent shape). log_alpha, the forward's workspace, is padded
#     to the longest target of all B * N sequences, as torch pads it within one batch; the
#     backward reads only each sequence's own part. (A per-example loop cannot stack it: its
#     width follows each example's longest target.)
def _ctc_fold(B, args, bdims):
    """(log_probs, targets, input_lengths, target_lengths, n): folded, n = N per example (None
    for unbatched examples)."""
    lp = expand_front(args[0], bdims[0], B)  # (B, T, N, C) or (B, T, C)
    n = lp.shape[2] if lp.dim() == 4 else None
    lp = lp.movedim(0, 1)
    lp = lp.flatten(1, 2) if n is not None else lp  # (T, B * N, C)

    def lengths(v, b):
        if isinstance(v, torch.Tensor):
            return expand_front(v, b, B).reshape(-1)
        return list(v) * B

    il, tl = lengths(args[2], bdims[2]), lengths(args[3], bdims[3])
    tg = expand_front(args[1], bdims[1], B)
    if n is not None and tg.dim() == 2:  # concatenated targets of N sequences per example
        tl_t = torch.as_tensor(tl, device=tg.device).reshape(B, n)
        starts = tl_t.cumsum(1) - tl_t
        S = tg.shape[1]
        pos = (starts.unsqueeze(-1) + torch.arange(S, device=tg.device)).clamp(max=max(S - 1, 0))
        tg = tg.gather(1, pos.reshape(B, -1)).reshape(B, n, S)
    tg = tg.flatten(0, 1) if n is not None else tg  # (B * N, S)
    return lp, tg, il, tl, n


def _ctc_unfold(x, B, n):
    """A result over the B * N folded sequences, back to examples."""
    return x.unflatten(0, (B, n)) if n is not None else x


def def_ctc_loss(op):
    def ctc_loss_vmap_rule(interp, args, bdims, kwargs):
        """Note [Batching ctc_loss]"""
        B = interp.batch_size
        lp, tg, il, tl, n = _ctc_fold(B, args, bdims)
        nll, log_alpha = op(lp, tg, il, tl, *args[4:], **kwargs)
        return (_ctc_unfold(nll, B, n), _ctc_unfold(log_alpha, B, n)), (0, 0)

    register_vmap_rule(op)(ctc_loss_vmap_rule)


def def_ctc_loss_backward(op):
    def ctc_loss_backward_vmap_rule(interp, args, bdims, kwargs):
        """Note [Batching ctc_loss]: grad, nll and log_alpha fold like the sequences."""
        B = interp.batch_size
        grad, (nll, log_alpha) = args[0], args[5:7]
        lp, tg, il, tl, n = _ctc_fold(B, args[1:5], bdims[1:5])

        def fold(v, b):
            v = expand_front(v, b, B)
            return v.flatten(0, 1) if n is not None else v

        g = op(
            fold(grad, bdims[0]), lp, tg, il, tl, fold(nll, bdims[5]),
            fold(log_alpha, bdims[6]), *args[7:], **kwargs,
        )  # fmt: skip
        g = g.unflatten(1, (B, n)) if n is not None else g  # (T, B, N, C) or (T, B, C)
        return g.movedim(1, 0), 0

    register_vmap_rule(op)(ctc_loss_backward_vmap_rule)


def_ctc_loss(aten._ctc_loss.Tensor)
def_ctc_loss(aten._ctc_loss.default)
def_ctc_loss_backward(aten._ctc_loss_backward.Tensor)
def_ctc_loss_backward(aten._ctc_loss_backward.default)


@register_vmap_rule(aten._scaled_dot_product_flash_attention_for_cpu.default)
def flash_attention_for_cpu_vmap_rule(interp, args, bdims, kwargs):
    """The kernel's rows (batch N, heads H) are independent: vmap's dim folds into N
    (``[B, N, H, L, E] -> [B*N, H, L, E]``, the mask expanded to ``[B*N, H, L, S]``) and the
    outputs (``[N, H, L, E]``, logsumexp ``[N, H, L]``) unfold. torch 2.15's
    ``scaled_dot_product_attention`` reaches vmap as this op; torch's decomposition of it
    returns the attention weights where logsumexp belongs. Unwraps its own ``attn_mask=``
    (``unwraps_kwargs``). The CPU kernel has no dropout (it raises for ``dropout_p > 0``), so
    nothing is drawn."""
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    B = interp.batch_size
    q, k, v = (expand_front(a, b, B) for a, b in zip(args[:3], bdims[:3]))
    N, H, L = q.shape[1:4]
    fold = lambda t: t.reshape((B * t.shape[1],) + tuple(t.shape[2:]))  # noqa: E731
    mask = kwargs.get("attn_mask")
    if mask is not None:
        (m,), (mb,) = interp._unwrap([mask])
        m = pad_to(expand_front(m, mb, B), 4)
        kwargs = {**kwargs, "attn_mask": fold(m.expand(B, N, H, L, k.shape[3]))}
    out, lse = op(fold(q), fold(k), fold(v), *args[3:], **kwargs)
    return (out.reshape((B, N) + tuple(out.shape[1:])), lse.reshape(B, N, H, L)), (0, 0)


flash_attention_for_cpu_vmap_rule.unwraps_kwargs = True
