"""Lazy elementwise (Hadamard) products ``A ∘ B`` of operators (``A * B``).

Identities used (each a structure rule of `hadamard`, in the order tried):

* ``A ∘ 0 = 0``; ``A ∘ diag(d) = diag(d ∘ diag A)``; ``A ∘ (c I) = diag(c diag A)``;
* ``(A_1 ⊗ A_2) ∘ (B_1 ⊗ B_2) = (A_1 ∘ B_1) ⊗ (A_2 ∘ B_2)`` (factors of one shape);
* ``(A ∘ U V^H) x = sum_r diag(u_r) A diag(conj v_r) x``: r products with A, never A densely;
* otherwise the product is lazy and its matmul forms the dense factors elementwise
  (O(m n) memory per product).

Properties follow the Schur product theorem: the Hadamard product of symmetric positive
definite matrices is symmetric positive definite.
"""

from __future__ import annotations

import torch

from . import _base
from ._base import LinearOperator, broadcast_batch
from ._block import ZeroOperator
from ._composite import as_operator
from ._dense import DenseOperator, DiagonalOperator, ScaledIdentityOperator
from ._kronecker import KroneckerOperator
from ._lowrank import LowRankOperator
from ._rules import diagonal, scale, trace


class HadamardProductOperator(LinearOperator):
    """``A_1 ∘ A_2 ∘ ...``: the elementwise product of operators of one shape, kept lazy.

    Build it with ``A * B`` (two operators) or `hadamard`, which first applies the identities
    of the module docstring (a diagonal, a zero, Kronecker factors of one shape). Matmul is
    structured when one factor is a `LowRankOperator` (``sum_r diag(u_r) A diag(v_r)``, r
    products with the other factors), else it forms the dense factors elementwise. Solves and
    determinants are the dense defaults.

    Example:
        >>> import torch
        >>> from functransforms.linalg import DenseOperator, LowRankOperator
        >>> A = DenseOperator(torch.arange(9.0).reshape(3, 3))
        >>> H = A * LowRankOperator(torch.ones(3, 1) * 2, torch.ones(3, 1))  # [3, 3], 2 A
        >>> (H @ torch.ones(3)).tolist()  # [3]
        [6.0, 24.0, 42.0]
    """

    _tree_fields = ("ops",)

    def __init__(self, ops, **props):
        ops = [as_operator(o, "HadamardProductOperator(ops)") for o in ops]
        flat = []
        for o in ops:
            flat.extend(o.ops if isinstance(o, HadamardProductOperator) else [o])
        if len(flat) < 1:
            raise ValueError("HadamardProductOperator(ops): expected at least one operator.")
        shapes = {o.shape[-2:] for o in flat}
        if len(shapes) != 1:
            raise ValueError(
                "HadamardProductOperator(ops): expected operators of one matrix shape, received "
                f"{[tuple(o.shape) for o in flat]}."
            )
        self.ops = flat
        for name in ("symmetric", "positive_definite", "lower", "upper"):
            props[name] = bool(props.get(name)) or all(getattr(o, name) for o in flat)
        # a product with one triangular factor is triangular
        props["lower"] = props["lower"] or any(o.lower for o in flat)
        props["upper"] = props["upper"] or any(o.upper for o in flat)
        batch = broadcast_batch(*(o.batch_shape for o in flat))
        dtype = flat[0].dtype
        for o in flat[1:]:
            dtype = torch.promote_types(dtype, o.dtype)
        super().__init__(batch + flat[0].shape[-2:], dtype, flat[0].device, **props)

    def _repr_extra(self):
        return " ∘ ".join(repr(o) for o in self.ops)

    def _low_rank_split(self):
        for i, o in enumerate(self.ops):
            if isinstance(o, LowRankOperator):
                rest = self.ops[:i] + self.ops[i + 1 :]
                return o, (rest[0] if len(rest) == 1 else HadamardProductOperator(rest))
        return None, None

    def _matmul(self, X):
        lr, rest = self._low_rank_split()
        if lr is None or len(self.ops) == 1:
            return self._to_dense() @ X
        # (A ∘ U V^H) X = sum_r diag(u_r) A diag(conj v_r) X: the r columns as one matmul
        U, V = lr.U, lr._V.conj()
        Xr = V.mT.unsqueeze(-1) * X.unsqueeze(-3)  # (..., r, n, k)
        Y = rest._matmul(Xr)  # (..., r, m, k)
        return (U.mT.unsqueeze(-1) * Y).sum(-3)

    def _rmatmul(self, X):
        return self._transpose()._matmul(X.mT).mT

    def _to_dense(self):
        out = self.ops[0]._to_dense()
        for o in self.ops[1:]:
            out = out * o._to_dense()
        return out

    def _transpose(self):
        props = self._props(lower=self.upper, upper=self.lower)
        return HadamardProductOperator([o._transpose() for o in self.ops], **props)

    def _adjoint(self):
        props = self._props(lower=self.upper, upper=self.lower)
        return HadamardProductOperator([o._adjoint() for o in self.ops], **props)


