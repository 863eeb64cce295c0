"""Indexing rules against torch.vmap, for every in_dims mix of (0, -1, None) plus dim 1."""

import pytest
import torch
import torch.nn.functional as Fn
from _vmap_helpers import build, check, check_loop, floats, ints, masks, mixes

CASES = {
    "getitem_int_tensor": (lambda x, i: x[i], [floats(5, 4), ints(5, 3)]),
    "getitem_2d_index": (lambda x, i: x[i], [floats(5, 4), ints(5, 2, 3)]),
    "getitem_second_dim": (lambda x, i: x[:, i], [floats(4, 5), ints(5, 3)]),
    "getitem_two_adjacent": (lambda x, i, j: x[:, i, j], [floats(2, 5, 4), ints(5, 3), ints(4, 3)]),
    "getitem_two_adjacent_front": (
        lambda x, i, j: x[i, j],
        [floats(5, 4, 2), ints(5, 3), ints(4, 3)],
    ),
    "getitem_non_adjacent": (lambda x, i, j: x[i, :, j], [floats(5, 2, 4), ints(5, 3), ints(4, 3)]),
    "getitem_broadcast_idx": (lambda x, i, j: x[i, j], [floats(5, 4), ints(5, 3, 1), ints(4, 2)]),
    "getitem_mask": (lambda x: x[torch.tensor([True, False, True, True])], [floats(4, 3)]),
    "getitem_mask_tail": (lambda x: x[:, torch.tensor([True, False, True])], [floats(4, 3)]),
    "getitem_ellipsis": (lambda x, i: x[..., i], [floats(2, 3, 5), ints(5, 4)]),
    "index_select": (lambda x, i: torch.index_select(x, 1, i), [floats(3, 5), ints(5, 4)]),
    "index_select_neg": (lambda x, i: torch.index_select(x, -2, i), [floats(5, 3), ints(5, 2)]),
    "gather": (lambda x, i: torch.gather(x, 1, i), [floats(3, 5), ints(5, 3, 4)]),
    "gather0": (lambda x, i: torch.gather(x, 0, i), [floats(5, 3), ints(5, 2, 3)]),
    "take_along_dim": (lambda x, i: torch.take_along_dim(x, i, 1), [floats(3, 5), ints(5, 3, 2)]),
    "scatter_src": (
        lambda x, i, s: x.scatter(1, i, s),
        [floats(3, 5), ints(5, 3, 2), floats(3, 2)],
    ),
    "scatter_value": (lambda x, i: x.scatter(0, i, 2.5), [floats(5, 3), ints(5, 2, 3)]),
    "scatter_add": (
        lambda x, i, s: x.scatter_add(1, i, s),
        [floats(3, 5), ints(5, 3, 4), floats(3, 4)],
    ),
    "scatter_reduce": (
        lambda x, i, s: x.scatter_reduce(1, i, s, "amax", include_self=False),
        [floats(3, 5), ints(5, 3, 4), floats(3, 4)],
    ),
    "index_add": (
        lambda x, i, s: x.index_add(1, i, s, alpha=2.0),
        [floats(3, 5), ints(5, 4), floats(3, 4)],
    ),
    "index_add0": (lambda x, i, s: x.index_add(0, i, s), [floats(5, 2), ints(5, 4), floats(4, 2)]),
    "index_copy": (
        lambda x, s: x.index_copy(1, torch.tensor([3, 0]), s),
        [floats(3, 5), floats(3, 2)],
    ),
    "index_fill": (lambda x, i: x.index_fill(1, i, -1.0), [floats(3, 5), ints(5, 2)]),
    "index_put": (
        lambda x, i, v: torch.index_put(x, (i,), v),
        [floats(5, 3), ints(5, 2), floats(2, 3)],
    ),
    "index_put_acc": (
        lambda x, i, v: torch.index_put(x, (i,), v, accumulate=True),
        [floats(5, 3), ints(5, 4), floats(4, 3)],
    ),
    "index_put_second": (
        lambda x, i, v: torch.index_put(x, (torch.arange(3)[:, None], i), v),
        [floats(3, 5), ints(5, 2), floats(3, 2)],
    ),
    "index_put_scalar_v": (
        lambda x, i, v: torch.index_put(x, (i,), v),
        [floats(5, 3), ints(5, 2), floats()],
    ),
    "masked_fill": (lambda x, m: x.masked_fill(m, 3.0), [floats(3, 4), masks(3, 4)]),
    "masked_fill_bcast": (lambda x, m: x.masked_fill(m, 3.0), [floats(3, 4), masks(4)]),
    "masked_fill_tensor": (
        lambda x, m, v: x.masked_fill(m, v),
        [floats(3, 4), masks(3, 4), floats()],
    ),
    "where": (lambda c, x, y: torch.where(c, x, y), [masks(3, 4), floats(3, 4), floats(4)]),
    "where_scalar": (lambda c, y: torch.where(c, 1.0, y), [masks(3, 4), floats(4)]),
    "embedding": (lambda w, i: Fn.embedding(i, w), [floats(6, 3), ints(6, 4)]),
    "embedding_2d": (lambda w, i: Fn.embedding(i, w), [floats(6, 3), ints(6, 2, 4)]),
    "slice_scatter": (
        lambda x, s: torch.slice_scatter(x, s, 1, 1, 5, 2),
        [floats(3, 6), floats(3, 2)],
    ),
    "select_scatter": (lambda x, s: torch.select_scatter(x, s, 0, 1), [floats(3, 4), floats(4)]),
    "diagonal_scatter": (lambda x, s: torch.diagonal_scatter(x, s, 1), [floats(4, 4), floats(3)]),
    "diagonal_scatter_dims": (
        lambda x, s: torch.diagonal_scatter(x, s, 0, -1, 0),
        [floats(3, 2, 3), floats(2, 3)],
    ),
    "new_zeros": (lambda x: x.new_zeros(2, 3) + x.sum(), [floats(4)]),
    "new_full": (lambda x: x.new_full((2,), 7.0) * x[0], [floats(4)]),
    "one_hot": (lambda i: Fn.one_hot(i, 5), [ints(5, 3)]),
}


