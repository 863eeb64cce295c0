"""Replay guards of ``jit``: programs whose replay would silently differ from running them
eagerly (Note [Replay guards], functransforms/_jit/_guards.py). Every test runs the jitted
function over several calls with changed inputs or state and compares with eager: values,
dtypes, shapes, strides, aliasing, requires_grad/grad_fn and side effects."""

import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn as nn

import functransforms as ft
from functransforms.errors import JitFallbackWarning

D = torch.float64


def _same(got, want):
    """Values, dtype, shape, strides and autograd flags agree (pytrees of tensors or values)."""
    g_leaves = torch.utils._pytree.tree_leaves(got)
    w_leaves = torch.utils._pytree.tree_leaves(want)
    assert len(g_leaves) == len(w_leaves)
    for g, w in zip(g_leaves, w_leaves):
        if isinstance(w, torch.Tensor):
            assert type(g) is type(w)
            torch.testing.assert_close(g, w, equal_nan=True)
            assert g.stride() == w.stride()
            assert (g.requires_grad, g.is_leaf) == (w.requires_grad, w.is_leaf)
        else:
            assert type(g) is type(w) and (g == w or g != g and w != w), (g, w)


@contextlib.contextmanager
def _no_fallback():
    with warnings.catch_warnings():
        warnings.simplefilter("error", JitFallbackWarning)
        yield


# -- module state: training flags, rebound parameters, attributes rebound in forward ---------


def test_module_train_eval_flip_is_a_new_entry_not_a_stale_graph():
    # Bug: the graph of train mode (dropout draws, batch statistics, running-stat updates)
    # replayed after model.eval().
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.3), nn.Linear(4, 2))
    m = m.double()
    ref = copy.deepcopy(m)
    jm = ft.jit(m)
    x = torch.randn(6, 3, dtype=D)
    for mode in (True, False, True, False):
        m.train(mode)
        ref.train(mode)
        torch.manual_seed(1)
        got = jm(x)
        torch.manual_seed(1)
        _same(got, ref(x))
        _same(m[1].running_mean, ref[1].running_mean)
    assert m[1].num_batches_tracked.item() == ref[1].num_batches_tracked.item() == 2
    assert jm.cache_info()[:3] == (2, 2, 0)  # one graph per mode, then replays


def test_training_flag_of_a_functional_call_module_guards_the_entry():
    m = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5)).double()
    p = {k: v.detach() for k, v in m.named_parameters()}

    def f(p, x):
        return ft.functional_call(m, p, (x,))

    jf = ft.jit(ft.vmap(f, in_dims=(None, 0), randomness="different"))
    ef = ft.vmap(f, in_dims=(None, 0), randomness="different")
    x = torch.randn(5, 3, dtype=D)
    for mode in (True, False, True):
        m.train(mode)
        torch.manual_seed(2)
        got = jf(p, x)
        torch.manual_seed(2)
        _same(got, ef(p, x))
    assert jf.cache_info().misses == 2


def test_rebound_parameter_retraces():
    # Bug: the graph held the old Parameter object after `lin.weight = nn.Parameter(...)`.
    lin = nn.Linear(3, 2).double()
    jl = ft.jit(lin)
    x = torch.randn(4, 3, dtype=D)
    _same(jl(x), lin(x))
    for _ in range(2):
        lin.weight = nn.Parameter(torch.randn(2, 3, dtype=D))
        _same(jl(x), lin(x))
    lin.register_buffer("scale", torch.ones(2, dtype=D))
    jl2 = ft.jit(lambda x: lin(x) * lin.scale)
    _same(jl2(x), lin(x) * lin.scale)
    lin.scale = torch.full((2,), 3.0, dtype=D)  # a rebound buffer of a module that ran
    _same(jl2(x), lin(x) * lin.scale)


