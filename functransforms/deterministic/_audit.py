"""``audit``: every op of one run that is nondeterministic where it ran, or would be on CUDA."""

from __future__ import annotations

import contextlib
import sys
import traceback
from dataclasses import dataclass

import torch

from ._mode import TransformAwareMode
from ._table import entries_for


@dataclass(frozen=True)
class Finding:
    """One nondeterministic op met by ``audit``.

    Attributes:
        op: the ATen overload (``torch._ops.OpOverload``).
        device: the device it ran on (``"cpu"``, ``"cuda:0"``).
        reason: why it is nondeterministic; "nondeterministic on CUDA" when it ran elsewhere.
        alternative: torch's deterministic alternative and how to get it, or that it has none.
        transform: the transform that introduced the op (``"grad"``, ``"vmap"``, ...), or None
            for an op the user called.
        location: the user's frame (``traceback.FrameSummary``): for a transform's op, the
            line of the forward op that caused it.
        raises: True when ``torch.use_deterministic_algorithms(True)`` makes the op raise.
    """

    op: object
    device: str
    reason: str
    alternative: str
    transform: str | None
    location: traceback.FrameSummary | None
    raises: bool = False

    def __str__(self):
        loc = self.location
        where = f"{loc.filename}:{loc.lineno}" if loc else "<unknown>"
        by = f" (introduced by {self.transform})" if self.transform else ""
        return (
            f"{self.op} on {self.device}{by} at {where}: {self.reason}. "
            f"Alternative: {self.alternative}"
        )


class AuditReport:
    """The findings of one ``audit`` run (``report.findings``, a list of ``Finding``)."""

    def __init__(self):
        self.findings: list[Finding] = []
        self.ops_seen = 0

    def __bool__(self):
        return bool(self.findings)

    def __len__(self):
        return len(self.findings)

    def __iter__(self):
        return iter(self.findings)

    def __str__(self):
        if not self.findings:
            return (
                f"audit: no nondeterministic op found ({self.ops_seen} ops recorded; none is "
                "nondeterministic on its device or on CUDA)."
            )
        rows = [("op", "device", "transform", "location")]
        for f in self.findings:
            loc = f.location
            where = f"{loc.filename.rsplit('/', 1)[-1]}:{loc.lineno}" if loc else "?"
            rows.append((str(f.op), f.device, f.transform or "-", where))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        fmt = lambda r: "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        lines = [
            f"audit: {len(self.findings)} nondeterministic op(s) in {self.ops_seen} ops",
            fmt(rows[0]),
        ]
        for r, f in zip(rows[1:], self.findings):
            lines.append(fmt(r))
            if f.location is not None and f.location.line:
                lines.append(f"      line: {f.location.line}")
            lines.append(f"      why: {f.reason}")
            lines.append(f"      alternative: {f.alternative}")
        return "\n".join(lines)

    __repr__ = __str__


def _device(args, kwargs):
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    return b.device
    for a in kwargs.values():
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


class AuditMode(TransformAwareMode):
    def __init__(self, report):
        super().__init__()
        self.report = report
        self._seen = set()  # (op, device, location, transform): one finding per source line

    def on_op(self, func, types, args, kwargs, passthrough):
        self.report.ops_seen += 1
        entries = entries_for(func)
        if entries:
            self._check(func, entries, args, kwargs, passthrough)
        return func(*args, **kwargs)

    def _check(self, func, entries, args, kwargs, passthrough):
        dev = _device(args, kwargs)
        for e in entries:
            if e.device != "any" and e.device != dev.type and not (e.device == "cuda"):
                continue
            if e.condition is not None:
                try:
                    if not e.condition(args, kwargs):
                        continue
                except Exception:  # an argument form the condition does not know: report it
                    pass
            here = e.device in ("any", dev.type)
            reason = e.reason if here else f"nondeterministic on CUDA: {e.reason}"
            loc, origin = self.where(sys._getframe(), passthrough)
            key = (func, str(dev), e.reason, loc and (loc.filename, loc.lineno), origin)
            if key in self._seen:
                continue
            self._seen.add(key)
            self.report.findings.append(
                Finding(func, str(dev), reason, e.alternative, origin, loc, e.raises)
            )


@contextlib.contextmanager
def _audit_cm():
    report = AuditReport()
    with AuditMode(report):
        yield report


def audit(fn=None, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` once and report every nondeterministic op.

    Records each op that is nondeterministic on the device it ran on and, wherever it ran, each
    op that would be nondeterministic (or raise under ``torch.use_deterministic_algorithms``) on
    CUDA, with the user's source line and, for ops a transform created (the backward of
    ``x[idx]`` under ``grad``, a batched form under ``vmap``), the line of the forward op and
    the transform. Also a context manager: ``with audit() as report: ...``.

    Args:
        fn: the function to run (plain, transformed, or calling ``nn.Module``s). Omit it to use
            ``audit()`` as a context manager.
        *args, **kwargs: its arguments.

    Returns:
        AuditReport: ``report.findings`` lists ``Finding(op, device, reason, alternative,
        transform, location)``; ``str(report)`` is a table.

    Example:
        >>> import torch, functransforms as ft
        >>> idx = torch.tensor([0, 2, 2])
        >>> loss = lambda x: x[idx].sum()  # [5] -> []
        >>> report = ft.deterministic.audit(ft.grad(loss), torch.randn(5))
        >>> f = report.findings[0]
        >>> (str(f.op), f.transform, f.location.line)
        ('aten.index_put.default', 'grad', 'loss = lambda x: x[idx].sum()  # [5] -> []')
    """
    if fn is None:
        if args or kwargs:
            raise TypeError(
                "audit(fn, *args, **kwargs): got arguments but no function. Pass the function "
                "first, or use `with ft.deterministic.audit() as report:` without arguments."
            )
        return _audit_cm()
    if not callable(fn):
        raise TypeError(
            f"audit(fn, *args, **kwargs): expected a callable as fn, got {type(fn).__name__}. "
            "Use `audit(f, x)` or `with audit() as report: f(x)`."
        )
    report = AuditReport()
    with AuditMode(report):
        fn(*args, **kwargs)
    return report
