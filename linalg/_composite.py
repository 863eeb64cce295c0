"""Operators built from operators (Transpose, Adjoint, Sum, Product, BlockDiagonal), and the
resolvers of ``a @ b`` and ``a + b`` (Note [Dispatch precedence] in ``_rules.py``)."""

from __future__ import annotations

import torch

from . import _base
from ._base import LinearOperator, broadcast_batch, dense_fallback
from ._dense import (
    DenseOperator,
    PermutationOperator,
    ScaledIdentityOperator,
    _scaled_props,
    dense_inv,
    dense_slogdet,
    dense_solve,
)
from ._rules import add as add_rule
from ._rules import cholesky, diagonal, eigh, inv, scale, slogdet, solve, trace
from ._rules import matmul as matmul_rule
from ._rules import rmatmul as rmatmul_rule


def as_operator(x, call: str = "as_operator(x)") -> LinearOperator:
    """A LinearOperator as is; a tensor of shape ``(..., m, n)`` as a DenseOperator.

    Example:
        >>> import torch
        >>> from functransforms.linalg import as_operator
        >>> as_operator(torch.eye(2))  # [2, 2]
        DenseOperator(shape=(2, 2), dtype=torch.float...)
    """
    if isinstance(x, LinearOperator):
        return x
    if isinstance(x, torch.Tensor):
        return DenseOperator(x)
    raise TypeError(
        f"{call}: expected a LinearOperator or a torch.Tensor, received {type(x).__name__}."
    )


def _matmul_of(op, X):
    return op._matmul(X)


def _rmatmul_of(op, X):
    return op._rmatmul(X)


class _MultiOperator(LinearOperator):
    """Shared plumbing for operators holding a list of operators in ``self.ops``."""

    _tree_fields = ("ops",)

    def _map_ops(self, fn) -> LinearOperator:
        return type(self)._from_children([[fn(op) for op in self.ops]], self._props())

    def _batch_getitem(self, batch_key):
        bshape = self.batch_shape
        return self._map_ops(lambda op: op._expand_batch(bshape)._batch_getitem(batch_key))

    def _expand_batch(self, batch_shape):
        if self.batch_shape == torch.Size(batch_shape):
            return self
        return self._map_ops(lambda op: op._expand_batch(batch_shape))

    def _repr_extra(self):
        return "[" + ", ".join(repr(op) for op in self.ops) + "]"


class TransposeOperator(LinearOperator):
    """``A^T`` of an operator without a structured transpose (usually built by ``A.mT``).

    Example:
        >>> import torch
        >>> from functransforms.linalg import TransposeOperator, DenseOperator
        >>> A = torch.arange(6.0).reshape(2, 3)
        >>> TransposeOperator(DenseOperator(A)).shape  # [3, 2]
        torch.Size([3, 2])
    """

    _tree_fields = ("base",)

    def __init__(self, base: LinearOperator, **props):
        base = as_operator(base, "TransposeOperator(base)")
        self.base = base
        props.update(
            symmetric=base.symmetric,
            positive_definite=base.positive_definite,
            lower=base.upper,
            upper=base.lower,
            unitary=base.unitary,
        )
        super().__init__(
            base.shape[:-2] + (base.shape[-1], base.shape[-2]), base.dtype, base.device, **props
        )

    def _stores_dense(self):
        return self.base._stores_dense()

    def _repr_extra(self):
        return repr(self.base)

    def _matmul(self, X):
        return self.base._rmatmul(X.mT).mT

    def _rmatmul(self, X):
        return self.base._matmul(X.mT).mT

    def _to_dense(self):
        return self.base._to_dense().mT

    def _transpose(self):
        return self.base

    def _frobenius_sq(self):
        return self.base._frobenius_sq()


@diagonal.register(TransposeOperator)
def _diagonal_transpose(A):
    # diag(A^T) = diag(A)
    return diagonal(A.base)


@solve.register(TransposeOperator)
def _solve_transpose(A, B):
    # A^{-T} B: the base's solve for symmetric real A, else (A^{-1})^T B
    if A.symmetric and not A.is_complex:
        return solve(A.base, B)
    return inv(A.base)._transpose()._matmul(B)


@inv.register(TransposeOperator)
def _inv_transpose(A):
    # (A^T)^{-1} = (A^{-1})^T
    return inv(A.base)._transpose()


