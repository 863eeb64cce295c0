"""Batching rules of the normalization kernels: layer, group and batch norm.

Note [Batching batch norm]
    Batch norm normalizes each channel over the examples' own batch, so the vmap batch dim folds
    into the *channels* (``[B, N, C, ...] -> [N, B * C, ...]``): channel ``b * C + c`` is channel
    ``c`` of example ``b``, with its own statistics. Weight, bias and running statistics fold the
    same way (an unbatched one is repeated). In training mode torch's kernel updates the running
    statistics in place, so batched buffers are passed as views of their physical storage (or
    written back); unbatched running statistics in training mode would receive every example's
    update at once, so that raises InplaceError, as PyTorch does.
"""

from __future__ import annotations

import torch

from functransforms.errors import raise_batch_norm_stats_unbatched

from ._registry import WRITES_CHECKED_BY_RULE, register_vmap_rule
from ._util import expand_front, pad_to, to_front

aten = torch.ops.aten


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


@register_vmap_rule(aten.native_group_norm.default)
def native_group_norm_vmap_rule(interp, args, bdims, kwargs):
    """The batch dim folds into N (groups are per example); a batched affine weight/bias is
    applied after the normalization. The kernel wants a contiguous input."""
    x, weight, bias, N, C, HxW, group, eps = args
    B = interp.batch_size
    x = expand_front(x, bdims[0], B)
    xf = x.reshape((B * N,) + tuple(x.shape[2:])).contiguous()
    wb, bb = bdims[1], bdims[2]
    gn = aten.native_group_norm.default
    if wb is None and bb is None:
        out, mean, rstd = gn(xf, weight, bias, B * N, C, HxW, group, eps)
    else:
        out, mean, rstd = gn(xf, None, None, B * N, C, HxW, group, eps)
        shape = (B, 1, C) + (1,) * (x.dim() - 3)
        if weight is not None:
            w = weight.reshape(shape[2:]) if wb is None else to_front(weight, wb).reshape(shape)
            out = out.reshape(x.shape) * w
        if bias is not None:
            b = bias.reshape(shape[2:]) if bb is None else to_front(bias, bb).reshape(shape)
            out = out.reshape(x.shape) + b
    stats = (B, N, group)  # not -1: ambiguous over an empty batch
    return (out.reshape(x.shape), mean.reshape(stats), rstd.reshape(stats)), (0, 0, 0)


def _fold_channels(t, bdim, B):
    """A per-channel vector ``[C]`` as ``[B * C]`` (Note [Batching batch norm])."""
    if t is None:
        return None
    return t.repeat(B) if bdim is None else to_front(t, bdim).reshape(-1)


def def_batch_norm(op, stats_pos, training_pos):
    """``op(x, weight, bias, [running_mean, running_var,] [training,] momentum, eps)``:
    Note [Batching batch norm]. ``stats_pos``: where the running statistics are (None: no
    such arguments); ``training_pos``: where ``training`` is (None: always eval mode)."""

    def batch_norm_vmap_rule(interp, args, bdims, kwargs):
        B = interp.batch_size
        a = list(args)
        training = (
            True
            if training_pos is None and stats_pos is None
            else (False if training_pos is None else a[training_pos])
        )
        x = expand_front(a[0], bdims[0], B)  # [B, N, C, ...]
        N, C = x.shape[1], x.shape[2]
        a[0] = x.movedim(0, 1).reshape((N, B * C) + tuple(x.shape[3:]))
        a[1] = _fold_channels(a[1], bdims[1], B)
        a[2] = _fold_channels(a[2], bdims[2], B)
        write_back = []
        if stats_pos is not None:
            for i in stats_pos:
                s = a[i]
                if s is None:
                    continue
                if bdims[i] is None:
                    if training:
                        name = "running_mean" if i == stats_pos[0] else "running_var"
                        raise_batch_norm_stats_unbatched(name)
                    a[i] = s.repeat(B)
                    continue
                f = to_front(s, bdims[i])
                if f.is_contiguous():
                    a[i] = f.view(-1)
                else:
                    a[i] = f.reshape(-1).clone()
                    write_back.append((f, a[i]))
        out, mean, rstd = op(*a, **kwargs)
        for f, flat in write_back:
            f.copy_(flat.view(f.shape))
        out = out.reshape((N, B, C) + tuple(x.shape[3:]))
        if mean.numel() == 0:  # eval mode: torch returns empty statistics
            return (out, mean, rstd), (1, None, None)
        return (out, mean.reshape(B, C), rstd.reshape(B, C)), (1, 0, 0)

    register_vmap_rule(op)(batch_norm_vmap_rule)
    WRITES_CHECKED_BY_RULE.add(op)  # running stats: written in training mode only (above)


def_batch_norm(aten.native_batch_norm.default, (3, 4), 5)
def_batch_norm(aten._native_batch_norm_legit.default, (3, 4), 5)
def_batch_norm(aten._native_batch_norm_legit.no_stats, None, 3)
def_batch_norm(aten._native_batch_norm_legit_no_training.default, (3, 4), None)
