"""Helpers shared by derivative rules and by the two autodiff interpreters."""

from __future__ import annotations

import weakref

import torch

from functransforms import _compat
from functransforms._core.levels import TransformTensor
from functransforms._core.levels import below_torch_autograd as _below_torch_autograd
from functransforms._core.metadata import dtype_of, dtypes_of
from functransforms._core.ops import op_name, positional_with_defaults
from functransforms._core.writes import physical_root
from functransforms.errors import (
    missing_rule,
    raise_inplace_untracked,
    raise_inplace_view_outside_base,
)


def unbroadcast(ct, shape):
    """Sum ``ct`` down to ``shape`` (the adjoint of broadcasting)."""
    if ct.shape == shape:
        return ct
    lead = ct.dim() - len(shape)
    dims = list(range(lead))
    for i, s in enumerate(shape):
        if s == 1 and ct.shape[lead + i] != 1:
            dims.append(lead + i)
    if dims:
        if len(dims) == lead and ct.shape[lead:] == shape:
            # only leading dims: their sum without keepdim has the shape already, the same
            # kernel and bits as the sum with keepdim and its reshape, one op fewer (each op a
            # node of every outer grad level: the bias cotangents of MAML's inner sweep)
            return ct.sum(dims)
        ct = ct.sum(dims, keepdim=True)
    return ct.reshape(shape) if lead or ct.shape != shape else ct


def match_dtype(ct, x):
    """A cotangent for ``x`` has x's dtype: the real part for a real ``x`` (docs/complex.md)."""
    ct_dtype, x_dtype = dtypes_of(ct, x)  # Note [Reading a wrapper's metadata]
    if ct_dtype == x_dtype:
        return ct
    if ct_dtype.is_complex and not x_dtype.is_complex:
        ct = ct.real
    return ct.to(x_dtype)


def is_tensor(x):
    return isinstance(x, torch.Tensor)


# Note [Composite ops inside rules]
#     At top level a CompositeImplicitAutograd op (aten.to.dtype, aten.reshape, ...) is
#     decomposed before it reaches a wrapper. Inside __torch_dispatch__ the Autograd keys, which
#     host those kernels, are excluded, so an op a rule calls on a wrapper of an outer level
#     arrives whole. With no rule of its own, the interpreter runs its composite kernel
#     (``OpOverload.decompose``), which dispatches its pieces back through the transforms.
def zeros_shaped(x, like):
    """Zeros of ``x``'s shape in ``like``'s dtype and device: the base a transpose scatters a
    cotangent ``like`` into (the cotangent's dtype wins, as for a complex ``ct`` of a real op)."""
    return torch.zeros(x.shape, dtype=like.dtype, device=like.device)


def conj_if_complex(t):
    """``conj_physical`` of a complex tensor: rules run inside ``__torch_dispatch__``, where a
    lazy conj bit would be ignored (Note [No lazy conjugate inside wrappers]). A real tensor is
    returned as is (no kernel call); a Python scalar is conjugated if complex."""
    if not isinstance(t, torch.Tensor):
        return t.conjugate() if isinstance(t, complex) else t
    return torch.conj_physical(t) if t.is_complex() else t


_COMPOSITE: dict = {}


def logsumexp_jvp(x, t, dims, keepdim):
    """torch's forward formula of logsumexp (also in softmax's and log_softmax's), op for op
    so that results are bit-identical: weights ``exp(x - amax x)``, then
    ``sum(w t) / sum(w)``."""
    w = (x - x.amax(dims, keepdim=True)).exp() if x.numel() else x.exp()
    return (w * t).sum(dims, keepdim) / w.sum(dims, keepdim)


def composite_implicit(func):
    """``func.decompose`` for a CompositeImplicitAutograd op, else None (cached per op)."""
    d = _COMPOSITE.get(func, False)
    if d is False:
        has = getattr(func, "has_kernel_for_dispatch_key", None)
        ok = has is not None and has(_compat.CompositeImplicitAutograd)
        d = _COMPOSITE[func] = func.decompose if ok else None
    return d


