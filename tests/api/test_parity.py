"""torch.func parity in the details: bad input gets torch.func's exception class with a clear
message, torch.func's accepted inputs are accepted, and the JAX extras behave as in JAX.

Every error test runs the same call through torch.func in the same test, so a change of
torch.func's behaviour shows up here.
"""

import warnings

import numpy as np
import pytest
import torch
import torch.func as tf

import functransforms as ft
from functransforms.errors import DataDependentError, EscapedTracerError, InplaceError

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


@pytest.mark.parametrize("transform", ["vjp", "grad", "jvp", "grad(grad)"])
def test_torch_tensor_of_a_wrapper_is_a_constant_as_in_torch_func(transform):
    """torch.tensor([a]) builds its data with the Python dispatch key excluded: it read the
    wrapper's (absent) data ("data is not allocated yet"). torch.func: a constant (no
    derivative), with the value of a; int(a) / complex(a) the same."""
    a = x[0].clone()

    def f(a):
        return torch.tensor([a, 2 * a]) * a + torch.tensor([int(a * 10)]) + torch.tensor([a]).sum()

    def run(lib):
        if transform == "vjp":
            out, fn = lib.vjp(f, a)
            return out, fn(torch.ones(2, dtype=a.dtype))
        if transform == "grad":
            return lib.grad(lambda a: f(a).sum())(a)
        if transform == "jvp":
            return lib.jvp(f, (a,), (torch.ones_like(a),))
        return lib.grad(lib.grad(lambda a: (f(a) * a).sum()))(a)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns of a requires-grad tensor made a number
        torch.testing.assert_close(run(ft), run(tf))
    z = torch.tensor(1.0 + 2.0j, dtype=torch.complex128)
    torch.testing.assert_close(
        ft.jvp(lambda z: torch.tensor([complex(z)]) * z, (z,), (z,)),
        tf.jvp(lambda z: torch.tensor([complex(z)]) * z, (z,), (z,)),
    )


def test_torch_tensor_of_a_batched_value_is_data_dependent():
    both_raise(RuntimeError, lambda lib: lib.vmap(lambda a: torch.tensor([a]))(x))
    with pytest.raises(DataDependentError, match="batched tensor as Python data"):
        ft.vmap(lambda a: torch.tensor([a]))(x)


# -- accepted where torch.func accepts -------------------------------------------------------------
def test_jvp_strict():
    torch.testing.assert_close(
        ft.jvp(torch.sin, (x,), (x,), strict=False), tf.jvp(torch.sin, (x,), (x,), strict=False)
    )
    # strict=True as torch.func's: computes when every output depends on the primals, raises
    # (RuntimeError) for an output that does not
    torch.testing.assert_close(
        ft.jvp(torch.sin, (x,), (x,), strict=True), tf.jvp(torch.sin, (x,), (x,), strict=True)
    )
    const = lambda a: (a.sin(), torch.ones(2))  # noqa: E731
    with pytest.raises(RuntimeError):
        tf.jvp(const, (x,), (x,), strict=True)
    with pytest.raises(RuntimeError, match=r"strict=True\): output 1 .* does not depend"):
        ft.jvp(const, (x,), (x,), strict=True)
    torch.testing.assert_close(ft.jvp(const, (x,), (x,)), tf.jvp(const, (x,), (x,)))


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
    both_raise(  # RuntimeError, as torch.func
        RuntimeError,
        lambda L: L.linearize(torch.tanh, x)[1](torch.ones(4, dtype=torch.float64)),
        match="a tangent has shape",
    )


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
    "detach": lambda t: t.detach(),  # shares memory, but not a view (_base None) in both
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

    def shares_memory(t):  # a copy would fail this where torch.func returns a view or alias
        return t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()

    assert shares_memory(ours) == shares_memory(ref)


