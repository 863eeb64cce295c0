"""Seeded draws inside grad/jvp equal eager's (and torch.func's): a random in-place fill of a
buffer made from a tracked value runs the kernel, not a decomposition that draws other values
(exponential_ went through -log1p(-uniform) / lambd, so F.gumbel_softmax's gradient differed
from torch.func's under the same seed)."""

import pytest
import torch
import torch.func as tf
import torch.nn.functional as F

import functransforms as ft

_FILLS = {
    "exponential_": lambda t: t.exponential_(),
    "geometric_": lambda t: t.geometric_(0.3),
    "log_normal_": lambda t: t.log_normal_(),
    "cauchy_": lambda t: t.cauchy_(),
    "random_": lambda t: t.random_(0, 10),
    "normal_": lambda t: t.normal_(),
    "uniform_": lambda t: t.uniform_(),
    "bernoulli_": lambda t: t.bernoulli_(0.3),
}
_X = torch.rand(4, 5) + 0.1


@pytest.mark.parametrize("name", sorted(_FILLS))
def test_fills_draw_as_eager_under_grad_and_jvp(name):
    fill = _FILLS[name]
    torch.manual_seed(0)
    eager = fill(torch.empty_like(_X))
    torch.manual_seed(0)
    g = ft.grad(lambda r: (fill(torch.empty_like(r)) * r).sum())(_X)
    torch.testing.assert_close(g, eager)
    torch.manual_seed(0)
    t = ft.jvp(lambda r: fill(torch.empty_like(r)) * r, (_X,), (torch.ones_like(_X),))[1]
    torch.testing.assert_close(t, eager)


def test_gumbel_softmax_gradient_matches_torch_func_under_one_seed():
    def f(r):
        return (F.gumbel_softmax(r, hard=True) * torch.arange(5.0)).sum()

    torch.manual_seed(0)
    ours = ft.grad(f)(_X)
    torch.manual_seed(0)
    torch.testing.assert_close(ours, tf.grad(f)(_X))
