"""The recorder of static ``jit`` traces: ATen ops run for real and appended to an FX graph.

Note [Recording static traces]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A static trace (``jit(f)``, ``dynamic=False``) runs ``f`` once for real and records the plain
ATen ops it issues, on concrete shapes. ``make_fx`` in real mode records that graph too, but
its entry imports ``torch._inductor.config`` and its real-mode metadata builds a
``FakeTensorMode``: either pulls in ``torch._dynamo`` and sympy, ~850 modules and ~1 s of CPU
on the first ``jit`` call of a process (import + first call: ~1150 ms CPU with make_fx, ~125
ms with the recorder; jax's import + first ``jax.jit`` call: ~1500 ms). ``Recorder`` does
what make_fx's proxy mode does in real mode, and nothing else, with ``torch.fx`` (imported by
``import torch``) and ``torch.utils._python_dispatch``:

* It is a ``TorchDispatchMode`` pushed before ``f`` runs, so it is the innermost mode: the
  transforms' wrappers unwrap above it (an op with a wrapper argument it does not know is
  returned ``NotImplemented``, so the wrapper's ``__torch_dispatch__`` runs and its plain ops
  come back here), and it sees plain ATen ops only.
* Each op runs for real and becomes a ``call_function`` node of its ``OpOverload`` with the
  arguments as called. Tensors map to nodes by the identity of their Python object, as
  make_fx's tracker (weak references: the trace keeps no intermediate alive): the flat inputs
  are placeholders ``arg<i>_1``; a tensor an op returned is that node (``operator.getitem``
  nodes for each element of a tuple or list result, as make_fx's proxies index them); an
  in-place op returns its argument, which from then on is the in-place node; any other tensor
  (a module's weight, a closure's tensor) is a constant: a ``get_attr`` of
  ``_param_constant<i>`` (``nn.Parameter``) or ``_tensor_constant<i>``, one attribute per
  tensor, one node per use; a ``torch.Generator`` argument is an ``_opaque_obj<i>`` attribute.
* make_fx's rules that change what is recorded are kept: ``lift_fresh`` (``torch.tensor``
  literals) is recorded and run as ``lift_fresh_copy``; ``is_nonzero`` is recorded as ``ne`` +
  ``_local_scalar_dense``; ``prim.device`` is not recorded; a data-dependent op (``.item()``)
  whose tracked inputs are all constants (one-element tensors made from literals, and what is
  computed from them alone) runs unrecorded, its value frozen (a captured tensor's ``.item()``
  as well); the autocast cache is off (a cached cast of a weight would enter the graph as a
  constant). A CompositeImplicitAutograd op that reaches the mode (a rule ran it below
  autograd) is decomposed with the mode active, by torch's C++ kernel, what eager runs;
  make_fx prefers the Python decompositions some ops have (``matmul``, ``dropout``, the RNNs),
  which import sympy. Same ops but for reshapes (``matmul``'s C++ kernel returns
  ``_unsafe_view`` where the Python one returns ``view``), which the clean-up drops alike.
* ``node.meta["val"]`` (the passes read layouts from it) is a data-less wrapper tensor with the
  value's sizes, strides, storage offset, dtype, device and conj/neg bits, made when the node
  is: later in-place changes of the real value's metadata do not reach it. make_fx's real-mode
  values are fake tensors made by ``empty_strided``: the same but for the storage offset (always
  0 there) and the conj/neg bits (always clear there).
* The modes of a trace (this one, ``_Watch``, the binding check's ``_Record``) subclass
  ``_compat.UncompiledDispatchMode``: torch wraps a mode's ``__torch_dispatch__`` in
  ``torch._disable_dynamo``, whose first call imports ``torch._dynamo``, sympy and all.

What the library asks of make_fx while tracing it asks of the recorder too: whether a tensor is
traced (``_Watch``); the exchange of two tensors' records when a buffer is promoted
(``_compat.swap_proxy_slots``); whether a tracer is active (``_compat.proxy_tracing``: while a
tracer's mode declines an op on a wrapper, torch's dispatch holds one more reference to each
argument, which promotion's use count allows for). ``dynamic=True`` traces with make_fx:
symbolic shapes need its fake tensors and shape environment, and importing them is the price of
asking for them. ``tests/jit/test_record.py`` compares the replayed graphs of both tracers op
by op (the benchmark workloads of benchmarks/bench_jax.py were all identical).
"""

