"""Every ordered pair and triple of {vmap, grad, vjp, jvp} against torch.func; perturbation
confusion; levels popped on exceptions."""

import itertools

import pytest
import torch

import functransforms as ft
from functransforms._core.levels import interpreter_stack


def _api(lib):
    if lib == "ft":
        return ft.vmap, ft.grad, ft.vjp, ft.jvp
    return torch.func.vmap, torch.func.grad, torch.func.vjp, torch.func.jvp


def _apply(name, f, lib):
    """Lift f: [3] -> [] ... each transform maps a function of x to a function of x.

    grad: x -> grad f(x) (f summed to a scalar); vjp: x -> vjp_fn(ones); jvp: x -> tangent along
    cos(x); vmap: over a leading batch dim of size 2 (the input is [2, *shape]; we fold it back by
    applying to x stacked with 2x and summing the two results, so the shape is preserved).
    """
    vmap, grad, vjp, jvp = _api(lib)
    if name == "grad":
        return grad(lambda x: f(x).sum())
    if name == "vjp":

        def g(x):
            out, fn = vjp(f, x)
            return fn(torch.ones_like(out))[0]

        return g
    if name == "jvp":
        return lambda x: jvp(f, (x,), (torch.cos(x),))[1]
    if name == "vmap":

        def g(x):
            ys = vmap(f)(torch.stack([x, 2 * x]))
            return ys[0] + 0.5 * ys[1]

        return g
    raise AssertionError(name)


def base(x):
    return torch.sin(x) * x.sum() + x**3


NAMES = ("vmap", "grad", "vjp", "jvp")
CHAINS = (
    list(itertools.permutations(NAMES, 2))
    + list(itertools.permutations(NAMES, 3))
    + [(a, a) for a in NAMES]
)


@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: "-".join(c))
def test_composition_matches_torch_func(chain):
    x = torch.randn(3, dtype=torch.float64)
    ours, ref = base, base
    for name in reversed(chain):  # chain[0] is the outermost transform
        ours, ref = _apply(name, ours, "ft"), _apply(name, ref, "torch")
    torch.testing.assert_close(ours(x), ref(x))
    assert interpreter_stack() == ()


def test_perturbation_confusion():
    # d/dx [x * d/dy (x * y)]  = d/dx [x * x] = 2x  (a confused implementation returns x + ...)
    x = torch.tensor(1.5, dtype=torch.float64)
    f = lambda x: x * ft.grad(lambda y: x * y)(x)
    torch.testing.assert_close(ft.grad(f)(x), 2 * x)
    fj = lambda x: x * ft.jvp(lambda y: x * y, (x,), (torch.ones_like(x),))[1]
    torch.testing.assert_close(ft.jvp(fj, (x,), (torch.ones_like(x),))[1], 2 * x)
    torch.testing.assert_close(ft.grad(fj)(x), 2 * x)


def test_nested_grad_of_closure_over_outer_variable():
    x = torch.tensor(0.7, dtype=torch.float64)
    g = ft.grad(lambda x: ft.grad(lambda y: (x * y).sin())(x))(x)
    g_ref = torch.func.grad(lambda x: torch.func.grad(lambda y: (x * y).sin())(x))(x)
    torch.testing.assert_close(g, g_ref)


@pytest.mark.parametrize("transform", ["grad", "vjp", "jvp", "vmap", "nested"])
def test_levels_popped_on_exception(transform):
    def boom(x):
        raise KeyError("boom")

    x = torch.randn(3, dtype=torch.float64)
    call = {
        "grad": lambda: ft.grad(boom)(x),
        "vjp": lambda: ft.vjp(boom, x),
        "jvp": lambda: ft.jvp(boom, (x,), (x,)),
        "vmap": lambda: ft.vmap(boom)(x),
        "nested": lambda: ft.vmap(ft.grad(lambda y: boom(y)))(x[None]),
    }[transform]
    with pytest.raises(KeyError, match="boom"):
        call()
    assert interpreter_stack() == ()
    torch.testing.assert_close(ft.grad(lambda y: (y**2).sum())(x), 2 * x)
    assert interpreter_stack() == ()
