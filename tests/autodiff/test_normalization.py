"""Normalization under jvp, vjp, grad, second order and vmap, against torch.func (float64) and,
for the mean/rstd outputs that torch.func does not differentiate, finite differences
(Note [Normalization derivatives], Note [Batching batch norm])."""

import pytest
import torch
import torch.nn.functional as F
from _ad_helpers import assert_trees_close, compare_with_torch_func

import functransforms as ft
from functransforms.errors import InplaceError
from functransforms.testing import check_grads

F64 = torch.float64
aten = torch.ops.aten


def _x():
    return torch.randn(4, 6, 3, 3, dtype=F64)


def _wb(c=6):
    return torch.randn(c, dtype=F64), torch.randn(c, dtype=F64)


def _stats(c=6):
    return torch.randn(c, dtype=F64), torch.rand(c, dtype=F64) + 0.5


FUNCTIONAL = {
    "layer_norm": lambda x, w, b: F.layer_norm(x, (3, 3), w[:3].repeat(3, 1), b[:3].repeat(3, 1)),
    "layer_norm_no_affine": lambda x, w, b: F.layer_norm(x, (6, 3, 3)),
    "group_norm": lambda x, w, b: F.group_norm(x, 3, w, b),
    "group_norm_2d": lambda x, w, b: F.group_norm(x[:, :, 0, 0], 2, w, b),
    "instance_norm": lambda x, w, b: F.instance_norm(x, weight=w, bias=b),
    "rms_norm": lambda x, w, b: F.rms_norm(x, (3,), w[:3]),
    "batch_norm_train_no_stats": lambda x, w, b: F.batch_norm(x, None, None, w, b, True),
    "batch_norm_1d": lambda x, w, b: F.batch_norm(x[..., 0, 0], None, None, w, b, True),
    "batch_norm_eval": lambda x, w, b: F.batch_norm(x, *_fixed_stats(), w, b, False),
}
_FIXED = _stats()


def _fixed_stats():
    return _FIXED


@pytest.mark.parametrize("name", sorted(FUNCTIONAL))
def test_norm_matches_torch_func(name):
    f = FUNCTIONAL[name]
    x, (w, b) = _x(), _wb()
    compare_with_torch_func(f, (x, w, b), check=False)
    check_grads(f, (x[:2], w, b))


@pytest.mark.parametrize("name", sorted(FUNCTIONAL))
def test_norm_second_order(name):
    f = FUNCTIONAL[name]
    x, (w, b) = _x()[:2], _wb()

    def loss(x, w, b):
        return (torch.tanh(f(x, w, b)) ** 2).sum()

    v = tuple(torch.randn_like(a) for a in (x, w, b))
    argnums = (0, 1, 2)

    def gv(g):
        return lambda *a: sum((gi * vi).sum() for gi, vi in zip(g(loss, argnums)(*a), v))

    assert_trees_close(
        ft.grad(gv(ft.grad), argnums)(x, w, b),
        torch.func.grad(gv(torch.func.grad), argnums)(x, w, b),
    )
    assert_trees_close(ft.hessian(loss)(x, w, b), torch.func.hessian(loss)(x, w, b))
    assert_trees_close(
        ft.jacfwd(ft.jacrev(loss, 1), 1)(x, w, b),
        torch.func.jacfwd(torch.func.jacrev(loss, 1), 1)(x, w, b),
    )


NATIVE = {
    "native_layer_norm": lambda x, w, b: aten.native_layer_norm(
        x, [3, 3], w[:3].repeat(3, 1), b[:3].repeat(3, 1), 1e-5
    ),
    "native_group_norm": lambda x, w, b: aten.native_group_norm(x, w, b, 4, 6, 9, 3, 1e-5),
    "native_batch_norm": lambda x, w, b: aten.native_batch_norm(
        x, w, b, None, None, True, 0.1, 1e-5
    ),
    "_native_batch_norm_legit.no_stats": lambda x, w, b: aten._native_batch_norm_legit(
        x, w, b, True, 0.1, 1e-5
    ),
}


@pytest.mark.parametrize("output", [0, 1, 2])
@pytest.mark.parametrize("name", sorted(NATIVE))
def test_every_output_of_native_norms_carries_derivatives(name, output):
    """torch.func treats mean and rstd as constants (its vjp ignores their cotangents); finite
    differences decide. Output 0 is also compared with torch.func."""
    f = NATIVE[name]
    x, (w, b) = _x(), _wb()

    def g(x, w, b):
        return f(x, w, b)[output]

    check_grads(g, (x, w, b), order=2 if output else 1)
    if output == 0:
        compare_with_torch_func(g, (x, w, b), check=False)


