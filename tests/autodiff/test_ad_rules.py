"""Derivative rules by family, against torch.func (the oracle) and finite differences."""

import pytest
import torch
import torch.nn.functional as F
from _ad_helpers import compare_with_torch_func, randn

import functransforms as ft

# (name, function, argument factory). Each runs jvp / vjp / grad vs torch.func and check_grads.
UNARY = [
    ("sin", torch.sin),
    ("cos", torch.cos),
    ("tan", torch.tan),
    ("exp", torch.exp),
    ("tanh", torch.tanh),
    ("sigmoid", torch.sigmoid),
    ("neg", torch.neg),
    ("square", torch.square),
    ("reciprocal", lambda x: torch.reciprocal(x + 4.0)),
    ("log", lambda x: torch.log(x * x + 0.5)),
    ("sqrt", lambda x: torch.sqrt(x * x + 1.0)),
    ("rsqrt", lambda x: torch.rsqrt(x * x + 1.0)),
    ("relu", lambda x: F.relu(x + 0.05)),
    ("gelu", F.gelu),
    ("silu", F.silu),
    ("softplus", F.softplus),
    ("log1p", lambda x: torch.log1p(x * x)),
    ("expm1", torch.expm1),
    ("erf", torch.erf),
    ("atan", torch.atan),
    ("pow_scalar", lambda x: x**3),
    ("pow_frac", lambda x: (x * x + 1) ** 1.5),
]


@pytest.mark.parametrize("name,f", UNARY, ids=[u[0] for u in UNARY])
def test_unary(name, f, device):
    compare_with_torch_func(f, (randn(3, 4, device=device),))


COMPLEX_UNARY = [
    ("sin", torch.sin),
    ("exp", torch.exp),
    ("mul_self", lambda z: z * z),
    ("mul_const", lambda z: z * (2 - 1j)),
    ("div", lambda z: z / (z * z + 3)),
    ("sum", lambda z: (z * z).sum()),
    ("matmul", lambda z: z @ z.T),
]


@pytest.mark.parametrize("name,f", COMPLEX_UNARY, ids=[u[0] for u in COMPLEX_UNARY])
def test_complex_unary(name, f):
    compare_with_torch_func(f, (randn(3, 3, dtype=torch.complex128),))


