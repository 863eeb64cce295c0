"""vmap rules of linear algebra and FFT ops (batching/linalg.py, batching/fft.py) against
torch.func.vmap (the oracle) and a stacked Python loop (functransforms.testing.check_vmap).

Operands whose batch dims broadcast (solvers) are checked for every mix of batched (in_dims 0,
1, -1) / unbatched operands and logical ranks 2, 3, 4. Every check runs with the per-example
fallback turned into an error, so a rule that is missing fails too.
"""

import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from functransforms.batching import _tensor

import functransforms as ft
from functransforms.errors import FallbackWarning
from functransforms.testing import check_vmap

B = 3
N = 4
DT = torch.float64
CDT = torch.complex128


# -- helpers ------------------------------------------------------------------------------------
def _leaves(x):
    return list(x) if isinstance(x, (tuple, list)) else [x]


def check(f, args, in_dims=0, out_dims=0, atol=1e-8, rtol=1e-6, oracle=True):
    """ft.vmap(f) == a stacked loop and == torch.func.vmap(f) (unless ``oracle=False``), with no
    per-example fallback."""
    saved = _tensor._WARNED
    _tensor._WARNED = set()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)
            ours = ft.vmap(f, in_dims, out_dims)(*args)
            check_vmap(f, tuple(args), in_dims, out_dims, atol=atol, rtol=rtol)
    finally:
        _tensor._WARNED = saved
    if not oracle:
        return
    ref = torch.func.vmap(f, in_dims, out_dims)(*args)
    for o, r in zip(_leaves(ours), _leaves(ref), strict=True):
        torch.testing.assert_close(o, r, atol=atol, rtol=rtol)


def stack(xs, d):
    """Per-example tensors stacked along ``d`` (None: the first one, unbatched)."""
    return xs[0] if d is None else torch.stack(xs, d)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def rand(shape, dtype=DT, g=None):
    return torch.randn(shape, dtype=dtype, generator=g)


def pd(shape, dtype=DT, g=None):
    """Well-conditioned Hermitian positive definite matrices ``shape + (N, N)``."""
    X = rand(shape + (N, N), dtype, g)
    return X @ X.mH / N + torch.eye(N, dtype=dtype)


def lower(shape, dtype=DT, g=None):
    return torch.linalg.cholesky(pd(shape, dtype, g))


def general(shape, dtype=DT, g=None):
    return rand(shape + (N, N), dtype, g) + 3 * torch.eye(N, dtype=dtype)


# logical batch shapes of the two operands of a broadcasting op, by logical rank - 2 (A's side
# has a 3, the other side size-1 dims, so that broadcasting happens inside the logical shape)
BATCH_X = {0: (), 1: (2,), 2: (3, 2)}
BATCH_Y = {0: (), 1: (2,), 2: (3, 1)}


def _mixes():
    """(batch rank of X, batch rank of Y, in_dim of X, in_dim of Y): for every pair of logical
    ranks, X batched only, Y batched only, and both, with the in_dims cycling through 0, 1, -1."""
    out = []
    for j, (kx, ky) in enumerate(itertools.product(range(3), repeat=2)):
        d1, d2 = (0, 1, -1)[j % 3], (0, 1, -1)[(j + 1) % 3]
        out += [(kx, ky, d1, None), (kx, ky, None, d2), (kx, ky, d2, d1)]
    return out


MIXES = _mixes()


def _pair(make_x, make_y, kx, ky, dx, dy, dtype, seed=0):
    g = gen(seed)
    xs = [make_x(BATCH_X[kx], dtype, g) for _ in range(B)]
    ys = [make_y(BATCH_Y[ky], dtype, g) for _ in range(B)]
    return stack(xs, dx), stack(ys, dy)


def _rhs(k):
    return lambda shape, dtype, g: rand(shape + (N, 2), dtype, g)


