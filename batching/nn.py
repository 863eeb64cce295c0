"""Batching rules for the neural-network ops that reach the dispatcher undecomposed: losses,
and the softmax backward ops (convolution, pooling and normalization: files of those names).

Note [Batching losses]
    A loss with ``reduction='mean'|'sum'`` reduces over every logical dim, so the per-example
    value is the reduction of the unreduced loss over all dims but the batch dim: the rule runs
    the op with ``reduction='none'`` on batch-aligned arguments and reduces dims ``1..``.
"""

from __future__ import annotations

import torch

from ._registry import register_vmap_rule
from ._util import expand_front, flat_batch, pad_to, to_front, wrap_dim
from .pooling import def_pool

aten = torch.ops.aten

_NONE, _MEAN, _SUM = 0, 1, 2


def _reduce(loss, reduction):
    """Per-example mean/sum of an unreduced loss with the batch dim in front."""
    if reduction == _NONE:
        return loss
    flat = flat_batch(loss)
    return flat.mean(1) if reduction == _MEAN else flat.sum(1)


def _broadcast_front(interp, tensors, bdims):
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
        fronted = _broadcast_front(
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
        w_elem = w_elem_src.gather(1, safe_t.reshape(B, -1)).reshape(t.shape)
    elif weight is not None:
        w_elem = weight[safe_t]
    else:
        w_elem = torch.ones_like(loss)
    w_elem = torch.where(ignored, 0, w_elem).to(loss.dtype)
    total = w_elem.reshape(B, -1).sum(1)
    summed = loss.reshape(B, -1).sum(1)
    if reduction == _SUM:
        return (summed, total), (0, 0)
    return (summed / total, total), (0, 0)


def _softmax_backward(op):
    """(grad_output, output, dim, input_dtype): both aligned, dim shifted."""

    def softmax_backward_vmap_rule(interp, args, bdims, kwargs):
        g, y = _broadcast_front(interp, args[:2], bdims[:2])
        n = g.dim() - 1
        if n == 0:
            return op(g[:, None], y[:, None], 1, *args[3:], **kwargs)[:, 0], 0
        return op(g, y, wrap_dim(args[2], n) + 1, *args[3:], **kwargs), 0

    register_vmap_rule(op)(softmax_backward_vmap_rule)


_softmax_backward(aten._softmax_backward_data.default)
_softmax_backward(aten._log_softmax_backward_data.default)


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
# upsampling with antialiasing works plane by plane on [N, C, H, W], like pooling
def_pool(aten._upsample_bilinear2d_aa.default, 2)
def_pool(aten._upsample_bicubic2d_aa.default, 2)


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
