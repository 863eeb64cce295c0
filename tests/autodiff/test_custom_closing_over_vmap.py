"""Custom functions (autograd.Function, custom_vjp, custom_jvp) closing over a tensor batched by an
enclosing vmap (Note [Values a custom function closes over under vmap]), against torch.func."""

import pytest
import torch
import torch.func as tf

import functransforms as ft

D = torch.float64


# -- 4. custom functions closing over a tensor batched by an enclosing vmap -------------------
# (Note [Values a custom function closes over under vmap], functransforms/_custom.py)
def _closing_over(generate_vmap_rule):
    held = {}

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(a):
            return a * held["y"]

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return g * held["y"]

    if generate_vmap_rule:
        Scale.generate_vmap_rule = True
    else:

        @staticmethod
        def vmap(info, in_dims, a):
            return Scale.apply(a), in_dims[0]

        Scale.vmap = vmap

    def f(a, y):
        held["y"] = y
        return Scale.apply(a)

    return f


def test_autograd_function_closing_over_a_batched_tensor_computes_as_torch_func():
    xs, ys = torch.randn(4, 3, dtype=D), torch.randn(4, 3, dtype=D)
    f = _closing_over(generate_vmap_rule=True)
    ours, theirs = ft.vmap(f)(xs, ys), tf.vmap(f)(xs, ys)  # raised EscapedTracerError
    assert torch.equal(ours, theirs)
    # torch.func fails here with an internal assert; the value is ys
    g = ft.vmap(ft.grad(lambda a, y: f(a, y).sum()))(xs, ys)
    torch.testing.assert_close(g, ys)


def test_vmap_rule_closing_over_a_batched_tensor_raises_naming_the_fix():
    xs, ys = torch.randn(4, 3, dtype=D), torch.randn(4, 3, dtype=D)
    f = _closing_over(generate_vmap_rule=False)
    with pytest.raises(RuntimeError):  # torch.func raises too
        tf.vmap(f)(xs, ys)
    with pytest.raises(ValueError, match="as an argument"):
        ft.vmap(f)(xs, ys)


def test_custom_vjp_and_jvp_closing_over_a_batched_tensor():
    xs, ys = torch.randn(4, 3, dtype=D), torch.randn(4, 3, dtype=D)
    held = {}

    @ft.custom_vjp
    def scale(a):
        return a * held["y"]

    scale.defvjp(lambda a: (a * held["y"], None), lambda res, g: (g * held["y"],))

    @ft.custom_jvp
    def wave(a):
        return (a * held["y"]).sin()

    @wave.defjvp
    def wave_jvp(primals, tangents):
        (a,), (t,) = primals, tangents
        return (a * held["y"]).sin(), (a * held["y"]).cos() * held["y"] * t

    def closing(fn):
        def g(a, y):
            held["y"] = y
            return fn(a)

        return g

    torch.testing.assert_close(ft.vmap(closing(scale))(xs, ys), xs * ys)
    torch.testing.assert_close(
        ft.vmap(ft.grad(lambda a, y: closing(scale)(a, y).sum()))(xs, ys), ys
    )
    torch.testing.assert_close(ft.vmap(ft.jacrev(closing(scale)))(xs, ys), torch.diag_embed(ys))
    d = (xs * ys).cos() * ys
    torch.testing.assert_close(ft.vmap(ft.grad(lambda a, y: closing(wave)(a, y).sum()))(xs, ys), d)
    torch.testing.assert_close(ft.vmap(ft.jacfwd(closing(wave)))(xs, ys), torch.diag_embed(d))
    nested = ft.vmap(ft.vmap(closing(scale)))(xs.expand(2, 4, 3), ys.expand(2, 4, 3))
    torch.testing.assert_close(nested, (xs * ys).expand(2, 4, 3))
    # the backward runs after the vmap returned (grad outside): the error names the fix
    with pytest.raises(ft.errors.EscapedTracerError, match="as an argument"):
        ft.grad(lambda a: ft.vmap(closing(scale))(a, ys).sum())(xs)
