"""jvps written as torch writes them (softmax, log_softmax, logsumexp, the normalizations):
bit-identical to torch.func's."""

import pytest
import torch
import torch.func as tf
import torch.nn.functional as F

import functransforms as ft

D = torch.float64


# -- 3. jvps written as torch writes them: bit-identical to torch.func ------------------------
def _affine(n, dtype):
    return torch.linspace(0.5, 2, n, dtype=dtype), torch.linspace(-1, 1, n, dtype=dtype)


_JVP_CASES = {
    "softmax": lambda a: F.softmax(a, -1),
    "softmax_dim0": lambda a: F.softmax(a, 0),
    "log_softmax": lambda a: F.log_softmax(a, -1),
    "logsumexp": lambda a: torch.logsumexp(a, -1),
    "logsumexp_all": lambda a: torch.logsumexp(a, tuple(range(a.dim()))),
    "layer_norm": lambda a: F.layer_norm(a, a.shape[-1:]),
    "layer_norm_affine": lambda a: F.layer_norm(a, a.shape[-1:], *_affine(a.shape[-1], a.dtype)),
    "layer_norm_2d": lambda a: F.layer_norm(a, a.shape[-2:]),
    "batch_norm_train": lambda a: F.batch_norm(
        a, None, None, *_affine(a.shape[1], a.dtype), training=True
    ),
    "group_norm": lambda a: F.group_norm(a, 2, *_affine(a.shape[1], a.dtype)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(4, 6), (3, 4, 10), (2, 6, 33)])
@pytest.mark.parametrize("name", list(_JVP_CASES))
def test_jvp_bit_identical_to_torch_func(name, shape, dtype):
    if name == "batch_norm_train" and dtype == torch.float16:
        pytest.skip("torch's CPU batch_norm has no float16 kernel")
    gen = torch.Generator().manual_seed(sum(map(ord, name)) + sum(shape))
    x = torch.randn(shape, generator=gen).to(dtype)
    t = torch.randn(shape, generator=gen).to(dtype)
    f = _JVP_CASES[name]
    out, tan = ft.jvp(f, (x,), (t,))
    ref_out, ref_tan = tf.jvp(f, (x,), (t,))
    assert torch.equal(out, ref_out)
    assert torch.equal(tan, ref_tan), (tan.double() - ref_tan.double()).abs().max()
