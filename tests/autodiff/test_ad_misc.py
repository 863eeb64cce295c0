"""NN ops outside the layer families: bilinear, cdist / pdist, ctc_loss, embedding_bag and the
antialiased upsampling kernels, against torch.func; the forward mode that torch lacks (cdist,
pdist, ctc_loss, embedding_bag: ours only) against finite differences and the dot-product test."""

import pytest
import torch
import torch.nn.functional as F
from _ad_helpers import compare_with_torch_func
from torch import func as tf

import functransforms as ft
from functransforms.testing import check_grads

F64 = torch.float64


def _x(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _ours_only(f, args, order=2, fd=True):
    """vjp against torch.func; jvp (ours only) by <J t, c> = <t, J^T c>, and by finite
    differences (with jvp-of-vjp to ``order``) where ``fd``."""
    gen = torch.Generator().manual_seed(3)
    out, fn = ft.vjp(f, *args)
    ct = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    cts = fn(ct)
    for a, b in zip(cts, tf.vjp(f, *args)[1](ct)):
        torch.testing.assert_close(a, b)
    ts = tuple(torch.randn(a.shape, generator=gen, dtype=a.dtype) for a in args)
    lhs = (ft.jvp(f, args, ts)[1] * ct).sum()
    torch.testing.assert_close(lhs, sum((t * c).sum() for t, c in zip(ts, cts)))
    if fd:
        check_grads(f, args, order=order)


def test_bilinear():
    x1, x2, W, b = _x(4, 3), _x(4, 5, seed=1), _x(2, 3, 5, seed=2), _x(2, seed=3)
    compare_with_torch_func(F.bilinear, (x1, x2, W, b), order=2)
    compare_with_torch_func(lambda a, c, w: F.bilinear(a, c, w), (_x(2, 4, 3), _x(2, 4, 5), W))


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, float("inf"), 0.5])
def test_cdist(p):
    x1, x2 = _x(2, 4, 3), _x(2, 5, 3, seed=1)
    _ours_only(lambda a, b: torch.cdist(a, b, p), (x1, x2), order=2 if p >= 1 else 1)
    _ours_only(lambda a, b: torch.cdist(a, b, p), (x1[0], x2), fd=False)  # broadcast batch


def test_cdist_at_zero_distance():
    """A zero distance has the zero subgradient, as torch picks it."""
    x = _x(3, 2)
    _ours_only(lambda a, b: torch.cdist(a, b), (x, x.clone()), fd=False)


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, float("inf")])
def test_pdist(p):
    _ours_only(lambda x: F.pdist(x, p), (_x(5, 3),))


@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_ctc_loss(reduction):
    T, B, C = 8, 2, 5
    logits = _x(T, B, C)
    targets = torch.tensor([[1, 2, 2], [3, 1, 0]])
    in_len, tgt_len = torch.tensor([8, 6]), torch.tensor([3, 2])

    def f(x):
        return F.ctc_loss(x.log_softmax(-1), targets, in_len, tgt_len, reduction=reduction)

    _ours_only(f, (logits,), order=1)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("weighted", [False, True])
def test_embedding_bag(mode, weighted):
    if weighted and mode != "sum":
        pytest.skip("per_sample_weights need mode='sum'")
    W = _x(6, 4)
    idx = torch.tensor([0, 2, 2, 5, 1, 3, 4])
    offsets = torch.tensor([0, 3, 3, 5])  # an empty bag
    psw = _x(7, seed=1)

    def f(W, psw):
        return F.embedding_bag(
            idx, W, offsets, mode=mode, per_sample_weights=psw if weighted else None
        )

    _ours_only(f, (W, psw), fd=mode != "max")
    if mode != "max":
        _ours_only(lambda W: F.embedding_bag(idx.reshape(-1)[:6].reshape(2, 3), W, mode=mode), (W,))
        _ours_only(lambda W: F.embedding_bag(idx, W, offsets, mode=mode, padding_idx=2), (W,))


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_upsample_antialias(mode):
    x = _x(1, 2, 6, 7)
    for kw in ({"scale_factor": 0.6}, {"size": (4, 9)}):
        compare_with_torch_func(
            lambda x, kw=kw: F.interpolate(x, mode=mode, antialias=True, **kw), (x,), order=2
        )


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align_corners", [False, True])
def test_grid_sample_3d(mode, padding_mode, align_corners):
    """vjp against torch.func; the jvp in the grid is ours only (finite differences)."""
    x = _x(2, 3, 3, 4, 5)
    grid = torch.rand(2, 2, 3, 2, 3, generator=torch.Generator().manual_seed(1), dtype=F64)
    grid = grid * 1.8 - 0.9

    def f(x, g):
        return F.grid_sample(
            x, g, mode=mode, padding_mode=padding_mode, align_corners=align_corners
        )

    _ours_only(f, (x, grid), order=1, fd=mode == "bilinear")
    _ours_only(lambda x: f(x, grid), (x,), order=1)  # torch has no forward mode at all


@pytest.mark.parametrize("causal", [False, True])
def test_scaled_dot_product_attention_forward_mode(causal):
    """jvp and jvp-of-vjp on CPU (torch has no forward mode there): ours only."""
    q, k, v = _x(2, 3, 4), _x(2, 5, 4, seed=1), _x(2, 5, 4, seed=2)
    if causal:
        k, v = k[:, :3], v[:, :3]

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    _ours_only(f, (q, k, v), order=2)


@pytest.mark.parametrize("sparse_ct", [True, False])
def test_to_sparse_vjp_is_to_dense(sparse_ct):
    """to_sparse changes the layout only: the cotangent comes back dense, as torch does."""
    x = _x(4, 5)
    ct = _x(4, 5, seed=1)
    ct = ct.to_sparse() if sparse_ct else ct
    for f in (lambda x: x.to_sparse(), lambda x: x.to_sparse(1)):
        (g,) = ft.vjp(f, x)[1](ct)
        assert g.layout == torch.strided
        torch.testing.assert_close(g, tf.vjp(f, x)[1](ct)[0])
    # through sparse arithmetic and back to dense
    f = lambda x: (x.to_sparse() * 3).to_dense().sum()  # noqa: E731
    torch.testing.assert_close(ft.grad(f)(x), tf.grad(f)(x))
