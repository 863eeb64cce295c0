"""``functionalize``: run a function with every mutation (and optionally every view) removed.

Note [functionalize as a level]
    ``functionalize`` is one more interpreter on the stack (Note [Levels]), built from the
    machinery the autodiff levels already use for in-place ops (Note [In-place ops and views
    under jvp and grad], autodiff/_util.py): its wrapper, a ``FunctionalizeTensor``, holds a
    value and nothing else (a jvp wrapper without a tangent). Every op on a wrapper runs on the
    values it holds and its tensor results are wrapped again; an in-place op runs its functional
    form and *rebinds* the wrapper; a write through a view is scattered into the view's root and
    the root's other live views are replayed; a plain buffer that receives a wrapped value is
    promoted (Note [Writing into a plain tensor]). So below this level no op ever mutates:
    under ``make_fx`` or ``ft.jit`` the graph holds out-of-place ops only, and under
    ``vmap(functionalize(f))`` the write of a batched value into a fresh unbatched buffer
    becomes an out-of-place op that vmap batches (plain vmap refuses the write).

    When ``f`` returns, each input whose wrapper was rebound gets its final value copied in
    (``_write_back``, Note [Writes to primals]): one ``copy_`` per mutated input, the only
    in-place op a traced graph keeps, as torch's. With ``remove="mutations_and_views"`` a view
    op runs as its ``<view>_copy`` op (``aten.view`` -> ``aten.view_copy``) on the values, while
    the wrappers keep the view bookkeeping, so writes through views still reach their base.

    Why not torch's functionalization (``torch._to_functional_tensor``, FunctionalTensorMode):
    its C++ wrapper and our Python wrappers do not compose (``functionalize(ft.vmap(f))``
    crashed the process), and it would make one transform that is not ours.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from . import _compat
from . import _pytree as pt
from ._core.compiling import eager_under_compile
from ._core.levels import Interpreter, TransformTensor
from ._core.metadata import metadata
from ._core.ops import facts, op_name
from ._typing import Func

_REMOVE = ("mutations", "mutations_and_views")


class FunctionalizeTensor(TransformTensor):
    """A value at one functionalize level (Note [functionalize as a level])."""

    _primal: torch.Tensor
    _base = None  # Note [In-place ops and views under jvp and grad]
    _chain = ()
    _views = None

    def _inner_requires_grad(self):  # Note [Torch autograd through our transforms]
        p = self._primal
        return not isinstance(p, TransformTensor) and p.requires_grad

    def _describe(self):
        return f"FunctionalizeTensor(lvl={self._interp.level}, value={self._primal!r})"


def _wrap(value, interp):
    shape, stride, dtype, device = metadata(value)  # Note [Reading a wrapper's metadata]
    r = _compat.make_wrapper_subclass(
        FunctionalizeTensor, shape, stride, dtype=dtype, device=device
    )
    r._primal = value
    r._interp = interp
    return r


_COPY_OF: dict = {}


def _copy_variant(func):
    """``aten.view.default`` -> ``aten.view_copy.default`` (None if torch has none)."""
    c = _COPY_OF.get(func, False)
    if c is False:
        namespace, _, base = func._schema.name.rpartition("::")
        packet = getattr(getattr(torch.ops, namespace or "aten"), base + "_copy", None)
        c = _COPY_OF[func] = getattr(packet, func._overloadname, None) if packet else None
    return c


_FUNCTIONAL_OF: dict = {}


def _out_functional(func):
    """The functional overload of an ``out=`` op (``aten.add.out`` -> ``aten.add.Tensor``): the
    overload of the same op whose arguments are the out op's minus the ``out=`` ones."""
    c = _FUNCTIONAL_OF.get(func, False)
    if c is False:
        c = None
        args = [
            (a.name, str(a.type))
            for a in func._schema.arguments
            if not (a.alias_info is not None and a.alias_info.is_write)
        ]
        packet = getattr(torch.ops.aten, func._schema.name.rpartition("::")[2], None)
        for name in packet.overloads() if packet is not None else ():
            cand = getattr(packet, name)
            if cand is func or any(
                a.alias_info is not None and a.alias_info.is_write for a in cand._schema.arguments
            ):
                continue
            if [(a.name, str(a.type)) for a in cand._schema.arguments] == args:
                c = cand
                break
        _FUNCTIONAL_OF[func] = c
    return c


