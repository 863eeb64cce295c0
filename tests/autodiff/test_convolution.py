"""Convolution under jvp, vjp, grad, their compositions and vmap, against torch.func (float64,
complex128) and finite differences (Note [Convolution derivatives through convolution])."""

import pytest
import torch
import torch.nn.functional as F
from _ad_helpers import assert_trees_close, compare_with_torch_func

import functransforms as ft
from functransforms.testing import check_grads

F64, C128 = torch.float64, torch.complex128

# (groups, stride, dilation, padding): every geometry argument away from its default at least once
GEOMETRIES = [(1, 1, 1, 0), (2, 2, 1, 1), (1, 2, 2, 1), (2, 3, 2, 2), (1, 1, 2, 3)]


def _case(nd, transposed, geometry, bias, dtype=F64):
    groups, stride, dilation, padding = geometry
    C, O = 4, 6
    side = 7 if nd < 3 else 5
    x = torch.randn((2, C) + (side,) * nd, dtype=dtype)
    if transposed:
        w = torch.randn((C, O // groups) + (3,) * nd, dtype=dtype)
        out_pad = stride - 1 if stride > 1 else 0

        def f(x, w, b=None):
            conv = getattr(F, f"conv_transpose{nd}d")
            return conv(x, w, b, stride, padding, out_pad, groups, dilation)

    else:
        w = torch.randn((O, C // groups) + (3,) * nd, dtype=dtype)

        def f(x, w, b=None):
            conv = getattr(F, f"conv{nd}d")
            return conv(x, w, b, stride, padding, dilation, groups)

    args = (x, w, torch.randn(O, dtype=dtype)) if bias else (x, w)
    return f, args


def _valid(f, args):
    try:
        f(*args)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_convolution_matches_torch_func(nd, transposed, geometry, bias):
    f, args = _case(nd, transposed, geometry, bias)
    if not _valid(f, args):
        pytest.skip("torch rejects this geometry (output_padding >= stride and dilation)")
    compare_with_torch_func(f, args, check=False)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("nd", [1, 2])
def test_convolution_complex(nd, transposed):
    f, args = _case(nd, transposed, (2, 2, 1, 1), True, C128)
    compare_with_torch_func(f, args, grads=True, check=False)
    check_grads(f, args)


@pytest.mark.parametrize("transposed", [False, True])
def test_convolution_finite_differences_second_order(transposed):
    f, args = _case(2, transposed, (2, 2, 1, 1), True)
    check_grads(f, args, order=2)


def _net(x, w1, w2):
    h = torch.tanh(F.conv2d(x, w1, padding=1, stride=2))
    return (F.conv_transpose2d(h, w2, stride=2, output_padding=1) ** 2).sum()


def _net_args():
    return (
        torch.randn(2, 3, 6, 6, dtype=F64),
        torch.randn(4, 3, 3, 3, dtype=F64),
        torch.randn(4, 3, 3, 3, dtype=F64),
    )


@pytest.mark.parametrize("argnums", [0, 1, 2])
def test_grad_of_grad_through_conv(argnums):
    args = _net_args()
    v = torch.randn_like(args[argnums])

    def gv(*a):
        return (ft.grad(_net, argnums)(*a) * v).sum()

    def gv_ref(*a):
        return (torch.func.grad(_net, argnums)(*a) * v).sum()

    ours = ft.grad(gv, (0, 1, 2))(*args)
    ref = torch.func.grad(gv_ref, (0, 1, 2))(*args)
    assert_trees_close(ours, ref)


def test_hessian_and_jacfwd_jacrev_through_conv():
    x, w1, w2 = _net_args()
    x, w1 = x[:1, :, :4, :4], w1[:2]
    w2 = w2[:2]
    ours = ft.hessian(_net, argnums=1)(x, w1, w2)
    ref = torch.func.hessian(_net, argnums=1)(x, w1, w2)
    assert_trees_close(ours, ref)
    ours = ft.jacfwd(ft.jacrev(_net))(x, w1, w2)
    ref = torch.func.jacfwd(torch.func.jacrev(_net))(x, w1, w2)
    assert_trees_close(ours, ref)


def test_hvp_jvp_of_grad_through_conv():
    args = _net_args()
    tangents = tuple(torch.randn_like(a) for a in args)
    ours = ft.jvp(ft.grad(_net, (0, 1, 2)), args, tangents)[1]
    ref = torch.func.jvp(torch.func.grad(_net, (0, 1, 2)), args, tangents)[1]
    assert_trees_close(ours, ref)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("in_dims", [(0, None, None), (None, 0, None), (0, 0, 0)])
def test_vmap_of_grad_per_sample_and_ensembles(transposed, in_dims):
    f, (x, w, b) = _case(2, transposed, (2, 2, 1, 1), True)
    B = 3
    batched = [
        torch.randn((B,) + tuple(a.shape), dtype=F64) if d == 0 else a
        for a, d in zip((x, w, b), in_dims)
    ]

    def loss(x, w, b):
        return (torch.sin(f(x, w, b)) ** 2).sum()

    ours = ft.vmap(ft.grad(loss, (0, 1, 2)), in_dims)(*batched)
    ref = torch.func.vmap(torch.func.grad(loss, (0, 1, 2)), in_dims)(*batched)
    assert_trees_close(ours, ref)
    # the jacobian pattern: vmap over cotangents of a vjp
    out, vjp_fn = ft.vjp(lambda x, w: f(x, w, b), x, w)
    cts = torch.randn((B,) + tuple(out.shape), dtype=F64)
    ref_out, ref_fn = torch.func.vjp(lambda x, w: f(x, w, b), x, w)
    assert_trees_close(ft.vmap(vjp_fn)(cts), torch.func.vmap(ref_fn)(cts))


def test_unbatched_input_conv():
    w = torch.randn(4, 3, 3, 3, dtype=F64)
    x = torch.randn(3, 6, 6, dtype=F64)
    compare_with_torch_func(lambda x, w: F.conv2d(x, w, padding=1), (x, w), check=False)


def test_underscore_convolution_directly():
    x = torch.randn(2, 4, 6, dtype=F64)
    w = torch.randn(6, 2, 3, dtype=F64)
    b = torch.randn(6, dtype=F64)

    def f(x, w, b):
        return torch.ops.aten._convolution(
            x, w, b, [2], [1], [1], False, [0], 2, False, False, True, True
        )

    compare_with_torch_func(f, (x, w, b), check=False)
    xs = torch.randn(3, 2, 4, 6, dtype=F64)
    assert_trees_close(
        ft.vmap(f, (0, None, None))(xs, w, b), torch.func.vmap(f, (0, None, None))(xs, w, b)
    )


@pytest.mark.parametrize(
    "mask", [[True, True, True], [True, False, False], [False, True, False], [False, True, True]]
)
@pytest.mark.parametrize("transposed", [False, True])
def test_convolution_backward_rules(transposed, mask):
    """The kernel the real vjp calls: its own jvp, vjp and batching (Note [Convolution
    derivatives through convolution], Note [Batching convolution_backward])."""
    f, (x, w, b) = _case(2, transposed, (2, 2, 1, 1), True)
    out = f(x, w, b)
    go = torch.randn_like(out)
    out_pad = [1, 1] if transposed else [0, 0]

    def cb(go, x, w):
        return torch.ops.aten.convolution_backward(
            go, x, w, [6], [2, 2], [1, 1], [1, 1], transposed, out_pad, 2, mask
        )

    def used(t):
        return tuple(o for o, m in zip(t, mask) if m)

    def g(go, x, w):
        return used(cb(go, x, w))

    compare_with_torch_func(g, (go, x, w), grads=False, check=False)
    check_grads(g, (go, x, w), order=2)
    B = 3
    for in_dims in [(0, None, None), (None, 0, None), (None, None, 0), (0, 0, 0), (1, None, 0)]:
        args = [
            torch.randn((B,) + tuple(a.shape), dtype=F64).movedim(0, d) if d is not None else a
            for a, d in zip((go, x, w), in_dims)
        ]
        assert_trees_close(ft.vmap(g, in_dims)(*args), torch.func.vmap(g, in_dims)(*args))