@slogdet.register(TransposeOperator)
def _slogdet_transpose(A):
    # det A^T = det A
    return slogdet(A.base)


@trace.register(TransposeOperator)
def _trace_transpose(A):
    # tr A^T = tr A
    return trace(A.base)


class AdjointOperator(TransposeOperator):
    """``A^H`` (conjugate transpose) of a complex operator without a structured adjoint.

    Example:
        >>> import torch
        >>> from functransforms.linalg import AdjointOperator, DenseOperator
        >>> A = torch.tensor([[1.0 + 1.0j, 2.0], [0.0, 1.0j]])
        >>> torch.equal(AdjointOperator(DenseOperator(A)).to_dense(), A.mH)  # [2, 2]
        True
    """

    def _matmul(self, X):
        return self.base._rmatmul(X.mH).mH

    def _rmatmul(self, X):
        return self.base._matmul(X.mH).mH

    def _to_dense(self):
        return self.base._to_dense().mH

    def _transpose(self):
        # (A^H)^T = conj(A): realized densely (rare: complex operators without structure).
        return DenseOperator(self.base._to_dense().conj())

    def _adjoint(self):
        return self.base


@diagonal.register(AdjointOperator)
def _diagonal_adjoint(A):
    # diag(A^H) = conj(diag(A))
    return diagonal(A.base).conj()


@solve.register(AdjointOperator)
def _solve_adjoint(A, B):
    # A^{-H} B = (A^{-1})^H B
    return inv(A.base)._adjoint()._matmul(B)


@inv.register(AdjointOperator)
def _inv_adjoint(A):
    # (A^H)^{-1} = (A^{-1})^H
    return inv(A.base)._adjoint()


@slogdet.register(AdjointOperator)
def _slogdet_adjoint(A):
    # det A^H = conj(det A)
    sign, logabs = slogdet(A.base)
    return sign.conj(), logabs


@trace.register(AdjointOperator)
def _trace_adjoint(A):
    # tr A^H = conj(tr A)
    return trace(A.base).conj()


class SumOperator(_MultiOperator):
    """``A_1 + ... + A_k`` (built by ``+`` when no structured sum exists).

    Matmul and diagonal are sums; solve/logdet are dense unless asked to be iterative.

    Example:
        >>> import torch
        >>> from functransforms.linalg import SumOperator, DenseOperator, LowRankOperator
        >>> U = torch.ones(3, 1)
        >>> S = SumOperator([DenseOperator(torch.eye(3)), LowRankOperator(U, U)])  # [3, 3]
        >>> torch.trace(S).item()
        6.0
    """

    def __init__(self, ops, **props):
        ops = [as_operator(op, "SumOperator(ops)") for op in ops]
        flat = []
        for op in ops:
            flat.extend(op.ops if isinstance(op, SumOperator) else [op])
        if not flat:
            raise ValueError("SumOperator(ops): expected at least one operator, received none.")
        mn = {op.shape[-2:] for op in flat}
        if len(mn) != 1:
            raise ValueError(
                f"SumOperator(ops): expected operators of one matrix shape, received "
                f"{[tuple(op.shape) for op in flat]}."
            )
        self.ops = flat
        batch = broadcast_batch(*(op.batch_shape for op in flat))
        props.update(
            symmetric=props.get("symmetric") or all(op.symmetric for op in flat),
            positive_definite=props.get("positive_definite")
            or all(op.positive_definite for op in flat),
            lower=all(op.lower for op in flat),
            upper=all(op.upper for op in flat),
        )
        dtype = torch.promote_types(flat[0].dtype, flat[-1].dtype)
        super().__init__(batch + flat[0].shape[-2:], dtype, flat[0].device, **props)

    def _matmul(self, X):
        out = self.ops[0]._matmul(X)
        for op in self.ops[1:]:
            out = out + op._matmul(X)
        return out

    def _rmatmul(self, X):
        out = self.ops[0]._rmatmul(X)
        for op in self.ops[1:]:
            out = out + op._rmatmul(X)
        return out

    def _to_dense(self):
        out = self.ops[0]._to_dense()
        for op in self.ops[1:]:
            out = out + op._to_dense()
        return out

    def _transpose(self):
        return SumOperator([op._transpose() for op in self.ops], **self._props())

    def _adjoint(self):
        return SumOperator([op._adjoint() for op in self.ops], **self._props())


