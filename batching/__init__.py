"""vmap's batching rules, by op family. Importing this package registers them all."""

from . import elementwise, fft, indexing, linalg, nn, random, reductions, views  # noqa: F401  (registration)
from ._registry import VMAP_RULES, register_vmap_rule
from ._tensor import BatchedTensor, VmapInterpreter

__all__ = ["VMAP_RULES", "BatchedTensor", "VmapInterpreter", "register_vmap_rule"]