def test_layer_norm_mean_rstd_cotangents_change_the_gradient():
    """The reported bug: the vjp ignored the cotangents of mean and rstd."""
    x = torch.randn(3, 5, dtype=F64)
    out, vjp_fn = ft.vjp(lambda x: aten.native_layer_norm(x, [5], None, None, 1e-5), x)
    ct_mean = torch.randn_like(out[1])
    g = vjp_fn((torch.zeros_like(out[0]), ct_mean, torch.zeros_like(out[2])))[0]
    torch.testing.assert_close(g, (ct_mean / 5).expand(3, 5))


@pytest.mark.parametrize("momentum", [0.1, 0.5])
def test_batch_norm_running_stats_update_under_grad_jvp_and_vmap(momentum):
    x, (w, b) = _x(), _wb()
    ours_stats, ref_stats = _stats(), None
    ref_stats = tuple(s.clone() for s in ours_stats)

    def f(stats):
        return lambda x, w, b: F.batch_norm(x, *stats, w, b, True, momentum).pow(2).sum()

    g = ft.grad(f(ours_stats), (0, 1, 2))(x, w, b)
    gr = torch.func.grad(f(ref_stats), (0, 1, 2))(x, w, b)
    assert_trees_close(g, gr)
    assert_trees_close(ours_stats, ref_stats)
    t = tuple(torch.randn_like(a) for a in (x, w, b))
    assert_trees_close(
        ft.jvp(f(ours_stats), (x, w, b), t), torch.func.jvp(f(ref_stats), (x, w, b), t)
    )
    assert_trees_close(ours_stats, ref_stats)
    # batched running statistics under vmap (each example keeps its own)
    xs = torch.randn(3, 4, 6, 2, 2, dtype=F64)
    ours_b = tuple(torch.stack([s] * 3) for s in ours_stats)
    ref_b = tuple(s.clone() for s in ours_b)

    def h(x, m, v):
        return F.batch_norm(x, m, v, w, b, True, momentum)

    assert_trees_close(ft.vmap(h)(xs, *ours_b), torch.func.vmap(h)(xs, *ref_b))
    assert_trees_close(ours_b, ref_b)
    assert not torch.equal(ours_b[0][0], ours_b[0][1])


def test_batch_norm_unbatched_running_stats_in_training_under_vmap_raise():
    stats = _stats()
    xs = torch.randn(3, 4, 6, 2, 2, dtype=F64)
    with pytest.raises(InplaceError, match="running_mean"):
        ft.vmap(lambda x: F.batch_norm(x, *stats, training=True))(xs)
    # eval mode only reads them
    ours = ft.vmap(lambda x: F.batch_norm(x, *stats, training=False))(xs)
    ref = torch.func.vmap(lambda x: F.batch_norm(x, *stats, training=False))(xs)
    assert_trees_close(ours, ref)


@pytest.mark.parametrize(
    "f",
    [
        lambda x, w, b: aten.native_group_norm(x, w, b, 4, 6, 9, 3, 1e-5),
        lambda x, w, b: aten._native_batch_norm_legit(x, w, b, True, 0.1, 1e-5),
        lambda x, w, b: aten.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5),
        lambda x, w, b: aten._native_batch_norm_legit_no_training(x, w, b, *_FIXED, 0.1, 1e-5)[0],
        lambda x, w, b: aten.native_layer_norm(x, [3], w[:3], b[:3], 1e-5),
    ],
    ids=["group_norm", "bn_legit", "native_batch_norm", "bn_no_training", "layer_norm"],
)
@pytest.mark.parametrize("in_dims", [(0, None, None), (1, 0, 0), (None, 0, None)])
def test_native_norms_under_vmap(f, in_dims):
    x, (w, b) = _x(), _wb()
    args = [
        torch.randn((3,) + tuple(a.shape), dtype=F64).movedim(0, d) if d is not None else a
        for a, d in zip((x, w, b), in_dims)
    ]
    if in_dims[0] == 1:
        args[0] = args[0].contiguous()
    assert_trees_close(ft.vmap(f, in_dims)(*args), torch.func.vmap(f, in_dims)(*args))
    out0 = lambda *a: f(*a)[0] if isinstance(f(*a), tuple) else f(*a)  # noqa: E731
    loss = lambda *a: (out0(*a) ** 2).sum()  # noqa: E731
    assert_trees_close(
        ft.vmap(ft.grad(loss, (0, 1, 2)), in_dims)(*args),
        torch.func.vmap(torch.func.grad(loss, (0, 1, 2)), in_dims)(*args),
    )


def test_batch_norm_double_backward():
    x, (w, b) = _x(), _wb()

    def loss(x, w, b):
        return (F.batch_norm(x, None, None, w, b, True) ** 3).sum()

    v = torch.randn_like(x)
    ours = ft.grad(lambda x, w, b: (ft.grad(loss)(x, w, b) * v).sum(), (0, 1, 2))(x, w, b)
    ref = torch.func.grad(lambda x, w, b: (torch.func.grad(loss)(x, w, b) * v).sum(), (0, 1, 2))(
        x, w, b
    )
    assert_trees_close(ours, ref)
