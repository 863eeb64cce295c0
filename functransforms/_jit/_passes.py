"""``jit``'s graph rewrites: the clean-up every recorded graph gets before it is cached
(dead code, constant folding, cheaper equivalents of what the transforms emit), and the
rewrites that pay off only in the graph handed to inductor. docs/design/jit.md.
"""

from __future__ import annotations

import operator
import warnings

import torch

from .. import _compat
from ._buffers import large_layout

_Tensor = torch.Tensor
_RANDOM = torch.Tag.nondeterministic_seeded
aten = torch.ops.aten


def _impure(node) -> bool:
    t = node.target
    if isinstance(t, _compat.OpOverload):
        return t._schema.is_mutable or _RANDOM in t.tags  # a dead draw still advances the RNG
    return node.is_impure()


def _roots(graph):
    """Map each node to the node that owns its memory (views and in-place results alias)."""
    root = {}
    for node in graph.nodes:
        r = node
        t = node.target
        if node.op == "call_function":
            if t is operator.getitem:
                r = root.get(node.args[0], node)
            elif isinstance(t, _compat.OpOverload) and node.args:
                first = node.args[0]
                alias = t._schema.returns and t._schema.returns[0].alias_info is not None
                if alias and isinstance(first, torch.fx.Node):
                    r = root.get(first, first)
                elif isinstance(first, (list, tuple)) and alias and first:
                    r = root.get(first[0], first[0])
        root[node] = r
    return root


_LIKE = {
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}


def _fold_constants(gm, dynamic: bool) -> int:
    """Evaluate subgraphs built only from factory ops once; return how many nodes it replaced.

    Captured tensors (``get_attr``) are never folded: they are live references, so an in-place
    update of a weight after tracing is seen by the next replay. Nothing that is written in
    place, or returned (or a view of either), is folded: a folded tensor is shared by every
    replay.
    """
    graph = gm.graph
    root = _roots(graph)
    written = set()
    for node in graph.nodes:
        t = node.target
        if node.op == "call_function" and isinstance(t, _compat.OpOverload):
            for a, arg in zip(t._schema.arguments, node.args):
                if a.alias_info is not None and a.alias_info.is_write:
                    for n in arg if isinstance(arg, (list, tuple)) else (arg,):
                        if isinstance(n, torch.fx.Node):
                            written.add(root.get(n, n))
            for k, arg in node.kwargs.items():
                if isinstance(arg, torch.fx.Node) and k == "out":
                    written.add(root.get(arg, arg))
        elif node.op == "output":
            for n in node.all_input_nodes:
                written.add(root.get(n, n))
    foldable = {}
    for node in graph.nodes:
        t = node.target
        if node.op != "call_function" or root[node] in written:
            continue
        if t is operator.getitem:
            if node.args[0] in foldable:
                foldable[node] = None
            continue
        if not isinstance(t, _compat.OpOverload) or _RANDOM in t.tags or t._schema.is_mutable:
            continue
        inputs = node.all_input_nodes
        if t in _LIKE and not dynamic:
            ok = (
                bool(node.args)
                and isinstance(node.args[0], torch.fx.Node)
                and all(i in foldable for i in inputs[1:])
            )
        else:
            ok = all(i in foldable for i in inputs)  # no inputs at all: a factory
        if ok:
            foldable[node] = None
    if not foldable:
        return 0
    env = {}
    with _compat.disable_current_modes(), torch.no_grad():
        for node in foldable:
            if node.target in _LIKE and not dynamic:
                like = node.args[0].meta.get("val")
                if not isinstance(like, _Tensor):
                    continue
                like = torch.empty_strided(
                    like.shape, like.stride(), dtype=like.dtype, device=like.device
                )
                args = (like,) + tuple(node.args[1:])
            else:
                if any(i not in env for i in node.all_input_nodes):
                    continue
                args = torch.fx.node.map_arg(node.args, env.__getitem__)
            kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
            env[node] = node.target(*args, **kwargs)
    replaced = 0
    for node, value in env.items():
        if not isinstance(value, _Tensor):
            continue
        if all(u in env for u in node.users):
            continue  # an inner node of a folded subgraph
        name = f"_folded_{replaced}"
        setattr(gm, name, value)
        with graph.inserting_before(node), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fx's owning-module check misses setattr'd tensors
            attr = graph.get_attr(name)
        node.replace_all_uses_with(attr)
        replaced += 1
    return replaced


