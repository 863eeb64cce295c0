"""Composite torch kernels that cannot run on the transforms' wrappers, replaced by ours.

Note [Composite kernels of ours]
    A CompositeImplicitAutograd op is decomposed by its C++ kernel above ``__torch_dispatch__``,
    so no rule of ours ever sees it whole. Most such kernels are harmless: their pieces reach
    the rules. A few are not, because the C++ kernel does something with a wrapper that only
    works on a real tensor: the recurrent kernels write a transformed value into a buffer they
    keep computing with in C++ (Note [RNN kernels under transforms], ``_core/rnn.py``);
    ``_pad_packed_sequence`` copies into a buffer it made, the same way; ``tensor_split`` with
    a tensor of split points reads that tensor's memory directly (a wrapper has none: torch's
    internal "data is not allocated" error). The autodiff wrappers
    have no ``__torch_function__`` (its cost on every op), so these ops get a kernel of ours at
    the ``PythonTLSSnapshot`` dispatch key, the one key above autograd that wrapper
    subclasses carry: torch calls it only when an argument is a tensor subclass with
    ``__torch_dispatch__`` or a dispatch mode is on (never for plain tensors), and only for
    the ops in ``KERNELS`` (no cost for other programs). With a transform's wrapper among the
    arguments it runs our kernel; otherwise (a fake tensor, another library's subclass or
    mode) it hands the call on to torch's kernel unchanged. Registered once per process, at
    the first transform call (``_core._install_entry``).
"""

from __future__ import annotations

import torch

from .. import _compat
from ..errors import DataDependentError
from . import rnn as _rnn
from .levels import TransformTensor

aten = torch.ops.aten


def read_sizes(t, what):
    """The values of an integer tensor that sets output shapes (split points, lengths, batch
    sizes), read through the transforms: a Dual/GradTensor hands over its primal (integers
    are constants); batched under vmap, each example would get outputs of its own shapes,
    which one batched result cannot hold (functorch refuses these too)."""
    if isinstance(t, TransformTensor) and t._interp.name == "vmap":
        raise DataDependentError(
            f"{t._interp.call}: {what} is a batched tensor: each example would get outputs of "
            "its own shapes, which one batched result cannot hold (PyTorch's own vmap raises too). "
            "Expected: Python ints or an unbatched tensor. Do: pass it from outside vmap "
            "(in_dims=None), or compute with masks (torch.where) instead."
        )
    return t.tolist()


def _tensor_split(self, tensor_indices_or_sections, dim=0):
    """torch's kernel, reading the split points through the transforms (``read_sizes``)."""
    points = tensor_indices_or_sections
    what = "torch.tensor_split(x, indices_or_sections, dim): the tensor of split points"
    values = read_sizes(points, what)
    if points.dim() > 1 or points.dtype != torch.long:
        return None  # torch's kernel raises its own error
    return torch.tensor_split(self, values, dim)


def _pad_packed_sequence(data, batch_sizes, batch_first, padding_value, total_length):
    """torch's unpacking (``nn.utils.rnn.pad_packed_sequence``) out of place: the kernel
    copies each run of time steps into a buffer it made (InplaceError under the transforms).
    Each step's rows, padded to the largest batch, stacked; then the padding steps up to
    ``total_length``. The lengths come from torch's kernel on a plain stand-in (integers)."""
    sizes = read_sizes(batch_sizes, "pad_packed_sequence: the batch_sizes")
    if data.dim() < 1 or type(sizes) is not list:
        return None  # torch's kernel raises its own error
    # on the CPU whatever the default device: torch's kernel takes CPU batch sizes
    stand_in = torch.zeros(sum(sizes), dtype=torch.int8, device="cpu")
    _, lengths = aten._pad_packed_sequence.default(
        stand_in, torch.tensor(sizes, device="cpu"), False, 0, total_length
    )  # torch's checks (total_length too short) and its lengths
    features = tuple(data.shape[1:])
    steps = []
    for piece in torch.split(data, sizes):
        missing = sizes[0] - piece.shape[0]
        if missing:
            fill = torch.full(
                (missing, *features), padding_value, dtype=data.dtype, device=data.device
            )
            piece = torch.cat([piece, fill])
        steps.append(piece)
    out = torch.stack(steps)
    if total_length > len(sizes):
        shape = (total_length - len(sizes), sizes[0], *features)
        fill = torch.full(shape, padding_value, dtype=data.dtype, device=data.device)
        out = torch.cat([out, fill])
    return (out.transpose(0, 1) if batch_first else out), lengths


KERNELS = dict(_rnn.KERNELS)
KERNELS["tensor_split.tensor_indices_or_sections"] = _tensor_split
KERNELS["_pad_packed_sequence"] = _pad_packed_sequence


def _transformed(args):
    for a in args:
        if isinstance(a, TransformTensor):
            return True
        if type(a) is list or type(a) is tuple:
            for b in a:
                if isinstance(b, TransformTensor):
                    return True
    return False


def _kernel(op, impl):
    after = _compat.dispatch_keyset_full_after(_compat.DispatchKey.PythonTLSSnapshot)

    def kernel(keyset, *args, **kwargs):
        if _transformed(args) or _transformed(kwargs.values()):
            out = impl(*args, **kwargs)
            if out is not None:
                return out
        return op.redispatch(keyset & after, *args, **kwargs)  # torch's own kernel

    return kernel


_LIB = None


def install():
    """Register the kernels of ``KERNELS`` (Note [Composite kernels of ours]); once."""
    global _LIB
    if _LIB is not None:
        return
    _LIB = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - a key no torch kernel uses
    for name, impl in KERNELS.items():
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet), overload or "default")
        _LIB.impl(name, _kernel(op, impl), "PythonTLSSnapshot", with_keyset=True)
