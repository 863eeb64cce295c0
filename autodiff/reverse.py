"""Reverse mode: GradTensor, the tape, the grad interpreter and the backward sweep.

Note [The tape]
    Each op on a GradTensor of level L records a ``Node`` holding the vjp rule, the unwrapped
    inputs, the output and, per input, the node that produced it. Node ids grow with creation, so
    sweeping the nodes reachable from the outputs in decreasing id order visits every node after
    all its consumers. The sweep runs ordinary torch ops on cotangents after level L has exited:
    the values it touches are plain tensors or wrappers of *lower* levels, so an enclosing vmap
    batches the backward pass and an enclosing grad/jvp differentiates it.

Note [Grad mode]
    PyTorch's semantics, which follow torch's autograd: ``torch.no_grad()``,
    ``set_grad_enabled(False)`` or ``inference_mode()`` *inside* the transformed function stops
    recording at every grad level (what it computes is a constant), while a no_grad around the
    *call* does not stop the transform (a level enables grad mode for the function it runs, and
    restores the caller's mode on exit). A level entered under no_grad runs the ops it hands
    down (on unwrapped values: to outer levels and to torch's autograd) under no_grad, so the
    results of ``grad`` called under no_grad do not require grad in torch's sense. functorch
    does the same (``prevGradMode`` in its grad interpreter).
"""

from __future__ import annotations

import heapq
import itertools
import sys
import weakref
from collections import OrderedDict  # weakly referable, as RemovableHandle needs

import torch

from functransforms import _compat
from functransforms import _pytree as pt
from functransforms._ad import vjp
from functransforms._core.compiling import eager_under_compile
from functransforms._core.decomp import decomposition
from functransforms._core.levels import (
    DEFERRING,
    Interpreter,
    TransformTensor,
    below_torch_autograd,
    data_as_constant,
    interpreter_stack,
    redispatch,
)
from functransforms._core.metadata import (
    SLOW_METADATA,
    PlainMetadata,
    is_floating,
    metadata,
    metadata_conj,
)
from functransforms._core.ops import facts

from ._registry import decompose, missing_rule
from ._torch_graph import written_under_no_grad
from ._util import (
    InplaceMixin,
    any_floating,
    composite_implicit,
    match_dtype,
    resolve_lazy,
    restride,
    unwrap_level,
)

_mk = _compat.make_wrapper_subclass
_STRIDED = torch.strided
_ids = itertools.count()
_grad_enabled = torch.is_grad_enabled


# Note [Writes into saved constants]
#     A node keeps its op's arguments for the backward pass. The values of this level are never
#     written in place (their in-place ops rebind the wrapper to a new value), but a constant of
#     the level (a captured tensor, a buffer made inside the function, an outer transform's
#     value) is the user's object: ``z = x * w; w.add_(1)`` (or a write that promotes ``w``:
#     Note [Writing into a plain tensor]) changed what the rule of ``x * w`` would read, and the
#     gradient came out with the new ``w``, silently. As torch's saved variables, each node
#     notes the version counter (and class: promotion swaps it) of its tensor constants, and
#     the sweep raises torch's error when one changed. Writes a kernel makes itself (batch
#     norm's running statistics) do not bump the counter, in torch as here.
class Node:
    __slots__ = (
        "id",
        "rule",
        "primals",
        "kwargs",
        "out",
        "inputs",
        "needs",
        "name",
        "versions",
        "__weakref__",
    )

    def __init__(self, rule, primals, kwargs, out, inputs, needs):
        self.id = next(_ids)
        self.rule = rule
        self.primals = primals
        self.kwargs = kwargs
        self.out = out
        self.inputs = inputs  # per positional arg: None | (Node, idx) | list of those
        self.needs = needs
        # Note [Writes into saved constants]
        versions = None
        for p, i in zip(primals, inputs):
            if i is None and isinstance(p, _Tensor):
                try:
                    version = p._version
                except RuntimeError:  # an inference tensor: no counter, in torch either
                    continue
                if versions is None:
                    versions = []
                versions.append((p, p.__class__, version))
        self.versions = versions


class Leaf(Node):
    """The node of a value the user differentiates with respect to."""

    __slots__ = ()

    def __init__(self):
        self.id = next(_ids)
        self.inputs = ()