def _broadcast_result_strides(shape, *operands) -> tuple[int, ...]:
    """The strides of a pointwise op's fresh result, as TensorIterator lays it out on CPU
    and CUDA: dimensions ordered by the operands' strides, the first operand deciding,
    broadcast dimensions ignored, ties to the smaller size (TensorIterator's
    ``reorder_dimensions``). Written out because a meta-tensor op loads torch's Python meta
    kernels, which import torch._dynamo and sympy (~1 s on a first trace). Callers compare
    the result with the layout they need and keep the original op when it differs.
    ``operands``: (shape, strides) pairs whose shapes broadcast to ``shape``."""
    ndim = len(shape)
    strides = []
    for op_shape, op_strides in operands:
        offset = ndim - len(op_shape)
        s = [0] * offset + [
            0 if size == 1 and shape[offset + i] != 1 else op_strides[i]
            for i, size in enumerate(op_shape)
        ]
        strides.append(s)

    def should_swap(dim0, dim1):
        for s in strides:
            s0, s1 = s[dim0], s[dim1]
            if s0 == 0 or s1 == 0:
                continue
            if s0 != s1:
                return 1 if s0 > s1 else -1
            if shape[dim0] > shape[dim1]:
                return 1
        return 0

    perm = list(range(ndim - 1, -1, -1))  # perm[0]: the fastest-moving dimension
    for i in range(1, ndim):
        dim1 = i
        for dim0 in range(i - 1, -1, -1):
            c = should_swap(perm[dim0], perm[dim1])
            if c > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif c < 0:
                break
    result = [0] * ndim
    step = 1
    for d in perm:
        result[d] = step
        step *= shape[d]
    return tuple(result)


def _outer_products(gm) -> int:
    """``bmm``/``mm`` with a contraction of length 1 is an outer product: rewrite it as a
    broadcasting ``mul`` (bit-identical: one product per element, nothing summed), 3-4x
    faster on CPU. vmap of ``x[:, None] @ y[None]`` (per-sample weight gradients) makes them."""
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (aten.bmm.default, aten.mm.default):
            a, b = (x.meta.get("val") if isinstance(x, torch.fx.Node) else None for x in node.args)
            out = node.meta.get("val")
            if not all(isinstance(t, _Tensor) for t in (a, b, out)):
                continue
            if any(type(d) is not int for t in (a, b) for d in (*t.shape, *t.stride())):
                continue  # symbolic shapes: leave it
            if a.shape[-1] != 1 or a.dtype != b.dtype or a.is_complex():
                continue
            # Operands of one shape (a 1x1 result) or an empty result take TensorIterator's
            # other layout paths: leave them.
            if a.shape == b.shape or out.numel() == 0:
                continue
            # Same layout as the matmul's result, or later views could fail.
            mul_strides = _broadcast_result_strides(
                tuple(out.shape), (a.shape, a.stride()), (b.shape, b.stride())
            )
            if mul_strides == out.stride():
                node.target = aten.mul.Tensor
                n += 1
    return n


_ADD_INTO = {aten.bmm.default: aten.baddbmm.default, aten.mm.default: aten.addmm.default}


def _fused_bias(gm) -> int:
    """``add(bmm(a, b), c)`` -> ``baddbmm(c, a, b)`` (and ``mm`` -> ``addmm``) when ``c``
    broadcasts to the product and nothing else reads it: the GEMM starts from ``c`` instead of
    writing the product and reading it back for the add. vmap of ``F.linear`` (an ensemble of
    MLPs) emits the two ops. Rounding as torch's own ``F.linear`` (``addmm``): the bias joins
    inside the GEMM's accumulation, not after it."""
    n = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.add.Tensor or node.kwargs:
            continue
        for prod, c in (node.args, node.args[::-1]):
            if not (isinstance(prod, torch.fx.Node) and isinstance(c, torch.fx.Node)):
                continue
            if prod.target not in _ADD_INTO or len(prod.users) != 1:
                continue
            p, cv, out = (x.meta.get("val") for x in (prod, c, node))
            if not all(isinstance(t, _Tensor) for t in (p, cv, out)):
                continue
            if any(type(d) is not int for t in (p, cv) for d in t.shape):
                continue  # symbolic shapes: leave it
            if cv.dtype != p.dtype or p.is_complex() or cv.dim() > p.dim():
                continue
            if out.shape != p.shape or out.stride() != p.stride():
                continue  # c does not broadcast to the product without growing it
            node.target = _ADD_INTO[prod.target]
            node.args = (c, *prod.args)
            gm.graph.erase_node(prod)
            n += 1
            break
    return n


