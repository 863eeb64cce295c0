"""Randomness, in-place ops, error messages and the per-example fallback."""

import warnings

import pytest
import torch
from functransforms.batching import _tensor

import functransforms as ft
from functransforms.errors import (
    DataDependentError,
    FallbackWarning,
    InplaceError,
    RandomnessError,
)

DT = torch.float64


# -- randomness ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "f",
    [
        lambda x: x + torch.randn(3),
        lambda x: torch.rand_like(x),
        lambda x: x.clone().uniform_(),
        lambda x: torch.nn.functional.dropout(x, 0.5),
    ],
    ids=["randn", "rand_like", "uniform_", "dropout"],
)
def test_randomness_error_raises(f):
    with pytest.raises(RandomnessError, match="randomness='error'"):
        ft.vmap(f)(torch.randn(4, 3))


@pytest.mark.parametrize(
    "f",
    [lambda x: x * 0 + torch.randn(3), lambda x: torch.rand_like(x), lambda x: x.clone().normal_()],
    ids=["randn", "rand_like", "normal_"],
)
def test_randomness_same_gives_identical_rows(f):
    out = ft.vmap(f, randomness="same")(torch.zeros(5, 3))
    assert out.shape == (5, 3)
    torch.testing.assert_close(out, out[:1].expand(5, 3))
    assert out.std() > 0


@pytest.mark.parametrize(
    "f",
    [lambda x: x * 0 + torch.randn(3), lambda x: torch.rand_like(x), lambda x: x.clone().normal_()],
    ids=["randn", "rand_like", "normal_"],
)
def test_randomness_different_gives_different_rows(f):
    out = ft.vmap(f, randomness="different")(torch.zeros(5, 3))
    assert out.shape == (5, 3)
    assert all(not torch.equal(out[0], out[k]) for k in range(1, 5))


def test_randomness_different_nested_shapes():
    out = ft.vmap(
        ft.vmap(lambda x: torch.randn(2) + x, randomness="different"), randomness="different"
    )(torch.zeros(4, 3))
    assert out.shape == (4, 3, 2)
    assert len({tuple(r.tolist()) for r in out.reshape(12, 2)}) == 12


@pytest.mark.parametrize(
    "f",
    [
        lambda x, b: torch.nn.functional.dropout(x, 0.5) * b,
        lambda x, b: torch.nn.Dropout(0.3)(x) + b,
        lambda x, b: (
            torch.nn.functional.dropout2d(x.reshape(1, 3, 4, 1), 0.5).flatten() * b.flatten()
        ),
        lambda x, b: torch.nn.functional.alpha_dropout(x, 0.5, True) * b,
        lambda x, b: torch.dropout(x, 0.5, True) * b,
    ],
    ids=["dropout", "nn.Dropout", "dropout2d", "alpha_dropout", "torch.dropout"],
)
@pytest.mark.parametrize("randomness", ["same", "different"])
def test_dropout_of_an_unbatched_tensor_matches_torch_func(f, randomness):
    """Note [Dropout of an unbatched tensor]: an ensemble's shared input dropped out under
    randomness='different' raised RandomnessError (torch's CPU kernel draws in place into a
    buffer like the unbatched input); PyTorch gives each example its own mask (same stream)."""
    x = torch.ones(3, 4)

    def run(vmap):
        torch.manual_seed(5)
        return vmap(lambda b: f(x, b), randomness=randomness)(torch.ones(4, 3, 4))

    out = run(ft.vmap)
    torch.testing.assert_close(out, run(torch.vmap))
    assert (randomness == "same") == all(torch.equal(out[0], out[k]) for k in range(1, 4))
    nested = ft.vmap(ft.vmap(lambda b: f(x, b), randomness="different"), randomness=randomness)
    out = nested(torch.ones(2, 3, 3, 4)).reshape(6, -1)
    assert len({tuple(r.tolist()) for r in out}) > 2


# -- in-place ops ------------------------------------------------------------------------------
def test_inplace_add_on_batched_self():
    def f(x, y):
        x = x.clone()
        x.add_(y)
        x.mul_(2)
        return x

    x, y = torch.randn(4, 3, dtype=DT), torch.randn(3, dtype=DT)
    for in_dims in [(0, None), (0, 0), (1, 0)]:
        a = x if in_dims[0] != 1 else x.T.contiguous()
        b = y if in_dims[1] is None else torch.randn(4, 3, dtype=DT)
        torch.testing.assert_close(ft.vmap(f, in_dims)(a, b), torch.vmap(f, in_dims)(a, b))


def test_inplace_into_unbatched_raises():
    w = torch.zeros(3)

    def f(x):
        w.add_(x)
        return w

    with pytest.raises(InplaceError, match=r"aten\.add_\.Tensor writes a batched value in place"):
        ft.vmap(f)(torch.randn(4, 3))
    assert torch.equal(w, torch.zeros(3))


def test_squeeze_inplace_via_vector_matmul():
    W = torch.randn(3, 5, dtype=DT)
    x = torch.randn(4, 3, dtype=DT)
    f = lambda x1d: x1d @ W  # matmul of a 1-d operand squeezes in place internally
    torch.testing.assert_close(ft.vmap(f)(x), torch.vmap(f)(x))
    g = lambda x: x.unsqueeze(0).squeeze_(0).t_() if x.dim() == 2 else x
    xs = torch.randn(4, 2, 3, dtype=DT)
    torch.testing.assert_close(ft.vmap(g)(xs), torch.vmap(g)(xs))


# -- error messages ---------------------------------------------------------------------------
def test_mismatched_batch_sizes():
    with pytest.raises(
        ValueError, match=r"same size along their in_dim.*shape \(3, 2\).*shape \(4, 2\)"
    ):
        ft.vmap(torch.add)(torch.randn(3, 2), torch.randn(4, 2))


