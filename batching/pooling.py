"""Batching rules of pooling: the batch dim folds into the op's leading dim, since every
output (and the indices) is computed per plane."""

from __future__ import annotations

import torch

from ._registry import register_vmap_rule
from ._util import expand_front, merge_dims, split_dim, to_front

aten = torch.ops.aten


def def_pool(op, spatial):
    """Pooling over the last ``spatial`` dims of ``[N, C, *spatial]`` or ``[C, *spatial]``: the
    batch dim folds into the leading dim (every output and the indices are per plane)."""

    def pool_vmap_rule(interp, args, bdims, kwargs):
        x = to_front(args[0], bdims[0])
        fold = x.dim() - 1 == spatial + 2
        a = list(args)
        a[0] = merge_dims(x, 0) if fold else x
        out = op(*a, **kwargs)
        if isinstance(out, torch.Tensor):
            return (split_dim(out, 0, x.shape[0], x.shape[1]) if fold else out), 0
        outs = tuple(split_dim(o, 0, x.shape[0], x.shape[1]) if fold else o for o in out)
        return outs, (0,) * len(out)

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


def _fold(x, bdim, batch_size, spatial):
    """``x`` (batched or not) as the op's input with the batch dim folded into the leading dim:
    ``(value, n)``; ``n`` is the per-example leading N dim when the logical value has one (the
    size split_dim needs for an empty batch), else None (nothing folded)."""
    x = expand_front(x, bdim, batch_size)
    fold = x.dim() - 1 == spatial + 2
    return (merge_dims(x, 0), x.shape[1]) if fold else (x, None)


def def_pool_backward(op, spatial):
    """``op(grad_output, self, ...)``: both fold (``self`` gives only the input's shape)."""

    def pool_backward_vmap_rule(interp, args, bdims, kwargs):
        B = interp.batch_size
        go, n = _fold(args[0], bdims[0], B, spatial)
        x, _ = _fold(args[1], bdims[1], B, spatial)
        out = op(go, x, *args[2:], **kwargs)
        return (out if n is None else split_dim(out, 0, B, n)), 0

    register_vmap_rule(op)(pool_backward_vmap_rule)


for _op, _k in (
    (aten.avg_pool2d_backward.default, 2),
    (aten.avg_pool3d_backward.default, 3),
    (aten._adaptive_avg_pool2d_backward.default, 2),
    (aten._adaptive_avg_pool3d_backward.default, 3),
):
    def_pool_backward(_op, _k)


def def_max_pool_backward(op, spatial):
    """``op(grad_output, self, ..., indices)``: the three tensors fold (planes are independent
    and the indices are flat within each plane). The indices are made contiguous: unbatched
    ones are expanded, and adaptive_max_pool3d_backward reads expanded (stride-0) indices
    out of bounds (a segfault, torch 2.13)."""

    def max_pool_backward_vmap_rule(interp, args, bdims, kwargs):
        B = interp.batch_size
        go, n = _fold(args[0], bdims[0], B, spatial)
        x, _ = _fold(args[1], bdims[1], B, spatial)
        idx, _ = _fold(args[-1], bdims[-1], B, spatial)
        out = op(go, x, *args[2:-1], idx.contiguous(), **kwargs)
        return (out if n is None else split_dim(out, 0, B, n)), 0

    register_vmap_rule(op)(max_pool_backward_vmap_rule)


for _op, _k in (
    (aten.max_pool2d_with_indices_backward.default, 2),
    (aten.max_pool3d_with_indices_backward.default, 3),
    (aten.adaptive_max_pool2d_backward.default, 2),
    (aten.adaptive_max_pool3d_backward.default, 3),
):
    def_max_pool_backward(_op, _k)


def def_fractional_max_pool(op, spatial):
    """``op(x, kernel_size, output_size, random_samples)``: the samples (``[N, C, spatial]``)
    fold like the input; unbatched samples are shared by every example. The kernel reads the
    first N rows of the samples only (row 0 for an input without N, as ``nn.FractionalMaxPool``
    given ``_random_samples`` of a batch calls it), so each example keeps its first N rows."""

    def fractional_max_pool_vmap_rule(interp, args, bdims, kwargs):
        B = interp.batch_size
        x, n = _fold(args[0], bdims[0], B, spatial)
        s = expand_front(args[3], bdims[3], B)  # [B, N', C, spatial]: the rows the kernel reads
        s = s[:, : (1 if n is None else n)].reshape((x.shape[0],) + tuple(s.shape[-2:]))
        out, idx = op(x, args[1], args[2], s, **kwargs)
        if n is not None:
            out, idx = split_dim(out, 0, B, n), split_dim(idx, 0, B, n)
        return (out, idx), (0, 0)

    register_vmap_rule(op)(fractional_max_pool_vmap_rule)


def_fractional_max_pool(aten.fractional_max_pool2d.default, 2)
def_fractional_max_pool(aten.fractional_max_pool3d.default, 3)


# upsampling with antialiasing works plane by plane on [N, C, H, W], like pooling
def_pool(aten._upsample_bilinear2d_aa.default, 2)
def_pool(aten._upsample_bicubic2d_aa.default, 2)


# -- antialiased upsampling backward ops (vmap of their vjp) ---------------------------------
def def_sized_backward(op):
    """``op(grad_output [N, C, ...], output_size, input_size [N, C, ...], ...)``: planes are
    independent, so the batch dim folds into N and into ``input_size``."""

    def sized_backward_vmap_rule(interp, args, bdims, kwargs):
        B = interp.batch_size
        g = to_front(args[0], bdims[0])
        a = list(args)
        a[0] = merge_dims(g, 0)
        a[2] = [B * args[2][0], *args[2][1:]]
        return split_dim(op(*a, **kwargs), 0, B), 0

    register_vmap_rule(op)(sized_backward_vmap_rule)


def_sized_backward(aten._upsample_bilinear2d_aa_backward.default)
def_sized_backward(aten._upsample_bicubic2d_aa_backward.default)