from __future__ import annotations

import operator
import threading
import weakref

import torch

from .. import _compat

__all__ = ["Recorder", "RecordError", "recording", "swap_records"]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_HANDLED = (_Tensor, _Parameter)
_DDO = torch.Tag.data_dependent_output
_RANDOM = torch.Tag.nondeterministic_seeded
aten = torch.ops.aten
_SIZES = (aten.size.default, aten.stride.default, aten.storage_offset.default)
_DEVICE = torch.ops.prim.device.default
_CIA = _compat.CompositeImplicitAutograd
_has_kernel = _compat.has_kernel_for_dispatch_key
# make_fx's CONSTANT_NUMEL_LIMIT: results of constants stay constants up to this many elements
_CONSTANT_NUMEL = 1


class RecordError(RuntimeError):
    """The recorder failed, not ``f``: the trace falls back (Note [Jit fallbacks])."""


class _Value(torch.Tensor):
    """A traced value's metadata without its data (``node.meta["val"]``)."""

    __torch_function__ = _compat.disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RecordError(f"{func}: a jit graph's metadata tensor holds no values")


_make_value = _compat.make_wrapper_subclass


def _value(t):
    if t.layout is not torch.strided or type(t) is _Value:
        return None
    v = _make_value(
        _Value,
        t.shape,
        strides=t.stride(),
        storage_offset=t.storage_offset(),
        dtype=t.dtype,
        device=t.device,
        requires_grad=False,
    )
    if t.is_conj():
        _compat.set_conj(v, True)
    if t.is_neg():
        _compat.set_neg(v, True)
    return v


def _tensors(tree, out):
    for a in tree:
        if isinstance(a, _Tensor):
            out.append(a)
        elif type(a) is list or type(a) is tuple:
            _tensors(a, out)
    return out


class _Active(threading.local):
    recorder = None


_active = _Active()


def recording() -> bool:
    """Whether a recorder is active on this thread (``_compat.proxy_tracing``)."""
    return _active.recorder is not None


def swap_records(a, b, share=False) -> None:
    """``_compat.swap_proxy_slots`` for the active recorder, if any (this thread's)."""
    rec = _active.recorder
    if rec is not None:
        rec.swap(a, b, share)


