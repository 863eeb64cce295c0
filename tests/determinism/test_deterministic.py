"""functransforms.deterministic: audit, check_deterministic, deterministic mode, the CUDA table."""

from __future__ import annotations

import inspect
import os
import re

import pytest
import torch

import functransforms as ft
from functransforms._compat import TORCH_VERSION
from functransforms.deterministic import _table
from functransforms.testing import assert_deterministic

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
det = ft.deterministic


@pytest.fixture
def two_threads():
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(prev)


def _line_of(marker, fn):
    src, start = inspect.getsourcelines(fn)
    for i, line in enumerate(src):
        if marker in line:
            return start + i
    raise AssertionError(marker)


# -- audit ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_audit_finds_index_backward_under_grad_at_the_forward_line(device):
    idx = torch.tensor([0, 2, 2, 1], device=device)

    def loss(x):
        y = x[idx]  # FORWARD
        return (y * y).sum()

    x = torch.randn(5, dtype=torch.float64, device=device)
    report = det.audit(ft.grad(loss), x)
    hits = [f for f in report.findings if "index_put" in str(f.op)]
    if device == "cpu":  # accumulating index_put is nondeterministic on CPU only
        assert len(hits) == 1
        f = hits[0]
        assert f.transform == "grad"
        assert f.location.lineno == _line_of("# FORWARD", loss)
        assert f.location.filename == __file__
        assert "x[idx]" in f.location.line
        assert f.device == "cpu" and "index_put" in f.reason
        assert "use_deterministic_algorithms" in f.alternative
        assert "grad" in str(report) and "FORWARD" in str(report)
    else:
        assert hits == []


@pytest.mark.parametrize("device", DEVICES)
def test_audit_vmap_of_grad_names_grad_and_the_forward_line(device):
    idx = torch.tensor([0, 2, 2], device=device)

    def loss(x):
        return x[idx].pow(2).sum()  # FORWARD

    xs = torch.randn(3, 4, dtype=torch.float64, device=device)
    report = det.audit(ft.vmap(ft.grad(loss)), xs)
    hits = [f for f in report.findings if "index_put" in str(f.op)]
    assert len(hits) == (1 if device == "cpu" else 0)
    if hits:
        assert hits[0].transform == "grad"
        assert hits[0].location.lineno == _line_of("# FORWARD", loss)


@pytest.mark.parametrize("device", DEVICES)
def test_audit_flags_cuda_only_op_while_running_on_cpu(device):
    idx = torch.tensor([0, 1, 1], device=device)

    def f(x, src):
        return x.index_add(0, idx, src)  # USER

    report = det.audit(f, torch.zeros(3, device=device), torch.ones(3, device=device))
    assert len(report.findings) == 1
    (finding,) = report.findings
    assert finding.op is torch.ops.aten.index_add.default
    assert finding.transform is None  # the user called it
    assert finding.location.lineno == _line_of("# USER", f)
    assert finding.device.startswith(device)
    if device == "cpu":
        assert finding.reason.startswith("nondeterministic on CUDA")
    assert "atomicAdd" in finding.reason


def test_audit_scatter_add_backward_of_gather_under_vmap_is_cuda_only():
    idx = torch.tensor([[0, 0], [1, 0]])

    def loss(x):
        return torch.gather(x, 1, idx).sum()  # GATHER

    report = det.audit(ft.vmap(ft.grad(loss)), torch.randn(3, 2, 2, dtype=torch.float64))
    (finding,) = [f for f in report.findings if "scatter_add" in str(f.op)]
    assert finding.transform == "grad"
    assert finding.reason.startswith("nondeterministic on CUDA")
    assert finding.location.lineno == _line_of("# GATHER", loss)


def test_audit_nn_module_and_context_manager():
    emb = torch.nn.Embedding(10, 3).double()
    idx = torch.tensor([1, 1, 4])
    params = dict(emb.named_parameters())

    def loss(p):
        return ft.functional_call(emb, p, (idx,)).sum()  # MODULE

    with det.audit() as report:
        ft.grad(loss)(params)
    found = [f for f in report.findings if f.transform == "grad"]
    assert found, str(report)
    assert all(f.location.lineno == _line_of("# MODULE", loss) for f in found)
    assert all(f.reason.startswith("nondeterministic on CUDA") for f in found)  # index_add


def test_audit_empty_report_says_so():
    report = det.audit(lambda x: (x.sin() * 2).sum(), torch.randn(4))
    assert report.findings == []
    assert not report
    assert "no nondeterministic op" in str(report)


