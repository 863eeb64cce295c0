"""The zero operator, general block operators ``[[A, B], [C, D]]`` and concatenation.

* ``0 @ X = 0``, ``0 + B = B``, ``0 A = A 0 = 0``: structure rules, so zeros vanish from algebra.
* A block operator applies each block to its slice of ``X``: ``(B X)_i = sum_j B_ij X_j``, with
  zero blocks skipped. Block triangular operators with square diagonal blocks solve by block
  substitution (``X_i = B_ii^{-1}(Y_i - sum_{j<i} B_ij X_j)``) and have
  ``det = prod_i det B_ii``; anything else is the dense default.
"""

from __future__ import annotations

import math

import torch

from ._base import LinearOperator, broadcast_batch
from ._composite import as_operator
from ._rules import add, diagonal, matmul, rmatmul, scale, slogdet, solve, trace


class ZeroOperator(LinearOperator):
    """The ``(..., m, n)`` zero matrix: no tensors, every product is zero.

    Args:
        m, n: matrix shape (``n`` defaults to ``m``).
        batch_shape: batch dimensions (default none).
        dtype, device: of the represented matrix.

    Example:
        >>> import torch
        >>> from functransforms.linalg import ZeroOperator, DiagonalOperator
        >>> Z = ZeroOperator(3, 2, dtype=torch.float64)  # [3, 2]
        >>> (Z @ torch.ones(2, dtype=torch.float64)).tolist()  # [3]
        [0.0, 0.0, 0.0]
        >>> D = DiagonalOperator(torch.ones(3, dtype=torch.float64))
        >>> ZeroOperator(3, dtype=torch.float64) + D is D
        True
    """

    _static_fields = ("m", "n", "batch_shape_", "dtype", "device")

    def __init__(self, m: int, n: int | None = None, *, batch_shape_=(), batch_shape=None,
                 dtype=None, device=None, **props):  # fmt: skip
        self.m = int(m)
        self.n = self.m if n is None else int(n)
        self.batch_shape_ = torch.Size(batch_shape if batch_shape is not None else batch_shape_)
        dtype = dtype or torch.get_default_dtype()
        device = torch.device(device) if device is not None else torch.device("cpu")
        square = self.m == self.n
        props.update(symmetric=square, lower=square, upper=square)
        props["positive_definite"] = False
        props["unitary"] = False
        super().__init__(self.batch_shape_ + (self.m, self.n), dtype, device, **props)

    def _zeros(self, X, rows):
        """Zeros of shape ``broadcast(batch, X's batch) + (rows, k)`` (X's transform wrappers
        kept, so vmap sees a batched result)."""
        batch = broadcast_batch(self.batch_shape, X.shape[:-2])
        z = torch.zeros_like(X[..., :1, :]).expand(X.shape[:-2] + (rows, X.shape[-1]))
        return z.expand(batch + z.shape[-2:]).to(torch.promote_types(X.dtype, self.dtype))

    def _matmul(self, X):
        return self._zeros(X, self.m)

    def _rmatmul(self, X):
        return self._zeros(X.mT, self.n).mT

    def _to_dense(self):
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def _transpose(self):
        return ZeroOperator(
            self.n, self.m, batch_shape=self.batch_shape, dtype=self.dtype, device=self.device
        )

    _adjoint = _transpose

    def _frobenius_sq(self):
        return torch.zeros(self.batch_shape, dtype=self.dtype, device=self.device)

    def _expand_batch(self, batch_shape):
        return ZeroOperator(
            self.m, self.n, batch_shape=batch_shape, dtype=self.dtype, device=self.device
        )

    def _batch_getitem(self, batch_key):
        shape = torch.empty(self.batch_shape + (0,), device="meta")[batch_key].shape[:-1]
        return self._expand_batch(shape)


def _zero_like(A, m, n):
    return ZeroOperator(m, n, batch_shape=A.batch_shape, dtype=A.dtype, device=A.device)


@diagonal.register(ZeroOperator)
def _diagonal_zero(A):
    # diag 0 = 0
    return torch.zeros(A.batch_shape + (min(A.m, A.n),), dtype=A.dtype, device=A.device)


@trace.register(ZeroOperator)
def _trace_zero(A):
    # tr 0 = 0
    return torch.zeros(A.batch_shape, dtype=A.dtype, device=A.device)


