"""ft.functionalize against torch.func.functionalize: outputs, writes into inputs, aliasing of
outputs, traced graphs without mutations (and without views), compositions, errors."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.func as tf
from hypothesis import given
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import functransforms as ft
from functransforms.errors import InplaceError


@pytest.fixture(autouse=True, scope="module")
def _float64():
    """float64 for this module only (a module-level set_default_dtype leaked into every test
    that ran after it in the same process)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


# -- functions with mutations ------------------------------------------------------------------
def add_inplace(x):
    x.add_(1)
    return x * 2


def through_view(x):
    x.view(-1)[1:3].mul_(3)
    x.t()[0].sub_(1)
    return x.sum(0)


def setitem(x, y):
    x[0] = y[1]
    x[1:3, 1] += y[0, 0]  # explicit ends: torch.func.vmap fails on `1:` here (torch 2.13)
    out = x.new_zeros(2, 3)
    out[1] = x[0]
    return out, x + 1


def local_buffer(x):
    buf = torch.zeros(3)
    buf.copy_(x)
    buf[1] = 0
    return buf * 2


def several_outputs(x, y):
    y.mul_(2)
    return {"s": (x + y).sum(), "pair": [x.sin(), y.clone()]}


def out_arg(x, y):
    z = torch.empty(3)
    torch.mul(x, y, out=z)
    torch.add(y[1:], 1, out=x[1:])
    return z


def shape_inplace(x):
    y = x.clone()
    y.unsqueeze_(0)
    y.t_()
    return y


def dtype_inplace(x):
    x.mul_(torch.ones(3, dtype=torch.float64))  # eager keeps x's float32
    return x


def unmutated(x):
    return x.view(-1), x, x[0]


CASES = [
    (add_inplace, lambda: (torch.randn(3),)),
    (through_view, lambda: (torch.randn(2, 2),)),
    (setitem, lambda: (torch.randn(3, 3), torch.randn(2, 3))),
    (local_buffer, lambda: (torch.randn(3),)),
    (several_outputs, lambda: (torch.randn(3), torch.randn(3))),
    (out_arg, lambda: (torch.randn(3), torch.randn(3))),
    (shape_inplace, lambda: (torch.randn(3),)),
    (dtype_inplace, lambda: (torch.randn(3, dtype=torch.float32),)),
    (unmutated, lambda: (torch.randn(2, 2),)),
]
IDS = [f.__name__ for f, _ in CASES]


def _clone(args):
    return tuple(a.clone() for a in args)


def _assert_same(ours, theirs):
    ours_flat, theirs_flat = ft._pytree.tree_flatten(ours), ft._pytree.tree_flatten(theirs)
    assert ours_flat[1] == theirs_flat[1]
    for a, b in zip(ours_flat[0], theirs_flat[0]):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("remove", ["mutations", "mutations_and_views"])
@pytest.mark.parametrize("f, make", CASES, ids=IDS)
def test_values_and_input_writes_match_torch_func(f, make, remove):
    torch.manual_seed(0)
    args = make()
    ours_in, theirs_in, eager_in = _clone(args), _clone(args), _clone(args)
    ours = ft.functionalize(f, remove=remove)(*ours_in)
    theirs = tf.functionalize(f, remove=remove)(*theirs_in)
    _assert_same(ours, theirs)
    _assert_same(ours_in, theirs_in)  # the inputs received the same writes
    _assert_same(ours, f(*eager_in))
    _assert_same(ours_in, eager_in)