@diagonal.register(SumOperator)
def _diagonal_sum(A):
    # diag(sum A_i) = sum diag(A_i)
    out = diagonal(A.ops[0])
    for op in A.ops[1:]:
        out = out + diagonal(op)
    return out


@scale.register(SumOperator)
def _scale_sum(A, c):
    # c sum A_i = sum c A_i
    return SumOperator([scale(op, c) for op in A.ops], **_scaled_props(A, c))


@trace.register(SumOperator)
def _trace_sum(A):
    # tr(sum A_i) = sum tr(A_i)
    return sum(trace(op) for op in A.ops)


class ProductOperator(_MultiOperator):
    """The composition ``A_1 @ A_2 @ ... @ A_k`` (applied right to left, never multiplied out).

    Example:
        >>> import torch
        >>> from functransforms.linalg import ProductOperator, DiagonalOperator, DenseOperator
        >>> P = ProductOperator([DiagonalOperator(torch.ones(3) * 2), DenseOperator(torch.eye(3))])
        >>> round(torch.det(P).item(), 6)  # [3, 3] operator, scalar det
        8.0
    """

    def __init__(self, ops, **props):
        ops = [as_operator(op, "ProductOperator(ops)") for op in ops]
        flat = []
        for op in ops:
            flat.extend(op.ops if isinstance(op, ProductOperator) else [op])
        if not flat:
            raise ValueError("ProductOperator(ops): expected at least one operator, received none.")
        for a, b in zip(flat, flat[1:]):
            if a.shape[-1] != b.shape[-2]:
                raise ValueError(
                    f"ProductOperator(ops): inner dimensions differ: {a!r} @ {b!r} "
                    f"({a.shape[-1]} != {b.shape[-2]})."
                )
        self.ops = flat
        batch = broadcast_batch(*(op.batch_shape for op in flat))
        props.update(
            lower=all(op.lower for op in flat),
            upper=all(op.upper for op in flat),
            unitary=all(op.unitary for op in flat),
        )
        dtype = flat[0].dtype
        for op in flat[1:]:
            dtype = torch.promote_types(dtype, op.dtype)
        shape = batch + (flat[0].shape[-2], flat[-1].shape[-1])
        super().__init__(shape, dtype, flat[0].device, **props)

    def _matmul(self, X):
        for op in reversed(self.ops):
            X = op._matmul(X)
        return X

    def _rmatmul(self, X):
        for op in self.ops:
            X = op._rmatmul(X)
        return X

    def _transpose(self):
        # (A B)^T = B^T A^T
        return ProductOperator([op._transpose() for op in reversed(self.ops)], **self._props())

    def _adjoint(self):
        return ProductOperator([op._adjoint() for op in reversed(self.ops)], **self._props())

    def _all_square(self):
        return all(op.is_square for op in self.ops)


@scale.register(ProductOperator)
def _scale_product(A, c):
    # c (A_1 A_2 ...) = (c A_1) A_2 ...
    ops = [scale(A.ops[0], c)] + A.ops[1:]
    return ProductOperator(ops, **_scaled_props(A, c))


@solve.register(ProductOperator)
def _solve_product(A, B):
    # (A_1 ... A_k)^{-1} B = A_k^{-1} ... A_1^{-1} B when every factor is square.
    if not A._all_square():
        return dense_solve(A, B)
    for op in A.ops:
        B = solve(op, B)
    return B


@inv.register(ProductOperator)
def _inv_product(A):
    # (A_1 ... A_k)^{-1} = A_k^{-1} ... A_1^{-1} (square factors)
    if not A._all_square():
        return dense_inv(A)
    return ProductOperator([inv(op) for op in reversed(A.ops)], **A._props())


@slogdet.register(ProductOperator)
def _slogdet_product(A):
    # det(A_1 ... A_k) = prod det(A_i) (square factors)
    if not A._all_square():
        return dense_slogdet(A)
    signs, logs = zip(*(slogdet(op) for op in A.ops))
    sign, logabs = signs[0], logs[0]
    for s, l in zip(signs[1:], logs[1:]):
        sign, logabs = sign * s, logabs + l
    return sign, logabs


