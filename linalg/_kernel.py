"""Lazy kernel (Gram) matrices ``K[i, j] = k(x_i, x'_j)`` and the fused ``inv_quad_logdet``.

`KernelOperator` never stores K beyond a block of rows: ``K @ V`` evaluates ``k`` on
``chunk_size`` rows of ``X1`` at a time (O(chunk n) memory; reverse mode keeps each block's
intermediates, as any recorded computation does), or on everything at once when ``m n`` is
small. Its hyperparameters are tensor children, so grad, jvp and vmap see them.
"""

from __future__ import annotations

import torch

from ._base import LinearOperator, broadcast_batch, dense_cholesky
from ._rules import diagonal, slogdet, solve

# below this many entries, K is formed in one kernel call (fewer, larger operations)
_DENSE_ENTRIES = 1 << 20


def rbf(X1, X2, lengthscale, variance):
    """``variance * exp(-|x - x'|^2 / (2 lengthscale^2))``, batched over leading dims.

    Example:
        >>> import torch
        >>> from functransforms.linalg import rbf
        >>> X = torch.tensor([[0.0], [1.0]], dtype=torch.float64)
        >>> round(rbf(X, X, torch.tensor(1.0), torch.tensor(2.0))[0, 1].item(), 6)  # 2 exp(-1/2)
        1.213061
    """
    d2 = _sqdist(X1 / lengthscale, X2 / lengthscale)
    return variance * torch.exp(-0.5 * d2)


def matern52(X1, X2, lengthscale, variance):
    """Matérn 5/2: ``variance (1 + √5 r + 5 r^2 / 3) exp(-√5 r)``, ``r = |x - x'| / lengthscale``.

    Example:
        >>> import torch
        >>> from functransforms.linalg import matern52
        >>> X = torch.zeros(1, 2, dtype=torch.float64)
        >>> matern52(X, X, torch.tensor(1.0), torch.tensor(3.0)).item()
        3.0
    """
    d2 = _sqdist(X1 / lengthscale, X2 / lengthscale)
    r = torch.sqrt(d2 + 1e-30 * (d2 == 0))  # finite derivative at r = 0 (where it is 0)
    s5 = 5.0**0.5
    return variance * (1 + s5 * r + (5.0 / 3.0) * d2) * torch.exp(-s5 * r)


def _sqdist(A, B):
    # |a|^2 + |b|^2 - 2 a.b, clamped at 0 (rounding)
    sq = (A * A).sum(-1).unsqueeze(-1) + (B * B).sum(-1).unsqueeze(-2) - 2 * A @ B.mT
    return sq.clamp_min(0)