# -- broadcasting solvers (bug 1) ------------------------------------------------------------
SOLVERS = {
    # name: (make first operand, make second operand, f)
    "cholesky_solve": (_rhs(2), lower, lambda b, L: torch.cholesky_solve(b, L)),
    "cholesky_solve_upper": (
        _rhs(2),
        lambda s, d, g: lower(s, d, g).mH,
        lambda b, U: torch.cholesky_solve(b, U, upper=True),
    ),
    "solve_triangular": (
        lower,
        _rhs(2),
        lambda L, b: torch.linalg.solve_triangular(L, b, upper=False),
    ),
    "solve_triangular_right_unit": (
        lambda s, d, g: lower(s, d, g).mH,
        lambda s, d, g: rand(s + (3, N), d, g),  # 3 rows: never A.shape[:-1]
        lambda U, b: torch.linalg.solve_triangular(
            U, b, upper=True, left=False, unitriangular=True
        ),
    ),
    "triangular_solve": (
        _rhs(2),
        lower,
        lambda b, L: torch.triangular_solve(b, L, upper=False, transpose=True),
    ),
    "solve": (general, _rhs(2), torch.linalg.solve),
    "solve_right": (
        general,
        lambda s, d, g: rand(s + (3, N), d, g),  # 3 rows: never A.shape[:-1]
        lambda A, b: torch.linalg.solve(A, b, left=False),
    ),
    "solve_ex_all_outputs": (general, _rhs(2), lambda A, b: torch.linalg.solve_ex(A, b)),
    "lu_solve": (
        general,
        _rhs(2),
        lambda A, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(A), b),
    ),
    "lu_solve_adjoint_right": (
        general,
        lambda s, d, g: rand(s + (3, N), d, g),  # 3 rows: never A.shape[:-1]
        lambda A, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(A), b, adjoint=True, left=False),
    ),
}


# torch.func.vmap (2.13) itself is wrong or raises for these when the operands' logical ranks
# differ (solve: wrong values or shapes, e.g. A (4, 4) unbatched with B (3, 1, 4, 2) batched gives
# (3, 3, 3, 4, 2); solve_ex: info of shape (1,) instead of (); lu_solve: torch's own kernel is wrong
# when LU's batch dims broadcast against B's). There the stacked loop is the only reference.
ORACLE_NEEDS_EQUAL_RANKS = {
    "solve",
    "solve_right",
    "solve_ex_all_outputs",
    "lu_solve",
    "lu_solve_adjoint_right",
}


@pytest.mark.filterwarnings("ignore:torch.triangular_solve is deprecated")
@pytest.mark.parametrize("dtype", [DT, CDT], ids=["real", "complex"])
@pytest.mark.parametrize("name", list(SOLVERS))
def test_broadcasting_solvers(name, dtype):
    make_x, make_y, f = SOLVERS[name]
    for kx, ky, dx, dy in MIXES:
        x, y = _pair(make_x, make_y, kx, ky, dx, dy, dtype)
        oracle = kx == ky or name not in ORACLE_NEEDS_EQUAL_RANKS
        try:
            check(f, (x, y), in_dims=(dx, dy), oracle=oracle)
        except AssertionError as e:
            raise AssertionError(
                f"{name}: logical ranks ({kx + 2}, {ky + 2}), in_dims {(dx, dy)}"
            ) from e


def test_cholesky_solve_broadcast_reported_case():
    """The reported case: per example A (2, 4, 4) with B (4, 1), both batched and B unbatched."""
    g = gen(1)
    L = torch.linalg.cholesky(pd((B, 2), g=g))
    b = rand((B, N, 1), g=g)
    f = lambda b, L: torch.cholesky_solve(b, L)  # noqa: E731
    check(f, (b, L), in_dims=(0, 0))
    check(f, (b[0], L), in_dims=(None, 0))
    check(f, (b, L[0]), in_dims=(0, None))
    out = ft.vmap(f, in_dims=(0, None))(b, L[0])
    assert out.shape == (B, 2, N, 1)


# logical (A batch, b shape) for solve's vector right-hand sides: b is a (batch of) vector(s)
# when it is 1-d or its shape is A.shape[:-1] (torch's rule on the *logical* shapes)
VECTOR_CASES = [((), (N,)), ((2,), (N,)), ((2,), (2, N)), ((3, 2), (3, 2, N)), ((3, 2), (N,))]


@pytest.mark.parametrize("dtype", [DT, CDT], ids=["real", "complex"])
@pytest.mark.parametrize("a_batch,b_shape", VECTOR_CASES)
def test_solve_vector_rhs(a_batch, b_shape, dtype):
    g = gen(2)
    As = [general(a_batch, dtype, g) for _ in range(B)]
    bs = [rand(b_shape, dtype, g) for _ in range(B)]
    oracle = b_shape == a_batch + (N,)  # torch.func raises when a vector B broadcasts
    for da, db in [(0, 0), (None, 0), (0, None), (-1, -1), (1, None)]:
        check(torch.linalg.solve, (stack(As, da), stack(bs, db)), (da, db), oracle=oracle)


