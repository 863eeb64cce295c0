"""The transform core: levels, the interpreter stack, and the one routing path from the
dispatcher to the innermost interpreter.

Note [Levels]
    Every active transform call (one vmap, one jvp, one grad/vjp) pushes an interpreter with a
    fresh, strictly increasing level, and pops it on exit (also on exceptions). Values taking
    part in a level are wrapped in that level's tensor subclass. An op touching wrappers is
    processed by the interpreter with the highest level among its arguments; the interpreter
    unwraps *its own* level only and runs ordinary torch ops on what is inside, which may be
    wrappers of lower levels: that recursion is how transforms compose. Anything not wrapped at
    a level (captured from outside, created inside) is a constant at that level, so perturbation
    confusion cannot happen. Levels are never reused, so a wrapper that escapes its transform is
    recognised (its interpreter is dead) instead of being mistaken for a new level's value.
"""

from __future__ import annotations

import contextlib
import itertools
import threading

import torch

from .. import _compat
from ..errors import EscapedTracerError, TransformError
from .gcpause import collector_paused
from .ops import facts


class _State(threading.local):
    def __init__(self):
        self.stack: list[Interpreter] = []


_state = _State()
_level_counter = itertools.count(1)  # shared by all threads: levels are globally unique


class Interpreter:
    """One active transform call. Subclasses implement ``process`` (ops) and
    ``process_custom`` (custom functions): the two ways into rules."""

    name = "transform"
    stand_in = None  # Note [Values a custom function closes over under vmap] (_custom.py)

    def __init__(self):
        self.level = next(_level_counter)
        self.alive = True

    def process(self, func, args, kwargs):  # pragma: no cover - abstract
        """An ATen op ``func`` whose arguments hold this level's wrappers (and none of a
        higher level): unwrap this level, apply the rule, wrap the results."""
        raise NotImplementedError

    def process_custom(self, custom_fn, args):  # pragma: no cover - abstract
        """A call of a custom function (``custom_vjp``/``custom_jvp``/``custom_vmap``, an
        autograd.Function) with ``args`` holding this level's wrappers: Note [Custom rules
        across levels] (functransforms/_custom.py)."""
        raise NotImplementedError

    # Note [Entering is all or nothing]
    #     A ``with`` block's ``__exit__`` runs only if its ``__enter__`` returned. An exception
    #     raised inside an ``__enter__`` after it changed state (a KeyboardInterrupt from a
    #     signal handler lands at any call) left the level on this thread's stack, or a mode
    #     on torch's, for good: jit then ran eagerly forever, every op went through the mode.
    #     So each ``__enter__`` that does more than one step undoes what it did before
    #     re-raising. (Whatever lands inside ``__exit__`` before its first step cannot be
    #     caught there; functorch has the same windows, and fails an internal assert.)
    def __enter__(self):
        if _entry_pending:
            _install_entry()
        _state.stack.append(self)
        return self

    _on_exit = None

    def on_exit(self, fn):
        """Call ``fn()`` when this level exits, also on exceptions (e.g. restoring a user's
        tensor that an inner level handed over: Note [Writing into a plain tensor])."""
        if self._on_exit is None:
            self._on_exit = []
        self._on_exit.append(fn)

    def __exit__(self, *exc):
        popped = _state.stack.pop()
        if popped is not self:
            unwind_to(self, popped)
        self.alive = False
        if self._on_exit:
            for fn in reversed(self._on_exit):
                fn()
        return False

    def __repr__(self):
        return f"{type(self).__name__}(level={self.level})"


