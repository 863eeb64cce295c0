"""jit's recorder of static traces against make_fx in real mode, which it replaces (Note
[Recording static traces], functransforms/_jit/_record.py): the graphs jit replays are op for
op the same; what the recorder keys, keeps and records."""

from __future__ import annotations

import gc
import operator
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import functransforms as ft
from functransforms._jit._passes import _clean
from functransforms._jit._record import Recorder
from functransforms._pytree import tree_flatten


def _canon(gm):
    """The graph as comparable data: each op with its arguments, nodes named by what they are
    (input i, a constant of this shape, the k-th op, item j of a node)."""
    ids, ops = {}, []

    def arg(a):
        if isinstance(a, torch.fx.Node):
            return ids[a]
        if isinstance(a, (list, tuple)):
            return type(a)(arg(x) for x in a)
        return "generator" if isinstance(a, torch.Generator) else a

    for n in gm.graph.nodes:
        if n.op == "placeholder":
            ids[n] = ("input", len(ids))
        elif n.op == "get_attr":
            v = getattr(gm, n.target)
            ids[n] = ("constant", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else "obj"
        elif n.op == "call_function" and n.target is operator.getitem:
            ids[n] = ("item", ids[n.args[0]], n.args[1])
        elif n.op == "call_function":
            ids[n] = ("op", len(ops))
            ops.append((str(n.target), arg(n.args), arg(dict(n.kwargs))))
        else:
            ops.append((n.op, arg(n.args)))
    return ops


def _both(f, *args):
    """The cleaned graphs (what jit replays) of ``f`` recorded, then traced by make_fx."""

    def flat(*ts):
        return [x for x in tree_flatten(f(*ts))[0] if isinstance(x, torch.Tensor)]

    graphs = []
    for trace in (
        lambda ts: Recorder().run(flat, ts),
        lambda ts: make_fx(
            flat,
            decomposition_table={},
            tracing_mode="real",
            _error_on_data_dependent_ops=False,
            _allow_non_fake_inputs=True,
        )(*ts),
    ):
        torch.manual_seed(0)
        gm = trace([a.clone() for a in args])
        _clean(gm, False)
        graphs.append(_canon(gm))
    return graphs


torch.manual_seed(0)
_W = [torch.randn(16, 8), torch.randn(16), torch.randn(4, 16), torch.randn(4)]


def _mlp_loss(p, x, y):
    h = F.relu(F.linear(x, p[0], p[1]))
    return F.cross_entropy(F.linear(h, p[2], p[3])[None], y[None])


def _maml(w, xs, ys):
    def loss(v, x, y):
        return ((torch.tanh(x @ v) - y) ** 2).mean()

    def task(w, x, y):
        return loss(w - 0.1 * ft.grad(loss)(w, x, y), x, y)

    return ft.grad(lambda w: ft.vmap(task, in_dims=(None, 0, 0))(w, xs, ys).mean())(w)


def _inplace(x, y):
    x.mul_(2).add_(y)
    y[1:].sub_(1)  # through a view of an input
    return x * 3, y.t() if y.dim() == 2 else y[:2]  # a view of an input returned


_CASES = {
    "per-sample grads": (
        lambda *a: ft.vmap(ft.grad(_mlp_loss), in_dims=(None, 0, 0))(list(a[:4]), a[4], a[5]),
        (*_W, torch.randn(5, 8), torch.randint(0, 4, (5,))),
    ),
    "jacrev": (lambda x: ft.jacrev(lambda z: torch.tanh(_W[0] @ z))(x), (torch.randn(8),)),
    "hessian": (
        lambda x: ft.hessian(lambda z: (z.sin() * (_W[0][:8, :] @ z)).sum() + (z**3).sum())(x),
        (torch.randn(8),),
    ),
    "maml": (_maml, (torch.randn(8), torch.randn(4, 5, 8), torch.randn(4, 5))),
    "in place": (_inplace, (torch.randn(4), torch.randn(4))),
    "lists, literals, several results": (
        lambda x: (
            torch.cat([t * i for i, t in enumerate(x.split(2))] + [torch.tensor([1.0, 2.0])]),
            x.max(0),
            x.sort()[0].cumsum(0),
        ),
        (torch.randn(6),),
    ),
    "random under vmap": (
        lambda x: ft.vmap(lambda a: F.dropout(a, 0.5) + torch.randn(()), randomness="different")(x),
        (torch.randn(3, 4),),
    ),
    "jvp of grad": (
        lambda x, v: ft.jvp(ft.grad(lambda z: z.exp().sum()), (x,), (v,))[1],
        (torch.randn(4), torch.randn(4)),
    ),
}


@pytest.mark.parametrize("name", sorted(_CASES))
def test_replayed_graph_is_make_fxs_op_for_op(name):
    f, args = _CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recorded, traced = _both(f, *args)
    assert len(recorded) > 2
    assert recorded == traced


def test_the_jitted_results_and_graph_come_from_the_recorder():
    f, args = _CASES["per-sample grads"]
    jitted = ft.jit(f)
    first, again = jitted(*args), jitted(*args)
    for a, b, c in zip(first, again, f(*args)):
        torch.testing.assert_close(a, c)
        torch.testing.assert_close(b, c)
    assert jitted.cache_info().hits == 1
    assert "torch.ops.aten" in jitted.graph(*args).code


def test_constants_one_attribute_per_tensor_one_node_per_use():
    w = torch.nn.Parameter(torch.randn(3))
    c = torch.randn(3)

    def flat(x):
        return [x * w + c * w + c]

    gm = Recorder().run(flat, [torch.randn(3)])
    attrs = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    assert attrs == [
        "_param_constant0",
        "_tensor_constant0",
        "_param_constant0",
        "_tensor_constant0",
    ]
    assert gm._param_constant0 is w and gm._tensor_constant0 is c


def test_values_hold_layouts_not_data():
    x = torch.randn(4, 6)

    def flat(x):
        y = x[1:, ::2]  # a view: offset 6, strides (6, 2)
        return [y, y.conj()]

    gm = Recorder().run(flat, [x])
    (sliced,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.slice.Tensor][-1:]
    v = sliced.meta["val"]
    assert (tuple(v.shape), v.stride(), v.storage_offset(), v.device) == (
        (3, 3),
        (6, 2),
        6,
        x.device,
    )
    with pytest.raises(RuntimeError, match="holds no values"):
        v + 1


def test_the_recorder_keeps_no_intermediate_alive():
    seen = []

    def flat(x):
        y = x * 2  # dropped inside f
        seen.append(weakref.ref(y))
        return [y.sum()]

    gm = Recorder().run(flat, [torch.randn(1000)])
    gc.collect()
    assert seen[0]() is None
    assert len(gm.graph.nodes) == 4  # input, mul, sum, output


def test_a_captured_tensors_value_is_frozen_as_make_fx_froze_it():
    # Note [Recording static traces]: .item() of a constant runs unrecorded (make_fx's
    # constant propagation), so this is no fallback; a traced value's .item() is one
    scale = torch.tensor(3.0)
    jitted = ft.jit(lambda x: x * scale.item())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(jitted(torch.ones(2)), torch.full((2,), 3.0))
    assert jitted.cache_info().fallbacks == 0
    reads = ft.jit(lambda x: x * x.sum().item())
    with pytest.warns(ft.errors.JitFallbackWarning, match="reads a tensor value"):
        reads(torch.ones(2))
