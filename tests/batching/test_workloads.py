"""Realistic workloads run under vmap with no per-example fallback at all."""

import torch
import torch.nn.functional as Fn
from _vmap_helpers import assert_tree_close

import functransforms as ft

DT = torch.float64


def _params(gen):
    return (
        torch.randn(8, 4, dtype=DT, generator=gen),
        torch.randn(8, dtype=DT, generator=gen),
        torch.randn(3, 8, dtype=DT, generator=gen),
        torch.randn(3, dtype=DT, generator=gen),
    )


def mlp_loss(W1, b1, W2, b2, x, y):
    h = Fn.gelu(torch.tanh(Fn.relu(Fn.linear(x, W1, b1))))
    logits = Fn.linear(h, W2, b2)
    logp = Fn.log_softmax(logits, -1)
    target = Fn.one_hot(y, 3).to(logits.dtype)
    return (
        Fn.cross_entropy(logits, y)
        + Fn.mse_loss(logp.exp(), target)
        + Fn.nll_loss(logp, y, reduction="sum")
        + 0.1 * Fn.smooth_l1_loss(logits, target)
    )


def test_mlp_classifier_no_fallback(no_fallback):
    gen = torch.Generator().manual_seed(1)
    W1, b1, W2, b2 = _params(gen)
    x, y = torch.randn(6, 4, dtype=DT, generator=gen), torch.randint(0, 3, (6,), generator=gen)
    dims = (None, None, None, None, 0, 0)
    out = ft.vmap(mlp_loss, in_dims=dims)(W1, b1, W2, b2, x, y)
    ref = torch.vmap(mlp_loss, in_dims=dims)(W1, b1, W2, b2, x, y)
    assert out.shape == (6,)
    torch.testing.assert_close(out, ref)
    # per-example minibatches and per-model ensembles
    xb, yb = x.reshape(3, 2, 4), y.reshape(3, 2)
    Ws = [torch.stack([p, p * 0.5, -p]) for p in (W1, b1, W2, b2)]
    assert_tree_close(
        ft.vmap(mlp_loss, in_dims=(0, 0, 0, 0, 0, 0))(*Ws, xb, yb),
        torch.vmap(mlp_loss, in_dims=(0, 0, 0, 0, 0, 0))(*Ws, xb, yb),
    )


def _net(W1, b1, W2, b2, x):
    return Fn.linear(torch.tanh(Fn.linear(x, W1, b1)), W2, b2)


def test_ntk_style_no_fallback(no_fallback):
    """Empirical NTK from explicit per-example feature Jacobians (finite-width, linear head)."""
    gen = torch.Generator().manual_seed(2)
    W1, b1, W2, b2 = _params(gen)
    x1 = torch.randn(5, 4, dtype=DT, generator=gen)
    x2 = torch.randn(7, 4, dtype=DT, generator=gen)

    def features(x):  # d out / d (W2, b2) and d out / d b1 in closed form, per example
        h = torch.tanh(Fn.linear(x, W1, b1))
        dh = (1 - h**2) * W2[:, None, :]  # [3, 8]
        J_W2 = torch.einsum("ij,k->ijk", torch.eye(3, dtype=DT), h).reshape(3, -1)
        return torch.cat([J_W2, torch.eye(3, dtype=DT), dh.reshape(3, -1)], -1)

    def ntk(a, b):
        return features(a) @ features(b).T

    out = ft.vmap(ft.vmap(ntk, in_dims=(None, 0)), in_dims=(0, None))(x1, x2)
    ref = torch.vmap(torch.vmap(ntk, in_dims=(None, 0)), in_dims=(0, None))(x1, x2)
    assert out.shape == (5, 7, 3, 3)
    torch.testing.assert_close(out, ref)
    outs = ft.vmap(_net, in_dims=(None, None, None, None, 0))(W1, b1, W2, b2, x1)
    torch.testing.assert_close(outs, _net(W1, b1, W2, b2, x1))


def physics(state, params):
    """One explicit step of a damped pendulum chain with a wall (sin/cos/exp/pow/sqrt/where/
    clamp/cat/stack/indexing)."""
    q, p = state[0], state[1]
    k, damping = params[0], params[1]
    dq = q[1:] - q[:-1]
    spring = k * torch.cat([dq[:1], dq[1:] - dq[:-1], -dq[-1:]])
    force = -torch.sin(q) + spring - damping * p * torch.exp(-q.abs())
    energy = 0.5 * p.pow(2).sum() + (1 - torch.cos(q)).sum() + 0.5 * k * (dq**2).sum()
    p_new = torch.where(q.abs() > 2.0, -p, p + 0.01 * force).clamp(-5.0, 5.0)
    q_new = q + 0.01 * p_new / torch.sqrt(1 + p_new**2)
    q_new[torch.tensor([0])] = q_new[torch.tensor([0])] * 0.5
    return torch.stack([q_new, p_new]), energy, q_new[[0, -1]].sum()


def test_physics_no_fallback(no_fallback):
    gen = torch.Generator().manual_seed(3)
    states = torch.randn(6, 2, 5, dtype=DT, generator=gen)
    params = torch.rand(6, 2, dtype=DT, generator=gen)
    for dims in [(0, 0), (0, None), (None, 0)]:
        s = states if dims[0] is not None else states[0]
        p = params if dims[1] is not None else params[0]
        out = ft.vmap(physics, in_dims=dims)(s, p)
        ref = torch.vmap(physics, in_dims=dims)(s, p)
        assert_tree_close(out, ref)