def test_outputs_alias_inputs_as_torch_func():
    """An unmutated input comes back as itself, and its views share its memory; a mutated
    input's outputs are new tensors (the input receives a copy), as in torch.func."""
    for fn in (ft.functionalize, tf.functionalize):
        x = torch.randn(2, 2)
        flat, same, row = fn(unmutated)(x)
        assert same is x
        assert flat.data_ptr() == x.data_ptr() and row.data_ptr() == x.data_ptr()
        assert flat._base is x and row._base is x  # real views: torch autograd tracks them
        flat, same, row = fn(unmutated, remove="mutations_and_views")(x)
        assert same is x  # an input returned as is stays itself ...
        assert flat.data_ptr() != x.data_ptr() and row.data_ptr() != x.data_ptr()  # ... views copy

        def mutated(x):
            x.add_(1)
            return x.view(-1), x

        x = torch.randn(2, 2)
        before = x.clone()
        flat, same = fn(mutated)(x)
        assert same is not x and same.data_ptr() != x.data_ptr()
        assert flat.data_ptr() != x.data_ptr()
        torch.testing.assert_close(x, before + 1)


def test_untouched_inputs_get_no_write():
    x, y = torch.randn(3), torch.randn(3)
    x_version, y_version = x._version, y._version
    ft.functionalize(several_outputs)(x, y)
    assert x._version == x_version  # x was only read
    assert y._version == y_version + 1  # one copy_ back into y


# -- traced graphs -------------------------------------------------------------------------------
def _mutating_nodes(gm):
    """In-place nodes other than a final copy_ into a graph input."""
    bad = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not hasattr(node.target, "_schema"):
            continue
        if node.target._schema.is_mutable:
            final_copy = (
                node.target is torch.ops.aten.copy_.default and node.args[0].op == "placeholder"
            )
            if not final_copy:
                bad.append(str(node.target))
    return bad


def _view_nodes(gm):
    return [
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function"
        and hasattr(n.target, "_schema")
        and any(r.alias_info is not None for r in n.target._schema.returns)
        and not n.target._schema.is_mutable
    ]


@pytest.mark.parametrize("f, make", CASES, ids=IDS)
def test_make_fx_graph_has_no_mutations(f, make):
    torch.manual_seed(0)
    args = make()
    gm = make_fx(ft.functionalize(f))(*_clone(args))
    assert _mutating_nodes(gm) == []
    ref_in, gm_in = _clone(args), _clone(args)
    _assert_same(gm(*gm_in), f(*ref_in))
    _assert_same(gm_in, ref_in)
    copies = [n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default]
    theirs = make_fx(tf.functionalize(f))(*_clone(args))
    assert len(copies) == len(
        [n for n in theirs.graph.nodes if n.target is torch.ops.aten.copy_.default]
    )


