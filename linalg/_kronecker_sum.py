"""Kronecker sums ``A_1 ⊕ ... ⊕ A_k = sum_i I ⊗ ... ⊗ A_i ⊗ ... ⊗ I`` (square factors).

The discrete Laplacian on a grid is the Kronecker sum of 1-D Laplacians. With ``N = prod n_i``:

* matmul applies each ``A_i`` along its axis of ``X`` reshaped to ``(n_1, ..., n_k)``:
  O(N sum n_i);
* for symmetric factors ``A_i = Q_i Λ_i Q_i^T``: ``⊕ A_i = (⊗ Q_i)(⊕ Λ_i)(⊗ Q_i)^T``, with
  ``⊕ Λ_i`` diagonal (every sum ``λ_1[j_1] + ... + λ_k[j_k]``): solve and slogdet exact in
  O(sum n_i^3 + N sum n_i);
* ``(⊕ A_i) + s I = (A_1 + s I) ⊕ A_2 ⊕ ...``, ``(⊕ A_i)^T = ⊕ A_i^T``,
  ``tr(⊕ A_i) = sum_i (N / n_i) tr A_i``;
* nonsymmetric factors: solve and slogdet are the dense defaults.
"""

from __future__ import annotations

import torch

from ._base import LinearOperator, broadcast_batch, prod
from ._composite import ProductOperator, as_operator
from ._dense import IdentityOperator, PermutationOperator, ScaledIdentityOperator, _scaled_props
from ._kronecker import KroneckerOperator, kron_apply
from ._rules import add, diagonal, eigh, scale, slogdet, solve, trace


class KroneckerSumOperator(LinearOperator):
    """``A_1 ⊕ A_2 ⊕ ... = A_1 ⊗ I ⊗ ... + I ⊗ A_2 ⊗ ... + ...`` of square factors.

    Args:
        *factors: square operators or tensors ``(..., n_i, n_i)``.
        **props: declared properties (symmetric / positive definite are derived from the
            factors: a sum of symmetric (PD) terms is symmetric (PD)).

    Example:
        >>> import torch
        >>> from functransforms.linalg import KroneckerSumOperator
        >>> A = torch.tensor([[2.0, -1.0], [-1.0, 2.0]], dtype=torch.float64)
        >>> K = KroneckerSumOperator(A, A, symmetric=True)  # [4, 4]: the 2-D Laplacian
        >>> I = torch.eye(2, dtype=torch.float64)
        >>> torch.allclose(K.to_dense(), torch.kron(A, I) + torch.kron(I, A))
        True
        >>> x = torch.linalg.solve(K, torch.ones(4, dtype=torch.float64))  # [4], eigh of factors
    """

    _tree_fields = ("factors",)

    def __init__(self, *factors, **props):
        if len(factors) == 1 and isinstance(factors[0], (list, tuple)):
            factors = tuple(factors[0])
        call = "KroneckerSumOperator(*factors)"
        if not factors:
            raise ValueError(f"{call}: expected at least one factor.")
        fs = []
        for f in factors:
            if isinstance(f, torch.Tensor):
                sym = props.get("symmetric") or props.get("positive_definite")
                f = as_operator(f, call)
                f.symmetric = bool(sym)
            f = as_operator(f, call)
            if not f.is_square:
                raise ValueError(f"{call}: expected square factors, received {f!r}.")
            fs.append(f)
        self.factors = tuple(fs)
        for name in ("symmetric", "positive_definite"):
            props[name] = bool(props.get(name)) or all(getattr(f, name) for f in fs)
        props.update(lower=all(f.lower for f in fs), upper=all(f.upper for f in fs))
        batch = broadcast_batch(*(f.batch_shape for f in fs))
        N = prod(f.shape[-1] for f in fs)
        dtype = fs[0].dtype
        for f in fs[1:]:
            dtype = torch.promote_types(dtype, f.dtype)
        super().__init__(batch + (N, N), dtype, fs[0].device, **props)

    @classmethod
    def _from_children(cls, children, kwargs):
        return cls(*children[0], **kwargs)

    def _repr_extra(self):
        return " ⊕ ".join(repr(f) for f in self.factors)

    def _map(self, fn, **props):
        return KroneckerSumOperator(*[fn(f) for f in self.factors], **props)

    def _batch_getitem(self, batch_key):
        bshape = self.batch_shape
        return self._map(
            lambda f: f._expand_batch(bshape)._batch_getitem(batch_key), **self._props()
        )

    def _expand_batch(self, batch_shape):
        if self.batch_shape == torch.Size(batch_shape):
            return self
        return self._map(lambda f: f._expand_batch(batch_shape), **self._props())

    def _identities(self):
        return [IdentityOperator(f.shape[-1], dtype=f.dtype, device=f.device) for f in self.factors]

    def _terms(self, ops, X):
        eye = self._identities()
        out = None
        for i, f in enumerate(ops):
            term = kron_apply(eye[:i] + [f] + eye[i + 1 :], X)
            out = term if out is None else out + term
        return out

    def _matmul(self, X):
        return self._terms(self.factors, X)

    def _rmatmul(self, X):
        return self._terms([f._transpose() for f in self.factors], X.mT).mT

    def _transpose(self):
        return self._map(lambda f: f._transpose(), **_swapped(self))

    def _adjoint(self):
        return self._map(lambda f: f._adjoint(), **_swapped(self))

    def _to_dense(self):
        eye = self._identities()
        out = None
        for i, f in enumerate(self.factors):
            term = KroneckerOperator(*(eye[:i] + [f] + eye[i + 1 :]))._to_dense()
            out = term if out is None else out + term
        return out

    def _eig_parts(self):
        """``(⊕ λ_i, [Q_i])`` for symmetric factors."""
        pairs = [eigh(f) for f in self.factors]
        return kron_sum_vectors([p[0] for p in pairs]), [p[1] for p in pairs]

    def _logdet_pd(self, scale=1):
        lam, _ = self._eig_parts()
        return scale * lam.log().sum(-1)


