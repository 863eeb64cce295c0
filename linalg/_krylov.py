"""Krylov solvers beyond CG, used only when asked: MINRES, GMRES, BiCGStab and LSMR.

Each runs on all right-hand sides (the columns of B) and on a batch of operators at once:
every scalar of the recurrences is a ``(..., 1, k)`` tensor, one value per column, and a column
that has converged stops changing (its updates are masked to zero) while the others go on
(Note [Data-dependent stopping under vmap] in ``_iterative.py``). Solves by them are
differentiated implicitly, never through their iterations (Note [Implicit differentiation of
iterative solves]); for a non-symmetric A the adjoint solves of the derivative run the same
method on ``A^H`` (`SolveMethod.adjoint`).

# Note [Implicit derivatives of iterative least squares]
``X = argmin |A X - B|^2 + damp^2 |X|^2`` solves the normal equations ``N X = A^H B`` with
``N = A^H A + damp^2 I``. LSMR computes X on constants (it is MINRES on the normal equations
in exact arithmetic, without forming ``A^H A``, whose condition number is squared), and the
derivatives are those of the normal equations, as for any implicit solve:
``dX = N^{-1}(dA^H (B - A X) + A^H (dB - dA X))``, ``B_bar = A N^{-1} X_bar``, with the solves
by MINRES on the operator ``N`` (`NormalOperator`, applied as ``A^H (A X) + damp^2 X``), to the
same tolerance. A rank-deficient A without damping has no unique solution: the derivative is
then undefined and MINRES reports non-convergence.
"""

from __future__ import annotations

import dataclasses

import torch

from functransforms._pytree import tree_flatten

from . import _iterative
from ._base import LinearOperator, _try_bool, broadcast_batch
from ._dense import DenseOperator
from ._implicit import differentiable, implicit_solve
from ._iterative import (
    METHODS,
    SYMMETRIC_METHODS,
    SolverInfo,
    _apply,
    _constant,
    _dot,
    _preconditioner,
    _readable_float,
    _record,
    require_symmetric,
)
from ._rules import solve as _solve


def _columns(A, B, call):
    """``(vec, Bm)``: B as columns ``(..., n, k)``, and whether it was a (batch of) vector(s);
    a non-square A or a B of the wrong height refused."""
    vec = B.dim() == 1 or (isinstance(A, LinearOperator) and B.dim() == A.ndim - 1)
    Bm = B.unsqueeze(-1) if vec else B
    if isinstance(A, LinearOperator):
        if not A.is_square:
            raise ValueError(
                f"{call}: expected a square operator, received {A!r}; for least squares use "
                "lsmr(A, B)."
            )
        if Bm.shape[-2] != A.shape[-1]:
            raise ValueError(
                f"{call}: expected B with {A.shape[-1]} rows for {A!r}, received shape "
                f"{tuple(B.shape)}."
            )
    return vec, Bm


def _safe(d):
    """``d`` with its zeros replaced by ones: a divisor for masked (converged) columns."""
    return torch.where(d == 0, torch.ones_like(d), d)


def _norm(X):
    return torch.linalg.vector_norm(X, dim=-2, keepdim=True)


def _broadcast(A, Bm):
    """B expanded over A's batch (the recurrences stack and mask per batch element)."""
    if isinstance(A, LinearOperator) and len(A.batch_shape):
        batch = broadcast_batch(A.batch_shape, Bm.shape[:-2])
        return Bm.expand(*batch, *Bm.shape[-2:])
    return Bm


def _start(A, Bm, x0, vec):
    """``(X, R)``: the start X (zeros or x0, broadcast over A's batch) and ``R = B - A X``."""
    if x0 is None:
        R = _broadcast(A, Bm)
        return torch.zeros_like(R), R
    X = x0.unsqueeze(-1) if vec else x0
    R = Bm - _apply(A, X)
    return X + torch.zeros_like(R), R


def _info(method, it, rel, done, tol):
    rel = _readable_float(rel.max())
    conv = None if rel is None else bool(_try_bool(done.all()))
    return SolverInfo(method, it, rel, conv, tol)


def _minv(A, preconditioner, call):
    if isinstance(A, LinearOperator):
        return _preconditioner(A, preconditioner, call)
    return preconditioner


