"""Derivative rules of QR, Householder products, ormqr, pinv and lstsq (autodiff/linalg_qr.py)
against torch.func (vjp, jvp, vmap of grad, second order), finite differences
(functransforms.testing.check_grads), torch's errors for the non-differentiable QR modes, the
batching rules of lstsq and pinv (no per-example loop), and svd_lowrank / pca_lowrank."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.func as tf

import functransforms as ft
from functransforms.errors import FallbackWarning
from functransforms.testing import check_grads

F64, C128 = torch.float64, torch.complex128
DTYPES = [pytest.param(F64, id="f64"), pytest.param(C128, id="c128")]


def _randn(*shape, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        return torch.complex(
            torch.randn(shape, generator=g, dtype=F64), torch.randn(shape, generator=g, dtype=F64)
        )
    return torch.randn(shape, generator=g, dtype=dtype)


def _close(a, b, atol=1e-8, rtol=1e-6):
    for x, y in zip(torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)):
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol)


def _vjp_both(f, args, seed=7):
    """vjp of f at args with the same random cotangents, ours and torch.func's."""
    out, ours = ft.vjp(f, *args)
    out_ref, theirs = tf.vjp(f, *args)
    _close(out, out_ref)
    cts = torch.utils._pytree.tree_map(
        lambda o: (
            _randn(*o.shape, dtype=o.dtype, seed=seed)
            if o.is_floating_point() or o.is_complex()
            else None
        ),
        out,
    )
    return ours(cts), theirs(cts)


def _jvp_both(f, args, seed=11):
    tangents = tuple(_randn(*a.shape, dtype=a.dtype, seed=seed + i) for i, a in enumerate(args))
    return ft.jvp(f, args, tangents), tf.jvp(f, args, tangents)


# -- QR ----------------------------------------------------------------------------------------
QR_CASES = [
    ((5, 3), "reduced"),
    ((4, 4), "reduced"),
    ((4, 4), "complete"),
    ((3, 5), "reduced"),
    ((3, 5), "complete"),
    ((2, 4, 3), "reduced"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,mode", QR_CASES)
def test_qr_vjp_jvp_match_torch(shape, mode, dtype):
    A = _randn(*shape, dtype=dtype)
    f = lambda a: torch.linalg.qr(a, mode=mode)  # noqa: E731
    ours, ref = _vjp_both(f, (A,))
    _close(ours, ref)
    ours, ref = _jvp_both(f, (A,))
    _close(ours, ref)


@pytest.mark.parametrize("shape", [(5, 3), (3, 5), (4, 4)])
def test_qr_finite_differences(shape):
    A = _randn(*shape, seed=1)
    check_grads(lambda a: torch.linalg.qr(a), (A,), order=1)


@pytest.mark.parametrize(
    "shape,mode,message",
    [((5, 3), "r", "mode='r'"), ((5, 3), "complete", "mode='complete' and nrows > ncols")],
)
def test_qr_non_differentiable_modes_raise_as_torch(shape, mode, message):
    A = _randn(*shape)
    f = lambda a: torch.linalg.qr(a, mode=mode)[1].sum()  # noqa: E731
    with pytest.raises(RuntimeError, match=message):
        tf.grad(f)(A)
    with pytest.raises(RuntimeError, match=message):
        ft.grad(f)(A)
    with pytest.raises(RuntimeError, match=message):
        ft.jvp(f, (A,), (A,))
    # the forward values alone are fine
    _close(
        ft.vmap(lambda a: torch.linalg.qr(a, mode=mode)[1])(A[None]),
        torch.linalg.qr(A[None], mode=mode)[1],
    )


def _qr_loss(a, b):
    Q, R = torch.linalg.qr(a)
    return (Q.mT @ b).square().sum() + R.diagonal(0, -2, -1).abs().log().sum()


def test_qr_hessian_matches_torch():
    A, b = _randn(5, 3, seed=2), _randn(5, seed=3)
    _close(ft.hessian(_qr_loss)(A, b), tf.hessian(_qr_loss)(A, b), atol=1e-7)


def test_qr_vmap_grad_and_jvp_of_grad_match_torch():
    A, b = _randn(6, 5, 3, seed=4), _randn(6, 5, seed=5)
    _close(ft.vmap(ft.grad(_qr_loss))(A, b), tf.vmap(tf.grad(_qr_loss))(A, b))
    V = _randn(5, 3, seed=6)
    ours = ft.jvp(ft.grad(_qr_loss), (A[0], b[0]), (V, torch.zeros_like(b[0])))[1]
    ref = tf.jvp(tf.grad(_qr_loss), (A[0], b[0]), (V, torch.zeros_like(b[0])))[1]
    _close(ours, ref, atol=1e-7)


def test_qr_vmap_grad_unbatched_operand():
    """One operand batched, the other not: the rule's physical path expands the unbatched one."""
    A, b = _randn(5, 3, seed=4), _randn(6, 5, seed=5)
    ours = ft.vmap(ft.grad(_qr_loss), in_dims=(None, 0))(A, b)
    _close(ours, tf.vmap(tf.grad(_qr_loss), in_dims=(None, 0))(A, b))


# -- Householder products and ormqr ------------------------------------------------------------
def _geqrf(shape, dtype, seed=0):
    return torch.geqrf(_randn(*shape, dtype=dtype, seed=seed))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 3), (4, 4), (2, 5, 2)])