def test_solve_vector_rhs_with_left_false_raises_as_torch():
    """torch makes a vector B a column even for left=False, and reports the mismatch."""
    A, b = general((B,)), torch.randn(B, N, dtype=DT)
    with pytest.raises(RuntimeError, match="Incompatible shapes"):
        torch.linalg.solve(A[0], b[0], left=False)
    with pytest.raises(RuntimeError, match="Incompatible shapes"):
        ft.vmap(lambda A, b: torch.linalg.solve(A, b, left=False))(A, b)


def test_solve_unbatched_matrix_rhs_is_not_a_vector():
    """A batched (B, n, n) and an unbatched n x n B: physically B.shape == A.shape[:-1], yet
    per example B is a matrix."""
    g = gen(3)
    A = general((B,), g=g)
    b = rand((N, N), g=g)
    check(torch.linalg.solve, (A, b), in_dims=(0, None))


# -- Note [Fast path for linalg.solve] (batching/linalg.py) ------------------------------------
_rhs_right = SOLVERS["solve_right"][1]


def _without_solve_fast_path(monkeypatch):
    from functransforms.batching import _fastpath

    monkeypatch.delitem(_fastpath.SHAPED_FUNCS, torch.linalg.solve)


def _dispatched_ops(fn, args, in_dims, monkeypatch):
    calls = []
    process = _tensor.VmapInterpreter.process

    def counting(self, func, a, k):
        calls.append(func)
        return process(self, func, a, k)

    with monkeypatch.context() as m:
        m.setattr(_tensor.VmapInterpreter, "process", counting)
        out = ft.vmap(fn, in_dims=in_dims)(*args)
    return out, calls


@pytest.mark.parametrize("dtype", [DT, CDT], ids=["real", "complex"])
def test_solve_fast_path_matches_ordinary_path(dtype, monkeypatch):
    """Every vector case and every mix of batch ranks / in_dims, left=True and left=False: the
    fast path gives exactly the ordinary path's values and shapes (or steps aside)."""
    cases = []
    for a_batch, b_shape in VECTOR_CASES:
        for da, db in [(0, 0), (None, 0), (0, None), (-1, -1), (1, None)]:
            g = gen(5)
            A = stack([general(a_batch, dtype, g) for _ in range(B)], da)
            b = stack([rand(b_shape, dtype, g) for _ in range(B)], db)
            cases.append((torch.linalg.solve, (A, b), (da, db)))
    right = lambda A, b: torch.linalg.solve(A, b, left=False)  # noqa: E731
    for kx, ky, dx, dy in MIXES:
        for f, make_y in ((torch.linalg.solve, _rhs(2)), (right, _rhs_right)):
            x, y = _pair(general, make_y, kx, ky, dx, dy, dtype)
            cases.append((f, (x, y), (dx, dy)))
    fast = [ft.vmap(f, in_dims=d)(*a) for f, a, d in cases]
    with monkeypatch.context() as m:
        _without_solve_fast_path(m)
        slow = [ft.vmap(f, in_dims=d)(*a) for f, a, d in cases]
    for (_, a, d), o, r in zip(cases, fast, slow, strict=True):
        assert o.shape == r.shape and o.dtype == r.dtype, (a[0].shape, a[1].shape, d)
        torch.testing.assert_close(o, r, atol=1e-10, rtol=1e-10)


