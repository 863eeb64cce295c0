"""Derivative rules of pooling and of the antialiased upsampling kernels (linear, with torch's
backward kernel as the transpose, like average pooling).

Note [Pooling derivatives]
    Two shapes cover every pooling op that reaches dispatch (the 1-d ops arrive as their 2-d
    versions with an unsqueezed dim, ``lp_pool`` and ``local_response_norm`` as ``avg_pool``
    and pointwise ops, ``max_unpool`` through torch's decomposition):

    - *max-like* (``max_pool{2,3}d_with_indices``, ``adaptive_max_pool{2,3}d``,
      ``fractional_max_pool{2,3}d``) return ``(out, indices)`` where ``indices`` are flat
      positions in each plane's spatial dims. The jvp gathers the tangent at the indices, the vjp
      scatter-adds the cotangent there (ties follow the op's own indices, as torch's). The
      scatter-add is torch's backward kernel where there is one (Note [Max pooling's backward
      kernel]); the fractional ops keep the scatter-add, an ordinary indexing op with its own
      rules.
    - *average-like* (``avg_pool{2,3}d``, ``_adaptive_avg_pool{2,3}d``) are linear: the jvp is
      the op on the tangent and the vjp is torch's ``*_backward`` kernel, which is linear in
      its ``grad_output``; that kernel's own vjp is the forward op again, so the two ops are
      each other's transpose and every order of derivative uses one of the two kernels.
"""

from __future__ import annotations

import torch

from ._registry import register_jvp_rule, register_vjp_rule

aten = torch.ops.aten


def _planes(t, spatial):
    """``t`` with its last ``spatial`` dims as one (``reshape``: ``flatten`` is a composite op
    that would reach an enclosing vmap whole)."""
    return t.reshape(tuple(t.shape[: t.dim() - spatial]) + (-1,))


def _gather_planes(t, idx, spatial):
    """``t``'s entries at each plane's flat ``idx``: max pooling's jvp, and the vjp (in the
    cotangent) of its backward kernel."""
    return _planes(t, spatial).gather(-1, _planes(idx, spatial)).reshape(idx.shape)


def def_max_pool(op, spatial, backward=None, backward_args=None):
    """``op(x, ...) -> (out, indices)``, ``indices`` flat over the last ``spatial`` dims.

    ``backward``: torch's kernel ``backward(ct, x, *backward_args(primals, kwargs), indices)``
    (Note [Max pooling's backward kernel]); without one, the vjp scatter-adds."""

    def max_pool_jvp_rule(primals, tangents, kwargs):
        out, idx = op(*primals, **kwargs)
        t = tangents[0]
        if t is None:
            return (out, idx), None
        return (out, idx), (_gather_planes(t, idx, spatial), None)

    def max_pool_vjp_rule(cts, primals, kwargs, out, needs):
        ct = cts[0]
        rest = (None,) * (len(primals) - 1)
        if ct is None or not needs[0]:
            return (None,) + rest
        x, idx = primals[0], out[1]
        if backward is not None:
            return (backward(ct, x, *backward_args(primals, kwargs), idx),) + rest
        flat = x.shape[: x.dim() - spatial] + (-1,)
        g = ct.new_zeros(x.shape).reshape(flat)
        g = g.scatter_add(-1, _planes(idx, spatial), _planes(ct, spatial))
        return (g.reshape(x.shape),) + rest

    register_jvp_rule(op)(max_pool_jvp_rule)
    register_vjp_rule(op)(max_pool_vjp_rule)
    if backward is None:
        return

    # the kernel is linear in grad_output (its first argument) and constant in the rest: the
    # input only chooses the indices, which are fixed (torch's derivatives.yaml: self gets 0)
    def max_pool_backward_jvp_rule(primals, tangents, kwargs):
        g = backward(*primals, **kwargs)
        t = tangents[0]
        return g, None if t is None else backward(t, *primals[1:], **kwargs)

    def max_pool_backward_vjp_rule(ct, primals, kwargs, out, needs):
        rest = (None,) * (len(primals) - 1)
        if not needs[0]:
            return (None,) + rest
        return (_gather_planes(ct, primals[-1], spatial),) + rest

    register_jvp_rule(backward)(max_pool_backward_jvp_rule)
    register_vjp_rule(backward)(max_pool_backward_vjp_rule)


def _max_pool_args(spatial):
    """``max_pool*d_with_indices``'s optional arguments spelled out for its backward kernel,
    which has no defaults: (kernel_size, stride, padding, dilation, ceil_mode)."""
    names = ("kernel_size", "stride", "padding", "dilation", "ceil_mode")
    defaults = (None, [], 0, 1, False)

    def full(v):
        v = [v] if isinstance(v, int) else list(v)
        return v * spatial if len(v) == 1 else v

    def args(primals, kwargs):
        given = list(primals[1:])
        vals = given + [kwargs.get(n, d) for n, d in zip(names, defaults)][len(given) :]
        k = full(vals[0])
        stride = full(vals[1]) if isinstance(vals[1], int) or len(vals[1]) else k
        return k, stride, full(vals[2]), full(vals[3]), bool(vals[4])

    return args


