"""``check_deterministic``: run a function N times and report the first op whose output bits
differ, where the divergence was born.

Note [Hashing every op]
    Each run records, per op that reaches a plain tensor, the overload and a hash of its output
    bits (``TransformAwareMode``, so the ops our transforms emit are included). Run 0 keeps a
    reference to each output (a copy for in-place and view outputs, which later ops may change)
    and the hashes of each op's inputs (cached per tensor and version counter, so an input that
    is an earlier output costs a dict lookup). Later runs compare as they go; at the first
    mismatch the frames are live, so the user's line is read there, the outputs are diffed
    against run 0's copy (max abs and max ULP difference) and the op's inputs are hashed: if
    they differ too, the divergence came from outside the recorded ops (state mutated between
    runs, Python-side randomness), which ``inputs_differed`` says. Later runs stop hashing past
    the earliest divergence found so far.

Note [One-time setup is not recorded]
    Work done once per process or per cache happens inside run 0 only: the library's first-call
    probe (``_probe_above_python``, now run with the modes off), a rule's cached constant masks
    (``autodiff/linalg.py``'s ``_mask``), a user's memoised constants. Recorded in run 0 alone,
    such ops shifted every later position, and the first op of run 1 was compared with a setup
    op of run 0: "max abs diff inf, inputs identical" at the first op of every transformed
    function checked first in a process (seeded dropout under grad at its ``sin``; vmap, jvp,
    jacrev alike). Each run marks the ops with no input derived from the function's arguments
    (``setup``); where a later run's op differs from run 0's at a position, and run 0 has from
    there only such ops and then this op with the very same output bits, the later run lacks
    their construction and skips them (``shift``). Anything else is still reported where it
    differs: a constant that is built differently, an op that only one run has.
"""

from __future__ import annotations

import random
import sys
import traceback
from dataclasses import dataclass

import torch

from functransforms._compat import torch_pytree as pytree
from functransforms._core.ops import facts

from ._mode import TransformAwareMode


@dataclass(frozen=True)
class Divergence:
    """The first op whose outputs differed between two runs.

    Attributes:
        op: the ATen overload.
        position: its 0-based index in the sequence of recorded ops.
        location: the user's frame (``traceback.FrameSummary``), the forward line for an op of
            a backward pass.
        max_abs_diff: the largest absolute difference between the two runs' outputs (``inf``
            when shapes or the op itself differ).
        max_ulp_diff: the largest difference in units in the last place (floating outputs), or
            None.
        inputs_differed: True when the op's inputs already differed (the divergence was born
            outside the recorded ops, e.g. state mutated between runs).
        run: the index of the run that diverged from run 0.
        threads: (threads of run 0, threads of the diverging run).
        transform: the transform that introduced the op, or None.
    """

    op: object
    position: int
    location: traceback.FrameSummary | None
    max_abs_diff: float
    max_ulp_diff: int | None
    inputs_differed: bool
    run: int = 1
    threads: tuple = ()
    transform: str | None = None

    def __str__(self):
        loc = self.location
        where = (
            f"{loc.filename}:{loc.lineno}" + (f" ({loc.line})" if loc.line else "") if loc else "?"
        )
        by = f", introduced by {self.transform}" if self.transform else ""
        thr = (
            f" with {self.threads[1]} thread(s) vs {self.threads[0]}"
            if self.threads and self.threads[0] != self.threads[1]
            else ""
        )
        born = (
            "its inputs already differed (state changed outside the recorded ops)"
            if self.inputs_differed
            else "its inputs were identical: the divergence was born here"
        )
        return (
            f"first divergence at op #{self.position} {self.op}{by} (run {self.run}{thr}) at "
            f"{where}: max abs diff {self.max_abs_diff:g}, max ULP diff {self.max_ulp_diff}; {born}"
        )


class DeterminismReport:
    """The result of ``check_deterministic``: ``identical`` and ``first_divergence``."""

    def __init__(self, runs, ops, divergence, threads):
        self.runs = runs
        self.ops = ops
        self.first_divergence: Divergence | None = divergence
        self.threads = threads

    @property
    def identical(self) -> bool:
        return self.first_divergence is None

    @property
    def thread_dependent(self) -> bool:
        d = self.first_divergence
        return d is not None and len(set(d.threads)) > 1

    def __bool__(self):
        return self.identical

    def __str__(self):
        thr = sorted(set(self.threads))
        t = f", threads {thr}" if len(thr) > 1 else ""
        if self.identical:
            return f"bitwise identical over {self.runs} runs ({self.ops} ops each{t})"
        return f"not deterministic over {self.runs} runs{t}: {self.first_divergence}"

    __repr__ = __str__


