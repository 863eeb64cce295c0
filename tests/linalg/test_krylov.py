"""MINRES, GMRES, BiCGStab and LSMR: against dense float64 torch.linalg, info and warnings,
refusals, and implicit derivatives (ours, torch.func, torch.autograd) against the dense ones."""

import functransforms.linalg as L
import pytest
import torch

import functransforms as ft
from functransforms.testing import check_vmap

DT = torch.float64
TOL = 1e-12
SOLVERS = {"minres": L.minres, "gmres": L.gmres, "bicgstab": L.bicgstab}
IMPLS = ["functransforms", "torch.func", "torch.autograd"]


def close(a, b, **kw):
    torch.testing.assert_close(a, b, **{"rtol": 1e-6, "atol": 1e-8, **kw})


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _with_spectrum(evals, seed):
    Q, _ = torch.linalg.qr(torch.randn(len(evals), len(evals), generator=_gen(seed), dtype=DT))
    return Q @ torch.diag(torch.tensor(evals, dtype=DT)) @ Q.mT


def _general(n, seed):
    """A non-symmetric, well-conditioned matrix."""
    return torch.eye(n, dtype=DT) * 3 + torch.randn(n, n, generator=_gen(seed), dtype=DT) / n**0.5


def _sym(P):
    return (P + P.mT) / 2


# Each case: (params, build(params) -> operator). Symmetric (indefinite) ones for MINRES,
# general ones for GMRES and BiCGStab.
def _case(name, symmetric):
    if name == "dense":
        if symmetric:
            p = (_with_spectrum([-3.0, -2.0, -1.0, -0.5, 0.7, 1, 1.5, 2, 2.5, 3, 4, 5], 0),)
            return p, lambda p: L.DenseOperator(_sym(p[0]), symmetric=True)
        return (_general(12, 0),), lambda p: L.DenseOperator(p[0])
    if name == "kronecker":
        if symmetric:
            p = (_with_spectrum([-2.0, -1.0, 1.5, 3.0], 1), _with_spectrum([1.0, 2.0, -1.5], 2))
            return p, lambda p: L.KroneckerOperator(_sym(p[0]), _sym(p[1]), symmetric=True)
        return (_general(4, 1), _general(3, 2)), lambda p: L.KroneckerOperator(*p)
    if name == "diag_lowrank":
        g = _gen(3)
        d = torch.linspace(1, 3, 12, dtype=DT)
        U = 0.3 * torch.randn(12, 2, generator=g, dtype=DT)
        if symmetric:
            d = d * torch.tensor([1.0, -1.0] * 6, dtype=DT)  # indefinite
            return (U, d), lambda p: L.LowRankPlusDiagonalOperator(p[0], p[1])
        V = 0.3 * torch.randn(12, 2, generator=g, dtype=DT)
        return (U, d, V), lambda p: L.LowRankPlusDiagonalOperator(*p)
    if name == "batched":
        if symmetric:
            evs = [
                [-2.0, -1, 1, 2, 3, 4, 5, 6, -3, 0.5],
                [1.0] * 5 + [-1.0] * 5,
                list(range(1, 11)),
            ]
            p = (torch.stack([_with_spectrum(e, 4 + i) for i, e in enumerate(evs)]),)
            return p, lambda p: L.DenseOperator(_sym(p[0]), symmetric=True)
        return (torch.stack([_general(10, 4 + i) for i in range(3)]),), lambda p: L.DenseOperator(
            p[0]
        )
    raise AssertionError(name)


CASES = ["dense", "kronecker", "diag_lowrank", "batched"]


def _rhs(op, k=2, seed=7):
    return torch.randn(*op.batch_shape, op.shape[-1], k, generator=_gen(seed), dtype=DT)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("method", list(SOLVERS))
def test_solvers_match_dense_solve(method, case):
    p, build = _case(case, method == "minres")
    op = build(p)
    B = _rhs(op)
    ref = torch.linalg.solve(op.to_dense(), B)
    X, info = SOLVERS[method](op, B, tol=TOL)
    close(X, ref, rtol=1e-9, atol=1e-10)
    assert info.method == method and info.converged is True and info.residual <= TOL
    assert 0 < info.iterations <= 10 * op.shape[-1]
    # one vector right-hand side, and through solve / torch.linalg.solve in an iterative block
    close(SOLVERS[method](op, B[..., 0], tol=TOL)[0], ref[..., 0], rtol=1e-9, atol=1e-10)
    close(L.solve(op, B, method=method, tol=TOL), ref, rtol=1e-9, atol=1e-10)
    with L.iterative(solve=method, tol=TOL) as it:
        X2 = torch.linalg.solve(op, B)
    close(X2, ref, rtol=1e-9, atol=1e-10)
    assert [i.method for i in it.infos] == [method]


