"""Ops on 0-d examples (a reduction over dim 0 of a scalar is the scalar) and as_strided, whose
sizes, strides and offset are relative to each example: cases the OpInfo conformance suite
found silently wrong."""

import pytest
import torch

import functransforms as ft
from functransforms.testing import check_vmap

ZERO_D = [
    lambda x: torch.logsumexp(x, (0,), True),
    lambda x: torch.argmax(x, 0, True),
    lambda x: torch.all(x > 0, 0, True),
    lambda x: torch.median(x, 0, True)[0],
    lambda x: torch.nansum(x, (0,), True),
    lambda x: torch.linalg.vector_norm(x, 2, (0,), True),
    lambda x: torch.sum(x, (0,), True),
    lambda x: torch.var_mean(x.expand(4), 0)[1],
    lambda x: torch.argmax(x),
    lambda x: torch.index_select(x, 0, torch.tensor([0])),
    lambda x: x.unfold(0, 1, 1),
]


@pytest.mark.parametrize("f", ZERO_D)
def test_reductions_and_selections_of_0d_examples(f):
    x = torch.randn(3, dtype=torch.float64)
    out = ft.vmap(f)(x)
    torch.testing.assert_close(out, torch.stack([f(v) for v in x]))
    torch.testing.assert_close(out, torch.func.vmap(f)(x))


def test_index_select_with_a_batched_index_on_0d_examples():
    x = torch.randn(3)
    check_vmap(lambda v, i: torch.index_select(v, 0, i), (x, torch.zeros(3, 1, dtype=torch.long)))


def test_multi_output_reductions_over_a_dim():
    x = torch.randn(3, 4, 5)
    for f in (lambda v: torch.var_mean(v, 0), lambda v: torch.std_mean(v, (0, 1), keepdim=True)):
        check_vmap(f, (x,), in_dims=1)


@pytest.mark.parametrize(
    "f",
    [
        lambda v: v.as_strided((2, 2), (1, 2), 0),
        lambda v: v[1:].as_strided((2,), (2,)),
        lambda v: v.as_strided((2,), (1,), 2),
        lambda v: torch.as_strided(v[:1], (1,), (1,), 0),
    ],
)
@pytest.mark.parametrize("in_dim", [0, 1])
def test_as_strided_is_relative_to_each_example(f, in_dim):
    y = torch.randn(3, 4).movedim(0, in_dim).contiguous()
    torch.testing.assert_close(ft.vmap(f, in_dims=in_dim)(y), torch.func.vmap(f, in_dims=in_dim)(y))
    if in_dim == 0:  # contiguous examples: the same as a loop over fresh (compact) copies
        torch.testing.assert_close(ft.vmap(f)(y), torch.stack([f(v.clone()) for v in y]))


@pytest.mark.parametrize(
    "size,stride,offset,in_dims",
    [((2, 2), (1, 2), 0, (0, 0)), ((2,), (2,), 1, (1, None)), ((), (), 0, (0, 0))],
)
def test_as_strided_scatter_is_relative_to_each_example(size, stride, offset, in_dims):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, generator=g)
    src = torch.randn((3, *size) if in_dims[1] == 0 else size, generator=g)
    xin = x if in_dims[0] == 0 else x.T.contiguous()

    def f(a, s):
        return torch.as_strided_scatter(a, s, size, stride, offset)

    srcs = src if in_dims[1] == 0 else [src] * 3
    expected = torch.stack([f(a.clone(), s) for a, s in zip(x, srcs)])  # fresh examples
    torch.testing.assert_close(ft.vmap(f, in_dims=in_dims)(xin, src), expected)


@pytest.mark.parametrize("in_dims", [0, 1, -1])
def test_view_copy_of_examples_that_are_not_contiguous(in_dims):
    """view_copy reshapes where a view cannot (eager's kernel): an example batched at dim 1 or
    last is not contiguous (conformance test_vmap_dims[view_copy-real] raised)."""
    x = torch.randn(5, 3, 5, dtype=torch.float64).movedim(1, in_dims)
    f = lambda v: torch.view_copy(v, (25,))  # noqa: E731
    out = ft.vmap(f, in_dims=in_dims, out_dims=-1)(x)
    loop = torch.stack([f(v) for v in x.unbind(in_dims)], -1)
    torch.testing.assert_close(out, loop)
    torch.testing.assert_close(out, torch.func.vmap(f, in_dims=in_dims, out_dims=-1)(x))
