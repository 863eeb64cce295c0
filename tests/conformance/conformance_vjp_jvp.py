"""vjp(jvp), reverse over forward (jacrev(jacfwd)), in the conformance suite.

Note [vjp(jvp) against finite differences]
    ``g(*primals, *tangents) = jvp(f, primals, tangents)`` returns (outputs, output tangents);
    its vjp with random cotangents ``(c_out, c_tan)`` gives the primals' cotangent
    ``J^T c_out + d/dx <c_tan, J(x) t>`` (the second-order part) and the tangents' cotangent
    ``J^T c_tan``. Samples and dtypes are jvp's (float64 / complex128, ops with
    ``supports_forward_ad``, samples 0 and 1), compared with torch.func's same composition.

    torch.func is not a reliable oracle here: its reverse pass through forward-mode formulas
    is wrong on several ops (``TORCH_FUNC_WRONG``). Where the two disagree, the harness
    decides with finite differences, with nothing trusted but first-order derivatives that
    are themselves checked: in random directions ``(u, w)`` of (primals, tangents) the claimed
    cotangents ``(g_x, g_t)`` must satisfy

        Re<g_x, u> + Re<g_t, w>
            = Re<c_out, D_u f(x)> + Re<c_tan, D_u [J(x) t]> + Re<c_tan, D_w f(x)>

    where ``D_u`` is a central difference along ``u`` in float64, Richardson-extrapolated
    (steps h/2^k, error O(h^4)) and accepted once two extrapolations agree to FD_RTOL (h from
    1e-3 down to 1e-5 of the primals' scale: ill-conditioned solves need the small ones);
    ``J(x) t`` is our first-order jvp, trusted only after it matches the difference of ``f``
    along ``t`` at ``x`` (which also decides disagreeing output tangents). An element whose
    two sides are equal (a constant ``-inf``) differences to 0, not NaN. Ops whose derivative
    is defined for structured perturbations only take such tangents and directions
    (``DIRECTIONS``: eigh's are Hermitian). Where no step converges, f is not differentiable
    at x (linalg.norm at 0): the second-order term is taken instead by the symmetry of second
    derivatives from functorch's jvp(vjp), Re<c_tan, D_u [J t]> = Re<D_u [J^T c_tan], t>,
    the convention the jvp(vjp) test already compares ours with.

    * op listed in ``TORCH_FUNC_WRONG`` and ours differs from torch.func: ours must satisfy
      the identity (else ``wrong value``); the sample counts as compared ("torch.func.vjp(jvp)
      wrong (ours equals finite differences)" in docs/conformance.md), never skipped.
    * op not listed: a disagreement is ``wrong value``; the detail gives both sides' values
      and the differences', so an oracle error is visible and goes into the table.
"""

from __future__ import annotations

import torch
from conformance_harness import (
    Result,
    _randn_like,
    _short,
    classify_exception,
    compare,
)

# (op full name, kind) -> what torch.func gets wrong in vjp(jvp); ours is checked against
# finite differences on every sample where the two differ (Note [vjp(jvp) against finite
# differences]). The values of one run are in docs/design/testing.md ("vjp(jvp) in the conformance
# suite").
_NORM = "batch statistics' reverse-over-forward formula (torch 2.13 and 2.15)"
_DET = "1x1 matrices (torch 2.13; right on 2.15)"
_SOLVE = "the reverse pass of the solve's forward formula (torch 2.13; right on 2.15)"
TORCH_FUNC_WRONG: dict[tuple[str, str], str] = {
    ("_batch_norm_with_update", "real"): _NORM,
    ("_native_batch_norm_legit", "real"): _NORM,
    ("native_batch_norm", "real"): _NORM,
    ("nn.functional.batch_norm", "real"): _NORM,
    ("nn.functional.instance_norm", "real"): _NORM,
    ("nn.functional.layer_norm", "real"): _NORM,
    ("linalg.det", "real"): _DET,
    ("linalg.det", "complex"): _DET,
    ("logdet", "real"): _DET,
    ("logdet", "complex"): _DET,
    ("linalg.slogdet", "real"): _DET,
    ("linalg.slogdet", "complex"): _DET,
    ("linalg.solve", "real"): _SOLVE,
    ("linalg.solve", "complex"): _SOLVE,
    ("linalg.solve_ex", "real"): _SOLVE,
    ("linalg.solve_ex", "complex"): _SOLVE,
    ("linalg.tensorsolve", "real"): _SOLVE,
    ("linalg.tensorsolve", "complex"): _SOLVE,
    ("linalg.householder_product", "real"): "torch 2.13 and 2.15",
    ("linalg.householder_product", "complex"): "torch 2.13 and 2.15",
    ("linalg.eigh", "real"): "nan (torch 2.13 and 2.15); ours in Hermitian directions",
    ("linalg.norm.subgradients_at_zero", "real"): (
        "nan at 0 (torch 2.13 and 2.15); ours is 0, the transpose of functorch's jvp(vjp) "
        "(no finite-difference limit at a kink)"
    ),
    ("linalg.norm.subgradients_at_zero", "complex"): (
        "nan at 0 (torch 2.13 and 2.15); as the real case"
    ),
    ("masked.logaddexp", "real"): "nan where both masks are off (torch 2.13 and 2.15)",
    ("torch.ops.aten._safe_softmax.default", "real"): (
        "nan in rows with -inf inputs (torch 2.13 and 2.15)"
    ),
}


