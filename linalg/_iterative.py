"""Iterative algorithms, used only when asked: CG, Lanczos, SLQ logdet, Hutchinson/Hutch++ trace.

MINRES, GMRES, BiCGStab and LSMR are in ``_krylov.py``; matrix functions and top-k eigenpairs
by Lanczos in ``_matfunc.py``.

# Note [Implicit differentiation of iterative solves]
``X = A^{-1} B`` is computed by CG on *constant* copies of A's tensors (nothing is recorded
through the iterations) and differentiated as the exact solves are (Note [Implicit
differentiation of structured solves] in ``_implicit.py``): ``X* + S(B - A X*)`` with S's rules
solving by the same method, so ``dX = A^{-1}(dB - dA X)`` and ``B_bar = A^{-H} X_bar``: the
implicit function theorem, to the solver's tolerance, never by unrolling.

# Note [Data-dependent stopping under vmap]
Convergence tests read a tensor value. Inside a vmap the value cannot be read; the loop then
runs to ``maxiter`` with converged columns masked (their updates are exactly zero).
"""

from __future__ import annotations

import contextvars
import dataclasses
import warnings

import torch

from functransforms._pytree import tree_map

from ._base import LinearOperator, _try_bool
from ._rules import diagonal, solve

_CONFIG: contextvars.ContextVar = contextvars.ContextVar(
    "functransforms_linalg_iterative", default=None
)

# The iterative methods each operation accepts (the solvers themselves: ``_krylov.py``).
METHODS = {
    "solve": ("cg", "minres", "gmres", "bicgstab"),
    "lstsq": ("lsmr",),
    "logdet": ("slq",),
    "trace": ("hutchinson", "hutchpp"),
}
# The solve methods that need a symmetric (Hermitian) operator.
SYMMETRIC_METHODS = ("cg", "minres")


@dataclasses.dataclass
class SolverInfo:
    """What an iterative method did: ``method``, ``iterations``, relative ``residual`` (max over
    right-hand sides; None when unreadable inside a transform), ``converged``, ``tol``.

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator, cg
        >>> _, info = cg(DiagonalOperator(torch.tensor([1.0, 4.0])), torch.ones(2), tol=1e-8)
        >>> info.method, info.converged
        ('cg', True)
    """

    method: str
    iterations: int
    residual: float | None
    converged: bool | None
    tol: float
    num_probes: int | None = None


class iterative:
    """Context manager: use iterative methods for the operations named, and record their info.

    Args:
        solve: ``"cg"`` (preconditioned conjugate gradients; symmetric positive definite A),
            ``"minres"`` (symmetric, possibly indefinite A), ``"gmres"`` (restarted, any
            square A) or ``"bicgstab"`` (any square A).
        logdet: ``"slq"`` (stochastic Lanczos quadrature).
        trace: ``"hutchinson"`` or ``"hutchpp"``.
        lstsq: ``"lsmr"`` (``torch.linalg.lstsq`` of an operator by LSMR, `lsmr`).
        **options: ``tol``, ``maxiter``, ``preconditioner`` (an operator ≈ A, a callable
            ``R -> M^{-1} R`` or ``"jacobi"``), ``restart`` (GMRES), ``damp`` (LSMR),
            ``num_probes``, ``lanczos_steps``, ``generator``.

    Attributes:
        infos: the `SolverInfo` of every iterative call made inside the block.

    Example:
        >>> import torch
        >>> from functransforms.linalg import DenseOperator, iterative
        >>> A = DenseOperator(torch.eye(3, dtype=torch.float64) * 2, positive_definite=True)
        >>> with iterative(solve="cg", tol=1e-10) as it:
        ...     x = torch.linalg.solve(A, torch.ones(3, dtype=torch.float64))  # [3]
        >>> x.tolist(), it.infos[0].iterations, it.infos[0].converged
        ([0.5, 0.5, 0.5], 1, True)
    """

    def __init__(
        self,
        solve: str | None = "cg",
        logdet: str | None = "slq",
        trace: str | None = None,
        lstsq: str | None = None,
        **options,
    ):
        _check_method("iterative(solve=...)", solve, METHODS["solve"])
        _check_method("iterative(logdet=...)", logdet, METHODS["logdet"])
        _check_method("iterative(trace=...)", trace, METHODS["trace"])
        _check_method("iterative(lstsq=...)", lstsq, METHODS["lstsq"])
        self.methods = {"solve": solve, "logdet": logdet, "trace": trace, "lstsq": lstsq}
        self.options = options
        self.infos: list[SolverInfo] = []
        self._token = None

    def __enter__(self):
        self._token = _CONFIG.set(self)
        return self

    def __exit__(self, *exc):
        _CONFIG.reset(self._token)
        return False