def test_minres_solves_indefinite_systems():
    p, build = _case("dense", True)
    op = build(p)
    assert torch.linalg.eigvalsh(op.to_dense()).min() < 0
    b = torch.ones(12, dtype=DT)
    x, info = L.minres(op, b, tol=TOL)
    close(x, torch.linalg.solve(op.to_dense(), b), rtol=1e-9, atol=1e-10)
    assert info.converged and info.iterations <= 13


def test_gmres_restart_converges_to_the_same_answer_in_more_steps():
    op = L.DenseOperator(_general(40, 9))
    b = torch.randn(40, generator=_gen(1), dtype=DT)
    ref = torch.linalg.solve(op.to_dense(), b)
    x_full, full = L.gmres(op, b, tol=TOL, restart=40)
    x_short, short = L.gmres(op, b, tol=TOL, restart=4)
    close(x_full, ref, rtol=1e-9, atol=1e-10)
    close(x_short, ref, rtol=1e-9, atol=1e-10)
    assert short.iterations > full.iterations
    with L.iterative(solve="gmres", restart=4, tol=TOL) as it:
        torch.linalg.solve(op, b)
    assert it.infos[0].iterations == short.iterations
    with pytest.raises(ValueError, match=r"gmres\(A, B, restart=0\): expected restart >= 1"):
        L.gmres(op, b, restart=0)


def test_gmres_full_is_exact_in_n_steps():
    op = L.DenseOperator(_general(15, 3))
    b = torch.randn(15, 3, generator=_gen(2), dtype=DT)
    _, info = L.gmres(op, b, tol=1e-10, restart=15)
    assert info.converged and info.iterations <= 15


