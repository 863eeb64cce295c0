"""Differential tests of odd inputs: hypothesis draws layouts (transposed, strided,
expanded, channels_last, conj and neg views), dtypes (half to complex128, integer and bool
operands, 0-d tensors of other dtypes, Python scalars), batch sizes 0 and 1, and runs small
programs under our transforms and torch.func's, comparing structure, dtypes, shapes, values and
exceptions (docs/design/inplace-and-views.md, "Layouts, dtypes and odd inputs").

Examples per test: the "ci" hypothesis profile of tests/conftest.py (derandomized, 30).

Rules of the comparison: where torch.func computes, ours must compute the same dtype, shape and
values; where torch.func raises, ours may raise or compute (our documented extensions). Lazy
conj/neg bits of outputs and strides are not compared (torch.func's follow its internals), except
where a bug was about them. The regression tests at the end fail if a bug found here returns.
"""

from __future__ import annotations

import pytest
import torch
import torch.func as tf
import torch.nn.functional as F
from hypothesis import assume, given, note
from hypothesis import strategies as st
from torch.utils._pytree import tree_flatten, tree_unflatten

import functransforms as ft
from functransforms.testing import strategies as fts

D = torch.float64


# -- comparison -----------------------------------------------------------------------------------
_TOL = {
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (4e-2, 4e-2),
    torch.float32: (1e-4, 1e-5),
    torch.complex64: (1e-4, 1e-5),
}


def _plain(t):
    return t.resolve_conj().resolve_neg()


def assert_same(ours, ref, dtypes=None, bits=False):
    """Leaf by leaf: dtype, shape, device, values. ``dtypes`` (one per leaf) are the dtypes
    eager execution gives; where torch.func's differs from them and ours does not, torch.func
    is wrong (docs/torch_func_differences.md 8, Python scalars with 0-d tensors under jacfwd).
    ``bits``: ours may carry a lazy conj/neg bit only where torch.func's does (derivatives;
    vmap returns lazy views of lazy inputs, as torch.func's unchunked vmap)."""
    lo, so = tree_flatten(ours)
    lr, sr = tree_flatten(ref)
    assert so == sr, f"structure {so} vs {sr}"
    for i, (a, b) in enumerate(zip(lo, lr)):
        if not isinstance(b, torch.Tensor):
            assert a == b
            continue
        assert isinstance(a, torch.Tensor), type(a)
        dtype_b = b.dtype
        if dtypes is not None and dtype_b != dtypes[i] and a.dtype == dtypes[i]:
            dtype_b = a.dtype
        assert (a.dtype, a.shape, a.device) == (dtype_b, b.shape, b.device)
        if bits:  # view_as_real and .numpy() refuse lazy bits: complex gradients of
            # column-major inputs broke Adam
            assert b.is_conj() or not a.is_conj(), "ours is a lazy conjugate, torch.func's not"
            assert b.is_neg() or not a.is_neg(), "ours is a lazy negation, torch.func's is not"
        if a.device.type == "meta":
            continue
        rtol, atol = _TOL.get(a.dtype, (1e-7, 1e-9))
        torch.testing.assert_close(
            _plain(a), _plain(b).to(a.dtype), rtol=rtol, atol=atol, equal_nan=True
        )


def _note(text):
    try:
        note(text)
    except Exception:  # outside a hypothesis test (the parametrized ones): nothing to note
        pass


def differential(run, dtypes=None, bits=True, oracle=None):
    """``run(lib)`` with torch.func and with ours: the same results, or torch.func raises.
    ``oracle()`` (eager, e.g. a loop over the examples) settles a disagreement: ours must
    match it where torch.func does not (torch.func's vmap of size-0 examples with
    out_dims=-1 returns garbage shapes or raises, depending on memory)."""
    torch.manual_seed(0)
    try:
        ref = run(tf)
    except Exception as e:  # torch.func refuses: ours may compute (an extension) or refuse
        _note(f"torch.func raised {type(e).__name__}: {e}")
        torch.manual_seed(0)
        try:
            run(ft)
        except Exception as ours:
            _note(f"ours raised {type(ours).__name__}: {ours}")
        return
    torch.manual_seed(0)
    ours = run(ft)
    try:
        assert_same(ours, ref, dtypes, bits)
    except AssertionError:
        if oracle is None:
            raise
        truth = oracle()
        assert_same(ours, truth, dtypes, bits)
        with pytest.raises(AssertionError):  # else the disagreement was ours after all
            assert_same(ref, truth, dtypes, bits)


