"""Batching rules for pointwise ops (every op tagged ``torch.Tag.pointwise`` uses one rule).

Note [Batching pointwise ops]
    A pointwise op broadcasts its tensor arguments. With one batched argument and no other tensor
    argument the batch dim can stay where it is. Otherwise every batched argument gets its batch
    dim moved to the front and size-1 dims inserted after it up to the largest logical rank, so
    right-aligned broadcasting lines up logical dims with logical dims and the batch dim with
    the batch dim (unbatched arguments broadcast over it).
"""

from __future__ import annotations

import torch

from ._registry import register_vmap_rule
from ._tensor import raise_data_dependent
from ._util import expand_front, pad_to, promote_like_logical, to_front

aten = torch.ops.aten


def make_pointwise_rule(func):
    n_out = len(func._schema.returns)  # frexp returns (mantissa, exponent): one bdim each

    def out_bdims(b):
        return b if n_out == 1 else (b,) * n_out

    def pointwise_vmap_rule(interp, args, bdims, kwargs):
        n_tensors = 0
        nd = 0
        for a, b in zip(args, bdims):
            if isinstance(a, torch.Tensor):
                n_tensors += 1
                d = a.dim() - (b is not None)
                if d > nd:
                    nd = d
        if n_tensors == 1:  # fast path: the batch dim stays where it is
            return func(*args, **kwargs), out_bdims(next(b for b in bdims if b is not None))
        new = promote_like_logical(args, bdims)
        for i, b in enumerate(bdims):
            if b is not None:
                new[i] = pad_to(to_front(new[i], b), nd)
        return func(*new, **kwargs), out_bdims(0)

    return pointwise_vmap_rule


def _same_bdim_rule(func):
    """Ops of one tensor argument that act per element or on metadata only."""

    def same_bdim_vmap_rule(interp, args, bdims, kwargs):
        return func(*args, **kwargs), bdims[0]

    return same_bdim_vmap_rule


for _op in (
    aten.alias.default,
    aten._to_copy.default,
    aten.lift_fresh.default,
    aten.empty_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.resolve_conj.default,
    aten.resolve_neg.default,
    aten._conj.default,
    aten.view_as_real.default,
    aten.view_as_complex.default,
):
    register_vmap_rule(_op)(_same_bdim_rule(_op))


@register_vmap_rule(aten.detach.default)
def detach_vmap_rule(interp, args, bdims, kwargs):
    """detach shares memory but is not a view in torch (``x.detach()._base is None``): marked,
    so that vmap's output is not rebuilt as a view of the input (Note [Views of vmap's
    inputs], functransforms/_vmap.py)."""
    out = aten.detach.default(args[0])
    out._ft_detached = True
    return out, bdims[0]


@register_vmap_rule(aten.copy.default)
def copy_vmap_rule(interp, args, bdims, kwargs):
    """copy(self, src): src broadcast to self's shape, in self's dtype (functional copy_)."""
    self_, src = args[0], args[1]
    n = max(self_.dim() - (bdims[0] is not None), src.dim() - (bdims[1] is not None))
    dst = pad_to(expand_front(self_, bdims[0], interp.batch_size), n)
    s = src if bdims[1] is None else pad_to(to_front(src, bdims[1]), n)
    return aten.copy.default(dst, s, *args[2:], **kwargs), 0


@register_vmap_rule(aten.copy_.default)
def copy__vmap_rule(interp, args, bdims, kwargs):
    """copy_(self, src): broadcast src into the (batched) self."""
    self_, src = args[0], args[1]
    sb = bdims[1]
    dst = to_front(self_, bdims[0])
    dst.copy_(src if sb is None else pad_to(to_front(src, sb), dst.dim() - 1), *args[2:])
    return self_, bdims[0]


def _data_dependent(func):
    """``.item()``, ``bool(x)``, ``torch.equal``: one Python answer per example is impossible."""

    def data_dependent_vmap_rule(interp, args, bdims, kwargs):
        raise_data_dependent(interp, func)

    register_vmap_rule(func)(data_dependent_vmap_rule)


