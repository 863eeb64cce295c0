"""det at singular matrices. Its gradient is the adjugate (torch's SVD formula for tensor
subclasses), its jvp tr(adj(A) dA) from one LU with zero pivots replaced by eps, the Hessian
through both.

The oracle is the Leibniz polynomial of a 3 x 3 determinant, differentiated by torch.func:
division-free and smooth everywhere, so exact at every rank. torch's own jvp of det is not an
oracle at a singular matrix: it multiplies det(A) by tr(A^-1 dA) from an LU whose last pivot is
0 or a rounding residue depending on the LAPACK library and path, and gets 0 where the
derivative is -1 (MKL here), -1 elsewhere."""

import itertools

import pytest
import torch
import torch.func as tf

import functransforms as ft

det = torch.linalg.det


def _leibniz_det(A):
    """det of a 3 x 3 matrix as its polynomial (no pivoting, no division)."""
    total = 0
    for perm in itertools.permutations(range(3)):
        inversions = sum(perm[i] > perm[j] for i in range(3) for j in range(i + 1, 3))
        term = A[..., 0, perm[0]] * A[..., 1, perm[1]] * A[..., 2, perm[2]]
        total = total + (-term if inversions % 2 else term)
    return total


def _singular(rank, dtype, exact):
    """A 3 x 3 matrix of the given rank; ``exact``: small integers (LU ends on an exact zero
    pivot), else a product of random factors (LU ends on a rounding residue)."""
    if exact:
        A = {
            0: torch.zeros(3, 3),
            1: torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [3.0, 6.0, 9.0]]),
            2: torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.0, 1.0, 1.0]]),
        }[rank]
        return A.to(dtype)
    g = torch.Generator().manual_seed(rank)
    B = torch.randn(3, max(rank, 1), generator=g, dtype=torch.float64)
    C = torch.randn(max(rank, 1), 3, generator=g, dtype=torch.float64)
    return (B @ C * (rank > 0)).to(dtype)


def _tol(dtype):
    return {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-9, "atol": 1e-9}


_CASES = [
    pytest.param(rank, dtype, exact, id=f"rank_{rank}_of_3-{kind}-{str(dtype)[6:]}")
    for rank in (0, 1, 2)
    for dtype in (torch.float32, torch.float64)
    for exact, kind in ((True, "exact"), (False, "rounded"))
    if rank > 0 or exact
]


