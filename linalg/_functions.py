"""Public linear-algebra functions on operators (what `__torch_function__` routes to).

Each function validates its arguments, handles what torch's signature allows (vectors,
``left=False``, ``upper=True``, iterative methods) and calls the single-dispatch structure rule
of ``_rules.py`` for the operator's class. Matrix-valued results (`inv`, `cholesky`, the
eigenvectors of `eigh`) are operators, so that they stay structured.

``solve.register``, ``inv.register``, ... register a structure rule for an operator class (the
rule's registry is exposed on the public function): see docs/linalg.md, "Structure rules for
your own operators", and Note [Dispatch precedence].
"""

from __future__ import annotations

import cmath
import math

import torch

from functransforms import _pytree as pt

from . import _rules
from ._base import LinearOperator, read_through
from ._composite import add, matmul
from ._dense import DenseOperator
from ._implicit import InverseOperator, can_differentiate, implicit_solve
from ._iterative import (
    hutchinson_trace,
    hutchpp_trace,
    iterative_logdet,
    resolve_method,
)
from ._krylov import iterative_solve


def _with_rules(rule):
    """Expose ``rule``'s registry on the public function (``solve.register(MyOperator)``)."""

    def expose(public):
        public.register = rule.register
        public.dispatch = rule.dispatch
        public.registry = rule.registry
        return public

    return expose


# ``a @ b`` and ``a + b`` are resolved in _composite.py (Note [Dispatch precedence]); their
# rules: ``matmul.register(T)`` for ``T @ X``, ``matmul.register_right(T)`` for ``X @ T``,
# ``add.register(T)`` for ``T + X`` and ``X + T``.
_with_rules(_rules.matmul)(matmul)
matmul.register_right = _rules.rmatmul.register
_with_rules(_rules.add)(add)


def _IMPLICIT_SOLVE(A) -> bool:
    # Dense solves are differentiated by torch.linalg.solve's own rules; structured ones as a
    # whole (Note [Implicit differentiation of structured solves]).
    # An InverseOperator's solve is a matmul by its base: differentiated op by op.
    return type(A) is not DenseOperator and type(A) is not InverseOperator


def _name(x) -> str:
    return type(x).__name__


def _require_operator(A, call: str) -> LinearOperator:
    if not isinstance(A, LinearOperator):
        raise TypeError(f"{call}: expected a LinearOperator, received {_name(A)}.")
    return A


def _require_square(A: LinearOperator, call: str) -> None:
    if not A.is_square:
        raise ValueError(f"{call}: expected a square operator, received {A!r}.")


# ------------------------------------------------------------------ solves
def _is_vector_rhs(A: LinearOperator, B: torch.Tensor) -> bool:
    # torch.linalg.solve's rule: B is a (batch of) vectors when B.ndim == 1, or
    # B.ndim == A.ndim - 1 and B.shape == A.shape[:-1].
    return B.dim() == 1 or (B.dim() == A.ndim - 1 and B.shape == A.shape[:-1])


@_with_rules(_rules.solve)
def solve(A, B, *, left: bool = True, method: str | None = None, **options):
    """``A^{-1} B`` through A's structure (exact), or an iterative method when asked.

    Args:
        A: a square LinearOperator ``(..., n, n)``.
        B: ``(..., n)`` or ``(..., n, k)``.
        left: solve ``A X = B`` (True) or ``X A = B`` (False), as ``torch.linalg.solve``.
        method: None (exact, unless an `iterative` context asks otherwise), ``"cg"``,
            ``"minres"``, ``"gmres"`` or ``"bicgstab"`` (implicitly differentiated).
        **options: for iterative methods (``tol``, ``maxiter``, ``preconditioner``,
            ``restart`` for GMRES).

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator, solve
        >>> solve(DiagonalOperator(torch.tensor([2.0, 4.0])), torch.ones(2)).tolist()  # [2]
        [0.5, 0.25]
    """
    A = _require_operator(A, "solve(A, B)")
    _require_square(A, "solve(A, B)")
    if not isinstance(B, torch.Tensor):
        raise TypeError(f"solve({A!r}, B): expected B to be a Tensor, received {_name(B)}.")
    if not left:
        return solve(A._transpose(), B.mT, method=method, **options).mT
    vec = _is_vector_rhs(A, B)
    Bm = B.unsqueeze(-1) if vec else B
    if Bm.shape[-2] != A.shape[-1]:
        raise ValueError(
            f"solve({A!r}, B): expected B with {A.shape[-1]} rows, received shape {tuple(B.shape)}."
        )
    method, options = resolve_method("solve", method, options)
    if method is None:
        X = implicit_solve(A, Bm) if _IMPLICIT_SOLVE(A) else _rules.solve(A, Bm)
        _require_solved(A, Bm, X)
    else:
        X = iterative_solve(A, Bm, method, **options)
    return X.squeeze(-1) if vec else X


