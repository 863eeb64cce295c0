"""Generate docs/coverage.md: every OpInfo of PyTorch's op database, and every ATen op with a
rule anywhere, with how each transform handles it.

Run ``python -m functransforms.coverage`` to rewrite the file of the installed torch
(``doc_path``: docs/coverage.md for torch 2.13, docs/coverage-torch2.15.md for 2.15);
tests/package/test_coverage_doc.py fails when that file is stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def _vmap_kind(op):
    from functransforms._core.decomp import decomposition
    from functransforms.batching import VMAP_RULES

    if op in VMAP_RULES:
        return "rule"
    if VMAP_RULES.derived(op) is not None:
        return "rule (pointwise)"
    if decomposition(op) is not None:
        return "decomposition"
    return "fallback (loop)"


def _ad_kind(op, table):
    from functransforms._core.decomp import decomposition

    if op in table:
        return "rule"
    if decomposition(op) is not None:
        return "decomposition"
    return "missing"


# Note [Coverage over the OpInfo database]
#     An ATen op without a rule in any registry would not appear in the ATen table, so a whole
#     missing family could hide. The first table lists every OpInfo of torch's op_db instead,
#     with the conformance suite's verdict per transform (tests/conformance: its SKIP list and
#     its expected-failure table, so this page goes stale, and its test fails, whenever that
#     table changes). "ours only": the OpInfo says torch has no forward-mode formula
#     (the OpInfo flags no forward AD) and our jvp computes on its first float64 sample; its values
#     are checked against finite differences by the family tests, not by the suite (which has
#     no oracle for it).
#     The compositions (vmap(vjp), jvp(vjp), vmap(jvp), vjp(vjp), vjp(jvp)) and vmap_dims
#     (in_dims / out_dims other than 0, nested vmap) get a column each (Note [Conformance
#     compositions]; vjp(jvp): Note [vjp(jvp) against finite differences]), and so does
#     torch's own autograd over ours: autograd(vjp), autograd(vmap), autograd(jvp) (Note
#     [Conformance of torch autograd over our transforms]).
OPINFO_TRANSFORMS = (
    "vmap",
    "vjp",
    "jvp",
    "vmap(vjp)",
    "jvp(vjp)",
    "vmap(jvp)",
    "vjp(vjp)",
    "vjp(jvp)",
    "vmap_dims",
    "autograd(vjp)",
    "autograd(vmap)",
    "autograd(jvp)",
)


def _conformance_modules():
    """conformance_harness, conformance_compositions, expected_failures (tests/conformance)."""
    import importlib

    folder = str(Path(__file__).resolve().parent.parent / "tests" / "conformance")
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        names = ("conformance_harness", "conformance_compositions", "expected_failures")
        return [importlib.import_module(n) for n in names]
    finally:
        if added:
            sys.path.remove(folder)


def _ours_only(op, harness, compositions) -> bool:
    """Whether our jvp computes on the op's first float64 sample (Note [Coverage over the
    OpInfo database])."""
    import warnings

    import functransforms as ft

    if torch.float64 not in op.supported_dtypes(harness.DEVICE):
        return False
    name = harness.full_name(op)
    try:
        sample = harness.take_samples(op, torch.float64, (name, "ours only"), True)[0]
        leaves, spec = harness._leaves(sample)
        f, diff = compositions._function(op, spec, leaves, sample)
        primals = tuple(leaves[k].detach() for k in diff)
        gen = torch.Generator().manual_seed(harness._seed_of(name, "ours only"))
        tangents = tuple(harness._randn_like(p, gen) for p in primals)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return bool(diff) and len(ft.jvp(f, primals, tangents)[1]) > 0
    except Exception:
        return False


def _opinfo_rows():
    harness, compositions, expected = _conformance_modules()
    table = expected.EXPECTED
    applicable = {t: set(harness.cases(t)) for t in OPINFO_TRANSFORMS}
    counts = {t: {} for t in OPINFO_TRANSFORMS}
    lines = []
    for name, op in sorted(harness.op_db().items()):
        cells = []
        for t in OPINFO_TRANSFORMS:
            kinds = [k for k in (harness.REAL, harness.COMPLEX) if (name, k) in applicable[t]]
            if name in harness.SKIP:
                cell, kind = "skip", "skip"
            elif not kinds:
                cell = kind = "—"
                if t == "jvp" and op.supports_autograd and not op.supports_forward_ad:
                    ours = _ours_only(op, harness, compositions)
                    cell = kind = "**ours only**" if ours else "— (torch has none)"
            else:
                bad = [(k, table.get((name, harness.transform_key(t, k)))) for k in kinds]
                bad = [c + ("" if k == harness.REAL else " (complex)") for k, c in bad if c]
                cell, kind = ("; ".join(bad), "fail") if bad else ("ok", "ok")
            counts[t][kind] = counts[t].get(kind, 0) + 1
            cells.append(cell)
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    summary = "\n".join(
        f"- **{t}**: " + ", ".join(f"{k}: {n}" for k, n in sorted(c.items()))
        for t, c in counts.items()
    )
    return summary, lines


def render() -> str:
    import functransforms  # noqa: F401
    from functransforms._compat import DOCS_TORCH, TORCH_MINOR
    from functransforms.autodiff import JVP_RULES, VJP_RULES
    from functransforms.batching import VMAP_RULES

    for registry in (VMAP_RULES, JVP_RULES, VJP_RULES):
        # every rule family (Note [Rule families load on first use]) and the rules of ops
        # torch defines on a lazy import
        registry.define_pending()
    ops = set(VMAP_RULES) | set(JVP_RULES) | set(VJP_RULES)
    rows = sorted(ops, key=str)
    counts = {"vmap": {}, "jvp": {}, "vjp": {}}
    lines = []
    for op in rows:
        v, j, r = _vmap_kind(op), _ad_kind(op, JVP_RULES), _ad_kind(op, VJP_RULES)
        for name, kind in (("vmap", v), ("jvp", j), ("vjp", r)):
            counts[name][kind] = counts[name].get(kind, 0) + 1
        lines.append(f"| `{op}` | {v} | {j} | {r} |")
    summary = "\n".join(
        f"- **{name}**: " + ", ".join(f"{k}: {n}" for k, n in sorted(c.items()))
        for name, c in counts.items()
    )
    op_summary, op_lines = _opinfo_rows()
    return (
        "# Operator coverage\n\n"
        f"Generated by `python -m functransforms.coverage` under torch {TORCH_MINOR} (a test "
        "fails when this file is stale; each supported torch has its page, docs/coverage.md is "
        f"torch {DOCS_TORCH}'s).\n"
        "\n## Every OpInfo of torch's op database\n\n"
        "One row per OpInfo of `torch.testing._internal.common_methods_invocations.op_db`, with "
        "the verdict of the conformance suite (tests/conformance, docs/conformance.md) per "
        "transform, real and complex dtypes together: *ok*: no expected failure (it passes, or "
        "the suite found nothing PyTorch itself computes); a failure category: its entry in "
        "tests/conformance/expected_failures.py; *skip*: skipped by the suite (random or "
        "uninitialized output); *—*: the OpInfo says torch does not support the transform; "
        "*vmap_dims*: vmap with in_dims / out_dims other than 0 and vmap of vmap; "
        "*autograd(vjp)*, *autograd(vmap)*, *autograd(jvp)*: torch's autograd over what our "
        "vjp, vmap and jvp return (double backward, backward through vmap, over jvp); "
        "**ours only**: torch has no forward-mode formula and our jvp computes (Note [Coverage "
        "over the OpInfo database] in functransforms/coverage.py).\n\n"
        f"{op_summary}\n\n"
        "| OpInfo | "
        + " | ".join(OPINFO_TRANSFORMS)
        + " |\n"
        + "|---" * (1 + len(OPINFO_TRANSFORMS))
        + "|\n"
        + "\n".join(op_lines)
        + "\n\n"
        "## ATen ops with a rule\n\n"
        "Rows: every ATen op with a rule in any registry. *rule*: a registered rule; *rule "
        "(pointwise)*: the one batching rule every op tagged `torch.Tag.pointwise` shares; "
        "*decomposition*: rewritten with `torch._decomp` and handled op by op; *fallback (loop)*: "
        "vmap's per-example loop (with a warning); *missing*: raises NotImplementedError. Ops not "
        "listed: vmap batches pointwise-tagged ops with the pointwise rule, tries a decomposition, "
        "then the loop; jvp/vjp try a decomposition, then raise (ops without floating outputs "
        f"need no derivative rule).\n\n{summary}\n\n"
        "| op | vmap | jvp | vjp |\n|---|---|---|---|\n" + "\n".join(lines) + "\n"
    )


def doc_path(minor=None) -> Path:
    """docs/coverage.md for the torch the docs are made with (``_compat.DOCS_TORCH``),
    docs/coverage-torch<minor>.md for another: rules, decompositions and the conformance
    verdicts differ between torch versions (Note [Supported torch versions])."""
    from functransforms._compat import DOCS_TORCH, TORCH_MINOR

    minor = minor or TORCH_MINOR
    name = "coverage.md" if minor == DOCS_TORCH else f"coverage-torch{minor}.md"
    return Path(__file__).resolve().parent.parent / "docs" / name


def main(argv=None):
    path = doc_path()
    path.write_text(render())
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
