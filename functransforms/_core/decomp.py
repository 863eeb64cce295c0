"""Decompositions as the second line of rules.

Note [Decomposition fallback]
    An op with no rule of its own is rewritten with torch's decomposition table
    (``torch._decomp``) when it has an entry: the decomposition runs on the original arguments,
    so each op it emits dispatches back through the transforms and hits their rules. The table is
    imported on the first miss only, so the common path pays nothing for it (cold start).
"""

from __future__ import annotations

import torch

from .. import _compat

aten = torch.ops.aten
_TABLE = None
_CACHE: dict = {}


def _multilabel_margin_loss_forward(input, target, reduction):
    """Rows ``[C]`` of input and target; a target row lists class indices up to the first -1.
    Replaces torch's decomposition, which (torch 2.13) also counts the slots after the -1 as
    class 0: the kernel's loss is ``sum_{j < end} sum_{i not a target} max(0, 1 - x[y_j] +
    x[i]) / C`` per row."""
    C = input.shape[-1] if input.dim() else 1
    rows, trows = input.reshape(-1, C), target.reshape(-1, C)
    idx = torch.arange(C, device=input.device)
    end = torch.where(trows == -1, idx, C).amin(-1, keepdim=True)
    slot = idx < end  # [R, C]: the target slots before the terminator
    y = torch.where(slot, trows, 0)
    is_target = (idx == torch.where(slot, trows, -1).unsqueeze(-1)).any(1)  # [R, C] by class
    margins = (1 - rows.gather(1, y).unsqueeze(-1) + rows.unsqueeze(1)).clamp_min(0) / C
    keep = slot.unsqueeze(-1) & ~is_target.unsqueeze(1)  # [R, slot, class]
    loss = torch.where(keep, margins, 0).sum((1, 2))
    loss = loss.mean() if reduction == 1 else loss.sum() if reduction == 2 else loss
    return loss.reshape(input.shape[:-1]) if reduction == 0 else loss, is_target.to(
        input.dtype
    ).reshape(input.shape)


_FLASH_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default


def _flash_attention_for_cpu(
    query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None
):
    """torch's decomposition (2.13 and 2.15) returns the attention weights ``[N, H, L, S]`` as
    the second output, where the kernel returns the logsumexp ``[N, H, L]`` of the scaled,
    masked scores: the output stays torch's decomposition's, logsumexp is computed."""
    out, _ = _compat.decomposition_table()[_FLASH_CPU](
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    if key.shape[1] != query.shape[1]:  # grouped-query attention: key heads are shared
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    s = query @ key.mT * (scale if scale is not None else query.shape[-1] ** -0.5)
    if is_causal:
        L, S = s.shape[-2:]
        causal = torch.ones(L, S, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(causal.logical_not(), float("-inf"))
    if attn_mask is not None:
        s = s + attn_mask
    return out, torch.logsumexp(s, -1)


def _reduce(loss, reduction):
    return loss.mean() if reduction == 1 else loss.sum() if reduction == 2 else loss


# Note [Kinks as torch's formulas]
#     Decompositions whose derivatives at a kink differ from torch's derivative formulas, which
#     PyTorch returns there (tests/autodiff/test_special_points.py): torch's decompositions of
#     smooth_l1 and huber square |d|, whose second derivative at d = 0 is 0 (|d|'s sign) where
#     torch's is 1 / beta (1); and which branch owns the boundary |d| = beta (delta) follows
#     torch's backward formulas: linear for smooth_l1 (|d| < beta), quadratic for huber.
def _smooth_l1_loss(input, target, reduction=1, beta=1.0):
    d = input - target
    if beta == 0:  # torch: l1 loss, derivative sgn(d)
        return _reduce(d.abs(), reduction)
    small = d.abs() < beta
    dq = torch.where(small, d, torch.zeros_like(d))  # no 0 * inf from the other branch at d = inf
    loss = torch.where(small, 0.5 * dq * dq / beta, d.abs() - 0.5 * beta)
    return _reduce(loss, reduction)


def _huber_loss(input, target, reduction=1, delta=1.0):
    d = input - target
    small = d.abs() <= delta
    dq = torch.where(small, d, torch.zeros_like(d))  # as smooth_l1: no 0 * inf at d = inf
    loss = torch.where(small, 0.5 * dq * dq, delta * (d.abs() - 0.5 * delta))
    return _reduce(loss, reduction)


# Decompositions of ours that replace torch's (each says why).
_OVERRIDES = {
    torch.ops.aten.multilabel_margin_loss_forward.default: _multilabel_margin_loss_forward,
    _FLASH_CPU: _flash_attention_for_cpu,
    torch.ops.aten.smooth_l1_loss.default: _smooth_l1_loss,
    torch.ops.aten.huber_loss.default: _huber_loss,
}


def override(*ops):
    """Decorator: ``fn`` is our decomposition of each op in ``ops``, in place of torch's or where
    torch has none (Note [Differentiable backward kernels] in autodiff/nn.py)."""

    def register(fn):
        for op in ops:
            if op in _OVERRIDES:
                raise ValueError(f"override: {op} already has a decomposition of ours")
            _OVERRIDES[op] = fn
            _CACHE.pop(op, None)
        return fn

    return register


def decomposition(func):
    """torch's decomposition of ``func``, or None."""
    d = _CACHE.get(func, False)
    if d is False:
        from .ops import load_for

        load_for("decomposition", func)  # Note [Rule families load on first use]
        global _TABLE
        if _TABLE is None:
            _TABLE = _compat.decomposition_table()
        d = _CACHE[func] = _OVERRIDES.get(func) or _TABLE.get(func)
    return d
