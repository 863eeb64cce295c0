"""Elementwise, reduction, view and matmul rules against torch.vmap, every in_dims mix."""

import pytest
import torch
from _vmap_helpers import build, check, floats, ints, masks, mixes

ELEMENTWISE = {
    "sin": (torch.sin, [floats(3, 4)]),
    "exp_log": (lambda x: torch.log1p(torch.exp(x)), [floats(3, 4)]),
    "add_bcast": (torch.add, [floats(3, 4), floats(4)]),
    "sub_alpha": (lambda x, y: torch.sub(x, y, alpha=2), [floats(4), floats(3, 4)]),
    "mul_0d": (torch.mul, [floats(), floats(2, 3)]),
    "div": (torch.div, [floats(2, 3), floats(2, 3)]),
    "pow": (lambda x, y: x.abs().pow(y), [floats(2, 3), floats(3)]),
    "pow_scalar": (lambda x: x**3, [floats(2, 3)]),
    "atan2": (torch.atan2, [floats(2, 3), floats(2, 1)]),
    "clamp": (lambda x: x.clamp(-0.5, 0.5), [floats(5)]),
    "clamp_tensor": (lambda x, lo: x.clamp(min=lo), [floats(2, 5), floats(5)]),
    "where": (lambda x, y: torch.where(x > 0, x, y), [floats(3, 4), floats(3, 1)]),
    "addcmul": (
        lambda a, b, c: torch.addcmul(a, b, c, value=0.5),
        [floats(4), floats(3, 4), floats(1)],
    ),
    "lerp": (lambda a, b: torch.lerp(a, b, 0.3), [floats(4), floats(4)]),
    "comparison": (lambda a, b: (a < b) & (a > -1), [floats(4), floats(4)]),
    "relu_gelu_tanh": (lambda x: torch.nn.functional.gelu(torch.tanh(torch.relu(x))), [floats(6)]),
    "softplus_silu": (
        lambda x: torch.nn.functional.softplus(torch.nn.functional.silu(x)),
        [floats(6)],
    ),
    "sigmoid": (torch.sigmoid, [floats(2, 2)]),
    "int_ops": (lambda i, j: (i * j + 1) // 2, [ints(5, 3), ints(5, 3)]),
    "mask_logic": (lambda m, n: m ^ n | ~m, [masks(4), masks(4)]),
    "to_dtype": (lambda x: x.float().double() + x.to(torch.int64), [floats(3)]),
    "frexp_two_outputs": (torch.frexp, [floats(3, 4)]),  # a pointwise op with two outputs
}

REDUCTIONS = {
    "sum": (lambda x: x.sum(), [floats(3, 4)]),
    "sum_dim": (lambda x: x.sum(-1, keepdim=True), [floats(3, 4)]),
    "sum_dims": (lambda x: x.sum((0, 2)), [floats(2, 3, 4)]),
    "mean": (lambda x: x.mean(0), [floats(3, 4)]),
    "prod": (lambda x: x.prod(1), [floats(3, 4)]),
    "amax": (lambda x: x.amax(-1), [floats(3, 4)]),
    "max_dim": (lambda x: x.max(1), [floats(3, 4)]),
    "max_all": (lambda x: x.max(), [floats(3, 4)]),
    "argmax": (lambda x: x.argmax(), [floats(3, 4)]),
    "argmin_dim": (lambda x: x.argmin(0), [floats(3, 4)]),
    "var": (lambda x: x.var(1), [floats(3, 4)]),
    "std_all": (lambda x: x.std(), [floats(3, 4)]),
    "norm": (lambda x: torch.linalg.vector_norm(x, 3, dim=-1), [floats(3, 4)]),
    "norm_all": (lambda x: x.norm(), [floats(3, 4)]),
    "logsumexp": (lambda x: x.logsumexp(0), [floats(3, 4)]),
    "softmax": (lambda x: x.softmax(-1), [floats(3, 4)]),
    "log_softmax0": (lambda x: x.log_softmax(0), [floats(3, 4)]),
    "cumsum": (lambda x: x.cumsum(1), [floats(3, 4)]),
    "cumprod": (lambda x: x.cumprod(0), [floats(3, 4)]),
    "sort": (lambda x: x.sort(-1), [floats(3, 4)]),
    "topk": (lambda x: x.topk(2), [floats(3, 4)]),
    "any_all": (lambda m: (m.any(-1), m.all()), [masks(3, 4)]),
    "sum_0d": (lambda x: x.sum(), [floats()]),
    "softmax_0d": (lambda x: x.softmax(0), [floats()]),
    "flip": (lambda x: x.flip(0, -1), [floats(3, 4)]),
    "searchsorted_1d": (lambda s, x: torch.searchsorted(s.sort()[0], x), [floats(5), floats(3, 2)]),
    "searchsorted_nd": (
        lambda s, x: torch.searchsorted(s.sort()[0], x, right=True),
        [floats(3, 5), floats(3, 2)],
    ),
    "median": (lambda x: x.median(1), [floats(3, 5)]),
}

VIEWS = {
    "view": (lambda x: x.view(3, 2, 2), [floats(3, 4)]),
    "reshape": (lambda x: x.reshape(-1), [floats(3, 4)]),
    "flatten": (lambda x: x.flatten(1), [floats(2, 3, 4)]),
    "permute": (lambda x: x.permute(2, 0, 1), [floats(2, 3, 4)]),
    "transpose": (lambda x: x.transpose(0, -1), [floats(2, 3, 4)]),
    "t_mT": (lambda x: x.t() + x.mT, [floats(3, 3)]),
    "unsqueeze": (lambda x: x.unsqueeze(-1).unsqueeze(0), [floats(3)]),
    "squeeze": (lambda x: x.squeeze(), [floats(1, 3, 1)]),
    "squeeze_dim": (lambda x: x.squeeze(-1), [floats(3, 1)]),
    "select": (lambda x: x[1], [floats(3, 4)]),
    "slice": (lambda x: x[:, 1:3], [floats(3, 4)]),
    "slice_step": (lambda x: x[::2, -2:], [floats(5, 4)]),
    "narrow": (lambda x: x.narrow(1, 1, 2), [floats(3, 4)]),
    "diagonal": (lambda x: x.diagonal(1), [floats(3, 4)]),
    "diag_embed": (lambda x: torch.diag_embed(x), [floats(3)]),
    "expand": (lambda x: x.expand(2, 3, 4), [floats(3, 1)]),
    "expand_as": (lambda x, y: x.expand_as(y), [floats(4), floats(3, 4)]),
    "split": (lambda x: x.split([1, 3], 1), [floats(3, 4)]),
    "chunk": (lambda x: x.chunk(2), [floats(4, 3)]),
    "unbind": (lambda x: x.unbind(1), [floats(3, 4)]),
    "cat": (lambda x, y: torch.cat([x, y], -1), [floats(3, 2), floats(3, 4)]),
    "cat0": (lambda x, y: torch.cat([x, y]), [floats(2), floats(3)]),
    "stack": (lambda x, y: torch.stack([x, y], 1), [floats(3, 2), floats(3, 2)]),
    "unfold": (lambda x: x.unfold(0, 2, 1), [floats(5)]),
    "roll": (lambda x: x.roll(1, 0), [floats(3, 4)]),
    "roll_flat": (lambda x: x.roll(2), [floats(3, 4)]),
    "repeat": (lambda x: x.repeat(2, 1, 3), [floats(3, 4)]),
    "movedim": (lambda x: x.movedim(0, -1), [floats(2, 3, 4)]),
    "tril": (lambda x: x.tril(), [floats(3, 3)]),
}

LINALG = {
    "matmul_mm": (torch.matmul, [floats(2, 3), floats(3, 4)]),
    "matmul_mv": (torch.matmul, [floats(2, 3), floats(3)]),
    "matmul_vm": (torch.matmul, [floats(3), floats(3, 4)]),
    "matmul_vv": (torch.matmul, [floats(3), floats(3)]),
    "matmul_batched": (torch.matmul, [floats(2, 2, 3), floats(3, 4)]),
    "mm": (torch.mm, [floats(2, 3), floats(3, 4)]),
    "bmm": (torch.bmm, [floats(2, 2, 3), floats(2, 3, 4)]),
    "dot": (torch.dot, [floats(3), floats(3)]),
    "mv": (torch.mv, [floats(2, 3), floats(3)]),
    "linear": (torch.nn.functional.linear, [floats(2, 3), floats(4, 3), floats(4)]),
    "linear_1d": (torch.nn.functional.linear, [floats(3), floats(4, 3), floats(4)]),
    "einsum": (lambda a, b: torch.einsum("ij,jk->ik", a, b), [floats(2, 3), floats(3, 4)]),
    "outer": (torch.outer, [floats(2), floats(3)]),
    "slogdet": (lambda a: torch.linalg.slogdet(_spd(a)), [floats(3, 3)]),
    "det_inv": (lambda a: (torch.linalg.det(a), torch.linalg.inv(_spd(a))), [floats(3, 3)]),
    "cholesky": (lambda a: torch.linalg.cholesky(_spd(a)), [floats(3, 3)]),
    "eigvalsh": (lambda a: torch.linalg.eigvalsh(_spd(a)), [floats(3, 3)]),
    "qr_r": (lambda a: torch.linalg.qr(a)[1].abs(), [floats(4, 3)]),
    "svdvals": (lambda a: torch.linalg.svdvals(a), [floats(4, 3)]),
    "solve_vec": (lambda a, b: torch.linalg.solve(_spd(a), b), [floats(3, 3), floats(3)]),
    "solve_mat": (lambda a, b: torch.linalg.solve(_spd(a), b), [floats(3, 3), floats(3, 2)]),
    "solve_triangular": (
        lambda a, b: torch.linalg.solve_triangular(_spd(a).tril(), b, upper=False),
        [floats(3, 3), floats(3, 2)],
    ),
    "cdist": (torch.cdist, [floats(4, 3), floats(5, 3)]),
    "diag": (lambda v, m: (torch.diag(v, 1), torch.diag(m)), [floats(3), floats(3, 3)]),
    "trace": (torch.trace, [floats(3, 3)]),
    "cross": (lambda a, b: torch.linalg.cross(a, b), [floats(2, 3), floats(2, 3)]),
    "broadcast_and": (
        lambda a, b: torch.broadcast_tensors(a, b)[0] + ((a > 0) & (b > 0)),
        [floats(3, 1), floats(4)],
    ),
}


def _spd(a):
    return a @ a.mT + 3 * torch.eye(a.shape[-1], dtype=a.dtype)


def _run(table, name):
    fn, specs = table[name]
    for in_dims in mixes(specs):
        check(fn, in_dims, *build(specs, in_dims))


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_elementwise(name):
    _run(ELEMENTWISE, name)


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reductions(name):
    _run(REDUCTIONS, name)


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_views(name):
    _run(VIEWS, name)


@pytest.mark.parametrize("name", sorted(LINALG))
def test_linalg(name):
    _run(LINALG, name)


def test_nested_vmap_with_out_dims_and_chunks():
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    y = torch.randn(5, 4, dtype=torch.float64)

    def f(a, b):
        return (a.sin() * b).sum(-1), a @ b.T if b.dim() == 2 else a * b

    from functransforms import vmap

    for od, cs in [(0, None), (1, 2), ((0, -1), 1), (-1, 5)]:
        inner = vmap(f, in_dims=(0, 1), out_dims=0)
        out = vmap(inner, in_dims=(0, None), out_dims=od, chunk_size=cs)(x, y)
        ref = torch.vmap(torch.vmap(f, in_dims=(0, 1)), in_dims=(0, None), out_dims=od)(x, y)
        for o, r in zip(out, ref):
            torch.testing.assert_close(o, r)


def test_chunk_size_matches_unchunked():
    x = torch.randn(7, 3, dtype=torch.float64)
    f = lambda x: (x.cumsum(0), x.norm())
    check(f, 0, x, chunk_size=3)
    check(f, 1, x.T.contiguous(), chunk_size=2, out_dims=(1, 0))
