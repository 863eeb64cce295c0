"""vmap's batching rules, by op family (each family loads on first use: Note [Rule families
load on first use], functransforms/_core/ops.py)."""

import sys as _sys

# Note [A clone shadowing the package]: Python started in the folder that *contains* a clone
# named functransforms/ imports that folder (no __init__.py) as a namespace package ahead of an
# editable install's finder; then this subpackage loads without the real functransforms. (From
# the repository root, `import batching` loads this folder under its own name: said apart.)
if __name__ != "functransforms.batching":
    raise ImportError(
        f"{__name__}: this folder is functransforms.batching, found here as a top-level module "
        "because Python was started in the repository root. Do: `import functransforms.batching`."
    )
if getattr(_sys.modules.get("functransforms"), "__file__", None) is None:
    raise ImportError(
        f"functransforms: the folder {_sys.modules['functransforms'].__path__[0]} (a clone of "
        "the repository) shadows the installed package as an empty namespace package. Do: start "
        "Python from another directory, or install with the README's command (`pip install -e "
        "<clone> --config-settings editable_mode=strict`), which imports from any directory."
    )

# The rule families load on first use (Note [Rule families load on first use],
# functransforms/_core/ops.py); these are needed by every vmap: the wrapper classes, the derived
# pointwise rule, random draws.
from . import (  # noqa: F401
    _nested,
    elementwise,
    random,
    views,
)
from ._registry import VMAP_RULES, register_vmap_rule
from ._tensor import BatchedTensor, VmapInterpreter

VMAP_RULES.load_lazily()  # Note [Rule families load on first use] (functransforms/_core/ops.py)

__all__ = ["VMAP_RULES", "BatchedTensor", "VmapInterpreter", "register_vmap_rule"]
