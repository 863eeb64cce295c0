"""Type aliases of the public API's signatures (PyTorch's argument names and shapes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

# A pytree of tensors: a tensor, or tuples / lists / dicts (and registered nodes) of them.
PyTree = Any
# Which positional inputs a derivative is taken with respect to.
ArgNums = int | tuple[int, ...]
# vmap's in_dims / out_dims: an int, None (not mapped) or a tree prefix of the inputs / outputs.
Dims = int | None | tuple[Any, ...] | list[Any] | dict[str, Any]
Randomness = Literal["error", "different", "same"]
Func = Callable[..., Any]
Tensor = torch.Tensor

__all__ = ["ArgNums", "Dims", "Func", "PyTree", "Randomness", "Tensor"]