class BlockDiagonalOperator(_MultiOperator):
    """``blockdiag(A_1, ..., A_k)`` of square blocks (sizes may differ); every algorithm per block.

    Equal blocks are one batched operator (a `BatchedBlockDiagonalOperator`, every algorithm
    one batched call): blocks given as a tensor ``(k, ..., b, b)`` (the blocks along its first
    dimension), as an operator whose last batch dimension lists them (``(..., k, b, b)``), or
    as a list of dense blocks of one shape, dtype and declared properties (stacked).

    Example:
        >>> import torch
        >>> from functransforms.linalg import BlockDiagonalOperator, DiagonalOperator
        >>> B = BlockDiagonalOperator([torch.eye(2) * 2, DiagonalOperator(torch.ones(3))])
        >>> B.shape, torch.logdet(B).item() == 2 * torch.log(torch.tensor(2.0)).item()  # [5, 5]
        (torch.Size([5, 5]), True)
    """

    def __new__(cls, ops, **props):
        if cls is BlockDiagonalOperator:
            base = _stacked_blocks(ops)
            if base is not None:  # equal blocks: one batched operator
                return BatchedBlockDiagonalOperator(base, **props)
        return super().__new__(cls)

    def __init__(self, ops, **props):
        ops = [as_operator(op, "BlockDiagonalOperator(blocks)") for op in ops]
        if not ops:
            raise ValueError("BlockDiagonalOperator(blocks): expected at least one block.")
        for op in ops:
            if not op.is_square:
                raise ValueError(
                    f"BlockDiagonalOperator(blocks): expected square blocks, received {op!r}."
                )
        self.ops = ops
        self.sizes = [op.shape[-1] for op in ops]
        n = sum(self.sizes)
        batch = broadcast_batch(*(op.batch_shape for op in ops))
        for name in ("symmetric", "positive_definite", "lower", "upper", "unitary"):
            props[name] = props.get(name) or all(getattr(op, name) for op in ops)
        super().__init__(batch + (n, n), ops[0].dtype, ops[0].device, **props)

    def _split(self, X, dim=-2):
        return torch.split(X, self.sizes, dim=dim)

    def _per_block(self, fn, X, out_dim=-2):
        """``fn(block, rows of X)`` for every block, concatenated along ``out_dim``."""
        parts = [fn(op, x) for op, x in zip(self.ops, self._split(X, out_dim))]
        batch = broadcast_batch(*(p.shape[:-2] for p in parts))
        return torch.cat([p.expand(batch + p.shape[-2:]) for p in parts], dim=out_dim)

    def _matmul(self, X):
        return self._per_block(_matmul_of, X)

    def _rmatmul(self, X):
        return self._per_block(_rmatmul_of, X, out_dim=-1)

    def _to_dense(self):
        dense = [op._to_dense() for op in self.ops]
        batch = broadcast_batch(*(d.shape[:-2] for d in dense))
        out = torch.zeros(batch + self.shape[-2:], dtype=self.dtype, device=self.device)
        i = 0
        rows = []
        for d, n in zip(dense, self.sizes):
            pieces = [
                out[..., i : i + n, :i],
                d.expand(batch + d.shape[-2:]),
                out[..., i : i + n, i + n :],
            ]
            rows.append(torch.cat(pieces, dim=-1))
            i += n
        return torch.cat(rows, dim=-2)

    def _transpose(self):
        return self._map_ops(lambda op: op._transpose())._with_props(_swap_lu(self))

    def _adjoint(self):
        return self._map_ops(lambda op: op._adjoint())._with_props(_swap_lu(self))

    def _with_props(self, props):
        for k, v in props.items():
            setattr(self, k, v)
        return self

    def _frobenius_sq(self):
        return sum(op._frobenius_sq() for op in self.ops)


