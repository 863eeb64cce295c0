"""Batching rules for the neural-network ops that reach the dispatcher undecomposed: losses,
layer norm, convolution, pooling and the softmax backward ops.

Note [Batching losses]
    A loss with ``reduction='mean'|'sum'`` reduces over every logical dim, so the per-example
    value is the reduction of the unreduced loss over all dims but the batch dim: the rule runs
    the op with ``reduction='none'`` on batch-aligned arguments and reduces dims ``1..``.

Note [Batching convolution]
    A batched input folds its batch dim into the conv's own batch dim (``[B, N, ...] ->
    [B * N, ...]``). A batched weight folds into the channels and multiplies ``groups`` by ``B``:
    the input's channels are repeated (or, when batched too, laid out per example) so that group
    ``b * groups + g`` of the grouped conv is group ``g`` of example ``b``.
"""

from __future__ import annotations

import torch

from ._registry import register_vmap_rule
from ._util import expand_front, pad_to, to_front, wrap_dim

aten = torch.ops.aten

_NONE, _MEAN, _SUM = 0, 1, 2


def _reduce(loss, reduction):
    """Per-example mean/sum of an unreduced loss with the batch dim in front."""
    if reduction == _NONE:
        return loss
    flat = loss.reshape(loss.shape[0], -1)
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


@register_vmap_rule(aten.native_layer_norm.default)
def native_layer_norm_vmap_rule(interp, args, bdims, kwargs):
    """Normalizes over trailing dims, so the batch dim in front changes nothing; a batched
    affine weight/bias is applied after the normalization."""
    x, shape, weight, bias, eps = args
    x = expand_front(x, bdims[0], interp.batch_size)
    wb, bb = bdims[2], bdims[3]
    if wb is None and bb is None:
        out = aten.native_layer_norm.default(x, shape, weight, bias, eps)
        return out, (0, 0, 0)
    n = x.dim() - 1
    out, mean, rstd = aten.native_layer_norm.default(x, shape, None, None, eps)
    if weight is not None:
        out = out * (weight if wb is None else pad_to(to_front(weight, wb), n))
    if bias is not None:
        out = out + (bias if bb is None else pad_to(to_front(bias, bb), n))
    return (out, mean, rstd), (0, 0, 0)


@register_vmap_rule(aten.convolution.default)
def convolution_vmap_rule(interp, args, bdims, kwargs):
    """Note [Batching convolution]."""
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = args
    xb, wb, bb = bdims[0], bdims[1], bdims[2]
    B = interp.batch_size
    conv = aten.convolution.default
    if wb is None:
        if xb is not None:
            x = to_front(x, xb)
            out = conv(
                x.flatten(0, 1),
                w,
                bias if bb is None else None,
                stride,
                padding,
                dilation,
                transposed,
                output_padding,
                groups,
            )
            out = out.unflatten(0, (B, -1))
        else:
            out = conv(x, w, None, stride, padding, dilation, transposed, output_padding, groups)
            out = out.unsqueeze(0)
        if bb is not None:
            out = out + to_front(bias, bb).reshape((B, 1, -1) + (1,) * (out.dim() - 3))
        elif xb is None and bias is not None:
            out = out + bias.reshape((-1,) + (1,) * (out.dim() - 3))
        return out, 0
    w = to_front(w, wb)
    if xb is None:
        x = x.repeat((1, B) + (1,) * (x.dim() - 2))  # [N, C, ...] -> [N, B * C, ...]
    else:
        x = to_front(x, xb)  # [B, N, C, ...] -> [N, B * C, ...]
        x = x.movedim(0, 1).flatten(1, 2)
    if bias is not None:
        bias = bias.repeat(B) if bb is None else to_front(bias, bb).flatten()
    out = conv(
        x, w.flatten(0, 1), bias, stride, padding, dilation, transposed, output_padding, groups * B
    )
    return out.unflatten(1, (B, -1)), 1


def def_pool(op, spatial):
    """Pooling over the last ``spatial`` dims of ``[N, C, *spatial]`` or ``[C, *spatial]``: the
    batch dim folds into the leading dim (every output and the indices are per plane)."""

    def pool_vmap_rule(interp, args, bdims, kwargs):
        x = to_front(args[0], bdims[0])
        fold = x.dim() - 1 == spatial + 2
        a = list(args)
        a[0] = x.flatten(0, 1) if fold else x
        out = op(*a, **kwargs)
        if isinstance(out, torch.Tensor):
            return (out.unflatten(0, (x.shape[0], -1)) if fold else out), 0
        return tuple(o.unflatten(0, (x.shape[0], -1)) if fold else o for o in out), (0,) * len(out)

    register_vmap_rule(op)(pool_vmap_rule)


for _op, _k in (
    (aten.max_pool2d_with_indices.default, 2),
    (aten.max_pool3d_with_indices.default, 3),
    (aten.avg_pool2d.default, 2),
    (aten.avg_pool3d.default, 3),
    (aten._adaptive_avg_pool2d.default, 2),
    (aten._adaptive_avg_pool3d.default, 3),
    (aten.adaptive_max_pool2d.default, 2),
    (aten.adaptive_max_pool3d.default, 3),
):
    def_pool(_op, _k)


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

