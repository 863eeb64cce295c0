"""Named axes and collectives: ``psum``, ``pmean``, ``all_gather``, ``axis_index``, ...

Inside ``vmap(f, axis_name="i")`` the function ``f`` sees one example; a collective names the
axis ``"i"`` and combines the values of *all* examples along it (JAX's semantics and names).
How the ops reach the interpreters: Note [Collectives are ops] in ``_collective_ops.py``.

Derivatives are those of the same function written with explicit reductions over the batch
(``psum``'s transpose is ``psum``, ``all_gather``'s is ``psum_scatter``, ``ppermute``'s the
inverse permutation; ``pmax``/``pmin`` get the ordinary max/min derivative, ties sharing it).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from .. import _pytree as pt
from .._compat import len_torch_dispatch_stack as _modes
from .._compat import tensor_requires_grad as _requires_grad
from .._core.levels import (
    _ADINPLACE,
    TransformTensor,
    _excluded,
    _state,
    below_torch_autograd,
    interpreter_stack,
)
from .._typing import PyTree
from ..errors import UnboundAxisError
from . import _collective_ops as ops

# an axis name, or a tuple of them (combined as one axis, the first name major)
AxisName = Hashable

__all__ = [
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
]


# -- resolving names ---------------------------------------------------------------------------
def _names(axis_name):
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def binding(name, call):
    """The innermost active interpreter whose mapped axis is called ``name``. ``call`` names
    the call in errors: a string, or a function making it (built only to raise)."""
    for interp in reversed(interpreter_stack()):
        if getattr(interp, "axis_name", None) == name:
            if getattr(interp, "chunked", False):
                call = call() if callable(call) else call
                raise ValueError(
                    f"{call}: the axis {name!r} is mapped with vmap(..., chunk_size=...), so each "
                    "chunk sees only part of it and a collective over it would be wrong. Do: "
                    "drop chunk_size (or make it at least the axis size) when f uses collectives."
                )
            return interp
    bound = [i.axis_name for i in interpreter_stack() if getattr(i, "axis_name", None) is not None]
    call = call() if callable(call) else call
    raise UnboundAxisError(
        f"{call}: unbound axis name {name!r}. Expected the name of an enclosing "
        f"vmap(..., axis_name=...) or pmap(..., axis_name=...); the axes bound here are "
        f"{bound or 'none'}. Do: call it inside vmap(f, axis_name={name!r})."
    )


def by_level(level):
    """The active interpreter of ``level`` (the ``axis`` argument of a collective op)."""
    for interp in interpreter_stack():
        if interp.level == level:
            return interp
    raise RuntimeError(f"functransforms: no active transform at level {level} (internal error)")


def size_of(interp):
    """The size of the axis ``interp`` binds: its examples, times the processes under pmap."""
    return interp.batch_size * getattr(interp, "world", 1)


# -- lifting an operand to the binding level ---------------------------------------------------
def _batched_at(x, interp):
    t = x
    while isinstance(t, TransformTensor):
        if t._interp is interp:
            return True
        if t._interp.level < interp.level:
            return False
        t = t._value if hasattr(t, "_value") else t._primal
    return False


def lift(x, interp):
    """``x`` as a value batched at ``interp``'s level (the same for every example if it was not):
    the binding vmap then processes the collective even when ``x`` does not vary along it."""
    from functransforms.batching._tensor import wrap_batched

    if _batched_at(x, interp):
        return x
    shape = (interp.batch_size,) + tuple(x.shape)
    top = x._interp.level if isinstance(x, TransformTensor) else -1
    if top < interp.level:  # only outer levels wrap x: wrap a broadcast view of it
        return wrap_batched(x.unsqueeze(0).expand(shape), 0, interp)
    zeros = torch.zeros((), dtype=x.dtype, device=x.device).expand(shape)
    return x + wrap_batched(zeros, 0, interp)  # inner levels wrap x: they must see the add


# Note [Collectives skip the dispatcher]
#     A collective is an op so that every interpreter handles it through its registry (Note
#     [Collectives are ops]); the dispatcher's only job is then to route it to the interpreter
#     of the innermost wrapper among its arguments. When the operand is already a wrapper of the
#     binding vmap (the common case: a per-example value), that interpreter is known here, and
#     the round trip through the C++ dispatcher, the Python dispatch key and the routing costs
#     more than the reduction on a small batch (two thirds of a vmapped psum: 23 -> 7 us a call,
#     bench_distributed.py, now less than a vmapped ``sum(0)``). So ``bind`` calls the
#     interpreter's ``process`` itself: the same method, rule and wrapping the dispatcher would
#     reach. It keeps the dispatcher when something else may need to see the op: a dispatch
#     mode is active (a user's mode, the determinism checker, randomness='different'), or we
#     run below torch's autograd (inside a rule) where ``__torch_dispatch__`` would re-enable
#     it (Note [Torch autograd through our transforms], functransforms/_core/levels.py). A value of
#     another level (a grad inside the vmap, a vmap inside it) or one not varying along the
#     axis takes the dispatcher too: the levels in between must see the op.
def bind(op, x, level, *params):
    """Apply collective ``op`` over the axis of ``level`` (used by the public functions and by
    the derivative rules, which rebind collectives on tangents and cotangents)."""
    return _bind(op, x, by_level(level), params)


def _bind(op, x, interp, params):
    if getattr(interp, "direct", False):  # Note [pmap without a level for its shard]
        return _direct(op, x, interp, params)
    if _routes_to(interp, (x,)):  # Note [Collectives skip the dispatcher]
        return interp.process(op, (x, interp.level, *params), {})
    return op(lift(x, interp), interp.level, *params)


def _routes_to(interp, values):
    """Whether the dispatcher would hand an op on ``values`` straight to ``interp`` with nothing
    else to see it (Note [Collectives skip the dispatcher])."""
    for v in values:
        if not isinstance(v, TransformTensor) or v._interp is not interp:
            return False
    return not _modes() and not below_torch_autograd()


# Note [pmap without a level for its shard]
#     pmap runs ``f`` as a vmap over this process's ``k`` examples (Note [pmap is vmap over
#     this process's shard], functransforms/distributed/_pmap.py). In JAX's layout,
#     ``pmap(vmap(f))``, each
#     process holds one example (``k = 1``), and a level of size 1 only costs: every op of ``f``
#     passes through one more wrapper and interpreter (2-30% of a DP-SGD step's CPU time, the
#     most at 4 processes: docs/performance.md), for no batching.
#     So for ``k = 1`` pmap pushes its interpreter (which binds the axis name and carries the
#     group) but wraps nothing: ``f`` runs on the process's example itself, and a collective on
#     the axis applies the same cross-process rule the level would have applied to the value
#     with a batch dim of size 1 in front (``batching/collectives.py``, ``ACROSS``), then drops
#     that dim. The rule is made of ordinary ops and the ``dist_*`` ops, whose derivative and
#     batching rules are the cross-process transposes and pass-throughs, so every composition
#     (grad/jvp/vmap inside or outside pmap) differentiates and batches it as before. Every
#     value is then unmapped along the pmap axis, which for one example per process is exact.
def _direct(op, x, interp, params):
    from functransforms.batching.collectives import ACROSS

    out, bdim = ACROSS[op](x.unsqueeze(0), 0, interp.group, interp.world, *params)
    return out if bdim is None else out.squeeze(bdim)


def _tensor(x, call):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (bool, int, float, complex)):
        return torch.as_tensor(x)
    raise TypeError(
        f"{call}: expected tensors (or Python numbers) as leaves, got {type(x).__name__}."
    )


def _map(call, fn, x):
    if isinstance(x, torch.Tensor):
        return fn(x)
    leaves, spec = pt.tree_flatten(x)
    return pt.tree_unflatten(spec, [fn(_tensor(leaf, call)) for leaf in leaves])


# -- the public collectives --------------------------------------------------------------------
def _bindings(axis_name, call):
    """The interpreters binding ``axis_name`` (one name or a tuple), innermost first: a pmap's
    collective then communicates the already-reduced value."""
    if not isinstance(axis_name, (tuple, list)):
        return (binding(axis_name, call),)
    return sorted((binding(n, call) for n in axis_name), key=lambda i: -i.level)


# Note [A reduction at its own level]
#     The commonest collective is a reduction of a per-example value of the vmap that binds the
#     axis: ``psum(t, "i")`` with ``t`` one of that vmap's BatchedTensors. Its batching rule is then
#     one reduction of the physical value over the batch dim, with an unbatched result
#     (``batching/collectives.py``, ``REDUCE``), and the way there (the pytree map, the call's
#     string for errors, ``_bind``, ``process``'s unwrapping and op records) cost more than the
#     reduction on a small batch: 7 of a vmapped psum's 11 us, and bench_distributed.py's
#     normalisation (a) is a few such calls around kernels. So the public function applies that same
#     reduction to the physical value itself when the conditions of Note [Collectives skip the
#     dispatcher] hold for a plain BatchedTensor (not a lazy conjugate: its rules read the resolved
#     value) of a vmap that is not a pmap's (whose rule also communicates). Anything else takes
#     ``_bind``.
#     Its commonest case is tested first with no Python call at all: ``t``'s vmap is the top
#     of the interpreter stack (then it is the innermost binding of ``axis_name`` exactly when
#     its name is ``axis_name``, which is ``binding``'s answer without the search), and the
#     reduction is the closure's own Tensor method. Below torch's autograd only a physical
#     value requiring grad needs the dispatcher (the one case where ``__torch_dispatch__``
#     re-enables torch's autograd: ``_torch_autograd_wanted``), so the thread-local query (a
#     pybind11 call) is made only for such a value, as the pointwise fast path does. The
#     benchmark's (a) runs its collectives after 1 MB kernels, where every Python frame, dict
#     lookup and pybind11 call runs cache-cold: ours / hand-written 1.34-1.35 with the
#     collectives' inline path (one process, load 15; the reductions written on the
#     physical value by hand, the floor of any collective: 1.31-1.33). The rest is vmap's.
def _reduction(op, name):
    # (BatchedTensor, REDUCE[op]: a Tensor method), set at the first call (imported then:
    # import cycle); until then no type is None and the inline test fails
    fast = [None, None]

    def collective(x: PyTree, axis_name: AxisName) -> PyTree:
        batched, reduce = fast
        if type(x) is batched:  # Note [A reduction at its own level], inline
            interp = x._interp
            stack = _state.stack
            if (
                stack
                and stack[-1] is interp
                and interp.axis_name == axis_name
                and not isinstance(axis_name, (tuple, list))  # several names: _bindings
                and not interp.chunked
                and getattr(interp, "group", None) is None
                and not _modes()
                # below torch's autograd matters only where __torch_dispatch__ would re-enable
                # it: for a plain value requiring grad (as the pointwise fast path checks)
                and not (_requires_grad(x._value) and _excluded(_ADINPLACE))
            ):
                return reduce(x._value, x._bdim)
        if batched is None:
            from functransforms.batching._tensor import BatchedTensor as batched
            from functransforms.batching.collectives import REDUCE

            reduce = REDUCE[op]
            fast[:] = batched, reduce
        if isinstance(x, TransformTensor) and not isinstance(axis_name, (tuple, list)):
            interp = binding(axis_name, lambda: f"{name}(x, axis_name={axis_name!r})")
            if (  # Note [A reduction at its own level]
                type(x) is batched
                and x._interp is interp
                and getattr(interp, "group", None) is None
                and not _modes()
                and not below_torch_autograd()
            ):
                return reduce(x._value, x._bdim)
        call = f"{name}(x, axis_name={axis_name!r})"
        interps = _bindings(axis_name, call)
        if op in (ops.psum, ops.pmean) and getattr(interps[-1], "group", None) is not None:
            return _reduce_across_processes(op, call, x, interps)

        def one(t):
            for interp in interps:
                t = _bind(op, t, interp, ())
            return t

        return _map(call, one, x)

    collective.__name__ = collective.__qualname__ = name
    return collective


def _reduce_across_processes(op, call, x, interps):
    """psum/pmean of a pytree whose outermost axis is a pmap's: the inner axes leaf by leaf,
    then every leaf in one collective (``psum_many``: one all-reduce per dtype)."""
    leaves, spec = pt.tree_flatten(x)
    leaves = [_tensor(leaf, call) for leaf in leaves]
    for inner in interps[:-1]:
        leaves = [_bind(op, t, inner, ()) for t in leaves]
    interp = interps[-1]
    if not leaves:
        summed = []
    elif getattr(interp, "direct", False):  # Note [pmap without a level for its shard]
        from functransforms.batching.collectives import all_reduce_by_dtype

        summed = all_reduce_by_dtype(leaves, interp.group)
    elif _routes_to(interp, leaves):  # Note [Collectives skip the dispatcher]
        summed = interp.process(ops.psum_many, (leaves, interp.level), {})
    else:
        summed = ops.psum_many([lift(t, interp) for t in leaves], interp.level)
    if op is ops.pmean:
        summed = [t / size_of(interp) for t in summed]
    return pt.tree_unflatten(spec, list(summed))


psum = _reduction(ops.psum, "psum")
pmean = _reduction(ops.pmean, "pmean")
pmax = _reduction(ops.pmax, "pmax")
pmin = _reduction(ops.pmin, "pmin")
psum.__doc__ = """The sum of ``x`` over the named axis (or axes), the same for every example.

    Args:
        x: a tensor or a pytree of tensors (Python numbers are allowed: ``psum(1, "i")`` is the
            axis size).
        axis_name: the name given to an enclosing ``vmap(..., axis_name=...)``, or a tuple of them.

    Returns:
        The sum over all examples along the axis, with the structure of ``x``.

    Example:
        >>> import torch, functransforms as ft
        >>> x = torch.tensor([1.0, 2.0, 3.0])                   # [N]
        >>> ft.vmap(lambda t: t / ft.psum(t, "i"), axis_name="i")(x)   # [N]
        tensor([0.1667, 0.3333, 0.5000])
    """
pmean.__doc__ = "The mean of ``x`` over the named axis (or axes): ``psum(x) / axis_size``."
pmax.__doc__ = "The maximum of ``x`` over the named axis (or axes), elementwise."
pmin.__doc__ = "The minimum of ``x`` over the named axis (or axes), elementwise."


def _dim(d, ndim, call, what="axis"):
    if not -ndim <= d < ndim:
        raise ValueError(f"{call}: {what}={d} is out of range for a {ndim - 1}-d example.")
    return d % ndim


def all_gather(x: PyTree, axis_name: AxisName, *, axis: int = 0, tiled: bool = False) -> PyTree:
    """Every example's ``x``, stacked (or, ``tiled=True``, concatenated) along ``axis``.

    Example:
        >>> import torch, functransforms as ft
        >>> x = torch.arange(3.0)                                 # [N]
        >>> ft.vmap(lambda t: ft.all_gather(t, "i"), axis_name="i")(x)   # [N, N]
        tensor([[0., 1., 2.],
                [0., 1., 2.],
                [0., 1., 2.]])
    """
    call = f"all_gather(x, axis_name={axis_name!r}, axis={axis}, tiled={tiled})"
    levels = [binding(n, call).level for n in _names(axis_name)]

    def one(t):
        if not tiled:
            t = t.unsqueeze(_dim(axis, t.dim() + 1, call))
        d = _dim(axis, t.dim(), call)
        for level in reversed(levels):  # the first name is the major index
            t = bind(ops.all_gather, t, level, d)
        return t

    return _map(call, one, x)


def psum_scatter(
    x: PyTree, axis_name: AxisName, *, scatter_dimension: int = 0, tiled: bool = False
) -> PyTree:
    """``psum(x)`` split along ``scatter_dimension``: example ``i`` keeps the ``i``-th part (the
    transpose of ``all_gather``; untiled, the dim must have the axis size and is removed).

    Example:
        >>> import torch, functransforms as ft
        >>> x = torch.ones(3, 3)                                  # [N, N]
        >>> ft.vmap(lambda t: ft.psum_scatter(t, "i"), axis_name="i")(x)   # [N]
        tensor([3., 3., 3.])
    """
    call = f"psum_scatter(x, axis_name={axis_name!r}, scatter_dimension={scatter_dimension})"
    levels = [binding(n, call).level for n in _names(axis_name)]
    size = 1
    for level in levels:
        size *= size_of(by_level(level))

    def one(t):
        d = _dim(scatter_dimension, t.dim(), call, "scatter_dimension")
        if t.shape[d] % size or (not tiled and t.shape[d] != size):
            raise ValueError(
                f"{call}: dim {d} of the example has size {t.shape[d]}; expected "
                + (f"a multiple of the axis size {size}." if tiled else f"the axis size {size}.")
            )
        for level in levels:
            t = bind(ops.psum_scatter, t, level, d)
        return t if tiled else t.squeeze(d)

    return _map(call, one, x)


def all_to_all(
    x: PyTree, axis_name: AxisName, split_axis: int, concat_axis: int, *, tiled: bool = False
) -> PyTree:
    """Example ``i`` receives the ``i``-th chunk (along ``split_axis``) of every example's ``x``,
    concatenated along ``concat_axis`` in example order (JAX's ``all_to_all``; untiled, the split
    dim must have the axis size: it is removed and a dim of that size is inserted at
    ``concat_axis``).

    Example:
        >>> import torch, functransforms as ft
        >>> x = torch.arange(4.0).reshape(2, 2)                   # [N, N]
        >>> ft.vmap(lambda t: ft.all_to_all(t, "i", 0, 0), axis_name="i")(x)   # transposes
        tensor([[0., 2.],
                [1., 3.]])
    """
    call = (
        f"all_to_all(x, axis_name={axis_name!r}, split_axis={split_axis}, "
        f"concat_axis={concat_axis})"
    )
    names = _names(axis_name)
    interps = [binding(n, call) for n in names]
    size = 1
    for interp in interps:
        size *= size_of(interp)

    def tiled_op(t, split, concat):
        if len(interps) == 1:
            return bind(ops.all_to_all, t, interps[0].level, split, concat)
        # several axes: gather every example's x, keep this example's chunk of each
        # (Note [Collectives over several axes])
        g = all_gather(t, names)  # [N, *S]
        g = g.unflatten(1 + split, (size, g.shape[1 + split] // size))  # [j, ..., i, c, ...]
        g = g.index_select(1 + split, axis_index(names).reshape(1)).squeeze(1 + split)
        return g.movedim(0, concat).flatten(concat, concat + 1)  # j-major blocks along concat

    def one(t):
        split = _dim(split_axis, t.dim(), call, "split_axis")
        if not tiled:  # as JAX: insert the new dim, run the tiled op, drop the split dim
            if t.shape[split] != size:
                raise ValueError(
                    f"{call}: the split dim has size {t.shape[split]}; expected the axis "
                    f"size {size}."
                )
            concat = _dim(concat_axis, t.dim(), call, "concat_axis")
            if split == concat:
                return tiled_op(t, split, concat)
            if split < concat:
                concat += 1
                t = t.unsqueeze(concat)
            else:
                t = t.unsqueeze(concat)
                split += 1
            return tiled_op(t, split, concat).squeeze(split)
        concat = _dim(concat_axis, t.dim(), call, "concat_axis")
        if t.shape[split] % size:
            raise ValueError(
                f"{call}: the split dim has size {t.shape[split]}; expected a multiple of the axis "
                f"size {size}."
            )
        return tiled_op(t, split, concat)

    return _map(call, one, x)


def ppermute(x: PyTree, axis_name: AxisName, perm: list[tuple[int, int]]) -> PyTree:
    """Example ``dst`` receives example ``src``'s ``x`` for each ``(src, dst)`` in ``perm``;
    examples that receive nothing get zeros (JAX's ``ppermute``).

    Example:
        >>> import torch, functransforms as ft
        >>> x = torch.arange(3.0)                                 # [N]
        >>> ring = [(i, (i + 1) % 3) for i in range(3)]
        >>> ft.vmap(lambda t: ft.ppermute(t, "i", ring), axis_name="i")(x)
        tensor([2., 0., 1.])
    """
    call = f"ppermute(x, axis_name={axis_name!r}, perm={perm!r})"
    names = _names(axis_name)
    interps = [binding(n, call) for n in names]
    size = 1
    for interp in interps:
        size *= size_of(interp)
    src = [-1] * size
    for pair in perm:
        if len(pair) != 2:
            raise ValueError(f"{call}: expected (source, destination) pairs, got {pair!r}.")
        s, d = (int(v) for v in pair)
        for v in (s, d):
            if not 0 <= v < size:
                raise ValueError(f"{call}: index {v} is out of range for the axis of size {size}.")
        if src[d] != -1 or s in src:
            raise ValueError(
                f"{call}: perm must be a permutation: {(s, d)} repeats a source or a destination."
            )
        src[d] = s
    if len(interps) == 1:
        return _map(call, lambda t: bind(ops.ppermute, t, interps[0].level, src), x)

    # Note [Collectives over several axes]
    #     A permutation (or all_to_all) over several axes moves values between examples of
    #     different levels, which no single level's batching rule sees at once. It is written
    #     with the collectives that do take several names: gather every example's value
    #     (all_gather over the names) and select this example's part by its linearised index
    #     (axis_index over the names). Correct and differentiable (all_gather's transpose sums
    #     the cotangents back), at the cost of materialising the gathered values.
    index = torch.tensor([s if s >= 0 else size for s in src])[axis_index(names)]

    def one(t):
        gathered = all_gather(t, names)  # [N, *S]
        padded = torch.cat([gathered, torch.zeros_like(gathered[:1])])  # index N: zeros
        # the index is made on the default device: the values' device decides
        return padded.index_select(0, index.reshape(1).to(padded.device)).squeeze(0)

    return _map(call, one, x)


def axis_index(axis_name: AxisName) -> torch.Tensor:
    """The index of the current example along the named axis (a 0-d int64 tensor; for a tuple of
    names, the row-major index over them).

    Example:
        >>> import torch, functransforms as ft
        >>> ft.vmap(lambda t: t * ft.axis_index("i"), axis_name="i")(torch.ones(3))
        tensor([0., 1., 2.])
    """
    from functransforms.batching._tensor import wrap_batched

    call = f"axis_index({axis_name!r})"
    index = None
    for n in _names(axis_name):
        interp = binding(n, call)
        k = interp.batch_size  # under pmap: this process's examples are rank * k + [0, k)
        if getattr(interp, "direct", False):  # Note [pmap without a level for its shard]
            here = torch.tensor(interp.rank)
        else:
            here = wrap_batched(torch.arange(k) + getattr(interp, "rank", 0) * k, 0, interp)
        index = here if index is None else index * size_of(interp) + here
    return index


def axis_size(axis_name: AxisName) -> int:
    """The size of the named axis (a Python int; for a tuple of names, their product).

    Example:
        >>> import torch, functransforms as ft
        >>> ft.vmap(lambda t: t * ft.axis_size("i"), axis_name="i")(torch.ones(3))
        tensor([3., 3., 3.])
    """
    call = f"axis_size({axis_name!r})"
    size = 1
    for n in _names(axis_name):
        size *= size_of(binding(n, call))
    return size