# Note [Entering through registered rules]
#     Every op on a wrapper enters the library through torch's C++ subclass dispatch
#     (``dispatch_on_subclass``). Since torch 2.10 that path checks each argument for DTensor
#     unless a per-op ``__torch_dispatch__`` rule is registered for the argument's type (the
#     table behind ``torch.library.register_torch_dispatch``), and the check imports
#     ``torch.distributed.tensor`` and sympy at the first subclass op of the process: ~1 s, most
#     of a cold first ``grad`` call. So the first transform call registers each wrapper class's
#     own ``__torch_dispatch__`` as its rule for the ops that reach wrappers: every overload of an
#     op with a rule in a registry, plus ``_ALSO_ENTERING`` (~700 ops, ~15-25 ms once, mostly
#     torch building its registry entries; all 3600 ops would cost ~3x that). The
#     C++ path then calls the same function it would have called, found by one dict lookup it
#     makes anyway, and skips the DTensor check: no cost per op (bench_core --per-op, same
#     numbers before and after). An op outside the table (an ``out=`` variant, a custom op, a
#     rare decomposed op) takes the old path: correct, and the first such op in a process pays
#     the import. The alternative, a dispatch mode as the single entry
#     point (the mode path has no DTensor check), costs a Python call for every plain op run
#     inside a nested transform, where subclass dispatch costs nothing.
_entry_pending = True

# Ops that reach wrappers without a rule of their own: pointwise ops that vmap batches by their
# tag, ops the rules call below torch's autograd (where CompositeImplicit ops reach the Python
# key too), and common ops that run through torch's decompositions.
_ALSO_ENTERING = (
    "reshape view view_as movedim clone copy detach alias expand expand_as where masked_fill "
    "eq ne lt le gt ge isinf isnan isfinite isneginf isposinf signbit logical_and logical_or "
    "logical_not logical_xor bitwise_and bitwise_or bitwise_xor bitwise_not addcmul addcdiv "
    "norm linalg_vector_norm renorm logaddexp logaddexp2 lerp zeros_like ones_like full_like "
    "empty_like rand_like randn_like new_zeros new_ones new_full new_empty new_empty_strided "
    "fill fill_ zero_ scalar_tensor to _to_copy contiguous flatten unflatten squeeze unsqueeze "
    "permute transpose t select slice index_select gather scatter scatter_add index index_put "
    "cat stack split split_with_sizes chunk unbind narrow sum mean amax amin max min var std "
    "prod cumsum softmax log_softmax _softmax _log_softmax dropout native_dropout bernoulli "
    "matmul mm bmm addmm linear abs neg sign round floor ceil trunc frac clamp clamp_min "
    "clamp_max maximum minimum fmax fmin remainder fmod pow sqrt rsqrt exp log sin cos tanh "
    "sigmoid relu gelu add sub mul div true_divide rsub sym_size sym_stride sym_numel"
)


_entered: set = set()  # the wrapper classes whose per-op rules are registered


@collector_paused  # Note [Long-lived setup without young collections]
def _install_entry():
    """Note [Entering through registered rules]: register each wrapper class's
    ``__torch_dispatch__`` as its per-op rule, at the first transform call after the class
    is defined (vmap's classes are defined by its first call: Note [Lazy parts of the
    package], functransforms/__init__.py)."""
    global _entry_pending
    if not _entry_pending:  # another thread did it while this one waited for the lock
        return
    # cleared last (truthy meanwhile): another thread's first call waits for this one under
    # the setup lock instead of running before the probe and the registrations (Note
    # [One-time setup under one lock], _core/gcpause.py); a class defined meanwhile sets it True
    _entry_pending = _INSTALLING
    try:
        _install_entry_locked()
    except BaseException:
        _entry_pending = True
        raise
    if _entry_pending is _INSTALLING:
        _entry_pending = False


_INSTALLING = "installing"


def _install_entry_locked():
    global _ABOVE_PYTHON
    from .. import _compat
    from . import composites as _composites
    from . import ops as _ops

    if _ABOVE_PYTHON is None:
        _ABOVE_PYTHON = _probe_above_python()  # Note [Direct route to the inner level]
        _composites.install()  # once, as the probe: Note [Composite kernels of ours]
    classes, todo = [], [TransformTensor]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in _entered:
                classes.append(sub)
            todo.append(sub)
    if not classes:
        return
    _entered.update(classes)
    # every op with a rule, its family loaded or not (Note [Rule families load on first use]),
    # and the ops whose rules wait for torch to define them (Registry.register_when_defined)
    packets, exact = _ops.rule_names()
    packets.update(f"{ns}::{name}" for name in _ALSO_ENTERING.split() for ns in ("aten", "prims"))
    _compat.register_subclass_dispatch_rules(
        classes, lambda c: c.__torch_dispatch__.__func__, packets, exact
    )


