"""The error-behaviour checks of functorch's own test suite (test/functorch/test_vmap.py and
test_eager_transforms.py in PyTorch: `assertRaisesRegex` on misuse of vmap, grad, vjp, jvp and
the Jacobians), run against functransforms and, as the reference, against torch.func.

Each case is the misuse and the exception class torch.func raises for it; ours must raise the
same class (or a subclass), with a message of our own (it restates the call, expected vs
received, and what to do: messages are not matched against functorch's wording). The cases
where we deliberately differ are in DIFFERENCES, each with its section of
docs/torch_func_differences.md, and are checked to behave as documented.
"""

import pytest
import torch
import torch.func as tf

import functransforms as ft

x23 = torch.randn(2, 3)
x235 = torch.randn(2, 3, 5)
v3 = torch.randn(3)


def _mul(a, b):
    return a * b


# name: (the call, made with a transforms module `M`; torch.func's exception class)
CASES = {
    # -- test_vmap.py ---------------------------------------------------------------------------
    "vmap_non_tensor_output": (lambda M: M.vmap(lambda x: 3.14)(torch.ones(3)), ValueError),
    "vmap_non_tensor_second_output": (
        lambda M: M.vmap(lambda x: (x, 3))(torch.ones(3)),
        ValueError,
    ),
    "vmap_different_map_dim_size": (
        lambda M: M.vmap(_mul)(torch.randn(2), torch.randn(3)),
        ValueError,
    ),
    "vmap_func_with_no_inputs": (lambda M: M.vmap(lambda: torch.ones(3))(), ValueError),
    "vmap_func_with_no_tensors": (lambda M: M.vmap(lambda x: x)(1), ValueError),
    "vmap_in_dims_wrong_type_list": (
        lambda M: M.vmap(_mul, in_dims=[0, 0])(x23, x23),
        ValueError,
    ),
    "vmap_in_dims_wrong_type_set": (lambda M: M.vmap(torch.sin, in_dims={0})(x23), ValueError),
    "vmap_in_dims_wrong_type_str": (lambda M: M.vmap(torch.sin, in_dims="lol")(x23), ValueError),
    "vmap_in_dims_wrong_entry_type": (
        lambda M: M.vmap(torch.sin, in_dims=("lol",))(x23),
        ValueError,
    ),
    "vmap_not_enough_in_dims": (lambda M: M.vmap(_mul, (0,))(x23, x23), ValueError),
    "vmap_too_many_in_dims": (lambda M: M.vmap(_mul, (0, 0, 0))(x23, x23), ValueError),
    "vmap_integer_in_dim_for_a_float": (lambda M: M.vmap(_mul, (0, 0))(x23, 0.5), ValueError),
    "vmap_integer_in_dim_for_a_tuple_of_ints": (
        lambda M: M.vmap(lambda a, t: a, (0, 0))(x23, (1,)),
        ValueError,
    ),
    "vmap_integer_in_dim_for_none": (lambda M: M.vmap(_mul, (0, 0))(x23, None), ValueError),
    "vmap_in_dim_not_in_tensor": (lambda M: M.vmap(torch.sum, (2,))(x23), ValueError),
    "vmap_negative_in_dim_not_in_tensor": (lambda M: M.vmap(torch.sum, (-3,))(x23), ValueError),
    "vmap_in_dim_of_a_0d_tensor": (lambda M: M.vmap(torch.sum)(torch.tensor(1.0)), ValueError),
    "vmap_out_dims_str": (lambda M: M.vmap(lambda x: x, out_dims="lol")(x23), ValueError),
    "vmap_out_dims_tuple_of_str": (
        lambda M: M.vmap(lambda x: x, out_dims=("lol",))(x23),
        ValueError,
    ),
    "vmap_too_many_out_dims": (lambda M: M.vmap(lambda x: x, out_dims=(0, 0))(x235), ValueError),
    "vmap_too_many_out_dims_for_three_outputs": (
        lambda M: M.vmap(lambda x: (x, x, x), out_dims=(0, 0, 0, 0))(x235),
        ValueError,
    ),
    "vmap_too_few_out_dims": (lambda M: M.vmap(lambda x: (x, x), out_dims=(0,))(x235), ValueError),
    "vmap_too_few_out_dims_for_three_outputs": (
        lambda M: M.vmap(lambda x: (x, x, x), out_dims=(0, 0))(x235),
        ValueError,
    ),
    "vmap_out_dim_out_of_bounds": (lambda M: M.vmap(lambda x: x, out_dims=3)(x235), IndexError),
    "vmap_negative_out_dim_out_of_bounds": (
        lambda M: M.vmap(lambda x: x, out_dims=-4)(x235),
        IndexError,
    ),
    "vmap_out_dim_none_for_a_batched_output": (
        lambda M: M.vmap(lambda x: x, out_dims=None)(x23),
        ValueError,
    ),
    "vmap_inplace_into_an_unbatched_tensor": (
        lambda M: M.vmap(lambda x: torch.zeros(3).add_(x))(x23),
        RuntimeError,
    ),
    "vmap_item_of_a_batched_tensor": (
        lambda M: M.vmap(lambda x: x.sum().item())(x23),
        RuntimeError,
    ),
    "vmap_random_op_under_randomness_error": (
        lambda M: M.vmap(lambda x: x + torch.rand(3))(x23),
        RuntimeError,
    ),
    "vmap_invalid_randomness": (
        lambda M: M.vmap(torch.sin, randomness="lol")(x23),
        RuntimeError,
    ),
    "vmap_chunk_size_zero": (lambda M: M.vmap(torch.sin, chunk_size=0)(x23), ValueError),
    "vmap_chunk_size_negative": (lambda M: M.vmap(torch.sin, chunk_size=-1)(x23), ValueError),
    # -- test_eager_transforms.py ---------------------------------------------------------------
    "grad_of_a_non_scalar_output": (lambda M: M.grad(lambda x: x)(v3), RuntimeError),
    "grad_of_a_non_tensor_output": (lambda M: M.grad(lambda x: 1.0)(v3), RuntimeError),
    "grad_of_an_integer_input": (
        lambda M: M.grad(lambda x: x.sum())(torch.ones(3, dtype=torch.long)),
        RuntimeError,
    ),
    "grad_of_a_python_int": (lambda M: M.grad(lambda x: x * x)(3), ValueError),
    "grad_of_a_string": (lambda M: M.grad(lambda x: torch.ones(()))("x"), ValueError),
    "grad_argnums_out_of_range": (
        lambda M: M.grad(lambda x, y: (x * y).sum(), argnums=2)(v3, v3),
        RuntimeError,
    ),
    "grad_negative_argnums_out_of_range": (
        lambda M: M.grad(lambda x, y: (x * y).sum(), argnums=-3)(v3, v3),
        RuntimeError,
    ),
    "grad_argnums_empty": (lambda M: M.grad(lambda x: x.sum(), argnums=())(v3), RuntimeError),
    "grad_argnums_repeated": (
        lambda M: M.grad(lambda x, y: (x * y).sum(), argnums=(0, 0))(v3, v3),
        RuntimeError,
    ),
    "grad_argnums_float": (lambda M: M.grad(lambda x: x.sum(), argnums=0.0)(v3), RuntimeError),
    "grad_argnums_list": (lambda M: M.grad(lambda x: x.sum(), argnums=[0])(v3), RuntimeError),
    "grad_has_aux_without_a_tuple": (
        lambda M: M.grad(lambda x: x.sum(), has_aux=True)(v3),
        RuntimeError,
    ),
    "grad_has_aux_with_a_triple": (
        lambda M: M.grad(lambda x: (x.sum(), x, x), has_aux=True)(v3),
        RuntimeError,
    ),
    "grad_has_aux_with_a_list": (
        lambda M: M.grad(lambda x: [x.sum(), x], has_aux=True)(v3),
        RuntimeError,
    ),
    "grad_aux_is_an_int": (
        lambda M: M.grad(lambda x: (x.sum(), 3), has_aux=True)(v3),
        RuntimeError,
    ),
    "grad_of_a_complex_output": (lambda M: M.grad(lambda x: x.sum() * 1j)(v3), RuntimeError),
    "vjp_of_a_python_int": (lambda M: M.vjp(lambda x: x, 3), ValueError),
    "vjp_of_a_non_tensor_output": (lambda M: M.vjp(lambda x: 1.0, v3), RuntimeError),
    "vjp_of_no_output": (lambda M: M.vjp(lambda x: None, v3), RuntimeError),
    "vjp_has_aux_without_a_tuple": (lambda M: M.vjp(lambda x: x, v3, has_aux=True), RuntimeError),
    "vjp_aux_is_an_int": (lambda M: M.vjp(lambda x: (x, 3), v3, has_aux=True), RuntimeError),
    "vjp_fn_cotangent_of_the_wrong_shape": (
        lambda M: M.vjp(torch.sin, v3)[1](torch.ones(2)),
        RuntimeError,
    ),
    "vjp_fn_cotangent_of_the_wrong_structure": (
        lambda M: M.vjp(lambda x: (x, x), v3)[1](torch.ones(3)),
        RuntimeError,
    ),
    "vjp_fn_cotangent_that_is_not_a_tensor": (
        lambda M: M.vjp(torch.sin, v3)[1](3),
        TypeError,
    ),
    "jvp_primals_not_a_tuple": (lambda M: M.jvp(torch.sin, v3, (v3,)), RuntimeError),
    "jvp_tangents_not_a_tuple": (lambda M: M.jvp(torch.sin, (v3,), v3), RuntimeError),
    "jvp_primals_a_list": (lambda M: M.jvp(torch.sin, [v3], [v3]), RuntimeError),
    "jvp_structures_differ": (lambda M: M.jvp(torch.sin, (v3,), (v3, v3)), RuntimeError),
    "jvp_tangent_of_the_wrong_shape": (
        lambda M: M.jvp(torch.sin, (v3,), (torch.ones(2),)),
        RuntimeError,
    ),
    "jvp_integer_tangent": (
        lambda M: M.jvp(torch.sin, (v3,), (torch.ones(3, dtype=torch.long),)),
        ValueError,
    ),
    "jvp_of_a_python_int": (lambda M: M.jvp(lambda x: x, (3,), (1,)), RuntimeError),
    "jvp_of_a_non_tensor_output": (lambda M: M.jvp(lambda x: 1.0, (v3,), (v3,)), RuntimeError),
    "jvp_of_no_output": (lambda M: M.jvp(lambda x: None, (v3,), (v3,)), RuntimeError),
    "jvp_strict_with_an_output_independent_of_the_primals": (
        lambda M: M.jvp(lambda x: (x.sin(), torch.ones(2)), (v3,), (v3,), strict=True),
        RuntimeError,
    ),
    "jvp_has_aux_without_a_tuple": (
        lambda M: M.jvp(lambda x: x.sin(), (v3,), (v3,), has_aux=True),
        RuntimeError,
    ),
    "jacrev_argnums_out_of_range": (lambda M: M.jacrev(torch.sin, argnums=1)(v3), RuntimeError),
    "jacfwd_argnums_out_of_range": (lambda M: M.jacfwd(torch.sin, argnums=1)(v3), RuntimeError),
    "jacrev_of_a_complex_input": (
        lambda M: M.jacrev(torch.sin)(v3.to(torch.complex64)),
        RuntimeError,
    ),
    "jacfwd_of_a_complex_output": (lambda M: M.jacfwd(lambda x: x * 1j)(v3), RuntimeError),
    "jacfwd_invalid_randomness": (
        lambda M: M.jacfwd(torch.sin, randomness="lol")(v3),
        RuntimeError,
    ),
    "jacrev_of_no_output": (lambda M: M.jacrev(lambda x: None)(v3), RuntimeError),
    "jacfwd_of_no_output": (lambda M: M.jacfwd(lambda x: None)(v3), RuntimeError),
    "jacrev_chunk_size_zero": (lambda M: M.jacrev(torch.sin, chunk_size=0)(v3), ValueError),
    "hessian_of_a_python_int": (lambda M: M.hessian(lambda x: (x * x).sum())(3), ValueError),
}