@scale.register(ZeroOperator)
def _scale_zero(A, c):
    # c 0 = 0
    return A


@add.register(ZeroOperator)
def _add_zero(A, B):
    # 0 + B = B (batch shapes broadcast)
    if B.batch_shape == broadcast_batch(A.batch_shape, B.batch_shape):
        return B
    return B._expand_batch(broadcast_batch(A.batch_shape, B.batch_shape))


@matmul.register(ZeroOperator)
def _matmul_zero(A, B):
    # 0 B = 0
    return ZeroOperator(
        A.m, B.shape[-1], batch_shape=broadcast_batch(A.batch_shape, B.batch_shape),
        dtype=A.dtype, device=A.device,
    )  # fmt: skip


@rmatmul.register(ZeroOperator)
def _rmatmul_zero(B, A):
    # A 0 = 0
    return ZeroOperator(
        A.shape[-2], B.n, batch_shape=broadcast_batch(A.batch_shape, B.batch_shape),
        dtype=B.dtype, device=B.device,
    )  # fmt: skip


@slogdet.register(ZeroOperator)
def _slogdet_zero(A):
    # det 0 = 0: sign 0, log|det| = -inf (as torch.linalg.slogdet of a zero matrix)
    z = torch.zeros(A.batch_shape, dtype=A.dtype, device=A.device)
    return z, torch.full_like(z, -math.inf)


@solve.register(ZeroOperator)
def _solve_zero(A, B):
    raise torch.linalg.LinAlgError(
        f"torch.linalg.solve({A!r}, B): the zero operator is singular. Expected an invertible "
        "operator."
    )


