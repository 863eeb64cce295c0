"""Ops called with a Python scalar take other overloads (``x % 0.7`` is aten.remainder.Scalar,
``torch.fmod(x, s)`` aten.fmod.Scalar): the OpInfo samples rarely use them, so each gets its own
test against torch.func here, in grad, jvp and vmap(grad)."""

import pytest
import torch
import torch.func as tf

import functransforms as ft

_X = torch.tensor([0.9, 1.3, 2.2, 0.6], dtype=torch.float64)
_Q = torch.tensor([1.5, 2.0, 0.7, 3.0], dtype=torch.float64)

_FNS = {
    "remainder_scalar": lambda t: t % 0.7,
    "fmod_scalar": lambda t: torch.fmod(t, 0.7),
    "nan_to_num": lambda t: torch.nan_to_num(torch.log(t - 1.0), nan=0.5),
    "zeta_q": lambda q: torch.special.zeta(torch.tensor(3.0, dtype=q.dtype), q),
    "zeta_scalar_x": lambda q: torch.special.zeta(2.5, q),
}


@pytest.mark.parametrize("name", sorted(_FNS))
def test_grad_and_vmap_grad_match_torch_func(name):
    f = _FNS[name]
    x = _Q if name.startswith("zeta") else _X
    g = lambda t: f(t).sum()  # noqa: E731
    torch.testing.assert_close(ft.grad(g)(x), tf.grad(g)(x), equal_nan=True)
    s = lambda t: f(t).sum()  # noqa: E731
    xb = torch.stack([x, x + 0.05])
    torch.testing.assert_close(ft.vmap(ft.grad(s))(xb), tf.vmap(tf.grad(s))(xb), equal_nan=True)


@pytest.mark.parametrize("name", ["remainder_scalar", "fmod_scalar", "nan_to_num"])
def test_jvp_matches_torch_func(name):
    f, t = _FNS[name], torch.linspace(-1, 1, 4, dtype=torch.float64)
    torch.testing.assert_close(ft.jvp(f, (_X,), (t,)), tf.jvp(f, (_X,), (t,)), equal_nan=True)


def test_nan_to_num_keeps_a_nan_tangent_as_torch():
    f = lambda t: torch.nan_to_num(t / 0 * 0)  # noqa: E731  nan values, nan tangents
    ours = ft.jvp(f, (_X,), (torch.ones_like(_X),))[1]
    assert ours.isnan().all() and tf.jvp(f, (_X,), (torch.ones_like(_X),))[1].isnan().all()


def test_zeta_jvp_in_q_matches_finite_differences():
    # torch has no forward formula for zeta; ours is d/dq zeta(x, q) = -x zeta(x + 1, q)
    f = lambda q: torch.special.zeta(3.0, q)  # noqa: E731
    t = torch.ones_like(_Q)
    eps = 1e-6
    fd = (f(_Q + eps * t) - f(_Q - eps * t)) / (2 * eps)
    torch.testing.assert_close(ft.jvp(f, (_Q,), (t,))[1], fd, rtol=1e-6, atol=1e-8)


def test_scalar_remainder_tensor_matches_finite_differences():
    # torch has no derivative for s % q; ours is d/dq = -floor(s / q) (q away from the jumps)
    f = lambda q: torch.remainder(0.7, q)  # noqa: E731
    t, eps = torch.ones_like(_X), 1e-6
    fd = (f(_X + eps * t) - f(_X - eps * t)) / (2 * eps)
    torch.testing.assert_close(ft.jvp(f, (_X,), (t,))[1], fd)
    torch.testing.assert_close(ft.grad(lambda q: f(q).sum())(_X), fd)


def test_zeta_in_x_is_a_clear_error_as_in_torch():
    q = _Q
    with pytest.raises(NotImplementedError, match="zeta.*with respect to x"):
        ft.grad(lambda x: torch.special.zeta(x, q).sum())(_X + 1)
    with pytest.raises(NotImplementedError, match="zeta.*with respect to x"):
        ft.grad(lambda x: torch.special.zeta(x, 2.0).sum())(_X + 1)


@pytest.mark.parametrize(
    "f",
    [
        torch.special.spherical_bessel_j0,
        torch.special.scaled_modified_bessel_k0,
        torch.special.scaled_modified_bessel_k1,
    ],
    ids=["spherical_bessel_j0", "scaled_modified_bessel_k0", "scaled_modified_bessel_k1"],
)
def test_special_functions_torch_cannot_differentiate_match_finite_differences(f):
    # torch has no derivative (torch.func returns a silent 0); ours: checked to second order
    x = torch.tensor([0.4, 1.3, 2.7], dtype=torch.float64)
    t, eps = torch.ones_like(x), 1e-6
    fd = (f(x + eps * t) - f(x - eps * t)) / (2 * eps)
    torch.testing.assert_close(ft.grad(lambda q: f(q).sum())(x), fd, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(ft.jvp(f, (x,), (t,))[1], fd, rtol=1e-6, atol=1e-8)
    g = lambda q: ft.grad(lambda r: f(r).sum())(q)  # noqa: E731
    fd2 = (g(x + eps * t) - g(x - eps * t)) / (2 * eps)
    torch.testing.assert_close(ft.jvp(g, (x,), (t,))[1], fd2, rtol=1e-5, atol=1e-7)


def test_spherical_bessel_j0_derivative_at_zero_is_zero():
    assert ft.grad(torch.special.spherical_bessel_j0)(torch.tensor(0.0)).item() == 0.0