# ------------------------------------------------------------------ MINRES
def minres(
    A,
    B: torch.Tensor,
    *,
    x0=None,
    tol: float = 1e-6,
    atol: float = 0.0,
    maxiter: int | None = None,
    preconditioner=None,
) -> tuple[torch.Tensor, SolverInfo]:
    """MINRES (Paige and Saunders) for a symmetric (Hermitian), possibly indefinite ``A``.

    Minimizes ``|b - A x|`` over the Krylov space at each step. Not differentiated (use
    ``solve(A, B, method="minres")`` for implicit derivatives).

    Args:
        A: operator declared symmetric (or callable ``X -> A X``) ``(..., n, n)``.
        B: ``(..., n)`` or ``(..., n, k)``.
        tol, atol: stop when the residual estimate is ``<= max(tol |b|, atol)`` for every
            column (norms in the preconditioner's ``M^{-1}`` norm when there is one).
        maxiter: default 10 n.
        preconditioner: a symmetric positive definite ``M ≈ A`` (an operator, a callable
            ``R -> M^{-1} R`` or "jacobi", for a positive diagonal).

    Returns:
        ``(X, info)``: X like B, info a `SolverInfo`.

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator, minres
        >>> A = DiagonalOperator(torch.tensor([2.0, -1.0], dtype=torch.float64))  # indefinite
        >>> x, info = minres(A, torch.ones(2, dtype=torch.float64), tol=1e-12)  # x: [2]
        >>> [round(v, 12) for v in x.tolist()], info.converged
        ([0.5, -1.0], True)
    """
    require_symmetric(A, "minres(A, B)", "MINRES")
    vec, Bm = _columns(A, B, "minres(A, B)")
    n = Bm.shape[-2]
    maxiter = 10 * n if maxiter is None else int(maxiter)
    Minv = _minv(A, preconditioner, "minres")
    X, R1 = _start(A, Bm, x0, vec)
    Y = Minv(R1) if Minv is not None else R1
    beta1 = _dot(R1, Y).real.clamp(min=0).sqrt()
    if x0 is None:
        bnorm = beta1
    else:
        Mb = Minv(Bm) if Minv is not None else Bm
        bnorm = _dot(Bm, Mb).real.clamp(min=0).sqrt()
    thresh = torch.clamp(tol * bnorm, min=atol)
    zero = torch.zeros_like(beta1)
    oldb, beta, dbar, epsln, phibar = zero, beta1, zero, zero, beta1
    cs, sn = zero - 1, zero
    W = W2 = torch.zeros_like(X)
    R2 = R1
    done = phibar <= thresh
    it = 0
    for it in range(maxiter + 1):
        if it == maxiter or _try_bool(done.all()):
            break
        s = 1 / _safe(beta)
        V = s * Y
        Y = _apply(A, V)
        if it >= 1:
            Y = Y - (beta / _safe(oldb)) * R1
        alfa = _dot(V, Y).real
        Y = Y - (alfa * s) * R2
        R1, R2 = R2, Y
        Y = Minv(R2) if Minv is not None else R2
        oldb, beta = beta, _dot(R2, Y).real.clamp(min=0).sqrt()
        # the previous rotation applied to the new column of the tridiagonal, then a new one
        oldeps = epsln
        delta = cs * dbar + sn * alfa
        gbar = sn * dbar - cs * alfa
        epsln = sn * beta
        dbar = -cs * beta
        gamma = _safe(torch.hypot(gbar, beta))
        cs, sn = gbar / gamma, beta / gamma
        phi = cs * phibar
        phibar = sn * phibar
        W1, W2 = W2, W
        W = (V - oldeps * W1 - delta * W2) / gamma
        X = X + torch.where(done, 0, phi * W)
        done = done | (phibar.abs() <= thresh)
    info = _info("minres", it, phibar.abs() / _safe(bnorm), done, tol)
    return (X.squeeze(-1) if vec else X), info


# ------------------------------------------------------------------ GMRES
def _givens(a, b):
    """``(c, s, r)`` with ``[[c̄, s̄], [-s, c]] [a, b] = [r, 0]`` (complex-safe), ``r = |(a, b)|``."""
    r = torch.sqrt(a.abs() ** 2 + b.abs() ** 2)
    safe = _safe(r)
    c = torch.where(r == 0, torch.ones_like(a), a / safe)
    return c, b / safe, r.to(a.dtype)