@pytest.mark.parametrize("rank, dtype, exact", _CASES)
def test_first_order_equals_the_adjugate(rank, dtype, exact):
    A = _singular(rank, dtype, exact)
    adj_t = tf.grad(_leibniz_det)(A.double())  # d det / dA_ij = cofactor_ij
    t = torch.randn(3, 3, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    tol = _tol(dtype)
    expected = (adj_t * t).sum()
    for M in (A, A.mT):  # row- and column-major: torch's det factors A or A^T
        cof = adj_t if M is A else adj_t.mT
        tt = t.to(dtype) if M is A else t.mT.to(dtype)
        torch.testing.assert_close(ft.jvp(det, (M,), (tt,))[1].double(), expected, **tol)
        torch.testing.assert_close(ft.jacfwd(det)(M).double(), cof, **tol)
        torch.testing.assert_close(ft.grad(det)(M).double(), cof, **tol)
        torch.testing.assert_close(ft.grad(det)(M), tf.grad(det)(M), **tol)
    # the all-ones tangent of the published report: -1 at the exact rank-2 matrix
    ones = torch.ones_like(A)
    torch.testing.assert_close(ft.jvp(det, (A,), (ones,))[1].double(), adj_t.sum(), **tol)


@pytest.mark.parametrize("rank, dtype, exact", [c for c in _CASES if c.values[0] == 2])
def test_hessian_equals_the_polynomial_hessian(rank, dtype, exact):
    """jacfwd over det's vjp (an SVD) is exact while at most one singular value is 0. Not at
    rank <= n-2 nor at repeated singular values (the identity): the SVD's derivative divides by
    s_i^2 - s_j^2 there and the Hessian is nan, as torch.func's."""
    A = _singular(rank, dtype, exact)
    expected = tf.hessian(_leibniz_det)(A.double())
    ours = ft.hessian(det)(A)
    torch.testing.assert_close(ours.double(), expected, **_tol(dtype))
    try:
        theirs = tf.hessian(det)(A)
    except torch.linalg.LinAlgError:  # torch 2.15's jvp of det solves with A itself
        return
    torch.testing.assert_close(ours, theirs, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_singular_and_regular(dtype):
    As = torch.stack(
        [
            _singular(2, dtype, True),
            _singular(2, dtype, False),
            _singular(1, dtype, True),
            _singular(0, dtype, True),
            torch.tensor([[2.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 4.0]], dtype=dtype),
        ]
    )
    ts = torch.randn(As.shape, generator=torch.Generator().manual_seed(3), dtype=dtype)
    adj_t = tf.vmap(tf.grad(_leibniz_det))(As.double())
    tol = _tol(dtype)
    torch.testing.assert_close(ft.vmap(ft.grad(det))(As).double(), adj_t, **tol)
    _, tangent = ft.vmap(lambda A, t: ft.jvp(det, (A,), (t,)))(As, ts)
    torch.testing.assert_close(tangent.double(), (adj_t * ts.double()).sum((-2, -1)), **tol)
    _, tangent = ft.jvp(det, (As,), (ts,))  # one batched LU, no vmap
    torch.testing.assert_close(tangent.double(), (adj_t * ts.double()).sum((-2, -1)), **tol)
    torch.testing.assert_close(ft.vmap(ft.jacfwd(det))(As).double(), adj_t, **tol)


def test_regular_matches_torch_func():
    A = torch.tensor([[2.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 4.0]], dtype=torch.float64)
    t = torch.ones_like(A)
    torch.testing.assert_close(ft.jvp(det, (A,), (t,)), tf.jvp(det, (A,), (t,)))
    torch.testing.assert_close(ft.hessian(det)(A), tf.hessian(det)(A))
    torch.testing.assert_close(ft.jacfwd(ft.jacfwd(det))(A), tf.hessian(_leibniz_det)(A))


def test_complex_grad_and_jvp_match_torch_func():
    A = torch.tensor([[1 + 1j, 2 - 1j], [2 + 2j, 1 + 5j]], dtype=torch.complex128)
    f = lambda A: torch.linalg.det(A).abs()  # noqa: E731
    torch.testing.assert_close(ft.grad(f)(A), tf.grad(f)(A))
    t = torch.tensor([[0.5 - 1j, 1j], [2.0, -1 + 0.5j]], dtype=torch.complex128)
    torch.testing.assert_close(ft.jvp(det, (A,), (t,)), tf.jvp(det, (A,), (t,)))
    S = torch.tensor([[1 + 1j, 2 + 2j], [1.0, 2.0]], dtype=torch.complex128)  # singular
    h = 1e-6
    fd = (det(S + h * t) - det(S - h * t)) / (2 * h)
    torch.testing.assert_close(ft.jvp(det, (S,), (t,))[1], fd)


def test_empty_matrix_and_empty_product():
    """det of a 0 x 0 matrix is an empty product (of the LU's pivots): its derivative rules,
    and prod's, weigh no element (prod's vjp narrowed a size-0 dim and raised)."""
    A = torch.zeros(2, 0, 0, dtype=torch.float64)
    f = lambda A: ft.jvp(det, (A,), (A,))[1]  # noqa: E731
    g = lambda A: tf.jvp(det, (A,), (A,))[1]  # noqa: E731
    ct = torch.ones(2, dtype=torch.float64)
    torch.testing.assert_close(ft.vjp(f, A)[1](ct), tf.vjp(g, A)[1](ct))
    x = torch.randn(3, 0, dtype=torch.float64)
    torch.testing.assert_close(
        ft.grad(lambda x: x.prod(-1).sum())(x), torch.zeros(3, 0, dtype=torch.float64)
    )
    expected = (torch.ones(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(ft.jvp(lambda x: x.prod(-1), (x,), (x,)), expected)
