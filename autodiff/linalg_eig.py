"""Derivative rules of the general eigendecomposition and of the matrix exponential, written
with `def_linalg` (Note [Linalg derivative rules], autodiff/linalg.py)."""

from __future__ import annotations

import torch

from functransforms._core import TransformTensor
from functransforms.errors import IllDefinedDerivativeError

from .linalg import _H, _conj, _diag_embed, _inv_gaps, def_linalg

aten = torch.ops.aten


# -- eig ---------------------------------------------------------------------------------------
# Note [Derivatives of eig]
#     A V = V diag(L), V's columns scaled to norm 1 (LAPACK's, and torch's, convention). V and L
#     are complex even for a real A. With dP = V^-1 dA V and F = _inv_gaps(L)
#     (F_ij = 1 / (L_j - L_i), 0 on the diagonal):
#         dL = diag(dP),   dV = V (F o dP) - V diag(Re(V^H V (F o dP)))
#     (the last term keeps each column at norm 1). The vjp is its adjoint:
#         bar A = V^-H (diag(bar L) + conj(F) o (V^H bar V - V^H V diag(Re diag(V^H bar V)))) V^H
#     A column v_k is only defined up to a phase e^{i phi_k}; a loss that depends on that phase
#     has no derivative, which shows as Im diag(V^H bar V) != 0. torch's linalg_eig_backward
#     raises then (tolerance 1e-2, absolute and relative), and so do we: silently dropping that
#     part would give a gradient of a different function. torch skips the check when the values
#     are wrapped (under torch.func); we check the physical values behind every level, so
#     vmap(vjp) and jvp(vjp) raise too, where torch.func would return a number.
def _physical(x):
    """The plain tensor behind the wrappers of every level (a BatchedTensor's whole batch)."""
    while isinstance(x, TransformTensor):
        x = x._value if hasattr(x, "_value") else x._primal
    return x


def _check_phase_invariant(d):
    """Raise when ``Im d`` (d = diag(V^H bar V)) is not ~0 (Note [Derivatives of eig])."""
    im = _physical(d.imag)
    if isinstance(im, torch._subclasses.FakeTensor) or im.device.type == "meta":
        return  # a symbolic trace has no values to check
    with torch._C._DisableTorchDispatch():  # a value check, not part of the computation
        bad = im.abs().max().item() if im.numel() else 0.0
    if bad > 1e-2:
        raise IllDefinedDerivativeError(
            "linalg.eig backward: the eigenvectors of eig are defined only up to a phase "
            "e^{i phi} per column, and the cotangent of the eigenvectors is not invariant to it "
            f"(max |Im diag(V^H bar V)| = {bad:.3g}, expected < 1e-2), so the loss has no "
            "derivative (torch's linalg_eig_backward raises the same). Do: make the loss depend "
            "on the eigenvectors only through phase-invariant quantities (abs(V), "
            "V diag(.) V^-1, |v^H w|, ...), or use the eigenvalues alone."
        )


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
        _check_phase_invariant(d)
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
