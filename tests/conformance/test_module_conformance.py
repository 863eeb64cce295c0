"""Our transforms against torch.func on every nn.Module of PyTorch's module_db.

Note [Module conformance] (module_harness.py) says what each check computes and how the
verdict is reached. A disagreement that is not fixed yet is a strict xfail in ``EXPECTED``
with its root cause.
"""

from __future__ import annotations

import warnings

import module_harness as mh
import pytest
import torch

import functransforms as ft
from functransforms.testing import check_grads

# (case id, check) -> the root cause; strict xfails.
EXPECTED: dict[tuple[str, str], str] = {}


def _params():
    out = []
    for case_id in mh.case_ids():
        for check in mh.CHECKS:
            reason = EXPECTED.get((case_id, check))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            out.append(pytest.param(case_id, check, marks=marks, id=f"{check}[{case_id}]"))
    return out


@pytest.mark.parametrize(("case_id", "check"), _params())
def test_module(case_id, check):
    applied = 0
    why_not, verdicts = set(), set()
    for case in mh.cases(case_id):
        why = mh.applicable(check, case)
        if why is not None:
            why_not.add(why)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fallback loops, deprecations: values decide
            verdicts.add(mh.compare(check, case))
        applied += 1
    if not applied:
        pytest.skip(f"not applicable: {'; '.join(sorted(why_not))}")
    wrong = mh.TORCH_FUNC_WRONG.get((case_id, check))
    assert wrong is None or "torch.func wrong" in verdicts, (
        f"TORCH_FUNC_WRONG[{case_id!r}, {check!r}] says {wrong!r}, but torch.func agrees with a "
        "loop of autograd on every input: remove the entry"
    )


# Random modules: module_db builds every dropout with p=0, so these cases switch dropout on
# (p=0.5, training mode) to check randomness where torch.func defines it.
def _with_dropout(case_id):
    case = mh.cases(case_id)[0]
    for m in case.module.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.5
        if isinstance(m, (torch.nn.MultiheadAttention, torch.nn.RNNBase)):
            m.dropout = 0.5
    case.module.train()
    return case


_RANDOM_CASES = [
    "nn.TransformerEncoderLayer-train",
    "nn.MultiheadAttention-train",
    "nn.Transformer",
]


@pytest.mark.parametrize("case_id", _RANDOM_CASES)
def test_random_module_grad_same_stream(case_id):
    """grad and jvp outside vmap draw dropout's masks from torch's generator as torch does:
    from one seed, ours and torch.func drop the same units (compare() seeds both)."""
    case = _with_dropout(case_id)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for check in ("grad", "jvp"):
            assert mh.compare(check, case) == "both compute"


@pytest.mark.parametrize("case_id", _RANDOM_CASES)
def test_random_module_vmap_randomness(case_id):
    """vmap of a dropout module: randomness='error' raises like torch.func; 'same' gives one
    mask to B identical examples (identical rows), 'different' one mask per example; from one
    seed both draw what torch.func draws (batching/random.py keeps torch.func's streams)."""
    case = _with_dropout(case_id)
    xs = [torch.stack([x] * mh.B) for x in case.tensors]

    def f(api):
        def g(ts):
            return mh.floats_out(mh._call(api, case, case.module, case.params, ts, case.tensor_at))

        return g

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="randomness"):
            ft.vmap(f(mh.OURS))(xs)
        for randomness, identical in (("same", True), ("different", False)):
            torch.manual_seed(1)
            ours = ft.vmap(f(mh.OURS), randomness=randomness)(xs)
            torch.manual_seed(1)
            theirs = torch.func.vmap(f(mh.FUNC), randomness=randomness)(xs)
            torch.testing.assert_close(ours, theirs, **mh.TOL)
            out = ours[0]
            rows_equal = all(torch.allclose(out[0], out[k]) for k in range(1, mh.B))
            assert rows_equal == identical, randomness


@pytest.mark.parametrize(
    "module",
    [
        torch.nn.SoftMarginLoss(),  # torch's kernel: no derivative in the target
        torch.nn.LinearCrossEntropyLoss(  # the chunked ops: no forward formula in torch
            6, 4, options=torch.nn.LinearCrossEntropyOptions(batch_chunk_size=2)
        ).double(),
    ],
    ids=["SoftMarginLoss", "LinearCrossEntropyLoss"],
)
def test_beyond_torch_by_finite_differences(module):
    """Where ours differentiates what torch refuses or gets wrong (torch_func_differences.md
    37), finite differences agree, forward and reverse, to second order."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    if isinstance(module, torch.nn.SoftMarginLoss):
        args = (x, torch.randn(5, 6, generator=gen, dtype=torch.float64))
    else:
        args = (x, torch.randint(0, 4, (5,), generator=gen))
    names = [k for k, _ in module.named_parameters()]
    params = [v.detach() for _, v in module.named_parameters()]

    def f(*ps_and_args):  # check_grads differentiates the positional float tensors
        ps, args = ps_and_args[: len(names)], ps_and_args[len(names) :]
        return ft.functional_call(module, dict(zip(names, ps)), args)

    check_grads(f, (*params, *args), order=2)
