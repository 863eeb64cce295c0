"""What a replayed ``jit`` graph cannot see, found while tracing (Note [Replay guards]).

Note [Replay guards]
~~~~~~~~~~~~~~~~~~~~
A recorded graph holds ATen ops. Python-level state that ``f`` reads or writes is not an op,
so a replay would silently keep the first call's answer. Three kinds are found while tracing:

* calls that read or write autograd or host state (``print(x)``, ``torch.tensor([x[0]])``,
  ``requires_grad_()``, ``detach_()``, hooks, ``.grad``, ``.backward()``): the signature
  falls back to eager (Note [Jit fallbacks]), see ``host_reason``;
* tensors made outside the dispatcher from traced values (``nn.Parameter(x * 2)``): make_fx
  records them as constants, so every replay would return the first call's tensor (fallback,
  see ``untraced_constants``);
* an ``autograd.Function`` node that the call added to torch's graph of the results (a user's
  Function whose forward runs no op, or the node through which the library gives torch's
  autograd an op's statistics): the recorded ATen ops do not recreate it, so torch's autograd
  would differentiate another graph at a replay (fallback, see ``autograd_function_node``);
* state of the ``nn.Module``\\ s whose forward ran during the trace: their ``training`` flags
  and the identity of the parameters/buffers the graph captures become a guard of the cached
  entry (``ModuleWatch.guard``): ``model.eval()`` or ``model.weight = nn.Parameter(...)``
  retraces instead of replaying the train-mode graph or the old weight. A module that rebinds
  its own tensor attributes inside ``forward`` (``self.buf = self.buf * m + x``) falls back:
  the replay cannot repeat the assignment.

Python values read from closures or globals, and attributes of objects hashed by identity,
are not guarded: as in JAX they are frozen at trace time (docs/jit.md, "What the signature
does not see").
"""

from __future__ import annotations

import copy
import enum
import functools
import threading

import torch

from .. import _compat

_T = torch.Tensor
_torch_requires_grad = _compat.tensor_requires_grad

_PRINT = (
    "printing or formatting a tensor (`print(x)`, `str(x)`, `repr(x)`) reads its values on the "
    "host, and a replay would not run it"
)
_CTOR = (
    "builds a tensor from a list of tensors (`torch.tensor([x[0], ...])`), which copies their "
    "values on the host (use `torch.stack`)"
)
_AUTOGRAD = "a replayed ATen graph does not record autograd metadata"


def _has_traced(data, traced) -> bool:
    if isinstance(data, (list, tuple)):
        return any(_has_traced(d, traced) for d in data)
    return isinstance(data, _T) and traced((data,))


def _ctor(i):
    def why(args, kwargs, traced):
        data = args[i] if len(args) > i else kwargs.get("data")
        if isinstance(data, (list, tuple)) and _has_traced(data, traced):
            return _CTOR
        return None

    return why


def _on_traced(text):
    return lambda args, kwargs, traced: text if traced(args[:1]) else None


def _requires_grad_(args, kwargs, traced):
    want = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
    if bool(want) != _torch_requires_grad(args[0]):
        return f"`requires_grad_({want})` inside f: {_AUTOGRAD}"
    return None


def _set_requires_grad(args, kwargs, traced):
    if bool(args[1]) != _torch_requires_grad(args[0]):
        return f"`x.requires_grad = {args[1]}` inside f: {_AUTOGRAD}"
    return None


def _if_requires_grad(text):
    return lambda args, kwargs, traced: text if _torch_requires_grad(args[0]) else None


def _always(text):
    return lambda args, kwargs, traced: text


_GRAD_STATE = (
    "autograd rebinds on each backward (pass gradients to f as arguments, e.g. "
    "`[p.grad for p in params]`)"
)

