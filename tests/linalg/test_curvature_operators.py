"""Jacobian, Hessian and GGN operators of a function: products against the dense matrices that
torch.func builds (jacrev, hessian), and grad, jvp and vmap through them with our transforms."""

import functransforms.linalg as L
import pytest
import torch

import functransforms as ft

DT = torch.float64


def close(a, b, **kw):
    torch.testing.assert_close(a, b, **{"rtol": 1e-8, "atol": 1e-10, **kw})


_G = torch.Generator().manual_seed(0)
W = torch.randn(4, 6, generator=_G, dtype=DT)


def model(x):  # [2, 3] -> [2, 2]
    return torch.tanh(W @ x.reshape(-1)).reshape(2, 2)


def scalar(x):
    return (torch.sin(x) ** 2).sum() * x.sum() + (x**3).prod()


def loss(z):
    return torch.logsumexp(z.reshape(-1), 0)


def x0(seed=1):
    return torch.randn(2, 3, generator=torch.Generator().manual_seed(seed), dtype=DT)


def dense_jacobian(x):
    return torch.func.jacrev(model)(x).reshape(4, 6)


def dense_hessian(x):
    return torch.func.hessian(scalar)(x).reshape(6, 6)


def dense_ggn(x):
    J = dense_jacobian(x)
    HL = torch.func.hessian(loss)(model(x)).reshape(4, 4)
    return J.T @ HL @ J


BUILDERS = {
    "jacobian": (lambda x: L.JacobianOperator(model, x), dense_jacobian),
    "hessian": (lambda x: L.HessianOperator(scalar, x), dense_hessian),
    "ggn": (lambda x: L.GGNOperator(model, loss, x), dense_ggn),
}


@pytest.mark.parametrize("kind", BUILDERS)
def test_products_match_dense(kind):
    build, dense = BUILDERS[kind]
    x = x0()
    op, D = build(x), dense(x)
    close(op.to_dense(), D)
    close(op.mT.to_dense(), D.T)
    g = torch.Generator().manual_seed(2)
    V = torch.randn(3, D.shape[1], 5, generator=g, dtype=DT)  # batch of matrices
    U = torch.randn(3, 5, D.shape[0], generator=g, dtype=DT)
    close(op @ V, D @ V)
    close(U @ op, U @ D)
    close(op.mT @ U.mT, D.T @ U.mT)
    v = V[0, :, 0]
    close(op @ v, D @ v)
    if kind != "jacobian":
        assert op.symmetric and op.mT is op
        close(torch.trace(op), torch.trace(D))


@pytest.mark.parametrize("kind", BUILDERS)
def test_grad_jvp_vmap_through_products(kind):
    build, dense = BUILDERS[kind]
    x = x0()
    g = torch.Generator().manual_seed(3)
    v = torch.randn(dense(x).shape[1], generator=g, dtype=DT)

    def f(x, v):
        return ((build(x) @ v) ** 2).sum() + (build(x).mT @ (build(x) @ v)).sum()

    def fd(x, v):
        D = dense(x)
        return ((D @ v) ** 2).sum() + (D.T @ (D @ v)).sum()

    close(ft.grad(f, argnums=(0, 1))(x, v), torch.func.grad(fd, argnums=(0, 1))(x, v))
    t = (torch.randn_like(x), torch.randn_like(v))
    close(ft.jvp(f, (x, v), t), torch.func.jvp(fd, (x, v), t))
    xs = torch.stack([x0(s) for s in range(3)])
    vs = torch.randn(3, v.shape[0], generator=g, dtype=DT)
    close(ft.vmap(f)(xs, vs), torch.stack([fd(a, b) for a, b in zip(xs, vs)]))
    # plain torch.autograd through the products
    xr = x.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(f(xr, v), xr)
    close(gx, torch.func.grad(fd)(x, v))


def test_ggn_cg_solve_is_implicitly_differentiated():
    x = x0()
    damping = 0.5

    def f(x, b):
        G = L.GGNOperator(model, loss, x) + L.ScaledIdentityOperator(
            torch.tensor(damping, dtype=DT), 6
        )
        return L.solve(G, b, method="cg", tol=1e-12).sum()

    def fd(x, b):
        return torch.linalg.solve(dense_ggn(x) + damping * torch.eye(6, dtype=DT), b).sum()

    b = torch.randn(6, generator=torch.Generator().manual_seed(4), dtype=DT)
    close(f(x, b), fd(x, b))
    close(ft.grad(f, argnums=(0, 1))(x, b), torch.func.grad(fd, argnums=(0, 1))(x, b), rtol=1e-6)


def test_errors_restate_the_call():
    with pytest.raises(ValueError, match=r"HessianOperator\(fn, x\): expected `fn` to return a"):
        L.HessianOperator(model, x0())
    with pytest.raises(TypeError, match=r"JacobianOperator\(fn, x\): expected `fn` to be a"):
        L.JacobianOperator(3, x0())
    with pytest.raises(TypeError, match=r"JacobianOperator\(fn, x\): expected `x` to be a float"):
        L.JacobianOperator(model, torch.ones(6, dtype=torch.long))


def test_torch_func_outside_refuses_clearly():
    """The products run our jvp/vjp; torch.func transforms outside them cannot be seen through,
    and the core says so (plain torch.autograd works: see above)."""
    with pytest.raises(Exception, match="called inside a torch.func transform"):
        torch.func.grad(lambda x: (L.JacobianOperator(model, x) @ torch.ones(6, dtype=DT)).sum())(
            x0()
        )
