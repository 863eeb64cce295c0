"""Forward mode: DualTensor and the jvp interpreter."""

from __future__ import annotations

import torch

from functransforms import _compat
from functransforms import _pytree as pt
from functransforms._core.decomp import decomposition
from functransforms._core.levels import Interpreter, TransformTensor, data_as_constant
from functransforms._core.metadata import dtype_conj, is_floating, metadata, metadata_conj
from functransforms._core.ops import facts

from ._registry import decompose, missing_rule
from ._torch_graph import written_under_no_grad
from ._util import (
    InplaceMixin,
    any_floating,
    composite_implicit,
    restride,
    unwrap_level,
)

_mk = _compat.make_wrapper_subclass
_STRIDED = torch.strided
_fwd_enabled = _compat.is_fwd_grad_enabled
_Tensor = torch.Tensor
_set_fwd = _compat.set_fwd_grad_enabled


class DualTensor(TransformTensor):
    """A primal value carrying a tangent at one jvp level."""

    _primal: torch.Tensor
    _tangent: torch.Tensor
    _base = None  # Note [In-place ops and views under jvp and grad]
    _chain = ()
    _views = None

    def _inner_requires_grad(self):  # Note [Torch autograd through our transforms]
        p, t = self._primal, self._tangent
        if type(p) is _Tensor and type(t) is _Tensor:  # the common case: runs for every op
            return p.requires_grad or t.requires_grad
        return (not isinstance(p, TransformTensor) and p.requires_grad) or (
            not isinstance(t, TransformTensor) and t.requires_grad
        )

    data = data_as_constant  # Note [torch's own detach of a wrapper]

    def register_hook(self, hook):
        # torch records a node on this wrapper when a captured tensor requires grad, but only
        # the graph of the unwrapped values is differentiated once jvp returns: a hook here
        # would silently never run. functorch refuses it (its values inside jvp do not
        # require grad).
        raise RuntimeError(
            "x.register_hook(hook) inside jvp: a value inside jvp has no reverse-mode graph "
            "to hook (as in functorch, where it does not require grad). Expected: the hook "
            "on a tensor outside the transform, or on a value inside grad/vjp."
        )

    def _describe(self):
        return (
            f"DualTensor(lvl={self._interp.level}, primal={self._primal!r}, "
            f"tangent={self._tangent!r})"
        )


def wrap_dual(primal, tangent, interp, meta=None):
    """A DualTensor of ``primal``; ``meta``: its ``metadata`` when the caller has it."""
    # the primal's own strides, so torch's view-or-copy decisions on the wrapper are right
    shape, stride, dtype, device = meta or metadata(primal)  # Note [Reading a wrapper's metadata]
    r = _mk(DualTensor, shape, stride, None, None, dtype, _STRIDED, device)  # positional: faster
    r._primal = primal
    r._tangent = tangent
    r._interp = interp
    return r


def _tangent_of(a):
    return a._tangent


