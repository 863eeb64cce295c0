"""``jit``: trace a (transformed) function once per call signature, replay the ATen graph.

Note [Trace and replay]
~~~~~~~~~~~~~~~~~~~~~~~
The tracer is the innermost dispatch mode and traces through our wrapper subclasses
unmodified: a wrapper's ``__torch_dispatch__`` unwraps and runs ordinary ops on what it holds,
and those ops reach the tracer's mode, so the graph of ``vmap(grad(loss))`` holds only plain
ATen ops, no transform machinery. Replaying that graph costs what the ops cost plus one Python
call per op.

* A static trace is recorded by ``Recorder`` (Note [Recording static traces], ``_record.py``):
  ``f`` runs once for real, its outputs are the first call's result (nothing runs twice, side
  effects happen once) and every host-side check of the library (vmap's ``randomness='error'``
  RNG snapshot, shape checks) behaves as eagerly. It builds the graph make_fx's real mode built,
  op for op, without importing torch's symbolic-shapes stack (~1 s of a process's first call).
* ``dynamic=True`` traces with ``make_fx`` and symbolic shapes (fake tensors, nothing runs);
  the first result comes from replaying the graph. The shape environment's guards are compiled
  into one expression checked per call, so one graph serves every batch size that satisfies
  them.

Note [Jit fallbacks]
~~~~~~~~~~~~~~~~~~~~
A graph replays faithfully only if nothing in ``f`` depended on tensor *values* on the host.
``_Watch``, a dispatch mode pushed on top of the tracer's for the duration of the trace, sees the
user's ops and records the first one that reads values (``.item()``, ``bool(x)``,
``torch.equal``; tag ``data_dependent_output``) or makes a data-dependent shape (``nonzero``,
``masked_select``, boolean indexing; tag ``dynamic_output_shape``), with the user's source line,
and a change of grad mode around tensors that require grad (``torch.no_grad()`` blocks and
``autograd.Function`` inside ``f``: a replayed ATen graph would not keep them). A scan of the
finished graph is the safety net for ops issued deeper down. Such a signature is recorded as
*eager*: ``f`` runs as is for it from then on, with one ``JitFallbackWarning``; no graph that
would replay wrongly is ever cached. A static trace has already computed the right result
(data-dependent reads return real values), so the first call is not run twice.
"""

from __future__ import annotations

import collections
import functools
import linecache
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .. import _compat
from .._core import compiling as _compiling
from .._core import levels as _core
from .._pytree import tree_flatten, tree_unflatten
from ..errors import JitFallbackWarning
from ._buffers import Spares, call_with_buffers, replay_target, with_output_buffers
from ._guards import (
    _MAX_GUARDED,
    Fresh,
    ModuleWatch,
    RngWatch,
    WatchFunctions,
    _alias_pattern,
    _entry_check,
    _layout,
    autocast_state,
    autograd_function_node,
    autograd_node_mark,
    default_device,
    fresh_storage,
    mutable,
    untraced_constants,
)
from ._passes import _clean, _for_inductor, _impure, _roots
from ._record import Recorder, RecordError
from ._signature import (
    _TENSOR,
    _dict_orders,
    _dyn_tensor_key,
    _globals_key,
    _leaf_key,
    _rebuild_flat,
    _rebuild_walked,
    _tensor_key,
    _walk,
)

__all__ = ["jit", "CacheInfo"]

_Tensor = torch.Tensor
_DDO = torch.Tag.data_dependent_output
_DYN = torch.Tag.dynamic_output_shape
_RANDOM = torch.Tag.nondeterministic_seeded
aten = torch.ops.aten


class CacheInfo(NamedTuple):
    """Counters of a jitted function (``jitted.cache_info()``).

    ``hits``: calls served by replaying a cached graph. ``misses``: calls that traced a new
    signature. ``fallbacks``: calls that ran ``f`` eagerly because their signature cannot be
    traced faithfully (the first of them is also a miss). ``currsize``: signatures cached
    (graphs and eager markers), at most ``maxsize``.
    """

    hits: int
    misses: int
    fallbacks: int
    maxsize: int
    currsize: int


class _Tracing(threading.local):
    active = False


_tracing = _Tracing()
_TRACE_LOCK = threading.RLock()  # Note [One trace at a time]
_EAGER = object()  # cache value of a signature that runs eagerly (Note [Jit fallbacks])


