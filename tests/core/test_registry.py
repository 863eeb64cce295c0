"""The rule registries and the per-op record (Note [One record per op],
functransforms/_core/ops.py), and the one route of custom functions into rules (Note [Custom
rules across levels])."""

import warnings

import pytest
import torch
from functransforms.autodiff import JVP_RULES, VJP_RULES, register_jvp_rule
from functransforms.autodiff.forward import JvpInterpreter
from functransforms.autodiff.reverse import GradInterpreter
from functransforms.batching import VMAP_RULES, register_vmap_rule
from functransforms.batching import _tensor as batching_tensor
from functransforms.batching._tensor import VmapInterpreter

import functransforms as ft
from functransforms._core.ops import facts
from functransforms.errors import FallbackWarning, MissingRuleError

aten = torch.ops.aten
DT = torch.float64


def test_a_rule_registered_after_the_record_was_filled_is_seen(monkeypatch):
    # the first call caches "no vmap rule" in the op's record (the loop runs); a rule
    # registered later must replace it, and removing it must bring the loop back
    monkeypatch.setattr(batching_tensor, "_WARNED", set())
    op = aten._pdist_forward.default
    assert op not in VMAP_RULES
    x = torch.rand(3, 4, 2, dtype=DT)
    with pytest.warns(FallbackWarning, match="_pdist_forward"):
        expected = ft.vmap(torch.pdist)(x)
    assert facts(op).vmap_rule is None
    calls = []

    def pdist_vmap_rule(interp, args, bdims, kwargs):
        calls.append(bdims)
        return torch.stack([op(v, *args[1:]) for v in args[0].movedim(bdims[0], 0)]), 0

    monkeypatch.setitem(VMAP_RULES, op, pdist_vmap_rule)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        torch.testing.assert_close(ft.vmap(torch.pdist)(x), expected)
    assert calls == [[0]]
    monkeypatch.undo()
    assert facts(op).vmap_rule is None and op not in VMAP_RULES


def test_a_missing_derivative_is_not_cached_for_good(monkeypatch):
    # igamma in its first argument: torch has no derivative, nor do we
    op = aten.igamma.default
    a, x = torch.rand(3, dtype=DT) + 0.5, torch.ones(3, dtype=DT)
    f = lambda a: torch.igamma(a, x)  # noqa: E731
    with pytest.raises(MissingRuleError):
        ft.jvp(f, (a,), (torch.ones_like(a),))

    def stand_in_jvp_rule(primals, tangents, kwargs):  # any rule: the test checks it is used
        return op(*primals), -torch.special.bessel_j1(primals[0]) * tangents[0]

    monkeypatch.setitem(JVP_RULES, op, stand_in_jvp_rule)
    _, t = ft.jvp(f, (a,), (torch.ones_like(a),))
    torch.testing.assert_close(t, -torch.special.bessel_j1(a))
    monkeypatch.undo()
    with pytest.raises(MissingRuleError):
        ft.jvp(f, (a,), (torch.ones_like(a),))


def test_the_record_holds_the_registered_rules():
    f = facts(aten.mm.default)
    assert f.vmap_rule is VMAP_RULES[aten.mm.default]
    assert f.jvp_rule is JVP_RULES[aten.mm.default]
    assert f.vjp_rule is VJP_RULES[aten.mm.default]
    # pointwise ops without a rule of their own get the shared rule from their tag
    assert aten.sinh.default not in VMAP_RULES
    assert facts(aten.sinh.default).vmap_rule is not None


@pytest.mark.parametrize(
    "register, op",
    [(register_vmap_rule, aten.mm.default), (register_jvp_rule, aten.sin.default)],
)
def test_registering_twice_raises(register, op):
    with pytest.raises(ValueError, match=rf"{register.__name__}: .* already has"):
        register(op)(lambda *a: None)