# func (as a TorchFunctionMode receives it) -> why(args, kwargs, traced) -> reason or None
_HOST_STATE = {
    _T.tolist: _on_traced("`.tolist()` reads tensor values on the host"),
    _T.numpy: _on_traced("`.numpy()` reads tensor values on the host"),
    _T.__array__: _on_traced("converting to a NumPy array reads tensor values on the host"),
    _T.data_ptr: _on_traced("`.data_ptr()` depends on the memory of one call"),
    _T.__repr__: _on_traced(_PRINT),
    torch.tensor: _ctor(0),
    torch.as_tensor: _ctor(0),
    torch.asarray: _ctor(0),
    _T.new_tensor: _ctor(1),
    _T.requires_grad_: _requires_grad_,
    _T.requires_grad.__set__: _set_requires_grad,
    _T.detach_: _if_requires_grad(f"`detach_()` of a tensor that requires grad: {_AUTOGRAD}"),
    _T.retain_grad: _if_requires_grad(f"`retain_grad()` inside f: {_AUTOGRAD}"),
    _T.register_hook: _always(f"a tensor hook registered inside f: {_AUTOGRAD}"),
    _T.register_post_accumulate_grad_hook: _always(
        f"a tensor hook registered inside f: {_AUTOGRAD}"
    ),
    _T.grad.__get__: _always(f"reads `.grad`, a tensor that {_GRAD_STATE}"),
    _T.grad.__set__: _always("assigns `.grad`, Python state a replay would not assign"),
    _T.data.__set__: _always("assigns `.data`, Python state a replay would not assign"),
    _T.backward: _always(
        "runs `.backward()` inside f: it accumulates into `.grad` attributes, which a replay "
        "would not do"
    ),
}
_BACKWARD = (
    "runs `torch.autograd.backward` inside f: it accumulates into `.grad` attributes, which a "
    "replay would not do"
)


def host_reason(func, args, kwargs, traced) -> str | None:
    """Why a call seen by the watch's TorchFunctionMode makes the trace unfaithful, or None."""
    why = _HOST_STATE.get(func)
    if why is None:
        # torch.autograd.backward, named rather than referenced: library code never touches
        # torch's own autograd entry points (tests/package/test_invariants.py)
        if getattr(func, "__name__", None) == "backward":
            if getattr(func, "__module__", None) == "torch.autograd":
                return _BACKWARD
        return None
    return why(args, kwargs or {}, traced)


# Where an argument sits in its storage, which the signature leaves out (slices of one buffer
# at different offsets share a graph): read by f, it guards the entry (_entry_check).
_LAYOUT_READS = (_T.storage_offset, _T._base.__get__, _T._is_view)


class WatchFunctions(torch.overrides.TorchFunctionMode):
    """Calls that never reach the dispatcher: host reads (``tolist`` copies memory directly,
    ``print(x)``), autograd and ``.grad`` state (Note [Replay guards]); and whether ``f`` read
    where an argument sits in its storage (that then guards the entry)."""

    def __init__(self, watch, inputs, user_line):
        super().__init__()
        self.watch = watch
        self.user_line = user_line
        self.inputs = {id(t) for t in inputs}
        self.reads_layout = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.watch.reason is None:
            why = host_reason(func, args, kwargs, self.watch._traced)
            if why is not None:
                self.watch.reason = why, self.user_line()
        if func in _LAYOUT_READS and id(args[0]) in self.inputs:
            self.reads_layout = True
        return func(*args, **(kwargs or {}))


def fresh_storage(func, out, ptrs: set) -> None:
    """Record the storage of each new (non-aliasing) tensor ``func`` returned while tracing."""
    returns = func._schema.returns
    if any(r.alias_info is not None for r in returns):
        return
    for t in out if isinstance(out, (list, tuple)) else (out,):
        if type(t) is _T and t.layout is torch.strided:
            p = t.untyped_storage().data_ptr()
            if p:
                ptrs.add(p)


_LIFT = {torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift_fresh.default}


def untraced_constants(gm, ptrs: set) -> str | None:
    """A constant of the graph sharing memory with a tensor an op made while tracing was
    made from a traced value outside the dispatcher (``nn.Parameter(x * 2)``): every replay
    would return the first call's tensor. A captured tensor (a closure's, a module's) existed
    before the trace, so no op of the trace allocated its memory; a literal
    ``torch.tensor([1., 2.])`` is a constant only ``lift_fresh_copy`` reads."""
    for node in gm.graph.nodes:
        if node.op != "get_attr" or all(u.target in _LIFT for u in node.users):
            continue
        v = getattr(gm, node.target, None)
        if type(v) is not _T and isinstance(v, _T) and v.layout is torch.strided:
            kind = type(v).__name__
        elif type(v) is _T and v.layout is torch.strided:
            kind = "tensor"
        else:
            continue
        if v.untyped_storage().data_ptr() in ptrs:
            return (
                f"f makes a {kind} from a tensor it computed outside torch's dispatcher "
                "(`nn.Parameter(x)`, `Tensor._make_subclass`): the graph would hold the first "
                "call's tensor as a constant"
            )
    return None