class BlockOperator(LinearOperator):
    """A matrix of blocks ``[[B_00, B_01, ...], [B_10, ...], ...]`` (operators, tensors or None
    for a zero block), never assembled.

    Every block row has one height and every block column one width. Matmul applies the blocks
    to slices of the input and skips zero blocks. Block lower/upper triangular operators with
    square diagonal blocks solve by block substitution and take ``det = prod det B_ii`` (exact,
    through the diagonal blocks' own structure); other solves and determinants are dense.

    Args:
        blocks: a list of block rows, each a list of operators, tensors ``(..., m_i, n_j)`` or
            None.
        **props: declared properties (``symmetric``: the caller promises ``B_ji = B_ij^T``).

    Example:
        >>> import torch
        >>> from functransforms.linalg import BlockOperator, DiagonalOperator
        >>> A = DiagonalOperator(torch.tensor([2.0, 4.0]))
        >>> B = BlockOperator([[A, None], [torch.ones(1, 2), torch.ones(1, 1)]])  # [3, 3]
        >>> (B @ torch.ones(3)).tolist()  # [3]
        [2.0, 4.0, 3.0]
        >>> torch.linalg.solve(B, torch.tensor([2.0, 4.0, 3.0])).tolist()  # block substitution
        [1.0, 1.0, 1.0]
    """

    _tree_fields = ("blocks",)

    def __init__(self, blocks, **props):
        call = "BlockOperator(blocks)"
        if (
            not isinstance(blocks, (list, tuple))
            or not blocks
            or not all(isinstance(r, (list, tuple)) and r for r in blocks)
        ):
            raise TypeError(
                f"{call}: expected a non-empty list of non-empty block rows (lists), received "
                f"{type(blocks).__name__}."
            )
        ncols = len(blocks[0])
        if any(len(r) != ncols for r in blocks):
            raise ValueError(
                f"{call}: expected block rows of one length, received lengths "
                f"{[len(r) for r in blocks]}."
            )
        grid = [[None if b is None else as_operator(b, call) for b in r] for r in blocks]
        heights = [_common(call, "block row", i, [b.shape[-2] for b in r if b is not None])
                   for i, r in enumerate(grid)]  # fmt: skip
        widths = [
            _common(call, "block column", j, [r[j].shape[-1] for r in grid if r[j] is not None])
            for j in range(ncols)
        ]
        known = [b for r in grid for b in r if b is not None]
        dtype = known[0].dtype
        for b in known[1:]:
            dtype = torch.promote_types(dtype, b.dtype)
        device = known[0].device
        batch = broadcast_batch(*(b.batch_shape for b in known))
        self.blocks = [
            [
                ZeroOperator(heights[i], widths[j], dtype=dtype, device=device) if b is None else b
                for j, b in enumerate(r)
            ]
            for i, r in enumerate(grid)
        ]
        self.heights, self.widths = heights, widths
        square_diag = len(grid) == ncols and heights == widths
        zero_above = all(_is_zero(self.blocks[i][j]) for i in range(len(grid))
                         for j in range(i + 1, ncols))  # fmt: skip
        zero_below = all(_is_zero(self.blocks[i][j]) for i in range(len(grid)) for j in range(i))
        self._tri = None
        if square_diag and (zero_above or zero_below):
            self._tri = "lower" if zero_above else "upper"
            diag = [self.blocks[i][i] for i in range(ncols)]
            if zero_above and all(d.lower for d in diag):
                props["lower"] = True
            if zero_below and all(d.upper for d in diag):
                props["upper"] = True
            if zero_above and zero_below:
                for name in ("symmetric", "positive_definite", "unitary"):
                    props[name] = props.get(name) or all(getattr(d, name) for d in diag)
        super().__init__(batch + (sum(heights), sum(widths)), dtype, device, **props)

    def _repr_extra(self):
        return f"{len(self.heights)}x{len(self.widths)} blocks"

    def _apply(self, X, grid, sizes_out, sizes_in, method):
        parts = torch.split(X, sizes_in, dim=-2)
        rows = []
        for i, r in enumerate(grid):
            acc = None
            for b, x in zip(r, parts):
                if not _is_zero(b):
                    y = method(b, x)
                    acc = y if acc is None else acc + y
            if acc is None:
                acc = torch.zeros_like(X[..., :1, :]).expand(X.shape[:-2] + (sizes_out[i], -1))
            rows.append(acc)
        batch = broadcast_batch(self.batch_shape, *(p.shape[:-2] for p in rows))
        return torch.cat([p.expand(batch + p.shape[-2:]) for p in rows], dim=-2)

    def _matmul(self, X):
        return self._apply(X, self.blocks, self.heights, self.widths, _matmul_of)

    def _rmatmul(self, X):
        # X B: (B^T X^T)^T, blocks transposed
        grid = [[r[j]._transpose() for r in self.blocks] for j in range(len(self.widths))]
        return self._apply(X.mT, grid, self.widths, self.heights, _matmul_of).mT

    def _to_dense(self):
        dense = [[b._to_dense() for b in r] for r in self.blocks]
        batch = broadcast_batch(*(d.shape[:-2] for r in dense for d in r))
        rows = [torch.cat([d.to(self.dtype).expand(batch + d.shape[-2:]) for d in r], -1)
                for r in dense]  # fmt: skip
        return torch.cat(rows, -2)

    def _transpose(self):
        grid = [[r[j]._transpose() for r in self.blocks] for j in range(len(self.widths))]
        return BlockOperator(grid, **_swap(self._props()))

    def _adjoint(self):
        if not self.is_complex:
            return self._transpose()
        grid = [[r[j]._adjoint() for r in self.blocks] for j in range(len(self.widths))]
        return BlockOperator(grid, **_swap(self._props()))

    def _frobenius_sq(self):
        return sum(b._frobenius_sq() for r in self.blocks for b in r if not _is_zero(b))

    def _diag_blocks(self):
        return [self.blocks[i][i] for i in range(len(self.heights))]

    def _square_diagonal(self):
        return self.heights == self.widths


def _common(call, what, i, sizes):
    if not sizes:
        raise ValueError(
            f"{call}: {what} {i} has only None blocks, so its size is unknown; give one of its "
            "blocks as a ZeroOperator(m, n)."
        )
    if len(set(sizes)) != 1:
        raise ValueError(f"{call}: the blocks of {what} {i} have different sizes {sizes}.")
    return sizes[0]


def _is_zero(b):
    return isinstance(b, ZeroOperator)


def _matmul_of(op, X):
    return op._matmul(X)


def _swap(props):
    props = dict(props)
    props["lower"], props["upper"] = props["upper"], props["lower"]
    return props


@diagonal.register(BlockOperator)
def _diagonal_block(A):
    # the diagonal blocks' diagonals, concatenated (square diagonal blocks)
    if not A._square_diagonal():
        return A._to_dense().diagonal(dim1=-2, dim2=-1)
    parts = [diagonal(b) for b in A._diag_blocks()]
    batch = broadcast_batch(A.batch_shape, *(p.shape[:-1] for p in parts))
    return torch.cat([p.to(A.dtype).expand(batch + p.shape[-1:]) for p in parts], -1)


