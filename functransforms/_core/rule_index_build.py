"""Builds functransforms/_core/rule_index.py: which rule family registers what, for loading the
families on first use (Note [Rule families load on first use], functransforms/_core/ops.py).

    python -m functransforms._core.rule_index_build --write   # regenerate after changing a family
    python -m functransforms._core.rule_index_build --check   # exit 1 if the index is stale

The build runs in a fresh process: it imports ``functransforms`` (the eager modules only),
switches the lazy loading off, then imports each family of ``FAMILIES`` in turn and records what
the import added to each registry, to our decomposition overrides and to the registrations by
name. ``FAMILIES`` lists a family after the families it imports, so that each import adds one
family only (checked).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# Rule modules that load on first use, each after the families it imports (autodiff/linalg_eig
# imports batching/linalg on torch 2.15). The other modules
# of batching/ and autodiff/ are imported by their package (the interpreters, and the families
# that define wrapper classes or the derived pointwise rule: batching/__init__.py).
FAMILIES = (
    "batching.reductions",
    "batching.nn",
    "batching.scans",
    "batching.sorting",
    "batching.indexing",
    "batching.linalg",
    "batching.normalization",
    "batching.pooling",
    "batching.fft",
    "batching.convolution",
    "batching.collectives",
    "autodiff.elementwise",
    "autodiff.views",
    "autodiff.reductions",
    "autodiff.special",
    "autodiff.indexing",
    "autodiff.scans",
    "autodiff.random",
    "autodiff.linalg",
    "autodiff.linalg_eig",
    "autodiff.linalg_lu",
    "autodiff.linalg_qr",
    "autodiff.nn",
    "autodiff.normalization",
    "autodiff.pooling",
    "autodiff.sorting",
    "autodiff.fft",
    "autodiff.convolution",
    "autodiff.collectives",
)

_OUT = Path(__file__).with_name("rule_index.py")


def _record():
    """In a fresh process: ``{table: {"ns::name.overload": bits}}`` and the by-name rules."""
    import importlib
    import types

    # an empty index, so that nothing loads lazily while the eager modules import (the current
    # index may be stale)
    stub = types.ModuleType("functransforms._core.rule_index")
    stub.FAMILIES, stub.BY_NAME, stub.INDEX = FAMILIES, frozenset(), {}
    sys.modules[stub.__name__] = stub
    import functransforms  # noqa: F401  (the eager modules)
    import functransforms.batching  # noqa: F401  (imported by the first vmap)
    from functransforms._core import decomp as _decomp
    from functransforms._core import ops as _ops
    from functransforms.batching._registry import WRITES_CHECKED_BY_RULE

    registries = dict(_ops._REGISTRIES)
    for r in registries.values():
        r._lazy = None  # record what each import adds, nothing else
    eager = [m for m in FAMILIES if "functransforms." + m in sys.modules]
    if eager:
        raise RuntimeError(f"imported by `import functransforms`, so not lazy: {eager}")

    def keys(table):
        return {_ops._key(op) for op in table}

    # the rules of the eagerly imported modules have no family to load (0), but the index is
    # also the list of every op with a rule (_ops.rule_names), before vmap's first call too
    index: dict = {slot: dict.fromkeys(keys(dict.keys(r)), 0) for slot, r in registries.items()}
    index["decomposition"] = dict.fromkeys(keys(_decomp._OVERRIDES), 0)
    by_name = set()

    for bit, family in enumerate(FAMILIES):
        before_mods = set(sys.modules)
        before = {slot: keys(dict.keys(r)) for slot, r in registries.items()}
        before_names = {slot: set(r._by_name) for slot, r in registries.items()}
        before_dec = keys(_decomp._OVERRIDES)
        before_writes = set(WRITES_CHECKED_BY_RULE)
        importlib.import_module("functransforms." + family)
        families = {"functransforms." + m for m in FAMILIES}
        loaded = (set(sys.modules) - before_mods) & families
        if loaded != {"functransforms." + family}:
            raise RuntimeError(
                f"importing {family} imported {sorted(loaded)}: list a family after the "
                "families it imports in FAMILIES"
            )
        for slot, r in registries.items():
            new_names = set(r._by_name) - before_names[slot]
            by_name |= new_names
            added = (keys(dict.keys(r)) - before[slot]) | {_ops._name_key(n) for n in new_names}
            for key in added:
                index[slot][key] = index[slot].get(key, 0) | 1 << bit
        for key in keys(_decomp._OVERRIDES) - before_dec:
            index["decomposition"][key] = index["decomposition"].get(key, 0) | 1 << bit
        for op in set(WRITES_CHECKED_BY_RULE) - before_writes:  # read after the vmap rule
            if not index["vmap_rule"].get(_ops._key(op), 0) >> bit & 1:
                raise RuntimeError(f"{family} marks {op} written by its rule without its rule")
    if None in {k for t in index.values() for k in t}:
        raise RuntimeError("a registry holds a key that is not an OpOverload")
    return {"index": index, "by_name": sorted(by_name)}


def build() -> str:
    """The text of functransforms/_core/rule_index.py, recorded in a fresh process."""
    code = (
        "import json, functransforms._core.rule_index_build as b; "
        "print(json.dumps(b._record(), sort_keys=True))"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=False
    )
    if out.returncode:
        raise RuntimeError(out.stderr)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    _keep_other_versions(data)
    lines = [
        '"""Generated by ``python -m functransforms._core.rule_index_build --write``: do not edit.',
        "",
        "Which rule families register a rule (or a decomposition override) for each op, as bits of",
        "``FAMILIES`` (Note [Rule families load on first use], functransforms/_core/ops.py).",
        '"""',
        "",
        "# fmt: off",
        "FAMILIES = (",
        *(f"    {m!r}," for m in FAMILIES),
        ")",
        "BY_NAME = frozenset((",
        *(f"    {n!r}," for n in data["by_name"]),
        "))",
        "INDEX = {",
    ]
    for table in sorted(data["index"]):
        lines.append(f"    {table!r}: {{")
        lines += _packed(f"{k!r}: {v}," for k, v in sorted(data["index"][table].items()))
        lines.append("    },")
    lines += ["}", ""]
    return "\n".join(lines)


def _packed(items, indent="        ", width=99):
    """``items`` joined by spaces into lines of at most ``width`` characters."""
    lines, line = [], indent
    for item in items:
        if line != indent and len(line) + 1 + len(item) > width:
            lines.append(line)
            line = indent
        line += item if line == indent else " " + item
    if line != indent:
        lines.append(line)
    return lines


def _keep_other_versions(data):
    """The index serves every supported torch: keep the current file's entries for ops the
    running torch does not define (rules a family registers only on another torch version)."""
    from functransforms._core import rule_index as _rule_index
    from functransforms._core.ops import _defined_op

    if tuple(_rule_index.FAMILIES) != FAMILIES:
        return  # other bits: a build on each torch version restores its entries
    for table, entries in _rule_index.INDEX.items():
        new = data["index"].setdefault(table, {})
        for key, mask in entries.items():
            name = key if "." in key.partition("::")[2] else key + ".default"
            if key not in new and _defined_op(name) is None:
                new[key] = mask
    data["by_name"] = sorted(set(data["by_name"]) | set(_rule_index.BY_NAME))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    text = build()
    if "--write" in argv:
        _OUT.write_text(text)
        print(f"wrote {_OUT}")
        return 0
    if _OUT.read_text() != text:
        print(f"{_OUT} is stale: run python -m functransforms._core.rule_index_build --write")
        return 1
    print("current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