def test_in_dims_length_mismatch():
    with pytest.raises(ValueError, match=r"in_dims has 3 entries but 2 positional inputs"):
        ft.vmap(torch.add, in_dims=(0, 0, 0))(torch.randn(3), torch.randn(3))


def test_in_dims_wrong_type():
    # ValueError, as torch.func
    with pytest.raises(ValueError, match=r"in_dims to be an int, None or a tuple"):
        ft.vmap(torch.add, in_dims=[0, 0])(torch.randn(3), torch.randn(3))


def test_in_dim_out_of_range():
    with pytest.raises(
        ValueError, match=r"in_dim=2, but it has 2 dims.*expected in_dim in \[-2, 1\]"
    ):
        ft.vmap(torch.sin, in_dims=2)(torch.randn(3, 4))


def test_out_dim_out_of_range():
    with pytest.raises(IndexError, match=r"out_dim=3 is out of range"):
        ft.vmap(torch.sin, out_dims=3)(torch.randn(3, 4))


def test_non_tensor_with_in_dim_zero():
    with pytest.raises(ValueError, match=r"input 1 \(flattened\) has in_dim=0, but it is a float"):
        ft.vmap(lambda x, s: x * s, in_dims=(0, 0))(torch.randn(3), 2.0)


def test_no_mapped_input():
    with pytest.raises(ValueError, match="no input is mapped"):
        ft.vmap(torch.sin, in_dims=None)(torch.randn(3))


@pytest.mark.parametrize(
    "f, op",
    [
        (lambda x: x.sum().item(), "aten._local_scalar_dense.default"),
        (lambda x: bool(x.sum() > 0), "aten.is_nonzero.default|aten._local_scalar_dense.default"),
        (lambda x: torch.equal(x, x), "aten.equal.default"),
    ],
    ids=["item", "bool", "equal"],
)
def test_data_dependent_errors(f, op):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        with pytest.raises(DataDependentError, match=rf"({op}) reads a batched tensor"):
            ft.vmap(f)(torch.randn(3, 2))


def test_tolist_under_vmap_raises():
    with pytest.raises((DataDependentError, RuntimeError), match="tolist|Python value"):
        ft.vmap(lambda x: torch.tensor(x.tolist()))(torch.randn(3, 2))


# -- fallback ---------------------------------------------------------------------------------
def test_op_without_rule_falls_back_with_warning(monkeypatch):
    monkeypatch.setattr(_tensor, "_WARNED", set())
    r, theta = torch.rand(4, 5, 3, dtype=DT), torch.randn(5, 3, dtype=DT)
    op = torch.ops.aten._pdist_forward.default
    assert op not in ft.batching.VMAP_RULES
    f = lambda r, theta: torch.pdist(r * theta).sin()
    with pytest.warns(
        FallbackWarning, match=r"no batching rule for aten\._pdist_forward\.default.*per-example"
    ):
        out = ft.vmap(f, in_dims=(0, None))(r, theta)
    torch.testing.assert_close(out, torch.stack([f(x, theta) for x in r]))
    with warnings.catch_warnings():  # warned once per op
        warnings.simplefilter("error", FallbackWarning)
        ft.vmap(f, in_dims=(0, None))(r, theta)


def test_in_dims_and_out_dims_through_registered_pytree_nodes():
    import dataclasses

    from functransforms._pytree import register_pytree_node

    @dataclasses.dataclass
    class Params:
        w: torch.Tensor
        b: torch.Tensor

    register_pytree_node(Params, lambda p: ((p.w, p.b), None), lambda aux, ch: Params(*ch))
    p = Params(torch.randn(5, 3), torch.randn(3, 5))

    out = ft.vmap(lambda p: p.w * p.b, in_dims=(Params(0, 1),))(p)
    torch.testing.assert_close(out, p.w * p.b.T)

    out = ft.vmap(lambda x: Params(x, x.sum()), out_dims=Params(1, 0))(p.w)
    torch.testing.assert_close(out.w, p.w.T)
    torch.testing.assert_close(out.b, p.w.sum(1))

    with pytest.raises(ValueError, match=r"in_dims\[0\] is a Params node.*got a tuple"):
        ft.vmap(lambda p: p[0], in_dims=(Params(0, None),))((p.w, p.b))


@pytest.mark.parametrize("in_dim", [0, 1, 2])
def test_wrappers_report_the_per_example_strides(in_dim):
    y = torch.randn(5, 2, 3, 4).movedim(0, in_dim)
    seen = {}

    def f(a):
        seen["stride"] = a.stride()
        seen["t_stride"] = a.mT.stride()
        seen["contiguous"] = a.contiguous().is_contiguous()
        return (
            a.contiguous().view(-1)
            + a.reshape(-1)
            + a.mT.reshape(-1).reshape(2, 4, 3).mT.reshape(-1)
        )

    out = ft.vmap(f, in_dims=in_dim)(y)
    ref = y.movedim(in_dim, 0)[0]
    assert seen["stride"] == tuple(s for i, s in enumerate(y.stride()) if i != in_dim)
    assert seen["t_stride"] == seen["stride"][:1] + seen["stride"][:0:-1]
    assert seen["contiguous"]
    torch.testing.assert_close(out[0], 3 * ref.reshape(-1))


def test_view_of_a_non_viewable_example_raises_like_torch():
    y = torch.randn(5, 3, 4)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        ft.vmap(lambda a: a.mT.view(-1))(y)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        torch.func.vmap(lambda a: a.mT.view(-1))(y)
