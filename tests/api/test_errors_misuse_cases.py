"""The mistakes a new user makes with each transform, one named test each, with torch.func's
behaviour as the reference: the same exception class, or the same value, or a documented
difference (docs/torch_func_differences.md, the section named in the test)."""

import re

import pytest
import torch
import torch.func as tf
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import functransforms as ft
from functransforms._compat import TORCH_VERSION

f64 = torch.float64
x32 = torch.randn(3, 2, dtype=f64)
v3 = torch.randn(3, dtype=f64)


def both_raise(exc, make, match):
    with pytest.raises(exc):
        make(tf)
    with pytest.raises(exc, match=match):
        make(ft)


# -- vmap ---------------------------------------------------------------------------------------
def test_vmap_integer_in_dim_for_a_none_input_raises():
    both_raise(
        ValueError,
        lambda M: M.vmap(lambda a, b: a, in_dims=(0, 0))(x32, None),
        r"in_dims=\(0, 0\).*in_dims\[1\] is 0, but the matching input is None.*in_dims=\(0, None\)",
    )
    both_raise(ValueError, lambda M: M.vmap(lambda a, b: a)(x32, None), r"input 1\) is 0.*None")
    both_raise(
        ValueError,
        lambda M: M.vmap(lambda d: d["w"], in_dims=({"w": 0, "b": 0},))({"w": x32, "b": None}),
        r"in_dims\[0\]\['b'\] is 0, but the matching input is None",
    )
    # None as its in_dim: both compute
    torch.testing.assert_close(
        ft.vmap(lambda a, b: a.sin(), in_dims=(0, None))(x32, None),
        tf.vmap(lambda a, b: a.sin(), in_dims=(0, None))(x32, None),
    )


def test_vmap_none_nested_in_a_mapped_container_is_an_empty_subtree():
    """Section 6: None inside a container mapped by one int is an empty subtree (as JAX);
    torch.func raises."""
    with pytest.raises(ValueError):
        tf.vmap(lambda d: d["w"].sin())({"w": x32, "b": None})
    torch.testing.assert_close(ft.vmap(lambda d: d["w"].sin())({"w": x32, "b": None}), x32.sin())


def test_vmap_bool_in_dim_raises():
    both_raise(
        TypeError,
        lambda M: M.vmap(torch.sin, in_dims=(True,))(x32),
        r"in_dims\[0\] is True; expected an int or None",
    )


@pytest.mark.parametrize("out_dims", [3, -3, (0, 5)], ids=["3", "-3", "(0, 5)"])
def test_vmap_out_dims_out_of_range(out_dims):
    f = (lambda a: (a.sin(), a.cos())) if isinstance(out_dims, tuple) else torch.sin
    bad = out_dims[1] if isinstance(out_dims, tuple) else out_dims
    both_raise(
        IndexError,
        lambda M: M.vmap(f, out_dims=out_dims)(x32),
        rf"out_dims={re.escape(repr(out_dims))}.*out_dim={bad} is out of range"
        r".*expected out_dim in \[-2, 1\]",
    )


def test_vmap_of_a_function_returning_none():
    """Section 6: None outputs come back as None (as JAX); torch.func raises ValueError."""
    for f in (lambda a: None, lambda a: (a.sin(), None)):
        with pytest.raises(ValueError, match="must only return Tensors"):
            tf.vmap(f)(x32)
    assert ft.vmap(lambda a: None)(x32) is None
    y, nothing = ft.vmap(lambda a: (a.sin(), None))(x32)
    assert nothing is None
    torch.testing.assert_close(y, x32.sin())


def test_vmap_non_tensor_output_names_the_value():
    both_raise(
        ValueError,
        lambda M: M.vmap(lambda a: (a, 3))(x32),
        r"output 1 \(flattened\) is an int \(3\); .*out_dims=None",
    )


def test_vmap_0d_input_names_what_to_pass():
    both_raise(
        ValueError,
        lambda M: M.vmap(torch.sin)(torch.tensor(1.0)),
        r"has 0 dims \(shape \(\)\); expected in_dim=None",
    )


