"""Numerical checks of our transforms, in the spirit of ``jax.test_util.check_grads``.

Note [Complex dot-product test]
    jvp is R-linear in the tangent, so for complex inputs a random complex direction perturbs
    the real and imaginary parts at once, and central differences along it give ``J t``. With
    the real inner product ``<u, v> = Re sum(conj(u) * v)``, PyTorch's vjp (``w -> w . conj(J)``
    for holomorphic maps; docs/complex.md) is exactly the adjoint of that R-linear map, so the
    dot-product test reads ``<c, J t> == <vjp(c), t>`` for real and complex values alike.
"""

from __future__ import annotations

import torch

from .. import _pytree as pt

_MODES = ("fwd", "rev")


def _is_diff(x) -> bool:
    return isinstance(x, torch.Tensor) and (x.dtype.is_floating_point or x.dtype.is_complex)


def _name(f):
    return getattr(f, "__name__", type(f).__name__)


def _rand_like(x, gen):
    if not _is_diff(x):
        return x
    if x.dtype.is_complex:
        real = torch.randn(x.shape, generator=gen, dtype=x.real.dtype)
        imag = torch.randn(x.shape, generator=gen, dtype=x.real.dtype)
        return torch.complex(real, imag).to(x.device)
    return torch.randn(x.shape, generator=gen, dtype=x.dtype).to(x.device)


def _inner(us, vs) -> torch.Tensor:
    """Real inner product sum Re(conj(u) * v) over lists (Note [Complex dot-product test])."""
    total = torch.zeros((), dtype=torch.float64)
    for u, v in zip(us, vs):
        if u is None or v is None or not _is_diff(u) or not _is_diff(v):
            continue
        p = torch.conj(u.to(torch.complex128)) * v.to(torch.complex128)
        total = total + p.real.sum().cpu()
    return total


def _numerical_jvp(f, args, tangents, eps):
    def shifted(sign):
        moved = [a + sign * eps * t if _is_diff(a) else a for a, t in zip(args, tangents)]
        return pt.tree_leaves(f(*moved))

    plus, minus = shifted(1.0), shifted(-1.0)
    return [
        (p - m) / (2 * eps) if _is_diff(p) else torch.zeros_like(p) for p, m in zip(plus, minus)
    ]


def _assert_close(ours, ref, atol, rtol, what):
    for i, (a, b) in enumerate(zip(ours, ref)):
        if not torch.allclose(a, b.to(a.dtype), atol=atol, rtol=rtol):
            err = (a - b.to(a.dtype)).abs().max().item()
            raise AssertionError(
                f"{what}: output {i} differs (max abs error {err:.3g}, atol={atol}, rtol={rtol}).\n"
                f"ours:      {a}\nreference: {b}"
            )


def _check_jvp(f, args, gen, eps, atol, rtol):
    from .. import jvp

    tangents = [_rand_like(a, gen) if _is_diff(a) else torch.zeros(()) for a in args]
    diff = [i for i, a in enumerate(args) if _is_diff(a)]

    def g(*d):
        full = list(args)
        for i, x in zip(diff, d):
            full[i] = x
        return f(*full)

    out, tout = jvp(g, tuple(args[i] for i in diff), tuple(tangents[i] for i in diff))
    num = _numerical_jvp(f, args, tangents, eps)
    _assert_close(
        [t for t in pt.tree_leaves(tout)],
        num,
        atol,
        rtol,
        f"check_grads({_name(f)}): jvp disagrees with central finite differences (eps={eps})",
    )
    return tangents


