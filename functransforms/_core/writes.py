"""The physical value an in-place op under vmap writes into, for the levels below it.

Note [Physical roots of writes under vmap]
    A vmap rule of an in-place op often writes through a view of the target's physical value:
    the pointwise rule moves a batch dim that is not in front (``movedim``), index_put_ and
    scatter_ rules do the same. It makes that view below torch's autograd, so the view has no
    ``_base``: a grad level below that sees a write of a value it tracks into the view
    (``x.clone().add_(w)`` under ``grad(vmap(f, in_dims=1))``) found a plain tensor whose memory
    something else shares, and refused to promote it (InplaceError, where torch's own vmap
    computes).
    The vmap level names the physical value it hands to the rule while the rule runs
    (`writing_into`); a level promoting a plain target without ``_base`` takes that value as
    the target's base when they share a storage (`physical_root`), so the value and the view
    are promoted together, as for a view the user made. When the target is itself a batched
    view (``h[1:].copy_(w)``), the named value is its base's physical value and the target's
    own physical value is named as an alias: both are promoted as views of it, so the vmap
    level's wrappers read the promoted values. Any other alias still alive (another batched
    view of the same value) keeps the refusal: promotion would leave it stale.
"""

from __future__ import annotations

import threading

import torch

_state = threading.local()


def physical_root(target: torch.Tensor):
    """``(root, aliases)``: the physical value the running vmap rule writes into and the
    physical views of it the vmap level holds, when ``target`` is a view of that value
    without ``_base`` (same storage); else None."""
    named = getattr(_state, "named", None)
    if named is None:
        return None
    root, aliases = named
    if root is target or type(root) is not torch.Tensor or root._base is not None:
        return None
    if root.untyped_storage()._cdata != target.untyped_storage()._cdata:
        return None
    return root, aliases


class writing_into:
    """While a vmap rule of an in-place op runs: the physical value it writes into (``root``)
    and the physical views of it that the vmap level holds (``aliases``: the target's own
    physical value when the target is a batched view)."""

    __slots__ = ("named", "prev")

    def __init__(self, root, aliases=()):
        self.named = (root, aliases)

    def __enter__(self):
        self.prev = getattr(_state, "named", None)
        _state.named = self.named

    def __exit__(self, *exc):
        _state.named = self.prev