# -- programs of one tensor (per example) ---------------------------------------------------------
def _matrix(x):
    return x if x.dim() >= 2 else x.reshape(1, -1) if x.dim() == 1 else x.reshape(1, 1)


def _real(x):
    return x.real if x.is_complex() else x


def _inplace_view(x):
    y = x.clone()
    if y.dim():
        y.narrow(-1, 0, min(1, y.shape[-1])).mul_(2)  # a write into a view of y
    return y + 1


def _setitem_adv(x):
    y = x.clone()
    if y.dim() and y.shape[0]:
        idx = torch.tensor([0, 0], device=x.device)
        y[idx] += x[idx] * 3  # duplicate indices: index_put without accumulate, last wins
    return y


def _scatter_add(x):
    if x.dim() == 0 or x.shape[-1] == 0:
        return x * 1
    n = x.shape[-1]
    idx = (torch.arange(n, device=x.device) % 2).expand(x.shape)
    return torch.zeros_like(x).scatter_add(-1, idx, x)


def _index_add(x):
    if x.dim() == 0 or x.shape[0] == 0:
        return x * 1
    idx = torch.arange(x.shape[0], device=x.device).flip(0) % 2
    return torch.zeros_like(x).index_add(0, idx, x * 2)


def _sort_ties(x):
    r = _real(x).round()  # ties
    if r.dim() == 0:
        return r
    v, i = r.sort(dim=-1, stable=True)
    return v * 2, i


def _topk(x):
    r = _real(x)
    if r.dim() == 0 or r.shape[-1] == 0:
        return r * 1
    return r.topk(1, -1).values


def _where_int(x):
    return torch.where(_real(x) > 0, x, torch.tensor(2, device=x.device))


PROGRAMS = {
    "pointwise": lambda x: (x.sin() * x + 1.5).exp() * 0.25,
    "sum_keepdim": lambda x: x.sum(-1, keepdim=True) * x if x.dim() else x.sum() * x,
    "mean_dim0": lambda x: x.mean(0) if x.dim() else x.mean(),
    "amax": lambda x: _real(x).amax(-1) if x.dim() else _real(x) * 1,
    "matmul": lambda x: _matrix(x) @ _matrix(x).mT,
    "einsum": lambda x: torch.einsum("...ij,...kj->...ik", _matrix(x), _matrix(x)),
    "index": lambda x: x[torch.tensor([0, 0], device=x.device)] if x.dim() and x.shape[0] else x,
    "mask": lambda x: x * (_real(x) > 0),
    "where_int": _where_int,
    "inplace_clone": lambda x: x.clone().add_(x).mul_(0.5),
    "inplace_view": _inplace_view,
    "setitem_adv": _setitem_adv,
    "cat_stack": lambda x: torch.stack(
        [
            torch.cat([x.reshape(-1), x.reshape(-1) * 2]),
            torch.cat([x.reshape(-1) * 3, x.reshape(-1)]),
        ],
        -1,
    ),
    "scatter_add": _scatter_add,
    "index_add": _index_add,
    "sort_ties": _sort_ties,
    "topk": _topk,
    "cumsum": lambda x: x.cumsum(-1) if x.dim() else x,
    "cumprod_zeros": lambda x: (x * (_real(x) > -0.5)).cumprod(-1) if x.dim() else x,
    "int_operand": lambda x: x * torch.arange(x.shape[-1] if x.dim() else 1, device=x.device),
    "scalars": lambda x: x * 2 + 0.5 - torch.tensor(1, dtype=torch.int32, device=x.device),
    "zero_d_other": lambda x: x * torch.tensor(1.5, dtype=torch.float16, device=x.device),
    "reshape_t": lambda x: _matrix(x).mT.reshape(-1),
    "view_t": lambda x: _matrix(x).mT.contiguous().view(-1),
    "unbind": lambda x: torch.stack(x.unbind(0)[::-1]) if x.dim() and x.shape[0] else x,
}


