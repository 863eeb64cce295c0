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
from ._util import to_front

aten = torch.ops.aten


@register_vmap_rule(aten.convolution.default, aten._convolution.default)
def convolution_vmap_rule(interp, args, bdims, kwargs):
    """Note [Batching convolution]."""
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = args[:9]
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
