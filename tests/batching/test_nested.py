"""vmap over nested tensors (strided and jagged layouts), against torch.func.

Note [Nested tensors under vmap] (batching/_nested.py). Where torch.func computes, ours returns
the same structure (nested or dense, layout, component shapes) and equal values; where it
raises, ours raises a clear error or (views, dtype casts, chunk_size, compositions whose
examples agree in shape) computes what a per-component loop computes.
"""

import warnings

import pytest
import torch
from functransforms.batching import _nested as nested_mod
from hypothesis import given
from hypothesis import strategies as st

import functransforms as ft
from functransforms.errors import DataDependentError, FallbackWarning, InplaceError
from functransforms.testing import check_vmap

DT = torch.float64
LAYOUTS = [pytest.param(torch.strided, id="strided"), pytest.param(torch.jagged, id="jagged")]
pytestmark = [
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors"),
    pytest.mark.filterwarnings("ignore:There is a performance drop"),
    pytest.mark.filterwarnings("ignore::functransforms.errors.FallbackWarning"),
]


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def nt(layout, shapes=((2, 3), (4, 3)), seed=0):
    g = _g(seed)
    return torch.nested.nested_tensor(
        [torch.randn(s, dtype=DT, generator=g) for s in shapes], layout=layout
    )


W = torch.randn(3, 5, dtype=DT, generator=_g(7))
Y2 = torch.randn(2, dtype=DT, generator=_g(8))
Y23 = torch.randn(2, 3, dtype=DT, generator=_g(9))
V3 = torch.randn(3, dtype=DT, generator=_g(10))


def assert_same(ours, ref):
    """Same structure (tuple, nested or dense, layout, component shapes) and equal values."""
    if isinstance(ref, tuple):
        assert isinstance(ours, tuple) and len(ours) == len(ref)
        for o, r in zip(ours, ref):
            assert_same(o, r)
        return
    assert type(ours) is type(ref), (type(ours), type(ref))
    assert ours.is_nested == ref.is_nested
    assert ours.layout == ref.layout
    assert ours.dtype == ref.dtype
    if ref.is_nested:
        oc, rc = ours.unbind(), ref.unbind()
        assert len(oc) == len(rc)
        for o, r in zip(oc, rc):
            assert o.shape == r.shape and torch.equal(o, r)
    else:
        assert ours.shape == ref.shape and torch.equal(ours, ref)


# -- where torch.func computes: the same nested structure and values ---------------------------