def test_writes_through_a_returned_view_reach_the_input():
    ours, ref = torch.zeros(3, 4), torch.zeros(3, 4)
    ft.vmap(lambda t: t[1:])(ours).fill_(1.0)
    tf.vmap(lambda t: t[1:])(ref).fill_(1.0)
    assert torch.equal(ours, ref) and ours.sum() == 9


# -- the randomness contract -----------------------------------------------------------------------
def _seeded(make, lib):
    torch.manual_seed(0)
    return make(lib)


RANDOM_FNS = {
    "randn factory": (lambda a: a + torch.randn(3), 0),
    "rand_like": (lambda a: torch.rand_like(a), 0),
    "rand_like in_dims=1": (lambda a: torch.rand_like(a), 1),
    "normal_ batched": (lambda a: a.clone().normal_(), 0),
    "dropout": (lambda a: torch.nn.functional.dropout(a, 0.5), 0),
    "bernoulli_(float) batched": (lambda a: a.clone().bernoulli_(0.5), 0),
    "randint": (lambda a: a + torch.randint(0, 5, (3,)), 0),
    "randperm": (lambda a: a + torch.randperm(3), 0),
}


@pytest.mark.parametrize("name", sorted(RANDOM_FNS))
@pytest.mark.parametrize("randomness", ["same", "different"])
def test_random_streams_are_torch_funcs(name, randomness):
    # documented in docs/torch_func_differences.md: our draws are torch.func's, bit for bit
    f, d = RANDOM_FNS[name]
    x = torch.rand(4, 3) if d == 0 else torch.rand(3, 4)
    ours = _seeded(lambda L: L.vmap(f, in_dims=d, randomness=randomness)(x), ft)
    ref = _seeded(lambda L: L.vmap(f, in_dims=d, randomness=randomness)(x), tf)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize(
    "f",
    [lambda a: torch.randn(3) + 0 * a, torch.rand_like, lambda a: a.clone().uniform_()],
    ids=["factory", "rand_like", "uniform_"],
)
def test_same_randomness_holds_across_chunks(f):
    x = torch.zeros(5, 3)
    whole = _seeded(lambda L: L.vmap(f, randomness="same")(x), ft)
    chunked = _seeded(lambda L: L.vmap(f, randomness="same", chunk_size=2)(x), ft)
    assert torch.equal(chunked, whole)
    assert torch.equal(whole, whole[:1].expand_as(whole))


def test_same_randomness_inplace_with_unbatched_tensor_parameter():
    p = torch.rand(3)
    ours = _seeded(
        lambda L: L.vmap(lambda t: t.bernoulli_(p), randomness="same")(torch.zeros(4, 3)), ft
    )
    ref = _seeded(
        lambda L: L.vmap(lambda t: t.bernoulli_(p), randomness="same")(torch.zeros(4, 3)), tf
    )
    assert torch.equal(ours, ours[:1].expand_as(ours)) and torch.equal(ref, ref[:1].expand_as(ref))


def test_same_randomness_of_an_op_without_a_rule_is_one_draw():
    out = ft.vmap(lambda a: torch.poisson(torch.full((3,), 4.0)) + a, randomness="same")(
        torch.zeros(4, 3)
    )
    assert torch.equal(out, out[:1].expand_as(out))


@pytest.mark.parametrize(
    "make",
    [
        lambda L, p: L.vmap(lambda q: torch.normal(q, 1.0), randomness="same")(p),
        lambda L, p: L.vmap(torch.bernoulli, randomness="same")(p),
        lambda L, p: L.vmap(torch.poisson, randomness="same")(p),
        lambda L, p: L.vmap(lambda q: torch.binomial(torch.full((3,), 5.0), q), randomness="same")(
            p
        ),
        lambda L, p: L.vmap(lambda q: torch.multinomial(q, 2), randomness="same")(p),
        lambda L, p: L.vmap(lambda t, q: t.bernoulli_(q), randomness="same")(torch.zeros(4, 3), p),
    ],
    ids=["normal", "bernoulli", "poisson", "binomial", "multinomial", "bernoulli_"],
)
def test_same_randomness_with_batched_parameters_raises(make):
    p = torch.rand(4, 3)
    with pytest.raises(RuntimeError):
        make(tf, p)
    with pytest.raises(RuntimeError, match="randomness='same'"):
        make(ft, p)