def _hermitian(x):
    return (x + x.mT.conj()) / 2


# Ops whose derivative is defined for structured perturbations only: eigh reads one triangle
# but its derivative (functorch's and ours) is that of the Hermitian matrix, so its tangents
# and difference directions are Hermitian (a direction in the other triangle is not one the
# derivative describes: the differences of f along it differ from every jvp).
DIRECTIONS = {"linalg.eigh": [_hermitian]}


FD_STEPS = (1e-3, 1e-4, 1e-5)  # relative to the primals' scale, tried until one converges
FD_RTOL = 1e-5  # the identity is one scalar: a wrong cotangent misses it by O(1)


def _inner(u, v):
    """Re sum(conj(u) v) over two lists of tensors (NaN propagates)."""
    return sum(float((a.conj() * b).real.sum()) for a, b in zip(u, v))


def _scale(xs):
    finite = [x[x.isfinite()].abs() for x in xs]
    return max([float(x.max()) for x in finite if x.numel()] + [1.0])


def _central(fn, xs, us, s):
    """(fn(x + s u) - fn(x - s u)) / 2s elementwise over fn's list of tensors; 0 where the two
    sides are equal (a constant infinity: NaN otherwise)."""
    plus = fn([x + s * u for x, u in zip(xs, us)])
    minus = fn([x - s * u for x, u in zip(xs, us)])
    return [torch.where(p == m, 0.0, p - m) / (2 * s) for p, m in zip(plus, minus)]


def _converged(estimate, scale):
    """``estimate(s)``'s limit as s -> 0: for the first step h of FD_STEPS where the two
    Richardson extrapolations (4 D(h/2) - D(h)) / 3 and (4 D(h/4) - D(h/2)) / 3 (error
    O(h^4)) agree to FD_RTOL, the finer one; else None: f is not differentiable there (a
    kink), or too ill-conditioned to tell."""
    for step in FD_STEPS:
        c, m, fine = (estimate(step * scale * 2.0**-k) for k in range(3))
        r1, r2 = (4 * m - c) / 3, (4 * fine - m) / 3
        if abs(r1 - r2) <= FD_RTOL * (1 + abs(r2)):
            return r2
    return None


def _close(a, b):
    return abs(a - b) <= 10 * FD_RTOL * (1 + abs(b))  # NaN: not close


def _symmetric_side(ref_f, primals, tangents, cts, us, ws):
    """The identity's right side with the second-order term by the symmetry of second
    derivatives, Re<c_tan, D_u [J(x) t]> = Re<D_u [J(x)^T c_tan], t>, from functorch's
    forward over reverse (jvp(vjp), which the jvp(vjp) test compares with ours)."""
    n = len(primals)
    c_out, c_tan = cts

    def pullback(*a):
        return torch.func.vjp(ref_f, *a[:n])[1](tuple(a[n:]))

    zero = tuple(torch.zeros_like(c) for c in c_tan)
    d_pullback = torch.func.jvp(pullback, (*primals, *c_tan), (*us, *zero))[1]
    ju = torch.func.jvp(ref_f, tuple(primals), tuple(us))[1]
    jw = torch.func.jvp(ref_f, tuple(primals), tuple(ws))[1]
    return _inner(c_out, ju) + _inner(d_pullback, tangents) + _inner(c_tan, jw)