for _op in (aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default):
    _data_dependent(_op)


def _fill(func):
    """fill(self, value) / fill_ / zero_: a batched 0-d ``value`` fills each example's slice."""
    inplace = func._schema.name.endswith("_")

    def fill_vmap_rule(interp, args, bdims, kwargs):
        x = args[0]
        B = interp.batch_size
        if len(args) > 1 and isinstance(args[1], torch.Tensor) and bdims[1] is not None:
            xf = to_front(x, bdims[0]) if inplace else expand_front(x, bdims[0], B)
            v = to_front(args[1], bdims[1]).reshape((B,) + (1,) * (xf.dim() - 1))
            if inplace:
                xf.copy_(v.expand(xf.shape))
                return x, bdims[0]
            return v.to(x.dtype).expand(xf.shape).clone(), 0
        out = func(*args, **kwargs)
        return (x if inplace else out), bdims[0]

    register_vmap_rule(func)(fill_vmap_rule)


for _op in (
    aten.fill.Scalar,
    aten.fill.Tensor,
    aten.fill_.Scalar,
    aten.fill_.Tensor,
    aten.zero_.default,
):
    _fill(_op)


for _op in (
    aten.to.dtype,
    aten.to.device,
    aten.to.dtype_layout,
):
    register_vmap_rule(_op)(_same_bdim_rule(_op))

# pointwise ops that reach the dispatcher without the pointwise tag: dunder spellings, and
# polar/complex (their decompositions write into a fresh, unbatched result in place)
for _op in (
    aten.polar.default,
    aten.complex.default,
    aten.__and__.Tensor,
    aten.__or__.Tensor,
    aten.__xor__.Tensor,
    aten.__and__.Scalar,
    aten.__or__.Scalar,
    aten.__xor__.Scalar,
):
    register_vmap_rule(_op)(make_pointwise_rule(_op))


@register_vmap_rule(aten.broadcast_tensors.default)
def broadcast_tensors_vmap_rule(interp, args, bdims, kwargs):
    tensors, bds = args[0], bdims[0]
    shapes = [
        t.shape[:b] + t.shape[b + 1 :] if b is not None else t.shape for t, b in zip(tensors, bds)
    ]
    shape = tuple(torch.broadcast_shapes(*shapes))
    outs = [
        t.expand(shape)
        if b is None
        else pad_to(to_front(t, b), len(shape)).expand((t.shape[b], *shape))
        for t, b in zip(tensors, bds)
    ]
    return tuple(outs), tuple(None if b is None else 0 for b in bds)


def _prims_elementwise(func):
    """Elementwise prims (what torch._refs decompositions emit) want operands of one shape:
    every tensor gets the batch dim in front and is expanded to ``[B, *logical shape]``."""

    def prims_elementwise_vmap_rule(interp, args, bdims, kwargs):
        B = interp.batch_size
        shapes = [
            a.shape[:b] + a.shape[b + 1 :] if b is not None else a.shape
            for a, b in zip(args, bdims)
            if isinstance(a, torch.Tensor)
        ]
        full = (B, *torch.broadcast_shapes(*shapes))
        new = [
            pad_to(expand_front(a, b, B), len(full) - 1).expand(full)
            if isinstance(a, torch.Tensor)
            else a
            for a, b in zip(args, bdims)
        ]
        return func(*new, **kwargs), 0

    register_vmap_rule(func)(prims_elementwise_vmap_rule)


for _name in (
    "add atan2 bitwise_and bitwise_or bitwise_xor div eq fmax fmin fmod gcd ge gt hypot igamma "
    "igammac le lt maximum minimum mul ne nextafter pow remainder shift_left "
    "shift_right_arithmetic sub zeta where"
).split():
    _prims_elementwise(getattr(torch.ops.prims, _name).default)
