"""Iterative methods: accuracy, reported info, implicit differentiation (never unrolled)."""

import importlib
import pathlib
import re
import warnings

import functransforms.linalg as L
import pytest
import torch
from functransforms.linalg import _iterative

DT = torch.float64
IMPLS = ["torch.func", "functransforms"]


def _get(impl, name):
    mod = torch.func if impl == "torch.func" else importlib.import_module("functransforms")
    fn = getattr(mod, name, None)
    if fn is None:
        pytest.skip(f"{impl}.{name} does not exist yet (the transform core is in progress)")
    return fn


def _spd(n, seed=0, cond=50.0):
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=DT))
    evals = torch.logspace(0, torch.log10(torch.tensor(cond)).item(), n, dtype=DT)
    return Q @ torch.diag(evals) @ Q.mT


def close(a, b, **kw):
    torch.testing.assert_close(a, b, **{"rtol": 1e-6, "atol": 1e-8, **kw})


def test_cg_matches_exact_and_reports_info():
    A = _spd(40)
    b = torch.randn(40, 3, dtype=DT, generator=torch.Generator().manual_seed(1))
    op = L.DenseOperator(A, positive_definite=True)
    x, info = L.cg(op, b, tol=1e-10)
    close(x, torch.linalg.solve(A, b))
    assert info.method == "cg" and info.converged is True
    assert 0 < info.iterations <= 80 and info.residual <= 1e-10 and info.tol == 1e-10


def test_cg_vector_rhs_and_batch():
    A = torch.stack([_spd(10, s) for s in range(3)])
    b = torch.randn(3, 10, dtype=DT)
    x, info = L.cg(L.DenseOperator(A, positive_definite=True), b, tol=1e-12)
    close(x, torch.linalg.solve(A, b))


def test_jacobi_and_operator_preconditioners_cut_iterations():
    g = torch.Generator().manual_seed(2)
    d = torch.logspace(0, 4, 60, dtype=DT)
    E = 0.1 * torch.randn(60, 60, generator=g, dtype=DT)
    A = torch.diag(d) + (E @ E.mT)
    op = L.DenseOperator(A, positive_definite=True)
    b = torch.randn(60, dtype=DT, generator=g)
    _, plain = L.cg(op, b, tol=1e-10, maxiter=2000)
    xj, jac = L.cg(op, b, tol=1e-10, preconditioner="jacobi")
    xo, opre = L.cg(op, b, tol=1e-10, preconditioner=L.DiagonalOperator(A.diagonal()))
    close(xj, torch.linalg.solve(A, b))
    close(xo, torch.linalg.solve(A, b))
    assert jac.iterations < plain.iterations / 2, (jac, plain)
    assert opre.iterations == jac.iterations


def test_cg_not_converged_warns_with_residual():
    op = L.DenseOperator(_spd(30, cond=1e4), positive_definite=True)
    with pytest.warns(UserWarning, match=r"cg: did not converge in 2 iterations"):
        L.solve(op, torch.ones(30, dtype=DT), method="cg", maxiter=2)


def test_exact_by_default_iterative_only_when_asked():
    op = L.DenseOperator(_spd(20), positive_definite=True)
    b = torch.ones(20, dtype=DT)
    gen = torch.Generator().manual_seed(0)
    with L.iterative(solve="cg", tol=1e-12, num_probes=400, generator=gen) as it:
        x = torch.linalg.solve(op, b)
        ld = torch.logdet(op)
    assert [i.method for i in it.infos] == ["cg", "slq"]
    close(x, torch.linalg.solve(op.to_dense(), b))
    assert abs(ld - torch.logdet(op.to_dense())) < 1.0
    calls = []
    orig = _iterative.cg
    try:
        _iterative.cg = lambda *a, **k: calls.append(1) or orig(*a, **k)
        torch.linalg.solve(op, b)
        torch.logdet(op)
    finally:
        _iterative.cg = orig
    assert calls == []  # outside the context: exact