def test_solve_fast_path_is_one_batched_call(monkeypatch):
    """The benchmarked case (bench_core's row (i)) never reaches the dispatcher; a value of another
    level, or a keyword the fast path does not cover, takes the ordinary path."""
    A, b = general((B,)), torch.randn(B, N, dtype=DT)
    out, calls = _dispatched_ops(torch.linalg.solve, (A, b), 0, monkeypatch)
    assert calls == []
    torch.testing.assert_close(out, torch.linalg.solve(A, b))
    out, calls = _dispatched_ops(
        lambda A, b: torch.linalg.solve(A, b.unsqueeze(-1), left=True), (A, b), 0, monkeypatch
    )
    assert torch.ops.aten._linalg_solve_ex.default not in calls
    # an unbatched vector b broadcast against a batch of matrices
    out, calls = _dispatched_ops(torch.linalg.solve, (A, b[0]), (0, None), monkeypatch)
    assert calls == []
    # values of two levels: the inner level's wrapper is not this level's
    out, calls = _dispatched_ops(
        lambda b: ft.vmap(torch.linalg.solve, in_dims=(0, None))(A, b), (b,), 0, monkeypatch
    )
    assert torch.ops.aten._linalg_solve_ex.default in calls
    torch.testing.assert_close(out, torch.stack([torch.linalg.solve(A, bi) for bi in b]))


_SOLVE_COMPOSITIONS = {
    "grad(vmap)": lambda m, A, b: m.grad(
        lambda A, b: m.vmap(torch.linalg.solve)(A, b).abs().sum(), argnums=(0, 1)
    )(A, b),
    "jvp(vmap)": lambda m, A, b: m.jvp(
        m.vmap(torch.linalg.solve), (A, b), (torch.ones_like(A), torch.ones_like(b))
    ),
    "vmap(vmap)": lambda m, A, b: m.vmap(
        m.vmap(torch.linalg.solve, in_dims=(0, None)), in_dims=(None, 0)
    )(A, b),
    "vmap(grad)": lambda m, A, b: m.vmap(m.grad(lambda A, b: torch.linalg.solve(A, b).abs().sum()))(
        A, b
    ),
    "jacrev(vmap)": lambda m, A, b: m.jacrev(m.vmap(torch.linalg.solve), argnums=1)(A, b),
}


@pytest.mark.parametrize("dtype", [DT, CDT], ids=["real", "complex"])
@pytest.mark.parametrize("name", list(_SOLVE_COMPOSITIONS))
def test_solve_fast_path_under_other_transforms(name, dtype):
    """The fast path's physical call runs on the inner levels' wrappers (grad, jvp, an inner
    vmap) when vmap is the outer transform, and under torch's autograd at top level."""
    if name == "jacrev(vmap)" and dtype == CDT:
        pytest.skip("jacrev of a complex output")
    A, b = general((B,), dtype, gen(6)), rand((B, N), dtype, gen(7))
    f = _SOLVE_COMPOSITIONS[name]
    torch.testing.assert_close(f(ft, A, b), f(torch.func, A, b))
    A1, b1 = A.clone().requires_grad_(), b.clone().requires_grad_()
    ft.vmap(torch.linalg.solve)(A1, b1).abs().sum().backward()
    A2, b2 = A.clone().requires_grad_(), b.clone().requires_grad_()
    torch.linalg.solve(A2, b2).abs().sum().backward()
    torch.testing.assert_close((A1.grad, b1.grad), (A2.grad, b2.grad))


_MATRIX_FAST = {
    "inv": (general, torch.linalg.inv),
    "cholesky": (pd, torch.linalg.cholesky),
    "cholesky_upper": (pd, lambda A: torch.linalg.cholesky(A, upper=True)),
    "det": (general, torch.linalg.det),
    "slogdet": (general, torch.linalg.slogdet),
    "eigh": (pd, lambda A: _eigh(A)[:2]),
    "eigh_U": (pd, lambda A: torch.linalg.eigh(A, "U")[0]),
    "matrix_exp": (general, torch.linalg.matrix_exp),
}


_MATRIX_FAST_FUNCS = (
    torch.linalg.inv,
    torch.linalg.cholesky,
    torch.linalg.det,
    torch.linalg.slogdet,
    torch.linalg.eigh,
    torch.linalg.matrix_exp,
)


