"""Matrix functions ``f(A) V`` and top-k eigenpairs by Lanczos, against dense float64 eigh and
matrix_exp, with derivatives through the steps (exact when steps >= n)."""

import functransforms.linalg as L
import pytest
import torch

import functransforms as ft
from functransforms.testing import check_grads, check_vmap

DT = torch.float64
FUNCS = {"exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "invsqrt": torch.rsqrt}
IMPLS = ["functransforms", "torch.func", "torch.autograd"]


def close(a, b, **kw):
    torch.testing.assert_close(a, b, **{"rtol": 1e-6, "atol": 1e-8, **kw})


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _spd(n, seed, lo=0.5, hi=4.0):
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=_gen(seed), dtype=DT))
    return Q @ torch.diag(torch.linspace(lo, hi, n, dtype=DT)) @ Q.mT


def _sym(P):
    return (P + P.mT) / 2


# symmetric positive definite cases (log, sqrt, invsqrt need them): (params, build)
def _case(name):
    if name == "dense":
        return (_spd(12, 0),), lambda p: L.DenseOperator(_sym(p[0]), symmetric=True)
    if name == "kronecker":
        # distinct products of the factors' eigenvalues (Note [Differentiating Lanczos
        # approximations]: a repeated eigenvalue makes only the value exact)
        return (_spd(4, 1), _spd(3, 2, 0.7, 2.9)), lambda p: L.KroneckerOperator(
            _sym(p[0]), _sym(p[1]), symmetric=True
        )
    if name == "diag_lowrank":
        p = (0.5 * torch.randn(12, 2, generator=_gen(3), dtype=DT), torch.linspace(1, 3, 12))
        return p, lambda p: L.LowRankPlusDiagonalOperator(p[0], p[1])
    if name == "batched":
        p = (torch.stack([_spd(10, 4 + i) for i in range(3)]),)
        return p, lambda p: L.DenseOperator(_sym(p[0]), symmetric=True)
    raise AssertionError(name)


CASES = ["dense", "kronecker", "diag_lowrank", "batched"]


def dense_f(A, f):
    """f(A) by the dense float64 eigendecomposition (matrix_exp for exp)."""
    if f == "exp":
        return torch.linalg.matrix_exp(A)
    evals, Q = torch.linalg.eigh(A)
    fn = FUNCS[f] if isinstance(f, str) else f
    return Q @ (fn(evals).unsqueeze(-1) * Q.mT)


def _V(op, p=3, seed=7):
    return torch.randn(*op.batch_shape, op.shape[-1], p, generator=_gen(seed), dtype=DT)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("f", list(FUNCS))
def test_matfunc_is_exact_with_n_steps(f, case):
    p, build = _case(case)
    op = build(p)
    V = _V(op)
    n = op.shape[-1]
    want = dense_f(op.to_dense(), f) @ V
    close(L.lanczos_matfunc(op, V, f, steps=n), want, rtol=1e-10, atol=1e-11)
    close(L.lanczos_matfunc(op, V[..., 0], f, steps=n + 5), want[..., 0], rtol=1e-10, atol=1e-11)


def test_matfunc_callable_and_convergence_in_steps():
    op = L.DenseOperator(_spd(60, 5, 0.1, 2.0), symmetric=True)
    V = _V(op, 2)
    want = dense_f(op.to_dense(), "exp") @ V
    errs = [
        ((L.lanczos_matfunc(op, V, torch.exp, steps=s) - want).norm() / want.norm()).item()
        for s in (3, 6, 12)
    ]
    assert errs[0] > errs[1] > errs[2] and errs[2] < 1e-10, errs  # far fewer than n = 60 steps
    g = lambda t: 1 / (1 + t**2)  # noqa: E731
    close(L.lanczos_matfunc(op, V, g, steps=60), dense_f(op.to_dense(), g) @ V)


def _grads(impl, f, args):
    if impl == "functransforms":
        return ft.grad(f, argnums=(0, 1))(*args)
    if impl == "torch.func":
        return torch.func.grad(f, argnums=(0, 1))(*args)
    p, V = args
    p = tuple(t.detach().requires_grad_() for t in p)
    V = V.detach().requires_grad_()
    gs = torch.autograd.grad(f(p, V), [*p, V])
    return tuple(gs[:-1]), gs[-1]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("f", ["exp", "invsqrt"])
def test_matfunc_grad_matches_dense_with_n_steps(f, case, impl):
    p, build = _case(case)
    op = build(p)
    V = _V(op)
    W = torch.randn(V.shape, generator=_gen(8), dtype=DT)
    n = op.shape[-1]

    def loss(p, V):
        return (L.lanczos_matfunc(build(p), V, f, steps=n) * W).sum()

    def dense(p, V):
        return ((dense_f(build(p).to_dense(), f) @ V) * W).sum()

    close(_grads(impl, loss, (p, V)), torch.func.grad(dense, argnums=(0, 1))(p, V))


@pytest.mark.parametrize("case", CASES)
def test_matfunc_jvp_matches_dense(case):
    p, build = _case(case)
    op = build(p)
    V = _V(op)
    n = op.shape[-1]
    g = _gen(9)
    t = (tuple(torch.randn(x.shape, generator=g, dtype=DT) for x in p), torch.randn_like(V))

    def f(p, V):
        return L.lanczos_matfunc(build(p), V, "sqrt", steps=n)

    out, tan = ft.jvp(f, (p, V), t)
    eout, etan = torch.func.jvp(lambda p, V: dense_f(build(p).to_dense(), "sqrt") @ V, (p, V), t)
    close(out, eout)
    close(tan, etan)


