"""Small shape helpers shared by the batching rule families."""

from __future__ import annotations


def to_front(x, bdim):
    """Move the batch dim to position 0 (a view)."""
    return x if bdim == 0 else x.movedim(bdim, 0)


def logical_dim(x, bdim):
    return x.dim() - (bdim is not None)


def wrap_dim(d, n):
    """Normalize a possibly negative logical dim against logical rank ``n``."""
    if d < 0:
        d += n
    if not 0 <= d < max(n, 1):
        raise IndexError(f"Dimension out of range (expected to be in range of [{-max(n, 1)}, {max(n, 1) - 1}], but got {d})")
    return d


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