def _not_finite(v):
    # a finite sum has only finite terms (one reduction and one read); a sum that overflowed
    # says nothing, so the elementwise test decides then
    if cmath.isfinite(v.sum().item()):
        return False
    return not torch.isfinite(v).all()


def _require_solved(A, B, X, call="torch.linalg.solve"):
    """Note [Singular structured operators]: a structured solve divides by pivots it never
    checks (the diagonal of a DiagonalOperator or a triangle, a zero scale, a singular
    Kronecker factor declared triangular), so an exactly singular operator gave inf/nan
    silently where ``torch.linalg.solve`` of the dense matrix raises. A non-finite solution
    from finite inputs means a zero pivot: raise torch's error type. One reduction over the
    result (torch's own solve reads its pivot flag too); nothing to read under jit's trace."""
    if not read_through(X, _not_finite):
        return
    leaves = [t for t in pt.tree_leaves(A) if isinstance(t, torch.Tensor)] + [B]
    if any(read_through(t, _not_finite) for t in leaves if t.is_floating_point() or t.is_complex()):
        return  # inf/nan in, inf/nan out: as torch
    raise torch.linalg.LinAlgError(
        f"{call}({A!r}{', B' if call.endswith('solve') else ''}): the operator is singular "
        f"(the structured algorithm gave inf/nan from finite inputs: a zero pivot), as {call} "
        "raises for its dense matrix. Expected an invertible operator: check the zero "
        "entries of its diagonal, scale or factors."
    )


def solve_triangular(A, B, *, upper: bool, left: bool = True, unitriangular: bool = False):
    """``torch.linalg.solve_triangular`` with an operator: uses its structure when it is declared
    triangular of the same kind, else reads its triangle (as torch does).

    Example:
        >>> import torch
        >>> from functransforms.linalg import TriangularOperator, solve_triangular
        >>> T = TriangularOperator(torch.tensor([[2.0, 0.0], [1.0, 1.0]]))  # [2, 2]
        >>> solve_triangular(T, torch.tensor([[2.0], [2.0]]), upper=False).tolist()  # [2, 1]
        [[1.0], [1.0]]
    """
    A = _require_operator(A, "solve_triangular(A, B)")
    kind_ok = (A.upper if upper else A.lower) and not unitriangular
    if not kind_ok:
        D = A._to_dense()
        return torch.linalg.solve_triangular(
            D, B, upper=upper, left=left, unitriangular=unitriangular
        )
    if isinstance(B, LinearOperator):
        B = B._to_dense()
    if not left:
        return _rules.solve(A._transpose(), B.mT).mT
    return _rules.solve(A, B)


def cholesky_solve(B, L, upper: bool = False):
    """``torch.cholesky_solve(B, L)``: ``(L L^H)^{-1} B`` with a triangular operator ``L``.

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator, cholesky, cholesky_solve
        >>> Lf = cholesky(DiagonalOperator(torch.tensor([4.0, 16.0])))
        >>> cholesky_solve(torch.ones(2, 1), Lf).tolist()  # [2, 1]
        [[0.25], [0.0625]]
    """
    L = _require_operator(L, "cholesky_solve(B, L)")
    if upper:
        L = L._adjoint()
    if isinstance(B, LinearOperator):
        B = B._to_dense()
    Y = _rules.solve(L, B) if L.lower else solve_triangular(L, B, upper=False)
    LH = L._adjoint()
    return _rules.solve(LH, Y) if LH.upper else solve_triangular(LH, Y, upper=True)


