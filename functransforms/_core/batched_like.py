"""Fresh seeds and bases batched as functorch batches them (Note [Seeds batched like the output]).

Note [Seeds batched like the output]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
functorch seeds ``grad`` with ``ones_like(output)`` and builds the bases of ``jacrev`` /
``jacfwd`` with ``output.new_zeros`` / ``primal.new_zeros``. Under an enclosing vmap those are
batched whenever the output (primal) is, so the batch dim flows through the whole backward
(forward) pass and every result is a fresh batched tensor: ``vmap(grad(f, argnums=1),
in_dims=(None, 0))`` with ``f = (w * x).mean()`` returns a contiguous ``[B, n]`` gradient
(``w / n`` per example). A plain seed is the same number, but a result that never meets a
batched value stays unbatched and vmap returns it as a stride-0 expansion: other strides, and an
in-place write into it raises. So the seed and the bases are batched at the vmap levels of the
value they stand for, physically contiguous with the batch dims in front (as the batched
``new_zeros`` of functorch). Only vmap levels: a ``*_like`` of a grad/jvp-level value would be a
constant wrapper of that level (Note [Buffers held by kernels]) that every later op passes through
for nothing, and the values inside are the same.
"""

from __future__ import annotations

import sys

from functransforms._core.levels import TransformTensor


def vmap_levels(x):
    """The vmap interpreters ``x`` is batched at, innermost (highest level) first."""
    batching = sys.modules.get("functransforms.batching._tensor")
    # no vmap has run: nothing is batched (and grad alone stays lean). The class, not the
    # module: another thread's first vmap may be importing it (Note [One-time setup under one
    # lock], _core/gcpause.py), and until the class exists no value can be batched
    BatchedTensor = getattr(batching, "BatchedTensor", None)
    if BatchedTensor is None:
        return []
    levels = []
    while isinstance(x, TransformTensor):
        if isinstance(x, BatchedTensor):
            levels.append(x._interp)
            x = x._value
        else:
            inner = getattr(x, "_primal", None)  # Dual/GradTensor: the primal's batching
            if inner is None:
                break
            x = inner
    return levels


def batched_like(levels, plain):
    """``plain`` (a fresh tensor, the per-example value) batched at ``levels``
    (``vmap_levels(x)``): a contiguous physical copy with one batch dim per level in front."""
    if not levels:
        return plain
    from functransforms.batching._tensor import wrap_batched

    sizes = tuple(interp.batch_size for interp in reversed(levels))
    value = plain.expand(sizes + tuple(plain.shape)).contiguous()
    for interp in reversed(levels):  # the lowest level's dim is outermost
        value = wrap_batched(value, 0, interp)
    return value
