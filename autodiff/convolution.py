"""Derivative rules of convolution (1/2/3-d, transposed, grouped, strided, dilated, padded).

Note [Convolution derivatives through convolution]
    ``convolution(x, w, b)`` is bilinear in ``(x, w)`` plus ``b``, so its jvp is
    ``conv(tx, w) + conv(x, tw) + tb`` and its vjp is three transposes, each written as one
    more ``aten.convolution`` (with reshapes and permutes around it), never as
    ``aten.convolution_backward``:

    - input: the adjoint of a convolution is the transposed convolution with the same weight
      (``output_padding`` chosen so the result has the input's size), and the adjoint of a
      transposed convolution is the plain convolution;
    - weight: ``dw[o, c, k] = sum_{n, q} ct[n, o, q] x[n, g(o) c, q s + k d - p]`` is a
      convolution whose batch is the input's channels within a group, whose input channels are
      (group, sample) and whose kernel is the cotangent, with stride and dilation exchanged; its
      output is cropped to the kernel size. A transposed convolution swaps the roles of its
      input and output, so its weight cotangent is the same formula with ``x`` and ``ct``
      exchanged;
    - bias: the cotangent summed over every dim but the channels.

    These formulas are closed under differentiation and batching, but the weight one is a
    convolution whose kernel is as large as the image, which oneDNN runs 2-6x slower than
    torch's dedicated backward kernel (measured: 6.5 ms vs 1.2 ms for a 16x16x32x32 batch). So
    for real dtypes the vjp calls ``aten.convolution_backward`` (one kernel for all three
    cotangents), and that op gets rules of its own, each again a convolution or a
    ``convolution_backward``: it is bilinear, ``gi = J_x(w)^T go``, ``gw = J_w(x)^T go``,
    ``gb = sum(go)``, so

    - jvp: ``cb(t_go, x, w) + cb(go, t_x, t_w)`` (the second call's ``gi`` uses only ``t_w``,
      its ``gw`` only ``t_x``: two calls cover every term);
    - vjp: ``go_bar = conv(Gi, w) + conv(x, Gw) + Gb`` and ``(x_bar, w_bar) = cb(go, Gi, Gw)``
      (``<gi, Gi> = <go, conv(Gi, w)>``, ``<gw, Gw> = <go, conv(x, Gw)>``), whatever the
      geometry (transposed or not);
    - vmap: Note [Batching convolution_backward] (batching/convolution.py).

    Complex dtypes keep the convolution-only formulas: the op is bilinear (no conjugation), so
    the transposes conjugate the other factor (docs/complex.md).
"""

from __future__ import annotations

import torch

from ._registry import register_jvp_rule, register_vjp_rule

aten = torch.ops.aten


def _conj(t):
    return t.conj() if t.is_complex() else t


def _sum_to_channels(ct):
    """The bias cotangent: ``ct`` summed over every dim but dim 1."""
    return ct.sum([0] + list(range(2, ct.dim())))


def conv_input_grad(ct, w, x_shape, stride, padding, dilation, transposed, groups):
    """The cotangent of a convolution's input (Note [Convolution derivatives through
    convolution])."""
    nd = ct.dim() - 2
    if transposed:
        return aten.convolution.default(
            ct, w, None, stride, padding, dilation, False, [0] * nd, groups
        )
    ks = w.shape[2:]
    out_pad = [
        x_shape[2 + i]
        + 2 * padding[i]
        - dilation[i] * (ks[i] - 1)
        - 1
        - (ct.shape[2 + i] - 1) * stride[i]
        for i in range(nd)
    ]
    return aten.convolution.default(ct, w, None, stride, padding, dilation, True, out_pad, groups)


