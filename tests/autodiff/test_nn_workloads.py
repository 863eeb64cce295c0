"""Whole networks as users write them, against torch.func: the per-sample-gradient CNN of
torch.func's tutorial and a ResNet basic block (conv-bn-relu-conv-bn + skip)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _ad_helpers import assert_trees_close

import functransforms as ft

F64 = torch.float64


class SimpleCNN(nn.Module):
    """torch.func's per-sample-gradients tutorial model."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


class BasicBlock(nn.Module):
    """ResNet's basic block: conv-bn-relu-conv-bn, plus the identity, then relu."""

    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + x)


def test_per_sample_gradients_tutorial_cnn():
    model = SimpleCNN().to(F64)
    params = {k: v.detach() for k, v in model.named_parameters()}
    data = torch.randn(4, 1, 28, 28, dtype=F64)
    targets = torch.randint(10, (4,))

    def make(lib):
        def loss(p, x, t):
            out = lib.functional_call(model, p, (x.unsqueeze(0),))
            return F.nll_loss(out, t.unsqueeze(0))

        return lib.vmap(lib.grad(loss), in_dims=(None, 0, 0))

    ours = make(ft)(params, data, targets)
    ref = make(torch.func)(params, data, targets)
    assert_trees_close(ours, ref)
    # and the sum of per-sample gradients is the batch gradient (of the summed loss)
    batch = torch.func.grad(
        lambda p: F.nll_loss(
            torch.func.functional_call(model, p, (data,)), targets, reduction="sum"
        )
    )(params)
    assert_trees_close({k: v.sum(0) for k, v in ours.items()}, batch)


@pytest.mark.parametrize("training", [True, False])
def test_resnet_basic_block(training):
    torch.manual_seed(0)
    block = BasicBlock(4).to(F64).train(training)
    for m in block.modules():  # non-trivial affine parameters and running statistics
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_()
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 1.5)
            # the module's Python-side `num_batches_tracked.add_(1)` on a captured buffer is
            # refused by torch.func; the kernel's running-statistics update is what we compare
            m.num_batches_tracked = None
    ref_block = copy.deepcopy(block)
    params = {k: v.detach() for k, v in block.named_parameters()}
    x = torch.randn(3, 4, 6, 6, dtype=F64)

    def make(lib, mod):
        def loss(p, x):
            return (lib.functional_call(mod, p, (x,)) ** 2).mean()

        return loss

    loss, ref_loss = make(ft, block), make(torch.func, ref_block)
    assert_trees_close(
        ft.grad(loss, (0, 1))(params, x), torch.func.grad(ref_loss, (0, 1))(params, x)
    )
    tangents = ({k: torch.randn_like(v) for k, v in params.items()}, torch.randn_like(x))
    assert_trees_close(
        ft.jvp(loss, (params, x), tangents), torch.func.jvp(ref_loss, (params, x), tangents)
    )
    # Hessian-vector product (forward over reverse)
    assert_trees_close(
        ft.jvp(ft.grad(loss, (0, 1)), (params, x), tangents)[1],
        torch.func.jvp(torch.func.grad(ref_loss, (0, 1)), (params, x), tangents)[1],
    )
    # running statistics moved exactly as torch's (training) or not at all (eval)
    assert_trees_close(dict(block.named_buffers()), dict(ref_block.named_buffers()))