@pytest.mark.parametrize(
    "f",
    [lambda a: a + torch.zeros(3).normal_(), lambda a: a + x[:3].float().clone().uniform_()],
    ids=["fresh", "captured"],
)
def test_different_randomness_inplace_into_unbatched_raises(f):
    x = torch.rand(4, 3)
    with pytest.raises(RuntimeError):
        tf.vmap(f, randomness="different")(x)
    with pytest.raises(RuntimeError, match="in place into a tensor that is not batched"):
        ft.vmap(f, randomness="different")(x)


def test_new_factories_of_a_batched_tensor_are_batched():
    # as torch.func: x.new_zeros(...) under vmap is one buffer per example, so per-example
    # writes and 'different' draws into it work
    def f(a):
        buf = a.new_zeros(2)
        buf[0] = a.sum()
        return buf + a.new_empty(()).uniform_() * 0

    x = torch.rand(4, 3)
    assert torch.equal(ft.vmap(f, randomness="different")(x), tf.vmap(f, randomness="different")(x))


# -- custom rules: JAX's API -----------------------------------------------------------------------
def test_custom_jvp_nondiff_argnums_and_kwargs():
    @ft.custom_jvp(nondiff_argnums=(0,))
    def apply(fn, a, scale=1.0):
        return fn(a) * scale

    @apply.defjvp
    def apply_jvp(fn, primals, tangents):
        (a, scale), (t, _) = primals, tangents
        assert fn is torch.sin  # the nondiff argument arrives first, as in JAX
        return apply(fn, a, scale), torch.cos(a) * t * scale

    ref = tf.grad(lambda a: (torch.sin(a) * 2.0).sum())(x)
    torch.testing.assert_close(ft.grad(lambda a: apply(torch.sin, a, scale=2.0).sum())(x), ref)
    _, t = ft.jvp(lambda a: apply(torch.sin, a, scale=2.0), (x,), (torch.ones_like(x),))
    torch.testing.assert_close(t, 2.0 * torch.cos(x))


def test_custom_vjp_nondiff_argnums():
    @ft.custom_vjp(nondiff_argnums=(1,))
    def clip(a, bound):
        return a

    clip.defvjp(lambda a, bound: (a, None), lambda bound, res, g: (g.clamp(-bound, bound),))
    g = ft.grad(lambda a: (clip(a, 0.5) * 10).sum())(x)
    torch.testing.assert_close(g, torch.full_like(x, 0.5))
    gs = ft.vmap(ft.grad(lambda a: (clip(a, 0.25) * 10).sum()))(xb)
    torch.testing.assert_close(gs, torch.full_like(xb, 0.25))


def test_custom_jvp_defjvps():
    f = ft.custom_jvp(lambda a, b: a * b.exp())
    f.defjvps(lambda ta, out, a, b: ta * b.exp(), lambda tb, out, a, b: out * tb)
    b = torch.randn(3, dtype=torch.float64)
    ref = tf.grad(lambda a, b: (a * b.exp()).sum(), argnums=(0, 1))(x, b)
    ours = ft.grad(lambda a, b: f(a, b).sum(), argnums=(0, 1))(x, b)
    torch.testing.assert_close(ours, ref)
    t = ft.jvp(f, (x, b), (torch.ones_like(x), torch.zeros_like(b)))[1]
    torch.testing.assert_close(t, b.exp())


def test_custom_vjp_bad_nondiff_argnums():
    with pytest.raises(ValueError, match="nondiff_argnums"):
        ft.custom_vjp(lambda a: a, nondiff_argnums=(-1,))


