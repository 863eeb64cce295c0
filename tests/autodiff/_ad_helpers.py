"""Compare ft.grad / ft.vjp / ft.jvp against torch.func (the oracle) and run check_grads."""

import torch

import functransforms as ft
from functransforms.testing import check_grads

F64 = torch.float64


def randn(*shape, dtype=F64, device="cpu"):
    return torch.randn(tuple(shape), dtype=dtype, device=device)


def assert_trees_close(a, b, atol=1e-7, rtol=1e-6):
    la = torch.utils._pytree.tree_leaves(a)
    lb = torch.utils._pytree.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol)


def compare_with_torch_func(f, args, *, grads=True, order=1, check=True):
    """vjp and jvp (and grad of sum-of-real-part when ``grads``) against torch.func."""
    gen = torch.Generator().manual_seed(1)
    diff = tuple(i for i, a in enumerate(args) if a.dtype.is_floating_point or a.dtype.is_complex)

    def g(*d):
        full = list(args)
        for i, x in zip(diff, d):
            full[i] = x
        return f(*full)

    primals = tuple(args[i] for i in diff)
    tangents = tuple(_rand(p, gen) for p in primals)
    out, tout = ft.jvp(g, primals, tangents)
    out_ref, tout_ref = torch.func.jvp(g, primals, tangents)
    assert_trees_close(out, out_ref)
    assert_trees_close(tout, tout_ref)

    out, vjp_fn = ft.vjp(g, *primals)
    out_ref, vjp_ref = torch.func.vjp(g, *primals)
    cts = torch.utils._pytree.tree_map(lambda o: _rand(o, gen), out_ref)
    assert_trees_close(vjp_fn(cts), vjp_ref(cts))

    if grads:

        def s(*d):
            o = g(*d)
            o = o.real if o.is_complex() else o
            return (o * o).sum()

        argnums = tuple(range(len(primals)))
        assert_trees_close(ft.grad(s, argnums)(*primals), torch.func.grad(s, argnums)(*primals))
    if check:
        check_grads(g, primals, order=order)


def _rand(x, gen):
    if x.dtype.is_complex:
        return torch.complex(
            torch.randn(x.shape, generator=gen, dtype=x.real.dtype),
            torch.randn(x.shape, generator=gen, dtype=x.real.dtype),
        ).to(x.device)
    return torch.randn(x.shape, generator=gen, dtype=x.dtype).to(x.device)
