"""Sparse operators: a matrix given by its nonzero entries.

# Note [Sparse operators as gathers and scatters]
``SparseOperator`` stores a coordinate list: ``values (..., nnz)`` at ``(rows[k], cols[k])``,
the pattern shared by the batch. Its product is ``Y[r] += v_k X[c_k]`` for every entry: one
``index_select`` of X's rows, one multiply, one ``index_add`` into Y, ordinary dense ops that
every transform (ours and torch's) differentiates and batches, in the values and in X, with no
sparse-tensor support needed from any of them (torch's sparse kernels have no forward-mode AD
and no vmap rule). O(nnz k) per product, as a sparse matrix product. A torch sparse tensor
(COO, CSR, CSC, BSR) is taken apart once into that list (`SparseOperator.from_torch`). The
solve, log determinant and eigenproblem have no sparse direct method here (no fill-reducing
factorization in torch): they fall back to the dense matrix with a `DenseFallbackWarning`
naming the operator and its size, unless an iterative method is asked for (`iterative(solve=
"cg")`, `minres`, `gmres`, `eigsh`, stochastic log determinants), which need only products.
"""

from __future__ import annotations

import torch

from ._base import LinearOperator
from ._dense import _scaled_props
from ._rules import diagonal, scale, trace


def _index(t, name, call):
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_floating_point() or t.is_complex():
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{call}: expected `{name}` a 1-d integer tensor, received {got}.")
    return t.to(torch.long)


class SparseOperator(LinearOperator):
    """A matrix from its nonzero entries ``values[..., k]`` at ``(rows[k], cols[k])`` (Note
    [Sparse operators as gathers and scatters]); repeated coordinates add up.

    Args:
        values: ``(..., nnz)``, the entries (a batch shares the pattern).
        rows, cols: ``(nnz,)`` integer coordinates.
        dims: ``(m, n)``, the matrix size.
        **props: declared properties (``symmetric``, ``positive_definite``, ...), unchecked.

    Example:
        >>> import torch
        >>> from functransforms.linalg import SparseOperator
        >>> rows, cols = torch.tensor([0, 1, 1, 2]), torch.tensor([0, 0, 1, 2])
        >>> A = SparseOperator(torch.tensor([2.0, -1.0, 3.0, 4.0]), rows, cols, (3, 3))
        >>> (A @ torch.ones(3)).tolist()  # [3]
        [2.0, 2.0, 4.0]
    """

    _tree_fields = ("values", "rows", "cols")
    _static_fields = ("dims",)
    _core_ndims = (1, 1, 1)

    def __init__(self, values, rows, cols, dims, **props):
        call = "SparseOperator(values, rows, cols, dims)"
        rows, cols = _index(rows, "rows", call), _index(cols, "cols", call)
        if not isinstance(values, torch.Tensor) or values.dim() < 1:
            got = type(values).__name__
            raise TypeError(f"{call}: expected `values` a tensor (..., nnz), received {got}.")
        nnz = rows.shape[0]
        if cols.shape[0] != nnz or values.shape[-1] != nnz:
            raise ValueError(
                f"{call}: expected rows, cols and values[..., :] of one length, received "
                f"{nnz}, {cols.shape[0]} and {values.shape[-1]}."
            )
        m, n = (int(d) for d in dims)
        if nnz and (
            bool((rows < 0).any() | (rows >= m).any()) or bool((cols < 0).any() | (cols >= n).any())
        ):
            raise ValueError(f"{call}: a coordinate lies outside the {m} x {n} matrix.")
        self.values, self.rows, self.cols, self.dims = values, rows, cols, (m, n)
        super().__init__(values.shape[:-1] + (m, n), values.dtype, values.device, **props)

    @classmethod
    def from_torch(cls, S: torch.Tensor, **props) -> SparseOperator:
        """The operator of a torch sparse matrix ``S`` (COO, CSR, CSC or BSR; ``(m, n)``), its
        duplicate entries summed."""
        if not isinstance(S, torch.Tensor) or S.layout == torch.strided or S.dim() != 2:
            got = (
                f"a {S.layout} tensor of shape {tuple(S.shape)}"
                if isinstance(S, torch.Tensor)
                else type(S).__name__
            )
            raise TypeError(
                f"SparseOperator.from_torch(S): expected a 2-d torch sparse tensor, received {got}."
            )
        coo = (S if S.layout == torch.sparse_coo else S.to_sparse_coo()).coalesce()
        rows, cols = coo.indices()
        return cls(coo.values(), rows, cols, tuple(S.shape), **props)

    def _repr_extra(self):
        return f"nnz={self.rows.shape[0]}"

    def _matmul(self, X):
        gathered = X.index_select(-2, self.cols) * self.values.unsqueeze(-1)  # (..., nnz, k)
        batch = torch.broadcast_shapes(self.values.shape[:-1], X.shape[:-2])
        out = torch.zeros(
            batch + (self.dims[0], X.shape[-1]),
            dtype=torch.promote_types(self.values.dtype, X.dtype),
            device=X.device,
        )
        return out.index_add(-2, self.rows, gathered.expand(batch + gathered.shape[-2:]))

    def _to_dense(self):
        m, n = self.dims
        flat = torch.zeros(self.values.shape[:-1] + (m * n,), dtype=self.dtype, device=self.device)
        return flat.index_add(-1, self.rows * n + self.cols, self.values).unflatten(-1, (m, n))

    def _transpose(self):
        return SparseOperator(self.values, self.cols, self.rows, self.dims[::-1], **self._props())

    def _adjoint(self):
        return SparseOperator(
            self.values.conj(), self.cols, self.rows, self.dims[::-1], **self._props()
        )


@diagonal.register(SparseOperator)
def _diagonal_sparse(A):
    on = A.rows == A.cols
    d = torch.zeros(A.values.shape[:-1] + (min(A.dims),), dtype=A.dtype, device=A.device)
    return d.index_add(-1, A.rows[on], A.values[..., on])


@trace.register(SparseOperator)
def _trace_sparse(A):
    return A.values[..., A.rows == A.cols].sum(-1)


@scale.register(SparseOperator)
def _scale_sparse(A, c):
    # c S keeps the pattern
    return SparseOperator(A.values * c, A.rows, A.cols, A.dims, **_scaled_props(A, c))
