"""Every private torch API the library uses, in one module, so that a torch upgrade breaks here.

Each name below is a private (underscore) torch module, class or function, or lives in one. The
comment above each says what we use it for and the torch versions it was checked on; a torch
release that moves or changes one is handled in this file only.
``tests/package/test_compat.py`` fails on a private torch name anywhere else in the library (tests
and benchmarks are exempt: they use
torch's internals as oracles, e.g. ``torch.testing._internal``'s OpInfo database), and checks
that every name here resolves on the installed torch.

Not routed here: private *attributes of objects* torch hands us (``OpOverload._schema``,
``OpOverload._op``, ``Tensor._base``, ``Tensor._use_count``, ``untyped_storage()._cdata``).
They are read in many rules, cannot be imported, and torch's own extension docs use them.

Modules that are imported lazily by their callers (``torch._decomp``, ``torch._inductor``,
``torch._guards``, ``torch._subclasses.fake_tensor``, ``torch._prims_common``) stay lazy here
too: they are functions, so importing this module costs nothing at cold start.

It also holds what differs between the supported torch versions (pyproject: ``torch>=2.13,<2.16``),
so that version-aware code reads a named fact instead of comparing version strings.

Note [Supported torch versions]
    We match PyTorch bit for bit where we can, so where torch changed a formula between
    releases we follow the installed torch (a rule of ours that computed 2.13's formula on 2.15
    would be a silent difference from PyTorch there). Each fact below names the torch
    change it stands for; docs/design/torch-versions.md lists them with the tests
    that pin each one. Other version-dependent torch API this library relies on:
    ``torch.autograd.Function.apply`` (a Python classmethod up to 2.14, a C
    ``classmethod_descriptor`` in 2.15: ``_autograd_function._original_apply``) and the
    namespace torch.compile writes into tree specs (``_pytree.same_structure``).
"""

from __future__ import annotations

import importlib
import re
import sys

import torch
import torch.utils._pytree as torch_pytree  # checked on 2.13.0, 2.15.0; arg_tree_leaves, tree_map

# -- dispatch modes (checked on 2.13.0, 2.15.0) ---------------------------------------------------
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    autograd_would_have_decomposed,
)

__all__ = [
    "device_context_class",
    "dynamo_skip_paths",
    "being_imported",
    "top_saved_tensors_hooks",
    "is_any_autocast_enabled",
    "neg_view",
    "ADInplaceOrView",
    "AutoDispatchBelowADInplaceOrView",
    "AutogradFunctionality",
    "AutogradNestedTensor",
    "AutogradOther",
    "CompositeImplicitAutograd",
    "DisableTorchDispatch",
    "DisableTorchFunction",
    "DisableTorchFunctionSubclass",
    "DispatchKey",
    "DispatchKeySet",
    "ForceDispatchKeyGuard",
    "OpOverload",
    "OpOverloadPacket",
    "RANDOM_GUARD_KEY",
    "SetExcludeDispatchKeyGuard",
    "SingleLevelFunction",
    "TensorBase",
    "binding_homes",
    "TorchDispatchMode",
    "autograd_would_have_decomposed",
    "has_kernel_for_dispatch_key",
    "UncompiledDispatchMode",
    "BatchNormBase",
    "compile_fx",
    "decomposition_table",
    "disable_current_modes",
    "disabled_torch_function_impl",
    "dispatch_tls_is_dispatch_key_excluded",
    "dispatch_tls_is_dispatch_key_included",
    "dispatch_tls_local_exclude_set",
    "dispatch_tls_local_include_set",
    "dispatch_tls_set_dispatch_key_excluded",
    "dispatch_tls_set_dispatch_key_included",
    "dispatch_keyset_full_after",
    "elementwise_dtypes",
    "fake_tensor_mode",
    "has_internal_overlap",
    "has_cpu_kernel",
    "is_fake_tensor",
    "is_fwd_grad_enabled",
    "is_torch_function_mode_enabled",
    "register_subclass_dispatch_rules",
    "len_torch_dispatch_stack",
    "make_wrapper_subclass",
    "set_conj",
    "set_neg",
    "nested_tensor_from_tensor_list",
    "set_fwd_grad_enabled",
    "set_grad_enabled",
    "storage_use_count",
    "storage_address",
    "swap_proxy_slots",
    "proxy_tracing",
    "swap_tensor_impl",
    "tensor_requires_grad",
    "tensor_set_data",
    "current_autograd_node",
    "unpack_dual",
    "forward_ad_state",
    "torch_pytree",
    "tracing_context",
]

