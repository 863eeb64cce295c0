"""The pointwise fast path (Note [Pointwise fast path] in batching/_fastpath.py) gives exactly
what the ordinary dispatch path gives, is taken where it should be, and steps aside wherever
its preconditions fail."""

import pytest
import torch
import torch.nn.functional as F
from functransforms.batching import _tensor
from functransforms.batching._fastpath import POINTWISE_FUNCS
from hypothesis import given
from hypothesis import strategies as st

import functransforms as ft
from functransforms.testing import check_vmap


def _slow(monkeypatch):
    monkeypatch.setattr(_tensor, "POINTWISE_FUNCS", {})


@pytest.fixture
def dispatch_count(monkeypatch):
    """How many ops reached the vmap interpreter's ordinary (dispatch) path."""
    calls = []
    process = _tensor.VmapInterpreter.process

    def counting(self, func, args, kwargs):
        calls.append(func)
        return process(self, func, args, kwargs)

    monkeypatch.setattr(_tensor.VmapInterpreter, "process", counting)
    return calls


def test_table_is_derived_from_tags():
    ft.vmap(torch.sin)(torch.zeros(1))  # the table is built on the first vmap call
    for fn in (torch.sin, torch.Tensor.sin, torch.add, torch.Tensor.__rsub__, torch.where):
        assert (fn in POINTWISE_FUNCS) == (fn is not torch.where)  # where(c) is nonzero
    for fn in (torch.sum, torch.Tensor.add_, torch.rand_like, torch.Tensor.view, F.dropout):
        assert fn not in POINTWISE_FUNCS
    assert POINTWISE_FUNCS[F.relu] == 1 and POINTWISE_FUNCS[torch.sin] == -1  # `inplace` position


def test_fast_path_is_taken(dispatch_count):
    x = torch.randn(5, 3)
    out = ft.vmap(lambda v: torch.sin(v) * 2.0 + v.exp() - 1 / (1 + v.abs()))(x)
    torch.testing.assert_close(out, torch.sin(x) * 2.0 + x.exp() - 1 / (1 + x.abs()))
    assert dispatch_count == []


def test_fast_path_steps_aside_for_misaligned_batch_dims(dispatch_count):
    x, y = torch.randn(5, 3), torch.randn(3, 5)
    out = ft.vmap(torch.mul, in_dims=(0, 1))(x, y)
    torch.testing.assert_close(out, x * y.T)
    assert len(dispatch_count) == 1


def test_two_values_of_one_level_take_the_fast_path(dispatch_count):
    x, y = torch.randn(3, 5, 2), torch.randn(3, 5, 2)
    check_vmap(lambda a, b: a * b + a / b - b**a, (x, y.abs()), in_dims=1)
    check_vmap(lambda a, b: torch.maximum(a, b) + torch.atan2(b, a), (x, y), in_dims=0)
    assert dispatch_count == []


def test_two_values_step_aside_across_levels_and_batch_dims(dispatch_count):
    x, y = torch.randn(3, 4), torch.randn(4, 3)
    torch.testing.assert_close(ft.vmap(torch.mul, in_dims=(0, 1))(x, y), x * y.T)
    assert dispatch_count == [torch.ops.aten.mul.Tensor]
    dispatch_count.clear()
    nested = ft.vmap(ft.vmap(torch.sub, in_dims=(0, None)), in_dims=(None, 0))(x[0], x[:, 0])
    torch.testing.assert_close(nested, x[0] - x[:, 0, None])
    assert dispatch_count  # an outer level's value: the ordinary path


def test_two_values_requiring_grad_under_a_rule():
    # vmap of a function whose values require grad, differentiated by torch's autograd
    # through the transform: the fast path must not run below torch's autograd
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(4, 3)
    out = ft.vmap(lambda v: (v * w) * (v + w))(x)
    (g,) = torch.autograd.grad(out.sum(), w)
    torch.testing.assert_close(g, (x * (x + w) + x * w).sum(0).detach())
    gg = ft.grad(lambda u: ft.vmap(lambda v: (v * u) * (v * u))(x).sum())(w.detach())
    torch.testing.assert_close(gg, (2 * x * x * w.detach()).sum(0))


def test_unary_keeps_the_batch_dim_where_it_is(dispatch_count):
    x = torch.randn(3, 5, 2)
    check_vmap(lambda v: torch.tanh(v).sigmoid(), (x,), in_dims=1)
    assert torch.ops.aten.tanh.default not in dispatch_count