_COPY = torch.ops.aten.copy.default


def _clone_all(out):
    if isinstance(out, torch.Tensor):
        return out.clone()
    return type(out)(_clone_all(o) for o in out)


def _torch_autograd_through(src):
    """Whether torch's autograd records this op on ``src`` (Note [Torch autograd through our
    transforms]): a plain tensor that requires grad, with grad mode on."""
    return (
        isinstance(src, torch.Tensor)
        and not isinstance(src, TransformTensor)
        and src.requires_grad
        and torch.is_grad_enabled()
    )


def _copy_differentiably(dst, src, non_blocking=False):
    """``aten.copy(dst, src)`` (what ``dst.copy_(src)`` becomes here) as ops torch's autograd
    differentiates: torch registers no derivative for ``aten.copy``, so ``y[1] = w`` inside
    ``functionalize`` would break backward through it (it does in PyTorch)."""
    return src.to(dtype=dst.dtype, device=dst.device).expand(dst.shape).clone()


def _make_interpreter():
    # autodiff/_util.py imports the autodiff package, which imports this module's siblings:
    # resolved at the first call, as _ad.py does
    from functransforms.autodiff._util import InplaceMixin, composite_implicit, restride

    class FunctionalizeInterpreter(InplaceMixin, Interpreter):
        name = "functionalize"
        rule_kind = "functionalize"
        decorator = "a functional variant (the op's name without the trailing underscore)"
        tracked_value = "a value computed from the function's inputs"  # for InplaceError

        def __init__(self, call, copy_views):
            super().__init__()
            self.call = call  # the public call, for error messages
            self.copy_views = copy_views  # remove="mutations_and_views"
            self._shape_may_change = False

        def _unwrap(self, x):
            if isinstance(x, FunctionalizeTensor) and x._interp is self:
                return x._primal
            if type(x) is list or type(x) is tuple:
                return type(x)(self._unwrap(y) for y in x)
            return x

        def _wrap_out(self, out):
            if isinstance(out, torch.Tensor):
                return _wrap(out, self)
            if type(out) is list or type(out) is tuple:
                return type(out)(self._wrap_out(o) for o in out)
            return out

        def process(self, func, args, kwargs):
            f = facts(func)
            if f.inplace or f.inplace_view:
                self._shape_may_change = f.inplace_view
                try:
                    return self._inplace(func, f, args, kwargs)
                finally:
                    self._shape_may_change = False
            if f.written or f.written_kwargs:
                return self._out_op(func, f, args, kwargs)
            if f.view and self.copy_views:
                copy = _copy_variant(func)
                if copy is None:
                    d = composite_implicit(func)
                    if d is not None:  # reshape, ...: its pieces come back here
                        return d(*args, **kwargs)
                    raise NotImplementedError(
                        f"{self.call}: the view op {op_name(func)} has no {op_name(func)}_copy "
                        "variant in torch, so remove='mutations_and_views' cannot replace it. "
                        "Do: use remove='mutations', or write the function with .clone() "
                        "after this view."
                    )
                values = self._unwrap(args)
                kw = {k: self._unwrap(v) for k, v in kwargs.items()}
                if any(isinstance(v, TransformTensor) for v in pt.tree_leaves((values, kw))):
                    # an outer level (vmap, grad, jvp) holds the values: the view and a clone,
                    # which its rules cover (the *_copy ops have no rules of their own)
                    out = self._wrap_out(_clone_all(func(*values, **kw)))
                else:
                    out = self._wrap_out(copy(*values, **kw))
            else:
                values = self._unwrap(args)
                kw = {k: self._unwrap(v) for k, v in kwargs.items()}
                if func is _COPY and _torch_autograd_through(values[1]):
                    func = _copy_differentiably
                out = self._wrap_out(func(*values, **kw))
            if f.view:
                self._note_views(func, args, kwargs, out)
            return out

        def _out_op(self, func, f, args, kwargs):
            """``torch.add(x, y, out=buf)``: the functional op, then a write into ``buf``."""
            functional = _out_functional(func)
            if functional is None or f.written or len(f.written_kwargs) != 1:
                raise NotImplementedError(
                    f"{self.call}: {op_name(func)} writes into its arguments and has no "
                    "functional overload to replace it. Do: drop `out=` and use the return value."
                )
            kwargs = dict(kwargs)
            target = kwargs.pop(f.written_kwargs[0])
            result = self.process(functional, args, kwargs)
            if result.shape != target.shape:  # out= resizes its target, as torch does
                torch.ops.aten.resize_.default(target, result.shape)
            # the out= op's own frame holds its target twice (the dispatcher's stack and torch's
            # Python argument parser): references that will not read it again
            self._caller_holds = 2
            try:
                torch.ops.aten.copy_.default(target, result)
            finally:
                self._caller_holds = 0
            return target

        def process_custom(self, custom_fn, args):
            """Note [Custom rules across levels]: this level changes no value, so the custom
            function is called again on the values (its rules belong to the levels below: an
            outer grad uses its custom vjp) and the results are wrapped."""
            flat, spec = pt.tree_flatten(args)
            out = custom_fn(*pt.tree_unflatten(spec, [self._unwrap(a) for a in flat]))
            return pt.tree_map(lambda o: _wrap(o, self) if isinstance(o, torch.Tensor) else o, out)

        def _rebind(self, w, value):
            if isinstance(value, FunctionalizeTensor) and value._interp is self:
                value = value._primal
            shape, _, dtype, _ = metadata(value)
            if not self._shape_may_change and shape != w.shape:
                # the functional form broadcast where the in-place op writes in w's shape only
                raise RuntimeError(
                    f"{self.call}: an in-place op writes a result of shape {tuple(shape)} into "
                    f"a tensor of shape {tuple(w.shape)}; in-place ops cannot change the shape "
                    "of their target (as in eager torch)."
                )
            if dtype != w.dtype:  # an in-place op keeps its target's dtype (eager: x.mul_(y))
                if not torch.can_cast(dtype, w.dtype):
                    raise RuntimeError(
                        f"{self.call}: result type {dtype} can't be cast to the desired output "
                        f"type {w.dtype} of an in-place op (as in eager torch)."
                    )
                value = value.to(w.dtype)
            w._primal = value
            restride(w)

        def _constant(self, primal):
            return _wrap(primal, self)

        def _demote(self):
            """Note [Writing into a plain tensor], except for promoted buffers nothing refers
            to any more (locals of ``f``): their write-back would be an in-place op left in a
            traced graph (make_fx, ft.jit), into a tensor no one reads. Liveness is asked of
            the garbage collector: drop our own references, keep what survives."""
            entries, self._promoted = self._promoted, None
            weak = []
            for obj, holder, is_root in entries:
                weak.append((weakref.ref(obj), holder, is_root))
                del holder.__dict__["_target"]  # the holder's reference to obj
            del entries, obj  # ours: reference counting frees the dead ones here
            alive = []
            for ref, holder, is_root in weak:
                obj = ref()
                if obj is not None:
                    holder.__dict__["_target"] = obj
                    alive.append((obj, holder, is_root))
                else:
                    holder.__class__ = torch.Tensor  # a plain tensor again, about to be freed
            del weak, obj
            if alive:
                self._promoted = alive
                super()._demote()

    return FunctionalizeInterpreter


