"""The collective primitives, as ops of the ``functransforms`` torch library namespace.

Note [Collectives are ops]
    A collective (``psum``, ``all_gather``, ...) is not a function of one example: under vmap it
    reduces or permutes *across* the mapped axis, so it cannot be written with per-example ops.
    It is a primitive, like JAX's ``psum_p``: an op of its own (``functransforms::psum``) that
    reaches our interpreters through torch's dispatcher like any aten op, so that every
    transform handles it through its registry (``batching/collectives.py``,
    ``autodiff/collectives.py``) and nothing else in the core knows about axes.

    The op names its axis by the *level* of the vmap that binds it (``axis``): the public
    functions (``functransforms/distributed/_collectives.py``) resolve names to levels, and lift
    the operand
    to be batched at that level first, so the named vmap always processes the op. A vmap of
    another level passes it through to the level below (it commutes with the collective); the
    named level turns it into a reduction, gather or permutation of its physical tensor. The
    kernels below run only if an op escapes every interpreter, which the public functions rule
    out: they raise.
"""

from __future__ import annotations

import threading

import torch

# FRAGMENT, and each op defined only once: the doctest collector imports a second copy of this
# module, whose definitions must find the first copy's ops
_LIB = torch.library.Library("functransforms", "FRAGMENT")  # noqa: TOR901 - a private namespace


def _define(name, schema, kernel):
    if not hasattr(torch.ops.functransforms, name):
        _LIB.define(f"{name}({schema}) -> Tensor")
        _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    return getattr(torch.ops.functransforms, name).default


# Each op: its schema after the operand. ``axis`` is the binding vmap's level.
_SCHEMAS = {
    "psum": "int axis",
    "pmean": "int axis",
    "pmax": "int axis",
    "pmin": "int axis",
    # all_gather / psum_scatter / all_to_all are the tiled forms (JAX's tiled=True); the untiled
    # ones add and remove a size-1 dim around them (functransforms/distributed/_collectives.py)
    "all_gather": "int axis, int dim",
    "psum_scatter": "int axis, int dim",
    "all_to_all": "int axis, int split_dim, int concat_dim",
    # src[i]: the example whose value example i receives, -1 for none (zeros)
    "ppermute": "int axis, int[] src",
}


def _escaped(name):
    def kernel(x, *params):
        raise RuntimeError(
            f"functransforms.{name}: the collective reached a tensor outside the vmap that binds "
            "its axis (an internal error: please report it with the code that raised it)."
        )

    return kernel


OPS = {
    name: _define(name, f"Tensor x, {params}", _escaped(name)) for name, params in _SCHEMAS.items()
}
# psum of several leaves at once: under pmap, one all-reduce for a whole pytree (as DDP buckets
# gradients) instead of one per leaf (Note [pmap's collectives])
if not hasattr(torch.ops.functransforms, "psum_many"):
    _LIB.define("psum_many(Tensor[] xs, int axis) -> Tensor[]")
    _LIB.impl("psum_many", _escaped("psum_many"), "CompositeExplicitAutograd")
OPS["psum_many"] = torch.ops.functransforms.psum_many.default
psum, pmean, pmax, pmin = OPS["psum"], OPS["pmean"], OPS["pmax"], OPS["pmin"]
all_gather, psum_scatter = OPS["all_gather"], OPS["psum_scatter"]
all_to_all, ppermute = OPS["all_to_all"], OPS["ppermute"]
psum_many = OPS["psum_many"]


# -- the cross-process halves, for pmap -------------------------------------------------------
# Note [pmap's collectives]
#     Under pmap the binding level holds this process's examples; a collective first combines
#     them locally (the vmap rule's reduction), then across the processes of the group with
#     one of these ops. They take plain per-process tensors and call torch.distributed; as ops
#     they get derivative rules (autodiff/collectives.py: dist_psum's transpose is dist_psum,
#     dist_all_gather's is dist_psum_scatter, dist_exchange is its own, dist_ppermute's is the
#     inverse permutation) and pass-through batching rules (a vmap *around* pmap maps over
#     independent problems: every process holds the same batch of them).
#     ``dim`` is the dim the op gathers, scatters or exchanges along; ``src`` of dist_ppermute
#     is global: example i of the axis receives example src[i] (k examples per process).
#     ``group`` is a key of GROUPS, not the pmap's level: an outer grad runs the transposes
#     after the pmap has returned. dist_replicate is the identity on a replicated (unmapped)
#     input of pmap whose transpose sums over the processes: Note [Replicated inputs of pmap].
_DIST_SCHEMAS = {
    "dist_psum": "int group",
    "dist_pmax": "int group",
    "dist_pmin": "int group",
    "dist_all_gather": "int group, int dim",
    "dist_psum_scatter": "int group, int dim",
    "dist_exchange": "int group, int dim",
    "dist_ppermute": "int group, int dim, int[] src",
    "dist_replicate": "int group",
}
GROUPS: dict = {}  # key -> process group, filled by pmap


