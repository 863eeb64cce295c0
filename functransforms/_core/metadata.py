"""Metadata reads of wrappers whose class has a Python ``__torch_function__`` (BatchedTensor,
GradTensorInVmap): the accessors those classes use, and the reads the interpreters make of the
values they wrap."""

from __future__ import annotations

# the accessors keep torch's docstrings, whose examples (run by tests/package/test_doctests.py
# with this module's globals) name torch
import torch  # noqa: F401

from .. import _compat

# Note [Reading a wrapper's metadata]
#     A BatchedTensor defines a Python ``__torch_function__`` (Note [Pointwise fast path]), so
#     every metadata query on it (``x.shape``, ``x.dtype``, ``x.stride()``, ``x.is_conj()``)
#     is a Python call: ~1.2 us, ten times a plain tensor's. The interpreters query the values
#     they wrap, and under ``vmap(grad(f))`` or ``jacfwd`` those values are BatchedTensors: about
#     ten queries per op, 15% of its cost. So the interpreters query through ``metadata`` and
#     ``dtype_conj``, which for the classes in ``SLOW_METADATA`` read under
#     ``torch._C.DisableTorchFunctionSubclass``: that skips the Python handler, which does
#     nothing for metadata queries, so the answers are the same. Plain tensors are read directly
#     (entering the guard costs ~0.5 us, more than their four queries). Only queries go under
#     the guard, never ops: ops on a BatchedTensor may take the fast path.
#     Under the guard the queries call torch's C accessors directly (``TensorBase.shape`` ...):
#     BatchedTensor shadows the attributes with Python ones that enter the guard themselves
#     (Note [Metadata reads without __torch_function__]), and four nested guards cost 1 us more
#     than one.
SLOW_METADATA: set = set()  # wrapper classes with a Python __torch_function__ (BatchedTensor)
plain_metadata = _compat.DisableTorchFunctionSubclass


def no_tf_property(getset):
    """Note [Metadata reads without __torch_function__] (batching/_tensor.py): ``getset`` read
    with subclass torch functions disabled, for a wrapper class with a Python
    ``__torch_function__`` (the classes in ``SLOW_METADATA``)."""
    get = getset.__get__

    def read(self):
        with plain_metadata():
            return get(self)

    return property(read, doc=getset.__doc__)


def no_tf_method(method):
    """Note [Metadata reads without __torch_function__]: ``method`` called with subclass torch
    functions disabled."""

    def call(self, *args, **kwargs):
        with plain_metadata():
            return method(self, *args, **kwargs)

    call.__name__ = method.__name__
    call.__doc__ = method.__doc__
    return call


_TB = _compat.TensorBase


class PlainMetadata:
    """Note [Metadata reads without __torch_function__]: the metadata accessors of a wrapper class
    with a Python ``__torch_function__`` (BatchedTensor, GradTensorInVmap), read with subclass
    torch functions disabled. A mixin placed before the wrapper's tensor base."""

    dtype = no_tf_property(_TB.dtype)
    shape = no_tf_property(_TB.shape)
    device = no_tf_property(_TB.device)
    ndim = no_tf_property(_TB.ndim)
    is_conj = no_tf_method(_TB.is_conj)
    is_neg = no_tf_method(_TB.is_neg)
    stride = no_tf_method(_TB.stride)
    size = no_tf_method(_TB.size)
    dim = no_tf_method(_TB.dim)
    is_complex = no_tf_method(_TB.is_complex)
    is_floating_point = no_tf_method(_TB.is_floating_point)


_shape = _compat.TensorBase.shape.__get__
_stride = _compat.TensorBase.stride
_dtype = _compat.TensorBase.dtype.__get__
_device = _compat.TensorBase.device.__get__
_is_conj = _compat.TensorBase.is_conj


def metadata(t):
    """``(shape, stride, dtype, device)`` of tensor ``t`` (Note [Reading a wrapper's metadata])."""
    if type(t) in SLOW_METADATA:
        with plain_metadata():
            return _shape(t), _stride(t), _dtype(t), _device(t)
    return t.shape, t.stride(), t.dtype, t.device


def metadata_conj(t):
    """``(shape, stride, dtype, device, is_conj)`` of tensor ``t``, one guard for all five
    (Note [Reading a wrapper's metadata]): what a wrapper of ``t`` needs, and the check
    before it."""
    if type(t) in SLOW_METADATA:
        with plain_metadata():
            return _shape(t), _stride(t), _dtype(t), _device(t), _is_conj(t)
    return t.shape, t.stride(), t.dtype, t.device, t.is_conj()


def dtype_conj(t):
    """``(dtype, is_conj)`` of tensor ``t`` (Note [Reading a wrapper's metadata])."""
    if type(t) in SLOW_METADATA:
        with plain_metadata():
            return _dtype(t), _is_conj(t)
    return t.dtype, t.is_conj()


def dtype_of(t):
    """``t.dtype`` (Note [Reading a wrapper's metadata])."""
    if type(t) in SLOW_METADATA:
        with plain_metadata():
            return _dtype(t)
    return t.dtype


def dtypes_of(a, b):
    """``(a.dtype, b.dtype)`` under at most one guard (Note [Reading a wrapper's metadata]):
    the backward sweep compares each cotangent's dtype with its input's, both BatchedTensors
    under ``vmap(grad(f))``."""
    if type(a) in SLOW_METADATA or type(b) in SLOW_METADATA:
        with plain_metadata():
            return _dtype(a), _dtype(b)
    return a.dtype, b.dtype


def is_floating(t) -> bool:
    """True for floating and complex dtypes: the values that can carry derivatives."""
    dtype = t.dtype
    return dtype.is_floating_point or dtype.is_complex
