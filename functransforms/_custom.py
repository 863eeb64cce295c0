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
import inspect

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
    def __init__(self, fn, nondiff_argnums=()):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.fwd = None
        self.bwd = None
        self.jvp_rule = None
        self.vmap_rule = None
        # (fn, fwd, bwd, jvp_rule) for the generic batching, when they differ from the rules
        # other levels use (Note [autograd.Function under transforms])
        self.generic_vmap = None
        self.nondiff_argnums = _check_nondiff(fn, nondiff_argnums)

    def defvjp(self, fwd, bwd):
        """``fwd(*args) -> (out, residuals)``; ``bwd(residuals, ct) -> tuple of cotangents``
        (with ``nondiff_argnums``: ``bwd(*nondiff_args, residuals, ct)``, one cotangent per
        differentiable argument, as JAX)."""
        self.fwd, self.bwd = fwd, bwd
        return self

    def defjvp(self, jvp_rule):
        """``jvp_rule(primals, tangents) -> (out, tangent_out)`` (with ``nondiff_argnums``:
        ``jvp_rule(*nondiff_args, primals, tangents)`` over the differentiable arguments)."""
        self.jvp_rule = jvp_rule
        return jvp_rule

    def defjvps(self, *jvps):
        """One rule per argument (JAX's ``defjvps``): ``jvp_i(t_i, out, *primals)`` is the
        tangent contribution of argument ``i``; ``None`` for an argument with no derivative.

        Example:
            >>> import torch, functransforms as ft
            >>> f = ft.custom_jvp(lambda x, y: x * y)
            >>> f.defjvps(lambda tx, out, x, y: tx * y, lambda ty, out, x, y: x * ty)
            >>> ft.grad(lambda a: f(a, a).sum())(torch.tensor([3.0]))    # d(a*a)/da = 2a
            tensor([6.])
        """

        def jvp_rule(primals, tangents):
            out = self.fn(*primals)
            t_out = None
            for rule, t in zip(jvps, tangents):
                if rule is None:
                    continue
                contribution = rule(t, out, *primals)
                t_out = (
                    contribution if t_out is None else pt.tree_map(torch.add, t_out, contribution)
                )
            if t_out is None:
                t_out = pt.tree_map(torch.zeros_like, out)
            return out, t_out

        self.jvp_rule = jvp_rule

    def def_vmap(self, vmap_rule):
        """``vmap_rule(axis_size, in_batched, *args) -> (out, out_batched)`` (see
        :func:`custom_vmap`)."""
        self.vmap_rule = vmap_rule
        return vmap_rule

    def __call__(self, *args, **kwargs):
        if kwargs:  # JAX resolves keyword arguments to positions by the signature
            args = _resolve_kwargs(self.fn, args, kwargs)
        if self.nondiff_argnums:
            return self._closed_over_nondiff(args)
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

    def _closed_over_nondiff(self, args):
        """The non-differentiable arguments become constants of a function of the others."""
        nondiff = [args[i] for i in self.nondiff_argnums]
        diff_at = [i for i in range(len(args)) if i not in self.nondiff_argnums]

        def full(diff):
            a = list(args)
            for i, d in zip(diff_at, diff):
                a[i] = d
            return a

        closed = _CustomFunction(lambda *diff: self.fn(*full(diff)))
        if self.fwd is not None:
            fwd, bwd = self.fwd, self.bwd
            closed.defvjp(lambda *diff: fwd(*full(diff)), lambda res, ct: bwd(*nondiff, res, ct))
        if self.jvp_rule is not None:
            rule = self.jvp_rule
            closed.defjvp(lambda primals, tangents: rule(*nondiff, primals, tangents))
        closed.vmap_rule = self.vmap_rule
        return closed(*[args[i] for i in diff_at])


