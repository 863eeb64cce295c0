"""jit: trace a transformed function once per call signature into a graph of ATen ops and replay
it (public as ``functransforms.jit``, which loads this package on first access: Note [Lazy parts
of the package], functransforms/__init__.py).

Modules: ``_trace`` (the cache, tracing and replay: Notes [Trace and replay], [Jit fallbacks]),
``_signature`` (call signatures), ``_guards`` (Note [Replay guards]), ``_passes`` (graph
rewrites), ``_buffers`` (Note [Large buffers reused across calls]). Design:
docs/design/jit.md; user guide: docs/jit.md.
"""

from ._trace import jit

__all__ = ["jit"]