def unwind_to(interp, popped):
    """``interp`` is exiting but ``popped`` was on top of this thread's stack: an inner level
    whose ``__exit__`` an asynchronous exception interrupted before it popped (Note [Entering
    is all or nothing]). Its call is over: drop it and any other down to ``interp``."""
    stack = _state.stack
    while popped is not interp:
        popped.alive = False
        for fn in reversed(popped._on_exit or ()):
            fn()
        if not stack:
            raise AssertionError(f"interpreter stack corrupted: {interp!r} is not on it")
        popped = stack.pop()


def interpreter_stack() -> tuple[Interpreter, ...]:
    """The active interpreters, outermost first."""
    return tuple(_state.stack)


class TransformTensor(torch.Tensor):
    """Base of the wrapper subclasses (BatchedTensor, DualTensor, GradTensor).

    A wrapper has the *logical* shape, dtype and device; ``_interp`` is the interpreter of the
    level it belongs to. Every ATen op touching a wrapper arrives in ``__torch_dispatch__``,
    which routes it to the innermost interpreter among the arguments (Note [Levels]).
    """

    _interp: Interpreter

    __torch_function__ = _compat.disabled_torch_function_impl

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        global _entry_pending
        _entry_pending = True  # its per-op rules, at the next transform call (_install_entry)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is _DETACH and not _excluded(_ADINPLACE):  # Note [torch's own detach of a wrapper]
            func = _ALIAS
        return _route(_innermost(args, kwargs), func, args, kwargs or {})

    def _inner_requires_grad(self) -> bool:  # pragma: no cover - every wrapper class overrides
        """Whether a tensor this wrapper holds (value, primal, tangent) requires grad in torch's
        own autograd. Only plain tensors count: a wrapper of a lower level inside is that
        level's business (Note [Torch autograd through our transforms])."""
        raise NotImplementedError

    def __repr__(self, *, tensor_contents=None):
        return self._describe()

    # Note [Escaping to Python]
    #     PyTorch lets a transformed function read values out as Python/NumPy data
    #     (``x.tolist()``, ``x.numpy()``; ``.item()`` arrives as ``aten._local_scalar_dense``):
    #     the values are not differentiated. torch's C++ methods refuse wrapper subclasses, so
    #     the wrappers define them: a Dual/GradTensor hands over its primal; a BatchedTensor
    #     raises (one Python value cannot hold a batch: DataDependentError); a wrapper whose
    #     transform has returned says that it escaped, and from which transform.
    def tolist(self):
        return self._python_value("tolist").tolist()

    # float(x), int(x), complex(x), operator.index(x): torch's C versions dispatch ``.item()``,
    # which reaches us, except inside ``torch.tensor([x])``: torch builds the new tensor's data
    # with the Python dispatch key excluded, so the item would run the CPU kernel on a wrapper,
    # which has no data ("data is not allocated yet").
    def __float__(self):
        return float(self._python_value("__float__"))

    def __int__(self):
        return int(self._python_value("__int__"))

    def __complex__(self):
        return complex(self._python_value("__complex__"))

    def __index__(self):
        return self._python_value("__index__").__index__()

    def numpy(self, *, force=False):
        return self._python_value("numpy").numpy(force=force)

    def __array__(self, dtype=None, copy=None):
        value = self._python_value("__array__").numpy(force=True)
        return value if dtype is None else value.astype(dtype, copy=False)

    def _python_value(self, method):
        interp = self._interp
        if not interp.alive:
            raise EscapedTracerError(
                f"`.{method}()` of a {interp.name} wrapper tensor (level {interp.level}) after its "
                f"{interp.name} call returned: the value escaped the transformed function "
                "(stored in a global, a closure or an attribute). Return it from the function."
            )
        return self._escape_value(method)

    def _escape_value(self, method):
        return self._primal  # Dual/GradTensor; BatchedTensor overrides

    def requires_grad_(self, requires_grad=True):
        raise RuntimeError(
            f"x.requires_grad_() inside a function transformed by {self._interp.name}: this is "
            "not supported (as in PyTorch). Expected: let the transform track derivatives "
            "(grad/vjp/jvp take care of it); use torch.autograd outside the transform."
        )


