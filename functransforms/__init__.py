"""functransforms: composable function transforms for PyTorch (grad, vjp, jvp, vmap, ...)."""

from . import batching  # noqa: F401  (registers the batching rules)
from ._vmap import vmap

__all__ = ["vmap"]
__version__ = "0.1.0"