@_with_rules(_rules.inv)
def inv(A) -> LinearOperator:
    """The inverse, as an operator with A's structure (Kronecker of inverses, Woodbury, ...).

    Example:
        >>> import torch
        >>> from functransforms.linalg import KroneckerOperator, inv
        >>> K = KroneckerOperator(torch.eye(2) * 2, torch.eye(3) * 4)  # [6, 6]
        >>> type(inv(K)).__name__, inv(K).diagonal()[0].item()
        ('KroneckerOperator', 0.125)
    """
    A = _require_operator(A, "inv(A)")
    _require_square(A, "inv(A)")
    if _IMPLICIT_SOLVE(A) and can_differentiate(A):
        # Applied by implicitly differentiated solves (Note [Implicit differentiation of
        # structured solves]): inv(A) @ X is solve(A, X) in every mode.
        return InverseOperator(A)
    Ainv = _rules.inv(A)
    if isinstance(Ainv, LinearOperator):  # Note [Singular structured operators]
        leaves = [t for t in pt.tree_leaves(Ainv) if isinstance(t, torch.Tensor)]
        bad = [t for t in leaves if (t.is_floating_point() or t.is_complex())]
        if any(read_through(t, _not_finite) for t in bad):
            _require_solved(
                A, torch.zeros((), device=bad[0].device), bad[0], call="torch.linalg.inv"
            )
    return Ainv


# ------------------------------------------------------------------ determinants
@_with_rules(_rules.slogdet)
def slogdet(A, *, method: str | None = None, **options):
    """``(sign, log|det A|)`` through A's structure.

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator, slogdet
        >>> sign, logabs = slogdet(DiagonalOperator(torch.tensor([-1.0, 2.0])))
        >>> sign.item(), round(logabs.item(), 4)
        (-1.0, 0.6931)
    """
    A = _require_operator(A, "slogdet(A)")
    _require_square(A, "slogdet(A)")
    method, options = resolve_method("logdet", method, options)
    if method is not None:
        logabs = iterative_logdet(A, method, **options)
        return torch.ones_like(logabs), logabs
    sign, logabs = _rules.slogdet(A)
    if A.is_complex and not sign.is_complex():  # torch: the sign has the matrix's dtype
        sign = sign.to(A.dtype)
    return sign, logabs


def logdet(A, *, method: str | None = None, **options) -> torch.Tensor:
    """``log det A`` (nan for a negative determinant, as ``torch.logdet``).

    Exact through A's structure; ``method="slq"`` (stochastic Lanczos quadrature) for large
    symmetric positive definite operators.

    Example:
        >>> import torch
        >>> from functransforms.linalg import KroneckerOperator, logdet
        >>> K = KroneckerOperator(torch.eye(2) * 2, torch.eye(2), positive_definite=True)
        >>> round(logdet(K).item(), 4)  # 4 log 2
        2.7726
    """
    A = _require_operator(A, "logdet(A)")
    if A.positive_definite:
        _require_square(A, "logdet(A)")
        m, opts = resolve_method("logdet", method, options)
        if m is None:
            out = A._logdet_pd()
            return out.to(A.dtype) if A.is_complex else out  # as torch.logdet: complex dtype
    sign, logabs = slogdet(A, method=method, **options)
    if A.positive_definite:
        return logabs.to(A.dtype) if A.is_complex else logabs
    if sign.is_complex():
        return logabs + torch.log(sign)
    return torch.where(
        sign < 0, torch.full_like(logabs, math.nan), torch.where(sign == 0, -math.inf, logabs)
    )


def det(A) -> torch.Tensor:
    """``det A = sign * exp(log|det A|)`` through A's structure.

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator, det
        >>> det(DiagonalOperator(torch.tensor([2.0, -3.0], dtype=torch.float64))).item()
        -6.0
    """
    sign, logabs = slogdet(A)
    return sign * torch.exp(logabs)


# ------------------------------------------------------------------ factorizations
@_with_rules(_rules.cholesky)
def cholesky(A, *, upper: bool = False) -> LinearOperator:
    """The Cholesky factor of a symmetric PD operator, as a (structured) lower triangular operator.

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator, cholesky
        >>> cholesky(DiagonalOperator(torch.tensor([4.0, 9.0]))).diagonal().tolist()
        [2.0, 3.0]
    """
    A = _require_operator(A, "cholesky(A)")
    _require_square(A, "cholesky(A)")
    L = _rules.cholesky(A)
    return L._adjoint() if upper else L