# ------------------------------------------------------------------------------------------
# Signatures


# torch's own flag, not a grad wrapper's Python-level one (Note [requires_grad and grad_fn
# inside grad], autodiff/reverse.py)
_torch_requires_grad = _compat.tensor_requires_grad


# ------------------------------------------------------------------------------------------
# The watch mode (Note [Jit fallbacks])

_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(p)) + os.sep
    for p in (torch.__file__, os.path.dirname(os.path.abspath(__file__)))  # functransforms/
) + tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (
        __import__("functransforms.autodiff", fromlist=["_"]),
        __import__("functransforms.batching", fromlist=["_"]),
    )
)


def _user_line() -> str:
    """The innermost frame outside torch and functransforms, as ``file:line: source``."""
    frame = sys._getframe(1)
    while frame is not None:
        fname = frame.f_code.co_filename
        if not fname.startswith("<") and not os.path.abspath(fname).startswith(_LIBRARY_DIRS):
            src = linecache.getline(fname, frame.f_lineno).strip()
            return f"{fname}:{frame.f_lineno} (in {frame.f_code.co_name}): {src}"
        frame = frame.f_back
    return "<unknown line>"


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _data_dependent(func, args) -> str | None:
    """Why replaying ``func`` could differ from running it, or None."""
    tags = func.tags
    if _DDO in tags or func is aten.is_nonzero.default:
        return "reads a tensor value on the host (`.item()`, `bool(x)`, `if x > 0:`)"
    if _DYN in tags:
        if func is aten.index.Tensor and not _bool_index(args):
            return None
        return "makes a tensor whose shape depends on tensor values"
    return None


class _Watch(_compat.UncompiledDispatchMode):
    """Sees the user's ops during a trace; records the first reason the trace is unfaithful."""

    def __init__(self, symbolic: bool, grad_mode: bool, tracked):
        super().__init__()
        self.symbolic = symbolic
        self.tracked = tracked  # tensor -> whether the tracer records it
        self.grad_mode = grad_mode
        self.reason = None
        self.devices = set()
        self.fresh = set()  # storages of the tensors the trace's ops made (real mode)
        self.rng = RngWatch(_user_line)  # Note [Replay guards]: f must not seed a generator

    def _traced(self, flat):
        for t in flat:
            if isinstance(t, _Tensor) and (isinstance(t, _core.TransformTensor) or self.tracked(t)):
                return True
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.reason is None:
            why = _data_dependent(func, args)
            if why is not None:
                flat = _compat.torch_pytree.arg_tree_leaves(*args, **kwargs)
                if self._traced(flat):
                    self.reason = f"{_op_name(func)} {why}", _user_line()
            elif torch.is_grad_enabled() != self.grad_mode:
                flat = _compat.torch_pytree.arg_tree_leaves(*args, **kwargs)
                if any(isinstance(t, _Tensor) and _torch_requires_grad(t) for t in flat):
                    self.reason = (
                        f"{_op_name(func)} runs with torch grad mode "
                        f"{'on' if torch.is_grad_enabled() else 'off'} inside f "
                        "(torch.no_grad()/enable_grad() or an autograd.Function) on tensors "
                        "that require grad; a replayed graph would not keep that region",
                        _user_line(),
                    )
        if _RANDOM in func.tags:
            why = self.rng.before(args, kwargs)
            if why is not None and self.reason is None:
                self.reason = why, _user_line()
            if self.symbolic:
                self._advance_rng(args, kwargs)
                out = func(*args, **kwargs)
            else:
                out = func(*args, **kwargs)
            self.rng.after(args, kwargs)
            return out
        out = func(*args, **kwargs)
        if not self.symbolic:
            fresh_storage(func, out, self.fresh)  # Note [Replay guards]: nn.Parameter(x * 2)
        return out

    def _advance_rng(self, args, kwargs):
        # Fake random ops draw nothing, so vmap's randomness='error' snapshot would not see
        # them. Advance the real generator (restored after the trace) so it does. An explicit
        # generator is left alone: vmap's snapshot is of the default ones, and nothing would
        # restore it.
        if kwargs.get("generator") is not None:
            return
        dev = kwargs.get("device")
        if dev is None:
            dev = next((a.device for a in args if isinstance(a, _Tensor)), torch.device("cpu"))
        dev = torch.device(dev)
        with _compat.disable_current_modes():
            torch.rand(1, device=dev)
        self.devices.add(dev.type)