class GradTensor(TransformTensor):
    """A value tracked by one grad/vjp level: its primal and the node that produced it."""

    _primal: torch.Tensor
    _node: Node
    _idx: int
    _base = None  # Note [In-place ops and views under jvp and grad]
    _chain = ()
    _views = None

    def _inner_requires_grad(self):  # Note [Torch autograd through our transforms]
        p = self._primal
        if type(p) is _Tensor:  # the common case first: this runs for every op
            return p.requires_grad
        return not isinstance(p, TransformTensor) and _torch_requires_grad(p)

    def _describe(self):
        return f"GradTensor(lvl={self._interp.level}, primal={self._primal!r})"

    # Note [requires_grad and grad_fn inside grad]
    #     As PyTorch's wrappers do, a value a grad level tracks reads as requiring grad, and
    #     one computed from the inputs (an op's or an autograd.Function's output) has a grad_fn
    #     (our tape node, named after the op); the inputs themselves are leaves. User code
    #     branches on these (``if out.requires_grad: ctx.save...``, ``assert y.grad_fn``).
    #     Python-level reads only: torch's C++ autograd still sees the wrapper's own flag, so it
    #     does not record on wrappers (Note [Torch autograd through our transforms]); library
    #     code that means torch's flag reads it with ``_torch_requires_grad``.
    @property
    def requires_grad(self):
        return True

    @requires_grad.setter
    def requires_grad(self, value):
        self.requires_grad_(value)  # raises, as in PyTorch

    @property
    def grad_fn(self):
        node = self._node
        return None if isinstance(node, Leaf) else GradFn(node)

    @property
    def is_leaf(self):
        return isinstance(self._node, Leaf)

    data = data_as_constant  # Note [torch's own detach of a wrapper]

    def register_hook(self, hook):
        """Run ``hook(ct)`` on this value's cotangent in the level's backward sweep, as
        functorch does (Note [Tensor hooks inside grad]); the hook may return a replacement."""
        if self._interp.call.startswith("linearize("):
            # linearize records reverse mode only to transpose it into a jvp: a hook on a
            # cotangent has no meaning for the tangents (functorch's linearize refuses it too)
            raise RuntimeError(
                f"{self._interp.call}: x.register_hook(hook) inside linearize: the function is "
                "differentiated in forward mode, which has no cotangents to hook (as in "
                "functorch). Expected: the hook inside grad/vjp."
            )
        hooks = _HOOKS.setdefault(self._node, {}).setdefault(self._idx, OrderedDict())
        handle = torch.utils.hooks.RemovableHandle(hooks)
        if not _engine_hook(hook):  # Note [Tensor hooks inside grad]: kept, never run
            hooks[handle.id] = hook
        return handle


class GradFn:
    """``x.grad_fn`` of a value a grad level computed (Note [requires_grad and grad_fn inside
    grad]): the tape node, named as torch names its nodes (``MulBackward``)."""

    __slots__ = ("_node",)

    def __init__(self, node):
        self._node = node

    def name(self):
        what = getattr(self._node, "name", None)  # an OpOverload, or a custom function's name
        base = what._schema.name.split("::")[-1] if hasattr(what, "_schema") else str(what)
        return "".join(w[:1].upper() + w[1:] for w in base.split("_")) + "Backward"

    def __repr__(self):
        return f"<{self.name()} (functransforms tape node {self._node.id})>"


# Note [Tensor hooks inside grad]
#     ``y.register_hook(h)`` on a value a grad level tracks (torch's would reach for a C++
#     grad_fn our wrappers do not have) puts ``h`` here, by the value's tape node and output
#     index. The sweep visits a node once every consumer has added its cotangent, so that is
#     where the node's hooks see the whole cotangent and may replace it, as torch's hooks do;
#     the inputs' hooks run on their final cotangents. Nothing is read while no hook exists.
#     The per-tensor hooks of ``torch.autograd.graph.register_multi_grad_hook`` (module
#     backward tracking: ``ModuleTracker``, so ``FlopCounterMode``) group calls by torch's
#     engine's graph task and assert they run inside one; our sweep is not torch's engine, so
#     they are not run here (their handle is still returned): FlopCounterMode around our grad
#     counts every op, and attributes the backward's to the modules around the call.
_HOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Node -> {idx: {id: hook}}


def _engine_hook(hook) -> bool:
    """Whether ``hook`` is one of register_multi_grad_hook's, which need torch's engine."""
    code = getattr(hook, "__code__", None)
    return (
        code is not None
        and code.co_name in ("inner_hook", "wrapped_fn")
        and code.co_filename == torch.autograd.graph.__file__
    )


_torch_requires_grad = _compat.tensor_requires_grad
_Tensor = torch.Tensor
_no_torch_function = _compat.disabled_torch_function_impl

