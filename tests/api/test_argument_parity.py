"""The API surface against torch.func, call by call: the same call runs through
functransforms and torch.func and must give the same values, dtypes, shapes and pytree
structure, or raise the same exception class (ours with a message naming the call).
Deliberate differences are in docs/torch_func_differences.md and are tested there."""

import collections
import dataclasses
import functools

import pytest
import torch
import torch.func as tf
import torch.nn as nn
from torch.utils._pytree import tree_flatten

import functransforms as ft

g = torch.Generator().manual_seed(0)
x = torch.randn(3, 4, dtype=torch.float64, generator=g)
y = torch.randn(4, 3, dtype=torch.float64, generator=g)
z = torch.randn(3, dtype=torch.float64, generator=g)
w = torch.randn(3, dtype=torch.float64, generator=g)
NT = collections.namedtuple("NT", "a b")
f2 = lambda a, b: (a * b.sin()).sum()  # noqa: E731


def same(make):
    """``make(lib)`` gives the same pytree of values for torch.func and for us."""
    torch.manual_seed(0)
    ref = make(tf)
    torch.manual_seed(0)
    ours = make(ft)
    lr, sr = tree_flatten(ref)
    lo, so = tree_flatten(ours)
    assert str(so) == str(sr)
    for a, b in zip(lo, lr):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor)
            assert (a.dtype, a.shape) == (b.dtype, b.shape)
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        else:
            assert a == b


def both_raise(make, exc, match):
    with pytest.raises(exc):
        make(tf)
    with pytest.raises(exc, match=match):
        make(ft)


