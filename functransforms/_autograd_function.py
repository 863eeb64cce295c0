"""``torch.autograd.Function`` under our transforms, with PyTorch's contract.

Note [autograd.Function under transforms]
    PyTorch runs a user's ``autograd.Function`` as one op with its own rules: ``forward`` on
    unwrapped tensors (so a forward written with NumPy works), ``setup_context`` to save what
    the rules need, ``backward`` for reverse mode, ``jvp`` for forward mode, and the ``vmap``
    staticmethod (or ``generate_vmap_rule=True``) for batching. Without help, our wrappers
    would reach ``forward`` itself: torch's C++ ``Function.apply`` runs it with grad mode off,
    so a grad level would see nothing and return a zero gradient, silently. torch offers no
    hook (``Function.apply`` asks ``torch._C._are_functorch_transforms_active()``, which only
    knows functorch), so we wrap ``torch.autograd.Function.apply`` once, at import: when one
    of our transforms is active and a wrapper is among the arguments, the Function becomes a
    custom function (``_custom.py``) whose rules are the Function's staticmethods; otherwise
    the original ``apply`` runs, unchanged. The check costs one attribute read when no
    transform is active. (``functransforms/_compat.py`` lists the torch API this relies on.)
"""

from __future__ import annotations

import inspect
import threading
import weakref

import torch

from . import _compat
from . import _pytree as pt
from ._core.levels import TransformTensor, _state
from ._custom import _CustomFunction

_Function = torch.autograd.Function
_APPLY = _Function.__dict__["apply"]


def _original_apply(cls, *args, **kwargs):
    """torch's own ``Function.apply`` for ``cls``: a Python classmethod up to torch 2.14, a C
    ``classmethod_descriptor`` in 2.15 (checked on 2.13.0 and 2.15.0)."""
    if isinstance(_APPLY, classmethod):
        return _APPLY.__func__(cls, *args, **kwargs)
    return _APPLY.__get__(None, cls)(*args, **kwargs)


class _Ctx:
    """What ``setup_context`` may use on ``ctx`` (torch's FunctionCtx surface), as a pytree:
    its tensors (saved or stored as attributes) are the children, so vmap can batch the
    residuals of ``generate_vmap_rule=True`` like any other value."""

    def __init__(self, needs_input_grad=()):
        self.saved_tensors = ()
        # torch keeps two lists: ``saved_tensors`` is what ``save_for_backward`` saved inside
        # ``backward`` and what ``save_for_forward`` saved inside ``jvp`` (one list for both
        # gave ``backward`` the forward's tensors when a Function saved different ones)
        self.saved_for_forward = ()
        self.needs_input_grad = needs_input_grad
        self.materialize_grads = True

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors):
        self.saved_for_forward = tensors

    def mark_dirty(self, *tensors):
        self.dirty = tensors  # Note [mark_dirty under transforms]

    def mark_non_differentiable(self, *tensors):
        pass

    def set_materialize_grads(self, value):
        self.materialize_grads = value


def _ctx_flatten(ctx):
    names = sorted(ctx.__dict__)
    tensor_names = [n for n in names if _is_tensor_tree(getattr(ctx, n))]
    other = {n: getattr(ctx, n) for n in names if n not in tensor_names}
    return [getattr(ctx, n) for n in tensor_names], (tuple(tensor_names), other)


def _ctx_unflatten(aux, children):
    names, other = aux
    ctx = _Ctx.__new__(_Ctx)
    ctx.__dict__.update(other)
    ctx.__dict__.update(zip(names, children))
    return ctx


def _is_tensor_tree(v):
    if isinstance(v, torch.Tensor):
        return True
    return (
        isinstance(v, (tuple, list)) and len(v) > 0 and all(isinstance(t, torch.Tensor) for t in v)
    )


pt.register_pytree_node(_Ctx, _ctx_flatten, _ctx_unflatten)


def _apply(cls, *args, **kwargs):
    if _state.stack and _has_wrapper(args, kwargs):
        return _apply_under_transforms(cls, args, kwargs)
    return _original_apply(cls, *args, **kwargs)


def _has_wrapper(args, kwargs):
    for a in pt.tree_leaves((args, kwargs)):
        if isinstance(a, TransformTensor):
            return True
    return False


def _apply_under_transforms(cls, args, kwargs):
    if cls.setup_context is _compat.SingleLevelFunction.setup_context:
        raise RuntimeError(
            f"{cls.__name__}.apply under a functransforms transform: to use an "
            "autograd.Function with transforms (vmap, grad, jvp, jacrev, ...), it must override "
            "the setup_context staticmethod (as PyTorch requires), with forward(*args) not "
            "taking ctx. See https://pytorch.org/docs/main/notes/extending.func.html"
        )
    sig = _signature(cls)
    if kwargs or len(args) < len(sig.parameters):
        # torch's apply binds forward's defaults too, so setup_context's inputs, backward's
        # gradients and jvp's tangents count every parameter of forward
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        args = bound.args
    calls = _in_flight.dirty
    calls.append([])
    try:
        out = _as_custom_function(cls)(*args)
    finally:
        dirty = calls.pop()
    return _dirty_outputs(args, out, dirty) if dirty else out