def unwrap_level(interp, args, payload):
    """``(primals, payloads)`` of ``args`` at ``interp``'s level: ``payload(w)`` for each of its
    wrappers (tangent or tape entry), ``None`` elsewhere; lists of tensors are unwrapped too."""
    primals = list(args)
    payloads = [None] * len(args)
    for i, a in enumerate(args):
        if isinstance(a, TransformTensor):
            if a._interp is interp:
                primals[i] = a._primal
                payloads[i] = payload(a)
        elif type(a) is list or type(a) is tuple:
            if any(isinstance(b, TransformTensor) and b._interp is interp for b in a):
                primals[i], payloads[i] = unwrap_level(interp, a, payload)
    return primals, payloads


def resolve_lazy(x):
    """``x`` without a lazy conj bit (Note [No lazy conjugate inside wrappers])."""
    return x.resolve_conj() if isinstance(x, torch.Tensor) and x.is_conj() else x


def any_floating(out):
    """Whether an op's output (a tensor or a sequence) holds a value that carries derivatives."""
    if isinstance(out, torch.Tensor):
        return out.dtype.is_floating_point or out.dtype.is_complex
    if isinstance(out, (tuple, list)):
        return any(
            isinstance(o, torch.Tensor) and (o.dtype.is_floating_point or o.dtype.is_complex)
            for o in out
        )
    return False


def restride(w):
    """Make wrapper ``w``'s metadata (shape, strides) match its rebound primal's, as wrappers are
    created with their primal's strides (so torch's view-or-copy decisions are right)."""
    p = w._primal
    if w.shape != p.shape or w.stride() != p.stride():
        with _compat.DisableTorchDispatch():
            w.as_strided_(p.shape, p.stride())


# -- in-place ops under jvp and grad ------------------------------------------------------------
# Note [In-place ops and views under jvp and grad]
#     Both autodiff levels are functional inside: an in-place op runs its functional variant
#     (aten.add_ -> aten.add, aten.copy_ -> aten.copy), and the wrapper is *rebound* to the
#     result, so a value saved for the backward pass is never mutated. Aliasing is kept by
#     bookkeeping, as functionalization does: a wrapper made by a view op records its root base
#     (``_base``) and the view steps from that base (``_chain``); a root keeps weak references to
#     its live views (``_views``). A write through a view computes the view's new value, scatters
#     it back through the chain into a new value of the root (select_scatter, slice_scatter, ...),
#     rebinds the root and regenerates every other live view by replaying its chain. All of it is
#     ordinary ops on wrappers, recorded like any other. A write to a wrapper that is not a view
#     and has no live views (the common case) costs one functional op and nothing else.
#
# Note [Writing into a plain tensor]
#     ``buf = torch.zeros(3); buf[1] = f(x)`` writes a differentiated value into a tensor the
#     transform does not see. PyTorch supports it for tensors created inside the transform, by
#     wrapping every factory output through an always-on dispatch mode; a do-nothing mode costs
#     ~9.5 us on every op, so we do it at the one op that needs it instead: the target (and its
#     base, for a view such as ``buf[1]``) is *promoted* in place: ``torch._C._swap_tensor_impl``
#     turns the user's Python object into a wrapper of this level whose value is a copy of the
#     data, so every later op on ``buf`` reaches the interpreter. The old impl stays with a holder
#     object that redirects any use (``out = buf.add_(x)`` returns it) to the wrapper through
#     ``__torch_function__``. When the level exits, each promoted tensor gets its final value back
#     as a plain tensor (written into its original memory), so a tensor captured from outside
#     ends up as eager execution would leave it. Promotion refuses (InplaceError) when other
#     tensors share the memory, the target requires grad, or it is another transform's wrapper.


class _Step:
    """One view step from a base: ``replay(base)`` makes the view, ``scatter(base, v)`` writes
    ``v`` into the view's place and returns the new base (both as ops on wrappers)."""

    __slots__ = ("func", "rest", "kwargs", "index")

    def __init__(self, func, rest, kwargs, index):
        self.func, self.rest, self.kwargs, self.index = func, rest, kwargs, index

    def replay(self, base):
        out = self.func(base, *self.rest, **self.kwargs)
        return out if self.index is None else out[self.index]

    def scatter(self, base, v):
        if self.index is not None:
            multi = _MULTI_SCATTER.get(self.func)
            if multi is not None:
                return multi(base, v, self.index, *self.rest, **self.kwargs)
        else:
            one = _SCATTER.get(self.func)
            if one is not None:
                return one(base, v, *self.rest, **self.kwargs)
        positions = self.replay(
            torch.arange(base.numel(), device=positions_device(base)).reshape(base.shape)
        )
        return _index_scatter(base, v, positions, self.func)


