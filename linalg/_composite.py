"""Operators built from operators: Transpose, Adjoint, Sum, Product, BlockDiagonal."""

from __future__ import annotations

import torch

from ._base import LinearOperator, broadcast_batch


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
        from ._dense import DenseOperator

        return DenseOperator(x)
    raise TypeError(
        f"{call}: expected a LinearOperator or a torch.Tensor, received {type(x).__name__}."
    )


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

    def _diagonal(self):
        return self.base._diagonal()

    def _solve(self, B):
        if self.symmetric and not self.is_complex:
            return self.base._solve(B)
        return self.base._inverse()._transpose()._matmul(B)

    def _inverse(self):
        return self.base._inverse()._transpose()

    def _slogdet(self):
        return self.base._slogdet()

    def _trace(self):
        return self.base._trace()

    def _frobenius_sq(self):
        return self.base._frobenius_sq()


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
        from ._dense import DenseOperator

        return DenseOperator(self.base._to_dense().conj())

    def _adjoint(self):
        return self.base

    def _diagonal(self):
        return self.base._diagonal().conj()

    def _solve(self, B):
        return self.base._inverse()._adjoint()._matmul(B)

    def _inverse(self):
        return self.base._inverse()._adjoint()

    def _slogdet(self):
        sign, logabs = self.base._slogdet()
        return sign.conj(), logabs

    def _trace(self):
        return self.base._trace().conj()


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

    def _diagonal(self):
        out = self.ops[0]._diagonal()
        for op in self.ops[1:]:
            out = out + op._diagonal()
        return out

    def _scale(self, c):
        from ._dense import _scaled_props

        return SumOperator([op._scale(c) for op in self.ops], **_scaled_props(self, c))

    def _trace(self):
        return sum(op._trace() for op in self.ops)


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

    def _scale(self, c):
        from ._dense import _scaled_props

        ops = [self.ops[0]._scale(c)] + self.ops[1:]
        return ProductOperator(ops, **_scaled_props(self, c))

    def _all_square(self):
        return all(op.is_square for op in self.ops)

    def _solve(self, B):
        # (A_1 ... A_k)^{-1} B = A_k^{-1} ... A_1^{-1} B when every factor is square.
        if not self._all_square():
            return super()._solve(B)
        for op in self.ops:
            B = op._solve(B)
        return B

    def _inverse(self):
        if not self._all_square():
            return super()._inverse()
        return ProductOperator([op._inverse() for op in reversed(self.ops)], **self._props())

    def _slogdet(self):
        if not self._all_square():
            return super()._slogdet()
        signs, logs = zip(*(op._slogdet() for op in self.ops))
        sign, logabs = signs[0], logs[0]
        for s, l in zip(signs[1:], logs[1:]):
            sign, logabs = sign * s, logabs + l
        return sign, logabs


class BlockDiagonalOperator(_MultiOperator):
    """``blockdiag(A_1, ..., A_k)`` of square blocks (sizes may differ); every algorithm per block.

    Example:
        >>> import torch
        >>> from functransforms.linalg import BlockDiagonalOperator, DiagonalOperator
        >>> B = BlockDiagonalOperator([torch.eye(2) * 2, DiagonalOperator(torch.ones(3))])
        >>> B.shape, torch.logdet(B).item() == 2 * torch.log(torch.tensor(2.0)).item()  # [5, 5]
        (torch.Size([5, 5]), True)
    """

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

    def _per_block(self, method, X, out_dim=-2):
        parts = [getattr(op, method)(x) for op, x in zip(self.ops, self._split(X, out_dim))]
        batch = broadcast_batch(*(p.shape[:-2] for p in parts))
        return torch.cat([p.expand(batch + p.shape[-2:]) for p in parts], dim=out_dim)

    def _matmul(self, X):
        return self._per_block("_matmul", X)

    def _rmatmul(self, X):
        return self._per_block("_rmatmul", X, out_dim=-1)

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

    def _diagonal(self):
        parts = [op._diagonal() for op in self.ops]
        batch = broadcast_batch(*(p.shape[:-1] for p in parts))
        return torch.cat([p.expand(batch + p.shape[-1:]) for p in parts], dim=-1)

    def _scale(self, c):
        from ._dense import _scaled_props

        return BlockDiagonalOperator([op._scale(c) for op in self.ops], **_scaled_props(self, c))

    def _matmul_operator(self, other):
        if isinstance(other, BlockDiagonalOperator) and other.sizes == self.sizes:
            from ._functions import matmul

            return BlockDiagonalOperator([matmul(a, b) for a, b in zip(self.ops, other.ops)])
        return None

    def _add(self, other):
        if isinstance(other, BlockDiagonalOperator) and other.sizes == self.sizes:
            from ._functions import add

            return BlockDiagonalOperator([add(a, b) for a, b in zip(self.ops, other.ops)])
        return None

    def _solve(self, B):
        return self._per_block("_solve", B)

    def _inverse(self):
        return self._map_ops(lambda op: op._inverse())

    def _slogdet(self):
        signs, logs = zip(*(op._slogdet() for op in self.ops))
        sign, logabs = signs[0], logs[0]
        for s, l in zip(signs[1:], logs[1:]):
            sign, logabs = sign * s, logabs + l
        return sign, logabs

    def _cholesky(self):
        return BlockDiagonalOperator([op._cholesky() for op in self.ops])

    def _eigh(self):
        from ._dense import PermutationOperator

        pairs = [op._eigh() for op in self.ops]
        evals = [p[0] for p in pairs]
        batch = broadcast_batch(*(e.shape[:-1] for e in evals))
        evals = torch.cat([e.expand(batch + e.shape[-1:]) for e in evals], dim=-1)
        evals, idx = torch.sort(evals, dim=-1)
        Q = BlockDiagonalOperator([p[1] for p in pairs], unitary=True)
        return evals, ProductOperator([Q, PermutationOperator(idx, dtype=self.dtype).mT])

    def _trace(self):
        return sum(op._trace() for op in self.ops)

    def _frobenius_sq(self):
        return sum(op._frobenius_sq() for op in self.ops)


def _swap_lu(op):
    return dict(lower=op.upper, upper=op.lower)
