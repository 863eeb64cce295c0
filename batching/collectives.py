"""Batching rules of the collectives (Note [Collectives are ops], in
functransforms/distributed/_collective_ops.py).

At the vmap that binds the op's axis the collective is a reduction, gather or permutation of the
physical tensor along its batch dim: one batched kernel, no loop. Any other vmap passes the op
on to the level below, on its physical value with the batch dim in front (a collective over
one axis commutes with mapping over another).
"""

from __future__ import annotations

import torch

from functransforms.distributed import _collective_ops as ops

from ._registry import register_vmap_rule
from ._util import to_front

# Ops whose parameters after ``axis`` are dims of the example (shifted by a front batch dim).
_DIM_PARAMS = {ops.all_gather: 1, ops.psum_scatter: 1, ops.all_to_all: 2, ops.ppermute: 0}


# op -> its ``across`` rule: also applied by pmap without a level (Note [pmap without a level
# for its shard], functransforms/distributed/_collectives.py)
ACROSS: dict = {}
# reduction op -> the Tensor method of its rule at the binding vmap, ``method(x, bdim)``: also
# applied by the public reductions themselves (Note [A reduction at its own level],
# functransforms/distributed/_collectives.py)
REDUCE: dict = {}


def def_collective(op, named, across=None):
    """Register ``op``'s batching rule: ``named(x, bdim, batch_size, *params) -> (out, bdim)``
    at the binding vmap, ``across(x, bdim, group, world, *params)`` at a binding pmap (Note
    [pmap's collectives] in functransforms/distributed/_collective_ops.py), the pass-through
    elsewhere."""
    ACROSS[op] = across

    @register_vmap_rule(op)
    def rule(interp, args, bdims, kwargs):
        x, axis, *params = args
        bdim = bdims[0]
        if interp.level == axis:
            if bdim is None:  # not varying along the axis: lift (the public functions do this)
                x, bdim = x.unsqueeze(0).expand((interp.batch_size,) + tuple(x.shape)), 0
            if getattr(interp, "group", None) is not None:
                return across(x, bdim, interp.group, interp.world, *params)
            return named(x, bdim, interp.batch_size, *params)
        return pass_through(op, x, bdim, axis, params)

    return rule


def pass_through(op, x, bdim, axis, params):
    """``op`` at a level that does not bind its axis: on the physical value, batch dim in front."""
    if bdim is None:
        return op(x, axis, *params), None
    n = _DIM_PARAMS.get(op, 0)
    shifted = [p + 1 for p in params[:n]] + list(params[n:])
    return op(to_front(x, bdim), axis, *shifted), 0


for _op in (ops.dist_all_gather, ops.dist_psum_scatter, ops.dist_exchange, ops.dist_ppermute):
    _DIM_PARAMS[_op] = 1
for _op in (
    ops.dist_replicate,
    ops.dist_psum,
    ops.dist_pmax,
    ops.dist_pmin,
    ops.dist_all_gather,
    ops.dist_psum_scatter,
    ops.dist_exchange,
    ops.dist_ppermute,
):
    register_vmap_rule(_op)(
        lambda interp, args, bdims, kwargs, _op=_op: pass_through(
            _op, args[0], bdims[0], args[1], args[2:]
        )
    )


def _all_gather(x, bdim, n, dim):
    # [N, *S] -> S with S[dim] * N: example j's block at position j along dim
    return to_front(x, bdim).movedim(0, dim).flatten(dim, dim + 1), None


