"""torch.compile and torch.export around and inside our transforms: the transform packages kept
off dynamo's trace, transform entry points run eagerly under compile, and export's pre-dispatch
failure restated."""

from __future__ import annotations

import functools
import os
import sys

import torch

from .. import _compat
from .levels import _raise_inside_torch_func

# Note [torch.compile inside our transforms]
#     ``ft.vmap(torch.compile(g))(x)`` runs the compiled ``g`` on our wrappers, and dynamo
#     compiles every Python frame it reaches, ours included: it inlined BatchedTensor's
#     ``__torch_function__`` and the pointwise fast path, guarded on what it saw and replayed
#     graphs over the wrapper's physical value. ``v.sin() * 2 + v.sum()`` came out wrong without
#     an error (the batched ``sum`` added unaligned), and ``vmap(grad(torch.compile(f)))`` died
#     in dynamo with a RecursionError. Our dispatch is Python that reads and rewraps wrappers, as
#     torch's own functorch and dispatch internals are, which dynamo never traces. So the
#     packages of the transforms (not ``linalg``, whose operator algebra compiles well) go on
#     dynamo's skip list: a compiled frame that calls into them, including an op on a wrapper,
#     graph-breaks and runs that call eagerly, which is always right. Registered at import when
#     dynamo is loaded, else at the first transform call after it is (a compiled function runs
#     inside a transform only after that transform's entry ran).
DYNAMO_KEPT_OUT: list = []  # [True] once our packages are on dynamo's skip list


def keep_dynamo_out() -> None:
    """Put the transform packages on dynamo's skip list (Note [torch.compile inside our
    transforms]); idempotent. Every module and subpackage of ``functransforms`` but
    ``linalg`` (a wheel nests batching/, autodiff/ and linalg/ inside it; a checkout keeps
    them beside it), and the folders of ``batching`` and ``autodiff`` wherever they are."""
    if DYNAMO_KEPT_OUT:
        return
    if _compat.being_imported("torch._dynamo") or _compat.being_imported(
        "torch._dynamo.trace_rules"
    ):
        return  # another thread is importing dynamo: importing its parts here could deadlock
    from importlib.util import find_spec  # finds the folders without importing (cold start)

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # functransforms/
    paths = [
        os.path.dirname(os.path.abspath(find_spec(f"functransforms.{name}").origin)) + "/"
        for name in ("batching", "autodiff")
    ]
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.endswith(".py"):
            paths.append(path)
        elif name not in ("linalg", "__pycache__") and os.path.isdir(path):
            paths.append(path + "/")
    _compat.dynamo_skip_paths(paths)
    DYNAMO_KEPT_OUT.append(True)  # last: a thread that sees it sees the paths in place


def eager_under_compile(fn):
    """Note [torch.compile around our transforms]: under ``torch.compile``, run ``fn`` (a
    transform's entry point) eagerly, as one graph break, instead of letting dynamo trace into
    the interpreters.

    Tracing our Python dispatch gave correct results but 10-20 graph breaks per composition and
    10-20 s of compilation for graphs of a few ops each; PyTorch has dynamo support built in,
    which a third-party library cannot have. Run eagerly, the transform costs what it costs
    outside compile, the code around it still compiles, and a function compiled *inside* a
    transform (``ft.grad(torch.compile(f))``) works as usual. Without dynamo imported nothing
    can be compiling, so the common path only checks ``sys.modules`` (and, with dynamo
    imported, ``torch.compiler.is_compiling()``, which is True only in a frame being traced).
    """
    disabled = []

    @functools.wraps(fn)
    def entry(*args, **kwargs):
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None and not DYNAMO_KEPT_OUT:
            keep_dynamo_out()
        if dynamo is None or not torch.compiler.is_compiling():  # True only while tracing
            if _compat.functorch_interpreter() is not None:  # not while dynamo traces: it
                _raise_inside_torch_func()  # would trace this call
            try:
                return fn(*args, **kwargs)
            except RuntimeError as e:
                raise_if_pre_dispatch(e)
                raise
        if not disabled:
            disabled.append(dynamo.disable(fn, recursive=True))
        try:
            return disabled[0](*args, **kwargs)
        except RuntimeError as e:
            raise_if_pre_dispatch(e)
            raise

    return entry


def raise_if_pre_dispatch(e: RuntimeError):
    """Note [Pre-dispatch tracing]: ``torch.export`` (non-strict) traces at torch's PreDispatch
    key, whose modes return NotImplemented for our wrappers, and torch then fails with "Unable
    to cast NotImplemented to Tensor" from inside the transform (only vmap's pointwise fast
    path, above the dispatcher, went through). That error, under such a trace, is restated."""
    if "Unable to cast NotImplemented" not in str(e) or not _compat.len_pre_dispatch_stack():
        return
    from functransforms.errors import TransformError

    raise TransformError(
        "torch.export cannot trace through functransforms' transforms: its pre-dispatch trace "
        "does not look inside tensor subclasses (our wrappers), and failed inside the "
        "transform. Expected: the transform outside the exported function. Do: export the "
        "model without the transform and apply the transform to the exported module "
        "(ep.module()), or trace the transformed function to a graph of plain ops with "
        "functransforms.jit / make_fx (without pre_dispatch)."
    ) from e
