"""Gradients come back in torch.func's memory layout: code that calls ``.view`` on a gradient
(``grads['w'].view(B, -1)``, flattening per-sample gradients) works with torch.func's, so it must
with ours (a transposed-stride weight gradient made ``.view`` raise)."""

import pytest
import torch
import torch.func as tf
import torch.nn.functional as F

import functransforms as ft

_G = torch.Generator().manual_seed(0)
_P = {
    "w0": torch.randn(16, 12, generator=_G),
    "b0": torch.zeros(16),
    "w1": torch.randn(4, 16, generator=_G),
    "c": torch.randn(3, 1, 3, 3, generator=_G),
}
_X = torch.randn(5, 12, generator=_G)
_IMG = torch.randn(5, 1, 6, 6, generator=_G)


def _mlp(p, x):
    return F.linear(F.linear(x, p["w0"], p["b0"]).tanh(), p["w1"]).pow(2).sum()


def _conv(p, img):
    return F.conv2d(img[None], p["c"]).tanh().sum()


@pytest.mark.parametrize("per_sample", [False, True])
@pytest.mark.parametrize("loss, data", [(_mlp, _X), (_conv, _IMG)], ids=["mlp", "conv"])
def test_gradient_strides_match_torch_func(loss, data, per_sample):
    if per_sample:
        ours = ft.vmap(ft.grad(loss), in_dims=(None, 0))(_P, data)
        theirs = tf.vmap(tf.grad(loss), in_dims=(None, 0))(_P, data)
    else:
        ours, theirs = ft.grad(loss)(_P, data[0]), tf.grad(loss)(_P, data[0])
    for k in _P:
        assert ours[k].stride() == theirs[k].stride(), k
        if theirs[k].is_contiguous():  # (an unused input's zeros are expanded in both)
            ours[k].view(-1)  # flattening a gradient works, as with torch.func's
