"""The transforms are ours: library code never uses torch's own transforms to implement one.

torch.func, torch.vmap, torch.autograd.grad/backward, Tensor.backward and torch.autograd.forward_ad
are the oracle in tests and the baseline in benchmarks only. The check reads the code (AST), so
comments and docstrings that name torch.func as the reference behaviour do not count.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ["functransforms", "autodiff", "batching", "linalg"]
FORBIDDEN = (
    "torch.func",
    "torch.vmap",
    "torch.autograd.grad",
    "torch.autograd.backward",
    "torch.autograd.forward_ad",
    "torch._functorch",
    "functorch",
)


def _dotted(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _uses(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Attribute):
            names.append(_dotted(node))
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [f"{node.module}.{a.name}" for a in node.names]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            # Tensor.backward(); `cls.backward` is a user autograd.Function's own staticmethod
            if node.func.attr == "backward" and _dotted(node.func.value) != "cls":
                names.append("Tensor.backward")
        for name in names:
            if name and (name == "Tensor.backward" or name.startswith(FORBIDDEN)):
                yield f"{path.relative_to(ROOT)}:{node.lineno}: {name}"


def test_library_code_never_calls_torchs_transforms():
    found = [
        u for folder in LIBRARY for p in sorted((ROOT / folder).rglob("*.py")) for u in _uses(p)
    ]
    assert not found, f"torch's own transforms used in library code: {found}"