# Note [Torch autograd through our transforms]
#     Two tapes can be involved in one program: ours (a grad level's Nodes, autodiff/reverse.py)
#     and torch's own autograd graph, which records ops on plain tensors that require grad
#     (parameters, a user's leaf). Our transforms must be transparent to the second one: a
#     training step may run backward on ``ft.vmap(model_fn)(x).sum()``, or a MAML
#     outer step may differentiate the result of ``ft.grad``.
#
#     The difficulty: rules run inside ``__torch_dispatch__``, where the dispatcher has already
#     passed the Autograd keys and excluded them for the rest of the call (it redispatches
#     "below autograd"), so every op a rule runs on unwrapped values would be invisible to
#     torch's autograd. functorch avoids it because its rules run with the outer Autograd key
#     active. We do the same, but only when it can matter: when grad mode is on and a plain
#     tensor the op touches at this level (an argument, or the value/primal/tangent held by a
#     wrapper of this level) requires grad, ``__torch_dispatch__`` re-enables the Autograd and
#     ADInplaceOrView keys in the thread-local exclude set for the duration of ``process``
#     (``_ForceKeys``, ~0.6-1.2 us). Everything the rule runs on plain tensors is then
#     recorded by torch as in eager code, saved tape values (a Node's primals and outputs)
#     keep their torch graph, and the unwrapped outputs of vmap/jvp/vjp/grad carry
#     ``grad_fn``: ``backward()`` and double backward see through the transform. Wrappers of a
#     lower level do not count: ops on them reach that level, which decides for itself. The
#     common case (nothing requires grad) pays one grad-mode read and one scan of the
#     arguments.
#
#     Side effect, harmless by construction: when a requires-grad plain tensor meets a wrapper
#     at a point where autograd is active (user code at top level, or a rule under the guard),
#     torch also records a node on the *wrapper* (its logical view). Those wrapper-level nodes
#     are never differentiated: the transforms return unwrapped values, whose graph is the
#     real one, and the wrappers (with their junk graph) die with the transform.
_AUTOGRAD_KEYS = (
    _compat.DispatchKeySet(_compat.AutogradFunctionality)
    | _compat.DispatchKeySet(_compat.AutogradOther)
    | _compat.DispatchKeySet(_compat.AutogradNestedTensor)
    | _compat.DispatchKeySet(_compat.ADInplaceOrView)
)
_ForceKeys = _compat.ForceDispatchKeyGuard
_tls_include = _compat.dispatch_tls_local_include_set
_tls_exclude = _compat.dispatch_tls_local_exclude_set
_grad_enabled = torch.is_grad_enabled
_excluded = _compat.dispatch_tls_is_dispatch_key_excluded
_ADINPLACE = _compat.ADInplaceOrView
_unpack_dual = _compat.unpack_dual
# read, never called: Note [Torch forward AD through our transforms]
_fwad = _compat.forward_ad_state

# Note [torch's own detach of a wrapper]
#     torch's autograd saves the output of a node it records (``SavedVariable``) as a shallow
#     copy, which for a subclass is ``aten.detach`` sent straight to ``__torch_dispatch__``,
#     not through the dispatcher: the Autograd keys are not excluded then, as they are for a
#     user's ``x.detach()`` (which passed torch's Autograd kernel on its way down). A detach
#     makes a constant at our levels, so a node torch recorded on our wrappers (a tensor that
#     requires grad, met inside ``grad``) held a constant for its output: ``torch.autograd.grad``
#     of ``logsumexp``/``exp``/``tanh``/... called inside the function dropped the output's
#     dependence on the transform's inputs, silently (8% off for a logsumexp). torch's copy
#     is an alias of the value, so it stays one at our levels too. ``x.data`` takes the same
#     path into ``__torch_dispatch__`` and must stay a constant: the grad and jvp wrappers
#     define it (``data_as_constant``) as an ordinary detach, through the dispatcher.
_DETACH = torch.ops.aten.detach.default
_ALIAS = torch.ops.aten.alias.default
_set_data = _compat.tensor_set_data