@pytest.mark.parametrize("method", list(SOLVERS))
def test_preconditioners_cut_iterations(method):
    n = 60
    scale = torch.logspace(0, 3, n, dtype=DT)
    if method == "minres":
        S = _sym(_general(n, 5)) * torch.tensor([1.0, -1.0] * (n // 2), dtype=DT)
        S = _sym(S * scale.sqrt().unsqueeze(-1) * scale.sqrt())
        op = L.DenseOperator(S, symmetric=True)
        M = L.DiagonalOperator(S.diagonal().abs())  # positive definite, as MINRES needs
    else:
        op = L.DenseOperator(_general(n, 5) * scale)  # columns scaled: Jacobi undoes it
        M = "jacobi"
    b = torch.randn(n, generator=_gen(0), dtype=DT)
    _, plain = SOLVERS[method](op, b, tol=1e-10, maxiter=3000)
    x, pre = SOLVERS[method](op, b, tol=1e-10, preconditioner=M)
    close(x, torch.linalg.solve(op.to_dense(), b), rtol=1e-7, atol=1e-9)
    assert pre.converged and pre.iterations < plain.iterations / 2, (pre, plain)


def test_complex_operators():
    g = _gen(11)
    n = 10
    M = (
        torch.eye(n, dtype=torch.complex128) * 3
        + torch.randn(n, n, generator=g, dtype=torch.complex128) / n**0.5
    )
    H = M + M.mH - 2 * torch.eye(n, dtype=torch.complex128)  # Hermitian, indefinite
    b = torch.randn(n, 2, generator=g, dtype=torch.complex128)
    for method, A in [("gmres", M), ("bicgstab", M), ("minres", H)]:
        op = L.DenseOperator(A, symmetric=method == "minres")
        X, info = SOLVERS[method](op, b, tol=TOL)
        close(X, torch.linalg.solve(A, b), rtol=1e-9, atol=1e-10)
        # vjp through the adjoint solve (runs the method on A^H)

        def f(A, b, method=method):
            op = L.DenseOperator(A, symmetric=method == "minres")
            return L.solve(op, b, method=method, tol=TOL)

        ct = torch.randn(n, 2, generator=g, dtype=torch.complex128)
        got = ft.vjp(f, A, b)[1](ct)
        want = torch.func.vjp(torch.linalg.solve, A, b)[1](ct)
        close(got[1], want[1])
        if method != "minres":  # A's cotangent of a Hermitian parametrization differs
            close(got[0], want[0])


# ------------------------------------------------------------------ derivatives
def _grads(impl, f, args):
    if impl == "functransforms":
        return ft.grad(f, argnums=(0, 1))(*args)
    if impl == "torch.func":
        return torch.func.grad(f, argnums=(0, 1))(*args)
    p, b = args
    p = tuple(t.detach().requires_grad_() for t in p)
    b = b.detach().requires_grad_()
    gs = torch.autograd.grad(f(p, b), [*p, b])
    return tuple(gs[:-1]), gs[-1]


def _loss_pair(method, case, symmetric):
    p0, build = _case(case, symmetric)
    W = torch.randn(_rhs(build(p0)).shape, generator=_gen(13), dtype=DT)

    def iterative(p, b):
        return (L.solve(build(p), b, method=method, tol=TOL) * W).sum()

    def dense(p, b):
        return (torch.linalg.solve(build(p).to_dense(), b) * W).sum()

    return iterative, dense


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("method", list(SOLVERS))
def test_grad_matches_dense(method, case, impl):
    p, build = _case(case, method == "minres")
    B = _rhs(build(p))
    f, fd = _loss_pair(method, case, method == "minres")
    got = _grads(impl, f, (p, B))
    want = torch.func.grad(fd, argnums=(0, 1))(p, B)
    close(got, want)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("method", list(SOLVERS))
def test_jvp_matches_dense(method, case):
    p, build = _case(case, method == "minres")
    B = _rhs(build(p))
    g = _gen(17)
    tangents = (tuple(torch.randn(t.shape, generator=g, dtype=DT) for t in p), torch.randn_like(B))

    def f(p, b):
        return L.solve(build(p), b, method=method, tol=TOL)

    def fd(p, b):
        return torch.linalg.solve(build(p).to_dense(), b)

    out, tan = ft.jvp(f, (p, B), tangents)
    eout, etan = torch.func.jvp(fd, (p, B), tangents)
    close(out, eout)
    close(tan, etan)


def test_adjoint_solve_uses_the_adjoint_preconditioner():
    A = _general(12, 21)
    M = L.DenseOperator(A)  # the exact preconditioner: one step per solve, if adjointed
    b = torch.randn(12, generator=_gen(4), dtype=DT)
    w = torch.randn(12, generator=_gen(5), dtype=DT)

    def f(A, b):
        return (torch.linalg.solve(L.DenseOperator(A), b) * w).sum()

    with L.iterative(solve="gmres", tol=TOL, preconditioner=M) as it:
        got = ft.grad(f, argnums=(0, 1))(A, b)
    want = torch.func.grad(lambda A, b: (torch.linalg.solve(A, b) * w).sum(), argnums=(0, 1))(A, b)
    close(got, want)
    # the forward solve and the two adjoint solves (with M^H for A^H)
    assert len(it.infos) == 3 and all(i.iterations <= 2 for i in it.infos), it.infos


@pytest.mark.parametrize("method", list(SOLVERS))
def test_vmap_over_right_hand_sides_and_operators(method):
    p, build = _case("dense", method == "minres")
    Bs = torch.randn(4, 12, generator=_gen(23), dtype=DT)

    def f(p, b):
        return L.solve(build(p), b, method=method, tol=TOL)

    check_vmap(f, (p, Bs), in_dims=(None, 0), atol=1e-9, rtol=1e-8)
    close(ft.vmap(f, in_dims=(None, 0))(p, Bs), torch.linalg.solve(build(p).to_dense(), Bs.mT).mT)
    # over a batch of operators (every step runs, converged columns masked)
    P = (torch.stack([p[0] + 0.1 * i * torch.eye(12, dtype=DT) for i in range(3)]),)
    check_vmap(f, (P, Bs[:3]), in_dims=(0, 0), atol=1e-9, rtol=1e-8)
    ref = torch.linalg.solve(build(P).to_dense(), Bs[:3].unsqueeze(-1)).squeeze(-1)
    close(ft.vmap(f)(P, Bs[:3]), ref)
    # and per-example gradients
    g = ft.vmap(ft.grad(lambda p, b: f(p, b).sum()), in_dims=(None, 0))(p, Bs)
    e = torch.func.vmap(
        torch.func.grad(lambda p, b: torch.linalg.solve(build(p).to_dense(), b).sum()),
        in_dims=(None, 0),
    )(p, Bs)
    close(g, e)


# ------------------------------------------------------------------ warnings and refusals
@pytest.mark.parametrize("method", list(SOLVERS))
def test_not_converged_warns_with_residual(method):
    p, build = _case("dense", method == "minres")
    b = torch.ones(12, dtype=DT)
    with pytest.warns(UserWarning, match=rf"{method}: did not converge in 2 iterations \(relative"):
        L.solve(build(p), b, method=method, maxiter=2)
    _, info = SOLVERS[method](build(p), b, maxiter=2)  # the bare solver reports it
    assert info.converged is False and info.residual > 1e-6 and info.iterations == 2


@pytest.mark.parametrize("method", ["cg", "minres"])
def test_symmetric_methods_refuse_non_symmetric_operators(method):
    op = L.DenseOperator(_general(5, 0))
    b = torch.ones(5, dtype=DT)
    msg = (
        rf"solve\(A, B, method='{method}'\): {method.upper()} needs a symmetric \(Hermitian\) "
        r"operator, received DenseOperator\(shape=\(5, 5\).*method='gmres' or method='bicgstab'"
    )
    with pytest.raises(ValueError, match=msg):
        L.solve(op, b, method=method)
    with pytest.raises(ValueError, match=msg), L.iterative(solve=method):
        torch.linalg.solve(op, b)
    bare = {"cg": L.cg, "minres": L.minres}[method]
    with pytest.raises(ValueError, match=rf"{method}\(A, B\): {method.upper()} needs a symmetric"):
        bare(op, b)


def test_bad_options_and_methods_fail_loudly():
    op = L.DenseOperator(_general(5, 0))
    with pytest.raises(TypeError, match=r"solve\(A, B, method='gmres'\): unexpected options"):
        L.solve(op, torch.ones(5, dtype=DT), method="gmres", restrat=3)
    with pytest.raises(ValueError, match=r"iterative\(lstsq=\.\.\.\): expected one of \('lsmr',\)"):
        L.iterative(lstsq="lsqr")
    with pytest.raises(ValueError, match=r"gmres\(\.\.\., preconditioner='ilu'\)"):
        L.gmres(op, torch.ones(5, dtype=DT), preconditioner="ilu")
    rect = L.DenseOperator(torch.ones(4, 3, dtype=DT))
    for name, fn in SOLVERS.items():
        with pytest.raises(ValueError, match=rf"{name}\(A, B\): expected a square operator.*lsmr"):
            fn(
                rect if name != "minres" else L.DenseOperator(torch.ones(4, 3), symmetric=True),
                torch.ones(4),
            )
        with pytest.raises(ValueError, match=rf"{name}\(A, B\): expected B with 5 rows"):
            fn(L.DenseOperator(torch.eye(5, dtype=DT), symmetric=True), torch.ones(4, dtype=DT))


# ------------------------------------------------------------------ LSMR
def _rect(m, n, seed):
    g = _gen(seed)
    U, _ = torch.linalg.qr(torch.randn(m, n, generator=g, dtype=DT))
    V, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=DT))
    return U @ torch.diag(torch.linspace(1, 10, n, dtype=DT)) @ V.mT  # condition 10