def test_bad_method_names_fail_loudly():
    op = L.DiagonalOperator(torch.ones(3, dtype=DT))
    with pytest.raises(
        ValueError,
        match=r"solve\(\.\.\., method=\.\.\.\): expected one of "
        r"\('cg', 'minres', 'gmres', 'bicgstab'\)",
    ):
        L.solve(op, torch.ones(3, dtype=DT), method="qmr")
    with pytest.raises(ValueError, match=r"iterative\(trace=\.\.\.\)"):
        L.iterative(trace="exact")


def _count_cg(monkeypatch):
    calls = []
    orig = _iterative.cg

    def counting(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    monkeypatch.setattr(_iterative, "cg", counting)
    return calls


def _kron_params():
    g = torch.Generator().manual_seed(5)
    return (torch.randn(4, 4, generator=g, dtype=DT), torch.randn(5, 5, generator=g, dtype=DT))


def _build(p):
    A, B = p
    return L.KroneckerOperator(
        A @ A.mT / 4 + torch.eye(4), B @ B.mT / 5 + torch.eye(5), positive_definite=True
    )


def _solve_cg(p, b):
    return L.solve(_build(p), b, method="cg", tol=1e-12)


def _solve_exact(p, b):
    return torch.linalg.solve(_build(p).to_dense(), b)


@pytest.mark.parametrize("impl", IMPLS)
def test_implicit_grad_two_extra_solves(impl, monkeypatch):
    grad = _get(impl, "grad")
    p, b = _kron_params(), torch.randn(20, dtype=DT)
    w = torch.randn(20, dtype=DT)
    calls = _count_cg(monkeypatch)
    g = grad(lambda p, b: (_solve_cg(p, b) * w).sum(), argnums=(0, 1))(p, b)
    # the forward solve and two for the vjp (Note [Second-order exactness of the implicit
    # solve]): nothing unrolled
    assert len(calls) == 3
    e = torch.func.grad(lambda p, b: (_solve_exact(p, b) * w).sum(), argnums=(0, 1))(p, b)
    close(g, e)


@pytest.mark.parametrize("impl", IMPLS)
def test_implicit_vjp(impl):
    vjp = _get(impl, "vjp")
    p, b = _kron_params(), torch.randn(20, 2, dtype=DT)
    out, fn = vjp(_solve_cg, p, b)
    eout, efn = torch.func.vjp(_solve_exact, p, b)
    close(out, eout)
    ct = torch.randn(20, 2, dtype=DT)
    close(fn(ct), efn(ct))


@pytest.mark.parametrize("impl", IMPLS)
def test_implicit_jvp_two_extra_solves(impl, monkeypatch):
    jvp = _get(impl, "jvp")
    p, b = _kron_params(), torch.randn(20, dtype=DT)
    t = (tuple(torch.randn_like(x) for x in p), torch.randn(20, dtype=DT))
    calls = _count_cg(monkeypatch)
    out, tan = jvp(_solve_cg, (p, b), t)
    assert len(calls) == 3  # forward solve + two for the tangent
    eout, etan = torch.func.jvp(_solve_exact, (p, b), t)
    close(out, eout)
    close(tan, etan)


@pytest.mark.parametrize("impl", IMPLS)
def test_implicit_vmap(impl):
    vmap = _get(impl, "vmap")
    ps = [_kron_params() for _ in range(3)]
    ps = [tuple(x + 0.1 * i for x in p) for i, p in enumerate(ps)]
    P = tuple(torch.stack([p[k] for p in ps]) for k in range(2))
    bs = torch.randn(3, 20, dtype=DT)
    out = vmap(_solve_cg)(P, bs)
    close(out, torch.stack([_solve_exact(p, b) for p, b in zip(ps, bs)]))


@pytest.mark.parametrize("impl", IMPLS)
def test_implicit_grad_under_vmap(impl):
    vmap, grad = _get(impl, "vmap"), _get(impl, "grad")
    p = _kron_params()
    bs = torch.randn(3, 20, dtype=DT)
    g = vmap(grad(lambda p, b: _solve_cg(p, b).sum()), in_dims=(None, 0))(p, bs)
    e = torch.func.vmap(torch.func.grad(lambda p, b: _solve_exact(p, b).sum()), in_dims=(None, 0))(
        p, bs
    )
    close(g, e)


def test_lanczos_tridiagonal_has_the_spectrum():
    A = _spd(12)
    Q, a, b = L.lanczos(L.DenseOperator(A, symmetric=True), torch.ones(12, 1, dtype=DT), 12)
    T = torch.diag(a[0]) + torch.diag(b[0], 1) + torch.diag(b[0], -1)
    close(torch.linalg.eigvalsh(T), torch.linalg.eigvalsh(A))
    close(Q[0] @ Q[0].mT, torch.eye(12, dtype=DT))


def test_slq_logdet_and_its_gradient():
    g = torch.Generator().manual_seed(0)
    A = _spd(80, cond=20.0)
    op = L.DenseOperator(A, positive_definite=True)
    est, info = L.slq_logdet(op, num_probes=256, lanczos_steps=25, generator=g)
    exact = torch.logdet(A)
    assert abs(est - exact) / abs(exact) < 0.02, (est, exact)
    assert info.method == "slq" and info.num_probes == 256

    # d/ds logdet(A + s I) = tr((A + s I)^{-1}): the estimator's gradient, against the exact one.
    def f(s, exact_):
        op = L.DenseOperator(A + s * torch.eye(80, dtype=DT), positive_definite=True)
        if exact_:
            return torch.logdet(op)
        gen = torch.Generator().manual_seed(1)
        return L.logdet(op, method="slq", num_probes=256, lanczos_steps=30, generator=gen)

    s = torch.tensor(0.5, dtype=DT)
    ge = torch.func.grad(lambda s: f(s, True))(s)
    gs = torch.func.grad(lambda s: f(s, False))(s)
    close(ge, torch.trace(torch.linalg.inv(A + 0.5 * torch.eye(80, dtype=DT))))
    assert abs(gs - ge) / ge < 0.05, (gs, ge)
    t = torch.func.jvp(lambda s: f(s, False), (s,), (torch.tensor(2.0, dtype=DT),))[1]
    close(t, 2 * gs)


def test_trace_estimators():
    d = torch.arange(1.0, 11.0, dtype=DT)
    D = L.DiagonalOperator(d)
    assert L.hutchinson_trace(D, num_probes=3).item() == pytest.approx(55.0)  # exact on diagonals
    U = torch.randn(100, 4, dtype=DT, generator=torch.Generator().manual_seed(0))
    lr = L.LowRankOperator(U)
    close(L.hutchpp_trace(lr, num_probes=15), (U * U).sum())  # exact when the sketch has the range
    A = _spd(100, cond=1e3)
    op = L.DenseOperator(A, symmetric=True)
    g = torch.Generator().manual_seed(3)
    est = L.hutchinson_trace(op, num_probes=2000, generator=g)
    assert abs(est - torch.trace(A)) / torch.trace(A) < 0.05
    with L.iterative(solve=None, logdet=None, trace="hutchpp", num_probes=30) as it:
        t = torch.trace(op)
    assert it.infos[0].method == "hutchpp" and abs(t - torch.trace(A)) / torch.trace(A) < 0.1


def test_library_never_calls_torch_transforms():
    """Product rule: our library never uses torch's transforms to implement its own."""
    forbidden = re.compile(
        r"torch\.func|torch\.vmap|autograd\.grad|\.backward\(|forward_ad|functorch"
    )
    root = pathlib.Path(L.__file__).parent
    hits = [
        f"{p.name}:{i}: {line.strip()}"
        for p in sorted(root.glob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if forbidden.search(line)
    ]
    assert hits == [], hits


def test_fallback_warns_once_naming_op_and_operator():
    op = L.KroneckerOperator(torch.eye(2, dtype=DT), torch.eye(2, dtype=DT))
    _iterative  # noqa: B018
    from functransforms.linalg import _dispatch

    _dispatch._warn_once.cache_clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out1 = torch.linalg.matrix_exp(op)
        out2 = torch.linalg.matrix_exp(op)
    msgs = [str(x.message) for x in w if "no structured rule" in str(x.message)]
    assert len(msgs) == 1 and "matrix_exp" in msgs[0] and "KroneckerOperator" in msgs[0]
    close(out1, torch.linalg.matrix_exp(op.to_dense()))
    close(out2, out1)
