"""custom_vjp / custom_jvp / stop_gradient (JAX's extras).

Note [Custom rules across levels]
    A custom function is a single "op" to the transforms. Called with wrappers, it is processed
    by the innermost level among its arguments: a grad level records one tape node whose vjp is
    the user's ``bwd``; a jvp level calls the user's jvp rule; a vmap level calls a custom
    function whose ``fn``, ``fwd``, ``bwd`` and jvp rule are themselves vmapped, so the custom
    rule stays visible to every enclosing level. Forward mode of a vjp-only function and reverse
    mode of a jvp-only function follow JAX: the latter transposes the (linear) jvp rule.
"""

from __future__ import annotations

import functools

import torch

from . import _pytree as pt
from ._core import TransformTensor, is_floating


_SCALARS = (int, float, bool, complex, str, type(None))


def _plain(a):
    """A plain tensor, a Python scalar, or a tuple/list of those: nothing a transform wraps
    (registered pytree nodes such as operators may hold wrappers, so they are not plain)."""
    if type(a) is torch.Tensor or type(a) in _SCALARS:
        return True
    return (type(a) is tuple or type(a) is list) and all(
        type(b) is torch.Tensor or type(b) in _SCALARS for b in a
    )


class _CustomFunction:
    def __init__(self, fn):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.fwd = None
        self.bwd = None
        self.jvp_rule = None

    def defvjp(self, fwd, bwd):
        """``fwd(*args) -> (out, residuals)``; ``bwd(residuals, ct) -> tuple of cotangents``."""
        self.fwd, self.bwd = fwd, bwd
        return self

    def defjvp(self, jvp_rule):
        """``jvp_rule(primals, tangents) -> (out, tangent_out)``."""
        self.jvp_rule = jvp_rule
        return jvp_rule

    def __call__(self, *args):
        if all(_plain(a) for a in args):
            return self.fn(*args)  # no transform can be involved: skip flattening (hot in linalg)
        flat, spec = pt.tree_flatten(args)
        interp = None
        for x in flat:
            if isinstance(x, TransformTensor) and (
                interp is None or x._interp.level > interp.level
            ):
                interp = x._interp
        if interp is None:
            return self.fn(*args)
        return _PROCESS[interp.name](self, interp, args)


def custom_vjp(fn):
    """Give ``fn`` a hand-written reverse-mode rule (JAX's ``custom_vjp``).

    Example:
        >>> import torch, functransforms as ft
        >>> @ft.custom_vjp
        ... def clip_grad(x):
        ...     return x
        >>> clip_grad.defvjp(lambda x: (x, None), lambda res, g: (g.clamp(-1, 1),))  # doctest: +ELLIPSIS
        <...>
        >>> ft.grad(lambda x: (clip_grad(x) * 10).sum())(torch.ones(2))
        tensor([1., 1.])
    """
    return _CustomFunction(fn)


def custom_jvp(fn):
    """Give ``fn`` a hand-written forward-mode rule (JAX's ``custom_jvp``); reverse mode
    transposes it.

    Example:
        >>> import torch, functransforms as ft
        >>> @ft.custom_jvp
        ... def f(x):
        ...     return torch.sin(x)
        >>> @f.defjvp
        ... def f_jvp(primals, tangents):
        ...     (x,), (t,) = primals, tangents
        ...     return torch.sin(x), torch.cos(x) * t
        >>> ft.grad(lambda x: f(x).sum())(torch.zeros(2))
        tensor([1., 1.])
    """
    return _CustomFunction(fn)