def _get_data(self):
    return _DETACH(self)


data_as_constant = property(_get_data, _set_data, doc="``x.data``: a constant at every level")


def _route(interp, func, args, kwargs):
    """``interp.process`` of an op, with torch's autograd re-enabled when it must record
    (Note [Torch autograd through our transforms]): the body of ``__torch_dispatch__``."""
    if _fwad._current_level >= 0 and _torch_forward_ad_wanted(interp, args, kwargs):
        _refuse_torch_forward_ad(interp, func)
    if not _grad_enabled():
        return interp.process(func, args, kwargs)
    # _torch_autograd_wanted, its loop over the positional arguments inlined: this runs for
    # every op at every level (hvp: ~25 per call), where a call frame is a fifth of its cost
    for a in args:
        if isinstance(a, TransformTensor):
            if a._interp is interp and a._inner_requires_grad():
                break
        elif isinstance(a, torch.Tensor):
            if a.requires_grad:
                break
        elif type(a) is list or type(a) is tuple:
            if _torch_autograd_wanted(interp, a, None):
                break
    else:
        if not kwargs or not _torch_autograd_wanted(interp, tuple(kwargs.values()), None):
            return interp.process(func, args, kwargs)
    mode = _graph_mode[0] if _graph_mode else _load_graph_mode()
    func = _RECORDED_FORM.get(func, func)
    with _ForceKeys(_tls_include(), _tls_exclude() - _AUTOGRAD_KEYS), mode:
        return interp.process(func, args, kwargs)


# Ops torch chooses when nothing requires grad at the call (our wrappers do not, in torch's
# sense), for their recorded twin with the same schema: torch's autograd refuses to record the
# forward-only kernel (its integer outputs), as eager torch never asks it to.
_aten = torch.ops.aten
_RECORDED_FORM = {_aten._embedding_bag_forward_only.default: _aten._embedding_bag.default}


_graph_mode: list = []  # Note [Outputs torch leaves without a graph] (autodiff/_torch_graph.py)


def _load_graph_mode():
    from functransforms.autodiff._torch_graph import TorchGraphMode

    if not _graph_mode:
        _graph_mode.append(TorchGraphMode())
    return _graph_mode[0]