def test_matfunc_derivative_is_that_of_the_approximation():
    # with steps < n the derivative is the approximation's, checked by finite differences
    p, build = _case("dense")
    V = _V(build(p), 1)[..., 0]
    check_grads(lambda M, V: L.lanczos_matfunc(build((M,)), V, "exp", steps=5), (p[0], V))


def test_matfunc_vmap_over_vectors_and_operators():
    p, build = _case("dense")
    Vs = torch.randn(4, 12, generator=_gen(10), dtype=DT)

    def f(p, v):
        return L.lanczos_matfunc(build(p), v, "exp", steps=12)

    check_vmap(f, (p, Vs), in_dims=(None, 0), atol=1e-10, rtol=1e-9)
    close(ft.vmap(f, in_dims=(None, 0))(p, Vs), (dense_f(_sym(p[0]), "exp") @ Vs.mT).mT)
    P = (torch.stack([_spd(12, 20 + i) for i in range(3)]),)
    check_vmap(f, (P, Vs[:3]), atol=1e-10, rtol=1e-9)
    want = (dense_f(P[0], "exp") @ Vs[:3].unsqueeze(-1)).squeeze(-1)
    close(ft.vmap(f)(P, Vs[:3]), want)


def test_matfunc_refusals():
    A = torch.randn(5, 5, generator=_gen(0), dtype=DT)
    with pytest.raises(
        ValueError,
        match=r"lanczos_matfunc\(A, V, f\): Lanczos needs a symmetric \(Hermitian\) operator, "
        r"received DenseOperator\(shape=\(5, 5\).*matrix_exp",
    ):
        L.lanczos_matfunc(L.DenseOperator(A), torch.ones(5, dtype=DT), "exp")
    op = L.DenseOperator(_spd(5, 0), symmetric=True)
    with pytest.raises(ValueError, match=r"expected f in \['exp', 'invsqrt', 'log', 'sqrt'\]"):
        L.lanczos_matfunc(op, torch.ones(5, dtype=DT), "cos")
    with pytest.raises(ValueError, match=r"expected V with 5 rows"):
        L.lanczos_matfunc(op, torch.ones(4, dtype=DT), "exp")


# ------------------------------------------------------------------ eigsh
def _indefinite(n, seed):
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=_gen(seed), dtype=DT))
    evals = torch.linspace(-5, 9, n, dtype=DT) ** 3 / 50  # spread at both ends
    return Q @ torch.diag(evals) @ Q.mT


def _check_pairs(op, vals, vecs, which, k, **tol):
    evals, U = torch.linalg.eigh(op.to_dense())
    sel = slice(-k, None) if which == "LA" else slice(0, k)
    close(vals, evals[..., sel], **tol)
    # eigenvectors up to sign: |<y_i, u_i>| = 1, and orthonormal
    overlap = (vecs * U[..., sel]).sum(-2).abs()
    close(overlap, torch.ones_like(overlap), **tol)
    eye = torch.eye(k, dtype=DT).expand(vecs.shape[:-2] + (k, k))
    close(vecs.mT @ vecs, eye, rtol=1e-9, atol=1e-9)


EIG_CASES = {
    "dense": lambda: L.DenseOperator(_indefinite(30, 0), symmetric=True),
    "kronecker": lambda: L.KroneckerOperator(_spd(5, 1), _indefinite(6, 2), symmetric=True),
    "diag_lowrank": lambda: L.LowRankPlusDiagonalOperator(
        torch.randn(30, 2, generator=_gen(3), dtype=DT), torch.linspace(-3, 3, 30)
    ),
    "batched": lambda: L.DenseOperator(
        torch.stack([_indefinite(20, 4 + i) for i in range(3)]), symmetric=True
    ),
}


@pytest.mark.parametrize("which", ["LA", "SA"])
@pytest.mark.parametrize("case", list(EIG_CASES))
def test_eigsh_matches_eigh(case, which):
    op = EIG_CASES[case]()
    n = op.shape[-1]
    vals, vecs = L.eigsh(op, 3, which=which, steps=n)
    assert vals.shape == op.batch_shape + (3,) and vecs.shape == op.batch_shape + (n, 3)
    _check_pairs(op, vals, vecs, which, 3, rtol=1e-9, atol=1e-9)


def test_eigsh_converges_in_fewer_steps_than_n():
    op = L.DenseOperator(_indefinite(200, 5), symmetric=True)
    with L.iterative() as it:
        vals, vecs = L.eigsh(op, 2, which="LA", steps=60, tol=1e-8)
    _check_pairs(op, vals, vecs, "LA", 2, rtol=1e-7, atol=1e-7)
    assert it.infos[0].method == "eigsh" and it.infos[0].converged


def test_eigsh_warns_when_not_converged_and_refuses():
    op = L.DenseOperator(_indefinite(200, 5), symmetric=True)
    with pytest.warns(UserWarning, match=r"eigsh: did not converge in 4 iterations.*raise steps"):
        L.eigsh(op, 2, which="SA", steps=4)
    with pytest.raises(ValueError, match=r"eigsh\(A, k=2, which='LA'\): Lanczos needs a symmetric"):
        L.eigsh(L.DenseOperator(torch.randn(4, 4, dtype=DT)), 2)
    with pytest.raises(ValueError, match=r"expected which='LA' or 'SA', received 'LM'"):
        L.eigsh(op, 2, which="LM")
    with pytest.raises(ValueError, match=r"expected 1 <= k <= n = 200, received k=0"):
        L.eigsh(op, 0)


def test_eigsh_eigenvalue_grad_with_n_steps():
    p = (_indefinite(10, 6),)

    def top(p):
        return L.eigsh(L.DenseOperator(_sym(p[0]), symmetric=True), 2, steps=10)[0].sum()

    want = torch.func.grad(lambda p: torch.linalg.eigvalsh(_sym(p[0]))[-2:].sum())(p)
    close(ft.grad(top)(p), want)
