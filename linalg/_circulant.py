"""Circulant operators (diagonalized by the FFT) and the circulant preconditioner of a Toeplitz
operator.

``C[i, j] = c[(i - j) mod n]`` has eigenvalues ``λ = fft(c)`` and eigenvectors the Fourier
basis, so with ``F`` the DFT:

* ``C x = ifft(λ ∘ fft(x))``, ``C^{-1} b = ifft(fft(b) / λ)``: exact, O(n log n);
* ``det C = prod λ_k``: for real ``c`` the λ come in conjugate pairs, so
  ``sign det C = sign(λ_0) sign(λ_{n/2})`` (n even) and ``log|det C| = sum log|λ_k|``;
* ``C^{-1}``, ``C^T``, ``C_1 C_2``, ``C_1 + C_2``, ``C + s I`` are circulant.

T. Chan's optimal circulant approximation of a Toeplitz ``T`` (the circulant closest to T in the
Frobenius norm), ``c_k = ((n - k) t_k + k t_{k - n}) / n``, is a cheap preconditioner for CG on
Toeplitz systems: `circulant_preconditioner`.
"""

from __future__ import annotations

import torch

from ._base import LinearOperator
from ._dense import ScaledIdentityOperator, _scaled_props
from ._rules import add, diagonal, inv, matmul, scale, slogdet, solve, trace
from ._structured import ToeplitzOperator


class CirculantOperator(LinearOperator):
    """The circulant matrix ``C[i, j] = column[(i - j) mod n]``: FFT matmul and exact FFT solve.

    Args:
        column: the first column, ``(..., n)``.
        **props: declared properties (``symmetric`` when ``column[k] == column[n - k]``).

    Example:
        >>> import torch
        >>> from functransforms.linalg import CirculantOperator
        >>> C = CirculantOperator(torch.tensor([4.0, 1.0, 0.0, 1.0], dtype=torch.float64))
        >>> C.to_dense()[1].tolist()  # [4, 4]: row 1
        [1.0, 4.0, 1.0, 0.0]
        >>> x = torch.linalg.solve(C, torch.ones(4, dtype=torch.float64))  # [4], by FFT
        >>> x.tolist()
        [0.16666666666666666, 0.16666666666666666, 0.16666666666666666, 0.16666666666666666]
    """

    _tree_fields = ("column",)
    _core_ndims = (1,)

    def __init__(self, column: torch.Tensor, **props):
        if not isinstance(column, torch.Tensor) or column.dim() < 1:
            raise TypeError(
                "CirculantOperator(column): expected a tensor of shape (..., n), received "
                f"{column!r}."
            )
        self.column = column
        n = column.shape[-1]
        super().__init__(column.shape[:-1] + (n, n), column.dtype, column.device, **props)

    def _complex(self, X=None):
        return self.is_complex or (X is not None and X.is_complex())

    def _eigenvalues(self):
        """``fft(column)`` (``rfft`` for real columns: the first n // 2 + 1 eigenvalues)."""
        if self.is_complex:
            return torch.fft.fft(self.column)
        return torch.fft.rfft(self.column)

    def _apply(self, lam_fn, X):
        n = self.shape[-1]
        Xt = X.mT  # (..., k, n)
        if self._complex(X):
            lam = torch.fft.fft(self.column.to(torch.promote_types(self.dtype, X.dtype)))
            return torch.fft.ifft(lam_fn(lam.unsqueeze(-2), torch.fft.fft(Xt))).mT
        lam = torch.fft.rfft(self.column)
        return torch.fft.irfft(lam_fn(lam.unsqueeze(-2), torch.fft.rfft(Xt)), n=n).mT

    def _matmul(self, X):
        return self._apply(torch.mul, X)

    def _to_dense(self):
        n = self.shape[-1]
        i = torch.arange(n, device=self.device)
        return self.column[..., (i.unsqueeze(-1) - i.unsqueeze(-2)) % n]

    def _transpose(self):
        # C^T[i, j] = c[(j - i) mod n]: the column reversed after its first entry
        c = self.column
        return CirculantOperator(torch.cat([c[..., :1], c[..., 1:].flip(-1)], -1), **self._props())

    def _adjoint(self):
        if not self.is_complex:
            return self._transpose()
        c = self.column.conj()
        return CirculantOperator(torch.cat([c[..., :1], c[..., 1:].flip(-1)], -1), **self._props())

    def _frobenius_sq(self):
        return self.shape[-1] * (self.column * self.column.conj()).real.sum(-1)