CASES = [
    # (function, args, in_dims): each covers one precondition of the fast path
    (torch.add, (torch.randn(4, 3), torch.randn(4, 3)), 0),
    (torch.add, (torch.randn(4, 2, 3), torch.randn(4, 3)), 0),  # logical ranks differ
    (torch.add, (torch.randn(4, 2, 3), torch.randn(3)), (0, None)),  # plain lower rank
    (torch.add, (torch.randn(4, 3), torch.randn(2, 3)), (0, None)),  # plain higher rank
    (torch.mul, (torch.randn(4, 3), torch.randn(3, 4)), (0, 1)),
    (lambda a, b: a - b, (torch.randn(4, 3), 2.5), (0, None)),
    (lambda a, b: b / a, (torch.randn(4, 3), torch.randn(3)), (0, None)),
    (lambda a, b: b**a, (torch.rand(4, 3), torch.rand(3) + 0.5), (0, None)),
    # 0-d logical values against a 0-d plain tensor of another dtype: type promotion treats
    # the logical value as 0-d, the physical one as 1-d
    (
        lambda a, b: a + b,
        (torch.randn(4, dtype=torch.float16), torch.tensor(1.5, dtype=torch.float64)),
        (0, None),
    ),
    (lambda a, b: a * b, (torch.arange(4), torch.tensor(0.5)), (0, None)),
    (
        lambda a, b: a * b,
        (torch.randn(4, 3, dtype=torch.float16), torch.tensor(3.0, dtype=torch.float64)),
        (0, None),
    ),
    (
        lambda a, b, c: torch.addcmul(a, b, c, value=0.5),
        (torch.randn(4, 3), torch.randn(4, 3), torch.randn(3)),
        (0, 0, None),
    ),
    (lambda a, lo: torch.clamp(a, min=lo), (torch.randn(4, 3), torch.zeros(4, 3)), 0),
    (lambda a, b: torch.where(a > b, a, b), (torch.randn(4, 3), torch.randn(3, 4)), (0, 1)),
    (lambda a: a + (a == None), (torch.randn(4, 3),), 0),  # noqa: E711  (a Python bool)
    (lambda a: F.gelu(a, approximate="tanh") + F.leaky_relu(a, 0.2), (torch.randn(4, 3),), 0),
    (lambda z: (z * z.conj()).real + z.abs(), (torch.randn(4, 3, dtype=torch.complex64),), 0),
    # two values of one level (the inline case): batch dims elsewhere than in front, logical
    # broadcasting at equal rank, 0-d logical values of two dtypes, promotion int * float
    (torch.mul, (torch.randn(4, 3), torch.randn(4, 3)), 1),
    (torch.add, (torch.randn(4, 1, 3), torch.randn(4, 2, 3)), 0),
    (torch.add, (torch.randn(2, 4, 3), torch.randn(2, 4, 1)), 1),
    (torch.mul, (torch.randn(4, dtype=torch.float16), torch.randn(4, dtype=torch.float64)), 0),
    (lambda a, b: a * b, (torch.arange(12).view(4, 3), torch.randn(4, 3)), 0),
    (lambda a, b: a - b.conj(), (torch.randn(4, 3, dtype=torch.complex64),) * 2, 0),
    (lambda a, b: b.neg() / a, (torch.rand(4, 3) + 1, torch.randn(4, 3)), 0),
]


@pytest.mark.parametrize("f,args,in_dims", CASES)
def test_same_answer_as_the_dispatch_path(f, args, in_dims, monkeypatch):
    fast = ft.vmap(f, in_dims=in_dims)(*args)
    expected = torch.func.vmap(f, in_dims=in_dims)(*args)
    _slow(monkeypatch)
    slow = ft.vmap(f, in_dims=in_dims)(*args)
    if isinstance(expected, bool):
        assert fast == slow == expected
        return
    for got in (fast, slow):
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected)


def test_plain_tensor_operand_keeps_torch_autograd(dispatch_count):
    # the inline case for (batched, plain tensor): torch records the op on a plain operand
    # that requires grad, at top level as on the ordinary path
    x, w = torch.randn(4, 3), torch.randn(3, requires_grad=True)
    out = ft.vmap(lambda a: (a - w) / w)(x)
    assert dispatch_count == []
    (g,) = torch.autograd.grad(out.sum(), w)
    w0 = w.detach().requires_grad_()
    (expected,) = torch.autograd.grad(((x - w0) / w0).sum(), w0)
    torch.testing.assert_close(g, expected)


