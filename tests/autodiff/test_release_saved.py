"""Note [Releasing saved values]: grad drops what each node saved once the sweep is past it;
vjp (whose pullback may run again) keeps it."""

import weakref

import torch

import functransforms as ft


def _probe_loss(record):
    """A loss whose oldest node (a custom_vjp identity) records, when the backward sweep reaches
    it, whether the output of a later exp (saved by exp's node for its pullback) is alive."""
    ref = {}

    @ft.custom_vjp
    def probe(x):
        return x

    def bwd(res, g):
        record.append(ref["exp_out"]() is not None)
        return (g,)

    probe.defvjp(lambda x: (x, None), bwd)

    def loss(x):
        z = torch.exp(probe(x) * 2)
        ref["exp_out"] = weakref.ref(z._primal)  # the value exp's node saves
        return z.sum()

    return loss


def test_grad_frees_a_saved_activation_before_the_sweep_ends():
    record = []
    x = torch.randn(5, dtype=torch.float64)
    g = ft.grad(_probe_loss(record))(x)
    assert record == [False]
    torch.testing.assert_close(g, 2 * torch.exp(2 * x))
    # value_and_grad and grad of grad sweep each graph once too
    record.clear()
    v, g = ft.value_and_grad(_probe_loss(record))(x)
    assert record == [False]
    torch.testing.assert_close(v, torch.exp(2 * x).sum())


def test_vjp_keeps_saved_values_for_a_second_pullback():
    record = []
    x = torch.randn(5, dtype=torch.float64)
    out, vjp_fn = ft.vjp(_probe_loss(record), x)
    first = vjp_fn(torch.tensor(1.0, dtype=torch.float64))
    second = vjp_fn(torch.tensor(3.0, dtype=torch.float64))
    assert record == [True, True]
    torch.testing.assert_close(second[0], 3 * first[0])


def test_released_graphs_still_compose():
    """Inner grads release their own graphs; the outer transforms' tapes keep what they need."""

    def f(x):
        return (torch.sin(x) * torch.exp(x)).sum()

    x = torch.randn(4, dtype=torch.float64)
    v = torch.randn(4, dtype=torch.float64)
    tf = torch.func
    torch.testing.assert_close(ft.hessian(f)(x), tf.hessian(f)(x))
    torch.testing.assert_close(
        ft.grad(lambda x: (ft.grad(f)(x) * v).sum())(x),
        tf.grad(lambda x: (tf.grad(f)(x) * v).sum())(x),
    )
    torch.testing.assert_close(ft.jvp(ft.grad(f), (x,), (v,))[1], tf.jvp(tf.grad(f), (x,), (v,))[1])
    xs = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(ft.vmap(ft.grad(f))(xs), tf.vmap(tf.grad(f))(xs))
    torch.testing.assert_close(
        ft.vmap(ft.grad(ft.grad(lambda x: f(x.unsqueeze(0)))))(xs[:, 0]),
        tf.vmap(tf.grad(tf.grad(lambda x: f(x.unsqueeze(0)))))(xs[:, 0]),
    )