def gmres(
    A,
    B: torch.Tensor,
    *,
    x0=None,
    tol: float = 1e-6,
    atol: float = 0.0,
    restart: int | None = None,
    maxiter: int | None = None,
    preconditioner=None,
) -> tuple[torch.Tensor, SolverInfo]:
    """Restarted GMRES for a general square ``A`` (right preconditioned).

    Each cycle builds an orthonormal Krylov basis of ``A M^{-1}`` (Arnoldi, Gram-Schmidt twice)
    of at most ``restart`` vectors, minimizing the true residual ``|b - A x|`` over it by Givens
    rotations; then restarts from the new residual. Not differentiated (use
    ``solve(A, B, method="gmres")`` for implicit derivatives).

    Args:
        A: operator (or callable ``X -> A X``) ``(..., n, n)``. B: ``(..., n)`` or ``(..., n, k)``.
        tol, atol: stop when ``|r| <= max(tol |b|, atol)`` for every column.
        restart: the basis size of a cycle (default ``min(n, 30)``; ``n``: full GMRES, exact
            in at most n steps in exact arithmetic).
        maxiter: total Arnoldi steps over all cycles, default 10 n.
        preconditioner: ``M ≈ A`` (an operator, a callable ``R -> M^{-1} R`` or "jacobi").

    Returns:
        ``(X, info)``: X like B, info a `SolverInfo` (``iterations``: Arnoldi steps).

    Example:
        >>> import torch
        >>> from functransforms.linalg import DenseOperator, gmres
        >>> A = DenseOperator(torch.tensor([[2.0, 1.0], [0.0, 1.0]], dtype=torch.float64))
        >>> x, info = gmres(A, torch.tensor([3.0, 1.0], dtype=torch.float64))  # x: [2]
        >>> [round(v, 12) for v in x.tolist()], info.converged
        ([1.0, 1.0], True)
    """
    vec, Bm = _columns(A, B, "gmres(A, B)")
    n = Bm.shape[-2]
    restart = min(n, 30 if restart is None else int(restart))
    if restart < 1:
        raise ValueError(f"gmres(A, B, restart={restart}): expected restart >= 1.")
    maxiter = 10 * n if maxiter is None else int(maxiter)
    Minv = _minv(A, preconditioner, "gmres")
    X, R = _start(A, Bm, x0, vec)
    bnorm = _norm(Bm)
    thresh = torch.clamp(tol * bnorm, min=atol)
    rnorm = _norm(R)
    done = rnorm <= thresh
    it = 0
    while it < maxiter and not _try_bool(done.all()):
        V = [R / _safe(rnorm)]
        g = [rnorm.to(R.dtype)]  # the rotated right-hand side |r| e_1
        cols, cs, sn = [], [], []  # the rotated (upper triangular) Hessenberg columns
        for j in range(min(restart, maxiter - it)):
            W = _apply(A, Minv(V[j]) if Minv is not None else V[j])
            Vs = torch.stack(V, dim=-3)  # (..., j+1, n, k)
            h = 0
            for _ in range(2):  # Gram-Schmidt twice: orthogonal to working precision
                c = (Vs.conj() * W.unsqueeze(-3)).sum(-2, keepdim=True)  # (..., j+1, 1, k)
                W = W - (c * Vs).sum(-3)
                h = h + c
            hnext = _norm(W)
            V.append(W / _safe(hnext))
            col = list(h.unbind(-3)) + [hnext.to(W.dtype)]
            for i in range(j):  # the previous rotations
                a, b = col[i], col[i + 1]
                col[i] = cs[i].conj() * a + sn[i].conj() * b
                col[i + 1] = -sn[i] * a + cs[i] * b
            c, s, r = _givens(col[j], col[j + 1])
            # A converged column takes no more steps: its new unknown is zero (diagonal 1,
            # right-hand side 0), and its residual moves down unchanged.
            c, s = torch.where(done, 1, c), torch.where(done, 0, s)
            cols.append([torch.where(done, 0, x) for x in col[:j]] + [torch.where(done, 1, r)])
            cs.append(c)
            sn.append(s)
            gj = g[j]
            g[j] = torch.where(done, 0, c.conj() * gj)
            g.append(torch.where(done, gj, -s * gj))
            it += 1
            done = done | (g[-1].abs() <= thresh)
            if _try_bool(done.all()):
                break
        m = len(cols)
        zero = torch.zeros_like(g[0])
        H = torch.stack(
            [torch.stack(cols[j] + [zero] * (m - j - 1), dim=-1) for j in range(m)], dim=-1
        ).squeeze(-4)  # (..., k, m, m): H[..., i, j] = cols[j][i]
        y = torch.linalg.solve_triangular(
            H, torch.stack(g[:m], dim=-1).squeeze(-3).unsqueeze(-1), upper=True
        )  # (..., k, m, 1)
        update = (torch.stack(V[:m], dim=-1) * y.squeeze(-1).unsqueeze(-3)).sum(-1)  # (..., n, k)
        X = X + (Minv(update) if Minv is not None else update)
        R = Bm - _apply(A, X)  # the true residual decides, not the recurrence's estimate
        rnorm = _norm(R)
        done = rnorm <= thresh
    info = _info("gmres", it, rnorm / _safe(bnorm), done, tol)
    return (X.squeeze(-1) if vec else X), info


