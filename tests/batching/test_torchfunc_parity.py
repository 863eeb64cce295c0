"""vmap cases that are easy to get wrong (a crash, a loop, a wrong value), against torch.func.

Each case runs ``ft.vmap`` and ``torch.vmap`` on the same inputs (``check``: equal values, no
per-example fallback) over the in_dims mixes that matter for the bug.
"""

import pytest
import torch
from _vmap_helpers import check

import functransforms as ft

F = torch.nn.functional
DT = torch.float64


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed=0):
    return torch.randn(shape, dtype=DT, generator=_g(seed))


# -- gather / take / bucketize / searchsorted --------------------------------------------------


@pytest.mark.parametrize(
    "x_shape,i_shape,in_dims",
    [
        ((3,), (3, 1), (0, 0)),  # 0-d self, 1-d index: the result has the index's shape (1,)
        ((3, 4), (3,), (0, 0)),  # 1-d self, 0-d index: 0-d result
        ((3,), (1,), (0, None)),
        ((3,), (), (0, None)),
        ((), (3, 1), (None, 0)),
        ((3, 4, 5), (3, 4, 2), (0, 0)),
    ],
)
def test_gather_zero_d_examples(x_shape, i_shape, in_dims):
    x = randn(*x_shape)
    logical = x_shape[1:] if in_dims[0] == 0 else x_shape
    n = logical[-1] if logical else 1
    idx = torch.randint(0, n, i_shape, generator=_g(1))
    check(lambda x, i: torch.gather(x, -1 if x.dim() else 0, i), in_dims, x, idx)


@pytest.mark.parametrize("in_dims", [(0, 0), (0, None), (None, 0)])
def test_take_batched_indices(in_dims):
    x = randn(3, 4, 5) if in_dims[0] == 0 else randn(4, 5)
    i = torch.tensor([[-1, 2, 19], [0, -20, 7], [3, 3, 3]])
    check(torch.take, in_dims, x, i if in_dims[1] == 0 else i[0])


def test_take_zero_d_examples():
    check(torch.take, (0, 0), randn(3), torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("in_dims", [(0, 0), (0, None), (None, 0)])
@pytest.mark.parametrize("x_shape", [(), (2, 2)])
@pytest.mark.parametrize("right", [False, True])
def test_bucketize_batched_boundaries(in_dims, x_shape, right):
    x = randn(3, *x_shape) if in_dims[0] == 0 else randn(*x_shape)
    b = torch.sort(randn(3, 5, seed=2)).values if in_dims[1] == 0 else randn(5).sort().values

    def f(x, b):
        return torch.bucketize(x, b, right=right, out_int32=right)

    check(f, in_dims, x, b)


@pytest.mark.parametrize("in_dims", [(0, 0), (0, None), (None, 0)])
def test_searchsorted_batched_boundaries(in_dims):
    b = torch.sort(randn(3, 2, 5)).values
    x = randn(3, 2, 6, seed=1)
    check(
        torch.searchsorted, in_dims, b if in_dims[0] == 0 else b[0], x if in_dims[1] == 0 else x[0]
    )


# -- sort / slice ---------------------------------------------------------------------------


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("dim", [0, -1])
def test_sort_argsort_stable(descending, dim):
    x = torch.tensor([[1.0, 2.0, 1.0, 0.0], [3.0, 3.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]).repeat(
        3, 1, 1
    )
    check(lambda x: torch.sort(x, stable=True, dim=dim, descending=descending), 0, x)
    check(lambda x: torch.argsort(x, stable=True, dim=dim, descending=descending), 1, x)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x[2:100],
        lambda x: x[-100:2],
        lambda x: torch.ops.aten.slice(x, dim=1, start=1, end=-2),
        lambda x: torch.ops.aten.slice(x, 0, -100, 100, 2),
        lambda x: torch.ops.aten.slice(x),
    ],
)
def test_slice_bounds_and_keywords(fn):
    check(fn, 0, randn(3, 5, 4))


# -- nn -------------------------------------------------------------------------------------


def test_sdpa_dropout_zero_is_not_random():
    q = randn(3, 2, 4, 8)
    m = randn(3, 4, 4, seed=1)
    check(lambda q, m: F.scaled_dot_product_attention(q, q, q, attn_mask=m, dropout_p=0.0), 0, q, m)
    check(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), 0, q)


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