def test_householder_product_matches_torch(shape, dtype):
    A, tau = _geqrf(shape, dtype)
    ours, ref = _vjp_both(torch.linalg.householder_product, (A, tau))
    _close(ours, ref)
    ours, ref = _jvp_both(torch.linalg.householder_product, (A, tau))
    _close(ours, ref)


def test_householder_product_fewer_reflectors_and_fd():
    A, tau = _geqrf((5, 3), F64)
    tau = tau[:2]  # k < n: the last column of A is not read
    ours, ref = _vjp_both(torch.linalg.householder_product, (A, tau))
    _close(ours, ref)
    assert ours[0][:, 2].abs().max() == 0
    check_grads(torch.linalg.householder_product, (A, tau), order=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("transpose", [True, False])
def test_ormqr_vjp_matches_torch_and_jvp_matches_fd(left, transpose, dtype):
    A, tau = _geqrf((5, 3), dtype)
    C = _randn(5, 2, dtype=dtype, seed=3) if left else _randn(2, 5, dtype=dtype, seed=3)
    f = lambda a, t, c: torch.ormqr(a, t, c, left=left, transpose=transpose)  # noqa: E731
    ours, ref = _vjp_both(f, (A, tau, C))
    _close(ours, ref)
    # torch has no forward-mode formula for ormqr; ours is checked against finite differences
    check_grads(f, (A, tau, C), order=1, modes=("fwd", "rev"))


# -- pseudo-inverse ----------------------------------------------------------------------------
PINV_CASES = {
    "tall": lambda dtype: (_randn(5, 3, dtype=dtype), {}),
    "wide": lambda dtype: (_randn(3, 5, dtype=dtype), {}),
    "batched": lambda dtype: (_randn(2, 4, 3, dtype=dtype), {}),
    "atol": lambda dtype: (_randn(4, 3, dtype=dtype), {"atol": 1e-3}),
    "singular": lambda dtype: (_randn(4, 2, dtype=dtype) @ _randn(2, 3, dtype=dtype, seed=1), {}),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(PINV_CASES))
def test_pinv_matches_torch(case, dtype):
    A, kw = PINV_CASES[case](dtype)
    f = lambda a: torch.linalg.pinv(a, **kw)  # noqa: E731
    ours, ref = _vjp_both(f, (A,))
    _close(ours, ref, atol=1e-7)
    ours, ref = _jvp_both(f, (A,))
    _close(ours, ref, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pinv_hermitian_and_pinverse(dtype):
    X = _randn(4, 4, dtype=dtype)
    f = lambda x: torch.linalg.pinv(x @ x.mH, hermitian=True)  # noqa: E731
    _close(*_vjp_both(f, (X,)), atol=1e-7)
    _close(*_jvp_both(f, (X,)), atol=1e-7)
    _close(*_vjp_both(torch.pinverse, (X[:, :3],)), atol=1e-7)


def test_pinv_finite_differences_second_order():
    check_grads(torch.linalg.pinv, (_randn(4, 3, seed=2),), order=2)


# -- least squares -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("driver", [None, "gelsd"])
@pytest.mark.parametrize("rhs", [(5, 2), (5,)])
def test_lstsq_matches_torch(rhs, driver, dtype):
    """solution and (with gelsd, which computes them) residuals carry derivatives."""
    A, B = _randn(5, 3, dtype=dtype), _randn(*rhs, dtype=dtype, seed=1)
    f = lambda a, b: torch.linalg.lstsq(a, b, driver=driver)[:2]  # noqa: E731
    ours, ref = _vjp_both(f, (A, B))
    _close(ours, ref, atol=1e-7)
    ours, ref = _jvp_both(f, (A, B))
    _close(ours, ref, atol=1e-7)


def test_lstsq_residuals_finite_differences():
    A, B = _randn(6, 3), _randn(6, 2, seed=1)
    check_grads(lambda a, b: torch.linalg.lstsq(a, b, driver="gelsd").residuals, (A, B), order=1)


def _lstsq_loss(a, b):
    return torch.linalg.lstsq(a, b).solution.square().sum()


def test_lstsq_hessian_matches_torch():
    A, B = _randn(5, 3, seed=2), _randn(5, 2, seed=3)
    _close(ft.hessian(_lstsq_loss)(A, B), tf.hessian(_lstsq_loss)(A, B), atol=1e-7)


def test_lstsq_vmap_grad_matches_torch():
    A, B = _randn(4, 5, 3, seed=2), _randn(4, 5, 2, seed=3)
    _close(ft.vmap(ft.grad(_lstsq_loss, (0, 1)))(A, B), tf.vmap(tf.grad(_lstsq_loss, (0, 1)))(A, B))


# -- batching rules: no per-example loop -------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("driver", [None, "gels", "gelsd"])
@pytest.mark.parametrize(
    "in_dims,rhs", [((0, 0), (5, 2)), ((None, 0), (5, 2)), ((0, None), (5, 2)), ((0, None), (5,))]
)
def test_lstsq_vmap_without_fallback(in_dims, rhs, driver, dtype):
    A, B = _randn(3, 5, 3, dtype=dtype), _randn(3, *rhs, dtype=dtype, seed=1)
    args = tuple(x if d is not None else x[0] for x, d in zip((A, B), in_dims))
    f = lambda a, b: torch.linalg.lstsq(a, b, driver=driver)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        ours = ft.vmap(f, in_dims=in_dims)(*args)
    ref = tf.vmap(f, in_dims=in_dims)(*args)
    for o, r in zip(ours, ref):
        assert o.shape == r.shape
        _close(o, r)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kw",
    [{}, {"atol": 0.1}, {"rtol": "vector"}, {"hermitian": True}],
    ids=["default", "atol", "rtol-vector", "herm"],
)
def test_pinv_vmap_without_fallback(kw, dtype):
    A = _randn(3, 4, 4, dtype=dtype)
    if kw.get("rtol") == "vector":  # the tolerance's shape broadcasts into the batch shape
        kw = {"rtol": torch.tensor([0.1, 0.2], dtype=F64)}
    f = lambda a: torch.linalg.pinv(a @ a.mH if kw.get("hermitian") else a, **kw)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        ours = ft.vmap(f)(A)
    ref = tf.vmap(f)(A)
    assert ours.shape == ref.shape
    _close(ours, ref, atol=1e-8)


# -- randomized low-rank decompositions --------------------------------------------------------
def _svd_lowrank_loss(a):
    U, S, V = torch.svd_lowrank(a, q=4, niter=2)
    return S.sum() + ((U * S.unsqueeze(-2)) @ V.mT).square().sum()


def _pca_lowrank_loss(a):
    U, S, V = torch.pca_lowrank(a, q=3, center=True, niter=2)
    return S.square().sum() + (U.abs() @ V.abs().mT).sum()  # |U|, |V|: sign-invariant


@pytest.mark.parametrize("loss", [_svd_lowrank_loss, _pca_lowrank_loss], ids=["svd", "pca"])
def test_lowrank_under_grad_vjp_vmap(loss):
    """Random sketches: both libraries draw from the same generator state, so the results agree
    exactly (the quantities compared are sign-invariant where the sketch's sign is free)."""
    A = _randn(5, 10, 8, seed=3)
    torch.manual_seed(0)
    ours = ft.grad(loss)(A[0])
    torch.manual_seed(0)
    _close(ours, tf.grad(loss)(A[0]))
    torch.manual_seed(0)
    out, pull = ft.vjp(loss, A[0])
    torch.manual_seed(0)
    out_ref, pull_ref = tf.vjp(loss, A[0])
    _close(out, out_ref)
    one = torch.tensor(1.0, dtype=F64)
    _close(pull(one), pull_ref(one))
    for randomness in ("same", "different"):
        torch.manual_seed(0)
        ours = ft.vmap(ft.grad(loss), randomness=randomness)(A)
        torch.manual_seed(0)
        _close(ours, tf.vmap(tf.grad(loss), randomness=randomness)(A))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_dims", [(0, 0, 0), (None, None, 0), (0, 0, None)])
@pytest.mark.parametrize("left,transpose", [(True, False), (False, True)])
def test_ormqr_vmap_without_fallback(in_dims, left, transpose, dtype):
    A, tau = _geqrf((3, 5, 3), dtype)
    C = _randn(3, 5, 2, dtype=dtype, seed=3) if left else _randn(3, 2, 5, dtype=dtype, seed=3)
    args = tuple(x if d is not None else x[0] for x, d in zip((A, tau, C), in_dims))
    f = lambda a, t, c: torch.ormqr(a, t, c, left=left, transpose=transpose)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        ours = ft.vmap(f, in_dims=in_dims)(*args)
    _close(ours, tf.vmap(f, in_dims=in_dims)(*args))


def _all_ops_loss(a):
    Q, R = torch.linalg.qr(a)
    w = torch.arange(3.0, dtype=F64)
    return (
        (Q.abs() ** 2 * w).sum()
        + R.diagonal(0, -2, -1).abs().log().sum()
        + torch.linalg.pinv(a).abs().sum()
        + torch.linalg.lstsq(a, a[..., :2]).solution.abs().sum()
    )


COMPOSITIONS = {
    "vmap(vmap(grad))": lambda L, A, T: L.vmap(L.vmap(L.grad(_all_ops_loss)))(A),
    "vmap(jvp)": lambda L, A, T: L.vmap(lambda a, t: L.jvp(_all_ops_loss, (a,), (t,))[1])(
        A[0], T[0]
    ),
    "jvp(vmap)": lambda L, A, T: L.jvp(L.vmap(_all_ops_loss), (A[0],), (T[0],))[1],
    "vmap(jvp(grad))": lambda L, A, T: L.vmap(
        lambda a, t: L.jvp(L.grad(_all_ops_loss), (a,), (t,))[1]
    )(A[0], T[0]),
    "grad(vmap)": lambda L, A, T: L.grad(lambda a: L.vmap(_all_ops_loss)(a).sum())(A[0]),
    "vmap(grad), in_dims=1": lambda L, A, T: L.vmap(L.grad(_all_ops_loss), in_dims=1)(
        A[0].movedim(0, 1)
    ),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_compositions_match_torch(name, dtype):
    """QR, pinv and lstsq together under nested transforms (the rules' physical-value path
    under vmap, op by op otherwise)."""
    A, T = _randn(3, 4, 5, 3, dtype=dtype, seed=8), _randn(3, 4, 5, 3, dtype=dtype, seed=9)
    f = COMPOSITIONS[name]
    _close(f(ft, A, T), f(tf, A, T), atol=1e-7)