AGREE = {
    # vmap: in_dims / out_dims trees, negative dims, chunking, batch sizes, callables
    "in_dims dict": lambda M: M.vmap(lambda d: d["a"] + d["b"], in_dims=({"a": 0, "b": None},))(
        {"a": x, "b": z.new_ones(4)}
    ),
    "in_dims list": lambda M: M.vmap(lambda l: l[0] + l[1], in_dims=([0, 1],))([x, y]),
    "in_dims namedtuple": lambda M: M.vmap(lambda t: t.a * t.b, in_dims=(NT(0, 1),))(NT(x, y)),
    "in_dims -1": lambda M: M.vmap(lambda a: a * 2, in_dims=-1)(y),
    "in_dims -2": lambda M: M.vmap(lambda a: a * 2, in_dims=-2)(x),
    "out_dims -1": lambda M: M.vmap(lambda a: a * 2, out_dims=-1)(x),
    "out_dims per output": lambda M: M.vmap(lambda a: (a, a.sum()), out_dims=(1, 0))(x),
    "out_dims nested": lambda M: M.vmap(
        lambda a: (a, {"s": a.sum(), "t": a * 2}), out_dims=(1, {"s": 0, "t": -1})
    )(x),
    "out_dims None unbatched": lambda M: M.vmap(lambda a: z * 2, out_dims=None)(x),
    "out_dims (0,) single": lambda M: M.vmap(lambda a: a, out_dims=(0,))(x),
    "in_dims None int": lambda M: M.vmap(lambda a, n: a * n, in_dims=(0, None))(x, 3),
    "returns input": lambda M: M.vmap(lambda a: a)(x),
    "returns captured": lambda M: M.vmap(lambda a: z)(x),
    "returns unbatched input": lambda M: M.vmap(lambda a, b: b, in_dims=(0, None))(x, z),
    "kwargs unbatched": lambda M: M.vmap(lambda a, s=None: a + s)(x, s=z.new_ones(4)),
    "chunk uneven": lambda M: M.vmap(lambda a: a * 2, chunk_size=2)(y),
    "chunk out_dims 1": lambda M: M.vmap(lambda a: a * 2, chunk_size=2, out_dims=1)(y),
    "chunk in_dims 1": lambda M: M.vmap(lambda a: a.sum(), chunk_size=2, in_dims=1)(x),
    "chunk > B": lambda M: M.vmap(lambda a: a * 2, chunk_size=10)(x),
    "chunk tuple out": lambda M: M.vmap(lambda a: (a * 2, a.sum()), chunk_size=2, out_dims=(1, 0))(
        y
    ),
    "B=0": lambda M: M.vmap(lambda a: a * 2)(x[:0]),
    "B=0 sum": lambda M: M.vmap(lambda a: a.sum())(x[:0]),
    "B=1": lambda M: M.vmap(lambda a: a.sum())(x[:1]),
    "nested same tensor": lambda M: M.vmap(
        M.vmap(lambda a, b: a * b, in_dims=(0, None)), in_dims=(None, 0)
    )(x, x),
    "nested closure": lambda M: M.vmap(lambda a: M.vmap(lambda b: a * b)(a))(x),
    "randomness same": lambda M: M.vmap(lambda a: a + torch.rand(()), randomness="same")(x),
    "namedtuple out": lambda M: M.vmap(lambda a: NT(a, a.sum()))(x),
    "OrderedDict out": lambda M: M.vmap(lambda a: collections.OrderedDict(b=a, a=a.sum()))(x),
    "Tensor method": lambda M: M.vmap(torch.Tensor.sum)(x),
    "partial": lambda M: M.vmap(functools.partial(torch.sum, dim=0))(x),
    "nn.Module": lambda M: M.vmap(nn.Linear(4, 2).double())(x),
    "lambda default": lambda M: M.vmap(lambda a, k=2: a * k)(x),
    # grad family
    "argnums -1": lambda M: M.grad(f2, argnums=-1)(z, w),
    "argnums (1, 0)": lambda M: M.grad(f2, argnums=(1, 0))(z, w),
    "argnums (0,)": lambda M: M.grad(f2, argnums=(0,))(z, w),
    "grad_and_value tuple": lambda M: M.grad_and_value(f2, argnums=(0, 1))(z, w),
    "aux is input": lambda M: M.grad(lambda a: (a.sum(), a), has_aux=True)(z),
    "aux nested": lambda M: M.grad_and_value(
        lambda a: (a.sum(), {"k": [a.sin(), (a * 2,)]}), has_aux=True
    )(z),
    "grad dict": lambda M: M.grad(lambda d: (d["a"] * d["b"]).sum())({"a": z, "b": w}),
    "grad namedtuple": lambda M: M.grad(lambda d: (d.a * d.b).sum())(NT(z, w)),
    "grad OrderedDict": lambda M: M.grad(lambda d: (d["a"] * d["b"]).sum())(
        collections.OrderedDict(b=w, a=z)
    ),
    "grad kwargs": lambda M: M.grad(lambda a, k=None: (a * k).sum())(z, k=w),
    "grad partial": lambda M: M.grad(functools.partial(f2, b=w))(z),
    "grad int arg": lambda M: M.grad(lambda a, n: (a * n).sum())(z, 3),
    "vjp twice": lambda M: (lambda fn: (fn(w), fn(w * 2)))(M.vjp(lambda a: a.sin(), z)[1]),
    "vjp f32 cotangent": lambda M: M.vjp(lambda a: a.sin(), z)[1](w.float()),
    "vjp retain_graph": lambda M: M.vjp(lambda a: a.sin(), z)[1](w, retain_graph=False),
    "vjp create_graph": lambda M: M.grad(
        lambda a: M.vjp(lambda b: b.sin(), a)[1](w, create_graph=True)[0].sum()
    )(z),
    "vjp create_graph False": lambda M: M.grad(
        lambda a: M.vjp(lambda b: b.sin(), a)[1](w, create_graph=False)[0].sum()
    )(z),
    "vjp dict": lambda M: M.vjp(lambda d: d["a"] * d["b"], {"a": z, "b": w})[1](w),
    "jvp has_aux": lambda M: M.jvp(lambda a: (a.sin(), {"a": [a]}), (z,), (w,), has_aux=True),
    "jvp f32 tangent": lambda M: M.jvp(lambda a: a.sin(), (z,), (w.float(),)),
    "jvp dict": lambda M: M.jvp(
        lambda d: d["a"] * d["b"], ({"a": z, "b": w},), ({"a": w, "b": z},)
    ),
    "jacrev chunk 1": lambda M: M.jacrev(lambda a: a.sin(), chunk_size=1)(z),
    "jacrev chunk 2 tuple": lambda M: M.jacrev(lambda a: (a.sin(), a.sum()), chunk_size=2)(z),
    "jacrev argnums": lambda M: M.jacrev(lambda a, b: a * b, argnums=(0, 1))(z, w),
    "jacrev dict out": lambda M: M.jacrev(lambda a: {"s": a.sin(), "c": a.cos()})(z),
    "jacrev namedtuple out": lambda M: M.jacrev(lambda a: NT(a.sin(), a.cos()))(z),
    "jacrev module": lambda M: M.jacrev(nn.Linear(3, 2).double())(z),
    "jacfwd same": lambda M: M.jacfwd(lambda a: a * torch.rand(()), randomness="same")(z),
    "jacfwd different": lambda M: M.jacfwd(
        lambda a: a * torch.rand(3, dtype=torch.float64), randomness="different"
    )(z),
    "jacfwd aux": lambda M: M.jacfwd(lambda a: (a.sin(), {"a": a}), has_aux=True)(z),
    "jacfwd dict in": lambda M: M.jacfwd(lambda d: d["a"] * d["b"])({"a": z, "b": w}),
    "hessian argnums": lambda M: M.hessian(lambda a, b: (a**3 * b).sum(), argnums=(0, 1))(z, w),
}