class _IndexStep:
    """A view given by the flat positions of its elements in the base (a promoted plain view)."""

    __slots__ = ("positions",)

    def __init__(self, positions):
        self.positions = positions

    def replay(self, base):
        return torch.ops.aten.index.Tensor(base.reshape(-1), [self.positions])

    def scatter(self, base, v):
        return _index_scatter(base, v, self.positions, None)


def positions_device(t):
    """Where the flat positions of ``t``'s elements are computed: its device, except CPU for a
    meta tensor (positions are metadata, and the overlap check reads them; meta tensors have no
    values, and ATen's index ops take CPU indices for a meta tensor)."""
    return _CPU if t.is_meta else t.device


_CPU = torch.device("cpu")


def _index_scatter(base, v, positions, func):
    flat = positions.reshape(-1)
    with _compat.DisableTorchDispatch():  # positions are metadata: no traced read (jit)
        overlap = positions.dtype != torch.long or flat.unique().numel() != flat.numel()
    if overlap:
        what = op_name(func) if func is not None else "this view"
        raise NotImplementedError(
            f"an in-place write through a view made by {what} is not supported under jvp/grad: "
            "its elements overlap or reinterpret memory. Do: write out of place (e.g. "
            "torch.where / index_put / torch.cat) and use the result."
        )
    return torch.ops.aten.index_put.default(base.reshape(-1), [flat], v.reshape(-1)).reshape(
        base.shape
    )


def _reshape_back(b, v, *a, **k):
    return v.reshape(b.shape)


def _inverse_perm(perm):
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p % len(perm)] = i
    return inv


def _expanded(b, v, *a, **k):
    raise NotImplementedError(
        "an in-place write into an expanded view (x.expand(...), broadcasting) is not supported: "
        "several elements share one memory location (torch refuses it too). Do: write into "
        "x.expand(...).clone() or compute the result out of place."
    )


_aten = torch.ops.aten


# Note [Complex scatters torch's autograd refuses]
#     torch's autograd refuses complex outputs of ``slice_scatter`` and ``select_scatter`` ("does
#     not support automatic differentiation for outputs with complex dtype"), though it
#     differentiates a write into a slice of a clone. Our rules run these ops for the transpose
#     of slicing and indexing views and for writes into views: with a plain complex tensor that
#     requires grad and torch recording (Note [Torch autograd through our transforms]),
#     ``torch.autograd.grad`` over ``ft.vjp`` of ``x[1:3]``, ``narrow``, ``split``, the FFTs
#     with ``s=`` (padding), ``trapezoid`` raised. There, the same values are computed as a
#     clone written through the view.
def _torch_refuses_complex(b, v):
    return (
        (b.is_complex() or v.is_complex())
        and torch.is_grad_enabled()
        and not isinstance(b, TransformTensor)
        and not isinstance(v, TransformTensor)
        and (b.requires_grad or v.requires_grad)
        and not _below_torch_autograd()
    )


def slice_scatter(b, v, dim=0, start=None, end=None, step=1):
    """``aten.slice_scatter``, differentiable by torch for complex values too (Note [Complex
    scatters torch's autograd refuses])."""
    if _torch_refuses_complex(b, v):
        out = b.clone()
        _aten.slice.Tensor(out, dim, start, end, step).copy_(v)
        return out
    return _aten.slice_scatter.default(b, v, dim, start, end, step)


def select_scatter(b, v, dim, index):
    """``aten.select_scatter``, as ``slice_scatter`` above."""
    if _torch_refuses_complex(b, v):
        out = b.clone()
        _aten.select.int(out, dim, index).copy_(v)
        return out
    return _aten.select_scatter.default(b, v, dim, index)


