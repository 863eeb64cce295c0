"""Named axes across processes: ``pmap``'s collectives (``_collectives``, ``_collective_ops``,
``_pmap``; public as ``functransforms.psum``, ``functransforms.pmap``, ...) and local multi-process
runs, ``launch(fn, nprocs, *args)`` (``_launch``).

Design: docs/design/named-axes.md. User guide: docs/distributed.md. ``launch`` and
``WorkerError`` load on first access (Note [Lazy parts of the package], functransforms/__init__.py).
"""

from __future__ import annotations

__all__ = ["WorkerError", "launch"]


def __getattr__(name):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import _launch

    value = getattr(_launch, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