# Note [Direct route to the inner level]
#     An interpreter's rule hands an op down to the next level by calling it again on what it
#     unwrapped: under ``vmap(grad(f))`` the grad level runs ``aten.sin(x)`` with ``x`` a
#     BatchedTensor. Through torch, that call costs a trip through the op's Python
#     ``__call__``, BatchedTensor's ``__torch_function__``, the C++ dispatcher (boxing the
#     arguments, the Python fallback, the per-op rule table) and back into
#     ``__torch_dispatch__``, only to land in ``_route`` with the same arguments: ~5 us of an
#     op's ~45 under vmap(grad). ``redispatch`` calls ``_route`` directly when the dispatcher
#     provably would, and nothing else would see the call:
#       * the arguments are in the dispatcher's normal form, because they came out of a
#         ``__torch_dispatch__`` (positional as the schema says, lists not tuples, defaults
#         dropped) with only wrappers replaced by what they hold; callers guarantee this;
#       * every dispatch key above Python is excluded in the thread-local state, exactly the
#         set the Python fallback excludes around ``__torch_dispatch__`` (``_ABOVE_PYTHON``,
#         read from torch at the first transform call), and Python itself is not: so no
#         autograd kernel (recording, or decomposing a CompositeImplicit op), no autocast,
#         functionalization, conj/neg fallback or functorch layer runs before the Python key.
#         Inside a rule this holds; after ``_ForceKeys`` re-enabled torch's autograd, or
#         ``_lazy_conj_enabled`` the conjugate keys, it does not, and the op goes through torch;
#       * no TorchDispatchMode is on the stack (a jit trace, the determinism checker, a user's
#         mode would handle the op at the Python key first) and no TorchFunctionMode is
#         enabled (it would see the OpOverload call first);
#       * every tensor argument is a plain tensor or one of our wrappers (another subclass's
#         ``__torch_dispatch__`` could be called first; BatchedTensor's ``__torch_function__``
#         passes OpOverloads through unchanged).
#     The result is what ``__torch_dispatch__`` returns, with the container the dispatcher
#     would give back (a list for ``Tensor[]``, a tuple for several returns). Anything else
#     takes the ordinary call. tests/core/test_direct_route.py checks both routes agree.
_ABOVE_PYTHON = None  # raw DispatchKeySet of the keys the Python fallback excludes
_PYTHON_BIT = _compat.DispatchKeySet(_compat.DispatchKey.Python).raw_repr()
_dispatch_modes = _compat.len_torch_dispatch_stack
_function_modes = _compat.is_torch_function_mode_enabled
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _probe_above_python():
    """The exclude set torch's Python fallback installs around ``__torch_dispatch__``, read
    once from inside one (with a clean thread-local state, so the caller's does not leak in)."""
    seen = []
    # made with the modes off: a mode active at the first transform call (check_deterministic's)
    # would record it in its first run only (Note [One-time setup is not recorded],
    # functransforms/deterministic/_check.py)
    with _compat.disable_current_modes():
        plain = torch.empty(0)

    class _Probe(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            seen.append(_tls_exclude().raw_repr())
            return plain

    # its own rule for alias, so that torch's default subclass path (and the import it
    # makes, Note [Entering through registered rules]) is not taken
    _compat.register_subclass_dispatch_rules(
        [_Probe], lambda c: c.__torch_dispatch__.__func__, {"aten::alias"}
    )
    probe = _compat.make_wrapper_subclass(_Probe, (0,))
    idle = not _compat.len_torch_dispatch_stack() and not _compat.len_pre_dispatch_stack()
    modes = contextlib.nullcontext() if idle else _compat.disable_current_modes()  # cold start
    with modes, _compat.DisableTorchFunction():
        empty = _compat.DispatchKeySet(_compat.DispatchKey.Undefined)
        with _ForceKeys(empty, empty):
            torch.ops.aten.alias.default(probe)
    return seen[0] & ~_PYTHON_BIT


# wrapper classes whose __torch_dispatch__ does more than route to their level (nested tensors
# under vmap run ops per component, batching/_nested.py): their ops always go through torch
OWN_DISPATCH: set = set()


def redispatch(func, args, kwargs):
    """``func(*args, **kwargs)`` for ``args``/``kwargs`` in the dispatcher's normal form (a
    ``__torch_dispatch__``'s arguments with this level's wrappers unwrapped), straight to the
    innermost interpreter when torch would route it there (Note [Direct route to the inner
    level])."""
    interp = None
    level = -1
    for a in args:
        if isinstance(a, torch.Tensor):
            if isinstance(a, TransformTensor):
                if type(a) in OWN_DISPATCH:
                    return func(*args, **kwargs)
                i = a._interp
                if i.level > level:
                    interp, level = i, i.level
            elif type(a) not in _PLAIN_TYPES:
                return func(*args, **kwargs)
        elif type(a) is list:
            for b in a:
                if isinstance(b, torch.Tensor):
                    if isinstance(b, TransformTensor):
                        if type(b) in OWN_DISPATCH:
                            return func(*args, **kwargs)
                        i = b._interp
                        if i.level > level:
                            interp, level = i, i.level
                    elif type(b) not in _PLAIN_TYPES:
                        return func(*args, **kwargs)
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, torch.Tensor):
                if isinstance(a, TransformTensor):
                    if type(a) in OWN_DISPATCH:
                        return func(*args, **kwargs)
                    i = a._interp
                    if i.level > level:
                        interp, level = i, i.level
                elif type(a) not in _PLAIN_TYPES:
                    return func(*args, **kwargs)
            elif type(a) is list or type(a) is tuple:
                return func(*args, **kwargs)
    if interp is None or not interp.alive or _dispatch_modes() or _function_modes():
        return func(*args, **kwargs)
    excluded = _tls_exclude().raw_repr()
    if excluded & _PYTHON_BIT or excluded & _ABOVE_PYTHON != _ABOVE_PYTHON:
        return func(*args, **kwargs)
    out = _route(interp, func, args, kwargs)
    shape = facts(func).returns
    if shape == 1:  # Tensor[]
        return out if type(out) is list else list(out)
    if shape == 2:  # several returns
        return out if type(out) is tuple else tuple(out)
    return out