def test_audit_jvp_tangent_of_index_put_accumulate():
    idx = torch.tensor([0, 0, 1])

    def f(x, v):
        return torch.ops.aten.index_put.default(x, [idx], v, True)  # USER

    x, v = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    report = det.audit(lambda a, b: ft.jvp(f, (a, b), (a, b)), x, v)
    by = {r.transform for r in report.findings}
    assert by == {None, "jvp"}  # the primal is the user's op, the tangent is jvp's
    assert all(r.location.lineno == _line_of("# USER", f) for r in report.findings)


def test_audit_argument_errors():
    with pytest.raises(TypeError, match="expected a callable"):
        det.audit(3)
    with pytest.raises(TypeError, match="no function"):
        det.audit(None, torch.ones(1))


# -- the table against torch's own list -----------------------------------------------------------


def _documented_by_torch():
    doc = torch.use_deterministic_algorithms.__doc__
    return set(re.findall(r"^\s*\* :(?:class|func):`([\w.]+)`", doc, re.M))


def _python_alerts_in_torch():
    root = os.path.dirname(torch.__file__)
    names = set()
    for rel in ("_meta_registrations.py", os.path.join("_decomp", "decompositions.py")):
        with open(os.path.join(root, rel)) as fh:
            for m in re.finditer(r'alert_not_deterministic\(f?"([^"]+)"\)', fh.read()):
                name = m.group(1)
                for d in ("2", "3"):
                    names.add(name.replace("{dim}", d))
    return names


def test_table_covers_torch_documented_list():
    torch_names = _documented_by_torch()
    assert len(torch_names) > 30  # the docstring was parsed
    missing = torch_names - _table.documented_names()
    assert not missing, f"torch {torch.__version__} documents entries the table lacks: {missing}"


def test_table_covers_torch_alert_names():
    alerts = _python_alerts_in_torch()
    assert alerts
    ours = _table.alert_names()
    missing = {a for a in alerts if not any(a == o or a.startswith(o) for o in ours)}
    assert not missing, f"torch alerts the table lacks: {missing}"


def test_table_ops_exist_in_installed_torch():
    for e in _table.ENTRIES:
        assert any(_table._resolve(n) is not None for n in e.ops), e.ops


def test_table_conditions():
    aten = torch.ops.aten
    x, i, v = torch.zeros(4), torch.tensor([0, 0]), torch.ones(2)
    (put_acc,) = [e for e in _table.entries_for(aten.put_.default) if e.device == "cpu"]
    assert put_acc.condition((x, i, v, True), {}) and not put_acc.condition((x, i, v), {})
    (sr_sum, sr_prod) = [
        e for e in _table.entries_for(aten.scatter_reduce.two) if e.device == "cuda"
    ]
    assert sr_sum.condition((x, 0, i, v, "sum"), {}) and not sr_sum.condition(
        (x, 0, i, v, "amax"), {}
    )
    assert sr_prod.raises and sr_prod.condition((x, 0, i, v, "prod"), {})
    (copy,) = _table.entries_for(aten.index_copy.default)
    assert copy.condition((x, 0, i, v), {}) and not copy.condition(
        (x, 0, torch.tensor([0, 1]), v), {}
    )
    bad = [e for e in _table.entries_for(aten.index_put.default) if e.device == "any"][0]
    assert bad.condition((x, [i], v), {}) and not bad.condition((x, [torch.tensor([0, 1])], v), {})
    (cum,) = _table.entries_for(aten.cumsum.default)
    assert cum.condition((x, 0), {}) and not cum.condition((i, 0), {})
    # torch 2.15 gave CUDA cumsum a deterministic kernel and documents raising MPS kernels
    assert cum.raises == (TORCH_VERSION < (2, 15))
    mps = [e for e in _table.entries_for(aten.index_put.default) if e.device == "mps"]
    assert len(mps) == (TORCH_VERSION >= (2, 15))
    if mps:
        assert mps[0].condition((x, [i], v, True), {}) and not mps[0].condition((x, [i], v), {})


# -- check_deterministic --------------------------------------------------------------------------


_noisy_calls = [0]


@torch.library.custom_op("ftdet_test::noisy", mutates_args=())
def _noisy(x: torch.Tensor) -> torch.Tensor:
    _noisy_calls[0] += 1
    return x + _noisy_calls[0] * 1e-3


