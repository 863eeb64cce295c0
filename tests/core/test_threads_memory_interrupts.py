"""The transforms as a resource of long-running programs (threads, memory, exceptions, depth).
docs/design/levels-and-routing.md, "Threads, memory, exceptions, depth".

functorch keeps its interpreter stack per thread, frees a call's intermediates when it returns
and leaves no state behind an exception: so must we. Thread tests use fixed seeds and compare
every result with the single-threaded one; ``sys.setswitchinterval`` is lowered while threads
run so that they interleave inside the library (the default 5 ms lets most calls finish
uninterrupted).
"""

import contextlib
import gc
import os
import subprocess
import sys
import textwrap
import threading
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.func as tf

import functransforms as ft
from functransforms import _compat
from functransforms._core import levels as _core

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _x(seed, n=4, d=3):
    return torch.randn(n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def _interleaved():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _run_threads(n, fn):
    with _interleaved(), ThreadPoolExecutor(n) as ex:
        return list(ex.map(fn, range(n)))


# --- 1. threads ------------------------------------------------------------------------------

_FRESH = textwrap.dedent(
    """
    import sys, threading, traceback, warnings
    warnings.simplefilter("ignore")
    import torch
    import functransforms as ft
    import torch.func as tf
    sys.setswitchinterval(1e-6)
    N = 8
    barrier = threading.Barrier(N)
    def f(x): return (x.sin() * x.cos()).sum() + torch.logsumexp(x.flatten(), 0)
    def g(x): return torch.tanh(x @ x.T).sum()
    def h(x): return (x.exp() / (1 + x**2)).sum()
    def x_of(i): return torch.randn(5, 3, dtype=torch.float64,
                                    generator=torch.Generator().manual_seed(i))
    def case(F, i, x):
        k = i % 8
        if k == 0: return F.vmap(F.grad(f))(x)
        if k == 1: return F.hessian(h)(x[0])
        if k == 2: return F.jvp(g, (x,), (torch.ones_like(x),))[1]
        if k == 3: return F.vmap(F.vmap(torch.sin))(x)
        if k == 4: return F.jacfwd(lambda y: torch.cumsum(y, 0).cos())(x[0])
        if k == 5: return ft.jit(ft.grad(g))(x) if F is ft else F.grad(g)(x)
        if k == 6:
            if F is tf: return torch.zeros(())
            try:  # the randomness guard's kernels, registered by the first such vmap
                ft.vmap(lambda r: r + torch.randn(()), randomness="error")(x)
            except RuntimeError:
                return torch.zeros(())
            return torch.ones(())
        return F.functionalize(lambda y: y.clone().add_(1).mul_(2))(x)
    errors, results = [], {}
    def job(i):
        x = x_of(i)
        barrier.wait()
        try:
            results[i] = case(ft, i, x)
        except BaseException:
            errors.append(traceback.format_exc())
    threads = [threading.Thread(target=job, args=(i,)) for i in range(N)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors[0]
    for i, r in results.items():
        torch.testing.assert_close(r, case(tf, i, x_of(i)), msg=f"thread {i}")
    import gc
    assert gc.isenabled()
    print("OK", len(results))
    """
)


def test_first_calls_of_eight_threads_in_a_fresh_process():
    # crash: the one-time setup raced (Note [One-time setup under one lock], _core/gcpause.py): a
    # rule record published before its rules were filled ("has a vjp rule in a family that
    # _core/rule_index.py does not name"), the randomness guard's fallback registered twice,
    # torch's pytree registrations copied twice ("already registered")
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run(
        [sys.executable, "-c", _FRESH], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK 8" in out.stdout


@ft.custom_vjp
def _clip_grad(x):
    return x * 1.0


_clip_grad.defvjp(lambda x: (x * 1.0, None), lambda res, g: (g.clamp(-0.1, 0.1),))


def _f(x):
    return (x.sin() * x.cos()).sum() + torch.logsumexp(x.flatten(), 0)


def _g(x):
    return torch.tanh(x @ x.T).sum()


def _h(x):
    return (x.exp() / (1 + x**2)).sum()


_jitted = ft.jit(ft.grad(_g))


def _draws(x, seed):
    gen = torch.Generator().manual_seed(seed)
    return ft.vmap(
        lambda r: r + torch.randn(r.shape, generator=gen, dtype=r.dtype), randomness="different"
    )(x)


_CASES = [
    lambda x: ft.vmap(ft.grad(_f))(x),
    lambda x: ft.hessian(_h)(x[0]),
    lambda x: ft.jvp(_g, (x,), (torch.ones_like(x),))[1],
    lambda x: ft.vmap(ft.vmap(torch.sin))(x),
    lambda x: ft.jacrev(lambda y: torch.cumsum(y, 0).cos())(x[0]),
    lambda x: _jitted(x),
    lambda x: ft.grad(lambda y: (_clip_grad(y) ** 3).sum())(x),
    lambda x: ft.grad(lambda y: ft.checkpoint(lambda z: z.sin().exp())(y).sum())(x),
    lambda x: _draws(x, 7),  # a generator per call: the same draws in every thread
    lambda x: ft.vmap(ft.jacrev(_h))(x),
    lambda x: ft.vjp(_g, x)[1](torch.tensor(1.0, dtype=x.dtype))[0],
    lambda x: ft.linearize(_h, x)[1](torch.ones_like(x)),
    lambda x: ft.vmap(ft.vmap(ft.grad(lambda s: s.sin() * s)))(x),
]


def test_threads_agree_with_one_thread():
    shapes = [(3 + s, 3) for s in range(3)]
    ref = {(k, s): c(_x(s, *shapes[s])) for k, c in enumerate(_CASES) for s in range(3)}

    def work(t):
        wrong = []
        for it in range(len(_CASES)):
            k, s = (t * 5 + it) % len(_CASES), (t + it) % 3
            r = _CASES[k](_x(s, *shapes[s]))
            if not torch.allclose(r, ref[k, s]):
                wrong.append((k, s))
        return wrong

    assert _run_threads(4, work) == [[]] * 4


def test_first_traces_of_a_jitted_function_from_threads():
    # crash: torch's tracer keeps its patcher in a module global ("CURRENT_PATCHER is None in
    # finally block" when two threads traced at once: Note [One trace at a time], _jit/_trace.py);
    # and
    # a signature evicted by another thread between the cache read and move_to_end (KeyError)
    for _ in range(2):
        jitted = ft.jit(ft.grad(_g), cache_size=2)
        barrier = threading.Barrier(4)

        def work(t, jitted=jitted, barrier=barrier):
            barrier.wait()
            bad = 0
            for it in range(3):
                x = _x(0, 2 + (t + it) % 4)
                bad += not torch.allclose(jitted(x), tf.grad(_g)(x))
            return bad

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert _run_threads(4, work) == [0] * 4


class _DoubleInPlace(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.mul_(2)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_dirty(inputs[0])

    @staticmethod
    def backward(ctx, g):
        return 2 * g


class _Square(torch.autograd.Function):
    entered = None  # set: a call is in flight; then waits for the other thread
    resume = None

    @staticmethod
    def forward(x):
        _Square.entered.set()
        assert _Square.resume.wait(30)
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        return 2 * ctx.saved_tensors[0] * g


def test_mark_dirty_functions_in_flight_on_two_threads():
    # SILENT: the calls' dirty lists were one global stack. Thread A's Function call is in
    # flight when thread B's mark_dirty call pushes its list and records its dirty input; A
    # finishes first and pops B's list: it wrote its output into its own input (x^3 became
    # x^4) and B lost its record (the dirtied input kept its old history: 6x instead of 8x).
    x = _x(1)
    _Square.entered, _Square.resume = threading.Event(), threading.Event()
    b_recorded = threading.Event()

    def a():  # y^3 through a Function that dirties nothing: 3x^2
        def f(z):
            y = z.clone()
            return (y * _Square.apply(y)).sum()

        try:
            return ft.grad(f)(x)
        finally:
            b_recorded.set()  # let B go on, whatever happened

    def stop_after_recording(frame, event, arg):
        # B's forward step returns after it recorded the dirty input, before its call pops
        if frame.f_code.co_name == "fwd" and "_autograd_function" in frame.f_code.co_filename:

            def at_return(frame, event, arg):
                if event == "return":
                    _Square.resume.set()  # A's call finishes now
                    assert b_recorded.wait(30)
                return at_return

            return at_return
        return None

    def b():  # (2y)^2 through a Function that dirties its input: 8x
        assert _Square.entered.wait(30)
        sys.settrace(stop_after_recording)
        try:
            return ft.grad(_uses_dirty_input)(x)
        finally:
            sys.settrace(None)

    def _uses_dirty_input(z):
        y = z.clone()
        return (y * _DoubleInPlace.apply(y)).sum()

    with ThreadPoolExecutor(2) as ex:
        ga, gb = ex.submit(a), ex.submit(b)
        ga, gb = ga.result(), gb.result()
    torch.testing.assert_close(ga, 3 * x**2)
    torch.testing.assert_close(gb, 8 * x)


def test_closures_of_one_thread_called_in_another():
    x = _x(2)
    f = lambda y: (y.sin() * y.exp()).sum(0)  # noqa: E731

    def make(F):
        return F.vjp(f, x)[1], F.linearize(f, x)[1]

    def use(F, fns):
        vjp_fn, jvp_fn = fns
        eye = torch.eye(3, dtype=torch.float64)
        return vjp_fn(eye[0])[0], jvp_fn(torch.ones_like(x)), F.vmap(vjp_fn)(eye)[0]

    with ThreadPoolExecutor(1) as a, ThreadPoolExecutor(1) as b:
        for F in (ft, tf):
            fns = a.submit(make, F).result()
            got = b.submit(use, F, fns).result()
            if F is ft:
                ours = got
    for o, t in zip(ours, got):
        torch.testing.assert_close(o, t)


def test_one_pullback_called_from_threads_at_once():
    # a vjp_fn and a linearize jvp_fn run again and again (the tape is kept): concurrent calls
    # must not share any per-sweep state
    x = _x(3, 5, 4)
    f = lambda y: (y.sin() @ y.T).tanh().cumsum(0) * y.sum()  # noqa: E731
    _, vjp_fn = ft.vjp(f, x)
    _, jvp_fn = ft.linearize(f, x)
    cts = [_x(10 + i, 5, 5) for i in range(6)]
    tangents = [_x(20 + i, 5, 4) for i in range(6)]
    _, tf_vjp = tf.vjp(f, x)
    ref = [tf_vjp(c)[0] for c in cts]
    ref_t = [tf.jvp(f, (x,), (t,))[1] for t in tangents]
    barrier = threading.Barrier(6, timeout=30)

    def work(i):
        barrier.wait()
        bad = 0
        for _ in range(5):
            bad += not torch.allclose(vjp_fn(cts[i])[0], ref[i])
            bad += not torch.allclose(jvp_fn(tangents[i]), ref_t[i])
            bad += not torch.allclose(
                ft.vmap(vjp_fn)(torch.stack(cts[:3]))[0], torch.stack(ref[:3])
            )
        return bad

    assert _run_threads(6, work) == [0] * 6


def test_levels_of_other_threads_stay_out_of_the_stack():
    # each thread sees only its own interpreters while others are inside transforms
    seen = []
    barrier = threading.Barrier(3, timeout=30)

    def f(y):
        barrier.wait()  # all three threads inside their transform
        seen.append(len(ft._core.levels.interpreter_stack()))
        barrier.wait()
        return y.sin().sum()

    out = _run_threads(3, lambda t: ft.vmap(ft.grad(f))(_x(t)))
    assert seen == [2, 2, 2]
    for t, g in enumerate(out):
        torch.testing.assert_close(g, _x(t).cos())


# --- 2. memory -------------------------------------------------------------------------------


@ft.custom_vjp
def _scaled(x):
    return x * 1.0


_scaled.defvjp(lambda x: (x * 1.0, x), lambda res, g: (g * res,))
_jit_step = ft.jit(ft.grad(_g))


def _kronecker_solve(x):
    import functransforms.linalg as fl

    A = x[:2, :2] @ x[:2, :2].T + torch.eye(2, dtype=x.dtype)
    B = x[2:, 1:] @ x[2:, 1:].T + torch.eye(2, dtype=x.dtype)
    return torch.linalg.solve(fl.KroneckerOperator(A, B), torch.ones(4, dtype=x.dtype)).sum()


_MEMORY_CASES = {
    # leak: a custom function made per structured solve closed over itself (linalg/_implicit.py)
    "structured solve": lambda x: ft.grad(_kronecker_solve)(x),
    "grad": lambda x: ft.grad(_f)(x),
    "vmap(grad)": lambda x: ft.vmap(ft.grad(_f))(x),
    "vjp": lambda x: ft.vjp(_g, x)[1](torch.tensor(1.0, dtype=x.dtype)),
    "vjp dropped": lambda x: ft.vjp(_g, x),
    "jvp": lambda x: ft.jvp(_g, (x,), (x,)),
    "jacrev": lambda x: ft.jacrev(_f)(x),
    "hessian": lambda x: ft.hessian(_f)(x[0]),
    "linearize": lambda x: ft.linearize(_f, x),
    "grad(grad)": lambda x: ft.grad(lambda y: ft.grad(lambda z: z.sin().sum())(y).sum())(x),
    "vmap different": lambda x: ft.vmap(lambda r: r * torch.rand(()), randomness="different")(x),
    "jit": lambda x: _jit_step(x),
    "custom_vjp": lambda x: ft.grad(lambda y: _scaled(y).pow(2).sum())(x),
    "checkpoint": lambda x: ft.grad(lambda y: ft.checkpoint(lambda z: z.sin().exp())(y).sum())(x),
}


@pytest.mark.parametrize("name", list(_MEMORY_CASES))
def test_a_call_leaves_no_reference_cycle(name):
    # with the collector disabled (as a training loop may run), a cycle would keep every
    # intermediate of the call alive; functorch's own calls leave some (its grad ~57 objects)
    # that we must not add to
    call = _MEMORY_CASES[name]
    x = _x(3)
    for _ in range(2):
        call(x)  # one-time setup (rule records, jit's trace) is not what is measured
    gc.disable()
    gc.freeze()  # what exists now is not counted (and collecting is not a scan of torch's heap)
    try:
        del_me = call(x)
        del del_me
        found = gc.collect()
    finally:
        gc.unfreeze()
        gc.enable()
    assert found == 0


def test_intermediates_die_when_the_call_returns():
    # a weakref to a big intermediate (the wrapper and what it holds) is dead as soon as grad,
    # vmap(grad) or vjp returns, the collector disabled
    refs = []

    def f(y):
        big = y.exp() * torch.ones(256, 1, 1, dtype=y.dtype)
        refs.append(weakref.ref(big))
        return big.sum()

    x = _x(4)
    gc.disable()
    try:
        ft.grad(f)(x)
        ft.vmap(ft.grad(f))(x)
        out, vjp_fn = ft.vjp(f, x)
        vjp_fn(torch.ones((), dtype=x.dtype))
        del vjp_fn, out  # the pullback's residuals go with it
        assert [r() for r in refs] == [None] * 3
    finally:
        gc.enable()


# --- 3. exceptions ---------------------------------------------------------------------------


def _library_state():
    return (
        len(_core.interpreter_stack()),
        _compat.len_torch_dispatch_stack(),
        _compat.len_torch_function_stack(),
        torch.is_grad_enabled(),
        _compat.dispatch_tls_local_include_set().raw_repr(),
        _compat.dispatch_tls_local_exclude_set().raw_repr(),
        gc.isenabled(),
    )


class _Stop(BaseException):
    pass


_WRAPS = {
    "grad": lambda f: ft.grad(lambda y: f(y).sum()),
    "vmap": lambda f: ft.vmap(f),
    "jvp": lambda f: lambda y: ft.jvp(f, (y,), (y,)),
    "jacrev": lambda f: ft.jacrev(f),
    "jit": lambda f: ft.jit(f),
    "vmap error": lambda f: ft.vmap(f, randomness="error"),
    "vmap different": lambda f: ft.vmap(f, randomness="different"),
    "functionalize": lambda f: ft.functionalize(f),
    "checkpoint": lambda f: lambda y: ft.checkpoint(f)(y),
}


@pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt, GeneratorExit, _Stop])
@pytest.mark.parametrize(
    "nest",
    [("grad",), ("vmap", "grad"), ("jvp", "vmap"), ("jit", "vmap error", "grad")]
    + [("jacrev", "functionalize"), ("vmap different", "checkpoint", "jvp")],
)
def test_state_is_clean_after_f_raises(nest, exc):
    def f(y):
        y.sin().exp()
        raise exc("from f")

    for name in reversed(nest):
        f = _WRAPS[name](f)
    before = _library_state()
    with pytest.raises(exc, match="from f"):
        f(_x(5)[0])
    assert _library_state() == before
    torch.testing.assert_close(ft.vmap(ft.grad(lambda y: y.sin().sum()))(_x(5)), _x(5).cos())


@ft.custom_vjp
def _bwd_raises(x):
    return x * 1.0


def _raising_bwd(res, g):
    raise KeyboardInterrupt("from bwd")


_bwd_raises.defvjp(lambda x: (x * 1.0, None), _raising_bwd)


@pytest.mark.parametrize("call", ["grad", "vmap(grad)", "jacrev", "vjp_fn"])
def test_state_is_clean_after_a_backward_raises(call):
    x = _x(6)
    before = _library_state()
    with pytest.raises(KeyboardInterrupt):
        if call == "grad":
            ft.grad(lambda y: _bwd_raises(y).sum())(x)
        elif call == "vmap(grad)":
            ft.vmap(ft.grad(lambda y: _bwd_raises(y).sum()))(x)
        elif call == "jacrev":
            ft.jacrev(_bwd_raises)(x)
        else:
            ft.vjp(_bwd_raises, x)[1](torch.ones_like(x))
    assert _library_state() == before


class _RunsTransformWhenCollected:
    results: list = []
    # drawn here, not in __del__: a collection inside vmap would make the draw a random op of
    # that vmap, refused under randomness='error' (by torch.func too)
    y = _x(7)[0]
    expected = tf.grad(lambda z: (z.sin() * z.exp()).sum())(y)

    def __init__(self):
        self.me = self  # a cycle: freed by the collector, at any allocation

    def __del__(self):
        y = self.y
        r = ft.vmap(ft.grad(lambda z: (z.sin() * z.exp()).sum()))(y.unsqueeze(0))[0]
        self.results.append(torch.allclose(r, self.expected))


def test_transforms_run_from_finalizers_inside_transforms():
    # a collection can run at any allocation inside a transform: a finalizer's own transforms
    # nest on the stack, and both results are right
    def f(z):
        for _ in range(3):
            _RunsTransformWhenCollected()
        return (z.tanh() ** 2).sum()

    x = _x(8)
    expected = tf.vmap(tf.grad(f))(x)
    expected_jac = tf.jacrev(tf.grad(f))(x[0])  # outside the loop: ours refuse inside torch.func
    gc.collect()
    _RunsTransformWhenCollected.results = []
    old = gc.get_threshold()
    gc.set_threshold(5, 1, 1)
    try:
        for _ in range(5):
            torch.testing.assert_close(ft.vmap(ft.grad(f))(x), expected)
            torch.testing.assert_close(ft.jacrev(ft.grad(f))(x[0]), expected_jac)
    finally:
        gc.set_threshold(*old)
        gc.collect()
    assert _RunsTransformWhenCollected.results
    assert all(_RunsTransformWhenCollected.results)

    obj = type("Collected", (), {})()
    got = []
    weakref_ = weakref.ref(obj, lambda _: got.append(ft.grad(lambda z: z.sin().sum())(x)))

    def drops(z):
        nonlocal obj
        obj = None  # the callback runs inside this transform
        return z.cos().sum()

    torch.testing.assert_close(ft.vmap(ft.grad(drops))(x), -x.sin())
    assert weakref_() is None
    torch.testing.assert_close(got[0], x.cos())


def test_generator_driven_functions():
    x = _x(9)

    def coroutine():
        y = yield
        while True:
            y = yield (y.sin() * 2).sum()

    for F in (ft, tf):
        c = coroutine()
        next(c)
        a = F.grad(lambda y, c=c: c.send(y))(x)
        b = F.vmap(F.grad(lambda y, c=c: c.send(y)))(x)
        c.close()

        def results(F=F):
            for k in range(5):
                yield F.vmap(F.grad(lambda y, k=k: (y.exp() * k).sum()))(x)

        it = results()
        first = next(it)
        it.close()  # GeneratorExit at the yield, between two transforms
        torch.testing.assert_close(a, 2 * x.cos())
        torch.testing.assert_close(b, 2 * x.cos())
        torch.testing.assert_close(first, 0 * x)
    assert not _core.interpreter_stack()


# --- 4. depth and size -----------------------------------------------------------------------


def test_deep_nesting():
    h = torch.sin
    for _ in range(6):
        h = ft.grad(h)
    x0 = torch.tensor(0.7, dtype=torch.float64)
    torch.testing.assert_close(h(x0), -torch.sin(x0))  # sin'''''' = -sin
    v = torch.sin
    for _ in range(8):
        v = ft.vmap(v)
    x8 = torch.randn(*([2] * 8), dtype=torch.float64)
    torch.testing.assert_close(v(x8), x8.sin())
    v = torch.exp
    for _ in range(24):
        v = ft.vmap(v)
    x24 = torch.randn(*([1] * 24), 2, dtype=torch.float64)
    torch.testing.assert_close(v(x24), x24.exp())


def test_big_and_deep_pytrees():
    d = {f"p{i}": torch.full((2,), i / 1e4, dtype=torch.float64) for i in range(10_000)}
    g = ft.grad(lambda p: sum(v.sin().sum() for v in p.values()))(d)
    assert len(g) == 10_000
    torch.testing.assert_close(g["p7"], d["p7"].cos())
    small = dict(list(d.items())[-2000:])
    doubled = ft.vmap(lambda p: {k: v * 2 for k, v in p.items()})(small)
    torch.testing.assert_close(doubled["p9999"], 2 * d["p9999"])
    nested = torch.tensor(0.5, dtype=torch.float64)
    for _ in range(500):  # functorch: RecursionError in its pytree code
        nested = [nested]

    def innermost(p):
        while isinstance(p, list):
            p = p[0]
        return p.sin()

    g = ft.grad(innermost)(nested)
    for _ in range(500):
        g = g[0]
    torch.testing.assert_close(g, torch.tensor(0.5, dtype=torch.float64).cos())


def test_a_long_tape():
    def chain(y):
        for _ in range(10_000):
            y = y * 1.0001
        return y.sum()

    x = torch.ones(3, dtype=torch.float64)
    torch.testing.assert_close(ft.grad(chain)(x), torch.full_like(x, 1.0001**10_000))


def test_a_retraced_jit_keeps_no_source_of_dropped_graphs():
    # leak: torch.fx keeps the source of every graph it compiles (two per trace), so a
    # signature evicted and traced again grew the process ~8 KB a time (Note [Sources of
    # dropped graphs], _jit/_trace.py); now they go with the graph
    step = ft.jit(ft.grad(_g), cache_size=2)
    mark = _compat.fx_source_mark()
    for i in range(12):
        torch.testing.assert_close(step(_x(0, 2 + i % 6)), tf.grad(_g)(_x(0, 2 + i % 6)))
    gc.collect()
    assert len(_compat.fx_sources_since(mark)) <= 2 * 2  # the two live graphs' only
    step.cache_clear()
    gc.collect()
    assert _compat.fx_sources_since(mark) == []


def test_process_groups_registered_from_threads_keep_their_keys():
    # SILENT: two threads' new groups could take the same key (pmap's collectives of one
    # thread ran on the other's group)
    from functransforms.distributed import _collective_ops

    groups = [object() for _ in range(8)]
    barrier = threading.Barrier(8, timeout=30)

    def register(t):
        barrier.wait()
        return _collective_ops.group_key(groups[t])

    keys = _run_threads(8, register)
    assert [_collective_ops.GROUPS[k] for k in keys] == groups
    for k in keys:
        del _collective_ops.GROUPS[k]


def test_deterministic_enable_and_disable_stay_on_their_thread():
    # crash: enable(level="threads") kept its mode in a global list, so another thread's
    # disable() popped it from its own (empty) mode stack, "trying to pop from empty mode
    # stack", and the first thread's mode could never be turned off
    enabled, done = threading.Event(), threading.Event()
    seen = {}

    def a():
        ft.deterministic.enable("threads")
        seen["a on"] = _compat.len_torch_dispatch_stack()
        enabled.set()
        assert done.wait(30)
        seen["a still on"] = (_compat.len_torch_dispatch_stack(), ft.deterministic.is_enabled())
        ft.deterministic.disable()
        seen["a off"] = _compat.len_torch_dispatch_stack()

    def b():
        assert enabled.wait(30)
        try:
            ft.deterministic.disable()  # enabled nothing on this thread
            seen["b"] = _compat.len_torch_dispatch_stack()
        finally:
            done.set()

    with ThreadPoolExecutor(2) as ex:
        for f in [ex.submit(a), ex.submit(b)]:
            f.result()
    assert seen == {"a on": 1, "b": 0, "a still on": (1, True), "a off": 0}


def _interrupt_once(monkeypatch, owner, name):
    """``owner.name`` raises KeyboardInterrupt at its first call (as a Ctrl-C landing there)."""
    original = getattr(owner, name)
    fired = []

    def interrupted(*args, **kwargs):
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)