@pytest.mark.parametrize("dtype", [DT, CDT], ids=["real", "complex"])
@pytest.mark.parametrize("name", list(_MATRIX_FAST))
def test_matrix_fast_path_matches_ordinary_path(name, dtype, monkeypatch):
    """One-matrix functions (inv, cholesky, det, slogdet, eigh, matrix_exp) take one
    batched call on the physical value: the same values as the ordinary path, for every in_dim
    and logical batch rank, and no trip through the dispatcher."""
    from functransforms.batching import _fastpath

    make, f = _MATRIX_FAST[name]
    cases = []
    for batch, d in [((), 0), ((), 1), ((2,), -1), ((2,), 1)]:
        cases.append((stack([make(batch, dtype, gen(8)) for _ in range(B)], d), d))
    fast = [ft.vmap(f, in_dims=d)(x) for x, d in cases]
    with monkeypatch.context() as m:
        for fn in _MATRIX_FAST_FUNCS:
            m.delitem(_fastpath.SHAPED_FUNCS, fn)
        slow = [ft.vmap(f, in_dims=d)(x) for x, d in cases]
    for (x, d), o, r in zip(cases, fast, slow, strict=True):
        torch.testing.assert_close(o, r, atol=0, rtol=0)
        torch.testing.assert_close(o, torch.func.vmap(f, in_dims=d)(x))
    x = cases[0][0]
    _, calls = _dispatched_ops(f, (x,), 0, monkeypatch)
    assert not [c for c in calls if "linalg" in str(c)], calls


def test_matrix_fast_path_under_other_transforms():
    """The physical call runs on inner levels' wrappers (grad, jvp, an inner vmap)."""
    A = general((B,), g=gen(9))
    t = torch.ones_like(A)
    checks = [
        lambda m: m.grad(lambda A: m.vmap(torch.linalg.inv)(A).sum())(A),
        lambda m: m.jvp(m.vmap(torch.linalg.slogdet), (A,), (t,)),
        lambda m: m.jvp(m.vmap(torch.linalg.matrix_exp), (A,), (t,)),
        lambda m: m.vmap(m.vmap(torch.linalg.det))(A.unsqueeze(0).expand(2, B, N, N)),
        lambda m: m.vmap(m.grad(lambda A: torch.linalg.det(A)))(A),
    ]
    for c in checks:
        torch.testing.assert_close(c(ft), c(torch.func))


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "ordinary"])
def test_matrix_fast_path_errors_as_torch(fast, monkeypatch):
    """A singular / non positive-definite example raises torch's error with its batch index."""
    from functransforms.batching import _fastpath

    if not fast:
        monkeypatch.delitem(_fastpath.SHAPED_FUNCS, torch.linalg.inv)
        monkeypatch.delitem(_fastpath.SHAPED_FUNCS, torch.linalg.cholesky)
    A = general((B,))
    A[2] = 0
    with pytest.raises(torch.linalg.LinAlgError, match=r"\(Batch element 2\): The diagonal"):
        ft.vmap(torch.linalg.inv)(A)
    with pytest.raises(torch.linalg.LinAlgError, match=r"\(Batch element 2\): The factorization"):
        ft.vmap(torch.linalg.cholesky)(torch.cat([pd((2,)), -pd((1,))]))
    with pytest.raises(RuntimeError) as ours:
        ft.vmap(torch.linalg.inv)(torch.randn(B, 3, 4))
    with pytest.raises(RuntimeError) as ref:
        torch.linalg.inv(torch.randn(3, 4))
    assert str(ours.value) == str(ref.value)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "ordinary"])
