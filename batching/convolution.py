"""Batching rule of convolution (``aten._convolution``, reached only when called directly,
batches as ``aten.convolution``).

Note [Batching convolution]
    A batched input folds its batch dim into the conv's own batch dim (``[B, N, ...] ->
    [B * N, ...]``). A batched weight folds into the channels and multiplies ``groups`` by ``B``:
    the input's channels are repeated (or, when batched too, laid out per example) so that group
    ``b * groups + g`` of the grouped conv is group ``g`` of example ``b``.
"""

from __future__ import annotations

import torch

from ._registry import register_vmap_rule
from ._util import empty_batch, merge_dims, split_dim, to_front

aten = torch.ops.aten


@register_vmap_rule(aten.convolution.default, aten._convolution.default)
def convolution_vmap_rule(interp, args, bdims, kwargs):
    """Note [Batching convolution]."""
    if interp.batch_size == 0:  # groups * 0 is no convolution; the shapes come from one example
        return empty_batch(aten.convolution.default, args[:9], bdims[:9], {})
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = args[:9]
    xb, wb, bb = bdims[0], bdims[1], bdims[2]
    B = interp.batch_size
    conv = aten.convolution.default
    if wb is None:
        if xb is not None:
            x = to_front(x, xb)
            out = conv(
                merge_dims(x, 0),
                w,
                bias if bb is None else None,
                stride,
                padding,
                dilation,
                transposed,
                output_padding,
                groups,
            )
            out = split_dim(out, 0, B)
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
        x = merge_dims(x.movedim(0, 1), 1)
    if bias is not None:
        bias = bias.repeat(B) if bb is None else to_front(bias, bb).reshape(-1)
    out = conv(
        x, merge_dims(w, 0), bias, stride, padding, dilation, transposed, output_padding, groups * B
    )
    return split_dim(out, 1, B), 1


# Note [Batching convolution_backward]
#     ``convolution_backward(go, x, w, ...) -> (gi, gw, gb)``: each output depends on two of
#     the inputs (``gi`` on go and w, ``gw`` on go and x, ``gb`` on go; the third input only
#     gives a shape), so each is batched on its own, as in Note [Batching convolution]:
#     - ``gi`` with w unbatched: go's batch dim folds into N; with w batched, into the channels,
#       with ``groups * B`` groups (x's placeholder laid out the same way);
#     - ``gw``: go and x fold into the channels (an unbatched one is expanded) and the kernel
#       computes every example's weight cotangent as one grouped backward, ``groups * B``;
#     - ``gb``: the per-example sum of go.
#     An output whose two inputs are unbatched is computed once, unbatched.


def _select0(t, bdim):
    return t if bdim is None else t.select(bdim, 0)


def _channels_fold(t, bdim, B):
    """``[B, N, C, ...] -> [N, B * C, ...]`` (an unbatched ``t`` is expanded first)."""
    if bdim is None:
        t = t.unsqueeze(0).expand((B,) + tuple(t.shape))
    else:
        t = to_front(t, bdim)
    return merge_dims(t.movedim(0, 1), 1)


def _weight_fold(t, bdim, B):
    """``[B, O, ...] -> [B * O, ...]`` (an unbatched weight is expanded first)."""
    if bdim is None:
        t = t.unsqueeze(0).expand((B,) + tuple(t.shape))
    else:
        t = to_front(t, bdim)
    return merge_dims(t, 0)


@register_vmap_rule(aten.convolution_backward.default)
def convolution_backward_vmap_rule(interp, args, bdims, kwargs):
    """Note [Batching convolution_backward]."""
    if interp.batch_size == 0:  # as convolution_vmap_rule
        return empty_batch(aten.convolution_backward.default, args, bdims, kwargs)
    go, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask = args
    gb_, xb, wb = bdims[0], bdims[1], bdims[2]
    B = interp.batch_size
    cb = aten.convolution_backward.default
    geo = (stride, padding, dilation, transposed, output_padding)
    outs, out_bdims = [None, None, None], [None, None, None]
    if mask[0]:
        if gb_ is None and wb is None:
            outs[0] = cb(go, _select0(x, xb), w, None, *geo, groups, [True, False, False])[0]
        elif wb is None:
            g = merge_dims(to_front(go, gb_), 0)
            xs = _select0(x, xb)
            xs = xs.new_empty((g.shape[0],) + tuple(xs.shape[1:]))
            gi = cb(g, xs, w, None, *geo, groups, [True, False, False])[0]
            outs[0], out_bdims[0] = split_dim(gi, 0, B), 0
        else:
            g = _channels_fold(go, gb_, B)
            ws = _weight_fold(w, wb, B)
            xs = _select0(x, xb)
            xs = xs.new_empty((xs.shape[0], B * xs.shape[1]) + tuple(xs.shape[2:]))
            gi = cb(g, xs, ws, None, *geo, groups * B, [True, False, False])[0]
            outs[0], out_bdims[0] = split_dim(gi, 1, B), 1
    if mask[1]:
        if gb_ is None and xb is None:
            outs[1] = cb(go, x, _select0(w, wb), None, *geo, groups, [False, True, False])[1]
        else:
            g = _channels_fold(go, gb_, B)
            xs = _channels_fold(x, xb, B)
            ws = _select0(w, wb)
            ws = ws.new_empty((B * ws.shape[0],) + tuple(ws.shape[1:]))
            gw = cb(g, xs, ws, None, *geo, groups * B, [False, True, False])[1]
            outs[1], out_bdims[1] = split_dim(gw, 0, B), 0
    if mask[2]:
        if gb_ is None:
            outs[2] = go.sum([0] + list(range(2, go.dim())))
        else:
            g = to_front(go, gb_)
            outs[2], out_bdims[2] = g.sum([1] + list(range(3, g.dim()))), 0
    return tuple(outs), tuple(out_bdims)