@pytest.mark.parametrize("f, make", CASES, ids=IDS)
def test_make_fx_mutations_and_views_has_no_views(f, make):
    torch.manual_seed(0)
    args = make()
    gm = make_fx(ft.functionalize(f, remove="mutations_and_views"))(*_clone(args))
    assert _mutating_nodes(gm) == []
    assert _view_nodes(gm) == []
    if _view_nodes(make_fx(ft.functionalize(f))(*_clone(args))):  # they became *_copy ops
        assert any("_copy." in str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    ref_in, gm_in = _clone(args), _clone(args)
    _assert_same(gm(*gm_in), f(*ref_in))
    _assert_same(gm_in, ref_in)


def test_views_stay_views_with_remove_mutations():
    gm = make_fx(ft.functionalize(through_view))(torch.randn(2, 2))
    assert _view_nodes(gm)  # only mutations_and_views removes them


# -- compositions ----------------------------------------------------------------------------------
def write_batched_into_fresh(x):
    buf = torch.zeros(3)
    buf.copy_(x)
    y = x.new_zeros(2, 3)
    y[0] = x
    y[1, 1:3] = x[:2] * 2
    return buf.sin(), (y * y).sum()


def test_vmap_of_functionalize_writes_into_fresh_buffers():
    xs = torch.randn(4, 3)
    with pytest.raises(InplaceError):
        ft.vmap(write_batched_into_fresh)(xs)  # plain vmap refuses, as torch.func.vmap
    ours = ft.vmap(ft.functionalize(write_batched_into_fresh))(xs)
    theirs = tf.vmap(tf.functionalize(write_batched_into_fresh))(xs)
    _assert_same(ours, theirs)


def test_vmap_of_functionalize_writes_into_batched_input():
    xs, ys = torch.randn(4, 3, 3), torch.randn(4, 2, 3)
    ours_in, theirs_in = (xs.clone(), ys.clone()), (xs.clone(), ys.clone())
    ours = ft.vmap(ft.functionalize(setitem))(*ours_in)
    theirs = tf.vmap(tf.functionalize(setitem))(*theirs_in)
    _assert_same(ours, theirs)
    _assert_same(ours_in, theirs_in)


def test_functionalize_of_vmap():
    def f(x):
        x = x.clone()
        x[1:] *= x[:2]
        x.sin_()
        return x

    xs = torch.randn(4, 3)
    _assert_same(ft.functionalize(ft.vmap(f))(xs), tf.functionalize(tf.vmap(f))(xs))
    xs_ours, xs_theirs = xs.clone(), xs.clone()
    _assert_same(
        ft.functionalize(ft.vmap(add_inplace))(xs_ours),
        tf.functionalize(tf.vmap(add_inplace))(xs_theirs),
    )
    _assert_same(xs_ours, xs_theirs)


def _scalar(x):
    buf, s = write_batched_into_fresh(x)
    return s + buf.sum()


def test_grad_and_functionalize_compose():
    x = torch.randn(3)
    # torch.func.grad(torch.func.functionalize(f)) raises (no derivative for aten::copy)
    expected = tf.grad(_scalar)(x)
    torch.testing.assert_close(ft.grad(ft.functionalize(_scalar))(x), expected)
    torch.testing.assert_close(ft.functionalize(ft.grad(_scalar))(x), expected)
    xs = torch.randn(4, 3)
    torch.testing.assert_close(
        ft.vmap(ft.grad(ft.functionalize(_scalar)))(xs),
        torch.stack([tf.grad(_scalar)(x) for x in xs]),  # torch.func.vmap refuses the write
    )


def test_jit_of_functionalize_replays_right_values():
    jitted = ft.jit(ft.functionalize(_scalar))
    jitted_vmap = ft.jit(ft.vmap(ft.functionalize(_scalar)))
    for _ in range(3):  # the first call traces, the next ones replay the graph
        x = torch.randn(3)
        torch.testing.assert_close(jitted(x), _scalar(x))
        torch.testing.assert_close(jitted_vmap(x[None])[0], _scalar(x))
    x, x_ref = torch.randn(3), None
    jit_add = ft.jit(ft.functionalize(add_inplace))
    for _ in range(2):
        x = torch.randn(3)
        x_ref = x.clone()
        out = jit_add(x)
        torch.testing.assert_close(out, (x_ref + 1) * 2)
        torch.testing.assert_close(x, x_ref + 1)  # the replayed graph writes the input too


def test_jit_of_grad_with_a_local_buffer_replays_right_values():
    """Promotion under tracing (Note [Writing into a plain tensor]): the tracer keys tensors by
    Python object, so the promoted buffer must carry its trace record over the impl swap."""

    def f(x):
        buf = torch.zeros(3)
        buf.copy_(x)
        return (buf * buf).sum()

    jitted = ft.jit(ft.grad(f))
    for _ in range(3):
        x = torch.randn(3)
        torch.testing.assert_close(jitted(x), 2 * x)


def test_kwargs_and_non_tensor_arguments():
    def f(x, n, *, scale):
        x.mul_(scale)
        return x * n

    x_ours, x_theirs = torch.randn(3), None
    x_theirs = x_ours.clone()
    _assert_same(
        ft.functionalize(f)(x_ours, 3, scale=2.0), tf.functionalize(f)(x_theirs, 3, scale=2.0)
    )
    _assert_same(x_ours, x_theirs)


# -- errors --------------------------------------------------------------------------------------
def test_bad_remove_names_the_call_and_the_choices():
    with pytest.raises(RuntimeError, match=r"functionalize\(add_inplace, remove='views'\)") as e:
        ft.functionalize(add_inplace, remove="views")
    assert "'mutations'" in str(e.value) and "'mutations_and_views'" in str(e.value)
    with pytest.raises(RuntimeError):
        tf.functionalize(add_inplace, remove="views")  # torch.func raises the same class


def test_inplace_broadcast_raises_as_eager():
    def f(x):
        x.add_(torch.ones(2, 3))
        return x

    with pytest.raises(RuntimeError):
        f(torch.zeros(3))
    with pytest.raises(RuntimeError, match="shape"):
        ft.functionalize(f)(torch.zeros(3))


def test_signature_and_export():
    assert "functionalize" in ft.__all__
    assert ft.functionalize(add_inplace).__wrapped__ is add_inplace


def test_write_into_a_plain_buffer_with_live_views_raises():
    """Promotion refuses a buffer whose memory a live view shares (Note [Writing into a plain
    tensor]): a clear error, not a write the view would miss."""

    def f(x):
        buf = torch.zeros(3)
        view = buf[1:]
        buf.copy_(x)
        return buf.sum() + view.sum()

    with pytest.raises(InplaceError, match=r"functionalize\(f\).*computed from the function"):
        ft.functionalize(f)(torch.ones(3))


def test_write_into_a_captured_tensor_lands_after_the_call():
    g = torch.zeros(3)

    def f(x):
        g.add_(x)
        return x * 2

    torch.testing.assert_close(ft.functionalize(f)(torch.ones(3)), torch.full((3,), 2.0))
    assert type(g) is torch.Tensor  # torch.func raises here (an internal assert)
    torch.testing.assert_close(g, torch.ones(3))


def test_torch_autograd_through_functionalize():
    """loss.backward() through writes of parameters into buffers: torch has no derivative for
    aten.copy (torch.func raises); ours runs the copy as differentiable ops."""
    w = torch.randn(3, requires_grad=True)

    def f(x):
        y = x.clone()
        y[1] = w[0] * 3
        y.mul_(w)
        buf = torch.zeros(2)
        buf.copy_(w[1:])
        return y.sum() + (buf * buf).sum()

    x = torch.randn(3)
    (ours,) = torch.autograd.grad(ft.functionalize(f)(x), w)
    (eager,) = torch.autograd.grad(f(x), w)
    torch.testing.assert_close(ours, eager)
    with pytest.raises(RuntimeError, match="copy"):
        tf.functionalize(f)(x).backward()


@pytest.mark.parametrize("remove", ["mutations", "mutations_and_views"])
def test_many_view_ops_and_writes_through_them(remove):
    def f(x, z):
        a = x.unbind(0)[1] + x.split(1, 1)[0].sum() + x.chunk(2, 0)[1].sum()
        b = x.diagonal().sum() + x[None].expand(2, 3, 3).sum() + x.narrow(0, 1, 2).sum()
        c = x.unfold(0, 2, 1).sum() + x.as_strided((2,), (1,)).sum() + x.movedim(0, 1)[0]
        d = z.real.sum() + z.imag.sum() + torch.view_as_real(z).sum()
        x.diagonal().add_(1)
        x[None].squeeze(0)[0, 1:3] = 7
        z.imag.mul_(2)
        return a + b + c + d, x.T.contiguous(), z.conj().resolve_conj()

    torch.manual_seed(0)
    args = (torch.randn(3, 3), torch.randn(3, dtype=torch.complex128))
    ours_in, theirs_in, eager_in = _clone(args), _clone(args), _clone(args)
    _assert_same(ft.functionalize(f, remove=remove)(*ours_in), f(*eager_in))
    _assert_same(ours_in, eager_in)
    _assert_same(tf.functionalize(f, remove=remove)(*theirs_in), f(*_clone(args)))
    gm = make_fx(ft.functionalize(f, remove=remove))(*_clone(args))
    assert _mutating_nodes(gm) == []
    if remove == "mutations_and_views":
        assert _view_nodes(gm) == []


def test_integer_inputs_and_nesting():
    def f(i):
        i += 1
        i[0] = 5
        return i * 2

    ours, eager = torch.arange(3), torch.arange(3)
    torch.testing.assert_close(ft.functionalize(ft.functionalize(f))(ours), f(eager))
    torch.testing.assert_close(ours, eager)


def test_make_fx_of_vmap_of_functionalize_has_no_mutations():
    xs = torch.randn(4, 3)
    gm = make_fx(ft.vmap(ft.functionalize(write_batched_into_fresh)))(xs)
    assert _mutating_nodes(gm) == []
    ys = torch.randn(4, 3)
    _assert_same(gm(ys), ft.vmap(ft.functionalize(write_batched_into_fresh))(ys))


def test_module_with_running_statistics():
    """BatchNorm in training mode updates its buffers in place: applied after the call, as
    torch.func's functionalize does, and torch autograd sees through it."""
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    eager = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    theirs = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    eager.load_state_dict(ours.state_dict())
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(5, 3)
    torch.testing.assert_close(ft.functionalize(ours)(x), tf.functionalize(theirs)(x))
    _assert_same(dict(ours.named_buffers()), dict(theirs.named_buffers()))
    eager(x)  # the same two updates of the running statistics
    out, ref = ft.functionalize(ours)(x), eager(x)
    torch.testing.assert_close(out, ref)
    for name, b in ours.named_buffers():
        assert type(b) is torch.Tensor
        torch.testing.assert_close(b, dict(eager.named_buffers())[name])
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(ours[0].weight.grad, eager[0].weight.grad)


# -- property: random programs of writes through views --------------------------------------------
_VIEWS = [
    lambda t: t,
    lambda t: t[1],
    lambda t: t[:, 2],
    lambda t: t.t(),
    lambda t: t.view(16)[3:11],
    lambda t: t.diagonal(),
    lambda t: t[1:3, ::2],
    lambda t: t.unsqueeze(0)[0, 2:],
]
_WRITES = [
    lambda v, c, s: v.add_(s),
    lambda v, c, s: v.mul_(c),  # c: a function of the other input, broadcast to v
    lambda v, c, s: v.copy_(c * s),
    lambda v, c, s: v.fill_(s),
    lambda v, c, s: v.sub_(v.sum() * s),  # reads the view it writes
]


def _program(steps):
    def f(x, y):
        outs = []
        for view_at, write_at, s in steps:
            v = _VIEWS[view_at](x)
            c = torch.sin(y[: v.shape[-1]]) if v.dim() else torch.sin(y[0])
            _WRITES[write_at](v, c, s)
            outs.append(x.sum() * s + v.sum())
        return torch.stack(outs), x[0] * 2

    return f


@given(
    st.lists(
        st.tuples(
            st.integers(0, len(_VIEWS) - 1),
            st.integers(0, len(_WRITES) - 1),
            st.floats(-2, 2, allow_nan=False).filter(lambda s: abs(s) > 0.1),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_random_writes_through_views_match_eager(steps):
    f = _program(steps)
    torch.manual_seed(0)
    args = (torch.randn(4, 4), torch.randn(16))
    for remove in ("mutations", "mutations_and_views"):
        ours_in, eager_in = _clone(args), _clone(args)
        _assert_same(ft.functionalize(f, remove=remove)(*ours_in), f(*eager_in))
        _assert_same(ours_in, eager_in)
    gm = make_fx(ft.functionalize(f))(*_clone(args))
    assert _mutating_nodes(gm) == []
    gm_in, eager_in = _clone(args), _clone(args)
    _assert_same(gm(*gm_in), f(*eager_in))
    _assert_same(gm_in, eager_in)


def test_custom_rules_pass_through_to_outer_levels():
    """A custom function's rules belong to the other transforms: grad(functionalize(f)) uses
    the custom vjp (torch.func's functionalize raises NYI for an autograd.Function)."""

    @ft.custom_vjp
    def sin10(x):
        return x.sin()

    sin10.defvjp(lambda x: (x.sin(), x), lambda x, g: (g * 10,))

    class Cube(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * x * x

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return g * 3

    def f(x):
        y = x.clone()
        y.mul_(2)
        return sin10(y).sum() + Cube.apply(y).sum()

    x = torch.randn(3)
    expected = torch.full((3,), 2 * 10.0 + 2 * 3.0)  # chain rule through y = 2x
    torch.testing.assert_close(ft.grad(ft.functionalize(f))(x), expected)
    torch.testing.assert_close(ft.functionalize(ft.grad(f))(x), expected)
    torch.testing.assert_close(ft.functionalize(f)(x), f(x))


def _many_views(x):
    y = x.t()[0] + x.view(-1)[:2] + x.diagonal() + x.unsqueeze(0).expand(3, 2, 2).sum(0)[1]
    y = y + x.unbind(0)[1] + x.split(1)[0][0] + x.permute(1, 0)[1]
    x = x.clone()
    x[0].mul_(y)
    return (y * y).sum() + x.sum()


def test_mutations_and_views_under_outer_transforms():
    """Under grad/jvp/vmap the *_copy ops run as the view and a clone (the outer levels have
    rules for those): no MissingRuleError, no per-example fallback, torch.func's values."""
    from functransforms.errors import FallbackWarning

    f = ft.functionalize(_many_views, remove="mutations_and_views")
    x, xs = torch.randn(2, 2), torch.randn(3, 2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        g, t, v = ft.grad(f)(x), ft.jvp(f, (x,), (x,))[1], ft.vmap(f)(xs)
    theirs = tf.functionalize(_many_views, remove="mutations_and_views")
    torch.testing.assert_close(g, tf.grad(theirs)(x))
    torch.testing.assert_close(t, tf.jvp(theirs, (x,), (x,))[1])
    # torch.func.vmap has no batching rule for split_copy: compared with a loop
    torch.testing.assert_close(v, torch.stack([_many_views(x) for x in xs]))


@pytest.mark.parametrize("transform", ["functionalize", "jvp", "vjp", "grad"])
def test_inplace_keeps_the_target_dtype(transform):
    """`x32.mul_(y64)` stays float32 in eager; the functional form promotes to float64. Every
    level that runs in-place ops out of place (autodiff/_util.py) casts back, and raises where
    eager refuses the cast (complex into real)."""
    y = torch.full((3,), 2.0, dtype=torch.float64)

    def f(x):
        x = x.clone()
        x.mul_(y)
        return x

    def g(x):
        x = x.clone()
        x.mul_(torch.ones(3, dtype=torch.complex64))
        return x

    run = {
        "functionalize": lambda h, x: ft.functionalize(h)(x),
        "jvp": lambda h, x: ft.jvp(h, (x,), (x,))[1],
        "vjp": lambda h, x: ft.vjp(h, x)[1](torch.ones_like(x))[0],
        "grad": lambda h, x: ft.grad(lambda x: h(x).sum())(x),
    }[transform]
    x = torch.randn(3, dtype=torch.float32)
    out = run(f, x)
    assert out.dtype == torch.float32
    expected = {"functionalize": 2 * x, "jvp": 2 * x}.get(transform, torch.full((3,), 2.0))
    torch.testing.assert_close(out, expected.float())
    with pytest.raises(RuntimeError, match="can't be cast"):
        g(x)
    with pytest.raises(RuntimeError, match="can't be cast"):
        run(g, x)