# -- hashing ------------------------------------------------------------------------------------


def _bits(t):
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def digest(t):
    """A checksum of a tensor's shape, dtype and bits (Note [Hashing every op]).

    The integer sum of the bits read as int64 words: any change of one word changes it, and an
    integer sum does not depend on the reduction order. One pass over memory, no copy for a
    contiguous tensor.
    """
    if not isinstance(t, torch.Tensor):
        return t if isinstance(t, (int, float, bool, type(None))) else type(t).__name__
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        return (tuple(t.shape), str(t.dtype))
    b = _bits(t)
    n8 = (b.numel() // 8) * 8
    h = int(b[:n8].view(torch.int64).sum()) if n8 else 0
    if n8 < b.numel():
        h = h * 1000003 + int((b[n8:].to(torch.int64) * _POS[: b.numel() - n8].to(b.device)).sum())
    return (tuple(t.shape), t.dtype, h)


_POS = torch.arange(1, 9, dtype=torch.int64)
_aten = torch.ops.aten
_UNINITIALIZED = frozenset(
    (
        _aten.empty.memory_format,
        _aten.empty_like.default,
        _aten.empty_strided.default,
        _aten.new_empty.default,
        _aten.new_empty_strided.default,
        _aten.empty_permuted.default,
    )
)


def _out_digest(out):
    if isinstance(out, (tuple, list)):
        return tuple(digest(o) for o in out)
    return digest(out)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for o in x for t in _tensors(o)]
    return []


def _geometry(out):
    return tuple((tuple(t.shape), t.stride(), t.storage_offset()) for t in _tensors(out))


def _ordered(bits, nbits):
    i = bits.to(torch.int64)
    mask = (1 << (nbits - 1)) - 1
    return torch.where(i < 0, -(i & mask), i)


_INT_OF = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def _diffs(a, b):
    """max abs and max ULP difference between two outputs (tensors or tuples of them)."""
    ta, tb = _tensors(a), _tensors(b)
    if len(ta) != len(tb):
        return float("inf"), None
    mad, mud = 0.0, None
    for x, y in zip(ta, tb):
        if x.shape != y.shape or x.dtype != y.dtype:
            return float("inf"), None
        if x.numel() == 0 or x.layout != torch.strided:
            continue
        x, y = x.detach().resolve_conj(), y.detach().resolve_conj()
        if x.is_complex():
            x, y = torch.view_as_real(x), torch.view_as_real(y)
        if x.dtype == torch.bool:
            x, y = x.to(torch.uint8), y.to(torch.uint8)
        d = (x.double() - y.double()).abs()
        d = torch.where(torch.isnan(x) & torch.isnan(y), 0.0, d)
        mad = max(mad, float(d.max()))
        if x.dtype.is_floating_point:
            size = x.element_size()
            it = _INT_OF[size]
            u = (
                _ordered(x.contiguous().view(it), size * 8)
                - _ordered(y.contiguous().view(it), size * 8)
            ).abs()
            mud = max(mud or 0, int(u.max()))
    return mad, mud


# -- the recording mode -------------------------------------------------------------------------


_DETACH = torch.ops.aten.detach.default