_C = torch._C


class UncompiledDispatchMode(TorchDispatchMode):
    """A ``TorchDispatchMode`` whose ``__torch_dispatch__`` torch leaves unwrapped. torch wraps
    a mode's ``__torch_dispatch__`` in ``torch._disable_dynamo``, which imports ``torch._dynamo``
    (and sympy: ~850 modules, ~0.8 s of CPU) at the mode's first op, so dynamo never compiles
    it. Ours are in our packages, on dynamo's skip list once dynamo is loaded (Note [torch.compile
    inside our transforms], _core/compiling.py): a first ``jit`` call imports none of it (Note
    [Recording static traces], _jit/_record.py). ``_should_skip_dynamo``: checked on 2.13.0,
    2.15.0."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


# A context manager that turns every active TorchDispatchMode off (a jit trace, an audit) for
# bookkeeping that is no part of the computation.
disable_current_modes = _disable_current_modes
# The depth of the mode stack: 0 means no mode is active (checked before paying for a mode).
len_torch_dispatch_stack = _C._len_torch_dispatch_stack
# the modes torch's pre-dispatch tracing pushes (what disable_current_modes pops besides the
# stack above): with neither, there is nothing to disable (and no import of its mode classes)
len_pre_dispatch_stack = torch._ops._len_torch_dispatch_stack_pre_dispatch
# The TorchFunctionMode stack (checked on 2.13.0, 2.15.0): its depth, its modes, and the mode
# class torch.set_default_device pushes (jit keys on its device; any other mode sees f's calls).
len_torch_function_stack = _C._len_torch_function_stack
function_mode_stack = torch.overrides._get_current_function_mode_stack


def device_context_class():
    """The mode class of ``torch.set_default_device`` (its module loads on first use)."""
    return importlib.import_module("torch.utils._device").DeviceContext


# whether any device's autocast is on (one C call: jit checks it per call of an autocast entry)
is_any_autocast_enabled = _C._is_any_autocast_enabled
# a lazily negated view (the neg bit), as conj() is a lazily conjugated one
neg_view = torch._neg_view

# -- wrapper tensor subclasses (checked on 2.13.0, 2.15.0) ----------------------------------------
# The one way to build a tensor subclass with its own metadata and no storage of its own.
make_wrapper_subclass = torch.Tensor._make_wrapper_subclass
# ``__torch_function__ = disabled_torch_function_impl``: the subclass is invisible to the
# torch-function layer, so every op reaches ``__torch_dispatch__`` (what torch's own wrapper
# subclasses do).
disabled_torch_function_impl = _C._disabled_torch_function_impl
is_torch_function_mode_enabled = _C._is_torch_function_mode_enabled
# Dispatch off inside a block, for metadata work on a wrapper (``as_strided_`` of a wrapper,
# storage positions) that must not re-enter the interpreters.
DisableTorchDispatch = _C._DisableTorchDispatch
DisableTorchFunction = _C.DisableTorchFunction
# Below the autograd and ADInplaceOrView keys: views made here are not registered as views
# (Note [Many views at once], batching/views.py). Checked on 2.13.0, 2.15.0.
AutoDispatchBelowADInplaceOrView = _C._AutoDispatchBelowADInplaceOrView
# Sets a tensor's conjugate bit (a wrapper that stands for a lazy conjugate: Note [Conjugate
# views under vmap], batching/views.py). Checked on 2.13.0, 2.15.0.
set_conj = _C._set_conj
# Sets a tensor's negative bit (the metadata of a jit trace's values: Note [Recording static
# traces], _jit/_record.py). Checked on 2.13.0, 2.15.0.
set_neg = _C._set_neg
DisableTorchFunctionSubclass = _C.DisableTorchFunctionSubclass
# The C++ base of torch.Tensor: its metadata accessors (``dtype``, ``shape``, ``stride``, ...)
# read under DisableTorchFunctionSubclass (Note [Metadata reads without __torch_function__],
# batching/_tensor.py). Checked on 2.13.0, 2.15.0.
TensorBase = _C.TensorBase
# Exchange two tensors' TensorImpls, keeping the Python objects (promoting a plain buffer that
# a transformed function writes into: Note [Writing into a plain tensor]).
swap_tensor_impl = _C._swap_tensor_impl
# Where torch's Python bindings of the ATen ops live (``torch.sin``, ``F.linear``'s
# ``torch._C._nn.linear``, the Tensor methods): the jit's replay calls them directly (Note
# [Replay through Python bindings], functransforms/_jit/_passes.py). Checked on 2.13.0, 2.15.0.
binding_homes = (_C._VariableFunctions, _C._nn, _C.TensorBase)


def proxy_tracing() -> bool:
    """Whether a tracer records ATen ops below our wrappers: make_fx (``ft.jit(dynamic=True)``,
    or a caller's) or jit's own recorder (Note [Recording static traces], _jit/_record.py).
    Its mode declines an op on a wrapper, and torch's dispatch then holds one more reference
    to each argument while the wrapper's ``__torch_dispatch__`` runs. Checked on 2.13.0,
    2.15.0."""
    record = sys.modules.get("functransforms._jit._record")
    if record is not None and record.recording():
        return True
    proxy_tensor = sys.modules.get("torch.fx.experimental.proxy_tensor")
    return proxy_tensor is not None and proxy_tensor.get_proxy_mode() is not None


# The innermost saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``): ``(pack,
# unpack)`` or None; the argument is ``ignore_is_tracing``. A grad level refuses the user's
# (Note [Saved tensor hooks under grad], autodiff/reverse.py). Checked on 2.13.0, 2.15.0.
top_saved_tensors_hooks = _C._autograd._top_saved_tensors_default_hooks


def being_imported(name: str) -> bool:
    """Is module ``name`` in ``sys.modules`` but still executing its import (in another
    thread, or up this thread's stack)? Its attributes may be missing, and importing its
    submodules from here can deadlock on the import locks."""
    mod = sys.modules.get(name)
    spec = getattr(mod, "__spec__", None) if mod is not None else None
    return bool(getattr(spec, "_initializing", False))


def dynamo_skip_paths(paths) -> None:
    """Tell dynamo (``torch.compile``) to run the code under these paths (files, or folders
    ending in ``/``) as it runs torch's own internals: never trace into it, call it eagerly (a
    graph break where a traced frame calls in). What ``torch._dynamo.trace_rules.add`` does per
    module, with one recompile of the pattern for all (``add`` costs ~10 ms each). Checked on
    2.13.0, 2.15.0 (Note [torch.compile inside our transforms], _core/compiling.py)."""
    trace_rules = importlib.import_module("torch._dynamo.trace_rules")
    trace_rules.SKIP_DIRS.extend(p.replace("\\", "/") for p in paths)
    trace_rules._recompile_re()


def swap_proxy_slots(a, b, *, share=False):
    """Under ``make_fx`` (``ft.jit``): after ``swap_tensor_impl(a, b)``, exchange what the
    tracer knows about the two Python objects too (its tracker is keyed by object, not by
    impl), else an op on a promoted buffer is recorded on the buffer's old value. With
    ``share``, ``a`` takes ``b``'s record and ``b`` keeps it (a tensor given its memory back
    aliases the holder). Checked on 2.13.0, 2.15.0 (``tracer.tensor_tracker``)."""
    record = sys.modules.get("functransforms._jit._record")
    if record is not None:  # jit's own recorder (Note [Recording static traces])
        record.swap_records(a, b, share)
    proxy_tensor = sys.modules.get("torch.fx.experimental.proxy_tensor")
    mode = proxy_tensor.get_proxy_mode() if proxy_tensor is not None else None
    if mode is None:
        return
    tracker = mode.tracer.tensor_tracker
    pa, pb = tracker.get(a), tracker.get(b)
    if share:
        if pb is not None:
            tracker[a] = pb
        return
    for t, p in ((a, pb), (b, pa)):
        if p is None:
            if t in tracker:
                del tracker[t]
        else:
            tracker[t] = p


# the C-level flag, below any Python property a subclass defines (GradTensor.requires_grad)
tensor_requires_grad = _C.TensorBase.requires_grad.__get__
# ``x.data = y``'s C setter, for wrappers that define their own ``data`` getter (Note [torch's own
# detach of a wrapper]); checked on 2.13.0, 2.15.0.
tensor_set_data = _C.TensorBase.data.__set__
# The autograd node torch's engine is running, None outside a backward pass (names torch's
# checkpoint in EscapedTracerError); checked on 2.13.0, 2.15.0.
current_autograd_node = _C._current_autograd_node
# Whether a tensor carries a tangent of torch's forward AD at a level, and which level is open:
# read only to refuse such tangents in our rules (Note [Torch forward AD through our
# transforms]), never to compute one. ``_current_level`` is -1 outside ``dual_level()``;
# checked on 2.13.0, 2.15.0.
unpack_dual = torch._VF._unpack_dual
forward_ad_state = importlib.import_module("torch.autograd.forward_ad")
# How many TensorImpls share a storage (a buffer aliased elsewhere is not promoted).
storage_use_count = _C._storage_Use_Count
# The address of a tensor's StorageImpl (what storage_use_count takes), without making the
# storage's Python object: once made, that object holds a reference for the storage's lifetime.
storage_address = _C._storage_address
# Nonzero when a tensor's memory overlaps itself (expanded views cannot be promoted).
has_internal_overlap = torch._debug_has_internal_overlap

# -- dispatch keys and thread-local dispatch state (checked on 2.13.0, 2.15.0) -------------------
# The dispatch key that vmap(randomness='error') borrows to catch random factory ops (Note
# [Random ops by their tags]): torch has no key reserved for third-party modes, and registers
# nothing on this one.
RANDOM_GUARD_KEY = "TESTING_ONLY_GenericMode"
DispatchKey = _C.DispatchKey
DispatchKeySet = _C.DispatchKeySet
CompositeImplicitAutograd = DispatchKey.CompositeImplicitAutograd
# Whether an op has a kernel for a dispatch key (``(op.name(), key)``); with
# ``autograd_would_have_decomposed`` (imported above), how jit's recorder decides, as make_fx
# does, to decompose a CompositeImplicitAutograd op that reached it (Note [Recording static
# traces], _jit/_record.py). Checked on 2.13.0, 2.15.0.
has_kernel_for_dispatch_key = _C._dispatch_has_kernel_for_dispatch_key
AutogradFunctionality = DispatchKey.AutogradFunctionality
AutogradOther = DispatchKey.AutogradOther
AutogradNestedTensor = DispatchKey.AutogradNestedTensor
ADInplaceOrView = DispatchKey.ADInplaceOrView
ForceDispatchKeyGuard = _C._ForceDispatchKeyGuard
SetExcludeDispatchKeyGuard = _C._SetExcludeDispatchKeyGuard
dispatch_tls_local_include_set = _C._dispatch_tls_local_include_set
dispatch_tls_local_exclude_set = _C._dispatch_tls_local_exclude_set
dispatch_tls_is_dispatch_key_excluded = _C._dispatch_tls_is_dispatch_key_excluded
dispatch_tls_is_dispatch_key_included = _C._dispatch_tls_is_dispatch_key_included
dispatch_tls_set_dispatch_key_excluded = _C._dispatch_tls_set_dispatch_key_excluded
dispatch_tls_set_dispatch_key_included = _C._dispatch_tls_set_dispatch_key_included
# The keys below one key: what a kernel registered at that key redispatches to (Note [RNN
# kernels under transforms], functransforms/_core/rnn.py).
dispatch_keyset_full_after = _C._dispatch_keyset_full_after


# -- per-op subclass dispatch rules (checked on 2.13.0, 2.15.0) ---------------------------------
# Note [Entering through registered rules] (functransforms/_core/levels.py). torch's C++ subclass
# dispatch (``dispatch_on_subclass``) first asks ``torch._library.simple_registry`` for a rule
# registered for (op, type) -- the table behind ``torch.library.register_torch_dispatch`` --
# and only when there is none checks the argument for DTensor, which imports
# ``torch.distributed.tensor`` (and sympy, ~1 s) at the first subclass op of the process. We
# fill the table directly by qualified name: ``register_torch_dispatch`` would build an
# ``OpOverload`` per op (~10x the cost).
def register_subclass_dispatch_rules(classes, rule_of, packets, exact=()) -> int:
    """Register ``rule_of(cls)`` as the ``__torch_dispatch__`` rule of each class in
    ``classes`` for every overload of the ops named in ``packets`` (``"aten::sin"``; with its
    in-place variant ``"aten::sin_"``), except ``out=`` overloads and backend-specific
    families that never meet a transform. Other ops keep torch's default path: correct, only
    the first of them in a process pays the import. ``exact`` names overloads
    (``"ns::name.overload"``) to register even before they are defined (custom ops a torch
    module defines on its lazy import; the table is keyed by name, and an entry made before the
    op exists differs only in its effect, which torch derives from script-object arguments:
    the callers' ops have none). Returns how many ops were registered."""
    from torch._library.simple_registry import singleton

    wanted = set(packets)
    wanted |= {p + "_" for p in wanted}
    rules = [(cls, rule_of(cls)) for cls in classes]
    count = 0
    for name in _C._dispatch_get_all_op_names():
        base, _, overload = name.partition(".")
        if base not in wanted or overload.endswith("out") or _BACKEND_ONLY.search(name):
            continue
        # Creating the registry entry is the cost (~20-30 us: torch looks up the op's schema
        # for its effects table), hence registering the ops that reach us, not all 3600.
        table = singleton.find(name).torch_dispatch_rules._data
        for cls, rule in rules:
            table.setdefault(cls, rule)  # a rule someone registered first wins
        count += 1
    for name in exact:
        if name.endswith(".default"):  # the table's key of a default overload has no suffix
            name = name[: -len(".default")]
        table = singleton.find(name).torch_dispatch_rules._data
        for cls, rule in rules:
            table.setdefault(cls, rule)
        count += 1
    return count


_BACKEND_ONLY = re.compile(
    "cudnn|miopen|mkldnn|onednn|quantize|fbgemm|_foreach_|sparse|nested|_mps|xpu|vulkan|"
    "::q_|_fused_adam|_fused_sgd|_cslt|_efficientzerotensor|_test_|_amp_"
)


# -- grad modes (checked on 2.13.0, 2.15.0) -------------------------------------------------------
# The C setters, not the context managers: entering/leaving a level sets a flag without the
# context manager's Python frames (on the per-call path).
set_grad_enabled = _C._set_grad_enabled
# PyTorch's (functorch's) innermost active transform, None outside them (checked on 2.13.0, 2.15.0)
functorch_interpreter = _C._functorch.peek_interpreter_stack
_functorch_wrapped = _C._functorch.is_functorch_wrapped_tensor
_functorch_batched = _C._functorch.is_batchedtensor
_functorch_unwrapped = _C._functorch.get_unwrapped


def torch_differentiates(t: torch.Tensor) -> bool:
    """Whether one of torch's autodiff systems differentiates ``t``: a grad/jvp level of torch's
    own transforms wraps it (batching levels are looked through), torch's autograd tracks it
    (grad mode on), or it carries a tangent of torch's forward AD (its dual level, read, never
    entered). Read only to decide whether linalg builds its implicitly differentiated solve
    (checked on 2.13.0, 2.15.0)."""
    while _functorch_wrapped(t):
        if not _functorch_batched(t):
            return True
        t = _functorch_unwrapped(t)
    if t.requires_grad and torch.is_grad_enabled():
        return True
    level = forward_ad_state._current_level
    return level >= 0 and unpack_dual(t, level)[1] is not None


def is_torch_transform_wrapper(t: torch.Tensor) -> bool:
    """A wrapper of torch's own transforms (grad, jvp or vmap level) around ``t``'s value."""
    return _functorch_wrapped(t)


is_fwd_grad_enabled = _C._is_fwd_grad_enabled
set_fwd_grad_enabled = _C._set_fwd_grad_enabled

# -- op objects (checked on 2.13.0, 2.15.0) -------------------------------------------------------
# The classes of ``torch.ops.aten.sin.default`` and ``torch.ops.aten.sin``.
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket
# What OpOverloadPacket reads an op's overloads with, as C calls: ``(op, overload names)`` or
# ``(None, None)`` of ``"ns::name"``, the schema and ``(op, op_dk, tags)`` of one overload (""
# is the default): asking about many ops without making (and keeping) their Python objects
op_overload_names = _C._jit_get_operation
op_schema = _C._get_schema
op_overload_entry = _C._get_operation_overload

# -- nested tensors (checked on 2.13.0, 2.15.0) ---------------------------------------------------
# What PyTorch's nested fallback nests per-component results with (a strided nested tensor,
# differentiable by torch's autograd): Note [Nested tensors under vmap] (batching/_nested.py).
nested_tensor_from_tensor_list = torch._nested_tensor_from_tensor_list

# -- classes we recognise (checked on 2.13.0, 2.15.0) ---------------------------------------------
# An autograd.Function that does not override setup_context inherits this one.
SingleLevelFunction = torch.autograd.function._SingleLevelFunction
# The base class of BatchNorm1d/2d/3d (and their lazy variants).
BatchNormBase = torch.nn.modules.batchnorm._BatchNorm


# -- lazily imported modules (checked on 2.13.0, 2.15.0) ------------------------------------------
def decomposition_table():
    """``torch._decomp.decomposition_table`` (imported on the first op without a rule)."""
    from torch._decomp import decomposition_table as table

    return table


def elementwise_dtypes(*args, type_promotion_kind="DEFAULT"):
    """``torch._prims_common.elementwise_dtypes`` with the promotion kind given by name."""
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND
    from torch._prims_common import elementwise_dtypes as dtypes

    kind = getattr(ELEMENTWISE_TYPE_PROMOTION_KIND, type_promotion_kind)
    return dtypes(*args, type_promotion_kind=kind)


def is_fake_tensor(t) -> bool:
    """``isinstance(t, torch._subclasses.FakeTensor)`` (a jit trace's metadata tensors)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def has_cpu_kernel(op) -> bool:
    """Does ``op`` (an OpOverload) have a kernel of its own for the CPU dispatch key (not
    only a composite one, such as the generated ``out=`` overloads that copy a result)?"""
    return _C._dispatch_has_kernel_for_dispatch_key(op.name(), "CPU")


def compile_fx(gm, example_inputs):
    """``torch._inductor.compile_fx.compile_fx``: inductor without dynamo's guards."""
    from torch._inductor.compile_fx import compile_fx as compile_

    return compile_(gm, example_inputs)


# torch.fx keeps the source of every GraphModule it compiles, for tracebacks, in a process-wide
# loader (``torch.fx.graph_module._loader``: ``eval_cache`` by key ``<eval_with_key>.<id>``, ids
# from ``next_id``) and a lazy ``linecache`` entry, and never drops them: a jit retracing
# forever grew by ~8 KB per trace (Note [Sources of dropped graphs], _jit/_trace.py). Checked on
# 2.13.0, 2.15.0.
def fx_source_mark() -> int:
    """The id torch.fx gives the next graph source it keeps."""
    from torch.fx import graph_module

    return graph_module._loader.next_id


def fx_sources_since(mark: int) -> list:
    """The keys of the graph sources torch.fx kept since ``fx_source_mark()`` was ``mark``."""
    from torch.fx import graph_module

    loader = graph_module._loader
    ids = {f"<eval_with_key>.{i}" for i in range(mark, loader.next_id)}
    # a key may go on with " from <file>:<line> in <name>"
    return [k for k in list(loader.eval_cache) if k.partition(" ")[0] in ids]


def forget_fx_sources(keys) -> None:
    """Drop the sources of graphs that are gone (their code can no longer be in a traceback)."""
    import linecache

    from torch.fx import graph_module

    cache = graph_module._loader.eval_cache
    for key in keys:
        cache.pop(key, None)
        linecache.cache.pop(key, None)


def fake_tensor_mode(**kwargs):
    """A ``torch._subclasses.fake_tensor.FakeTensorMode``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**kwargs)


def tracing_context(fake_mode):
    """``torch._guards.tracing(TracingContext(fake_mode))``: one fake mode for a whole trace."""
    from torch._guards import TracingContext, tracing

    return tracing(TracingContext(fake_mode))


# -- facts that differ between supported torch versions (Note [Supported torch versions]) ----
def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_VERSION = _minor(torch.__version__)
"""(major, minor) of the installed torch, e.g. ``(2, 15)``."""

TORCH_MINOR = f"{TORCH_VERSION[0]}.{TORCH_VERSION[1]}"
"""``"2.15"``: the key of per-version tables (conformance expected failures, coverage)."""

DOCS_TORCH = "2.13"
"""The torch the generated docs (docs/coverage.md, docs/conformance.md) and the base table of
conformance expected failures are made with (the oldest supported); other versions get
overlays and pages of their own (docs/coverage-torch2.15.md)."""

# torch 2.15 derivatives.yaml: fmax/fmin, clamp_min/clamp_max/clamp with Tensor bounds split the
# derivative evenly at ties (as maximum/minimum always did); in 2.13 it goes to `self` (2.14 is
# not installed here: it is taken to be 2.13's).
SPLIT_TIES_FMAX_CLAMP_TENSOR = TORCH_VERSION >= (2, 15)

# torch 2.15's F.linear of a 1-d input (``_flatten_nd_linear``) ends with ``_unsafe_view`` where
# 2.13's ends with ``view``: the grad_fn name of the node that records it (autodiff/_fastpath.py)
LINEAR_ENDS_UNSAFE_VIEW = TORCH_VERSION >= (2, 15)

# torch 2.15: clamp / clamp_min / clamp_max with Number bounds pass the derivative only strictly
# inside the bounds (0 at x == min or max); 2.13 passes it at the bounds too.
CLAMP_BOUNDS_EXCLUDED = TORCH_VERSION >= (2, 15)

# torch 2.15 derivatives.yaml: log_ndtr's derivative multiplies by 1/sqrt(2 pi) (a constant)
# where 2.13 divided by sqrt(2 pi): the float32 results round differently.
LOG_NDTR_MULTIPLIES = TORCH_VERSION >= (2, 15)