def _lsq_case(name):
    if name == "dense":
        return (_rect(30, 12, 0),), lambda p: L.DenseOperator(p[0])
    if name == "kronecker":
        return (_rect(6, 3, 1), _rect(5, 4, 2)), lambda p: L.KroneckerOperator(*p)
    if name == "block_diag":  # [M; diag(d)]: a structured tall operator
        p = (_rect(15, 8, 3), torch.linspace(0.5, 2, 8, dtype=DT))
        return p, lambda p: L.cat([L.DenseOperator(p[0]), L.DiagonalOperator(p[1])], -2)
    if name == "batched":
        return (torch.stack([_rect(20, 7, 4 + i) for i in range(3)]),), lambda p: L.DenseOperator(
            p[0]
        )
    raise AssertionError(name)


LSQ_CASES = ["dense", "kronecker", "block_diag", "batched"]


def _dense_lstsq(A, B, damp=0.0):
    if damp == 0:
        return torch.linalg.lstsq(A, B, driver="gelsd" if A.dim() == 2 else None).solution
    n = A.shape[-1]
    return torch.linalg.solve(A.mH @ A + damp**2 * torch.eye(n, dtype=A.dtype), A.mH @ B)


@pytest.mark.parametrize("damp", [0.0, 0.7])
@pytest.mark.parametrize("case", LSQ_CASES)
def test_lsmr_matches_dense_lstsq(case, damp):
    p, build = _lsq_case(case)
    op = build(p)
    B = torch.randn(*op.batch_shape, op.shape[-2], 3, generator=_gen(8), dtype=DT)
    X, info = L.lsmr(op, B, damp=damp, tol=TOL)
    close(X, _dense_lstsq(op.to_dense(), B, damp), rtol=1e-9, atol=1e-10)
    assert info.method == "lsmr" and info.converged is True and info.residual <= TOL
    close(L.lsmr(op, B[..., 0], damp=damp, tol=TOL)[0], X[..., 0], rtol=1e-9, atol=1e-10)