def _check_nondiff(fn, nondiff_argnums):
    nums = (nondiff_argnums,) if isinstance(nondiff_argnums, int) else tuple(nondiff_argnums)
    if any(not isinstance(n, int) or n < 0 for n in nums) or len(set(nums)) != len(nums):
        raise ValueError(
            f"custom function {getattr(fn, '__name__', fn)!r}: "
            f"nondiff_argnums={nondiff_argnums!r}; expected distinct non-negative ints (positions "
            "of the non-differentiable arguments)."
        )
    return tuple(sorted(nums))


def _resolve_kwargs(fn, args, kwargs):
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"custom function {getattr(fn, '__name__', fn)!r} called with keyword arguments "
            f"{sorted(kwargs)}: they must match its signature ({e}). Expected the arguments "
            "of the function."
        ) from None
    bound.apply_defaults()
    if bound.kwargs:
        raise TypeError(
            f"custom function {getattr(fn, '__name__', fn)!r}: keyword-only arguments "
            f"{sorted(bound.kwargs)} are not supported (as in JAX); pass them positionally or "
            "through a closure."
        )
    return bound.args


def custom_vjp(fn=None, *, nondiff_argnums=()):
    """Give ``fn`` a hand-written reverse-mode rule (JAX's ``custom_vjp``).

    ``nondiff_argnums`` marks arguments that are not differentiated (Python values, functions,
    flags): ``bwd`` receives them first and returns cotangents for the other arguments only.
    Keyword arguments are resolved to positions by ``fn``'s signature.

    Example:
        >>> import torch, functransforms as ft
        >>> @ft.custom_vjp
        ... def clip_grad(x):
        ...     return x
        >>> _ = clip_grad.defvjp(lambda x: (x, None), lambda res, g: (g.clamp(-1, 1),))
        >>> ft.grad(lambda x: (clip_grad(x) * 10).sum())(torch.ones(2))
        tensor([1., 1.])
    """
    if fn is None:
        return functools.partial(custom_vjp, nondiff_argnums=nondiff_argnums)
    return _CustomFunction(fn, nondiff_argnums)


