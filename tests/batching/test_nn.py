"""nn rules (losses, layer norm, convolution, pooling, softmax backward) against torch.vmap."""

import warnings

import pytest
import torch
import torch.nn.functional as Fn
from _vmap_helpers import build, check, floats, ints, mixes

import functransforms as ft
from functransforms.errors import FallbackWarning, InplaceError

aten = torch.ops.aten

CASES = {
    "mse_mean": (lambda x, t: Fn.mse_loss(x, t), [floats(3, 4), floats(3, 4)]),
    "mse_sum": (lambda x, t: Fn.mse_loss(x, t, reduction="sum"), [floats(3, 4), floats(3, 4)]),
    "mse_none": (lambda x, t: Fn.mse_loss(x, t, reduction="none"), [floats(3, 4), floats(3, 4)]),
    "mse_0d": (lambda x, t: Fn.mse_loss(x, t), [floats(), floats()]),
    "smooth_l1": (lambda x, t: Fn.smooth_l1_loss(x, t, beta=0.5), [floats(3, 4), floats(3, 4)]),
    "huber": (lambda x, t: Fn.huber_loss(x, t, delta=0.7, reduction="sum"), [floats(5), floats(5)]),
    "l1": (lambda x, t: Fn.l1_loss(x, t), [floats(5), floats(5)]),
    "soft_margin": (lambda x, t: Fn.soft_margin_loss(x, t), [floats(5), floats(5)]),
    "bce": (
        lambda x, t: Fn.binary_cross_entropy(torch.sigmoid(x), torch.sigmoid(t)),
        [floats(3, 4), floats(3, 4)],
    ),
    "bce_weight": (
        lambda x, t, w: Fn.binary_cross_entropy(torch.sigmoid(x), torch.sigmoid(t), weight=w),
        [floats(3, 4), floats(3, 4), floats(4)],
    ),
    "bce_logits": (
        lambda x, t, w: Fn.binary_cross_entropy_with_logits(x, torch.sigmoid(t), pos_weight=w),
        [floats(3, 4), floats(3, 4), floats(4)],
    ),
    "nll_mean": (lambda x, t: Fn.nll_loss(x.log_softmax(-1), t), [floats(4, 5), ints(5, 4)]),
    "nll_sum": (lambda x, t: Fn.nll_loss(x, t, reduction="sum"), [floats(4, 5), ints(5, 4)]),
    "nll_none": (lambda x, t: Fn.nll_loss(x, t, reduction="none"), [floats(4, 5), ints(5, 4)]),
    "nll_1d": (lambda x, t: Fn.nll_loss(x, t), [floats(5), ints(5)]),
    "nll_weight": (
        lambda x, t, w: Fn.nll_loss(x, t, weight=w.exp()),
        [floats(4, 5), ints(5, 4), floats(5)],
    ),
    "nll_ignore": (lambda x, t: Fn.nll_loss(x, t, ignore_index=2), [floats(6, 5), ints(5, 6)]),
    "cross_entropy": (lambda x, t: Fn.cross_entropy(x, t), [floats(4, 5), ints(5, 4)]),
    "layer_norm": (lambda x: Fn.layer_norm(x, (4,)), [floats(3, 4)]),
    "layer_norm_affine": (
        lambda x, w, b: Fn.layer_norm(x, (3, 4), w, b),
        [floats(2, 3, 4), floats(3, 4), floats(3, 4)],
    ),
    "layer_norm_1d": (lambda x, w: Fn.layer_norm(x, (4,), w), [floats(4), floats(4)]),
    "conv1d": (
        lambda x, w, b: Fn.conv1d(x, w, b, padding=1),
        [floats(2, 3, 7), floats(4, 3, 3), floats(4)],
    ),
    "conv2d": (lambda x, w: Fn.conv2d(x, w, stride=2), [floats(2, 2, 6, 6), floats(3, 2, 3, 3)]),
    "conv2d_unbatched": (
        lambda x, w, b: Fn.conv2d(x, w, b),
        [floats(2, 5, 5), floats(3, 2, 2, 2), floats(3)],
    ),
    "conv2d_groups": (
        lambda x, w, b: Fn.conv2d(x, w, b, groups=2, dilation=2),
        [floats(1, 4, 7, 7), floats(6, 2, 2, 2), floats(6)],
    ),
    "conv_transpose2d": (
        lambda x, w, b: Fn.conv_transpose2d(x, w, b, stride=2),
        [floats(2, 4, 3, 3), floats(4, 3, 2, 2), floats(3)],
    ),
    "conv_transpose1d_groups": (
        lambda x, w: Fn.conv_transpose1d(x, w, groups=2),
        [floats(2, 4, 5), floats(4, 1, 3)],
    ),
    "max_pool2d": (lambda x: Fn.max_pool2d(x, 2), [floats(2, 3, 6, 6)]),
    "max_pool2d_indices": (
        lambda x: Fn.max_pool2d(x, 3, 2, 1, return_indices=True),
        [floats(3, 6, 6)],
    ),
    "avg_pool2d": (lambda x: Fn.avg_pool2d(x, 2, padding=1), [floats(2, 3, 5, 5)]),
    "adaptive_avg_pool2d": (lambda x: Fn.adaptive_avg_pool2d(x, (2, 3)), [floats(2, 3, 5, 7)]),
    "max_pool1d": (lambda x: Fn.max_pool1d(x, 2), [floats(2, 3, 6)]),
    "avg_pool1d": (lambda x: Fn.avg_pool1d(x, 2), [floats(2, 3, 6)]),
    "softmax_bwd": (
        lambda g, y: aten._softmax_backward_data(g, y, -1, torch.float64),
        [floats(3, 4), floats(3, 4)],
    ),
    "log_softmax_bwd": (
        lambda g, y: aten._log_softmax_backward_data(g, y, 0, torch.float64),
        [floats(3, 4), floats(3, 4)],
    ),
    "gelu_bwd": (lambda g, x: aten.gelu_backward(g, x), [floats(3, 4), floats(4)]),
    "threshold_bwd": (
        lambda g, x: aten.threshold_backward(g, x, 0.0),
        [floats(3, 4), floats(3, 4)],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_nn_matches_torch_vmap(name):
    fn, specs = CASES[name]
    for in_dims in mixes(specs):
        check(fn, in_dims, *build(specs, in_dims))


def test_conv_nested_and_chunked():
    x = torch.randn(2, 3, 1, 2, 5, 5, dtype=torch.float64)
    w = torch.randn(2, 4, 2, 3, 3, dtype=torch.float64)
    f = lambda x, w: Fn.conv2d(x, w, padding=1)
    from functransforms import vmap

    out = vmap(vmap(f, in_dims=(0, None)), in_dims=(0, 0), chunk_size=1)(x, w)
    ref = torch.vmap(torch.vmap(f, in_dims=(0, None)), in_dims=(0, 0))(x, w)
    torch.testing.assert_close(out, ref)


def test_cross_entropy_label_smoothing():
    # torch.vmap itself fails when only the target is batched (an in-place op inside torch)
    f = lambda x, t: Fn.cross_entropy(x, t, label_smoothing=0.1)
    specs = [floats(4, 5), ints(5, 4)]
    for in_dims in [(0, 0), (0, None), (-1, 0), (1, -1)]:
        check(f, in_dims, *build(specs, in_dims))


# backward ops that vmap(vjp) of antialiased upsampling and 3-d grid sampling reach
BACKWARD_CASES = {
    "upsample_bilinear_aa_bwd": (
        lambda g: aten._upsample_bilinear2d_aa_backward(g, [3, 3], [2, 1, 10, 12], False),
        [floats(2, 1, 3, 3)],
    ),
    "upsample_bicubic_aa_bwd": (
        lambda g: aten._upsample_bicubic2d_aa_backward(g, [4, 3], [1, 2, 9, 7], True),
        [floats(1, 2, 4, 3)],
    ),
    "grid_sampler_3d_bwd": (
        lambda g, x, grid: aten.grid_sampler_3d_backward(g, x, grid, 0, 0, False, [True, True]),
        [floats(2, 2, 2, 2, 2), floats(2, 2, 3, 3, 3), floats(2, 2, 2, 2, 3)],
    ),
    "grid_sampler_3d_bwd_grid_only": (
        lambda g, x, grid: aten.grid_sampler_3d_backward(g, x, grid, 1, 1, True, [False, True])[1],
        [floats(1, 2, 2, 2, 2), floats(1, 2, 3, 3, 3), floats(1, 2, 2, 2, 3)],
    ),
}


@pytest.mark.parametrize("name", sorted(BACKWARD_CASES))
def test_backward_ops_match_torch_vmap(name):
    fn, specs = BACKWARD_CASES[name]
    for in_dims in mixes(specs):
        check(fn, in_dims, *build(specs, in_dims))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_cross_entropy_chunked_batches(reduction, with_bias):
    # the chunked path (options=...) is a custom op; torch.vmap's rule for it loops (the oracle)
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=2)
    w = torch.rand(5, dtype=torch.float64) + 0.5

    def f(x, W, t, b):
        return Fn.linear_cross_entropy(
            x,
            W,
            t,
            linear_bias=b if with_bias else None,
            weight=w,
            reduction=reduction,
            ignore_index=1,
            options=options,
        )

    specs = [floats(4, 3), floats(5, 3), ints(5, 4), floats(5)]
    for in_dims in mixes(specs):
        check(f, in_dims, *build(specs, in_dims))


def _ctc_inputs(B=3, T=12, N=4, C=6, S=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(B, T, N, C, generator=g, dtype=torch.float64).log_softmax(-1)
    tg = torch.randint(1, C, (B, N, S), generator=g)
    il = torch.randint(T - 3, T + 1, (B, N), generator=g)
    tl = torch.randint(1, S + 1, (B, N), generator=g)
    tl[0, 0], tl[1] = S, 2  # the longest target differs per example (log_alpha's width)
    return lp, tg, il, tl


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("layout", ["padded", "concatenated", "unbatched"])
def test_ctc_loss_folds_into_its_batch(reduction, layout):
    """Note [Batching ctc_loss]: examples whose longest targets differ (a per-example loop
    could not stack log_alpha), in each target layout, against a loop; then vmap of the vjp."""
    from functransforms.testing import check_vmap

    lp, tg, il, tl = _ctc_inputs()
    if layout == "concatenated":  # each example's N targets back to back (torch: sum(tl) long)
        tl = torch.tensor([[7, 5, 6, 3], [2, 7, 7, 5], [4, 4, 6, 7]])
        tg = tg.flatten(1)[:, :21]
    if layout == "unbatched":  # one sequence per example (torch: targets exactly tl long)
        lp, tg, il, tl = lp[:, :, 0], tg[:, 0], il[:, 0], torch.full((3,), 7)

    def f(lp, tg, il, tl):
        return Fn.ctc_loss(lp, tg, il, tl, reduction=reduction, zero_infinity=True)

    def grads(lp, tg, il, tl):
        return ft.grad(lambda lp: f(lp, tg, il, tl).sum())(lp)

    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # a rule, not the per-example loop
        check_vmap(f, (lp, tg, il, tl))
        check_vmap(f, (lp, tg[0], il[0], tl[0]), in_dims=(0, None, None, None))
        check_vmap(grads, (lp, tg, il, tl))


@pytest.mark.parametrize(
    "op",
    [aten._native_batch_norm_legit.default, aten.native_batch_norm.default],
    ids=["legit", "native"],
)
def test_batch_norm_eval_with_unbatched_running_stats(op):
    """The schema marks the running statistics written, but eval mode only reads them: vmap
    (and vmap of the vjp, where they are constants) must not refuse them as unbatched targets.
    Training mode still raises (each example would write its own statistics)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 2, 4, generator=g, dtype=torch.float64)
    w, b = torch.randn(2, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    rm, rv = torch.randn(2, dtype=torch.float64), torch.rand(2, dtype=torch.float64) + 0.5
    ct = torch.randn(3, 2, 2, 4, generator=g, dtype=torch.float64)

    def f(x, w, b, training=False):
        return op(x, w, b, rm, rv, training, 0.1, 1e-5)[0]

    torch.testing.assert_close(ft.vmap(f)(x, w.expand(3, 2), b.expand(3, 2)),
                               torch.func.vmap(f)(x, w.expand(3, 2), b.expand(3, 2)))  # fmt: skip

    def per_sample(lib):
        return lib.vmap(lambda x, c: lib.vjp(lambda x, w: f(x, w, b), x, w)[1](c))

    for a, r in zip(per_sample(ft)(x, ct), per_sample(torch.func)(x, ct)):
        torch.testing.assert_close(a, r)
    before = rm.clone()
    with pytest.raises(InplaceError, match="training mode updates running_mean"):
        ft.vmap(lambda x: f(x, w, b, training=True))(x)
    assert torch.equal(rm, before)


def test_linear_cross_entropy_rules_are_registered_when_torch_defines_the_ops():
    # Note [Lazy parts of the package]: importing functransforms does not import torch's
    # module that defines the chunked ops; once defined, vmap finds our rules (no loop)
    from functransforms.batching import VMAP_RULES

    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=2)
    x, W, t = torch.randn(3, 4, 3), torch.randn(5, 3), torch.randint(0, 5, (3, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        for reduction in ("mean", "none"):
            ft.vmap(
                lambda x, t, r=reduction: Fn.linear_cross_entropy(
                    x, W, t, reduction=r, options=options
                )
            )(x, t)
    ns = torch.ops.torch_nn
    for op in (
        ns._linear_cross_entropy_batch_chunked.default,
        ns._linear_cross_entropy_batch_chunked_no_reduction.default,
    ):
        assert op in VMAP_RULES
    assert not VMAP_RULES._by_name
