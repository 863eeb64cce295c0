"""Matrix functions and extreme eigenpairs of symmetric operators by Lanczos, used only when asked.

# Note [Differentiating Lanczos approximations]
``lanczos_matfunc`` runs the Lanczos recurrence (``_iterative.lanczos``) and the
``eigh`` of its small tridiagonal as ordinary torch code, so our transforms (and torch's) go
through them step by step: the derivative is the derivative of the approximation. It is the
exact derivative of ``f(A) V`` when ``steps >= n`` and the Krylov space of each column of V is
all of R^n: the approximation is then exact for every A near the given one. When that space is
smaller (A has repeated eigenvalues, or a column of V lies in an invariant subspace, and the
recurrence stops early) the value is exact but the derivative is not: a perturbed A splits the
eigenvalues and its Krylov space grows. Unlike solves (Note [Implicit differentiation of
iterative solves]), no fixed-point identity pins the derivative of a truncated Krylov
approximation. The recurrence divides by its ``beta`` coefficients, so under a vmap, where the
early stop cannot read its test, a start vector in a small invariant subspace gives nan: start
from generic vectors there. ``eigsh`` is differentiated otherwise: its eigenpairs have
derivatives of their own (Note [Implicit derivatives of eigenpairs], linalg/_eigen.py).
"""

from __future__ import annotations

import torch

from functransforms._pytree import tree_flatten, tree_unflatten

from ._base import LinearOperator, broadcast_batch
from ._eigen import default_start, implicit_eigenpairs, lobpcg
from ._implicit import _constant
from ._iterative import SolverInfo, _readable_float, _record, _tridiag, lanczos, require_symmetric

_GENERAL_MATFUNC = (
    "for a general operator, the dense function of A.to_dense() (torch.linalg.matrix_exp, ...)"
)
_NAMED = {
    "exp": torch.exp,
    "log": torch.log,
    "sqrt": torch.sqrt,
    "invsqrt": torch.rsqrt,
}


def _require_square_operator(A, call):
    if not isinstance(A, LinearOperator):
        raise TypeError(f"{call}: expected a LinearOperator, received {type(A).__name__}.")
    if not A.is_square:
        raise ValueError(f"{call}: expected a square operator, received {A!r}.")


def lanczos_matfunc(A: LinearOperator, V: torch.Tensor, f, *, steps: int = 30) -> torch.Tensor:
    """``f(A) V`` for a symmetric (Hermitian) ``A`` by Lanczos from each column of V.

    ``f(A) v ≈ |v| Q^H f(T) e_1`` with ``T = Q A Q^H`` the tridiagonal of ``steps`` Lanczos
    steps (full reorthogonalization) and ``f(T) = U f(θ) U^H`` from its ``eigh``. Exact (to
    rounding) when ``steps >= n``, or when v lies in an invariant subspace of dimension
    ``<= steps``; otherwise the error falls as the polynomial approximation of f on A's
    spectrum does (fast for exp, slower for log and invsqrt near 0). Derivatives go through the
    steps (Note [Differentiating Lanczos approximations]): exact when ``steps >= n``.

    Args:
        A: operator ``(..., n, n)`` declared symmetric.
        V: ``(..., n)`` or ``(..., n, p)`` (nonzero columns).
        f: a callable on the Ritz values (elementwise, e.g. ``torch.exp``) or one of ``"exp"``,
            ``"log"``, ``"sqrt"``, ``"invsqrt"`` (``A^{-1/2}``); log, sqrt and invsqrt need a
            positive (semi)definite A.
        steps: Lanczos steps per column (capped at n).

    Returns:
        ``f(A) V``, shaped like V.

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator, lanczos_matfunc
        >>> d = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
        >>> y = lanczos_matfunc(DiagonalOperator(d), torch.ones(3, dtype=torch.float64), "exp")
        >>> torch.allclose(y, torch.exp(d))  # [3]: exact, steps >= n
        True
    """
    call = "lanczos_matfunc(A, V, f)"
    _require_square_operator(A, call)
    require_symmetric(A, call, "Lanczos", _GENERAL_MATFUNC)
    if isinstance(f, str):
        if f not in _NAMED:
            raise ValueError(
                f"{call}: expected f in {sorted(_NAMED)} or a callable, received {f!r}."
            )
        f = _NAMED[f]
    elif not callable(f):
        raise TypeError(f"{call}: expected f to be a callable or a name, received {f!r}.")
    n = A.shape[-1]
    vec = V.dim() == 1 or V.dim() == A.ndim - 1
    Vm = V.unsqueeze(-1) if vec else V
    if Vm.shape[-2] != n:
        raise ValueError(f"{call}: expected V with {n} rows, received shape {tuple(V.shape)}.")
    Vm = Vm.expand(*broadcast_batch(A.batch_shape, Vm.shape[:-2]), *Vm.shape[-2:])
    Q, alpha, beta = lanczos(A, Vm, min(int(steps), n))  # Q: (..., p, m, n)
    theta, U = torch.linalg.eigh(_tridiag(alpha, beta))  # (..., p, m), (..., p, m, m)
    fe1 = (U * (f(theta) * U[..., 0, :]).unsqueeze(-2)).sum(-1)  # f(T) e_1: (..., p, m)
    norm = torch.linalg.vector_norm(Vm, dim=-2)  # (..., p)
    Y = (norm.unsqueeze(-1) * (fe1.unsqueeze(-1).to(Q.dtype) * Q).sum(-2)).mT  # (..., n, p)
    return Y.squeeze(-1) if vec else Y