def custom_jvp(fn=None, *, nondiff_argnums=()):
    """Give ``fn`` a hand-written forward-mode rule (JAX's ``custom_jvp``); reverse mode
    transposes it.

    ``defjvp(rule)`` gives one rule for all arguments, ``defjvps(*rules)`` one per argument.
    ``nondiff_argnums`` marks arguments that are not differentiated: the rule receives them
    first, ``rule(*nondiff_args, primals, tangents)``. Keyword arguments are resolved to
    positions by ``fn``'s signature.

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
    if fn is None:
        return functools.partial(custom_jvp, nondiff_argnums=nondiff_argnums)
    return _CustomFunction(fn, nondiff_argnums)


def custom_vmap(fn):
    """Give ``fn`` a hand-written batching rule (JAX's ``jax.custom_batching.custom_vmap``).

    ``@f.def_vmap`` registers ``rule(axis_size, in_batched, *args) -> (out, out_batched)``:
    ``in_batched`` has one bool per argument (leaf), the batched ones carry the mapped dim in
    front; ``out_batched`` says, per output leaf, whether the output carries it. ``grad``/``jvp``
    differentiate ``fn`` itself.

    Example:
        >>> import torch, functransforms as ft
        >>> @ft.custom_vmap
        ... def row_sum(x):                               # [D] -> []
        ...     return x.sum()
        >>> @row_sum.def_vmap
        ... def rule(axis_size, in_batched, x):          # x: [B, D]
        ...     return x.sum(1), True
        >>> ft.vmap(row_sum)(torch.ones(4, 3))            # [B]
        tensor([3., 3., 3., 3.])
    """
    return _CustomFunction(fn)


def sequential_vmap(fn):
    """Under ``vmap``, run ``fn`` once per example and stack, silently (JAX's
    ``jax.custom_batching.sequential_vmap``): for functions with no batched form, where the
    per-example loop is the intended implementation rather than a fallback to warn about.

    Example:
        >>> import torch, functransforms as ft
        >>> f = ft.sequential_vmap(lambda x: x.sort().values)
        >>> ft.vmap(f)(torch.tensor([[3.0, 1.0], [0.0, 2.0]]))
        tensor([[1., 3.],
                [0., 2.]])
    """
    cf = _CustomFunction(fn)

    def loop(axis_size, in_batched, *args):
        flat, spec = pt.tree_flatten(args)
        results = []
        for i in range(axis_size):
            picked = [x[i] if b else x for x, b in zip(flat, in_batched)]
            results.append(fn(*pt.tree_unflatten(spec, picked)))
        flat_outs = [pt.tree_leaves(r) for r in results]
        out_spec = pt.tree_structure(results[0])
        stacked = [torch.stack([fo[j] for fo in flat_outs]) for j in range(len(flat_outs[0]))]
        return pt.tree_unflatten(out_spec, stacked), True

    cf.vmap_rule = loop
    return cf


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
    else:  # no derivative rule of its own (custom_vmap): differentiate fn itself
        return cf.fn(*args)

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
    node.name = getattr(cf.fn, "__name__", "CustomFunction")  # autograd.Function: the class name
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
                f"jvp of {cf.__name__}: it is a custom_vjp function, which defines only a "
                "reverse-mode rule. Expected: a jvp rule too. Do: `f.defjvp(jvp_rule)` (a "
                "function may have both)."
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
    if cf.vmap_rule is not None:
        return _user_vmap_rule(cf, interp, vals, dims, spec)
    in_dims = tuple(pt.tree_unflatten(spec, dims))
    fn, fwd, bwd, jvp_rule = cf.generic_vmap or (cf.fn, cf.fwd, cf.bwd, cf.jvp_rule)
    batched = _CustomFunction(vmap(fn, in_dims=in_dims, randomness=interp.randomness))
    if bwd is not None:
        batched.defvjp(
            vmap(fwd, in_dims=in_dims, randomness=interp.randomness),
            vmap(bwd, in_dims=(0, 0), randomness=interp.randomness),
        )
    if jvp_rule is not None:
        batched.defjvp(vmap(jvp_rule, in_dims=(in_dims, in_dims), randomness=interp.randomness))
    out = batched(*pt.tree_unflatten(spec, vals))
    return pt.tree_map(lambda o: wrap_batched(o, 0, interp), out)


def _user_vmap_rule(cf, interp, vals, dims, spec):
    """custom_vmap: the user's rule sees the batched arguments with the mapped dim in front."""
    from functransforms.batching._tensor import wrap_batched

    front = [v if d is None else v.movedim(d, 0) for v, d in zip(vals, dims)]
    in_batched = [d is not None for d in dims]
    out, out_batched = cf.vmap_rule(interp.batch_size, in_batched, *pt.tree_unflatten(spec, front))
    flat_out, out_spec = pt.tree_flatten(out)
    flags = (
        [out_batched] * len(flat_out)
        if isinstance(out_batched, bool)
        else pt.tree_leaves(out_batched)
    )
    if len(flags) != len(flat_out):
        raise ValueError(
            f"vmap rule of {cf.__name__}: returned out_batched={out_batched!r} for "
            f"{len(flat_out)} outputs; expected one bool per output leaf (or one bool for all)."
        )
    wrapped = []
    for o, b in zip(flat_out, flags):
        has_batch = isinstance(o, torch.Tensor) and o.dim() > 0 and o.shape[0] == interp.batch_size
        if b and not has_batch:
            got = tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__
            raise ValueError(
                f"vmap rule of {cf.__name__}: an output marked batched has shape {got}; expected "
                f"the mapped dim of size {interp.batch_size} in front."
            )
        wrapped.append(wrap_batched(o, 0, interp) if b else o)
    return pt.tree_unflatten(out_spec, wrapped)


_PROCESS = {"grad": _process_grad, "jvp": _process_jvp, "vmap": _process_vmap}


def stop_gradient(x):
    """Treat ``x`` as a constant for every transform (JAX's ``lax.stop_gradient``).

    Example:
        >>> import torch, functransforms as ft
        >>> ft.grad(lambda x: (x * ft.stop_gradient(x)).sum())(torch.tensor([3.0]))
        tensor([3.])
    """
    return pt.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, x)
