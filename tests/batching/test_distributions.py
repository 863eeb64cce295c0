"""torch.distributions inside vmap: their argument checks call `torch._is_all_true(valid)` and
read the answer as a Python bool; as in torch.func, the check spans the whole batch and is not
batched (before, every vmapped log_prob raised DataDependentError)."""

import pytest
import torch
import torch.distributions as D
import torch.func as tf

import functransforms as ft

_X = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
_CASES = {
    "normal": lambda r: D.Normal(0.5, 1.5).log_prob(r).sum(),
    "normal_batched_loc": lambda r: D.Normal(r, 1.0).log_prob(torch.zeros(3, dtype=r.dtype)).sum(),
    "mvn": lambda r: D.MultivariateNormal(
        torch.zeros(3, dtype=r.dtype), torch.eye(3, dtype=r.dtype)
    ).log_prob(r),
    "categorical_logits": lambda r: D.Categorical(logits=r).log_prob(torch.tensor(1)),
    "gamma": lambda r: D.Gamma(r.exp(), 2.0).log_prob(torch.ones(3, dtype=r.dtype)).sum(),
    "bernoulli_logits": lambda r: (
        D.Bernoulli(logits=r).log_prob(torch.ones(3, dtype=r.dtype)).sum()
    ),
}


@pytest.mark.parametrize("name", sorted(_CASES))
def test_vmap_and_vmap_grad_of_log_prob_match_torch_func(name):
    f = _CASES[name]
    torch.testing.assert_close(ft.vmap(f)(_X), tf.vmap(f)(_X))
    torch.testing.assert_close(ft.vmap(ft.grad(f))(_X), tf.vmap(tf.grad(f))(_X))


@pytest.mark.parametrize("op", [torch._is_all_true, torch._is_any_true])
def test_is_all_any_true_span_the_whole_batch(op):
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0]])
    for cond in (lambda r: r > 0, lambda r: r < 0, lambda r: r > -5):
        torch.testing.assert_close(
            ft.vmap(lambda r, c=cond: op(c(r)))(x), tf.vmap(lambda r, c=cond: op(c(r)))(x)
        )


def test_an_invalid_example_fails_the_whole_batch_check():
    # validation on explicitly: an inductor compile earlier in the process turns torch's
    # default off (torch.distributions' validation is a process-wide default)
    with pytest.raises(ValueError, match="scale"):
        ft.vmap(lambda s: D.Normal(0.0, s, validate_args=True).log_prob(torch.zeros(())))(
            torch.tensor([1.0, -1.0])
        )
