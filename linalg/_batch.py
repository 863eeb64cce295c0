"""Batch repeat and sum over a batch dimension of operators.

* `repeat(A, *sizes)` (``A.repeat``) has ``torch.Tensor.repeat``'s semantics: the leading sizes
  tile the batch (an index into the batch: structure kept, every child tensor gathered), the
  last two tile the matrix, ``[[A, A], [A, A]] = 1_{r x c} ⊗ A`` (a `KroneckerOperator`).
* `sum_batch(A, dim)` (``A.sum(dim)``) is ``sum_b A[b]`` along one batch dimension: operators
  linear in their tensors (dense, diagonal, scaled identity, Toeplitz, circulant, ...) sum their
  tensors, others become a lazy `BatchSumOperator` whose matmul is ``sum_b A[b] X``.
"""

from __future__ import annotations

import torch

from . import _base
from ._base import LinearOperator, _flatten_operator, _unflatten_operator
from ._dense import DenseOperator, DiagonalOperator, ScaledIdentityOperator, TriangularOperator
from ._kronecker import KroneckerOperator
from ._rules import diagonal, scale, trace
from ._structured import ToeplitzOperator


def repeat(A: LinearOperator, *sizes) -> LinearOperator:
    """``A`` repeated as ``torch.Tensor.repeat(*sizes)`` would repeat ``A.to_dense()``.

    Args:
        A: an operator of shape ``batch_shape + (m, n)``.
        *sizes: at least ``A.ndim`` repeat counts (more add leading batch dimensions); the last
            two tile the matrix.

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator, repeat
        >>> D = DiagonalOperator(torch.tensor([1.0, 2.0]))  # [2, 2]
        >>> R = repeat(D, 3, 1, 1)  # [3, 2, 2], still diagonal
        >>> type(R).__name__, tuple(R.shape)
        ('DiagonalOperator', (3, 2, 2))
    """
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        sizes = tuple(sizes[0])
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) < A.ndim or any(s < 1 for s in sizes):
        raise ValueError(
            f"repeat({A!r}, *sizes={sizes}): expected at least {A.ndim} positive repeat counts "
            "(one per dimension, the last two for the matrix)."
        )
    out = A
    batch_sizes, (r, c) = sizes[:-2], sizes[-2:]
    extra = len(batch_sizes) - len(A.batch_shape)
    if any(s != 1 for s in batch_sizes):
        bshape = (1,) * extra + tuple(A.batch_shape)
        out = out._expand_batch(torch.Size(bshape)) if extra else out
        if all(b == 1 for b, s in zip(bshape, batch_sizes) if s != 1):
            # repeating size-1 dimensions is an expand: nothing copied
            out = out._expand_batch(torch.Size(b * s for b, s in zip(bshape, batch_sizes)))
        else:
            nd = len(bshape)
            key = []
            for i, (b, s) in enumerate(zip(bshape, batch_sizes)):
                idx = torch.arange(b, device=A.device).repeat(s)
                key.append(idx.reshape((-1,) + (1,) * (nd - 1 - i)))
            out = out._batch_getitem(tuple(key))
    elif extra:
        out = out._expand_batch(torch.Size((1,) * extra + tuple(A.batch_shape)))
    if (r, c) != (1, 1):
        ones = torch.ones(r, c, dtype=A.dtype, device=A.device)
        out = KroneckerOperator(DenseOperator(ones), out)
    return out


# Operators whose matrix is linear in each of their tensors (and that have no others): the sum
# over a batch dimension is the operator of the summed tensors.
_LINEAR = (
    DenseOperator,
    DiagonalOperator,
    ScaledIdentityOperator,
    TriangularOperator,
    ToeplitzOperator,
)