def _loss(out):
    """A real scalar of a program's output(s) (integer outputs dropped)."""
    total = 0
    for o in tree_flatten(out)[0]:
        if o.dtype.is_floating_point or o.dtype.is_complex:
            total = total + (_real(o) * _real(o)).sum() + (o.imag.sum() if o.is_complex() else 0)
    return total if isinstance(total, torch.Tensor) else None


def _floating_out(prog):
    """The program with integer outputs dropped (jvp/jacfwd of an integer output is 0 in both,
    but jacrev of one raises in torch.func only)."""

    def f(x):
        out = [
            o for o in tree_flatten(prog(x))[0] if o.dtype.is_floating_point or o.dtype.is_complex
        ]
        return tuple(out)

    return f


# -- strategies -----------------------------------------------------------------------------------
def _example_shapes():
    return st.one_of(
        st.just(()),
        fts.shapes(min_dims=1, max_dims=3, min_side=0, max_side=3),
        fts.shapes(min_dims=4, max_dims=4, min_side=1, max_side=2),
    )


_DTYPES = fts.dtypes(include_complex=True, include_float32=True, include_half=True)


@st.composite
def batched_inputs(draw, dtype=_DTYPES, kinds=fts.LAYOUTS):
    """(x of shape [B, *example], in_dim): B in {0, 1, 3}, x in an odd layout, then the batch
    dim moved to in_dim (a view)."""
    shape = draw(_example_shapes())
    batch = draw(st.sampled_from([3, 1, 0]))
    x = draw(
        fts.laid_out(
            fts.tensors(shape=(batch, *shape), dtype=dtype, min_value=-2, max_value=2), kinds=kinds
        )
    )
    in_dim = draw(st.sampled_from([0, -1, 1] if len(shape) >= 1 else [0, -1]))
    return x.movedim(0, in_dim), in_dim


@st.composite
def examples(draw, dtype=_DTYPES, kinds=fts.LAYOUTS, nonempty=True):
    shape = draw(_example_shapes())
    assume(not nonempty or all(shape))
    x = draw(
        fts.laid_out(fts.tensors(shape=shape, dtype=dtype, min_value=-2, max_value=2), kinds=kinds)
    )
    return x


# -- the harness -------------------------------------------------------------------------------
# One hypothesis test per program, so that each program meets every layout and dtype (a test
# drawing the program too reaches too few layout and dtype mixes per program within the examples
# CI can afford).
_NAMES = sorted(PROGRAMS)


@pytest.mark.parametrize("name", _NAMES)
@given(xs=batched_inputs(), out_dim=st.sampled_from([0, -1, 1]), chunk=st.sampled_from([None, 2]))
def test_vmap_on_odd_inputs(name, xs, out_dim, chunk):
    x, in_dim = xs
    prog = PROGRAMS[name]
    run = lambda m: m.vmap(prog, in_dims=in_dim, out_dims=out_dim, chunk_size=chunk)(x)  # noqa: E731
    differential(run, bits=False, oracle=lambda: _loop(prog, x, in_dim, out_dim))


def _loop(prog, x, in_dim, out_dim):
    """vmap's meaning: prog on each example, stacked at out_dim."""
    outs = [prog(e) for e in x.unbind(in_dim)]
    flat = [tree_flatten(o)[0] for o in outs]
    spec = tree_flatten(outs[0])[1]
    return tree_unflatten([torch.stack(leaves, out_dim) for leaves in zip(*flat)], spec)


