"""Ops whose output size depends on the values under vmap: torch.func refuses nonzero/unique even
when the sizes agree, and so do we; a per-example loop whose results differ in shape raises a
clear DataDependentError instead of torch.stack's internal error."""

import pytest
import torch
import torch.func as tf

import functransforms as ft
from functransforms.errors import DataDependentError

_EQUAL_COUNTS = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 4.0]])
_INTS = torch.tensor([[0, 1, 1], [2, 2, 0]])


@pytest.mark.parametrize(
    "fn",
    [
        torch.nonzero,
        torch.unique,
        torch.unique_consecutive,
        lambda t: torch.unique(t, dim=0),
        lambda t: torch.unique(t, return_counts=True)[1],
    ],
    ids=["nonzero", "unique", "unique_consecutive", "unique_dim", "unique_counts"],
)
def test_refused_like_torch_func_even_when_sizes_agree(fn):
    x = _EQUAL_COUNTS if fn is torch.nonzero else _INTS
    with pytest.raises(RuntimeError, match="dynamic shape"):
        tf.vmap(fn)(x)
    with pytest.raises(DataDependentError, match="depends on the values"):
        ft.vmap(fn)(x)


@pytest.mark.parametrize(
    "fn, x",
    [
        (torch.bincount, _INTS),
        (torch.repeat_interleave, torch.tensor([[1, 2], [0, 1]])),
    ],
    ids=["bincount", "repeat_interleave"],
)
def test_loop_with_ragged_results_is_a_clear_error(fn, x):
    # torch.func: torch.stack's error (2.13), or asks for output_size (repeat_interleave, 2.15)
    with pytest.raises(RuntimeError, match="stack expects|output_size"):
        tf.vmap(fn)(x)
    with pytest.raises(DataDependentError, match=r"depends on the values.*give shapes \["):
        ft.vmap(fn)(x)


@pytest.mark.filterwarnings("ignore")  # both libraries warn that they loop
@pytest.mark.parametrize(
    "fn, x",
    [
        (lambda t: torch.bincount(t, minlength=4), torch.tensor([[0, 1], [2, 2]])),
        (torch.repeat_interleave, torch.tensor([[1, 1], [2, 0]])),
    ],
    ids=["bincount_minlength", "repeat_interleave_equal_totals"],
)
def test_loop_with_equal_sizes_still_batches(fn, x):
    expected = torch.stack([fn(x_i) for x_i in x])  # torch.func 2.15 refuses repeat_interleave
    torch.testing.assert_close(ft.vmap(fn)(x), expected)
