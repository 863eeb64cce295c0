"""Large buffers of a replayed graph in transparent huge pages.

Note [Large buffers in huge pages]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Per-sample gradients are large: the tutorial CNN's fc1 weight gradient at B=64 is
[64, 128, 9216] floats, 302 MB, a fresh buffer on every call. glibc maps a buffer that size
afresh each time (anything above its 32 MB mmap threshold) and the kernel then faults it in
4 KB page by 4 KB page: 74k faults, ~130 ms of a ~240 ms call, where the multiply writing the
values takes ~30 ms. The same buffer advised for transparent huge pages (``madvise(...,
MADV_HUGEPAGE)`` before anything touches it) faults in 2 MB at a time: ~35 ms for the write,
faults included (``benchmarks/bench_core.py``, the CNN rows; the kernel's default THP mode,
"madvise", grants huge pages only to advised memory).

jit knows every buffer's size and layout when it traces, so a replay can allocate the large
ones itself (``torch.empty_strided``, then the advice; an ordinary torch storage that torch
frees as always) and have the op write into them:
- replayed op by op, an op whose ``out=`` kernel is the functional one's own (pointwise ops,
  the matmul family) runs as that ``out=`` overload into the advised buffer: the same kernel
  on the same layout, bit-identical. When autograd records the op (grad mode on and an
  argument requiring grad), ``out=`` would refuse: the functional op runs, as traced.
- under inductor, a large output's buffer becomes an extra input of the compiled graph,
  which writes the output into it (``copy_`` into a graph input: inductor fuses the
  computation into the store), and the call passes a fresh advised buffer.
Only where it pays and cannot change a result: CPU, static shapes, buffers of at least 32 MB
(always a fresh mapping, so the advice reaches untouched memory), Linux with THP in
"madvise" mode ("always" needs no advice; "never" grants none).
"""

from __future__ import annotations

import copy
import ctypes
import operator
import sys

import torch

from . import _compat

aten = torch.ops.aten
_Tensor = torch.Tensor

# glibc's largest mmap threshold: a freed buffer at least this large was unmapped, so the
# next one is fresh pages (smaller ones come back from the heap already faulted in).
LARGE_BYTES = 32 << 20
_HUGE = 2 << 20  # the x86-64 / arm64 (4 KB base pages) transparent huge page
_MADV_HUGEPAGE = 14
_MATMULS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default}

_madvise = None  # libc's madvise, or False where huge pages cannot be advised


def _libc_madvise():
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux"):
            try:
                with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
                    mode = f.read()
                if "[madvise]" in mode:
                    fn = ctypes.CDLL(None, use_errno=True).madvise
                    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                    fn.restype = ctypes.c_int
                    _madvise = fn
            except (OSError, AttributeError):
                pass
    return _madvise


def empty_huge(size, stride, dtype):
    """``torch.empty_strided`` on the CPU, its 2 MB-aligned interior advised for huge pages."""
    t = torch.empty_strided(size, stride, dtype=dtype)
    start = t.data_ptr()
    end = start + t.untyped_storage().nbytes()
    lo, hi = -(-start // _HUGE) * _HUGE, end // _HUGE * _HUGE
    if hi > lo:
        _madvise(lo, hi - lo, _MADV_HUGEPAGE)  # a refusal only costs the speed-up
    return t


def large_layout(val):
    """(size, stride, dtype) of a traced value worth a huge-page buffer, else None."""
    if not isinstance(val, _Tensor) or val.layout != torch.strided or val.device.type != "cpu":
        return None
    if any(type(d) is not int for d in (*val.shape, *val.stride())):
        return None  # symbolic
    if val.numel() * val.element_size() < LARGE_BYTES or not _dense(val):
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


def enabled() -> bool:
    return bool(_libc_madvise())


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


def into_huge(op, out_op, layout):
    """A replay step: ``op(*args, **kwargs)`` written into a fresh huge-page buffer."""
    size, stride, dtype = layout

    def run(*args, **kwargs):
        if torch.is_grad_enabled() and any(
            isinstance(a, _Tensor) and a.requires_grad for a in args
        ):
            return op(*args, **kwargs)  # autograd records it: out= would refuse
        return out_op(*args, **kwargs, out=empty_huge(size, stride, dtype))

    return run


def replay_target(node):
    """What the op-by-op replay calls for ``node``: an ``into_huge`` step, or None."""
    layout = node.meta.get("large_layout")
    if layout is None or not enabled() or not isinstance(node.target, _compat.OpOverload):
        return None
    out = _out_overload(node.target)
    return None if out is None else into_huge(node.target._op, out._op, layout)


# ------------------------------------------------------------------------------------------
# Under inductor


def with_output_buffers(gm, roots, any_requires_grad: bool):
    """``gm`` rewritten to write its large fresh outputs into extra trailing inputs, and how
    to call it: ``(gm, None)`` when there is nothing to rewrite, else ``(new_gm, plan)`` for
    ``call_with_buffers``. The new graph returns the other outputs only: the caller's buffer
    (viewed as the traced output) is the output. Returned from the graph instead, inductor
    would compute it into a buffer of its own and copy that into ours."""
    if any_requires_grad or not enabled():
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
    graph.eliminate_dead_code(is_impure_node=_impure)
    graph.lint()
    plan = ([b.meta["large_layout"] for b in bases], taken, len(outs))
    return torch.fx.GraphModule(gm, graph), plan


def _impure(node) -> bool:
    t = node.target
    if isinstance(t, _compat.OpOverload):
        return t._schema.is_mutable or torch.Tag.nondeterministic_seeded in t.tags
    return node.is_impure()


def call_with_buffers(compiled, plan):
    """The runner of a graph made by ``with_output_buffers``: fresh huge-page buffers in, the
    outputs put back in their places (each a view of its buffer with the traced layout)."""
    layouts, taken, n = plan

    def output(buf, view):
        if (tuple(buf.shape), buf.stride(), 0) == view:
            return buf
        return buf.as_strided(*view)

    def run(*ts):
        bufs = [empty_huge(*layout) for layout in layouts]
        rest = iter(compiled(*ts, *bufs))
        return [
            output(bufs[taken[i][0]], taken[i][1]) if i in taken else next(rest) for i in range(n)
        ]

    return run
