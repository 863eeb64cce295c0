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