def _check_method(call, method, allowed):
    if method is not None and method not in allowed:
        raise ValueError(f"{call}: expected one of {allowed} or None, received {method!r}.")


def resolve_method(kind: str, method, options):
    ctx = _CONFIG.get()
    if method is None and ctx is not None:
        method = ctx.methods.get(kind)
        if method is not None:
            options = {**ctx.options, **options}
    if method is not None:
        _check_method(f"{kind}(..., method=...)", method, METHODS[kind])
    return method, options


_ADVICE = {
    None: "raise maxiter or add a preconditioner",
    "lsmr": "raise maxiter, or damp an ill-conditioned problem",
    "eigsh": "raise steps",
}


def _record(info: SolverInfo) -> None:
    ctx = _CONFIG.get()
    if ctx is not None:
        ctx.infos.append(info)
    if info.converged is False:
        advice = _ADVICE.get(info.method, _ADVICE[None])
        warnings.warn(
            f"{info.method}: did not converge in {info.iterations} iterations (relative residual "
            f"{info.residual:.3g} > tol {info.tol:.3g}); {advice}.",
            stacklevel=4,
        )


def _readable_float(t):
    try:
        return float(t)
    except RuntimeError:
        return None


def _apply(A, X):
    return A._matmul(X) if isinstance(A, LinearOperator) else A(X)


def _preconditioner(A, M, call="cg"):
    if M is None:
        return None
    if isinstance(M, str):
        if M != "jacobi":
            raise ValueError(
                f"{call}(..., preconditioner={M!r}): expected 'jacobi', an operator or a callable."
            )
        d = diagonal(A).unsqueeze(-1)
        return lambda R: R / d
    if isinstance(M, LinearOperator):
        return lambda R: solve(M, R)
    if callable(M):
        return M
    raise TypeError(
        f"{call}(..., preconditioner=...): expected an operator, a callable or 'jacobi', "
        f"received {type(M).__name__}."
    )


_GENERAL_SOLVE = "for a general square operator use method='gmres' or method='bicgstab'"


def require_symmetric(A, call: str, method: str, instead: str = _GENERAL_SOLVE) -> None:
    """Refuse a method that needs a symmetric (Hermitian) operator on one not declared so."""
    if isinstance(A, LinearOperator) and not A.symmetric:
        raise ValueError(
            f"{call}: {method} needs a symmetric (Hermitian) operator, received {A!r}, which is "
            f"not declared symmetric. Expected: {instead}; if it is symmetric, declare it (e.g. "
            "DenseOperator(M, symmetric=True), or positive_definite=True)."
        )


def _dot(X, Y):
    return (X.conj() * Y).sum(-2, keepdim=True)


def cg(
    A,
    B: torch.Tensor,
    *,
    x0=None,
    tol: float = 1e-6,
    atol: float = 0.0,
    maxiter: int | None = None,
    preconditioner=None,
) -> tuple[torch.Tensor, SolverInfo]:
    """Preconditioned conjugate gradients for a symmetric positive definite ``A``.

    Not differentiated (use `solve(A, B, method="cg")` for implicit derivatives).

    Args:
        A: operator declared symmetric (or callable ``X -> A X``) ``(..., n, n)``; one that is
            not declared symmetric is refused. B: ``(..., n)`` or ``(..., n, k)``.
        tol, atol: stop when ``|r| <= max(tol |b|, atol)`` for every column.
        maxiter: default 10 n (inside a vmap every iteration runs, see Note [Data-dependent
            stopping under vmap]).
        preconditioner: operator ≈ A, callable ``R -> M^{-1} R`` or "jacobi".

    Returns:
        ``(X, info)``: X like B, info a `SolverInfo`.

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator, cg
        >>> x, info = cg(DiagonalOperator(torch.tensor([1.0, 2.0])), torch.ones(2))  # x: [2]
        >>> x.tolist(), info.converged
        ([1.0, 0.5], True)
    """
    require_symmetric(A, "cg(A, B)", "CG")
    vec = B.dim() == 1 or (isinstance(A, LinearOperator) and B.dim() == A.ndim - 1)
    Bm = B.unsqueeze(-1) if vec else B
    n = Bm.shape[-2]
    maxiter = 10 * n if maxiter is None else int(maxiter)
    Minv = _preconditioner(A, preconditioner) if isinstance(A, LinearOperator) else preconditioner
    X = torch.zeros_like(Bm) if x0 is None else (x0.unsqueeze(-1) if vec else x0)
    R = Bm - _apply(A, X) if x0 is not None else Bm
    X = X + torch.zeros_like(R)  # broadcast batch
    Z = Minv(R) if Minv is not None else R
    P = Z
    rz = _dot(R, Z)
    bnorm = torch.linalg.vector_norm(Bm, dim=-2, keepdim=True)
    thresh = torch.clamp(tol * bnorm, min=atol)
    it = 0
    for it in range(maxiter + 1):
        rnorm = torch.linalg.vector_norm(R, dim=-2, keepdim=True)
        done = rnorm <= thresh
        if it == maxiter or _try_bool(done.all()):
            break
        AP = _apply(A, P)
        pAp = _dot(P, AP)
        alpha = torch.where(done, 0, rz / torch.where(done, 1, pAp))
        X = X + alpha * P
        R = R - alpha * AP
        Z = Minv(R) if Minv is not None else R
        rz_new = _dot(R, Z)
        beta = torch.where(done, 0, rz_new / torch.where(done, 1, rz))
        P = Z + beta * P
        rz = rz_new
    rel = _readable_float((rnorm / torch.where(bnorm > 0, bnorm, 1)).max())
    conv = None if rel is None else bool(_try_bool(done.all()))
    info = SolverInfo("cg", it, rel, conv, tol)
    return (X.squeeze(-1) if vec else X), info


