"""Forward mode: DualTensor and the jvp interpreter."""

from __future__ import annotations

import torch

from functransforms._decomp import decomposition
from functransforms._core import Interpreter, TransformTensor, is_floating
from functransforms._ops import facts, op_name
from functransforms.errors import InplaceError

from ._registry import JVP_RULES, missing_rule

_mk = torch.Tensor._make_wrapper_subclass


class DualTensor(TransformTensor):
    """A primal value carrying a tangent at one jvp level."""

    _primal: torch.Tensor
    _tangent: torch.Tensor

    def _describe(self):
        return (
            f"DualTensor(lvl={self._interp.level}, primal={self._primal!r}, "
            f"tangent={self._tangent!r})"
        )


def wrap_dual(primal, tangent, interp):
    r = _mk(DualTensor, primal.shape, dtype=primal.dtype, device=primal.device)
    r._primal = primal
    r._tangent = tangent
    r._interp = interp
    return r


class JvpInterpreter(Interpreter):
    name = "jvp"

    def _unwrap(self, args):
        primals = list(args)
        tangents = [None] * len(args)
        for i, a in enumerate(args):
            if isinstance(a, DualTensor):
                if a._interp is self:
                    primals[i] = a._primal
                    tangents[i] = a._tangent
            elif type(a) is list or type(a) is tuple:
                if any(isinstance(b, DualTensor) and b._interp is self for b in a):
                    primals[i], tangents[i] = self._unwrap(a)
        return primals, tangents

    def _wrap(self, out, t):
        if t is None:
            return out
        if isinstance(out, torch.Tensor):
            if not is_floating(out):
                return out
            if t.dtype != out.dtype:
                t = t.real.to(out.dtype) if t.is_complex() and not out.is_complex() else t.to(out.dtype)
            return wrap_dual(out, t, self)
        return type(out)(self._wrap(o, ti) for o, ti in zip(out, t))

    def process(self, func, args, kwargs):
        primals, tangents = self._unwrap(args)
        f = facts(func)
        if f.inplace or f.inplace_view:
            return self._inplace(func, f, args, primals, tangents, kwargs)
        rule = JVP_RULES.get(func)
        if rule is None:
            d = decomposition(func)
            if d is not None:
                return d(*args, **kwargs)
            out = func(*primals, **kwargs)
            if not _any_floating(out):
                return out
            raise missing_rule(func, "jvp", "register_jvp_rule")
        out, t_out = rule(primals, tangents, kwargs)
        return self._wrap(out, t_out)

    def _inplace(self, func, f, args, primals, tangents, kwargs):
        """Note [In-place under jvp]: compute the functional result, then write primal and tangent
        into the existing storage, so views of the primal and of the tangent stay aliased."""
        self_ = args[0]
        if not (isinstance(self_, DualTensor) and self_._interp is self):
            raise InplaceError(
                f"jvp: {op_name(func)} writes a value that carries a tangent in place into a tensor "
                "that does not (captured from outside jvp, or created inside it). Do: build the "
                "result out of place (torch.stack / torch.cat / torch.where / index_put)."
            )
        functional = f.functional
        rule = JVP_RULES.get(functional) if functional else None
        if rule is None:
            raise missing_rule(func, "jvp", "register_jvp_rule")
        out, t_out = rule(primals, tangents, kwargs)
        if f.inplace_view:
            self_._primal, self_._tangent = out, (t_out if t_out is not None else torch.zeros_like(out))
            with torch._C._DisableTorchDispatch():
                self_.as_strided_(out.shape, _contiguous(out.shape))
            return self_
        self_._primal.copy_(out)
        if t_out is None:
            self_._tangent.zero_()
        else:
            self_._tangent.copy_(t_out)
        return self_


def _contiguous(shape):
    strides, s = [], 1
    for n in reversed(shape):
        strides.append(s)
        s *= max(n, 1)
    return tuple(reversed(strides))


def _any_floating(out):
    if isinstance(out, torch.Tensor):
        return is_floating(out)
    if isinstance(out, (tuple, list)):
        return any(isinstance(o, torch.Tensor) and is_floating(o) for o in out)
    return False