@_with_rules(_rules.eigh)
def eigh(A, UPLO: str = "L"):
    """``(eigenvalues ascending, eigenvectors as an operator)`` of a symmetric operator.

    An operator not declared symmetric is handled as ``torch.linalg.eigh`` does (dense, one
    triangle read).

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator, eigh
        >>> evals, Q = eigh(DiagonalOperator(torch.tensor([3.0, 1.0, 2.0])))  # [3], operator
        >>> evals.tolist(), type(Q).__name__
        ([1.0, 2.0, 3.0], 'PermutationOperator')
    """
    A = _require_operator(A, "eigh(A)")
    _require_square(A, "eigh(A)")
    if not A.symmetric:
        evals, evecs = torch.linalg.eigh(A._to_dense(), UPLO=UPLO)
        return evals, DenseOperator(evecs, unitary=True)
    return _rules.eigh(A)


def eigvalsh(A, UPLO: str = "L") -> torch.Tensor:
    """Eigenvalues (ascending) of a symmetric operator, through its structure.

    Example:
        >>> import torch
        >>> from functransforms.linalg import KroneckerOperator, eigvalsh
        >>> A = torch.diag(torch.tensor([1.0, 2.0]))
        >>> K = KroneckerOperator(A, torch.eye(2) * 3, symmetric=True)  # [4, 4]
        >>> eigvalsh(K).tolist()  # [4]
        [3.0, 3.0, 6.0, 6.0]
    """
    A = _require_operator(A, "eigvalsh(A)")
    if not A.symmetric:
        return torch.linalg.eigvalsh(A._to_dense(), UPLO=UPLO)
    return _rules.eigh(A)[0]


@_with_rules(_rules.svd)
def svd(A, full_matrices: bool = True):
    """``(U, S, Vh)`` with U, Vh operators (structured for Diagonal/Kronecker).

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator, svd
        >>> U, S, Vh = svd(DiagonalOperator(torch.tensor([1.0, -3.0])))  # operators, [2], operators
        >>> S.tolist()
        [3.0, 1.0]
    """
    A = _require_operator(A, "svd(A)")
    if full_matrices and not A.is_square:
        U, S, Vh = torch.linalg.svd(A._to_dense(), full_matrices=True)
        return DenseOperator(U), S, DenseOperator(Vh)
    return _rules.svd(A)


def svdvals(A) -> torch.Tensor:
    """Singular values (descending), through the structure.

    Example:
        >>> import torch
        >>> from functransforms.linalg import ScaledIdentityOperator, svdvals
        >>> svdvals(ScaledIdentityOperator(torch.tensor(-2.0), 2)).tolist()
        [2.0, 2.0]
    """
    return svd(A, full_matrices=False)[1]


# ------------------------------------------------------------------ reductions
@_with_rules(_rules.trace)
def trace(A, *, method: str | None = None, **options) -> torch.Tensor:
    """Trace (exact through structure; ``method="hutchinson"``/``"hutchpp"`` estimates it).

    Example:
        >>> import torch
        >>> from functransforms.linalg import KroneckerOperator, trace
        >>> trace(KroneckerOperator(torch.eye(2) * 2, torch.eye(3))).item()  # tr A tr B = 4 * 3
        12.0
    """
    A = _require_operator(A, "trace(A)")
    _require_square(A, "trace(A)")
    method, options = resolve_method("trace", method, options)
    if method is not None:
        fn = {"hutchinson": hutchinson_trace, "hutchpp": hutchpp_trace}[method]
        return fn(A, **options)
    return _rules.trace(A)


@_with_rules(_rules.diagonal)
def diagonal(A, offset: int = 0, dim1: int = -2, dim2: int = -1) -> torch.Tensor:
    """The main diagonal through the structure (other offsets: dense).

    Example:
        >>> import torch
        >>> from functransforms.linalg import LowRankOperator, diagonal
        >>> diagonal(LowRankOperator(torch.tensor([[1.0], [2.0]]))).tolist()  # [2]
        [1.0, 4.0]
    """
    A = _require_operator(A, "diagonal(A)")
    return A.diagonal(offset=offset, dim1=dim1, dim2=dim2)  # the rule for the main diagonal


def frobenius_norm(A) -> torch.Tensor:
    """``||A||_F`` through the structure (``torch.linalg.matrix_norm(A)`` routes here).

    Example:
        >>> import torch
        >>> from functransforms.linalg import KroneckerOperator, frobenius_norm
        >>> frobenius_norm(KroneckerOperator(torch.eye(2), torch.eye(2) * 2)).item()  # 1.41 * 2.83
        4.0
    """
    A = _require_operator(A, "matrix_norm(A)")
    return torch.sqrt(A._frobenius_sq())
