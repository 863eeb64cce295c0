"""torch.autograd.Function under our transforms follows torch.func's contract
(Note [autograd.Function under transforms]): every test runs torch.func beside us."""

import numpy as np
import pytest
import torch
import torch.func as tf
from torch.autograd.function import once_differentiable

import functransforms as ft

x = torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
xb = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


class NumpySin(torch.autograd.Function):
    """forward in NumPy: only possible because forward runs on unwrapped tensors"""

    @staticmethod
    def forward(a):
        return torch.from_numpy(np.sin(a.detach().cpu().numpy()))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def vmap(info, in_dims, a):  # NumPy sees the whole physical batch
        return NumpySin.apply(a), in_dims[0]

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return g * a.cos() * 3  # deliberately not the true derivative: must be used

    @staticmethod
    def jvp(ctx, t):
        (a,) = ctx.saved_tensors
        return t * a.cos() * 3


class ScaledExp(torch.autograd.Function):
    """a differentiable backward, a jvp, and an explicit vmap staticmethod"""

    @staticmethod
    def forward(a, scale):
        return a.exp() * scale

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.scale = inputs[1]
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g * out, None

    @staticmethod
    def jvp(ctx, ta, _):
        (out,) = ctx.saved_tensors
        return ta * out

    @staticmethod
    def vmap(info, in_dims, a, scale):
        ScaledExp.vmap_calls += 1
        return ScaledExp.apply(a, scale), in_dims[0]

    vmap_calls = 0


def numpy_sin_sum(a):
    return NumpySin.apply(a).sum()


@pytest.mark.parametrize(
    "make",
    [
        lambda L: L.grad(numpy_sin_sum)(x),
        lambda L: L.jvp(NumpySin.apply, (x,), (torch.ones_like(x),)),
        lambda L: L.vmap(NumpySin.apply)(xb),
        lambda L: L.vmap(L.grad(numpy_sin_sum))(xb),
        lambda L: L.grad(lambda a: L.vmap(NumpySin.apply)(a).sum())(xb),
        lambda L: L.jacrev(NumpySin.apply)(x),
        lambda L: L.jacfwd(NumpySin.apply)(x),
    ],
    ids=["grad", "jvp", "vmap", "vmap(grad)", "grad(vmap)", "jacrev", "jacfwd"],
)
def test_user_rules_are_used_as_torch_func_uses_them(make):
    torch.testing.assert_close(make(ft), make(tf))


@pytest.mark.parametrize(
    "make",
    [
        lambda L: L.grad(lambda a: ScaledExp.apply(a, 2.0).sum())(x),
        lambda L: L.hessian(lambda a: ScaledExp.apply(a, 2.0).sum())(x),
        lambda L: L.jvp(L.grad(lambda a: ScaledExp.apply(a, 2.0).sum()), (x,), (x,)),
        lambda L: L.vmap(lambda a: ScaledExp.apply(a, 2.0))(xb),
        lambda L: L.vmap(L.grad(lambda a: ScaledExp.apply(a, 2.0).sum()))(xb),
    ],
    ids=["grad", "hessian", "jvp(grad)", "vmap", "vmap(grad)"],
)
def test_differentiable_backward_and_vmap_staticmethod(make):
    torch.testing.assert_close(make(ft), make(tf))


class GeneratedCube(torch.autograd.Function):
    """generate_vmap_rule=True: forward, backward and jvp are vmapped as they are"""

    generate_vmap_rule = True

    @staticmethod
    def forward(a):
        return a**3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return g * 3 * a**2

    @staticmethod
    def jvp(ctx, t):
        (a,) = ctx.saved_tensors
        return t * 3 * a**2


@pytest.mark.parametrize(
    "make",
    [
        lambda L: L.vmap(GeneratedCube.apply)(xb),
        lambda L: L.vmap(L.grad(lambda a: GeneratedCube.apply(a).sum()))(xb),
        lambda L: L.grad(lambda a: L.vmap(GeneratedCube.apply)(a).sum())(xb),
        lambda L: L.jacfwd(GeneratedCube.apply)(x),
        lambda L: L.jacrev(GeneratedCube.apply)(x),
        lambda L: L.hessian(lambda a: GeneratedCube.apply(a).sum())(x),
    ],
    ids=["vmap", "vmap(grad)", "grad(vmap)", "jacfwd", "jacrev", "hessian"],
)
def test_generate_vmap_rule(make):
    torch.testing.assert_close(make(ft), make(tf))


def test_vmap_staticmethod_is_called():
    ScaledExp.vmap_calls = 0
    ft.vmap(lambda a: ScaledExp.apply(a, 2.0))(xb)
    assert ScaledExp.vmap_calls == 1