@pytest.mark.parametrize("name", _NAMES)
@given(x=examples(), how=st.sampled_from(["grad", "vjp", "jvp"]), data=st.data())
def test_first_order_on_odd_inputs(name, x, how, data):
    prog = PROGRAMS[name]
    if how == "grad":
        differential(lambda m: m.grad(lambda a: _loss(prog(a)))(x))
    elif how == "vjp":

        def run(m):
            out, pull = m.vjp(_floating_out(prog), x)
            return out, pull(tuple(torch.ones_like(o) for o in out))

        differential(run)
    else:  # a tangent in a layout of its own (tangents laid out unlike their primal crashed)
        t = data.draw(
            fts.laid_out(fts.tensors(shape=x.shape, dtype=x.dtype, min_value=-2, max_value=2)),
            label="tangent",
        )
        dtypes = [o.dtype for o in tree_flatten(prog(x))[0]] * 2  # outputs, then tangents
        differential(lambda m: m.jvp(prog, (x,), (t,)), dtypes)


_REAL = fts.dtypes(include_complex=False, include_float32=True, include_half=True)
_HIGHER = ["jacrev", "jacfwd", "hessian", "jvp_grad", "vmap_grad", "jacrev_chunk"]


@pytest.mark.parametrize("name", _NAMES)
@given(x=examples(dtype=_REAL), how=st.sampled_from(_HIGHER))
def test_higher_order_on_odd_inputs(name, x, how):
    assume(x.numel() <= 8)
    prog = PROGRAMS[name]
    loss = lambda a: _loss(prog(a))  # noqa: E731
    runs = {
        "jacrev": lambda m: m.jacrev(_floating_out(prog))(x),
        "jacrev_chunk": lambda m: m.jacrev(_floating_out(prog), chunk_size=2)(x),
        "jacfwd": lambda m: m.jacfwd(_floating_out(prog))(x),
        "hessian": lambda m: m.hessian(loss)(x),
        "jvp_grad": lambda m: m.jvp(m.grad(loss), (x,), (torch.ones_like(x),)),
        "vmap_grad": lambda m: m.vmap(m.grad(loss))(torch.stack([x, -x])),
    }
    if how.startswith("jac"):  # a Jacobian has its output's dtype
        dtypes = [o.dtype for o in _floating_out(prog)(x)]
    else:  # hessian, jvp of grad, vmap of grad: the input's
        dtypes = [x.dtype] * (2 if how == "jvp_grad" else 1)
    differential(runs[how], dtypes)


# -- meta tensors: shapes and dtypes only ---------------------------------------------------------
_META_PROGRAMS = [n for n in _NAMES if n not in ("setitem_adv", "index", "index_add")]
_META_HOW = ["vmap", "grad", "jvp", "vjp", "jacrev", "jacfwd", "vmap_grad"]


@pytest.mark.parametrize("how", _META_HOW)
@given(
    x=examples(dtype=fts.dtypes(include_complex=False, include_half=True)),
    name=st.sampled_from(_META_PROGRAMS),
)
def test_meta_tensors_propagate_shapes_and_dtypes(how, x, name):
    assume(x.numel() <= 8)
    x = x.to("meta")
    prog = PROGRAMS[name]
    loss = lambda a: _loss(prog(a))  # noqa: E731
    runs = {
        "vmap": lambda m: m.vmap(prog)(torch.stack([x, x])),
        "grad": lambda m: m.grad(loss)(x),
        "jvp": lambda m: m.jvp(prog, (x,), (torch.empty_like(x),)),
        "vjp": lambda m: (lambda o: o[1](tuple(torch.ones_like(t) for t in o[0])))(
            m.vjp(_floating_out(prog), x)
        ),
        "jacrev": lambda m: m.jacrev(_floating_out(prog))(x),
        "jacfwd": lambda m: m.jacfwd(_floating_out(prog))(x),
        "vmap_grad": lambda m: m.vmap(m.grad(loss))(torch.stack([x, x])),
    }
    differential(runs[how])


