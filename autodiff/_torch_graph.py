"""Outputs that torch's autograd leaves without a graph, given one by our vjp rule.

Note [Outputs torch leaves without a graph]
    When torch's autograd records an op inside one of our rules (Note [Torch autograd through
    our transforms], functransforms/_core/levels.py), some floating outputs come back without a
    graph even though their inputs require grad: torch's derivative formula declares them
    non-differentiable. ``native_layer_norm``'s ``mean`` and ``rstd``, the batch-norm kernels'
    saved statistics, ``_linalg_det``'s ``LU``: torch's own backward formulas read them as
    saved values and their double-backward formulas account for how they depend on the input
    (``layer_norm_double_backward`` recomputes it). Our rules read them too, as outputs with a
    derivative of their own: the layer-norm vjp builds ``xhat = (x - mean) * rstd`` from them,
    its jvp the tangents of all three outputs. torch's autograd, differentiating those ops,
    took ``mean`` and ``rstd`` for constants: the user's outer derivative of ``ft.grad``'s result
    (MAML's meta-gradient through a LayerNorm) was 15-20% off, silently.

    The fix is one mechanism, not a rule per op: while torch records the ops of a rule, a
    ``TorchFunctionMode`` sees each ATen op the rule runs. When an op returns several outputs
    and a floating one came back without a graph while a plain input requires grad, the
    outputs are handed to torch again through one ``autograd.Function`` node whose backward is
    our vjp rule of that op, which gives every output its cotangent (the same rule our own
    reverse mode uses, so ``vjp(vjp)`` in the conformance suite already checks it). The
    backward runs ordinary ops on the saved inputs and outputs, so torch differentiates it
    again (double backward, MAML), and at every level, since each level's rules run under the
    same guard (vmap's rules on physical values, jvp's on primals, grad's forward).

    Cost: nothing unless torch's autograd records inside a rule (a plain tensor that requires
    grad reaches a transform); then one Python call per op the rule runs. Outputs that torch
    declares non-differentiable become differentiable through our rule: more than eager torch
    allows on those outputs (docs/torch_func_differences.md), never a different value.
"""

from __future__ import annotations

import re

import torch
from torch.overrides import TorchFunctionMode

from functransforms import _compat
from functransforms._core.levels import (
    _AUTOGRAD_KEYS,
    TransformTensor,
    _ForceKeys,
    _tls_exclude,
    _tls_include,
    copy_as_torch_records,
)
from functransforms._core.ops import facts

from ._util import match_dtype

_OpOverload = _compat.OpOverload


def _floating(t) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def _lacks_graph(out, flat_args) -> bool:
    """Does a plain floating output lack a graph while a plain input requires grad?"""
    missing = False
    for o in out:
        if isinstance(o, TransformTensor):
            return False  # the op ran on a lower level's wrappers: that level decides
        if isinstance(o, torch.Tensor) and not o.requires_grad and _floating(o):
            missing = True
    if not missing:
        return False
    return any(
        isinstance(a, torch.Tensor) and not isinstance(a, TransformTensor) and a.requires_grad
        for a in flat_args
    )