def eigsh(
    A: LinearOperator,
    k: int = 1,
    *,
    which: str = "LA",
    method: str = "lanczos",
    steps: int | None = None,
    tol: float = 1e-8,
    v0: torch.Tensor | None = None,
    maxiter: int | None = None,
    preconditioner=None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest (``which="LA"``) or smallest (``"SA"``) eigenpairs of a symmetric A.

    ``method="lanczos"``: Lanczos with full reorthogonalization from ``v0`` (a Gaussian draw
    when None), then the Ritz pairs of the tridiagonal; exact (to rounding) when ``steps >= n``,
    otherwise extreme, well separated eigenvalues converge first. ``method="lobpcg"``: LOBPCG
    (Note [LOBPCG], linalg/_eigen.py) on a block of k vectors (``v0`` of shape ``(..., n, k)``
    or a Gaussian draw), with an optional symmetric positive definite ``preconditioner``; needs
    ``n >= 3 k``. A pair whose residual ``|A y - θ y| > tol max|θ|`` makes the call warn; the
    `SolverInfo` (method ``"eigsh"``) is recorded in an `iterative` block.

    Derivatives are those of the eigenpairs themselves, not of the iterations (Note [Implicit
    derivatives of eigenpairs]): exact first derivatives of eigenvalues and eigenvectors and
    second derivatives of eigenvalues, to the tolerance of the MINRES solves that compute them,
    whatever the number of steps; undefined at a repeated eigenvalue among the k found, as for
    ``torch.linalg.eigh``.

    Args:
        A: operator ``(..., n, n)`` declared symmetric.
        k: how many eigenpairs (``k <= steps``).
        which: "LA" (largest algebraic) or "SA" (smallest algebraic).
        method: "lanczos" or "lobpcg".
        steps: Lanczos steps, default ``min(n, max(2k + 20, 40))``.
        tol: the relative residual the warning checks (and LOBPCG's stopping test).
        v0: start vector ``(..., n)`` (Lanczos) or block ``(..., n, k)`` (LOBPCG).
        maxiter: LOBPCG iterations, default ``max(100, n)``.
        preconditioner: LOBPCG only: an operator ``M ≈ A`` (positive definite), a callable
            ``R -> M^{-1} R`` or "jacobi".
        generator: for the default draw.

    Returns:
        ``(eigenvalues, eigenvectors)``: ``(..., k)`` ascending, as ``torch.linalg.eigh``, and
        ``(..., n, k)`` orthonormal columns.

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator, eigsh
        >>> A = DiagonalOperator(torch.arange(1.0, 11.0, dtype=torch.float64))  # [10, 10]
        >>> vals, vecs = eigsh(A, 2, which="LA")  # [2], [10, 2]
        >>> [round(v, 8) for v in vals.tolist()]
        [9.0, 10.0]
    """
    call = f"eigsh(A, k={k}, which={which!r})"
    _require_square_operator(A, call)
    require_symmetric(A, call, "Lanczos", "for a general operator, torch.linalg.eig(A.to_dense())")
    if which not in ("LA", "SA"):
        raise ValueError(f"{call}: expected which='LA' or 'SA', received {which!r}.")
    if method not in ("lanczos", "lobpcg"):
        raise ValueError(f"{call}: expected method='lanczos' or 'lobpcg', received {method!r}.")
    n = A.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"{call}: expected 1 <= k <= n = {n}, received k={k}.")
    if method == "lanczos" and preconditioner is not None:
        raise ValueError(f"{call}: a preconditioner needs method='lobpcg'; Lanczos takes none.")
    leaves, spec = tree_flatten(A)
    Ac = tree_unflatten(spec, [_constant(t) for t in leaves])  # derivatives: implicit
    if method == "lobpcg":
        if n < 3 * k:
            raise ValueError(
                f"{call}: LOBPCG needs n >= 3 k, received n={n}; use method='lanczos'."
            )
        if v0 is None:
            v0 = default_start((n, k), generator, A.dtype, A.device)
        elif v0.shape[-2:] != (n, k):
            raise ValueError(
                f"{call}: expected v0 of shape (..., {n}, {k}) for LOBPCG, received "
                f"{tuple(v0.shape)}."
            )
        X0 = v0.detach().expand(*broadcast_batch(A.batch_shape, v0.shape[:-2]), n, k)
        maxiter = max(100, n) if maxiter is None else int(maxiter)
        vals, vecs, info = lobpcg(Ac, k, which, X0, tol, maxiter, preconditioner)
        _record(info)
        return implicit_eigenpairs(A, vals, vecs, tol * 1e-2)
    steps = min(n, max(2 * k + 20, 40)) if steps is None else min(int(steps), n)
    if steps < k:
        raise ValueError(f"{call}: expected steps >= k, received steps={steps}.")
    if v0 is None:
        v0 = default_start((n,), generator, A.dtype, A.device)
    v0 = v0.detach().expand(*broadcast_batch(A.batch_shape, v0.shape[:-1]), n).unsqueeze(-1)
    Q, alpha, beta = lanczos(Ac, v0, steps)  # Q: (..., 1, m, n)
    m = Q.shape[-2]
    if m < k:
        raise ValueError(
            f"{call}: the Krylov space of v0 has dimension {m} < k (v0 lies in an invariant "
            "subspace); pass another v0."
        )
    theta, U = torch.linalg.eigh(_tridiag(alpha, beta))  # (..., 1, m), (..., 1, m, m)
    sel = slice(m - k, m) if which == "LA" else slice(0, k)
    vals = theta[..., 0, sel]  # (..., k)
    vecs = (Q.mT @ U[..., sel].to(Q.dtype))[..., 0, :, :]  # (..., n, k)
    resid = torch.linalg.vector_norm(Ac._matmul(vecs) - vecs * vals.unsqueeze(-2), dim=-2)
    scale = theta.abs().amax(-1).clamp(min=torch.finfo(theta.dtype).tiny)
    rel = _readable_float((resid / scale).max())
    info = SolverInfo("eigsh", m, rel, None if rel is None else rel <= tol, tol)
    _record(info)
    return implicit_eigenpairs(A, vals, vecs, tol * 1e-2)