# -- torch.set_default_dtype(torch.float64) -------------------------------------------------------
_DEFAULT_PROGRAMS = {
    "ones": lambda x: x * torch.ones(x.shape[-1]),
    "arange": lambda x: x + torch.arange(x.shape[-1]) * 0.5,
    "tensor_literal": lambda x: x * torch.tensor(1.5) + torch.tensor([2.0]),
    "python_float": lambda x: x * 2.5 + 1,
    "buffer": lambda x: torch.zeros(2, x.shape[-1]).index_add(
        0, torch.tensor([1]), x[None].double()
    ),
    "full_like": lambda x: torch.full_like(x, 3.0) * x + torch.full((1,), 0.5),
    "linspace": lambda x: x * torch.linspace(0, 1, x.shape[-1]),
    "randn": lambda x: x + torch.randn(x.shape[-1]),
}


@pytest.fixture
def float64_default():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.mark.parametrize("name", sorted(_DEFAULT_PROGRAMS))
@pytest.mark.parametrize(
    "how", ["vmap", "grad", "jvp", "jacrev", "jacfwd", "vmap_grad", "hessian", "float_primal"]
)
def test_programs_under_a_float64_default_dtype(float64_default, name, how):
    prog = _DEFAULT_PROGRAMS[name]
    for dtype in (torch.float32, torch.float64, torch.float16):
        x = torch.linspace(-1, 1, 6, dtype=torch.float32).reshape(2, 3).to(dtype).mT
        if how == "float_primal":  # torch.func refuses floats (torch_func_differences.md 1)
            g = ft.grad(lambda a: (a * a).sum())(1.5)
            assert g.dtype == torch.float64 and g.item() == 3.0
            continue
        differential(_default_dtype_run(prog, how, x))


def _default_dtype_run(prog, how, x):
    loss = lambda a: prog(a).sum()  # noqa: E731
    return {
        "vmap": lambda m: m.vmap(prog, randomness="different")(x),
        "grad": lambda m: m.grad(loss)(x[0]),
        "jvp": lambda m: m.jvp(prog, (x[0],), (x[1],)),
        "jacrev": lambda m: m.jacrev(prog)(x[0]),
        "jacfwd": lambda m: m.jacfwd(prog, randomness="different")(x[0]),
        "vmap_grad": lambda m: m.vmap(m.grad(loss), randomness="different")(x),
        "hessian": lambda m: m.hessian(loss)(x[0]),
    }[how]


# -- arguments that alias each other, and inputs that require grad --------------------------------
_PAIRS = {
    "same": lambda x: (x, x),
    "transposed": lambda x: (x, x.mT),
    "overlapping": lambda x: (x[:-1], x[1:]),
    "expanded": lambda x: (x, x[:1].expand(x.shape)),
}
_TWO = {
    "mul": lambda a, b: a * b.sin(),
    "matmul": lambda a, b: a @ b.mT,
    "write_b": lambda a, b: (b.clone().mul_(a), a * 2),
    "where": lambda a, b: torch.where(a > b, a, b),
    "cat": lambda a, b: torch.cat([a, b]),
}


@pytest.mark.parametrize("pair", sorted(_PAIRS))
@given(
    x=fts.laid_out(
        fts.tensors(shape=(3, 3), dtype=fts.dtypes(include_complex=False)),
        kinds=("contiguous", "transposed", "strided", "neg"),
    ),
    name=st.sampled_from(sorted(_TWO)),
    how=st.sampled_from(["grad", "jacrev", "jacfwd", "jvp", "vmap", "vmap01", "vmap_none"]),
)
def test_arguments_that_alias_each_other(pair, x, name, how):
    a, b = _PAIRS[pair](x)
    prog = _TWO[name]
    runs = {
        "grad": lambda m: m.grad(lambda u, v: _loss(prog(u, v)), argnums=(0, 1))(a, b),
        "jacrev": lambda m: m.jacrev(prog, argnums=(0, 1))(a, b),
        "jacfwd": lambda m: m.jacfwd(prog, argnums=(0, 1))(a, b),
        "jvp": lambda m: m.jvp(prog, (a, b), (b, a)),
        "vmap": lambda m: m.vmap(prog)(a, b),
        "vmap01": lambda m: m.vmap(prog, in_dims=(0, 1))(a, b),
        "vmap_none": lambda m: m.vmap(prog, in_dims=(None, 0))(a, b),
    }
    differential(runs[how], bits=how != "vmap" and how != "vmap01" and how != "vmap_none")