class TorchGraphMode(TorchFunctionMode):
    """Note [Outputs torch leaves without a graph]: active while torch records a rule's ops."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        recorded = _RECORDED_AS.get(func)
        if recorded is not None:  # Note [Ops torch's autograd cannot record]
            if not _holds_wrapper(args):
                return recorded(*args, **kwargs)
            with _ForceKeys(_tls_include(), _tls_exclude() | _AUTOGRAD_KEYS):
                return func(*args, **kwargs)
        try:
            out = func(*args, **kwargs)
        except RuntimeError as e:
            args = _refused_detached(func, args, e)
            out = func(*args, **kwargs)
        if type(func) is not _OpOverload or type(out) is not tuple or not torch.is_grad_enabled():
            return out
        flat = _flatten(args)
        if not _lacks_graph(out, flat) or _lacks_graph(out, kwargs.values()):
            return out  # (a keyword tensor that requires grad: no ATen op has one to differentiate)
        rule = facts(func).vjp_rule
        if rule is None or not callable(rule):  # no rule, or NONDIFFERENTIABLE
            return out
        diff = [i for i, a in enumerate(flat) if _is_input(a)]
        aux = [i for i, o in enumerate(out) if _without_graph(o)]
        new = _RuleNode.apply((rule, args, kwargs, out, diff, aux), *(flat[i] for i in diff))
        out = list(out)
        for i, t in zip(aux, new):
            out[i] = t
        return tuple(out)


# Note [Ops torch's autograd cannot record]
#     Our levels run the functional form of every in-place op (``x.copy_(y)`` is ``aten.copy``,
#     ``x.zero_()`` ``aten.zero``) and rules use the functional scatters. torch's autograd
#     records some of them with no derivative (``aten.copy``: the backward then raised
#     "derivative for aten::copy is not implemented") or refuses them for complex values
#     (``slice_scatter``, ``select_scatter``, ``diagonal_scatter``, ``zero``) or differentiates
#     them wrongly (``as_strided_scatter``), where eager torch, which runs the in-place
#     forms, differentiates them right. While torch records, each runs as the in-place form on
#     a fresh copy: the same values and layout, a graph torch differentiates (``diff(n=0)``,
#     ``matrix_power(A, 0)``, circular ``pad`` of complex values under ``torch.autograd.grad``
#     of our results).
def _written_into_copy(op, view, always=False):
    """``op(base, src, *args)`` computed as ``base.clone()`` with ``src`` written into
    ``view(copy, *args)``: for complex values, which torch's autograd refuses in ``op``, or
    ``always`` (torch's derivative of ``op`` is wrong)."""

    def run(base, src, *args, **kwargs):
        if not (always or base.is_complex() or src.is_complex()):
            return op(base, src, *args, **kwargs)
        out = base.clone()
        view(out, *args, **kwargs).copy_(src)
        return out

    return run


def _holds_wrapper(args) -> bool:
    """Does the op run on our wrappers? Then a level's interpreter carries it out as it is, and
    its rule runs the op again on plain values, where the substitution applies. The substitute
    (a write through a view) on wrappers was lost by the level's own write bookkeeping, which
    runs these scatters (complex ``x[1:3].copy_(y)``, ``zero_``, circular ``pad`` under
    ``vjp``/``jvp``/``grad`` of an input that requires grad came out zero). The call on wrappers
    goes below torch's autograd: what it would record there is the wrappers' own graph, never
    differentiated (Note [Torch autograd through our transforms]), and for complex values it
    refuses these ops."""
    return any(isinstance(a, TransformTensor) for a in _flatten(args))


def _zero_recorded(x):
    return x.clone().zero_() if x.is_complex() else _aten.zero.default(x)


_aten = torch.ops.aten
_SCATTER_VIEWS = {
    _aten.slice_scatter.default: _aten.slice.Tensor,
    _aten.select_scatter.default: _aten.select.int,
    _aten.diagonal_scatter.default: _aten.diagonal.default,
}
_RECORDED_AS = {
    _aten.copy.default: copy_as_torch_records,
    _aten.zero.default: _zero_recorded,
    **{op: _written_into_copy(op, view) for op, view in _SCATTER_VIEWS.items()},
    # torch's derivative of as_strided_scatter in ``self`` is the transpose of the right one
    # (it keeps the cotangent at the scattered positions; its OpInfo marks the gradient test an
    # expected failure): the in-place form's is right
    _aten.as_strided_scatter.default: _written_into_copy(
        _aten.as_strided_scatter.default, _aten.as_strided.default, always=True
    ),
}


_REFUSED = re.compile(r"is not differentiable with respect to argument '(\w+)'")


def _refused_detached(func, args, error):
    """torch's backward kernels refuse an argument that requires grad when their derivative
    formula takes it for a constant and accounts for it otherwise (``log_sigmoid_backward``'s
    ``buffer``, as the batch-norm kernel's statistics): once we gave that value a graph, it goes
    in detached. Any other error is re-raised."""
    m = _REFUSED.search(str(error))
    op = getattr(func, "default", func)  # an OpOverloadPacket: its default overload
    if type(op) is not _OpOverload or m is None:
        raise error
    names = [a.name for a in op._schema.arguments]
    if m.group(1) not in names or names.index(m.group(1)) >= len(args):
        raise error
    i = names.index(m.group(1))
    a = args[i]
    if type(a) is not torch.Tensor:
        raise error
    return args[:i] + (a.detach(),) + args[i + 1 :]


def _without_graph(o) -> bool:
    return isinstance(o, torch.Tensor) and _floating(o) and not o.requires_grad


def _flatten(args):
    """The positional arguments with list arguments spliced in (one level, as ATen's schemas)."""
    flat = []
    for a in args:
        if type(a) is list or type(a) is tuple:
            flat.extend(a)
        else:
            flat.append(a)
    return flat


def _unflatten(args, flat):
    it = iter(flat)
    return [type(a)(next(it) for _ in a) if type(a) in (list, tuple) else next(it) for a in args]


def _is_input(a) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and not isinstance(a, TransformTensor)
        and a.requires_grad
        and _floating(a)
    )


