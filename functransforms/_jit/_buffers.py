"""Large buffers of a replayed graph, reused across calls.

Note [Large buffers reused across calls]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Per-sample gradients are large: the tutorial CNN's fc1 weight gradient at B=64 is
[64, 128, 9216] floats, 302 MB, a fresh buffer on every call of eager code. glibc maps a
buffer that size afresh each time (anything above its 32 MB mmap threshold: smaller freed
buffers come back from the heap, already in memory) and the kernel then faults it in 4 KB page
by 4 KB page: ~130 ms of a ~240 ms call, where the multiply writing the values takes ~30 ms.
functorch, ``torch.compile`` and hand-written code all pay it (benchmarks/bench_core.py).

jit knows every buffer's size and layout when it traces, so a replay can hand an op a buffer
that is already in memory: the one the previous call returned, once the caller has dropped
it. A jitted function keeps, for each result of at least 32 MB (the memory of a returned
tensor; never intermediates, which kept all together could outgrow the graph's own peak),
the storages of the last two calls (two: in ``g = jitted(x)`` the previous ``g`` is still
alive during the call), and a call reuses one that nothing else holds any more (its
storage's use count is 1: no tensor, view, numpy array, autograd graph or storage object
refers to it), else allocates. One signature's buffers at a time: the replay of another
signature that writes large buffers releases them, and ``cache_clear()`` releases them all.
This is what a caching allocator does (torch's CUDA one keeps freed blocks the same way),
limited to these buffers; a caller's tensor is never written while the caller holds it.
- Replayed op by op, an op whose ``out=`` kernel is its own (pointwise ops, the matmul family)
  runs as that ``out=`` overload into the buffer: the same kernel on the same layout,
  bit-identical. When autograd records the op (grad mode on and an argument requiring grad),
  ``out=`` would refuse: the functional op runs, as traced.
- Under inductor, a large output's buffer is an extra input of the compiled graph, which
  writes the output into it (``copy_`` into a graph input: inductor fuses the computation
  into the store); the result is that buffer, with the traced output's sizes and strides.
Only where it cannot change a result: CPU, static shapes, dense layouts.

Rejected: advising fresh buffers for transparent huge pages (``madvise(MADV_HUGEPAGE)``, 2 MB
pages, ~500x fewer faults). Alone in a loop it wrote the 302 MB in ~35 ms, but interleaved
with other large allocations (any real program) a call took 35 to 860 ms, median ~140: on a
virtual machine freed 2 MB blocks go back to the host (free page reporting), and faulting
them in again costs more than the 4 KB pages it saves.
"""

from __future__ import annotations

import copy
import operator
import threading

import torch

from .. import _compat

aten = torch.ops.aten
_Tensor = torch.Tensor

# glibc's largest mmap threshold: a freed buffer at least this large was unmapped, so the
# next one is fresh pages (smaller ones come back from the heap already faulted in).
LARGE_BYTES = 32 << 20
_CPU = torch.device("cpu")  # explicit: `with torch.device(...)` around a call sets the default
_KEPT = 2  # storages kept per buffer: the caller's last result, and one to write into
_MATMULS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default}


def large_layout(val):
    """(size, stride, dtype) of a traced value worth reusing, else None."""
    if not isinstance(val, _Tensor) or val.layout != torch.strided or val.device.type != "cpu":
        return None
    if any(type(d) is not int for d in (*val.shape, *val.stride())):
        return None  # symbolic
    if val.numel() * val.element_size() < LARGE_BYTES or not _dense(val):
        return None
    if val.is_conj() or val.is_neg() or val.requires_grad:
        return None
    return (tuple(val.shape), tuple(val.stride()), val.dtype)


def _dense(val) -> bool:
    """Non-overlapping and dense: the storage holds exactly the elements, no gaps."""
    dims = sorted((st, sz) for sz, st in zip(val.shape, val.stride()) if sz != 1)
    expect = 1
    for st, sz in dims:
        if st != expect:
            return False
        expect *= sz
    return True


class Spares:
    """The large buffers a jitted function keeps for its next calls (one per Jitted).

    Each kept buffer is a private alias (a tensor of our own on the storage) and the storage's
    address, whose use count is 1 when nothing but the alias refers to it. Never through the
    storage's Python object (``untyped_storage()``): once made, that object keeps a reference
    for the storage's lifetime, and it is the same object a caller would hold. (A caller who
    made it leaves the count above 1 for good: that buffer is simply not reused.)"""

    def __init__(self):
        self._lock = threading.Lock()  # two threads must never take the same storage
        self._graph = None  # the graph (signature) whose buffers are kept
        self._kept = {}  # slot -> [(alias, storage address)], oldest first

    def take(self, graph, slot, layout):
        """An empty tensor of ``layout`` on a storage nobody else holds."""
        size, stride, dtype = layout
        with self._lock:
            if graph is not self._graph:
                self._kept = {}  # another signature ran last: its buffers go
                self._graph = graph
            kept = self._kept.setdefault(slot, [])
            for i, item in enumerate(kept):
                if _compat.storage_use_count(item[1]) == 1:  # only our alias holds it
                    kept.append(kept.pop(i))
                    # made inside the lock: the count is 2 before another thread looks
                    return torch.empty((0,), dtype=dtype, device=_CPU).set_(item[0])
            t = torch.empty_strided(size, stride, dtype=dtype, device=_CPU)
            kept.append((t.detach(), _compat.storage_address(t)))
            if len(kept) > _KEPT:
                del kept[0]
            return t

    def clear(self):
        with self._lock:
            self._kept = {}
            self._graph = None


