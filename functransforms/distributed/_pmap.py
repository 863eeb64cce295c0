"""pmap: map over an axis split across the processes of a torch.distributed group.

Note [pmap is vmap over this process's shard]
    Each process passes its shard: its slice of the leading (mapped) axis, ``k`` examples (the
    same ``k`` everywhere). pmap runs ``f`` as ``vmap`` over those ``k`` examples with the axis
    name bound to a level that also knows the group, its size and this process's rank: the axis
    has ``k * world`` examples, ``axis_index`` counts from ``rank * k``, and each collective
    combines the local examples first and then the processes (Note [pmap's collectives]). So
    the code that runs under ``vmap`` on one process runs under ``pmap`` unchanged, and
    ``vmap``/``grad``/``jvp`` compose with it as with any level. With one example per process
    (``k = 1``) the level binds the axis but wraps nothing: Note [pmap without a level for its
    shard] (functransforms/distributed/_collectives.py).

Note [Replicated inputs of pmap]
    An unmapped input (``in_dims=None``) is the same on every process: one value, used by all
    ``k * world`` examples. When an outer transform differentiates it (``grad(lambda w:
    pmap(f)(w, x).sum())``), each process sees only its own examples' use of it, so its
    cotangent must be summed over the processes for the gradient to be the single-process one.
    pmap passes such inputs through ``dist_replicate`` (the identity, transposed to an
    all-reduce), so every process gets the gradient of the sum of all processes' outputs.
    Values captured by ``f`` from outside (closures) are not seen by pmap: pass what you
    differentiate as arguments.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any

import torch

from .. import _pytree as pt
from .._core.compiling import eager_under_compile
from .._core.levels import TransformTensor
from .._typing import Dims, Func
from . import _collective_ops as ops


def pmap(
    f: Func,
    axis_name: Hashable,
    in_dims: Dims = 0,
    out_dims: Dims = 0,
    *,
    group: Any = None,
) -> Func:
    """Map ``f`` over the leading axis split across the processes of a process group.

    Args:
        f: the function of one example, as for ``vmap``; collectives in it may name
            ``axis_name`` (and the names of vmaps around or inside it).
        axis_name: the name of the mapped axis.
        in_dims, out_dims: as for ``vmap``; the mapped dim of each input holds this process's
            examples (its shard), the same number on every process.
        group: the ``torch.distributed`` process group (default: the whole world). It must be
            initialised (``torchrun``, ``init_process_group``, or
            ``functransforms.distributed.launch``).

    Returns:
        A function taking this process's shard and returning this process's slice of the
        outputs.

    Example (not a doctest: it needs a process group; docs/distributed.md runs one)::

        # in every process, x holds this process's rows of the global batch
        normalised = ft.pmap(lambda t: t - ft.pmean(t, "batch"), "batch")(x)
    """
    if not callable(f):
        raise TypeError(f"pmap(f, {axis_name!r}): expected a callable, got {type(f).__name__}.")
    if axis_name is None:
        raise ValueError("pmap(f, axis_name=None): pmap needs a name for its axis.")

    @functools.wraps(f)
    def pmapped(*args, **kwargs):
        from .._vmap import _vmap_call, broadcast_prefix

        call = f"pmap({getattr(f, '__name__', 'f')}, {axis_name!r})(<inputs>)"
        g, world, rank = _group(group, call)
        key = ops.group_key(g)
        flat, spec = pt.tree_flatten(args)
        if isinstance(in_dims, int) or in_dims is None:
            dims = [in_dims] * len(flat)
        else:
            dims = broadcast_prefix(in_dims, args, "in_dims", call)
        ops.PENDING_CHECKS[key] = _start_shard_check(flat, dims, g, call)
        flat = [
            ops.dist_replicate(x, key) if d is None and isinstance(x, TransformTensor) else x
            for x, d in zip(flat, dims)
        ]
        try:
            if type(out_dims) is int and _one_per_process(flat, dims):
                binding = (axis_name, key, world, rank)
                return _direct(f, call, flat, dims, spec, kwargs, in_dims, out_dims, binding)
            args = pt.tree_unflatten(spec, flat)
            return _vmap_call(
                f,
                in_dims,
                out_dims,
                "error",
                None,
                args,
                kwargs,
                (axis_name, None),
                pmap=(key, world, rank),
            )
        finally:  # f ran no collective: the check still ends with the call
            ops.finish_shard_check(key)

    return pmapped


def _one_per_process(flat, dims):
    """True when every mapped input holds one example (JAX's layout: Note [pmap without a level
    for its shard] in functransforms/distributed/_collectives.py); anything else, including inputs
    vmap
    would reject, takes the vmap path (and its errors)."""
    mapped = False
    for x, d in zip(flat, dims):
        if d is None:
            continue
        if type(d) is not int or not isinstance(x, torch.Tensor) or x.is_nested:
            return False
        n = x.dim()
        if not -n <= d < n or x.shape[d] != 1:
            return False
        mapped = True
    return mapped


@eager_under_compile
def _direct(f, call, flat, dims, spec, kwargs, in_dims, out_dims, binding):
    """pmap with one example per process: the axis is bound, nothing is wrapped (Note [pmap
    without a level for its shard])."""
    from functransforms.batching._tensor import BatchedTensor, VmapInterpreter
    from functransforms.batching.random import no_random_ops

    from .._vmap import _unwrap_outputs

    interp = VmapInterpreter(1, "error", call)
    interp.axis_name, interp.group, interp.world, interp.rank = binding
    interp.chunked, interp.direct = False, True
    args = pt.tree_unflatten(spec, [x if d is None else x.select(d, 0) for x, d in zip(flat, dims)])
    with interp, no_random_ops():
        out = f(*args, **kwargs)
    return _unwrap_outputs(out, out_dims, interp, 1, f, in_dims, BatchedTensor)


def _group(group, call):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{call}: no torch.distributed process group is initialised. Expected one per "
            "process: run under `torchrun`, call `torch.distributed.init_process_group(...)`, or "
            "start local workers with `functransforms.distributed.launch(fn, nprocs, ...)`."
        )
    g = group if group is not None else dist.group.WORLD
    return g, dist.get_world_size(g), dist.get_rank(g)


def _start_shard_check(flat, dims, group, call):
    """Every process must hold shards of the same shapes and dtypes: a mismatch would hang or
    garble the collectives. Compare a digest of them with one small all-reduce, started here
    without waiting (Note [The shard check overlaps the computation])."""
    import torch.distributed as dist

    shapes = tuple(
        (tuple(x.shape), str(x.dtype), d) if isinstance(x, torch.Tensor) else None
        for x, d in zip(flat, dims)
    )
    digest = _stable_hash(repr(shapes))  # not hash(): str hashing is salted per process
    both = torch.tensor([digest, -digest], dtype=torch.int64)
    work = dist.all_reduce(both, dist.ReduceOp.MIN, group=group, async_op=True)

    def finish():
        work.wait()
        if both[0].item() != -both[1].item():
            every = [None] * dist.get_world_size(group)
            dist.all_gather_object(every, shapes, group=group)
            lines = "\n".join(f"  rank {r}: {s}" for r, s in enumerate(every))
            raise ValueError(
                f"{call}: the processes passed inputs of different shapes or dtypes (each entry: "
                f"shape, dtype, in_dim of a flattened input):\n{lines}\nExpected every process "
                "to pass a shard of the same shape: split the global batch evenly."
            )

    return finish


def _stable_hash(text):
    import zlib

    data = text.encode()
    return zlib.crc32(data) | ((zlib.adler32(data) & 0x3FFFFFFF) << 32)