# ------------------------------------------------------------------ BiCGStab
def bicgstab(
    A,
    B: torch.Tensor,
    *,
    x0=None,
    tol: float = 1e-6,
    atol: float = 0.0,
    maxiter: int | None = None,
    preconditioner=None,
) -> tuple[torch.Tensor, SolverInfo]:
    """BiCGStab (van der Vorst) for a general square ``A`` (right preconditioned).

    Two products with A per iteration and short recurrences (no growing basis, unlike GMRES);
    convergence is not monotone and may break down (then it reports non-convergence). Not
    differentiated (use ``solve(A, B, method="bicgstab")`` for implicit derivatives).

    Args:
        A: operator (or callable ``X -> A X``) ``(..., n, n)``. B: ``(..., n)`` or ``(..., n, k)``.
        tol, atol: stop when ``|r| <= max(tol |b|, atol)`` for every column.
        maxiter: default 10 n.
        preconditioner: ``M ≈ A`` (an operator, a callable ``R -> M^{-1} R`` or "jacobi").

    Returns:
        ``(X, info)``: X like B, info a `SolverInfo`.

    Example:
        >>> import torch
        >>> from functransforms.linalg import DenseOperator, bicgstab
        >>> A = DenseOperator(torch.tensor([[4.0, 1.0], [-1.0, 3.0]], dtype=torch.float64))
        >>> x, info = bicgstab(A, torch.tensor([5.0, 2.0], dtype=torch.float64), tol=1e-12)
        >>> [round(v, 12) for v in x.tolist()], info.converged  # x: [2]
        ([1.0, 1.0], True)
    """
    vec, Bm = _columns(A, B, "bicgstab(A, B)")
    n = Bm.shape[-2]
    maxiter = 10 * n if maxiter is None else int(maxiter)
    Minv = _minv(A, preconditioner, "bicgstab")
    X, R = _start(A, Bm, x0, vec)
    Rhat = R  # the shadow residual
    bnorm = _norm(Bm)
    thresh = torch.clamp(tol * bnorm, min=atol)
    one = torch.ones_like(_dot(R, R))
    rho, alpha, omega = one, one, one
    P = Vv = torch.zeros_like(R)
    it = 0
    for it in range(maxiter + 1):
        rnorm = _norm(R)
        done = rnorm <= thresh
        if it == maxiter or _try_bool(done.all()):
            break
        rho_new = _dot(Rhat, R)
        beta = (rho_new / _safe(rho)) * (alpha / _safe(omega))
        P = R + beta * (P - omega * Vv)
        Phat = Minv(P) if Minv is not None else P
        Vv = _apply(A, Phat)
        alpha = rho_new / _safe(_dot(Rhat, Vv))
        S = R - alpha * Vv
        half = _norm(S) <= thresh  # converged at the half step: no stabilizing step
        Shat = Minv(S) if Minv is not None else S
        T = _apply(A, Shat)
        omega = torch.where(half, 0, _dot(T, S) / _safe(_dot(T, T)))
        X = X + torch.where(done, 0, alpha * Phat + omega * Shat)
        R = torch.where(done, R, S - omega * T)
        rho = rho_new
    info = _info("bicgstab", it, rnorm / _safe(bnorm), done, tol)
    return (X.squeeze(-1) if vec else X), info


