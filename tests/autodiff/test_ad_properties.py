"""Hypothesis properties: jvp vs finite differences, the vjp dot-product test, and commuting
transforms (vmap of grad, jvp of grad == hvp), all on float64."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functransforms as ft
from functransforms.testing import check_grads, check_vmap
from functransforms.testing import strategies as fts

FUNCS = {
    "sin_sq_sum": lambda x: (x.sin() ** 2).sum(),
    "tanh_mean": lambda x: torch.tanh(x * 1.5).mean(),
    "softmax_dot": lambda x: (torch.softmax(x.flatten(), 0) * x.flatten()).sum(),
    "exp_norm": lambda x: torch.exp(-(x * x).sum()) + (x**3).sum(),
    "logsumexp": lambda x: torch.logsumexp(x.flatten(), 0),
}
VECTOR_FUNCS = {
    "sin_times_exp": lambda x: x.sin() * x.exp(),
    "cumsum_tanh": lambda x: torch.tanh(x).cumsum(-1),
    "outer_sum": lambda x: (x.unsqueeze(-1) * x.unsqueeze(-2)).sum(-1),
}
real_tensors = fts.tensors(
    shape=fts.shapes(min_dims=1, max_dims=2, max_side=3), min_value=-2, max_value=2
)


@given(x=real_tensors, name=st.sampled_from(sorted(VECTOR_FUNCS)))
def test_jvp_matches_finite_differences(x, name):
    check_grads(VECTOR_FUNCS[name], (x,), modes=("fwd",))


@given(x=real_tensors, name=st.sampled_from(sorted(VECTOR_FUNCS)))
def test_vjp_dot_product(x, name):
    check_grads(VECTOR_FUNCS[name], (x,), modes=("rev",))


@given(x=fts.tensors(shape=(3,), dtype=torch.complex128, min_value=-2, max_value=2))
def test_complex_holomorphic_first_order(x):
    check_grads(lambda z: z.sin() * z + z.exp(), (x,), order=1)


@given(
    x=fts.tensors(
        shape=fts.shapes(min_dims=1, max_dims=2, max_side=3), min_value=-1.5, max_value=1.5
    ),
    name=st.sampled_from(sorted(FUNCS)),
)
def test_second_order(x, name):
    check_grads(FUNCS[name], (x,), order=2)


@given(
    xs=fts.tensors(
        shape=st.tuples(st.integers(1, 4), st.integers(1, 3)), min_value=-2, max_value=2
    ),
    name=st.sampled_from(sorted(FUNCS)),
)
def test_vmap_of_grad_is_per_example_grad(xs, name):
    f = FUNCS[name]
    batched = ft.vmap(ft.grad(f))(xs)
    for i in range(xs.shape[0]):
        torch.testing.assert_close(batched[i], ft.grad(f)(xs[i]))
        torch.testing.assert_close(batched[i], torch.func.grad(f)(xs[i]))


@given(x=real_tensors, name=st.sampled_from(sorted(FUNCS)), data=st.data())
def test_jvp_of_grad_is_hvp(x, name, data):
    f = FUNCS[name]
    v = data.draw(fts.tensors(shape=tuple(x.shape), min_value=-1, max_value=1))
    hvp = ft.jvp(ft.grad(f), (x,), (v,))[1]
    ref = torch.func.jvp(torch.func.grad(f), (x,), (v,))[1]
    torch.testing.assert_close(hvp, ref)
    torch.testing.assert_close(
        hvp, ft.hessian(f)(x).reshape(x.numel(), x.numel()).mv(v.flatten()).reshape(x.shape)
    )


@given(
    x=fts.tensors(shape=(3, 2)),
    y=fts.tensors(shape=(2,)),
    in_dims=st.sampled_from([(0, None), (-2, None), (1, None), (-1, 0), (None, 0)]),
)
def test_vmap_matches_loop_for_in_dims_mix(x, y, in_dims):
    check_vmap(lambda a, b: a * b.sum() + b.mean(), (x, y), in_dims=in_dims, out_dims=0)
    check_vmap(
        lambda a, b: (a.sin(), {"s": a.sum() * b.sum()}), (x, y), in_dims=in_dims, out_dims=(-1, 0)
    )


def test_check_grads_catches_wrong_rule():
    x = torch.randn(4, dtype=torch.float64)
    with pytest.raises(AssertionError, match="finite differences"):
        check_grads(lambda x: x.detach() * x, (x,), modes=("fwd",))
    with pytest.raises(AssertionError, match="dot-product test"):
        check_grads(lambda x: x.detach() * x, (x,), modes=("rev",))