@pytest.mark.parametrize("in_dims", [(0, 0), (0, None), (None, 0), (1, 0)])
def test_flash_attention_for_cpu_folds_the_batch_into_n(in_dims):
    """The op torch 2.15's sdpa reaches vmap as: a rule (no loop) with a batched or shared
    q and attn_mask, both outputs (logsumexp too) equal to the per-example loop."""
    from _vmap_helpers import check_loop

    q = randn(2, 4, 5, 8) if in_dims[0] is None else randn(3, 2, 4, 5, 8).movedim(0, in_dims[0])
    # a mask has 2 or 4 dims per example
    m = randn(2, 4, 5, 5, seed=1) if in_dims[1] is None else randn(3, 5, 5, seed=1)
    check_loop(lambda q, m: _FLASH_CPU(q, q, q, attn_mask=m), in_dims, q, m)


@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"attn_mask": "mask"}])
def test_flash_attention_for_cpu_under_vjp_and_jvp_keeps_logsumexp(kw):
    """jvp/vjp run the op through its decomposition, whose second output must be the kernel's
    logsumexp [N, H, L] (torch's returns the attention weights there)."""
    q, k = randn(2, 3, 4, 8), randn(2, 3, 6, 8, seed=1)
    kw = {**kw, "attn_mask": randn(4, 6, seed=2)} if "attn_mask" in kw else kw
    out, lse = _FLASH_CPU(q, k, k, **kw)
    (o1, l1), _ = ft.vjp(lambda q: _FLASH_CPU(q, k, k, **kw), q)
    (o2, l2), (t_out, t_lse) = ft.jvp(lambda q: _FLASH_CPU(q, k, k, **kw), (q,), (q,))
    for o, lo in ((o1, l1), (o2, l2)):
        torch.testing.assert_close(o, out)
        torch.testing.assert_close(lo, lse)
    assert t_lse.shape == lse.shape


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(5,), (4, 5)])
def test_multilabel_margin_loss_terminator(reduction, shape):
    """Labels after the first -1 are ignored (torch's decomposition counted them as class 0)."""
    x = randn(3, *shape)
    t = torch.tensor([3, 0, -1, 1, 2]).expand(3, *shape).clone()
    t[1, ..., 1] = -1
    t[2, ..., 4] = 4

    def f(x, t):
        return F.multilabel_margin_loss(x, t, reduction=reduction)

    loop = torch.stack([f(x[i], t[i]) for i in range(3)])
    torch.testing.assert_close(ft.vmap(f)(x, t), loop)
    torch.testing.assert_close(ft.vmap(f, (0, None))(x, t[0]), ft.vmap(f)(x, t[0].expand_as(t)))
    g = ft.vmap(ft.grad(lambda x, t: f(x, t).sum()))(x, t)
    ref = torch.func.vmap(torch.func.grad(lambda x, t: f(x, t).sum()))(x, t)
    torch.testing.assert_close(g, ref)


def test_multilabel_margin_loss_paper_value():
    """Under vmap, the loss of this input is torch's value (1.294), per example."""
    torch.manual_seed(0)
    x = torch.randn(4, 5, dtype=DT)
    t = torch.tensor([[3, 0, -1, 1, 2]] * 4)
    torch.testing.assert_close(
        ft.vmap(F.multilabel_margin_loss)(x[None].expand(2, 4, 5), t[None].expand(2, 4, 5))[0],
        F.multilabel_margin_loss(x, t),
    )


@pytest.mark.parametrize("in_dims", [(0, 0, 0), (0, None, 0), (0, 0, None), (None, 0, None)])
def test_index_add(in_dims):
    x, i, s = randn(3, 4, 2), torch.tensor([[0, 2, 0], [1, 1, 1], [3, 0, 3]]), randn(3, 3, 2)
    args = [a if d == 0 else a[0] for a, d in zip((x, i, s), in_dims)]
    check(lambda x, i, s: x.index_add(0, i, s, alpha=2), in_dims, *args)


@pytest.mark.parametrize("mode", ["circular", "reflect", "replicate"])
@pytest.mark.parametrize("pad,shape", [((1, 2), (2, 4)), ((1, 2, 2, 1), (2, 4, 5))])
def test_pad_modes(mode, pad, shape):
    check(lambda x: F.pad(x, pad, mode=mode), 0, randn(3, *shape))
    check(lambda x: F.pad(x, pad, mode=mode), 1, randn(shape[0], 3, *shape[1:]))