# torch.vmap gets index_fill wrong for an unbatched self and a batched value (it fills every
# example with the last example's value), so these cases compare with the per-example loop.
LOOP_CASES = {
    "index_fill_tensor": (
        lambda x, v: x.index_fill(1, torch.tensor([0, 2]), v),
        [floats(3, 5), floats()],
    ),
    "index_fill_tensor_0d": (
        lambda x, v: x.index_fill(0, torch.tensor(0), v),
        [floats(), floats()],
    ),
}


@pytest.mark.parametrize("name", sorted(LOOP_CASES))
def test_indexing_matches_loop(name):
    fn, specs = LOOP_CASES[name]
    for in_dims in mixes(specs):
        check_loop(fn, in_dims, *build(specs, in_dims))


def test_setitem_with_batched_index_matches_loop():
    # x[:, idx] = v: torch.vmap gets in_dims=(1, 0, 1) wrong, so the oracle is the loop
    def f(x, s, v):
        x = x.clone()
        x[:, (torch.tensor([0, 2]) + s) % 5] = v
        return x

    specs = [floats(2, 5, 3), ints(5), floats(2, 2, 3)]
    for in_dims in mixes(specs, choices=(0, -1), extra=(1,)) + [(0, None, None), (2, 0, None)]:
        check_loop(f, in_dims, *build(specs, in_dims))


def test_setitem_into_unbatched_raises_inplace_error():
    from functransforms import vmap
    from functransforms.errors import InplaceError

    def f(x, v):
        x = x.clone()
        x[torch.tensor([0, 2])] = v
        return x

    with pytest.raises(InplaceError, match=r"aten\.index_put_\.default writes a batched value"):
        vmap(f, in_dims=(None, 0))(torch.randn(4), torch.randn(3, 2))


def _setitem(x, idx, v):
    x = x.clone()
    x[idx] = v
    return x


@pytest.mark.parametrize("name", sorted(CASES))
def test_indexing_matches_torch_vmap(name):
    fn, specs = CASES[name]
    for in_dims in mixes(specs):
        args = build(specs, in_dims)
        check(fn, in_dims, *args)


def test_nested_vmap_gather_and_index():
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    i = torch.randint(0, 5, (2, 4))

    def f(x, i):
        return torch.gather(x, 0, i) + x[i].sum()

    from functransforms import vmap

    out = vmap(vmap(f, in_dims=(0, None)), in_dims=(0, 0))(x, i)
    ref = torch.vmap(torch.vmap(f, in_dims=(0, None)), in_dims=(0, 0))(x, i)
    torch.testing.assert_close(out, ref)


