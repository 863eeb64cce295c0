"""Torch functions recorded whole at a grad level under vmap (Note [Torch functions at the grad
level under vmap], autodiff/reverse.py): ``F.linear``, and the common unary activations.

Note [F.linear as one node]
    torch decomposes ``F.linear(x, w, b)`` (CompositeImplicit) before any wrapper sees it: for a
    2-d ``x``, ``addmm(b, x, w.t())``; for a contiguous 1-d ``x`` (one example of a batch),
    ``view(addmm(b, view(x, [1, n]), w.t()), [m])``. At the grad level each piece is a tape node
    and a trip through both levels. Here the call is one node: its value is ``F.linear`` of the
    unwrapped values, which the level below decomposes into the same ops (so the same numbers),
    and its vjp rule runs the rules of the pieces (views.py's ``_reshape_back`` and ``t``,
    linalg.py's addmm rule) in the order the sweep would, on the same values: the cotangents are
    bit for bit the ordinary path's (tests/autodiff/test_mlp_fastpaths.py). Declined, to the
    ordinary path: no bias or a bias passed oddly, other ranks or layouts, mixed dtypes (torch's
    errors come from there), a level other than this one inside the arguments, anything torch's
    autograd must record (a plain tensor that requires grad, or a call below its keys), grad
    mode off, a dispatch mode on the stack.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from functransforms import _compat
from functransforms._core.levels import TransformTensor, below_torch_autograd, linear_args
from functransforms._core.metadata import metadata, metadata_conj
from functransforms._core.ops import facts

from .reverse import GRAD_FAST, NONDIFFERENTIABLE, GradTensorInVmap, Node, _prune, wrap_grad

_grad_enabled = torch.is_grad_enabled
_dispatch_modes = _compat.len_torch_dispatch_stack
_torch_requires_grad = _compat.tensor_requires_grad
_aten = torch.ops.aten
_addmm, _unsafe_view = _aten.addmm.default, _aten._unsafe_view.default
_LAST_UNSAFE = _compat.LINEAR_ENDS_UNSAFE_VIEW
_rules = []  # (unbroadcast, _mm_vjp_a, _mm_vjp_b), imported at first use (rule families)


def _linear_fast(args, kwargs):
    """``F.linear`` as one tape node (Note [F.linear as one node]), or None to decline."""
    args = linear_args(args, kwargs)
    if args is None:
        return None
    interp = None
    for a in args:
        if type(a) is GradTensorInVmap:
            if interp is None:
                interp = a._interp
            elif a._interp is not interp:
                return None
    if (
        interp is None
        or not interp.alive
        or not interp.prev_grad
        or not _grad_enabled()
        or _dispatch_modes()
        or below_torch_autograd()
    ):
        return None
    primals = []
    inputs = []
    metas = []
    for a in args:
        if isinstance(a, TransformTensor):
            if a._interp is interp:
                p = a._primal
                if type(p) is torch.Tensor and p.requires_grad:
                    return None  # torch's autograd records this one: the ordinary path
                primals.append(p)
                inputs.append((a._node, a._idx))
            elif a._interp.level > interp.level:
                return None  # an inner level's value: that level sees the call first
            else:
                primals.append(a)  # a lower level's value: a constant here
                inputs.append(None)
        elif type(a) is torch.Tensor:
            if a.requires_grad:
                return None
            primals.append(a)
            inputs.append(None)
        else:
            return None
        shape, stride, dtype, _ = metadata(a)  # Note [Reading a wrapper's metadata]
        metas.append((shape, stride, dtype))
    (xs, xst, xd), (ws, _, wd), (bs, _, bd) = metas
    if not (xd == wd == bd and (xd.is_floating_point or xd.is_complex)):
        return None
    if len(ws) != 2 or len(bs) != 1:
        return None
    if len(xs) == 1:
        if xst[0] != 1 and xs[0] > 1:  # torch decomposes a strided 1-d x another way
            return None
    elif len(xs) != 2:
        return None
    out = F.linear(*primals)
    node = Node(_linear_vjp_rule, primals, {}, out, inputs, [i is not None for i in inputs])
    # for grad_fn: the op torch's decomposition ends with (Note [requires_grad and grad_fn ...])
    node.name = _addmm if len(xs) == 2 else _unsafe_view if _LAST_UNSAFE else _aten.view.default
    return wrap_grad(out, node, 0, interp)


def _linear_vjp_rule(ct, primals, kwargs, out, needs):
    """F.linear(x, w, b) = x w^T + b: the decomposition's rules in the sweep's order (Note
    [F.linear as one node])."""
    if not _rules:
        from ._util import unbroadcast
        from .linalg import _column_major, _mm, _mm_vjp_a, _mm_vjp_b

        _rules.append((unbroadcast, _mm_vjp_a, _mm_vjp_b, _column_major, _mm))
    unbroadcast, mm_vjp_a, mm_vjp_b, column_major, mm = _rules[0]
    x, w, b = primals
    one = x.dim() == 1
    if one:  # view(x, [1, n]) and view(y2, [m]): their cotangents are reshapes back
        xv = x.view(1, x.shape[0])
        ct = ct.reshape(1, w.shape[0])
    else:
        xv = x
    if not w.is_complex():
        # Note [Real linear cotangents without the views that cancel]
        #     For a real weight the decomposition's rules apply transposes that cancel: addmm's
        #     ``mm_vjp_a(ct, x, w.t())`` multiplies by ``w.t().mH``, a view with w's own sizes
        #     and strides, and for a row-major w (``w.t()`` column-major) ``mm_vjp_b`` returns
        #     ``P.mH`` of a product P, which the decomposition's ``t()`` turns back into P
        #     itself. Skipping them runs the same kernels on the same operands, so the same
        #     bits and the same layout, and saves up to four ops per layer (under MAML's
        #     grad(vmap(grad)) each is a node of the outer grad level and a trip through vmap).
        ws = w.stride()
        row_major = ws[1] == 1 and ws[0] == w.shape[1]  # == _column_major(w.t())
        if one and row_major:  # and unbroadcast's sum over the size-1 dim without its reshape
            cb = ct.sum(0) if needs[2] else None
        else:
            cb = unbroadcast(ct, b.shape) if needs[2] else None
        cx = None
        if needs[0]:
            cx = mm(w.t(), ct.mH).mH if column_major(xv) else mm(ct, w)
            if one:
                cx = cx.reshape(x.shape)
        cw = None
        if needs[1]:
            cw = mm(ct.mH, xv) if row_major else mm(xv.mH, ct).t()
        return cx, cw, cb
    wt = w.t()
    cb = unbroadcast(ct, b.shape) if needs[2] else None
    cx = mm_vjp_a(ct, xv, wt) if needs[0] else None
    cw = mm_vjp_b(ct, xv, wt) if needs[1] else None
    if one and cx is not None:
        cx = cx.reshape(x.shape)
    if cw is not None:
        cw = cw.t()
    return cx, cw, cb


# Note [Unary functions at the grad level under vmap]
#     ``torch.relu(h)`` of a tracked value under vmap(grad) is the ATen op ``relu`` whatever the
#     spelling (``F.relu(h)``, ``h.relu()``): the grad level records the node it would record
#     for ``aten.relu`` (the same rule, kept values and name) and runs ``torch.relu`` on the
#     primal, which the vmap level's pointwise fast path takes directly (the ordinary path
#     reaches the vmap level's rule through the dispatcher: the same kernel, Note [Pointwise
#     fast path]). Declined as F.linear's is, and for a keyword other than ``inplace=False``.
#     Listed: relu (also ``F.relu``), tanh, sigmoid, exp, log, sin, cos, neg, abs, sqrt, rsqrt,
#     log1p, expm1, erf, reciprocal, each as ``torch.<name>`` and ``Tensor.<name>``.
def _def_unary(op, *funcs):
    def unary_fast(args, kwargs):
        if len(args) != 1 or (kwargs and kwargs != _NOT_INPLACE):
            return None
        a = args[0]
        if type(a) is not GradTensorInVmap:
            return None
        interp = a._interp
        if (
            not interp.alive
            or not interp.prev_grad
            or not _grad_enabled()
            or _dispatch_modes()
            or below_torch_autograd()
        ):
            return None
        p = a._primal
        if type(p) is torch.Tensor and p.requires_grad:
            return None
        return _record(interp, op, run, p, (a._node, a._idx))

    run = getattr(torch, op.__name__.split(".")[0])
    for fn in funcs:
        GRAD_FAST[fn] = unary_fast


_NOT_INPLACE = {"inplace": False}


def _record(interp, op, run, p, entry):
    """GradInterpreter.process's node for ``op(p)`` (one tensor in, one out), with the value
    computed by ``run(p)``; None where that method does more (Note [Unary functions at the grad
    level under vmap])."""
    f = facts(op)
    rule = f.vjp_rule
    if rule is None or rule is NONDIFFERENTIABLE or f.vjp_forward is not None or f.view:
        return None
    out = run(p)
    shape, stride, dtype, device, conj = metadata_conj(out)
    if not (dtype.is_floating_point or dtype.is_complex):
        return out
    meta = (shape, stride, dtype, device)
    if conj:  # Note [No lazy conjugate inside wrappers]
        out = out.resolve_conj()
        meta = None
    primals, saved = [p], out
    keeps = getattr(rule, "keeps", None)
    if keeps is not None:  # Note [What a vjp rule keeps]
        primals, saved = _prune(primals, out, keeps)
    node = Node(rule, primals, {}, saved, [entry], [True])
    node.name = op
    return wrap_grad(out, node, 0, interp, meta)


GRAD_FAST[F.linear] = _linear_fast
_def_unary(_aten.relu.default, torch.relu, torch.Tensor.relu, F.relu)
# ops with kernels of their own (a CompositeImplicit op would reach the grad level decomposed,
# as other nodes: never listed here)
for _name in "tanh sigmoid exp log sin cos neg abs sqrt rsqrt log1p expm1 erf reciprocal".split():
    _op = getattr(_aten, _name).default
    assert not _op.has_kernel_for_dispatch_key(_compat.CompositeImplicitAutograd), _op
    _def_unary(_op, getattr(torch, _name), getattr(torch.Tensor, _name))
