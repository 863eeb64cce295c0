"""Cold start (Note [Entering through registered rules], functransforms/_core/levels.py): the first
transform calls of a fresh process must not make torch import ``torch.distributed.tensor``
(and sympy), which its C++ subclass dispatch does for a wrapper op without a registered rule.
No timing here: the benchmark measures the time; this checks the mechanism."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import functransforms as ft

ROOT = Path(__file__).resolve().parents[2]
_REPORT = "print('torch.distributed.tensor' in sys.modules, 'sympy' in sys.modules)"


def _run(code):
    """The lines ``code`` prints in a fresh process (after ``import sys, torch``)."""
    return subprocess.run(
        [sys.executable, "-c", f"import sys, torch\n{code}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")


def _words(code):
    return " ".join(_run(code)).split()


def _fresh(code):
    return _words(f"{code}\n{_REPORT}")[-2:]


def _fresh_with_dynamo(code):
    """torch._dynamo, torch.distributed.tensor, sympy: in sys.modules after ``code``?"""
    return _words(f"{code}\nprint('torch._dynamo' in sys.modules)\n{_REPORT}")[-3:]


def test_first_transform_calls_do_not_import_distributed():
    code = (
        "import functransforms as ft\n"
        "f = lambda x: (x.sin() * x).sum()\n"
        "ft.grad(f)(torch.randn(3)); ft.vmap(ft.grad(f))(torch.randn(2, 3))\n"
        "ft.jvp(f, (torch.randn(3),), (torch.randn(3),)); ft.jacrev(torch.tanh)(torch.randn(3))"
    )
    assert _fresh(code) == ["False", "False"]


def test_a_plain_wrapper_subclass_does_import_it():
    # guards the test above: without registered rules, torch does import it (torch >= 2.10)
    code = (
        "class W(torch.Tensor):\n"
        "    @classmethod\n"
        "    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):\n"
        "        return func(args[0].v)\n"
        "w = torch.Tensor._make_wrapper_subclass(W, (3,)); w.v = torch.randn(3); torch.sin(w)"
    )
    if tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 10):
        assert _fresh(code)[0] == "True"


def test_registered_entry_is_the_class_dispatch():
    # the rule torch finds for a wrapper op is the class's own __torch_dispatch__: same code path
    from torch._library.simple_registry import find_torch_dispatch_rule

    from functransforms._core.levels import TransformTensor

    ft.grad(torch.sin)(torch.tensor(1.0))  # installs the rules
    for cls in TransformTensor.__subclasses__():
        rule = find_torch_dispatch_rule(torch.ops.aten.sin.default, cls)
        assert rule is cls.__torch_dispatch__.__func__


def test_import_leaves_the_rarely_used_parts_unloaded():
    # Note [Lazy parts of the package] (functransforms/__init__.py): import functransforms
    # loads no jit, process launching, determinism audit/checker/table, nor torch's module
    # that defines the linear_cross_entropy custom ops; each loads at first use
    lazy = (
        "functransforms._jit",
        "functransforms.distributed",
        "functransforms.deterministic._audit",
        "functransforms.deterministic._check",
        "functransforms.deterministic._table",
        "torch.nn.modules.linear_cross_entropy",
    )
    code = (
        "import functransforms as ft\n"
        f"print(*[m in sys.modules for m in {lazy!r}])\n"
        "d = ft.deterministic\n"
        "print(callable(ft.jit), ft.distributed.__name__, callable(d.audit), len(d.TABLE) > 0,\n"
        "      'jit' in dir(ft), 'audit' in dir(d))\n"
        "from functransforms import jit\n"
        "from functransforms.deterministic import check_deterministic, TABLE\n"
        "print(jit is ft.jit, TABLE is ft.deterministic.TABLE)"
    )
    out = _run(code)
    assert out[0].split() == ["False"] * len(lazy)
    assert out[1].split() == ["True", "functransforms.distributed", "True", "True", "True", "True"]
    assert out[2].split() == ["True", "True"]
    with pytest.raises(AttributeError, match="no attribute 'not_there'"):
        ft.not_there  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'not_there'"):
        ft.deterministic.not_there  # noqa: B018


def test_randomness_check_under_a_mode_needs_no_jit():
    # batching/random.py asks whether jit is tracing only if jit was loaded: under another
    # dispatch mode a draw counts as recorded, not drawn (as before), and jit stays unloaded
    code = (
        "import functransforms as ft\n"
        "from torch.utils._python_dispatch import TorchDispatchMode\n"
        "class M(TorchDispatchMode):\n"
        "    def __torch_dispatch__(self, func, types, args=(), kwargs=None):\n"
        "        return func(*args, **(kwargs or {}))\n"
        "try:\n"
        "    with M():\n"
        "        ft.vmap(lambda x: x + torch.rand(()), randomness='error')(torch.ones(2))\n"
        "    print('no error')\n"
        "except Exception as e:\n"
        "    print(type(e).__name__)\n"
        "print('functransforms._jit' in sys.modules)"
    )
    assert _words(code) == ["no", "error", "False"]


def test_ops_torch_defines_after_the_first_call_enter_through_registered_rules():
    # linear_cross_entropy's chunked ops are defined when F.linear_cross_entropy first runs,
    # after the first transform call registered the wrappers' rules: they were registered by
    # name, so their first call on a wrapper does not import torch.distributed.tensor either
    code = (
        "import functransforms as ft\n"
        "import torch.nn.functional as F\n"
        "ft.grad(lambda x: x.sin().sum())(torch.randn(3))\n"
        "opts = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=2)\n"
        "W = torch.randn(5, 3)\n"
        "f = lambda x, t: F.linear_cross_entropy(x, W, t, options=opts)\n"
        "ft.vmap(f)(torch.randn(3, 4, 3), torch.randint(0, 5, (3, 4)))"
    )
    assert _fresh(code) == ["False", "False"]


# -- Note [Rule families load on first use] (functransforms/_core/ops.py) ---------------------


def test_import_loads_no_rule_family_and_a_first_grad_only_its_own():
    # would fail if the import went back to registering every family eagerly
    code = (
        "from functransforms._core.rule_index_build import FAMILIES\n"
        "import functransforms as ft\n"
        "loaded = lambda: sorted(m for m in FAMILIES if 'functransforms.' + m in sys.modules)\n"
        "print(*loaded(), 'functransforms.batching' in sys.modules, sep=',')\n"
        "ft.grad(lambda x: x.sin().sum())(torch.randn(3))\n"
        "print(*loaded(), 'functransforms.batching' in sys.modules, sep=',')\n"
        "ft.vmap(ft.grad(lambda x: x.sin().sum()))(torch.randn(2, 3))\n"
        "print(*loaded(), sep=',')\n"
    )
    out = _run(code)
    assert out[0] == "False"  # no family, no vmap machinery
    assert out[1] == "autodiff.elementwise,autodiff.reductions,False"
    # autodiff.views: under vmap the seed is batched (Note [Seeds batched like the output]), so
    # sum's vjp expands a batched value and the expand op's record loads its family
    assert out[2] == "autodiff.elementwise,autodiff.reductions,autodiff.views,batching.reductions"


def test_rule_index_is_current():
    # the index names the family of every rule; a family changed without regenerating it fails
    from functransforms._core import rule_index as _rule_index
    from functransforms._core.rule_index_build import _OUT, FAMILIES, build

    assert tuple(_rule_index.FAMILIES) == FAMILIES
    assert build() == _OUT.read_text(), (
        "stale: run python -m functransforms._core.rule_index_build --write"
    )


_REGISTRY_DUMP = (
    "from functransforms._core import ops as _ops\n"
    "import functransforms.batching\n"
    "for slot, r in sorted(_ops._REGISTRIES.items()):\n"
    "    print(slot, sorted(str(op) for op in dict.keys(r)))\n"
)


def test_forced_loading_gives_the_eager_registry():
    # every module of batching/ and autodiff/ imported (as the packages used to) against the
    # lazy families all loaded: the same ops in every registry (a new family file missing from
    # FAMILIES would be in the first only)
    modules = sorted(
        f"functransforms.{pkg}.{p.stem}"
        for pkg in ("autodiff", "batching")
        for p in (ROOT / pkg).glob("*.py")
        if p.stem != "__init__"
    )
    eager = _run(
        f"import importlib, functransforms\nfor m in {modules!r}: importlib.import_module(m)\n"
        + _REGISTRY_DUMP
    )
    lazy = _run(
        "import functransforms.batching\nfrom functransforms._core.ops import load_all_families\n"
        "load_all_families()\n" + _REGISTRY_DUMP
    )
    assert lazy == eager


def test_lookups_find_the_rule_of_the_full_registry():
    # each op's rule through its record (which loads only its own families) is the rule the
    # registry holds once every family is loaded; the decomposition overrides likewise
    code = (
        "import functransforms.batching\n"
        "from functransforms._core import decomp as _decomp, ops as _ops\n"
        "from functransforms._core import rule_index as _rule_index\n"
        "found = {}\n"
        "for slot, table in _rule_index.INDEX.items():\n"
        "    for key in table:\n"
        "        name = key if '.' in key.partition('::')[2] else key + '.default'\n"
        "        op = _ops._defined_op(name)\n"
        "        if op is None:\n"
        "            continue  # another torch version's op, or defined on a lazy import\n"
        "        if slot == 'decomposition':\n"
        "            found[slot, op] = _decomp.decomposition(op)\n"
        "        else:\n"
        "            found[slot, op] = getattr(_ops.facts(op), slot)\n"
        "_ops.load_all_families()\n"
        "bad = [(s, str(op)) for (s, op), rule in found.items() if rule is not (\n"
        "    _decomp._OVERRIDES.get(op) if s == 'decomposition'\n"
        "    else _ops._REGISTRIES[s].lookup(op))]\n"
        "print(len(found), bad)\n"
    )
    n, bad = _run(code)[0].split(" ", 1)
    assert int(n) > 900 and bad == "[]"


def test_a_duplicate_of_a_lazily_loaded_rule_still_raises_at_once():
    code = (
        "import functransforms as ft\n"
        "from functransforms.autodiff import register_vjp_rule, VJP_RULES\n"
        "try:\n"
        "    register_vjp_rule(torch.ops.aten.cumsum.default)(lambda *a: None)\n"
        "except ValueError as e:\n"
        "    print('raised', 'already has' in str(e))\n"
        "print(torch.ops.aten.cumsum.default in VJP_RULES, len(VJP_RULES) > 300)\n"
    )
    out = _run(code)
    assert out[0] == "raised True" and out[1] == "True True"


# Note [Long-lived setup without young collections] (functransforms/_core/gcpause.py)
_UNTIL_FULL_GC = """
import gc, sys, torch
full = []
def on_gc(phase, info):
    if phase == "start" and info["generation"] == 2:
        full.append(1)