@pytest.mark.parametrize("name", AGREE)
def test_agrees_with_torch_func(name):
    same(AGREE[name])


RAISE = {
    # (make, torch.func's class, our message)
    "in_dims float": (lambda M: M.vmap(lambda a: a, in_dims=1.0)(x), ValueError, "in_dims"),
    "in_dims list": (
        lambda M: M.vmap(lambda a, b: a + b, in_dims=[0, 0])(x, x),
        ValueError,
        "in_dims to be an int",
    ),
    "out_dims float": (lambda M: M.vmap(lambda a: a, out_dims=1.0)(x), ValueError, "out_dims"),
    "out_dims str": (lambda M: M.vmap(lambda a: a, out_dims="a")(x), ValueError, "out_dims"),
    "out_dims list for tensor": (
        lambda M: M.vmap(lambda a: a, out_dims=[0])(x),
        ValueError,
        "out_dims",
    ),
    "in_dims out of range": (lambda M: M.vmap(lambda a: a, in_dims=2)(x), ValueError, r"\[-2, 1\]"),
    "mismatched sizes": (
        lambda M: M.vmap(lambda a, b: a + b)(x, y),
        ValueError,
        "same size along their in_dim",
    ),
    "chunk 0": (lambda M: M.vmap(lambda a: a, chunk_size=0)(x), ValueError, "chunk_size=0"),
    "randomness bad": (
        lambda M: M.vmap(lambda a: a, randomness="foo")(x),
        RuntimeError,
        "randomness",
    ),
    "argnums out of range": (lambda M: M.grad(f2, argnums=2)(z, w), RuntimeError, "argnums"),
    "argnums repeated": (lambda M: M.grad(f2, argnums=(0, -2))(z, w), RuntimeError, "twice"),
    "grad non-scalar": (lambda M: M.grad(lambda a: a)(z), RuntimeError, "scalar"),
    "grad int input": (lambda M: M.grad(lambda a: a.sum())(torch.arange(3)), RuntimeError, "int64"),
    "vjp shape": (lambda M: M.vjp(lambda a: a.sin(), z)[1](w[:1]), RuntimeError, "shape"),
    "vjp structure": (lambda M: M.vjp(lambda a: a.sin(), z)[1]((w,)), RuntimeError, "structure"),
    "jvp list primals": (lambda M: M.jvp(lambda a: a, [z], [w]), RuntimeError, "tuples"),
    "jvp tangent shape": (lambda M: M.jvp(lambda a: a, (z,), (w[:1],)), RuntimeError, "shape"),
    "jvp non-tensor output": (
        lambda M: M.jvp(lambda a: (a.sin(), 3), (z,), (w,)),
        RuntimeError,
        "output 1.*int",
    ),
    "jacfwd non-tensor output": (
        lambda M: M.jacfwd(lambda a: (a.sin(), 3))(z),
        RuntimeError,
        "jacfwd.*output 1",
    ),
    "jvp aux int": (
        lambda M: M.jvp(lambda a: (a, 3), (z,), (w,), has_aux=True),
        RuntimeError,
        "aux",
    ),
    "jacrev chunk 0": (lambda M: M.jacrev(lambda a: a, chunk_size=0)(z), ValueError, "chunk"),
}