def below_torch_autograd() -> bool:
    """True inside a dispatch handler (or a rule) where torch's autograd does not record."""
    return _excluded(_ADINPLACE)


def copy_as_torch_records(dst, src, *rest):
    """``aten.copy(dst, src)`` (the functional ``dst.copy_(src)``, which rules run on unwrapped
    values). torch registers no derivative for ``aten.copy``, so where torch's autograd records
    (Note [Torch autograd through our transforms]) it is an in-place copy into a fresh tensor
    laid out as ``dst``: the same values and layout, and a derivative."""
    if (
        _grad_enabled()
        and not below_torch_autograd()
        and (getattr(src, "requires_grad", False) or dst.requires_grad)
    ):
        return torch.empty_like(dst).copy_(src, *rest)
    return torch.ops.aten.copy.default(dst, src, *rest)


def _torch_autograd_wanted(interp, args, kwargs) -> bool:
    """Note [Torch autograd through our transforms]: does a plain tensor among the op's
    arguments, or held by a wrapper of ``interp``'s level, require grad?"""
    for a in args:
        if isinstance(a, torch.Tensor):
            if isinstance(a, TransformTensor):
                if a._interp is interp and a._inner_requires_grad():
                    return True
            elif a.requires_grad:
                return True
        elif type(a) is list or type(a) is tuple:
            if _torch_autograd_wanted(interp, a, None):
                return True
    if kwargs:
        return _torch_autograd_wanted(interp, tuple(kwargs.values()), None)
    return False


# Note [Torch forward AD through our transforms]
#     torch's forward AD (``forward_ad.make_dual`` inside ``dual_level()``) is computed by the
#     same Autograd kernels as its reverse mode, so an op a rule runs below them drops the
#     tangent: the outputs of grad, jacrev, vjp and of vmap's rules lost the dual's tangent or
#     got part of it (half of it for ``x @ w.diag()`` under grad), silently. Re-enabling the
#     Autograd keys for them, as for reverse mode, is not enough: torch computes the forward
#     formulas on the wrappers too, which reach kernels and rules that fail (and one crashed
#     the process). Until that is designed, an op of ours that meets a tangent of torch's
#     forward AD raises; vmap's ops that its fast paths run on plain tensors (above the
#     dispatcher) keep the tangent, as functorch does, and do not get here.
def _torch_forward_ad_wanted(interp, args, kwargs) -> bool:
    """Inside ``forward_ad.dual_level()``: does a plain tensor among the op's arguments, or
    held by a wrapper of ``interp``'s level, carry a tangent of torch's forward AD?"""
    level = _fwad._current_level
    with _ForceKeys(_tls_include(), _tls_exclude() - _AUTOGRAD_KEYS):  # _unpack_dual's kernel
        return any(_has_forward_grad(interp, a, level) for a in _tensor_args(args, kwargs))


def _has_forward_grad(interp, a, level):
    if isinstance(a, TransformTensor):
        if a._interp is not interp:  # a lower level's wrapper: its own level decides
            return False
        held = [getattr(a, n, None) for n in ("_value", "_primal", "_tangent")]
    else:
        held = [a]
    return any(type(h) is torch.Tensor and _unpack_dual(h, level).tangent is not None for h in held)


def _refuse_torch_forward_ad(interp, func):
    raise TransformError(
        f"{interp.name}: {func} got a tensor with a tangent of torch's forward AD "
        "(torch.autograd.forward_ad.make_dual) inside a functransforms transform. Forward "
        "AD of torch's does not reach through our transforms' rules (the tangent would be "
        "lost, silently). Expected: the tangent as a transform, functransforms.jvp (it "
        "composes with grad, vmap and jacrev at any depth)."
    )