def _check_vjp(f, args, gen, eps, atol, rtol, use_fwd):
    from .. import jvp, vjp

    diff = [i for i, a in enumerate(args) if _is_diff(a)]

    def g(*d):  # non-floating inputs are constants, not differentiated inputs
        full = list(args)
        for i, x in zip(diff, d):
            full[i] = x
        return f(*full)

    out, vjp_fn = vjp(g, *(args[i] for i in diff))
    flat_out, spec = pt.tree_flatten(out)
    cts = [_rand_like(o, gen) if _is_diff(o) else torch.zeros_like(o) for o in flat_out]
    ct_in = vjp_fn(pt.tree_unflatten(spec, cts))
    tangents = [_rand_like(a, gen) if _is_diff(a) else None for a in args]
    if use_fwd:
        jt = pt.tree_leaves(
            jvp(g, tuple(args[i] for i in diff), tuple(tangents[i] for i in diff))[1]
        )
    else:
        jt = _numerical_jvp(f, args, [t if t is not None else 0 for t in tangents], eps)
    lhs = _inner(cts, jt)
    rhs = _inner(list(ct_in), [tangents[i] for i in diff])
    scale = max(lhs.abs().item(), rhs.abs().item(), 1.0)
    source = "our jvp" if use_fwd else "finite differences"
    if not abs(lhs.item() - rhs.item()) <= atol + rtol * scale:
        raise AssertionError(
            f"check_grads({_name(f)}): vjp fails the dot-product test <c, J t> = <J^T c, t>: "
            f"<c, J t> = {lhs.item():.10g} (J t from {source}) "
            f"but <vjp(c), t> = {rhs.item():.10g} (difference {abs(lhs.item() - rhs.item()):.3g}, "
            f"atol={atol}, rtol={rtol})."
        )
    return cts


def check_grads(f, args, order=1, modes=("fwd", "rev"), eps=1e-6, atol=1e-5, rtol=1e-4, *, seed=0):
    """Check our derivatives of ``f`` at ``args`` against finite differences, to ``order``.

    ``fwd``: ``jvp`` along a random direction equals central differences. ``rev``: ``vjp``
    passes the dot-product test against the jvp (Note [Complex dot-product test]). For
    ``order > 1`` the same checks run on the jvp / vjp functions themselves, as in
    ``jax.test_util.check_grads``.

    Args:
        f: a function of tensors (positional) returning a tensor or a pytree of tensors.
        args: a tuple of inputs; non-floating inputs are held constant.
        order: how many levels of derivatives to check.
        modes: a subset of ``('fwd', 'rev')``.
        eps: the finite-difference step; use float64 inputs.
        atol, rtol: tolerances.
        seed: seed of the random directions.

    Raises:
        AssertionError: naming the mode and showing the mismatch.

    Example:
        >>> import torch
        >>> from functransforms.testing import check_grads
        >>> check_grads(torch.sin, (torch.randn(3, dtype=torch.float64),), order=2)
    """
    if isinstance(modes, str):
        modes = (modes,)
    bad = [m for m in modes if m not in _MODES]
    if bad or not modes:
        raise ValueError(
            f"check_grads(f, args, modes={modes!r}): expected a non-empty subset of {_MODES}."
        )
    if not isinstance(order, int) or order < 1:
        raise ValueError(f"check_grads(f, args, order={order!r}): expected a positive int.")
    if not isinstance(args, (tuple, list)):
        args = (args,)
    gen = torch.Generator().manual_seed(seed)
    _check(f, list(args), order, tuple(modes), eps, atol, rtol, gen)


def _check(f, args, order, modes, eps, atol, rtol, gen):
    from .. import jvp, vjp

    n = len(args)
    diff = [i for i, a in enumerate(args) if _is_diff(a)]
    if "fwd" in modes:
        tangents = _check_jvp(f, args, gen, eps, atol, rtol)
        if order > 1:

            def f_jvp(*xs):
                prim, tans = list(xs[:n]), xs[n:]

                def g(*d):
                    full = list(prim)
                    for i, x in zip(diff, d):
                        full[i] = x
                    return f(*full)

                return jvp(g, tuple(prim[i] for i in diff), tuple(tans))[1]

            f_jvp.__name__ = f"jvp({_name(f)})"
            _check(
                f_jvp, args + [tangents[i] for i in diff], order - 1, modes, eps, atol, rtol, gen
            )
    if "rev" in modes:
        cts = _check_vjp(f, args, gen, eps, atol, rtol, "fwd" in modes)
        if order > 1:
            spec = pt.tree_structure(f(*args))

            def f_vjp(*xs):
                prim = list(xs[:n])

                def g(*d):  # non-floating inputs are constants, not differentiated inputs
                    full = list(prim)
                    for i, x in zip(diff, d):
                        full[i] = x
                    return f(*full)

                _, fn = vjp(g, *(prim[i] for i in diff))
                return fn(pt.tree_unflatten(spec, list(xs[n:])))

            f_vjp.__name__ = f"vjp({_name(f)})"
            _check(f_vjp, args + cts, order - 1, modes, eps, atol, rtol, gen)


