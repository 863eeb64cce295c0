"""``rearrange``: einops' reordering of axes (PyTorch exports it), as one reshape, one permute
and one reshape, so that every transform handles it through those ops' rules."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch

_ELLIPSIS = "..."
_TOKEN = re.compile(r"\.\.\.|\(|\)|[A-Za-z_][A-Za-z0-9_]*|\d+|\S")


def _parse(side: str, pattern: str) -> list:
    """A side of the pattern as a list of elements: an axis name, ``...``, or a group (a list of
    names/``...``; ``()`` and ``1`` are unit axes, kept as empty groups)."""
    out: list = []
    group: list | None = None
    for tok in _TOKEN.findall(side):
        if tok == "(":
            if group is not None:
                raise _error(pattern, "nested parentheses")
            group = []
        elif tok == ")":
            if group is None:
                raise _error(pattern, "a ')' without its '('")
            out.append(group)
            group = None
        elif tok == "1":  # a unit axis: an empty group (inside a group it adds nothing)
            if group is None:
                out.append([])
        elif tok.isdigit():
            raise _error(pattern, f"the number {tok} (only 1, a unit axis, may appear)")
        elif tok == _ELLIPSIS or tok.isidentifier():
            (out if group is None else group).append(tok)
        else:
            raise _error(pattern, f"the character {tok!r}")
    if group is not None:
        raise _error(pattern, "a '(' without its ')'")
    return out


def _names(side: list) -> list[str]:
    flat = []
    for e in side:
        flat.extend(e if isinstance(e, list) else [e])
    return flat


def _error(pattern: str, what: str) -> ValueError:
    return ValueError(f"rearrange(tensor, {pattern!r}): {what}.")


def rearrange(
    tensor: torch.Tensor | Sequence[torch.Tensor], pattern: str, **axes_lengths: int
) -> torch.Tensor:
    """einops' ``rearrange`` (as ``PyTorch's rearrange``): transpose, reshape, squeeze,
    unsqueeze, stack and concatenate, written as a pattern such as ``"b (h w) c -> b h w c"``.
    A list or tuple of tensors is stacked along a new first axis first.

    Example:
        >>> import torch, functransforms as ft
        >>> ft.rearrange(torch.zeros(32, 30, 40, 3), "b (h h1) (w w1) c -> b h w (c h1 w1)",
        ...              h1=2, w1=2).shape
        torch.Size([32, 15, 20, 12])
    """
    if isinstance(tensor, (list, tuple)):
        tensor = torch.stack(list(tensor))
    if "->" not in pattern or pattern.count("->") != 1:
        raise _error(pattern, "expected one '->' between the input and output patterns")
    left_s, right_s = pattern.split("->")
    left, right = _parse(left_s, pattern), _parse(right_s, pattern)
    lnames, rnames = _names(left), _names(right)
    for side, names in (("input", lnames), ("output", rnames)):
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise _error(pattern, f"the {side} pattern repeats {sorted(dup)}")
    if set(lnames) != set(rnames):
        only = sorted(set(lnames) ^ set(rnames))
        raise _error(pattern, f"axes {only} appear on one side only (rearrange keeps every axis)")
    unused = sorted(set(axes_lengths) - set(lnames))
    if unused:
        raise _error(pattern, f"axes_lengths names {unused}, which the pattern does not use")
    if any(isinstance(e, list) and _ELLIPSIS in e for e in left):
        raise _error(pattern, "'...' inside parentheses on the input side")

    n_fixed = sum(1 for e in left if e != _ELLIPSIS)
    if _ELLIPSIS in left:
        n_ell = tensor.dim() - n_fixed
        if n_ell < 0:
            raise _error(
                pattern, f"{n_fixed} axes before and after '...', got a {tensor.dim()}-d tensor"
            )
    elif tensor.dim() != len(left):
        raise _error(
            pattern, f"{len(left)} input axes, got a {tensor.dim()}-d tensor {tuple(tensor.shape)}"
        )
    else:
        n_ell = 0
    ell = [f"...{i}" for i in range(n_ell)]

    # the size of every elementary axis, from the input's shape and axes_lengths
    sizes: dict[str, int] = {}
    elementary: list[str] = []
    dims = iter(tensor.shape)
    for e in left:
        if e == _ELLIPSIS:
            for name in ell:
                sizes[name] = next(dims)
                elementary.append(name)
            continue
        group = e if isinstance(e, list) else [e]
        d = next(dims)
        unknown = [n for n in group if n not in axes_lengths]
        known = math.prod(axes_lengths[n] for n in group if n in axes_lengths)
        if len(unknown) > 1:
            raise _error(
                pattern,
                f"cannot infer the lengths of {unknown} from one axis of size {d}; "
                "give all but one in axes_lengths",
            )
        if unknown:
            if known == 0 or d % known:
                raise _error(
                    pattern,
                    f"an axis of size {d} does not split into {group} with lengths {axes_lengths}",
                )
            sizes[unknown[0]] = d // known
        elif known != d:
            raise _error(
                pattern, f"the axis {group} has size {d}, but the lengths given multiply to {known}"
            )
        for n in group:
            sizes.setdefault(n, axes_lengths.get(n))
            elementary.append(n)

    order: list[str] = []
    shape: list[int] = []
    for e in right:
        group = e if isinstance(e, list) else [e]
        if e == _ELLIPSIS:
            order += ell
            shape += [sizes[n] for n in ell]
            continue
        names = [m for n in group for m in (ell if n == _ELLIPSIS else [n])]
        order += names
        shape.append(math.prod(sizes[n] for n in names))
    x = tensor.reshape([sizes[n] for n in elementary])
    perm = [elementary.index(n) for n in order]
    if perm != list(range(len(perm))):
        x = x.permute(perm)
    return x.reshape(shape)