@diagonal.register(HadamardProductOperator)
def _diagonal_hadamard(A):
    # diag(A ∘ B) = diag A ∘ diag B
    out = diagonal(A.ops[0])
    for o in A.ops[1:]:
        out = out * diagonal(o)
    return out


@trace.register(HadamardProductOperator)
def _trace_hadamard(A):
    # tr(A ∘ B) = sum diag A ∘ diag B
    return diagonal(A).sum(-1)


@scale.register(HadamardProductOperator)
def _scale_hadamard(A, c):
    # c (A ∘ B) = (c A) ∘ B
    props = A._props(
        positive_definite=A.positive_definite and isinstance(c, (int, float)) and c > 0
    )
    return HadamardProductOperator([scale(A.ops[0], c)] + A.ops[1:], **props)


def hadamard(a, b) -> LinearOperator:
    """``a ∘ b``, the elementwise product of two operators (or an operator and a tensor
    ``(..., m, n)``), structured when an identity applies (module docstring), else a lazy
    `HadamardProductOperator`. ``a * b`` of two operators calls this.

    Example:
        >>> import torch
        >>> from functransforms.linalg import DenseOperator, DiagonalOperator, hadamard
        >>> H = hadamard(DenseOperator(torch.ones(2, 2) * 3), DiagonalOperator(torch.ones(2)))
        >>> type(H).__name__, H.diagonal().tolist()  # A ∘ diag(d) = diag(d ∘ diag A)
        ('DiagonalOperator', [3.0, 3.0])
    """
    a = as_operator(a, "hadamard(a, b)")
    b = as_operator(b, "hadamard(a, b)")
    if a.shape[-2:] != b.shape[-2:]:
        raise ValueError(
            f"hadamard({a!r}, {b!r}): expected operators of one matrix shape, received "
            f"{tuple(a.shape)} and {tuple(b.shape)}."
        )
    for x, y in ((a, b), (b, a)):
        if isinstance(x, ZeroOperator):
            batch = broadcast_batch(x.batch_shape, y.batch_shape)
            return ZeroOperator(x.m, x.n, batch_shape=batch, dtype=x.dtype, device=x.device)
        if isinstance(x, DiagonalOperator) or (
            isinstance(x, ScaledIdentityOperator) and x.is_square
        ):
            # A ∘ diag(d) = diag(d ∘ diag A)
            return DiagonalOperator(diagonal(x) * diagonal(y))
    if isinstance(a, DenseOperator) and isinstance(b, DenseOperator):
        return DenseOperator(a.A * b.A, **_hadamard_props(a, b))
    if (
        isinstance(a, KroneckerOperator)
        and isinstance(b, KroneckerOperator)
        and len(a.factors) == len(b.factors)
        and all(f.shape[-2:] == g.shape[-2:] for f, g in zip(a.factors, b.factors))
    ):
        # (A_1 ⊗ A_2) ∘ (B_1 ⊗ B_2) = (A_1 ∘ B_1) ⊗ (A_2 ∘ B_2)
        return KroneckerOperator(*[hadamard(f, g) for f, g in zip(a.factors, b.factors)])
    return HadamardProductOperator([a, b])


def _hadamard_props(a, b):
    # Schur product theorem: PD ∘ PD is PD; symmetric ∘ symmetric is symmetric
    return dict(
        symmetric=a.symmetric and b.symmetric,
        positive_definite=a.positive_definite and b.positive_definite,
    )


# the base class reaches this through ``_late`` (Note [The base class's import cycles])
_base._late.__dict__.update(hadamard=hadamard)