def _tensor_args(args, kwargs):
    for a in itertools.chain(args, kwargs.values() if kwargs else ()):
        if isinstance(a, torch.Tensor):
            yield a
        elif type(a) is list or type(a) is tuple:
            yield from (b for b in a if isinstance(b, torch.Tensor))


def _innermost(args, kwargs) -> Interpreter | None:
    """The interpreter of the highest level among the wrappers in ``args``/``kwargs`` (None if
    there is no wrapper); a dead one raises (Note [Levels])."""
    best = None
    level = -1
    for a in args:
        if isinstance(a, TransformTensor):
            i = a._interp
            if i.level > level:
                best, level = i, i.level
        elif type(a) is list or type(a) is tuple:
            for b in a:
                if isinstance(b, TransformTensor):
                    i = b._interp
                    if i.level > level:
                        best, level = i, i.level
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, TransformTensor):
                i = a._interp
                if i.level > level:
                    best, level = i, i.level
    if best is not None and not best.alive:
        if best.stand_in is not None:  # Note [Values a custom function closes over under vmap]
            return best.stand_in
        hint = (
            " A custom function (custom_vjp, custom_jvp, autograd.Function) closed over it and "
            "its backward ran after the vmap returned (a grad outside the vmap): pass the "
            "tensor to the custom function as an argument instead of closing over it."
            if getattr(best, "closed_over", False)
            else ""
        )
        why = (
            _IN_TORCH_BACKWARD
            if _compat.current_autograd_node() is not None
            else "a value leaked out of the transformed function (stored in a global, a closure "
            "or an attribute). Return it from the function instead." + hint
        )
        raise EscapedTracerError(
            f"A {best.name} wrapper tensor (level {best.level}) was used after its "
            f"{best.name} call returned: {why}"
        )
    return best


# the one way a wrapper reaches torch's backward pass without user code keeping it: a
# recomputation that torch's non-reentrant checkpoint runs there, with the forward's arguments
_IN_TORCH_BACKWARD = (
    "torch's autograd used it in a backward pass. torch.utils.checkpoint("
    "use_reentrant=False) inside a transformed function recomputes that function with the "
    "transform's values when torch's backward runs, after the transform returned. Use "
    "functransforms.checkpoint inside transforms, or torch's checkpoint around the "
    "transformed call."
)


def innermost(values) -> Interpreter | None:
    """The interpreter that processes a call on ``values`` (a flat sequence, e.g. the leaves of
    a custom function's arguments): the innermost level among its wrappers, None if there is
    none. The same choice as for an op (Note [Levels])."""
    return _innermost(values, None)


def _raise_inside_torch_func():
    """PyTorch's transform wrappers (functorch's TensorWrapper, BatchedTensorImpl) have no storage
    and do not reach ``__torch_dispatch__`` as tensors we can wrap: a transform of ours inside
    one of PyTorch's failed deep inside with an internal error ("Cannot access storage of
    TensorWrapper"). The other nesting works (PyTorch's transforms inside ours)."""
    from functransforms.errors import TransformError

    raise TransformError(
        "a functransforms transform was called inside a torch.func transform (torch.func.grad, "
        "vmap, jvp, jacrev, ...), whose tensors it cannot see through. Expected: functransforms "
        "transforms outside, or torch.func only. Do: use the functransforms transform for the "
        "outer one too (same signature), e.g. ft.grad(ft.vmap(f)); torch.func inside ours works."
    )


# wrapper class -> the torch functions its ``__torch_function__`` wants to see before
# BatchedTensor's handles them (Note [Torch functions at the grad level under vmap],
# autodiff/reverse.py)
DEFERRING: dict = {}


def linear_args(args, kwargs):
    """``F.linear``'s ``(x, w, b)`` with the bias given (positionally or as ``bias=``), or None:
    the calls the fast paths take (batching/_fastpath.py and autodiff/_fastpath.py)."""
    if kwargs:
        if len(args) != 2 or len(kwargs) != 1 or "bias" not in kwargs:
            return None
        args = (args[0], args[1], kwargs["bias"])
    return args if len(args) == 3 else None
