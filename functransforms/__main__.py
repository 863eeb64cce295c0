"""``python -m functransforms [--quick]``: the tour.

The tour compares our transforms with PyTorch's own (the oracle and baseline), which library
code must never call, so it lives beside the benchmarks in ``benchmarks/tour.py`` and this
module only runs it from the source checkout (the README installs the package editable).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

TOUR = Path(__file__).resolve().parent.parent / "benchmarks" / "tour.py"


def main() -> int:
    if not TOUR.is_file():
        print(
            f"python -m functransforms: the tour ships with the source checkout ({TOUR} is "
            "missing). Clone the repository and run `pip install -e '.[test]'` first.",
            file=sys.stderr,
        )
        return 2
    sys.argv[0] = str(TOUR)
    runpy.run_path(str(TOUR), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