class KernelOperator(LinearOperator):
    """``K[i, j] = kernel(X1, X2, *params)[i, j]``, evaluated in row blocks, never stored whole.

    Args:
        kernel: ``(X1 (..., p, d), X2 (..., q, d), *params) -> (..., p, q)``, batched over
            leading dimensions (`rbf`, `matern52`, or your own).
        X1: ``(..., m, d)`` points. X2: ``(..., n, d)`` points, or None for ``X2 = X1`` (then
            the operator is declared symmetric; declare ``positive_definite=True`` yourself for
            a positive definite kernel on distinct points).
        params: the kernel's tensors (lengthscales, variances): children, differentiated.
        chunk_size: rows per kernel evaluation in ``K @ V`` (default: all when ``m n`` is at
            most 2^20 entries, else enough rows for about 2^20 entries).

    Solves and log determinants are the dense defaults (exact, O(n^3)), or CG / SLQ on request.

    Example:
        >>> import torch
        >>> from functransforms.linalg import KernelOperator, rbf
        >>> X = torch.linspace(0, 1, 5, dtype=torch.float64).unsqueeze(-1)  # [5, 1]
        >>> params = (torch.tensor(0.3).double(), torch.tensor(1.0).double())  # l, variance
        >>> K = KernelOperator(rbf, X, params=params, chunk_size=2)  # [5, 5]
        >>> v = torch.ones(5, dtype=torch.float64)
        >>> torch.allclose(K @ v, rbf(X, X, *params) @ v)
        True
    """

    _tree_fields = ("X1", "X2", "params")
    _static_fields = ("kernel", "chunk_size")

    def __init__(self, kernel, X1, X2=None, *, params=(), chunk_size=None, **props):
        call = "KernelOperator(kernel, X1, X2)"
        if not callable(kernel):
            raise TypeError(f"{call}: expected `kernel` to be callable, received {kernel!r}.")
        for name, X in (("X1", X1), ("X2", X2)):
            if X is not None and (not isinstance(X, torch.Tensor) or X.dim() < 2):
                raise ValueError(
                    f"{call}: expected `{name}` of shape (..., points, features), received "
                    f"{tuple(X.shape) if isinstance(X, torch.Tensor) else type(X).__name__}."
                )
        if X2 is not None and X2.shape[-1] != X1.shape[-1]:
            raise ValueError(
                f"{call}: X1 and X2 have different numbers of features ({X1.shape[-1]} and "
                f"{X2.shape[-1]})."
            )
        self.kernel, self.X1, self.X2 = kernel, X1, X2
        self.params = tuple(params)
        self.chunk_size = chunk_size
        if X2 is None:
            props["symmetric"] = True
        Y = X1 if X2 is None else X2
        batch = broadcast_batch(X1.shape[:-2], Y.shape[:-2])
        super().__init__(batch + (X1.shape[-2], Y.shape[-2]), X1.dtype, X1.device, **props)

    @classmethod
    def _from_children(cls, children, kwargs):
        X1, X2, params = children
        kernel = kwargs.pop("kernel")
        return cls(kernel, X1, X2, params=params, **kwargs)

    def _repr_extra(self):
        return f"kernel={getattr(self.kernel, '__name__', type(self.kernel).__name__)}"

    @property
    def _Y(self):
        return self.X1 if self.X2 is None else self.X2

    def _batch_getitem(self, batch_key):
        if any(isinstance(p, torch.Tensor) and p.dim() > 0 for p in self.params):
            raise NotImplementedError(
                f"{self!r}[batch index]: the kernel's params are broadcast by the kernel itself, "
                "so their batch dimensions are unknown. Index X1, X2 and params yourself and "
                "build a new KernelOperator (or vmap over them)."
            )
        return super()._batch_getitem(batch_key)

    def _child_core_ndims(self, children):
        return (2, 2, 0)

    def _block(self, rows):
        return self.kernel(self.X1[..., rows, :], self._Y, *self.params)

    def _rows_per_chunk(self):
        m, n = self.shape[-2:]
        if self.chunk_size is not None:
            return int(self.chunk_size)
        return m if m * n <= _DENSE_ENTRIES else max(1, _DENSE_ENTRIES // n)

    def _matmul(self, X):
        m = self.shape[-2]
        c = self._rows_per_chunk()
        if c >= m:
            return self.kernel(self.X1, self._Y, *self.params) @ X
        return torch.cat([self._block(slice(i, i + c)) @ X for i in range(0, m, c)], -2)

    def _to_dense(self):
        return self.kernel(self.X1, self._Y, *self.params)

    def _transpose(self):
        if self.X2 is None:
            return self
        return KernelOperator(
            _swapped(self.kernel), self.X2, self.X1, params=self.params, chunk_size=self.chunk_size
        )


def _swapped(kernel):
    def transposed(A, B, *params):
        return kernel(B, A, *params).mT

    transposed.__name__ = f"{getattr(kernel, '__name__', 'kernel')}_transposed"
    return transposed


@diagonal.register(KernelOperator)
def _diagonal_kernel(A):
    # K[i, i] = k(x_i, x'_i): n kernel calls on 1x1 blocks, batched
    n = min(A.shape[-2:])
    a = A.X1[..., :n, :].unsqueeze(-2)  # (..., n, 1, d)
    b = A._Y[..., :n, :].unsqueeze(-2)
    return A.kernel(a, b, *A.params)[..., 0, 0]


def inv_quad_logdet(A, b, *, logdet: bool = True):
    """``(b^H A^{-1} b, log det A)`` for a positive definite operator, sharing one
    factorization where the operator is solved densely (one Cholesky instead of two).

    ``b``: ``(..., n)`` (one quadratic form per vector) or ``(..., n, k)`` (summed over the k
    columns, as gpytorch's ``inv_quad_logdet``). Structured operators use their own solve and
    log determinant rules (each exact). Derivatives: those of the solve and the log det.

    Example:
        >>> import torch
        >>> from functransforms.linalg import DenseOperator, inv_quad_logdet
        >>> A = DenseOperator(torch.tensor([[2.0, 0.0], [0.0, 4.0]]), positive_definite=True)
        >>> q, ld = inv_quad_logdet(A, torch.tensor([2.0, 2.0]))
        >>> round(q.item(), 6), round(ld.item(), 5)  # 4/2 + 4/4, log 8
        (3.0, 2.07944)
    """
    if not isinstance(A, LinearOperator) or not A.positive_definite:
        raise ValueError(
            f"inv_quad_logdet(A, b): expected a LinearOperator declared positive_definite, "
            f"received {A!r}. Declare positive_definite=True (a promise), or call "
            "torch.linalg.solve and torch.linalg.slogdet separately."
        )
    vec = b.dim() == 1 or b.shape == A.shape[:-1]
    B = b.unsqueeze(-1) if vec else b
    dense_rule = solve.dispatch(type(A)) is solve.dispatch(LinearOperator)
    if dense_rule and slogdet.dispatch(type(A)) is slogdet.dispatch(LinearOperator):
        Lc = dense_cholesky(A._to_dense(), A)
        W = torch.linalg.solve_triangular(Lc, B, upper=False)
        quad = (W * W.conj()).real.sum((-2, -1))
        if not logdet:
            return quad, None
        d = Lc.diagonal(dim1=-2, dim2=-1)
        return quad, 2 * (d.real if d.is_complex() else d).log().sum(-1)
    X = torch.linalg.solve(A, B)
    quad = (B.conj() * X).real.sum((-2, -1))
    return quad, (torch.logdet(A) if logdet else None)