# Note [mark_dirty under transforms]
#     A Function that writes into an input and marks it dirty returns that input, and torch
#     rebases the input's history on the Function's node, so later uses of the input are
#     differentiated through the Function. Our levels saw only a new output: the input kept its
#     old history (``y = x.clone(); z = F.apply(y); y * z`` differentiated ``y`` as ``x``,
#     silently). Each forward run (``fwd`` at whatever level) records which input became which
#     output here; once the Function's call returns, the output's value is written into the
#     input with an ordinary ``copy_`` (the levels' in-place rules rebind it, as for any
#     in-place op), and the input itself is returned, as torch returns it.
class _InFlight(threading.local):
    """Per thread, as the calls are: one thread's Function calls popped another's list (a
    dirtied input not written back, silently)."""

    def __init__(self):
        self.dirty: list = []  # per Function call in flight: [(input position, output position)]


_in_flight = _InFlight()


def _dirty_outputs(args, out, dirty):
    flat, spec = pt.tree_flatten(out)
    for i, j in set(dirty):
        if flat[j] is not args[i]:
            args[i].copy_(flat[j])
            flat[j] = args[i]
    return pt.tree_unflatten(spec, flat)


def _same_tensor(o, t):
    """``o`` is ``t``, or wraps the same memory (a lower level ran the in-place forward and
    this level got its output rewrapped)."""
    if o is t:
        return True
    if not isinstance(o, torch.Tensor) or not isinstance(t, torch.Tensor):
        return False
    o, t = _innermost(o), _innermost(t)
    return o.shape == t.shape and o.device == t.device and o.data_ptr() == t.data_ptr()


def _innermost(t):
    while isinstance(t, TransformTensor):
        t = t._value if hasattr(t, "_value") else t._primal
    return t


_SIGNATURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _signature(cls):
    sig = _SIGNATURES.get(cls)
    if sig is None:
        sig = _SIGNATURES[cls] = inspect.signature(cls.forward)
    return sig


_CUSTOM: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # classes may be made per call


def _as_custom_function(cls):
    """The custom function whose rules are ``cls``'s staticmethods (cached per class)."""
    cf = _CUSTOM.get(cls)
    if cf is None:
        cf = _CUSTOM[cls] = _make_custom_function(cls)
    return cf


def _make_custom_function(cls):

    def fn(*args):
        if _has_wrapper(args, {}):  # an enclosing level: the Function is its op, too
            return cf(*args)
        if not _torch_differentiates(args):
            # nothing for torch's autograd to record: the forward itself, under no_grad as
            # torch runs it (torch's apply binds the arguments through inspect.signature,
            # ~30 us a call, more than a small Function's forward)
            with torch.no_grad():
                return cls.forward(*args)
        return _original_apply(cls, *args)  # plain tensors: torch's own apply and autograd

    def forward_ops(*args):  # generate_vmap_rule: vmap batches forward's own ops
        return cls.forward(*args) if _has_wrapper(args, {}) else _original_apply(cls, *args)

    fn.__name__ = forward_ops.__name__ = cls.__name__
    cf = _CustomFunction(fn)

    def setup(args, out):
        # every inexact input may be differentiated: a complex one too (False there made a
        # backward that returns None when not ``needs_input_grad`` give a zero gradient)
        ctx = _Ctx(tuple(isinstance(a, torch.Tensor) and _inexact(a) for a in args))
        cls.setup_context(ctx, args, out)
        dirty = ctx.__dict__.pop("dirty", ())
        calls = _in_flight.dirty
        if dirty and calls:  # Note [mark_dirty under transforms]
            flat_out = pt.tree_leaves(out)
            calls[-1].extend(
                (i, j)
                for t in dirty
                for i, a in enumerate(args)
                if a is t
                for j, o in enumerate(flat_out)
                if _same_tensor(o, t)
            )
        return ctx

    def make_fwd(run):
        def fwd(*args):
            out = run(*args)
            return out, setup(args, out)

        return fwd

    fwd = make_fwd(fn)

    once = _is_once_differentiable(cls.backward)

    def bwd(ctx, ct):
        cts = ct if isinstance(ct, tuple) else (ct,)
        if once and any(_differentiated(c) for c in pt.tree_leaves((cts, ctx))):
            raise RuntimeError(
                f"{cls.__name__}.backward is decorated with @once_differentiable, but a transform "
                "is differentiating it (a second derivative: grad of grad, hessian, jvp of a "
                "vjp). Expected: a backward written with differentiable torch ops, without "
                "@once_differentiable."
            )
        grads = cls.backward(ctx, *cts)
        return grads if isinstance(grads, tuple) else (grads,)

    def make_jvp(fwd):
        def jvp_rule(primals, tangents):
            out, ctx = fwd(*primals)
            ctx.saved_tensors = ctx.saved_for_forward  # torch's ``jvp`` sees these
            # torch gives a non-tensor input the tangent None
            tangents = [
                t if isinstance(p, torch.Tensor) else None for p, t in zip(primals, tangents)
            ]
            return out, cls.jvp(ctx, *tangents)

        return jvp_rule

    cf.defvjp(fwd, bwd)
    cf.materialize_grads = lambda ctx: ctx.materialize_grads
    has_jvp = _overrides(cls, "jvp")
    cf.defjvp(make_jvp(fwd) if has_jvp else _no_jvp_rule(cls))
    if _overrides(cls, "vmap"):
        cf.vmap_rule = _vmap_staticmethod_rule(cls)
    elif getattr(cls, "generate_vmap_rule", False):
        # Note [Generated vmap rules of autograd.Function]: the pieces the batching level vmaps
        # (forward's own ops: re-entering the Function there would batch it again, forever)
        def tangents_out(ctx, primals, tangents):
            ctx.saved_tensors = ctx.saved_for_forward  # torch's ``jvp`` sees these
            tangents = [
                t if isinstance(p, torch.Tensor) else None for p, t in zip(primals, tangents)
            ]
            return cls.jvp(ctx, *tangents)

        cf.generic_vmap = (forward_ops, setup, bwd, tangents_out if has_jvp else None)
    else:
        cf.vmap_rule = _no_vmap_rule(cls)
    return cf


