"""Root and inverse-root decompositions, the matrix square root, stochastic diagonal estimation
and the pivoted-Cholesky preconditioner.

* ``root_decomposition(A) = R`` with ``A = R R^H``: the Cholesky factor through A's structure
  (a Kronecker of factors' Cholesky factors, a diagonal's square root, ...), exact;
* ``root_inv_decomposition(A) = S`` with ``A^{-1} = S S^H``: ``S = L^{-H}``, exact;
* ``sqrtm(A) = Q Λ^{1/2} Q^H`` from A's structured `eigh` (symmetric positive semi-definite A),
  exact, an operator (a product through the eigenvectors' structure);
* ``estimate_diagonal(A)``: ``E[z ∘ A z]`` over Rademacher probes z (Bekas, Kokiopoulou and
  Saad), unbiased, opt-in, for operators whose diagonal has no structured rule;
* ``pivoted_cholesky_preconditioner(K, noise, rank)``: ``L_k L_k^T + s I`` from k steps of
  pivoted Cholesky of K (Harbrecht, Peters and Schneider; gpytorch's default preconditioner),
  a `LowRankPlusDiagonalOperator` solved by Woodbury: a preconditioner for
  ``solve(K + s I, b, method="cg", preconditioner=...)``.
"""

from __future__ import annotations

import torch

from ._base import LinearOperator, _try_bool
from ._composite import ProductOperator
from ._dense import DiagonalOperator
from ._functions import cholesky, eigh, inv
from ._iterative import _probes
from ._lowrank import LowRankPlusDiagonalOperator
from ._rules import diagonal


def _require_pd(A, call):
    if not isinstance(A, LinearOperator) or not A.positive_definite:
        raise ValueError(
            f"{call}: expected a LinearOperator declared positive_definite, received {A!r}."
        )


def root_decomposition(A: LinearOperator) -> LinearOperator:
    """``R`` with ``A = R R^H`` (the lower Cholesky factor, through A's structure).

    Example:
        >>> import torch
        >>> from functransforms.linalg import KroneckerOperator, root_decomposition
        >>> K = KroneckerOperator(torch.eye(2) * 4, torch.eye(2) * 9, positive_definite=True)
        >>> R = root_decomposition(K)  # a Kronecker of the factors' Cholesky factors
        >>> type(R).__name__, R.diagonal().tolist()
        ('KroneckerOperator', [6.0, 6.0, 6.0, 6.0])
    """
    _require_pd(A, "root_decomposition(A)")
    return cholesky(A)


def root_inv_decomposition(A: LinearOperator) -> LinearOperator:
    """``S`` with ``A^{-1} = S S^H``: ``S = L^{-H}`` for the Cholesky factor ``L`` of A.

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator, root_inv_decomposition
        >>> A = DiagonalOperator(torch.tensor([4.0, 16.0]), positive_definite=True)
        >>> S = root_inv_decomposition(A)  # [2, 2], A^{-1} = S S^T
        >>> S.diagonal().tolist()
        [0.5, 0.25]
    """
    _require_pd(A, "root_inv_decomposition(A)")
    return inv(cholesky(A))._adjoint()


def sqrtm(A: LinearOperator) -> LinearOperator:
    """The principal square root ``Q Λ^{1/2} Q^H`` of a symmetric positive semi-definite
    operator, through its structured eigendecomposition (an operator, never dense unless A's
    `eigh` is).

    Example:
        >>> import torch
        >>> from functransforms.linalg import DenseOperator, sqrtm
        >>> A = DenseOperator(torch.tensor([[5.0, 4.0], [4.0, 5.0]]), positive_definite=True)
        >>> S = sqrtm(A)  # [[2, 1], [1, 2]]
        >>> torch.allclose(S.to_dense(), torch.tensor([[2.0, 1.0], [1.0, 2.0]]))
        True
    """
    if not isinstance(A, LinearOperator) or not A.symmetric:
        raise ValueError(
            f"sqrtm(A): expected a LinearOperator declared symmetric (positive semi-definite), "
            f"received {A!r}."
        )
    evals, Q = eigh(A)
    root = DiagonalOperator(evals.clamp_min(0).sqrt().to(A.dtype))
    return ProductOperator([Q, root, Q._adjoint()], symmetric=True)