_RESHAPES = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.expand.default,
    aten.reshape.default,
    aten.alias.default,
}


def _noop_views(gm) -> int:
    """Drop views to the same shape and strides (vmap's batching of matmul emits
    ``expand``/``view`` pairs that change nothing): each costs a dispatch per replay. Kept
    when returned (the caller may rely on a fresh alias) or used by a mutating op (metadata
    mutations such as ``t_`` would reach the base)."""
    n = 0
    outputs = set()
    for node in gm.graph.nodes:
        if node.op == "output":
            outputs = set(node.all_input_nodes)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _RESHAPES or node in outputs:
            continue
        src = node.args[0]
        a, b = src.meta.get("val"), node.meta.get("val")
        if not (isinstance(a, _Tensor) and isinstance(b, _Tensor)):
            continue
        if any(type(d) is not int for d in (*a.shape, *b.shape)):
            continue  # symbolic shapes: equality would add a guard
        if (
            a.shape != b.shape
            or a.stride() != b.stride()
            or a.storage_offset() != b.storage_offset()
        ):
            continue
        if any(
            isinstance(u.target, _compat.OpOverload) and u.target._schema.is_mutable
            for u in node.users
        ):
            continue
        node.replace_all_uses_with(src)
        n += 1
    return n


# Views that only rearrange the same elements (never ``detach``, ``alias`` of a lifted
# constant or other ops returning an alias with a meaning of its own for autograd).
_SHAPE_VIEWS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.transpose.int,
    aten.t.default,
    aten.permute.default,
    aten.expand.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
}


def _is_view(node) -> bool:
    return (
        node.op == "call_function"
        and node.target in _SHAPE_VIEWS
        and isinstance(node.args[0], torch.fx.Node)
    )


def _static_layout(val):
    if not isinstance(val, _Tensor) or val.layout != torch.strided:
        return None
    layout = (tuple(val.shape), tuple(val.stride()), val.storage_offset(), val.dtype)
    if not all(type(d) is int for d in (*layout[0], *layout[1], layout[2])):
        return None  # symbolic
    return layout


def _outputs_and_mutated(graph):
    outputs, mutated = set(), set()
    for node in graph.nodes:
        if node.op == "output":
            outputs = set(node.all_input_nodes)
        elif isinstance(node.target, _compat.OpOverload) and node.target._schema.is_mutable:
            mutated.update(node.all_input_nodes)
    return outputs, mutated


def _view_round_trips(gm) -> int:
    """A chain of views that ends with the layout it started from (``transpose(transpose(x,
    1, 2), 1, 2)``: vmap's batching rules move the batch dim out and back) is its source.
    Same memory, same layout: every reader sees the same elements; gradients through an
    identity are the identity. Kept when returned (the caller may rely on a fresh alias) or
    read by a mutating op (metadata mutations would reach the source)."""
    n = 0
    outputs, mutated = _outputs_and_mutated(gm.graph)
    for node in list(gm.graph.nodes):
        if not _is_view(node) or node in outputs or node in mutated:
            continue
        want = _static_layout(node.meta.get("val"))
        if want is None:
            continue
        src = node.args[0]
        while True:
            if _static_layout(src.meta.get("val")) == want:
                node.replace_all_uses_with(src)
                n += 1
                break
            if not _is_view(src):
                break
            src = src.args[0]
    return n


