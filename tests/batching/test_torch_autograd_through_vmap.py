"""torch's own autograd through what our vmap returns (``loss.backward()`` of a vmapped
function): the same gradients as through torch.func.vmap and the per-example loop."""

import torch
import torch.nn.functional as F

import functransforms as ft

D = torch.float64


def _grads(vmap, f, xs, in_dims, ws):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    out = vmap(f, in_dims=in_dims)(*xs)
    out = out if isinstance(out, tuple) else (out,)
    return out, torch.autograd.grad(out, xs, ws, allow_unused=True, materialize_grads=True)


def _loop(f, in_dims):
    def stacked(*xs):
        rows = [f(*[x if d is None else x[b] for x, d in zip(xs, in_dims)]) for b in range(3)]
        rows = [r if isinstance(r, tuple) else (r,) for r in rows]
        return tuple(torch.stack(o) for o in zip(*rows))

    return stacked


def _agree(f, xs, in_dims, ws):
    ours = _grads(ft.vmap, f, xs, in_dims, ws)
    loop = _grads(lambda g, in_dims: _loop(g, in_dims), f, xs, in_dims, ws)
    for a, b in zip((*ours[0], *ours[1]), (*loop[0], *loop[1])):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, equal_nan=False)


def test_unbatched_output_keeps_its_torch_history():
    """Note [Unbatched outputs under torch's autograd] (batching/_tensor.py): lstsq's empty
    residuals, not batched by the rule, reached a dead wrapper in backward."""
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(3, 2, 3, dtype=D, generator=gen)
    b = torch.randn(2, 3, dtype=D, generator=gen)

    def f(A, b):
        sol, res = torch.linalg.lstsq(A, b, driver="gels")[:2]
        return sol, res

    ws = [torch.randn(3, 3, 3, dtype=D, generator=gen), torch.zeros(3, 0, dtype=D)]
    _agree(f, [A, b], (0, None), ws)


def test_embedding_bag_loop_runs_the_differentiable_op():
    """embedding_bag reaches vmap's loop as _embedding_bag_forward_only, which torch's autograd
    refuses: the loop runs _embedding_bag when torch records."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3, 10, 5, dtype=D, generator=gen)
    psw = torch.randn(3, 5, dtype=D, generator=gen)
    idx, off = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2])

    def f(w, p):
        return F.embedding_bag(idx, w, offsets=off, mode="sum", per_sample_weights=p)

    _agree(f, [w, psw], (0, 0), [torch.randn(3, 2, 5, dtype=D, generator=gen)])


def test_safe_softmax_rows_of_minus_inf_have_zero_gradient():
    """_safe_softmax's own rule, not torch's decomposition (NaN in rows of -inf)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2, 3, dtype=D, generator=gen)
    x[:, 0, :] = float("-inf")
    x[0, 1, 0] = float("-inf")

    def f(x):
        return torch.ops.aten._safe_softmax.default(x, 1)

    _agree(f, [x], (0,), [torch.randn(3, 2, 3, dtype=D, generator=gen)])