# -- Python numbers as differentiated inputs ---------------------------------------------------
def test_python_float_primal_is_differentiated_as_a_0d_tensor():
    """Section 1: a Python float is differentiated as a 0-d tensor of the default dtype (as
    JAX); torch.func raises. The value is torch.func's at that tensor."""
    t = torch.tensor(3.0)
    cube = lambda a: a * a * a  # noqa: E731
    with pytest.raises(ValueError):
        tf.grad(cube)(3.0)
    with pytest.raises(ValueError):
        tf.vjp(cube, 3.0)
    with pytest.raises(RuntimeError):
        tf.jvp(cube, (3.0,), (1.0,))
    torch.testing.assert_close(ft.grad(cube)(3.0), tf.grad(cube)(t))
    torch.testing.assert_close(ft.vjp(cube, 3.0)[1](torch.tensor(1.0)), tf.vjp(cube, t)[1](t / t))
    torch.testing.assert_close(
        ft.jvp(cube, (3.0,), (1.0,)), tf.jvp(cube, (t,), (torch.tensor(1.0),))
    )


def test_float_returning_function_raises_rather_than_giving_zero():
    """A function that returns a Python float (``float(x)`` drops the graph): both raise, never
    a zero gradient."""
    for f in (lambda a: 1.5, lambda a: float(a.sum())):
        both_raise(RuntimeError, lambda M, f=f: M.grad(f)(v3), r"output 0 \(flattened\) is a float")
        both_raise(RuntimeError, lambda M, f=f: M.vjp(f, v3), r"is a float")
        both_raise(RuntimeError, lambda M, f=f: M.jvp(f, (v3,), (v3,)), r"is a float")


def test_grad_of_a_python_int_names_it():
    both_raise(
        ValueError,
        lambda M: M.grad(lambda a: a * a)(3),
        r"^grad\(<lambda>, argnums=0\): .*differentiated input 0 \(flattened\) is an int \(3\)\. "
        r"Pass a float \(3\.0\)",
    )
    both_raise(RuntimeError, lambda M: M.jvp(lambda a: a, (3,), (1,)), r"is an int \(3\)")


def test_grad_of_a_none_input_and_none_aux():
    """Section 6: None is an empty pytree (its gradient is None), and so may aux be; torch.func
    raises for both."""
    with pytest.raises(ValueError):
        tf.grad(lambda a: torch.tensor(1.0))(None)
    assert ft.grad(lambda a, b: (a * a).sum())(v3, None) is not None
    assert ft.grad(lambda a: torch.ones(()))(None) is None
    with pytest.raises(RuntimeError):
        tf.grad(lambda a: (a.sum(), None), has_aux=True)(v3)
    g, aux = ft.grad(lambda a: (a.sum(), None), has_aux=True)(v3)
    assert aux is None
    torch.testing.assert_close(g, torch.ones_like(v3))


# -- has_aux: the message names the user's value -------------------------------------------------
@pytest.mark.parametrize(
    "call",
    [
        lambda M: M.grad(lambda a: a.sum(), has_aux=True)(v3),
        lambda M: M.vjp(lambda a: a.sin(), v3, has_aux=True),
        lambda M: M.jvp(lambda a: a.sin(), (v3,), (v3,), has_aux=True),
        lambda M: M.jacrev(lambda a: a.sin(), has_aux=True)(v3),
        lambda M: M.jacfwd(lambda a: a.sin(), has_aux=True)(v3),
        lambda M: M.vmap(M.grad(lambda a: a.sum(), has_aux=True))(x32),
    ],
    ids=["grad", "vjp", "jvp", "jacrev", "jacfwd", "vmap_grad"],
)
def test_has_aux_error_names_the_value_not_a_wrapper_class(call):
    with pytest.raises(RuntimeError):
        call(tf)
    with pytest.raises(RuntimeError, match=r"pair \(output, aux\); got a tensor of shape") as info:
        call(ft)
    assert "dtype torch.float64" in str(info.value)
    for internal in ("GradTensor", "DualTensor", "BatchedTensor", "InVmap"):
        assert internal not in str(info.value)