def test_lsmr_underdetermined_gives_the_minimum_norm_solution():
    M = _rect(12, 8, 5).mT  # 8 x 12: consistent, infinitely many solutions
    b = torch.randn(8, generator=_gen(6), dtype=DT)
    x, info = L.lsmr(M, b, tol=TOL)  # a plain tensor is taken as a DenseOperator
    close(x, torch.linalg.pinv(M) @ b, rtol=1e-9, atol=1e-10)
    assert info.converged


def test_torch_lstsq_of_an_operator_runs_lsmr_only_when_asked():
    p, build = _lsq_case("kronecker")
    op = build(p)
    B = torch.randn(30, 2, generator=_gen(9), dtype=DT)
    ref = _dense_lstsq(op.to_dense(), B)
    with L.iterative(lstsq="lsmr", tol=TOL) as it:
        res = torch.linalg.lstsq(op, B)
    close(res.solution, ref, rtol=1e-9, atol=1e-10)
    assert [i.method for i in it.infos] == ["lsmr"]
    with L.iterative(lstsq="lsmr", tol=TOL, damp=0.7):
        close(torch.linalg.lstsq(op, B).solution, _dense_lstsq(op.to_dense(), B, 0.7))
    # exact by default: the dense algorithm (with the dense-fallback warning)
    from functransforms.linalg import _dispatch

    _dispatch._warn_once.cache_clear()
    with pytest.warns(UserWarning, match="lstsq"):
        exact = torch.linalg.lstsq(op, B).solution
    close(exact, ref, rtol=1e-9, atol=1e-10)


def _lsq_losses(case, damp):
    p, build = _lsq_case(case)
    op = build(p)
    W = torch.randn(*op.batch_shape, op.shape[-1], 2, generator=_gen(14), dtype=DT)

    def iterative(p, b):
        return (L.lsmr(build(p), b, damp=damp, tol=TOL)[0] * W).sum()

    def dense(p, b):
        return (_dense_lstsq(build(p).to_dense(), b, damp) * W).sum()

    B = torch.randn(*op.batch_shape, op.shape[-2], 2, generator=_gen(15), dtype=DT)
    return p, B, iterative, dense


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("damp", [0.0, 0.7])
@pytest.mark.parametrize("case", LSQ_CASES)
def test_lsmr_grad_matches_dense(case, damp, impl):
    p, B, f, fd = _lsq_losses(case, damp)
    close(_grads(impl, f, (p, B)), torch.func.grad(fd, argnums=(0, 1))(p, B))


@pytest.mark.parametrize("case", LSQ_CASES)
def test_lsmr_jvp_matches_dense(case):
    p, build = _lsq_case(case)
    op = build(p)
    B = torch.randn(*op.batch_shape, op.shape[-2], 2, generator=_gen(16), dtype=DT)
    g = _gen(18)
    t = (tuple(torch.randn(x.shape, generator=g, dtype=DT) for x in p), torch.randn_like(B))

    def f(p, b):
        with L.iterative(lstsq="lsmr", tol=TOL):
            return torch.linalg.lstsq(build(p), b).solution

    out, tan = ft.jvp(f, (p, B), t)
    eout, etan = torch.func.jvp(lambda p, b: _dense_lstsq(build(p).to_dense(), b), (p, B), t)
    close(out, eout)
    close(tan, etan)