# ------------------------------------------------------------------------------------------
# Replayed op by op


def _out_overload(op):
    """The ``out=`` overload whose kernel is ``op``'s own, or None."""
    if not (torch.Tag.pointwise in op.tags or op in _MATMULS):
        return None
    schema = op._schema
    if schema.is_mutable or len(schema.returns) != 1 or schema.returns[0].alias_info:
        return None
    if torch.Tag.nondeterministic_seeded in op.tags:
        return None
    out = getattr(op.overloadpacket, "out", None)
    if out is None or not _compat.has_cpu_kernel(out):
        return None  # none, or generated: it would run op, then copy the result
    outs = [a for a in out._schema.arguments if a.is_out]
    if len(outs) != 1 or outs[0].name != "out":
        return None

    # Same arguments as the functional overload, plus out: the call can be forwarded as is.
    def args(s):
        return [(a.name, str(a.type), a.kwarg_only) for a in s.arguments if not a.is_out]

    if args(out._schema) != args(schema):
        return None
    return out


def _into(op, out_op, take):
    """A replay step: ``op(*args, **kwargs)`` written into a kept buffer."""

    def run(*args, **kwargs):
        if torch.is_grad_enabled() and any(
            isinstance(a, _Tensor) and a.requires_grad for a in args
        ):
            return op(*args, **kwargs)  # autograd records it: out= would refuse
        return out_op(*args, **kwargs, out=take())

    return run


def replay_target(node, spares, graph):
    """What the op-by-op replay calls for ``node``: a step writing into a kept buffer, or
    None (the op itself)."""
    layout = node.meta.get("large_layout")
    if layout is None or not isinstance(node.target, _compat.OpOverload):
        return None
    out = _out_overload(node.target)
    if out is None:
        return None
    slot = node.name
    return _into(node.target._op, out._op, lambda: spares.take(graph, slot, layout))


# ------------------------------------------------------------------------------------------
# Under inductor


def with_output_buffers(gm, roots, any_requires_grad: bool, is_impure):
    """``gm`` rewritten to write its large fresh outputs into extra trailing inputs, and how
    to call it: ``(gm, None)`` when there is nothing to rewrite, else ``(new_gm, plan)`` for
    ``call_with_buffers``. The new graph returns the other outputs only: the caller's buffer
    (viewed as the traced output) is the output. Returned from the graph instead, inductor
    would compute it into a buffer of its own and copy that into ours. ``is_impure`` is the
    graph passes' test of a node dead code elimination must keep (given by the caller:
    _passes.py imports this module)."""
    if any_requires_grad:
        return gm, None
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = out_node.args[0]
    if not isinstance(outs, (list, tuple)):
        return gm, None
    bases, taken = [], {}  # base nodes; output position -> (base index, output view)
    for i, arg in enumerate(outs):
        view = arg.meta.get("out_view") if isinstance(arg, torch.fx.Node) else None
        base = roots.get(arg, arg) if view is not None else None
        if base is None or base.op != "call_function" or base.target is operator.getitem:
            continue
        if base.meta.get("large_layout") is None:
            continue
        if base not in bases:
            bases.append(base)
        taken[i] = (bases.index(base), view)
    if not bases:
        return gm, None
    graph = copy.deepcopy(gm.graph)
    mapping = dict(zip(gm.graph.nodes, graph.nodes))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    for k, base in enumerate(bases):
        if anchor is None:
            with graph.inserting_before(next(iter(graph.nodes))):
                buf = anchor = graph.placeholder(f"large_out_{k}")
        else:
            with graph.inserting_after(anchor):
                buf = anchor = graph.placeholder(f"large_out_{k}")
        with graph.inserting_after(mapping[base]):
            graph.call_function(aten.copy_.default, (buf, mapping[base]))
    new_out = next(n for n in graph.nodes if n.op == "output")
    kept = [a for i, a in enumerate(new_out.args[0]) if i not in taken]
    new_out.args = (kept,)
    graph.eliminate_dead_code(is_impure_node=is_impure)
    graph.lint()
    plan = ([b.meta["large_layout"] for b in bases], taken, len(outs))
    return torch.fx.GraphModule(gm, graph), plan


def call_with_buffers(compiled, plan, spares, graph):
    """The runner of a graph made by ``with_output_buffers``: kept buffers in, the outputs put
    back in their places (each its buffer, or a view of it with the traced layout)."""
    layouts, taken, n = plan

    def output(buf, view):
        if (tuple(buf.shape), buf.stride(), 0) == view:
            return buf
        return buf.as_strided(*view)

    def run(*ts):
        bufs = [spares.take(graph, k, layout) for k, layout in enumerate(layouts)]
        rest = iter(compiled(*ts, *bufs))
        return [
            output(bufs[taken[i][0]], taken[i][1]) if i in taken else next(rest) for i in range(n)
        ]

    return run