def _keepdim_sums(gm) -> int:
    """``view(sum(x, dims, keepdim=True), shape)`` where the view only drops the kept size-1
    dims is ``sum(x, dims)``: the same reduction kernel over the same elements, written
    contiguous in both cases (bit-identical). vmap of a reduction keeps the dims and views
    them away. Only when the view is the sum's one reader and is neither returned nor
    written."""
    n = 0
    outputs, mutated = _outputs_and_mutated(gm.graph)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (
            aten.view.default,
            aten._unsafe_view.default,
        ):
            continue
        s = node.args[0]
        if s.op != "call_function" or s.target is not aten.sum.dim_IntList or len(s.users) != 1:
            continue
        if node in outputs or node in mutated or s.kwargs.get("dtype") is not None:
            continue
        args = list(s.args) + [None] * (3 - len(s.args))
        x, dims, keepdim = args[:3]
        keepdim = keepdim if keepdim is not None else s.kwargs.get("keepdim", False)
        xv, sv, out = (v.meta.get("val") for v in (x, s, node))
        if not keepdim or not dims or not all(_static_layout(v) for v in (xv, sv, out)):
            continue
        dropped = {d % xv.dim() for d in dims}
        shape = [sz for i, sz in enumerate(xv.shape) if i not in dropped]
        if list(out.shape) != shape or not out.is_contiguous() or not sv.is_contiguous():
            continue
        s.args = (x, list(dims), False)
        s.kwargs = {}
        s.meta["val"] = out
        node.replace_all_uses_with(s)
        gm.graph.erase_node(node)
        n += 1
    return n


def _common_subexpressions(gm) -> int:
    """Two calls of one pure op on the same arguments compute the same value: the second
    reads the first's (``hessian`` computes ``cos(x)`` in both of its passes, vmap's rules
    transpose the same weight several times). Not for random or mutating ops, nor when
    either result's memory is written later (through a view or in place), nor for a
    duplicate that is returned (two outputs would become one tensor)."""
    root = _roots(gm.graph)
    written = set()
    outputs = set()
    for node in gm.graph.nodes:
        t = node.target
        if node.op == "output":
            outputs = set(node.all_input_nodes)
        elif isinstance(t, _compat.OpOverload) and t._schema.is_mutable:
            for a, arg in zip(t._schema.arguments, node.args):
                if a.alias_info is not None and a.alias_info.is_write:
                    for x in arg if isinstance(arg, (list, tuple)) else (arg,):
                        if isinstance(x, torch.fx.Node):
                            written.add(root.get(x, x))
            if isinstance(node.kwargs.get("out"), torch.fx.Node):
                written.add(root.get(node.kwargs["out"], node.kwargs["out"]))

    def key(a):
        if isinstance(a, torch.fx.Node):
            return a
        if isinstance(a, (list, tuple)):
            return (type(a), tuple(key(x) for x in a))
        if isinstance(a, float):
            return (float, a.hex())
        if isinstance(a, (bool, int, str, type(None), torch.dtype, torch.device)):
            return (type(a), a)
        raise TypeError  # a value we do not compare: no merging

    seen = {}
    n = 0
    for node in list(gm.graph.nodes):
        t = node.target
        if node.op != "call_function" or not isinstance(t, _compat.OpOverload):
            continue
        if t._schema.is_mutable or _RANDOM in t.tags or node in outputs:
            continue
        if root.get(node, node) in written:
            continue
        try:
            k = (t, key(node.args), tuple((a, key(v)) for a, v in node.kwargs.items()))
        except TypeError:
            continue
        first = seen.setdefault(k, node)
        if first is not node:
            node.replace_all_uses_with(first)
            gm.graph.erase_node(node)
            n += 1
    return n


def _identity_products(gm) -> int:
    """``mm(I, B)`` / ``mm(A, I)`` with a folded identity matrix ``I`` is a contiguous copy of
    the other factor. jacfwd pushes the rows of an identity basis through the function, so
    the first matmul with a weight multiplies by ``I`` (256 -> 256: 17M multiply-adds per call
    for a copy). Equal to the product for finite values (each element is ``1 * b`` plus exact
    zeros); where the other factor holds inf/nan the copy keeps it in place, as the Jacobian
    itself does, instead of spreading nan along the row/column as ``0 * inf`` would."""
    eye = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target.startswith("_folded_"):
            v = getattr(gm, node.target)
            if v.dim() == 2 and v.shape[0] == v.shape[1] and not v.is_complex():
                ident = torch.eye(v.shape[0], dtype=v.dtype, device=v.device)
                if torch.equal(v, ident):
                    eye[node] = v
    n = 0
    for node in list(gm.graph.nodes) if eye else ():
        if node.op != "call_function" or node.target is not aten.mm.default:
            continue
        a, b = node.args
        other = b if a in eye else a if b in eye else None
        if not isinstance(other, torch.fx.Node):
            continue
        with gm.graph.inserting_before(node):
            copy = gm.graph.call_function(
                aten.clone.default, (other,), {"memory_format": torch.contiguous_format}
            )
        copy.meta.update(node.meta)
        node.replace_all_uses_with(copy)
        gm.graph.erase_node(node)
        n += 1
    return n


