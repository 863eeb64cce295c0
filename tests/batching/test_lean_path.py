"""vmap's lean path (Note [vmap's lean path], functransforms/_vmap.py): the common call skips
``_vmap_call`` and builds its interpreter inline, so these tests hold it to what the general
path does. ``chunk_size`` at least the batch size changes nothing in the result but always
takes the general path: the reference here."""

import pytest
import torch
from functransforms.batching._tensor import VmapInterpreter

import functransforms as ft
from functransforms import _vmap
from functransforms._core import levels as _core
from functransforms.errors import RandomnessError

BIG = 1000  # a chunk_size above every batch here: one chunk, the general path


def _general(f, **kw):
    return ft.vmap(f, chunk_size=BIG, **kw)


@pytest.fixture
def no_general(monkeypatch):
    """Fail if the call reaches _vmap_call: the lean path must take it."""

    def refuse(*a, **k):
        raise AssertionError("the general path ran")

    monkeypatch.setattr(_vmap, "_vmap_call", refuse)


def test_the_common_calls_take_the_lean_path(no_general):
    x, w = torch.randn(4, 3), torch.randn(3)
    assert torch.equal(ft.vmap(torch.neg)(x), -x)
    assert torch.equal(ft.vmap(torch.mul, in_dims=(0, None))(x, w), x * w)
    assert torch.equal(ft.vmap(torch.mul, in_dims=(1, 0))(x.T, x), x * x)
    assert torch.equal(ft.vmap(torch.sum, out_dims=0)(x, dim=0), x.sum(1))  # kwargs pass through
    assert torch.equal(ft.vmap(lambda t: t + 1, randomness="same")(x), x + 1)
    assert torch.equal(ft.vmap(lambda t: t.sum(0), axis_name="i")(x), x.sum(1))
    # the one-tensor branch: a negative in_dim, a Parameter (a Tensor subclass)
    assert torch.equal(ft.vmap(torch.neg, in_dims=-1)(x), -x.T)
    p = torch.nn.Parameter(x.clone())
    assert torch.equal(ft.vmap(torch.neg)(p), -p)


def _interp_attrs(vmapped, *args):
    seen = []

    def f(*a):
        seen.append(_core.interpreter_stack()[-1])
        return a[0] * 2

    vmapped(f)(*args)
    (interp,) = seen
    assert type(interp) is VmapInterpreter and not interp.alive
    attrs = dict(vars(interp))
    attrs.pop("level")
    return attrs


@pytest.mark.parametrize("kw", [{}, {"in_dims": (0, None)}, {"axis_name": "i"}])
def test_lean_interpreter_matches_the_class(kw):
    """The lean path sets VmapInterpreter's attributes itself: the same set, the same values
    (but the level) as the general path, which constructs and enters the class."""
    args = (torch.randn(4, 3), torch.randn(3)) if "in_dims" in kw else (torch.randn(4, 3),)
    lean = _interp_attrs(lambda f: ft.vmap(f, **kw), *args)
    general = _interp_attrs(lambda f: _general(f, **kw), *args)
    assert lean == general


@pytest.mark.parametrize("fail", [False, True])
def test_lean_exit_restores_the_stack_and_runs_on_exit(fail):
    before = _core.interpreter_stack()
    ran = []

    def f(t):
        _core.interpreter_stack()[-1].on_exit(lambda: ran.append(True))
        if fail:
            raise KeyError("inside")
        return t

    if fail:
        with pytest.raises(KeyError, match="inside"):
            ft.vmap(f)(torch.randn(2))
    else:
        ft.vmap(f)(torch.randn(2))
    assert ran == [True]
    assert _core.interpreter_stack() == before


def test_lean_randomness_guard_raises_and_is_restored():
    x = torch.randn(3, 2)
    with pytest.raises(RandomnessError, match=r"vmap\(<lambda>, in_dims=0\)"):
        ft.vmap(lambda t: t + torch.randn(2))(x)
    torch.randn(2)  # the guard is off again
    # nested: the inner lean call restores the outer call's guard, which still raises
    with pytest.raises(RandomnessError):
        ft.vmap(lambda t: ft.vmap(torch.neg)(t) + torch.randn(()))(x)
    assert ft.vmap(lambda t: t + torch.randn(()), randomness="same")(x).shape == (3, 2)


VIEWS = {
    "identity": lambda t: t,
    "select": lambda t: t[0],
    "transpose": lambda t: t.T,
    "fresh": lambda t: t * 2,
    "detach": lambda t: t.detach(),
    "tuple": lambda t: (t, t + 1, t[1:]),
}


@pytest.mark.parametrize("name", sorted(VIEWS))
@pytest.mark.parametrize("out_dims", [0, 1])
def test_lean_outputs_alias_as_the_general_path(name, out_dims):
    f = VIEWS[name]
    x = torch.randn(4, 3, 2)
    ours, ref = ft.vmap(f, out_dims=out_dims)(x), _general(f, out_dims=out_dims)(x)
    ours, ref = (ours, ref) if isinstance(ref, tuple) else ((ours,), (ref,))
    for a, b in zip(ours, ref):
        assert torch.equal(a, b) and a.stride() == b.stride()
        assert (a is x) == (b is x)
        assert (a._base is x) == (b._base is x)
        same = a.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        assert same == (b.untyped_storage().data_ptr() == x.untyped_storage().data_ptr())


@pytest.mark.parametrize(
    "in_dims, args",
    [
        (0, (torch.randn(()),)),  # in_dim out of range of a 0-d tensor
        (2, (torch.randn(3, 2),)),
        (0, (torch.randn(3), torch.randn(4))),  # sizes differ
        ((0, 0), (torch.randn(3),)),  # in_dims longer than the inputs
        ((None,), (torch.randn(3),)),  # nothing mapped
        (0, (torch.randn(3), 2.0)),  # a float mapped
        (0, (2.0,)),  # a float alone (the one-argument branch)
        (-3, (torch.randn(3, 2),)),  # a negative in_dim out of range
    ],
)
def test_lean_leaves_bad_calls_to_the_general_errors(in_dims, args):
    """The lean path raises nothing of its own: each of these reaches _vmap_call's error."""
    with pytest.raises((ValueError, TypeError)) as lean:
        ft.vmap(torch.add if len(args) == 2 else torch.neg, in_dims=in_dims)(*args)
    with pytest.raises(type(lean.value)) as general:
        _vmap._vmap_call(
            torch.add if len(args) == 2 else torch.neg, in_dims, 0, "error", None, args, {}
        )
    assert str(lean.value) == str(general.value)


def test_lean_path_autograd_through_outputs():
    x = torch.randn(4, 3, requires_grad=True)
    ft.vmap(torch.sin)(x).sum().backward()
    torch.testing.assert_close(x.grad, x.detach().cos())