def _psum_scatter(x, bdim, n, dim):
    # sum over examples, then example i keeps chunk i of dim: that chunk index is the new bdim
    total = x.sum(bdim)
    return total.unflatten(dim, (n, total.shape[dim] // n)), dim


def _all_to_all(x, bdim, n, split, concat):
    w = to_front(x, bdim)  # [j, *S], S[split] = n * k
    w = w.unflatten(1 + split, (n, w.shape[1 + split] // n))  # [j, ..., i, k, ...]
    return _blocks_to_examples(w, split, concat)


def _blocks_to_examples(w, split, concat):
    """[j, ..., i, k, ...] (i at 1 + split): example i's blocks from every j along concat."""
    w = w.movedim(1 + split, 0)  # [i, j, *S_k]
    w = w.movedim(1, 1 + concat)  # [i, *S_k[:concat], j, S_k[concat], ...]
    return w.flatten(1 + concat, 2 + concat), 0  # j-major blocks along concat


def _ppermute(x, bdim, n, src):
    w = to_front(x, bdim)
    if -1 in src:  # receivers of nothing read a zero slice appended at index n
        w = torch.cat([w, torch.zeros_like(w[:1])])
    index = torch.tensor([s if s >= 0 else n for s in src], device=w.device)
    return w.index_select(0, index), 0


# -- across processes (pmap): the local step, then the group's collective ----------------------
def _dist_all_gather(x, bdim, group, world, dim):
    local, _ = _all_gather(x, bdim, None, dim)
    return ops.dist_all_gather(local, group, dim), None


def _dist_psum_scatter(x, bdim, group, world, dim):
    mine = ops.dist_psum_scatter(x.sum(bdim), group, dim)  # this process's k chunks
    k = x.shape[bdim]
    return mine.unflatten(dim, (k, mine.shape[dim] // k)), dim


def _dist_all_to_all(x, bdim, group, world, split, concat):
    w = to_front(x, bdim)  # [j_local, *S], S[split] = world * k * c
    k = w.shape[0]
    w = w.unflatten(1 + split, (world, k, w.shape[1 + split] // (world * k)))
    w = ops.dist_exchange(w, group, 1 + split)  # block q goes to process q, from p comes p's
    w = w.movedim(1 + split, 0).flatten(0, 1)  # [j, ..., i_local, c, ...], j = p * k + j_local
    return _blocks_to_examples(w, split, concat)


def _dist_ppermute(x, bdim, group, world, src):
    return ops.dist_ppermute(to_front(x, bdim), group, 0, src), 0


def def_reduction(op, reduce, dist_op, mean=False):
    """A reduction over the axis: ``reduce`` over the local examples, then ``dist_op`` over the
    processes under pmap (a mean divides the global sum by the axis size)."""

    method = REDUCE[op] = getattr(torch.Tensor, reduce)

    def local(x, b, n):
        return method(x, b), None

    def across(x, b, group, world):
        out = dist_op(getattr(x, "sum" if mean else reduce)(b), group)
        return (out / (x.shape[b] * world) if mean else out), None

    def_collective(op, local, across)


def_reduction(ops.psum, "sum", ops.dist_psum)
def_reduction(ops.pmean, "mean", ops.dist_psum, mean=True)
def_reduction(ops.pmax, "amax", ops.dist_pmax)
def_reduction(ops.pmin, "amin", ops.dist_pmin)
def_collective(ops.all_gather, _all_gather, _dist_all_gather)
def_collective(ops.psum_scatter, _psum_scatter, _dist_psum_scatter)
def_collective(ops.all_to_all, _all_to_all, _dist_all_to_all)
def_collective(ops.ppermute, _ppermute, _dist_ppermute)


@register_vmap_rule(ops.psum_many)
def psum_many_vmap_rule(interp, args, bdims, kwargs):
    """At the binding level: each leaf summed over its examples, then (under pmap) all leaves
    of one dtype flattened into one buffer and all-reduced once. Elsewhere: leaf by leaf, the
    batch dim in front (it commutes)."""
    xs, axis = args
    bs = bdims[0] if isinstance(bdims[0], list) else [None] * len(xs)
    if interp.level != axis:
        out = ops.psum_many([x if b is None else to_front(x, b) for x, b in zip(xs, bs)], axis)
        return tuple(out), tuple(None if b is None else 0 for b in bs)
    n = interp.batch_size
    local = [x * n if b is None else x.sum(b) for x, b in zip(xs, bs)]
    if getattr(interp, "group", None) is not None:
        local = all_reduce_by_dtype(local, interp.group)
    return tuple(local), (None,) * len(local)


def all_reduce_by_dtype(tensors, group):
    """``dist_psum`` of each tensor, as one all-reduce per dtype and device."""
    out = list(tensors)
    by_dtype = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault((t.dtype, t.device), []).append(i)
    for idx in by_dtype.values():
        flat = ops.dist_psum(torch.cat([tensors[i].reshape(-1) for i in idx]), group)
        for i, piece in zip(idx, flat.split([tensors[i].numel() for i in idx])):
            out[i] = piece.view(tensors[i].shape)
    return out
