"""Kronecker products ``A_1 ⊗ ... ⊗ A_k`` and ``(A_1 ⊗ ... ⊗ A_k) + s I``.

Every algorithm goes through the factors: with ``N = prod n_i``,

* ``(⊗ A_i) vec(X)`` applies each ``A_i`` along its axis of ``X`` reshaped to ``(n_1, ..., n_k)``
  (row-major ``vec``, as ``torch.kron``): O(N sum n_i) instead of O(N^2).
* ``(⊗ A_i)^{-1} = ⊗ A_i^{-1}``, ``chol(⊗ A_i) = ⊗ chol(A_i)``, ``(⊗ A_i)^T = ⊗ A_i^T``.
* ``logdet(⊗ A_i) = sum_i (N / n_i) logdet(A_i)``.
* ``eigh(⊗ A_i)``: eigenvalues ``⊗ λ_i``, eigenvectors ``⊗ Q_i`` (sorted by a permutation).
* ``(⊗ A_i) + s I = (⊗ Q_i)(⊗ Λ_i + s I)(⊗ Q_i)^T`` for symmetric factors: solve and logdet in
  O(sum n_i^3 + N sum n_i).
"""

from __future__ import annotations

import torch

from ._base import _PROPERTY_NAMES as _PROPS
from ._base import LinearOperator, broadcast_batch, prod
from ._composite import ProductOperator, matmul
from ._dense import (
    DenseOperator,
    DiagonalOperator,
    PermutationOperator,
    ScaledIdentityOperator,
    _scaled_props,
    _transposed_props,
    pd_logdet_sum,
)
from ._kronecker_eig import KroneckerEigLogdet, KroneckerEigSolve, call, grid_eigenvalues
from ._rules import add, cholesky, diagonal, eigh, inv, scale, slogdet, solve, svd, trace
from ._rules import matmul as matmul_rule


def _matmul_of(f, X):
    return f._matmul(X)


def kron_apply(factors, X: torch.Tensor, method=_matmul_of) -> torch.Tensor:
    """Apply ``⊗ f`` (each factor through ``method(f, ·)``, its matmul by default, or a rule
    such as `solve`) to ``X`` of shape ``(..., N, k)``."""
    if len(factors) == 2 and X.dim() == 2 and X.shape[-1] == 1:
        # (A ⊗ B) vec(M) = vec(A M B^T) for row-major vec: two matrix operations, one copy.
        f0, f1 = factors
        M = X.reshape(f0._shape[-1], f1._shape[-1])
        Y = method(f0, M)  # A M
        Z = method(f1, Y.mT)  # B (A M)^T
        if Z.dim() == 2:
            Zt = Z.mT if type(Z) is torch.Tensor else _compact(Z.mT)
            return Zt.reshape(-1, 1)
        return _compact(Z.mT).reshape(Z.shape[:-2] + (-1, 1))
    ns = [f.shape[-1] for f in factors]
    batch, k = X.shape[:-2], X.shape[-1]
    T = X.reshape(batch + tuple(ns) + (k,))
    nb = len(batch)
    dims = list(ns)
    last = len(factors) - 1
    for i, f in enumerate(factors):
        if i == last and i and k == 1:
            # The last factor acts on the trailing axis: f (T as rows)^T, no permutation needed
            # on the way in (the solvers take the transposed view as is).
            Z = T.reshape(batch + (-1, dims[i]))
            out = method(f, Z.mT)  # (batch..., m_i, rest)
            dims[i] = out.shape[-2]
            batch = out.shape[:-2]
            return _compact(out.mT).reshape(batch + (prod(dims), 1))
        # T: (batch..., d_0, ..., d_{K-1}, k) -> (batch..., d_i, rest) -> f -> back
        Ti = _compact(T.movedim(nb + i, nb)) if i else T
        rest = Ti.shape[nb + 1 :]
        out = method(f, Ti.reshape(batch + (dims[i], -1)))
        dims[i] = out.shape[-2]
        batch = out.shape[:-2]
        nb = len(batch)
        T = out.reshape(batch + (dims[i],) + rest)
        if i:
            T = _compact(T.movedim(nb, nb + i))
    return T.reshape(batch + (prod(dims), k))