def test_lsmr_vmap_over_right_hand_sides_and_operators():
    p, build = _lsq_case("dense")
    Bs = torch.randn(4, 30, generator=_gen(19), dtype=DT)

    def f(p, b):
        return L.lsmr(build(p), b, tol=TOL)[0]

    check_vmap(f, (p, Bs), in_dims=(None, 0), atol=1e-9, rtol=1e-8)
    close(ft.vmap(f, in_dims=(None, 0))(p, Bs), _dense_lstsq(p[0], Bs.mT).mT)
    P = (torch.stack([p[0] * (1 + 0.2 * i) for i in range(3)]),)
    check_vmap(f, (P, Bs[:3]), atol=1e-9, rtol=1e-8)

    def started(p, b, x0):  # a start and a preconditioner per batch element
        return L.lsmr(build(p), b, damp=0.5, tol=TOL, x0=x0, preconditioner="jacobi")[0]

    X0 = torch.randn(3, 12, generator=_gen(31), dtype=DT)
    check_vmap(started, (P, Bs[:3], X0), atol=1e-9, rtol=1e-8)
    close(ft.vmap(started)(P, Bs[:3], X0), _dense_lstsq(P[0], Bs[:3, :, None], 0.5)[..., 0])
    g = ft.vmap(ft.grad(lambda p, b: f(p, b).sum()), in_dims=(None, 0))(p, Bs)
    e = torch.func.vmap(
        torch.func.grad(lambda p, b: _dense_lstsq(p[0], b.unsqueeze(-1)).sum()), in_dims=(None, 0)
    )(p, Bs)
    close(g, e)


def test_lsmr_not_converged_warns_and_bad_inputs_refused():
    M = _rect(30, 12, 0)
    with pytest.warns(UserWarning, match=r"lsmr: did not converge in 2 iterations"):
        with L.iterative(lstsq="lsmr", maxiter=2):
            torch.linalg.lstsq(L.DenseOperator(M), torch.ones(30, 1, dtype=DT))
    with pytest.raises(
        ValueError, match=r"lsmr\(DenseOperator\(shape=\(30, 12\).*expected B with 30 rows"
    ):
        L.lsmr(M, torch.ones(12, dtype=DT))
    with pytest.raises(TypeError, match=r"lsmr\(A, B\): expected A to be a LinearOperator"):
        L.lsmr([[1.0]], torch.ones(1, dtype=DT))


def _badly_scaled(m=40, n=10, seed=21):
    """A tall matrix whose columns' scales span 1e-3 .. 1e3 (condition ~1e6 + that of _rect)."""
    return _rect(m, n, seed) * torch.logspace(-3, 3, n, dtype=DT)


@pytest.mark.parametrize("damp", [0.0, 0.7])
@pytest.mark.parametrize("case", LSQ_CASES)
def test_lsmr_from_a_start_solves_the_same_damped_problem(case, damp):
    p, build = _lsq_case(case)
    op = build(p)
    B = torch.randn(*op.batch_shape, op.shape[-2], 3, generator=_gen(22), dtype=DT)
    ref = _dense_lstsq(op.to_dense(), B, damp)
    x0 = ref + 0.3 * torch.randn(ref.shape, generator=_gen(23), dtype=DT)
    X, info = L.lsmr(op, B, damp=damp, tol=TOL, x0=x0)
    close(X, ref, rtol=1e-9, atol=1e-10)
    assert info.converged
    x, _ = L.lsmr(op, B[..., 0], damp=damp, tol=TOL, x0=x0[..., 0])  # vectors too
    close(x, ref[..., 0], rtol=1e-9, atol=1e-10)


def test_lsmr_from_the_solution_stops_at_once():
    M, b = _rect(30, 12, 0), torch.randn(30, generator=_gen(24), dtype=DT)
    ref = _dense_lstsq(M, b.unsqueeze(-1), 0.5).squeeze(-1)
    cold = L.lsmr(M, b, damp=0.5, tol=1e-8)[1]
    warm = L.lsmr(M, b, damp=0.5, tol=1e-8, x0=ref)[1]
    assert warm.iterations <= 1 < cold.iterations