@pytest.mark.parametrize("name", RAISE)
def test_raises_as_torch_func(name):
    make, exc, match = RAISE[name]
    both_raise(make, exc, match)


def test_vjp_fn_keywords_have_torch_funcs_defaults():
    import inspect

    (_, ours), (_, ref) = ft.vjp(torch.sin, z), tf.vjp(torch.sin, z)
    kw = lambda fn: {  # noqa: E731
        k: p.default
        for k, p in inspect.signature(fn).parameters.items()
        if p.kind == p.KEYWORD_ONLY or p.default is not p.empty
    }
    assert kw(ours) == kw(ref)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3, bias=False)
        self.b = self.a  # one weight under two names
        self.register_buffer("buf", torch.ones(3))

    def forward(self, v, scale=1.0):
        return (self.b(self.a(v)) + self.buf) * scale


tied = Tied().double()
W = torch.randn(3, 3, dtype=torch.float64, generator=g)
b0 = torch.zeros(3, dtype=torch.float64)

FC_AGREE = {
    "one name": lambda M: M.functional_call(tied, {"a.weight": W}, (x[:, :3],)),
    "the other name": lambda M: M.functional_call(tied, {"b.weight": W}, (x[:, :3],)),
    "both names, one tensor": lambda M: M.functional_call(
        tied, {"a.weight": W, "b.weight": W}, (x[:, :3],)
    ),
    "tie_weights=False": lambda M: M.functional_call(
        tied, {"a.weight": W}, (x[:, :3],), tie_weights=False
    ),
    "strict through a tie": lambda M: M.functional_call(
        tied, {"b.weight": W, "buf": b0}, (x[:, :3],), strict=True
    ),
    "tuple of dicts": lambda M: M.functional_call(
        tied, ({"a.weight": W}, {"buf": b0}), (x[:, :3],)
    ),
    "buffers only": lambda M: M.functional_call(tied, {"buf": b0}, (x[:, :3],)),
    "kwargs": lambda M: M.functional_call(tied, {"a.weight": W}, (x[:, :3],), {"scale": 2.0}),
    "single arg": lambda M: M.functional_call(tied, {"a.weight": W}, x[:, :3]),
    "unexpected key": lambda M: M.functional_call(tied, {"a.weight": W, "zzz": W}, (x[:, :3],)),
    "grad of params": lambda M: M.grad(lambda p: M.functional_call(tied, p, (x[:, :3],)).sum())(
        {"a.weight": W}
    ),
    "vmap of params": lambda M: M.vmap(lambda p: M.functional_call(tied, p, (x[:, :3],)))(
        {"a.weight": W.expand(2, 3, 3)}
    ),
}


@pytest.mark.parametrize("name", FC_AGREE)
def test_functional_call_agrees(name):
    same(FC_AGREE[name])


@pytest.mark.parametrize(
    "make",
    [
        # two tensors for one tied weight: torch.func refuses; differentiating both names
        # used to give the first a silent zero gradient
        lambda M: M.functional_call(tied, {"a.weight": W, "b.weight": W * 2}, (x[:, :3],)),
        lambda M: M.grad(lambda p: M.functional_call(tied, p, (x[:, :3],)).sum())(
            {"a.weight": W, "b.weight": W}
        ),
    ],
)
def test_functional_call_two_values_for_a_tied_weight(make):
    both_raise(make, ValueError, "tied names")