def sum_batch(A: LinearOperator, dim: int = 0) -> LinearOperator:
    """``sum_b A[..., b, ...]`` along batch dimension ``dim`` (``A.sum(dim)``; ``dim`` counts
    over the whole shape, as ``A.to_dense().sum(dim)``: -3 is the last batch dimension).

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator, sum_batch
        >>> D = DiagonalOperator(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))  # [2, 2, 2]
        >>> sum_batch(D, 0).diagonal().tolist()  # [2]
        [4.0, 6.0]
    """
    nb = len(A.batch_shape)
    if not -A.ndim <= dim < A.ndim or dim % A.ndim >= nb:
        raise ValueError(
            f"sum_batch({A!r}, dim={dim}): expected a batch dimension (dim in [0, {nb}) or "
            f"[{-A.ndim}, -2), as for its dense tensor); the matrix dimensions of an operator "
            "cannot be summed."
        )
    d = dim % A.ndim
    if type(A) in _LINEAR:
        children, aux = _flatten_operator(A)
        bshape = A.batch_shape
        new = []
        for child, core in zip(children, A._child_core_ndims(children)):
            if isinstance(child, torch.Tensor) and (
                child.is_floating_point() or child.is_complex()
            ):
                child = child.expand(bshape + child.shape[child.dim() - core :]).sum(d)
            new.append(child)
        return _unflatten_operator(aux, new)
    return BatchSumOperator(A, d)


class BatchSumOperator(LinearOperator):
    """``sum_b A[..., b, ...]`` over batch dimension ``dim`` of ``base``, kept lazy: matmul is
    ``sum_b A[b] X`` (``base`` applied once to the broadcast ``X``).

    Example:
        >>> import torch
        >>> from functransforms.linalg import BatchSumOperator, LowRankOperator
        >>> S = BatchSumOperator(LowRankOperator(torch.ones(4, 3, 1)), 0)  # [3, 3]
        >>> (S @ torch.ones(3)).tolist()  # 4 (1 1^T) 1
        [12.0, 12.0, 12.0]
    """

    _tree_fields = ("base",)
    _static_fields = ("dim",)

    def __init__(self, base: LinearOperator, dim: int = 0, **props):
        if not isinstance(base, LinearOperator) or not base.batch_shape:
            raise TypeError(
                f"BatchSumOperator(base, dim): expected an operator with a batch dimension, "
                f"received {base!r}."
            )
        nb = len(base.batch_shape)
        self.base, self.dim = base, dim % nb
        for name in ("symmetric", "positive_definite", "lower", "upper"):
            props[name] = bool(props.get(name)) or getattr(base, name)
        batch = base.batch_shape[: self.dim] + base.batch_shape[self.dim + 1 :]
        super().__init__(batch + base.shape[-2:], base.dtype, base.device, **props)

    def _repr_extra(self):
        return f"{self.base!r}, dim={self.dim}"

    def _axis(self, core):
        # the summed dimension, counted from the right of a result with `core` matrix dims
        return self.dim - len(self.base.batch_shape) - core

    def _lift(self, X):
        # X's batch aligns with the result's batch: a size-1 dimension where base has `dim`
        i = self._axis(2)
        return X.unsqueeze(i) if X.dim() >= -i - 1 else X

    def _matmul(self, X):
        return self.base._matmul(self._lift(X)).sum(self._axis(2))

    def _rmatmul(self, X):
        return self.base._rmatmul(self._lift(X)).sum(self._axis(2))

    def _to_dense(self):
        return self.base._to_dense().sum(self._axis(2))

    def _transpose(self):
        return BatchSumOperator(self.base._transpose(), self.dim, **self._props(
            lower=self.upper, upper=self.lower))  # fmt: skip

    def _adjoint(self):
        return BatchSumOperator(self.base._adjoint(), self.dim, **self._props(
            lower=self.upper, upper=self.lower))  # fmt: skip


@diagonal.register(BatchSumOperator)
def _diagonal_batch_sum(A):
    # diag(sum_b A_b) = sum_b diag(A_b)
    return diagonal(A.base).sum(A._axis(1))


@trace.register(BatchSumOperator)
def _trace_batch_sum(A):
    # tr(sum_b A_b) = sum_b tr(A_b)
    return trace(A.base).sum(A._axis(0))


@scale.register(BatchSumOperator)
def _scale_batch_sum(A, c):
    # c sum_b A_b = sum_b c A_b
    return BatchSumOperator(scale(A.base, c), A.dim)


# the base class reaches these through ``_late`` (Note [The base class's import cycles])
_base._late.__dict__.update(repeat=repeat, sum_batch=sum_batch)