def conv_weight_grad(x, ct, w_shape, stride, padding, dilation, groups):
    """``dw`` of the plain convolution ``ct = conv(x, w)``: one convolution with the input's
    in-group channels as batch and the cotangent as kernel (Note [Convolution derivatives
    through convolution])."""
    nd = x.dim() - 2
    N, C = x.shape[0], x.shape[1]
    G = groups
    Cg, O = C // G, ct.shape[1]
    sp = list(range(3, 3 + nd))
    xs = x.reshape((N, G, Cg) + tuple(x.shape[2:])).permute([2, 1, 0] + sp)
    xs = xs.reshape((Cg, G * N) + tuple(x.shape[2:]))
    cs = ct.reshape((N, G, O // G) + tuple(ct.shape[2:])).permute([1, 2, 0] + sp)
    cs = cs.reshape((O, N) + tuple(ct.shape[2:]))
    r = aten.convolution.default(xs, cs, None, dilation, padding, stride, False, [0] * nd, G)
    for i in range(nd):
        if r.shape[2 + i] != w_shape[2 + i]:
            r = r.narrow(2 + i, 0, w_shape[2 + i])
    return r.transpose(0, 1)


def def_convolution(op):
    """``op(x, w, bias, stride, padding, dilation, transposed, output_padding, groups, ...)``:
    bilinear in ``(x, w)`` (Note [Convolution derivatives through convolution])."""

    def convolution_jvp_rule(primals, tangents, kwargs):
        x, w, b, stride, padding, dilation, transposed, output_padding, groups = primals[:9]
        out = op(*primals, **kwargs)
        tx, tw, tb = tangents[0], tangents[1], tangents[2]
        geo = (stride, padding, dilation, transposed, output_padding, groups)
        t = None
        if tx is not None:
            t = aten.convolution.default(tx, w, None, *geo)
        if tw is not None:
            t2 = aten.convolution.default(x, tw, None, *geo)
            t = t2 if t is None else t + t2
        if tb is not None:
            tb = tb.reshape((-1,) + (1,) * (out.dim() - 2))
            t = tb.expand(out.shape) if t is None else t + tb
        return out, t

    def convolution_vjp_rule(ct, primals, kwargs, out, needs):
        x, w, b, stride, padding, dilation, transposed, output_padding, groups = primals[:9]
        rest = (None,) * (len(primals) - 3)
        if not ct.is_complex():
            mask = [bool(needs[0]), bool(needs[1]), b is not None and bool(needs[2])]
            gx, gw, gb = aten.convolution_backward.default(
                ct,
                x,
                w,
                None if b is None else list(b.shape),
                stride,
                padding,
                dilation,
                transposed,
                output_padding,
                groups,
                mask,
            )
            return (gx, gw, gb) + rest
        gx = gw = gb = None
        if needs[0]:
            gx = conv_input_grad(
                ct, _conj(w), x.shape, stride, padding, dilation, transposed, groups
            )
        if needs[1]:
            xc = _conj(x)
            if transposed:
                gw = conv_weight_grad(ct, xc, w.shape, stride, padding, dilation, groups)
            else:
                gw = conv_weight_grad(xc, ct, w.shape, stride, padding, dilation, groups)
        if needs[2] and b is not None:
            gb = _sum_to_channels(ct)
        return (gx, gw, gb) + rest

    convolution_vjp_rule.keeps = (None, False)  # Note [What a vjp rule keeps]: not the output
    register_jvp_rule(op)(convolution_jvp_rule)
    register_vjp_rule(op)(convolution_vjp_rule)


def_convolution(aten.convolution.default)
def_convolution(aten._convolution.default)


def _real_only(go):
    if go.is_complex():
        raise NotImplementedError(
            "aten.convolution_backward of complex tensors has no derivative rule here (the vjp "
            "of a complex convolution is written with aten.convolution instead). Do: "
            "differentiate the convolution itself, e.g. torch.nn.functional.conv2d."
        )


@register_jvp_rule(aten.convolution_backward.default)
def convolution_backward_jvp_rule(primals, tangents, kwargs):
    """Bilinear: ``cb(t_go, x, w) + cb(go, t_x, t_w)`` (Note [Convolution derivatives through
    convolution])."""
    go, x, w = primals[:3]
    geo, mask = primals[3:10], primals[10]
    out = aten.convolution_backward.default(*primals)
    t_go, t_x, t_w = tangents[:3]
    _real_only(go)
    t = [None, None, None]
    if t_go is not None:
        t = list(aten.convolution_backward.default(t_go, x, w, *geo, mask))
    second = [mask[0] and t_w is not None, mask[1] and t_x is not None, False]
    if any(second):
        tx = t_x if t_x is not None else x
        tw = t_w if t_w is not None else w
        more = aten.convolution_backward.default(go, tx, tw, *geo, second)
        for i in (0, 1):
            if second[i]:
                t[i] = more[i] if t[i] is None else t[i] + more[i]
    return out, tuple(t)


@register_vjp_rule(aten.convolution_backward.default)
def convolution_backward_vjp_rule(cts, primals, kwargs, out, needs):
    """``go_bar = conv(Gi, w) + conv(x, Gw) + Gb``, ``(x_bar, w_bar) = cb(go, Gi, Gw)``."""
    go, x, w = primals[:3]
    bias_sizes, stride, padding, dilation, transposed, output_padding, groups = primals[3:10]
    _real_only(go)
    Gi, Gw, Gb = cts
    geo = (stride, padding, dilation, transposed, output_padding, groups)
    go_bar = x_bar = w_bar = None
    if needs[0]:
        if Gi is not None:
            go_bar = aten.convolution.default(Gi, w, None, *geo)
        if Gw is not None:
            t = aten.convolution.default(x, Gw, None, *geo)
            go_bar = t if go_bar is None else go_bar + t
        if Gb is not None:
            t = Gb.reshape((-1,) + (1,) * (go.dim() - 2)).expand(go.shape)
            go_bar = t if go_bar is None else go_bar + t
    mask = [bool(needs[1]) and Gw is not None, bool(needs[2]) and Gi is not None, False]
    if any(mask):
        gi = Gi if Gi is not None else x
        gw = Gw if Gw is not None else w
        x_bar, w_bar, _ = aten.convolution_backward.default(go, gi, gw, bias_sizes, *geo, mask)
    return (go_bar, x_bar, w_bar) + (None,) * (len(primals) - 3)
