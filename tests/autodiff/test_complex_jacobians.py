"""jacrev / jacfwd / hessian with complex inputs or outputs, as torch.func: without
holomorphic=True every input and output must be real (torch.func raises; before, ours returned
the real part of the Jacobian of x -> (1+1j) x, a silent wrong result); with holomorphic=True
(JAX) every one must be complex, and the result is f'(z)."""

import pytest
import torch
import torch.func as tf

import functransforms as ft

_X = torch.tensor([0.3, -1.2], dtype=torch.float64)
_Z = torch.tensor([0.3 + 0.5j, -1.2 + 0.1j], dtype=torch.complex128)
_CASES = {
    "real_to_complex": (lambda x: x * (1 + 1j), _X),
    "complex_to_real": (lambda z: z.abs(), _Z),
    "complex_to_complex": (lambda z: z * z, _Z),
}
_SCALAR = {  # for hessian: scalar outputs
    "real_to_complex": (lambda x: (x * (1 + 1j)).sum(), _X),
    "complex_to_real": (lambda z: z.abs().sum(), _Z),
    "complex_to_complex": (lambda z: (z * z).sum(), _Z),
}


@pytest.mark.parametrize("kind", sorted(_CASES))
@pytest.mark.parametrize("transform", ["jacrev", "jacfwd", "hessian"])
def test_complex_without_holomorphic_raises_as_torch_func(transform, kind):
    f, x = (_SCALAR if transform == "hessian" else _CASES)[kind]
    with pytest.raises(RuntimeError, match="Expected all (inputs|outputs) to be real"):
        getattr(tf, transform)(f)(x)
    with pytest.raises(RuntimeError, match="Expected all (inputs|outputs) to be real.*holomorphic"):
        getattr(ft, transform)(f)(x)


@pytest.mark.parametrize("kind", ["real_to_complex", "complex_to_real"])
@pytest.mark.parametrize("transform", ["jacrev", "jacfwd", "hessian"])
def test_holomorphic_needs_complex_inputs_and_outputs(transform, kind):
    f, x = (_SCALAR if transform == "hessian" else _CASES)[kind]
    with pytest.raises(TypeError, match="holomorphic=True: expected complex"):
        getattr(ft, transform)(f, holomorphic=True)(x)


@pytest.mark.parametrize("transform", ["jacrev", "jacfwd"])
def test_holomorphic_jacobian_is_the_complex_derivative(transform):
    f = lambda z: z.exp() * z  # noqa: E731  f'(z) = exp(z) (1 + z)
    jac = getattr(ft, transform)(f, holomorphic=True)(_Z)
    torch.testing.assert_close(jac, torch.diag(_Z.exp() * (1 + _Z)))


def test_holomorphic_hessian_is_the_second_complex_derivative():
    h = ft.hessian(lambda z: (z**3).sum(), holomorphic=True)(_Z)
    torch.testing.assert_close(h, torch.diag(6 * _Z))


def test_vjp_and_jvp_still_take_complex_functions():
    # the transforms that follow PyTorch's convention (docs/complex.md) are not restricted
    f = lambda z: z.abs() * z  # noqa: E731  not holomorphic
    w = torch.ones_like(_Z)
    torch.testing.assert_close(ft.vjp(f, _Z)[1](w), tf.vjp(f, _Z)[1](w))
    torch.testing.assert_close(ft.jvp(f, (_Z,), (w,)), tf.jvp(f, (_Z,), (w,)))