@trace.register(BlockOperator)
def _trace_block(A):
    # tr B = sum_i tr B_ii
    if not A._square_diagonal():
        return diagonal(A).sum(-1)
    return sum(trace(b) for b in A._diag_blocks())


@scale.register(BlockOperator)
def _scale_block(A, c):
    # c [B_ij] = [c B_ij]
    grid = [[scale(b, c) for b in r] for r in A.blocks]
    props = A._props()
    props["positive_definite"] = (
        props["positive_definite"] and isinstance(c, (int, float)) and (c > 0)
    )
    return BlockOperator(grid, **props)


@add.register(BlockOperator)
def _add_block(A, B):
    # [A_ij] + [B_ij] = [A_ij + B_ij] for one partition
    if isinstance(B, BlockOperator) and A.heights == B.heights and A.widths == B.widths:
        return BlockOperator(
            [[a + b for a, b in zip(ra, rb)] for ra, rb in zip(A.blocks, B.blocks)]
        )
    return None


@matmul.register(BlockOperator)
def _matmul_block(A, B):
    # [A_ik] [B_kj] = [sum_k A_ik B_kj] when A's column partition is B's row partition
    if isinstance(B, BlockOperator) and A.widths == B.heights:
        grid = []
        for ra in A.blocks:
            row = []
            for j in range(len(B.widths)):
                terms = [a @ rb[j] for a, rb in zip(ra, B.blocks)]
                acc = terms[0]
                for t in terms[1:]:
                    acc = acc + t
                row.append(acc)
            grid.append(row)
        return BlockOperator(grid)
    return None


@solve.register(BlockOperator)
def _solve_block(A, B):
    # block forward (lower) or back (upper) substitution:
    # X_i = B_ii^{-1} (Y_i - sum_{j != i, earlier} B_ij X_j)
    if A._tri is None:
        return solve.dispatch(LinearOperator)(A, B)
    nb = len(A.heights)
    parts = list(torch.split(B, A.heights, dim=-2))
    order = range(nb) if A._tri == "lower" else range(nb - 1, -1, -1)
    X = [None] * nb
    for i in order:
        rhs = parts[i]
        for j in range(nb):
            if j != i and X[j] is not None and not _is_zero(A.blocks[i][j]):
                rhs = rhs - A.blocks[i][j]._matmul(X[j])
        X[i] = solve(A.blocks[i][i], rhs)
    batch = broadcast_batch(*(x.shape[:-2] for x in X))
    return torch.cat([x.expand(batch + x.shape[-2:]) for x in X], -2)


@slogdet.register(BlockOperator)
def _slogdet_block(A):
    # det of a block triangular matrix = prod_i det B_ii
    if A._tri is None:
        return slogdet.dispatch(LinearOperator)(A)
    signs, logs = zip(*(slogdet(b) for b in A._diag_blocks()))
    sign, logabs = signs[0], logs[0]
    for s, lg in zip(signs[1:], logs[1:]):
        sign, logabs = sign * s, logabs + lg
    return sign, logabs


def cat(ops, dim: int = -2) -> BlockOperator:
    """Concatenate operators (or tensors) along the rows (``dim=-2``) or columns (``dim=-1``),
    lazily: a one-column or one-row `BlockOperator`. ``torch.cat`` of operators routes here.

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator, cat
        >>> C = cat([DiagonalOperator(torch.ones(2)), torch.ones(1, 2)])  # [3, 2]
        >>> (C @ torch.tensor([1.0, 2.0])).tolist()  # [3]
        [1.0, 2.0, 3.0]
    """
    ops = list(ops)
    if not ops:
        raise ValueError("cat(ops, dim): expected at least one operator, received none.")
    nd = max(getattr(o, "ndim", 2) for o in ops)
    d = dim % nd if dim < 0 else dim
    if d == nd - 2:
        return BlockOperator([[o] for o in ops])
    if d == nd - 1:
        return BlockOperator([ops])
    raise ValueError(
        f"cat(ops, dim={dim}): only the matrix dimensions (-2: rows, -1: columns) of operators "
        "can be concatenated; concatenating batch dimensions is not supported."
    )
