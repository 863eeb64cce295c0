"""Zero, Kronecker-sum, block, Hadamard, batch repeat/sum, circulant and tridiagonal operators:
every operation against the dense float64 matrix (`to_dense` and an independently built one),
and grad, jvp and vmap through it with torch.func (the oracle) and our transforms."""

import importlib
import math
import warnings

import functransforms.linalg as L
import pytest
import torch
from structured_cases import STRUCTURED_BY_NAME, STRUCTURED_CASES

DT = torch.float64
IMPLS = ["torch.func", "functransforms"]


def close(a, b, **kw):
    torch.testing.assert_close(a, b, **{"rtol": 1e-6, "atol": 1e-8, **kw})


def _mod(impl):
    return torch.func if impl == "torch.func" else importlib.import_module("functransforms")


def _square(case):
    p, op = case.make()
    return op.shape[-1] == op.shape[-2]


OPS = {
    "to_dense": (lambda c: True, False, lambda A, b, d: A if d else A.to_dense()),
    "matmul": (lambda c: True, True, lambda A, b, d: A @ b[..., : A.shape[-1]]),
    "rmatmul": (lambda c: True, True, lambda A, b, d: b[..., : A.shape[-2]] @ A),
    "solve": (lambda c: c.invertible, True, lambda A, b, d: torch.linalg.solve(A, b)),
    "inv_matmul": (lambda c: c.invertible, True, lambda A, b, d: torch.linalg.inv(A) @ b),
    "logdet": (lambda c: c.pd, False, lambda A, b, d: torch.logdet(A)),
    "slogdet": (
        lambda c: c.invertible and not c.pd,
        False,
        lambda A, b, d: torch.linalg.slogdet(A)[1],
    ),
    "trace": (_square, False, lambda A, b, d: A.diagonal(dim1=-2, dim2=-1).sum(-1)),
    "diagonal": (_square, False, lambda A, b, d: A.diagonal(dim1=-2, dim2=-1)),
}


def _params(transforms=True):
    out = []
    for case in STRUCTURED_CASES:
        for name, (applies, uses_b, _) in OPS.items():
            if not applies(case):
                continue
            if transforms and not uses_b and case.params(torch.Generator().manual_seed(0)) == ():
                continue  # nothing to differentiate or batch
            out.append(pytest.param(case, name, id=f"{case.name}-{name}"))
    return out


def _fns(case, opname):
    fn = OPS[opname][2]
    return (lambda p, b: fn(case.build(*p), b, False)), (lambda p, b: fn(case.dense(*p), b, True))


def _inputs(case, seed=0):
    params = case.params(torch.Generator().manual_seed(seed))
    n = max(case.build(*params).shape[-2:])
    return params, torch.randn(n, generator=torch.Generator().manual_seed(seed + 100), dtype=DT)