def _torch_differentiates(args):
    return any(isinstance(a, torch.Tensor) and _compat.torch_differentiates(a) for a in args)


def _inexact(t):
    return t.is_floating_point() or t.is_complex()


def _differentiated(c):
    """A grad/jvp wrapper: an enclosing level wants the derivative of the backward."""
    return isinstance(c, TransformTensor) and not hasattr(c, "_bdim")


def _overrides(cls, name):
    return getattr(cls, name) is not getattr(torch.autograd.Function, name)


def _is_once_differentiable(backward):
    code = getattr(backward, "__code__", None)
    return (
        hasattr(backward, "__wrapped__")
        and code is not None
        and code.co_name == "wrapper"
        and code.co_filename == torch.autograd.function.__file__
    )


class _VmapInfo:
    def __init__(self, batch_size, randomness):
        self.batch_size = batch_size
        self.randomness = randomness


def _vmap_staticmethod_rule(cls):
    """PyTorch's ``vmap(info, in_dims, *args) -> (out, out_dims)`` as a custom_vmap rule."""

    def rule(axis_size, in_batched, *args):
        from ._core.levels import interpreter_stack

        interp = interpreter_stack()[-1]
        flat, spec = pt.tree_flatten(args)
        in_dims = pt.tree_unflatten(spec, [0 if b else None for b in in_batched])
        info = _VmapInfo(axis_size, getattr(interp, "randomness", "error"))
        out, out_dims = cls.vmap(info, tuple(in_dims), *args)
        flat_out, out_spec = pt.tree_flatten(out)
        flat_dims = (
            [out_dims] * len(flat_out)
            if out_dims is None or isinstance(out_dims, int)
            else list(out_dims)
        )
        if len(flat_dims) != len(flat_out):
            raise RuntimeError(
                f"{cls.__name__}.vmap returned out_dims={out_dims!r} for {len(flat_out)} "
                "outputs; expected one out_dim (an int or None) per output, as PyTorch does."
            )
        moved = [o if d is None else o.movedim(d, 0) for o, d in zip(flat_out, flat_dims)]
        return pt.tree_unflatten(out_spec, moved), [d is not None for d in flat_dims]

    return rule


def _no_jvp_rule(cls):
    def rule(primals, tangents):  # functorch's exception class, for forward mode
        raise NotImplementedError(
            f"forward-mode AD (jvp, jacfwd, hessian) of {cls.__name__}.apply: the "
            "autograd.Function has no jvp staticmethod. Expected: a jvp(ctx, *tangents) "
            "staticmethod, as PyTorch requires for forward mode."
        )

    return rule


def _no_vmap_rule(cls):
    def rule(axis_size, in_batched, *args):
        raise RuntimeError(
            f"vmap of {cls.__name__}.apply: to use an autograd.Function with vmap, it must "
            "either override the vmap staticmethod or set generate_vmap_rule=True (as "
            "PyTorch requires)."
        )

    return rule


def install():
    """Route ``torch.autograd.Function.apply`` through :func:`_apply` (idempotent)."""
    if getattr(_Function.__dict__["apply"], "__func__", None) is not _apply:
        _Function.apply = classmethod(_apply)