_interpreter_class = None


def functionalize(func: Func, *, remove: str = "mutations") -> Func:
    """``func`` with its mutations (and, with ``remove="mutations_and_views"``, its views)
    removed: ``PyTorch's functionalize``, built on our own levels.

    The returned function computes what ``func`` computes and leaves its inputs as ``func``
    leaves them, but inside it every in-place op runs out of place, and the mutated inputs
    receive their final values once ``func`` has returned (one ``copy_`` each). Traced with
    ``make_fx`` or ``ft.jit``, its graph holds no in-place op except those final copies.
    ``vmap(functionalize(f))`` runs functions that write batched values into fresh buffers
    (``buf = torch.zeros(3); buf.copy_(x)``), which plain vmap refuses.

    Args:
        func: a function of pytrees of tensors.
        remove: ``"mutations"`` (in-place and ``out=`` ops become out-of-place ops) or
            ``"mutations_and_views"`` (view ops also become their ``*_copy`` ops).

    Returns:
        A function with ``func``'s signature and outputs.

    Example:
        >>> import torch, functransforms as ft
        >>> def f(x):                                    # [3] -> [2, 3]
        ...     out = x.new_zeros(2, 3)
        ...     out[0] = x                               # an in-place write of x
        ...     return out
        >>> ft.vmap(ft.functionalize(f))(torch.ones(4, 3)).shape   # [4, 3] -> [4, 2, 3]
        torch.Size([4, 2, 3])
    """
    if remove not in _REMOVE:
        raise RuntimeError(
            f"functionalize({_name(func)}, remove={remove!r}): expected remove='mutations' "
            "(in-place and out= ops become out-of-place ops) or remove='mutations_and_views' "
            "(view ops also become their *_copy ops)."
        )
    call = f"functionalize({_name(func)})"
    copy_views = remove == "mutations_and_views"

    @eager_under_compile
    def functionalized(*args: Any, **kwargs: Any) -> Any:
        return _run(func, args, kwargs, call, copy_views)

    functionalized.__name__ = f"functionalize_{_name(func)}"
    functionalized.__doc__ = func.__doc__
    functionalized.__wrapped__ = func
    return functionalized