@pytest.mark.parametrize(
    "size,stride",
    [((4, 5), (0, 1)), ((2, 3, 5), (0, 5, 1)), ((3, 3), (1, 1)), ((5, 2), (1, 0))],
)
def test_as_strided_expand_patterns(size, stride):
    check(lambda x: x.as_strided(size, stride), 0, randn(3, 3, 5))


@pytest.mark.parametrize("return_indices", [False, True])
def test_adaptive_max_pool3d(return_indices):
    check(lambda x: F.adaptive_max_pool3d(x, 2, return_indices), 0, randn(3, 2, 4, 4, 4))
    check(lambda x: F.adaptive_max_pool3d(x, (1, 2, 3), return_indices), 1, randn(2, 3, 2, 4, 4, 4))


@pytest.mark.parametrize("shape", [(5,), (4, 5)])
def test_multinomial_batched_probabilities(shape):
    p = torch.rand(3, *shape, dtype=DT, generator=_g())
    p[0, ..., 2:] = 0  # example 0 draws from {0, 1} only, example 1 from {3, 4}
    p[1, ..., :3] = 0
    out = ft.vmap(lambda p: torch.multinomial(p, 2), randomness="different")(p)
    assert out.shape == (3, *shape[:-1], 2)
    assert set(out[0].flatten().tolist()) <= {0, 1}
    assert set(out[1].flatten().tolist()) <= {3, 4}
    for row in out.reshape(-1, 2):  # without replacement
        assert row[0] != row[1]
    with pytest.raises(RuntimeError, match="randomness='same'"):  # as torch.func
        ft.vmap(lambda p: torch.multinomial(p, 2), randomness="same")(p)


# -- batching rules where torch.func has them (no per-example loop) ---------------------------


@pytest.mark.parametrize("in_dims", [(0, 0, 0), (0, None, None), (None, 0, None), (None, None, 0)])
def test_addbmm(in_dims):
    args = [randn(3, 4, 6), randn(3, 2, 4, 5, seed=1), randn(3, 2, 5, 6, seed=2)]
    args = [a if d == 0 else a[0] for a, d in zip(args, in_dims)]
    check(lambda b, x, y: torch.addbmm(b, x, y, beta=0.5, alpha=2), in_dims, *args)


@pytest.mark.parametrize("in_dims", [0, 1, -1])
def test_masked_select_unbatched_mask(in_dims):
    mask = torch.rand(4, 5, generator=_g()) > 0.5
    x = randn(3, 4, 5).movedim(0, in_dims)
    check(lambda x: torch.masked_select(x, mask), in_dims, x)
    check(lambda x: torch.masked_select(x, mask[0]), in_dims, x)


def test_nanmedian():
    x = randn(3, 7)
    x[0, 2] = float("nan")
    check(torch.nanmedian, 0, x)
    check(lambda x: torch.nanmedian(x, 0), 0, x)
    check(lambda x: torch.nanmedian(x, -1, keepdim=True), 0, randn(3, 4, 5))


def test_grid_sampler_3d_and_antialiased_upsampling():
    x, grid = (
        randn(3, 2, 2, 4, 4, 4),
        torch.rand(3, 2, 3, 3, 3, 3, dtype=DT, generator=_g()) * 2 - 1,
    )
    check(lambda x, g: torch.grid_sampler_3d(x, g, 0, 0, False), (0, 0), x, grid)
    check(lambda x, g: torch.grid_sampler_3d(x, g, 1, 1, True), (None, 0), x[0], grid)
    for mode in ("bilinear", "bicubic"):
        check(
            lambda x, mode=mode: F.interpolate(x, size=(4, 5), mode=mode, antialias=True),
            0,
            randn(3, 2, 3, 10, 12),
        )


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.softmax(x, -1),
        lambda x: F.scaled_dot_product_attention(x, x, x),
        lambda x: x.flatten(1, 2).unflatten(1, (4, 10)),
        lambda x: torch.atleast_3d(x[0, 0]),
        lambda x: torch.outer(x[0, 0], x[1, 1]),
        lambda x: x.narrow(1, 1, 2),
        lambda x: torch.tensor_split(x, 3, dim=-1),
        lambda x: F.glu(x, -1),
        lambda x: x.T,
    ],
)
def test_composite_ops_batch_without_a_loop(fn):
    """CompositeImplicitAutograd ops that a rule or decomposition hands to vmap whole run their
    composite kernel op by op (Note [Composite ops inside rules]), not the per-example loop."""
    check(fn, 0, randn(3, 2, 4, 10))
    check(fn, 2, randn(2, 4, 3, 10))
