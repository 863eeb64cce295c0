"""The two derivative registries, keyed by ``OpOverload`` (``make_registry``, Note [One record
per op] in functransforms/_core/ops.py), and the decorators that fill them.

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

from functransforms._core.ops import make_registry
from functransforms.errors import MissingRuleError, missing_rule

JVP_RULES = make_registry("jvp")
VJP_RULES = make_registry("vjp")
# Ops whose value under grad is computed by another function than the op itself: the lazy
# conj/neg views, which must materialize (Note [No lazy conjugate inside wrappers]), and kernels
# that need the conj keys inside transforms (def_linalg(forward=), autodiff/linalg.py).
VJP_FORWARD = make_registry("vjp_forward", slot="vjp_forward")


def register_jvp_rule(*ops):
    """Decorator: register a forward-mode (jvp) rule for each op in ``ops``."""
    return JVP_RULES.register(*ops)


def register_vjp_rule(*ops):
    """Decorator: register a reverse-mode (vjp) rule for each op in ``ops``."""
    return VJP_RULES.register(*ops)


__all__ = [
    "JVP_RULES",
    "VJP_FORWARD",
    "VJP_RULES",
    "MissingRuleError",  # re-exported: it lives in functransforms.errors
    "decompose",
    "missing_rule",
    "register_jvp_rule",
    "register_vjp_rule",
]


def decompose(interp, func, d, args, kwargs):
    """Run decomposition ``d`` of ``func``; a missing rule inside it is reported as ``func``'s."""
    try:
        return d(*args, **kwargs)
    except MissingRuleError as e:
        if not str(e).startswith(interp.call + ":"):
            raise
        raise missing_rule(func, interp.call, interp.rule_kind, interp.decorator, e.path) from None