# name: (section of docs/torch_func_differences.md, what we do instead, checked)
DIFFERENCES = {
    # torch.func raises AttributeError ("'int' object has no attribute 'numel'") from inside
    "hessian_of_a_python_int": ("40", lambda r: isinstance(r, ValueError)),
    "jacfwd_of_a_python_int": ("40", lambda r: isinstance(r, ValueError)),
}


def _outcome(call, lib):
    try:
        return call(lib)
    except Exception as e:  # noqa: BLE001
        return e


@pytest.mark.parametrize("name", sorted(CASES))
def test_functorch_error_check(name):
    call, expected = CASES[name]
    ref = _outcome(call, tf)
    ours = _outcome(call, ft)
    if name in DIFFERENCES:
        _, holds = DIFFERENCES[name]
        assert holds(ours), ours
        return
    assert isinstance(ref, expected), f"torch.func: {ref!r}"  # the reference still holds
    assert isinstance(ours, expected), f"ours: {ours!r}"
    assert str(ours), "an empty message"


def test_jacfwd_of_a_python_int():
    with pytest.raises(AttributeError):  # torch.func, from inside its jacfwd
        tf.jacfwd(lambda x: x * x)(3)
    with pytest.raises(ValueError, match=r"^jacfwd\(<lambda>, argnums=0\): .*an int \(3\)"):
        ft.jacfwd(lambda x: x * x)(3)
