"""Decompositions as the second line of rules.

Note [Decomposition fallback]
    An op with no rule of its own is rewritten with torch's decomposition table
    (``torch._decomp``) when it has an entry: the decomposition runs on the original arguments,
    so each op it emits dispatches back through the transforms and hits their rules. The table is
    imported on the first miss only, so the common path pays nothing for it (cold start).
"""

from __future__ import annotations

_TABLE = None
_CACHE: dict = {}


def decomposition(func):
    """torch's decomposition of ``func``, or None."""
    d = _CACHE.get(func, False)
    if d is False:
        global _TABLE
        if _TABLE is None:
            from torch._decomp import decomposition_table

            _TABLE = decomposition_table
        d = _CACHE[func] = _TABLE.get(func)
    return d
