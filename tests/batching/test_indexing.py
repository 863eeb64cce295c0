"""Indexing rules against torch.vmap, for every in_dims mix of (0, -1, None) plus dim 1."""

import pytest
import torch
import torch.nn.functional as Fn
from _vmap_helpers import F, I, M, build, check, check_loop, mixes

CASES = {
    "getitem_int_tensor": (lambda x, i: x[i], [F(5, 4), I(5, 3)]),
    "getitem_2d_index": (lambda x, i: x[i], [F(5, 4), I(5, 2, 3)]),
    "getitem_second_dim": (lambda x, i: x[:, i], [F(4, 5), I(5, 3)]),
    "getitem_two_adjacent": (lambda x, i, j: x[:, i, j], [F(2, 5, 4), I(5, 3), I(4, 3)]),
    "getitem_two_adjacent_front": (lambda x, i, j: x[i, j], [F(5, 4, 2), I(5, 3), I(4, 3)]),
    "getitem_non_adjacent": (lambda x, i, j: x[i, :, j], [F(5, 2, 4), I(5, 3), I(4, 3)]),
    "getitem_broadcast_idx": (lambda x, i, j: x[i, j], [F(5, 4), I(5, 3, 1), I(4, 2)]),
    "getitem_mask": (lambda x: x[torch.tensor([True, False, True, True])], [F(4, 3)]),
    "getitem_mask_tail": (lambda x: x[:, torch.tensor([True, False, True])], [F(4, 3)]),
    "getitem_ellipsis": (lambda x, i: x[..., i], [F(2, 3, 5), I(5, 4)]),
    "index_select": (lambda x, i: torch.index_select(x, 1, i), [F(3, 5), I(5, 4)]),
    "index_select_neg": (lambda x, i: torch.index_select(x, -2, i), [F(5, 3), I(5, 2)]),
    "gather": (lambda x, i: torch.gather(x, 1, i), [F(3, 5), I(5, 3, 4)]),
    "gather0": (lambda x, i: torch.gather(x, 0, i), [F(5, 3), I(5, 2, 3)]),
    "take_along_dim": (lambda x, i: torch.take_along_dim(x, i, 1), [F(3, 5), I(5, 3, 2)]),
    "scatter_src": (lambda x, i, s: x.scatter(1, i, s), [F(3, 5), I(5, 3, 2), F(3, 2)]),
    "scatter_value": (lambda x, i: x.scatter(0, i, 2.5), [F(5, 3), I(5, 2, 3)]),
    "scatter_add": (lambda x, i, s: x.scatter_add(1, i, s), [F(3, 5), I(5, 3, 4), F(3, 4)]),
    "scatter_reduce": (
        lambda x, i, s: x.scatter_reduce(1, i, s, "amax", include_self=False),
        [F(3, 5), I(5, 3, 4), F(3, 4)],
    ),
    "index_add": (lambda x, i, s: x.index_add(1, i, s, alpha=2.0), [F(3, 5), I(5, 4), F(3, 4)]),
    "index_add0": (lambda x, i, s: x.index_add(0, i, s), [F(5, 2), I(5, 4), F(4, 2)]),
    "index_copy": (
        lambda x, s: x.index_copy(1, torch.tensor([3, 0]), s),
        [F(3, 5), F(3, 2)],
    ),
    "index_fill": (lambda x, i: x.index_fill(1, i, -1.0), [F(3, 5), I(5, 2)]),
    "index_put": (lambda x, i, v: torch.index_put(x, (i,), v), [F(5, 3), I(5, 2), F(2, 3)]),
    "index_put_acc": (
        lambda x, i, v: torch.index_put(x, (i,), v, accumulate=True),
        [F(5, 3), I(5, 4), F(4, 3)],
    ),
    "index_put_second": (
        lambda x, i, v: torch.index_put(x, (torch.arange(3)[:, None], i), v),
        [F(3, 5), I(5, 2), F(3, 2)],
    ),
    "index_put_scalar_v": (lambda x, i, v: torch.index_put(x, (i,), v), [F(5, 3), I(5, 2), F()]),
    "masked_fill": (lambda x, m: x.masked_fill(m, 3.0), [F(3, 4), M(3, 4)]),
    "masked_fill_bcast": (lambda x, m: x.masked_fill(m, 3.0), [F(3, 4), M(4)]),
    "masked_fill_tensor": (lambda x, m, v: x.masked_fill(m, v), [F(3, 4), M(3, 4), F()]),
    "where": (lambda c, x, y: torch.where(c, x, y), [M(3, 4), F(3, 4), F(4)]),
    "where_scalar": (lambda c, y: torch.where(c, 1.0, y), [M(3, 4), F(4)]),
    "embedding": (lambda w, i: Fn.embedding(i, w), [F(6, 3), I(6, 4)]),
    "embedding_2d": (lambda w, i: Fn.embedding(i, w), [F(6, 3), I(6, 2, 4)]),
    "slice_scatter": (lambda x, s: torch.slice_scatter(x, s, 1, 1, 5, 2), [F(3, 6), F(3, 2)]),
    "select_scatter": (lambda x, s: torch.select_scatter(x, s, 0, 1), [F(3, 4), F(4)]),
    "diagonal_scatter": (lambda x, s: torch.diagonal_scatter(x, s, 1), [F(4, 4), F(3)]),
    "diagonal_scatter_dims": (
        lambda x, s: torch.diagonal_scatter(x, s, 0, -1, 0),
        [F(3, 2, 3), F(2, 3)],
    ),
    "new_zeros": (lambda x: x.new_zeros(2, 3) + x.sum(), [F(4)]),
    "new_full": (lambda x: x.new_full((2,), 7.0) * x[0], [F(4)]),
    "one_hot": (lambda i: Fn.one_hot(i, 5), [I(5, 3)]),
}


# torch.vmap gets index_fill wrong for an unbatched self and a batched value (it fills every
# example with the last example's value), so these cases compare with the per-example loop.
LOOP_CASES = {
    "index_fill_tensor": (lambda x, v: x.index_fill(1, torch.tensor([0, 2]), v), [F(3, 5), F()]),
    "index_fill_tensor_0d": (lambda x, v: x.index_fill(0, torch.tensor(0), v), [F(), F()]),
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

    specs = [F(2, 5, 3), I(5), F(2, 2, 3)]
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
        args = build([F(5, 3), I(5, 4), F(4, 3)], in_dims)
        check(f, in_dims, *args)


def test_scatter_inplace_and_index_add_inplace():
    def f(x, i, s):
        y = x.clone()
        y.scatter_add_(1, i, s)
        y.index_add_(1, i[0, :2], s[:, 1:3])
        return y

    for in_dims in [(0, 0, 0), (0, None, None), (1, 0, None), (-1, None, 0)]:
        args = build([F(3, 5), I(3, 3, 4), F(3, 4)], in_dims)
        check(f, in_dims, *args)


def test_batched_bool_mask_is_data_dependent():
    from functransforms import vmap
    from functransforms.errors import DataDependentError

    x = torch.randn(3, 4)
    with pytest.raises(DataDependentError, match=r"aten\.index\.Tensor"):
        vmap(lambda x: x[x > 0])(x)
