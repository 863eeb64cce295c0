"""The library's own error conditions. Each names the call, what was expected and what was
received."""

from __future__ import annotations


class TransformError(RuntimeError):
    """Base class of the errors raised by a transform about how it was used."""


class EscapedTracerError(TransformError):
    """A wrapper tensor was used after the transform that created it returned."""


class DataDependentError(TransformError):
    """A batched value was read as a Python value (``.item()``, ``bool(x)``) under vmap."""


class RandomnessError(TransformError):
    """A random op ran under ``vmap(..., randomness='error')``."""


class InplaceError(TransformError):
    """A transformed value was written in place into a tensor the transform does not see."""


class FallbackWarning(UserWarning):
    """vmap ran an op through the per-example loop because it has no batching rule."""


class JitFallbackWarning(UserWarning):
    """jit runs a call signature eagerly because its trace would not replay faithfully."""


class UnboundAxisError(NameError):
    """A collective (``psum``, ``axis_index``, ...) named an axis that no enclosing ``vmap``/
    ``pmap`` binds (JAX raises ``NameError`` for this too)."""