@pytest.mark.parametrize("how", ["grad", "vjp", "jvp", "vmap", "jacrev", "jacfwd"])
@pytest.mark.parametrize("view", [False, True])
def test_inputs_that_require_grad(how, view):
    """torch's autograd through our results, as through torch.func's (docs/design/interop.md)."""

    def run(m):
        torch.manual_seed(0)
        w = torch.randn(3, 4, dtype=D).mT.requires_grad_()  # a column-major leaf
        x = w[1:] if view else w
        f = lambda a: (a.sin() * w[:1]).exp()  # noqa: E731
        out = {
            "grad": lambda: m.grad(lambda a: f(a).sum())(x),
            "vjp": lambda: m.vjp(f, x)[1](torch.ones_like(f(x)))[0],
            "jvp": lambda: m.jvp(f, (x,), (torch.ones_like(x),))[1],
            "vmap": lambda: m.vmap(f)(x),
            "jacrev": lambda: m.jacrev(f)(x),
            "jacfwd": lambda: m.jacfwd(f)(x),
        }[how]()
        assert out.requires_grad
        return out, torch.autograd.grad(out.pow(2).sum(), w)

    differential(run)


# -- regression tests of the cases the harness found -----------------------------------------------
def test_jvp_of_a_view_with_a_tangent_laid_out_unlike_its_primal():
    # crash: a Dual/GradTensor reports its primal's strides, so `x.mT.view(-1)` took the view
    # branch for a column-major primal and aten.view then failed on the contiguous tangent
    x = torch.randn(4, 3, dtype=D).mT  # column-major [3, 4]
    t = torch.randn(3, 4, dtype=D)
    for f in (
        lambda a: a.mT.view(-1),
        lambda a: a.mT.reshape(-1),
        lambda a: a.movedim(0, 1).contiguous().view(2, 6),
        lambda a: a.mT.reshape(-1).unflatten(0, (6, 2)),
    ):
        assert_same(ft.jvp(f, (x,), (t,)), tf.jvp(f, (x,), (t,)))
        assert_same(ft.jacfwd(f)(x), tf.jacfwd(f)(x))  # jacfwd's basis is contiguous
        cube = lambda a, f=f: f(a).pow(3).sum()  # noqa: E731
        assert_same(ft.hessian(cube)(x), tf.hessian(cube)(x))
    # view_as_complex needs a last stride of 1: a step-2 tangent has 2
    x = torch.randn(3, 2, dtype=D)
    t = torch.randn(3, 4, dtype=D)[:, ::2]
    assert_same(
        ft.jvp(torch.view_as_complex, (x,), (t,)), tf.jvp(torch.view_as_complex, (x,), (t,))
    )


def test_complex_gradients_carry_no_lazy_conjugate():
    # `_mm(b, ct.mH).mH` keeps a column-major input's layout; for complex values the result was a
    # lazy conjugate: right values, but torch.optim.Adam (view_as_real) raised on it
    w = torch.randn(5, 4, dtype=torch.complex64)
    x = torch.randn(4, 3, dtype=torch.complex64).mT  # column-major [3, 4]
    loss = lambda a: (a @ w.mT).abs().sum()  # noqa: E731
    g = ft.grad(loss)(x)
    assert not g.is_conj()
    assert_same(g, tf.grad(loss)(x))
    assert not ft.vjp(lambda a: a @ w.mT, x)[1](torch.ones(3, 5, dtype=torch.complex64))[
        0
    ].is_conj()
    assert not ft.vmap(ft.grad(loss))(torch.stack([x, 2 * x])).is_conj()
    p = torch.nn.Parameter(x.detach().clone().mT.contiguous().mT)
    p.grad = ft.grad(loss)(p.detach())
    torch.optim.Adam([p]).step()  # raised "view_as_real doesn't work on unresolved conjugated"


