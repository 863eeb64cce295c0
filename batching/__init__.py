"""vmap's batching rules, by op family. Importing this package registers them all."""

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
    _nested,  # noqa: F401  (NestedBatchedTensor, before the first transform call)
    collectives,
    convolution,
    elementwise,
    fft,
    indexing,
    linalg,
    nn,
    normalization,
    pooling,
    random,
    reductions,
    scans,
    sorting,
    views,
)
from ._registry import VMAP_RULES, register_vmap_rule
from ._tensor import BatchedTensor, VmapInterpreter

__all__ = ["VMAP_RULES", "BatchedTensor", "VmapInterpreter", "register_vmap_rule"]