_ABSOLUTE_OFFSET = {
    aten.as_strided.default,
    aten.as_strided_.default,
    aten.as_strided_scatter.default,
}


def _offset_readers(node) -> bool:
    """Whether an op reading absolute storage offsets (``as_strided``) uses ``node``'s memory,
    directly or through views: it would read another tensor's storage if ``node`` became a
    view of one."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if u.target in _ABSOLUTE_OFFSET:
                return True
            if _is_view(u) or u.target is operator.getitem:
                todo.append(u)
    return False


def _scalar_identities(gm) -> int:
    """Products and powers by a scalar that change no bit: ``pow(x, 1)`` and ``mul(x, 1)``
    are ``x``; ``mul(x, -1)`` is ``neg(x)``; ``mul(neg(x), s)`` is ``mul(x, -s)`` (negation
    is exact and rounding is symmetric, so ``(-x) * s`` and ``x * (-s)`` round to the same
    float). A transform's derivative rules make these: the vjp of ``x ** 2`` multiplies by
    ``2 * x ** 1``, of ``a - b`` by ``-1``, and the inner SGD step of MAML scales that by the
    learning rate (MAML's replay: 9 of 179 ops). Nothing else: folding ``(x * a) * b`` into
    ``x * (a * b)`` rounds differently in general. A dropped node is kept when it is returned
    or written (the caller, or the write, needs its own memory), when its source is written
    later (the node's value was taken before), or when the dtype or layout would change."""
    root = _roots(gm.graph)
    outputs, mutated = _outputs_and_mutated(gm.graph)
    written = {root.get(n, n) for n in mutated}

    def scalar(a):
        return type(a) in (int, float)

    def same_as(node, src):
        # shape, strides and dtype; not the storage offset, which make_fx's values do not
        # keep for views (a split's pieces all read 0): hence no absolute-offset reader below
        a, b = src.meta.get("val"), node.meta.get("val")
        la, lb = _static_layout(a), _static_layout(b)
        if la is None or lb is None or (la[0], la[1], la[3]) != (lb[0], lb[1], lb[3]):
            return False
        return b.requires_grad == a.requires_grad and not _offset_readers(node)

    n = 0
    for node in list(gm.graph.nodes):
        t = node.target
        if node.op != "call_function" or node.kwargs or len(node.args) != 2:
            continue
        x, s = node.args
        if not (isinstance(x, torch.fx.Node) and scalar(s)):
            continue
        val = node.meta.get("val")
        if not isinstance(val, _Tensor) or not (val.is_floating_point() or val.is_complex()):
            continue
        if node in outputs or node in written:
            continue
        if t in (aten.pow.Tensor_Scalar, aten.mul.Tensor) and s == 1:
            if root.get(x, x) not in written and same_as(node, x):
                node.replace_all_uses_with(x)
                gm.graph.erase_node(node)
                n += 1
            continue
        if t is not aten.mul.Tensor:
            continue
        if s == -1 and _static_layout(x.meta.get("val")) is not None:
            if x.meta["val"].dtype == val.dtype:
                node.target, node.args = aten.neg.default, (x,)
                n += 1
                continue
        if x.op == "call_function" and x.target is aten.neg.default and len(x.users) == 1:
            src = x.args[0]
            sv = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
            if isinstance(sv, _Tensor) and sv.dtype == val.dtype:
                node.args = (src, -s)
                gm.graph.erase_node(x)
                n += 1
    return n


def _clean(gm, dynamic: bool, replay: bool = True, autograd: bool = False):
    """The clean-up of every recorded graph. ``replay``: the graph is replayed op by op, not
    compiled (a compiler fuses the bias add into its own kernels: it gets the plain ops).
    ``autograd``: torch's autograd records the replay (grad mode, an input or captured
    tensor requiring grad): common subexpressions and view round trips are kept, since
    merging two reads, or removing nodes from torch's graph, changes the order in which its
    backward accumulates gradients into a tensor read twice (same values, other roundings)."""
    _outer_products(gm)
    _noop_views(gm)
    if not dynamic:
        if not autograd:
            _common_subexpressions(gm)
            _view_round_trips(gm)
            _scalar_identities(gm)
        _keepdim_sums(gm)
    _fold_constants(gm, dynamic)
    _identity_products(gm)
    gm.graph.eliminate_dead_code(is_impure_node=_impure)
    if replay:
        _fused_bias(gm)  # after DCE: the no-op views between the product and the add are gone
    gm.graph.lint()
    if not dynamic:
        _record_output_views(gm)
        if replay:
            _python_bindings(gm)  # Note [Replay through Python bindings]
    for node in gm.graph.nodes:  # real-mode vals would keep every intermediate alive
        if not dynamic:
            node.meta.pop("val", None)
        node.meta.pop("tensor_meta", None)
    gm.recompile()
    # Attributes the graph no longer reads (folded-away inputs) are dropped.
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name in list(vars(gm)):
        if name.startswith(("_tensor_constant", "_folded_")) and name not in used:
            delattr(gm, name)


def _record_output_views(gm) -> None:
    """Note [Large buffers reused across calls]: what the values would tell, kept after they
    are dropped. On each returned tensor, its (size, stride, storage offset): a graph that
    writes a large output into a kept buffer returns it as this view of the buffer. On the
    node owning a returned tensor's memory, if large, the buffer's layout. Only outputs:
    the memory kept between calls is what the caller got back, never intermediates (kept,
    all of them together could outgrow the graph's own peak)."""
    root = _roots(gm.graph)
    for node in gm.graph.nodes:
        if node.op == "output" and isinstance(node.args[0], (list, tuple)):
            for arg in node.args[0]:
                val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
                if not isinstance(val, _Tensor) or val.layout != torch.strided:
                    continue
                view = (tuple(val.shape), tuple(val.stride()), val.storage_offset())
                if not all(type(d) is int for d in (*view[0], *view[1])):
                    continue  # symbolic
                arg.meta["out_view"] = view
                base = root.get(arg, arg)
                if base.op == "call_function" and base.target is not operator.getitem:
                    layout = large_layout(base.meta.get("val"))
                    if layout is not None:
                        base.meta["large_layout"] = layout


def _shape_only_placeholders(gm) -> int:
    """Note [Shape-only convolution_backward arguments under inductor]

    ``convolution_backward(go, x, w, ..., mask)`` reads ``x`` only for ``gw`` and ``w`` only
    for ``gi``; otherwise the argument only gives a shape, and vmap's rule
    (batching/convolution.py) passes a ``new_empty`` placeholder, which the clean-up folds
    into a constant. ATen's kernel still converts every argument to the memory format it
    picked (``x.contiguous(channels_last)``); under inductor, which lays the folded [1, B*C,
    H, W] convolutions out channels-last, that is a full copy of the constant on every call
    (the tutorial CNN, B=64: 5.5 MB, ~4.6 ms of ~225). functorch's rule passes
    ``empty([]).expand(shape)`` instead, whose conversion reads one element: so do we, on the
    graph handed to inductor only (replayed eagerly, the contiguous constant is the cheaper
    one: ATen's contiguous format leaves it alone, and would copy an expanded one)."""
    n = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.convolution_backward.default:
            continue
        mask = node.args[10]
        for pos, unused in ((1, not mask[1]), (2, not mask[0])):
            arg = node.args[pos]
            if not (unused and isinstance(arg, torch.fx.Node) and arg.op == "get_attr"):
                continue
            if not arg.target.startswith("_folded_"):
                continue  # a captured tensor, not a placeholder
            v = getattr(gm, arg.target)
            with gm.graph.inserting_before(node):
                one = gm.graph.call_function(
                    aten.empty.memory_format, ([],), {"dtype": v.dtype, "device": v.device}
                )
                shape = gm.graph.call_function(aten.expand.default, (one, list(v.shape)))
            node.update_arg(pos, shape)
            n += 1
    return n


# glibc's largest mmap threshold: smaller freed buffers are reused from the heap, larger ones
# are unmapped, and a new one faults its pages in again (slower than reading a stored copy).
_FRESH_BYTES = 32 << 20


def _uniform_factories(gm) -> int:
    """A folded constant holding one value everywhere (the zeros that max_pool2d's pullback
    scatters into, a scalar 0) becomes ``aten.full`` again in the graph handed to inductor,
    which then writes it inside the kernel that uses it instead of reading the stored copy on
    every call (the tutorial CNN's [64, 1, 64, 576] zeros: 9.4 MB per call)."""
    n = 0
    for node in list(gm.graph.nodes):
        if node.op != "get_attr" or not node.target.startswith("_folded_"):
            continue
        v = getattr(gm, node.target)
        if v.numel() == 0 or not v.is_contiguous() or v.is_complex() or v.layout != torch.strided:
            continue
        if v.numel() * v.element_size() > _FRESH_BYTES:
            continue  # a buffer this large is fresh pages on every call: read the stored one
        with _compat.disable_current_modes():
            first = v.reshape(-1)[0]
            if not bool((v == first).all()):
                continue  # not uniform (or NaN, which compares unequal: kept as stored)
            value = first.item()
        with gm.graph.inserting_before(node):
            full = gm.graph.call_function(
                aten.full.default, (list(v.shape), value), {"dtype": v.dtype, "device": v.device}
            )
        node.replace_all_uses_with(full)
        gm.graph.erase_node(node)
        n += 1
    return n


def _for_inductor(gm) -> None:
    """Rewrites of the cleaned graph that pay off only under inductor (each says why)."""
    if _shape_only_placeholders(gm) + _uniform_factories(gm):
        gm.graph.eliminate_dead_code(is_impure_node=_impure)
        gm.graph.lint()
        gm.recompile()
        used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
        for name in list(vars(gm)):
            if name.startswith("_folded_") and name not in used:
                delattr(gm, name)


# ------------------------------------------------------------------------------------------
# Note [Replay through Python bindings]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The replay calls each op; how it calls it costs as much as a small op itself. Through
# ``OpOverload._op`` the call goes through the boxed path (arguments converted one by one
# against the schema onto a stack): ~5 us for a ``transpose`` or ``view`` here, ~10.7 us for a
# small ``mul``. torch's generated Python bindings (``torch._C._VariableFunctions.transpose``,
# ``Tensor.view``) parse the same arguments and call the same op unboxed: ~3.3 us and ~9.3 us.
# A graph of small ops (a MAML meta-gradient: ~220 ops, most under 5 us of work) is mostly
# that cost. So each node whose op has a C binding that dispatches to exactly that overload,
# with exactly the node's arguments, is replayed through the binding: the same kernel on the
# same arguments (bit-identical), and the same autograd node when an input requires grad.
#
# * Which binding: checked, not assumed. The binding is called once on meta tensors of the
#   node's layouts under a dispatch mode that records what reaches the dispatcher: it must
#   be one call of the node's overload with every schema argument equal (defaults filled in;
#   a Python number the schema takes as a Tensor arrives as the 0-dim tensor both paths wrap
#   it in). Python's overload resolution depends on the arguments' kinds (tensor, int, float,
#   list, None, keyword names), so the verdict is cached per (overload, kinds). The mode runs
#   no kernel: it returns empty stand-ins of the schema's results (the call succeeded when it
#   was traced; what is checked is where it goes). Meta kernels would run Python for many ops
#   (torch's elementwise refs), whose first call imports torch._dynamo and sympy: ~0.8 s of a
#   process's first jit call (Note [Recording static traces], _record.py).
# * Only ops with a tensor argument (factories stay on ``_op``: ``torch.set_default_device``'s
#   mode would otherwise see them), and never for the ``out=`` steps of kept buffers.
# * ``__torch_function__``: the bindings would call it on a tensor subclass argument, which
#   ``_op`` never does; the replay runs under ``DisableTorchFunction`` (one context
#   per call, ~0.3 us), so both paths see the same: nothing above the dispatcher.

_BINDING_HOMES = _compat.binding_homes
_BINDING_CACHE: dict = {}


def _kind(a):
    if isinstance(a, torch.fx.Node):
        return "T"
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, *map(_kind, a))
    return type(a).__name__


class _Record(_compat.UncompiledDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args, kwargs or {}))
        return _stand_in(func)


