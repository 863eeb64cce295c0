"""torch.func parity in the details: bad input gets torch.func's exception class with a clear
message, torch.func's accepted inputs are accepted, and the JAX extras behave as in JAX.

Every error test runs the same call through torch.func in the same test, so a change of
torch.func's behaviour shows up here.
"""

import numpy as np
import pytest
import torch
import torch.func as tf

import functransforms as ft
from functransforms.errors import DataDependentError, EscapedTracerError

x = torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
xb = torch.randn(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
xi = torch.arange(3)


def both_raise(exc, make, match=None):
    """``make(lib)`` raises ``exc`` for torch.func and for us (with ``match`` in our message)."""
    with pytest.raises(exc):
        make(tf)
    with pytest.raises(exc, match=match):
        make(ft)


# -- bad input: the same exception class as torch.func, and a message that restates the call --
@pytest.mark.parametrize(
    "make",
    [
        lambda L: L.jvp(lambda a: a.sin(), (x,), (x,), has_aux=True),
        lambda L: L.jvp(lambda a: (a.sin(), a, a), (x,), (x,), has_aux=True),
        lambda L: L.jacfwd(lambda a: a.sin(), has_aux=True)(x),
        lambda L: L.grad(lambda a: a.sin().sum(), has_aux=True)(x),
        lambda L: L.vjp(lambda a: a.sin(), x, has_aux=True),
    ],
)
def test_has_aux_with_a_wrong_return_structure(make):
    both_raise(RuntimeError, make, match=r"has_aux=True: expected the function to return a pair")


@pytest.mark.parametrize(
    "make",
    [
        lambda L: L.grad(lambda a: (a.sin().sum(), 1.0), has_aux=True)(x),
        lambda L: L.vjp(lambda a: (a.sin(), "s"), x, has_aux=True),
        lambda L: L.jvp(lambda a: (a.sin(), 1.0), (x,), (x,), has_aux=True),
    ],
)
def test_non_tensor_aux(make):
    both_raise(RuntimeError, make, match=r"the aux output contains a (float|str)")


def test_tensor_aux_pytree_is_returned():
    g, aux = ft.grad(lambda a: (a.sin().sum(), {"k": a.cos()}), has_aux=True)(x)
    g_ref, aux_ref = tf.grad(lambda a: (a.sin().sum(), {"k": a.cos()}), has_aux=True)(x)
    torch.testing.assert_close(g, g_ref)
    torch.testing.assert_close(aux["k"], aux_ref["k"])


def test_vjp_fn_of_a_python_float():
    both_raise(TypeError, lambda L: L.vjp(lambda a: a.sum(), x)[1](1.0), match="tensor cotangents")


def test_vjp_fn_complex_cotangent_for_real_output():
    ct = torch.ones(3, dtype=torch.complex128)
    both_raise(RuntimeError, lambda L: L.vjp(torch.sin, x)[1](ct), match="complex output needs")
    z = x.to(torch.complex128)
    both_raise(RuntimeError, lambda L: L.vjp(torch.sin, z)[1](x), match="complex output needs")


def test_vjp_fn_casts_a_cotangent_of_another_real_dtype():
    ct = torch.ones(3, dtype=torch.float32)
    torch.testing.assert_close(ft.vjp(torch.sin, x)[1](ct), tf.vjp(torch.sin, x)[1](ct))


def test_vjp_fn_wrong_shape_and_structure():
    both_raise(RuntimeError, lambda L: L.vjp(torch.sin, x)[1](torch.ones(5, dtype=x.dtype)))
    both_raise(RuntimeError, lambda L: L.vjp(torch.sin, x)[1]((x, x)))


@pytest.mark.parametrize("returns", [None, ()])
def test_jacrev_of_a_function_with_no_output(returns):
    both_raise(RuntimeError, lambda L: L.jacrev(lambda a: returns)(x), match="at least one tensor")


def test_vmap_chunk_size():
    both_raise(TypeError, lambda L: L.vmap(torch.sin, chunk_size=True)(xb), match="positive int")
    for bad in (0, -1):
        both_raise(
            ValueError, lambda L, b=bad: L.vmap(torch.sin, chunk_size=b)(xb), match="positive int"
        )


def test_vmap_in_dims_bool():
    both_raise(TypeError, lambda L: L.vmap(torch.sin, in_dims=True)(xb), match="in_dims")


def test_grad_output_must_be_0d():
    both_raise(RuntimeError, lambda L: L.grad(lambda a: a.sum().reshape(1))(x), match=r"\(1,\)")


@pytest.mark.parametrize(
    "make,exc",
    [
        (lambda L: L.grad(lambda a: a.sum())(xi.double() * 0 + xi), None),  # float: fine
        (lambda L: L.grad(lambda a: a.sum())(xi), RuntimeError),
        (lambda L: L.jacrev(lambda a: a * 2)(xi), RuntimeError),
        (lambda L: L.vjp(lambda a: a * 2, xi), RuntimeError),
        (lambda L: L.jvp(lambda a: a * 2, (xi,), (xi,)), ValueError),
        (lambda L: L.jacfwd(lambda a: a * 2)(xi), ValueError),
        (lambda L: L.grad(lambda a: a.float().sum())(xi > 0), RuntimeError),
    ],
)
def test_integer_and_bool_inputs_are_not_differentiated(make, exc):
    if exc is None:
        torch.testing.assert_close(make(ft), make(tf))
    else:
        both_raise(exc, make, match="only floating-point and complex tensors carry derivatives")


def test_out_dims_out_of_range():
    both_raise(
        IndexError,
        lambda L: L.vmap(torch.sin, out_dims=2)(xb),
        match=r"out_dim=2 is out of range.*expected out_dim in \[-2, 1\]",
    )


def test_repeated_argnums():
    f = lambda a, b: (a * b).sum()  # noqa: E731
    both_raise(RuntimeError, lambda L: L.grad(f, argnums=(0, 0))(x, x), match="same input twice")
    both_raise(RuntimeError, lambda L: L.grad(f, argnums=(0, -2))(x, x), match="same input twice")


def test_requires_grad_inside_transforms():
    both_raise(
        RuntimeError, lambda L: L.grad(lambda a: a.requires_grad_().sum())(x), match="not supported"
    )
    both_raise(
        RuntimeError, lambda L: L.vmap(lambda a: a.requires_grad_())(xb), match="not supported"
    )


def test_data_under_vmap():
    both_raise(RuntimeError, lambda L: L.vmap(lambda a: a.data * 2)(xb), match="x.data")


def test_data_under_grad_is_allowed_as_in_torch_func():
    f = lambda a: (a.data * a).sum()  # noqa: E731
    torch.testing.assert_close(ft.grad(f)(x), tf.grad(f)(x))


def test_tolist_of_an_escaped_wrapper_names_the_transform():
    box = []
    ft.grad(lambda a: (box.append(a), a.sum())[1])(x)
    with pytest.raises(EscapedTracerError, match=r"`.tolist\(\)` of a grad wrapper.*escaped"):
        box[0].tolist()


# -- escaping to Python inside a transform (values, not differentiated) ---------------------------
@pytest.mark.parametrize("transform", ["grad", "jvp"])
def test_tolist_and_item_inside_autodiff(transform):
    def f(a):
        scale = a.tolist()[0] + a[1].item()
        return (a.sin() * scale).sum()

    if transform == "grad":
        ours, ref = ft.grad(f)(x), tf.grad(f)(x)
    else:
        ours = ft.jvp(f, (x,), (torch.ones_like(x),))
        ref = tf.jvp(lambda a: f(a), (x,), (torch.ones_like(x),))
    torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize("transform", ["grad", "jvp"])
def test_numpy_inside_autodiff(transform):
    # deliberate difference (docs/torch_func_differences.md): torch.func's wrappers have no
    # storage, so x.numpy() raises there; ours hands over the primal values, not differentiated
    def f(a):
        scale = float(np.asarray(a)[2]) + float(a.numpy()[0])
        return (a.sin() * scale).sum()

    def ref(a):
        return (a.sin() * (x[2].item() + x[0].item())).sum()

    if transform == "grad":
        torch.testing.assert_close(ft.grad(f)(x), tf.grad(ref)(x))
    else:
        t = torch.ones_like(x)
        torch.testing.assert_close(ft.jvp(f, (x,), (t,)), tf.jvp(ref, (x,), (t,)))


def test_tolist_of_a_batched_value_is_data_dependent():
    with pytest.raises(DataDependentError, match=r"\.tolist\(\)"):
        ft.vmap(lambda a: torch.tensor(a.tolist()))(xb)
    with pytest.raises(RuntimeError):
        ft.vmap(lambda a: a.sum().item())(xb)


# -- accepted where torch.func accepts -------------------------------------------------------------
def test_jvp_strict():
    torch.testing.assert_close(
        ft.jvp(torch.sin, (x,), (x,), strict=False), tf.jvp(torch.sin, (x,), (x,), strict=False)
    )
    with pytest.raises(RuntimeError, match="strict=True is not supported"):
        ft.jvp(torch.sin, (x,), (x,), strict=True)


def test_vmap_out_dims_none_returns_non_tensors_as_they_are():
    ref = tf.vmap(lambda a: (a.sin(), 3), out_dims=(0, None))(xb)
    for chunk_size in (None, 1):  # torch.func's chunked vmap raises here: ours does not
        ours = ft.vmap(lambda a: (a.sin(), 3), out_dims=(0, None), chunk_size=chunk_size)(xb)
        torch.testing.assert_close(ours[0], ref[0])
        assert ours[1] == ref[1] == 3
    both_raise(ValueError, lambda L: L.vmap(lambda a: (a, 3))(xb), match="out_dims=None")


def test_python_float_primals_as_in_jax():
    # deliberate difference (docs/torch_func_differences.md): torch.func raises
    g = ft.grad(lambda a: a * a)(3.0)
    assert g.dtype == torch.get_default_dtype() and g.dim() == 0 and g.item() == 6.0
    out, t = ft.jvp(lambda a: a * a, (3.0,), (1.0,))
    assert (out.item(), t.item()) == (9.0, 6.0)
    out, vjp_fn = ft.vjp(lambda a: a * a, 3.0)
    assert vjp_fn(torch.tensor(1.0))[0].item() == 6.0
    with pytest.raises(ValueError):
        tf.grad(lambda a: a * a)(3.0)
    with pytest.raises(ValueError, match="expected the differentiated inputs to be tensors"):
        ft.grad(lambda a: a * a)("3")


# -- shape errors torch raises, we raise -----------------------------------------------------------
def test_t_of_a_3d_example():
    both_raise(RuntimeError, lambda L: L.vmap(torch.t)(torch.randn(2, 3, 4, 5)), match=r"<= 2")


@pytest.mark.parametrize(
    "make",
    [
        lambda L: L.vmap(torch.mm)(torch.randn(2, 3, 4), torch.randn(2, 5, 6)),
        lambda L: L.vmap(torch.mm, in_dims=(0, None))(torch.randn(2, 3, 4), torch.randn(5, 6)),
        lambda L: L.vmap(torch.mv)(torch.randn(2, 3, 4), torch.randn(2, 5)),
        lambda L: L.vmap(torch.dot)(torch.randn(2, 3), torch.randn(2, 5)),
        lambda L: L.vmap(torch.bmm)(torch.randn(2, 1, 3, 4), torch.randn(2, 1, 5, 6)),
        lambda L: L.vmap(torch.linalg.det)(torch.randn(2, 3)),
        lambda L: L.vmap(torch.linalg.slogdet)(torch.randn(2, 3)),
        lambda L: L.vmap(torch.linalg.eigvalsh)(torch.randn(2, 3)),
    ],
)
def test_mismatched_shapes_raise(make):
    both_raise(RuntimeError, make)


@pytest.mark.parametrize("op", [torch.amin, torch.amax, torch.mean, torch.sum, torch.logsumexp])
def test_dim_minus_one_of_0d_examples(op):
    xs = torch.randn(3, dtype=torch.float64)
    torch.testing.assert_close(ft.vmap(lambda a: op(a, -1))(xs), tf.vmap(lambda a: op(a, -1))(xs))


# -- the JAX API -----------------------------------------------------------------------------------
z = torch.randn(3, dtype=torch.complex128, generator=torch.Generator().manual_seed(2))


def test_grad_holomorphic_is_the_complex_derivative():
    f = lambda a: (a * a.exp()).sum()  # noqa: E731  f'(z) = (1 + z) e^z, elementwise
    expected = (1 + z) * z.exp()
    torch.testing.assert_close(ft.grad(f, holomorphic=True)(z), expected)
    v, g = ft.value_and_grad(f, holomorphic=True)(z)
    torch.testing.assert_close(g, expected)
    torch.testing.assert_close(v, f(z))
    g2, v2 = ft.grad_and_value(f, holomorphic=True)(z)
    torch.testing.assert_close(g2, expected)
    # jacrev(holomorphic) agrees
    torch.testing.assert_close(ft.jacrev(f, holomorphic=True)(z), expected)


def test_hessian_holomorphic():
    f = lambda a: (a**3).sum()  # noqa: E731  f'' = 6 z on the diagonal
    torch.testing.assert_close(ft.hessian(f, holomorphic=True)(z), torch.diag(6 * z))


def test_holomorphic_rejects_real_inputs_and_outputs():
    with pytest.raises(TypeError, match="holomorphic=True: expected complex inputs"):
        ft.grad(lambda a: (a * a).sum(), holomorphic=True)(x)
    with pytest.raises(TypeError, match="holomorphic=True: expected complex inputs"):
        ft.jacrev(lambda a: a * a, holomorphic=True)(x)
    with pytest.raises(TypeError, match="holomorphic=True: expected a complex output"):
        ft.grad(lambda a: (a * a).abs().sum(), holomorphic=True)(z)


def test_hessian_has_aux():
    f = lambda a: ((a**3).sum(), a.cos())  # noqa: E731
    h, aux = ft.hessian(f, has_aux=True)(x)
    torch.testing.assert_close(h, tf.hessian(lambda a: (a**3).sum())(x))
    torch.testing.assert_close(aux, x.cos())


def test_linearize_runs_the_function_once_and_matches_jvp():
    calls = []

    def f(a, b):
        calls.append(1)
        return {"y": (a.sin() * b).cumsum(0), "z": a @ b}

    b = torch.randn(3, dtype=torch.float64)
    out, jvp_fn = ft.linearize(f, x, b)
    assert len(calls) == 1
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        ta, tb = (torch.randn(3, dtype=torch.float64, generator=g) for _ in range(2))
        t = jvp_fn(ta, tb)
        _, ref = tf.jvp(f, (x, b), (ta, tb))
        torch.testing.assert_close(t["y"], ref["y"])
        torch.testing.assert_close(t["z"], ref["z"])
    assert len(calls) == 1 + 3 * 1  # only torch.func's reference ran it again
    ref_out, ref_fn = tf.linearize(f, x, b)
    torch.testing.assert_close(out["y"], ref_out["y"])


def test_linearize_complex_and_has_aux():
    f = lambda a: (a.exp() * a.conj(), a.abs())  # noqa: E731  not holomorphic: real-linear
    out, jvp_fn, aux = ft.linearize(f, z, has_aux=True)
    v = torch.randn(3, dtype=torch.complex128)
    torch.testing.assert_close(jvp_fn(v), tf.jvp(lambda a: f(a)[0], (z,), (v,))[1])
    torch.testing.assert_close(aux, z.abs())


def test_linearize_inside_vmap_and_wrong_tangent():
    def per_example(a, t):
        return ft.linearize(torch.tanh, a)[1](t)

    ts = torch.randn(2, 3, dtype=torch.float64)
    torch.testing.assert_close(
        ft.vmap(per_example)(xb, ts),
        tf.vmap(lambda a, t: tf.jvp(torch.tanh, (a,), (t,))[1])(xb, ts),
    )
    _, jvp_fn = ft.linearize(torch.tanh, x)
    with pytest.raises(ValueError, match="a tangent has shape"):
        jvp_fn(torch.ones(4, dtype=torch.float64))


# -- views and aliasing as in torch ----------------------------------------------------------------
VIEW_FNS = {
    "slice": lambda t: t[1:],
    "select": lambda t: t[0],
    "narrow": lambda t: t.narrow(0, 1, 2),
    "view": lambda t: t.view(5),
    "reshape": lambda t: t.reshape(5),
    "t": lambda t: t.unsqueeze(0).t(),
    "transpose": lambda t: t.unsqueeze(1).transpose(0, 1),
    "permute": lambda t: t.unsqueeze(1).permute(1, 0),
    "diagonal": lambda t: t.view(1, 5).diagonal(),
    "unbind": lambda t: t.unbind()[1],
    "split": lambda t: t.split(2)[1],
    "as_strided": lambda t: t.as_strided((2,), (2,)),
    "expand": lambda t: t.expand(2, 5),
    "movedim": lambda t: t.unsqueeze(0).movedim(0, 1),
    "flatten_copy": lambda t: t.unsqueeze(0).mT.flatten(),  # a copy in both
    "sin": torch.sin,  # not a view in both
}


@pytest.mark.parametrize("name", sorted(VIEW_FNS))
@pytest.mark.parametrize("in_dim", [0, 1])
def test_vmap_returns_views_where_torch_func_does(name, in_dim):
    f = VIEW_FNS[name]
    base = torch.randn(4, 5)
    x = base if in_dim == 0 else base.mT.contiguous()
    ours, ref = ft.vmap(f, in_dims=in_dim)(x), tf.vmap(f, in_dims=in_dim)(x)
    torch.testing.assert_close(ours, ref)
    assert (ours._base is x) == (ref._base is x)
    assert ours.stride() == ref.stride()


def test_writes_through_a_returned_view_reach_the_input():
    ours, ref = torch.zeros(3, 4), torch.zeros(3, 4)
    ft.vmap(lambda t: t[1:])(ours).fill_(1.0)
    tf.vmap(lambda t: t[1:])(ref).fill_(1.0)
    assert torch.equal(ours, ref) and ours.sum() == 9
