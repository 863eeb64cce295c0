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


def empty_batch(op, args, bdims, kwargs):
    """``op`` over an empty batch (batch size 0): ``(out, out_bdim)`` with the shapes and dtypes
    one example gives, computed on meta (no values), and a batch dim of size 0 in front. For
    rules that fold the batch dim into another, which loses that dim's per-example size (and
    ``groups * B`` is no valid convolution) when ``B == 0``."""

    def example(a, b):
        if not isinstance(a, torch.Tensor):
            return a
        shape = a.shape if b is None else a.shape[:b] + a.shape[b + 1 :]
        return torch.empty(shape, dtype=a.dtype, device="meta")

    out = op(*[example(a, b) for a, b in zip(args, bdims)], *args[len(bdims) :], **kwargs)
    device = next(a.device for a in args if isinstance(a, torch.Tensor))

    def batch(o):
        return None if o is None else torch.empty((0, *o.shape), dtype=o.dtype, device=device)

    if isinstance(out, torch.Tensor):
        return batch(out), 0
    outs = tuple(batch(o) for o in out)
    return outs, tuple(None if o is None else 0 for o in outs)


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


def split_dim(x, d, n, inner=None):
    """``x`` with dim ``d`` split into ``(n, inner)``, through ``reshape`` (see ``merge_dims``).
    ``inner`` defaults to ``size(d) // n``, which an empty batch (``n == 0``) cannot give: a
    caller that folded the batch dim passes the per-example size it knows."""
    s = tuple(x.shape)
    if n == 0 and inner is None:
        raise NotImplementedError(
            "vmap over an empty batch (batch size 0): this batching rule folds the batch dim "
            "into another and cannot recover that dim's per-example size. Expected: a batch "
            "size >= 1, or a rule that passes split_dim(..., inner=) (batching/_util.py)."
        )
    return x.reshape(s[:d] + (n, s[d] // n if n else inner) + s[d + 1 :])


# Note [Memory formats per example]
#     A copy in a memory format must give every example that format. Contiguous: the batch dim
#     outermost. channels_last (_3d): the physical value is one rank up, where torch's formats
#     do not apply (they raised "required rank 4 tensor", in every jacfwd of a channels_last
#     input through a decomposition that calls contiguous(memory_format=...)); the copy is made
#     contiguous with the channel dim innermost, then permuted back, which is exactly each
#     example's channels_last strides. Used by clone/_to_copy (views.py) and the *_like
#     factories (elementwise.py).
_PER_EXAMPLE_RANK = {torch.channels_last: 4, torch.channels_last_3d: 5}


def in_format(op, args, bdims, kwargs):
    """``op(x, *args[1:], **kwargs)`` batched over ``x``'s ``bdims[0]``, with its
    ``memory_format`` holding for each example: ``(out, out_bdim)``."""
    x, fmt = args[0], kwargs.get("memory_format")
    if fmt is None or fmt is torch.preserve_format:
        return op(*args, **kwargs), bdims[0]
    x = to_front(x, bdims[0])
    if fmt is torch.contiguous_format:
        return op(x, *args[1:], **kwargs), 0
    rank = _PER_EXAMPLE_RANK.get(fmt)
    if rank is None or x.dim() - 1 != rank:
        return op(x, *args[1:], **kwargs), 0  # torch's own error, or a format it knows
    order = [0, 1, *range(3, rank + 1), 2]  # [B, N, C, *spatial] -> [B, N, *spatial, C]
    inverse = [order.index(i) for i in range(rank + 1)]
    kw = {**kwargs, "memory_format": torch.contiguous_format}
    return op(x.permute(order), *args[1:], **kw).permute(inverse), 0
