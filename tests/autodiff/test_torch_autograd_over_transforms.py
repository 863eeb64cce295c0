"""torch's own autograd over what our vjp / jvp return (MAML's meta-gradient, double backward):
the same derivatives as plain autograd with create_graph=True and as torch.func."""

import pytest
import torch
import torch.nn.functional as F

import functransforms as ft

D = torch.float64


def _double_backward(vjp_of, f, xs, ct, ws):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    ct = ct.detach().clone().requires_grad_()
    out, g = vjp_of(f, xs, ct)
    return torch.autograd.grad((*g,), (*xs, ct), ws, allow_unused=True, materialize_grads=True)


def _ours(f, xs, ct):
    out, pullback = ft.vjp(f, *xs)
    return out, pullback(ct)


def _plain(f, xs, ct):
    out = f(*xs)
    return out, torch.autograd.grad(out, xs, ct, create_graph=True)


def _clamp_under_no_grad(v):
    v = v.clone()
    with torch.no_grad():
        v.clamp_(min=0.5)
    return 1 / v


def _gaussian_nll(a, b, v):
    return F.gaussian_nll_loss(a, b, v, reduction="none")


def _cosine(x, y):
    return F.cosine_similarity(x, y, dim=1)


_IN_PLACE_UNDER_NO_GRAD = {
    # Note [Grad mode] at torch's autograd below a level (autodiff/_util.py keep_torch_history)
    "clamp_under_no_grad": (_clamp_under_no_grad, lambda g: [torch.rand(6, dtype=D, generator=g)]),
    "gaussian_nll_loss": (
        _gaussian_nll,
        lambda g: (
            [torch.randn(5, dtype=D, generator=g) for _ in "ab"]
            + [torch.rand(5, dtype=D, generator=g) + 0.1]
        ),
    ),
    "cosine_similarity": (
        _cosine,
        lambda g: [torch.randn(4, 5, dtype=D, generator=g) for _ in "xy"],
    ),
}


@pytest.mark.parametrize("name", list(_IN_PLACE_UNDER_NO_GRAD))
def test_in_place_under_no_grad_keeps_torch_history_through_vjp(name):
    f, make = _IN_PLACE_UNDER_NO_GRAD[name]
    gen = torch.Generator().manual_seed(0)
    xs = make(gen)
    out = f(*xs)
    ct = torch.randn(out.shape, dtype=D, generator=gen)
    ws = [torch.randn(x.shape, dtype=D, generator=gen) for x in xs]
    ours = _double_backward(_ours, f, xs, ct, ws)
    ref = _double_backward(_plain, f, xs, ct, ws)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", list(_IN_PLACE_UNDER_NO_GRAD))
def test_in_place_under_no_grad_keeps_torch_history_through_jvp(name):
    f, make = _IN_PLACE_UNDER_NO_GRAD[name]
    gen = torch.Generator().manual_seed(1)
    xs = make(gen)
    ts = [torch.randn(x.shape, dtype=D, generator=gen) for x in xs]
    out = f(*xs)
    cs = [torch.randn(out.shape, dtype=D, generator=gen) for _ in "ot"]

    def grads(jvp, f):
        x = [a.clone().requires_grad_() for a in xs]
        t = [a.clone().requires_grad_() for a in ts]
        o, jo = jvp(f, tuple(x), tuple(t))
        return torch.autograd.grad((o, jo), (*x, *t), cs, allow_unused=True, materialize_grads=True)

    for a, b in zip(grads(ft.jvp, f), grads(torch.func.jvp, f)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_in_place_under_no_grad_leaves_values_saved_earlier_alone():
    """The kept history is out of place: ``v * v`` saved ``v`` before it was doubled."""

    def f(x):
        v = x.clone()
        y = v * v
        with torch.no_grad():
            v.mul_(2)
        return y + v  # value x^2 + 2x; torch's derivative 2x + 1 (v's history: x's clone)

    x = torch.tensor([1.0, -2.0, 3.0], dtype=D, requires_grad=True)
    ct = torch.tensor([1.0, 2.0, -1.0], dtype=D, requires_grad=True)
    out, pullback = ft.vjp(f, x)
    (g,) = pullback(ct)
    torch.testing.assert_close(out, x.detach() ** 2 + 2 * x.detach())
    torch.testing.assert_close(g, ct.detach() * (2 * x.detach() + 1))
    gx, gct = torch.autograd.grad(g.sum(), (x, ct))
    torch.testing.assert_close(gx, 2 * ct.detach())
    torch.testing.assert_close(gct, 2 * x.detach() + 1)


C = torch.complex128
_COMPLEX_SCATTERS = {
    # Note [Complex scatters torch's autograd refuses] (autodiff/_util.py)
    "slice": lambda x: x[1:3] * 2,
    "select": lambda x: x[2] * 2,
    "narrow_then_write": lambda x: torch.narrow(x, 0, 1, 2).exp(),
    "split": lambda x: torch.split(x, 2)[1].sin(),
    "fft_padded": lambda x: torch.fft.fft(x, n=8),
    "unfold": lambda x: x.unfold(0, 3, 1).sum(-1),
}


@pytest.mark.parametrize("name", list(_COMPLEX_SCATTERS))
def test_complex_views_double_backward_through_vjp(name):
    f = _COMPLEX_SCATTERS[name]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, dtype=C, generator=gen)
    out = f(x)
    ct = torch.randn(out.shape, dtype=C, generator=gen)
    ws = [torch.randn(5, dtype=C, generator=gen)]
    ours = _double_backward(_ours, f, [x], ct, ws)
    ref = _double_backward(_plain, f, [x], ct, ws)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
