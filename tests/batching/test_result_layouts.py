"""Layouts (shape, strides, contiguity) of results under vmap of grad, jacrev, jacfwd, hessian
and vjp: fresh where torch.func's are fresh (Note [Seeds batched like the output]), including
identically-zero second derivatives. Each test compares with torch.func, the oracle."""

import itertools

import pytest
import torch
import torch.func as tf

import functransforms as ft

D = torch.float64


def _layout(t):
    return tuple(t.shape), t.stride(), t.is_contiguous()


def _leaves(x):
    return torch.utils._pytree.tree_leaves(x)


def _same_layout(build):
    ours, theirs = build(ft), build(tf)
    for a, b in zip(_leaves(ours), _leaves(theirs), strict=True):
        assert _layout(a) == _layout(b)
        torch.testing.assert_close(a, b)
    return ours


# -- 1. fresh results where torch.func's are fresh (Note [Seeds batched like the output]) ------
def test_vmap_grad_wrt_batched_argument_is_fresh_and_writable():
    w, xs = torch.randn(3, dtype=D), torch.randn(4, 3, dtype=D)
    f = lambda w, x: (w * x).mean()  # noqa: E731  grad wrt x = w / 3: never meets a batched value
    g = _same_layout(lambda L: L.vmap(L.grad(f, argnums=1), in_dims=(None, 0))(w, xs))
    assert g.is_contiguous()
    g.add_(1.0)  # raised before: a stride-0 expansion of w / 3
    torch.testing.assert_close(g, (w / 3 + 1).expand(4, 3))


_SCALAR = {
    "mean": lambda w, x: (w * x).mean(),
    "const": lambda w, x: (w * 2).sum() + x.sum(),
    "sums": lambda w, x: w.sum() + x.sum(),
    "sin": lambda w, x: w.sin().sum() + (x**2).sum(),
    "dot": lambda w, x: w @ x,
    "mixed": lambda w, x: (w**2).sum() * x.sum(),
}
_VECTOR = {
    "mul": lambda w, x: w * x,
    "affine": lambda w, x: 2 * w + x,
    "sin": lambda w, x: w.sin() + x.sum(),
    "scaled": lambda w, x: w.sum() * x,
}
_IN_DIMS = [(None, 0), (0, None), (0, 0)]


def _args(in_dims):
    torch.manual_seed(0)
    return tuple(torch.randn(4, 3, dtype=D) if d == 0 else torch.randn(3, dtype=D) for d in in_dims)


@pytest.mark.parametrize(
    "name,argnums,in_dims,out_dims",
    list(itertools.product(_SCALAR, [0, 1, (0, 1)], _IN_DIMS, [0, 1])),
)
def test_vmap_grad_layout_matches_torch_func(name, argnums, in_dims, out_dims):
    f, args = _SCALAR[name], _args(in_dims)
    _same_layout(
        lambda L: L.vmap(L.grad(f, argnums=argnums), in_dims=in_dims, out_dims=out_dims)(*args)
    )


@pytest.mark.parametrize(
    "name,argnums,in_dims,jac",
    list(itertools.product(_VECTOR, [0, 1, (0, 1)], _IN_DIMS, ["jacrev", "jacfwd"])),
)
def test_vmap_jacobian_layout_matches_torch_func(name, argnums, in_dims, jac):
    f, args = _VECTOR[name], _args(in_dims)
    _same_layout(lambda L: L.vmap(getattr(L, jac)(f, argnums=argnums), in_dims=in_dims)(*args))


@pytest.mark.parametrize("name,in_dims", list(itertools.product(_SCALAR, _IN_DIMS)))
def test_vmap_hessian_layout_matches_torch_func(name, in_dims):
    f, args = _SCALAR[name], _args(in_dims)
    _same_layout(lambda L: L.vmap(L.hessian(f, argnums=(0, 1)), in_dims=in_dims)(*args))


@pytest.mark.parametrize("name,in_dims", list(itertools.product(_VECTOR, _IN_DIMS)))
def test_vmap_vjp_of_unbatched_inputs_layout_matches_torch_func(name, in_dims):
    f, args = _VECTOR[name], _args(in_dims)

    def pulled(L):
        def one(w, x):
            out, vjp_fn = L.vjp(f, w, x)
            return vjp_fn(torch.ones_like(out))

        return L.vmap(one, in_dims=in_dims)(*args)

    _same_layout(pulled)


def test_broadcast_tangent_with_zero_partner_is_fresh():
    # torch's forward AD adds a zero tensor: _to_copy(t.expand(shape)), not a stride-0 view
    w, x = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    f = lambda w, x: w.sin() + x.sum()  # noqa: E731
    j = _same_layout(lambda L: L.jacfwd(f, argnums=1)(w, x))
    j.mul_(2.0)
    t = _same_layout(lambda L: L.jvp(lambda a: w + a.sum(), (x,), (x,))[1])
    t.add_(1.0)


# -- identically-zero second derivatives (docs/torch_func_differences.md, "Strides of results")
_W = torch.randn(3, 3, dtype=D, generator=torch.Generator().manual_seed(3))
_ZERO_SECOND = {
    # through torch's explicit zeros (threshold_backward's derivative in its mask input,
    # autodiff/elementwise.py def_mask_kernel): fresh batched tensors
    "relu": lambda x: torch.relu(x).sum(),
    "relu_linear": lambda x: torch.relu(x @ _W).sum(),
    "relu_vector": lambda x: torch.relu(x) * 2,
    # no path at all from x to the first derivative: functorch's zeros of the unbatched x
    "linear": lambda x: (x @ _W).sum(),
    "affine": lambda x: 2 * x.sum() + 1,
}


@pytest.mark.parametrize(
    "name,second", list(itertools.product(_ZERO_SECOND, ["hessian", "jacrev2", "jacfwd_jacrev"]))
)
def test_vmap_identically_zero_second_derivative_layout_matches_torch_func(name, second):
    f = _ZERO_SECOND[name]
    xs = torch.randn(4, 3, dtype=D, generator=torch.Generator().manual_seed(4))

    def build(L):
        if second == "hessian":
            h = L.hessian(f)
        elif second == "jacrev2":
            h = L.jacrev(L.jacrev(f))
        else:
            h = L.jacfwd(L.jacrev(f))
        return L.vmap(h)(xs)

    out = _same_layout(build)
    assert not out.abs().any()