def _process_grad(cf, interp, args):
    from functransforms.autodiff.reverse import GradTensor, Node, wrap_grad

    flat, spec = pt.tree_flatten(args)
    primals, inputs = [], []
    for x in flat:
        if isinstance(x, GradTensor) and x._interp is interp:
            primals.append(x._primal)
            inputs.append((x._node, x._idx))
        else:
            primals.append(x)
            inputs.append(None)
    p_args = pt.tree_unflatten(spec, primals)
    if cf.bwd is not None:
        out, res = cf.fwd(*p_args)

        def bwd(ct):
            cts = cf.bwd(res, ct)
            if not isinstance(cts, tuple):
                cts = (cts,)
            return (
                pt.tree_leaves(cts)
                if len(pt.tree_leaves(cts)) == len(flat)
                else _flat_cts(cts, args)
            )
    elif cf.jvp_rule is not None:
        from ._ad import vjp

        out = cf.fn(*p_args)
        diff = [i for i, p in enumerate(primals) if isinstance(p, torch.Tensor) and is_floating(p)]

        def lin(*ts):
            # the jvp rule at fixed primals, as a (linear) function of the tangents
            tans = [torch.zeros_like(p) if isinstance(p, torch.Tensor) else p for p in primals]
            for i, t in zip(diff, ts):
                tans[i] = t
            return cf.jvp_rule(p_args, pt.tree_unflatten(spec, tans))[1]

        def bwd(ct):
            _, pull = vjp(lin, *[torch.zeros_like(primals[i]) for i in diff])
            got = pull(ct)
            cts = [None] * len(primals)
            for i, g in zip(diff, got):
                cts[i] = g
            return cts
    else:
        out = cf.fn(*p_args)
        return out

    flat_out, out_spec = pt.tree_flatten(out)
    single = isinstance(out, torch.Tensor)

    def rule(ct, _primals, _kwargs, _out, _needs):
        if single:
            c = ct
        else:
            c = pt.tree_unflatten(
                out_spec,
                [x if x is not None else torch.zeros_like(o) for x, o in zip(ct, flat_out)],
            )
        return bwd(c)

    node = Node(
        rule,
        primals,
        {},
        flat_out[0] if single else tuple(flat_out),
        inputs,
        [i is not None for i in inputs],
    )
    wrapped = [
        wrap_grad(o, node, i, interp) if is_floating(o) else o for i, o in enumerate(flat_out)
    ]
    return pt.tree_unflatten(out_spec, wrapped)


def _flat_cts(cts, args):
    # one cotangent per positional argument, each a pytree matching that argument
    out = []
    for c, a in zip(cts, args):
        n = len(pt.tree_leaves(a))
        out.extend(pt.tree_leaves(c) if c is not None else [None] * n)
    return out


def _process_jvp(cf, interp, args):
    from functransforms.autodiff.forward import DualTensor, wrap_dual

    flat, spec = pt.tree_flatten(args)
    primals, tangents = [], []
    for x in flat:
        if isinstance(x, DualTensor) and x._interp is interp:
            primals.append(x._primal)
            tangents.append(x._tangent)
        else:
            primals.append(x)
            tangents.append(torch.zeros_like(x) if isinstance(x, torch.Tensor) else x)
    if cf.jvp_rule is None:
        if cf.bwd is not None:
            raise TypeError(
                f"jvp of {cf.__name__}: it is a custom_vjp function, which defines only a reverse-mode "
                "rule. Expected: a jvp rule too. Do: `f.defjvp(jvp_rule)` (a function may have both)."
            )
        return cf.fn(*args)
    out, t_out = cf.jvp_rule(pt.tree_unflatten(spec, primals), pt.tree_unflatten(spec, tangents))
    return pt.tree_map(lambda o, t: wrap_dual(o, t, interp) if is_floating(o) else o, out, t_out)


def _process_vmap(cf, interp, args):
    from functransforms.batching._tensor import BatchedTensor, wrap_batched

    from ._vmap import vmap

    flat, spec = pt.tree_flatten(args)
    vals, dims = [], []
    for x in flat:
        if isinstance(x, BatchedTensor) and x._interp is interp:
            vals.append(x._value)
            dims.append(x._bdim)
        else:
            vals.append(x)
            dims.append(None)
    in_dims = tuple(pt.tree_unflatten(spec, dims))
    batched = _CustomFunction(vmap(cf.fn, in_dims=in_dims, randomness=interp.randomness))
    if cf.bwd is not None:
        fwd = vmap(cf.fwd, in_dims=in_dims, randomness=interp.randomness)
        bwd = vmap(cf.bwd, in_dims=(0, 0), randomness=interp.randomness)
        batched.defvjp(fwd, bwd)
    if cf.jvp_rule is not None:
        batched.defjvp(vmap(cf.jvp_rule, in_dims=(in_dims, in_dims), randomness=interp.randomness))
    out = batched(*pt.tree_unflatten(spec, vals))
    return pt.tree_map(lambda o: wrap_batched(o, 0, interp), out)


_PROCESS = {"grad": _process_grad, "jvp": _process_jvp, "vmap": _process_vmap}


def stop_gradient(x):
    """Treat ``x`` as a constant for every transform (JAX's ``lax.stop_gradient``).

    Example:
        >>> import torch, functransforms as ft
        >>> ft.grad(lambda x: (x * ft.stop_gradient(x)).sum())(torch.tensor([3.0]))
        tensor([3.])
    """
    return pt.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, x)
