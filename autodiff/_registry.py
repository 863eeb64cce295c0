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


def missing_rule(func, transform, decorator):
    from functransforms._ops import op_name

    name = op_name(func)
    return NotImplementedError(
        f"{transform}: there is no {transform} rule for {name}, so it cannot be differentiated. "
        f"Register one with `@functransforms.autodiff.{decorator}({name})` (signatures in "
        "functransforms/autodiff/_registry.py), or wrap the computation in "
        "`functransforms.custom_vjp` / `custom_jvp`."
    )
