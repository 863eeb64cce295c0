"""The transform core, beneath the public API modules: levels, wrapper tensors and the routing
path (``levels``), op facts and rule registries (``ops``), decompositions (``decomp``,
``composites``, ``rnn``), the generated rule index (``rule_index``, built by
``python -m functransforms._core.rule_index_build``), batched factories (``batched_like``)
and the collector pause of the one-time setup (``gcpause``). Design:
docs/design/levels-and-routing.md and docs/design/rules.md."""