@diagonal.register(CirculantOperator)
def _diagonal_circulant(A):
    # every diagonal entry is c_0
    return A.column[..., :1].expand(A.batch_shape + (A.shape[-1],))


@trace.register(CirculantOperator)
def _trace_circulant(A):
    # tr C = n c_0
    return A.shape[-1] * A.column[..., 0]


@scale.register(CirculantOperator)
def _scale_circulant(A, c):
    # a C is circulant
    return CirculantOperator(A.column * c, **_scaled_props(A, c))


@add.register(CirculantOperator)
def _add_circulant(A, B):
    # C_1 + C_2 = circ(c_1 + c_2); C + s I = circ(c + s e_0)
    if isinstance(B, CirculantOperator):
        return CirculantOperator(A.column + B.column, symmetric=A.symmetric and B.symmetric)
    if isinstance(B, ScaledIdentityOperator):
        e0 = torch.zeros(A.shape[-1], dtype=A.dtype, device=A.device)
        e0[0] = 1
        column = A.column + B.scale.unsqueeze(-1) * e0
        return CirculantOperator(column, symmetric=A.symmetric and B.symmetric)
    return None


@matmul.register(CirculantOperator)
def _matmul_circulant(A, B):
    # circ(a) circ(b) = circ(a ⊛ b) (circular convolution): the eigenvalues multiply
    if isinstance(B, CirculantOperator):
        return CirculantOperator(A._matmul(B.column.unsqueeze(-1)).squeeze(-1))
    return None


@solve.register(CirculantOperator)
def _solve_circulant(A, B):
    # C^{-1} B = ifft(fft(B) / λ)
    return A._apply(lambda lam, fb: fb / lam, B)


@inv.register(CirculantOperator)
def _inv_circulant(A):
    # C^{-1} = circ(C^{-1} e_0)
    e0 = torch.zeros_like(A.column)
    e0 = torch.cat([torch.ones_like(e0[..., :1]), e0[..., 1:]], -1)
    return CirculantOperator(_solve_circulant(A, e0.unsqueeze(-1)).squeeze(-1), **A._props())


@slogdet.register(CirculantOperator)
def _slogdet_circulant(A):
    # det C = prod_k λ_k, λ = fft(c)
    n = A.shape[-1]
    if A.is_complex:
        lam = torch.fft.fft(A.column)
        return (lam / lam.abs()).prod(-1), lam.abs().log().sum(-1)
    lam = torch.fft.rfft(A.column)  # λ_0 .. λ_{n//2}; the rest are conjugates of λ_1 ..
    logs = lam.abs().log()
    pairs = logs[..., 1 : (n + 1) // 2]  # λ_k and λ_{n-k} = conj λ_k
    logabs = logs[..., 0] + 2 * pairs.sum(-1)
    sign = torch.sign(lam[..., 0].real)
    if n % 2 == 0:
        logabs = logabs + logs[..., n // 2]
        sign = sign * torch.sign(lam[..., n // 2].real)
    return sign, logabs


def circulant_preconditioner(T: ToeplitzOperator) -> CirculantOperator:
    """T. Chan's optimal circulant approximation of a Toeplitz operator, a preconditioner for
    ``solve(T, b, method="cg", preconditioner=circulant_preconditioner(T))``:
    ``c_k = ((n - k) t_k + k t_{k - n}) / n`` (the circulant nearest to T in Frobenius norm).

    Example:
        >>> import torch
        >>> from functransforms.linalg import ToeplitzOperator, circulant_preconditioner, solve
        >>> t = 1.0 / (1.0 + torch.arange(200, dtype=torch.float64)) ** 2  # decaying, SPD
        >>> T = ToeplitzOperator(t, positive_definite=True)  # [200, 200]
        >>> b = torch.ones(200, dtype=torch.float64)
        >>> x = solve(T, b, method="cg", tol=1e-12, preconditioner=circulant_preconditioner(T))
        >>> torch.allclose(T @ x, b)
        True
    """
    if not isinstance(T, ToeplitzOperator):
        raise TypeError(
            f"circulant_preconditioner(T): expected a ToeplitzOperator, received {T!r}."
        )
    n = T.shape[-1]
    col, row = T.column, T._r()
    k = torch.arange(n, dtype=col.real.dtype if col.is_complex() else col.dtype, device=col.device)
    wrapped = torch.cat([torch.zeros_like(row[..., :1]), row[..., 1:].flip(-1)], -1)  # t_{k-n}
    c = ((n - k) * col + k * wrapped) / n
    return CirculantOperator(c, symmetric=T.symmetric)