@pytest.mark.parametrize("damp", [0.0, 1e-3])  # a large damping conditions the problem itself
def test_lsmr_jacobi_preconditioner_on_badly_scaled_columns(damp):
    M = _badly_scaled()
    b = torch.randn(40, generator=_gen(25), dtype=DT)
    ref = _dense_lstsq(M, b.unsqueeze(-1), damp).squeeze(-1)
    plain = L.lsmr(M, b, damp=damp, tol=1e-10, maxiter=400)
    jacobi = L.lsmr(M, b, damp=damp, tol=1e-10, maxiter=400, preconditioner="jacobi")
    close(jacobi[0], ref, rtol=1e-7, atol=1e-9)
    assert jacobi[1].converged and jacobi[1].iterations < plain[1].iterations / 2
    # with a start as well
    x0 = torch.zeros(10, dtype=DT) + 1.0
    close(L.lsmr(M, b, damp=damp, tol=1e-10, x0=x0, preconditioner="jacobi")[0], ref, rtol=1e-7)


def test_lsmr_operator_preconditioner():
    M = _badly_scaled()
    b = torch.randn(40, 2, generator=_gen(26), dtype=DT)
    R = torch.linalg.qr(M)[1]  # the exact right preconditioner: M R^{-1} is orthonormal
    x, info = L.lsmr(M, b, tol=1e-12, preconditioner=L.TriangularOperator(R, upper=True))
    close(x, _dense_lstsq(M, b), rtol=1e-9, atol=1e-10)
    assert info.iterations <= 3


@pytest.mark.parametrize("impl", IMPLS)
def test_lsmr_derivatives_with_a_start_and_a_preconditioner(impl):
    M0 = _badly_scaled(20, 6, 27)
    B = torch.randn(20, 2, generator=_gen(28), dtype=DT)
    W = torch.randn(6, 2, generator=_gen(29), dtype=DT)
    x0 = torch.ones(6, 2, dtype=DT)

    def f(p, b):
        X = L.lsmr(p[0], b, damp=0.3, tol=1e-13, x0=x0, preconditioner="jacobi")[0]
        return (X * W).sum()

    def fd(p, b):
        return (_dense_lstsq(p[0], b, 0.3) * W).sum()

    p = (M0,)
    close(_grads(impl, f, (p, B)), torch.func.grad(fd, argnums=(0, 1))(p, B), rtol=1e-6)


def test_lsmr_start_is_not_differentiated_and_bad_options_refused():
    M, b = _rect(30, 12, 0), torch.randn(30, generator=_gen(30), dtype=DT)
    ref = _dense_lstsq(M, b.unsqueeze(-1)).squeeze(-1)
    g = ft.grad(lambda x0: L.lsmr(M, b, tol=TOL, x0=x0)[0].sum())(ref + 1)
    assert torch.count_nonzero(g) == 0  # the solution does not depend on where LSMR starts
    with pytest.raises(
        ValueError, match=r"lsmr\(.*x0=\.\.\.\): expected x0 shaped as the solution"
    ):
        L.lsmr(M, b, x0=torch.zeros(30, dtype=DT))
    with pytest.raises(TypeError, match=r"lsmr\(.*x0=\.\.\.\): expected x0 to be a Tensor"):
        L.lsmr(M, b, x0=[0.0] * 12)
    with pytest.raises(TypeError, match=r"products with both P\^\{-1\} and P\^\{-H\}"):
        L.lsmr(M, b, preconditioner=lambda r: r)
    with pytest.raises(ValueError, match=r"expected 'jacobi' or an operator"):
        L.lsmr(M, b, preconditioner="ilu")
    with pytest.raises(ValueError, match=r"expected a square operator of size 12"):
        L.lsmr(M, b, preconditioner=L.DiagonalOperator(torch.ones(30, dtype=DT)))


def test_normal_operator_is_the_normal_matrix():
    M = _rect(9, 4, 1)
    N = L.NormalOperator(L.DenseOperator(M), damp=0.5)
    close(N.to_dense(), M.mT @ M + 0.25 * torch.eye(4, dtype=DT), rtol=1e-12, atol=1e-12)
    assert N.symmetric and N.positive_definite
    assert not L.NormalOperator(L.DenseOperator(M)).positive_definite
