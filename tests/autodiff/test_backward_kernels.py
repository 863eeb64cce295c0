"""ctc_loss and 3-d grid_sample to second order (Note [Differentiable backward kernels]
in autodiff/nn.py). Their first-order vjps are torch's backward kernels; second order runs the
differentiable formulations of those kernels. torch has no double backward for either op, so
second order is checked against finite differences (functransforms.testing.check_grads and
central differences of our gradient, which is itself checked against torch.func). The ctc
losses take ``log_softmax`` of their input: torch's ctc gradient is ``exp(lp) - posterior``,
a true derivative only along normalized log-probabilities."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from functransforms.autodiff.nn import _ctc_loss_backward, _grid_sampler_3d_backward
from torch import func as tf

import functransforms as ft
from functransforms.testing import check_grads

aten = torch.ops.aten
F64 = torch.float64
GRID_MODES = list(itertools.product(("bilinear", "nearest"), ("zeros", "border", "reflection"),
                                    (False, True)))  # fmt: skip
MODE = {"bilinear": 0, "nearest": 1}
PAD = {"zeros": 0, "border": 1, "reflection": 2}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _grid_args(dtype=F64, seed=0):
    """An input [1, 2, 3, 3, 4] and a grid reaching past [-1, 1] (the padding modes matter)."""
    x = torch.randn(1, 2, 3, 3, 4, generator=_gen(seed), dtype=dtype)
    grid = torch.rand(1, 2, 2, 1, 3, generator=_gen(seed + 1), dtype=dtype) * 3 - 1.5
    return x, grid


def _grid_loss(mode, padding, align):
    def loss(x, grid):
        out = F.grid_sample(x, grid, mode=mode, padding_mode=padding, align_corners=align)
        w = torch.cos(torch.arange(out.numel(), dtype=out.dtype)).reshape(out.shape)
        return (w * torch.tanh(out)).sum()

    return loss


# (targets, input lengths, target lengths): 2-d padded and 1-d concatenated targets; the second
# example of "impossible" cannot align (2 labels in 1 step): its nll is inf.
_TARGETS = torch.tensor([[1, 2, 2], [3, 1, 0]])
CTC = {
    "padded": (_TARGETS, [6, 5], [3, 2]),
    "concatenated": (torch.tensor([1, 2, 2, 3, 1]), [6, 5], [3, 2]),
    "empty-target": (_TARGETS, [6, 4], [3, 0]),
    "impossible": (_TARGETS, [6, 1], [3, 2]),
}


def _ctc_loss(case, reduction="mean", blank=0, zero_infinity=False, tensors=False):
    targets, il, tl = CTC[case]
    if blank:  # move the labels off the blank index
        targets = torch.where(targets == blank, 0, targets)
    if tensors:  # the Tensor overload of _ctc_loss
        il, tl = torch.tensor(il), torch.tensor(tl)

    def loss(x):
        lp = x.log_softmax(-1)
        return F.ctc_loss(lp, targets, il, tl, blank, reduction, zero_infinity)

    return loss


def _ctc_x(dtype=F64, seed=0):
    return torch.randn(6, 2, 4, generator=_gen(seed), dtype=dtype)


# -- the formulations compute the kernels' numbers -------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("mode,padding,align", GRID_MODES)
def test_grid_sampler_3d_backward_formulation_equals_kernel(dtype, mode, padding, align):
    x, grid = _grid_args(dtype)
    ct = torch.randn(1, 2, 2, 2, 1, generator=_gen(7), dtype=dtype)
    args = (ct, x, grid, MODE[mode], PAD[padding], align)
    for mask in ([True, True], [True, False], [False, True]):
        ours = _grid_sampler_3d_backward(*args, mask)
        theirs = aten.grid_sampler_3d_backward(*args, mask)
        for a, b, m in zip(ours, theirs, mask):
            assert (a is None) == (not m)
            if m:
                torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("case", sorted(CTC))
@pytest.mark.parametrize(
    "blank,zero_infinity,tensors", [(0, False, False), (3, True, True), (2, False, True)]
)
def test_ctc_loss_backward_formulation_equals_kernel(dtype, case, blank, zero_infinity, tensors):
    targets, il, tl = CTC[case]
    targets = torch.where(targets == blank, 0 if blank else 1, targets)
    if tensors:
        il, tl = torch.tensor(il), torch.tensor(tl)
    lp = _ctc_x(dtype).log_softmax(-1)
    overload = "Tensor" if tensors else "default"
    nll, alpha = getattr(aten._ctc_loss, overload)(lp, targets, il, tl, blank, zero_infinity)
    grad = torch.randn(2, generator=_gen(3), dtype=dtype)
    args = (grad, lp, targets, il, tl, nll, alpha, blank, zero_infinity)
    theirs = getattr(aten._ctc_loss_backward, overload)(*args)
    torch.testing.assert_close(_ctc_loss_backward(*args), theirs, equal_nan=True)
    if case == "impossible":  # the kernel's NaN in the one step, or 0 under zero_infinity
        assert theirs[0, 1].isnan().all() != zero_infinity and (theirs[1:, 1] == 0).all()


# -- first order: torch's kernels, equal to torch.func ---------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("mode,padding,align", GRID_MODES)
def test_grid_sample_3d_first_order_matches_torch_func(dtype, mode, padding, align):
    f = _grid_loss(mode, padding, align)
    args = _grid_args(dtype)
    for a, b in zip(ft.grad(f, argnums=(0, 1))(*args), tf.grad(f, argnums=(0, 1))(*args)):
        torch.testing.assert_close(a, b)
    xs = torch.randn((3,) + args[0].shape, generator=_gen(4), dtype=dtype)
    torch.testing.assert_close(
        ft.vmap(ft.grad(f, argnums=1), (0, None))(xs, args[1]),
        tf.vmap(tf.grad(f, argnums=1), (0, None))(xs, args[1]),
    )


def _autograd_vjp(f, x, ct):
    """torch's reverse mode, the oracle for ctc_loss: torch.func.vjp raises inside F.ctc_loss for
    mean reduction with int-list lengths ("Cannot access data pointer of Tensor that doesn't
    have storage")."""
    x = x.detach().requires_grad_()
    out = f(x)
    return out.detach(), torch.autograd.grad(out, x, ct)[0]


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("case", sorted(CTC))
@pytest.mark.parametrize("blank,zero_infinity,tensors", [(0, True, False), (3, False, True)])
def test_ctc_loss_first_order_matches_torch(dtype, reduction, case, blank, zero_infinity,
                                            tensors):  # fmt: skip
    f = _ctc_loss(case, reduction, blank, zero_infinity, tensors)
    x = _ctc_x(dtype)
    out, pullback = ft.vjp(f, x)
    ct = torch.rand(out.shape, generator=_gen(5), dtype=dtype)
    ref, ref_grad = _autograd_vjp(f, x, ct)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(pullback(ct)[0], ref_grad, equal_nan=True)
    xs = torch.randn((3,) + x.shape, generator=_gen(6), dtype=dtype)
    g = ft.vmap(ft.grad(lambda y: f(y).sum()))(xs)
    ones = torch.ones_like(out)
    loop = torch.stack([_autograd_vjp(f, xi, ones)[1] for xi in xs])
    torch.testing.assert_close(g, loop, equal_nan=True)


# -- second order against finite differences -------------------------------------------------------
def _fd_hessian(g, x, eps=1e-6):
    """Central differences of the gradient ``g`` along each coordinate: [x.numel(), *x.shape]."""
    cols = []
    for i in range(x.numel()):
        e = torch.zeros(x.numel(), dtype=x.dtype)
        e[i] = eps
        e = e.reshape(x.shape)
        cols.append((g(x + e) - g(x - e)) / (2 * eps))
    return torch.stack(cols)


def _second_order(f, x, v):
    """grad(grad), jacfwd(jacrev), hessian and a vmapped hvp of f at x against differences."""
    H = _fd_hessian(ft.grad(f), x).reshape(x.numel(), -1)  # symmetric up to the differences
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ft.hessian(f)(x).reshape(H.shape), H, **close)
    torch.testing.assert_close(ft.jacfwd(ft.jacrev(f))(x).reshape(H.shape), H, **close)
    gg = ft.grad(lambda y: (ft.grad(f)(y) * v).sum())(x)  # vjp of the vjp
    torch.testing.assert_close(gg.reshape(-1), H @ v.reshape(-1), **close)
    vs = torch.stack([v, v.cos()])
    hvps = ft.vmap(lambda t: ft.jvp(ft.grad(f), (x,), (t,))[1])(vs)  # forward over reverse
    torch.testing.assert_close(hvps.reshape(2, -1), vs.reshape(2, -1) @ H, **close)