def test_inplace_flag_and_out_take_the_ordinary_path():
    x = torch.randn(4, 3)

    def relu_inplace(v):
        v = v.clone()
        F.relu(v, inplace=True)
        return v

    torch.testing.assert_close(ft.vmap(relu_inplace)(x), x.relu())
    torch.testing.assert_close(ft.vmap(lambda v: F.relu(v.clone(), True))(x), x.relu())
    with pytest.raises(ft.errors.InplaceError, match="out="):
        ft.vmap(lambda v: torch.sin(v, out=torch.empty(3)))(x)


def test_composes_with_other_levels():
    x = torch.randn(4, 3)
    f = lambda v: (torch.sin(v) * v + 1.0).sum()  # noqa: E731
    torch.testing.assert_close(ft.vmap(ft.grad(f))(x), torch.func.vmap(torch.func.grad(f))(x))
    torch.testing.assert_close(ft.grad(lambda v: ft.vmap(f)(v).sum())(x), x.cos() * x + x.sin())
    torch.testing.assert_close(ft.vmap(ft.vmap(torch.sin))(x), x.sin())
    torch.testing.assert_close(
        ft.vmap(ft.vmap(torch.mul, in_dims=(0, None)), in_dims=(None, 0))(x[0], x[:, 0]),
        x[:, 0, None] * x[0],
    )


def test_escaped_wrapper_is_still_detected():
    leaked = []
    ft.vmap(lambda v: leaked.append(v) or v)(torch.randn(2, 3))
    with pytest.raises(ft.errors.EscapedTracerError):
        torch.sin(leaked[0])


UNARY = [torch.sin, torch.exp, torch.tanh, torch.sigmoid, F.silu, torch.abs, torch.neg]
BINARY = [torch.add, torch.mul, torch.sub, torch.maximum, torch.atan2, lambda a, b: a / (1 + b * b)]


@given(
    ops=st.lists(
        st.tuples(st.sampled_from(UNARY), st.sampled_from(BINARY)), min_size=1, max_size=4
    ),
    in_dims=st.tuples(st.sampled_from([0, 1, None]), st.sampled_from([0, 1, None])).filter(
        lambda d: d != (None, None)
    ),
    rank=st.sampled_from([1, 2]),
)
def test_chains_match_torch_func(ops, in_dims, rank):
    shape = (3, 3) if rank == 2 else (3,)

    def f(a, b):
        for u, bi in ops:
            a = bi(u(a), b)
        return a

    g = torch.Generator().manual_seed(0)
    args = [
        torch.randn(shape if d is None else (3,) + shape, generator=g).movedim(0, d or 0)
        if d is not None
        else torch.randn(shape, generator=g)
        for d in in_dims
    ]
    torch.testing.assert_close(
        ft.vmap(f, in_dims=in_dims)(*args), torch.func.vmap(f, in_dims=in_dims)(*args)
    )


def test_out_into_a_batched_tensor_writes_each_example():
    x, o = torch.randn(4, 3), torch.zeros(4, 3)
    ft.vmap(lambda v, out: torch.sin(v, out=out))(x, o)
    torch.testing.assert_close(o, x.sin())


# Note [Pointwise ops reaching the interpreter]: ATen pointwise ops that reach
# VmapInterpreter.process (called as ops, or handed down by another level's rule)
aten = torch.ops.aten
ATEN_CASES = [
    # (function, args, in_dims, whether the shortcut applies)
    (lambda a: aten.sin.default(a), (torch.randn(4, 3),), 1, True),
    (lambda a, b: aten.mul.Tensor(a, b), (torch.randn(4, 3), torch.randn(4, 3)), 1, True),
    (lambda a, b: aten.add.Tensor(a, b), (torch.randn(4, 1, 3), torch.randn(4, 2, 3)), 0, True),
    (lambda a: aten.mul.Tensor(a, 2.5), (torch.arange(4),), 0, True),
    (lambda a: aten.add.Tensor(a, 1, alpha=2), (torch.randn(4, 3),), 0, False),  # kwargs
    (
        lambda a, b: aten.mul.Tensor(a, b),
        (torch.randn(4, dtype=torch.float16), torch.randn(4, dtype=torch.float64)),
        0,
        True,
    ),
    (lambda a, b: aten.mul.Tensor(a, b), (torch.randn(4, 3), torch.randn(3, 4)), (0, 1), False),
    (lambda a, b: aten.sub.Tensor(a, b), (torch.randn(4, 3), torch.randn(4)), 0, False),  # ranks
    (lambda a, b: aten.div.Tensor(a, b), (torch.randn(4, 3), torch.randn(3)), (0, None), False),
    (
        lambda a, b: aten.where.self(a > 0, a, b),
        (torch.randn(4, 3), torch.randn(4, 3)),
        0,
        True,
    ),
    # z.conj() under vmap is a wrapper of a resolved value: the shortcut applies to it
    (lambda z: aten.mul.Tensor(z, z.conj()), (torch.randn(4, 3, dtype=torch.complex64),), 0, True),
    (lambda z: aten.mul.Tensor(z, z.conj()), (torch.randn(3, 4, dtype=torch.complex64),), 1, True),
]


