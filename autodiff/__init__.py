"""Forward- and reverse-mode derivative rules, by op family (each family loads on first use:
Note [Rule families load on first use], functransforms/_core/ops.py)."""

import sys as _sys

# Note [A clone shadowing the package]: Python started in the folder that *contains* a clone
# named functransforms/ imports that folder (no __init__.py) as a namespace package ahead of an
# editable install's finder; then this subpackage loads without the real functransforms. (From
# the repository root, `import autodiff` loads this folder under its own name: said apart.)
if __name__ != "functransforms.autodiff":
    raise ImportError(
        f"{__name__}: this folder is functransforms.autodiff, found here as a top-level module "
        "because Python was started in the repository root. Do: `import functransforms.autodiff`."
    )
if getattr(_sys.modules.get("functransforms"), "__file__", None) is None:
    raise ImportError(
        f"functransforms: the folder {_sys.modules['functransforms'].__path__[0]} (a clone of "
        "the repository) shadows the installed package as an empty namespace package. Do: start "
        "Python from another directory, or install with the README's command (`pip install -e "
        "<clone> --config-settings editable_mode=strict`), which imports from any directory."
    )

# The rule families load on first use (Note [Rule families load on first use],
# functransforms/_core/ops.py): `from . import elementwise` imports one explicitly.
from . import _fastpath  # noqa: F401  (fills reverse.GRAD_FAST: F.linear under vmap(grad))
from ._registry import JVP_RULES, VJP_FORWARD, VJP_RULES, register_jvp_rule, register_vjp_rule
from .forward import DualTensor, JvpInterpreter
from .reverse import GradInterpreter, GradTensor

for _registry in (JVP_RULES, VJP_RULES, VJP_FORWARD):
    _registry.load_lazily()  # Note [Rule families load on first use] (functransforms/_core/ops.py)

__all__ = [
    "JVP_RULES",
    "VJP_RULES",
    "DualTensor",
    "GradInterpreter",
    "GradTensor",
    "JvpInterpreter",
    "register_jvp_rule",
    "register_vjp_rule",
]
