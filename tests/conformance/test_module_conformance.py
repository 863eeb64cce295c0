"""Our transforms against torch.func on every nn.Module of PyTorch's module_db.

Note [Module conformance] (module_harness.py) says what each check computes and how the
verdict is reached. A disagreement that is not fixed yet is a strict xfail in ``EXPECTED``
with its root cause.
"""

from __future__ import annotations

import warnings

import module_harness as mh
import pytest

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
