"""nn.LSTM under the transforms. On CPU in float32, torch runs each layer as the fused oneDNN
kernel aten.mkldnn_rnn_layer, which ours differentiates and batches through a decomposition
(Note [LSTM through oneDNN], autodiff/nn.py): grad as torch.func, and beyond it jvp and vmap
(per-sample gradients of an LSTM), which torch.func cannot do. In float64 torch's composite
kernel writes into its own C++ buffers, which no Python transform can see: ours raise a clear
InplaceError (before, jvp gave a silently wrong tangent)."""

import pytest
import torch
import torch.func as tf
import torch.nn as nn

import functransforms as ft
from functransforms.errors import InplaceError


def _lstm(**kw):
    torch.manual_seed(0)
    return nn.LSTM(4, 6, **kw)


_CONFIGS = {
    "one_layer": {},
    "batch_first": {"batch_first": True},
    "two_layers_bidirectional": {"num_layers": 2, "bidirectional": True},
    "no_bias": {"bias": False},
}


@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_grad_matches_torch_func(name):
    m = _lstm(**_CONFIGS[name])
    x = torch.randn(3, 5, 4)
    p = {k: v.detach() for k, v in m.named_parameters()}

    def loss(lib):
        return lambda p, x: lib.functional_call(m, p, (x,))[0].pow(2).sum()

    ours, theirs = ft.grad(loss(ft), argnums=(0, 1))(p, x), tf.grad(loss(tf), argnums=(0, 1))(p, x)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_per_sample_gradients_equal_a_loop_of_torch_func(name):
    cfg = _CONFIGS[name]
    m = _lstm(**cfg)
    bf = cfg.get("batch_first", False)
    x = torch.randn(3, 5, 4)  # 3 examples
    p = {k: v.detach() for k, v in m.named_parameters()}

    def loss(lib):
        def f(p, xi):  # one example: [5, 4]
            xi = xi[None] if bf else xi[:, None]
            return lib.functional_call(m, p, (xi,))[0].pow(2).sum()

        return f

    ours = ft.vmap(ft.grad(loss(ft)), in_dims=(None, 0))(p, x)
    for i in range(3):
        ref = tf.grad(loss(tf))(p, x[i])
        torch.testing.assert_close({k: v[i] for k, v in ours.items()}, ref, rtol=1e-4, atol=1e-5)


def test_jvp_matches_finite_differences():
    m = _lstm(num_layers=2)
    x, t = torch.randn(5, 2, 4), torch.randn(5, 2, 4)
    out, tangent = ft.jvp(lambda x: m(x)[0], (x,), (t,))
    eps = 1e-3
    fd = (m(x + eps * t)[0] - m(x - eps * t)[0]) / (2 * eps)
    torch.testing.assert_close(tangent, fd.detach(), rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(out, m(x)[0].detach())


def test_float64_raises_clearly_instead_of_a_wrong_tangent():
    m = _lstm().double().requires_grad_(False)
    x = torch.randn(5, 2, 4, dtype=torch.float64)
    with pytest.raises(InplaceError, match="a torch kernel holds it"):
        ft.jvp(lambda x: m(x)[0], (x,), (torch.ones_like(x),))
