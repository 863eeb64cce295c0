"""``enabled(level="threads")``: full reductions in an order independent of the thread count
(Note [Thread-count independent reductions] in ``_ops.py``)."""

from __future__ import annotations

from ._mode import TransformAwareMode
from ._ops import REDUCTIONS


class ThreadsMode(TransformAwareMode):
    wants_nodes = False

    def on_op(self, func, types, args, kwargs, passthrough):
        r = REDUCTIONS.get(func)
        if r is not None:
            out = r(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)