gc.callbacks.append(on_gc)
{setup}
seen = len(full)
keep = []
while len(full) == seen and len(keep) < 200_000:
    keep.append([])
print(seen, len(keep), gc.isenabled())
"""


def _until_full_gc(setup):
    out = subprocess.run(
        [sys.executable, "-c", _UNTIL_FULL_GC.format(setup=setup)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    seen, allocations, enabled = out.stdout.split()
    return int(seen), int(allocations), enabled == "True"


def test_library_setup_leaves_the_programs_collection_schedule_nearly_as_it_was():
    """Without the pause, import + first vmap(grad) ran the full collection torch's import
    leaves due (the first call paid ~70 ms for torch's heap) and without functransforms the
    program's ~12k-th allocation runs it. With the setup paused the program's own code still
    reaches it, and not much sooner: the library's setup counts as a few young collections,
    not ~19."""
    _, alone, _ = _until_full_gc("")
    seen, after_setup, enabled = _until_full_gc(
        "import functransforms as ft\nft.vmap(ft.grad(lambda x: x.sin().sum()))(torch.randn(2, 3))"
    )
    assert enabled
    assert seen == 0, "the library's setup ran the full collection torch's import left due"
    assert after_setup > 0.6 * alone, (after_setup, alone)


def test_a_collector_the_program_disabled_stays_disabled():
    seen, _, enabled = _until_full_gc(
        "gc.disable()\nimport functransforms as ft\nft.vmap(ft.grad(torch.sin))(torch.randn(2))\n"
        "ft.jit"
    )
    assert not enabled


def test_a_first_op_that_loads_a_registry_making_family():
    # jvp(vjp) of matrix_exp as a process's first call loads a family that makes a registry
    # while facts() refreshes the op's new record from every registry: iterating the live
    # dict raised "dictionary changed size during iteration" (torch 2.15; conformance
    # test_jvp_vjp[matrix_exp-real] in a full -n 2 run)
    code = (
        "import functransforms as ft\n"
        "x = torch.randn(5, 5, dtype=torch.float64)\n"
        "f = lambda a: ft.vjp(torch.linalg.matrix_exp, a)[1](torch.ones_like(a))[0]\n"
        "print(tuple(ft.jvp(f, (x,), (x,))[1].shape))\n"
    )
    assert _run(code)[0] == "(5, 5)"


def test_subpackages_are_attributes_loaded_at_first_use():
    # `import functransforms as ft; ft.linalg.KroneckerOperator(...)` works without importing
    # the subpackage by name, and `import functransforms` loads none of them
    subpackages = ("linalg", "testing", "distributed", "batching")
    code = (
        "import functransforms as ft\n"
        f"print(*[f'functransforms.{{n}}' in sys.modules for n in {subpackages!r}])\n"
        f"print(*[getattr(ft, n).__name__ for n in {subpackages!r}])\n"
        "import functransforms.linalg as fl\n"
        "print(fl is ft.linalg, all(n in dir(ft) for n in "
        f"{subpackages!r}), ft.autodiff.__name__)"
    )
    out = _run(code)
    assert out[0].split() == ["False"] * len(subpackages)
    assert out[1].split() == [f"functransforms.{n}" for n in subpackages]
    assert out[2].split() == ["True", "True", "functransforms.autodiff"]


# -- the first jit call (docs/jit.md, "Side by side with jax.jit") ------------------------------
_FIRST_JIT = (
    "import functransforms as ft\n"
    "f = lambda x: (x.sin() * x).sum()\n"
    "ft.jit(ft.vmap(ft.grad(f)))(torch.randn(2, 3))"
)


def test_static_first_jit_call_does_not_import_sympy():
    # Note [Recording static traces] (functransforms/_jit/_record.py): a static trace is
    # recorded by jit's own dispatch mode, not make_fx (whose entry imports torch._inductor's
    # config, and with it torch._dynamo and sympy); and no mode of ours lets torch wrap its
    # __torch_dispatch__ in torch._disable_dynamo, which imports torch._dynamo at the first op
    assert _fresh_with_dynamo(_FIRST_JIT) == ["False", "False", "False"]


def test_first_jit_of_an_outer_product_does_not_import_sympy():
    # the outer-product pass checks the layout of the product it substitutes by TensorIterator's
    # rule written out, not by a meta-tensor op (torch's Python meta kernels import torch._dynamo)
    code = (
        "import functransforms as ft\n"
        "j = ft.jit(lambda a, b: torch.bmm(a, b).sin())\n"
        "j(torch.randn(4, 3, 1), torch.randn(4, 1, 5))"
    )
    assert _fresh_with_dynamo(code) == ["False", "False", "False"]


def test_first_vmap_with_different_randomness_does_not_import_sympy():
    # its dispatch mode is an UncompiledDispatchMode too (torch would import torch._dynamo at
    # the mode's first op); inside jit as well
    code = (
        "import functransforms as ft\n"
        "f = ft.vmap(lambda x: x + torch.rand(()), randomness='different')\n"
        "f(torch.ones(3)); ft.jit(f)(torch.ones(3))"
    )
    assert _fresh(code) == ["False", "False"]


def test_dynamic_first_jit_call_still_traces_with_make_fx():
    # guards the check above: dynamic=True needs make_fx's symbolic shapes (and sympy)
    code = _FIRST_JIT.replace("ft.jit(", "ft.jit(dynamic=True)(")
    assert _fresh(code)[1] == "True"


def test_first_jit_call_result_in_a_fresh_process():
    # guards the check above: the statement runs and traces (a fallback would not trace)
    code = _FIRST_JIT.replace(
        "ft.jit(ft.vmap(ft.grad(f)))(torch.randn(2, 3))",
        "j = ft.jit(ft.vmap(ft.grad(f))); x = torch.randn(2, 3); j(x)\n"
        "print(j.cache_info().misses, torch.allclose(j(x), ft.vmap(ft.grad(f))(x)))",
    )
    assert _words(code) == ["1", "True"]


def test_first_determinism_check_does_not_import_sympy():
    # the checker's dispatch modes are UncompiledDispatchModes too
    code = (
        "import functransforms as ft\n"
        "from functransforms.deterministic import check_deterministic\n"
        "check_deterministic(lambda x: ft.grad(lambda z: (z.sin() * z).sum())(x), torch.ones(3))"
    )
    assert _fresh(code) == ["False", "False"]