def test_has_aux_with_an_int_aux():
    both_raise(
        RuntimeError,
        lambda M: M.grad(lambda a: (a.sum(), 3), has_aux=True)(v3),
        r"has_aux=True: the aux output contains an int \(3\)",
    )


# -- functions without a tensor output ---------------------------------------------------------
@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "jacrev", "vjp", "grad", "hessian"])
def test_function_returning_none_raises(transform):
    call = {
        "jvp": lambda M: M.jvp(lambda a: None, (v3,), (v3,)),
        "vjp": lambda M: M.vjp(lambda a: None, v3),
    }.get(transform, lambda M: getattr(M, transform)(lambda a: None)(v3))
    both_raise(
        RuntimeError, call, rf"^{transform}\(.*output to contain at least one tensor; got None"
    )


def test_jvp_with_empty_primals_gives_zero_tangents():
    """Section 25: jvp with no tensor primals returns the output and a zero tangent; torch.func
    raises "Expected primals to contain at least one Tensor"."""
    with pytest.raises(RuntimeError):
        tf.jvp(lambda: torch.ones(2), (), ())
    out, t = ft.jvp(lambda: torch.ones(2), (), ())
    assert torch.equal(out, torch.ones(2)) and torch.equal(t, torch.zeros(2))


# -- argnums ------------------------------------------------------------------------------------
def test_jacfwd_negative_argnums():
    """Section 40: torch.func's jacfwd at a negative argnum returns zeros (torch 2.13 and 2.15);
    ours is the Jacobian, as jacrev's and torch.func's jacrev."""
    f = lambda a, b: a.sin() * b  # noqa: E731
    ref = tf.jacrev(f, argnums=1)(v3, v3)
    torch.testing.assert_close(ft.jacfwd(f, argnums=-1)(v3, v3), ref)
    torch.testing.assert_close(ft.jacrev(f, argnums=-1)(v3, v3), ref)
    assert not tf.jacfwd(f, argnums=-1)(v3, v3).any()  # torch.func: zeros


# -- grad mode and devices ------------------------------------------------------------------------
def test_inference_mode_inside_grad_acts_as_no_grad():
    """Section 40: inference_mode() inside the function acts as no_grad (its results are
    constants); torch.func raises when one of its tensors is saved for backward, and computes
    the same value when none is."""

    def f(a, ctx):
        with ctx():
            b = a * 2
        return (b * a).sum()

    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        tf.grad(f)(v3, torch.inference_mode)
    torch.testing.assert_close(ft.grad(f)(v3, torch.inference_mode), tf.grad(f)(v3, torch.no_grad))

    def whole(a):
        with torch.inference_mode():
            return (a * a).sum()

    torch.testing.assert_close(ft.grad(whole)(v3), tf.grad(whole)(v3))  # both: zeros


@pytest.mark.parametrize("transform", ["grad", "jvp"])
def test_meta_tensors_writing_into_a_fresh_zeros_buffer(transform):
    x = torch.empty(3, dtype=f64, device="meta")

    def f(a):
        buf = torch.zeros(3, dtype=f64, device=a.device)
        buf[0] = a[0]
        return (buf * a).sum()

    if transform == "grad":
        ours, ref = ft.grad(f)(x), tf.grad(f)(x)
    else:
        ours, ref = ft.jvp(f, (x,), (x,))[1], tf.jvp(f, (x,), (x,))[1]
    assert ours.device == ref.device and ours.shape == ref.shape and ours.dtype == ref.dtype


def test_packed_sequences_under_another_default_device():
    """The stand-ins torch's packing kernels read are made on the CPU (the kernels take CPU
    lengths) and the padding on the values' device, whatever the default device."""
    x = torch.randn(4, 3, 2, dtype=f64)
    lengths = [4, 3, 2]

    def f(x):
        out, _ = pad_packed_sequence(pack_padded_sequence(x, lengths), total_length=5)
        return out.pow(2).sum()

    leaf = x.clone().requires_grad_()  # plain autograd: torch.func's grad refuses packing
    (expected,) = torch.autograd.grad(f(leaf), leaf)
    with torch.device("meta"):
        got = ft.grad(f)(x)
        batched = ft.vmap(ft.grad(f))(x.expand(2, 4, 3, 2))
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(batched, expected.expand(2, 4, 3, 2))