_SCATTER = {
    _aten.select.int: select_scatter,
    _aten.slice.Tensor: slice_scatter,
    _aten.diagonal.default: lambda b, v, offset=0, dim1=0, dim2=1: _aten.diagonal_scatter.default(
        b, v, offset, dim1, dim2
    ),
    _aten.permute.default: lambda b, v, dims: v.permute(_inverse_perm(dims)),
    _aten.transpose.int: lambda b, v, d0, d1: v.transpose(d0, d1),
    _aten.t.default: lambda b, v: v.t(),
    _aten._conj.default: lambda b, v: torch.conj_physical(v),
    _aten._neg_view.default: lambda b, v: torch.neg(v),
    _aten.real.default: lambda b, v: torch.complex(v, b.imag),
    _aten.imag.default: lambda b, v: torch.complex(b.real, v),
    _aten.view_as_real.default: lambda b, v: torch.view_as_complex(v.contiguous()),
    _aten.view_as_complex.default: lambda b, v: torch.view_as_real(v),
    _aten.expand.default: _expanded,
}
for _op in (
    _aten.view.default,
    _aten.reshape.default,
    _aten._reshape_alias.default,
    _aten.squeeze.default,
    _aten.squeeze.dim,
    _aten.squeeze.dims,
    _aten.unsqueeze.default,
    _aten.flatten.using_ints,
    _aten.unflatten.int,
):
    _SCATTER[_op] = _reshape_back
for _op in (
    _aten.alias.default,
    _aten.lift_fresh.default,
    _aten.resolve_conj.default,
    _aten.resolve_neg.default,
):
    _SCATTER[_op] = lambda b, v: v


def _split_scatter(b, v, i, split_size, dim=0):
    start = i * split_size
    return slice_scatter(b, v, dim, start, start + v.shape[dim])


def _split_sizes_scatter(b, v, i, sizes, dim=0):
    start = sum(sizes[:i])
    return slice_scatter(b, v, dim, start, start + sizes[i])


_MULTI_SCATTER = {
    _aten.split.Tensor: _split_scatter,
    _aten.split_with_sizes.default: _split_sizes_scatter,
    _aten.unbind.int: lambda b, v, i, dim=0: select_scatter(b, v, dim, i),
}


# Note [Writing into an outer transform's value]
#     ``vmap(grad(f))`` with ``h = x.sin(); h.mul_(y)`` in f, differentiating y only: h is a
#     value of the outer level (vmap's, or an outer grad's), a constant of this one, and the
#     write gives it derivatives at this level. functorch wraps every value at every level, so
#     the write just works there; we promote h as a plain buffer is (Note [Writing into a plain
#     tensor]): h becomes a wrapper of this level holding a clone of its old value, and at exit
#     it becomes its final value, still a value of the outer level. There is no user memory to
#     write back into, and the old value is dead (its holder redirects to h). Refused when
#     something aliases h (a view of, or viewed by, another outer value): the write would not
#     reach the alias.
_OUTER = "outer"


