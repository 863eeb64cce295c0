"""Deterministic formulations used by our rules, and the switch that selects them.

Note [Deterministic accumulation]
    Our derivative and batching rules accumulate with scatters: the vjp of ``x[idx]`` is
    ``index_put(zeros, idx, ct, accumulate=True)``, of ``index_select`` an ``index_add``, of
    ``gather``/``topk``/``sort`` a ``scatter_add``, and vmap of these ops emits them again on
    the batched values. Which kernel is nondeterministic depends on the device (measured and
    documented by torch): on CPU ``index_put(accumulate=True)`` runs in parallel with atomic
    adds (different bits run to run with 2 threads), while CPU ``index_add`` and ``scatter_add``
    accumulate serially in index order; on CUDA it is the other way round: ``index_put``
    accumulates with a sort and a segmented sum (deterministic), ``index_add``/``scatter_add``
    use atomicAdd. So, when deterministic mode is on (``ft.deterministic.enabled()``, or
    ``torch.are_deterministic_algorithms_enabled()``), each accumulation is rewritten, by flat
    positions, onto the kernel that is deterministic on its device: CPU -> ``index_add`` along
    one flat dim, CUDA -> ``index_put(accumulate=True)`` (sort + segment sum). A fixed order of
    additions also makes the CPU result independent of the thread count. The rewrites are
    ordinary ops, so they are themselves batched and differentiated by the transforms (vmap of a
    backward pass, hessians). The measured cost is in docs/performance.md (section
    "Determinism").

Note [Thread-count independent reductions]
    A full float reduction (``x.sum()``, ``mean``, ``dot``, a vector norm) of more than torch's
    grain size (32768 elements) is split across threads, so its bits depend on the thread count.
    ``enabled(level="threads")`` rewrites those to a fixed-order blocked reduction: rows of
    ``_BLOCK`` elements are each summed by one thread (``[n // B, B].sum(1)``: the split is over
    rows, the order within a row is fixed), the partial sums are reduced the same way until they
    fit under the grain size, where torch reduces serially.
"""

from __future__ import annotations

import threading

import torch

aten = torch.ops.aten

_GRAIN = 32768  # at::internal::GRAIN_SIZE: torch reduces serially below it
_BLOCK = 4096


class _Flags(threading.local):
    def __init__(self):
        self.level = None  # None | "default" | "threads"
        # the ThreadsMode enable(level="threads") pushed on this thread's mode stack: per
        # thread, as the stack is (another thread's disable() popped it from its own empty
        # stack, and this thread's mode could no longer be turned off)
        self.modes: list = []


_flags = _Flags()
_LEVELS = ("default", "threads")


def active() -> bool:
    """True when our rules must use deterministic formulations."""
    return _flags.level is not None or torch.are_deterministic_algorithms_enabled()


def level() -> str | None:
    """The level set through ``enable``/``enabled`` (None when off)."""
    return _flags.level


def check_level(lvl, call):
    if lvl not in _LEVELS:
        raise ValueError(
            f"{call}: expected level='default' or level='threads', got level={lvl!r}. "
            "Use 'threads' to also make full reductions independent of the thread count."
        )


# -- accumulating scatters (Note [Deterministic accumulation]) ---------------------------------


def _positions(x):
    return torch.arange(x.numel(), device=x.device).view(x.shape)


def _accumulate_flat(x, pos, vals):
    """``x`` with ``vals`` added at flat positions ``pos`` (same shape), in a fixed order."""
    flat = x.reshape(-1)
    pos, vals = pos.reshape(-1), vals.reshape(-1)
    if x.device.type == "cpu":
        out = aten.index_add.default(flat, 0, pos, vals)  # serial, index order
    else:
        out = aten.index_put.default(flat, [pos], vals, True)  # sort + segment sum
    return out.view(x.shape)


def index_put_accumulate(x, indices, values):
    """Deterministic ``index_put(x, indices, values, accumulate=True)``."""
    if x.device.type != "cpu":
        return aten.index_put.default(x, indices, values, True)
    pos = aten.index.Tensor(_positions(x), indices)
    return _accumulate_flat(x, pos, values.expand(pos.shape))


def index_add(x, dim, index, source, *, alpha=1):
    """Deterministic ``index_add(x, dim, index, source, alpha=alpha)``."""
    if x.device.type == "cpu":
        return aten.index_add.default(x, dim, index, source, alpha=alpha)
    if alpha != 1:
        source = source * alpha
    if x.dim() == 0:
        return _accumulate_flat(x, torch.zeros_like(index), source.reshape(index.shape))
    pos = _positions(x).index_select(dim, index)
    return _accumulate_flat(x, pos, source)


def scatter_add(x, dim, index, src):
    """Deterministic ``scatter_add(x, dim, index, src)``."""
    if x.device.type == "cpu":
        return aten.scatter_add.default(x, dim, index, src)
    if x.dim() == 0:
        return _accumulate_flat(x, torch.zeros_like(index), src.reshape(index.shape))
    pos = _positions(x).gather(dim, index)
    src = src[tuple(slice(0, s) for s in index.shape)]
    return _accumulate_flat(x, pos, src)