def check_vmap(f, args, in_dims=0, out_dims=0, *, atol=1e-6, rtol=1e-5, randomness="error"):
    """Check ``vmap(f, in_dims, out_dims)(*args)`` against a Python loop over the examples.

    Args:
        f: a function of the positional ``args``.
        args: a tuple of inputs (pytrees of tensors). A nested tensor mapped at in_dim 0 gives
            one example per component, and a nested output is compared component by component.
        in_dims, out_dims: as for :func:`functransforms.vmap` (None, negative dims, prefixes).

    Raises:
        AssertionError: naming the output that differs.

    Example:
        >>> import torch
        >>> from functransforms.testing import check_vmap
        >>> check_vmap(torch.dot, (torch.randn(4, 3), torch.randn(3)), in_dims=(0, None))
    """
    from .._vmap import broadcast_prefix, vmap

    if not isinstance(args, (tuple, list)):
        args = (args,)
    args = tuple(args)
    flat_args, spec = pt.tree_flatten(args)
    call = f"check_vmap({_name(f)}, in_dims={in_dims!r}, out_dims={out_dims!r})"
    flat_dims = (
        [in_dims] * len(flat_args)
        if in_dims is None or isinstance(in_dims, int)
        else broadcast_prefix(in_dims, args, "in_dims", call)
    )
    sizes = {x.size(d) for x, d in zip(flat_args, flat_dims) if d is not None}
    if len(sizes) != 1:
        raise ValueError(
            f"{call}: expected the mapped inputs to share one batch size; got {sorted(sizes)}."
        )
    (batch,) = sizes
    ours = vmap(f, in_dims, out_dims, randomness=randomness)(*args)
    # a nested input maps over its components (Note [Nested tensors under vmap])
    parts = [
        x.unbind() if d is not None and x.is_nested else None for x, d in zip(flat_args, flat_dims)
    ]
    per_example = []
    for i in range(batch):
        xs = [
            x if d is None else x.select(d, i) if p is None else p[i]
            for x, d, p in zip(flat_args, flat_dims, parts)
        ]
        per_example.append(f(*pt.tree_unflatten(spec, xs)))
    flat_ours, out_spec = pt.tree_flatten(ours)
    flat_ods = (
        [out_dims] * len(flat_ours)
        if out_dims is None or isinstance(out_dims, int)
        else broadcast_prefix(out_dims, per_example[0], "out_dims", call)
    )
    loops = [pt.tree_leaves(p) for p in per_example]
    for j, (o, od) in enumerate(zip(flat_ours, flat_ods)):
        if o.is_nested:  # one component per example: compared one by one
            for i, (oc, lp) in enumerate(zip(o.unbind(), loops)):
                _assert_example(oc, lp[j], atol, rtol, f"{call}: output {j}, example {i}")
            continue
        if od is None:
            ref = loops[0][j]
        else:
            ref = torch.stack([lp[j] for lp in loops], 0)
            ref = ref.movedim(0, od % ref.dim())
        if o.shape != ref.shape:
            raise AssertionError(
                f"{call}: output {j} (flattened) has shape {tuple(o.shape)} under vmap but the "
                f"stacked loop gives {tuple(ref.shape)}."
            )
        if not torch.allclose(o, ref, atol=atol, rtol=rtol, equal_nan=True):
            err = (o - ref).abs().max().item()
            raise AssertionError(
                f"{call}: output {j} (flattened) differs from the stacked loop (max abs error "
                f"{err:.3g}).\nvmap: {o}\nloop: {ref}"
            )


def _assert_example(o, ref, atol, rtol, what):
    if o.shape != ref.shape or not torch.allclose(o, ref, atol=atol, rtol=rtol, equal_nan=True):
        raise AssertionError(f"{what} differs from the loop.\nvmap: {o}\nloop: {ref}")
