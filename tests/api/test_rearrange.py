"""ft.rearrange (einops' rearrange, exported by torch.func) against torch.func.rearrange: values,
errors, and under vmap / grad / jvp (it is reshape + permute, so every transform handles it)."""

import pytest
import torch
import torch.func as tf

import functransforms as ft

_X = torch.randn(4, 6, 10, 3, generator=torch.Generator().manual_seed(0))
_PATTERNS = [
    ("b h w c -> b h w c", {}),
    ("b h w c -> (b h) w c", {}),
    ("b h w c -> h (b w) c", {}),
    ("b h w c -> b c h w", {}),
    ("b h w c -> b (c h w)", {}),
    ("b (h1 h) (w1 w) c -> (b h1 w1) h w c", {"h1": 2, "w1": 2}),
    ("b (h h1) (w w1) c -> b h w (c h1 w1)", {"h1": 2, "w1": 2}),
    ("b ... c -> c b ...", {}),
    ("b ... -> b (...)", {}),
    ("... c -> c ...", {}),
    ("... -> ...", {}),
    ("b h w c -> b h w c 1", {}),
    ("b h w c -> b h w () c", {}),
    ("b h w c -> (w h) b c", {}),
    ("b h (w q) c -> q b h w c", {"q": 5}),
]


@pytest.mark.parametrize("pattern, lengths", _PATTERNS, ids=[p for p, _ in _PATTERNS])
def test_values_match_torch_func(pattern, lengths):
    torch.testing.assert_close(
        ft.rearrange(_X, pattern, **lengths), tf.rearrange(_X, pattern, **lengths), rtol=0, atol=0
    )


@pytest.mark.parametrize("pattern", ["a 1 b -> a b", "a () b -> b a", "a 1 b -> (a 1 b)"])
def test_unit_axes(pattern):
    y = torch.randn(3, 1, 5)
    torch.testing.assert_close(ft.rearrange(y, pattern), tf.rearrange(y, pattern))


def test_a_list_of_tensors_is_stacked_first():
    xs = [torch.randn(2, 3) for _ in range(4)]
    torch.testing.assert_close(
        ft.rearrange(xs, "n a b -> a (n b)"), tf.rearrange(xs, "n a b -> a (n b)")
    )


@pytest.mark.parametrize(
    "pattern, lengths, match",
    [
        ("b h w c -> b h w", {}, "one side only"),
        ("b h -> b h", {}, "2 input axes, got a 4-d tensor"),
        ("b (h w) c d -> b h w c d", {}, "cannot infer the lengths"),
        ("b h w c -> b h w c", {"z": 2}, "does not use"),
        ("b (h q) w c -> b h q w c", {"q": 7}, "does not split"),
        ("a a b c -> a b c", {}, "repeats"),
        ("b h w c > b", {}, "one '->'"),
        ("b (h (w)) c d -> b h w c d", {}, "nested parentheses"),
    ],
)
def test_bad_patterns_raise_value_error_naming_the_pattern(pattern, lengths, match):
    with pytest.raises(Exception):  # noqa: B017  (torch.func: ValueError or DimensionBindError)
        tf.rearrange(_X, pattern, **lengths)
    with pytest.raises(ValueError, match=match):
        ft.rearrange(_X, pattern, **lengths)


def test_under_vmap_grad_and_jvp():
    pat = "(h h1) (w w1) c -> h w (c h1 w1)"
    f = lambda lib: lambda x: lib.rearrange(x, pat, h1=2, w1=2).sin().sum()  # noqa: E731
    torch.testing.assert_close(ft.vmap(ft.grad(f(ft)))(_X), tf.vmap(tf.grad(f(tf)))(_X))
    g = lambda lib: lambda x: lib.rearrange(x, "b h w c -> c (b w) h")  # noqa: E731
    t = torch.ones_like(_X)
    torch.testing.assert_close(ft.jvp(g(ft), (_X,), (t,)), tf.jvp(g(tf), (_X,), (t,)))
    torch.testing.assert_close(
        ft.vmap(lambda x: ft.rearrange(x, "... c -> c ..."), in_dims=2)(_X),
        tf.vmap(lambda x: tf.rearrange(x, "... c -> c ..."), in_dims=2)(_X),
    )