def _stacked_blocks(ops):
    """The blocks as one operator with a batch dimension listing them (dim -3), or None."""
    if isinstance(ops, LinearOperator):
        if ops.ndim < 3:
            raise ValueError(
                f"BlockDiagonalOperator({ops!r}): an operator gives its blocks along its last "
                "batch dimension (shape (..., k, b, b)); expected at least 3 dimensions. For one "
                "block, BlockDiagonalOperator([A])."
            )
        return ops
    if isinstance(ops, torch.Tensor):
        if ops.dim() < 3:
            return None  # the list path's error
        return DenseOperator(ops.movedim(0, -3) if ops.dim() > 3 else ops)
    if not isinstance(ops, (list, tuple)) or len(ops) < 2:
        return None
    first = ops[0]
    if isinstance(first, torch.Tensor):
        if not all(type(o) is torch.Tensor for o in ops):
            return None
        mats, props = list(ops), {}
    elif type(first) is DenseOperator:
        props = first.properties()
        if not all(type(o) is DenseOperator and o.properties() == props for o in ops):
            return None
        mats = [o.A for o in ops]
    else:
        return None
    shape, dtype, device = mats[0].shape, mats[0].dtype, mats[0].device
    if len(shape) < 2 or shape[-1] != shape[-2]:
        return None
    if not all(m.shape == shape and m.dtype == dtype and m.device == device for m in mats):
        return None
    return DenseOperator(torch.stack(mats, dim=-3), **props)


class BatchedBlockDiagonalOperator(BlockDiagonalOperator):
    """``blockdiag(B[..., 0, :, :], ..., B[..., k-1, :, :])``: k equal square blocks stored as one
    operator ``B`` of shape ``(..., k, b, b)``, every algorithm one batched call on it (a solve
    of 500 blocks of 8 x 8 is one batched Cholesky). What `BlockDiagonalOperator` builds for
    equal blocks.

    Args:
        base: an operator or tensor ``(..., k, b, b)``, the blocks along dimension -3.

    Example:
        >>> import torch
        >>> from functransforms.linalg import BlockDiagonalOperator
        >>> blocks = torch.eye(2).expand(3, 2, 2) * torch.tensor([1.0, 2.0, 4.0])[:, None, None]
        >>> B = BlockDiagonalOperator(blocks)  # [6, 6]: three 2 x 2 blocks
        >>> type(B).__name__, torch.linalg.solve(B, torch.ones(6)).tolist()
        ('BatchedBlockDiagonalOperator', [1.0, 1.0, 0.5, 0.5, 0.25, 0.25])
    """

    _tree_fields = ("base",)

    def __new__(cls, base, **props):
        return LinearOperator.__new__(cls)

    def __init__(self, base, **props):
        if "base" in self.__dict__:  # built by BlockDiagonalOperator.__new__, which Python
            return  # then initializes again with the list of blocks
        if isinstance(base, (list, tuple)):  # a pytree rebuild from blocks: stack them
            stacked = _stacked_blocks(base)
            if stacked is None:
                raise ValueError(
                    "BatchedBlockDiagonalOperator(base): expected an operator or tensor of "
                    "shape (..., k, b, b), or a list of dense blocks of one shape; received a "
                    "list of other blocks. Use BlockDiagonalOperator(blocks) for those."
                )
            base = stacked
        base = as_operator(base, "BatchedBlockDiagonalOperator(base)")
        if base.ndim < 3 or not base.is_square:
            raise ValueError(
                "BatchedBlockDiagonalOperator(base): expected square blocks along dimension -3 "
                f"(shape (..., k, b, b)), received {base!r}."
            )
        self.base = base
        k, b = base._shape[-3], base._shape[-1]
        for name in ("symmetric", "positive_definite", "lower", "upper", "unitary"):
            props[name] = props.get(name) or getattr(base, name)
        super(BlockDiagonalOperator, self).__init__(
            base._shape[:-3] + (k * b, k * b), base.dtype, base.device, **props
        )

    @property
    def ops(self):
        """The blocks, one operator each (the general form's view; algorithms use ``base``)."""
        return [self.base[..., i, :, :] for i in range(self.base.shape[-3])]

    @property
    def sizes(self):
        return [self.base.shape[-1]] * self.base.shape[-3]

    def _repr_extra(self):
        k, b = self.base.shape[-3], self.base.shape[-1]
        return f"{k} blocks of {b}x{b}: {self.base!r}"

    def _blocks(self, X):
        """``(..., k b, c)`` -> ``(..., k, b, c)``."""
        return X.reshape(X.shape[:-2] + (self.base._shape[-3], self.base._shape[-1], X.shape[-1]))

    @staticmethod
    def _unblocks(Y):
        return Y.reshape(Y.shape[:-3] + (-1, Y.shape[-1]))

    def _matmul(self, X):
        return self._unblocks(self.base._matmul(self._blocks(X)))

    def _rmatmul(self, X):
        # X B = (B^T X^T)^T
        return self._unblocks(self.base._transpose()._matmul(self._blocks(X.mT))).mT

    def _to_dense(self):
        D = self.base._to_dense()  # (..., k, b, b)
        k, b = D.shape[-3], D.shape[-1]
        eye = torch.eye(k, dtype=D.dtype, device=D.device).reshape(k, 1, k, 1)
        return (D.unsqueeze(-2) * eye).reshape(D.shape[:-3] + (k * b, k * b))

    def _transpose(self):
        return BatchedBlockDiagonalOperator(self.base._transpose(), **_swap_props(self))

    def _adjoint(self):
        return BatchedBlockDiagonalOperator(self.base._adjoint(), **_swap_props(self))

    def _frobenius_sq(self):
        return self.base._frobenius_sq().sum(-1)

    def _stores_dense(self):
        return self.base._stores_dense()

    def _batch_getitem(self, batch_key):
        base = self.base._expand_batch(self.batch_shape + self.base._shape[-3:-2])
        return BatchedBlockDiagonalOperator(
            base._batch_getitem(tuple(batch_key) + (slice(None),)), **self._props()
        )

    def _expand_batch(self, batch_shape):
        if self.batch_shape == torch.Size(batch_shape):
            return self
        base = self.base._expand_batch(torch.Size(batch_shape) + self.base._shape[-3:-2])
        return BatchedBlockDiagonalOperator(base, **self._props())

    def _logdet_pd(self, scale=1):
        return self.base._logdet_pd(scale).sum(-1)

    def _solve_closed_form(self, B):
        # dense blocks: torch's batched solve, differentiated by its own rules (exact), as a
        # DenseOperator's solve is
        if type(self.base) is not DenseOperator:
            return None
        return self._unblocks(solve(self.base, self._blocks(B)))