class HashMode(TransformAwareMode):
    def __init__(self, reference=None, limit=None):
        super().__init__()
        self.ref = reference  # run 0's HashMode, or None when this is run 0
        self.limit = limit  # stop comparing at this position (earliest divergence so far)
        self.ops = []
        self.hashes = []
        self.values = []  # run 0: outputs
        self.in_hashes = []  # run 0: input hashes per op
        self._cache = {}  # (id, version) -> hash, for tensors this run holds
        self._held = []
        self.divergence = None
        self.run = 0
        self.threads = ()
        # Note [One-time setup is not recorded]: each run marks the ops that only build
        # constants (no input derived from the function's arguments); a later run may skip
        # run 0's where it lacks them
        self.setup = []  # per op, True when it only builds a constant
        self._tainted = set()  # ids of the arguments and of every value derived from them
        self.shift = 0  # later runs: run 0's setup ops skipped so far

    def _in_hash(self, t):
        key = (id(t), t._version)
        h = self._cache.get(key)
        if h is None:
            h = self._cache[key] = digest(t)
            self._held.append(t)
        return h

    def _ins(self, args, kwargs):
        return tuple(self._in_hash(t) for t in _tensors(args) + _tensors(list(kwargs.values())))

    def on_op(self, func, types, args, kwargs, passthrough):
        f = facts(func)
        ref = self.ref
        pre = self._ins(args, kwargs) if f.written and (ref is None or self._comparing()) else None
        out = func(*args, **kwargs)
        if func is _DETACH:  # torch detaches factory outputs that run 0 still references
            if id(args[0]) in self._tainted:
                self._tainted.add(id(out))
                self._held.append(out)
            return out
        self.ops.append(func)
        self._note_setup(args, kwargs, out)
        if ref is not None and not self._comparing():
            return out
        if f.view:  # a view's bits are its input's: identify it by that and its geometry
            h = ("view", self._in_hash(args[0]), _geometry(out))
        elif func in _UNINITIALIZED:
            # Note [Uninitialized memory is not a divergence]: empty/empty_like hand back
            # whatever the allocator held, so their bits differ between runs by design (every
            # F.dropout on CPU draws into empty_like: seeded dropout was reported at its
            # buffer). Only the shape counts; an op that reads the garbage differs itself.
            h = ("uninitialized", _geometry(out))
        else:
            h = _out_digest(out)
        for i, t in enumerate(_tensors(out)):
            self._cache[(id(t), t._version)] = h if t is out else (h, i)
            self._held.append(t)
        if ref is None:  # run 0: keep what a later divergence needs
            self.hashes.append(h)
            self.in_hashes.append(pre if pre is not None else self._ins(args, kwargs))
            keep = None
            if not f.view:
                keep = out
                if f.written:
                    keep = pytree.tree_map(
                        lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, out
                    )
            self.values.append(keep)
            return out
        pos = len(self.ops) - 1 + self.shift  # run 0's numbering
        if pos >= len(ref.ops) or ref.ops[pos] is not func or h != ref.hashes[pos]:
            pos = self._skip_setup(func, h, pos)
        if pos >= len(ref.ops) or ref.ops[pos] is not func:
            self._diverge(func, pos, float("inf"), None, False, passthrough)
        elif h != ref.hashes[pos]:
            ins = pre if pre is not None else self._ins(args, kwargs)
            differed = ins != ref.in_hashes[pos]
            if f.view:
                mad, mud = float("inf"), None
            else:
                mad, mud = _diffs(ref.values[pos], out)
            self._diverge(func, pos, mad, mud, differed, passthrough)
        return out

    def _comparing(self):
        return self.divergence is None and (
            self.limit is None or len(self.ops) + self.shift < self.limit
        )

    def _note_setup(self, args, kwargs, out):
        tainted = self._tainted
        ins = _tensors(args) + _tensors(list(kwargs.values()))
        setup = not any(id(t) in tainted for t in ins)
        self.setup.append(setup)
        if not setup:
            outs = _tensors(out)
            tainted.update(id(t) for t in outs)
            self._held.extend(outs)  # held: their ids stay theirs

    def taint(self, args):
        """The function's arguments: every op on a value derived from them is no setup."""
        leaves = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
        self._tainted.update(id(t) for t in leaves)
        self._held.extend(leaves)

    def _skip_setup(self, func, h, pos):
        """Note [One-time setup is not recorded]: this op differs from run 0's at ``pos``;
        if run 0 has, from ``pos`` on, ops that only built constants (a cache filled in run 0:
        a rule's constant masks) followed by this op with these very output bits, this run
        lacks those constants' construction: skip them. Returns the position to compare at."""
        ref, j = self.ref, pos
        while j < len(ref.ops) and ref.setup[j]:
            if ref.ops[j] is func and ref.hashes[j] == h:
                break
            j += 1
        if j < len(ref.ops) and j > pos and ref.ops[j] is func and ref.hashes[j] == h:
            self.shift += j - pos
            return j
        return pos

    def _diverge(self, func, pos, mad, mud, inputs_differed, passthrough):
        loc, origin = self.where(sys._getframe(), passthrough)
        self.divergence = Divergence(
            func, pos, loc, mad, mud, inputs_differed, self.run, self.threads, origin
        )


