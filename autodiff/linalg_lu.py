"""Derivative rules of the LU family (linalg.lu, lu_factor(_ex), lu_unpack, lu_solve), the legacy
``triangular_solve`` and ``cholesky``; registered through ``def_linalg``
(Note [Linalg derivative rules] in autodiff/linalg.py). Decisions: docs/design/linalg.md,
"LU family".

Note [LU derivatives]
    A = P L U with P a permutation (from the pivots), L unit lower triangular [m, k] and U upper
    triangular [k, n], k = min(m, n). The pivots are piecewise constant in A, so P carries no
    derivative (as in torch): dA = P (dL U + L dU), and for a square A
    ``L^-1 P^T dA U^-1 = L^-1 dL + dU U^-1`` splits into a strictly lower part (dL) and an upper
    part (dU). Wide and tall A factor the leading k x k block and solve for the rest. The packed
    LU of lu_factor holds dL below the diagonal and dU on and above it. A singular or
    rank-deficient A has no derivative: the triangular solves by U then give inf / nan, as in
    torch (no error, no silent finite number). Complex: the vjp is the adjoint of the jvp under
    Re <a, b> (docs/complex.md); every formula is the real one with ^T replaced by ^H.
"""

from __future__ import annotations

import torch

from ._util import unbroadcast
from .linalg import _H, _cholesky_jvp, _cholesky_vjp, _conj, _plus, _solve_tri, _tri, def_linalg

aten = torch.ops.aten


def _unpack(LU, pivots, pivot=True):
    """(P or None, L [m, k], U [k, n]); through ``lu_unpack``, whose own rules make the result
    differentiable again (second order)."""
    P, L, U = torch.lu_unpack(LU, pivots, unpack_pivots=pivot)
    return (P if pivot else None), L, U


def _lower(X):  # strictly lower part (where dL lives)
    return X.tril(-1)


def _upper(X):  # upper part with the diagonal (where dU lives)
    return X.triu()


def _zeros_cat(X, size, dim):
    """X padded with zeros to ``size`` along ``dim`` (-1 or -2)."""
    extra = size - X.shape[dim]
    if extra == 0:
        return X
    shape = list(X.shape)
    shape[dim] = extra
    return torch.cat([X, X.new_zeros(shape)], dim)


# linalg.lu: L^-1 P^T dA U^-1 = L^-1 dL + dU U^-1 (square; Note [LU derivatives]);
# wide A = P L [U1 U2]: dU2 = L^-1 (P^T dA2 - dL U2); tall A = P [L1; L2] U:
# dL2 = (P^T dA)_2 U^-1 - L2 dU U^-1.
def _lu_jvp_core(dA, P, L, U):
    m, n = dA.shape[-2], dA.shape[-1]
    k = min(m, n)
    PdA = dA if P is None else P.mT @ dA
    if m == n:
        dK = _solve_tri(L, _solve_tri(U, PdA, upper=True, left=False), upper=False, unit=True)
        return L @ _lower(dK), _upper(dK) @ U
    if m < n:
        U1, U2 = U[..., :k], U[..., k:]
        dK = _solve_tri(L, _solve_tri(U1, PdA[..., :k], True, left=False), False, unit=True)
        dL = L @ _lower(dK)
        dU2 = _solve_tri(L, PdA[..., k:] - dL @ U2, upper=False, unit=True)
        return dL, torch.cat([_upper(dK) @ U1, dU2], -1)
    L1, L2 = L[..., :k, :], L[..., k:, :]
    dK = _solve_tri(L1, _solve_tri(U, PdA[..., :k, :], True, left=False), False, unit=True)
    dU = _upper(dK) @ U
    dL2 = _solve_tri(U, PdA[..., k:, :] - L2 @ dU, upper=True, left=False)
    return torch.cat([L1 @ _lower(dK), dL2], -2), dU


