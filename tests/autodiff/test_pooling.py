"""Pooling under jvp, vjp, grad, second order and vmap(grad), against torch.func in float64
(Note [Pooling derivatives]). Inputs are random floats, so max pooling has no ties."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from _ad_helpers import assert_trees_close, compare_with_torch_func

import functransforms as ft
from functransforms.errors import FallbackWarning
from functransforms.testing import check_grads

F64 = torch.float64


def _x(nd, batched=True):
    side = {1: 9, 2: 7, 3: 5}[nd]
    shape = (2, 3) + (side,) * nd if batched else (3,) + (side,) * nd
    return torch.randn(shape, dtype=F64)


def _unpool(nd):
    def f(x):
        out, idx = getattr(F, f"max_pool{nd}d")(x, 2, return_indices=True)
        return getattr(F, f"max_unpool{nd}d")(out * out, idx, 2, output_size=x.shape[-nd:])

    return f


def _fractional(nd):
    samples = torch.rand(2, 3, nd, dtype=F64)

    def f(x):
        pool = getattr(F, f"fractional_max_pool{nd}d")
        s = samples[: x.shape[0], : x.shape[1]]  # a slice of the input takes its samples' slice
        return pool(x, 2, output_size=3, _random_samples=s)

    return f


POOLS = {
    "avg_pool1d": (lambda x: F.avg_pool1d(x, 3, 2, 1), 1),
    "avg_pool2d": (lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True), 2),
    "avg_pool2d_divisor": (lambda x: F.avg_pool2d(x, 2, divisor_override=3), 2),
    "avg_pool2d_no_pad_count": (lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False), 2),
    "avg_pool3d": (lambda x: F.avg_pool3d(x, 2, 1), 3),
    "adaptive_avg_pool1d": (lambda x: F.adaptive_avg_pool1d(x, 4), 1),
    "adaptive_avg_pool2d": (lambda x: F.adaptive_avg_pool2d(x, (3, 4)), 2),
    "adaptive_avg_pool3d": (lambda x: F.adaptive_avg_pool3d(x, 3), 3),
    "max_pool1d": (lambda x: F.max_pool1d(x, 3, 2, 1), 1),
    "max_pool2d": (lambda x: F.max_pool2d(x, 3, 2, 1, dilation=1, ceil_mode=True), 2),
    "max_pool2d_dilated": (lambda x: F.max_pool2d(x, 2, 1, dilation=2), 2),
    "max_pool3d": (lambda x: F.max_pool3d(x, 2), 3),
    "adaptive_max_pool1d": (lambda x: F.adaptive_max_pool1d(x, 4), 1),
    "adaptive_max_pool2d": (lambda x: F.adaptive_max_pool2d(x, 3), 2),
    "adaptive_max_pool3d": (lambda x: F.adaptive_max_pool3d(x, 2), 3),
    "fractional_max_pool2d": (_fractional(2), 2),
    "fractional_max_pool3d": (_fractional(3), 3),
    "max_unpool1d": (_unpool(1), 1),
    "max_unpool2d": (_unpool(2), 2),
    "max_unpool3d": (_unpool(3), 3),
    "lp_pool1d": (lambda x: F.lp_pool1d(x, 2.0, 3, 2), 1),
    "lp_pool2d": (lambda x: F.lp_pool2d(x, 3.0, 2), 2),
    "lp_pool3d": (lambda x: F.lp_pool3d(x, 2.0, 2), 3),
    "local_response_norm": (lambda x: F.local_response_norm(x, 2), 2),
    "local_response_norm_3d": (lambda x: F.local_response_norm(x, 3), 3),
}


@pytest.mark.parametrize("name", sorted(POOLS))
def test_pool_matches_torch_func(name):
    f, nd = POOLS[name]
    x = _x(nd)
    if name.startswith("lp_pool"):
        x = x.abs() + 0.5  # the p-th root is not differentiable where a window sums to 0
    compare_with_torch_func(f, (x,), check=False)
    check_grads(f, (x,))


@pytest.mark.parametrize("name", ["avg_pool2d", "adaptive_avg_pool2d", "max_pool2d", "max_pool1d"])
def test_pool_unbatched_input(name):
    f, nd = POOLS[name]
    compare_with_torch_func(f, (_x(nd, batched=False),), check=False)


@pytest.mark.parametrize(
    "name",
    [
        "avg_pool2d",
        "adaptive_avg_pool3d",
        "max_pool2d",
        "adaptive_max_pool2d",
        "lp_pool2d",
        "local_response_norm",
        "fractional_max_pool2d",
        "max_unpool2d",
    ],
)
def test_pool_second_order(name):
    f, nd = POOLS[name]
    x = _x(nd).abs() + 0.5

    def loss(x):
        return (torch.tanh(f(x)) ** 2).sum()

    assert_trees_close(ft.hessian(loss)(x[:1, :1]), torch.func.hessian(loss)(x[:1, :1]))
    v = torch.randn_like(x)
    ours = ft.grad(lambda x: (ft.grad(loss)(x) * v).sum())(x)
    ref = torch.func.grad(lambda x: (torch.func.grad(loss)(x) * v).sum())(x)
    assert_trees_close(ours, ref)
    assert_trees_close(
        ft.jvp(ft.grad(loss), (x,), (v,))[1], torch.func.jvp(torch.func.grad(loss), (x,), (v,))[1]
    )


@pytest.mark.parametrize("name", sorted(n for n in POOLS if not n.startswith("fractional")))
def test_vmap_of_grad_through_pool(name):
    f, nd = POOLS[name]
    xs = _x(nd).abs() + 0.5  # per-example inputs are [3, *spatial]: the op's unbatched form

    def loss(x):
        return (torch.sin(f(x.unsqueeze(0))) ** 2).sum()

    assert_trees_close(ft.vmap(ft.grad(loss))(xs), torch.func.vmap(torch.func.grad(loss))(xs))


@pytest.mark.parametrize("nd", [2, 3])
def test_fractional_max_pool_vmap_with_batched_samples(nd):
    xs = torch.randn((4, 2, 3) + (5,) * nd, dtype=F64)
    samples = torch.rand(4, 2, 3, nd, dtype=F64)

    def f(x, s):
        pool = getattr(F, f"fractional_max_pool{nd}d")
        return pool(x, 2, output_size=3, _random_samples=s)

    for in_dims in [(0, 0), (0, None)]:
        s = samples if in_dims[1] == 0 else samples[0]
        ours = ft.vmap(f, in_dims)(xs, s)
        ref = torch.func.vmap(f, in_dims)(xs, s)
        assert_trees_close(ours, ref)
        g = ft.vmap(ft.grad(lambda x, s: f(x, s).pow(2).sum()), in_dims)(xs, s)
        gr = torch.func.vmap(torch.func.grad(lambda x, s: f(x, s).pow(2).sum()), in_dims)(xs, s)
        assert_trees_close(g, gr)


@pytest.mark.parametrize(
    "op,args",
    [
        (torch.ops.aten.avg_pool2d_backward.default, ([3, 3], [2, 2], [1, 1], False, True, None)),
        (torch.ops.aten._adaptive_avg_pool2d_backward.default, ()),
    ],
)
def test_pool_backward_kernels_are_differentiable_and_batched(op, args):
    """The avg-pool backward kernels, the transposes used by the vjp rules, are linear with
    the forward op as their own transpose."""
    x = _x(2)
    fwd = F.avg_pool2d(x, 3, 2, 1) if args else F.adaptive_avg_pool2d(x, 3)
    go = torch.randn_like(fwd)

    def f(go, x):
        return op(go, x, *args)

    compare_with_torch_func(lambda go: f(go, x), (go,), check=False)
    gos = torch.randn((3,) + tuple(go.shape), dtype=F64)
    assert_trees_close(ft.vmap(f, (0, None))(gos, x), torch.func.vmap(f, (0, None))(gos, x))


aten = torch.ops.aten
# (forward producing (out, indices), its backward kernel's arguments between self and indices)
MAX_KERNELS = {
    "max_pool2d": (
        lambda x: aten.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1], [1, 1], True),
        aten.max_pool2d_with_indices_backward.default,
        ([3, 3], [2, 2], [1, 1], [1, 1], True),
        2,
    ),
    "max_pool3d": (
        lambda x: aten.max_pool3d_with_indices(x, [2, 2, 2]),
        aten.max_pool3d_with_indices_backward.default,
        ([2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1], False),
        3,
    ),
    "adaptive_max_pool2d": (
        lambda x: aten.adaptive_max_pool2d(x, [3, 3]),
        aten.adaptive_max_pool2d_backward.default,
        (),
        2,
    ),
    "adaptive_max_pool3d": (
        lambda x: aten.adaptive_max_pool3d(x, [2, 2, 2]),
        aten.adaptive_max_pool3d_backward.default,
        (),
        3,
    ),
}


@pytest.mark.parametrize("name", sorted(MAX_KERNELS))
def test_max_pool_backward_kernels_are_differentiable_and_batched(name):
    """Note [Max pooling's backward kernel]: the vjps call torch's kernels, which are linear in
    grad_output with a gather as transpose; they batch with no per-example fallback, also with
    unbatched indices (which adaptive_max_pool3d_backward must not read expanded)."""
    fwd, op, args, nd = MAX_KERNELS[name]
    x = _x(nd)
    out, idx = fwd(x)
    go = torch.randn_like(out)

    def f(go, x, idx):
        return op(go, x, *args, idx)

    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        compare_with_torch_func(lambda go: f(go, x, idx), (go,), check=False)
        check_grads(lambda go: f(go, x, idx), (go,), order=2)
        gos, xs = torch.randn((3,) + tuple(go.shape), dtype=F64), _x(nd).expand(3, *x.shape)
        idxs = torch.stack([idx, fwd(x.flip(-1))[1], fwd(-x)[1]])
        for in_dims, a in [
            ((0, None, None), (gos, x, idx)),
            ((0, 0, 0), (gos, xs, idxs)),
            ((None, None, 0), (go, x, idxs)),
        ]:
            assert_trees_close(ft.vmap(f, in_dims)(*a), torch.func.vmap(f, in_dims)(*a))
        # vmap of the second-order pass through the kernel (vjp of the vjp, per example)
        v = torch.randn((3,) + tuple(x.shape), dtype=F64)

        def hvp(x, v):
            g = ft.grad(lambda x: (fwd(x)[0] ** 3).sum())
            return ft.jvp(g, (x,), (v,))[1]

        def hvp_ref(x, v):
            g = torch.func.grad(lambda x: (fwd(x)[0] ** 3).sum())
            return torch.func.jvp(g, (x,), (v,))[1]

        xs3 = torch.randn((3,) + tuple(x.shape), dtype=F64)
        assert_trees_close(ft.vmap(hvp)(xs3, v), torch.func.vmap(hvp_ref)(xs3, v))


def _graph_ops(fn, *args):
    from torch.fx.experimental.proxy_tensor import make_fx

    g = make_fx(fn)(*args)
    return [str(n.target) for n in g.graph.nodes if n.op == "call_function"]


def test_max_pool_vjp_is_one_kernel_call():
    """The vjp of max pooling allocates one input-sized result (torch's kernel), not zeros and a
    scatter-add (Note [Max pooling's backward kernel]): this fails if the rule goes back."""
    x = torch.randn(4, 3, 8, 8)
    per_example = ft.vmap(ft.grad(lambda x: F.max_pool2d(x, 2).pow(2).sum()))
    for fn in (ft.grad(lambda x: F.max_pool2d(x, 2).pow(2).sum()), per_example):
        ops = _graph_ops(fn, x)
        assert ops.count("aten.max_pool2d_with_indices_backward.default") == 1, ops
        assert not [o for o in ops if "scatter" in o or "new_zeros" in o], ops


def test_per_sample_cnn_gradient_graph_has_no_scatter():
    """The per-sample gradients of torch.func's tutorial CNN (benchmarks/bench_surface.py (a),
    whose peak memory must stay <= torch.func's) run max pooling's backward as torch's one
    kernel call, as torch.func's graph does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3),
        torch.nn.ReLU(),
        torch.nn.Conv2d(4, 8, 3),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 5 * 5, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 10),
        torch.nn.LogSoftmax(dim=1),
    )
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, t = torch.randn(3, 1, 14, 14), torch.randint(10, (3,))

    def loss(p, x, t):
        out = ft.functional_call(model, p, (x.unsqueeze(0),))
        return F.nll_loss(out, t.unsqueeze(0))

    per_sample = ft.vmap(ft.grad(loss), in_dims=(None, 0, 0))
    ops = _graph_ops(lambda x, t: per_sample(params, x, t), x, t)
    assert ops.count("aten.max_pool2d_with_indices_backward.default") == 1, ops
    assert not [o for o in ops if "scatter" in o or "new_zeros" in o], ops
    ref = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, t)
    assert_trees_close(per_sample(params, x, t), ref)
