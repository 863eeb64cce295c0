"""Elementary operators: Dense, Diagonal, Identity, ScaledIdentity, Triangular, Permutation,
and the dense defaults of every structure rule (registered for `LinearOperator`)."""

from __future__ import annotations

import torch

from functransforms._custom import custom_vjp

from ._base import (
    LinearOperator,
    _sign_prod,
    broadcast_batch,
    dense_cholesky,
    warn_dense_algorithm,
)
from ._rules import (
    add,
    cholesky,
    diagonal,
    eigh,
    inv,
    matmul,
    rmatmul,
    scale,
    slogdet,
    solve,
    svd,
    trace,
)


def _as_tensor(x, name: str, call: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    raise TypeError(f"{call}: expected `{name}` to be a torch.Tensor, received {type(x).__name__}.")


def _check_matrix(A: torch.Tensor, call: str, square: bool = True) -> None:
    if A.dim() < 2 or (square and A.shape[-1] != A.shape[-2]):
        kind = "a (batch of) square matrices" if square else "a (batch of) matrices"
        raise ValueError(
            f"{call}: expected {kind} of shape (..., n, n), received {tuple(A.shape)}."
        )


class _StoredMatrix:
    """The methods of an operator that stores its matrix as ``self.A`` (Dense, Triangular);
    transposes keep the operator's type."""

    def _matmul(self, X):
        return self.A @ X

    def _rmatmul(self, X):
        return X @ self.A

    def _to_dense(self):
        return self.A

    def _stores_dense(self):
        return True

    def _transpose(self):
        return type(self)(self.A.mT, **_transposed_props(self))

    def _adjoint(self):
        return type(self)(self.A.mH, **_transposed_props(self))


@diagonal.register(_StoredMatrix)
def _diagonal_stored_matrix(A):
    # the stored matrix's diagonal
    return A.A.diagonal(dim1=-2, dim2=-1)


class DenseOperator(_StoredMatrix, LinearOperator):
    """A plain matrix seen as an operator (dense algorithms, chosen by the declared properties).

    Args:
        A: tensor of shape ``(..., m, n)``.
        **props: ``symmetric``, ``positive_definite``, ``lower``, ``upper``, ``unitary``, ``check``.

    Example:
        >>> import torch
        >>> from functransforms.linalg import DenseOperator
        >>> A = DenseOperator(torch.eye(3) * 2, positive_definite=True)  # [3, 3]
        >>> round(torch.logdet(A).item(), 5)  # 3 log 2
        2.07944
    """

    _tree_fields = ("A",)
    _core_ndims = (2,)

    def __init__(self, A: torch.Tensor, **props):
        A = _as_tensor(A, "A", "DenseOperator(A)")
        _check_matrix(A, "DenseOperator(A)", square=False)
        self.A = A
        super().__init__(A.shape, A.dtype, A.device, **props)

    @classmethod
    def _from_tensor(
        cls, A: torch.Tensor, symmetric: bool, positive_definite: bool
    ) -> DenseOperator:
        """Fast construction from a matrix already known to be a square tensor (internal)."""
        op = cls.__new__(cls)
        op.A = A
        op._shape, op._dtype, op._device = A.shape, A.dtype, A.device
        op.symmetric = symmetric or positive_definite
        op.positive_definite = positive_definite
        op.lower = op.upper = op.unitary = False
        return op


@scale.register(DenseOperator)
def _scale_dense(A, c):
    # c A, kept dense
    return DenseOperator(A.A * c, **_scaled_props(A, c))


@add.register(DenseOperator)
def _add_dense(A, B):
    # Dense + Dense is one dense matrix
    if isinstance(B, DenseOperator):
        return DenseOperator(A.A + B.A, **_sum_props(A, B))
    return None


@matmul.register(DenseOperator)
def _matmul_dense(A, B):
    # Dense @ Dense is one dense matrix (unitary if both are)
    if isinstance(B, DenseOperator):
        return DenseOperator(A.A @ B.A, unitary=A.unitary and B.unitary)
    return None


class DiagonalOperator(LinearOperator):
    """``diag(d)``: O(n) matmul, solve, logdet, eigh; Diagonal algebra stays diagonal.

    Args:
        d: diagonal of shape ``(..., n)``.

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator
        >>> D = DiagonalOperator(torch.tensor([2.0, 4.0]))  # [2, 2]
        >>> torch.linalg.solve(D, torch.tensor([2.0, 2.0])).tolist()  # [2]
        [1.0, 0.5]
    """

    _tree_fields = ("d",)
    _core_ndims = (1,)

    def __init__(self, d: torch.Tensor, **props):
        d = _as_tensor(d, "d", "DiagonalOperator(d)")
        if d.dim() < 1:
            raise ValueError(
                "DiagonalOperator(d): expected a diagonal of shape (..., n), received a scalar; "
                "use ScaledIdentityOperator(scale, n)."
            )
        self.d = d
        n = d.shape[-1]
        props.update(lower=True, upper=True)
        if not d.is_complex():
            props["symmetric"] = True
        super().__init__(d.shape[:-1] + (n, n), d.dtype, d.device, **props)

    def _matmul(self, X):
        return self.d.unsqueeze(-1) * X

    def _rmatmul(self, X):
        return X * self.d.unsqueeze(-2)

    def _to_dense(self):
        return torch.diag_embed(self.d)

    def _transpose(self):
        return self

    def _adjoint(self):
        return DiagonalOperator(self.d.conj(), **self._props()) if self.is_complex else self

    def _frobenius_sq(self):
        return (self.d * self.d.conj()).real.sum(-1)


@diagonal.register(DiagonalOperator)
def _diagonal_diagonal(A):
    # diag(diag(d)) = d
    return A.d


@scale.register(DiagonalOperator)
def _scale_diagonal(A, c):
    # c diag(d) = diag(c d)
    return DiagonalOperator(A.d * c, **_scaled_props(A, c))


@add.register(DiagonalOperator)
def _add_diagonal(A, B):
    # diag(d) + diag(e) = diag(d + e), diag(d) + s I = diag(d + s); a dense or triangular
    # matrix absorbs a diagonal without changing its kind
    if isinstance(B, DiagonalOperator):
        return DiagonalOperator(A.d + B.d, **_sum_props(A, B))
    if isinstance(B, ScaledIdentityOperator):
        return DiagonalOperator(A.d + B.scale.unsqueeze(-1), **_sum_props(A, B))
    if isinstance(B, (DenseOperator, TriangularOperator)):
        return type(B)._from_children(
            [B._to_dense() + A._to_dense()],
            {**_sum_props(A, B), **_static(B)},
        )
    return None


@matmul.register(DiagonalOperator)
def _matmul_diagonal(A, B):
    # diag(d) diag(e) = diag(d e), diag(d) (s I) = diag(s d)
    if isinstance(B, DiagonalOperator):
        return DiagonalOperator(A.d * B.d)
    if isinstance(B, ScaledIdentityOperator):
        return DiagonalOperator(A.d * B.scale.unsqueeze(-1))
    return None


@solve.register(DiagonalOperator)
def _solve_diagonal(A, B):
    # diag(d)^{-1} B = B / d (row-wise)
    return B / A.d.unsqueeze(-1)


@inv.register(DiagonalOperator)
def _inv_diagonal(A):
    # diag(d)^{-1} = diag(1 / d)
    return DiagonalOperator(1 / A.d, **A._props())


@slogdet.register(DiagonalOperator)
def _slogdet_diagonal(A):
    # det diag(d) = prod d
    return _sign_prod(A.d), A.d.abs().log().sum(-1)


@cholesky.register(DiagonalOperator)
def _cholesky_diagonal(A):
    # chol diag(d) = diag(sqrt d) (d > 0)
    return DiagonalOperator(A.d.sqrt())


@eigh.register(DiagonalOperator)
def _eigh_diagonal(A):
    # the eigenvalues are d sorted, the eigenvectors the sorting permutation
    evals, idx = torch.sort(A.d.real if A.is_complex else A.d, dim=-1)
    return evals, PermutationOperator(idx, dtype=A.dtype).mT


@svd.register(DiagonalOperator)
def _svd_diagonal(A):
    # diag(d) = U diag(s) V^H with s = |d| sorted descending, V = columns e_idx, U = V phase.
    s, idx = torch.sort(A.d.abs(), dim=-1, descending=True)
    V = PermutationOperator(idx, dtype=A.dtype).mT
    dsorted = torch.gather(A.d, -1, idx)
    phase = torch.where(s > 0, dsorted / torch.where(s > 0, s, 1), 1).to(A.dtype)
    return V @ DiagonalOperator(phase), s, V.mH  # a lazy product


@trace.register(DiagonalOperator)
def _trace_diagonal(A):
    # tr diag(d) = sum d
    return A.d.sum(-1)


class ScaledIdentityOperator(LinearOperator):
    """``c * I_n`` (``c`` a scalar or a batch of scalars of shape ``batch_shape``).

    Example:
        >>> import torch
        >>> from functransforms.linalg import ScaledIdentityOperator
        >>> S = ScaledIdentityOperator(torch.tensor(3.0), 4)  # [4, 4]
        >>> torch.logdet(S).item() == 4 * torch.log(torch.tensor(3.0)).item()
        True
    """

    _tree_fields = ("scale",)
    _static_fields = ("n",)
    _core_ndims = (0,)

    def __init__(self, scale, n: int, *, like=None, dtype=None, device=None, **props):
        if not isinstance(scale, torch.Tensor):
            dtype = dtype or (like.dtype if like is not None else torch.get_default_dtype())
            device = device or (like.device if like is not None else None)
            scale = torch.tensor(scale, dtype=dtype, device=device)
        self.scale = scale
        self.n = int(n)
        if not scale.is_complex():
            props["symmetric"] = True
        props.update(lower=True, upper=True)
        super().__init__(scale.shape + (self.n, self.n), scale.dtype, scale.device, **props)

    def _repr_extra(self):
        return f"scale={self.scale.tolist() if self.scale.numel() <= 4 else '...'}"

    def _matmul(self, X):
        return self.scale.unsqueeze(-1).unsqueeze(-1) * X

    def _rmatmul(self, X):
        return self._matmul(X)

    def _to_dense(self):
        eye = torch.eye(self.n, dtype=self.dtype, device=self.device)
        return self.scale.unsqueeze(-1).unsqueeze(-1) * eye

    def _transpose(self):
        return self

    def _adjoint(self):
        return ScaledIdentityOperator(self.scale.conj(), self.n) if self.is_complex else self

    def _frobenius_sq(self):
        return self.n * (self.scale * self.scale.conj()).real


@diagonal.register(ScaledIdentityOperator)
def _diagonal_scaled_identity(A):
    # diag(c I) = c, n times
    return A.scale.unsqueeze(-1).expand(A.scale.shape + (A.n,))


@scale.register(ScaledIdentityOperator)
def _scale_scaled_identity(A, c):
    # a (c I) = (a c) I
    return ScaledIdentityOperator(A.scale * c, A.n, **_scaled_props(A, c))


@add.register(ScaledIdentityOperator)
def _add_scaled_identity(A, B):
    # c I + d I = (c + d) I; c I + diag(e): the diagonal rule
    if isinstance(B, ScaledIdentityOperator):
        return ScaledIdentityOperator(A.scale + B.scale, A.n, **_sum_props(A, B))
    if isinstance(B, DiagonalOperator):
        return add(B, A)
    return None


@matmul.register(ScaledIdentityOperator)
def _matmul_scaled_identity(A, B):
    # (c I) B = c B
    return scale(B, A.scale)


@rmatmul.register(ScaledIdentityOperator)
def _rmatmul_scaled_identity(B, A):
    # A (c I) = c A
    return scale(A, B.scale)


@solve.register(ScaledIdentityOperator)
def _solve_scaled_identity(A, B):
    # (c I)^{-1} B = B / c
    return B / A.scale.unsqueeze(-1).unsqueeze(-1)


@inv.register(ScaledIdentityOperator)
def _inv_scaled_identity(A):
    # (c I)^{-1} = (1 / c) I
    return ScaledIdentityOperator(1 / A.scale, A.n, **A._props())


@slogdet.register(ScaledIdentityOperator)
def _slogdet_scaled_identity(A):
    # det(c I) = c^n
    s = A.scale
    sign = (s / s.abs()) ** A.n if s.is_complex() else torch.sign(s) ** A.n
    return sign, A.n * s.abs().log()


@cholesky.register(ScaledIdentityOperator)
def _cholesky_scaled_identity(A):
    # chol(c I) = sqrt(c) I
    return ScaledIdentityOperator(A.scale.sqrt(), A.n)


@eigh.register(ScaledIdentityOperator)
def _eigh_scaled_identity(A):
    # c I = I (c I) I^T
    evals = diagonal(A).real if A.is_complex else diagonal(A)
    return evals, IdentityOperator(A.n, dtype=A.dtype, device=A.device)


@trace.register(ScaledIdentityOperator)
def _trace_scaled_identity(A):
    # tr(c I) = n c
    return A.n * A.scale


class IdentityOperator(ScaledIdentityOperator):
    """``I_n``: every algorithm is free.

    Example:
        >>> import torch
        >>> from functransforms.linalg import IdentityOperator
        >>> I = IdentityOperator(3, dtype=torch.float64)  # [3, 3]
        >>> torch.logdet(I).item()
        0.0
    """

    _tree_fields = ()
    _static_fields = ("n", "dtype", "device")

    def __init__(self, n: int, *, dtype=None, device=None, **props):
        dtype = dtype or torch.get_default_dtype()
        props.update(positive_definite=True, unitary=True)
        super().__init__(torch.ones((), dtype=dtype, device=device), n, **props)

    def _repr_extra(self):
        return ""

    def _matmul(self, X):
        return X


@matmul.register(IdentityOperator)
def _matmul_identity(A, B):
    # I B = B
    return B


@rmatmul.register(IdentityOperator)
def _rmatmul_identity(B, A):
    # A I = A
    return A


@solve.register(IdentityOperator)
def _solve_identity(A, B):
    # I^{-1} B = B
    return B


class TriangularOperator(_StoredMatrix, LinearOperator):
    """A lower (default) or upper triangular matrix: O(n^2) solve, O(n) logdet.

    Only the triangle is read (as ``torch.linalg.solve_triangular``).

    Example:
        >>> import torch
        >>> from functransforms.linalg import TriangularOperator
        >>> L = TriangularOperator(torch.tensor([[2.0, 0.0], [1.0, 1.0]]))  # [2, 2], lower
        >>> torch.linalg.solve(L, torch.tensor([2.0, 2.0])).tolist()  # [2]
        [1.0, 1.0]
    """

    _tree_fields = ("A",)
    _core_ndims = (2,)

    def __init__(self, A: torch.Tensor, upper: bool = False, lower: bool = True, **props):
        A = _as_tensor(A, "A", "TriangularOperator(A)")
        _check_matrix(A, "TriangularOperator(A)")
        self.A = A.triu() if upper else A.tril()
        props["lower"], props["upper"] = not upper, bool(upper)
        super().__init__(A.shape, A.dtype, A.device, **props)


@scale.register(TriangularOperator)
def _scale_triangular(A, c):
    # c T is triangular of the same kind
    return TriangularOperator(A.A * c, **_scaled_props(A, c))


@add.register(TriangularOperator)
def _add_triangular(A, B):
    # sums of triangular matrices of one kind keep the kind
    if isinstance(B, TriangularOperator) and B.upper == A.upper:
        return TriangularOperator(A.A + B.A, **_sum_props(A, B))
    return None


@matmul.register(TriangularOperator)
def _matmul_triangular(A, B):
    # products of triangular matrices of one kind keep the kind
    if isinstance(B, TriangularOperator) and B.upper == A.upper:
        return TriangularOperator(A.A @ B.A, upper=A.upper)
    return None


@solve.register(TriangularOperator)
def _solve_triangular(A, B):
    # forward / back substitution, O(n^2)
    return torch.linalg.solve_triangular(A.A, B, upper=A.upper)


@slogdet.register(TriangularOperator)
def _slogdet_triangular(A):
    # det T = prod diag(T)
    d = diagonal(A)
    return _sign_prod(d), d.abs().log().sum(-1)


@cholesky.register(TriangularOperator)
def _cholesky_triangular(A):
    if A.positive_definite:  # a PD triangular matrix is diagonal
        return DiagonalOperator(diagonal(A).sqrt())
    return TriangularOperator(dense_cholesky(A._to_dense(), A))


@trace.register(TriangularOperator)
def _trace_triangular(A):
    # tr T = sum diag(T)
    return diagonal(A).sum(-1)


class PermutationOperator(LinearOperator):
    """The permutation ``(P x)[i] = x[perm[i]]`` (i.e. ``P = I[perm]``): unitary, O(n) matmul.

    Args:
        perm: integer tensor of shape ``(..., n)``, a permutation of ``range(n)``.
        dtype: dtype of the represented matrix (default: the default dtype).

    Example:
        >>> import torch
        >>> from functransforms.linalg import PermutationOperator
        >>> P = PermutationOperator(torch.tensor([2, 0, 1]))  # [3, 3]
        >>> (P @ torch.tensor([10.0, 20.0, 30.0])).tolist()  # [3]
        [30.0, 10.0, 20.0]
    """

    _tree_fields = ("perm",)
    _static_fields = ("perm_dtype",)
    _core_ndims = (1,)

    def __init__(self, perm: torch.Tensor, *, dtype=None, perm_dtype=None, **props):
        perm = _as_tensor(perm, "perm", "PermutationOperator(perm)")
        if perm.is_floating_point() or perm.is_complex() or perm.dim() < 1:
            raise TypeError(
                "PermutationOperator(perm): expected an integer tensor of shape (..., n), "
                f"received dtype {perm.dtype} and shape {tuple(perm.shape)}."
            )
        self.perm = perm
        self.perm_dtype = perm_dtype or dtype or torch.get_default_dtype()
        n = perm.shape[-1]
        props.update(unitary=True)
        super().__init__(perm.shape[:-1] + (n, n), self.perm_dtype, perm.device, **props)

    def _matmul(self, X):
        idx = self.perm.unsqueeze(-1).expand(
            broadcast_batch(self.perm.shape[:-1], X.shape[:-2]) + (X.shape[-2], X.shape[-1])
        )
        return torch.gather(X.expand(idx.shape[:-2] + X.shape[-2:]), -2, idx)

    def _to_dense(self):
        eye = torch.eye(self.shape[-1], dtype=self.dtype, device=self.device)
        return eye[self.perm]

    def _inverse_perm(self):
        return torch.argsort(self.perm, dim=-1)

    def _transpose(self):
        return PermutationOperator(self._inverse_perm(), dtype=self.dtype)

    def _frobenius_sq(self):
        return torch.full(
            self.batch_shape, float(self.shape[-1]), dtype=self.dtype, device=self.device
        )


@diagonal.register(PermutationOperator)
def _diagonal_permutation(A):
    # P[i, i] = 1 where perm[i] = i
    ar = torch.arange(A.shape[-1], device=A.device)
    return (A.perm == ar).to(A.dtype)


@matmul.register(PermutationOperator)
def _matmul_permutation(A, B):
    if isinstance(B, PermutationOperator):  # (P Q x)[i] = x[q[p[i]]]
        return PermutationOperator(torch.gather(B.perm, -1, A.perm), dtype=A.dtype)
    return None


@solve.register(PermutationOperator)
def _solve_permutation(A, B):
    # P^{-1} = P^T
    return A._transpose()._matmul(B)


@inv.register(PermutationOperator)
def _inv_permutation(A):
    # P^{-1} = P^T
    return A._transpose()


@slogdet.register(PermutationOperator)
def _slogdet_permutation(A):
    # sign = (-1)^(n - number of cycles); integer data, no derivative.
    perms = A.perm.reshape(-1, A.shape[-1]).tolist()
    signs = [_perm_sign(p) for p in perms]
    sign = torch.tensor(signs, dtype=A.dtype, device=A.device).reshape(A.batch_shape)
    return sign, torch.zeros(A.batch_shape, dtype=A.dtype, device=A.device)


def _perm_sign(p) -> float:
    seen, cycles = [False] * len(p), 0
    for i in range(len(p)):
        if not seen[i]:
            cycles += 1
            j = i
            while not seen[j]:
                seen[j] = True
                j = p[j]
    return -1.0 if (len(p) - cycles) % 2 else 1.0


# ------------------------------------------------------------------ the dense defaults
# Registered for LinearOperator, so that they apply to every operator without a structured rule
# (Note [Dispatch precedence]): materialize, then torch's dense algorithm, chosen by the declared
# properties (Note [Properties are promises]).
@solve.register(LinearOperator)
def dense_solve(A, B):
    warn_dense_algorithm("solve", A)
    M = A._to_dense()
    if A.positive_definite:
        return torch.cholesky_solve(B, dense_cholesky(M, A))
    if A.lower or A.upper:
        return torch.linalg.solve_triangular(M, B, upper=A.upper)
    if A.unitary:  # A^{-1} = A^H
        return M.mH @ B
    if B.shape[:-2] != M.shape[:-2]:
        # broadcast explicitly: torch's own vmap rule of linalg.solve mistakes a right-hand
        # side without A's batch dims for a wrongly shaped one
        batch = torch.broadcast_shapes(M.shape[:-2], B.shape[:-2])
        M, B = M.expand(batch + M.shape[-2:]), B.expand(batch + B.shape[-2:])
    return torch.linalg.solve(M, B)


@inv.register(LinearOperator)
def dense_inv(A):
    if A.unitary:  # A^{-1} = A^H
        return A._adjoint()
    warn_dense_algorithm("inv", A)
    eye = torch.eye(A._shape[-1], dtype=A._dtype, device=A._device)
    if A.lower or A.upper:  # the inverse of a triangular matrix is triangular of the same kind
        return TriangularOperator(solve(A, eye), upper=A.upper)
    return DenseOperator(solve(A, eye), **A._props())


@slogdet.register(LinearOperator)
def dense_slogdet(A):
    if A.positive_definite:
        warn_dense_algorithm("logdet", A)
        logabs = A._dense_logdet_pd()
        return torch.ones_like(logabs), logabs
    if A.lower or A.upper:  # det of a triangular matrix = product of its diagonal
        d = diagonal(A)
        return _sign_prod(d), d.abs().log().sum(-1)
    warn_dense_algorithm("slogdet", A)
    return torch.linalg.slogdet(A._to_dense())


@cholesky.register(LinearOperator)
def dense_cholesky_operator(A):
    warn_dense_algorithm("cholesky", A)
    return TriangularOperator(dense_cholesky(A._to_dense(), A), upper=False)


@eigh.register(LinearOperator)
def dense_eigh(A):
    warn_dense_algorithm("eigh", A)
    evals, evecs = torch.linalg.eigh(A._to_dense())
    return evals, DenseOperator(evecs, unitary=True)


@svd.register(LinearOperator)
def dense_svd(A):
    warn_dense_algorithm("svd", A)
    U, S, Vh = torch.linalg.svd(A._to_dense(), full_matrices=False)
    return DenseOperator(U), S, DenseOperator(Vh)


@trace.register(LinearOperator)
def dense_trace(A):
    return diagonal(A).sum(-1)


@diagonal.register(LinearOperator)
def dense_diagonal(A):
    return A._to_dense().diagonal(dim1=-2, dim2=-1)


# ------------------------------------------------------------------ property algebra
def _transposed_props(op: LinearOperator) -> dict:
    """Transpose/adjoint keep symmetry, definiteness and unitarity; swap lower/upper."""
    return dict(
        symmetric=op.symmetric,
        positive_definite=op.positive_definite,
        lower=op.upper,
        upper=op.lower,
        unitary=op.unitary,
    )


def _scaled_props(op: LinearOperator, c) -> dict:
    """``c * A``: triangularity always; symmetry for real c; definiteness for c > 0 known."""
    real = not (isinstance(c, complex) or (isinstance(c, torch.Tensor) and c.is_complex()))
    positive = isinstance(c, (int, float)) and c > 0
    return dict(
        symmetric=op.symmetric and real,
        positive_definite=op.positive_definite and positive,
        lower=op.lower,
        upper=op.upper,
    )


def _sum_props(a: LinearOperator, b: LinearOperator) -> dict:
    """Sums keep symmetry, definiteness (PD + PD) and triangularity of the same kind."""
    return dict(
        symmetric=a.symmetric and b.symmetric,
        positive_definite=a.positive_definite and b.positive_definite,
        lower=a.lower and b.lower,
        upper=a.upper and b.upper,
    )


def _static(op: LinearOperator) -> dict:
    return {name: getattr(op, name) for name in op._static_fields}


# ------------------------------------------------------------------ log det of a PD matrix
# Note [Differentiating log det]: d log det A = tr(A^-1 dA), so the vjp of
# sum_i w_i log det A_i is w_i ct A_i^-1 and its jvp sum_i w_i tr(A_i^-1 dA_i): one
# Cholesky-based inverse per matrix, and one tape node for the whole sum, instead of
# differentiating the Cholesky factorizations, diagonals, logs, sums and weights op by op (what
# the Kronecker logdet gradient spent its time on). The inverse is cholesky_inverse, which has
# rules of its own, so higher orders (hessian, jvp of grad) differentiate the rule again.
def weighted_logdet(weights, As):
    """``sum_i weights[i] * log det As[i]`` for Hermitian positive definite ``As`` (batches
    broadcast), and the Cholesky factors. Matrices sharing a weight share one log and one sum
    over their concatenated diagonals (fewer tiny ops)."""
    Ls = [dense_cholesky(A) for A in As]
    groups: dict = {}
    for w, L in zip(weights, Ls):
        d = L.diagonal(0, -2, -1)
        groups.setdefault(2 * w, []).append(d.real if d.is_complex() else d)
    out = None
    for c, ds in groups.items():
        if len(ds) > 1 and all(d.shape[:-1] == ds[0].shape[:-1] for d in ds):
            term = c * torch.cat(ds, -1).log().sum(-1)
        else:
            term = c * sum(d.log().sum(-1) for d in ds)
        out = term if out is None else out + term
    return out, Ls


@custom_vjp
def pd_logdet_sum(weights, *As):
    """``sum_i weights[i] * log det As[i]`` (Note [Differentiating log det])."""
    return weighted_logdet(weights, As)[0]


def _logdet_sum_fwd(weights, *As):
    out, Ls = weighted_logdet(weights, As)
    return out, (weights, Ls)


def _logdet_sum_bwd(res, ct):
    weights, Ls = res
    ct = ct[..., None, None]
    return (None, *((ct * w) * torch.cholesky_inverse(L) for w, L in zip(weights, Ls)))


def _logdet_sum_jvp(primals, tangents):
    weights, As = primals[0], primals[1:]
    out, Ls = weighted_logdet(weights, As)
    t = None
    for w, L, dA in zip(weights, Ls, tangents[1:]):
        if dA is None:
            continue
        term = w * (torch.cholesky_inverse(L).mT * dA).sum((-2, -1))
        t = term if t is None else t + term
    if t is None:
        t = torch.zeros_like(out)
    return out, (t.real if t.is_complex() else t)


pd_logdet_sum.defvjp(_logdet_sum_fwd, _logdet_sum_bwd)
pd_logdet_sum.defjvp(_logdet_sum_jvp)
