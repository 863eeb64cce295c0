"""The two derivative registries, keyed by ``OpOverload``, and the rule-shape helpers.

Frozen rule signatures::

    jvp rule:  rule(primals, tangents, kwargs) -> (out, tangent_out)
    vjp rule:  rule(cts, primals, kwargs, out, needs) -> cotangents

``primals`` are the op's positional arguments with this level's wrappers unwrapped;
``tangents`` is parallel to it (``None`` is a symbolic zero; a list for a list argument).
``cts`` is the output cotangent (a tuple for ops with several outputs, ``None`` entries for
zeros); ``out`` the op's output; ``needs[i]`` says whether argument ``i`` wants a cotangent.
A vjp rule returns one cotangent (or ``None``) per positional argument, a list for a list
argument. Complex conventions: docs/complex.md.
"""

from __future__ import annotations

JVP_RULES: dict = {}
VJP_RULES: dict = {}
# Ops whose value under grad is computed by another function than the op itself: the lazy
# conj/neg views, which must materialize (Note [No lazy conjugate inside wrappers]). Other ops
# say so on their vjp rule (`rule.forward`, see def_linalg in autodiff/linalg.py).
VJP_FORWARD: dict = {}


def _register(table, kind, ops):
    def deco(rule):
        for op in ops:
            if op in table:
                raise ValueError(f"{kind}: {op} already has a rule")
            table[op] = rule
        return rule

    return deco


def register_jvp_rule(*ops):
    """Decorator: register a forward-mode (jvp) rule for each op in ``ops``."""
    return _register(JVP_RULES, "register_jvp_rule", ops)


def register_vjp_rule(*ops):
    """Decorator: register a reverse-mode (vjp) rule for each op in ``ops``."""
    return _register(VJP_RULES, "register_vjp_rule", ops)


class MissingRuleError(NotImplementedError):
    """An op reached a jvp/vjp level that has no rule for it (nor a decomposition)."""

    def __init__(self, message, path):
        super().__init__(message)
        self.path = path  # the op, then what it decomposed into, down to the one without a rule


def missing_rule(func, call, kind, decorator, path=()):
    """The error for an op without a ``kind`` ('jvp' / 'vjp') rule, under ``call`` (the public
    call, e.g. ``grad(loss)``). ``path``: the ops ``func`` decomposed into, down to the one
    without a rule."""
    from functransforms._ops import facts, op_name

    name = op_name(func)
    if facts(func).written_kwargs:  # an out= variant: torch refuses these under autograd too
        return RuntimeError(
            f"{call}: {name} writes into `out=`, and functions with out= arguments do not "
            "support automatic differentiation (as in torch and torch.func). Do: drop `out=` "
            "and use the return value."
        )
    via = ""
    if path:
        steps = " -> ".join(op_name(p) for p in path)
        via = f" (it decomposes as {name} -> {steps}, which has none)"
    return MissingRuleError(
        f"{call}: there is no {kind} rule for {name}{via}, so it cannot be differentiated. "
        f"Register one with `@functransforms.autodiff.{decorator}({name})` (signatures in "
        "functransforms/autodiff/_registry.py), or wrap the computation in "
        "`functransforms.custom_vjp` / `custom_jvp`.",
        (func,) + tuple(path),
    )


def decompose(interp, func, d, args, kwargs):
    """Run decomposition ``d`` of ``func``; a missing rule inside it is reported as ``func``'s."""
    try:
        return d(*args, **kwargs)
    except MissingRuleError as e:
        if not str(e).startswith(interp.call + ":"):
            raise
        raise missing_rule(func, interp.call, interp.rule_kind, interp.decorator, e.path) from None
