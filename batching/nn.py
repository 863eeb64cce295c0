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
