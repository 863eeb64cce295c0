"""Operators built from operators (Transpose, Adjoint, Sum, Product; the block-diagonal ones are
in ``_block_diagonal.py``), and the resolvers of ``a @ b`` and ``a + b`` (Note [Dispatch
precedence] in ``_rules.py``)."""

from __future__ import annotations

import torch

from . import _base
from ._base import LinearOperator, broadcast_batch, dense_fallback
from ._dense import (
    DenseOperator,
    ScaledIdentityOperator,
    _scaled_props,
    dense_inv,
    dense_slogdet,
    dense_solve,
)
from ._rules import add as add_rule
from ._rules import diagonal, inv, scale, slogdet, solve, trace
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
    return slogdet_of_product(A.ops)


def slogdet_of_product(ops):
    """``(sign, logabs)`` of ``prod_i det(ops_i)``: the factors' slogdets multiplied."""
    signs, logs = zip(*(slogdet(op) for op in ops))
    sign, logabs = signs[0], logs[0]
    for s, l in zip(signs[1:], logs[1:]):
        sign, logabs = sign * s, logabs + l
    return sign, logabs


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
