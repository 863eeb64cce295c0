"""One record per ATen op overload: the facts every interpreter needs and the op's rules.

Note [One record per op]
    Reading an op's schema costs microseconds and every interpreter asks on every op, so the
    answers are computed once per ``OpOverload`` and kept in an ``OpFacts`` record (a plain dict
    lookup, ``facts(func)``). The record also holds the op's rule of each transform
    (``vmap_rule``, ``jvp_rule``, ``vjp_rule``, ``vjp_forward``), filled from the registries
    when the record is made (the op's first use), so an op that passes through
    ``vmap(grad(f))`` is hashed once per level, not once more per registry, and the rule is a
    plain slot read. Rules can be registered at any time (rule modules import in any order,
    users register their own): every write to a registry puts the op's current rule into its
    record, so a missing rule is ``None`` only until one is registered. (Filling on first
    read through ``__getattr__`` was tried: a class with ``__getattr__`` loses CPython's fast
    slot reads for *all* its attributes, which cost more than the lookups it saved.)
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
        "op",
        # the op's rules, kept current by the registries (Note [One record per op])
        "vmap_rule",
        "jvp_rule",
        "vjp_rule",
        "vjp_forward",
        "dropout_p_at",
        "returns",
    )

    def __init__(self, func):
        self.op = func
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
        # the container the dispatcher hands back (Note [Direct route to the inner level],
        # _core/levels.py): 1 a list (one ``Tensor[]`` return), 2 a tuple (several returns), else 0
        rets = schema.returns
        self.returns = 2 if len(rets) > 1 else int(len(rets) == 1 and "[]" in str(rets[0].type))
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
        # the rules: filled by facts() once the record is in _FACTS (a registry's derive may
        # ask for this record), kept current by the registries (Note [One record per op])
        self.vmap_rule = self.jvp_rule = self.vjp_rule = self.vjp_forward = None


# in-place ops whose functional form has another overload name
_FUNCTIONAL_OVERRIDES = {
    aten.bernoulli_.float: aten.bernoulli.p,
    aten.normal_.default: aten.normal_functional.default,
    aten.transpose_.default: aten.transpose.int,  # torch.stft transposes its result in place
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
    same = getattr(packet, func._overloadname, None)
    if same is not None and _arg_types(same) == _arg_types(func):
        return same
    # The overload of the same name may take other arguments (pow_.Scalar is pow(Tensor,
    # Scalar), pow.Scalar is pow(Scalar, Tensor)) or not exist (pow_.Tensor, floor_divide_.
    # Tensor): the functional form is the overload with the in-place one's argument types.
    for name in packet.overloads():
        candidate = getattr(packet, name)
        if _arg_types(candidate) == _arg_types(func):
            return candidate
    return None


def _arg_types(func):
    return [(str(a.type), a.kwarg_only) for a in func._schema.arguments]


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
_RULE_SLOTS = ("vmap_rule", "jvp_rule", "vjp_rule", "vjp_forward")
_REGISTRIES: dict = {}  # record slot -> the Registry that fills it


_FILLING: dict = {}  # records being filled, by the thread holding the setup lock


def facts(func) -> OpFacts:
    f = _FACTS.get(func)
    if f is None:
        f = _new_facts(func)
    return f


def _new_facts(func) -> OpFacts:
    """Make, fill and publish ``func``'s record. Published last, under the setup lock: another
    thread read a record whose rules were not filled yet as "no rule" (a missing-rule error at
    two threads' first ``grad``; Note [One-time setup under one lock], _core/gcpause.py). While it
    is filled, this thread (a registry's derive, a family's registrations) finds it in
    ``_FILLING``."""
    from .gcpause import paused_collector

    with paused_collector():
        f = _FACTS.get(func) or _FILLING.get(func)
        if f is not None:
            return f
        f = _FILLING[func] = OpFacts(func)
        try:
            # a snapshot: a lookup may load a rule family (Note [Rule families load on first
            # use]) that makes a registry, which refreshes every record itself
            # (make_registry); the live view raised "dictionary changed size during
            # iteration" (jvp(vjp) of matrix_exp, torch 2.15, when it was a worker's first
            # op of that family)
            for registry in tuple(_REGISTRIES.values()):
                registry._refresh(func)
            _FACTS[func] = f
        finally:
            del _FILLING[func]
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


class Registry(dict):
    """One transform's rules, keyed by ``OpOverload`` (Note [One record per op]).

    A dict, so ``op in RULES`` and ``RULES[op]`` work as before; every write also updates the
    op's record. ``register(*ops)`` is the decorator that refuses duplicates.
    """

    def __init__(self, kind, slot, what):
        super().__init__()
        self.kind = kind  # 'vmap', 'jvp', 'vjp'
        self.slot = slot  # the OpFacts slot this registry fills
        self.decorator = f"register_{kind}_rule"
        self.what = what  # for the duplicate error
        self._derive = None
        self._by_name = {}  # "ns::name.overload" -> rule, for ops not defined yet
        # "ns::name.overload" -> the families (bits of _rule_index.FAMILIES) that register a
        # rule of the op here and load on its first lookup (Note [Rule families load on first
        # use]); None: none left to load
        self._lazy = None

    def register(self, *ops):
        """Decorator: register ``rule`` for each op in ``ops``; an op registered twice raises."""

        def deco(rule):
            for op in ops:
                if op in self:
                    raise ValueError(f"{self.decorator}: {op} already has {self.what}")
                self[op] = rule
            return rule

        return deco

    def register_when_defined(self, qualname, rule, module):
        """Register ``rule`` for the op ``qualname`` (``"ns::name.overload"``), which importing
        ``module`` defines, when it first reaches a transform (its record is made) or
        ``lookup`` is asked for it: for custom ops that a torch module defines when it is
        imported (``torch.nn.modules.linear_cross_entropy``), so registering their rule does
        not import the module at ``import functransforms`` (Note [Lazy parts of the package]).
        Until then the op cannot have been called, so nothing can miss the rule.
        ``define_pending()`` imports the modules and registers them all (docs/coverage.md)."""
        self._load_key(_name_key(qualname))
        if qualname in self._by_name or any(_qualname(op) == qualname for op in dict.keys(self)):
            raise ValueError(f"{self.decorator}: {qualname} already has {self.what}")
        op = _defined_op(qualname)
        if op is not None:  # already defined: an ordinary registration
            self.register(op)(rule)
        else:
            self._by_name[qualname] = rule, module

    def define_pending(self):
        """Import the modules of the rules registered by name, and register those rules."""
        import importlib

        load_all_families()
        for qualname, (rule, module) in list(self._by_name.items()):
            try:
                importlib.import_module(module)
            except ImportError:
                continue
            op = _defined_op(qualname)
            if op is not None and self._by_name.pop(qualname, None) is not None:
                self.register(op)(rule)

    def load_lazily(self):
        """From now on, reads load the families that register the op's rule first (Note [Rule
        families load on first use]); records made before are refreshed (and their families
        loaded). Called by the registry's package at the end of its import, when the families
        can import it."""
        from .rule_index import INDEX

        self._lazy = INDEX.get(self.slot)
        self._refresh_all()

    def derive_with(self, derive):
        """Decorator: ``derive(func) -> rule or None`` gives a rule to ops registered without
        one (vmap: one shared rule for every op tagged pointwise). Returns ``derive``."""
        self._derive = derive
        self._refresh_all()
        return derive

    def lookup(self, op):
        """The registered rule of ``op``, else the derived one, else None (uncached: records
        hold it)."""
        if self._lazy is not None:
            self._load(op)
        rule = dict.get(self, op)
        if rule is None and self._by_name:
            rule, _ = self._by_name.pop(_qualname(op), (None, None))
            if rule is not None:
                dict.__setitem__(self, op, rule)  # a registered rule from now on
        if rule is None and self._derive is not None:
            rule = self._derive(op)
        return rule

    def derived(self, op):
        """The rule ``derive_with`` gives ``op``, or None (for docs/coverage.md)."""
        return None if self._derive is None else self._derive(op)

    # Reads load the families that register the op's rule first (Note [Rule families load on
    # first use]); whole-registry reads load them all. Interpreters never read here per op:
    # they read the op's record (Note [One record per op]).
    def _load(self, op):
        key = _key(op)
        if key is not None:
            self._load_key(key)

    def _load_key(self, key):
        lazy = self._lazy
        if lazy is not None:
            mask = lazy.get(key)
            if mask is not None and mask & ~_LOADED[0]:
                load_families(mask)

    def __contains__(self, op):
        if self._lazy is not None:
            self._load(op)
        return dict.__contains__(self, op)

    def __getitem__(self, op):
        if self._lazy is not None:
            self._load(op)
        return dict.__getitem__(self, op)

    def get(self, op, default=None):
        if self._lazy is not None:
            self._load(op)
        return dict.get(self, op, default)

    def __iter__(self):
        load_all_families()
        return dict.__iter__(self)

    def __len__(self):
        load_all_families()
        return dict.__len__(self)

    def keys(self):
        load_all_families()
        return dict.keys(self)

    def values(self):
        load_all_families()
        return dict.values(self)

    def items(self):
        load_all_families()
        return dict.items(self)

    def copy(self):
        load_all_families()
        return dict(dict.items(self))

    def __repr__(self):
        load_all_families()
        return dict.__repr__(self)

    # every write clears the cached slot, so a late registration is seen
    def __setitem__(self, op, rule):
        super().__setitem__(op, rule)
        self._refresh(op)

    def __delitem__(self, op):
        if self._lazy is not None:
            self._load(op)
        super().__delitem__(op)
        self._refresh(op)

    def pop(self, op, *default):
        if self._lazy is not None:
            self._load(op)
        out = super().pop(op, *default)
        self._refresh(op)
        return out

    def setdefault(self, op, rule=None):
        if op not in self:
            self[op] = rule
        return self[op]

    def update(self, *args, **kwargs):
        for op, rule in dict(*args, **kwargs).items():
            self[op] = rule

    def popitem(self):
        load_all_families()
        item = super().popitem()
        self._refresh(item[0])
        return item

    def clear(self):
        load_all_families()
        super().clear()
        self._refresh_all()

    def _refresh(self, op):
        """Put this registry's current rule of ``op`` into its record, if it has one (only the
        registry records read: see make_registry)."""
        record = _FACTS.get(op) or _FILLING.get(op)
        if record is not None and _REGISTRIES.get(self.slot) is self:
            setattr(record, self.slot, self.lookup(op))

    def _refresh_all(self):
        for op in [*_FACTS, *_FILLING]:
            self._refresh(op)


def _qualname(op) -> str | None:
    schema = getattr(op, "_schema", None)  # registries may also hold non-ATen keys
    return None if schema is None else f"{schema.name}.{op._overloadname}"


def _key(op) -> str | None:
    """The key of ``op`` in a lazy index: ``"ns::name.overload"``, ``"ns::name"`` for the
    default overload (``OpOverload._name``, as torch's own per-op tables)."""
    return getattr(op, "_name", None)


def _name_key(qualname) -> str:
    """``_key`` of the op named ``"ns::name.overload"``."""
    return qualname[: -len(".default")] if qualname.endswith(".default") else qualname


# Note [Rule families load on first use]
#     ``import functransforms`` used to import every rule family (~30 modules, ~8.5k objects):
#     with torch's heap, that pushed the first transform call of a process past the garbage
#     collector's threshold for a full collection (~75 ms: Note [Cold start and torch's
#     garbage] in benchmarks/bench_core.py). Now most families load when a rule of one of their
#     ops is first looked up: a generated index (functransforms/_core/rule_index.py, keyed by
#     ``"ns::name.overload"`` per registry) names the families that register each op's rule, and
#     every read of a registry (the record fill of ``facts``, ``op in RULES``, ``RULES[op]``,
#     ``get``, ``register``'s duplicate check, ``decomposition(op)`` for our overrides) loads
#     them first; reads of the whole registry (iteration, ``len``, ``keys``, coverage,
#     ``define_pending``) load every family. So a lookup never misses a rule that eager import
#     would have found, provided the index is current: tests/package/test_cold_start.py
#     rebuilds it and compares (``python -m functransforms._core.rule_index_build --write``
#     regenerates it).
_LOADED = [0]  # bits of _rule_index.FAMILIES loaded so far


def load_families(mask):
    """Import the rule families in ``mask`` (bits of ``_rule_index.FAMILIES``) not loaded yet."""
    todo = mask & ~_LOADED[0]
    if not todo:
        return
    import importlib

    from .gcpause import paused_collector
    from .rule_index import FAMILIES

    with paused_collector():  # Note [Long-lived setup without young collections]
        for i, name in enumerate(FAMILIES):
            if todo >> i & 1 and not _LOADED[0] >> i & 1:  # loaded while this thread waited
                # a family being imported (sys.modules holds it) comes back as it is
                importlib.import_module("functransforms." + name)
                _LOADED[0] |= 1 << i


def load_for(kind, op):
    """Load the families that register something for ``op`` in the index's table ``kind``
    (a registry's slot, or ``"decomposition"``: our overrides of torch's decompositions)."""
    from .rule_index import INDEX

    key = _key(op)
    mask = INDEX.get(kind, {}).get(key) if key is not None else None
    if mask is not None and mask & ~_LOADED[0]:
        load_families(mask)


def load_all_families():
    """Import every rule family (Note [Rule families load on first use])."""
    from .rule_index import FAMILIES

    load_families((1 << len(FAMILIES)) - 1)


def rule_names():
    """``(packets, exact)``: the ops that have a rule in some registry, loaded or not, as packet
    names (``"aten::sin"``), and the rules registered by name for ops torch may not define yet
    (``"ns::name.overload"``): Note [Entering through registered rules] in _core/levels.py."""
    from .rule_index import BY_NAME, INDEX

    packets = {
        key.partition(".")[0]
        for r in _REGISTRIES.values()
        for key in map(_key, dict.keys(r))
        if key is not None
    }
    exact = {name for r in _REGISTRIES.values() for name in r._by_name}
    by_name = {_name_key(name) for name in BY_NAME}
    for table in INDEX.values():
        for key in table:
            if key in by_name:
                continue
            packets.add(key.partition(".")[0])
            if not key.startswith(("aten::", "prims::")):
                # our custom ops (the collectives) are defined when their module first loads,
                # maybe after this: register them by name as well
                exact.add(key)
    for name in BY_NAME:
        if _defined_op(name) is None:
            exact.add(name)
        else:
            packets.add(name.partition(".")[0])
    return packets, exact


def _defined_op(qualname):
    """The ``OpOverload`` named ``"ns::name.overload"``, or None if no such op is defined (yet)."""
    ns, _, rest = qualname.partition("::")
    name, _, overload = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), name), overload or "default")
    except (AttributeError, RuntimeError):
        return None


def make_registry(kind, *, slot=None, what="a rule") -> Registry:
    """The registry of ``kind`` ('vmap', 'jvp', 'vjp'), whose rules ``OpFacts`` records cache in
    ``slot`` (default ``<kind>_rule``).

    The first registry made for a slot is the one records read. A second one comes from a
    second copy of a rule package (the doctest collector imports ``functransforms.functransforms
    .batching`` through a source checkout's ``__path__``): it works as a dict but is not read by
    the interpreters, which belong to the first copy.
    """
    slot = slot or f"{kind}_rule"
    if slot not in _RULE_SLOTS:
        raise ValueError(f"make_registry({kind!r}): no OpFacts slot {slot!r}; add it first.")
    registry = Registry(kind, slot, what)
    if _REGISTRIES.setdefault(slot, registry) is registry:
        registry._refresh_all()  # records made before this registry existed
    return registry