# ------------------------------------------------------------------ implicitly differentiated
_SOLVERS = {"cg": None, "minres": minres, "gmres": gmres, "bicgstab": bicgstab}
assert tuple(_SOLVERS) == METHODS["solve"]
_OPTIONS = {"tol", "atol", "maxiter", "preconditioner"}
_EXTRA_OPTIONS = {"gmres": {"restart"}}
# options of the `iterative` context meant for other operations
_OTHER_OPTIONS = {"num_probes", "lanczos_steps", "generator", "restart", "damp"}


@dataclasses.dataclass(frozen=True)
class SolveMethod:
    """An iterative solve method ``(A, B) -> X`` with its options, run on constants with its info
    recorded (`implicit_solve`'s ``method``). ``adjoint()``: the same for ``A^H`` (an operator
    preconditioner is adjointed; a callable one is used as given, which changes the speed of
    convergence, not the answer, for the right preconditioned GMRES and BiCGStab)."""

    name: str
    options: tuple

    def __call__(self, A, B):
        # CG through the module so that its callers can be counted (tests patch _iterative.cg)
        fn = _SOLVERS[self.name] or _iterative.cg
        X, info = fn(A, B, **dict(self.options))
        _record(info)
        return X

    def adjoint(self):
        opts = dict(self.options)
        M = opts.get("preconditioner")
        if isinstance(M, LinearOperator):
            opts["preconditioner"] = M._adjoint()
        return SolveMethod(self.name, tuple(opts.items()))


def iterative_solve(A: LinearOperator, B: torch.Tensor, method: str, **options) -> torch.Tensor:
    """``A^{-1} B`` by ``method`` with implicit derivatives (Note [Implicit differentiation of
    iterative solves])."""
    allowed = _OPTIONS | _EXTRA_OPTIONS.get(method, set())
    bad = set(options) - allowed - _OTHER_OPTIONS
    if bad:
        raise TypeError(
            f"solve(A, B, method={method!r}): unexpected options {sorted(bad)}; "
            f"allowed {sorted(allowed)}."
        )
    if method in SYMMETRIC_METHODS:
        require_symmetric(A, f"solve(A, B, method={method!r})", method.upper())
    opts = tuple((k, v) for k, v in options.items() if k in allowed)
    return implicit_solve(A, B, SolveMethod(method, opts))


# ------------------------------------------------------------------ LSMR
def _sym_ortho(a, b):
    """``(c, s, r)`` with ``c a + s b = r``, ``-s a + c b = 0`` for real a, b (a stable Givens)."""
    r = torch.hypot(a, b)
    safe = _safe(r)
    return torch.where(r == 0, torch.ones_like(a), a / safe), b / safe, r