class _RuleNode(torch.autograd.Function):
    """One torch node over the outputs of an op that torch left without a graph, differentiated
    by our vjp rule. The outputs torch records are left to torch's own node (the rule's
    cotangents are linear: the two nodes add up to the rule's whole vjp), so an in-place op on
    them (``ReLU(inplace=True)`` after a norm) does not invalidate this node."""

    @staticmethod
    def forward(ctx, info, *inputs):
        ctx.info = info
        ctx.set_materialize_grads(False)
        outs = tuple(info[3][i].detach() for i in info[5])
        ctx.n_inputs = len(inputs)
        ctx.save_for_backward(*inputs, *outs)
        return outs

    @staticmethod
    def backward(ctx, *aux_cts):
        rule, args, kwargs, out, diff, aux = ctx.info
        if all(c is None for c in aux_cts):
            return (None,) * (1 + ctx.n_inputs)
        saved = ctx.saved_tensors
        inputs, saved_aux = saved[: ctx.n_inputs], saved[ctx.n_inputs :]
        flat = _flatten(args)
        for i, t in zip(diff, inputs):
            flat[i] = t
        primals = _unflatten(args, flat)
        out, cts = list(out), [None] * len(out)
        for i, t, c in zip(aux, saved_aux, aux_cts):
            out[i], cts[i] = t, c
        out, cts = tuple(out), tuple(cts)
        # needs[k]: the k-th positional argument holds an input torch wants a gradient for
        wanted = {i for i, n in zip(diff, ctx.needs_input_grad[1:]) if n}
        needs, k = [], 0
        for a in args:
            n = len(a) if type(a) in (list, tuple) else 1
            needs.append(any(j in wanted for j in range(k, k + n)))
            k += n
        arg_cts = rule(cts, primals, kwargs, out, needs)
        flat_cts = []
        for a, c in zip(args, arg_cts):
            if type(a) in (list, tuple):
                flat_cts.extend([None] * len(a) if c is None else c)
            else:
                flat_cts.append(c)
        return (None,) + tuple(
            None if flat_cts[i] is None else match_dtype(flat_cts[i], flat[i]) for i in diff
        )


def torch_differentiates(t) -> bool:
    """Does torch's autograd differentiate ``t``'s value: the plain tensor inside every wrapper
    requires grad and grad mode is on. Rules that hand one of our outputs to a torch kernel
    whose derivative formula treats that input as a constant (the batch-norm backward kernel's
    saved statistics) ask this first."""
    while isinstance(t, TransformTensor):
        t = t._value if hasattr(t, "_value") else t._primal
    return isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled()


class _NewValueSameHistory(torch.autograd.Function):
    """``value``'s numbers with ``below``'s torch history: the derivative is the identity."""

    @staticmethod
    def forward(ctx, below, holder):
        return holder[0].detach()

    @staticmethod
    def backward(ctx, ct):
        return ct, None


def written_under_no_grad(below, value):
    """Note [Grad mode] (reverse.py) for torch's autograd: an in-place write under no_grad
    changes a tensor's value and keeps its history. Our levels write functionally (the wrapper
    takes ``value``, computed as a constant), so a plain ``below`` that torch differentiates
    hands its history to the new value: torch's ``cosine_similarity`` clamps its norms in place
    under no_grad, and torch's derivative of ``ft.grad`` of it lost the norms' graph."""
    if type(below) is not torch.Tensor or not below.requires_grad or value.requires_grad:
        return value
    if below.shape != value.shape or below.dtype != value.dtype:
        return value
    with torch.enable_grad():
        return _NewValueSameHistory.apply(below, (value,))