def _swap_props(op):
    return op._props(**_swap_lu(op))


@solve.register(BatchedBlockDiagonalOperator)
def _solve_batched_block_diagonal(A, B):
    # blockdiag(B_i)^{-1} X = the batched blocks' solves
    return A._unblocks(solve(A.base, A._blocks(B)))


@slogdet.register(BatchedBlockDiagonalOperator)
def _slogdet_batched_block_diagonal(A):
    # det blockdiag(B_i) = prod det(B_i)
    sign, logabs = slogdet(A.base)
    return sign.prod(-1), logabs.sum(-1)


@inv.register(BatchedBlockDiagonalOperator)
def _inv_batched_block_diagonal(A):
    # blockdiag(B_i)^{-1} = blockdiag(B_i^{-1})
    return BatchedBlockDiagonalOperator(inv(A.base))


@cholesky.register(BatchedBlockDiagonalOperator)
def _cholesky_batched_block_diagonal(A):
    # chol blockdiag(B_i) = blockdiag(chol B_i)
    return BatchedBlockDiagonalOperator(cholesky(A.base))


@diagonal.register(BatchedBlockDiagonalOperator)
def _diagonal_batched_block_diagonal(A):
    # the blocks' diagonals, concatenated
    return diagonal(A.base).flatten(-2)


@trace.register(BatchedBlockDiagonalOperator)
def _trace_batched_block_diagonal(A):
    # tr blockdiag(B_i) = sum tr(B_i)
    return trace(A.base).sum(-1)


@scale.register(BatchedBlockDiagonalOperator)
def _scale_batched_block_diagonal(A, c):
    # c blockdiag(B_i) = blockdiag(c B_i): a batched c gains the blocks' dimension
    cb = c.unsqueeze(-1) if isinstance(c, torch.Tensor) and c.dim() else c
    return BatchedBlockDiagonalOperator(scale(A.base, cb), **_scaled_props(A, c))


@matmul_rule.register(BatchedBlockDiagonalOperator)
def _matmul_batched_block_diagonal(A, B):
    if isinstance(B, BatchedBlockDiagonalOperator) and B.sizes == A.sizes:
        # blockdiag(A_i) blockdiag(B_i) = blockdiag(A_i B_i)
        return BatchedBlockDiagonalOperator(matmul(A.base, B.base))
    return _matmul_block_diagonal(A, B)


