"""Forward- and reverse-mode derivative rules, by op family. Importing registers them all."""

import sys as _sys

# Note [A clone shadowing the package]: Python started in the folder that *contains* a clone
# named functransforms/ imports that folder (no __init__.py) as a namespace package ahead of an
# editable install's finder; then this subpackage loads without the real functransforms.
if getattr(_sys.modules.get("functransforms"), "__file__", None) is None:
    raise ImportError(
        "functransforms: the folder functransforms/ in the current directory (a clone of the "
        "repository) shadows the installed package. Do: start Python from another directory, or "
        "reinstall with `pip install -e <clone> --config-settings editable_mode=compat` (the "
        "clone's root goes on sys.path and the real package wins), or `pip install <clone>`."
    )

from . import (  # noqa: F401  (registration)
    collectives,
    convolution,
    elementwise,
    fft,
    indexing,
    linalg,
    linalg_eig,
    linalg_lu,
    linalg_qr,
    nn,
    normalization,
    pooling,
    random,
    reductions,
    scans,
    sorting,
    special,
    views,
)
from ._registry import JVP_RULES, VJP_RULES, register_jvp_rule, register_vjp_rule
from .forward import DualTensor, JvpInterpreter
from .reverse import GradInterpreter, GradTensor

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
