"""Extreme eigenpairs of symmetric operators: LOBPCG, and exact implicit derivatives of any
eigenpairs found matrix-free (`eigsh` by Lanczos or LOBPCG).

# Note [Implicit derivatives of eigenpairs]
Differentiating the steps of Lanczos or LOBPCG gives the derivative of the approximation,
which with fewer steps than n is not the derivative of the eigenpair (Note [Differentiating
Lanczos approximations]). An eigenpair has its own derivative, found from the pair alone plus
solves: for a simple eigenvalue ``λ`` of a Hermitian ``A`` with unit eigenvector ``v``,

    dλ = v^H dA v,        dv = -(A - λ I)^+ (I - v v^H) dA v,

the pseudo-inverse taken on the complement of ``v`` (the derivative ``torch.linalg.eigh``
has for each column: no component along ``v``). With the pairs found on constants (``λc``,
``Vc``: no graph through the iterations) we rebuild them, as ordinary torch code in A's
tensors, by two Newton steps on the eigenvector equation ``r(A, v) = A v - v (v^H A v) /
(v^H v) = 0`` with a frozen inverse:

    V1 = Vc - P(r(A, Vc)),    V2 = V1 - P(r(A, V1)),    v = V2 / |V2|,    λ = v^H A v

``P`` (`EigenCorrection`) is a ``torch.autograd.Function`` whose value is zero and whose
rules apply the pseudo-inverse ``(Ac - λc I)^+`` of the constant operator, column by column:
along the other eigenvectors found, ``Σ_{j≠i} v_j v_j^H / (λ_j - λ_i)`` in closed form; on the
complement of all of them, MINRES on ``Q (Ac - λ_i I) Q`` (``Q = I - V V^H``), symmetric and
indefinite. Each rule's result is again ``P(R0) + P(R)`` (a constant MINRES value plus a
correction), so rules are differentiable in their input. The values are the pairs found
(``λ`` returned as ``λc`` plus the derivative-carrying ``v^H A v - (v^H A v)_const``). As with
structured solves (Note [Second-order exactness of the implicit solve], linalg/_implicit.py),
each frozen Newton step gains one order: the first derivatives of eigenvalues and eigenvectors
and their second derivatives are exact (to MINRES's tolerance); a third derivative reaches a
rule of order three, which raises NotImplementedError rather than return a wrong number. Like
``torch.linalg.eigh``, the derivative is undefined at a repeated eigenvalue among the pairs
found (a division by zero: inf/nan), and for complex A only phase-invariant functions of the
eigenvectors have one.

Because ``P`` is an autograd.Function with ``jvp``, ``setup_context`` and
``generate_vmap_rule``, torch's autograd, forward AD and transforms use it as ours do (Note
[autograd.Function under transforms]). MINRES runs to 1/100 of `eigsh`'s ``tol``; one that does
not converge warns (`SolverInfo` method ``"eigsh-derivative"``).

# Note [LOBPCG]
Knyazev's locally optimal block preconditioned conjugate gradient for the k extreme eigenpairs:
each iteration does Rayleigh-Ritz on ``span[X, W, P]`` (``X`` the current block, ``W =
M^{-1}(A X - X Θ)`` the preconditioned residuals, ``P`` the previous search directions), the
basis orthonormalized by two passes of classical Gram-Schmidt with a QR of each block (the
"ortho" variant: what keeps the small Gram matrix well conditioned). Needs products with A only,
converges for ``k`` pairs together, and uses a symmetric positive definite preconditioner when
given (for "SA"), where Lanczos cannot. Runs on constants; derivatives as above.
"""

from __future__ import annotations

import torch

from functransforms import _compat
from functransforms._pytree import tree_flatten, tree_unflatten

from ._base import LinearOperator
from ._implicit import _constant, _tensors, differentiable
from ._iterative import SolverInfo, _apply, _preconditioner, _readable_float, _record
from ._krylov import minres

_MAX_ORDER = 2  # the derivative order exact (Note [Implicit derivatives of eigenpairs])