@_noisy.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.mark.parametrize("device", DEVICES)
def test_check_localises_a_custom_op_that_differs_per_call(device):
    def f(x):
        a = x.sin()  # op 0
        b = a * 2  # op 1
        c = torch.ops.ftdet_test.noisy(b)  # NOISY op 2
        return c.exp().sum()

    x = torch.randn(6, dtype=torch.float64, device=device)
    report = det.check_deterministic(f, x, runs=3)
    assert not report.identical
    d = report.first_divergence
    assert d.op is torch.ops.ftdet_test.noisy.default
    assert d.position == 2
    assert d.location.lineno == _line_of("# NOISY", f)
    assert d.inputs_differed is False
    assert d.max_abs_diff == pytest.approx(1e-3, rel=1e-6)
    assert d.max_ulp_diff > 0
    assert "noisy" in str(report) and "born here" in str(report)
    with pytest.raises(AssertionError, match="noisy"):
        assert_deterministic(f, x)


def test_check_localises_the_custom_op_under_vmap():
    def f(r):
        return torch.ops.ftdet_test.noisy(r * 2)  # NOISY (vmap runs it per example)

    with pytest.warns(Warning):
        report = det.check_deterministic(ft.vmap(f), torch.ones(2, 3))
    d = report.first_divergence
    assert d.op is torch.ops.ftdet_test.noisy.default
    assert d.location.lineno == _line_of("# NOISY", f)


@pytest.mark.parametrize("device", DEVICES)
def test_check_pure_function_is_identical(device):
    W = torch.randn(4, 4, dtype=torch.float64, device=device)

    def loss(w, x):
        return torch.tanh(x @ w).sum()

    xs = torch.randn(5, 4, dtype=torch.float64, device=device)
    report = det.check_deterministic(ft.vmap(ft.grad(loss), in_dims=(None, 0)), W, xs)
    assert report.identical and report.first_divergence is None
    assert "bitwise identical over 3 runs" in str(report)
    assert_deterministic(ft.vmap(ft.grad(loss), in_dims=(None, 0)), W, xs)


def test_check_resets_rng_and_never_mutates_inputs():
    x = torch.ones(3)

    def f(x):
        x.add_(1)  # in place on our copy
        return x * torch.randn(3)

    report = det.check_deterministic(f, x, runs=4)
    assert report.identical, str(report)
    assert torch.equal(x, torch.ones(3))


def test_check_reports_inputs_that_differed():
    state = torch.zeros(3)

    def step(x):
        state.add_(x)  # STATE mutated across runs: not the function's input
        return state.sum()

    report = det.check_deterministic(step, torch.ones(3))
    d = report.first_divergence
    assert d.op is torch.ops.aten.add_.Tensor and d.position == 0
    assert d.inputs_differed is True
    assert d.location.lineno == _line_of("# STATE", step)
    assert "already differed" in str(report)


def test_check_different_op_sequence():
    calls = [0]

    def f(x):
        calls[0] += 1
        return x.sin() if calls[0] == 1 else x.cos()  # BRANCH

    d = det.check_deterministic(f, torch.ones(2)).first_divergence
    assert d.position == 0 and d.max_abs_diff == float("inf")


def test_check_argument_errors():
    with pytest.raises(ValueError, match="runs >= 2"):
        det.check_deterministic(lambda x: x, torch.ones(1), runs=1)
    with pytest.raises(TypeError, match="callable"):
        det.check_deterministic(torch.ones(1))


# -- the index backward: found, then stable under the mode ---------------------------------------


def _index_loss_problem():
    g = torch.Generator().manual_seed(0)
    S, N = 64_000, 1_000_000
    idx = torch.randint(0, S, (N,), generator=g)
    w = torch.randn(N, generator=g)
    x = torch.randn(S, 3, generator=g)

    def loss(x):
        y = x[idx]  # INDEX
        return (y.sum(1) * w).sum()

    return loss, x


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 threads to race")
def test_index_backward_found_by_check_and_stable_under_the_mode(two_threads):
    loss, x = _index_loss_problem()
    report = det.check_deterministic(ft.grad(loss), x, runs=6)
    assert not report.identical, "expected the CPU accumulating index_put to race"
    d = report.first_divergence
    assert d.op is torch.ops.aten.index_put.default
    assert d.transform == "grad" and d.inputs_differed is False
    assert d.location.lineno == _line_of("# INDEX", loss)
    with det.enabled():
        assert det.check_deterministic(ft.grad(loss), x, runs=6).identical
        assert det.check_deterministic(
            ft.vmap(ft.grad(loss)), x[None].expand(2, -1, -1), runs=3
        ).identical
    torch.use_deterministic_algorithms(True)
    try:
        assert det.check_deterministic(ft.grad(loss), x, runs=4).identical
    finally:
        torch.use_deterministic_algorithms(False)


# -- deterministic mode: same values as torch.func ------------------------------------------------