@pytest.mark.parametrize(
    "make, exc",
    [
        (
            lambda M: M.functional_call(tied, {"a.weight": W}, (x[:, :3],), strict=True),
            RuntimeError,
        ),
        (
            lambda M: M.functional_call(tied, ({"a.weight": W}, {"a.weight": W}), (x[:, :3],)),
            ValueError,
        ),
    ],
)
def test_functional_call_bad_dicts(make, exc):
    both_raise(make, exc, "functional_call")


# -- classes registered with torch.utils._pytree are pytree nodes, as for torch.func --
class Pair:
    def __init__(self, a, b):
        self.a, self.b = a, b


@dataclasses.dataclass
class DC:
    a: torch.Tensor
    b: torch.Tensor


torch.utils._pytree.register_pytree_node(Pair, lambda p: ([p.a, p.b], None), lambda c, _: Pair(*c))
torch.utils._pytree.register_dataclass(DC)

PYTREE = {
    "vmap Pair in": lambda M: M.vmap(lambda p: p.a * p.b)(Pair(x, x)),
    "vmap Pair in_dims": lambda M: M.vmap(lambda p: p.a * p.b, in_dims=(Pair(0, None),))(
        Pair(x, x[0])
    ),
    "vmap Pair out_dims": lambda M: M.vmap(lambda t: Pair(t, t.sum()), out_dims=Pair(1, 0))(x),
    "vmap dataclass in": lambda M: M.vmap(lambda p: p.a * p.b)(DC(x, x)),
    "vmap dataclass out": lambda M: M.vmap(lambda t: DC(t, t.sum()))(x),
    "grad dataclass": lambda M: M.grad(lambda p: (p.a * p.b).sum())(DC(z, w)),
    "grad Pair": lambda M: M.grad(lambda p: (p.a * p.b).sum())(Pair(z, w)),
    "grad dataclass aux": lambda M: M.grad(lambda t: (t.sum(), DC(t, t)), has_aux=True)(z),
    "jacrev dataclass out": lambda M: M.jacrev(lambda t: DC(t.sin(), t.cos()))(z),
    "jacfwd dataclass in": lambda M: M.jacfwd(lambda p: p.a * p.b)(DC(z, w)),
    "vjp dataclass": lambda M: M.vjp(lambda p: DC(p.a * p.b, p.a), DC(z, w))[1](DC(w, z)),
    "jvp dataclass": lambda M: M.jvp(lambda p: DC(p.a * p.b, p.a), (DC(z, w),), (DC(w, z),)),
    "hessian dataclass": lambda M: M.hessian(lambda p: (p.a**2 * p.b).sum())(DC(z, w)),
}


@pytest.mark.parametrize("name", PYTREE)
def test_torch_registered_pytree_nodes(name):
    def flat(v):  # compare as leaves: the classes have no __eq__ for the tree specs
        return tree_flatten(v)[0]

    same(lambda M: flat(PYTREE[name](M)))
    assert type(PYTREE[name](ft)) is type(PYTREE[name](tf))


def test_torch_registered_node_structure_is_checked():
    both_raise(
        lambda M: M.vjp(lambda p: DC(p.a * p.b, p.a), DC(z, w))[1]((w, z)),
        RuntimeError,
        "structure",
    )


@pytest.mark.parametrize(
    "tangent",
    [
        lambda: (w, w),  # structure
        lambda: (w[:2],),  # shape
        lambda: (torch.ones(3, dtype=torch.long),),  # an integer tangent
        lambda: (w.to(torch.complex128),),  # complex for a real primal
    ],
)
def test_linearize_jvp_fn_bad_tangents_raise_runtime_error(tangent):
    both_raise(lambda M: M.linearize(lambda t: t.sin(), z)[1](*tangent()), RuntimeError, "jvp_fn")


def test_linearize_jvp_fn_agrees():
    same(lambda M: M.linearize(lambda a, b: a * b.sin(), z, w)[1](w, z))


