"""Derivative rules of pooling and of the antialiased upsampling kernels (linear, with torch's
backward kernel as the transpose, like average pooling).

Note [Pooling derivatives]
    Two shapes cover every pooling op that reaches dispatch (the 1-d ops arrive as their 2-d
    versions with an unsqueezed dim, ``lp_pool`` and ``local_response_norm`` as ``avg_pool``
    and pointwise ops, ``max_unpool`` through torch's decomposition):

    - *max-like* (``max_pool{2,3}d_with_indices``, ``adaptive_max_pool{2,3}d``,
      ``fractional_max_pool{2,3}d``) return ``(out, indices)`` where ``indices`` are flat
      positions in each plane's spatial dims. The jvp gathers the tangent at the indices, the vjp
      scatter-adds the cotangent there: both are ordinary indexing ops with their own rules, so
      higher orders and batching need nothing else (ties follow the op's own indices, as
      torch's).
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


def def_max_pool(op, spatial):
    """``op(x, ...) -> (out, indices)``, ``indices`` flat over the last ``spatial`` dims."""

    def max_pool_jvp_rule(primals, tangents, kwargs):
        out, idx = op(*primals, **kwargs)
        t = tangents[0]
        if t is None:
            return (out, idx), None
        picked = _planes(t, spatial).gather(-1, _planes(idx, spatial))
        return (out, idx), (picked.reshape(out.shape), None)

    def max_pool_vjp_rule(cts, primals, kwargs, out, needs):
        ct = cts[0]
        rest = (None,) * (len(primals) - 1)
        if ct is None or not needs[0]:
            return (None,) + rest
        x, idx = primals[0], out[1]
        flat = x.shape[: x.dim() - spatial] + (-1,)
        g = ct.new_zeros(x.shape).reshape(flat)
        g = g.scatter_add(-1, _planes(idx, spatial), _planes(ct, spatial))
        return (g.reshape(x.shape),) + rest

    register_jvp_rule(op)(max_pool_jvp_rule)
    register_vjp_rule(op)(max_pool_vjp_rule)


for _op, _k in (
    (aten.max_pool2d_with_indices.default, 2),
    (aten.max_pool3d_with_indices.default, 3),
    (aten.adaptive_max_pool2d.default, 2),
    (aten.adaptive_max_pool3d.default, 3),
    (aten.fractional_max_pool2d.default, 2),
    (aten.fractional_max_pool3d.default, 3),
):
    def_max_pool(_op, _k)


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