def _name(func):
    return getattr(func, "__name__", type(func).__name__)


def _run(func, args, kwargs, call, copy_views):
    from ._ad import _write_back

    global _interpreter_class
    if _interpreter_class is None:
        from ._core.gcpause import paused_collector

        with paused_collector():  # Note [One-time setup under one lock]: one class
            if _interpreter_class is None:
                _interpreter_class = _make_interpreter()
    interp = _interpreter_class(call, copy_views)
    flat, spec = pt.tree_flatten((args, kwargs))
    given = []  # (input, value, wrapper): Note [Writes to primals]
    with interp:  # outputs are read inside: promoted buffers are restored on exit
        wrapped = []
        for x in flat:
            if isinstance(x, torch.Tensor):
                w = _wrap(x, interp)
                given.append((x, x, w))
                wrapped.append(w)
            else:
                wrapped.append(x)
        a, k = pt.tree_unflatten(spec, wrapped)
        del wrapped
        result = func(*a, **k)
        del a, k
        flat_out, out_spec = pt.tree_flatten(result)
        del result
        outs = [
            o._primal if isinstance(o, FunctionalizeTensor) and o._interp is interp else o
            for o in flat_out
        ]
        # views of inputs that were not written: made again below, on the inputs themselves
        unwritten = {id(w): x for x, _, w in given if w._primal is x}
        redo = {
            i: (unwritten[id(o._base)], o._chain)
            for i, o in enumerate(flat_out)
            if not copy_views
            and isinstance(o, FunctionalizeTensor)
            and o._base is not None
            and id(o._base) in unwritten
            and all(_plain_step(step) for step in o._chain)
        }
        del flat_out
    _write_back(given, call)
    for i, (x, chain) in redo.items():
        # As PyTorch: an output that is a view of an input nothing wrote is a real view of
        # it, with ``_base`` and torch autograd's view tracking (the one made inside the level
        # shares the memory but ran below autograd's view bookkeeping).
        for step in chain:
            x = step.replay(x)
        outs[i] = x
    return pt.tree_unflatten(out_spec, outs)


def _plain_step(step):
    """A view step that can be replayed on a plain tensor (no wrapper among its arguments)."""
    rest = getattr(step, "rest", ())
    return not any(
        isinstance(a, TransformTensor) for a in pt.tree_leaves((rest, getattr(step, "kwargs", {})))
    )