def test_jvp_complex_tangent_for_a_real_primal_raises():
    # torch.func returns a complex output tangent; casting to the real primal's dtype dropped
    # the imaginary part (a wrong number with a UserWarning): we refuse
    with pytest.raises(ValueError, match="complex128 tensor but its primal is real"):
        ft.jvp(torch.sin, (z,), (w.to(torch.complex128),))
    with pytest.raises(ValueError, match="complex128"):
        ft.jacfwd(lambda t: ft.jvp(torch.sin, (t,), (t * 1j,))[1])(z)


@pytest.mark.parametrize(
    "make, exc",
    [
        (lambda M: M.jvp(lambda a, n: a * n, (z, 3), (w, 0)), RuntimeError),
        (lambda M: M.jvp(lambda a: a, ("s",), ("s",)), RuntimeError),
        (lambda M: M.vjp(lambda a, n: a * n, z, 3), ValueError),
        (lambda M: M.grad(lambda a: a * 2)(3), ValueError),
        (lambda M: M.jacrev(lambda a: a * 2)(3), ValueError),
        (lambda M: M.functional_call(nn.Linear(3, 2), 3, (z,)), ValueError),
        (lambda M: M.functional_call(nn.Linear(3, 2), [3], (z,)), ValueError),
    ],
)
def test_non_tensor_inputs_raise_torch_funcs_class(make, exc):
    with pytest.raises(exc):
        make(tf)
    with pytest.raises(exc, match=r"jvp\(|vjp\(|grad\(|jacrev\(|functional_call\("):
        make(ft)


KWARGS = {  # torch.func's jacrev/jacfwd/hessian take no keyword arguments (TypeError)
    "jacrev": lambda: ft.jacrev(lambda t, k=1.0: t * k)(z, k=w),
    "hessian": lambda: ft.hessian(lambda t, k=1.0: (t**3 * k).sum())(z, k=2.0),
}


def test_keyword_arguments_reach_the_function():
    torch.testing.assert_close(KWARGS["jacrev"](), torch.diag(w))
    torch.testing.assert_close(KWARGS["hessian"](), torch.diag(12.0 * z))
    same(lambda M: M.vmap(M.grad(lambda t, k=None: (t * k).sum()))(x[:, :3], k=z))
    torch.testing.assert_close(ft.jacfwd(lambda t, k=1.0: t * k)(z, k=w), torch.diag(w))
    with pytest.raises(TypeError):
        tf.jacfwd(lambda t, k=1.0: t * k)(z, k=w)


