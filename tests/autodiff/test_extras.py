"""linear_transpose and checkpoint (JAX's extras), against explicit transposes and against the
un-checkpointed function under every transform."""

import pytest
import torch

import functransforms as ft
from functransforms.testing import check_grads


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_linear_transpose_is_the_conjugate_transpose(dtype):
    g = torch.Generator().manual_seed(0)
    A = torch.randn(3, 2, dtype=dtype, generator=g)
    B = torch.randn(3, 4, dtype=dtype, generator=g)
    x, y = torch.zeros(2, dtype=dtype), torch.zeros(4, 2, dtype=dtype)

    def f(x, y):
        return {"a": A @ x + (B @ y).sum(-1), "b": y.mT * 2}

    t = ft.linear_transpose(f, x, y)
    ca, cb = torch.randn(3, dtype=dtype, generator=g), torch.randn(2, 4, dtype=dtype, generator=g)
    tx, ty = t({"a": ca, "b": cb})
    torch.testing.assert_close(tx, A.mH @ ca)
    torch.testing.assert_close(ty, B.mH @ ca[:, None].expand(3, 2) + 2 * cb.mT)
    # the dot-product test: <f(v), c> = <v, f^T(c)>
    v = torch.randn(2, dtype=dtype, generator=g)
    lhs = torch.vdot(ca, f(v, y)["a"])
    torch.testing.assert_close(lhs, torch.vdot(t({"a": ca, "b": torch.zeros_like(cb)})[0], v))


def test_linear_transpose_rejects_affine_maps():
    with pytest.raises(ValueError, match="not linear.*f\\(x\\) - f\\(0\\)"):
        ft.linear_transpose(lambda x: 2 * x + 1, torch.zeros(3))


def _block(x, w):
    return (torch.tanh(x @ w).exp() * x.sum()).sum()


def test_checkpoint_recomputes_in_the_backward_pass():
    calls = []

    def f(x, w):
        calls.append(1)
        return _block(x, w)

    x, w = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    g = ft.grad(ft.checkpoint(f), argnums=(0, 1))(x, w)
    assert len(calls) == 2  # once forward (not recorded), once in the backward pass
    e = torch.func.grad(_block, argnums=(0, 1))(x, w)
    torch.testing.assert_close(g, e)


def test_checkpoint_is_transparent_to_every_transform():
    x, w = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    remat = ft.checkpoint(_block)
    check_grads(remat, (x, w), order=2)
    torch.testing.assert_close(ft.hessian(remat)(x, w), torch.func.hessian(_block)(x, w))
    xs = torch.randn(5, 3, 4, dtype=torch.float64)
    torch.testing.assert_close(
        ft.vmap(ft.grad(remat), in_dims=(0, None))(xs, w),
        torch.func.vmap(torch.func.grad(_block), in_dims=(0, None))(xs, w),
    )
    torch.testing.assert_close(
        ft.jvp(remat, (x, w), (w.sum() * x, w))[1],
        torch.func.jvp(_block, (x, w), (w.sum() * x, w))[1],
    )
