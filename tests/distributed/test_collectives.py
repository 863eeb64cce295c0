"""Named axes and collectives under vmap: values against hand-written batched
references, derivatives against the same functions written with explicit batch reductions
(torch.func as the oracle) and finite differences, composition at depth, and errors."""

import pytest
import torch
import torch.func as tf
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import functransforms as ft
from functransforms.errors import UnboundAxisError
from functransforms.testing import check_grads

N = 4


def rand(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype)


# -- values: each collective against its batched reference -------------------------------------
# (collective inside vmap(axis_name="i"), reference on the stacked [N, ...] tensor)
CASES = {
    "psum": (lambda t: ft.psum(t, "i"), lambda x: x.sum(0).expand_as(x)),
    "pmean": (lambda t: ft.pmean(t, "i"), lambda x: x.mean(0).expand_as(x)),
    "pmax": (lambda t: ft.pmax(t, "i"), lambda x: x.amax(0).expand_as(x)),
    "pmin": (lambda t: ft.pmin(t, "i"), lambda x: x.amin(0).expand_as(x)),
    "all_gather": (
        lambda t: ft.all_gather(t, "i"),
        lambda x: x.unsqueeze(0).expand((N,) + x.shape),
    ),
    "all_gather_axis1": (
        lambda t: ft.all_gather(t, "i", axis=1),
        lambda x: x.movedim(0, 1).unsqueeze(0).expand((N,) + x.movedim(0, 1).shape),
    ),
    "all_gather_tiled": (
        lambda t: ft.all_gather(t, "i", tiled=True),
        lambda x: x.reshape(-1, *x.shape[2:]).unsqueeze(0).expand(N, -1, *x.shape[2:]),
    ),
    "psum_scatter": (
        lambda t: ft.psum_scatter(t.reshape(N, -1), "i"),
        lambda x: x.reshape(N, N, -1).sum(0),
    ),
    "all_to_all": (
        lambda t: ft.all_to_all(t.reshape(N, -1), "i", 0, 1),
        lambda x: x.reshape(N, N, -1).transpose(0, 1).transpose(1, 2),
    ),
    "ppermute_ring": (
        lambda t: ft.ppermute(t, "i", [(j, (j + 1) % N) for j in range(N)]),
        lambda x: x.roll(1, 0),
    ),
    "ppermute_partial": (
        lambda t: ft.ppermute(t, "i", [(0, 2), (1, 0)]),
        lambda x: torch.stack([x[1], torch.zeros_like(x[0]), x[0], torch.zeros_like(x[0])]),
    ),
    "axis_index": (
        lambda t: t * ft.axis_index("i"),
        lambda x: x * torch.arange(N, dtype=x.dtype).reshape(-1, *[1] * (x.dim() - 1)),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_value_matches_batched_reference(name):
    collective, reference = CASES[name]
    x = rand(N, N, 3)
    torch.testing.assert_close(ft.vmap(collective, axis_name="i")(x), reference(x))


@pytest.mark.parametrize("name", sorted(CASES))
def test_value_with_in_dim_1(name):
    collective, reference = CASES[name]
    x = rand(N, N, 3)
    got = ft.vmap(collective, in_dims=1, axis_name="i")(x.movedim(0, 1))
    torch.testing.assert_close(got, reference(x))


class _RecordsOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.namespaces = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.namespaces.add(func.namespace)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", sorted(CASES))
def test_dispatch_modes_see_the_collective_ops(name):
    """Note [Collectives skip the dispatcher]: without a mode the binding vmap's rule is called
    directly; with one the op goes through the dispatcher, where the mode sees it. Same values."""
    collective, reference = CASES[name]
    x = rand(N, N, 3)
    mode = _RecordsOps()
    with mode:
        got = ft.vmap(collective, axis_name="i")(x)
    torch.testing.assert_close(got, reference(x))
    if name != "axis_index":  # not an op: a batched arange
        assert "functransforms" in mode.namespaces


def test_reduction_at_its_own_level_applies_the_rule_directly(monkeypatch):
    """Note [A reduction at its own level]: a reduction of a plain per-example value of the
    binding vmap never reaches ``process``; a lazy conjugate, a value of an outer level shadowed
    by an inner axis of the same name, and a grad level's value do, and all agree."""
    from functransforms.batching._tensor import VmapInterpreter

    seen = []
    process = VmapInterpreter.process

    def counting(self, func, args, kwargs):
        if func.namespace == "functransforms":
            seen.append(func)
        return process(self, func, args, kwargs)

    monkeypatch.setattr(VmapInterpreter, "process", counting)
    x = rand(N, 3)
    f = lambda t: (t - ft.pmean(t, "i")) / ft.psum(t.abs(), "i") + ft.pmax(t, "i") * ft.pmin(t, "i")  # noqa: E731
    ref = (x - x.mean(0)) / x.abs().sum(0) + x.amax(0) * x.amin(0)
    torch.testing.assert_close(ft.vmap(f, axis_name="i")(x), ref)
    torch.testing.assert_close(ft.vmap(f, in_dims=1, axis_name="i")(x.T.contiguous()), ref)
    assert seen == []
    z = rand(N, 3, dtype=torch.complex128)
    got = ft.vmap(lambda t: ft.psum(t.conj(), "i"), axis_name="i")(z)
    torch.testing.assert_close(got, z.conj().sum(0).expand(N, 3))
    assert seen  # the lazy conjugate took the ordinary path
    outer = ft.vmap(
        lambda t: ft.vmap(lambda s: ft.psum(t, "i"), axis_name="i")(x[0]), axis_name="i"
    )
    # the inner axis (size 3) shadows the outer one: t does not vary along it, so psum is 3 * t
    torch.testing.assert_close(outer(x), (3 * x).unsqueeze(1).expand(N, 3, 3))
    # grad levels inside and outside the vmap: JAX's semantics, psum transposed to psum
    h = lambda t: (t * ft.psum(t, "i")).sum()  # noqa: E731
    torch.testing.assert_close(ft.vmap(ft.grad(h), axis_name="i")(x), 2 * x.sum(0).expand_as(x))
    outside = ft.grad(lambda xs: ft.vmap(h, axis_name="i")(xs).sum())(x)
    torch.testing.assert_close(outside, 2 * x.sum(0).expand_as(x))


def test_all_to_all_untiled_matches_jax_shapes():
    # split dim (size N) removed, a dim of size N inserted at concat_axis
    x = rand(N, 2, N, 3)
    out = ft.vmap(lambda t: ft.all_to_all(t, "i", 1, 0), axis_name="i")(x)
    # out[i][j] = x[j][:, i]
    ref = x.permute(2, 0, 1, 3)
    assert out.shape == (N, N, 2, 3)
    torch.testing.assert_close(out, ref)


def test_all_to_all_tiled():
    x = rand(N, 2 * N, 3)  # each example: 2N rows, chunks of 2
    out = ft.vmap(lambda t: ft.all_to_all(t, "i", 0, 1, tiled=True), axis_name="i")(x)
    chunks = x.reshape(N, N, 2, 3)  # [j, i, 2, 3]
    ref = torch.stack([torch.cat([chunks[j, i] for j in range(N)], 1) for i in range(N)])
    torch.testing.assert_close(out, ref)


def test_reduction_below_torch_autograd_takes_process_only_for_values_requiring_grad(
    monkeypatch,
):
    """Note [A reduction at its own level]: below torch's autograd (inside a rule) only a value
    requiring grad needs the dispatcher (Note [Collectives skip the dispatcher]: it would
    re-enable torch's autograd there); any other value is reduced directly, to the same result."""
    from functransforms.batching._tensor import VmapInterpreter

    seen = []
    process = VmapInterpreter.process

    def counting(self, func, args, kwargs):
        seen.append(func)
        return process(self, func, args, kwargs)

    monkeypatch.setattr(VmapInterpreter, "process", counting)
    f = ft.vmap(lambda t: ft.psum(t, "i"), axis_name="i")
    x = rand(N, 3)
    w = rand(N, 3).requires_grad_()
    f(x)  # the inline path is loaded
    with torch._C._AutoDispatchBelowADInplaceOrView():
        torch.testing.assert_close(f(x), x.sum(0).expand(N, 3))
        assert seen == []
        torch.testing.assert_close(f(w), w.detach().sum(0).expand(N, 3))
        assert seen


def test_psum_of_unmapped_values_and_numbers():
    x = rand(N, 3)
    w = rand(3)
    out = ft.vmap(lambda t: t + ft.psum(w, "i") + ft.psum(1, "i"), axis_name="i")(x)
    torch.testing.assert_close(out, x + N * w + N)


def test_pytree_and_tuple_of_names():
    x = rand(3, N, 2)  # outer axis "a" of size 3, inner "b" of size N

    def f(t):
        tree = {"s": ft.psum(t, ("a", "b")), "m": (ft.pmean(t, "a"), ft.pmax(t, "b"))}
        return tree, ft.axis_index(("a", "b")), ft.all_gather(t, ("a", "b"))

    tree, index, gathered = ft.vmap(ft.vmap(f, axis_name="b"), axis_name="a")(x)
    torch.testing.assert_close(tree["s"], x.sum((0, 1)).expand_as(x))
    torch.testing.assert_close(tree["m"][0], x.mean(0).expand_as(x))
    torch.testing.assert_close(tree["m"][1], x.amax(1, keepdim=True).expand_as(x))
    assert torch.equal(index, torch.arange(3 * N).reshape(3, N))
    torch.testing.assert_close(gathered, x.reshape(3 * N, 2).expand(3, N, 3 * N, 2))


def test_nested_axes_see_their_own_level():
    x = rand(3, N)
    out = ft.vmap(
        ft.vmap(lambda t: ft.psum(t, "inner") * ft.axis_size("outer"), axis_name="inner"),
        axis_name="outer",
    )(x)
    torch.testing.assert_close(out, (x.sum(1, keepdim=True) * 3).expand_as(x))
    shadow = ft.vmap(ft.vmap(lambda t: ft.psum(t, "i"), axis_name="i"), axis_name="i")(x)
    torch.testing.assert_close(shadow, x.sum(1, keepdim=True).expand_as(x))  # innermost wins


def test_axis_size_without_mapped_inputs():
    out = ft.vmap(lambda: ft.axis_index("i") * 2.0, in_dims=(), axis_size=3, axis_name="i")()
    assert torch.equal(out, torch.tensor([0.0, 2.0, 4.0]))
    w = rand(2)
    torch.testing.assert_close(
        ft.vmap(lambda v: v.sin(), in_dims=None, axis_size=5)(w), w.sin().expand(5, 2)
    )


def test_batch_size_zero():
    out = ft.vmap(lambda t: t - ft.pmean(t, "i"), axis_name="i")(torch.zeros(0, 3))
    assert out.shape == (0, 3)


# -- derivatives ---------------------------------------------------------------------------------
def normalise(t):  # a per-example loss normalised across the batch
    centred = t - ft.pmean(t, "i")
    return (centred.pow(2).sum() / ft.psum(t.exp().sum(), "i")).sin()


def normalise_ref(x):
    centred = x - x.mean(0)
    return (centred.pow(2).sum(1) / x.exp().sum()).sin()


DIFF_CASES = {
    "normalise": (normalise, normalise_ref),
    "pmax": (lambda t: (ft.pmax(t, "i") * t).sum(), lambda x: (x.amax(0) * x).sum(1)),
    "pmin": (lambda t: (ft.pmin(t.sin(), "i") * t).sum(), lambda x: (x.sin().amin(0) * x).sum(1)),
    "all_gather": (
        lambda t: (ft.all_gather(t, "i") ** 2 * t).sum(),
        lambda x: ((x**2).sum(0) * x).sum(1),
    ),
    "psum_scatter": (
        lambda t: ft.psum_scatter(t.reshape(N, -1).cos(), "i").prod(),
        lambda x: x.reshape(N, N, -1).cos().sum(0).prod(1),
    ),
    "all_to_all": (
        lambda t: (
            (ft.all_to_all(t.reshape(N, -1), "i", 0, 1) * torch.arange(2.0)[:, None]).exp().sum()
        ),
        lambda x: (
            (x.reshape(N, N, -1).transpose(0, 1).transpose(1, 2) * torch.arange(2.0)[:, None])
            .exp()
            .sum((1, 2))
        ),
    ),
    "ppermute": (
        lambda t: (ft.ppermute(t, "i", [(0, 1), (1, 3), (3, 0)]) * t.tanh()).sum(),
        lambda x: (x[[3, 0, 2, 1]] * torch.tensor([1.0, 1, 0, 1]).unsqueeze(1) * x.tanh()).sum(1),
    ),
    "axis_index": (
        lambda t: (t * ft.axis_index("i") + ft.psum(t, "i")).pow(2).sum(),
        lambda x: (x * torch.arange(N).unsqueeze(1) + x.sum(0)).pow(2).sum(1),
    ),
}


@pytest.mark.parametrize("name", sorted(DIFF_CASES))
def test_grad_through_vmap_equals_explicit_reductions(name):
    f, ref = DIFF_CASES[name]
    x = rand(N, 2 * N)
    ours = ft.grad(lambda xs: ft.vmap(f, axis_name="i")(xs).sum())(x)
    torch.testing.assert_close(ours, tf.grad(lambda xs: ref(xs).sum())(x))


@pytest.mark.parametrize("name", sorted(DIFF_CASES))
def test_jvp_through_vmap_equals_explicit_reductions(name):
    f, ref = DIFF_CASES[name]
    x, t = rand(N, 2 * N), rand(N, 2 * N)
    ours = ft.jvp(ft.vmap(f, axis_name="i"), (x,), (t,))
    torch.testing.assert_close(ours, tf.jvp(ref, (x,), (t,)))


@pytest.mark.parametrize("name", sorted(DIFF_CASES))
def test_grad_inside_vmap_is_the_transpose(name):
    # JAX's semantics: vmap(grad(f)) with collectives transposed (psum <-> psum, ...) is the
    # gradient of the summed batched function: every example seeds its own output with 1
    f, _ = DIFF_CASES[name]
    x = rand(N, 2 * N)
    inside = ft.vmap(ft.grad(f), axis_name="i")(x)
    outside = ft.grad(lambda xs: ft.vmap(f, axis_name="i")(xs).sum())(x)
    torch.testing.assert_close(inside, outside)


@pytest.mark.parametrize("name", sorted(DIFF_CASES))
def test_jvp_inside_vmap(name):
    f, _ = DIFF_CASES[name]
    x, t = rand(N, 2 * N), rand(N, 2 * N)
    inside = ft.vmap(lambda a, b: ft.jvp(f, (a,), (b,)), axis_name="i")(x, t)
    outside = ft.jvp(ft.vmap(f, axis_name="i"), (x,), (t,))
    torch.testing.assert_close(inside, outside)


@pytest.mark.parametrize("name", sorted(DIFF_CASES))
def test_finite_differences(name):
    f, _ = DIFF_CASES[name]
    check_grads(ft.vmap(f, axis_name="i"), (rand(N, 2 * N),), order=2, modes=("fwd", "rev"))


def test_hessian_and_second_order_inside_vmap():
    x = rand(N, 3)
    ours = ft.hessian(lambda xs: ft.vmap(normalise, axis_name="i")(xs).sum())(x)
    torch.testing.assert_close(ours, tf.hessian(lambda xs: normalise_ref(xs).sum())(x))
    # inside the vmap, jacfwd seeds every example with the same basis tangent and jacrev every
    # example with the same basis cotangent: the full [N, 3, N, 3] Jacobian summed over the
    # examples that are seeded
    per_example_grads = ft.vmap(ft.grad(normalise), axis_name="i")
    full = ft.jacfwd(per_example_grads)(x)
    torch.testing.assert_close(full, ft.jacrev(per_example_grads)(x))
    fwd = ft.vmap(ft.jacfwd(ft.grad(normalise)), axis_name="i")(x)
    torch.testing.assert_close(fwd, full.sum(2))
    rev = ft.vmap(ft.jacrev(ft.grad(normalise)), axis_name="i")(x)
    torch.testing.assert_close(rev, full.sum(0).permute(1, 0, 2))


def test_pmax_ties_share_the_derivative():
    x = torch.tensor([[1.0], [3.0], [3.0], [0.0]], dtype=torch.float64)
    g = ft.grad(lambda xs: ft.vmap(lambda t: ft.pmax(t, "i").sum(), axis_name="i")(xs).sum())(x)
    torch.testing.assert_close(g, torch.tensor([[0.0], [2.0], [2.0], [0.0]], dtype=torch.float64))


def test_complex_psum_and_all_gather():
    z = rand(N, 3, dtype=torch.complex128)
    f = lambda t: (ft.all_gather(t, "i") * ft.psum(t, "i").conj()).abs().sum()  # noqa: E731
    ref = lambda x: (x * x.sum(0).conj()).abs().sum().expand(N)  # noqa: E731
    torch.testing.assert_close(ft.vmap(f, axis_name="i")(z), ref(z))
    got = ft.grad(lambda zs: ft.vmap(f, axis_name="i")(zs).sum())(z)
    torch.testing.assert_close(got, tf.grad(lambda zs: ref(zs).sum())(z))


def test_dp_sgd_per_sample_clipping_with_pmean():
    # the data-parallel per-sample-gradient pattern: vmap(grad) then a clipped mean over the batch
    torch.manual_seed(0)
    w = rand(3, 2)
    xs, ys = rand(8, 3), rand(8, 2)

    def loss(w, x, y):
        return ((x @ w - y) ** 2).sum()

    def clipped_mean(w, x, y):
        g = ft.grad(loss)(w, x, y)
        g = g / torch.clamp(g.norm() / 1.0, min=1.0)
        return ft.pmean(g, "batch")

    ours = ft.vmap(clipped_mean, in_dims=(None, 0, 0), axis_name="batch")(w, xs, ys)
    per = tf.vmap(tf.grad(loss), in_dims=(None, 0, 0))(w, xs, ys)
    norms = per.flatten(1).norm(dim=1).clamp(min=1.0)
    ref = (per / norms[:, None, None]).mean(0)
    torch.testing.assert_close(ours, ref.expand(8, 3, 2))


def test_under_torch_autograd():
    w = rand(3).requires_grad_()
    x = rand(N, 3)
    out = ft.vmap(lambda t: (t * w - ft.pmean(t * w, "i")).pow(2).sum(), axis_name="i")(x)
    (g,) = torch.autograd.grad(out.sum(), w)
    w2 = w.detach().requires_grad_()
    ref = ((x * w2 - (x * w2).mean(0)).pow(2).sum(1)).sum()
    (g2,) = torch.autograd.grad(ref, w2)
    torch.testing.assert_close(g, g2)


@given(st.integers(1, 5), st.integers(0, 2), st.booleans())
def test_all_gather_property(n, axis, tiled):
    x = rand(n, 2, 3)
    gather = ft.vmap(lambda t: ft.all_gather(t, "i", axis=axis, tiled=tiled), axis_name="i")
    if tiled and axis == 2:  # tiled gathers along an existing dim: a 2-d example has no dim 2
        with pytest.raises(ValueError, match="out of range"):
            gather(x)
        return
    out = gather(x)
    stacked = x.movedim(0, axis)
    ref = stacked.flatten(axis, axis + 1) if tiled else stacked
    torch.testing.assert_close(out, ref.unsqueeze(0).expand((n,) + ref.shape))


def test_meta_tensors():
    x = torch.empty(N, 3, device="meta")
    out = ft.vmap(lambda t: t - ft.pmean(t, "i") + ft.all_gather(t, "i").sum(0), axis_name="i")(x)
    assert out.shape == (N, 3) and out.device.type == "meta"


# -- errors ------------------------------------------------------------------------------------
def test_unbound_axis_names_it():
    with pytest.raises(UnboundAxisError, match="unbound axis name 'j'"):
        ft.psum(rand(3), "j")
    with pytest.raises(NameError, match=r"axes bound here are \['i'\]"):
        ft.vmap(lambda t: ft.pmean(t, "j"), axis_name="i")(rand(N))


def test_a_tuple_of_names_is_several_names_even_when_a_vmap_is_named_by_it():
    """A tuple passed to a collective names several axes (``_bindings``), also on the inline
    path of Note [A reduction at its own level], where the top vmap's name is compared: a vmap
    named by the tuple itself does not bind it."""
    x = rand(N)
    ft.vmap(lambda t: ft.psum(t, "i"), axis_name="i")(x)  # the inline path is loaded
    f = ft.vmap(lambda t: ft.psum(t, ("a", "b")), axis_name=("a", "b"))
    with pytest.raises(UnboundAxisError, match="unbound axis name 'a'"):
        f(x)


def test_chunk_size_refuses_collectives():
    with pytest.raises(ValueError, match="chunk_size"):
        ft.vmap(lambda t: ft.psum(t, "i"), axis_name="i", chunk_size=2)(rand(N))
    out = ft.vmap(lambda t: t.sin(), axis_name="i", chunk_size=2)(rand(N))  # no collective: fine
    assert out.shape == (N,)


def test_bad_arguments():
    x = rand(N, 3)
    with pytest.raises(ValueError, match="permutation"):
        ft.vmap(lambda t: ft.ppermute(t, "i", [(0, 1), (2, 1)]), axis_name="i")(x)
    with pytest.raises(ValueError, match="out of range"):
        ft.vmap(lambda t: ft.ppermute(t, "i", [(0, N)]), axis_name="i")(x)
    with pytest.raises(ValueError, match="axis size"):
        ft.vmap(lambda t: ft.all_to_all(t, "i", 0, 0), axis_name="i")(x)
    with pytest.raises(ValueError, match="axis_size=3"):
        ft.vmap(lambda t: t, axis_size=3)(x)
    with pytest.raises(TypeError, match="hashable"):
        ft.vmap(lambda t: t, axis_name=["i"])


def test_ppermute_and_all_to_all_over_two_axes():
    # the two axes act as one of 6 examples, "a" major (Note [Collectives over several axes])
    x = rand(2, 3, 4)
    perm = [(i, (i + 1) % 6) for i in range(6)]

    def nested(f):
        return ft.vmap(ft.vmap(f, axis_name="b"), axis_name="a")

    out = nested(lambda t: ft.ppermute(t, ("a", "b"), perm))(x)
    torch.testing.assert_close(out.reshape(6, 4), x.reshape(6, 4).roll(1, 0))
    y = rand(2, 3, 6)
    out = nested(lambda t: ft.all_to_all(t, ("a", "b"), 0, 0))(y)
    torch.testing.assert_close(out.reshape(6, 6), y.reshape(6, 6).T)

    def loss(y):
        return nested(lambda t: (ft.all_to_all(t, ("a", "b"), 0, 0).sin() * t).sum())(y).sum()

    ref = tf.grad(lambda y: (y.reshape(6, 6).T.sin() * y.reshape(6, 6)).sum())(y)
    torch.testing.assert_close(ft.grad(loss)(y), ref)

    def partial(x):
        return nested(lambda t: (ft.ppermute(t, ("a", "b"), perm[:3]) * t.cos()).sum())(x).sum()

    def partial_ref(x):
        f = x.reshape(6, 4)
        moved = torch.stack(
            [f[i - 1] if i in (1, 2, 3) else torch.zeros_like(f[0]) for i in range(6)]
        )
        return (moved * f.cos()).sum()

    torch.testing.assert_close(ft.grad(partial)(x), tf.grad(partial_ref)(x))
