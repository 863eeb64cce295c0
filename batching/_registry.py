"""The one registry of batching rules, keyed by ``OpOverload`` (``make_registry``, Note [One
record per op] in functransforms/_core/ops.py).

A batching rule has the frozen signature::

    rule(interp, args, bdims, kwargs) -> (out, out_bdims)

``args`` are the op's positional arguments with this level's BatchedTensors replaced by their
physical values (lists stay lists); ``bdims`` is parallel to ``args``: the batch dim of each
physical tensor, ``None`` for an unbatched value, a list of those for a list argument. ``out``
is a tensor or a tuple of tensors, ``out_bdims`` the matching int/None (tuple for tuples).
``interp.batch_size`` is the size of the mapped axis. ``kwargs`` are passed as given; an op
called with a batched tensor keyword runs as the per-example loop unless its rule sets
``rule.unwraps_kwargs = True`` (it then unwraps them with ``interp._unwrap``).

Ops without a registered rule may still have one derived from their tags
(``VMAP_RULES.derive_with``: every pointwise op shares one rule, batching/elementwise.py).
"""

from __future__ import annotations

from functransforms._core.ops import make_registry

VMAP_RULES = make_registry("vmap", what="a batching rule")
# ops whose schema marks an argument written although they write it only in some modes (batch
# norm writes its running statistics in training mode only): their rules check the targets
# themselves, instead of vmap refusing every unbatched target up front
WRITES_CHECKED_BY_RULE: set = set()


def register_vmap_rule(*ops):
    """Decorator: register ``rule`` as the batching rule of each op in ``ops``."""
    return VMAP_RULES.register(*ops)
