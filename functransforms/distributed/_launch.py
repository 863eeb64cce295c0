"""Local multi-process runs for ``pmap``: ``launch(fn, nprocs, *args)``.

``launch`` is for tests and notebooks: it starts ``nprocs`` processes on this machine, joins them
in a ``torch.distributed`` process group (gloo on CPU, nccl when every worker has its own CUDA
device), calls ``fn(*args)`` in each and returns the results ordered by rank. Under ``torchrun``
(or any code that initialises the process group itself) call ``pmap`` directly instead.

Note [Failures in one worker]
    When a worker raises, the others usually fail shortly after with secondary errors ("connection
    closed by peer", a timeout in a collective) or block in a collective forever. Each worker
    therefore reports its exception with a timestamp; the launcher re-raises the *earliest* one,
    with that worker's rank and traceback, and terminates the rest. The group's timeout bounds
    the wait of workers blocked in a collective, and the launcher's own deadline bounds the rest.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_module
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["WorkerError", "launch"]


class WorkerError(RuntimeError):
    """A worker started by ``launch`` raised; the message holds its rank and traceback."""

    def __init__(self, rank, message):
        super().__init__(message)
        self.rank = rank


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, nprocs, port, backend, timeout, fn, args, results):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # nprocs workers share the machine's cores
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=nprocs,
            timeout=datetime.timedelta(seconds=timeout),
        )
        out = fn(*args)
        # plain pickle: a tensor sent through a torch.multiprocessing queue lives in shared
        # memory owned by this process, which exits right after
        results.put((rank, time.time(), True, pickle.dumps(out)))
    except BaseException as e:  # noqa: BLE001 - every failure must reach the launcher
        text = "".join(traceback.format_exception(e))
        results.put((rank, time.time(), False, f"{type(e).__name__}: {e}\n\n{text}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _check_alive(fn, nprocs, procs, outs, dead_since, deadline, timeout):
    """Raise if a worker died without reporting (killed, or crashed below Python) or the
    launcher's deadline passed."""
    name = f"launch({getattr(fn, '__name__', fn)}, {nprocs})"
    now = time.monotonic()
    for rank, p in enumerate(procs):
        if rank in outs or p.exitcode is None:
            continue
        # its report may still be in the queue's pipe: give it a moment
        if now - dead_since.setdefault(rank, now) > 2.0:
            raise WorkerError(
                rank,
                f"{name}: worker {rank} exited with code {p.exitcode} without reporting a result "
                "or a Python exception (killed, or it crashed in native code). If it started "
                "at all, check that the calling script guards its entry point with "
                "`if __name__ == '__main__':` (workers are spawned and import it).",
            )
    if now > deadline:
        silent = [r for r in range(nprocs) if r not in outs]
        raise WorkerError(
            silent[0],
            f"{name}: workers {silent} sent nothing for {timeout + 30:.0f} s (a hang); they "
            "were terminated.",
        )


def launch(fn, nprocs, *args, backend=None, timeout=60.0):
    """Run ``fn(*args)`` in ``nprocs`` local processes joined in a process group.

    Args:
        fn: a picklable function (defined at module level: the workers are spawned, so they
            import it by name).
        nprocs: the number of processes (the world size).
        *args: picklable arguments passed to ``fn`` in every process.
        backend: ``"gloo"`` or ``"nccl"``; by default nccl when CUDA has at least ``nprocs``
            devices, gloo otherwise.
        timeout: seconds a collective may wait for the others before it fails; the launcher
            gives up (terminating every worker) after ``timeout + 30`` seconds without news.

    Returns:
        ``[fn's result in rank 0, ..., in rank nprocs - 1]``.

    Raises:
        WorkerError: with the rank and traceback of the first worker that raised
            (Note [Failures in one worker]).

    Example (not run as a doctest: it spawns processes)::

        def step(seed):                       # at module level
            x = torch.full((1, 3), float(dist.get_rank()))  # this process's shard
            return ft.pmap(lambda t: ft.psum(t, "d"), "d")(x)

        ft.distributed.launch(step, 2, 0)     # [tensor([[1., 1., 1.]]), tensor([[1., 1., 1.]])]
    """
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"launch(fn, nprocs={nprocs!r}): expected a positive int.")
    if backend is None:
        backend = "nccl" if torch.cuda.device_count() >= nprocs else "gloo"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, nprocs, port, backend, timeout, fn, args, results),
            daemon=True,
        )
        for rank in range(nprocs)
    ]
    for p in procs:
        p.start()
    outs, errors = {}, []
    deadline = time.monotonic() + timeout + 30
    dead_since = {}
    try:
        while len(outs) + len(errors) < nprocs:
            try:
                rank, stamp, ok, payload = results.get(timeout=0.5)
            except queue_module.Empty:
                _check_alive(fn, nprocs, procs, outs, dead_since, deadline, timeout)
                continue
            if ok:
                outs[rank] = pickle.loads(payload)
            else:
                errors.append((stamp, rank, payload))
                break  # the first failure decides; the others are secondary
        if errors:
            time.sleep(0.5)  # collect errors that were raised earlier but arrived later
            while True:
                try:
                    rank, stamp, ok, payload = results.get_nowait()
                except queue_module.Empty:
                    break
                if not ok:
                    errors.append((stamp, rank, payload))
            stamp, rank, payload = min(errors)
            raise WorkerError(
                rank,
                f"launch({getattr(fn, '__name__', fn)}, {nprocs}): worker {rank} raised {payload}",
            )
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=0 if errors else 5)
            if p.is_alive():
                p.terminate()
                p.join()
    return [outs[r] for r in range(nprocs)]