def _like(tree, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.utils._pytree.tree_map(lambda t: torch.randn(t.shape, generator=g, dtype=DT), tree)


@pytest.mark.parametrize("case,opname", _params(transforms=False))
def test_value(case, opname):
    structured, dense = _fns(case, opname)
    params, b = _inputs(case)
    close(case.build(*params).to_dense(), case.dense(*params), rtol=1e-12, atol=1e-12)
    close(structured(params, b), dense(params, b), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case,opname", _params())
def test_grad(impl, case, opname):
    structured, dense = _fns(case, opname)
    params, b = _inputs(case)
    w = _like(dense(params, b), 7)

    def loss(f):
        return lambda p, b: (f(p, b) * w).sum()

    g = _mod(impl).grad(loss(structured), argnums=(0, 1))(params, b)
    close(g, torch.func.grad(loss(dense), argnums=(0, 1))(params, b))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case,opname", _params())
def test_jvp(impl, case, opname):
    structured, dense = _fns(case, opname)
    params, b = _inputs(case)
    tangents = (_like(params, 3), _like(b, 4))
    out, t = _mod(impl).jvp(structured, (params, b), tangents)
    eout, et = torch.func.jvp(dense, (params, b), tangents)
    close(out, eout)
    close(t, et)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case,opname", _params())
def test_vmap(impl, case, opname):
    structured, dense = _fns(case, opname)
    inputs = [_inputs(case, seed) for seed in range(3)]
    params = tuple(torch.stack([i[0][k] for i in inputs]) for k in range(len(inputs[0][0])))
    b = torch.stack([i[1] for i in inputs])
    out = _mod(impl).vmap(structured)(params, b)
    close(out, torch.stack([dense(*i) for i in inputs]))


# ------------------------------------------------------------------ structure is kept
def _op(name):
    return STRUCTURED_BY_NAME[name].make()[1]


def test_algebra_keeps_structure():
    K = _op("kronecker_sum_pd")
    Z = L.ZeroOperator(6, dtype=DT)
    D = L.DiagonalOperator(torch.rand(6, dtype=DT) + 1)
    assert Z + D is D and D + Z is D
    assert isinstance(Z @ K, L.ZeroOperator) and isinstance(K @ Z, L.ZeroOperator)
    assert isinstance(2.0 * Z, L.ZeroOperator)
    assert isinstance(K + L.ScaledIdentityOperator(torch.tensor(0.5, dtype=DT), 6), type(K))
    assert isinstance(K + K, L.KroneckerSumOperator)
    assert isinstance(2.0 * K, L.KroneckerSumOperator)
    C = _op("circulant")
    assert isinstance(C @ C, L.CirculantOperator) and isinstance(C + C, L.CirculantOperator)
    assert isinstance(torch.linalg.inv(C), L.CirculantOperator)
    assert isinstance(C + L.ScaledIdentityOperator(torch.tensor(2.0, dtype=DT), 6), type(C))
    close((C @ C).to_dense(), C.to_dense() @ C.to_dense())
    close(torch.linalg.inv(C).to_dense(), torch.linalg.inv(C.to_dense()))
    T = _op("tridiagonal_dominant")
    assert isinstance(T + T, L.TridiagonalOperator) and isinstance(T + D, L.TridiagonalOperator)
    close((T + D).to_dense(), T.to_dense() + D.to_dense())
    M = L.DenseOperator(torch.randn(6, 6, dtype=DT))
    assert isinstance(M * D, L.DiagonalOperator)  # A ∘ diag(d) = diag(d ∘ diag A)
    close((M * D).to_dense(), M.to_dense() * D.to_dense())
    assert isinstance(M * Z, L.ZeroOperator)
    B = _op("block_general")
    assert isinstance(B + B, L.BlockOperator) and isinstance(B @ B, L.BlockOperator)
    close((B @ B).to_dense(), B.to_dense() @ B.to_dense())
    close((B + B).to_dense(), 2 * B.to_dense())
    assert isinstance(B.mT, L.BlockOperator)
    close(B.mT.to_dense(), B.to_dense().mT)


def test_kronecker_sum_eigh_and_transpose():
    K = _op("kronecker_sum3_sym")
    evals, Q = torch.linalg.eigh(K)
    close(evals, torch.linalg.eigvalsh(K.to_dense()))
    close(Q.to_dense() @ torch.diag(evals) @ Q.to_dense().mT, K.to_dense())
    N = _op("kronecker_sum_nonsym")
    close(N.mT.to_dense(), N.to_dense().mT)


def test_block_triangular_solves_by_substitution_not_densely(monkeypatch):
    B = _op("block_lower")
    assert B._tri == "lower" and B.lower is False  # the first diagonal block is not triangular

    def no_dense(self):
        raise AssertionError("densified")

    monkeypatch.setattr(L.BlockOperator, "_to_dense", no_dense)
    x = torch.linalg.solve(B, torch.ones(5, dtype=DT))
    close(B @ x, torch.ones(5, dtype=DT))
    torch.linalg.slogdet(B)
    assert _op("block_general")._tri is None  # a full block matrix: the dense default


def test_zero_operator_semantics():
    Z = L.ZeroOperator(3, batch_shape=(2,), dtype=DT)
    assert Z.shape == (2, 3, 3)
    assert torch.equal(Z @ torch.ones(3, dtype=DT), torch.zeros(2, 3, dtype=DT))
    sign, logabs = torch.linalg.slogdet(Z)
    assert torch.equal(sign, torch.zeros(2, dtype=DT)) and (logabs == -math.inf).all()
    with pytest.raises(torch.linalg.LinAlgError, match="the zero operator is singular"):
        torch.linalg.solve(Z, torch.ones(3, dtype=DT))
    assert Z[1].shape == (3, 3) and Z.mT.shape == (2, 3, 3)
    ft = importlib.import_module("functransforms")
    # the product with a batched (vmapped) right-hand side is batched
    out = ft.vmap(lambda b: L.ZeroOperator(4, 3, dtype=DT) @ b)(torch.ones(5, 3, dtype=DT))
    assert out.shape == (5, 4)


def test_cat_and_repeat_and_sum_follow_torch():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(2, 3, 4, generator=g, dtype=DT)
    op = L.DenseOperator(A)
    close(torch.cat([op, op], -1).to_dense(), torch.cat([A, A], -1))
    close(L.cat([op, op], dim=-2).to_dense(), torch.cat([A, A], -2))
    for sizes in [(2, 1, 1), (1, 2, 3), (3, 2, 1, 1), (2, 2, 2)]:
        close(op.repeat(*sizes).to_dense(), A.repeat(*sizes))
    U = torch.randn(2, 3, 4, 1, generator=g, dtype=DT)
    lr = L.LowRankOperator(U)
    for dim in (0, 1, -3, -4):
        close(lr.sum(dim).to_dense(), (U @ U.mT).sum(dim))
    assert isinstance(lr.repeat(2, 1, 1, 1), L.LowRankOperator)
    close(lr.repeat(1, 2, 1, 1).to_dense(), (U @ U.mT).repeat(1, 2, 1, 1))
    with pytest.raises(ValueError, match=r"sum_batch\(.*dim=-1\): expected a batch dimension"):
        lr.sum(-1)
    with pytest.raises(ValueError, match="only the matrix dimensions"):
        L.cat([op, op], dim=0)


def test_hadamard_lowrank_matmul_never_densifies():
    g = torch.Generator().manual_seed(0)
    n = 2000
    K = L.KroneckerOperator(
        torch.randn(40, 40, generator=g, dtype=DT), torch.randn(50, 50, generator=g, dtype=DT)
    )
    U, V = torch.randn(n, 2, generator=g, dtype=DT), torch.randn(n, 2, generator=g, dtype=DT)
    H = K * L.LowRankOperator(U, V)
    assert isinstance(H, L.HadamardProductOperator)
    x = torch.randn(n, generator=g, dtype=DT)
    called = []
    orig = L.KroneckerOperator._to_dense
    L.KroneckerOperator._to_dense = lambda self: called.append(1) or orig(self)
    try:
        y = H @ x
    finally:
        L.KroneckerOperator._to_dense = orig
    assert not called
    close(y, (K.to_dense() * (U @ V.mT)) @ x)


# ------------------------------------------------------------------ accuracy at size
def test_tridiagonal_pcr_large_and_logdet_without_overflow():
    g = torch.Generator().manual_seed(0)
    n = 2000
    lo = 2 * torch.rand(n - 1, generator=g, dtype=DT) - 1
    up = 2 * torch.rand(n - 1, generator=g, dtype=DT) - 1
    d = torch.rand(n, generator=g, dtype=DT) + 3
    T = L.TridiagonalOperator(lo, d, up)
    assert T._diagonally_dominant()  # the PCR / cyclic-reduction path, not dense LU
    D = T.to_dense()
    b = torch.randn(n, 3, generator=g, dtype=DT)
    x = torch.linalg.solve(T, b)
    assert (x - torch.linalg.solve(D, b)).abs().max() < 1e-12
    sign, logabs = torch.linalg.slogdet(T)
    es, el = torch.linalg.slogdet(D)
    assert sign == es and abs(logabs - el) / abs(el) < 1e-13, (logabs, el)
    assert el > 1000  # det itself overflows float64: the scaled product must not
    # the 1-D Laplacian: det = n + 1
    lap = L.TridiagonalOperator(-torch.ones(n - 1, dtype=DT), 2 * torch.ones(n, dtype=DT))
    assert lap._diagonally_dominant()  # weakly and irreducibly
    close(torch.logdet(lap), torch.log(torch.tensor(n + 1.0, dtype=DT)), rtol=1e-12, atol=0)


def test_tridiagonal_not_dominant_uses_pivoting():
    # b_0 = 0: elimination without pivoting divides by zero; LU with pivoting does not
    T = L.TridiagonalOperator(
        torch.ones(3, dtype=DT),
        torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=DT),
        2 * torch.ones(3, dtype=DT),
    )
    b = torch.arange(1.0, 5.0, dtype=DT)
    close(torch.linalg.solve(T, b), torch.linalg.solve(T.to_dense(), b), rtol=1e-12, atol=1e-12)
    close(torch.linalg.slogdet(T)[1], torch.linalg.slogdet(T.to_dense())[1])


def test_circulant_fft_solve_at_size():
    g = torch.Generator().manual_seed(0)
    n = 1024
    c = torch.randn(n, generator=g, dtype=DT) / n**0.5
    c[0] += 3
    C = L.CirculantOperator(c)
    b = torch.randn(n, generator=g, dtype=DT)
    D = C.to_dense()
    assert (torch.linalg.solve(C, b) - torch.linalg.solve(D, b)).abs().max() < 1e-13
    assert abs(torch.linalg.slogdet(C)[1] - torch.linalg.slogdet(D)[1]) < 1e-10


def test_circulant_preconditioner_cuts_cg_iterations():
    n = 500
    t = 1.0 / (1.0 + torch.arange(n, dtype=DT)) ** 1.1  # ill-conditioned, SPD
    T = L.ToeplitzOperator(t, positive_definite=True)
    b = torch.randn(n, generator=torch.Generator().manual_seed(0), dtype=DT)
    _, plain = L.cg(T, b, tol=1e-10, maxiter=5000)
    P = L.circulant_preconditioner(T)
    x, pre = L.cg(T, b, tol=1e-10, preconditioner=P)
    assert pre.converged and pre.iterations < plain.iterations / 3, (pre, plain)
    close(x, torch.linalg.solve(T.to_dense(), b), rtol=1e-7, atol=1e-9)
    # the preconditioned solve keeps its implicit derivatives
    ft = importlib.import_module("functransforms")
    g = ft.grad(
        lambda t: L.solve(
            L.ToeplitzOperator(t, positive_definite=True),
            b,
            method="cg",
            tol=1e-12,
            preconditioner=P,
        ).sum()
    )(t)

    def dense(t):
        i = torch.arange(n)
        return torch.linalg.solve(t[(i[:, None] - i[None, :]).abs()], b).sum()

    close(g, torch.func.grad(dense)(t), rtol=1e-6, atol=1e-8)


def test_kronecker_sum_laplacian_solve_at_size():
    n = 64
    lap = (
        2 * torch.eye(n, dtype=DT)
        - torch.diag(torch.ones(n - 1, dtype=DT), 1)
        - torch.diag(torch.ones(n - 1, dtype=DT), -1)
    )
    K = L.KroneckerSumOperator(lap, lap, positive_definite=True)  # [4096, 4096]
    b = torch.randn(n * n, generator=torch.Generator().manual_seed(0), dtype=DT)
    x = torch.linalg.solve(K, b)
    assert (K @ x - b).abs().max() < 1e-10
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing dense
        torch.logdet(K)


@pytest.mark.parametrize(
    "name", ["batched_tridiagonal", "batched_circulant", "repeat_batch", "kronecker_sum_pd"]
)
def test_our_vmap_takes_the_operator_as_an_argument(name):
    """Operators are pytrees: our vmap maps over their batch dimension directly."""
    ft = importlib.import_module("functransforms")
    params, op = STRUCTURED_BY_NAME[name].make()
    if not op.batch_shape:
        op = op.repeat(3, 1, 1)
    b = torch.randn(op.shape[-1], dtype=DT)
    out = ft.vmap(lambda A, b: torch.linalg.solve(A, b), in_dims=(0, None))(op, b)
    close(out, torch.linalg.solve(op.to_dense(), b))