def fd_verdict(fs, primals, tangents, cts, claims, gen, shape, vary_tangents=True):
    """Note [vjp(jvp) against finite differences]: (how, the identity's right side, the left
    side of each claim in ``claims`` (cotangents, output tangents), each claim's verdict: both
    parts agree with the differences), or a str saying why there is none.

    ``vary_tangents=False``: the directions ``w`` of the tangents are zero, so the identity
    checks the primals' cotangents alone (torch autograd over our vjp, where ``t`` is the
    outer cotangent of the pullback and the output tangent is the cotangent's own, J t:
    Note [Conformance of torch autograd over our transforms], conformance_autograd.py)."""
    import functransforms as ft

    f, ref_f = fs
    n = len(primals)
    c_out, c_tan = cts
    scale = _scale(primals)

    def outputs(xs):
        return list(f(*xs))

    def jvp_at(xs):
        return list(ft.jvp(f, tuple(xs), tuple(tangents))[1])

    # the first-order jvp we differentiate is trusted only once it matches differences of f
    # along t (in a random direction of the outputs, to FD_RTOL)
    probe = [_randn_like(o, gen) for o in c_tan]
    along_t = _converged(lambda s: _inner(probe, _central(outputs, primals, tangents, s)), scale)
    if along_t is None or not _close(_inner(probe, jvp_at(primals)), along_t):
        return f"our jvp is not the finite difference of f along t ({along_t})"
    us = [p(_randn_like(x, gen)) for p, x in zip(shape, primals)]
    ws = [p(_randn_like(t, gen)) for p, t in zip(shape, tangents)]
    if not vary_tangents:
        ws = [torch.zeros_like(w) for w in ws]

    def rhs_at(s):
        return (
            _inner(c_out, _central(outputs, primals, us, s))
            + _inner(c_tan, _central(jvp_at, primals, us, s))
            + _inner(c_tan, _central(outputs, primals, ws, s))
        )

    rhs, how = _converged(rhs_at, scale), "finite differences"
    if rhs is None:  # not differentiable at x: the convention of functorch's jvp(vjp)
        rhs = _symmetric_side(ref_f, primals, tangents, cts, us, ws)
        how = "no finite-difference limit; symmetry with functorch's jvp(vjp)"
    lhs = [_inner(c[:n], us) + _inner(c[n:], ws) for c, _ in claims]
    first_order = [_close(_inner(probe, t), along_t) for _, t in claims]
    return how, rhs, lhs, [_close(x, rhs) and ok for x, ok in zip(lhs, first_order)]


def run_vjp_jvp(fs, key, primals, out0, gen, result: Result, what):
    """vjp of ``g = jvp(f, ...)`` on one sample, against torch.func and, where they differ,
    finite differences (Note [vjp(jvp) against finite differences])."""
    import functransforms as ft

    f, ref_f = fs  # ours differentiate f, the oracle ref_f (Note [Conformance references])
    n = len(primals)
    shape = [*DIRECTIONS.get(key[0], []), *[lambda d: d] * n][:n]
    tangents = [p(_randn_like(x, gen)) for p, x in zip(shape, primals)]
    cts = ([_randn_like(o, gen) for o in out0], [_randn_like(o, gen) for o in out0])

    def args():
        return tuple(x.clone() for x in (*primals, *tangents))

    def composed(jvp, fn):
        def g(*a):
            return jvp(fn, a[:n], a[n:])

        return g

    cotangents = (tuple(cts[0]), tuple(cts[1]))
    try:
        ref_out, ref_fn = torch.func.vjp(composed(torch.func.jvp, ref_f), *args())
        ref = (ref_out, ref_fn(cotangents))
    except Exception:
        result.skip_sample("torch.func.vjp(jvp) raises")
        return
    try:
        out, fn = ft.vjp(composed(ft.jvp, f), *args())
        ours = (out, fn(cotangents))
    except Exception as e:
        result.fail(classify_exception(e), f"{what}: {_short(e)}")
        return
    bad = compare(ours[0][0], ref[0][0], f"{what}: vjp(jvp) outputs")
    if bad:
        result.fail(*bad)
        return
    bad = compare(ours[0][1], ref[0][1], f"{what}: vjp(jvp) output tangents") or compare(
        tuple(ours[1]), tuple(ref[1]), f"{what}: vjp(jvp) cotangents"
    )
    if bad is None:
        result.compared += 1
        return
    if bad[0] != "wrong value":
        result.fail(*bad)
        return
    claims = [(tuple(x[1]), x[0][1]) for x in (ours, ref)]  # (cotangents, output tangents)
    try:
        verdict = fd_verdict(fs, primals, tangents, cts, claims, gen, shape)
    except Exception as e:
        verdict = f"the finite differences raised {_short(e)}"
    if isinstance(verdict, str):
        result.fail("wrong value", f"{bad[1]}; no finite-difference verdict: {verdict}")
        return
    how, rhs, (l_ours, l_ref), (ours_ok, ref_ok) = verdict
    evidence = f"{how} {rhs:.6g}, ours {l_ours:.6g}, torch.func {l_ref:.6g}"
    if key in TORCH_FUNC_WRONG and ours_ok:
        result.compared += 1
        result.skip_sample("torch.func.vjp(jvp) wrong (ours equals finite differences)")
        return
    if ours_ok and not ref_ok:
        hint = "torch.func is wrong here: list the op in TORCH_FUNC_WRONG"
    elif ours_ok:
        hint = "both within the finite differences' tolerance"
    else:
        hint = "ours is wrong"
    result.fail("wrong value", f"{bad[1]}; {evidence}: {hint}")