def test_complex_conj_product_jvp():
    compare_with_torch_func(
        lambda z: z * z.conj(), (randn(3, dtype=torch.complex128),), check=False
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_abs(dtype):
    compare_with_torch_func(lambda x: torch.abs(x + 0.05), (randn(3, 4, dtype=dtype),))


def test_complex_second_order():
    from functransforms.testing import check_grads

    check_grads(lambda z: z * z, (randn(3, dtype=torch.complex128),), order=2)


BINARY_SHAPES = [
    ((3, 4), (3, 4)),
    ((3, 4), (4,)),
    ((3, 1), (1, 4)),
    ((2, 3, 4), (3, 1)),
    ((), (3,)),
]
BINARY = [
    ("add", torch.add),
    ("sub", torch.sub),
    ("mul", torch.mul),
    ("div", lambda a, b: a / (b * b + 1)),
    ("pow", lambda a, b: (a * a + 1) ** b),
    ("maximum", torch.maximum),
    ("minimum", torch.minimum),
    ("atan2", torch.atan2),
    ("add_alpha", lambda a, b: torch.add(a, b, alpha=2.5)),
]


@pytest.mark.parametrize("shapes", BINARY_SHAPES, ids=str)
@pytest.mark.parametrize("name,f", BINARY, ids=[b[0] for b in BINARY])
def test_binary_broadcasting(name, f, shapes):
    compare_with_torch_func(f, (randn(*shapes[0]), randn(*shapes[1])))


def test_binary_with_python_scalar():
    compare_with_torch_func(lambda x: 2.0 * x - 1.5 / (x * x + 1) + x**2, (randn(4),))


REDUCTIONS = [
    ("sum", lambda x: x.sum()),
    ("sum_dim", lambda x: x.sum(1)),
    ("sum_keep", lambda x: x.sum((0, 2), keepdim=True)),
    ("mean", lambda x: x.mean(-1)),
    ("mean_keep", lambda x: x.mean(0, keepdim=True)),
    ("prod", lambda x: x.prod(1)),
    ("amax", lambda x: x.amax(1)),
    ("max_dim", lambda x: x.max(2).values),
    ("min_dim_keep", lambda x: x.min(0, keepdim=True).values),
    ("var", lambda x: x.var(1)),
    ("std", lambda x: x.std(-1)),
    ("logsumexp", lambda x: torch.logsumexp(x, 1)),
    ("norm", lambda x: torch.linalg.vector_norm(x, dim=-1)),
    ("cumsum", lambda x: x.cumsum(1)),
]


@pytest.mark.parametrize("name,f", REDUCTIONS, ids=[r[0] for r in REDUCTIONS])
def test_reductions(name, f):
    compare_with_torch_func(f, (randn(2, 3, 4),))


VIEWS = [
    ("reshape", lambda x: x.reshape(4, 6)),
    ("view", lambda x: x.view(-1)),
    ("permute", lambda x: x.permute(2, 0, 1)),
    ("transpose", lambda x: x.transpose(0, 2)),
    ("T", lambda x: x[0].T),
    ("unsqueeze", lambda x: x.unsqueeze(1)),
    ("squeeze", lambda x: x[:, :1].squeeze(1)),
    ("expand", lambda x: x[:, :1].expand(2, 5, 4)),
    ("slice", lambda x: x[:, 1:3, ::2]),
    ("select", lambda x: x[1, :, -1]),
    ("flatten", lambda x: x.flatten(1)),
    ("index_tensor", lambda x: x[torch.tensor([1, 0, 1])]),
    ("narrow", lambda x: x.narrow(2, 1, 2)),
    ("movedim", lambda x: x.movedim(0, -1)),
    ("flip", lambda x: x.flip(1)),
    ("repeat", lambda x: x.repeat(1, 2, 1)),
    ("diagonal", lambda x: x.diagonal(0, 1, 2)),
    ("contiguous", lambda x: x.transpose(0, 1).contiguous()),
]


@pytest.mark.parametrize("name,f", VIEWS, ids=[v[0] for v in VIEWS])
def test_views(name, f):
    compare_with_torch_func(f, (randn(2, 3, 4),))


MATMUL = [
    ("matmul_mv", lambda a, b: a @ b[:, 0], (3, 4), (4, 2)),
    ("mm", torch.mm, (3, 4), (4, 2)),
    ("bmm", torch.bmm, (2, 3, 4), (2, 4, 5)),
    ("matmul_bcast", torch.matmul, (2, 3, 4), (4, 5)),
    ("dot", torch.dot, (4,), (4,)),
    ("einsum", lambda a, b: torch.einsum("ij,jk->ik", a, b), (3, 4), (4, 2)),
    ("outer", torch.outer, (3,), (4,)),
    ("linear", lambda a, b: F.linear(a, b), (3, 4), (5, 4)),
]


@pytest.mark.parametrize("name,f,sa,sb", MATMUL, ids=[m[0] for m in MATMUL])
def test_matmul_family(name, f, sa, sb):
    compare_with_torch_func(f, (randn(*sa), randn(*sb)))


def test_nn_losses():
    x, y = randn(4, 5), randn(4, 5)
    target = torch.tensor([0, 3, 1, 4])
    compare_with_torch_func(lambda x: F.softmax(x, -1), (x,))
    compare_with_torch_func(lambda x: F.log_softmax(x, 0), (x,))
    compare_with_torch_func(lambda x: F.cross_entropy(x, target), (x,))
    compare_with_torch_func(lambda x: F.cross_entropy(x, target, reduction="sum"), (x,))
    compare_with_torch_func(lambda x: F.nll_loss(F.log_softmax(x, -1), target), (x,))
    compare_with_torch_func(lambda x, y: F.mse_loss(x, y), (x, y))
    compare_with_torch_func(lambda x, y: F.mse_loss(x, y, reduction="none"), (x, y))


def test_where_clamp():
    x, y = randn(3, 4), randn(3, 4)
    compare_with_torch_func(lambda x, y: torch.where(x > 0.1, x * y, y.exp()), (x, y))
    compare_with_torch_func(lambda x: torch.clamp(x, -0.55, 0.45), (x,))
    compare_with_torch_func(lambda x: x.clamp(min=-0.33), (x,))
    compare_with_torch_func(lambda x: torch.where(x > 0, x, 0.0), (x,))


def test_cat_stack_split():
    a, b = randn(2, 3), randn(4, 3)
    compare_with_torch_func(lambda a, b: torch.cat([a, b * 2]), (a, b))
    compare_with_torch_func(lambda a, b: torch.stack([a, b[:2]], 1), (a, b))
    compare_with_torch_func(
        lambda b: sum(p.sum(0) * (i + 1) for i, p in enumerate(b.split(2))), (b,)
    )
    compare_with_torch_func(lambda b: b.chunk(3, 1)[1] * b.unbind(1)[0][:, None], (b,))


def test_std_keepdim():
    compare_with_torch_func(lambda x: x.std(-1, keepdim=True), (randn(2, 3, 4),))


def test_index_tensor_with_slice_prefix():
    compare_with_torch_func(lambda x: x[:, torch.tensor([0, 2, 2])], (randn(2, 3, 4),))


def test_inplace_on_wrappers_jvp():
    def f(x, y):
        z = x.clone()
        z.mul_(y)
        z.add_(1.0)
        z.sin_()
        return z

    x, y = randn(3, 4), randn(3, 4)
    out, t = ft.jvp(f, (x, y), (y, x))
    out_ref, t_ref = torch.func.jvp(f, (x, y), (y, x))
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(t, t_ref)


def test_inplace_on_wrappers():
    def f(x, y):
        z = x.clone()
        z.mul_(y)
        z.add_(1.0)
        z[0] = z[0] * 3
        z.sin_()
        return z

    compare_with_torch_func(f, (randn(3, 4), randn(3, 4)))


def test_inplace_into_fresh_buffer():
    def f(x):
        buf = torch.zeros(3, 4, dtype=x.dtype)
        buf[1] = x.sin()
        buf.add_(x.unsqueeze(0))
        return buf

    compare_with_torch_func(f, (randn(4),))


def test_grad_argnums_and_aux():
    x, y = randn(3), randn(3)

    def f(x, y):
        return (x * y.sin()).sum(), {"aux": x * 2}

    g, aux = ft.grad(f, argnums=(0, 1), has_aux=True)(x, y)
    g_ref, aux_ref = torch.func.grad(f, argnums=(0, 1), has_aux=True)(x, y)
    torch.testing.assert_close(g, g_ref)
    torch.testing.assert_close(aux["aux"], aux_ref["aux"])
    v, g2 = ft.value_and_grad(lambda x: (x**2).sum())(x)
    torch.testing.assert_close(v, (x**2).sum())
    torch.testing.assert_close(g2, 2 * x)


def test_jacobians_and_hessian():
    x = randn(3)
    f = lambda x: torch.stack([x.sin().sum(), (x**2).prod(), x[0] * x[1]])
    torch.testing.assert_close(ft.jacrev(f)(x), torch.func.jacrev(f)(x))
    torch.testing.assert_close(ft.jacfwd(f)(x), torch.func.jacfwd(f)(x))
    h = lambda x: (x.sin() * x.cos().sum()).sum()
    torch.testing.assert_close(ft.hessian(h)(x), torch.func.hessian(h)(x))