# ------------------------------------------------------------------------------------------
# Modules


def autograd_node_mark() -> int:
    """torch's per-thread autograd node counter now: nodes made later have larger numbers."""
    with torch.enable_grad():
        return torch.zeros((), requires_grad=True).clone().grad_fn._sequence_nr()


def autograd_function_node(outputs, mark: int) -> str | None:
    """The class of an ``autograd.Function`` node that the trace added to torch's graph of
    ``outputs`` (made after ``autograd_node_mark()`` returned ``mark``), if any (Note [Replay
    guards]). The recorded graph holds the ATen ops run inside and around it, not the node: a
    replay gives torch's autograd another graph (the op whose outputs the node re-exposes,
    with its own derivative formula; or a ``detach``), and ``torch.autograd.grad`` of the
    result would be wrong, silently. The walk stops at the history made before the call."""
    done = set()
    todo = [t.grad_fn for t in outputs if isinstance(t, _T) and t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in done or node._sequence_nr() <= mark:
            continue
        done.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            return type(node).__name__.removesuffix("Backward")
        todo.extend(n for n, _ in node.next_functions)
    return None


def _tensor_attrs(m):
    d = vars(m)
    state = [("_parameters", k, v) for k, v in m._parameters.items()]
    state += [("_buffers", k, v) for k, v in m._buffers.items()]
    state += [("__dict__", k, v) for k, v in d.items() if isinstance(v, _T)]
    return state


class ModuleWatch:
    """Records the modules whose forward runs during a trace (global module hooks, this
    thread only), and a module that rebinds its tensor attributes inside its forward."""

    def __init__(self):
        self.seen = {}  # id -> module, in call order
        self.reason = None
        self._open = []
        self._thread = threading.get_ident()

    def __enter__(self):
        reg = torch.nn.modules.module
        self._handles = (
            reg.register_module_forward_pre_hook(self._pre),
            reg.register_module_forward_hook(self._post),
        )
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()

    def _pre(self, m, args):
        if threading.get_ident() != self._thread:
            return
        self.seen.setdefault(id(m), m)
        self._open.append([(w, k, id(v)) for w, k, v in _tensor_attrs(m)])

    def _post(self, m, args, out):
        if threading.get_ident() != self._thread or not self._open:
            return
        before = self._open.pop()
        after = [(w, k, id(v)) for w, k, v in _tensor_attrs(m)]
        if before != after and self.reason is None:
            changed = sorted({k for _, k, _ in set(before) ^ set(after)})
            self.reason = (
                f"{type(m).__name__}.forward rebinds its tensor attributes {changed} (a Python "
                "assignment a replay would not repeat; update the tensor in place instead, "
                "e.g. `self.buf.copy_(...)`)",
                f"{type(m).__module__}.{type(m).__qualname__}.forward",
            )

    def guard(self, captured_ids: set):
        """``check(tensors) -> bool``: every seen module has the ``training`` flag it had
        while tracing, and holds the same parameter/buffer/tensor attribute objects the
        graph captured. None when no module ran."""
        if not self.seen:
            return None
        glob, terms = {}, []
        for i, m in enumerate(self.seen.values()):
            glob[f"m{i}"] = m
            terms.append(f"m{i}.training is {bool(m.training)}")
            for j, (where, k, v) in enumerate(_tensor_attrs(m)):
                if id(v) in captured_ids:
                    glob[f"v{i}_{j}"] = v
                    if where == "__dict__":
                        terms.append(f"vars(m{i}).get({k!r}) is v{i}_{j}")
                    else:
                        terms.append(f"m{i}.{where}.get({k!r}) is v{i}_{j}")
        src = "lambda tensors: " + " and ".join(terms)
        return eval(compile(src, "<jit module guard>", "eval"), glob)  # noqa: S307 - our own code


# ------------------------------------------------------------------------------------------
# Random generators


def _device_of(args, kwargs):
    dev = kwargs.get("device")
    if dev is None:
        dev = next((a.device for a in args if isinstance(a, _T)), torch.device("cpu"))
    return torch.device(dev)


class RngWatch:
    """A replay draws from whatever state each generator has when it runs: faithful only if
    ``f`` itself never sets a generator's state (``torch.manual_seed(0)`` inside ``f``, a
    ``Generator.manual_seed``/``set_state``, vmap's chunked ``randomness='same'``, which
    rewinds the generator between chunks). Each generator's state is taken after each random
    op of the trace; the next op (and the end of the trace, for the default generators) must
    find it unchanged. Only the trace pays (a CPU state is ~5 kB)."""

    def __init__(self, user_line):
        self.expected = {}  # key -> (generator or device, state)
        cpu = torch.device("cpu")
        self.expected["cpu"] = (cpu, self._state(None, cpu))
        self.reason = None
        self.first = []  # (explicit generator, its state when the trace first drew from it)
        self._user_line = user_line

    def __enter__(self):
        # The seeding functions are looked up on their modules at call time: wrapped while
        # any thread traces, they name a seed that leaves the state as it was
        # (`torch.manual_seed(0)` in f right after the caller's own), which no state shows.
        self._outer = getattr(_seeding, "watch", None)
        _seeding.watch = self
        with _seeding_lock:
            if not _seeding_users:
                for mod, name in _SEEDERS:
                    fn = getattr(mod, name, None)
                    if fn is not None:
                        _seeding_saved.append((mod, name, fn))
                        setattr(mod, name, _seeding_wrapper(fn, f"{mod.__name__}.{name}"))
            _seeding_users.append(self)
        return self

    def __exit__(self, *exc):
        _seeding.watch = self._outer
        with _seeding_lock:
            _seeding_users.remove(self)
            if not _seeding_users:
                for mod, name, fn in _seeding_saved:
                    setattr(mod, name, fn)
                _seeding_saved.clear()

    @staticmethod
    def _state(gen, dev):
        with _compat.disable_current_modes():
            if gen is not None:
                return gen.get_state()
            if dev.type == "cuda":
                return torch.cuda.get_rng_state(dev)
            if dev.type == "cpu":
                return torch.get_rng_state()
            return None

    @staticmethod
    def _key(gen, dev):
        return id(gen) if gen is not None else str(dev)

    def before(self, args, kwargs) -> str | None:
        gen = kwargs.get("generator")
        dev = _device_of(args, kwargs)
        known = self.expected.get(self._key(gen, dev))
        if gen is not None and known is None:
            self.first.append((gen, self._state(gen, dev)))
        if known is not None and not _same_state(known[1], self._state(gen, dev)):
            return _RESEEDED
        return None

    def after(self, args, kwargs) -> None:
        gen = kwargs.get("generator")
        dev = _device_of(args, kwargs)
        self.expected[self._key(gen, dev)] = (
            gen if gen is not None else dev,
            self._state(gen, dev),
        )

    def restore(self) -> None:
        """Explicit generators as they were before a symbolic trace drew from them (it ran
        ``f``'s Python, a ``g.manual_seed(1)`` included; the default ones are restored by
        the caller)."""
        for gen, state in self.first:
            gen.set_state(state)

    def finish(self) -> tuple[str, str] | None:
        """The default generators' states at the end of the trace are those of the last draw."""
        for owner, state in self.expected.values():
            if isinstance(owner, torch.device) and not _same_state(state, self._state(None, owner)):
                return _RESEEDED, "f, after its last random draw"
        return None


_RESEEDED = (
    "f sets the state of a random generator (`torch.manual_seed`, `Generator.manual_seed`, "
    "`set_rng_state`, vmap's chunked randomness='same') besides drawing from it: a replay "
    "draws on from the state the previous call left"
)


_seeding = threading.local()  # .watch: the RngWatch of this thread's trace
_seeding_lock = threading.Lock()
_seeding_users = []  # the RngWatches of every thread's trace: wrapped while non-empty
_seeding_saved = []  # (module, name, original function)


def _seeding_wrapper(fn, name):
    @functools.wraps(fn)
    def seeding(*args, **kwargs):
        watch = getattr(_seeding, "watch", None)
        if watch is not None and watch.reason is None:
            watch.reason = (
                f"f calls `{name}`, which sets a random generator's state: a replay would "
                "not, and would draw on from the state the previous call left",
                watch._user_line(),
            )
        return fn(*args, **kwargs)

    return seeding


_SEEDERS = [
    (torch, "manual_seed"),
    (torch, "seed"),
    (torch, "set_rng_state"),
    (torch.random, "manual_seed"),
    (torch.random, "seed"),
    (torch.random, "set_rng_state"),
    (torch.cuda, "manual_seed"),
    (torch.cuda, "manual_seed_all"),
    (torch.cuda, "seed"),
    (torch.cuda, "seed_all"),
    (torch.cuda, "set_rng_state"),
    (torch.cuda, "set_rng_state_all"),
]


def _same_state(a, b) -> bool:
    if a is None or b is None:
        return a is b
    with _compat.disable_current_modes():
        return a.shape == b.shape and bool(torch.equal(a, b))


# ------------------------------------------------------------------------------------------
# Outputs


class Fresh:
    """A mutable non-tensor output leaf (a set, a NumPy array, an object): eager ``f`` makes a
    new one per call, so each replay returns a copy, never the traced object itself."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = copy.deepcopy(value)  # the first call returned the traced object itself

    def copy(self):
        return copy.deepcopy(self.value)


_IMMUTABLE = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    range,
    frozenset,
    enum.Enum,
    type,
    torch.dtype,
    torch.device,
    torch.Size,
    torch.layout,
    torch.memory_format,
)


def mutable(c) -> bool:
    return not isinstance(c, _IMMUTABLE) and not callable(c)


# ------------------------------------------------------------------------------------------
# Call context: default device, autocast


def default_device():
    """The device of ``torch.set_default_device`` when the caller's TorchFunctionModes are
    only torch's default-device ones, else None (another mode must see f's own calls: ``f``
    runs eagerly). Factories inside ``f`` follow it, so it joins the signature."""
    modes = _compat.function_mode_stack()
    if modes and all(type(m) is _compat.device_context_class() for m in modes):
        return str(modes[-1].device)
    return None


def autocast_state():
    """None outside ``torch.autocast``; else what a graph traced inside it depends on (the
    casts are recorded ops). Checked per call only by entries traced under autocast; a graph
    traced outside replays under autocast with autocast applied to each ATen op."""
    if not _compat.is_any_autocast_enabled():
        return None
    devices = ("cpu", "cuda")
    state = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices]
    return tuple(state), torch.is_autocast_cache_enabled()


# ------------------------------------------------------------------------------------------
# Entry checks

# A signature holds several guarded entries (one per module state, aliasing pattern, ...);
# a bound keeps a loop that rebinds a weight on every call from keeping every old graph.
_MAX_GUARDED = 8


def _alias_pattern(tensors):
    seen = {}
    return tuple(seen.setdefault(t.untyped_storage().data_ptr(), i) for i, t in enumerate(tensors))


def _layout(tensors):
    return tuple([(t.storage_offset(), t._base is None) for t in tensors])


def _entry_check(alias, layout, modules, autocast=None):
    """``check(tensors) -> bool`` for what a replay depends on beyond the signature, checked
    per call only for entries that need it: the arguments' aliasing when the graph writes
    into one (a write through one alias is seen through the other), their storage offsets
    and view-ness when ``f`` read them, the module state (Note [Replay guards]) and the
    autocast state it was traced under. None if nothing needs checking."""
    checks = []
    if alias is not None:
        checks.append(lambda ts: _alias_pattern(ts) == alias)
    if layout:
        checks.append(lambda ts: _layout(ts) == layout)
    if modules is not None:
        checks.append(modules)
    if autocast is not None:
        checks.append(lambda ts: autocast_state() == autocast)
    if not checks:
        return None
    if len(checks) == 1:
        return checks[0]
    return lambda ts: all([c(ts) for c in checks])