def test_setup_context_is_required():
    class Old(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    for L in (tf, ft):
        with pytest.raises(RuntimeError, match="setup_context"):
            L.grad(lambda a: Old.apply(a).sum())(x)
    # outside transforms the old style keeps working
    a = x.clone().requires_grad_()
    Old.apply(a).sum().backward()
    torch.testing.assert_close(a.grad, torch.full_like(x, 2.0))


def test_vmap_needs_a_rule():
    class NoVmap(torch.autograd.Function):
        @staticmethod
        def forward(a):
            return a * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return g * 2

    for L in (tf, ft):
        with pytest.raises(RuntimeError, match="generate_vmap_rule"):
            L.vmap(NoVmap.apply)(xb)
    torch.testing.assert_close(ft.grad(lambda a: NoVmap.apply(a).sum())(x), torch.full_like(x, 2.0))


class Once(torch.autograd.Function):
    @staticmethod
    def forward(a):
        return a**3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return g * 3 * a**2


def test_once_differentiable():
    f = lambda a: Once.apply(a).sum()  # noqa: E731
    torch.testing.assert_close(ft.grad(f)(x), tf.grad(f)(x))
    with pytest.raises(RuntimeError):
        tf.grad(tf.grad(f))(x)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        ft.grad(lambda a: ft.grad(f)(a).sum())(x)


def test_plain_autograd_outside_transforms_is_unchanged():
    a = x.clone().requires_grad_()
    ScaledExp.apply(a, 2.0).sum().backward()
    torch.testing.assert_close(a.grad, 2.0 * x.exp())
    assert torch.autograd.Function.apply.__func__.__module__ == "functransforms._autograd_function"


@pytest.mark.parametrize("transform", ["grad", "vjp", "vmap(grad)"])
def test_outputs_have_requires_grad_and_grad_fn_inside_grad(transform):
    """Note [requires_grad and grad_fn inside grad]: as torch.func's, a Function's output inside
    grad requires grad and has a grad_fn (named after the Function), the input is a leaf that
    requires grad, and user code that branches on them takes the same branch."""
    seen = {}

    def f(lib):
        def g(a):
            y = NumpySin.apply(a)
            z = a * 2
            seen[lib] = (
                y.requires_grad, y.grad_fn is not None, y.is_leaf, a.requires_grad,
                a.grad_fn is None, a.is_leaf, z.requires_grad, z.grad_fn is not None,
            )  # fmt: skip
            scale = 2.0 if y.requires_grad and y.grad_fn is not None else 100.0
            return (y * scale).sum()

        return g

    def run(lib):
        if transform == "grad":
            return lib.grad(f(lib))(x)
        if transform == "vjp":
            out, fn = lib.vjp(f(lib), x)
            return out, fn(torch.ones_like(out))
        return lib.vmap(lib.grad(f(lib)))(xb)

    torch.testing.assert_close(run(ft), run(tf))
    assert seen[ft] == seen[tf] == (True, True, False, True, True, True, True, True)


def test_grad_fn_is_named_after_the_function_and_the_op():
    def g(a):
        names.append((NumpySin.apply(a).grad_fn.name(), a.sin().grad_fn.name()))
        return a.sum()

    names = []
    ft.grad(g)(x)
    assert names == [("NumpySinBackward", "SinBackward")]
    with pytest.raises(RuntimeError, match="requires_grad"):
        ft.grad(lambda a: setattr(a, "requires_grad", False) or a.sum())(x)


# -- generated vmap rules under enclosing differentiation levels --------------------------------
class _ZeroForward(torch.autograd.Function):
    """Value zero, derivative ``x_dot / a``: its forward's ops alone have no derivative (the
    shape of linalg's implicit solves), so only its rules give the right one."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, a):
        return torch.zeros_like(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])
        ctx.save_for_forward(inputs[1])

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return g / a, None

    @staticmethod
    def jvp(ctx, x_dot, a_dot):
        (a,) = ctx.saved_for_forward
        return x_dot / a


def _through_zero_forward(p):
    x = p[0] ** 3 + p[1] * p[0]
    y = _ZeroForward.apply(x * p[1], p[1] ** 2 + 1)  # its derivative: d(x p1) / (p1²+1)
    return x + y + 3 * y**2  # y² has the second derivative 2 dy dy^T: both levels' dy


@pytest.mark.parametrize(
    "outer",
    [
        lambda f: ft.hessian(f),
        lambda f: ft.jacrev(ft.jacrev(f)),
        lambda f: ft.jacfwd(ft.jacfwd(f)),
        lambda f: ft.jacfwd(ft.jacrev(f)),
    ],
    ids=["hessian", "jacrev-jacrev", "jacfwd-jacfwd", "jacfwd-jacrev"],
)
def test_generated_vmap_rule_inside_two_differentiation_levels_uses_the_rules(outer):
    # the enclosing levels see the batched Function as their op, not its forward's ops
    P = torch.tensor([[0.7, 1.3], [0.4, -2.0], [1.1, 0.2]], dtype=torch.float64)
    got = outer(lambda P: ft.vmap(_through_zero_forward)(P).sum())(P)
    # the rows are independent: torch.func's Hessian of each row on the diagonal blocks
    want = torch.zeros(3, 2, 3, 2, dtype=torch.float64)
    for i, p in enumerate(P):
        want[i, :, i, :] = torch.func.hessian(_through_zero_forward)(p)
    torch.testing.assert_close(got, want)
    # and a vmap inside that vmap batches the batched Function again
    got2 = outer(lambda P: ft.vmap(ft.vmap(_through_zero_forward))(P[None]).sum())(P)
    torch.testing.assert_close(got2, want)