# Note [Torch functions at the grad level under vmap]
#     Under ``vmap(grad(f))`` every op of ``f`` pays two levels of dispatch (grad, then vmap), and a
#     composite function pays them for each op it decomposes into: ``F.linear`` of one example is
#     view, t, addmm, view, four tape nodes and four trips through both levels, ~70% of the
#     per-sample-gradient MLP's forward at B=8 (benchmarks/bench_core.py, row (a)). A grad level
#     entered directly inside a vmap therefore wraps its values in ``GradTensorInVmap``, whose
#     ``__torch_function__`` sees such functions whole: a function in ``GRAD_FAST``
#     (autodiff/_fastpath.py) may record it as one node whose vjp rule computes what the
#     decomposition's rules would, and run it once on the unwrapped values (where the vmap level's
#     own fast paths apply); anything it declines, and every other function, goes on as before
#     (``_disabled_torch_function_impl``: the C++ dispatch and ``__torch_dispatch__``). Only there:
#     a grad level elsewhere keeps the plain GradTensor, with no Python call before dispatch (the
#     grad-only rows of benchmarks/bench_regression.py pay nothing). BatchedTensor's
#     ``__torch_function__`` declines a ``GRAD_FAST`` function when a GradTensorInVmap is among the
#     arguments (``F.linear(x, w, b)`` with a batched ``x`` and tracked ``w``), so the grad level,
#     the innermost, sees it first.
GRAD_FAST: dict = {}  # torch function -> fast(args, kwargs): the result, or None to decline