@add_rule.register(BatchedBlockDiagonalOperator)
def _add_batched_block_diagonal(A, B):
    if isinstance(B, BatchedBlockDiagonalOperator) and B.sizes == A.sizes:
        # blockdiag(A_i) + blockdiag(B_i) = blockdiag(A_i + B_i)
        return BatchedBlockDiagonalOperator(add(A.base, B.base))
    return _add_block_diagonal(A, B)


@eigh.register(BatchedBlockDiagonalOperator)
def _eigh_batched_block_diagonal(A):
    # the blocks' eigenpairs (one batched eigh), sorted by a permutation
    evals, Q = eigh(A.base)
    evals, idx = torch.sort(evals.flatten(-2), dim=-1)
    Qb = BatchedBlockDiagonalOperator(Q, unitary=True)
    return evals, ProductOperator([Qb, PermutationOperator(idx, dtype=A.dtype).mT])


@diagonal.register(BlockDiagonalOperator)
def _diagonal_block_diagonal(A):
    # the blocks' diagonals, concatenated
    parts = [diagonal(op) for op in A.ops]
    batch = broadcast_batch(*(p.shape[:-1] for p in parts))
    return torch.cat([p.expand(batch + p.shape[-1:]) for p in parts], dim=-1)


@scale.register(BlockDiagonalOperator)
def _scale_block_diagonal(A, c):
    # c blockdiag(A_i) = blockdiag(c A_i)
    return BlockDiagonalOperator([scale(op, c) for op in A.ops], **_scaled_props(A, c))


@matmul_rule.register(BlockDiagonalOperator)
def _matmul_block_diagonal(A, B):
    if isinstance(B, BlockDiagonalOperator) and B.sizes == A.sizes:
        # blockdiag(A_i) blockdiag(B_i) = blockdiag(A_i B_i)
        return BlockDiagonalOperator([matmul(a, b) for a, b in zip(A.ops, B.ops)])
    return None


@add_rule.register(BlockDiagonalOperator)
def _add_block_diagonal(A, B):
    if isinstance(B, BlockDiagonalOperator) and B.sizes == A.sizes:
        # blockdiag(A_i) + blockdiag(B_i) = blockdiag(A_i + B_i)
        return BlockDiagonalOperator([add(a, b) for a, b in zip(A.ops, B.ops)])
    return None


@solve.register(BlockDiagonalOperator)
def _solve_block_diagonal(A, B):
    # blockdiag(A_i)^{-1} B = the blocks' solves stacked
    return A._per_block(solve, B)


@inv.register(BlockDiagonalOperator)
def _inv_block_diagonal(A):
    # blockdiag(A_i)^{-1} = blockdiag(A_i^{-1})
    return A._map_ops(lambda op: inv(op))


@slogdet.register(BlockDiagonalOperator)
def _slogdet_block_diagonal(A):
    # det blockdiag(A_i) = prod det(A_i)
    signs, logs = zip(*(slogdet(op) for op in A.ops))
    sign, logabs = signs[0], logs[0]
    for s, l in zip(signs[1:], logs[1:]):
        sign, logabs = sign * s, logabs + l
    return sign, logabs


@cholesky.register(BlockDiagonalOperator)
def _cholesky_block_diagonal(A):
    # chol blockdiag(A_i) = blockdiag(chol A_i)
    return BlockDiagonalOperator([cholesky(op) for op in A.ops])


@eigh.register(BlockDiagonalOperator)
def _eigh_block_diagonal(A):
    # the blocks' eigenpairs, sorted by a permutation
    pairs = [eigh(op) for op in A.ops]
    evals = [p[0] for p in pairs]
    batch = broadcast_batch(*(e.shape[:-1] for e in evals))
    evals = torch.cat([e.expand(batch + e.shape[-1:]) for e in evals], dim=-1)
    evals, idx = torch.sort(evals, dim=-1)
    Q = BlockDiagonalOperator([p[1] for p in pairs], unitary=True)
    return evals, ProductOperator([Q, PermutationOperator(idx, dtype=A.dtype).mT])


@trace.register(BlockDiagonalOperator)
def _trace_block_diagonal(A):
    # tr blockdiag(A_i) = sum tr(A_i)
    return sum(trace(op) for op in A.ops)


def _swap_lu(op):
    return dict(lower=op.upper, upper=op.lower)


