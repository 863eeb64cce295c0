"""JAX's ``linear_transpose`` and ``checkpoint`` (rematerialization), built from our vjp, jvp
and custom functions: no new machinery."""

from __future__ import annotations

import contextlib
import functools
import sys
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
    inputs are kept). Forward mode and vmap see ``func`` unchanged. Random draws from torch's
    default generators (dropout) are replayed: the recomputation sees the generator state of
    the forward call, and leaves the global state as it found it (Note [Replaying random draws
    in checkpoint]). Inside ``ft.jit``'s trace ``func`` is not rematerialized (the graph
    records ops, not generator states), so a replay keeps the forward's values.

    Args:
        func: a function of positional tensor arguments returning a pytree of tensors.

    Example:
        >>> import torch, functransforms as ft
        >>> block = ft.checkpoint(lambda x: torch.tanh(x).exp().sum())
        >>> x = torch.tensor([0.0, 1.0])
        >>> torch.allclose(ft.grad(block)(x), ft.grad(lambda x: torch.tanh(x).exp().sum())(x))
        True
    """

    def jvp_rule(primals, tangents):
        return jvp(func, tuple(primals), tuple(tangents))

    @functools.wraps(func)
    def remat(*args):
        # Note [Replaying random draws in checkpoint]: the backward pass re-runs ``func``; a
        # dropout inside it would draw a fresh mask, so the gradient would belong to another
        # function than the value (silently). As torch.utils.checkpoint (preserve_rng_state),
        # the default generators' states at this call are kept beside the inputs and restored
        # for the recomputation, inside fork_rng so the global state is not advanced twice.
        # One custom function per call: each call has its own state (a block called in a
        # loop), and it stays out of the residuals, which vmap batches as tensors.
        # half imported by another thread: no trace
        jit = sys.modules.get("functransforms._jit._trace")
        if getattr(getattr(jit, "_tracing", None), "active", False):
            # jit records ATen ops, not generator states: a recomputation would replay as a
            # second, independent draw. The traced graph keeps the forward's values instead
            # (no rematerialization inside jit; the values are the same).
            return func(*args)
        state = _rng_state()

        def fwd(*a):
            return func(*a), a  # keep only the inputs

        def bwd(a, ct):
            # run the forward again, this time recording it
            with _replayed_rng(state), _foreign_vmaps_hidden(a):
                _, vjp_fn = vjp(func, *a)
            return vjp_fn(ct)

        call = custom_vjp(func)
        call.defvjp(fwd, bwd)
        call.defjvp(jvp_rule)
        return call(*args)

    return remat


@contextlib.contextmanager
def _foreign_vmaps_hidden(inputs):
    """Note [Replaying random draws in checkpoint], continued: the backward pass may run under
    vmap levels the forward call never saw (``jacrev`` vmaps the vjp over cotangents). They
    batch the cotangents, not the inputs, so they must not batch (or refuse, under
    randomness='error') the replayed draws: while the forward re-runs, every vmap level that
    batches none of the inputs is dead (its wrappers are not touched: the inputs do not hold
    them, and the cotangents enter afterwards)."""
    from ._core.levels import TransformTensor, interpreter_stack

    batching = sys.modules.get("functransforms.batching._tensor")
    # vmap never ran (or another thread's first vmap is importing it): no level to hide
    VmapInterpreter = getattr(batching, "VmapInterpreter", None)
    if VmapInterpreter is None:
        yield
        return
    seen = set()
    todo = [x for x in pt.tree_leaves(inputs) if isinstance(x, TransformTensor)]
    while todo:
        w = todo.pop()
        seen.add(id(w._interp))
        for name in ("_value", "_primal", "_tangent"):
            inner = getattr(w, name, None)
            if isinstance(inner, TransformTensor):
                todo.append(inner)
    hidden = [
        i
        for i in interpreter_stack()
        if isinstance(i, VmapInterpreter) and i.alive and id(i) not in seen
    ]
    for i in hidden:
        i.alive = False
    try:
        yield
    finally:
        for i in hidden:
            i.alive = True


def _rng_state():
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if cuda else None)


@contextlib.contextmanager
def _replayed_rng(state):
    cpu, cuda = state
    devices = list(range(len(cuda))) if cuda is not None else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        yield


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
    from ._core.levels import TransformTensor

    while isinstance(tensor, TransformTensor):
        tensor = tensor._value if hasattr(tensor, "_value") else tensor._primal
        if not recurse:
            break
    return tensor