def _lsmr(matvec, rmatvec, U, damp, tol, atol, maxiter):
    """LSMR (Fong and Saunders) on the columns of ``U`` for the operator whose products are
    ``matvec`` and ``rmatvec`` (its adjoint's); ``(X, info)``, nothing differentiated."""
    beta = _norm(U)
    U = U / _safe(beta)
    V = rmatvec(U)
    alpha = _norm(V)
    V = V / _safe(alpha)
    normb, zetabar, alphabar = beta, alpha * beta, alpha
    one, zero = torch.ones_like(beta), torch.zeros_like(beta)
    rho, rhobar, cbar, sbar = one, one, one, zero
    H, Hbar, X = V, torch.zeros_like(V), torch.zeros_like(V)
    betadd, betad, rhodold, tautildeold = beta, zero, one, zero
    thetatilde, zeta, d = zero, zero, zero
    normA2 = alpha**2
    damp = torch.full_like(beta, float(damp))
    test = zero  # min(|r| / |b|, |A^H r| / (|A| |r|)) per column
    done = zetabar == 0  # A^H b = 0: X = 0 is the answer
    it = 0
    for it in range(maxiter + 1):
        if it == maxiter or _try_bool(done.all()):
            break
        U = matvec(V) - alpha * U
        beta = _norm(U)
        U = U / _safe(beta)
        V = rmatvec(U) - beta * V
        alpha = _norm(V)
        V = V / _safe(alpha)
        # rotations: the damping, then the new subdiagonal, then the second bidiagonal
        chat, shat, alphahat = _sym_ortho(alphabar, damp)
        rhoold = rho
        c, s, rho = _sym_ortho(alphahat, beta)
        thetanew = s * alpha
        alphabar = c * alpha
        rhobarold, zetaold = rhobar, zeta
        thetabar = sbar * rho
        cbar, sbar, rhobar = _sym_ortho(cbar * rho, thetanew)
        zeta = cbar * zetabar
        zetabar = -sbar * zetabar
        Hbar = H - (thetabar * rho / _safe(rhoold * rhobarold)) * Hbar
        X = X + torch.where(done, 0, (zeta / _safe(rho * rhobar)) * Hbar)
        H = V - (thetanew / _safe(rho)) * H
        # estimates of |r| (with the damping rows) and of |A|
        betaacute = chat * betadd
        betacheck = -shat * betadd
        betahat = c * betaacute
        betadd = -s * betaacute
        thetatildeold = thetatilde
        ctildeold, stildeold, rhotildeold = _sym_ortho(rhodold, thetabar)
        thetatilde = stildeold * rhobar
        rhodold = ctildeold * rhobar
        betad = -stildeold * betad + ctildeold * betahat
        tautildeold = (zetaold - thetatildeold * tautildeold) / _safe(rhotildeold)
        taud = (zeta - thetatilde * tautildeold) / _safe(rhodold)
        d = d + betacheck**2
        normr = torch.sqrt(d + (betad - taud) ** 2 + betadd**2)
        normA2 = normA2 + beta**2
        normA = normA2.sqrt()
        normA2 = normA2 + alpha**2
        test1 = normr / _safe(normb)
        test2 = zetabar.abs() / _safe(normA * normr)
        new = torch.minimum(test1, test2)
        test = torch.where(done, test, new)
        done = done | (new <= tol) | (zetabar.abs() <= atol)
    info = _info("lsmr", it, test, done, tol)
    return X, info


def _right_preconditioner(A, P):
    """``(P^{-1}, P^{-H})`` as callables on columns, or None (`lsmr`'s ``preconditioner``)."""
    if P is None:
        return None
    if isinstance(P, str):
        if P != "jacobi":
            raise ValueError(
                f"lsmr({A!r}, B, preconditioner={P!r}): expected 'jacobi' or an operator."
            )
        d = NormalOperator(_constant(A)).diagonal().sqrt().unsqueeze(-1)  # column norms
        d = torch.where(d == 0, torch.ones_like(d), d)
        return (lambda R: R / d), (lambda R: R / d.conj())
    if isinstance(P, LinearOperator):
        if not P.is_square or P.shape[-1] != A.shape[-1]:
            raise ValueError(
                f"lsmr({A!r}, B, preconditioner={P!r}): expected a square operator of size "
                f"{A.shape[-1]} (A's columns), received shape {tuple(P.shape)}."
            )
        P, PH = _constant(P), _constant(P)._adjoint()
        return (lambda R: _solve(P, R)), (lambda R: _solve(PH, R))
    raise TypeError(
        f"lsmr({A!r}, B, preconditioner=...): expected 'jacobi' or an operator (LSMR needs "
        f"products with both P^{{-1}} and P^{{-H}}), received {type(P).__name__}."
    )