# ------------------------------------------------------------------ the algebra's resolvers
@scale.register(LinearOperator)
def _scale_lazy(A, c):
    # The default: c A = (c I) A, kept lazy.
    return ProductOperator([ScaledIdentityOperator(c, A._shape[-2], like=A), A])


def _name(x) -> str:
    return type(x).__name__


def matmul(a, b):
    """``a @ b`` for operators and tensors; operator @ operator keeps structure when it can.

    Two operators: ``a``'s `matmul` rules, then ``b``'s `rmatmul` rules, then a lazy
    ProductOperator (Note [Dispatch precedence]).

    Example:
        >>> import torch
        >>> from functransforms.linalg import KroneckerOperator, matmul
        >>> K = KroneckerOperator(torch.eye(2), torch.eye(3))  # [6, 6]
        >>> type(matmul(K, K)).__name__  # Kronecker of products
        'KroneckerOperator'
    """
    a_op, b_op = isinstance(a, LinearOperator), isinstance(b, LinearOperator)
    if a_op and b_op:
        if a.shape[-1] != b.shape[-2]:
            raise ValueError(
                f"matmul({a!r}, {b!r}): inner dimensions differ ({a.shape[-1]} != {b.shape[-2]})."
            )
        out = matmul_rule(a, b)
        if out is None:
            out = rmatmul_rule(b, a)
        return out if out is not None else ProductOperator([a, b])
    if a_op:
        if not isinstance(b, torch.Tensor):
            raise TypeError(
                f"matmul({a!r}, b): expected b to be a Tensor or LinearOperator, "
                f"received {_name(b)}."
            )
        if b.dim() == 1:
            _check_inner(a, b, a.shape[-1], b.shape[0])
            return a._matmul(b.unsqueeze(-1)).squeeze(-1)
        _check_inner(a, b, a.shape[-1], b.shape[-2])
        return a._matmul(b)
    if b_op:
        if not isinstance(a, torch.Tensor):
            raise TypeError(
                f"matmul(a, {b!r}): expected a to be a Tensor or LinearOperator, "
                f"received {_name(a)}."
            )
        if a.dim() == 1:
            _check_inner(a, b, a.shape[0], b.shape[-2])
            return b._rmatmul(a.unsqueeze(-2)).squeeze(-2)
        _check_inner(a, b, a.shape[-1], b.shape[-2])
        return b._rmatmul(a)
    return torch.matmul(a, b)


def _check_inner(a, b, k1, k2):
    if k1 != k2:
        sa = tuple(a.shape)
        sb = tuple(b.shape)
        raise ValueError(
            f"matmul(a, b): inner dimensions differ: a has shape {sa}, b has shape {sb}."
        )


def add(a, b):
    """``a + b``: Diagonal + Diagonal is Diagonal, LowRank + Diagonal is LowRankPlusDiagonal,
    Kronecker + s I is KroneckerPlusScaledIdentity, otherwise a lazy SumOperator.

    Two operators: ``a``'s `add` rules, then ``b``'s (with ``a`` as second argument: sums
    commute), then a lazy SumOperator (Note [Dispatch precedence]).

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator, LowRankOperator, add
        >>> type(add(LowRankOperator(torch.ones(3, 1)), DiagonalOperator(torch.ones(3)))).__name__
        'LowRankPlusDiagonalOperator'
    """
    if isinstance(a, torch.Tensor) and a.dim() >= 2:
        a = DenseOperator(a)
    if isinstance(b, torch.Tensor) and b.dim() >= 2:
        b = DenseOperator(b)
    if not (isinstance(a, LinearOperator) and isinstance(b, LinearOperator)):
        op = a if isinstance(a, LinearOperator) else b
        return dense_fallback(
            torch.add, (a, b), {}, reason=f"{_name(op)} + {_name(a if op is b else b)}"
        )
    if a.shape[-2:] != b.shape[-2:]:
        raise ValueError(f"add({a!r}, {b!r}): expected operators of one matrix shape.")
    out = add_rule(a, b)
    if out is None:
        out = add_rule(b, a)
    return out if out is not None else SumOperator([a, b])


# the base class reaches these through ``_late`` (Note [The base class's import cycles])
_base._late.__dict__.update(
    TransposeOperator=TransposeOperator, AdjointOperator=AdjointOperator, matmul=matmul, add=add
)
