"""Error conditions: the right exception class, and a message that names the call, what was
expected and what to do."""

import pytest
import torch

import functransforms as ft
from functransforms.errors import DataDependentError, InplaceError, RandomnessError, TransformError

x3 = torch.randn(3, dtype=torch.float64)


def test_grad_of_non_scalar_output():
    with pytest.raises(RuntimeError, match=r"scalar.*got \(3,\)"):
        ft.grad(lambda x: x * 2)(x3)
    with pytest.raises(RuntimeError):  # torch.func's class, for code written against it
        torch.func.grad(lambda x: x * 2)(x3)


def test_grad_of_complex_output():
    with pytest.raises(RuntimeError, match="real scalar output; got torch.complex128"):
        ft.grad(lambda x: (x * 2).sum() * 1j)(x3)
    with pytest.raises(RuntimeError):
        torch.func.grad(lambda x: (x * 2).sum() * 1j)(x3)


def test_grad_of_integer_output_is_zero_as_torch_func():
    f = lambda x: (x * 2).sum().long()  # noqa: E731
    torch.testing.assert_close(ft.grad(f)(x3), torch.func.grad(f)(x3))


@pytest.mark.parametrize("argnums", [2, -3, (0, 5)])
def test_argnums_out_of_range(argnums):
    with pytest.raises(
        RuntimeError, match=r"argnums=.*out of range.*2 positional arguments"
    ) as info:
        ft.grad(lambda x, y: (x * y).sum(), argnums=argnums)(x3, x3)
    assert f"argnums={argnums!r}" in str(info.value)


def test_vmap_mismatched_batch_sizes():
    with pytest.raises(ValueError, match=r"same size along their in_dim.*\(3, 2\).*\(4, 2\)"):
        ft.vmap(torch.add)(torch.randn(3, 2), torch.randn(4, 2))


def test_in_dims_not_matching_inputs():
    with pytest.raises(ValueError, match=r"in_dims has 3 entries but 2 positional inputs"):
        ft.vmap(torch.add, in_dims=(0, 0, 0))(x3, x3)
    with pytest.raises(ValueError, match=r"in_dims\[0\] is a tuple of length 3.*tree prefix"):
        ft.vmap(lambda p: p[0] + p[1], in_dims=((0, 0, 0),))((x3, x3))


@pytest.mark.parametrize("in_dim", [2, -3])
def test_out_of_range_in_dim(in_dim):
    with pytest.raises(ValueError, match=rf"in_dim={in_dim}.*2 dims.*expected in_dim in \[-2, 1\]"):
        ft.vmap(torch.sin, in_dims=in_dim)(torch.randn(3, 2))


@pytest.mark.parametrize(
    "f", [lambda x: x + torch.randn(2), lambda x: torch.rand_like(x)], ids=["randn", "rand_like"]
)
def test_randomness_error(f):
    with pytest.raises(RandomnessError, match="randomness='error'.*randomness='different'"):
        ft.vmap(f)(torch.randn(3, 2))
    assert issubclass(RandomnessError, TransformError)


@pytest.mark.parametrize(
    "f", [lambda x: x.sum().item(), lambda x: x * 2 if x.sum() > 0 else x], ids=["item", "bool"]
)
def test_data_dependent_under_vmap(f):
    with pytest.raises(
        DataDependentError, match=r"reads a batched tensor as a Python value.*\.item\(\)"
    ):
        ft.vmap(f)(torch.randn(3, 2))


@pytest.mark.parametrize(
    "write", [lambda buf, x: buf.add_(x), lambda buf, x: buf.copy_(x)], ids=["add_", "copy_"]
)
def test_inplace_batched_into_captured(write):
    buf = torch.zeros(2)
    with pytest.raises(
        InplaceError, match="writes a batched value in place into a tensor that is not batched"
    ):
        ft.vmap(lambda x: write(buf, x))(torch.randn(3, 2))
    assert torch.equal(buf, torch.zeros(2))


def test_missing_rule_names_op_and_decorator():
    # the message names the user's call, the op, where it decomposes to, and the decorator
    # (igamma in its first argument: torch has no derivative for it either)
    def f(a):
        return torch.igamma(a.abs() + 1, torch.ones(3))

    with pytest.raises(
        NotImplementedError,
        match=r"^grad\(<lambda>, argnums=0\): .*aten\.igamma\.default -> "
        r"prims\.igamma\.default"
        r".*register_vjp_rule\(aten\.igamma\.default\)",
    ):
        ft.grad(lambda x: f(x).sum())(x3)
    with pytest.raises(
        NotImplementedError,
        match=r"^jvp\(f, .*register_jvp_rule\(aten\.igamma",
    ):
        ft.jvp(f, (x3,), (x3,))


def test_escaped_wrapper():
    leaked = []
    ft.grad(lambda x: leaked.append(x * 2) or (x**2).sum())(x3)
    with pytest.raises(TransformError, match="after its .* call returned"):
        leaked[0] + 1