class Recorder(_compat.UncompiledDispatchMode):
    """Records the ATen ops of one static trace (Note [Recording static traces])."""

    def __init__(self):
        super().__init__()
        self.graph = torch.fx.Graph()
        self.root = torch.nn.Module()
        self._nodes = {}  # id(tensor) -> (weakref, node, constant)
        self._attrs = {}  # id(tensor) -> (tensor, attribute name)
        self._counts = {"_tensor_constant": 0, "_param_constant": 0, "_opaque_obj": 0}

    # -- what the library asks while tracing
    def tracked(self, t) -> bool:
        e = self._nodes.get(id(t))
        return e is not None and e[0]() is t

    def swap(self, a, b, share):
        """After ``swap_tensor_impl(a, b)``, the records follow the contents (make_fx's
        ``swap_proxy_slots``); with ``share``, ``a`` takes ``b``'s record and ``b`` keeps it."""
        ea, eb = self._entry(a), self._entry(b)
        if share:
            if eb is not None:
                self._nodes[id(a)] = (weakref.ref(a), eb[1], eb[2])
            return
        for t, e in ((a, eb), (b, ea)):
            if e is None:
                self._nodes.pop(id(t), None)
            else:
                self._nodes[id(t)] = (weakref.ref(t), e[1], e[2])

    # -- building the graph
    def _entry(self, t):
        e = self._nodes.get(id(t))
        if e is not None and e[0]() is t:
            return e
        return None

    def _track(self, t, node, constant=False):
        self._nodes[id(t)] = (weakref.ref(t), node, constant)

    def placeholder(self, i, t):
        node = self.graph.create_node("placeholder", f"arg{i}_1", name=f"arg{i}_1")
        node.meta["val"] = _value(t)
        self._track(t, node)

    def _constant(self, t, prefix):
        known = self._attrs.get(id(t))
        if known is not None and known[0] is t:
            name = known[1]
        else:
            name = f"{prefix}{self._counts[prefix]}"
            self._counts[prefix] += 1
            self._attrs[id(t)] = (t, name)
            setattr(self.root, name, t)
        node = self.graph.create_node("get_attr", name)
        if isinstance(t, _Tensor):
            node.meta["val"] = _value(t)
        return node

    def _arg(self, a):
        if isinstance(a, _Tensor):
            e = self._entry(a)
            if e is not None:
                return e[1]
            return self._constant(
                a, "_param_constant" if isinstance(a, _Parameter) else "_tensor_constant"
            )
        if type(a) is list or type(a) is tuple:
            return type(a)(self._arg(x) for x in a)
        if isinstance(a, torch.Generator):  # no literal in the graph's code: an attribute
            return self._constant(a, "_opaque_obj")
        return a

    def _outputs(self, out, node, constant):
        if isinstance(out, _Tensor):
            node.meta["val"] = _value(out)
            self._track(out, node, constant)
        elif type(out) is list or type(out) is tuple:
            node.meta["val"] = type(out)(_value(x) if isinstance(x, _Tensor) else x for x in out)
            for i, x in enumerate(out):
                item = self.graph.create_node("call_function", operator.getitem, (node, i))
                self._outputs(x, item, constant)

    # -- the mode
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _DEVICE:
            return func(*args, **kwargs)
        flat = _tensors(args, [])
        if kwargs:
            _tensors(kwargs.values(), flat)
        entries = []
        for t in flat:
            e = self._entry(t)
            if e is None and type(t) not in _HANDLED:
                return NotImplemented  # a wrapper: its __torch_dispatch__ first
            entries.append(e)
        if func not in _SIZES and _compat.autograd_would_have_decomposed(func, flat):
            with self:
                if _has_kernel(func.name(), _CIA):  # the C++ decomposition eager runs
                    return func._op_dk(_CIA, *args, **kwargs)
                r = func.decompose(*args, **kwargs)
            if r is not NotImplemented:
                return r
        if func is aten.is_nonzero.default:
            if args[0].numel() != 1:
                raise RuntimeError("Boolean value of Tensor with more than one value is ambiguous")
            with self:
                return (args[0] != 0).item()
        all_constant = all(e is None or e[2] for e in entries)
        if all_constant and _DDO in func.tags:
            return func(*args, **kwargs)  # a constant's value: frozen, as make_fx does
        if func is aten.lift_fresh.default:
            func = aten.lift_fresh_copy.default
        try:
            name = self.graph._target_to_str(func.overloadpacket.__name__)
            node = self.graph.create_node(
                "call_function",
                func,
                self._arg(args),
                {k: self._arg(v) for k, v in kwargs.items()},
                name=name,
            )
        except Exception as e:
            raise RecordError(f"recording {func} failed: {e}") from e
        out = func(*args, **kwargs)
        if func is aten.lift_fresh_copy.default:
            constant = out.numel() <= _CONSTANT_NUMEL
        else:
            constant = (
                all_constant
                and any(e is not None and e[2] for e in entries)
                and _RANDOM not in func.tags
                and all(t.numel() <= _CONSTANT_NUMEL for t in _tensors((out,), []))
            )
        try:
            self._outputs(out, node, constant)
        except Exception as e:
            raise RecordError(f"recording the results of {func} failed: {e}") from e
        return out

    def run(self, fn, tensors):
        """Run ``fn(*tensors)`` (a list of tensors out) once, recording it: the graph module."""
        for i, t in enumerate(tensors):
            self.placeholder(i, t)
        outer, _active.recorder = _active.recorder, self
        cache = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)  # make_fx's reason: a cached cast is untracked
        try:
            with self:
                out = fn(*tensors)
        finally:
            torch.set_autocast_cache_enabled(cache)
            _active.recorder = outer
        try:
            self.graph.output([self._arg(t) for t in out])
            return torch.fx.GraphModule(self.root, self.graph, "jit_trace")
        except Exception as e:
            raise RecordError(f"building the graph failed: {e}") from e
