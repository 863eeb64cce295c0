"""torch.tensor_split with a tensor of split points under the transforms. torch's composite
kernel reads the points' memory directly; ours reads them through the transforms (Note
[Composite kernels of ours], functransforms/_core/composites.py). torch.func has no batching rule
for this overload at all; ours computes with unbatched points and refuses batched ones with a
DataDependentError (a RuntimeError, as torch.func's), never an internal error."""

import pytest
import torch
import torch.func as tf

import functransforms as ft
from functransforms.errors import DataDependentError

_POINTS = {
    "indices_1d": lambda: torch.tensor([1, 3]),
    "sections_0d": lambda: torch.tensor(3),
}


def _split(x, points, dim=-1):
    return torch.tensor_split(x, points, dim)


@pytest.mark.parametrize("kind", sorted(_POINTS))
def test_unbatched_points_equal_a_loop(kind):
    xs = torch.randn(4, 2, 6, dtype=torch.float64)
    points = _POINTS[kind]()
    ours = ft.vmap(_split, in_dims=(0, None))(xs, points)
    ref = [torch.stack(p) for p in zip(*[_split(x, points) for x in xs])]
    torch.testing.assert_close(list(ours), ref)
    method = ft.vmap(lambda x, p: x.tensor_split(p, dim=0), in_dims=(1, None))(xs, points)
    torch.testing.assert_close(list(method), [p.movedim(1, 0) for p in xs.tensor_split(points, 0)])


def _autograd(f, x):
    x = x.clone().requires_grad_(True)
    return torch.autograd.grad(f(x), x)[0]


@pytest.mark.parametrize("kind", sorted(_POINTS))
def test_grad_and_per_sample_grad_with_tensor_points(kind):
    """torch.func's grad fails on 1-d tensor points ("Cannot access data pointer"): plain
    autograd is the oracle."""
    points = _POINTS[kind]()

    def f(x):
        return sum((k + 1) * p.sin().sum() for k, p in enumerate(_split(x, points)))

    x = torch.randn(2, 6, dtype=torch.float64)
    torch.testing.assert_close(ft.grad(f)(x), _autograd(f, x))
    torch.testing.assert_close(ft.jacfwd(f)(x), _autograd(f, x))
    xs = torch.randn(3, 2, 6, dtype=torch.float64)
    torch.testing.assert_close(ft.vmap(ft.grad(f))(xs), torch.stack([_autograd(f, x) for x in xs]))


@pytest.mark.parametrize(
    "in_dims,points",
    [
        ((0, 0), torch.tensor([[1, 3], [2, 4], [1, 3], [0, 5]])),
        ((0, 0), torch.tensor([[1, 3]] * 4)),  # equal points: refused all the same
        ((None, 0), torch.tensor([[1, 3], [2, 4], [1, 3], [0, 5]])),
        ((0, 0), torch.tensor([3, 2, 3, 3])),  # a 0-d number of sections per example
        ((None, 0), torch.tensor([3, 3, 3, 3])),
    ],
)
def test_batched_points_raise_a_clear_error_as_torch_func(in_dims, points):
    xs = torch.randn(4, 6)
    with pytest.raises(RuntimeError):  # torch.func: no batching rule for this overload
        tf.vmap(_split, in_dims=in_dims)(xs, points)
    with pytest.raises(DataDependentError, match=r"tensor_split.*split points is a batched tensor"):
        ft.vmap(_split, in_dims=in_dims)(xs, points)
    with pytest.raises(DataDependentError, match=r"^vmap\(<lambda>, in_dims"):  # names the call
        ft.vmap(ft.grad(lambda x, p: _split(x, p)[0].sum()), in_dims=in_dims)(xs, points)


def test_wrong_points_raise_torch_errors():
    x = torch.randn(4, 6)
    for bad in (torch.tensor([[1, 2]]), torch.tensor([1.0, 2.0])):
        with pytest.raises(RuntimeError, match="tensor_split"):
            torch.tensor_split(x[0], bad)
        with pytest.raises(RuntimeError, match="tensor_split"):
            ft.vmap(_split, in_dims=(0, None))(x, bad)