def estimate_diagonal(A: LinearOperator, *, num_probes: int = 64, generator=None):
    """Stochastic estimate of ``diag(A)``: ``mean_i z_i ∘ (A z_i)`` over Rademacher probes
    (unbiased; the error of entry j shrinks as ``sqrt(sum_{k != j} A_jk^2 / num_probes)``).
    Opt-in: ``A.diagonal()`` stays exact. Differentiable (linear in A's products).

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator, estimate_diagonal
        >>> estimate_diagonal(DiagonalOperator(torch.tensor([1.0, 2.0])), num_probes=4).tolist()
        [1.0, 2.0]
    """
    if not isinstance(A, LinearOperator) or not A.is_square:
        raise ValueError(f"estimate_diagonal(A): expected a square LinearOperator, received {A!r}.")
    Z = _probes(A.shape[-1], num_probes, A, generator)
    return (Z.conj() * A._matmul(Z)).mean(-1)


def pivoted_cholesky(K: LinearOperator, rank: int, *, tol: float = 0.0):
    """``L_k`` (``(..., n, k)``) with ``K ≈ L_k L_k^T``: k steps of pivoted Cholesky, each
    reading one row of K (``K[..., i, :]``, a product with a unit vector) and K's diagonal.
    Stops early (when the values are readable) once the trace of the remainder is
    ``<= tol * trace(K)``.

    Example:
        >>> import torch
        >>> from functransforms.linalg import LowRankOperator, pivoted_cholesky
        >>> U = torch.randn(6, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        >>> Lk = pivoted_cholesky(LowRankOperator(U), 2)  # rank 2 recovered exactly
        >>> torch.allclose(Lk @ Lk.mT, U @ U.mT)
        True
    """
    n = K.shape[-1]
    rank = min(int(rank), n)
    d = diagonal(K).clone()
    total = d.sum(-1)
    eye = torch.eye(n, dtype=K.dtype, device=K.device)
    cols = []
    for _ in range(rank):
        i = d.argmax(-1)  # (...,) pivots
        e = eye[i]  # (..., n) unit rows
        row = K._rmatmul(e.unsqueeze(-2)).squeeze(-2)  # K[..., i, :]
        piv = torch.gather(d, -1, i.unsqueeze(-1)).clamp_min(torch.finfo(K.dtype).tiny).sqrt()
        col = row
        for c in cols:  # subtract the previous columns' contribution
            col = col - torch.gather(c, -1, i.unsqueeze(-1)) * c
        col = col / piv
        cols.append(col)
        d = (d - col * col.conj()).clamp_min(0) if not d.is_complex() else d - col * col.conj()
        if tol > 0 and _try_bool((d.sum(-1) <= tol * total).all()):
            break
    return torch.stack(cols, -1)


def pivoted_cholesky_preconditioner(
    K: LinearOperator, noise, rank: int = 10
) -> LowRankPlusDiagonalOperator:
    """``L_k L_k^T + noise I`` (Woodbury solves, O(n k^2)), a preconditioner for conjugate
    gradients on ``K + noise I``: ``solve(K + s I, b, method="cg", preconditioner=P)``.

    Example:
        >>> import torch
        >>> from functransforms.linalg import KernelOperator, rbf, pivoted_cholesky_preconditioner
        >>> X = torch.linspace(0, 1, 100, dtype=torch.float64).unsqueeze(-1)  # [100, 1]
        >>> p = (torch.tensor(0.2, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
        >>> P = pivoted_cholesky_preconditioner(KernelOperator(rbf, X, params=p), 1e-2, rank=8)
        >>> type(P).__name__
        'LowRankPlusDiagonalOperator'
    """
    Lk = pivoted_cholesky(K, rank)
    if not isinstance(noise, torch.Tensor):
        noise = torch.tensor(noise, dtype=K.dtype, device=K.device)
    d = noise.unsqueeze(-1).expand(K.shape[:-1])
    return LowRankPlusDiagonalOperator(Lk.detach(), d.detach(), positive_definite=True)