def _lsmr_from(A, Bm, damp, tol, atol, maxiter, X0, P):
    """LSMR for ``min |A X - B|^2 + damp^2 |X|^2`` from ``X0`` (None: zeros) with the right
    preconditioner ``P`` (`_right_preconditioner`). From zeros without a preconditioner, or
    undamped: LSMR (with its own damping) on ``A P^{-1}``. Otherwise undamped LSMR on the
    stacked ``[A; damp I] P^{-1}`` for the correction ``X - X0``: LSMR's own damping acts on
    what it solves for (``P X`` or ``X - X0``), and the damping rows' right-hand side is
    ``-damp X0``."""
    m, n = A.shape[-2:]
    maxiter = 10 * min(m, n) if maxiter is None else int(maxiter)
    AH = A._adjoint()
    Pinv, PinvH = P if P is not None else (lambda R: R, lambda R: R)
    U = _broadcast(A, Bm)
    if X0 is None and (P is None or not damp):  # LSMR's own damping is of the unknown it solves for
        Y, info = _lsmr(
            lambda V: A._matmul(Pinv(V)),
            lambda U: PinvH(AH._matmul(U)),
            U,
            damp,
            tol,
            atol,
            maxiter,
        )
        return (Pinv(Y) if P is not None else Y), info
    if X0 is None:
        X0 = torch.zeros(U.shape[:-2] + (n, U.shape[-1]), dtype=U.dtype, device=U.device)
    else:
        X0 = X0 + torch.zeros(U.shape[:-2] + X0.shape[-2:], dtype=U.dtype, device=U.device)
    R = U - A._matmul(X0)
    if damp:
        R = torch.cat([R, -damp * X0], dim=-2)

        def matvec(V):
            W = Pinv(V)
            return torch.cat([A._matmul(W), damp * W], dim=-2)

        def rmatvec(U):
            return PinvH(AH._matmul(U[..., :m, :]) + damp * U[..., m:, :])

    else:

        def matvec(V):
            return A._matmul(Pinv(V))

        def rmatvec(U):
            return PinvH(AH._matmul(U))

    D, info = _lsmr(matvec, rmatvec, R, 0.0, tol, atol, maxiter)
    return X0 + Pinv(D), info


class NormalOperator(LinearOperator):
    """``A^H A + damp^2 I`` for an ``(..., m, n)`` operator A, applied as ``A^H (A X) + damp^2
    X`` (never formed): the operator of the normal equations (Note [Implicit derivatives of
    iterative least squares]). Symmetric positive semidefinite (definite when ``damp > 0``).

    Example:
        >>> import torch
        >>> from functransforms.linalg import DenseOperator, NormalOperator
        >>> M = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]], dtype=torch.float64)
        >>> N = NormalOperator(DenseOperator(M), damp=1.0)  # [2, 2]
        >>> torch.equal(N.to_dense(), M.mT @ M + torch.eye(2, dtype=torch.float64))
        True
    """

    _tree_fields = ("base",)
    _static_fields = ("damp",)

    def __init__(self, base: LinearOperator, damp: float = 0.0, **props):
        if not isinstance(base, LinearOperator):
            raise TypeError(
                f"NormalOperator(base): expected a LinearOperator, received {type(base).__name__}."
            )
        self.base = base
        self.damp = float(damp)
        props.update(symmetric=True, positive_definite=props.get("positive_definite", damp > 0))
        n = base.shape[-1]
        super().__init__(base.batch_shape + (n, n), base.dtype, base.device, **props)

    def _repr_extra(self):
        return f"{self.base!r}, damp={self.damp}"

    def _matmul(self, X):
        Y = self.base._adjoint()._matmul(self.base._matmul(X))
        return Y + self.damp**2 * X if self.damp else Y

    def _adjoint(self):
        return self

    def _transpose(self):
        return self if not self.is_complex else NormalOperator(self.base._conj(), self.damp)


