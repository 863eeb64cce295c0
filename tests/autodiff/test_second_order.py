"""Second order through the layer families and the linalg decompositions: grad(grad),
jacfwd(jacrev) and hessian of a scalar function against torch.func, in float64 at small sizes.
Each function's scalar is gauge-invariant where the decomposition has a gauge (eigenvector and
singular-vector signs/phases)."""

import pytest
import torch
import torch.nn.functional as F
from torch import func as tf

import functransforms as ft

F64 = torch.float64


def _x(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


_W = {n: _x(*s, seed=10 + i) for i, (n, s) in enumerate({"w1": (2, 1, 3), "w2": (2, 1, 3, 3),
                                                         "wt": (1, 2, 2, 2)}.items())}  # fmt: skip
_M = _x(4, 4, seed=3)
_SPD = _M @ _M.mT + 4 * torch.eye(4, dtype=F64)
_B = _x(4, 2, seed=4)
_B5 = _x(5, 2, seed=5)
_P, _PW = torch.sigmoid(_x(2, 3, seed=6)), _x(3, seed=7).exp()


def _sym(x):
    return (x + x.mT) / 2


def _weigh(y, seed=20):
    """A fixed weighted sum (weights from cos, not a random draw: f runs under vmap)."""
    w = torch.cos(torch.arange(y.numel(), dtype=F64) * (seed / 7 + 1) + seed).reshape(y.shape)
    return (y * w).sum()


# name -> (scalar function, input shape)
CASES = {
    # convolution
    "conv1d": (lambda x: _weigh(torch.tanh(F.conv1d(x, _W["w1"], padding=1))), (1, 1, 5)),
    "conv2d-strided": (
        lambda x: _weigh(torch.tanh(F.conv2d(x, _W["w2"], stride=2, padding=1))),
        (1, 1, 4, 4),
    ),
    "conv_transpose2d": (
        lambda x: _weigh(torch.tanh(F.conv_transpose2d(x, _W["wt"], stride=2))),
        (1, 1, 2, 3),
    ),
    # pooling
    "max_pool2d": (lambda x: _weigh(F.max_pool2d(x, 2) ** 2), (1, 2, 4, 4)),
    "avg_pool2d": (lambda x: _weigh(torch.sin(F.avg_pool2d(x, 2, stride=1))), (1, 1, 4, 4)),
    "adaptive_avg_pool2d": (lambda x: _weigh(F.adaptive_avg_pool2d(x, 2) ** 3), (1, 1, 5, 4)),
    "adaptive_max_pool1d": (lambda x: _weigh(F.adaptive_max_pool1d(x, 3) ** 2), (1, 2, 7)),
    "lp_pool2d": (lambda x: _weigh(F.lp_pool2d(x.exp(), 2, 2)), (1, 1, 4, 4)),
    # normalization
    "layer_norm": (lambda x: _weigh(F.layer_norm(x, (4,)) ** 2), (3, 4)),
    "group_norm": (lambda x: _weigh(F.group_norm(x, 2) ** 2), (2, 4, 3)),
    "batch_norm-train": (lambda x: _weigh(F.batch_norm(x, None, None, training=True) ** 2), (4, 3)),
    "instance_norm": (lambda x: _weigh(F.instance_norm(x) ** 2), (2, 2, 4)),
    "rms_norm": (lambda x: _weigh(F.rms_norm(x, (4,)) ** 2), (3, 4)),
    "linalg.vector_norm": (lambda x: torch.linalg.vector_norm(x, 3), (6,)),
    "linalg.matrix_norm-fro": (lambda x: torch.linalg.matrix_norm(x) ** 3, (3, 4)),
    "linalg.matrix_norm-nuc": (lambda x: torch.linalg.matrix_norm(x, "nuc"), (3, 4)),
    # activations and losses whose backward kernels have saved buffers: log_sigmoid_backward
    # decomposed under vmap read exp(-|x|) from its buffer, so jacfwd(jacrev) gave 0
    "logsigmoid": (lambda x: _weigh(F.logsigmoid(x)), (2, 3)),
    "bce_with_logits": (
        lambda x: F.binary_cross_entropy_with_logits(x, _P, pos_weight=_PW),
        (2, 3),
    ),
    "multilabel_soft_margin": (
        lambda x: F.multilabel_soft_margin_loss(x, (_P > 0.5).to(F64)),
        (2, 3),
    ),
    # linalg decompositions
    "cholesky": (lambda x: _weigh(torch.linalg.cholesky(_SPD + _sym(x))), (4, 4)),
    "qr": (lambda x: _weigh(torch.linalg.qr(x)[0]) + _weigh(torch.linalg.qr(x)[1], 21), (4, 3)),
    "eigh": (
        lambda x: (
            _weigh(torch.linalg.eigh(_sym(x))[0]) + _weigh(torch.linalg.eigh(_sym(x))[1] ** 2)
        ),
        (4, 4),
    ),
    "svd": (
        lambda x: _weigh(torch.linalg.svdvals(x)) + _weigh(torch.linalg.svd(x)[0][:, :3] ** 2),
        (4, 3),
    ),
    "eigvals": (lambda x: _weigh(torch.linalg.eigvals(_SPD + x).real), (4, 4)),
    "lu": (lambda x: sum(_weigh(t, 20 + i) for i, t in enumerate(torch.linalg.lu(x)[1:])), (4, 4)),
    "lu_factor+lu_solve": (
        lambda x: _weigh(torch.linalg.lu_solve(*torch.linalg.lu_factor(_SPD + x), _B)),
        (4, 4),
    ),
    "solve": (lambda x: _weigh(torch.linalg.solve(_SPD + x, _B)), (4, 4)),
    "slogdet": (lambda x: torch.linalg.slogdet(_SPD + x)[1], (4, 4)),
    "lstsq": (lambda x: _weigh(torch.linalg.lstsq(x, _B5).solution), (5, 3)),
    "pinv": (lambda x: _weigh(torch.linalg.pinv(x)), (4, 3)),
    "matrix_exp": (lambda x: _weigh(torch.linalg.matrix_exp(x / 2)), (3, 3)),
}


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("case", sorted(CASES))
def test_grad_grad_jacfwd_jacrev_hessian_match_torch_func(case):
    f, shape = CASES[case]
    x = _x(*shape, seed=1)
    v = _x(*shape, seed=2)
    _close(ft.grad(f)(x), tf.grad(f)(x))

    def gg(grad):
        return grad(lambda y: (grad(f)(y) * v).sum())(x)

    _close(gg(ft.grad), gg(tf.grad))
    _close(ft.jacfwd(ft.jacrev(f))(x), tf.jacfwd(tf.jacrev(f))(x))
    _close(ft.hessian(f)(x), tf.hessian(f)(x))
