"""Derivatives at the points where a function is not differentiable (ties, zeros, the origin,
constant inputs): torch picks a particular value (usually the zero subgradient, sometimes inf or
nan) and torch.func returns it; so must we, in grad, jvp and second order. A nan where torch
gives 0 is a silent wrong result for a user who checks with torch.func."""

import pytest
import torch
import torch.func as tf
import torch.nn.functional as F

import functransforms as ft

_CASES = {
    "clamp_boundaries": (lambda t: t.clamp(0, 1).sum(), [0.0, 0.5, 1.0, 2.0]),
    "relu_at_0": (lambda t: F.relu(t).sum(), [0.0, -1.0, 1.0]),
    "max_ties": (lambda t: t.max(), [1.0, 3.0, 3.0]),
    "amax_ties": (lambda t: t.amax(), [1.0, 3.0, 3.0]),
    "median_ties": (lambda t: t.median(), [1.0, 2.0, 2.0, 3.0]),
    "norm_at_0": (lambda t: t.norm(), [0.0, 0.0, 0.0]),
    "sqrt_at_0": (lambda t: t.sqrt().sum(), [0.0, 1.0]),
    "abs_at_0": (lambda t: t.abs().sum(), [0.0, 1.0]),
    "logsumexp_minus_inf": (lambda t: t.logsumexp(0), [-float("inf"), 0.0]),
    "cumprod_zeros": (lambda t: t.cumprod(0).sum(), [1.0, 0.0, 2.0, 0.0]),
    "prod_zeros": (lambda t: t.prod(), [1.0, 0.0, 2.0]),
    "pow_0_0": (lambda t: (t**0).sum() + (t**2).sum(), [0.0, 0.0]),
    "pow_tensor_at_0": (lambda t: torch.pow(t, torch.tensor([0.5, 2.0])).sum(), [0.0, 0.0]),
    "pow_tensor_zero_exponent_at_0": (
        lambda t: torch.pow(t, torch.tensor([0.0, 0.0, 2.0])).sum(),
        [0.0, 1.0, 0.0],
    ),
    "pow_exponent_at_base_0": (lambda t: torch.pow(torch.zeros(3), t).sum(), [0.0, -1.0, 2.0]),
    "atan2_origin": (lambda t: torch.atan2(t, t).sum(), [0.0, 0.0]),
    "atan2_x_axis": (lambda t: torch.atan2(t, torch.zeros(2)).sum(), [0.0, 1.0]),
    "xlogy_at_0": (lambda t: torch.xlogy(t, t).sum(), [0.0, 1.0]),
    "entr_at_0": (lambda t: torch.special.entr(t).sum(), [0.0, 0.5]),
    "cosine_similarity_zero": (lambda t: F.cosine_similarity(t, torch.ones(3), dim=0), [0.0] * 3),
    "normalize_zero": (lambda t: F.normalize(t, dim=0).sum(), [0.0] * 3),
    "std_constant": (lambda t: t.std(), [1.0, 1.0, 1.0]),
    "std_dim_constant": (lambda t: t.reshape(2, 2).std(0).sum(), [1.0, 2.0, 1.0, 2.0]),
    "std_mean_constant": (lambda t: torch.std_mean(t)[0], [1.0, 1.0, 1.0]),
    "var_one_element": (lambda t: t.var(), [1.0]),
    "dist_zero": (lambda t: torch.dist(t, torch.tensor([1.0, 2.0])), [1.0, 2.0]),
}


def _close(a, b):
    torch.testing.assert_close(a, b, equal_nan=True, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", sorted(_CASES))
def test_grad_jvp_hessian_match_torch_func(name):
    f, point = _CASES[name]
    x = torch.tensor(point, dtype=torch.float64)
    _close(ft.grad(f)(x), tf.grad(f)(x))
    t = torch.linspace(-1.0, 1.0, x.numel(), dtype=torch.float64)
    _close(ft.jvp(f, (x,), (t,)), tf.jvp(f, (x,), (t,)))
    _close(ft.jacfwd(ft.jacrev(f))(x), tf.jacfwd(tf.jacrev(f))(x))


def test_atan2_jvp_at_the_origin_is_nan_as_torch():
    z = torch.zeros(2)
    ours = ft.jvp(torch.atan2, (z, z), (torch.ones(2), torch.ones(2)))[1]
    theirs = tf.jvp(torch.atan2, (z, z), (torch.ones(2), torch.ones(2)))[1]
    assert ours.isnan().all() and theirs.isnan().all()