# The adjoint of _lu_jvp_core. Square: bar A = P L^-H (tril_-1(L^H bar L) + triu(bar U U^H)) U^-H.
# Wide: bar A1 = P L^-H (tril_-1(L^H bar L - triu(bar U) U^H) U1^-H + triu(bar U1)),
# bar A2 = P L^-H bar U2. Tall: bar A1 = P (L1^-H triu(bar U U^H - L^H tril_-1(bar L))
# + tril_-1(bar L1)) U^-H, bar A2 = P bar L2 U^-H.
def _lu_vjp_core(gL, gU, P, L, U):
    if gL is None and gU is None:  # a cotangent on P only: the pivots carry no derivative
        return None
    m, n = L.shape[-2], U.shape[-1]
    k = min(m, n)
    if m == n:
        gA = _plus(
            None if gL is None else _lower(L.mH @ gL), None if gU is None else _upper(gU @ U.mH)
        )
        gA = _solve_tri(L.mH, _solve_tri(U.mH, gA, upper=False, left=False), True, unit=True)
    elif m < n:
        gA = None if gL is None else L.mH @ gL
        if gU is not None:
            gA = _plus(gA, -(_upper(gU) @ U.mH))
        gA = _solve_tri(U[..., :k].mH, _lower(gA), upper=False, left=False)
        if gU is not None:
            gA = torch.cat([gA + _upper(gU[..., :k]), gU[..., k:]], -1)
        gA = _zeros_cat(_solve_tri(L.mH, gA, upper=True, unit=True), n, -1)
    else:
        gA = None if gU is None else gU @ U.mH
        if gL is not None:
            gA = _plus(gA, -(L.mH @ _lower(gL)))
        gA = _solve_tri(L[..., :k, :].mH, _upper(gA), upper=True, unit=True)
        if gL is not None:
            gA = torch.cat([gA + _lower(gL[..., :k, :]), gL[..., k:, :]], -2)
        gA = _zeros_cat(_solve_tri(U.mH, gA, upper=False, left=False), m, -2)
    return gA if P is None else P @ gA


def _lu_jvp(out, dots, A, pivot):
    P, L, U = out
    dL, dU = _lu_jvp_core(dots[0], P if pivot else None, L, U)
    return None, dL, dU


def _lu_vjp(bars, out, needs, A, pivot):
    P, L, U = out
    return (_lu_vjp_core(bars[1], bars[2], P if pivot else None, L, U),)


def_linalg(aten.linalg_lu.default, _lu_jvp, _lu_vjp)


# lu_factor_ex: the packed LU holds dL strictly below the diagonal and dU on and above it.
def _lu_factor_jvp(out, dots, A, pivot, check_errors):
    P, L, U = _unpack(out[0], out[1], pivot)
    dL, dU = _lu_jvp_core(dots[0], P, L, U)
    k = min(A.shape[-2], A.shape[-1])
    if A.shape[-2] >= A.shape[-1]:
        return (torch.cat([dL[..., :k, :] + dU, dL[..., k:, :]], -2),)
    return (torch.cat([dU[..., :k] + dL, dU[..., k:]], -1),)


def _lu_factor_vjp(bars, out, needs, A, pivot, check_errors):
    P, L, U = _unpack(out[0], out[1], pivot)
    g, k = bars[0], min(A.shape[-2], A.shape[-1])
    return (_lu_vjp_core(g[..., :, :k], g[..., :k, :], P, L, U),)


def_linalg(aten.linalg_lu_factor_ex.default, _lu_factor_jvp, _lu_factor_vjp)


# lu_unpack is linear in LU_data: L = tril_-1(LU[:, :k]) + I, U = triu(LU[:k, :]).
def _lu_unpack_jvp(out, dots, LU, pivots, unpack_data, unpack_pivots):
    dLU = dots[0]
    if not unpack_data:  # L and U are empty placeholders
        return None, None, None
    k = min(LU.shape[-2], LU.shape[-1])
    return None, _lower(dLU[..., :, :k]), _upper(dLU[..., :k, :])


def _lu_unpack_vjp(bars, out, needs, LU, pivots, unpack_data, unpack_pivots):
    gL, gU = bars[1], bars[2]
    if not unpack_data or (gL is None and gU is None):
        return None, None
    m, n = LU.shape[-2], LU.shape[-1]
    gL = None if gL is None else _zeros_cat(_lower(gL), n, -1)
    gU = None if gU is None else _zeros_cat(_upper(gU), m, -2)
    return _plus(gL, gU), None


def_linalg(aten.lu_unpack.default, _lu_unpack_jvp, _lu_unpack_vjp)


