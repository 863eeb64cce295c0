"""Batching rules for scans along a dim (cumsum, cumprod, logcumsumexp, cummax, cummin):
the batch dim goes to the front and the scanned dim shifts by one."""

from __future__ import annotations

import torch

from .reductions import def_dim

aten = torch.ops.aten

# (op, position of dim)
for _op, _pos in (
    (aten.cumsum.default, 1),
    (aten.cumprod.default, 1),
    (aten.logcumsumexp.default, 1),
    (aten.cummax.default, 1),
    (aten.cummin.default, 1),
):
    def_dim(_op, _pos)
