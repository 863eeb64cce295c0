"""Forward mode beyond torch: torch has no forward-mode formula for these ops on CPU
(OpInfo supports_forward_ad=False), so there is no torch.func oracle. Ours is checked against
central finite differences: the jvp against differences of the function, and the jvp of the
pullback (forward over reverse, the Hessian-vector-product pattern) against differences of
the pullback. Points are generic (no ties, no kinks within the step)."""

import pytest
import torch
import torch.nn.functional as F

import functransforms as ft

F64 = torch.float64
EPS = 1e-6


def _x(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _ctc(x):
    targets = torch.tensor([[1, 2, 2], [3, 1, 0]])
    lens, tlens = torch.tensor([8, 6]), torch.tensor([3, 2])
    return F.ctc_loss(x.log_softmax(-1), targets, lens, tlens, reduction="none")


_BAG = torch.tensor([0, 2, 4, 5, 1, 3, 4])
_OFFSETS = torch.tensor([0, 3, 3, 5])  # an empty bag
_INDEX = torch.tensor([0, 2, 0, 3, 0])
_LENGTHS = torch.tensor([2, 0, 4])

CASES = {
    "cdist": (lambda a, b: torch.cdist(a, b), (_x(2, 4, 3), _x(2, 5, 3, seed=1))),
    "cdist-p3": (lambda a, b: torch.cdist(a, b, 3.0), (_x(4, 3), _x(5, 3, seed=1))),
    "pdist": (lambda x: F.pdist(x), (_x(5, 3),)),
    "pdist-p1.5": (lambda x: F.pdist(x, 1.5), (_x(5, 3),)),
    "grid_sample-2d": (
        lambda x, g: F.grid_sample(x, g, mode="bilinear", align_corners=False),
        (
            _x(2, 3, 5, 6),
            torch.rand(2, 4, 3, 2, generator=torch.Generator().manual_seed(1), dtype=F64) * 1.6
            - 0.8,
        ),
    ),
    "grid_sample-3d": (
        lambda x, g: F.grid_sample(x, g, mode="bilinear", padding_mode="border"),
        (
            _x(1, 2, 3, 4, 5),
            torch.rand(1, 2, 3, 2, 3, generator=torch.Generator().manual_seed(1), dtype=F64) * 1.6
            - 0.8,
        ),
    ),
    "embedding_bag-sum-weighted": (
        lambda W, w: F.embedding_bag(_BAG, W, _OFFSETS, mode="sum", per_sample_weights=w),
        (_x(6, 4), _x(7, seed=1)),
    ),
    "embedding_bag-mean": (lambda W: F.embedding_bag(_BAG, W, _OFFSETS, mode="mean"), (_x(6, 4),)),
    "embedding_bag-max": (lambda W: F.embedding_bag(_BAG, W, _OFFSETS, mode="max"), (_x(6, 4),)),
    "ctc_loss": (_ctc, (_x(8, 2, 5),)),
    "segment_reduce-sum": (lambda d: torch.segment_reduce(d, "sum", lengths=_LENGTHS), (_x(6, 3),)),
    "segment_reduce-prod": (
        lambda d: torch.segment_reduce(d, "prod", lengths=_LENGTHS),
        (_x(6, 3),),
    ),
    "segment_reduce-max": (  # (an empty segment's max is -inf: no differences there)
        lambda d: torch.segment_reduce(d, "max", lengths=torch.tensor([2, 4])),
        (_x(6, 3),),
    ),
    "index_reduce-prod": (
        lambda x, s: x.index_reduce(0, _INDEX, s, "prod"),
        (_x(4, 3), _x(5, 3, seed=1)),
    ),
    "index_reduce-mean": (
        lambda x, s: x.index_reduce(0, _INDEX, s, "mean", include_self=False),
        (_x(4, 3), _x(5, 3, seed=1)),
    ),
    "index_reduce-amax": (
        lambda x, s: x.index_reduce(0, _INDEX, s, "amax"),
        (_x(4, 3), _x(5, 3, seed=1)),
    ),
    "scaled_dot_product_attention": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
        (_x(2, 3, 4), _x(2, 5, 4, seed=1), _x(2, 5, 4, seed=2)),
    ),
    "scaled_dot_product_attention-causal": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        (_x(2, 3, 4), _x(2, 3, 4, seed=1), _x(2, 3, 4, seed=2)),
    ),
}


# Not covered: jvp over the vjp of these ops. Their vjp is torch's backward kernel, which has
# no derivative rule of ours (nor of torch's)
def _moved(args, ts, s):
    return tuple(a + s * EPS * t for a, t in zip(args, ts))


@pytest.mark.parametrize("case", sorted(CASES))
def test_jvp_and_jvp_of_vjp_match_finite_differences(case):
    f, args = CASES[case]
    gen = torch.Generator().manual_seed(5)
    ts = tuple(torch.randn(a.shape, generator=gen, dtype=F64) for a in args)
    # jvp against central differences of f
    out, tangent = ft.jvp(f, args, ts)
    fd = (f(*_moved(args, ts, 1)) - f(*_moved(args, ts, -1))) / (2 * EPS)
    torch.testing.assert_close(tangent, fd, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, f(*args))
    # jvp of the pullback against central differences of the pullback
    ct = torch.randn(out.shape, generator=gen, dtype=F64)

    def pullback(*p):
        return ft.vjp(f, *p)[1](ct)

    hvp = ft.jvp(pullback, args, ts)[1]
    hi, lo = pullback(*_moved(args, ts, 1)), pullback(*_moved(args, ts, -1))
    for h, a, b in zip(hvp, hi, lo):
        torch.testing.assert_close(h, (a - b) / (2 * EPS), atol=1e-5, rtol=1e-5)