def test_custom_vmap_uses_the_rule_and_grad_differentiates_fn():
    calls = []

    @ft.custom_vmap
    def norm2(a):
        return (a * a).sum()

    @norm2.def_vmap
    def norm2_vmap(axis_size, in_batched, a):
        calls.append((axis_size, tuple(in_batched)))
        return torch.einsum("bi,bi->b", a, a), True

    torch.testing.assert_close(ft.vmap(norm2)(xb), (xb * xb).sum(1))
    assert calls == [(2, (True,))]
    torch.testing.assert_close(ft.grad(norm2)(x), 2 * x)
    torch.testing.assert_close(ft.vmap(ft.grad(norm2))(xb), 2 * xb)
    torch.testing.assert_close(ft.grad(lambda a: ft.vmap(norm2)(a).sum())(xb), 2 * xb)


def test_custom_vmap_checks_what_the_rule_returns():
    f = ft.custom_vmap(lambda a: a.sum())
    f.def_vmap(lambda n, b, a: (a.sum(), True))  # forgot the batch dim
    with pytest.raises(ValueError, match="marked batched has shape"):
        ft.vmap(f)(xb)


def test_sequential_vmap_loops_silently():
    import warnings

    f = ft.sequential_vmap(lambda a, k: torch.linalg.matrix_power(a, k))
    A = torch.randn(3, 2, 2, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no FallbackWarning: the loop is the implementation
        ours = ft.vmap(f, in_dims=(0, None))(A, 3)
    torch.testing.assert_close(ours, tf.vmap(lambda a: torch.linalg.matrix_power(a, 3))(A))


def test_debug_unwrap_as_torch_func():
    seen = {}

    def f(a):
        seen["ours"] = ft.debug_unwrap(a)
        seen["one"] = ft.debug_unwrap(a, recurse=False)
        return a

    ft.vmap(ft.grad(lambda a: (f(a) ** 2).sum()))(xb)
    assert seen["ours"].shape == (2, 3) and type(seen["ours"]) is torch.Tensor
    assert seen["one"].shape == (3,)  # one level: the grad wrapper's primal, still batched
    ref = {}
    tf.vmap(lambda a: ref.setdefault("r", tf.debug_unwrap(a)) * 0 + a)(xb)
    assert ref["r"].shape == seen["ours"].shape


def test_out_argument_under_autodiff():
    def f(a):
        return torch.sin(a, out=torch.empty(3, dtype=torch.float64)).sum()

    both_raise(RuntimeError, lambda L: L.grad(f)(x), match="out= arguments do not support")
    both_raise(
        RuntimeError,
        lambda L: L.jvp(f, (x,), (x,)),
        match="out= arguments do not support",
    )
    both_raise(RuntimeError, lambda L: L.vmap(lambda a: torch.sin(a, out=torch.empty(3)))(xb))


@pytest.mark.parametrize("in_dim", [0, 1])
def test_vmap_of_conj_is_a_lazy_conjugate_view_as_in_torch_func(in_dim):
    z = torch.randn(3, 4, dtype=torch.complex64)
    for f in (lambda t: t.conj(), lambda t: t.unsqueeze(0).conj()):
        ours, ref = ft.vmap(f, in_dims=in_dim)(z), torch.func.vmap(f, in_dims=in_dim)(z)
        assert ours.is_conj() and ref.is_conj()
        assert ours._base is z and ref._base is z
        torch.testing.assert_close(ours.resolve_conj(), ref.resolve_conj())
    # torch.func writes through the conjugate view into z; ours cannot (the view is
    # materialized inside vmap), so it raises instead of returning a different result
    ref_z = z.clone()
    torch.func.vmap(lambda t: t.conj().mul_(2))(ref_z)
    torch.testing.assert_close(ref_z, 2 * z)
    with pytest.raises(InplaceError, match=r"writes in place into the result of `conj\(\)`"):
        ft.vmap(lambda t: t.conj().mul_(2))(z.clone())
    out = ft.vmap(lambda t: t.conj().clone().mul_(2))(z.clone())  # a copy: fine
    torch.testing.assert_close(out, 2 * z.conj())