def test_solve_errors_as_torch(fast, monkeypatch):
    """A singular example raises torch's error (with its index in the batch); shape and dtype
    errors name the logical shapes, whichever path runs."""
    if not fast:
        _without_solve_fast_path(monkeypatch)
    A, b = general((B,)), torch.randn(B, N, dtype=DT)
    A[1] = 0
    msg = "(Batch element 1): The solver failed because the input matrix is singular"
    with pytest.raises(torch.linalg.LinAlgError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        ft.vmap(torch.linalg.solve)(A, b)
    A = torch.randn(B, N, N + 1, dtype=DT)
    with pytest.raises(RuntimeError) as ours:
        ft.vmap(torch.linalg.solve)(A, b)
    with pytest.raises(RuntimeError) as ref:
        torch.linalg.solve(A[0], b[0])
    assert str(ours.value) == str(ref.value)
    with pytest.raises(RuntimeError) as ours:
        ft.vmap(torch.linalg.solve)(general((B,)), b.float())
    with pytest.raises(RuntimeError) as ref:
        torch.linalg.solve(general(()), b[0].float())
    assert str(ours.value) == str(ref.value)


@pytest.mark.parametrize("dtype", [DT, CDT], ids=["real", "complex"])
def test_householder_product(dtype):
    g = gen(4)
    As = [rand((2, N, 3), dtype, g) for _ in range(B)]
    taus = [rand((2, 2), dtype, g) for _ in range(B)]
    for da, dt in [(0, 0), (None, 1), (-1, None), (1, -1)]:
        check(torch.linalg.householder_product, (stack(As, da), stack(taus, dt)), (da, dt))


# -- one-matrix ops ---------------------------------------------------------------------------
def _eigh(A):
    w, V = torch.linalg.eigh(A)
    return w, V.abs(), (V * w.unsqueeze(-2)) @ V.mH  # eigenvector phases are arbitrary


def _svd(A):
    U, S, Vh = torch.linalg.svd(A, full_matrices=False)
    return U.abs(), S, Vh.abs(), (U * S.unsqueeze(-2)) @ Vh


def _eig(A):
    w = torch.linalg.eigvals(A)
    return w.sum(-1), (w * w).sum(-1), w.prod(-1)  # the order of eigenvalues is arbitrary


MATRIX_OPS = {
    "cholesky": (pd, torch.linalg.cholesky),
    "cholesky_upper": (pd, lambda A: torch.linalg.cholesky(A, upper=True)),
    "cholesky_ex": (pd, torch.linalg.cholesky_ex),
    "eigh": (pd, _eigh),
    "eigh_upper": (pd, lambda A: _eigh(A.triu())[0]),
    "eigvalsh": (pd, torch.linalg.eigvalsh),
    "slogdet": (general, torch.linalg.slogdet),
    "logdet": (pd, torch.logdet),
    "det": (general, torch.linalg.det),
    "inv": (general, torch.linalg.inv),
    "inv_ex": (general, torch.linalg.inv_ex),
    "svd": (general, _svd),
    "svdvals": (general, torch.linalg.svdvals),
    "qr": (general, lambda A: torch.linalg.qr(A)),
    "qr_r": (general, lambda A: torch.linalg.qr(A, mode="r")[1]),
    "lu_factor": (general, torch.linalg.lu_factor),
    "lu_factor_ex": (general, torch.linalg.lu_factor_ex),
    "lu": (general, torch.linalg.lu),
    "matrix_exp": (lambda s, d, g: rand(s + (N, N), d, g) / 2, torch.linalg.matrix_exp),
    "eig": (general, _eig),
    "diagonal": (general, lambda A: A.diagonal(1, -1, -2)),
    "trace": (lambda s, d, g: rand((N, 3), d, g), torch.trace),
    "matrix_norm": (general, torch.linalg.matrix_norm),
    "matrix_norm_nuc": (general, lambda A: torch.linalg.matrix_norm(A, "nuc")),
    "vector_norm": (general, torch.linalg.vector_norm),
    "vector_norm_dims": (general, lambda A: torch.linalg.vector_norm(A, 3, dim=(0, -1))),
    "vector_norm_inf_keepdim": (
        general,
        lambda A: torch.linalg.vector_norm(A, float("inf"), dim=-2, keepdim=True),
    ),
    "diag_embed": (lambda s, d, g: rand(s + (N,), d, g), lambda v: torch.diag_embed(v, 1, 0, -1)),
}


@pytest.mark.parametrize("dtype", [DT, CDT], ids=["real", "complex"])
@pytest.mark.parametrize("name", list(MATRIX_OPS))
def test_matrix_ops(name, dtype):
    make, f = MATRIX_OPS[name]
    g = gen(5)
    xs = [make((2,), dtype, g) for _ in range(B)]
    for d, od in [(0, 0), (1, -1), (-1, 0)]:
        check(f, (stack(xs, d),), in_dims=d, out_dims=od)


# -- products whose operands broadcast -------------------------------------------------------
PRODUCTS = {
    "kron": (lambda s, d, g: rand((2, 3), d, g), lambda s, d, g: rand((3, 2), d, g), torch.kron),
    "cross": (
        lambda s, d, g: rand(s + (3,), d, g),
        lambda s, d, g: rand(s + (3,), d, g),
        torch.linalg.cross,
    ),
    "cross_dim0": (
        lambda s, d, g: rand((3,) + s, d, g),
        lambda s, d, g: rand((3,) + s, d, g),
        lambda a, b: torch.linalg.cross(a, b, dim=0),
    ),
    "matmul": (general, _rhs(2), torch.matmul),
    "vdot": (lambda s, d, g: rand((N,), d, g), lambda s, d, g: rand((N,), d, g), torch.vdot),
    "vecdot_1d": (
        lambda s, d, g: rand((N,), d, g),
        lambda s, d, g: rand((N,), d, g),
        torch.linalg.vecdot,
    ),
}


@pytest.mark.parametrize("dtype", [DT, CDT], ids=["real", "complex"])
@pytest.mark.parametrize("name", list(PRODUCTS))
def test_products(name, dtype):
    make_x, make_y, f = PRODUCTS[name]
    for kx, ky, dx, dy in MIXES:
        if name == "cross" and kx != ky:
            continue  # linalg.cross wants equal ranks (sizes broadcast)
        if name == "cross_dim0" and (kx, ky) != (0, 0):
            continue  # dim=0 names a different dim once batch dims are prepended
        x, y = _pair(make_x, make_y, kx, ky, dx, dy, dtype)
        check(f, (x, y), in_dims=(dx, dy))


# -- FFT ------------------------------------------------------------------------------------
FFTS = {
    # name: (complex input?, per-example shape, f)
    "fft": (True, (6,), torch.fft.fft),
    "fft_real_input": (False, (6,), torch.fft.fft),
    "fft_n_pad": (True, (6,), lambda x: torch.fft.fft(x, n=9)),
    "fft_n_trim_dim0": (True, (6, 2), lambda x: torch.fft.fft(x, n=4, dim=0)),
    "ifft_ortho": (True, (2, 6), lambda x: torch.fft.ifft(x, norm="ortho")),
    "fft2_forward": (True, (4, 6), lambda x: torch.fft.fft2(x, norm="forward")),
    "fftn_s": (True, (4, 5), lambda x: torch.fft.fftn(x, s=(6, 3))),
    "ifftn_dims": (True, (2, 4, 5), lambda x: torch.fft.ifftn(x, dim=(0, -1))),
    "rfft": (False, (6,), torch.fft.rfft),
    "rfft_n_pad": (False, (6,), lambda x: torch.fft.rfft(x, n=8)),
    "rfft_n_trim": (False, (2, 6), lambda x: torch.fft.rfft(x, n=5, norm="forward")),
    "rfft_dim0": (False, (6, 3), lambda x: torch.fft.rfft(x, dim=0, norm="ortho")),
    "rfft2": (False, (4, 6), torch.fft.rfft2),
    "rfftn_s": (False, (2, 4, 5), lambda x: torch.fft.rfftn(x, s=(6, 7))),
    "irfft": (True, (4,), torch.fft.irfft),
    "irfft_n_odd": (True, (2, 4), lambda x: torch.fft.irfft(x, n=7)),
    "irfft_dim0_ortho": (True, (4, 3), lambda x: torch.fft.irfft(x, dim=0, norm="ortho")),
    "irfft2": (True, (4, 3), torch.fft.irfft2),
    "irfftn_s": (True, (2, 4, 3), lambda x: torch.fft.irfftn(x, s=(5, 6), dim=(0, 2))),
    "hfft": (True, (4,), lambda x: torch.fft.hfft(x, n=6)),
    "ihfft": (False, (6,), torch.fft.ihfft),
    "fftshift": (False, (4, 5), torch.fft.fftshift),
    "roundtrip": (False, (6,), lambda x: torch.fft.irfft(torch.fft.rfft(x, n=12), n=12)[..., :6]),
}


@pytest.mark.parametrize("name", list(FFTS))
def test_fft(name):
    is_complex, shape, f = FFTS[name]
    g = gen(6)
    xs = [rand(shape, CDT if is_complex else DT, g) for _ in range(B)]
    for d, od in [(0, 0), (1, -1), (-1, 1)]:
        check(f, (stack(xs, d),), in_dims=d, out_dims=od)


def test_fft_convolution_like_toeplitz():
    """The Toeplitz matmul of functransforms.linalg: a circulant embedding multiplied through
    rfft/irfft with n= padding, the vector batched and the matrix unbatched (and vice versa)."""
    g = gen(7)
    vs = [rand((2 * N,), g=g) for _ in range(B)]
    Xs = [rand((3, N), g=g) for _ in range(B)]

    def f(v, Xt):
        n2 = 2 * N
        y = torch.fft.irfft(torch.fft.rfft(v, n=n2).unsqueeze(-2) * torch.fft.rfft(Xt, n=n2), n=n2)
        return y[..., :N].mT

    for dv, dX in [(0, 0), (None, 0), (0, None), (-1, 1)]:
        check(f, (stack(vs, dv), stack(Xs, dX)), in_dims=(dv, dX))


@pytest.mark.parametrize(
    "pad", [(0, 2), (1, 0, 2, 1), (-1, 2), (0, 0, 0, 0, 1, 1)], ids=["1d", "2d", "neg", "3d"]
)
def test_constant_pad_nd(pad):
    g = gen(8)
    xs = [rand((2, 3, 4), g=g) for _ in range(B)]
    f = lambda x: F.pad(x, pad, value=0.5)  # noqa: E731
    for d in (0, 1, -1):
        check(f, (stack(xs, d),), in_dims=d)


def test_constant_pad_nd_longer_than_the_logical_rank_raises():
    x = torch.randn(B, 4)
    with pytest.raises(RuntimeError, match="Pad length is 4 while the input has 1 dimensions"):
        ft.vmap(lambda v: torch.constant_pad_nd(v, (1, 1, 1, 1)))(x)


# -- polar / complex (bug 3) -------------------------------------------------------------------
@pytest.mark.parametrize("op", [torch.polar, torch.complex], ids=["polar", "complex"])
def test_polar_and_complex(op):
    g = gen(9)
    a = [torch.rand((2, 3), dtype=DT, generator=g) for _ in range(B)]
    t = [rand((3,), g=g) for _ in range(B)]
    for da, dt in [(0, 0), (None, 0), (0, None), (1, -1), (-1, None)]:
        check(op, (stack(a, da), stack(t, dt)), in_dims=(da, dt))


# -- the per-example fallback ---------------------------------------------------------------
def test_fallback_write_into_unbatched_buffer_raises():
    """prims.copy_to writes its first argument (no trailing `_`): writing a batched value into
    a fresh unbatched buffer must raise, not leave every example equal to the last."""
    x = torch.arange(12.0).reshape(3, 4)
    with pytest.raises(ft.errors.InplaceError, match="prims.copy_to"):
        ft.vmap(lambda v: torch.ops.prims.copy_to(torch.zeros(4), v))(x)
    out = torch.zeros(3, 4)
    ft.vmap(torch.ops.prims.copy_to)(out, x)  # into a batched target: each example's slice
    torch.testing.assert_close(out, x)


def test_fallback_pinv_complex():
    """Kernels run by the fallback make lazy conj views (pinv's V.mH * S): Note [Conjugate
    views]."""
    A = rand((B, N, N), CDT, gen(10))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ft.errors.FallbackWarning)
        out = ft.vmap(torch.linalg.pinv)(A)
    torch.testing.assert_close(out, torch.stack([torch.linalg.pinv(a) for a in A]))