_GROUPS_LOCK = threading.Lock()


def group_key(group):
    """The key of ``group`` in GROUPS (a process group object is not an op argument)."""
    for key, g in tuple(GROUPS.items()):  # a snapshot: another thread may add one
        if g is group:
            return key
    # two threads' new groups took the same key (one thread's collectives ran on the other's
    # group) and an insertion broke the other's loop: Note [One-time setup under one lock]
    with _GROUPS_LOCK:
        for key, g in GROUPS.items():
            if g is group:
                return key
        key = len(GROUPS)
        GROUPS[key] = group
        return key


# Note [The shard check overlaps the computation]
#     pmap compares the processes' shard shapes with one small all-reduce per call. Waiting for
#     it up front would add a synchronisation point per step; instead pmap starts it
#     asynchronously and the first cross-process collective of the call (or the end of the
#     call, if f has none) waits for it and raises on a mismatch, before any collective whose
#     sizes could differ runs. Every process runs the same program, so all of them check at
#     the same point and raise the same error.
PENDING_CHECKS: dict = {}  # group key -> finish() of the call's shard check


def finish_shard_check(key):
    finish = PENDING_CHECKS.pop(key, None)
    if finish is not None:
        finish()


def _group(key):
    finish_shard_check(key)
    return GROUPS[key]


def _contiguous_front(x, dim):
    return x.movedim(dim, 0).contiguous()


def _dist_reduce(op_name):
    def kernel(x, group):
        import torch.distributed as dist

        y = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(y, getattr(dist.ReduceOp, op_name), group=_group(group))
        return y

    return kernel


def _dist_all_gather(x, group, dim):
    import torch.distributed as dist

    group = _group(group)
    front = _contiguous_front(x, dim)
    out = front.new_empty((dist.get_world_size(group) * front.shape[0],) + front.shape[1:])
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, front, group=group)
    return out.movedim(0, dim)


def _dist_psum_scatter(x, group, dim):
    import torch.distributed as dist

    group = _group(group)
    front = _contiguous_front(x, dim)
    out = front.new_empty((front.shape[0] // dist.get_world_size(group),) + front.shape[1:])
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, front, group=group)
    return out.movedim(0, dim)


def _dist_exchange(x, group, dim):
    import torch.distributed as dist

    front = _contiguous_front(x, dim)
    out = torch.empty_like(front)
    dist.all_to_all_single(out, front, group=_group(group))
    return out.movedim(0, dim)


def _dist_ppermute(x, group, dim, src):
    import torch.distributed as dist

    group = _group(group)
    rank, k = dist.get_rank(group), x.shape[dim]
    front = _contiguous_front(x, dim)
    out = torch.zeros_like(front)
    ops, mine = [], range(rank * k, (rank + 1) * k)
    for dst, s in enumerate(src):
        if s < 0 or (dst in mine and s in mine):
            if s >= 0:  # both here: a local copy
                out[dst - rank * k] = front[s - rank * k]
            continue
        peer = dist.get_global_rank(group, (dst if s in mine else s) // k)
        if s in mine:
            ops.append(dist.P2POp(dist.isend, front[s - rank * k], peer, group, tag=dst))
        elif dst in mine:
            ops.append(dist.P2POp(dist.irecv, out[dst - rank * k], peer, group, tag=dst))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return out.movedim(0, dim)


_DIST_KERNELS = {
    "dist_psum": _dist_reduce("SUM"),
    "dist_pmax": _dist_reduce("MAX"),
    "dist_pmin": _dist_reduce("MIN"),
    "dist_all_gather": _dist_all_gather,
    "dist_psum_scatter": _dist_psum_scatter,
    "dist_exchange": _dist_exchange,
    "dist_ppermute": _dist_ppermute,
    "dist_replicate": lambda x, group: x.clone(),
}
for _name, _params in _DIST_SCHEMAS.items():
    OPS[_name] = _define(_name, f"Tensor x, {_params}", _DIST_KERNELS[_name])
dist_psum, dist_pmax, dist_pmin = OPS["dist_psum"], OPS["dist_pmax"], OPS["dist_pmin"]
dist_all_gather, dist_psum_scatter = OPS["dist_all_gather"], OPS["dist_psum_scatter"]
dist_exchange, dist_ppermute = OPS["dist_exchange"], OPS["dist_ppermute"]
dist_replicate = OPS["dist_replicate"]