_STAND_INS = {
    "TensorType": lambda: torch.empty(0, device="meta"),
    "ListType": list,
    "OptionalType": lambda: None,
    "IntType": int,
    "SymIntType": int,
    "FloatType": float,
    "NumberType": int,
    "BoolType": bool,
}


def _stand_in(func):
    """An empty value of each result of ``func``'s schema: what ``_Record`` returns."""
    outs = [_STAND_INS[r.type.kind()]() for r in func._schema.returns]
    return None if not outs else outs[0] if len(outs) == 1 else tuple(outs)


def _schema_values(schema, args, kwargs):
    vals = []
    for i, a in enumerate(schema.arguments):
        if i < len(args) and not a.kwarg_only:
            vals.append(args[i])
        elif a.name in kwargs:
            vals.append(kwargs[a.name])
        elif a.has_default_value():
            vals.append(a.default_value)
        else:
            return None
    return vals


def _same(mine, seen) -> bool:
    if isinstance(mine, _Tensor):
        return seen is mine
    if isinstance(mine, (list, tuple)) and isinstance(seen, (list, tuple)):
        return len(mine) == len(seen) and all(_same(a, b) for a, b in zip(mine, seen))
    if isinstance(seen, _Tensor):  # a number the schema takes as a Tensor: wrapped, 0-dim
        wrap = {bool: torch.bool, int: torch.int64, float: torch.float64}
        if type(mine) not in wrap or seen.dim() != 0 or seen.dtype != wrap[type(mine)]:
            return False
        return seen.item() == mine
    return type(mine) is type(seen) and mine == seen