@pytest.mark.parametrize(
    "f",
    [
        lambda x: x.conj().sum(-1),
        lambda x: x.mH.sum(-1),
        lambda x: torch.linalg.vecdot(x, x + 1),  # 2-d: conj + mul + sum
    ],
    ids=["conj_sum", "mH_sum", "vecdot_2d"],
)
def test_lazy_conj_reductions(f):
    """Lazy conj views reaching reductions are resolved, not silently read unconjugated."""
    check(f, (rand((B, N, N), CDT, gen(11)),))


@pytest.mark.parametrize("name", ["matrix_sqrth", "polar"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_matrix_sqrth_and_polar_batch_like_the_kernel(name, dtype):
    """New in torch 2.15; complex inputs go through eigh / svd (Note [matrix_sqrth and polar
    inside __torch_dispatch__], batching/linalg.py): vmap equals torch's batched call."""
    fn = getattr(torch.linalg, name, None)
    if fn is None:
        pytest.skip(f"torch.linalg.{name} is new in torch 2.15")
    g = torch.Generator().manual_seed(0)
    X = torch.randn(3, 4, 4, dtype=dtype, generator=g)
    A = X @ X.mH + torch.eye(4, dtype=dtype)  # Hermitian positive definite
    ref = fn(A)
    torch.testing.assert_close(ft.vmap(fn)(A), ref)
    torch.testing.assert_close(ft.vmap(fn, in_dims=1)(A.movedim(0, 1)), ref)