@pytest.mark.parametrize(
    "interp_cls, transform",
    [
        (VmapInterpreter, lambda f, x: ft.vmap(f)(x)),
        (JvpInterpreter, lambda f, x: ft.jvp(f, (x,), (torch.ones_like(x),))[1]),
        (GradInterpreter, lambda f, x: ft.grad(lambda y: f(y).sum())(x)),
    ],
    ids=["vmap", "jvp", "grad"],
)
def test_custom_functions_reach_the_innermost_interpreter(monkeypatch, interp_cls, transform):
    @ft.custom_jvp
    def f(x):
        return x.sin()

    f.defjvp(lambda p, t: (p[0].sin(), p[0].cos() * t[0]))
    seen = []
    original = interp_cls.process_custom

    def spy(self, custom_fn, args):
        seen.append((type(self), custom_fn))
        return original(self, custom_fn, args)

    monkeypatch.setattr(interp_cls, "process_custom", spy)
    x = torch.rand(3, dtype=DT)
    out = transform(f, x)
    assert seen == [(interp_cls, f)]
    torch.testing.assert_close(out, transform(torch.sin, x))


def test_a_rule_registered_by_name_is_used_once_the_op_is_defined(monkeypatch):
    # Registry.register_when_defined (Note [Lazy parts of the package]): a custom op that a
    # module defines later gets its rule when it first reaches a transform
    name = "ft_test_lazy::twice"
    calls = []

    def twice_vmap_rule(interp, args, bdims, kwargs):
        calls.append(bdims)
        return op(args[0]), bdims[0]

    monkeypatch.setattr(VMAP_RULES, "_by_name", {})  # only this test's rules
    VMAP_RULES.register_when_defined(f"{name}.default", twice_vmap_rule, "unused")
    with pytest.raises(ValueError, match="already has"):
        VMAP_RULES.register_when_defined(f"{name}.default", twice_vmap_rule, "unused")

    @torch.library.custom_op(name, mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    op = torch.ops.ft_test_lazy.twice.default
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)  # not the per-example loop
            out = ft.vmap(twice)(torch.arange(6.0).reshape(3, 2))
        torch.testing.assert_close(out, torch.arange(6.0).reshape(3, 2) * 2)
        assert calls == [[0]]
        assert VMAP_RULES[op] is twice_vmap_rule and facts(op).vmap_rule is twice_vmap_rule
    finally:
        dict.pop(VMAP_RULES, op, None)  # a rule like any other: test_registering_twice_raises


def test_a_rule_registered_by_name_for_a_defined_op_registers_at_once(monkeypatch):
    monkeypatch.setattr(VMAP_RULES, "_by_name", {})  # only this test's rules
    with pytest.raises(ValueError, match="already has"):  # mm has a rule: a duplicate
        VMAP_RULES.register_when_defined("aten::mm.default", lambda *a: None, "torch")
    op = aten._pdist_forward.default
    assert op not in VMAP_RULES

    def rule(*a):
        return None

    VMAP_RULES.register_when_defined("aten::_pdist_forward.default", rule, "torch")
    try:
        assert VMAP_RULES[op] is rule and "aten::_pdist_forward.default" not in VMAP_RULES._by_name
    finally:
        del VMAP_RULES[op]
    assert facts(op).vmap_rule is None


def test_define_pending_imports_the_module_and_registers(monkeypatch, tmp_path):
    # docs/coverage.md lists every op with a rule, also those torch defines lazily
    (tmp_path / "ft_lazy_op_mod.py").write_text(
        "import torch\n"
        "@torch.library.custom_op('ft_test_lazy::thrice', mutates_args=())\n"
        "def thrice(x: torch.Tensor) -> torch.Tensor:\n"
        "    return x * 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(VMAP_RULES, "_by_name", {})  # only this test's rules

    def rule(*a):
        return None

    VMAP_RULES.register_when_defined("ft_test_lazy::thrice.default", rule, "ft_lazy_op_mod")
    VMAP_RULES.define_pending()
    op = torch.ops.ft_test_lazy.thrice.default
    try:
        assert VMAP_RULES[op] is rule
        assert "ft_test_lazy::thrice.default" not in VMAP_RULES._by_name
    finally:
        del VMAP_RULES[op]
