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

from functransforms._core.ops import facts
from functransforms.errors import raise_data_dependent

from ._fastpath import ELEMENTWISE_RULES
from ._registry import VMAP_RULES, register_vmap_rule
from ._util import expand_front, in_format, pad_to, promote_like_logical, to_front

aten = torch.ops.aten


# Pointwise kernels that do not broadcast their tensor arguments: CPU gelu_backward goes to
# oneDNN, which raises for shapes [3] and [4, 3] and crashes the process when the [3] is an
# expanded (stride-0) gradient, the shape vmap(grad(gelu)) hands it; _standard_gamma_grad
# resizes its output to its first argument's shape (with a deprecation warning). They get the
# arguments expanded (views, no copy) to the common shape.
_NO_BROADCAST = {aten.gelu_backward.default, aten._standard_gamma_grad.default}


def _expand_tensors(args):
    shape = torch.broadcast_shapes(*(a.shape for a in args if isinstance(a, torch.Tensor)))
    return [a.expand(shape) if isinstance(a, torch.Tensor) else a for a in args]


def make_pointwise_rule(func):
    """The rule of Note [Batching pointwise ops] for ``func``, returned unregistered: the
    interpreter builds it on first use for every op tagged ``torch.Tag.pointwise``
    (``_derived_rule`` in _tensor.py), which spares cold start a scan of all ops."""
    n_out = len(func._schema.returns)  # frexp returns (mantissa, exponent): one bdim each
    no_broadcast = func in _NO_BROADCAST

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
        if no_broadcast:
            new = _expand_tensors(new)
        return func(*new, **kwargs), out_bdims(0)

    if n_out == 1 and not func._schema.is_mutable:
        ELEMENTWISE_RULES.add(pointwise_vmap_rule)  # Note [Pointwise ops reaching the interpreter]
    return pointwise_vmap_rule


@VMAP_RULES.derive_with
def pointwise_by_tag(func):
    """Every op tagged ``torch.Tag.pointwise`` (and not random) without a rule of its own shares
    one rule (Note [Batching pointwise ops]): new pointwise ops of a future torch batch without
    code changes. Built on first use; the op's record caches it."""
    if torch.Tag.pointwise in func.tags and not facts(func).random:
        return make_pointwise_rule(func)
    return None


def def_same_bdim(op):
    """Ops of one tensor argument that act per element or on metadata only: the output keeps
    the input's batch dim."""

    def same_bdim_vmap_rule(interp, args, bdims, kwargs):
        return op(*args, **kwargs), bdims[0]

    register_vmap_rule(op)(same_bdim_vmap_rule)


def def_pointwise(op):
    """A pointwise op torch does not tag ``pointwise``: the shared rule of Note [Batching
    pointwise ops], registered by name."""
    register_vmap_rule(op)(make_pointwise_rule(op))


def def_like(op):
    """A ``*_like`` factory: the input's batch dim, and its ``memory_format`` per example."""

    def like_vmap_rule(interp, args, bdims, kwargs):
        return in_format(op, args, bdims, kwargs)

    register_vmap_rule(op)(like_vmap_rule)


for _op in (
    aten.empty_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
):
    def_like(_op)


@register_vmap_rule(aten.detach.default)
def detach_vmap_rule(interp, args, bdims, kwargs):
    """detach shares memory but is not a view in torch (``x.detach()._base is None``): marked,
    so that vmap's output is not rebuilt as a view of the input (Note [Views of vmap's
    inputs], functransforms/_vmap.py)."""
    out = aten.detach.default(args[0])
    out._ft_detached = True
    return out, bdims[0]


def def_data_dependent(func):
    """``.item()``, ``bool(x)``, ``torch.equal``: one Python answer per example is impossible."""

    def data_dependent_vmap_rule(interp, args, bdims, kwargs):
        raise_data_dependent(interp, func)

    register_vmap_rule(func)(data_dependent_vmap_rule)


for _op in (aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default):
    def_data_dependent(_op)


def def_fill(func):
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
    def_fill(_op)


for _op in (
    aten.to.dtype,
    aten.to.device,
    aten.to.dtype_layout,
):
    def_same_bdim(_op)

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
    def_pointwise(_op)

# Pointwise kernels without the tag whose decompositions an outer jvp would differentiate in
# place of the kernel's own rule (autodiff/elementwise.py): at their kinks the decompositions'
# masks differ from torch's formulas (jacfwd(jacrev) of elu at 0 gave 1, torch 0.5; of
# prelu at 0 the other one-sided slope). Batched as pointwise, the kernel reaches the outer
# level whole. (prelu's weight arrives broadcastable, right-aligned, from aten.prelu.)
for _op in (
    aten.elu_backward.default,
    aten.softplus_backward.default,
    aten.hardsigmoid_backward.default,
    aten.hardswish.default,
    aten.hardswish_backward.default,
    aten._prelu_kernel.default,
    aten._prelu_kernel_backward.default,
    aten._standard_gamma_grad.default,  # Gamma.rsample's derivative, per-sample under vmap
):
    def_pointwise(_op)


@register_vmap_rule(aten.log_sigmoid_forward.default)
def log_sigmoid_forward_vmap_rule(interp, args, bdims, kwargs):
    """log_sigmoid_forward(x) -> (out, buffer), pointwise but untagged: its decomposition
    min(x, 0) - log1p(exp(-|x|)) reached an outer level in place of the op's rule (hessian of
    a vmapped F.logsigmoid at 0: |x|'s 0, not -1/4). The CUDA kernel's buffer is empty."""
    out, buffer = aten.log_sigmoid_forward.default(args[0], **kwargs)
    return (out, buffer), (bdims[0], bdims[0] if buffer.numel() else None)


@register_vmap_rule(aten.log_sigmoid_backward.default)
def log_sigmoid_backward_vmap_rule(interp, args, bdims, kwargs):
    """log_sigmoid_backward(g, x, buffer) carries no pointwise tag, and torch's decomposition
    reads exp(-|x|) from ``buffer``, which an outer jvp holds constant (log_sigmoid_forward's
    buffer has no tangent): jacfwd(jacrev) of F.logsigmoid or of
    binary_cross_entropy_with_logits gave a zero hessian. The kernel itself runs on operands
    of one physical shape (its output takes g's shape; an empty CUDA buffer stays empty)."""
    B = interp.batch_size
    new = [
        a if not isinstance(a, torch.Tensor) or a.numel() == 0 else expand_front(a, b, B)
        for a, b in zip(args, bdims)
    ]
    return aten.log_sigmoid_backward.default(*new, **kwargs), 0


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


def def_prims_elementwise(func):
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
    def_prims_elementwise(getattr(torch.ops.prims, _name).default)


def def_new_factory(func):
    """x.new_zeros(size) and friends on a batched x: a batched result, one buffer per example,
    as PyTorch makes it (code writes per-example values into it, or draws into it under
    randomness='different')."""

    def new_factory_vmap_rule(interp, args, bdims, kwargs):
        a = list(args)
        size = [int(s) for s in a[1]]
        a[1] = [interp.batch_size, *size]
        if func is aten.new_empty_strided.default:
            span = 1 + sum((s - 1) * st for s, st in zip(size, a[2])) if all(size) else 1
            a[2] = [span, *a[2]]
        return func(*a, **kwargs), 0

    register_vmap_rule(func)(new_factory_vmap_rule)


for _op in (
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
    aten.new_empty.default,  # torch's circular pad fills x.new_empty slice by slice
    aten.new_empty_strided.default,
):
    def_new_factory(_op)
