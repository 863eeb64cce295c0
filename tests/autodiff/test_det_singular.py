"""det at singular matrices, as torch.func: its gradient is the adjugate (torch's SVD formula for
tensor subclasses; ours inverted A and raised LinAlgError), its jvp torch's LU with zero
pivots replaced by eps; the Hessian through both."""

import pytest
import torch
import torch.func as tf

import functransforms as ft

_D = torch.float64
_CASES = {
    "rank_1": torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=_D),
    "rank_2_of_3": torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.0, 1.0, 1.0]], dtype=_D),
    "zero": torch.zeros(3, 3, dtype=_D),
    "regular": torch.tensor([[2.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 4.0]], dtype=_D),
}


@pytest.mark.parametrize("name", sorted(_CASES))
def test_grad_jvp_hessian_vmap_match_torch_func(name):
    A = _CASES[name]
    det = torch.linalg.det
    torch.testing.assert_close(ft.grad(det)(A), tf.grad(det)(A))
    t = torch.ones_like(A)
    try:
        theirs = tf.jvp(det, (A,), (t,))
    except torch.linalg.LinAlgError:  # torch 2.15's jvp solves with A itself at the zero matrix
        theirs = None
    if theirs is not None:
        torch.testing.assert_close(ft.jvp(det, (A,), (t,)), theirs)
        torch.testing.assert_close(ft.hessian(det)(A), tf.hessian(det)(A), equal_nan=True)
    As = torch.stack([A, A + torch.eye(A.shape[0], dtype=_D)])
    torch.testing.assert_close(ft.vmap(ft.grad(det))(As), tf.vmap(tf.grad(det))(As))


def test_complex_grad_matches_torch_func():
    A = torch.tensor([[1 + 1j, 2 - 1j], [2 + 2j, 1 + 5j]], dtype=torch.complex128)
    f = lambda A: torch.linalg.det(A).abs()  # noqa: E731
    torch.testing.assert_close(ft.grad(f)(A), tf.grad(f)(A))