def test_index_put_inplace_batched_self():
    def f(x, i, v):
        x = x.clone()
        x.index_put_((i,), v, accumulate=True)
        return x

    for in_dims in [(0, 0, 0), (0, None, 0), (0, 0, None), (-1, None, None)]:
        args = build([floats(5, 3), ints(5, 4), floats(4, 3)], in_dims)
        check(f, in_dims, *args)


def test_scatter_inplace_and_index_add_inplace():
    def f(x, i, s):
        y = x.clone()
        y.scatter_add_(1, i, s)
        y.index_add_(1, i[0, :2], s[:, 1:3])
        return y

    for in_dims in [(0, 0, 0), (0, None, None), (1, 0, None), (-1, None, 0)]:
        args = build([floats(3, 5), ints(3, 3, 4), floats(3, 4)], in_dims)
        check(f, in_dims, *args)


def test_batched_bool_mask_is_data_dependent():
    from functransforms import vmap
    from functransforms.errors import DataDependentError

    x = torch.randn(3, 4)
    with pytest.raises(DataDependentError, match=r"aten\.index\.Tensor"):
        vmap(lambda x: x[x > 0])(x)


@pytest.mark.parametrize(
    "kw",
    [
        dict(padding_idx=0),
        dict(scale_grad_by_freq=True),
        dict(padding_idx=1, scale_grad_by_freq=True),
    ],
)
def test_embedding_derivative_of_the_batched_call_matches_loop(kw):
    """padding_idx and scale_grad_by_freq act on the derivative taken of the physical call:
    with a flattened per-example table padding_idx held only batch 0's row (an ensemble of
    nn.Embedding(padding_idx=0) under autograd got gradients on the other padding rows), and
    a shared table counted the indices of the whole batch (PyTorch too)."""
    from functransforms import grad, jvp, vmap

    g = torch.Generator().manual_seed(0)
    wb, w = torch.randn(3, 6, 2, generator=g), torch.randn(6, 2, generator=g)
    idx = torch.tensor([[0, 0, 2], [1, 0, 3], [1, 1, 1]])
    c = torch.randn(3, 3, 2, generator=g)
    emb = lambda i, w: Fn.embedding(i, w, **kw)
    loop_b = torch.stack(
        [torch.func.grad(lambda w, b=b: (emb(idx[1], w) * c[b]).sum())(wb[b]) for b in range(3)]
    )
    loop_u = sum(torch.func.grad(lambda w, b=b: (emb(idx[b], w) * c[b]).sum())(w) for b in range(3))
    x = wb.clone().requires_grad_()
    (vmap(lambda w: emb(idx[1], w))(x) * c).sum().backward()
    torch.testing.assert_close(x.grad, loop_b)
    torch.testing.assert_close(
        grad(lambda x: (vmap(lambda w: emb(idx[1], w))(x) * c).sum())(wb), loop_b
    )
    x = w.clone().requires_grad_()
    (vmap(lambda i: emb(i, x))(idx) * c).sum().backward()
    torch.testing.assert_close(x.grad, loop_u)
    torch.testing.assert_close(
        grad(lambda x: (vmap(lambda i: emb(i, x))(idx) * c).sum())(w), loop_u
    )
    # the forward derivative stays embedding's (the padding rows move)
    t = torch.randn(3, 6, 2, generator=g)
    f = lambda w: vmap(lambda w, i: emb(i, w))(w, idx)
    ref = lambda w: torch.func.vmap(lambda w, i: emb(i, w))(w, idx)
    torch.testing.assert_close(jvp(f, (wb,), (t,)), torch.func.jvp(ref, (wb,), (t,)))


def test_masked_select_with_a_mask_of_higher_rank():
    """x (4,) and mask (4, 4) broadcast to (4, 4): the rule expanded x's physical (B, 4) to
    (B, 4, 4) without padding, so the batch dim aligned with the mask's first dim (a wrong
    jacfwd when B = 4, an error otherwise)."""
    from functransforms import jacfwd, vmap

    mask = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 1]]).bool()
    x = torch.randn(4, dtype=torch.float64)
    f = lambda x: x.masked_select(mask)
    torch.testing.assert_close(jacfwd(f)(x), torch.func.jacfwd(f)(x))
    for B, d in [(4, 0), (3, 0), (4, 1)]:  # torch.vmap raises here: the oracle is the loop
        xs = torch.randn(B, 4) if d == 0 else torch.randn(4, B)
        torch.testing.assert_close(
            vmap(f, in_dims=d)(xs), torch.stack([f(r) for r in xs.movedim(d, 0)])
        )
