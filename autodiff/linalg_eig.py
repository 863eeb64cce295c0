"""Derivative rules of the general eigendecomposition and of the matrix exponential, written
with `def_linalg` (Note [Linalg derivative rules], autodiff/linalg.py)."""

from __future__ import annotations

import torch

from .linalg import _H, _conj, _diag_embed, _inv_gaps, check_phase_invariant, def_linalg

aten = torch.ops.aten


# -- eig ---------------------------------------------------------------------------------------
# Note [Derivatives of eig]
#     A V = V diag(L), V's columns scaled to norm 1 (LAPACK's, and torch's, convention). V and L
#     are complex even for a real A. With dP = V^-1 dA V and F = _inv_gaps(L)
#     (F_ij = 1 / (L_j - L_i), 0 on the diagonal):
#         dL = diag(dP),   dV = V (F o dP) - V diag(Re(V^H V (F o dP)))
#     (the last term keeps each column at norm 1). The vjp is its adjoint:
#         bar A = V^-H (diag(bar L) + conj(F) o (V^H bar V - V^H V diag(Re diag(V^H bar V)))) V^H
#     A loss that depends on the columns' phases raises (Note [Phase-dependent losses]).
def _eig_jvp(out, dots, A):
    L, V = out
    dA = dots[0].to(V.dtype)
    dP = torch.linalg.solve(V, dA @ V)
    dV = V @ (dP * _inv_gaps(L))
    norm = (_H(V) @ dV).diagonal(0, -2, -1).real  # d|v_k|^2 / 2 before the correction
    return dP.diagonal(0, -2, -1), dV - V * norm.unsqueeze(-2)


def _eig_vjp(bars, out, needs, A):
    gL, gV = bars
    L, V = out
    Vh = _H(V)
    gP = None if gL is None else _diag_embed(gL, V)
    if gV is not None:
        VhgV = Vh @ gV
        d = VhgV.diagonal(0, -2, -1)
        check_phase_invariant(d.imag, "linalg.eig")
        X = (VhgV - Vh @ (V * d.real.unsqueeze(-2))) * _conj(_inv_gaps(L))
        gP = X if gP is None else gP + X
    return (torch.linalg.solve(Vh, gP @ Vh),)


def_linalg(aten.linalg_eig.default, _eig_jvp, _eig_vjp)


# -- matrix_exp --------------------------------------------------------------------------------
# The derivative of exp at A in direction E is the top-right block of exp([[A, E], [0, A]])
# (Mathias 1996; torch's differential_analytic_matrix_function). Its adjoint for the real inner
# product is the same map at A^H: bar A = top-right block of exp([[A^H, bar X], [0, A^H]]).
# The rules call matrix_exp itself, so they differentiate again (hessians double the block).
def _exp_frechet(A, E):
    n = A.shape[-1]
    if E.dtype != A.dtype:  # a real matrix with a complex tangent / cotangent
        dtype = torch.promote_types(A.dtype, E.dtype)
        A, E = A.to(dtype), E.to(dtype)
    top = torch.cat([A, E], -1)
    bottom = torch.cat([torch.zeros_like(A), A], -1)
    return torch.linalg.matrix_exp(torch.cat([top, bottom], -2))[..., :n, n:]


def_linalg(
    aten.linalg_matrix_exp.default,
    lambda out, dots, A: _exp_frechet(A, dots[0]),
    lambda bars, out, needs, A: (_exp_frechet(_H(A), bars[0]),),
)


# -- matrix_sqrth and polar (torch >= 2.15) ----------------------------------------------------
# Note [Derivatives of matrix_sqrth and polar]
#     S = sqrth(A) solves S S = A, so S dS + dS S = dA: a Sylvester equation. In the eigenbasis
#     of S (S = V diag(s) V^H) it is diagonal: (V^H dS V)_ij = (V^H dA V)_ij / (s_i + s_j).
#     That map (`_sylvester`) is self-adjoint for the real inner product, so it is also the vjp.
#     torch applies it to the Hermitian part of the tangent / cotangent (checked against
#     PyTorch on 2.15), as the op reads a Hermitian A and S is Hermitian.
#     polar: A = U H with H = sqrth(A^H A) (n x n), so dH = _sylvester(dA^H A + A^H dA) and
#     dU = (dA - U dH) H^-1. Adjoint: G = _sylvester(bar H - U^H bar U H^-1),
#     bar A = bar U H^-1 + A (G + G^H). The rules use only
#     differentiable ops, so they differentiate again (jvp of vjp, hessians); like eigh, a
#     repeated eigenvalue gives non-finite second derivatives. matrix_sqrth's rules take V, s
#     from eigh(A) (s = sqrt of its eigenvalues), not eigh(S): their own derivative then sees
#     the whole (non-Hermitian) tangent of A through eigh's rule, as torch's does (jvp(vjp)
#     differs otherwise); polar's take them from eigh(H).
#     For complex inputs the value is computed from eigh / svd (`forward=`), because torch 2.15's
#     kernels are wrong when called inside __torch_dispatch__ (Note [matrix_sqrth and polar
#     inside __torch_dispatch__], batching/linalg.py), which is where the rules run.
def _sylvester(S, X, squared=False):
    s, V = torch.linalg.eigh(S)
    if squared:  # S is A = sqrth(A)^2
        s = s.sqrt()
    X = X.to(V.dtype)
    return V @ ((_H(V) @ X @ V) / (s.unsqueeze(-1) + s.unsqueeze(-2))) @ _H(V)


def _herm(X):
    return (X + _H(X)) / 2


def _polar_jvp(out, dots, A):
    U, Hm = out
    dA = dots[0]
    dH = _sylvester(Hm, _H(dA) @ A + _H(A) @ dA)
    dU = torch.linalg.solve(Hm, dA - U @ dH, left=False)
    return dU, dH


def _polar_vjp(bars, out, needs, A):
    gU, gH = bars
    U, Hm = out
    gA = None
    if gU is not None:
        gU = gU.to(U.dtype)
        gA = torch.linalg.solve(Hm, gU, left=False)  # bar U H^-1 (H is Hermitian)
        gH2 = -(_H(U) @ gA)
        gH = gH2 if gH is None else gH + gH2
    if gH is not None:
        G = _sylvester(Hm, gH)
        gH_A = A @ (G + _H(G))
        gA = gH_A if gA is None else gA + gH_A
    return (gA,)


def _complex_by_formula(op, formula):
    return lambda A: formula(A) if A.is_complex() else op(A)


if hasattr(aten, "linalg_matrix_sqrth"):
    from functransforms.batching.linalg import _sqrth

    def_linalg(
        aten.linalg_matrix_sqrth.default,
        lambda out, dots, A: _sylvester(A, _herm(dots[0]), squared=True),
        lambda bars, out, needs, A: (_sylvester(A, _herm(bars[0]), squared=True),),
        forward=_complex_by_formula(aten.linalg_matrix_sqrth.default, _sqrth),
    )
if hasattr(aten, "linalg_polar"):
    from functransforms.batching.linalg import _polar

    def_linalg(
        aten.linalg_polar.default,
        _polar_jvp,
        _polar_vjp,
        forward=_complex_by_formula(aten.linalg_polar.default, _polar),
    )