def default_start(shape, generator, dtype, device):
    """`eigsh`'s start vectors when none is given. With a ``generator``: a Gaussian draw (a
    random op like any other: inside a vmap, its ``randomness`` decides). Without: a fixed
    pseudo-random vector, ``frac(43758.5453 sin(12.9898 (i + 1))) - 1/2`` over the flat
    index i, made by ordinary ops, no draw, so the call works inside any vmap (torch's own
    too) and traces to a constant; generic enough that no eigenvector is orthogonal to it."""
    if generator is not None:
        return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype).to(device)
    n = 1
    for s in shape:
        n *= s
    with _compat.disable_current_modes():
        i = torch.arange(1, n + 1, dtype=torch.float64)
        u = torch.frac(torch.sin(i * 12.9898).abs() * 43758.5453) - 0.5
        return u.reshape(shape).to(dtype).to(device)


def _deflated_pinv(A, vals, V, R, tol):
    """``(A - λ_i I)^+ r_i`` for each column ``i`` (the pseudo-inverse on the complement of
    ``v_i``): closed form along the other columns of ``V``, MINRES on the complement of all."""
    C = V.mH @ R  # (..., k, k): C[j, i] = v_j^H r_i
    gap = vals.unsqueeze(-1) - vals.unsqueeze(-2)  # [j, i] = λ_j - λ_i
    eye = torch.eye(gap.shape[-1], dtype=torch.bool, device=gap.device)
    known = V @ torch.where(eye, 0, C / torch.where(eye, 1, gap).to(C.dtype))
    Rp = R - V @ C
    shift = vals.unsqueeze(-2).to(R.dtype)

    def op(X):  # Q (A - λ_i I) Q on the complement, the identity on span V: symmetric
        inside = V @ (V.mH @ X)
        Xp = X - inside
        Y = _apply(A, Xp) - Xp * shift
        return Y - V @ (V.mH @ Y) + inside

    X, info = minres(op, Rp, tol=tol, maxiter=4 * R.shape[-2] + 20)
    _record(SolverInfo("eigsh-derivative", info.iterations, info.residual, info.converged, tol))
    return known + (X - V @ (V.mH @ X))