class GradTensorInVmap(PlainMetadata, GradTensor):
    """A GradTensor of a grad level entered directly inside a vmap (Note [Torch functions at
    the grad level under vmap])."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        fast = GRAD_FAST.get(func)
        if fast is not None:
            out = fast(args, kwargs)
            if out is not None:
                return out
        return _no_torch_function(func, types, args, kwargs or {})

    # metadata accessors: PlainMetadata's (Note [Metadata reads without __torch_function__])


SLOW_METADATA.add(GradTensorInVmap)  # Note [Reading a wrapper's metadata]
DEFERRING[GradTensorInVmap] = GRAD_FAST


def wrap_grad(primal, node, idx, interp, meta=None):
    """A GradTensor of ``primal``; ``meta``: its ``metadata`` when the caller has it."""
    # the primal's own strides, so torch's view-or-copy decisions on the wrapper are right
    shape, stride, dtype, device = meta or metadata(primal)  # Note [Reading a wrapper's metadata]
    # positional: parsing keyword arguments costs ~0.3 us per wrapper
    r = _mk(interp.wrapper_cls, shape, stride, None, None, dtype, _STRIDED, device)
    r.__dict__ = {"_primal": primal, "_node": node, "_idx": idx, "_interp": interp}  # one store
    return r


def _entry_of(a):
    return (a._node, a._idx)


# Note [Saved tensor hooks under grad]
#     ``saved_tensors_hooks`` act on what torch's autograd saves; our tape (Note [The tape])
#     saves its own values, so hooks around ``grad`` were skipped without a word: a hook that
#     changes what it saves (activation compression) changed torch's gradients and not ours.
#     functorch refuses every hook. We refuse the user's hooks active when a grad level is
#     entered, and let torch's own through (``save_on_cpu``, non-reentrant
#     ``torch.utils.checkpoint`` around the call): they give back what they saved, so skipping
#     them changes memory, not values. Hooks entered inside the function are not checked (one
#     look per op would cost every program): they apply to torch's autograd only, as torch's
#     checkpoint inside ``grad`` does (docs/torch_func_differences.md, sections 27 and 34).
def _raise_saved_tensors_hooks(call):
    from functransforms.errors import TransformError

    raise TransformError(
        f"{call}: called inside torch.autograd.graph.saved_tensors_hooks(...), whose hooks our "
        "transforms cannot apply (their tape does not save through torch's autograd: the hooks "
        "would be skipped, and gradients computed as without them). Expected: no saved tensor "
        "hooks around grad/vjp/jacrev/hessian (functorch refuses them too; torch's own "
        "save_on_cpu and checkpoint are let through). Do: enter the hooks around the code that "
        "uses torch's autograd only, not around the transform's call."
    )


class GradInterpreter(InplaceMixin, Interpreter):
    name = "grad"
    rule_kind = "vjp"
    decorator = "register_vjp_rule"

    def __init__(self, call="vjp(f)"):
        super().__init__()
        self.call = call  # the public call (grad, vjp, jacrev, hessian, ...), for error messages
        self.prev_grad = True  # grad mode when the level was entered (Note [Grad mode])

    wrapper_cls = GradTensor

    def __enter__(self):
        hooks = _compat.top_saved_tensors_hooks(False)
        if hooks is not None and not hooks[0].__module__.startswith("torch."):
            _raise_saved_tensors_hooks(self.call)  # Note [Saved tensor hooks under grad]
        # Note [Grad mode]: as PyTorch, recording is on inside the function whatever the
        # caller's grad mode, and the caller's mode is restored on exit.
        self.prev_grad = torch.is_grad_enabled()
        stack = interpreter_stack()
        if stack and stack[-1].name == "vmap":  # Note [Torch functions at the grad level ...]
            self.wrapper_cls = GradTensorInVmap
        super().__enter__()
        try:
            _compat.set_grad_enabled(True)
        except BaseException:  # Note [Entering is all or nothing] (functransforms/_core/levels.py)
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _compat.set_grad_enabled(self.prev_grad)

    def process(self, func, args, kwargs):
        f = facts(func)
        if f.inplace or f.inplace_view:
            return self._inplace(func, f, args, kwargs)
        if not _grad_enabled():  # Note [Grad mode]: no_grad inside the function: a constant
            return redispatch(func, unwrap_level(self, args, _entry_of)[0], kwargs)
        rule = f.vjp_rule  # Note [One record per op]
        if rule is None:
            d = composite_implicit(func) or decomposition(func)
            if d is not None:
                return decompose(self, func, d, args, kwargs)
        # Note [The grad level's common case]
        #     Every op at a grad level pays this method, and under grad(vmap(grad)) (MAML) the
        #     outer level records ~60 ops per call, so its common case is written out: the
        #     positional arguments unwrapped in one loop (unwrap_level's work, which lists of
        #     tensors still take), and when nothing of a lower level is left among them (no
        #     wrapper after unwrapping, no keyword arguments) the op is called directly, which
        #     is what ``redispatch`` does for such arguments after its own scan.
        primals = list(args)
        inputs = [None] * len(primals)
        direct = not kwargs
        for i, a in enumerate(args):
            if isinstance(a, TransformTensor):
                if a._interp is self:
                    p = a._primal
                    primals[i] = p
                    inputs[i] = (a._node, a._idx)
                    if direct and isinstance(p, TransformTensor):
                        direct = False
                else:
                    direct = False
            elif type(a) is list or type(a) is tuple:
                primals, inputs = unwrap_level(self, args, _entry_of)
                direct = False
                break
        # the value: the op itself, or what computes it in its place (VJP_FORWARD: the lazy
        # conj/neg views, Note [No lazy conjugate inside wrappers]; kernels that need the conj
        # keys, def_linalg(forward=) in autodiff/linalg.py)
        # Note [Direct route to the inner level]: the op itself goes on with its arguments as
        # __torch_dispatch__ received them
        run = f.vjp_forward
        if not self.prev_grad:  # lowered under the caller's no_grad (Note [Grad mode])
            with torch.no_grad():
                out = run(*primals, **kwargs) if run else redispatch(func, primals, kwargs)
        elif run is not None:
            out = run(*primals, **kwargs)
        elif direct:
            out = func(*primals)
        else:
            out = redispatch(func, primals, kwargs)
        if rule is None:
            if not any_floating(out):
                return out
            raise missing_rule(func, self.call, "vjp", "register_vjp_rule")
        if rule is NONDIFFERENTIABLE:
            if f.fresh_like:
                out = self._fresh_buffer(out)
            return out
        if isinstance(out, torch.Tensor):
            # Note [Reading a wrapper's metadata]: one read for the check and the wrapper
            shape, stride, dtype, device, conj = metadata_conj(out)
            if not (dtype.is_floating_point or dtype.is_complex):
                return out
            meta = (shape, stride, dtype, device)
            if conj:  # Note [No lazy conjugate inside wrappers]
                out = out.resolve_conj()
                meta = None
            saved = out
            keeps = getattr(rule, "keeps", None)
            if keeps is not None:  # Note [What a vjp rule keeps]
                primals, saved = _prune(primals, out, keeps)
            node = Node(rule, primals, kwargs, saved, inputs, [i is not None for i in inputs])
            node.name = func  # for grad_fn (Note [requires_grad and grad_fn inside grad])
            w = wrap_grad(out, node, 0, self, meta)
        else:
            out = type(out)(resolve_lazy(o) for o in out)
            node = Node(rule, primals, kwargs, out, inputs, [i is not None for i in inputs])
            node.name = func
            w = type(out)(
                wrap_grad(o, node, i, self) if isinstance(o, torch.Tensor) and is_floating(o) else o
                for i, o in enumerate(out)
            )
        if f.view:
            self._note_views(func, args, kwargs, w)
        return w

    def process_custom(self, custom_fn, args):
        """Note [Custom rules across levels]: one tape node whose vjp is the user's ``bwd``, or
        the transposed jvp rule of a custom_jvp function (as JAX)."""
        if custom_fn.bwd is None and custom_fn.jvp_rule is None:
            return custom_fn.fn(*args)  # custom_vmap: differentiate fn itself
        flat, spec = pt.tree_flatten(args)
        primals, inputs = unwrap_level(self, flat, _entry_of)
        p_args = pt.tree_unflatten(spec, primals)
        res = None
        if custom_fn.bwd is not None:
            out, res = custom_fn.fwd(*p_args)
            bwd = _custom_bwd(custom_fn, res, args, len(flat))
        else:
            out = custom_fn.fn(*p_args)
            bwd = _transposed_jvp(custom_fn, primals, p_args, spec)
        flat_out, out_spec = pt.tree_flatten(out)
        single = isinstance(out, torch.Tensor)

        # an autograd.Function after ctx.set_materialize_grads(False) gets None, as in torch
        materialize = custom_fn.bwd is None or custom_fn.materialize_grads(res)

        def custom_vjp_rule(ct, _primals, _kwargs, _out, _needs):
            if single:
                return bwd(ct)
            zeros = [
                c if c is not None or not materialize else torch.zeros_like(o)
                for c, o in zip(ct, flat_out)
            ]
            return bwd(pt.tree_unflatten(out_spec, zeros))

        saved = flat_out[0] if single else tuple(flat_out)
        needs = [i is not None for i in inputs]
        node = Node(custom_vjp_rule, primals, {}, saved, inputs, needs)
        # autograd.Function: its class name, for grad_fn (Note [requires_grad and grad_fn
        # inside grad])
        node.name = getattr(custom_fn.fn, "__name__", "CustomFunction")
        wrapped = [
            wrap_grad(o, node, i, self) if is_floating(o) else o for i, o in enumerate(flat_out)
        ]
        return pt.tree_unflatten(out_spec, wrapped)

    def _rebind(self, w, value):
        if isinstance(value, GradTensor) and value._interp is self:
            w._primal, w._node, w._idx = value._primal, value._node, value._idx
        elif not _grad_enabled() and value.shape == w._primal.shape:
            # Note [Grad mode]: written under no_grad (`with torch.no_grad(): w.mul_(2)`): as in
            # torch's autograd, the value changes and its history does not, at the levels below
            # as well: their ops ran under no_grad too, so ``value`` is a constant there; writing
            # it into the wrapper below (its own in-place path, under no_grad) keeps that
            # level's history, as functorch's in-place on the unwrapped value does. Replacing
            # the wrapper by ``value`` cut it: grad(grad(f)) of gaussian_nll_loss, whose
            # `var.clamp_(min=eps)` runs under no_grad, was zero (conformance vjp(vjp))
            below = w._primal
            if isinstance(below, TransformTensor):
                below.copy_(value)
            else:
                w._primal = written_under_no_grad(below, value)
        else:  # the new value no longer depends on this level (e.g. x.zero_())
            w._primal, w._node, w._idx = value, Leaf(), 0
        restride(w)

    def _constant(self, primal):
        return wrap_grad(primal, Leaf(), 0, self)


def _custom_bwd(custom_fn, res, args, n_leaves):
    """The user's ``bwd`` as a function of the output cotangent, returning one cotangent per
    argument leaf (``bwd`` returns one per positional argument, each a pytree like it)."""

    def bwd(ct):
        cts = custom_fn.bwd(res, ct)
        if not isinstance(cts, tuple):
            cts = (cts,)
        leaves = pt.tree_leaves(cts)
        if len(leaves) == n_leaves:
            return leaves
        out = []
        for c, a in zip(cts, args):
            n = len(pt.tree_leaves(a))
            out.extend(pt.tree_leaves(c) if c is not None else [None] * n)
        return out

    return bwd


def _transposed_jvp(custom_fn, primals, p_args, spec):
    """Reverse mode of a custom_jvp function (as JAX): the transpose of its jvp rule at fixed
    primals, which is linear in the tangents, computed by our own vjp."""
    diff = [i for i, p in enumerate(primals) if isinstance(p, torch.Tensor) and is_floating(p)]

    def lin(*ts):
        tans = [torch.zeros_like(p) if isinstance(p, torch.Tensor) else p for p in primals]
        for i, t in zip(diff, ts):
            tans[i] = t
        out, t_out = custom_fn.jvp_rule(p_args, pt.tree_unflatten(spec, tans))
        return _zero_for_none(out, t_out)

    def bwd(ct):
        _, pull = vjp(lin, *[torch.zeros_like(primals[i]) for i in diff])
        cts = [None] * len(primals)
        for i, g in zip(diff, pull(ct)):
            cts[i] = g
        return cts

    return bwd


def _zero_for_none(out, t_out):
    """A jvp rule may give None as the tangent of an output with no derivative (an index, as
    ``argmax``), where the output cotangent has a leaf: a zero keeps the structures aligned
    (grad of such a custom_jvp function raised a structure mismatch)."""
    if t_out is None:
        return pt.tree_map(torch.zeros_like, out)
    if type(out) in (tuple, list) and type(t_out) in (tuple, list) and len(out) == len(t_out):
        return type(out)(_zero_for_none(o, t) for o, t in zip(out, t_out))
    if isinstance(out, dict) and isinstance(t_out, dict) and out.keys() == t_out.keys():
        return {k: _zero_for_none(out[k], t_out[k]) for k in out}
    return t_out


NONDIFFERENTIABLE = object()  # a vjp "rule" for ops whose outputs carry no derivative


# Note [What a vjp rule keeps]
#     A node keeps its op's inputs and output for the backward pass, so every activation stays
#     alive until the sweep reaches it, also the ones its rule never reads (torch's autograd
#     saves only what each formula needs). A rule may declare ``rule.keeps = (read, out)``:
#     ``read`` the positional inputs it reads (None: all), ``out`` whether it reads the
#     output. The others are replaced in the node by data-free stand-ins (meta tensors with
#     the same shape and dtype, which is all a rule may ask of them), so e.g. a convolution's
#     output, read by the following relu only through that relu's output, is freed as in
#     torch (peak memory of per-sample gradients of a CNN: benchmarks/bench_surface.py).
#     Nodes share one stand-in per shape and dtype (``_STANDINS``): nothing writes to them
#     (not under a TorchDispatchMode, which must see the same ops in every run).


# Note [Releasing saved values]
#     grad (and value_and_grad) sweeps its graph once, so once a node's rule has run, the
#     inputs and output it saved are dropped (``backward(..., release=True)``), as torch's
#     engine frees saved variables without retain_graph: each activation is freed as soon as
#     the sweep is past it, where it would otherwise live until the whole gradient is done.
#     The nodes already swept are never read again (cotangents only flow to older nodes, and
#     ``_accumulate`` reads ``out`` of nodes not yet swept). vjp's and jacrev's pullbacks may
#     run many times (jacrev's chunks): they keep everything. Per-sample gradients of a CNN
#     (benchmarks/bench_surface.py (a)): peak memory ~5% lower, now below functorch's, whose
#     grad keeps its graph for higher orders (create_graph).


_STANDINS: dict = {}  # (shape, dtype) -> meta tensor; shared: rules only read their metadata


def _standin(t):
    # one stand-in per shape and dtype: building a meta tensor costs ~3-7 us, a lookup ~0.3
    if not isinstance(t, torch.Tensor):
        return t
    if _compat.len_torch_dispatch_stack():
        # a mode sees every op (a jit trace, the determinism checker's runs, fake tensors):
        # each run makes its own, as the mode expects
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    key = (t.shape, t.dtype)
    try:
        s = _STANDINS.get(key)
    except TypeError:  # an unhashable (symbolic) size
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    if s is None:
        if len(_STANDINS) >= 256:  # many shapes (a shape-polymorphic loop): start over
            _STANDINS.clear()
        s = _STANDINS[key] = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return s


def _prune(primals, out, keeps):
    read, reads_out = keeps
    if read is not None:
        primals = [p if i in read else _standin(p) for i, p in enumerate(primals)]
    return primals, out if reads_out else _standin(out)


# Note [Pointwise pullbacks on physical values]
#     Under ``vmap(grad(f))`` the backward sweep runs each pullback on BatchedTensors: the vjp of
#     ``sin`` is ``ct * cos(x)``, two ops, each through the vmap fast path with a wrapper of its
#     own (~6 us each, most of an op's backward). A pullback of a unary pointwise op (def_unary,
#     autodiff/elementwise.py, registered in ``PHYSICAL_PULLBACKS``) is itself pointwise in its
#     tensor arguments, so when the cotangent, the input and the output are BatchedTensors of
#     one live level with the same batch dim and the same physical shape (and plain values
#     inside), it is run once on the physical values and its result wrapped once: per example
#     the same elementwise formula on the same numbers. Anything else (other tensor
#     arguments, another level inside, complex values, whose lazy conjugates rules resolve
#     through the wrappers, a sweep run below torch's autograd, a result of another shape)
#     runs the pullback as usual. The values a rule does not read (Note [What a vjp rule keeps])
#     are meta stand-ins, passed as they are. A plain (real, strided) tensor with the logical
#     shape is the same value for every example, a constant of the vmap level (``jacrev``: the
#     sweep of a vjp taken outside the vmap, with batched cotangents): it enters with a size-1
#     dim at the batch dim, which broadcasts it per example exactly as the vmap rule would.
PHYSICAL_PULLBACKS: set = set()
_batched = []  # (BatchedTensor, wrap_batched), imported at first use (batching imports autodiff)


def _physical(a, interp, bdim, shape, device):
    """The physical value of ``a`` if it may enter the pullback as one, a stand-in as it is,
    a plain constant with a size-1 batch dim, else None."""
    cls = _batched[0][0]
    if type(a) is cls:
        v = a._value
        if (
            a._interp is interp
            and a._bdim == bdim
            and type(v) is torch.Tensor
            and v.shape == shape
            and not v.is_complex()
        ):
            return v
        return None
    if type(a) is not torch.Tensor:
        return None
    if a.is_meta:
        return a
    # (another device: a 0-d CPU value mixes with CUDA ones, its unsqueezed view would not)
    if a.is_complex() or a.is_nested or a.layout != torch.strided or a.device != device:
        return None
    logical = a.shape
    if len(logical) + 1 != len(shape) or logical != shape[:bdim] + shape[bdim + 1 :]:
        return None
    return a.unsqueeze(bdim)


def _physical_pullback(rule, ct, node):
    """Note [Pointwise pullbacks on physical values]: the input cotangents, or None."""
    if not _batched:
        batching = sys.modules.get("functransforms.batching._tensor")
        # no vmap has run (it imports batching): ct is not batched; the function, not the
        # module: another thread's first vmap may be importing it (defined last of the two)
        wrap = getattr(batching, "wrap_batched", None)
        if wrap is None:
            return None
        _batched.append((batching.BatchedTensor, wrap))
    cls, wrap = _batched[0]
    if type(ct) is not cls:
        return None
    interp, bdim, v = ct._interp, ct._bdim, ct._value
    if type(v) is not torch.Tensor or not interp.alive or v.is_complex() or below_torch_autograd():
        return None
    shape, device = v.shape, v.device
    primals = []
    for p in node.primals:
        if isinstance(p, torch.Tensor):
            p = _physical(p, interp, bdim, shape, device)
            if p is None:
                return None
        elif type(p) is list or type(p) is tuple:
            return None
        primals.append(p)
    out = _physical(node.out, interp, bdim, shape, device)
    if out is None or any(isinstance(k, torch.Tensor) for k in node.kwargs.values()):
        return None
    cts = rule(v, primals, node.kwargs, out, node.needs)
    first = cts[0]
    if type(first) is not torch.Tensor or first.shape != shape:
        return None  # not the elementwise result expected: run the rule on the wrappers
    return (wrap(first, bdim, interp),) + tuple(cts[1:])


@eager_under_compile  # Note [torch.compile around our transforms]
def backward(roots, leaves, release=False):
    """The cotangents of ``leaves`` given ``roots``: a list of (node, idx, cotangent).

    Returns one entry per leaf: its accumulated cotangent, or None (a symbolic zero).
    ``release``: the graph is swept only this once (Note [Releasing saved values]).
    """
    acc: dict = {}  # node -> list of cotangents per output
    heap = []  # (-id, node): the newest node first, compared as ints in C
    seen = set()
    hooked = bool(_HOOKS)  # Note [Tensor hooks inside grad]
    anomaly = torch.is_anomaly_enabled()  # Note [Anomaly detection in the sweep]
    for node, idx, ct in roots:
        if ct is None:
            continue
        _accumulate(acc, node, idx, ct)
        if node.id not in seen:
            seen.add(node.id)
            heapq.heappush(heap, (-node.id, node))
    while heap:
        node = heapq.heappop(heap)[1]
        if type(node) is Leaf:
            continue
        cts = acc.get(node)
        if cts is None:
            continue
        if hooked:
            _run_hooks(node, cts)
        out = node.out
        if isinstance(out, torch.Tensor):
            ct = cts[0]
        else:
            ct = tuple(cts)
        if node.versions is not None:
            _check_versions(node)
        rule = node.rule
        input_cts = None
        if rule in PHYSICAL_PULLBACKS:  # Note [Pointwise pullbacks on physical values]
            input_cts = _physical_pullback(rule, ct, node)
        if input_cts is None:
            input_cts = rule(ct, node.primals, node.kwargs, out, node.needs)
        if anomaly:
            _raise_on_nan(node, input_cts)
        for i, inp in enumerate(node.inputs):
            if inp is None:
                continue
            c = input_cts[i]
            if c is None:
                continue
            if type(inp) is list:
                prims = node.primals[i]
                for j, sub in enumerate(inp):
                    if sub is not None and c[j] is not None:
                        _push(acc, heap, seen, sub, match_dtype(c[j], prims[j]))
            else:
                _push(acc, heap, seen, inp, match_dtype(c, node.primals[i]))
        del acc[node]  # free cotangents as soon as they are consumed
        if release:  # Note [Releasing saved values]
            node.primals = node.out = node.versions = None
            input_cts = ct = cts = out = None
    if hooked:
        for leaf in leaves:
            cts = acc.get(leaf)
            if cts is not None:
                _run_hooks(leaf, cts)
    return [_leaf_ct(acc, leaf) for leaf in leaves]


def _check_versions(node):
    """Note [Writes into saved constants]: torch's error if a constant the node keeps was
    written after the op read it."""
    for p, cls, version in node.versions:
        if p.__class__ is not cls or p._version != version:
            now = (
                "promoted to a value of the transform"
                if p.__class__ is not cls
                else (f"is at version {p._version}; expected version {version} instead")
            )
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: the {cls.__name__} of shape {list(p.shape)} and dtype "
                f"{p.dtype} that {GradFn(node).name()} read {now}. It was written in place "
                "after that op used it, so its derivative would read the new value. Do: write "
                "into a copy (w = w.clone() before the write), or write before the tensor is used."
            )


# Note [Anomaly detection in the sweep]
#     Under ``torch.autograd.set_detect_anomaly(True)`` torch's engine, and so functorch's grad
#     (also under vmap), raises when a backward function returns NaN, naming it; our sweep
#     returned the NaN silently. With the mode on (read once per sweep: nothing otherwise), each
#     rule's cotangents are checked through every wrapper down to the plain value (all examples
#     of a vmap at once). Not on meta/fake values, nor while ft.jit traces (a replay would not
#     check, and a read of traced values makes the signature fall back).
def _raise_on_nan(node, input_cts):
    if _compat.proxy_tracing():
        return
    for i, c in enumerate(input_cts):
        for part in c if type(c) is list or type(c) is tuple else (c,):
            while isinstance(part, TransformTensor):  # BatchedTensor: _value; others: _primal
                part = part._value if hasattr(part, "_value") else part._primal
            if type(part) is torch.Tensor and part.device.type != "meta" and part.isnan().any():
                raise RuntimeError(
                    f"Function '{GradFn(node).name()}' returned nan values in its {i}th output "
                    "(functransforms tape, under torch.autograd.set_detect_anomaly)."
                )


def _leaf_ct(acc, leaf):
    cts = acc.get(leaf)
    return None if cts is None else cts[0]


def _run_hooks(node, cts):
    """Apply the hooks registered on ``node``'s outputs to their cotangents, in place."""
    per_output = _HOOKS.get(node)
    if not per_output:
        return
    for idx, hooks in per_output.items():
        for hook in list(hooks.values()):
            if cts[idx] is None:
                break
            new = hook(cts[idx])
            if new is not None:
                cts[idx] = new


def _push(acc, heap, seen, inp, ct):
    node, idx = inp
    _accumulate(acc, node, idx, ct)
    if node.id not in seen:
        seen.add(node.id)
        heapq.heappush(heap, (-node.id, node))  # ids are unique: nodes are never compared


def _accumulate(acc, node, idx, ct):
    cts = acc.get(node)
    if cts is None:
        n = (
            1
            if isinstance(getattr(node, "out", None), torch.Tensor) or type(node) is Leaf
            else len(node.out)
        )
        cts = acc[node] = [None] * n
    prev = cts[idx]
    cts[idx] = ct if prev is None else prev + ct