@pytest.mark.parametrize("mode,padding,align", GRID_MODES)
def test_grid_sample_3d_second_order_matches_finite_differences(mode, padding, align):
    loss = _grid_loss(mode, padding, align)
    x, grid = _grid_args()
    check_grads(loss, (x, grid), order=2)
    n = x.numel()

    def f(flat):  # input and grid as one vector: the Hessian has the cross terms
        return loss(flat[:n].reshape(x.shape), flat[n:].reshape(grid.shape))

    flat = torch.cat([x.reshape(-1), grid.reshape(-1)])
    _second_order(f, flat, torch.randn(flat.shape, generator=_gen(9), dtype=F64))


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("case", sorted(CTC))
@pytest.mark.parametrize("blank,zero_infinity,tensors", [(0, True, False), (3, True, True)])
def test_ctc_loss_second_order_matches_finite_differences(reduction, case, blank, zero_infinity,
                                                          tensors):  # fmt: skip
    loss = _ctc_loss(case, reduction, blank, zero_infinity, tensors)
    x = _ctc_x()
    check_grads(loss, (x,), order=2)
    w = torch.tensor([0.7, -1.3], dtype=F64)

    def f(y):
        out = loss(y)
        return (out * w).sum() if reduction == "none" else out

    _second_order(f, x, torch.randn(x.shape, generator=_gen(9), dtype=F64))


