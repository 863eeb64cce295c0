"""Reference formulations for ops whose derivatives in torch itself are wrong.

Note [Conformance references]
    The conformance oracle is torch.func. For a few ops torch's own derivative formula is wrong
    (a wrong number, not a missing rule), so torch.func cannot be the oracle for them: our
    correct derivatives would show as "wrong value" and the only way to pass would be to copy
    torch's mistake. For those ops (``REFERENCES``) the oracle runs torch.func on a reference
    formulation of the same function, written with ops whose torch derivatives are right; it
    computes the same values (the harness compares the outputs too, so a wrong reference fails
    the suite). Each entry says what is wrong in torch; tests/conformance/test_references.py shows
    it against finite differences, ours right and torch wrong, so an entry is dropped (that
    test fails) when torch fixes its formula.
"""

from __future__ import annotations

import torch


def storage_positions(x, size, stride, storage_offset):
    """Positions in a contiguous x's flat order of as_strided(x, size, stride, offset)."""
    pos = torch.tensor(storage_offset or 0, dtype=torch.long)
    for n, s in zip(size, stride):
        pos = pos.unsqueeze(-1) + torch.arange(n) * s
    return pos.reshape(-1)


def as_strided_scatter(x, src, size, stride, storage_offset=None):
    """x (contiguous) with src written at the view's positions: an index_put on the flat x."""
    assert x.is_contiguous(), "the reference covers contiguous x only"
    pos = storage_positions(x, size, stride, storage_offset)
    return x.reshape(-1).index_put((pos,), src.reshape(-1)).reshape(x.shape)


def logcumsumexp(x, dim):
    """out_j = logsumexp(x_k, k <= j), as one masked logsumexp per j (O(n^2); torch's
    logsumexp derivative is the softmax, stable at any spread of x). The values are the op's
    own (complex logs pick a branch; only the derivatives are the reference's)."""
    if x.dim() == 0:
        return x.clone()
    n = x.shape[dim]
    xm = x.movedim(dim, -1)
    later = torch.ones(n, n, dtype=torch.bool).triu(1)  # [j, k]: k > j is not summed
    rows = xm.unsqueeze(-2).expand(*xm.shape[:-1], n, n).masked_fill(later, float("-inf"))
    lse = torch.logsumexp(rows, -1).movedim(-1, dim)
    return lse + (torch.logcumsumexp(x, dim) - lse).detach()


def scatter_reduce(x, dim, index, src, reduce, *, include_self=True):
    """scatter_reduce(..., 'prod') as a dense product: each output position's src members are
    placed in a row padded with ones, and torch.prod reduces the rows."""
    assert reduce == "prod", "the reference covers reduce='prod' only"
    shape = x.shape
    if x.dim() == 0:
        x, index, src = x.reshape(1), index.reshape(1), src.reshape(1)
    dim = dim % x.dim()
    src = src[tuple(slice(0, n) for n in index.shape)]  # only the part index covers is used
    # flat target position in x of each src element: its coordinates with dim replaced by index
    coords = torch.meshgrid(*[torch.arange(n) for n in index.shape], indexing="ij")
    target = torch.zeros(index.shape, dtype=torch.long)
    for d, (c, n) in enumerate(zip(coords, x.shape)):
        target = target * n + (index if d == dim else c)
    target = target.reshape(-1)
    order = torch.argsort(target, stable=True)
    counts = torch.bincount(target, minlength=x.numel())
    rank = torch.arange(target.numel()) - (counts.cumsum(0) - counts)[target[order]]
    width = max(int(counts.max()), 1) if counts.numel() else 1
    rows = src.new_ones(x.numel(), width).index_put((target[order], rank), src.reshape(-1)[order])
    prod = rows.prod(-1).reshape(x.shape)
    out = x * prod if include_self else torch.where(counts.reshape(x.shape) > 0, prod, x)
    return out.reshape(shape)


def triangular_solve(b, A, upper=True, transpose=False, unitriangular=False):
    """torch.triangular_solve through linalg.solve_triangular (the same solve; its derivative
    reads only the triangle the solve reads), with the copy of A as its second output."""
    M = A.mT if transpose else A
    x = torch.linalg.solve_triangular(M, b, upper=upper != transpose, unitriangular=unitriangular)
    return torch.return_types.triangular_solve((x, A.clone()))


# op full name -> (reference, the kinds it covers, what is wrong in torch)
REFERENCES = {
    "as_strided_scatter": (
        as_strided_scatter,
        ("real", "complex"),
        "torch's derivative of as_strided_scatter w.r.t. self keeps the cotangent at the "
        "scattered positions and zeroes the rest (the transpose of the right answer; torch's "
        "own OpInfo marks TestBwdGradients.test_fn_grad an expected failure)",
    ),
    "logcumsumexp": (
        logcumsumexp,
        ("real", "complex"),
        "torch's logcumsumexp jvp divides cumsums of exp(x - max x), which underflow to 0 / 0 "
        "once x spans ~709 (it returns 0 there; complex: exp(x) overflows to inf at Re x = 1e4)"
        ", and so its jvp of the vjp is off by ~1e-5 when x spans 1e4",
    ),
    "scatter_reduce.prod": (
        scatter_reduce,
        ("real",),
        "torch's double backward of scatter_reduce(prod, include_self=False) divides the "
        "product of the src members by self, which is not one of them",
    ),
    "triangular_solve": (
        triangular_solve,
        ("real", "complex"),
        "torch's forward-mode formula of triangular_solve applies the whole tangent of A, "
        "though the solve reads only one triangle of A (and not its diagonal when "
        "unitriangular): its jvp, and so its jvp of the vjp, is wrong (its vjp is right)",
    ),
}


def oracle_op(op, name, kind):
    """The callable the oracle differentiates for ``op`` (Note [Conformance references])."""
    ref = REFERENCES.get(name)
    return ref[0] if ref is not None and kind in ref[1] else op
