"""custom_vjp / custom_jvp / stop_gradient (JAX's extras).

Note [Custom rules across levels]
    A custom function is a single "op" to the transforms, and it takes the ops' route: called
    with wrappers, it goes to the innermost interpreter among its arguments, whose
    ``process_custom`` (beside ``process``, as JAX's ``process_custom_jvp_call`` beside
    ``process_primitive``) unwraps that level like any op: a grad level (autodiff/reverse.py)
    records one tape node whose vjp is the user's ``bwd``; a jvp level (autodiff/forward.py)
    calls the user's jvp rule; a vmap level (batching/_tensor.py) calls the user's vmap rule, or
    a custom function whose ``fn``, ``fwd``, ``bwd`` and jvp rule are themselves vmapped, so the
    custom rule stays visible to every enclosing level. Forward mode of a vjp-only function
    raises (as JAX); reverse mode of a jvp-only function transposes the (linear) jvp rule.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from . import _pytree as pt
from ._core.levels import innermost

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

    @staticmethod
    def materialize_grads(residuals):
        """Whether ``bwd`` gets zeros (not None) for outputs without a cotangent: always, as
        JAX; an autograd.Function says otherwise with ``ctx.set_materialize_grads(False)``."""
        return True

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
        interp = innermost(pt.tree_leaves(args))
        if interp is None:
            return self.fn(*args)
        return interp.process_custom(self, args)  # Note [Custom rules across levels]

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


# Note [Values a custom function closes over under vmap]
#     Under vmap, a custom function runs as vmapped pieces (``vmap(fn)``, ``vmap(fwd)``, ...) on
#     this level's unwrapped values, and the level is dead meanwhile (Note [Random draws in custom
#     functions under vmap], batching/_tensor.py). A tensor of this level that ``fn`` closes over
#     (a closure, a global, an attribute: not an argument) then raised EscapedTracerError, where
#     functorch computes it (autograd.Function with generate_vmap_rule=True). JAX asks for
#     ``closure_convert``; here the conversion happens at dispatch: while the pieces run, the dead
#     level has a stand-in, and an op reaching one of its wrappers re-wraps the physical value
#     (same batch dim) as a value of the piece's own vmap level, which maps the same examples in
#     the same order: the closed-over tensor becomes one more mapped input. Outside the pieces
#     (the level exited: a bwd run later by an enclosing grad's sweep) the wrapper escaped, and
#     the error says to pass the tensor as an argument.
class ClosedOverStandIn:
    """Stands in for a vmap level whose custom-function pieces are running (see the Note)."""

    def __init__(self, dead):
        from ._core.levels import interpreter_stack

        self.dead = dead  # the replaced VmapInterpreter
        self.depth = len(interpreter_stack())  # its pieces' levels are pushed above this

    def _replacement(self):
        from ._core.levels import interpreter_stack
        from .errors import EscapedTracerError

        for interp in interpreter_stack()[self.depth :]:
            if getattr(interp, "batch_size", None) == self.dead.batch_size and hasattr(
                interp, "randomness"
            ):
                return interp
        raise EscapedTracerError(  # no vmapped piece is running: used outside them
            f"A vmap wrapper tensor (level {self.dead.level}) closed over by a custom function "
            "was used outside the function's vmapped pieces. Pass the tensor to the custom "
            "function as an argument instead of closing over it."
        )

    def _rewrap(self, x, to):
        from functransforms.batching._tensor import wrap_batched

        if isinstance(x, torch.Tensor) and getattr(x, "_interp", None) is self.dead:
            return wrap_batched(x._value, x._bdim, to)
        if type(x) is list or type(x) is tuple:
            return type(x)(self._rewrap(b, to) for b in x)
        return x

    def process(self, func, args, kwargs):
        to = self._replacement()
        self.dead.closed_over = True  # for the error if it is used again after the vmap returns
        args = self._rewrap(args, to)
        kwargs = {k: self._rewrap(v, to) for k, v in kwargs.items()} if kwargs else {}
        return func(*args, **kwargs)

    def process_custom(self, custom_fn, args):
        to = self._replacement()
        self.dead.closed_over = True
        return custom_fn(*pt.tree_map(lambda x: self._rewrap(x, to), args))


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


def custom_vjp(
    fn: Callable[..., Any] | None = None, *, nondiff_argnums: int | tuple[int, ...] = ()
) -> Callable[..., Any]:
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


def custom_jvp(
    fn: Callable[..., Any] | None = None, *, nondiff_argnums: int | tuple[int, ...] = ()
) -> Callable[..., Any]:
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


def custom_vmap(fn: Callable[..., Any]) -> Callable[..., Any]:
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


def sequential_vmap(fn: Callable[..., Any]) -> Callable[..., Any]:
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


def stop_gradient(x: Any) -> Any:
    """Treat ``x`` as a constant for every transform (JAX's ``lax.stop_gradient``).

    Example:
        >>> import torch, functransforms as ft
        >>> ft.grad(lambda x: (x * ft.stop_gradient(x)).sum())(torch.tensor([3.0]))
        tensor([3.])
    """
    return pt.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, x)