# Note [Max pooling's backward kernel]
#     The vjps of max_pool{2,3}d_with_indices and adaptive_max_pool{2,3}d call torch's backward
#     kernel: one output the input's size, where the scatter-add formulation allocated two (the
#     zeros and scatter_add's result) and freed one. In the per-sample-gradient CNN
#     (benchmarks/bench_surface.py (a)) that transient was the size of the second conv's
#     activation and sat at the allocator's high point. The kernels get rules of their own
#     (above: linear in grad_output, a gather is their transpose) and a batching rule
#     (batching/pooling.py), so every order of derivative and vmap go through ordinary rules.
def_max_pool(
    aten.max_pool2d_with_indices.default,
    2,
    aten.max_pool2d_with_indices_backward.default,
    _max_pool_args(2),
)
def_max_pool(
    aten.max_pool3d_with_indices.default,
    3,
    aten.max_pool3d_with_indices_backward.default,
    _max_pool_args(3),
)
def_max_pool(
    aten.adaptive_max_pool2d.default,
    2,
    aten.adaptive_max_pool2d_backward.default,
    lambda primals, kwargs: (),
)
def_max_pool(
    aten.adaptive_max_pool3d.default,
    3,
    aten.adaptive_max_pool3d_backward.default,
    lambda primals, kwargs: (),
)
def_max_pool(aten.fractional_max_pool2d.default, 2)
def_max_pool(aten.fractional_max_pool3d.default, 3)


def def_linear_pool(op, backward, spatial, adaptive):
    """``op(x, *rest)`` linear in ``x`` with transpose ``backward(ct, x, *rest)`` (Note [Pooling
    derivatives]); ``adaptive``: the transpose takes no ``rest`` and the forward's ``rest`` is
    the output size."""

    def pool_jvp_rule(primals, tangents, kwargs):
        out = op(*primals, **kwargs)
        t = tangents[0]
        return out, None if t is None else op(t, *primals[1:], **kwargs)

    def pool_vjp_rule(ct, primals, kwargs, out, needs):
        x = primals[0]
        rest = () if adaptive else _avg_rest(primals, kwargs, spatial)
        return (backward(ct, x, *rest),) + (None,) * (len(primals) - 1)

    def pool_backward_jvp_rule(primals, tangents, kwargs):
        out = backward(*primals, **kwargs)
        t = tangents[0]
        return out, None if t is None else backward(t, *primals[1:], **kwargs)

    def pool_backward_vjp_rule(ct, primals, kwargs, out, needs):
        go = primals[0]
        if adaptive:
            g = op(ct, list(go.shape[-spatial:]))
        else:
            g = op(ct, *primals[2:], **kwargs)
        return (g,) + (None,) * (len(primals) - 1)

    register_jvp_rule(op)(pool_jvp_rule)
    register_vjp_rule(op)(pool_vjp_rule)
    register_jvp_rule(backward)(pool_backward_jvp_rule)
    register_vjp_rule(backward)(pool_backward_vjp_rule)


def _avg_rest(primals, kwargs, spatial):
    """``avg_pool``'s optional arguments spelled out for ``avg_pool*_backward``, which has no
    defaults: (kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)."""
    names = (
        "kernel_size",
        "stride",
        "padding",
        "ceil_mode",
        "count_include_pad",
        "divisor_override",
    )
    defaults = (None, [], 0, False, True, None)
    vals = (
        list(primals[1:]) + [kwargs.get(n, d) for n, d in zip(names, defaults)][len(primals) - 1 :]
    )

    def full(v):
        v = [v] if isinstance(v, int) else list(v)
        return v * spatial if len(v) == 1 else v

    k = full(vals[0])
    stride = full(vals[1]) if isinstance(vals[1], int) or len(vals[1]) else k
    return k, stride, full(vals[2]), vals[3], vals[4], vals[5]


def_linear_pool(aten.avg_pool2d.default, aten.avg_pool2d_backward.default, 2, False)
def_linear_pool(aten.avg_pool3d.default, aten.avg_pool3d_backward.default, 3, False)
def_linear_pool(
    aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d_backward.default, 2, True
)
def_linear_pool(
    aten._adaptive_avg_pool3d.default, aten._adaptive_avg_pool3d_backward.default, 3, True
)


# -- antialiased upsampling: linear in the input, with torch's backward kernel as the transpose ----
def def_upsample_aa(op, backward):
    def upsample_aa_jvp_rule(primals, tangents, kwargs):
        out = op(*primals, **kwargs)
        t = tangents[0]
        return out, None if t is None else op(t, *primals[1:], **kwargs)

    def upsample_aa_vjp_rule(ct, primals, kwargs, out, needs):
        x, output_size, align_corners = primals[:3]
        scales = list(primals[3:]) + [None] * (5 - len(primals))
        scales_h = kwargs.get("scales_h", scales[0])
        scales_w = kwargs.get("scales_w", scales[1])
        g = backward(ct, output_size, list(x.shape), align_corners, scales_h, scales_w)
        return (g,) + (None,) * (len(primals) - 1)

    def backward_jvp_rule(primals, tangents, kwargs):
        out = backward(*primals, **kwargs)
        t = tangents[0]
        return out, None if t is None else backward(t, *primals[1:], **kwargs)

    def backward_vjp_rule(ct, primals, kwargs, out, needs):
        _, output_size, input_size, align_corners = primals[:4]
        rest = list(primals[4:]) + [None] * (6 - len(primals))
        scales_h = kwargs.get("scales_h", rest[0])
        scales_w = kwargs.get("scales_w", rest[1])
        return (op(ct, output_size, align_corners, scales_h, scales_w),) + (None,) * (
            len(primals) - 1
        )

    register_jvp_rule(op)(upsample_aa_jvp_rule)
    register_vjp_rule(op)(upsample_aa_vjp_rule)
    register_jvp_rule(backward)(backward_jvp_rule)
    register_vjp_rule(backward)(backward_vjp_rule)


def_upsample_aa(aten._upsample_bilinear2d_aa.default, aten._upsample_bilinear2d_aa_backward.default)
def_upsample_aa(aten._upsample_bicubic2d_aa.default, aten._upsample_bicubic2d_aa_backward.default)