# -- the public function ------------------------------------------------------------------------


def _rng_state():
    st = {"torch": torch.random.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        st["numpy"] = np.random.get_state()
    return st


def _set_rng_state(st):
    torch.random.set_rng_state(st["torch"])
    random.setstate(st["python"])
    if "cuda" in st:
        torch.cuda.set_rng_state_all(st["cuda"])
    if "numpy" in st:
        sys.modules["numpy"].random.set_state(st["numpy"])


def _copy(x):
    if isinstance(x, torch.Tensor):
        c = x.detach().clone()
        return c.requires_grad_() if x.requires_grad and x.is_leaf else c
    return x


def check_deterministic(fn, *args, runs=3, vary_threads=False, **kwargs):
    """Run ``fn(*args, **kwargs)`` ``runs`` times and report the first op that diverged.

    Every op's outputs are hashed in order (including the ops that transforms emit), so the
    report names where a divergence was *born*: the op, its position, the user's source line,
    the max abs and ULP difference of its outputs, and whether its inputs already differed.
    Each run gets fresh copies of the inputs (they are never mutated) and the same RNG state
    (torch CPU/CUDA, ``random``, numpy), so seeded randomness is not reported.

    Args:
        fn: the function (plain or transformed).
        *args, **kwargs: its arguments (pytrees of tensors are copied for every run).
        runs: how many runs with the current number of threads (at least 2).
        vary_threads: also run once with 1 thread (2 if the current count is 1) and report a
            thread-count dependence the same way.

    Returns:
        DeterminismReport: ``identical`` (bool), ``first_divergence`` (``Divergence`` or None).

    Example:
        >>> import torch, functransforms as ft
        >>> f = lambda x: (x.sin() * 2).sum()                 # [8] -> []
        >>> ft.deterministic.check_deterministic(f, torch.randn(8)).identical
        True
    """
    if not callable(fn):
        raise TypeError(
            f"check_deterministic(fn, *args, runs={runs}): expected a callable as fn, got "
            f"{type(fn).__name__}. Pass the function first, then its arguments."
        )
    if not isinstance(runs, int) or runs < 2:
        raise ValueError(
            f"check_deterministic(fn, *args, runs={runs!r}): expected runs >= 2 (a run is "
            "compared with the first), got {runs!r}. Use runs=3 (the default) or more."
        )
    cur = torch.get_num_threads()
    plan = [cur] * runs
    if vary_threads:
        plan.append(1 if cur > 1 else 2)
    rng = _rng_state()
    ref = None
    divergence = None
    try:
        for k, nthreads in enumerate(plan):
            a, kw = pytree.tree_map(_copy, (args, kwargs))
            _set_rng_state(rng)
            limit = None if divergence is None else divergence.position + 1
            mode = HashMode(ref, limit)
            mode.run = k
            mode.threads = (cur, nthreads)
            mode.taint((a, kw))
            torch.set_num_threads(nthreads)
            try:
                with mode:
                    fn(*a, **kw)
            finally:
                torch.set_num_threads(cur)
            if ref is None:
                ref = mode
                continue
            d = mode.divergence
            if d is None and len(mode.ops) + mode.shift != len(ref.ops) and (limit is None):
                d = Divergence(
                    None,
                    min(len(mode.ops) + mode.shift, len(ref.ops)),
                    None,
                    float("inf"),
                    None,
                    False,
                    k,
                    (cur, nthreads),
                )
            if d is not None and (divergence is None or d.position < divergence.position):
                divergence = d
    finally:
        torch.set_num_threads(cur)
    return DeterminismReport(len(plan), len(ref.ops) if ref else 0, divergence, tuple(plan))


def assert_deterministic(fn, *args, runs=3, vary_threads=False, **kwargs):
    """Raise ``AssertionError`` (the report as the message) unless ``fn`` is bitwise
    reproducible: ``check_deterministic`` for test suites and hypothesis properties.

    Example:
        >>> import torch, functransforms as ft
        >>> from functransforms.testing import assert_deterministic
        >>> assert_deterministic(ft.grad(lambda x: x.pow(3).sum()), torch.randn(4))   # [4] -> [4]
        bitwise identical over 3 runs (8 ops each)
    """
    report = check_deterministic(fn, *args, runs=runs, vary_threads=vary_threads, **kwargs)
    if not report.identical:
        raise AssertionError(str(report))
    return report