# -- found by generating misuse -------------------------------------------------------------
def test_vmap_mismatched_sizes_before_an_unmappable_input():
    """Two mapped sizes disagree and a later input cannot be mapped at all: the unmappable
    input is the error (torch.func checks every input before the sizes), never a crash while
    describing the sizes."""
    a, b = torch.randn(2, 2, dtype=f64), torch.randn(3, 2, dtype=f64)
    both_raise(
        ValueError,
        lambda M: M.vmap(lambda *t: t[0])(a, b, 2),
        r"input 2 \(flattened\) has in_dim=0, but it is an int \(2\); expected a tensor",
    )
    both_raise(
        ValueError,
        lambda M: M.vmap(lambda *t: t[0], in_dims=(0, 0, 2))(a, b, v3),
        r"input 2 \(flattened\) has in_dim=2, but it has 1 dims \(shape \(3,\)\)",
    )
    both_raise(
        ValueError,
        lambda M: M.vmap(lambda *t: t[0])(a, b, v3),
        r"input 0 of shape \(2, 2\) mapped over dim 0, input 1 of shape \(3, 2\) .*input 2",
    )


def test_linearize_of_an_integer_output_gives_a_zero_tangent():
    """An integer output does not move: jvp_fn gives it a zero tangent of its dtype, as
    torch.func's linearize and both libraries' jvp."""
    f = lambda a: (a.sin(), (a * 3).long(), torch.tensor(3))  # noqa: E731
    t = torch.ones_like(v3)
    out, jvp_fn = ft.linearize(f, v3)
    ref_out, ref_fn = tf.linearize(f, v3)
    ours, ref = jvp_fn(t), ref_fn(t)
    for o, r in zip(ours, ref):
        assert o.dtype == r.dtype and o.shape == r.shape
        torch.testing.assert_close(o, r.detach())
    torch.testing.assert_close(ours, ft.jvp(f, (v3,), (t,))[1])
    out, jvp_fn = ft.linearize(lambda a: (a * 3).long(), v3)  # nothing moves at all
    assert torch.equal(jvp_fn(t), torch.zeros(3, dtype=torch.long))


def test_python_number_tangent_of_a_0d_primal():
    """Section 1: a Python number is a tangent of its primal's dtype, as it is a primal;
    torch.func raises. A tangent must still have its primal's shape."""
    x = torch.tensor(0.5, dtype=f64)
    with pytest.raises(RuntimeError):
        tf.jvp(torch.sin, (x,), (1.0,))
    out, t = ft.jvp(torch.sin, (x,), (1.0,))
    assert t.dtype == f64
    torch.testing.assert_close((out, t), tf.jvp(torch.sin, (x,), (torch.ones_like(x),)))
    both_raise(
        RuntimeError, lambda M: M.jvp(torch.sin, (v3,), (1.0,)), r"a tangent is a float \(1\.0\)"
    )


def test_vmap_output_independent_of_the_mapped_inputs_at_a_nonzero_out_dim():
    """Section 39: an output that does not depend on the mapped inputs, placed at out_dim=k,
    is that value repeated along dim k, as torch 2.15's torch.func gives it. torch 2.13's raises
    from inside torch or, when the sizes happen to allow its expand, returns other values."""
    a = torch.randn(2, 3, dtype=f64)
    for out_dim, batch in ((1, 4), (2, 4), (1, 2)):
        want = a.exp().unsqueeze(out_dim).expand(*[2, 3][:out_dim], batch, *[2, 3][out_dim:])
        got = ft.vmap(lambda c, y: c.exp(), (None, 0), out_dim)(a, torch.randn(batch))
        assert torch.equal(got, want)
    square = torch.randn(2, 2, dtype=f64)
    ref = tf.vmap(lambda c, y: c.exp(), (None, 0), 1)(square, torch.randn(2))
    fixed = TORCH_VERSION >= (2, 15)
    assert torch.equal(ref, square.exp().unsqueeze(1).expand(2, 2, 2)) == fixed