def _cases():
    idx = torch.tensor([0, 2, 2, 1, 0])
    gidx = torch.tensor([[0, 0, 1], [2, 2, 2]])
    return {
        "index": lambda x: x[idx].sin().sum(),
        "index_2d": lambda x: x[idx[:3], idx[2:]].pow(2).sum(),
        "index_select": lambda x: x.index_select(0, idx).cos().sum(),
        "gather": lambda x: torch.gather(x, 1, gmod(gidx, x)).pow(3).sum(),
        "topk": lambda x: x.topk(2, dim=-1).values.sum(),
        "embedding": lambda x: torch.nn.functional.embedding(idx, x).tanh().sum(),
        "index_put_acc": lambda x: (
            torch.zeros(4, 3, dtype=x.dtype)
            .index_put((idx[:3],), x[:3], accumulate=True)
            .pow(2)
            .sum()
        ),
    }


def gmod(i, x):
    return i % x.shape[1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(_cases()))
def test_mode_matches_torch_func(name, device):
    f = _cases()[name]
    x = torch.randn(4, 3, dtype=torch.float64)
    want = torch.func.grad(f)(x)
    want_v = torch.func.vmap(torch.func.grad(f))(torch.stack([x, 2 * x]))
    want_h = torch.func.hessian(f)(x)
    for ctx in (det.enabled(), det.enabled(level="threads")):
        with ctx:
            torch.testing.assert_close(ft.grad(f)(x), want)
            torch.testing.assert_close(ft.vmap(ft.grad(f))(torch.stack([x, 2 * x])), want_v)
            torch.testing.assert_close(ft.hessian(f)(x), want_h)
            assert det.is_enabled()
    assert not det.is_enabled()


def test_mode_audit_is_clean_on_cpu():
    idx = torch.tensor([0, 2, 2])
    with det.enabled():
        report = det.audit(ft.vmap(ft.grad(lambda x: x[idx].sum())), torch.randn(2, 4))
    assert not [f for f in report.findings if f.device == "cpu" and "CUDA" not in f.reason]


def test_enable_disable_and_bad_level():
    det.enable()
    try:
        assert det.is_enabled()
    finally:
        det.disable()
    assert not det.is_enabled()
    with pytest.raises(ValueError, match="level='threads'"):
        with det.enabled(level="thread"):
            pass


def test_deterministic_vmap_of_user_index_put_accumulate():
    idx = torch.tensor([0, 0, 1])
    vals = torch.randn(2, 3, dtype=torch.float64)

    def f(v):
        return torch.zeros(2, dtype=v.dtype).index_put((idx,), v, accumulate=True)

    with det.enabled():
        got = ft.vmap(f)(vals)
    torch.testing.assert_close(got, torch.func.vmap(f)(vals))


# -- level="threads" ------------------------------------------------------------------------------


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 threads")
def test_thread_dependence_of_a_large_sum_is_found_and_removed(two_threads):
    x = torch.randn(4_000_000, generator=torch.Generator().manual_seed(0))

    def f(x):
        return x.sum()  # SUM

    report = det.check_deterministic(f, x, vary_threads=True)
    assert not report.identical and report.thread_dependent
    d = report.first_divergence
    assert d.op is torch.ops.aten.sum.default and d.threads == (2, 1)
    assert d.location.lineno == _line_of("# SUM", f)
    with det.enabled(level="threads"):
        report = det.check_deterministic(f, x, vary_threads=True)
        assert report.identical, str(report)
        got = f(x)
    torch.testing.assert_close(got.double(), x.double().sum(), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.mean(),
        lambda x: torch.dot(x, x.flip(0)),
        lambda x: torch.linalg.vector_norm(x),
        lambda x: torch.linalg.vector_norm(x, ord=1),
        lambda x: x.reshape(1000, -1).sum(dim=(0, 1)),
        lambda x: x.nansum(),
    ],
)
def test_threads_level_reductions_independent_of_thread_count(fn):
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(1))
    prev = torch.get_num_threads()
    outs = []
    try:
        with det.enabled(level="threads"):
            for n in (1, 2):
                torch.set_num_threads(n)
                outs.append(fn(x))
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0].double(), fn(x.double()), rtol=1e-5, atol=1e-5)


def test_threads_level_under_grad():
    x = torch.randn(100_000, dtype=torch.float64)
    with det.enabled(level="threads"):
        g = ft.grad(lambda x: (x * x).sum())(x)
    torch.testing.assert_close(g, 2 * x)


@pytest.mark.parametrize("name", ["__init__", "_audit", "_check"])
def test_docstring_examples_run(name):
    import doctest
    import importlib

    mod = importlib.import_module(
        "functransforms.deterministic" + ("" if name == "__init__" else "." + name)
    )
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0