# lu_solve: X = op(A)^-1 B (left) or B op(A)^-1, op(A) = A^H when adjoint, A = P L U.
# jvp: dX = lu_solve(R), R = dB - op(dA) X (or dB - X op(dA)),
# dA = P (tril_-1(dLU) U + L triu(dLU)).
# vjp: bar B = lu_solve(bar X) with the adjoint flag flipped; bar A from the solve
# (-bar B X^H, -X bar B^H, -X^H bar B, -bar B^H X for the four left/adjoint cases), then pulled
# back through A = P L U: bar LU = tril_-1(P^T bar A U^H) + triu(L^H P^T bar A).
def _dA(dLU, P, L, U):
    return P @ (_tri(dLU, upper=False, unit=True) @ U + L @ _tri(dLU, upper=True))


def _lu_solve_jvp(X, dots, LU, pivots, B, left, adjoint):
    dLU, dB = dots[0], dots[2]
    R = dB
    if dLU is not None:
        dA = _dA(dLU, *_unpack(LU, pivots))
        if adjoint:
            dA = _H(dA)
        R = _plus(R, -(dA @ X) if left else -(X @ dA))
    return torch.linalg.lu_solve(LU, pivots, R, left=left, adjoint=adjoint)


def _lu_solve_vjp(bars, X, needs, LU, pivots, B, left, adjoint):
    gB = torch.linalg.lu_solve(LU, pivots, bars[0], left=left, adjoint=not adjoint)
    gLU = None
    if needs[0]:
        if left:
            gA = -(X @ _H(gB)) if adjoint else -(gB @ _H(X))
        else:
            gA = -(_H(gB) @ X) if adjoint else -(_H(X) @ gB)
        P, L, U = _unpack(LU, pivots)
        gA = P.mT @ gA
        gLU = _tri(gA @ _H(U), upper=False, unit=True) + _tri(_H(L) @ gA, upper=True)
        gLU = unbroadcast(gLU, LU.shape)
    return gLU, None, (unbroadcast(gB, B.shape) if needs[2] else None)


def_linalg(aten.linalg_lu_solve.default, _lu_solve_jvp, _lu_solve_vjp)


# triangular_solve(B, A) = (op(A)^-1 B, A), op(A) = A^T when transpose (a plain transpose, as
# in torch). The solve reads one triangle of A (without the diagonal when unitriangular), so
# the solution's tangent and A's cotangent from it live in that triangle; torch's own jvp
# (torch 2.13) reads all of dA and ignores `transpose`, which finite differences contradict
# (docs/torch_func_differences.md). The second output is a copy of A: identity derivative.
def _triangular_solve_jvp(out, dots, B, A, upper, transpose, unitriangular):
    X = out[0]
    dB, dA = dots[0], dots[1]
    R = dB
    if dA is not None:
        dA_tri = _tri(dA, upper, unitriangular)
        R = _plus(R, -((dA_tri.mT if transpose else dA_tri) @ X))
    opA = A.mT if transpose else A
    dX = None if R is None else _solve_tri(opA, R, upper != transpose, unit=unitriangular)
    dM = None if dA is None else dA.expand(out[1].shape)
    return dX, dM


def _triangular_solve_vjp(bars, out, needs, B, A, upper, transpose, unitriangular):
    X = out[0]
    gX, gM = bars[0], bars[1]
    gB = gA = None
    if gX is not None:
        # op(A)^H is conj(A) (same triangle) when transpose, else A^H (the other triangle)
        opAh = _conj(A) if transpose else _H(A)
        gB = _solve_tri(opAh, gX, upper == transpose, unit=unitriangular)
        if needs[1]:
            gA = -(_conj(X) @ gB.mT) if transpose else -(gB @ _H(X))
            gA = _tri(gA, upper, unitriangular)
    gA = _plus(gA, gM)
    return (
        None if gB is None or not needs[0] else unbroadcast(gB, B.shape),
        None if gA is None or not needs[1] else unbroadcast(gA, A.shape),
    )


def_linalg(aten.triangular_solve.default, _triangular_solve_jvp, _triangular_solve_vjp)


# The legacy torch.cholesky(A, upper): linalg.cholesky_ex's rules (one output, no info).
# torch 2.15 removed it (aten.cholesky no longer exists, torch.cholesky raises).
if hasattr(aten, "cholesky"):
    def_linalg(
        aten.cholesky.default,
        lambda out, dots, A, upper: _cholesky_jvp((out,), dots, A, upper, False)[0],
        lambda bars, out, needs, A, upper: _cholesky_vjp(bars, (out,), needs, A, upper, False),
    )