def _index_put_call(func, x, indices, values, accumulate=False):
    if not accumulate:
        return func(x, indices, values, accumulate)
    out = index_put_accumulate(x, indices, values)
    if func is aten.index_put.default:
        return out
    return x.copy_(out)  # index_put_ / _index_put_impl_: write through


def _index_add_call(func, x, dim, index, source, *, alpha=1):
    out = index_add(x, dim, index, source, alpha=alpha)
    return out if func is aten.index_add.default else x.copy_(out)


def _scatter_add_call(func, x, dim, index, src):
    out = scatter_add(x, dim, index, src)
    return out if func is aten.scatter_add.default else x.copy_(out)


def _scatter_reduce_call(func, x, dim, index, src, reduce, *, include_self=True):
    if reduce != "sum":
        return func(x, dim, index, src, reduce, include_self=include_self)
    base = x if include_self else x.scatter(dim, index, 0.0)
    out = scatter_add(base, dim, index, src)
    return out if func is aten.scatter_reduce.two else x.copy_(out)


_REPLACEMENTS = {
    aten.index_put.default: _index_put_call,
    aten.index_put_.default: _index_put_call,
    aten._index_put_impl_.default: lambda f, x, i, v, acc=False, unsafe=False: _index_put_call(
        f, x, i, v, acc
    ),
    aten.index_add.default: _index_add_call,
    aten.index_add_.default: _index_add_call,
    aten.scatter_add.default: _scatter_add_call,
    aten.scatter_add_.default: _scatter_add_call,
    aten.scatter_reduce.two: _scatter_reduce_call,
    aten.scatter_reduce_.two: _scatter_reduce_call,
}


def det_call(func, *args, **kwargs):
    """``func(*args, **kwargs)``, or its deterministic formulation when deterministic mode is on.

    The one call site our rules use where they may emit an accumulating scatter; a non-
    accumulating op (or mode off) costs one flag check.
    """
    if _flags.level is None and not torch.are_deterministic_algorithms_enabled():
        return func(*args, **kwargs)
    repl = _REPLACEMENTS.get(func)
    if repl is None:
        return func(*args, **kwargs)
    return repl(func, *args, **kwargs)


# -- thread-count independent full reductions (Note [Thread-count independent reductions]) ------


def blocked_sum(x):
    """Sum of all elements of ``x`` in an order that does not depend on the thread count."""
    x = x.reshape(-1)
    while x.numel() > _GRAIN:
        n = x.numel()
        head = (n // _BLOCK) * _BLOCK
        parts = x[:head].view(-1, _BLOCK).sum(1)
        if head < n:
            parts = torch.cat([parts, x[head:].sum().reshape(1)])
        x = parts
    return x.sum()


def _full(x, dim):
    return dim is None or len(dim) == 0 or len({d % max(x.dim(), 1) for d in dim}) == x.dim()


def _big_float(x):
    return (
        isinstance(x, torch.Tensor)
        and x.numel() > _GRAIN
        and (x.dtype.is_floating_point or x.dtype.is_complex)
        and x.layout == torch.strided
    )


def _sum(x, dim=None, keepdim=False, *, dtype=None):
    if not _big_float(x) or not _full(x, dim):
        return None
    out = blocked_sum(x if dtype is None else x.to(dtype))
    return out.reshape((1,) * x.dim()) if keepdim else out


def _mean(x, dim=None, keepdim=False, *, dtype=None):
    out = _sum(x, dim, keepdim, dtype=dtype)
    return None if out is None else out / x.numel()


def _dot(a, b):
    if not _big_float(a):
        return None
    return blocked_sum(a * b)


def _vdot(a, b):
    if not _big_float(a):
        return None
    return blocked_sum(a.conj() * b)


def _vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    if not _big_float(x) or not _full(x, dim) or ord in (0, float("inf"), float("-inf")):
        return None  # max/min/count do not depend on the order
    a = (x if dtype is None else x.to(dtype)).abs()
    out = blocked_sum(a) if ord == 1 else blocked_sum(a.pow(ord)).pow(1.0 / ord)
    return out.reshape((1,) * x.dim()) if keepdim else out


REDUCTIONS = {
    aten.sum.default: lambda x, *, dtype=None: _sum(x, dtype=dtype),
    aten.sum.dim_IntList: _sum,
    aten.nansum.default: lambda x, dim=None, keepdim=False, *, dtype=None: (
        None if not _big_float(x) else _sum(torch.where(x.isnan(), 0, x), dim, keepdim, dtype=dtype)
    ),
    aten.mean.default: lambda x, *, dtype=None: _mean(x, dtype=dtype),
    aten.mean.dim: _mean,
    aten.dot.default: _dot,
    aten.vdot.default: _vdot,
    aten.linalg_vector_norm.default: _vector_norm,
}
