"""The one registry of batching rules, keyed by ``OpOverload``.

A batching rule has the frozen signature::

    rule(interp, args, bdims, kwargs) -> (out, out_bdims)

``args`` are the op's positional arguments with this level's BatchedTensors replaced by their
physical values (lists stay lists); ``bdims`` is parallel to ``args``: the batch dim of each
physical tensor, ``None`` for an unbatched value, a list of those for a list argument. ``out``
is a tensor or a tuple of tensors, ``out_bdims`` the matching int/None (tuple for tuples).
``interp.batch_size`` is the size of the mapped axis. ``kwargs`` are passed as given; an op
called with a batched tensor keyword runs as the per-example loop unless its rule sets
``rule.unwraps_kwargs = True`` (it then unwraps them with ``interp._unwrap``).
"""

from __future__ import annotations

VMAP_RULES: dict = {}


def register_vmap_rule(*ops):
    """Decorator: register ``rule`` as the batching rule of each op in ``ops``."""

    def deco(rule):
        for op in ops:
            if op in VMAP_RULES:
                raise ValueError(f"register_vmap_rule: {op} already has a batching rule")
            VMAP_RULES[op] = rule
        return rule

    return deco