@pytest.mark.parametrize("where", ["grad level", "different randomness", "jvp level exit"])
def test_an_interrupt_while_entering_or_leaving_a_level_leaves_no_state(monkeypatch, where):
    # a KeyboardInterrupt inside an __enter__ after it pushed the level (or a mode) left it
    # pushed for good, and one inside an inner level's __exit__ before it popped made the
    # outer exit fail "interpreter stack corrupted" (Note [Entering is all or nothing])
    from functransforms.autodiff import forward
    from functransforms.batching import random as batching_random

    x = _x(11)
    if where == "grad level":
        _interrupt_once(monkeypatch, _compat, "set_grad_enabled")
        call = lambda: ft.grad(lambda y: y.sin().sum())(x)  # noqa: E731
    elif where == "different randomness":
        _interrupt_once(monkeypatch, batching_random._DifferentDropoutInputs, "__enter__")
        call = lambda: ft.vmap(lambda r: r * torch.rand(()), randomness="different")(x)  # noqa: E731
    else:
        _interrupt_once(monkeypatch, forward.JvpInterpreter, "__exit__")
        call = lambda: ft.vmap(lambda r: ft.jvp(torch.sin, (r,), (r,))[1])(x)  # noqa: E731
    before = _library_state()
    with pytest.raises(KeyboardInterrupt):
        call()
    assert _library_state() == before
    call()  # and the next call works
    torch.testing.assert_close(ft.vmap(ft.grad(lambda y: y.sin().sum()))(x), x.cos())
