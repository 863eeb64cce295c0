"""Small shape helpers shared by the batching rule families."""

from __future__ import annotations

import torch

from functransforms import _compat


def to_front(x, bdim):
    """Move the batch dim to position 0 (a view)."""
    return x if bdim == 0 else x.movedim(bdim, 0)


def flat_batch(x):
    """``x`` (batch dim in front) as ``[B, prod(rest)]``; unlike ``reshape(B, -1)`` also for
    ``B == 0``, where -1 is ambiguous (vmap over an empty batch returns empty results)."""
    if x.shape[0] == 0:
        n = 1
        for s in x.shape[1:]:
            n *= s
        return x.reshape(0, n)
    return x.reshape(x.shape[0], -1)


def wrap_dim(d, n):
    """Normalize a possibly negative logical dim against logical rank ``n``. As in torch, a 0-d
    tensor accepts dims 0 and -1."""
    m = max(n, 1)
    if not -m <= d < m:
        raise IndexError(
            f"Dimension out of range (expected to be in range of [{-m}, {m - 1}], but got {d})"
        )
    return d % m


def pad_to(x, nd):
    """``x`` has its batch dim at 0 and logical rank < ``nd``: insert size-1 dims after the batch
    dim so that right-aligned broadcasting never aligns the batch dim with a logical dim."""
    missing = nd - (x.dim() - 1)
    if missing <= 0:
        return x
    return x.reshape((x.shape[0],) + (1,) * missing + tuple(x.shape[1:]))


def expand_front(x, bdim, batch_size):
    """``x`` with its batch dim at 0; an unbatched ``x`` is expanded (no copy)."""
    if bdim is None:
        return x.unsqueeze(0).expand((batch_size,) + tuple(x.shape))
    return to_front(x, bdim)


def promote_like_logical(args, bdims):
    """Note [0-d type promotion]: torch promotes a 0-d tensor with lower priority than a tensor
    with dims, but a batched value that is 0-d per example has a dim physically (the batch dim),
    so it would win the promotion it should lose (float16 0-d + float64 0-d is float64 per
    example, float16 physically). When that can matter (a 0-d logical value among tensors of
    differing dtypes), cast the non-bool tensors to the dtype the logical values promote to."""
    tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    if len({a.dtype for _, a in tensors}) < 2 or not any(
        bdims[i] is not None and a.dim() == 1 for i, a in tensors
    ):
        return args
    logical = [
        torch.empty(
            a.shape[: bdims[i]] + a.shape[bdims[i] + 1 :] if bdims[i] is not None else a.shape,
            dtype=a.dtype,
            device="meta",
        )
        for i, a in tensors
        if a.dtype != torch.bool
    ]
    scalars = [a for a in args if isinstance(a, (bool, int, float, complex))]
    if not logical:
        return args
    _, dtype = _compat.elementwise_dtypes(*logical, *scalars)
    new = list(args)
    for i, a in tensors:
        if a.dtype not in (dtype, torch.bool):
            new[i] = a.to(dtype)
    return new


def merge_dims(x, d):
    """``x`` with dims ``d`` and ``d + 1`` merged, through ``reshape`` (``flatten`` and
    ``unflatten`` are composite ops that reach an enclosing vmap whole inside a rule)."""
    s = tuple(x.shape)
    return x.reshape(s[:d] + (s[d] * s[d + 1],) + s[d + 2 :])


def split_dim(x, d, n):
    """``x`` with dim ``d`` split into ``(n, -1)``, through ``reshape`` (see ``merge_dims``)."""
    s = tuple(x.shape)
    return x.reshape(s[:d] + (n, s[d] // n) + s[d + 1 :])