def _compact(t: torch.Tensor) -> torch.Tensor:
    # Note [Copy before reshaping a permuted tensor]: `reshape` would copy here anyway; an
    # explicit contiguous clone keeps wrapper tensors (whose strides are nominal) from turning
    # the reshape into a `view` of a permuted inner tensor.
    return t.clone(memory_format=torch.contiguous_format)


def kron_vectors(vs) -> torch.Tensor:
    """``v_1 ⊗ ... ⊗ v_k`` of batches of vectors ``(..., n_i)`` -> ``(..., prod n_i)``."""
    out = vs[0]
    for v in vs[1:]:
        out = (out.unsqueeze(-1) * v.unsqueeze(-2)).flatten(-2)
    return out


class KroneckerOperator(LinearOperator):
    """``A_1 ⊗ A_2 ⊗ ... ⊗ A_k`` (any number of factors, operators or tensors; row-major vec).

    Args:
        *factors: operators or tensors of shapes ``(..., m_i, n_i)``.
        **props: declared properties of the product; when a factor is a plain tensor, a
            declared ``symmetric``/``positive_definite`` is also declared on that factor.

    Example:
        >>> import torch
        >>> from functransforms.linalg import KroneckerOperator
        >>> A, B = torch.eye(2) * 2, torch.eye(3) * 3
        >>> K = KroneckerOperator(A, B, positive_definite=True)  # [6, 6]
        >>> torch.allclose(K.to_dense(), torch.kron(A, B))
        True
        >>> y = torch.linalg.solve(K, torch.ones(6))  # [6], through the 2x2 and 3x3 factors
    """

    _tree_fields = ("factors",)

    def __init__(self, *factors, **props):
        if len(factors) == 1 and isinstance(factors[0], (list, tuple)):
            factors = tuple(factors[0])
        if not factors:
            raise ValueError("KroneckerOperator(*factors): expected at least one factor.")
        sym = props.get("symmetric", False)
        pd = props.get("positive_definite", False)
        fs = []
        for f in factors:
            if isinstance(f, torch.Tensor):
                if f.dim() < 2:
                    raise ValueError(
                        "KroneckerOperator(*factors): expected matrices of shape (..., m, n), "
                        f"received a tensor of shape {tuple(f.shape)}."
                    )
                f = DenseOperator._from_tensor(f, bool(sym), bool(pd))
            elif not isinstance(f, LinearOperator):
                raise TypeError(
                    "KroneckerOperator(*factors): expected operators or tensors, received "
                    f"{type(f).__name__}."
                )
            fs.append(f)
        self.factors = factors = tuple(fs)
        for name in _PROPS:
            if not props.get(name):
                props[name] = all([getattr(f, name) for f in factors])
        batch = broadcast_batch(*[f._shape[:-2] for f in factors])
        m = n = 1
        dtype = factors[0]._dtype
        for f in factors:
            m *= f._shape[-2]
            n *= f._shape[-1]
            if f._dtype != dtype:
                dtype = torch.promote_types(dtype, f._dtype)
        super().__init__(batch + (m, n), dtype, factors[0]._device, **props)

    @classmethod
    def _from_children(cls, children, kwargs):
        return cls(*children[0], **kwargs)

    def _repr_extra(self):
        return " ⊗ ".join(repr(f) for f in self.factors)

    def _map(self, fn, **props) -> KroneckerOperator:
        return KroneckerOperator(*[fn(f) for f in self.factors], **props)

    def _batch_getitem(self, batch_key):
        bshape = self.batch_shape
        return self._map(
            lambda f: f._expand_batch(bshape)._batch_getitem(batch_key), **self._props()
        )

    def _expand_batch(self, batch_shape):
        if self.batch_shape == torch.Size(batch_shape):
            return self
        return self._map(lambda f: f._expand_batch(batch_shape), **self._props())

    def _matmul(self, X):
        return kron_apply(self.factors, X)

    def _rmatmul(self, X):
        return kron_apply([f._transpose() for f in self.factors], X.mT).mT

    def _to_dense(self):
        out = self.factors[0]._to_dense()
        for f in self.factors[1:]:
            B = f._to_dense()
            out = (
                (out[..., :, None, :, None] * B[..., None, :, None, :])
                .flatten(-4, -3)
                .flatten(-2, -1)
            )
        return out

    def _transpose(self):
        return self._map(lambda f: f._transpose(), **_transposed_props(self))

    def _adjoint(self):
        return self._map(lambda f: f._adjoint(), **_transposed_props(self))

    def _logdet_pd(self, scale=1):
        # logdet(⊗ A_i) = sum_i (N / n_i) logdet(A_i): the dense PD factors in one weighted
        # sum (Note [Differentiating log det]), the others by their own structure.
        N = self._shape[-1]
        weights, mats, out = [], [], None
        for f in self.factors:
            c = scale * (N // f._shape[-1])
            if type(f) is DenseOperator and f.positive_definite:
                weights.append(c)
                mats.append(f.A)
            else:
                term = f._logdet_pd(c)
                out = term if out is None else out + term
        if mats:
            term = pd_logdet_sum(tuple(weights), *mats)
            out = term if out is None else out + term
        return out

    def _frobenius_sq(self):
        out = self.factors[0]._frobenius_sq()
        for f in self.factors[1:]:
            out = out * f._frobenius_sq()
        return out


@diagonal.register(KroneckerOperator)
def _diagonal_kronecker(A):
    # diag(⊗ A_i) = ⊗ diag(A_i)
    return kron_vectors([diagonal(f) for f in A.factors])


@scale.register(KroneckerOperator)
def _scale_kronecker(A, c):
    # c (A_1 ⊗ A_2 ⊗ ...) = (c A_1) ⊗ A_2 ⊗ ...
    fs = list(A.factors)
    fs[0] = scale(fs[0], c)
    return KroneckerOperator(*fs, **_scaled_props(A, c))


@matmul_rule.register(KroneckerOperator)
def _matmul_kronecker(A, B):
    # (⊗ A_i)(⊗ B_i) = ⊗ (A_i B_i) when the factor shapes chain.
    if isinstance(B, KroneckerOperator) and len(B.factors) == len(A.factors):
        if all(a.shape[-1] == b.shape[-2] for a, b in zip(A.factors, B.factors)):
            return KroneckerOperator(*[matmul(a, b) for a, b in zip(A.factors, B.factors)])
    return None


@add.register(KroneckerOperator)
def _add_kronecker(A, B):
    # (⊗ A_i) + s I keeps the factors' eigendecompositions usable (symmetric factors)
    if isinstance(B, ScaledIdentityOperator) and A.symmetric and A.is_square:
        return KroneckerPlusScaledIdentityOperator(A, B.scale)
    return None


@solve.register(KroneckerOperator)
def _solve_kronecker(A, B):
    # (⊗ A_i)^{-1} = ⊗ A_i^{-1}
    return kron_apply(A.factors, B, solve)


@inv.register(KroneckerOperator)
def _inv_kronecker(A):
    # inv(⊗ A_i) = ⊗ inv(A_i)
    return A._map(lambda f: inv(f), **A._props())


@slogdet.register(KroneckerOperator)
def _slogdet_kronecker(A):
    # det(⊗ A_i) = prod_i det(A_i)^(N / n_i)
    N = A.shape[-1]
    sign, logabs = None, None
    for f in A.factors:
        s, l = slogdet(f)
        p = N // f.shape[-1]
        s, l = s**p, p * l
        sign, logabs = (s, l) if sign is None else (sign * s, logabs + l)
    return sign, logabs


@cholesky.register(KroneckerOperator)
def _cholesky_kronecker(A):
    # chol(⊗ A_i) = ⊗ chol(A_i)
    return A._map(lambda f: cholesky(f))


@eigh.register(KroneckerOperator)
def _eigh_kronecker(A):
    # ⊗ (Q_i Λ_i Q_i^T) = (⊗ Q_i)(⊗ Λ_i)(⊗ Q_i)^T, eigenvalues sorted by a permutation
    pairs = [eigh(f) for f in A.factors]
    evals = kron_vectors([p[0] for p in pairs])
    evals, idx = torch.sort(evals, dim=-1)
    Q = KroneckerOperator(*[p[1] for p in pairs], unitary=True)
    return evals, ProductOperator([Q, PermutationOperator(idx, dtype=A.dtype).mT], unitary=True)


@svd.register(KroneckerOperator)
def _svd_kronecker(A):
    # ⊗ (U_i S_i V_i^H) = (⊗ U_i)(⊗ S_i)(⊗ V_i)^H, singular values sorted by a permutation
    triples = [svd(f) for f in A.factors]
    s = kron_vectors([t[1] for t in triples])
    s, idx = torch.sort(s, dim=-1, descending=True)
    P = PermutationOperator(idx, dtype=A.dtype).mT
    U = ProductOperator([KroneckerOperator(*[t[0] for t in triples]), P])
    Vh = ProductOperator([P.mT, KroneckerOperator(*[t[2] for t in triples])])
    return U, s, Vh


@trace.register(KroneckerOperator)
def _trace_kronecker(A):
    # tr(⊗ A_i) = prod_i tr(A_i)
    out = trace(A.factors[0])
    for f in A.factors[1:]:
        out = out * trace(f)
    return out


class KroneckerPlusScaledIdentityOperator(LinearOperator):
    """``(A_1 ⊗ ... ⊗ A_k) + s I`` with symmetric factors (a GP kernel on a grid plus noise).

    Solve, logdet, eigh and inverse go through the factors' eigendecompositions
    ``A_i = Q_i Λ_i Q_i^T``: ``K + s I = (⊗ Q_i)(⊗ Λ_i + s)(⊗ Q_i)^T``.

    Args:
        kron: a symmetric KroneckerOperator. scale: ``s``, a scalar tensor (or batch of them).

    Example:
        >>> import torch
        >>> from functransforms.linalg import KroneckerOperator, ScaledIdentityOperator
        >>> A = torch.eye(2, dtype=torch.float64)
        >>> s = ScaledIdentityOperator(torch.tensor(1.0, dtype=torch.float64), 4)
        >>> K = KroneckerOperator(A, A, symmetric=True) + s  # [4, 4]
        >>> type(K).__name__, torch.logdet(K).item() == 4 * torch.log(torch.tensor(2.0)).item()
        ('KroneckerPlusScaledIdentityOperator', True)
    """

    _tree_fields = ("kron", "scale")
    _core_ndims = (0, 0)

    def __init__(self, kron: KroneckerOperator, scale, **props):
        if not isinstance(kron, KroneckerOperator) or not kron.symmetric:
            raise TypeError(
                "KroneckerPlusScaledIdentityOperator(kron, scale): expected a symmetric "
                f"KroneckerOperator, received {kron!r}."
            )
        if not isinstance(scale, torch.Tensor):
            scale = torch.tensor(scale, dtype=kron.dtype, device=kron.device)
        self.kron, self.scale = kron, scale
        props["symmetric"] = True
        props["positive_definite"] = props.get("positive_definite") or kron.positive_definite
        super().__init__(
            broadcast_batch(kron.batch_shape, scale.shape) + kron.shape[-2:],
            kron.dtype,
            kron.device,
            **props,
        )

    def _repr_extra(self):
        return repr(self.kron) + " + s I"

    def _expand_batch(self, batch_shape):
        if self.batch_shape == torch.Size(batch_shape):
            return self
        return KroneckerPlusScaledIdentityOperator(
            self.kron._expand_batch(batch_shape), self.scale.expand(batch_shape), **self._props()
        )

    def _s(self):
        return self.scale.unsqueeze(-1)

    def _matmul(self, X):
        return self.kron._matmul(X) + self._s().unsqueeze(-1) * X

    def _rmatmul(self, X):
        return self.kron._rmatmul(X) + self._s().unsqueeze(-1) * X

    def _to_dense(self):
        eye = torch.eye(self.shape[-1], dtype=self.dtype, device=self.device)
        return self.kron._to_dense() + self._s().unsqueeze(-1) * eye

    def _transpose(self):
        return self

    def _factor_eigh(self):
        pairs = [eigh(f) for f in self.kron.factors]
        lam = kron_vectors([p[0] for p in pairs]) + self._s()
        return lam, [p[1] for p in pairs]

    def _eig_constants(self):
        """``(k, *A_i, *λ_i, *Q_i, Λ)``: the factors' tensors, eigendecompositions of their
        constant copies and the eigenvalue grid ``Λ = ⊗ λ_i + s``, for
        the eigenbasis nodes (Note [Kronecker plus noise in its eigenbasis]): computed once per
        operator (a solve and a logdet share them) and again only if a factor's tensor was
        replaced or written in place; None unless every factor is a real symmetric dense one."""
        fs = self.kron.factors
        if self.is_complex or not all(type(f) is DenseOperator and f.symmetric for f in fs):
            return None
        As = tuple(f.A for f in fs)
        key = [(id(A), A._version) for A in As] + [(id(self.scale), self.scale._version)]
        cached = self.__dict__.get("_eig_cache")
        if cached is not None and cached[0] == key:
            return cached[1]
        lams, Qs = [], []
        for A in As:
            lam, Q = torch.linalg.eigh(A.detach())
            lams.append(lam)
            Qs.append(Q)
        Lam = grid_eigenvalues(lams, self.scale.detach())
        out = (len(As), *As, *lams, *Qs, Lam)
        # the tensors themselves are kept in the entry, so the ids in the key stay theirs
        self._eig_cache = (key, out, self.scale)
        return out

    def _solve_closed_form(self, B):
        eig = self._eig_constants() if B.dtype == self.dtype else None
        if eig is None:
            return None
        k, *tensors = eig
        return call(KroneckerEigSolve, B, self.scale, k, 0, *tensors)

    def _logdet_pd(self, scale=1):
        eig = self._eig_constants()
        if eig is not None:
            out = call(KroneckerEigLogdet, self.scale, *eig)
            return out if scale == 1 else scale * out
        lam, _ = self._factor_eigh()
        return scale * lam.log().sum(-1)


@diagonal.register(KroneckerPlusScaledIdentityOperator)
def _diagonal_kronecker_plus_scaled_identity(A):
    # diag(K + s I) = diag(K) + s
    return diagonal(A.kron) + A._s()


@scale.register(KroneckerPlusScaledIdentityOperator)
def _scale_kronecker_plus_scaled_identity(A, c):
    # c (K + s I) = c K + (c s) I
    return KroneckerPlusScaledIdentityOperator(scale(A.kron, c), A.scale * c, **_scaled_props(A, c))


@add.register(KroneckerPlusScaledIdentityOperator)
def _add_kronecker_plus_scaled_identity(A, B):
    # (K + s I) + t I = K + (s + t) I
    if isinstance(B, ScaledIdentityOperator):
        return KroneckerPlusScaledIdentityOperator(A.kron, A.scale + B.scale, **A._props())
    return None


@solve.register(KroneckerPlusScaledIdentityOperator)
def _solve_kronecker_plus_scaled_identity(A, B):
    # (K + s I)^{-1} B = (⊗ Q_i) (⊗ Λ_i + s)^{-1} (⊗ Q_i)^H B
    lam, Qs = A._factor_eigh()
    Y = kron_apply([Q._transpose() if not A.is_complex else Q._adjoint() for Q in Qs], B)
    return kron_apply(Qs, Y / lam.unsqueeze(-1))


@inv.register(KroneckerPlusScaledIdentityOperator)
def _inv_kronecker_plus_scaled_identity(A):
    # inv(K + s I) = (⊗ Q_i) diag(1 / (⊗ Λ_i + s)) (⊗ Q_i)^H
    lam, Qs = A._factor_eigh()
    Q = KroneckerOperator(*Qs, unitary=True)
    return ProductOperator([Q, DiagonalOperator(1 / lam), Q._adjoint()], symmetric=True)


@slogdet.register(KroneckerPlusScaledIdentityOperator)
def _slogdet_kronecker_plus_scaled_identity(A):
    # det(K + s I) = prod (⊗ Λ_i + s)
    eig = A._eig_constants()
    if eig is not None:  # one node (Note [Kronecker plus noise in its eigenbasis])
        sign = torch.sign(eig[-1]).prod(-1)  # of the constant eigenvalue grid
        return sign, call(KroneckerEigLogdet, A.scale, *eig)
    lam, _ = A._factor_eigh()
    return torch.sign(lam).prod(-1), lam.abs().log().sum(-1)


@eigh.register(KroneckerPlusScaledIdentityOperator)
def _eigh_kronecker_plus_scaled_identity(A):
    # the eigenvectors of K, the eigenvalues shifted by s (Cholesky: the dense default, as
    # (⊗ Q_i) sqrt(⊗ Λ_i + s) is a root, not triangular)
    lam, Qs = A._factor_eigh()
    lam, idx = torch.sort(lam, dim=-1)
    Q = KroneckerOperator(*Qs, unitary=True)
    return lam, ProductOperator([Q, PermutationOperator(idx, dtype=A.dtype).mT], unitary=True)


@trace.register(KroneckerPlusScaledIdentityOperator)
def _trace_kronecker_plus_scaled_identity(A):
    # tr(K + s I) = tr(K) + n s
    return trace(A.kron) + A.shape[-1] * A.scale
