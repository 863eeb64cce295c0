"""The per-sample-gradient MLP's shortcuts (issue 13's B=8 row) give what the ordinary path
gives: outer products as broadcast products (Note [Outer products as products])."""

import pytest
import torch
import torch.func as tf
import torch.nn.functional as F

import functransforms as ft

_G = torch.Generator().manual_seed(0)


def _bits_equal(a, b):
    """Same values and the same zero signs (``torch.equal`` treats -0 and +0 as equal)."""
    if a.is_complex():
        return _bits_equal(torch.view_as_real(a), torch.view_as_real(b))
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.signbit(), b.signbit())
        and torch.equal(a, b)
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_outer_product_cotangent_matches_mm(dtype):
    # [n, 1] @ [1, m]: the weight cotangent of a linear layer on one example
    a = torch.randn(1, 5, generator=_G, dtype=dtype)
    b = torch.randn(5, 3, generator=_G, dtype=dtype)

    def f(a, b):
        y = a @ b
        return (y * y.conj()).real.sum() if dtype.is_complex else (y * y).sum()

    ours = ft.grad(f, argnums=(0, 1))(a, b)
    theirs = tf.grad(f, argnums=(0, 1))(a, b)
    for o, t in zip(ours, theirs):
        torch.testing.assert_close(o, t)


def test_per_sample_outer_products_keep_per_example_bits():
    # zeros in the input and negative cotangents: -1 * 0 is -0 per example (mm) and in the
    # broadcast product; a batched bmm would give +0
    w = torch.randn(4, 6, generator=_G, dtype=torch.float64)
    b = torch.randn(4, generator=_G, dtype=torch.float64)
    xs = torch.randn(3, 6, generator=_G, dtype=torch.float64)
    xs[:, :2] = 0.0

    def loss(w, b, x):
        return F.linear(x, w, b).sin().sum()

    g = ft.vmap(ft.grad(loss, argnums=(0, 1)), in_dims=(None, None, 0))(w, b, xs)
    for i in range(xs.shape[0]):
        one = ft.grad(loss, argnums=(0, 1))(w, b, xs[i])
        assert _bits_equal(g[0][i], one[0])
        assert _bits_equal(g[1][i], one[1])
    theirs = tf.vmap(tf.grad(loss, argnums=(0, 1)), in_dims=(None, None, 0))(w, b, xs)
    torch.testing.assert_close(g, theirs)


def test_pointwise_inline_results_carry_no_lazy_bits():
    # the inline pointwise path wraps results without wrap_batched's conj/neg check (its
    # functions return fresh tensors): complex values, a lazily conjugated plain operand
    z = torch.randn(4, 3, generator=_G, dtype=torch.complex128)
    c = torch.randn(3, generator=_G, dtype=torch.complex128).conj()
    assert c.is_conj()
    seen = []

    def f(x):
        outs = (torch.sin(x), x * 2.0, x * x, x * c, torch.neg(x))
        seen.extend(o._value for o in outs)
        return torch.stack(outs)

    ours = ft.vmap(f)(z)
    assert not any(v.is_conj() or v.is_neg() for v in seen)
    expected = torch.stack([torch.stack((x.sin(), x * 2.0, x * x, x * c, -x)) for x in z])
    # (complex x * x is vectorized differently for 12 and 3 elements: last-bit differences)
    torch.testing.assert_close(ours, expected, rtol=1e-15, atol=1e-15)