class _Redirect(torch.Tensor):
    """The holder of a promoted tensor's old impl: any use goes to the promoted tensor
    (Note [Writing into a plain tensor])."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        from functransforms import _pytree as pt

        def redirect(a):
            return a.__dict__["_target"] if type(a) is _Redirect else a

        args, kwargs = pt.tree_map(redirect, (args, kwargs or {}))
        with _compat.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _swap(a, b):
    """Exchange the contents (impl, class, attributes) of two tensor objects, keeping identities."""
    a.__class__, b.__class__ = b.__class__, a.__class__
    a.__dict__, b.__dict__ = b.__dict__, a.__dict__
    _compat.swap_tensor_impl(a, b)
    _compat.swap_proxy_slots(a, b)  # under make_fx (ft.jit): the tracer keys by object


def _give_back(obj, holder):
    """Give promoted ``obj`` back its original memory, held by ``holder`` (a plain tensor again).

    ``obj`` becomes a new tensor on the same storage, not a view of ``holder``: once the holder
    is gone (the usual case) ``obj`` owns its memory alone and can be promoted again by a later
    call; while someone keeps the holder (``out = buf.add_(x)``), both see the same memory."""
    # bookkeeping of a user's Python object, not part of the computation: no mode (a jit trace,
    # an audit) may see it
    with _compat.DisableTorchFunction(), _compat.disable_current_modes():
        alias = holder.new_empty(0).set_(
            holder.untyped_storage(), holder.storage_offset(), holder.shape, holder.stride()
        )
    _swap(obj, alias)
    _compat.swap_proxy_slots(obj, holder, share=True)  # a traced obj reads the holder's node


def _restore(obj, holder):
    """Give ``obj`` back its original implementation, kept by ``holder`` since promotion (its
    data untouched: the promoted wrapper worked on a copy)."""
    holder.__class__ = torch.Tensor
    holder.__dict__.pop("_target", None)
    _give_back(obj, holder)


class InplaceMixin:
    """In-place ops, views and promotion for the jvp and grad interpreters (Note [In-place ops
    and views under jvp and grad]). The interpreter supplies ``_rebind(w, value)`` (make wrapper
    ``w`` hold ``value``: a wrapper of this level or a constant) and ``_constant(primal)`` (a new
    wrapper of this level holding a constant)."""

    _replaying = False
    # references to a write target held by an op this level is itself carrying out (the
    # out= op whose result functionalize copies into its target): not a kernel reading it later
    _caller_holds = 0
    _promoted = None
    _fresh = None  # plain buffers made at this level by *_like ops (Note [Buffers held by kernels])

    def _fresh_buffer(self, out):
        """A floating buffer a *_like / new_* op made at this level from a tracked value: a
        constant of the level (Note [Buffers held by kernels]), so that a composite kernel
        writing into it and reading it back in C++ (diff(n=0), circular pad,
        hinge_embedding_loss) writes into a wrapper, whose in-place rule it then sees."""
        if isinstance(out, torch.Tensor) and (out.is_floating_point() or out.is_complex()):
            return self._constant(out)  # also an outer level's value: one constant per level
        self._note_fresh(out)
        return out

    def _note_fresh(self, out):
        if type(out) is torch.Tensor:
            if self._fresh is None:
                self._fresh = {}
            fresh, key = self._fresh, id(out)
            # by identity (a WeakSet would compare tensors with ==); gone with the tensor
            fresh[key] = weakref.ref(out, lambda _, k=key: fresh.pop(k, None))

    def _is_fresh(self, t):
        r = self._fresh.get(id(t)) if self._fresh is not None else None
        return r is not None and r() is t

    # -- views ---------------------------------------------------------------------------------
    def _note_views(self, func, args, kwargs, out):
        """Record ``out`` (a view op's result) as a view of ``args[0]``'s root."""
        src = args[0]
        if self._replaying or getattr(src, "_interp", None) is not self:
            return
        root = src._base if src._base is not None else src
        if isinstance(out, torch.Tensor):
            if getattr(out, "_interp", None) is self:
                self._add_view(root, out, src._chain + (_Step(func, args[1:], kwargs, None),))
            return
        for i, o in enumerate(out):
            if getattr(o, "_interp", None) is self:
                self._add_view(root, o, src._chain + (_Step(func, args[1:], kwargs, i),))

    @staticmethod
    def _add_view(root, view, chain):
        view._base, view._chain = root, chain
        views = root._views
        if views is None:
            root._views = [weakref.ref(view)]
            return
        if len(views) >= 8 and len(views) & (len(views) - 1) == 0:  # prune at powers of two
            views[:] = [r for r in views if r() is not None]
        views.append(weakref.ref(view))

    def _replay(self, root, chain):
        v = root
        for step in chain:
            v = step.replay(v)
        return v

    # -- in-place ------------------------------------------------------------------------------
    def _inplace(self, func, f, args, kwargs):
        self_ = args[0]
        if getattr(self_, "_interp", None) is not self:
            self._promote(func, self_)
        functional = f.functional
        if functional is None:
            raise missing_rule(func, self.call, self.rule_kind, self.decorator)
        if f.inplace_view:
            if self_._views is not None and any(r() is not None for r in self_._views):
                raise NotImplementedError(
                    f"{self.call}: {op_name(func)} changes the shape of a tensor that has live "
                    "views (x[0], x.T, ...); this is not supported. Do: use the out-of-place form "
                    f"({op_name(functional)}) and keep the result."
                )
            new = self.process(functional, args, kwargs)
            self._rebind(self_, new)
            if self_._base is not None and getattr(new, "_interp", None) is self:
                self_._chain = new._chain  # still a view of the same root, one step further
            return self_
        new = self.process(functional, positional_with_defaults(func, args), kwargs)
        if isinstance(new, torch.Tensor):
            new = self._in_dtype_of(func, self_, new)
        base = self_._base
        if base is None and (
            self_._views is None or not any(r() is not None for r in self_._views)
        ):
            self._rebind(self_, new)  # the common case: nothing else shares this value
            return self_
        root = self_ if base is None else base
        self._replaying = True
        try:
            if base is not None:
                self._rebind(root, self._scatter(root, self_._chain, new))
            else:
                self._rebind(root, new)
            for ref in root._views:
                v = ref()
                if v is not None and v is not self_:
                    self._rebind(v, self._replay(root, v._chain))
        finally:
            self._replaying = False
        if base is not None:
            self._rebind(self_, new)
        return self_

    def _in_dtype_of(self, func, self_, new):
        """``new`` in the target's dtype: an in-place op keeps it (``x32.mul_(y64)`` stays
        float32) where its functional form promotes; a cast eager refuses raises as eager."""
        dtype, target = dtype_of(new), dtype_of(self_)  # Note [Reading a wrapper's metadata]
        if dtype == target:
            return new
        if not torch.can_cast(dtype, target):
            raise RuntimeError(
                f"{self.call}: {op_name(func)}: result type {dtype} can't be cast to the "
                f"desired output type {target} of the in-place op (as in eager torch)."
            )
        return new.to(target)

    def _scatter(self, root, chain, v):
        """The new value of ``root`` after writing ``v`` into its view ``chain``."""
        bases = [root]
        for step in chain[:-1]:
            bases.append(step.replay(bases[-1]))
        for step, b in zip(reversed(chain), reversed(bases)):
            v = step.scatter(b, v)
        return v

    # -- promotion (Note [Writing into a plain tensor]) ----------------------------------------
    def _promote(self, func, target):
        why = None
        if isinstance(target, TransformTensor):
            why = self._why_not_wrapper(target)
            if why is None:  # Note [Writing into an outer transform's value]
                if self._promoted is None:
                    self._promoted = []
                self._promote_one(target, target.clone(), None, kind=_OUTER)
                return
        elif type(target) is not torch.Tensor:
            why = f"the target is a {type(target).__name__}, not a plain tensor"
        elif target.requires_grad:
            why = "the target requires grad (a torch.autograd leaf)"
        elif target.is_conj() or target.is_neg():
            why = "the target is a lazily conjugated or negated view (call .resolve_conj() first)"
        else:
            root = target._base if target._base is not None else target
            aliases = ()
            if root is target:  # Note [Physical roots of writes under vmap]
                named = physical_root(target)
                if named is not None:
                    root, aliases = named
                    aliases = [a for a in aliases if a is not target and a is not root]
            if type(root) is not torch.Tensor or root.requires_grad:
                why = "the target is a view of a tensor that cannot be promoted"
            elif _compat.has_internal_overlap(root) != 0 or root.dtype != target.dtype:
                why = "the target's memory overlaps itself or is reinterpreted"
            else:
                known = (1 if root is target else 2) + len(aliases)
                if _compat.storage_use_count(root.untyped_storage()._cdata) != known + 1:
                    why = "other tensors share its memory (views or aliases of it are alive)"
                elif root._use_count() > (
                    (3 if root is target else 2) + _compat.proxy_tracing() + self._caller_holds
                ):
                    # Note [Buffers held by kernels]: a buffer whose TensorImpl is referenced
                    # from C++ beyond its Python object and this op's arguments: a composite
                    # kernel made it and keeps computing with it in C++, where a promoted
                    # wrapper is invisible (hinge_embedding_loss: `(margin - x).clamp_min_(0)`
                    # on a *_like buffer; the CPU LSTM cell: `linear_hh(hx).add_(gates)` on a
                    # plain one); promoting would silently drop the derivative and the value.
                    # Buffers the user made (held only by Python) promote.
                    why = "a torch kernel holds it (a composite op writing into its own buffer)"
        if why is not None:
            raise_inplace_untracked(self, func, why)
        views = [v for v in (target, *aliases) if v is not root]
        positions = []
        if views:
            # Positions depend on metadata only: computed with dispatch off, they are
            # constants to a tracer (jit), and the check below is no data-dependent read.
            with _compat.DisableTorchDispatch():
                n = root.untyped_storage().nbytes() // root.element_size()
                dev = positions_device(root)
                store = torch.full((n,), -1, dtype=torch.long, device=dev)
                store.as_strided(root.shape, root.stride(), root.storage_offset()).copy_(
                    torch.arange(root.numel(), device=dev).reshape(root.shape)
                )
                for v in views:
                    positions.append(
                        store.as_strided(v.shape, v.stride(), v.storage_offset()).clone()
                    )
                outside = any(bool((p < 0).any()) for p in positions)
            if outside:
                raise_inplace_view_outside_base(self, func)
        if self._promoted is None:
            self._promoted = []
        self._promote_one(root, root.clone(), None)
        for v, p in zip(views, positions):
            step = _IndexStep(p)
            self._promote_one(v, step.replay(root._primal), (root, step))

    def _why_not_wrapper(self, target):
        """Why a lower level's wrapper cannot be promoted (None: it can): only a value that
        nothing else aliases, since the write reaches it alone."""
        if target._interp.level > self.level or not target._interp.alive:
            return f"the target belongs to another transform ({target._interp.name})"
        t = target
        while isinstance(t, TransformTensor):
            if t._inner_requires_grad():
                return "the target requires grad (a torch.autograd leaf)"
            if getattr(t, "_base", None) is not None or any(
                r() is not None for r in getattr(t, "_views", None) or ()
            ):
                return "the target is a view, or has live views, of a value of an outer transform"
            inner = getattr(t, "_value", None)  # vmap: in place on the physical value
            if inner is None:
                return None  # jvp/grad: functional inside, nothing else sees the write
            t = inner
        if t._base is not None or _compat.storage_use_count(t.untyped_storage()._cdata) != 2:
            return "other tensors share its memory (a view of an outer transform's value)"
        return None

    def _promote_one(self, obj, value, view_of, kind=None):
        holder = self._constant(value)
        _swap(obj, holder)  # obj: the wrapper; holder: the old impl
        holder.__class__ = _Redirect
        holder.__dict__["_target"] = obj
        if view_of is not None:
            root, step = view_of
            self._add_view(root, obj, (step,))
        self._promoted.append((obj, holder, view_of is None if kind is None else kind))

    def __exit__(self, *exc):
        try:
            if self._promoted:
                self._demote()
        finally:
            super().__exit__(*exc)
        return False

    def _demote(self):
        """Give every promoted tensor its final value back as a plain tensor (on level exit)."""
        promoted, self._promoted = self._promoted, None
        for obj, holder, is_root in promoted:
            final = obj._primal
            if is_root is _OUTER:  # the old value is dead: obj becomes the final one
                _swap(obj, torch.ops.aten.alias.default(final))
                continue
            holder.__class__ = torch.Tensor
            del holder.__dict__["_target"]
            plain = type(final) is torch.Tensor
            if plain and is_root and final.shape == holder.shape and final.dtype == holder.dtype:
                holder.copy_(final)
                _give_back(obj, holder)
            elif plain and not is_root:
                _swap(obj, holder.view(holder.shape))  # written through its root above
            else:  # the value belongs to an outer transform: obj becomes that value
                _swap(obj, torch.ops.aten.alias.default(final))
                holder.__class__ = _Redirect
                holder.__dict__["_target"] = obj
                # ... until that transform exits too: never leave a user's tensor a wrapper
                outer = final._interp
                if isinstance(outer, InplaceMixin):  # it writes the final value back, as we do
                    if outer._promoted is None:
                        outer._promoted = []
                    outer._promoted.append((obj, holder, is_root))
                else:  # vmap: one value per example, none for the tensor: restore the original
                    outer.on_exit(lambda obj=obj, holder=holder: _restore(obj, holder))