def _strides(t):
    """The strides that matter: those of dims longer than 1."""
    return tuple(s for s, n in zip(t.stride(), t.shape) if n > 1)


def test_copies_in_a_memory_format_have_it_per_example():
    # crash: channels_last on the physical (one rank up) value raised "required rank 4"
    x = torch.randn(2, 3, 4, 5, 6)
    for fmt in (torch.channels_last, torch.contiguous_format):
        for f in (
            lambda a, fmt=fmt: a.clone(memory_format=fmt),
            lambda a, fmt=fmt: a.contiguous(memory_format=fmt),
            lambda a, fmt=fmt: a.to(torch.float64, memory_format=fmt),
        ):
            for in_dim in (0, 2, -1):
                out = ft.vmap(f, in_dims=in_dim)(x.movedim(0, in_dim))
                assert torch.equal(out, torch.stack([f(e) for e in x]))
                assert _strides(out[1]) == _strides(f(x[1]))
    # the pointwise fast path copied the physical value contiguous with the batch dim inside:
    # examples were not contiguous and the view raised
    y = torch.randn(4, 3, 5)
    f = lambda a: a.mT.clone(memory_format=torch.contiguous_format).view(-1)  # noqa: E731
    assert torch.equal(ft.vmap(f, in_dims=1)(y), torch.stack([f(e) for e in y.unbind(1)]))
    # the *_like factories too (empty_like ... full_like with memory_format=)
    for f in (
        lambda a: torch.zeros_like(a.mT, memory_format=torch.contiguous_format).add_(a.mT).view(-1),
        lambda a: torch.full_like(a[None, None], 2.0, memory_format=torch.channels_last) * a,
    ):
        out = ft.vmap(f, in_dims=1)(y)
        assert torch.equal(out, torch.stack([f(e) for e in y.unbind(1)]))
        assert _strides(out[0]) == _strides(f(y[:, 0]))
    # what the user met: jacfwd through a decomposition that asks for channels_last
    x = torch.randn(1, 3, 4, 4, dtype=D).contiguous(memory_format=torch.channels_last)
    up = lambda a: F.interpolate(a, scale_factor=2, mode="bilinear").sum(0)  # noqa: E731
    assert_same(ft.jacfwd(up)(x), tf.jacfwd(up)(x))


def test_pow_of_a_real_base_with_a_complex_exponent_jvp():
    # torch.func drops the imaginary part of the tangent (torch_func_differences.md 8)
    x = torch.tensor([0.5, 1.5, 2.0], dtype=D)
    b = torch.tensor(1 + 1j, dtype=torch.complex128)
    f = lambda a: a**b  # noqa: E731
    _, t = ft.jvp(f, (x,), (torch.ones(3, dtype=D),))
    fd = (f(x + 1e-6) - f(x - 1e-6)) / 2e-6
    torch.testing.assert_close(t, fd, rtol=1e-6, atol=1e-8)
    assert not torch.allclose(
        tf.jvp(f, (x,), (torch.ones(3, dtype=D),))[1], fd
    )  # if torch fixes it


def test_tangents_of_zero_d_values_with_python_scalars_keep_the_output_dtype():
    # torch.func's tangent of `a + 1.5` for a 0-d float32 `a` is float64 (torch_func_differences 8)
    x = torch.tensor(0.5)
    out, t = ft.jvp(lambda a: a + 1.5, (x,), (torch.tensor(1.0),))
    assert out.dtype == t.dtype == torch.float32
    assert ft.jacfwd(lambda a: (a * 2.5).exp())(x).dtype == torch.float32
    assert tf.jvp(lambda a: a + 1.5, (x,), (torch.tensor(1.0),))[1].dtype == torch.float64