class EigenCorrection(torch.autograd.Function):
    """``P(R)`` of Note [Implicit derivatives of eigenpairs]: the value zero, derivatives the
    pseudo-inverses ``(A - λ_i I)^+`` of the constant operator, column by column. ``order``: 2
    x (the derivative order its rules serve) + (which correction, 0 or 1)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(R, spec, order, tol, vals, V, *leaves):
        return torch.zeros_like(R)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.spec, ctx.order, ctx.tol, vals, V, *leaves = inputs
        ctx.save_for_backward(vals, V, *leaves)
        ctx.save_for_forward(vals, V, *leaves)

    @staticmethod
    def _pinv(ctx, R):
        vals, V, *leaves = ctx.saved_tensors
        if ctx.order // 2 > _MAX_ORDER:
            raise NotImplementedError(
                f"eigsh: a derivative of order {ctx.order // 2} of its eigenpairs: eigenpairs "
                f"found matrix-free are differentiated exactly up to order {_MAX_ORDER} (grad, "
                "jvp, hessian, double backward; Note [Implicit derivatives of eigenpairs]). "
                "Expected: at most second derivatives; for higher ones, "
                "torch.linalg.eigh(A.to_dense())."
            )
        none = (None,) * (5 + len(leaves))
        # P(R) = P(R0) + E(R), R0 a constant copy: the value from MINRES on constants, the
        # derivative in R by the next correction (value zero, derivative P)
        A = tree_unflatten(ctx.spec, [_constant(t) for t in leaves])
        out = _deflated_pinv(A, vals, V, R.detach(), ctx.tol)
        nxt = 2 * (ctx.order // 2 + 1)
        return out + EigenCorrection.apply(R, ctx.spec, nxt, ctx.tol, vals, V, *leaves), none

    @staticmethod
    def backward(ctx, G):
        # the pseudo-inverse of a Hermitian operator is Hermitian: the vjp is the same map
        value, none = EigenCorrection._pinv(ctx, G)
        return (value,) + none

    @staticmethod
    def jvp(ctx, R_dot, *_):
        return EigenCorrection._pinv(ctx, R_dot)[0]


def _residual(A, V):
    """``r_i = A v_i - v_i (v_i^H A v_i) / (v_i^H v_i)``: zero exactly on eigenvectors, of any
    length; and ``A V``."""
    AV = A._matmul(V)
    ray = (V.conj() * AV).sum(-2, keepdim=True) / (V.conj() * V).sum(-2, keepdim=True)
    return AV - V * ray, AV


def implicit_eigenpairs(A: LinearOperator, vals, vecs, tol):
    """The pairs ``(vals, vecs)`` found on constants, rebuilt from A's tensors with the exact
    derivatives of Note [Implicit derivatives of eigenpairs]. Unchanged when nothing
    differentiates A."""
    leaves, spec = tree_flatten(A)
    if not differentiable(_tensors(leaves)):
        return vals, vecs
    vals, vecs = vals.detach(), vecs.detach()

    def correct(V, which):
        R, _ = _residual(A, V)
        return V - EigenCorrection.apply(R, spec, 2 + which, tol, vals, vecs, *leaves)

    V = correct(correct(vecs, 0), 1)  # two frozen Newton steps: exact to second order
    V = V / torch.linalg.vector_norm(V, dim=-2, keepdim=True)
    ray = (V.conj() * A._matmul(V)).sum(-2).real
    return vals + (ray - ray.detach()), V


def _orthonormal_against(Y, B):
    """Columns of ``Y`` orthonormalized against the orthonormal ``B`` and among themselves:
    two passes of projection and QR (one leaves rounding-sized overlaps with B)."""
    for _ in range(2):
        if B is not None:
            Y = Y - B @ (B.mH @ Y)
        Y, _ = torch.linalg.qr(Y)
    return Y


def lobpcg(A, k, which, X0, tol, maxiter, preconditioner):
    """Rayleigh-Ritz on ``[X, W, P]`` (Note [LOBPCG]); A on constants. Returns ``(vals, vecs,
    info)``, vals ascending."""
    largest = which == "LA"
    Minv = _preconditioner(A, preconditioner, "eigsh(..., method='lobpcg')")
    X, _ = torch.linalg.qr(X0)
    AX = _apply(A, X)
    theta, U = torch.linalg.eigh(X.mH @ AX)
    X, AX = X @ U.to(X.dtype), AX @ U.to(X.dtype)
    P = None
    tiny = torch.finfo(theta.dtype).tiny

    def relative_residual():
        Rr = AX - X * theta.unsqueeze(-2).to(X.dtype)
        scale = theta.abs().amax(-1, keepdim=True).clamp(min=tiny)
        return Rr, _readable_float((torch.linalg.vector_norm(Rr, dim=-2) / scale).max())

    it = 0
    while it < maxiter:
        it += 1
        Rr, rel = relative_residual()
        if rel is not None and rel <= tol:
            break
        W = _orthonormal_against(Minv(Rr) if Minv is not None else Rr, X)
        blocks = [X, W] if P is None else [X, W, _orthonormal_against(P, torch.cat([X, W], -1))]
        S = torch.cat(blocks, -1)
        AS = torch.cat([AX, _apply(A, torch.cat(blocks[1:], -1))], -1)
        G = S.mH @ AS
        theta_all, C = torch.linalg.eigh((G + G.mH) / 2)
        sel = slice(G.shape[-1] - k, None) if largest else slice(0, k)
        theta, C = theta_all[..., sel], C[..., sel].to(X.dtype)
        # the new search directions: the part of the update outside the old X
        keep = torch.arange(C.shape[-2], device=C.device) >= k
        P = S @ (C * keep.unsqueeze(-1))
        X, AX = S @ C, AS @ C
    _, rel = relative_residual()
    info = SolverInfo("eigsh", it, rel, None if rel is None else rel <= tol, tol)
    return theta, X, info