def _proxy_tracked(t) -> bool:
    """Whether make_fx (a symbolic trace) records ``t``."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, has_proxy_slot

    mode = get_proxy_mode()
    return (mode is not None and has_proxy_slot(t, mode.tracer)) or _compat.is_fake_tensor(t)


def _op_name(func) -> str:
    return f"aten.{func.__name__}" if hasattr(func, "__name__") else str(func)


def _scan(gm) -> str | None:
    """The safety net behind ``_Watch``: a data-dependent op anywhere in the graph."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, _compat.OpOverload):
            args = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
            if node.target is aten.index.Tensor:
                args[1] = [
                    i.meta.get("val") if isinstance(i, torch.fx.Node) else i for i in node.args[1]
                ]
            why = _data_dependent(node.target, args)
            if why is not None:
                return f"{_op_name(node.target)} {why}", "inside the library (no user line)"
    return None


def _python_forward(gm, spares=None):
    """A flat Python function that runs the graph: each ATen op called through its C++ entry
    (``OpOverload._op``, ~0.7 us/op cheaper than ``torch.ops.aten.x.y(...)``), intermediates
    dropped after their last use, captured tensors bound as the live objects themselves;
    large buffers kept in ``spares`` across calls (Note [Large buffers reused across calls])."""
    glob = {}
    names = {}
    consts = {}

    def const(v):
        if (
            v is None
            or isinstance(v, (bool, int, str))
            or (isinstance(v, float) and v == v and v not in (float("inf"), float("-inf")))
        ):
            return repr(v)
        key = id(v)
        if key not in consts:
            consts[key] = f"_c{len(consts)}"
            glob[consts[key]] = v
        return consts[key]

    def arg(a):
        if isinstance(a, torch.fx.Node):
            return names[a]
        if isinstance(a, (list, tuple)):
            inner = ", ".join(arg(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{k!r}: {arg(v)}" for k, v in a.items()) + "}"
        return const(a)

    nodes = list(gm.graph.nodes)
    last_use = {}
    for i, node in enumerate(nodes):
        for inp in node.all_input_nodes:
            last_use[inp] = i
    params, body = [], []
    for i, node in enumerate(nodes):
        name = f"v{i}"
        names[node] = name
        if node.op == "placeholder":
            params.append(name)
            continue
        if node.op == "get_attr":
            glob[f"_a{i}"] = getattr(gm, node.target)
            body.append(f"{name} = _a{i}")
        elif node.op == "call_function":
            t = node.target
            fn = spares is not None and replay_target(node, spares, gm)
            fn = fn or node.meta.get("binding")  # Note [Replay through Python bindings]
            fn = fn or (t._op if isinstance(t, _compat.OpOverload) else t)
            glob[f"_f{i}"] = fn
            pieces = [arg(a) for a in node.args]
            pieces += [f"{k}={arg(v)}" for k, v in node.kwargs.items()]
            body.append(f"{name} = _f{i}({', '.join(pieces)})")
        elif node.op == "output":
            body.append(f"return {arg(node.args[0])}")
            break
        else:
            return gm.forward  # call_module/call_method: not made by make_fx; use FX's code
        dead = [names[n] for n in node.all_input_nodes if last_use.get(n) == i]
        if dead:
            body.append(" = ".join(sorted(set(dead))) + " = None")
    if any("binding" in n.meta for n in nodes):
        # Note [Replay through Python bindings]: no __torch_function__, as through _op
        glob["_no_torch_function"] = _compat.DisableTorchFunction
        body = ["with _no_torch_function():", *("    " + line for line in body)]
    src = f"def forward({', '.join(params)}):\n    " + "\n    ".join(body) + "\n"
    exec(compile(src, "<jit replay>", "exec"), glob)  # noqa: S102 - our own generated code
    fn = glob["forward"]
    fn.__jit_source__ = src
    return fn


# ------------------------------------------------------------------------------------------
# The jitted function


class _Entry:
    __slots__ = ("gm", "run", "out_spec", "out_consts", "guard", "n_out", "check")

    def __init__(self, gm, run, out_spec, out_consts, guard=None, check=None):
        self.gm = gm
        self.run = run
        self.out_spec = out_spec
        self.out_consts = out_consts  # None if every output leaf is a tensor
        self.guard = guard  # dynamic: the shape guard
        self.check = check  # None, or what the signature cannot hold (see _entry_check)


def _mutates_inputs(gm) -> bool:
    root = _roots(gm.graph)
    for node in gm.graph.nodes:
        t = node.target
        if node.op == "call_function" and isinstance(t, _compat.OpOverload):
            for a, arg in zip(t._schema.arguments, node.args):
                if a.alias_info is not None and a.alias_info.is_write:
                    if isinstance(arg, torch.fx.Node) and root.get(arg, arg).op == "placeholder":
                        return True
    return False


class Jitted:
    """The callable that :func:`jit` returns. See :func:`jit`."""

    def __init__(self, f, backend, dynamic, cache_size):
        self.f = f
        self.backend = backend
        self.dynamic = dynamic
        self.cache_size = cache_size
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._hits = self._misses = self._fallbacks = 0
        self._spares = Spares()  # Note [Large buffers reused across calls]
        functools.update_wrapper(self, f)

    def __repr__(self):
        name = getattr(self.f, "__qualname__", None)
        # a module's repr spans lines (every submodule): its class names it in one
        name = repr(name) if name is not None else f"<{type(self.f).__name__} object>"
        return f"jit({name}, backend={self.backend!r}, dynamic={self.dynamic})"

    # -- public helpers
    def cache_info(self) -> CacheInfo:
        """Hit/miss/fallback counters and the cache size (see :class:`CacheInfo`)."""
        size = sum(len(v) if isinstance(v, list) else 1 for v in self._cache.values())
        return CacheInfo(self._hits, self._misses, self._fallbacks, self.cache_size, size)

    def cache_clear(self) -> None:
        """Forget every traced signature, release the buffers kept for reuse (Note [Large
        buffers reused across calls]) and reset the counters."""
        self._cache.clear()
        self._spares.clear()
        self._hits = self._misses = self._fallbacks = 0

    def graph(self, *args, **kwargs) -> torch.fx.GraphModule:
        """The FX graph (plain ATen ops) that a call with these arguments replays.

        Traces (runs ``f`` once) if the signature is new. Raises ``ValueError`` if the
        signature runs eagerly (Note [Jit fallbacks]): there is no faithful graph.
        """
        key, tensors, rebuild = self._signature(args, kwargs)
        if key is None:
            raise ValueError(
                f"{self!r}.graph(...): an argument is not hashable, so f runs eagerly."
            )
        entry = self._lookup(key, tensors)
        if entry is None:
            self._misses += 1
            entry, _ = self._trace(key, tensors, rebuild)
        if entry is _EAGER:
            raise ValueError(
                f"{self!r}.graph(...): this call signature runs eagerly (it cannot be traced "
                "faithfully; the JitFallbackWarning said why), so there is no graph."
            )
        return entry.gm

    # -- calling
    def __call__(self, *args, **kwargs):
        if _core._state.stack or _tracing.active or _compat.len_torch_dispatch_stack():
            # Inside a transform, another trace, or a dispatch mode: run f as is (correct,
            # and the enclosing trace, if any, records its ops).
            return self.f(*args, **kwargs)
        modes = _compat.len_torch_function_stack()
        if modes and default_device() is None:
            # A TorchFunctionMode of the caller's sees each torch call of f; a replay makes
            # none. torch.set_default_device's mode is keyed instead (_signature).
            return self.f(*args, **kwargs)
        if not self.dynamic and not modes:
            # Fast paths of a hit: a flat tuple of plain tensors, else plain tensors and
            # str-keyed dicts of them (Note [Signature walk]).
            tensors = args
            if kwargs or not all([type(a) is _Tensor and not a.is_nested for a in args]):
                walked = _walk(args, kwargs)
                tensors = None if walked is None else walked[2]
            if tensors is not None:
                if tensors is args:
                    key = (_globals_key(), None, None, tuple(map(_tensor_key, args)))
                else:
                    key = (_globals_key(), walked[0], walked[1], tuple(map(_tensor_key, tensors)))
                entry = self._cache.get(key)
                if entry.__class__ is list:  # guarded entries (Note [Replay guards])
                    for e in entry:
                        if e.check(tensors):
                            entry = e
                            break
                    else:
                        entry = None
                if entry.__class__ is _Entry:  # a plain entry is never guarded (_store)
                    try:
                        self._cache.move_to_end(key)
                    except KeyError:  # another thread's _store evicted it since the get
                        pass
                    self._hits += 1
                    out = entry.run(*tensors)
                    if entry.out_spec is None:
                        return out[0]
                    return self._unflatten(entry, out)
        key, tensors, rebuild = self._signature(args, kwargs)
        if key is None:
            self._fallbacks += 1
            return self.f(*args, **kwargs)
        entry = self._lookup(key, tensors)
        if entry is _EAGER:
            self._fallbacks += 1
            return self.f(*args, **kwargs)
        if entry is not None:
            self._hits += 1
            out = entry.run(*tensors)
            if entry.out_spec is None:
                return out[0]
            return self._unflatten(entry, out)
        self._misses += 1
        entry, result = self._trace(key, tensors, rebuild)
        return result

    @staticmethod
    def _unflatten(entry, out):
        leaves = out
        if entry.out_consts is not None:
            it = iter(out)
            leaves = [
                next(it) if c is _TENSOR else c.copy() if c.__class__ is Fresh else c
                for c in entry.out_consts
            ]
        return tree_unflatten(entry.out_spec, leaves)

    def _signature(self, args, kwargs):
        """``(key, tensor leaves, rebuild)``; key None if a leaf is not hashable."""
        walked = _walk(args, kwargs)
        if walked is not None:
            # Plain tensors and dicts of them (Note [Signature walk]): the key holds the
            # structure tokens in place of (pytree spec, non-tensor leaves).
            spec, consts, tensors = walked
            tkey = _dyn_tensor_key if self.dynamic else _tensor_key
            key = (_call_context(), spec, consts, tuple(map(tkey, tensors)))
            if spec is None:
                return key, tensors, _rebuild_flat
            return key, tensors, functools.partial(_rebuild_walked, spec, consts)
        leaves, spec = tree_flatten((args, kwargs))
        tensors, consts = [], []
        for x in leaves:
            if isinstance(x, _Tensor):
                if x.is_nested:  # make_fx does not trace nested tensors: run f as is
                    return None, None, None
                tensors.append(x)
                consts.append(_TENSOR)
            else:
                k = _leaf_key(x)
                if k is None:
                    return None, None, None
                consts.append(k)
        consts = tuple(consts)
        values = [None if isinstance(x, _Tensor) else x for x in leaves]
        tkey = _dyn_tensor_key if self.dynamic else _tensor_key
        orders = tuple(_dict_orders((args, kwargs)))
        key = (_call_context(), (spec, orders), consts, tuple(map(tkey, tensors)))

        def rebuild(ts):
            it = iter(ts)
            leaves = [next(it) if c is _TENSOR else v for c, v in zip(consts, values)]
            return tree_unflatten(spec, leaves)

        return key, tensors, rebuild

    def _lookup(self, key, tensors):
        entry = self._cache.get(key)
        if entry is None:
            return entry
        try:
            self._cache.move_to_end(key)
        except KeyError:  # another thread's _store evicted it since the get: still valid
            pass
        if entry is _EAGER:
            return entry
        if isinstance(entry, list):  # guarded graphs (shapes, module state, aliasing)
            for e in entry:
                if (e.guard is None or e.guard(tensors)) and (e.check is None or e.check(tensors)):
                    return e
            return None
        if entry.check is not None and not entry.check(tensors):
            return None
        return entry

    def _store(self, key, entry):
        # Guarded entries (dynamic, or with a check) live in a list per signature; a plain
        # entry has no check, which is what the fast path of __call__ relies on.
        if entry is not _EAGER and (self.dynamic or entry.check is not None):
            lst = self._cache.get(key)
            if not isinstance(lst, list):
                lst = self._cache[key] = []
            lst.append(entry)
            del lst[:-_MAX_GUARDED]
        else:
            self._cache[key] = entry
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_size:
            try:
                self._cache.popitem(last=False)
            except KeyError:  # emptied by another thread's cache_clear
                break

    # -- tracing
    def _trace(self, key, tensors, rebuild):
        # Note [One trace at a time]: torch's tracer (make_fx, dynamic=True) keeps its patcher
        # in a module global and patches nn.Module methods process-wide: two threads' first
        # calls of jitted functions raised "CURRENT_PATCHER is None" in torch.fx. Our recorder
        # needs no lock, but the watch's hooks and seeding wrappers are process-wide too.
        # Misses only; a jitted f called while tracing runs as is (_tracing.active), so the
        # lock never nests across threads.
        if not _compiling.DYNAMO_KEPT_OUT and "torch._dynamo" in sys.modules:
            _compiling.keep_dynamo_out()  # our modes' frames too (_compat.UncompiledDispatchMode)
        with _TRACE_LOCK:
            mark = _compat.fx_source_mark()
            try:
                entry, result = self._trace_locked(key, tensors, rebuild)
            except BaseException:
                _compat.forget_fx_sources(_compat.fx_sources_since(mark))
                raise
            # Note [Sources of dropped graphs]: torch.fx keeps the source of each graph it
            # compiles (two per trace) for good, so a signature evicted and traced again grew
            # the process ~8 KB a time (2000 retraces: +8 MB). They go with the graph.
            keys = _compat.fx_sources_since(mark)
            if entry is _EAGER:
                _compat.forget_fx_sources(keys)
            elif keys:
                weakref.finalize(entry.gm, _compat.forget_fx_sources, keys)
            return entry, result

    def _trace_locked(self, key, tensors, rebuild):
        grad_mode = torch.is_grad_enabled()
        recorder = None if self.dynamic else Recorder()  # Note [Recording static traces]
        tracked = _proxy_tracked if recorder is None else recorder.tracked
        watch = _Watch(self.dynamic, grad_mode, tracked)
        box = {}

        def flat_fn(*ts):
            args, kwargs = rebuild(ts)
            box["functions"] = functions = WatchFunctions(watch, ts, _user_line)
            with watch, functions, watch.rng:
                out = self.f(*args, **kwargs)
            box["out"] = out
            leaves, spec = tree_flatten(out)
            box["spec"] = spec
            box["consts"] = [x if not isinstance(x, _Tensor) else _TENSOR for x in leaves]
            return [x for x in leaves if isinstance(x, _Tensor)]

        rng = _rng_state()
        node_mark = autograd_node_mark()
        alias = _alias_pattern(tensors)
        autocast = autocast_state()
        _tracing.active = True
        modules = ModuleWatch()
        try:
            with modules:
                if recorder is not None:
                    gm = recorder.run(flat_fn, tensors)
                else:
                    gm = _symbolic_trace(flat_fn, tensors)
        except Exception as e:  # noqa: BLE001 - classified below
            _tracing.active = False
            if not self.dynamic and not _trace_machinery_error(e):
                raise  # f itself raised, exactly as it would eagerly
            _set_rng_state(rng)
            watch.rng.restore()
            args, kwargs = rebuild(tensors)
            result = self.f(*args, **kwargs)  # raises f's own error, if it is one
            reason = (
                f"tracing raised {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                _user_line_of(e),
            )
            self._fallback(key, reason)
            return _EAGER, result
        finally:
            _tracing.active = False
        reason = watch.reason or watch.rng.reason or modules.reason or watch.rng.finish()
        reason = reason or _scan(gm)
        if reason is None and torch.is_grad_enabled():
            node = autograd_function_node(tree_flatten(box["out"])[0], node_mark)
            if node is not None:
                reason = (
                    f"torch's autograd graph of the result holds an autograd.Function node "
                    f"({node}) that a replayed ATen graph would not recreate",
                    "a call in f that no op records",
                )
        if reason is None and not self.dynamic:
            why = untraced_constants(gm, watch.fresh)
            reason = None if why is None else (why, "a call in f that no op records")
        if reason is None and self.dynamic:
            sym = (torch.SymInt, torch.SymFloat, torch.SymBool)
            if any(isinstance(c, sym) for c in box["consts"]):
                reason = ("f returns a Python number computed from a symbolic size", "its return")
        if self.dynamic:
            _set_rng_state(rng)
            watch.rng.restore()
        if reason is not None:
            self._fallback(key, reason)
            if self.dynamic:  # nothing ran for real yet
                args, kwargs = rebuild(tensors)
                return _EAGER, self.f(*args, **kwargs)
            return _EAGER, box["out"]
        guard = _compile_guard(gm, len(tensors)) if self.dynamic else None
        captured = {id(getattr(gm, n.target)) for n in gm.graph.nodes if n.op == "get_attr"}
        check = _entry_check(
            alias if _mutates_inputs(gm) else None,
            box["functions"].reads_layout and _layout(tensors),
            modules.guard(captured),
            autocast,
        )
        autograd = grad_mode and any(
            isinstance(t, _Tensor) and _torch_requires_grad(t)
            for t in (
                *tensors,
                *(getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"),
            )
        )
        _clean(gm, self.dynamic, replay=self.backend is None, autograd=autograd)
        if self.backend == "inductor":
            run = _inductor(gm, tensors, self.dynamic, self._spares)
        elif callable(self.backend):
            run = self.backend(gm, tensors)
        else:
            run = _python_forward(gm, self._spares)
        spec = box["spec"]
        consts = [Fresh(c) if c is not _TENSOR and mutable(c) else c for c in box["consts"]]
        single = spec.num_leaves == 1 and spec.is_leaf() and consts[0] is _TENSOR
        entry = _Entry(
            gm,
            run,
            None if single else spec,
            None if all(c is _TENSOR for c in consts) else consts,
            guard,
            check,
        )
        self._store(key, entry)
        if self.dynamic:  # nothing ran for real: the first result is the first replay
            out = run(*tensors)
            return entry, out[0] if entry.out_spec is None else self._unflatten(entry, out)
        # The real trace already ran f: its result, not a run of the compiled graph, which
        # would write into arguments and captured buffers, and draw random numbers, twice.
        return entry, box["out"]

    def _fallback(self, key, reason):
        self._fallbacks += 1
        self._store(key, _EAGER)
        what, where = reason
        warnings.warn(
            f"{self!r}: this call signature runs eagerly from now on, because the trace cannot "
            f"be replayed faithfully: {what}, at {where}. Make the value a Python argument (it "
            "becomes part of the signature), or compute the data-dependent part outside jit.",
            JitFallbackWarning,
            stacklevel=4,
        )


def _call_context():
    """What the signature holds of the caller's state (the fast path of ``__call__`` takes
    ``_globals_key()`` alone: it runs only when no TorchFunctionMode is active)."""
    if _compat.len_torch_function_stack():
        return _globals_key(), default_device()
    return _globals_key()


def _inductor(gm, tensors, dynamic, spares):
    """Inductor on the cleaned graph. Static shapes go straight to ``compile_fx`` (what
    ``torch.compile`` calls after dynamo): no dynamo guards per call, ~30 us less on small
    workloads. Symbolic graphs, or a graph compile_fx refuses, go through ``torch.compile``."""
    _for_inductor(gm)
    if not dynamic:
        # Note [Large buffers reused across calls]: large outputs written into our buffers.
        grads = torch.is_grad_enabled() and any(
            t.requires_grad
            for t in (
                *tensors,
                *(getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"),
            )
            if isinstance(t, torch.Tensor)
        )
        gm_bufs, plan = with_output_buffers(gm, _roots(gm.graph), grads, _impure)
        if plan is not None:
            try:
                bufs = [torch.empty_strided(sz, st, dtype=dt) for sz, st, dt in plan[0]]
                compiled = _compat.compile_fx(gm_bufs, [*tensors, *bufs])
                return call_with_buffers(compiled, plan, spares, gm_bufs)
            except Exception as e:  # noqa: BLE001 - the plain graph below still compiles
                warnings.warn(
                    f"jit: inductor refused the graph writing large outputs into kept buffers "
                    f"({e}); compiling it without",
                    stacklevel=2,
                )
        try:
            return _compat.compile_fx(gm, list(tensors))
        except Exception as e:  # noqa: BLE001 - the general path below still works
            warnings.warn(
                f"jit: inductor's compile_fx refused the graph ({e}); using torch.compile",
                stacklevel=2,
            )
    return torch.compile(gm, backend="inductor", dynamic=dynamic)


def _symbolic_trace(flat_fn, tensors):
    """``make_fx`` with symbolic shapes (``dynamic=True``)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(
        flat_fn,
        # An explicit (empty) table: torch >= 2.15 otherwise rewrites `detach` to nothing, and
        # a replay would let gradients through `x.detach()`.
        decomposition_table={},
        tracing_mode="symbolic",
        _error_on_data_dependent_ops=False,
        # captured tensors (a module's weights) stay real: constants of the graph
        _allow_non_fake_inputs=True,
    )(*tensors)


def _trace_machinery_error(e) -> bool:
    """True if ``e`` is the tracer failing to trace, not ``f`` failing to run."""
    if isinstance(e, RecordError):
        return True
    mod = type(e).__module__ or ""
    return mod.startswith(("torch.fx", "torch._subclasses", "torch._dynamo")) or "tracing" in str(e)


def _user_line_of(e) -> str:
    tb = e.__traceback__
    line = "<unknown line>"
    while tb is not None:
        fname = tb.tb_frame.f_code.co_filename
        if not fname.startswith("<") and not os.path.abspath(fname).startswith(_LIBRARY_DIRS):
            src = linecache.getline(fname, tb.tb_lineno).strip()
            line = f"{fname}:{tb.tb_lineno} (in {tb.tb_frame.f_code.co_name}): {src}"
        tb = tb.tb_next
    return line


def _rng_state():
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state):
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _compile_guard(gm, n):
    """One compiled Python expression over the inputs' sizes/strides (Note [Trace and replay])."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    shape_env = getattr(gm, "shape_env", None)
    placeholders = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    code = None
    if shape_env is not None:
        code = shape_env.produce_guards_expression(placeholders, ignore_static=False)
    if not code:
        return lambda tensors: True
    src = compile(code.replace("L['", "").replace("']", ""), "<jit guard>", "eval")
    glob = dict(SYMPY_INTERP)

    def guard(tensors):
        return bool(eval(src, glob, {f"t{i}": t for i, t in enumerate(tensors)}))  # noqa: S307

    return guard


def jit(
    f: Callable | None = None,
    *,
    backend: str | Callable | None = None,
    dynamic: bool = False,
    cache_size: int = 64,
) -> Any:
    """Trace ``f`` once per call signature into a graph of ATen ops, and replay it.

    ``f`` is any composition of this library's transforms or a plain function of pytrees of
    tensors. The first call with a new *signature* (pytree structure; each tensor's shape,
    strides, dtype, device and requires_grad; the value of every non-tensor leaf; grad mode,
    default dtype and deterministic-algorithms mode) runs ``f`` once and records the ATen ops it
    issues; later calls with that signature replay the recorded graph,
    with no transform machinery left. See docs/jit.md.

    Args:
        f: the function to trace. Also usable as ``@jit`` or ``@jit(dynamic=True)``.
        backend: ``None`` replays the graph eagerly (op by op); ``"inductor"`` hands it to
            ``torch.compile``; a callable ``backend(graph_module, example_tensors)`` returns
            the function to call with the flat tensor arguments.
        dynamic: trace with symbolic shapes, so one graph serves every size that satisfies
            the shape guards met while tracing (e.g. every batch size).
        cache_size: how many signatures to keep (least recently used first out).

    Returns:
        A callable with ``f``'s signature, plus ``cache_info()``, ``cache_clear()`` and
        ``graph(*args, **kwargs)`` (the FX graph a call with those arguments replays).

    Example:
        >>> import torch, functransforms as ft
        >>> loss = lambda w, x: (x @ w).tanh().sum()
        >>> psg = ft.jit(ft.vmap(ft.grad(loss), in_dims=(None, 0)))
        >>> w, xs = torch.randn(3), torch.randn(8, 3)
        >>> psg(w, xs).shape                      # [8, 3]: traced, then the result
        torch.Size([8, 3])
        >>> torch.allclose(psg(w, xs), ft.vmap(ft.grad(loss), in_dims=(None, 0))(w, xs))
        True
        >>> psg.cache_info()
        CacheInfo(hits=1, misses=1, fallbacks=0, maxsize=64, currsize=1)
    """
    if backend not in (None, "eager", "inductor") and not callable(backend):
        raise ValueError(
            f"jit(f, backend={backend!r}): expected None (replay the graph), 'inductor' "
            "(torch.compile) or a callable backend(graph_module, example_tensors)."
        )
    if not isinstance(cache_size, int) or cache_size < 1:
        raise ValueError(f"jit(f, cache_size={cache_size!r}): expected a positive int.")
    if backend == "eager":
        backend = None

    def make(fn):
        if not callable(fn):
            raise TypeError(f"jit(f): expected a callable f, received {type(fn).__name__}.")
        return Jitted(fn, backend, dynamic, cache_size)

    return make if f is None else make(f)