def test_writes_into_a_negative_view_under_vmap_raise():
    # silent: the negative view was materialized when it entered the wrapper, so the write
    # reached a copy and `y` kept its old values (eager and torch.func write through)
    from functransforms.errors import InplaceError

    y = torch.arange(6.0).reshape(2, 3)
    for f in (lambda a: a.mul_(2), lambda a: a[1:].add_(1)):
        with pytest.raises(InplaceError, match="negative view"):
            ft.vmap(f)(torch._neg_view(y))
    assert torch.equal(y, torch.arange(6.0).reshape(2, 3))
    with pytest.raises(InplaceError, match="negative view"):
        ft.vmap(lambda a: torch._neg_view(a).mul_(2))(y)
    # reading one is fine, NaNs included
    y[0, 0] = float("nan")
    out = ft.vmap(lambda a: a * 2)(torch._neg_view(y))
    torch.testing.assert_close(out, -2 * y, equal_nan=True)


def test_a_floating_view_dtype_refuses_instead_of_a_silent_zero():
    # torch detaches x.view(dtype)'s output, so torch.func's derivative through it is a silent
    # zero; ours refuses at the forward op (a rule there could only give that zero)
    x = torch.randn(3, 4, dtype=D)
    loss = lambda a: a.view(torch.complex128).abs().sum()  # noqa: E731
    assert not tf.grad(loss)(x).any()  # torch.func: zero (wrong: the loss moves with x)
    for run in (
        lambda: ft.grad(loss)(x),
        lambda: ft.vmap(ft.grad(loss))(x[None]),
        lambda: ft.jvp(lambda a: a.view(torch.complex128), (x,), (x,)),
        lambda: ft.jacfwd(lambda a: a.view(torch.complex128).real)(x),
        lambda: ft.grad(lambda z: z.view(torch.float64).sum())(x.view(torch.complex128)),
    ):
        with pytest.raises(NotImplementedError, match="view_as_real"):
            run()
    # integer views carry no derivative and pass
    g = ft.grad(lambda a: (a.view(torch.int64) * 0 + a).sum())(x)
    assert torch.equal(g, torch.ones_like(x))
    # the spelling the message suggests agrees with torch.func
    spelled = lambda a: torch.view_as_complex(a.unflatten(-1, (-1, 2))).abs().sum()  # noqa: E731
    assert_same(ft.grad(spelled)(x), tf.grad(spelled)(x))


def test_the_gradient_of_a_mean_can_be_written_in_place():
    # ours was a stride-0 expand of ct / n (torch.func's is dense): clip_grad_norm_-style
    # `g.mul_(c)` raised "more than one element of the written-to tensor refers to a single
    # memory location"
    x = torch.randn(3, 4, dtype=D)
    for f in (lambda a: a.mean(), lambda a: a.mean(0).sum(), lambda a: a.mean((0, 1), True).sum()):
        g = ft.grad(f)(x)
        assert_same(g, tf.grad(f)(x))
        g.mul_(2)  # raised


# Found by the explore profile (docs/design/inplace-and-views.md, "Layouts, dtypes and odd
# inputs"): cumprod's derivative divides by x (as torch's backward does), which overflowed at
# a subnormal x (fixed for a scan over one element, where out is x: the identity) and
# underflowed in half precision (fixed: float32 inside, as torch's kernels).
def test_cumprod_gradient_at_a_subnormal_input():
    z = torch.tensor([2.2251e-309j], dtype=torch.complex128)
    loss = lambda x: x.cumprod(-1).imag.sum()  # noqa: E731
    assert_same(ft.grad(loss)(z), tf.grad(loss)(z))


def test_cumprod_hessian_in_half_precision():
    # silent: 4 instead of 2 (ct * C underflowed in float16 before the division by x)
    x = torch.tensor([8.0407e-05], dtype=torch.float16)
    loss = lambda a: (a.cumprod(-1) ** 2).sum()  # noqa: E731
    assert_same(ft.hessian(loss)(x), tf.hessian(loss)(x))
    assert ft.hessian(loss)(x).item() == 2.0
    y = torch.tensor([[3e-3, 2e-3, 5e-3]], dtype=torch.bfloat16)
    assert_same(ft.jacfwd(lambda a: a.cumprod(-1))(y), tf.jacfwd(lambda a: a.cumprod(-1))(y))