CASES = {  # name: (f, extra args after the nested input, in_dims)
    "sin": (torch.sin, (), 0),
    "sum": (lambda t: t.sum(), (), 0),
    "sum0": (lambda t: t.sum(0), (), 0),
    "sum1": (lambda t: t.sum(1), (), 0),
    "mean": (lambda t: t.mean(), (), 0),
    "mul2": (lambda t: t * 2, (), 0),
    "softmax": (lambda t: t.softmax(-1), (), 0),
    "matmul": (lambda t: t @ W, (), 0),
    "linear": (lambda t: torch.nn.functional.linear(t, W.T), (), 0),
    "cat": (lambda t: torch.cat([t, t]), (), 0),
    "clone": (lambda t: t.clone(), (), 0),
    "max_dim": (lambda t: tuple(t.max(-1)), (), 0),
    "tuple_out": (lambda t: (t.sin(), t.sum()), (), 0),
    "size_of_regular_dim": (lambda t: t * t.size(-1), (), 0),
    "dim": (lambda t: t * t.dim(), (), 0),
    "dense_batched_scalar": (lambda t, y: t.sum() + y, (Y2,), 0),
    "dense_batched_row": (lambda t, y: t * y, (Y23,), 0),
    "dense_unbatched": (lambda t, v: t * v, (V3,), (0, None)),
    "two_nested": (lambda t, u: t * u + u.exp(), ("nested",), 0),
    "constant_output_is_dense": (lambda t: torch.ones(3, dtype=DT), (), 0),
    "dense_only_output_stays_dense": (lambda t, y: (t.sin(), y * 2), (Y2,), 0),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shapes", [((2, 3), (4, 3)), ((2, 3), (2, 3))], ids=["ragged", "equal"])
def test_matches_torch_func(layout, case, shapes):
    f, extra, in_dims = CASES[case]
    x = nt(layout, shapes)
    args = [x, *(nt(layout, shapes, seed=1) if e == "nested" else e for e in extra)]
    ref = torch.func.vmap(f, in_dims=in_dims)(*args)
    assert_same(ft.vmap(f, in_dims=in_dims)(*args), ref)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_returns_input_itself_as_torch_func(layout):
    x = nt(layout)
    for f in (lambda t: t, lambda t: t.contiguous()):
        ref = torch.func.vmap(f)(x)
        ours = ft.vmap(f)(x)
        assert (ours is x) == (ref is x)
        assert_same(ours, ref)


def test_unbatched_jagged_input_with_a_dense_batch():
    x = nt(torch.jagged)
    f = lambda t, y: t.sum() + y  # noqa: E731  (a jagged sum is a dense scalar)
    ref = torch.func.vmap(f, in_dims=(None, 0))(x, V3)
    assert_same(ft.vmap(f, in_dims=(None, 0))(x, V3), ref)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_autograd_through_the_output(layout):
    comps = [torch.randn(2, 3, dtype=DT, requires_grad=True), torch.randn(4, 3, dtype=DT)]
    comps[1].requires_grad_()
    x = torch.nested.as_nested_tensor(comps, layout=layout)
    ours = ft.vmap(lambda t: (t.sin() * 2).sum())(x)
    ref = torch.func.vmap(lambda t: (t.sin() * 2).sum())(x)
    assert ours.requires_grad and ref.requires_grad
    g_ours = torch.autograd.grad(sum(c for c in ours.unbind()), comps, retain_graph=True)
    g_ref = torch.autograd.grad(sum(c for c in ref.unbind()), comps)
    for a, b in zip(g_ours, g_ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_randomness(layout):
    x = nt(layout, ((2, 3), (2, 3)))
    draw = lambda t: torch.rand_like(t)  # noqa: E731
    for vmap in (ft.vmap, torch.func.vmap):
        with pytest.raises(RuntimeError, match="randomness"):
            vmap(draw)(x)
        with pytest.raises(RuntimeError, match="randomness"):
            vmap(lambda t: t + torch.randn(3, dtype=DT))(x)
        a, b = vmap(draw, randomness="same")(x).unbind()
        assert torch.equal(a, b)  # one draw for the batch
    a, b = ft.vmap(draw, randomness="different")(x).unbind()
    assert not torch.equal(a, b)
    out = ft.vmap(lambda t: t + torch.randn(3, dtype=DT), randomness="different")(x)
    assert out.is_nested and [c.shape for c in out.unbind()] == [(2, 3), (2, 3)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_warns_once_per_function_as_the_loop_fallback(layout, monkeypatch):
    monkeypatch.setattr(nested_mod, "_WARNED", set())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ft.vmap(lambda t: t.sin().cos())(nt(layout))
    names = [str(w.message) for w in seen if w.category is FallbackWarning]
    assert any("sin on a nested tensor" in m for m in names)
    assert any("cos on a nested tensor" in m for m in names)


# -- where torch.func raises: ours raises clearly ----------------------------------------------

RAISES = {  # name: (call, exception, match)
    "in_dims=1": (lambda x: ft.vmap(torch.sin, in_dims=1)(x), ValueError, "in_dim=1.*in_dim=0"),
    "in_dims=-1": (lambda x: ft.vmap(torch.sin, in_dims=-1)(x), ValueError, "in_dim=0"),
    "out_dims=1": (lambda x: ft.vmap(torch.sin, out_dims=1)(x), ValueError, "out_dims=0"),
    "out_dims=None": (lambda x: ft.vmap(torch.sin, out_dims=None)(x), ValueError, "out_dim=None"),
    "add_": (lambda x: ft.vmap(lambda t: t.add_(1))(x), InplaceError, "add_ writes in place"),
    "setitem": (lambda x: ft.vmap(lambda t: t.__setitem__(0, 1.0))(x), InplaceError, "setitem"),
    "out=": (lambda x: ft.vmap(lambda t: torch.sin(t, out=t))(x), InplaceError, "out="),
    "shape": (lambda x: ft.vmap(lambda t: t * t.shape[0])(x), RuntimeError, r"dim\(s\) \[0\]"),
    "size0": (lambda x: ft.vmap(lambda t: t * t.size(0))(x), RuntimeError, r"x.size\(0\)"),
    "numel": (lambda x: ft.vmap(lambda t: t * t.numel())(x), RuntimeError, r"\[6, 12\]"),
    "bool": (lambda x: ft.vmap(lambda t: t if t.sum() > 0 else -t)(x), DataDependentError, "bool"),
    "item": (lambda x: ft.vmap(lambda t: t.sum().item())(x), DataDependentError, "item"),
    "unbind_ragged": (lambda x: ft.vmap(lambda t: t.unbind())(x), RuntimeError, r"\[2, 4\]"),
    "iterate_ragged": (lambda x: ft.vmap(lambda t: sum(t))(x), RuntimeError, r"\[2, 4\]"),
    "vmap(grad)": (
        lambda x: ft.vmap(ft.grad(lambda t: t.sin().sum()))(x),
        RuntimeError,
        "differ in size.*no other transform",
    ),
    "vmap(jvp)": (
        lambda x: ft.vmap(lambda t: ft.jvp(torch.sin, (t,), (t,))[1])(x),
        RuntimeError,
        "differ in size",
    ),
    "vmap(vmap)": (lambda x: ft.vmap(ft.vmap(torch.sin))(x), RuntimeError, "differ in size"),
    "grad(vmap)": (
        lambda x: ft.grad(lambda w: ft.vmap(lambda t: (t @ w).sum())(x).sum())(W[:, 0]),
        RuntimeError,
        "another transform",
    ),
    "jvp(vmap)": (
        lambda x: ft.jvp(lambda w: ft.vmap(lambda t: t @ w)(x), (W[:, 0],), (W[:, 1],)),
        RuntimeError,
        "another transform",
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(RAISES))
def test_clear_errors(layout, case):
    call, exc, match = RAISES[case]
    with pytest.raises(exc, match=match) as info:
        call(nt(layout))
    assert "vmap(" in str(info.value)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("transform", ["grad", "vjp", "jvp"])
def test_differentiating_a_nested_input_raises(layout, transform):
    f = lambda n: ft.vmap(lambda t: t.sin().sum())(n)  # noqa: E731
    x = nt(layout)
    call = {
        "grad": lambda: ft.grad(lambda n: f(n).sum())(x),
        "vjp": lambda: ft.vjp(f, x),
        "jvp": lambda: ft.jvp(f, (x,), (x,)),
    }[transform]
    with pytest.raises(NotImplementedError, match=rf"{transform}\(.*nested tensor.*unbind"):
        call()


def test_empty_nested_input_raises():  # torch.func crashes the process (SIGFPE) here
    with pytest.raises(ValueError, match="no components"):
        ft.vmap(torch.sin)(torch.nested.nested_tensor([], dtype=DT))


def test_batch_sizes_must_agree():
    with pytest.raises(ValueError, match="same size.*nested"):
        ft.vmap(lambda t, y: t * y)(nt(torch.jagged), torch.randn(3, 3, dtype=DT))


# -- where torch.func raises and a per-component loop is well defined: ours computes -----------


def loop(f, x):
    """The reference: ``f`` per component, nested as torch.func nests results."""
    outs = [f(c) for c in x.unbind()]
    if isinstance(outs[0], torch.Tensor):
        return torch.nested.as_nested_tensor(outs)
    return tuple(torch.nested.as_nested_tensor(list(o)) for o in zip(*outs))


BEYOND = {
    "T": lambda t: t.T,
    "T_matmul": lambda t: t.T @ t,
    "reshape": lambda t: t.reshape(-1),
    "view": lambda t: t.view(-1) * 2,
    "unsqueeze": lambda t: t.unsqueeze(0),
    "transpose": lambda t: t.transpose(0, 1),
    "getitem": lambda t: t[0],
    "getitem_column": lambda t: t[:, 0],
    "stack": lambda t: torch.stack([t, t.cos()]),
    "to_float32": lambda t: t.float(),
    "detach": lambda t: t.detach(),
    "flatten_then_sum": lambda t: t.flatten().sum(),
    "size_of_regular_dim_in_reshape": lambda t: t.reshape(-1, t.size(-1)).sum(0),
    "iterate_columns": lambda t: sum(col * i for i, col in enumerate(t.T)),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(BEYOND))
def test_views_and_casts_compute_per_component(layout, case):
    f = BEYOND[case]
    x = nt(layout)
    assert_same(ft.vmap(f)(x), loop(f, x))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("chunk_size", [1, 2, 5])
def test_chunk_size_changes_nothing(layout, chunk_size):
    x = nt(layout, ((2, 3), (4, 3), (1, 3)))
    y = torch.randn(3, dtype=DT, generator=_g(3))
    f = lambda t, y: (t.softmax(-1) * y).sum(0)  # noqa: E731
    assert_same(ft.vmap(f, chunk_size=chunk_size)(x, y), ft.vmap(f)(x, y))


def test_dense_argument_batched_along_another_dim():
    x = nt(torch.jagged)
    y = torch.randn(3, 2, dtype=DT, generator=_g(4))  # batched along dim 1
    out = ft.vmap(lambda t, y: t * y, in_dims=(0, 1))(x, y)
    ref = torch.nested.as_nested_tensor([c * y[:, i] for i, c in enumerate(x.unbind())])
    assert_same(out, ref)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_metadata_where_the_examples_agree(layout):
    def f(t):
        assert t.size(-1) == 3 and t.dim() == 2 and t.ndim == 2
        assert not t.is_nested and t.layout == torch.strided and t.dtype == DT
        return t

    ft.vmap(f)(nt(layout))
    out = ft.vmap(lambda t: t * t.shape[0] + t.numel())(nt(layout, ((2, 3), (2, 3))))
    x = nt(layout, ((2, 3), (2, 3)))
    assert_same(out, loop(lambda t: t * 2 + 6, x))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_transforms_inside_when_the_examples_agree_in_shape(layout):
    """torch.func raises for any transform inside a vmap over nested tensors; when the
    components have one shape the inner level has a logical shape, and ours computes what a
    loop over the components computes."""
    x = nt(layout, ((2, 3), (2, 3)))
    f = lambda t: (t.sin() * t).sum()  # noqa: E731
    assert_same(ft.vmap(ft.grad(f))(x), loop(torch.func.grad(f), x))
    jv = lambda t: ft.jvp(torch.tanh, (t,), (t.cos(),))[1]  # noqa: E731
    ref = loop(lambda t: torch.func.jvp(torch.tanh, (t,), (t.cos(),))[1], x)
    assert_same(ft.vmap(jv)(x), ref)
    assert_same(ft.vmap(ft.vmap(torch.sin))(x), loop(torch.sin, x))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_jit_runs_nested_inputs_eagerly(layout):
    """make_fx cannot trace nested tensors: functransforms.jit runs the call as is."""
    x = nt(layout)
    f = ft.vmap(lambda t: (t.sin() * 2).sum(0))
    g = ft.jit(f)
    for _ in range(2):
        assert_same(g(x), f(x))
    assert_same(g(x), torch.func.vmap(lambda t: (t.sin() * 2).sum(0))(x))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_complex_conj_views_per_component(layout):
    """torch.func raises for conj/real/view_as_real of a nested batch ("view ops"); the lazy
    conjugate bit must survive the re-nesting (it is resolved, never dropped)."""
    g = _g(5)
    comps = [torch.randn(s, dtype=torch.complex128, generator=g) for s in ((2, 3), (4, 3))]
    x = torch.nested.nested_tensor(comps, layout=layout)
    for f in (lambda t: t.conj(), lambda t: t.conj() * 1j, lambda t: t.real, torch.view_as_real):
        out = ft.vmap(f)(x)
        for o, c in zip(out.unbind(), comps):
            assert torch.equal(o.resolve_conj(), f(c).resolve_conj())


def _mlp():
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 4)
    )
    return m.double()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ragged_sequences_through_a_module(layout):
    """A workload: variable-length sequences through an MLP with attention pooling, the
    parameters unbatched (functional_call)."""
    model = _mlp()
    params = dict(model.named_parameters())
    g = _g(11)
    x = torch.nested.nested_tensor(
        [torch.randn(n, 8, dtype=DT, generator=g) for n in (3, 5, 2)], layout=layout
    )

    def pool(t, p):  # [n, 8] -> [4]
        h = torch.func.functional_call(model, p, (t,))
        return (h.softmax(0) * h).sum(0)

    ref = torch.func.vmap(pool, in_dims=(0, None))(x, params)
    assert_same(ft.vmap(pool, in_dims=(0, None))(x, params), ref)

    def attend(t, p):  # [n, 8] -> [4]; torch.func raises (h.T is a view op)
        h = torch.func.functional_call(model, p, (t,))
        return ((h @ h.T / 2.0).softmax(-1) @ h).mean(0)

    assert_same(ft.vmap(attend, in_dims=(0, None))(x, params), loop(lambda t: attend(t, params), x))


_PROPERTY_OPS = {
    "exp_sum": lambda t, v: (t.exp() * v).sum(0),
    "softmax_matmul": lambda t, v: t.softmax(-1) @ v,
    "norm_rows": lambda t, v: t / t.norm(dim=-1, keepdim=True),
    "cumsum_max": lambda t, v: tuple(t.cumsum(0).max(0)),
    "where": lambda t, v: torch.where(t > 0, t, v),
}


@given(
    lengths=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    op=st.sampled_from(sorted(_PROPERTY_OPS)),
    jagged=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_vmap_is_the_loop_over_components(lengths, op, jagged, seed):
    g = _g(seed)
    layout = torch.jagged if jagged else torch.strided
    x = torch.nested.nested_tensor(
        [torch.randn(n, 3, dtype=DT, generator=g) for n in lengths], layout=layout
    )
    v = torch.randn(3, dtype=DT, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_vmap(_PROPERTY_OPS[op], (x, v), in_dims=(0, None), atol=0, rtol=0)


def test_check_vmap_compares_nested_outputs(monkeypatch):
    import functransforms._vmap as vmap_mod

    real = vmap_mod.vmap
    off = lambda f, *a, **k: lambda *xs: real(lambda *ys: f(*ys) * 1.5, *a, **k)(*xs)  # noqa: E731
    monkeypatch.setattr(vmap_mod, "vmap", off)
    with pytest.raises(AssertionError, match="example 0"):
        check_vmap(torch.sin, (nt(torch.jagged),))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_aten_ops_below_torch_function_take_the_same_loop(layout):
    """With subclass torch functions disabled, ops reach the wrapper's __torch_dispatch__ as
    ATen overloads (decomposed): they run per component as well (the safety net)."""
    from functransforms import _compat

    def f(t):
        with _compat.DisableTorchFunctionSubclass():
            return (t.sin() * 2).sum(-1)

    x = nt(layout)
    assert_same(ft.vmap(f)(x), torch.func.vmap(lambda t: (t.sin() * 2).sum(-1))(x))
    with pytest.raises(RuntimeError, match="randomness"):
        ft.vmap(lambda t: _draw_below_torch_function(t))(x)


def _draw_below_torch_function(t):
    from functransforms import _compat

    with _compat.DisableTorchFunctionSubclass():
        return torch.rand_like(t)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dropout_draws_per_component(layout):
    """randomness='different': each component its own mask (torch.func 2.13's nested fallback
    gives every component the same one: docs/torch_func_differences.md); 'same': one mask."""
    x = torch.nested.nested_tensor([torch.ones(200, 3), torch.ones(200, 3)], layout=layout)
    drop = lambda t: torch.nn.functional.dropout(t, 0.5)  # noqa: E731
    a, b = ft.vmap(drop, randomness="different")(x).unbind()
    assert not torch.equal(a, b) and set(a.unique().tolist()) == {0.0, 2.0}
    a, b = ft.vmap(drop, randomness="same")(x).unbind()
    assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="randomness"):
        ft.vmap(drop)(x)
