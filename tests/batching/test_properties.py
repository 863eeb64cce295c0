"""Property: vmap(f) equals the stacked per-example loop, for random compositions of
elementwise, reduction and view ops and every in_dims mix of (0, 1, -1, None)."""

import torch
from _vmap_helpers import check_loop
from hypothesis import given
from hypothesis import strategies as st

UNARY = [torch.sin, torch.tanh, torch.exp, lambda x: x.abs().sqrt(), torch.relu, lambda x: x**2]
BINARY = [torch.add, torch.mul, torch.sub, torch.maximum, lambda a, b: torch.where(a > b, a, b)]
# shape-preserving-rank ops on a [3, 4] logical tensor
VIEWISH = [
    lambda x: x,
    lambda x: x.flip(-1),
    lambda x: x.cumsum(0),
    lambda x: x.softmax(-1),
    lambda x: x.roll(1, 1),
    lambda x: torch.cat([x[:, :2], x[:, 2:]], 1),
    lambda x: x.reshape(4, 3).T,
    lambda x: x.sum(0, keepdim=True).expand(3, 4),
    lambda x: x.mean(-1, keepdim=True) - x,
    lambda x: x.amax(1, keepdim=True) * x,
]
FINAL = [
    lambda x: x,
    lambda x: x.sum(),
    lambda x: x.sum(1),
    lambda x: x.T,
    lambda x: x[1:, ::2],
    lambda x: x.unsqueeze(0).squeeze(0),
    lambda x: torch.stack([x, x], 1).flatten(1),
    lambda x: x.norm(dim=0),
]


@given(
    u=st.sampled_from(range(len(UNARY))),
    b=st.sampled_from(range(len(BINARY))),
    v=st.sampled_from(range(len(VIEWISH))),
    f=st.sampled_from(range(len(FINAL))),
    d0=st.sampled_from([0, 1, -1, None]),
    d1=st.sampled_from([0, 1, -1, None]),
    seed=st.integers(0, 2**16),
)
def test_vmap_equals_loop(u, b, v, f, d0, d1, seed):
    if d0 is None and d1 is None:
        d1 = 0
    gen = torch.Generator().manual_seed(seed)

    def make(d):
        shape = [3, 4]
        if d is not None:
            shape.insert(d % 3, 5)
        return torch.randn(shape, dtype=torch.float64, generator=gen)

    def fn(x, y):
        return FINAL[f](VIEWISH[v](BINARY[b](UNARY[u](x), y)))

    check_loop(fn, (d0, d1), make(d0), make(d1))