def test_module_rebinding_a_tensor_attribute_in_forward_falls_back():
    # Bug: `self.avg = ...` in forward was not repeated by the replay (avg stayed stale).
    class EMA(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("avg", torch.zeros(3, dtype=D))

        def forward(self, x):
            self.avg = 0.9 * self.avg + 0.1 * x
            return x - self.avg

    a, b = EMA(), EMA()
    ja = ft.jit(a)
    with pytest.warns(JitFallbackWarning, match=r"rebinds its tensor attributes \['avg'\]"):
        ja(torch.ones(3, dtype=D))
    b(torch.ones(3, dtype=D))
    for k in range(3):
        x = torch.full((3,), float(k), dtype=D)
        _same(ja(x), b(x))
    _same(a.avg, b.avg)


def test_in_place_buffer_updates_replay_without_a_guard():
    # The supported form of the EMA: an in-place update is an op of the graph.
    class EMA(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("avg", torch.zeros(3, dtype=D))

        def forward(self, x):
            self.avg.mul_(0.9).add_(0.1 * x)
            return x - self.avg

    a, b = EMA(), EMA()
    ja = ft.jit(a)
    with _no_fallback():
        for k in range(3):
            x = torch.full((3,), float(k), dtype=D)
            _same(ja(x), b(x))
    _same(a.avg, b.avg)
    assert ja.cache_info().hits == 2


# -- reads outside the dispatcher ---------------------------------------------------------------


@pytest.mark.parametrize(
    "f",
    [
        lambda x: torch.tensor([x[0], x[1]]),
        lambda x: torch.as_tensor([x[0], x[1]]),
        lambda x: torch.asarray([[x[0]], [x[2]]]),
        lambda x: x.new_tensor([x[0]]),
    ],
    ids=["tensor", "as_tensor", "asarray", "new_tensor"],
)
def test_tensor_built_from_a_list_of_traced_elements_falls_back(f):
    # Bug: the values were copied on the host while tracing and replayed as a constant.
    jf = ft.jit(f)
    x1 = torch.tensor([0.3, -1.2, 2.5], dtype=D)
    with pytest.warns(JitFallbackWarning, match="torch.stack"):
        _same(jf(x1), f(x1))
    x2 = torch.tensor([-0.8, 0.1, 1.9], dtype=D)
    _same(jf(x2), f(x2))


def test_literal_tensors_and_tensor_of_a_tensor_still_replay():
    f = lambda x: x * torch.tensor([1.0, 2.0, 3.0], dtype=D) + torch.tensor(x)  # noqa: E731
    jf = ft.jit(f)
    with _no_fallback(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's advice on torch.tensor(tensor)
        for x in (torch.randn(3, dtype=D), torch.randn(3, dtype=D)):
            _same(jf(x), f(x))
    assert jf.cache_info().hits == 1


@pytest.mark.parametrize(
    "f",
    [lambda x: (x * 2, str(x)), lambda x: (x * 2, repr(x.sum())), lambda x: (print(x), x * 2)],
    ids=["str", "repr", "print"],
)
def test_printing_a_tensor_falls_back(f, capsys):
    # Bug: the string of the first call's values was returned by every replay.
    jf = ft.jit(f)
    x1, x2 = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    with pytest.warns(JitFallbackWarning, match="print"):
        _same(jf(x1), f(x1))
    _same(jf(x2), f(x2))
    out = capsys.readouterr().out
    if "print" in str(f.__code__.co_names):
        assert out.count("tensor([3., 4.])") == 2  # printed by jit's call too


# -- autograd metadata --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "f, needle",
    [
        (lambda x: (x * 2).detach().requires_grad_(), "requires_grad_"),
        (lambda x: setattr(y := (x * 2).detach(), "requires_grad", True) or y, "requires_grad ="),
        (lambda x: (x * 2).detach_() * x, "detach_"),
        (lambda x: (y := x * 2, y.retain_grad(), y)[2], "retain_grad"),
        (lambda x: (y := x * 2, y.register_hook(lambda g: g * 10), y * 1)[2], "hook"),
    ],
    ids=["requires_grad_", "set-requires_grad", "detach_", "retain_grad", "hook"],
)
def test_autograd_metadata_changed_inside_f_falls_back(f, needle):
    # Bug: the replay kept none of these (a gradient flowed through detach_(), a hook was
    # not applied, requires_grad_ was lost), silently changing gradients.
    jf = ft.jit(f)
    x = torch.randn(3, dtype=D, requires_grad=True)
    with pytest.warns(JitFallbackWarning, match=needle):
        jf(x)
    for _ in range(2):
        got, want = jf(x), f(x)
        _same(got, want)
        if want.requires_grad:
            (got * x).sum().backward()
            g, x.grad = x.grad, None
            (want * x).sum().backward()
            _same(g, x.grad)
            x.grad = None
            assert got.retains_grad == want.retains_grad


def test_reading_grad_or_running_backward_inside_f_falls_back():
    # Bug: `.grad` was captured as a constant (a stale gradient after the next backward), and
    # a backward inside f did not accumulate into `.grad` on replay.
    w = torch.ones(3, dtype=D, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_()

    def sgd(w):
        with torch.no_grad():
            w.sub_(0.1 * w.grad)

    jstep = ft.jit(lambda: sgd(w))
    with pytest.warns(JitFallbackWarning, match=r"\.grad"):
        for k in range(3):
            for p in (w, w_ref):
                p.grad = None
                (p**2 * (k + 1)).sum().backward()
            jstep()
            sgd(w_ref)
    _same(w.detach(), w_ref.detach())

    v = torch.ones(2, dtype=D, requires_grad=True)
    jb = ft.jit(lambda x: (v * x).sum().backward())
    with pytest.warns(JitFallbackWarning, match="backward"):
        jb(torch.ones(2, dtype=D))
    jb(torch.full((2,), 2.0, dtype=D))
    _same(v.grad, torch.full((2,), 3.0, dtype=D))


def test_parameter_made_from_a_traced_value_falls_back():
    # Bug: make_fx recorded nn.Parameter(x * 2) as a constant: every replay returned the first
    # call's Parameter object.
    f = lambda x: nn.Parameter(x * 2)  # noqa: E731
    jf = ft.jit(f)
    x1, x2 = torch.tensor([1.0, 2.0]), torch.tensor([5.0, 6.0])
    with pytest.warns(JitFallbackWarning, match="Parameter"):
        first = jf(x1)
    second = jf(x2)
    _same(second, f(x2))
    assert second is not first


def test_requires_grad_and_grad_fn_of_replayed_outputs_match_eager():
    W = torch.randn(3, 3, dtype=D, requires_grad=True)
    fs = [
        lambda x: torch.tanh(W @ x),
        lambda x: x.detach() * 2,
        lambda x: (W @ x).detach(),
        lambda x: x,
        lambda x: x[1:],
        lambda x: (x * 2, x.data * 3),
    ]
    for f in fs:
        jf = ft.jit(f)
        for rg in (False, True, False):
            x = torch.randn(3, dtype=D, requires_grad=rg)
            with _no_fallback():
                for _ in range(2):
                    _same(jf(x), f(x))


# -- signatures ---------------------------------------------------------------------------------


def test_dict_key_order_on_the_general_signature_path():
    # Bug: optree's spec sorts keys, so {1: a, 2: b} and {2: b, 1: a} shared a graph traced
    # for the first order (and f saw sorted dicts while tracing).
    f = lambda d: list(d.values())[0] * 2  # noqa: E731
    a, b = torch.randn(2, dtype=D), torch.randn(2, dtype=D)
    jf = ft.jit(f)
    for d in ({1: a, 2: b}, {2: b, 1: a}, {1: a, 2: b}):
        _same(jf(d), f(d))
    g = lambda ds: [{k: v * 2 for k, v in d.items()} for d in ds]  # noqa: E731
    jg = ft.jit(g)
    for ds in ([{"x": a, "y": b}], [{"y": b, "x": a}]):
        got = jg(ds)
        assert list(got[0]) == list(ds[0])  # the caller's key order
        _same(got, g(ds))
    assert jg.cache_info().misses == 2


def test_storage_offset_and_view_reads_guard_the_entry():
    # Bug: a storage offset read while tracing was baked into the graph; the signature leaves
    # offsets out (slices of one buffer at other offsets share a graph).
    buf = torch.arange(8, dtype=D)
    f = lambda x: x.as_strided((2,), (1,), x.storage_offset() + 1)  # noqa: E731
    jf = ft.jit(f)
    for x in (buf[:4], buf[1:5], buf[2:6], buf[1:5]):
        _same(jf(x), f(x))
    assert jf.cache_info()[:2] == (1, 3)
    g = lambda x: x * 2 if x._base is None else x * 3  # noqa: E731
    jg = ft.jit(g)
    for x in (buf[:4].clone(), buf[:4], buf[4:].clone()):
        _same(jg(x), g(x))
    h = ft.jit(torch.sin)  # an f that does not read offsets: slices share one graph
    for i in range(4):
        _same(h(buf[i : i + 4]), torch.sin(buf[i : i + 4]))
    assert h.cache_info()[:2] == (3, 1)


# -- what already agreed, kept so -----------------------------------------------------------------


def test_aliasing_of_outputs_and_inputs_matches_eager():
    def two_views(x):
        y = x * 2
        return y, y[:2], y

    x = torch.randn(3, dtype=D)
    with _no_fallback():
        j_id, j_view, j_two = ft.jit(lambda x: x), ft.jit(lambda x: x[1:]), ft.jit(two_views)
        for _ in range(2):
            assert j_id(x) is x
            v = j_view(x)
            assert v._base is x and v.data_ptr() == x[1:].data_ptr()
            a, b, c = j_two(x)
            assert a is c and b.data_ptr() == a.data_ptr()


def test_in_place_updates_of_arguments_and_captured_tensors_replay():
    buf = torch.zeros(3, dtype=D)

    def f(x, y):
        x.add_(1)
        x[0].mul_(2)
        buf.add_(y)
        return x, buf * 1

    jf = ft.jit(f)
    x, xr = torch.zeros(3, dtype=D), torch.zeros(3, dtype=D)
    y = torch.ones(3, dtype=D)
    with _no_fallback():
        for _ in range(3):
            got = jf(x, y)
            assert got[0] is x
    buf_j = buf.clone()
    buf.zero_()
    for _ in range(3):
        f(xr, y)
    _same(x, xr)
    _same(buf_j, buf)


def test_optimizer_steps_between_replays_match_eager():
    torch.manual_seed(0)
    lin = nn.Linear(3, 1).double()
    ref = copy.deepcopy(lin)
    opt = torch.optim.Adam(lin.parameters(), lr=0.1)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=0.1)
    jl = ft.jit(lambda x: lin(x).pow(2).sum())
    x = torch.randn(4, 3, dtype=D)
    with _no_fallback():
        for _ in range(4):
            for o in (opt, opt_ref):
                o.zero_grad()
            loss = jl(x)
            loss.backward()
            opt.step()
            loss_ref = ref(x).pow(2).sum()
            loss_ref.backward()
            opt_ref.step()
            _same(loss.detach(), loss_ref.detach())
    _same(lin.weight.detach(), ref.weight.detach())


def test_detach_inside_f_stops_gradients_on_replay():
    # Bug (torch >= 2.15): make_fx without a decomposition table rewrites `detach` to nothing,
    # so torch autograd through a replay differentiated through `x.detach()` (2x, not x).
    f = lambda x: (x * x.detach()).sum()  # noqa: E731
    jf = ft.jit(f)
    x = torch.randn(3, dtype=D, requires_grad=True)
    with _no_fallback():
        for _ in range(2):
            (g,) = torch.autograd.grad(jf(x), x)
            _same(g, x.detach())
    assert torch.ops.aten.detach.default in [n.target for n in jf.graph(x).graph.nodes]


# -- random generators --------------------------------------------------------------------------


def _draws(f, jit_kwargs, calls, reset):
    jf = ft.jit(f, **jit_kwargs)
    x = torch.zeros(3, dtype=D)
    reset()
    got = [jf(x) for _ in range(calls)]
    state = torch.get_rng_state()
    reset()
    want = [f(x) for _ in range(calls)]
    for g, w in zip(got, want):
        _same(g, w)
    assert torch.equal(state, torch.get_rng_state())
    return jf


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(
    "f, needle",
    [
        (lambda x: (torch.manual_seed(0), x + torch.randn(3, dtype=D))[1], "manual_seed"),
        (lambda x: (x + torch.randn(3, dtype=D), torch.manual_seed(0))[0], "manual_seed"),
        (
            lambda x: (torch.randn(3), torch.random.set_rng_state(torch.get_rng_state())) and x + 1,
            "set_rng_state",
        ),
        (
            lambda x: ft.vmap(
                lambda r: r + torch.randn(3, dtype=D), randomness="same", chunk_size=2
            )(x.expand(4, 3)),
            "random generator",
        ),
    ],
    ids=["seed-then-draw", "draw-then-seed", "set_rng_state", "vmap-same-chunked"],
)
def test_setting_the_generator_state_inside_f_falls_back(f, needle, dynamic):
    # Bug: the replay drew on from the previous call's state where eager f re-seeded (the
    # first case right after the caller's own torch.manual_seed(0): no state shows it).
    with pytest.warns(JitFallbackWarning, match=needle):
        jf = _draws(f, {"dynamic": dynamic}, 3, lambda: torch.manual_seed(0))
    assert jf.cache_info().hits == 0


@pytest.mark.parametrize("dynamic", [False, True])
def test_generator_state_set_between_draws_falls_back_and_captured_ones_replay(dynamic):
    g = torch.Generator().manual_seed(0)

    def reset():
        torch.manual_seed(0)
        g.manual_seed(0)

    reseeds = lambda x: (torch.randn(3, generator=g), g.manual_seed(1))[0] + x  # noqa: E731
    with pytest.warns(JitFallbackWarning, match="random generator"):
        _draws(
            lambda x: reseeds(x) + torch.randn(3, generator=g, dtype=D),
            {"dynamic": dynamic},
            3,
            reset,
        )
    with _no_fallback():  # a captured generator is live in the graph: draws continue its stream
        jf = _draws(
            lambda x: x + torch.randn(3, generator=g, dtype=D), {"dynamic": dynamic}, 3, reset
        )
    assert jf.cache_info().hits == 2


def test_torch_autograd_backward_inside_f_falls_back():
    v = torch.ones(2, dtype=D, requires_grad=True)
    jb = ft.jit(lambda x: torch.autograd.backward((v * x).sum()))
    with pytest.warns(JitFallbackWarning, match="torch.autograd.backward"):
        jb(torch.ones(2, dtype=D))
    jb(torch.full((2,), 2.0, dtype=D))
    _same(v.grad, torch.full((2,), 3.0, dtype=D))


# -- backends and dynamic shapes -------------------------------------------------------------------


def _compiled_or_skip(fn):
    try:
        return fn()
    except Exception as e:  # no C++ compiler on the machine
        if "compiler" in str(e).lower() or "cpp" in str(e).lower():
            pytest.skip(f"inductor cannot compile here: {e}")
        raise


@pytest.mark.parametrize("backend", ["inductor", "callable"])
def test_first_call_of_a_compiled_backend_runs_side_effects_once(backend):
    # Bug: the first call returned a run of the compiled graph after the real trace had run f,
    # so in-place writes (BatchNorm's running stats, an argument's add_) and random draws
    # happened twice.
    if backend == "inductor":
        pytest.importorskip("torch._inductor")
    else:
        backend = lambda gm, tensors: gm  # noqa: E731 - replays the cleaned graph
    buf = torch.zeros(3, dtype=D)
    # inductor draws with its own generator (torch._inductor.config.fallback_random), as
    # under torch.compile: the random stream is compared on the replaying backend only
    draws = backend != "inductor"

    def f(x):
        buf.add_(x)
        x.mul_(2)
        return x + torch.rand(3, dtype=D) if draws else x * 1

    jf = ft.jit(f, backend=backend)
    x, xr = torch.ones(3, dtype=D), torch.ones(3, dtype=D)
    torch.manual_seed(0)
    got = _compiled_or_skip(lambda: [jf(x) for _ in range(3)])
    buf_j = buf.clone()
    buf.zero_()
    torch.manual_seed(0)
    want = [f(xr) for _ in range(3)]
    _same(got, want)
    _same(x, xr)
    _same(buf_j, buf)


@pytest.mark.parametrize("backend", [None, "inductor"])
def test_dynamic_shapes_with_captured_module_weights_replay(backend):
    # Spurious fallback: a symbolic trace refused real captured tensors (a module's weights),
    # so jit(model, dynamic=True) always ran eagerly.
    if backend is not None:
        pytest.importorskip("torch._inductor")
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    ref = copy.deepcopy(m)
    jm = ft.jit(m, dynamic=True, backend=backend)
    x = torch.randn(7, 3, dtype=D)
    with _no_fallback():
        for mode in (True, False, True):
            m.train(mode)
            ref.train(mode)
            for xb in (x, x[:5], x[:6]):
                _same(_compiled_or_skip(lambda xb=xb: jm(xb)), ref(xb))
            _same(m[1].running_mean, ref[1].running_mean)
    assert jm.cache_info().misses == 2  # one graph per training mode, every batch size
    with torch.no_grad():
        m[0].weight.mul_(2)  # captured weights stay live in a symbolic graph
        ref[0].weight.mul_(2)
    _same(jm(x[:4]), ref(x[:4]))


# -- the caller's context --------------------------------------------------------------------------


def test_graph_traced_under_autocast_is_not_replayed_outside_it():
    # Bug: autocast was not in the signature: a graph traced inside torch.autocast (its casts
    # are recorded ops) replayed in bfloat16 outside it.
    x = torch.randn(4, 4)
    f = lambda x: x @ x  # noqa: E731
    jf = ft.jit(f)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _same(jf(x), f(x))
        _same(jf(x), f(x))
    with torch.autocast("cpu", dtype=torch.float16):
        _same(jf(x), f(x))


def test_default_device_joins_the_signature_and_other_function_modes_run_f():
    # Bug: the device torch.set_default_device gives f's factories was not in the signature
    # (a replay made CPU tensors where eager made meta ones); a caller's TorchFunctionMode
    # never saw the replay's calls.
    f = lambda x: torch.ones(3) * 2 + x.sum()  # noqa: E731
    jf = ft.jit(f)
    x = torch.randn(3)
    _same(jf(x), f(x))
    torch.set_default_device("meta")
    try:
        assert jf(x.to("meta")).device.type == "meta"
        assert jf(x.to("meta")).device.type == "meta"
    finally:
        torch.set_default_device(None)
    _same(jf(x), f(x))
    assert jf.cache_info()[:3] == (2, 2, 0)

    seen = []

    class Log(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", func))
            return func(*args, **(kwargs or {}))

    with Log():
        _same(jf(x), f(x))
    assert seen.count("ones") == 2  # jit's call ran f, as eager did


def test_mutable_non_tensor_outputs_are_fresh_per_call():
    # Bug: a set/list-like leaf that f returns was the traced object itself in every replay,
    # so a caller's mutation of one call's result showed in the next call's.
    import numpy as np

    f = lambda x: (x * 2, {1, 2}, np.zeros(2), "s", torch.float64)  # noqa: E731
    jf = ft.jit(f)
    x = torch.randn(2, dtype=D)
    for _ in range(3):
        out = jf(x)
        want = f(x)
        _same(out[0], want[0])
        assert out[1] == want[1] and out[2].tolist() == want[2].tolist() and out[3:] == want[3:]
        out[1].add(3)
        out[2][0] = 5.0
    assert jf.cache_info().hits == 2


def test_module_passed_as_an_argument_is_guarded_and_named_on_one_line():
    m = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5)).double()
    jf = ft.jit(lambda m, x: m(x))
    x = torch.ones(3, 2, dtype=D)
    jf(m, x)
    m.eval()
    _same(jf(m, x), m(x))
    assert repr(ft.jit(m)) == "jit(<Sequential object>, backend=None, dynamic=False)"
