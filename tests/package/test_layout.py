"""The source layout docs/design/rules.md promises, checked: the vmap rule of an op and its
derivative rules are registered in family files of the same name under batching/ and autodiff/,
and every family file is listed in docs/design/rules.md's layout section."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Modules of the two packages that hold machinery, not rules of one op family.
INFRASTRUCTURE = {
    "__init__",
    "_registry",
    "_util",
    "_tensor",
    "_fastpath",
    "_nested",
    "_torch_graph",
    "forward",
    "reverse",
}


def _family_files(package):
    return {
        p.stem: p for p in sorted((ROOT / package).glob("*.py")) if p.stem not in INFRASTRUCTURE
    }


def _op_name(node):
    """``aten.sum.dim_IntList`` -> ``"sum.dim_IntList"`` (None for anything else)."""
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "aten"
    ):
        return f"{node.value.attr}.{node.attr}"
    return None


class _Registered(ast.NodeVisitor):
    """The ops a module names at import time: decorator arguments, table rows and calls of
    ``def_<family>`` helpers. Function and lambda bodies are skipped: an op called inside a rule
    is used there, not registered."""

    def __init__(self):
        self.ops = set()

    def visit_FunctionDef(self, node):
        for d in node.decorator_list:
            self.visit(d)

    def visit_Lambda(self, node):
        pass

    def visit_Call(self, node):
        # aten.x.y(...) at import time computes a value; its arguments may still name ops
        if _op_name(node.func) is None:
            self.visit(node.func)
        for a in (*node.args, *(k.value for k in node.keywords)):
            self.visit(a)

    def visit_Attribute(self, node):
        name = _op_name(node)
        if name is not None:
            self.ops.add(name)
        else:
            self.generic_visit(node)


def _registered_ops(path):
    v = _Registered()
    v.visit(ast.parse(path.read_text()))
    return v.ops


def _owners(package):
    owners = {}
    for stem, path in _family_files(package).items():
        family = stem.split("_")[0]  # linalg_lu.py continues the linalg family
        for op in _registered_ops(path):
            owners.setdefault(op, set()).add(family)
    return owners


def test_an_ops_vmap_rule_and_derivative_share_a_family_file():
    vmap_owner, ad_owner = _owners("batching"), _owners("autodiff")
    misplaced = {
        op: (sorted(vmap_owner[op]), sorted(ad_owner[op]))
        for op in vmap_owner.keys() & ad_owner.keys()
        if not vmap_owner[op] & ad_owner[op]
    }
    assert not misplaced, (
        "ops whose vmap rule (batching/F.py) and derivative (autodiff/G.py) are in files of "
        f"different families; move one of them so that F == G: {misplaced}"
    )


def test_the_checker_sees_registrations():
    # guards the test above against passing because it finds nothing
    ad, vm = _owners("autodiff"), _owners("batching")
    assert "sort.default" in ad and ad["sort.default"] == {"sorting"}
    assert vm["sort.default"] == {"sorting"}
    assert vm["cumsum.default"] == ad["cumsum.default"] == {"scans"}
    assert "index_put.default" in ad and ad["index_put.default"] == {"indexing"}


def test_every_family_file_is_listed_in_the_design_docs():
    design = (ROOT / "docs" / "design" / "rules.md").read_text()
    section = design[design.index("## Source layout") :]
    section = section[: section.index("\n## ", 1)]
    for package in ("batching", "autodiff"):
        for family in _family_files(package):
            listed = f"`{family}.py`" in section or f"`{family.split('_')[0]}_*.py`" in section
            assert listed, (
                f"{package}/{family}.py is not listed in docs/design/rules.md's '## Source layout'"
            )
