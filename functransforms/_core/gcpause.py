"""The cyclic garbage collector paused while the library builds its long-lived tables.

Note [Long-lived setup without young collections]
    ``import functransforms`` and the first transform calls build objects that live as long as
    the process: modules, rule tables, torch's per-op dispatch entries (Note [Entering through
    registered rules], _core/levels.py), the randomness guard's kernels. ~13k container objects in
    all for a first ``vmap(grad)``. Built with the collector running, they go through ~19 young
    collections that cannot free any of them, and they advance the generation counters
    ``import torch`` leaves just short of a full collection over torch's ~166k objects (Note
    [Cold start and torch's garbage], benchmarks/bench_core.py): the library's first call
    became the statement that paid that ~70 ms collection, a cost of torch's import.
    CPython's advice for bulk-building long-lived data is to pause the collector while doing
    it: the objects then count as one young collection, and the program's own allocations
    reach the full collection about where they would without this library (it still runs,
    once, in the program's code). Paused only around setup that runs once per process (package
    import, lazy imports, the first call's registrations), never on a per-call path; a
    collector the program disabled stays disabled, and nesting is harmless.

Note [One-time setup under one lock]
    The same blocks are the library's one-time setup, and two threads can make their first
    transform call at once (a thread pool's first batch): one thread's half-built state (a
    record published before its rules were filled, a rule family marked loaded before its
    import ended, the randomness guard's kernels half registered, the collector re-enabled by
    the other thread's exit) gave the other a missing-rule error, a duplicate registration or
    a random op that ``randomness='error'`` let through. So a pause also holds ``SETUP_LOCK``,
    a reentrant lock (setup nests: a record's fill loads a family, whose import registers
    rules): the setup of different threads runs one at a time, and each site checks its
    "done?" flag again under the lock and publishes its result last. Never taken on a per-call
    path. Lock order: this lock, then an import's module lock (every lazy import of the
    library runs under it).
"""

import functools
import gc
import threading

SETUP_LOCK = threading.RLock()


class paused_collector:
    """``with paused_collector(): ...`` runs the block with the cyclic collector disabled and
    re-enables it afterwards if, and only if, it was enabled before; holding ``SETUP_LOCK``."""

    __slots__ = ("was_enabled",)

    def __enter__(self):
        SETUP_LOCK.acquire()  # Note [One-time setup under one lock]
        self.was_enabled = gc.isenabled()
        gc.disable()
        return self

    def __exit__(self, *exc):
        if self.was_enabled:
            gc.enable()
        SETUP_LOCK.release()
        return False


def collector_paused(fn):
    """Decorator: ``fn`` runs under ``paused_collector()`` (for once-per-process setup)."""

    @functools.wraps(fn)
    def paused(*args, **kwargs):
        with paused_collector():
            return fn(*args, **kwargs)

    return paused