class JvpInterpreter(InplaceMixin, Interpreter):
    name = "jvp"
    rule_kind = "jvp"
    decorator = "register_jvp_rule"

    def __init__(self, call="jvp(f)"):
        super().__init__()
        self.call = call  # the public call, for error messages
        self.prev_fwd = True  # forward-grad mode when the level was entered

    def __enter__(self):
        # Note [Grad mode] (autodiff/reverse.py), for forward mode: torch's forward-grad switch
        # (torch's `_set_fwd_grad_enabled(False)`) inside the function stops
        # this level; the caller's setting does not, and is restored on exit.
        self.prev_fwd = _fwd_enabled()
        super().__enter__()
        try:
            _set_fwd(True)
        except BaseException:  # Note [Entering is all or nothing] (_core/levels.py)
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _set_fwd(self.prev_fwd)

    def _as_dual(self, out, t):
        if t is None:
            return out
        if isinstance(out, torch.Tensor):
            # Note [Reading a wrapper's metadata]: one read for the check and the wrapper
            shape, stride, dtype, device, conj = metadata_conj(out)
            if not (dtype.is_floating_point or dtype.is_complex):
                return out
            meta = (shape, stride, dtype, device)
            t_dtype, t_conj = dtype_conj(t)
            if conj or t_conj:  # Note [No lazy conjugate inside wrappers]
                out, t = out.resolve_conj(), t.resolve_conj()
                meta = None
            if t_dtype != dtype:
                if t_dtype.is_complex and not dtype.is_complex:
                    t = t.real
                    t_dtype = t.dtype
                if t_dtype != dtype:
                    t = t.to(dtype)
            return wrap_dual(out, t, self, meta)
        return type(out)(self._as_dual(o, ti) for o, ti in zip(out, t))

    def process(self, func, args, kwargs):
        f = facts(func)
        if f.inplace or f.inplace_view:
            return self._inplace(func, f, args, kwargs)
        rule = f.jvp_rule  # Note [One record per op]
        primals, tangents = unwrap_level(self, args, _tangent_of)
        if not _fwd_enabled():  # forward grad off inside the function: a constant
            return func(*primals, **kwargs)
        if rule is None:
            d = composite_implicit(func) or decomposition(func)
            if d is not None:
                return decompose(self, func, d, args, kwargs)
            out = func(*primals, **kwargs)
            if not any_floating(out):
                return out
            raise missing_rule(func, self.call, "jvp", "register_jvp_rule")
        if self.prev_fwd:
            out, t_out = rule(primals, tangents, kwargs)
        else:  # lowered under the caller's setting (Note [Grad mode])
            _set_fwd(False)
            try:
                out, t_out = rule(primals, tangents, kwargs)
            finally:
                _set_fwd(True)
        out = self._as_dual(out, t_out)
        if f.fresh_like:
            out = self._fresh_buffer(out)
        if f.view:
            self._note_views(func, args, kwargs, out)
        return out

    def process_custom(self, custom_fn, args):
        """Note [Custom rules across levels]: the user's jvp rule on this level's primals and
        tangents (zeros for the arguments not tracked here)."""
        if custom_fn.jvp_rule is None:
            if custom_fn.bwd is not None:
                raise TypeError(
                    f"jvp of {custom_fn.__name__}: it is a custom_vjp function, which defines "
                    "only a reverse-mode rule. Expected: a jvp rule too. Do: "
                    "`f.defjvp(jvp_rule)` (a function may have both)."
                )
            return custom_fn.fn(*args)  # custom_vmap: differentiate fn itself
        flat, spec = pt.tree_flatten(args)
        primals, tangents = unwrap_level(self, flat, _tangent_of)
        tangents = [
            (torch.zeros_like(p) if isinstance(p, torch.Tensor) else p) if t is None else t
            for p, t in zip(primals, tangents)
        ]
        out, t_out = custom_fn.jvp_rule(
            pt.tree_unflatten(spec, primals), pt.tree_unflatten(spec, tangents)
        )
        return pt.tree_map(lambda o, t: wrap_dual(o, t, self) if is_floating(o) else o, out, t_out)

    def _rebind(self, w, value):
        if isinstance(value, DualTensor) and value._interp is self:
            primal, tangent = value._primal, value._tangent
            if not torch.is_grad_enabled():
                primal = _keep_history(w._primal, primal, in_place=True)
                tangent = _keep_history(w._tangent, tangent, in_place=False)
            w._primal, w._tangent = primal, tangent
        elif not _fwd_enabled() and value.shape == w._primal.shape:
            w._primal = value  # written with forward grad off: the tangent is kept
        else:  # the new value carries no tangent at this level
            w._primal, w._tangent = value, torch.zeros_like(value)
        restride(w)

    def _constant(self, primal):
        return wrap_dual(primal, torch.zeros_like(primal), self)


def _keep_history(below, value, in_place):
    """Note [Grad mode] (reverse.py) at the grad levels below a jvp level: written under
    no_grad, they computed ``value`` (the new primal, or the new tangent) as a constant, so it
    goes into the old wrapper below through that level's in-place path, which keeps its history
    (grad(jvp(f)) and vjp(jvp(f)) with gaussian_nll_loss's `var.clamp_(min=eps)` under no_grad
    lost the derivative). The primal is written in place, as functorch does; the tangent into a
    copy (recorded with grad on), since a rule may have handed the same tangent to another
    output."""
    if not isinstance(below, TransformTensor):
        return written_under_no_grad(below, value)
    if below.shape != value.shape:
        return value
    if not in_place:
        with torch.enable_grad():
            below = below.clone()
    below.copy_(value)
    return below
