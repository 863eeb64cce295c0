"""Low-rank operators: ``U V^H`` and ``diag(d) + U V^H`` (Woodbury solve, determinant lemma)."""

from __future__ import annotations

import torch

from ._base import LinearOperator, broadcast_batch, dense_cholesky
from ._dense import DiagonalOperator, ScaledIdentityOperator, _scaled_props


def _check_factor(U, name, call):
    if not isinstance(U, torch.Tensor):
        raise TypeError(
            f"{call}: expected `{name}` to be a torch.Tensor, received {type(U).__name__}."
        )
    if U.dim() < 2:
        raise ValueError(
            f"{call}: expected `{name}` of shape (..., n, r), received {tuple(U.shape)}."
        )


def _herm(A, B):
    """``A^H B`` for tall factors."""
    return A.mH @ B


class LowRankOperator(LinearOperator):
    """``U V^H`` with ``U`` of shape ``(..., m, r)`` and ``V`` of shape ``(..., n, r)``.

    ``V=None`` means ``V = U`` (a symmetric positive semi-definite operator). Matmul costs
    O((m + n) r k); the operator is singular when r < n (solve falls back to dense LU).

    Example:
        >>> import torch
        >>> from functransforms.linalg import LowRankOperator
        >>> U = torch.ones(4, 1)
        >>> K = LowRankOperator(U)  # [4, 4], rank 1
        >>> (K @ torch.ones(4)).tolist()  # [4]
        [4.0, 4.0, 4.0, 4.0]
    """

    _tree_fields = ("U", "V")
    _core_ndims = (2, 2)

    def __init__(self, U: torch.Tensor, V: torch.Tensor | None = None, **props):
        _check_factor(U, "U", "LowRankOperator(U, V)")
        if V is not None:
            _check_factor(V, "V", "LowRankOperator(U, V)")
            if V.shape[-1] != U.shape[-1]:
                raise ValueError(
                    f"LowRankOperator(U, V): expected U and V of one rank r, received "
                    f"{tuple(U.shape)} and {tuple(V.shape)}."
                )
        else:
            props["symmetric"] = True
        self.U, self.V = U, V
        Vt = U if V is None else V
        batch = broadcast_batch(U.shape[:-2], Vt.shape[:-2])
        super().__init__(batch + (U.shape[-2], Vt.shape[-2]), U.dtype, U.device, **props)

    @property
    def _V(self):
        return self.U if self.V is None else self.V

    def _repr_extra(self):
        return f"rank={self.U.shape[-1]}"

    def _matmul(self, X):
        return self.U @ _herm(self._V, X)

    def _rmatmul(self, X):
        return (X @ self.U) @ self._V.mH

    def _to_dense(self):
        return self.U @ self._V.mH

    def _transpose(self):
        if self.V is None:
            return self if not self.is_complex else LowRankOperator(self.U.conj())
        return LowRankOperator(self.V.conj(), self.U.conj())

    def _adjoint(self):
        return self if self.V is None else LowRankOperator(self.V, self.U)

    def _diagonal(self):
        k = min(self.shape[-2], self.shape[-1])
        return (self.U[..., :k, :] * self._V[..., :k, :].conj()).sum(-1)

    def _trace(self):
        return self._diagonal().sum(-1)

    def _frobenius_sq(self):
        # ||U V^H||_F^2 = tr(U^H U V^H V)
        return (_herm(self.U, self.U) * _herm(self._V, self._V).mT).sum((-2, -1)).real

    def _scale(self, c):
        V = self.V if self.V is not None else self.U
        return LowRankOperator(self.U * c, V, **_scaled_props(self, c))

    def _add(self, other):
        if isinstance(other, DiagonalOperator):
            return LowRankPlusDiagonalOperator(self.U, other.d, self.V, **_lr_props(self, other))
        if isinstance(other, ScaledIdentityOperator):
            d = other._diagonal()
            return LowRankPlusDiagonalOperator(self.U, d, self.V, **_lr_props(self, other))
        if isinstance(other, LowRankOperator):
            return LowRankOperator(
                torch.cat([self.U, other.U], -1), torch.cat([self._V, other._V], -1)
            )
        return None

    def _matmul_operator(self, other):
        if isinstance(other, LowRankOperator):  # U1 (V1^H U2) V2^H
            return LowRankOperator(self.U @ _herm(self._V, other.U), other._V)
        return None


def _lr_props(lr: LinearOperator, diag: LinearOperator) -> dict:
    return dict(
        symmetric=lr.symmetric and diag.symmetric,
        positive_definite=lr.symmetric and diag.positive_definite,
    )


