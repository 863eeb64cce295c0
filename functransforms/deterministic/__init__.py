"""Deterministic-algorithm checks that understand transforms (docs/determinism.md).

- ``audit(fn, *args)`` / ``with audit() as report``: every nondeterministic op of one run (on
  its device, or on CUDA), with the user's line and the transform that introduced it.
- ``check_deterministic(fn, *args, runs=3, vary_threads=False)``: the first op whose output
  bits differ between runs, where the divergence was born.
- ``enabled()`` / ``enable()`` / ``disable()``: our rules use deterministic formulations
  (also when ``torch.are_deterministic_algorithms_enabled()``); ``level="threads"`` also makes
  full reductions independent of the thread count.
"""

from __future__ import annotations

import contextlib

from ._ops import _flags, active, check_level

# Note [Lazy parts of the package]: the rules import this package for ``_ops`` (the mode flag
# and ``det_call``) at ``import functransforms``; the audit, the checker and the table (~1.4k
# objects, ~3 ms) load at first use, so a process that never audits does not pay for them
# (cold start, docs/performance.md). ``from functransforms.deterministic import audit`` works.
_LAZY = {
    "AuditReport": "._audit",
    "Finding": "._audit",
    "audit": "._audit",
    "DeterminismReport": "._check",
    "Divergence": "._check",
    "check_deterministic": "._check",
    "TABLE": "._table",
    "ThreadsMode": "._threads",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(
        importlib.import_module(module, __name__), "ENTRIES" if name == "TABLE" else name
    )
    globals()[name] = value  # later reads skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AuditReport",
    "DeterminismReport",
    "Divergence",
    "Finding",
    "TABLE",
    "audit",
    "check_deterministic",
    "disable",
    "enable",
    "enabled",
    "is_enabled",
]


def is_enabled() -> bool:
    """True when our rules use deterministic formulations (ours or torch's flag is on)."""
    return active()


def enable(level: str = "default") -> None:
    """Turn deterministic mode on until ``disable()`` (this thread).

    Args:
        level: ``"default"``: our batching and derivative rules never use an accumulating
            scatter whose result depends on the run. ``"threads"``: also full reductions to a
            scalar (sum, mean, dot, vector norms) use a fixed-order blocked reduction, so
            results do not depend on the thread count.
    """
    check_level(level, f"enable(level={level!r})")
    disable()
    _flags.level = level
    if level == "threads":
        from ._threads import ThreadsMode

        m = ThreadsMode()
        m.__enter__()
        _flags.modes.append(m)


def disable() -> None:
    """Turn off what ``enable`` turned on (torch's own flag is left as it is)."""
    while _flags.modes:
        _flags.modes.pop().__exit__(None, None, None)
    _flags.level = None


@contextlib.contextmanager
def enabled(level: str = "default"):
    """Deterministic mode inside a ``with`` block (see ``enable``).

    Example:
        >>> import torch, functransforms as ft
        >>> idx = torch.tensor([0, 2, 2])
        >>> with ft.deterministic.enabled():
        ...     g = ft.grad(lambda x: x[idx].sum())(torch.ones(4))   # [4] -> [4]
        >>> g
        tensor([1., 0., 2., 0.])
    """
    check_level(level, f"enabled(level={level!r})")
    prev = _flags.level
    _flags.level = level if prev != "threads" else prev
    try:
        if level == "threads" and prev != "threads":
            from ._threads import ThreadsMode

            with ThreadsMode():
                yield
        else:
            yield
    finally:
        _flags.level = prev