def test_second_order_ctc_without_zero_infinity_is_nan_where_torch_is():
    """An impossible alignment without zero_infinity: torch's gradient is NaN, so is ours."""
    f = _ctc_loss("impossible", "sum")
    g = ft.grad(f)(_ctc_x())
    assert g[0, 1].isnan().all() and not g[:, 0].isnan().any()
    h = ft.hessian(f)(_ctc_x())
    assert h[:, 0, :, :, 0, :].isfinite().all()


def test_vmap_of_hessian_through_both_kernels_equals_a_loop():
    """Per-example Hessians: the formulations run on batched values (inputs, grids, targets)."""
    grid_loss = _grid_loss("bilinear", "reflection", False)
    x, grid = _grid_args()
    xs = torch.stack([x, x.sin()])
    grids = torch.stack([grid, grid.flip(1)])
    h = ft.vmap(ft.hessian(grid_loss, argnums=(0, 1)))(xs, grids)
    for i in range(2):
        hi = ft.hessian(grid_loss, argnums=(0, 1))(xs[i], grids[i])
        for j, k in itertools.product(range(2), range(2)):  # d2 / d(x, grid)[j] d(x, grid)[k]
            torch.testing.assert_close(h[j][k][i], hi[j][k])

    def ctc(x, targets):
        lp = x.log_softmax(-1)
        return F.ctc_loss(lp, targets, [6, 5], [3, 2], reduction="sum")

    cs = torch.stack([_ctc_x(), _ctc_x(seed=1)])
    ts = torch.stack([_TARGETS, _TARGETS.flip(1).clamp(min=1)])
    h = ft.vmap(ft.hessian(ctc))(cs, ts)
    for i in range(2):
        torch.testing.assert_close(h[i], ft.hessian(ctc)(cs[i], ts[i]))