@pytest.mark.parametrize(
    "name, make",
    [
        ("grad", lambda M: M.grad(3)(z)),
        ("grad_and_value", lambda M: M.grad_and_value(None)(z)),
        ("jacrev", lambda M: M.jacrev(3)(z)),
        ("jacfwd", lambda M: M.jacfwd(3)(z)),
        ("hessian", lambda M: M.hessian(3)(z)),
        ("vjp", lambda M: M.vjp(3, z)),
        ("jvp", lambda M: M.jvp(3, (z,), (w,))),
        ("linearize", lambda M: M.linearize(3, z)),
        ("vmap", lambda M: M.vmap(3)(x)),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_non_callable_func_raises_type_error_naming_the_call(name, make):
    both_raise(make, TypeError, rf"^{name}\(.*callable")


def test_value_and_grad_errors_name_the_entry_point():
    """grad_and_value and JAX's value_and_grad name themselves, not the grad they share."""
    for name in ("grad_and_value", "value_and_grad"):
        with pytest.raises(
            RuntimeError, match=rf"^{name}\(<lambda>, argnums=0\)\(\.\.\.\): .*scalar"
        ):
            getattr(ft, name)(lambda a: a)(z)
        with pytest.raises(ValueError, match=rf"^{name}\(<lambda>, argnums=0\): .*an int \(3\)"):
            getattr(ft, name)(lambda a: a * a)(3)


xb = torch.randn(5, 4, dtype=torch.float64, generator=g)
dropout = nn.Dropout(0.5)
MORE = {
    "chunk unbatched out": lambda M: M.vmap(lambda t: (t, xb[0]), chunk_size=2)(xb),
    "chunk in_dims None": lambda M: M.vmap(lambda t, u: t * u, in_dims=(0, None), chunk_size=3)(
        xb, xb[0]
    ),
    "chunk dict out_dims": lambda M: M.vmap(
        lambda t: {"a": t, "b": t.sum()}, chunk_size=2, out_dims={"a": 1, "b": 0}
    )(xb),
    "chunk under grad": lambda M: M.grad(
        lambda u: M.vmap(lambda t: (t * u).sum(), chunk_size=2)(xb).sum()
    )(xb[0]),
    "chunk nested": lambda M: M.vmap(M.vmap(lambda a: a * 2, chunk_size=3), chunk_size=2)(xb),
    "chunk randomness different": lambda M: M.vmap(
        lambda t: t + torch.rand(4, dtype=torch.float64), chunk_size=2, randomness="different"
    )(xb),
    "chunk randomness same": lambda M: M.vmap(
        lambda t: t + torch.rand(4, dtype=torch.float64), chunk_size=2, randomness="same"
    )(xb),
    "same tensor as two argnums": lambda M: M.jacrev(lambda a, b: a * b.sin(), argnums=(0, 1))(
        z, z
    ),
    "same tensor twice jacfwd": lambda M: M.jacfwd(lambda a, b: a * b.sin(), argnums=(0, 1))(z, z),
    "vjp output twice": lambda M: M.vjp(lambda t: (t.sin(),) * 2, z)[1]((w, w)),
    "grad non-contiguous": lambda M: M.grad(lambda t: (t**2).sum())(x.t()),
    "vmap of bound method": lambda M: M.vmap(z.add)(x[:, :3]),
    "vmap dropout different": lambda M: M.vmap(dropout, randomness="different")(xb),
    "vmap dropout same chunked": lambda M: M.vmap(dropout, randomness="same", chunk_size=2)(xb),
    "vmap jacfwd dropout": lambda M: M.vmap(
        M.jacfwd(dropout, randomness="different"), randomness="different"
    )(xb),
    "vmap randperm": lambda M: M.vmap(lambda t: t[torch.randperm(4)], randomness="different")(xb),
    "jvp dropout": lambda M: M.jvp(dropout, (z,), (w,)),
}


@pytest.mark.parametrize("name", MORE)
def test_more_agreements(name):
    same(MORE[name])


def test_dicts_match_by_key_where_torch_func_matches_by_order():
    a, b = x, z.new_ones(4)
    ours = ft.vmap(lambda d: d["a"] * d["b"], in_dims=({"b": None, "a": 0},))({"a": a, "b": b})
    torch.testing.assert_close(ours, a * b)
    # torch.func maps the dicts by insertion order: b over its dim 0, a not at all
    ref = tf.vmap(lambda d: d["a"] * d["b"], in_dims=({"b": None, "a": 0},))({"a": a, "b": b})
    assert ref.shape == (4, 3, 4)
    # in order, both agree
    same(
        lambda M: M.vmap(lambda d: d["a"] * d["b"], in_dims=({"a": 0, "b": None},))(
            {"a": a, "b": b}
        )
    )
    out = ft.vmap(lambda t: {"a": t, "b": t.sum()}, out_dims={"b": 0, "a": 1})(x)
    torch.testing.assert_close(out["a"], x.T)
    torch.testing.assert_close(out["b"], x.sum(1))
    (gz,) = ft.vjp(lambda t: {"a": t.sin(), "b": t}, z)[1]({"b": w, "a": 2 * w})
    torch.testing.assert_close(gz, z.cos() * 2 * w + w)
    _, tz = ft.jvp(lambda d: d["a"] * d["b"], ({"a": z, "b": w},), ({"b": z, "a": w},))
    torch.testing.assert_close(tz, w * w + z * z)
