"""Block-diagonal operators: BlockDiagonalOperator (a list of blocks) and
BatchedBlockDiagonalOperator (equal blocks stacked along a batch dim), with their structure
rules."""

from __future__ import annotations

import torch

from ._base import LinearOperator, broadcast_batch
from ._composite import (
    ProductOperator,
    _matmul_of,
    _MultiOperator,
    _rmatmul_of,
    add,
    as_operator,
    matmul,
    slogdet_of_product,
)
from ._dense import (
    DenseOperator,
    PermutationOperator,
    _scaled_props,
)
from ._rules import add as add_rule
from ._rules import cholesky, diagonal, eigh, inv, scale, slogdet, solve, trace
from ._rules import matmul as matmul_rule


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
    return slogdet_of_product(A.ops)


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