def lsmr(
    A,
    B: torch.Tensor,
    *,
    damp: float = 0.0,
    tol: float = 1e-6,
    atol: float = 0.0,
    maxiter: int | None = None,
    x0: torch.Tensor | None = None,
    preconditioner=None,
) -> tuple[torch.Tensor, SolverInfo]:
    """LSMR (Fong and Saunders): ``X = argmin |A X - B|^2 + damp^2 |X|^2`` for a rectangular A.

    Uses only products with A and ``A^H``. Differentiated implicitly through the normal
    equations (Note [Implicit derivatives of iterative least squares]): grad, jvp, vmap of ours
    and of torch's transforms and autograd get ``dX`` exact to the tolerance, up to second
    order (as every implicit solve).

    Args:
        A: operator (or tensor) ``(..., m, n)``. B: ``(..., m)`` or ``(..., m, k)``.
        damp: the Tikhonov damping (a number, not differentiated).
        tol: stop when ``|r| <= tol |b|`` (consistent systems) or ``|A^H r| <= tol |A| |r|``
            (least squares), for every column (``r`` with the damping rows). atol: stop when
            ``|A^H r| <= atol``.
        maxiter: default 10 min(m, n).
        x0: where the iterations start (the solution's shape); not differentiated, since the
            solution does not depend on it. The problem stays the damped one: the start is
            folded in as ``min |[A; damp I] D - [B - A x0; -damp x0]|`` for ``X = x0 + D``
            (SciPy's ``x0`` damps the correction D instead).
        preconditioner: a right preconditioner: an ``(n, n)`` operator P with ``A P^{-1}``
            better conditioned (LSMR runs on it and returns ``X = P^{-1} Y``; products with
            ``P^{-1}`` and ``P^{-H}`` by `solve`), or ``"jacobi"``: P the diagonal of A's
            column norms. The derivative solves use ``(P^H P)^{-1}`` as MINRES's
            preconditioner. With a preconditioner ``tol`` applies to the preconditioned problem.

    Returns:
        ``(X, info)``: X ``(..., n)`` or ``(..., n, k)``; info a `SolverInfo` whose
        ``residual`` is the larger over columns of ``min(|r| / |b|, |A^H r| / (|A| |r|))``.

    Example:
        >>> import torch
        >>> from functransforms.linalg import DenseOperator, lsmr
        >>> M = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
        >>> b = torch.tensor([1.0, 2.0, 0.0], dtype=torch.float64)
        >>> x, info = lsmr(DenseOperator(M), b, tol=1e-12)  # x: [2]
        >>> torch.allclose(x, torch.linalg.lstsq(M, b.unsqueeze(-1)).solution.squeeze(-1))
        True
    """
    if isinstance(A, torch.Tensor):
        A = DenseOperator(A)
    if not isinstance(A, LinearOperator):
        raise TypeError(
            f"lsmr(A, B): expected A to be a LinearOperator or a Tensor, received "
            f"{type(A).__name__}."
        )
    if not isinstance(B, torch.Tensor):
        raise TypeError(f"lsmr({A!r}, B): expected B to be a Tensor, received {type(B).__name__}.")
    vec = B.dim() == 1 or B.dim() == A.ndim - 1
    Bm = B.unsqueeze(-1) if vec else B
    if Bm.shape[-2] != A.shape[-2]:
        raise ValueError(
            f"lsmr({A!r}, B): expected B with {A.shape[-2]} rows, received shape {tuple(B.shape)}."
        )
    X0 = None
    if x0 is not None:
        if not isinstance(x0, torch.Tensor):
            raise TypeError(
                f"lsmr({A!r}, B, x0=...): expected x0 to be a Tensor, received {type(x0).__name__}."
            )
        X0 = x0.unsqueeze(-1) if vec else x0
        if X0.shape[-2:] != (A.shape[-1], Bm.shape[-1]):
            raise ValueError(
                f"lsmr({A!r}, B, x0=...): expected x0 shaped as the solution, "
                f"{'(..., n)' if vec else '(..., n, k)'} with n = {A.shape[-1]} (A's columns)"
                f"{'' if vec else f' and k = {Bm.shape[-1]}'}, received shape {tuple(x0.shape)}."
            )
        X0 = X0.detach()  # only where the iterations start: the solution does not depend on it
    P = _right_preconditioner(A, preconditioner)
    infos = []

    def forward():
        X, info = _lsmr_from(_constant(A), Bm.detach(), damp, tol, atol, maxiter, X0, P)
        _record(info)
        infos.append(info)
        return X

    N = NormalOperator(A, damp)
    if differentiable([Bm, *_leaves(A)]):
        opts = (("tol", tol), ("atol", atol), ("maxiter", maxiter))
        if P is not None:  # the normal equations' preconditioner: (P^H P)^{-1} = P^{-1} P^{-H}
            opts += (("preconditioner", lambda R, P=P: P[0](P[1](R))),)
        method = SolveMethod("minres", opts)
        X = implicit_solve(N, A._adjoint()._matmul(Bm), method, forward=forward)
    else:
        X = forward()
    return (X.squeeze(-1) if vec else X), infos[0]


def _leaves(A):
    return [t for t in tree_flatten(A)[0] if isinstance(t, torch.Tensor)]


def iterative_lstsq(A: LinearOperator, B: torch.Tensor, method: str, **options) -> torch.Tensor:
    """``torch.linalg.lstsq(A, B).solution`` by ``method`` ("lsmr") with implicit derivatives."""
    allowed = {"tol", "atol", "maxiter", "damp"}
    opts = {k: v for k, v in options.items() if k in allowed}
    return lsmr(A, B, **opts)[0]