def _swapped(A):
    props = A._props()
    props["lower"], props["upper"] = A.upper, A.lower
    return props


def kron_sum_vectors(vs) -> torch.Tensor:
    """``⊕ v_i``: every sum ``v_1[j_1] + ... + v_k[j_k]``, row-major, ``(..., prod n_i)``."""
    out = vs[0]
    for v in vs[1:]:
        out = (out.unsqueeze(-1) + v.unsqueeze(-2)).flatten(-2)
    return out


@diagonal.register(KroneckerSumOperator)
def _diagonal_kronecker_sum(A):
    # diag(⊕ A_i) = ⊕ diag(A_i)
    return kron_sum_vectors([diagonal(f) for f in A.factors])


@trace.register(KroneckerSumOperator)
def _trace_kronecker_sum(A):
    # tr(⊕ A_i) = sum_i (N / n_i) tr A_i
    N = A.shape[-1]
    return sum((N // f.shape[-1]) * trace(f) for f in A.factors)


@scale.register(KroneckerSumOperator)
def _scale_kronecker_sum(A, c):
    # c (⊕ A_i) = ⊕ c A_i
    return A._map(lambda f: scale(f, c), **_scaled_props(A, c))


@add.register(KroneckerSumOperator)
def _add_kronecker_sum(A, B):
    # (⊕ A_i) + s I = (A_1 + s I) ⊕ A_2 ⊕ ...; (⊕ A_i) + (⊕ B_i) = ⊕ (A_i + B_i), one shape
    if isinstance(B, ScaledIdentityOperator) and not isinstance(B, IdentityOperator):
        f0 = A.factors[0]
        first = f0 + ScaledIdentityOperator(B.scale, f0.shape[-1])
        props = {"symmetric": A.symmetric and B.symmetric}
        return KroneckerSumOperator(first, *A.factors[1:], **props)
    if isinstance(B, KroneckerSumOperator) and [f.shape[-1] for f in A.factors] == [
        f.shape[-1] for f in B.factors
    ]:
        return KroneckerSumOperator(*[a + b for a, b in zip(A.factors, B.factors)])
    return None


@solve.register(KroneckerSumOperator)
def _solve_kronecker_sum(A, B):
    # (⊕ A_i)^{-1} B = (⊗ Q_i) (⊕ Λ_i)^{-1} (⊗ Q_i)^T B for symmetric factors
    if not A.symmetric or A.is_complex:
        return solve.dispatch(LinearOperator)(A, B)
    lam, Qs = A._eig_parts()
    Y = kron_apply([q._transpose() for q in Qs], B)
    return kron_apply(Qs, Y / lam.unsqueeze(-1))


@slogdet.register(KroneckerSumOperator)
def _slogdet_kronecker_sum(A):
    # det(⊕ A_i) = prod over the grid of (λ_1[j_1] + ... + λ_k[j_k]) for symmetric factors
    if not A.symmetric or A.is_complex:
        return slogdet.dispatch(LinearOperator)(A)
    lam, _ = A._eig_parts()
    return torch.sign(lam).prod(-1), lam.abs().log().sum(-1)


@eigh.register(KroneckerSumOperator)
def _eigh_kronecker_sum(A):
    # ⊕ A_i = (⊗ Q_i)(⊕ Λ_i)(⊗ Q_i)^T, eigenvalues sorted by a permutation
    lam, Qs = A._eig_parts()
    lam, idx = torch.sort(lam, dim=-1)
    Q = KroneckerOperator(*Qs, unitary=True)
    return lam, ProductOperator([Q, PermutationOperator(idx, dtype=A.dtype).mT], unitary=True)
