"""Facts about ATen op overloads that every interpreter needs, computed once per op and cached.

Reading an op's schema costs microseconds; the interpreters ask on every op, so the answer is
kept in a plain dict keyed by the ``OpOverload``.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


class OpFacts:
    __slots__ = (
        "inplace",
        "inplace_view",
        "view",
        "random",
        "functional",
        "name",
        "written",
        "written_kwargs",
        "fresh_like",
        "dropout_p_at",
    )

    def __init__(self, func):
        schema = func._schema
        namespace, _, base = schema.name.rpartition("::")
        self.name = f"{namespace or 'aten'}.{base}.{func._overloadname}"
        first = schema.arguments[0] if schema.arguments else None
        writes_self = bool(first is not None and first.alias_info and first.alias_info.is_write)
        tags = func.tags
        self.inplace_view = torch.Tag.inplace_view in tags
        self.inplace = writes_self and schema.name.endswith("_") and not self.inplace_view
        self.view = (not writes_self) and any(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
        )
        self.random = torch.Tag.nondeterministic_seeded in tags
        # attention kernels carry the random tag but draw only when dropout_p > 0
        self.dropout_p_at = next(
            (i for i, a in enumerate(schema.arguments) if a.name == "dropout_p"), None
        )
        self.functional = _functional_variant(func) if (self.inplace or self.inplace_view) else None
        # every argument the schema marks written (`Tensor(a!)`): not only add_'s self but the
        # target of prims.copy_to, which has no trailing underscore, and out= keywords
        positional = [a for a in schema.arguments if not a.kwarg_only]
        self.written = tuple(
            i
            for i, a in enumerate(positional)
            if a.alias_info is not None and a.alias_info.is_write
        )
        self.written_kwargs = tuple(
            a.name
            for a in schema.arguments
            if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
        )
        self.fresh_like = func in _FRESH_LIKE  # Note [Buffers held by kernels]


# in-place ops whose functional form has another overload name
_FUNCTIONAL_OVERRIDES = {
    aten.bernoulli_.float: aten.bernoulli.p,
    aten.normal_.default: aten.normal_functional.default,
}


def positional_with_defaults(func, args):
    """``args`` of ``func`` with its left-out positional defaults filled in (dispatch drops
    arguments equal to their default; an override's functional form may not default them)."""
    if func not in _FUNCTIONAL_OVERRIDES:
        return args
    schema = [a for a in func._schema.arguments if not a.kwarg_only]
    return tuple(args) + tuple(a.default_value for a in schema[len(args) :])


def _functional_variant(func):
    """aten.add_.Tensor -> aten.add.Tensor; aten.squeeze_.dim -> aten.squeeze.dim."""
    if func in _FUNCTIONAL_OVERRIDES:
        return _FUNCTIONAL_OVERRIDES[func]
    namespace, _, base = func._schema.name.rpartition("::")
    if not base.endswith("_"):
        return None
    packet = getattr(getattr(torch.ops, namespace or "aten"), base[:-1], None)
    if packet is None:
        return None
    return getattr(packet, func._overloadname, None)


# ops that make a new plain buffer from a tracked value (Note [Buffers held by kernels])
_FRESH_LIKE = frozenset(
    (
        aten.empty_like.default,
        aten.zeros_like.default,
        aten.ones_like.default,
        aten.full_like.default,
        aten.new_empty.default,
        aten.new_zeros.default,
        aten.new_ones.default,
        aten.new_full.default,
    )
)

_FACTS: dict = {}


def facts(func) -> OpFacts:
    f = _FACTS.get(func)
    if f is None:
        f = _FACTS[func] = OpFacts(func)
    return f


def draws_random(func, args, kwargs) -> bool:
    """Whether this call of ``func`` draws random numbers: its tag, except for attention
    kernels called with ``dropout_p == 0`` (torch 2.15's ``scaled_dot_product_attention`` reaches
    transforms as ``_scaled_dot_product_flash_attention_for_cpu``, tagged random)."""
    f = facts(func)
    if not f.random or f.dropout_p_at is None:
        return f.random
    at = f.dropout_p_at
    p = args[at] if len(args) > at else kwargs.get("dropout_p", 0.0)
    return p > 0


def op_name(func) -> str:
    """The op as a user would type it: ``aten.add.Tensor``, ``prims.abs.default``."""
    return facts(func).name if hasattr(func, "_schema") else getattr(func, "__name__", str(func))