def _example(a, gm):
    """A meta tensor of a node's layout (its traced value, or a captured tensor)."""
    if isinstance(a, (list, tuple)):
        out = [_example(x, gm) for x in a]
        return None if any(x is _MISSING for x in out) else type(a)(out)
    if not isinstance(a, torch.fx.Node):
        return a
    v = getattr(gm, a.target, None) if a.op == "get_attr" else a.meta.get("val")
    if not isinstance(v, _Tensor) or v.layout != torch.strided:
        return _MISSING
    return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")


_MISSING = object()


def _binding_of(node, gm):
    """A C binding that replays ``node`` exactly (Note [Replay through Python bindings])."""
    t = node.target
    key = (t, tuple(map(_kind, node.args)), tuple((k, _kind(v)) for k, v in node.kwargs.items()))
    if key in _BINDING_CACHE:
        return _BINDING_CACHE[key]
    found = None
    name = t._schema.name.split("::")[-1]
    homes = [getattr(h, name) for h in _BINDING_HOMES if hasattr(h, name)]
    args = [_example(a, gm) for a in node.args]
    kwargs = {k: _example(v, gm) for k, v in node.kwargs.items()}
    ready = _MISSING not in args and None not in args and _MISSING not in kwargs.values()
    for fn in homes if ready else ():
        rec = _Record()
        try:
            with _compat.disable_current_modes(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with rec:
                    fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - not this binding: keep _op
            continue
        if len(rec.calls) != 1 or rec.calls[0][0] is not t:
            continue
        mine = _schema_values(t._schema, args, kwargs)
        seen = _schema_values(t._schema, rec.calls[0][1], rec.calls[0][2])
        if mine is not None and seen is not None and all(map(_same, mine, seen)):
            found = fn
            break
    _BINDING_CACHE[key] = found
    return found


def _python_bindings(gm) -> int:
    """Mark each node the replay can call through a C binding (``meta["binding"]``); before
    the traced values are dropped (they give the layouts the check runs on)."""
    n = 0
    for node in gm.graph.nodes:
        t = node.target
        if node.op != "call_function" or not isinstance(t, _compat.OpOverload):
            continue
        if not any("Tensor" in str(a.type) for a in t._schema.arguments):
            continue  # a factory
        if not node.all_input_nodes:
            continue
        fn = _binding_of(node, gm)
        if fn is not None:
            node.meta["binding"] = fn
            n += 1
    return n