def _constant(A: LinearOperator) -> LinearOperator:
    """A copy of A whose tensors are detached (constants for differentiation)."""
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, A)


# ------------------------------------------------------------------ implicitly differentiated
def run_cg(A: LinearOperator, B: torch.Tensor, **options) -> torch.Tensor:
    """CG's solve on constants, its info recorded (the derivatives are the implicit ones of
    Note [Implicit differentiation of structured solves], whose rules call this again)."""
    X, info = cg(A, B, **options)
    _record(info)
    return X


# ------------------------------------------------------------------ Lanczos and SLQ
def lanczos(A, V0: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``steps`` Lanczos iterations (full reorthogonalization) from each column of ``V0``.

    Args:
        A: symmetric operator ``(..., n, n)`` (or callable). V0: ``(..., n, p)`` start vectors.

    Returns:
        ``(Q, alpha, beta)``: Q ``(..., p, m, n)`` orthonormal Krylov bases, alpha ``(..., p, m)``
        and beta ``(..., p, m - 1)`` the tridiagonal ``T = Q A Q^T`` (m <= steps: stops early on
        an invariant subspace when that is readable).

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator, lanczos
        >>> A = DiagonalOperator(torch.arange(1.0, 5.0, dtype=torch.float64))
        >>> Q, a, b = lanczos(A, torch.ones(4, 1, dtype=torch.float64), 4)  # Q: [1, 4, 4]
        >>> T = torch.diag(a[0]) + torch.diag(b[0], 1) + torch.diag(b[0], -1)  # [4, 4]
        >>> torch.allclose(torch.linalg.eigvalsh(T), torch.arange(1.0, 5.0, dtype=torch.float64))
        True
    """
    q = V0 / torch.linalg.vector_norm(V0, dim=-2, keepdim=True)
    qs, alphas, betas = [q.mT], [], []  # each (..., p, n)
    for j in range(steps):
        w = _apply(A, qs[-1].mT).mT  # (..., p, n)
        a = (qs[-1].conj() * w).sum(-1).real
        alphas.append(a)
        if j == steps - 1:
            break
        Q = torch.stack(qs, dim=-2)  # (..., p, j+1, n)
        for _ in range(2):  # full reorthogonalization, twice is enough
            coef = (Q.conj() * w.unsqueeze(-2)).sum(-1, keepdim=True)  # (..., p, j+1, 1)
            w = w - (coef * Q).sum(-2)
        b = torch.linalg.vector_norm(w, dim=-1)
        if _try_bool((b <= 1e-10 * (alphas[0].abs() + 1)).all()):
            break
        betas.append(b)
        qs.append(w / b.unsqueeze(-1))
    Q = torch.stack(qs[: len(alphas)], dim=-2)
    alpha = torch.stack(alphas, dim=-1)
    beta = torch.stack(betas[: len(alphas) - 1], dim=-1) if len(alphas) > 1 else alpha[..., :0]
    return Q, alpha, beta


def _tridiag(alpha, beta):
    T = torch.diag_embed(alpha)
    if beta.shape[-1]:
        T = T + torch.diag_embed(beta, 1) + torch.diag_embed(beta, -1)
    return T


def _probes(n, p, like: LinearOperator, generator=None):
    z = torch.randint(0, 2, like.batch_shape + (n, p), generator=generator, device=like.device)
    return (2 * z - 1).to(like.dtype)


def slq_logdet(
    A: LinearOperator, *, num_probes: int = 16, lanczos_steps: int = 30, generator=None, **_ignored
) -> tuple[torch.Tensor, SolverInfo]:
    """Stochastic Lanczos quadrature estimate of ``log det A`` for symmetric PD ``A``.

    ``logdet A = tr log A ≈ (n / p) sum_i sum_j (e_1^T u_j)^2 log θ_j`` over p Rademacher probes.
    Derivatives use the unbiased estimator ``d logdet = E[z^T A^{-1} dA z]``, with ``A^{-1} z``
    read off the same Lanczos bases (no extra solve, no unrolling).

    Returns:
        ``(estimate, info)``; estimate has shape ``batch_shape``.

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator, slq_logdet
        >>> d = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
        >>> A = DiagonalOperator(d, positive_definite=True)
        >>> est, info = slq_logdet(A, num_probes=4, lanczos_steps=3)  # exact for n <= steps
        >>> round(est.item(), 6) == round(torch.log(torch.tensor(6.0)).item(), 6)
        True
    """
    A_const = _constant(A)
    n = A.shape[-1]
    Z = _probes(n, num_probes, A, generator)
    Q, alpha, beta = lanczos(A_const, Z, min(lanczos_steps, n))
    theta, U = torch.linalg.eigh(_tridiag(alpha, beta))  # (..., p, m), (..., p, m, m)
    w = U[..., 0, :] ** 2
    est = n * (w * torch.log(theta)).sum(-1).mean(-1)
    # A^{-1} z ≈ |z| Q^T T^{-1} e_1 = |z| Q^T U diag(1/θ) U^T e_1
    coeff = (U * (U[..., 0, :] / theta).unsqueeze(-2)).sum(-1)  # (..., p, m)
    znorm = torch.linalg.vector_norm(Z, dim=-2)  # (..., p)
    W = (znorm.unsqueeze(-1) * (coeff.unsqueeze(-1) * Q).sum(-2)).mT  # (..., n, p) = A^{-1} Z
    quad = (W.detach().conj() * A._matmul(Z)).sum(-2).real.mean(-1)
    info = SolverInfo("slq", Q.shape[-2], None, None, 0.0, num_probes)
    _record(info)
    return est.detach() + (quad - quad.detach()), info


def iterative_logdet(A: LinearOperator, method: str, **options) -> torch.Tensor:
    opts = {k: v for k, v in options.items() if k in ("num_probes", "lanczos_steps", "generator")}
    return slq_logdet(A, **opts)[0]


# ------------------------------------------------------------------ trace estimators
def hutchinson_trace(
    A: LinearOperator, *, num_probes: int = 32, generator=None, **_ignored
) -> torch.Tensor:
    """Hutchinson's estimator ``tr A ≈ (1/p) sum z_i^T A z_i`` (Rademacher z); differentiable.

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator, hutchinson_trace
        >>> hutchinson_trace(DiagonalOperator(torch.ones(5)), num_probes=3).item()  # exact here
        5.0
    """
    Z = _probes(A.shape[-1], num_probes, A, generator)
    est = (Z * A._matmul(Z)).sum(-2).mean(-1)
    _record(SolverInfo("hutchinson", 0, None, None, 0.0, num_probes))
    return est


def hutchpp_trace(
    A: LinearOperator, *, num_probes: int = 33, generator=None, **_ignored
) -> torch.Tensor:
    """Hutch++: exact trace on a sketched top subspace plus Hutchinson on the rest.

    Uses ``num_probes`` matvecs in thirds (sketch, projection, residual probes); variance
    O(1/p^2) instead of O(1/p) for matrices with decaying spectra.

    Example:
        >>> import torch
        >>> from functransforms.linalg import LowRankOperator, hutchpp_trace
        >>> U = torch.randn(50, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        >>> A = LowRankOperator(U)  # [50, 50], rank 3: captured by the sketch
        >>> torch.allclose(hutchpp_trace(A, num_probes=12), A.diagonal().sum())
        True
    """
    k = max(num_probes // 3, 1)
    n = A.shape[-1]
    S = _probes(n, k, A, generator)
    G = _probes(n, max(num_probes - 2 * k, 1), A, generator)
    Q, _ = torch.linalg.qr(A._matmul(S))
    t1 = (Q.conj() * A._matmul(Q)).sum((-2, -1))
    G = G - Q @ (Q.mH @ G)
    t2 = (G.conj() * A._matmul(G)).sum(-2).mean(-1)
    _record(SolverInfo("hutchpp", 0, None, None, 0.0, num_probes))
    return (t1 + t2).real if not A.is_complex else t1 + t2
