"""vmap's batching rules, by op family. Importing this package registers them all."""

from . import (  # noqa: F401  (registration)
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
    views,
)
from ._registry import VMAP_RULES, register_vmap_rule
from ._tensor import BatchedTensor, VmapInterpreter

__all__ = ["VMAP_RULES", "BatchedTensor", "VmapInterpreter", "register_vmap_rule"]