@pytest.mark.parametrize("f,args,in_dims,applies", ATEN_CASES)
def test_aten_pointwise_same_answer_as_the_rule(f, args, in_dims, applies, monkeypatch):
    from functransforms.batching import _fastpath

    taken = []
    elementwise = _tensor.VmapInterpreter._elementwise

    def counting(self, func, a):
        out = elementwise(self, func, a)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(_tensor.VmapInterpreter, "_elementwise", counting)
    fast = ft.vmap(f, in_dims=in_dims)(*args)
    expected = torch.func.vmap(f, in_dims=in_dims)(*args)
    assert any(taken) == applies
    monkeypatch.setattr(_fastpath, "ELEMENTWISE_RULES", set())
    monkeypatch.setattr(_tensor, "ELEMENTWISE_RULES", set())
    slow = ft.vmap(f, in_dims=in_dims)(*args)
    for got in (fast, slow):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        torch.testing.assert_close(got, expected)


def test_pointwise_ops_handed_down_by_other_levels():
    x, v = torch.randn(4, 3), torch.randn(4, 3)
    f = lambda a: (a.sin() * a.exp() + a / (1 + a * a)).sum()  # noqa: E731
    for ours, theirs in (
        (ft.vmap(ft.grad(f)), torch.func.vmap(torch.func.grad(f))),
        (ft.vmap(ft.jacfwd(f)), torch.func.vmap(torch.func.jacfwd(f))),
        (ft.vmap(ft.hessian(f)), torch.func.vmap(torch.func.hessian(f))),
    ):
        torch.testing.assert_close(ours(x), theirs(x))
    jv = ft.vmap(lambda a, t: ft.jvp(f, (a,), (t,))[1])(x, v)
    torch.testing.assert_close(
        jv, torch.func.vmap(lambda a, t: torch.func.jvp(f, (a,), (t,))[1])(x, v)
    )


# Note [Lower levels' values in the pointwise fast path]
@pytest.mark.parametrize("case", ["sub", "rsub_scaled", "maximum", "0d", "higher_rank"])
def test_lower_level_values_are_constants(case, monkeypatch, dispatch_count):
    # grad(vmap(f)) where f mixes the batched value with an unbatched value of the grad level
    # (MAML's `p - lr * g`): the fast path hands the op to the grad level as the rule would
    g = torch.Generator().manual_seed(5)
    p = torch.randn(4, 3, generator=g, dtype=torch.float64)
    xs = torch.randn(6, 4, 3, generator=g, dtype=torch.float64)
    taken = True
    fn = {
        "sub": lambda p, x: p - x,
        "rsub_scaled": lambda p, x: p - 0.1 * (x * p),
        "maximum": lambda p, x: torch.maximum(x, p),
        "0d": lambda p, x: p.sum() * x,
        "higher_rank": lambda p, x: p.unsqueeze(0) * x,  # reaches the batch dim: declined
    }[case]
    if case == "higher_rank":
        xs, taken = xs[:, 0], False

    def loss(p):
        return ft.vmap(fn, in_dims=(None, 0))(p, xs).sin().sum()

    fast = ft.grad(loss)(p)
    assert (dispatch_count == []) == taken, dispatch_count
    _slow(monkeypatch)
    slow = ft.grad(loss)(p)
    assert torch.equal(fast, slow) and fast.stride() == slow.stride()
    theirs = torch.func.grad(lambda p: torch.func.vmap(fn, in_dims=(None, 0))(p, xs).sin().sum())
    torch.testing.assert_close(fast, theirs(p))


def test_higher_level_values_are_not_constants(dispatch_count):
    # vmap(grad(f)) whose inner function mixes a batched value with its own tracked one: the
    # grad level is innermost and sees the op first, never the vmap fast path's shortcut
    x = torch.randn(5, 3, dtype=torch.float64)
    w = torch.randn(3, dtype=torch.float64)
    f = lambda w, x: (torch.sub(x, w) * w).sin().sum()  # noqa: E731
    ours = ft.vmap(ft.grad(f), in_dims=(None, 0))(w, x)
    torch.testing.assert_close(ours, torch.func.vmap(torch.func.grad(f), in_dims=(None, 0))(w, x))
