"""Private torch APIs are used only through functransforms/_compat.py (a torch upgrade then
breaks in one file), and every name there resolves on the installed torch."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

from functransforms import _compat

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("functransforms", "autodiff", "batching", "linalg")
# a dotted path from ``torch`` with a component starting with one underscore (dunders such as
# ``torch.__version__`` are public)
PRIVATE = re.compile(r"\btorch(?:\.\w+)*?\._(?!_)\w*(?:\.\w+)*")
# Files allowed to name private torch APIs, each with the reason.
ALLOWED = {
    "functransforms/_compat.py": "the one module that does",
}


_SKIPPED = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1)}


def _code(path):
    """The source without comments and string literals (docstrings may name torch internals)."""
    kept = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in _SKIPPED or not tok.string.strip():
            continue
        kept.append((tok.start[0], tok.string))
    lines = {}
    for n, s in kept:
        lines.setdefault(n, []).append(s)
    return {n: " ".join(v).replace(" . ", ".") for n, v in lines.items()}


def _private_uses():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in ALLOWED:
                continue
            for n, line in sorted(_code(path).items()):
                for m in PRIVATE.finditer(line):
                    yield f"{rel}:{n}: {m.group(0)}"
                m = re.match(r"from (torch(?:\.\w+)*) import (.*)", line)
                if m:
                    for name in m.group(2).replace("(", "").replace(")", "").split(","):
                        if name.strip().startswith("_"):
                            yield f"{rel}:{n}: from {m.group(1)} import {name.strip()}"


def test_private_torch_apis_only_in_compat():
    uses = list(_private_uses())
    assert not uses, (
        "private torch APIs used outside functransforms/_compat.py; add the name there (with "
        "the torch versions it was checked on) and use it through _compat:\n" + "\n".join(uses)
    )


def test_the_scanner_finds_private_uses(tmp_path):
    # guards the test above against passing because its pattern matches nothing
    line = "with torch._C._DisableTorchDispatch(): x = torch.utils._pytree.tree_map(f, y)"
    found = [m.group(0) for m in PRIVATE.finditer(line)]
    assert found == ["torch._C._DisableTorchDispatch", "torch.utils._pytree.tree_map"]
    assert not PRIVATE.search("torch.__version__, torch.ops.aten.sin.default, torch.Tensor")
    p = tmp_path / "m.py"
    p.write_text(
        '"""torch._C in a docstring"""\n# torch._C in a comment\nk = torch._C.DispatchKey\n'
    )
    assert [bool(PRIVATE.search(s)) for s in _code(p).values()] == [True]


def test_every_compat_name_resolves():
    for name in _compat.__all__:
        assert getattr(_compat, name) is not None, name
    # the lazily imported ones
    assert _compat.decomposition_table()
    assert _compat.is_fake_tensor(_compat.torch_pytree.tree_leaves([1])[0]) is False
    mode = _compat.fake_tensor_mode(allow_fallback_kernels=True)
    with _compat.tracing_context(mode):
        pass
    import torch

    _, dtype = _compat.elementwise_dtypes(torch.ones(1, dtype=torch.float32), 2.0)
    assert dtype == torch.float32