class LowRankPlusDiagonalOperator(LinearOperator):
    """``diag(d) + U V^H``: Woodbury solve and determinant-lemma logdet in O(n r^2 + r^3).

    ``V=None`` means ``V = U`` (symmetric). Declare ``positive_definite=True`` (unchecked) when
    ``d > 0`` and ``V = U``, to use a Cholesky of the r x r capacitance matrix.

    Args:
        U: ``(..., n, r)``. d: ``(..., n)``. V: ``(..., n, r)`` or None.

    Example:
        >>> import torch
        >>> from functransforms.linalg import LowRankPlusDiagonalOperator
        >>> U = torch.ones(3, 1, dtype=torch.float64)
        >>> K = LowRankPlusDiagonalOperator(U, torch.ones(3, dtype=torch.float64))  # [3, 3]
        >>> round(torch.logdet(K).item(), 6) == round(torch.log(torch.tensor(4.0)).item(), 6)
        True
    """

    _tree_fields = ("U", "d", "V")
    _core_ndims = (2, 1, 2)

    def __init__(self, U: torch.Tensor, d: torch.Tensor, V: torch.Tensor | None = None, **props):
        call = "LowRankPlusDiagonalOperator(U, d, V)"
        _check_factor(U, "U", call)
        if not isinstance(d, torch.Tensor) or d.dim() < 1 or d.shape[-1] != U.shape[-2]:
            raise ValueError(
                f"{call}: expected d of shape (..., {U.shape[-2]}), received "
                f"{tuple(d.shape) if isinstance(d, torch.Tensor) else type(d).__name__}."
            )
        if V is not None:
            _check_factor(V, "V", call)
            if V.shape[-2:] != U.shape[-2:]:
                raise ValueError(
                    f"{call}: expected V of shape like U {tuple(U.shape)}, "
                    f"received {tuple(V.shape)}."
                )
        elif not d.is_complex():
            props["symmetric"] = True
        self.U, self.d, self.V = U, d, V
        n = U.shape[-2]
        batch = broadcast_batch(U.shape[:-2], d.shape[:-1], () if V is None else V.shape[:-2])
        super().__init__(batch + (n, n), U.dtype, U.device, **props)

    @property
    def _V(self):
        return self.U if self.V is None else self.V

    def _repr_extra(self):
        return f"rank={self.U.shape[-1]}"

    def _matmul(self, X):
        return self.d.unsqueeze(-1) * X + self.U @ _herm(self._V, X)

    def _rmatmul(self, X):
        return X * self.d.unsqueeze(-2) + (X @ self.U) @ self._V.mH

    def _to_dense(self):
        return torch.diag_embed(self.d) + self.U @ self._V.mH

    def _transpose(self):
        if self.V is None and not self.is_complex:
            return self
        return LowRankPlusDiagonalOperator(self._V.conj(), self.d, self.U.conj(), **self._props())

    def _adjoint(self):
        if self.V is None and not self.d.is_complex():
            return self
        return LowRankPlusDiagonalOperator(self._V, self.d.conj(), self.U, **self._props())

    def _diagonal(self):
        return self.d + (self.U * self._V.conj()).sum(-1)

    def _scale(self, c):
        return LowRankPlusDiagonalOperator(
            self.U * c, self.d * c, self._V, **_scaled_props(self, c)
        )

    def _add(self, other):
        if isinstance(other, (DiagonalOperator, ScaledIdentityOperator)):
            props = dict(symmetric=self.symmetric and other.symmetric)
            props["positive_definite"] = self.positive_definite and other.positive_definite
            return LowRankPlusDiagonalOperator(self.U, self.d + other._diagonal(), self.V, **props)
        return None

    def _capacitance(self):
        """``C = I_r + V^H D^{-1} U`` and ``D^{-1} U``."""
        DinvU = self.U / self.d.unsqueeze(-1)
        r = self.U.shape[-1]
        C = _herm(self._V, DinvU) + torch.eye(r, dtype=self.dtype, device=self.device)
        return C, DinvU

    def _solve(self, B):
        # Woodbury: (D + U V^H)^{-1} B = D^{-1} B - D^{-1} U C^{-1} V^H D^{-1} B
        C, DinvU = self._capacitance()
        DinvB = B / self.d.unsqueeze(-1)
        rhs = _herm(self._V, DinvB)
        if self.positive_definite:
            L = dense_cholesky(C, self)
            y = torch.linalg.solve_triangular(L, rhs, upper=False)
            y = torch.linalg.solve_triangular(L.mH, y, upper=True)
        else:
            y = torch.linalg.solve(C, rhs)
        return DinvB - DinvU @ y

    def _inverse(self):
        # (D + U V^H)^{-1} = D^{-1} + (-D^{-1} U C^{-1}) (D^{-H} V)^H
        C, DinvU = self._capacitance()
        Unew = -torch.linalg.solve(C, DinvU, left=False)  # D^{-1} U C^{-1}
        return LowRankPlusDiagonalOperator(
            Unew, 1 / self.d, self._V / self.d.conj().unsqueeze(-1), **self._props()
        )

    def _slogdet(self):
        # Matrix determinant lemma: det(D + U V^H) = det(D) det(I + V^H D^{-1} U)
        C, _ = self._capacitance()
        if self.positive_definite:
            L = dense_cholesky(C, self)
            logC = 2 * L.diagonal(dim1=-2, dim2=-1).abs().log().sum(-1)
            signC = torch.ones_like(logC)
        else:
            signC, logC = torch.linalg.slogdet(C)
        d = self.d
        signD = (d / d.abs()).prod(-1) if d.is_complex() else torch.sign(d).prod(-1)
        return signD * signC, d.abs().log().sum(-1) + logC

    def _trace(self):
        return self._diagonal().sum(-1)
