"""JAX's ``linear_transpose`` and ``checkpoint`` (rematerialization), built from our vjp, jvp
and custom functions: no new machinery."""

from __future__ import annotations

import functools
from typing import Any

import torch

from . import _pytree as pt
from ._ad import jvp, vjp
from ._custom import custom_vjp
from ._typing import Func, PyTree


def linear_transpose(func: Func, *primals: PyTree) -> Func:
    """The transpose of a linear function (JAX's ``linear_transpose``).

    Args:
        func: a function linear in its inputs (pytrees of tensors).
        *primals: example inputs; only their structure, shapes and dtypes are used.

    Returns:
        ``transpose_fn(cotangent) -> tuple`` with one entry per primal: for ``y = A x`` it computes
        ``A^H c`` (the conjugate transpose for complex maps, torch's vjp convention).

    ``func`` must be linear. Checked: ``func(0) == 0`` (an affine map raises ``ValueError``). Not
    checked: a nonlinear ``func`` with ``func(0) == 0`` gives the transpose of its derivative
    at 0.

    Example:
        >>> import torch, functransforms as ft
        >>> A = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
        >>> t = ft.linear_transpose(lambda x: A @ x, torch.zeros(2))
        >>> t(torch.tensor([1.0, 0.0, 0.0]))
        (tensor([1., 2.]),)
    """
    zeros = pt.tree_map(torch.zeros_like, primals)
    out, vjp_fn = vjp(func, *zeros)
    for leaf in pt.tree_leaves(out):
        # one host read per output (not per op); meta tensors have no values to check
        if leaf.device.type != "meta" and bool((leaf != 0).any()):
            raise ValueError(
                f"linear_transpose({getattr(func, '__name__', 'func')}, ...): the function is "
                "not linear: it maps 0 to a nonzero value (an affine map?). Expected a linear "
                "function. Do: subtract the offset, f(x) - f(0)."
            )
    return vjp_fn


def checkpoint(func: Func) -> Func:
    """Rematerialize ``func`` in reverse mode (JAX's ``checkpoint`` / ``remat``).

    Under ``grad``/``vjp``, ``func`` runs forward without recording its intermediate values; the
    backward pass runs it again to differentiate it, trading compute for memory (only the
    inputs are kept). Forward mode and vmap see ``func`` unchanged.

    Args:
        func: a function of positional tensor arguments returning a pytree of tensors.

    Example:
        >>> import torch, functransforms as ft
        >>> block = ft.checkpoint(lambda x: torch.tanh(x).exp().sum())
        >>> x = torch.tensor([0.0, 1.0])
        >>> torch.allclose(ft.grad(block)(x), ft.grad(lambda x: torch.tanh(x).exp().sum())(x))
        True
    """

    @custom_vjp
    @functools.wraps(func)
    def remat(*args):
        return func(*args)

    def fwd(*args):
        return func(*args), args  # keep only the inputs

    def bwd(args, ct):
        _, vjp_fn = vjp(func, *args)  # run the forward again, this time recording it
        return vjp_fn(ct)

    def jvp_rule(primals, tangents):
        return jvp(func, tuple(primals), tuple(tangents))

    remat.defvjp(fwd, bwd)
    remat.defjvp(jvp_rule)
    return remat


def debug_unwrap(tensor: Any, *, recurse: bool = True) -> Any:
    """The value inside a transform's wrapper tensor, for debugging (PyTorch's
    ``debug_unwrap``): a ``vmap`` wrapper gives its physical value (with the batch dim), a
    ``grad``/``jvp`` wrapper its primal; ``recurse=True`` unwraps every level. Plain tensors and
    other values are returned as they are.

    Example:
        >>> import torch, functransforms as ft
        >>> shapes = []
        >>> _ = ft.vmap(lambda x: shapes.append(ft.debug_unwrap(x).shape) or x)(torch.ones(4, 3))
        >>> shapes                                        # the physical [B, D]
        [torch.Size([4, 3])]
    """
    from ._core import TransformTensor

    while isinstance(tensor, TransformTensor):
        tensor = tensor._value if hasattr(tensor, "_value") else tensor._primal
        if not recurse:
            break
    return tensor
