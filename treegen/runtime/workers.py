"""Tensor parallel from a plain Python process or a notebook: the user's process is rank 0 and starts the rest.

:func:`start_team` makes a process group of ``tensor_parallel`` processes on this host (gloo on the
CPU, NCCL with one GPU per rank on CUDA, meeting on a free localhost port), starting ranks 1.. with
``torch.multiprocessing`` (spawn). Each worker loads its shard of the model and then follows rank 0:
it mirrors every tree run of rank 0 (:mod:`treegen.runtime.mirror`), fed by a queue of its own.

Faults: a worker that raises reports its traceback on the team's error queue and exits; a watchdog
thread on rank 0 notices a worker that ended (exception, killed) within ``WATCHDOG_S``. Rank 0 then
raises :class:`WorkerError` with that worker's error — at once if it was waiting in a collective
(the dead peer's connections close: gloo raises; on NCCL the watchdog aborts the groups), else at
its next call. A worker whose rank 0 is gone exits on its own. :meth:`Team.close` (``Engine.close``,
garbage collection, interpreter exit) tells the workers to exit and joins them, ending any that do
not within ``JOIN_S``: no process outlives the engine.
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue
import socket
import threading
import time
import traceback

import torch


WATCHDOG_S = 0.2  # how often rank 0 looks at its workers
JOIN_S = 10.0  # how long a worker may take to exit when told to
REPORT_S = 10.0  # how long rank 0 waits for a dead worker's report after a collective failed
FAULT_ENV = "TREEGEN_WORKER_FAULT"  # "RANK:CALL": that worker raises at its CALL-th call, 0: while starting (tests)


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed (its error is in the message); the engine cannot go on."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Team:
    """Rank 0's handle on its workers: their queues and processes, the watchdog, the first failure."""

    def __init__(self, processes, inboxes, errors) -> None:
        self.processes, self.inboxes, self.errors = processes, inboxes, errors
        self.failure: str | None = None
        self.closed = False
        self._lock = threading.Lock()
        self._watchdog = threading.Thread(target=self._watch, name="treegen-tp-watchdog", daemon=True)
        self._watchdog.start()
        atexit.register(self.close)

    # messages -------------------------------------------------------------------------------------
    def send(self, message) -> None:
        """To every worker, pickled now (the tree it carries may change right after)."""
        self.check()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for inbox in self.inboxes:
            inbox.put(data)

    def send_quietly(self, message) -> None:
        if self.failure is None and not self.closed:
            try:
                self.send(message)
            except Exception:  # noqa: BLE001 - the workers are gone: nothing to tell them
                pass

    # faults ---------------------------------------------------------------------------------------
    def check_started(self) -> None:
        """While the group is being made: raise :class:`WorkerError` (with its report, when it sends one)
        if a worker has died."""
        if self.failure is None and all(p.is_alive() for p in self.processes):
            return
        deadline = time.monotonic() + REPORT_S  # the watchdog records the dead worker's report
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(WATCHDOG_S / 4)
        raise WorkerError(self.failure or "a tensor-parallel worker exited before joining the group")

    def check(self) -> None:
        if self.failure is not None:
            raise WorkerError(self.failure)
        if self.closed:
            raise WorkerError("this engine's tensor-parallel workers were closed (engine.close())")

    def _reports(self, wait_s: float = 0.0) -> dict[int, str]:
        out: dict[int, str] = {}
        deadline = time.monotonic() + wait_s
        while True:
            try:
                rank, kind, text = self.errors.get(timeout=max(0.0, deadline - time.monotonic()) or 0.05)
            except queue.Empty:
                return out
            if kind == "failed":
                out[rank] = text

    def _watch(self) -> None:
        while not self.closed and self.failure is None:
            dead = [(r, p) for r, p in enumerate(self.processes, start=1) if not p.is_alive()]
            if dead:
                reports = self._reports(wait_s=2.0)
                rank, p = dead[0]
                self._record(next(iter(reports.items()), None) or
                             (rank, f"exited with code {p.exitcode} without reporting an error (killed?)"))
                return
            time.sleep(WATCHDOG_S)

    def _record(self, failed: tuple[int, str]) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = f"tensor-parallel worker rank {failed[0]} failed: {failed[1]}"
        _abort_collectives()
        self._stop()

    def fail_from(self, error: BaseException, where: str) -> None:
        """Rank 0's call failed (``error``). If a worker failed, raise its error (it is the cause);
        else the ranks are out of step: stop the workers and record why."""
        deadline = time.monotonic() + 2.0  # a collective that failed because a worker died: it is gone by now
        while self.failure is None and all(p.is_alive() for p in self.processes) and time.monotonic() < deadline:
            time.sleep(WATCHDOG_S / 4)
        deadline = time.monotonic() + REPORT_S  # ... and the watchdog records its report
        while self.failure is None and not all(p.is_alive() for p in self.processes) and time.monotonic() < deadline:
            time.sleep(WATCHDOG_S / 4)
        if self.failure is not None:
            raise WorkerError(self.failure) from error
        with self._lock:
            if self.failure is None:
                self.failure = f"{where} ({type(error).__name__}: {error}); the workers were stopped, load the engine again"
        self._stop()

    # ending ---------------------------------------------------------------------------------------
    def _stop(self) -> None:
        for inbox in self.inboxes:
            try:
                inbox.put(pickle.dumps(("exit",)))
            except Exception:  # noqa: BLE001
                pass
        join_or_kill(self.processes)

    def close(self) -> None:
        """Tell the workers to exit, join them (ending any that hang), leave the process group."""
        if self.closed:
            return
        self.closed = True
        self._stop()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        atexit.unregister(self.close)


def join_or_kill(processes) -> None:
    """Join processes told to exit, together within ``JOIN_S``; kill (and join) any still alive."""
    deadline = time.monotonic() + JOIN_S
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(timeout=JOIN_S)


def _abort_collectives() -> None:
    """Make rank 0's collectives that wait for a dead worker return: NCCL waits in a kernel (gloo
    already raises when the peer's connections close)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        try:
            abort()
        except Exception:  # noqa: BLE001 - best effort: the group timeout still bounds the wait
            pass


def start_team(engine_class, model, *, dtype, device: torch.device, tensor_parallel: int, options: dict,
               vocab_parallel: bool = False):
    """Start ranks 1..tensor_parallel-1, make the group with them; returns ``(parallel, team)``. Each
    rank builds an ``engine_class(model, tokenizer, parallel=..., **options)`` (the class is passed, not
    imported here: the engine starts its workers). ``vocab_parallel``: every rank's model splits its LM
    head by vocabulary."""
    import torch.multiprocessing as mp

    from treegen.runtime.distributed import init_parallel, join_local_group

    ctx = mp.get_context("spawn")
    port = _free_port()
    errors = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(1, tensor_parallel)]
    processes = [ctx.Process(target=_worker_main, name=f"treegen-tp-rank{r}", daemon=True,
                             args=(engine_class, r, tensor_parallel, port, model, dtype, str(device), options,
                                   vocab_parallel, inboxes[r - 1], errors))
                 for r in range(1, tensor_parallel)]
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # (inherited by the workers)
    for p in processes:
        p.start()
    team = Team(processes, inboxes, errors)
    try:
        join_local_group(0, tensor_parallel, port, device, check_peers=team.check_started)
        parallel = init_parallel(tensor_parallel=tensor_parallel, data_parallel=1, device=device,
                                 vocab_parallel=vocab_parallel)
    except BaseException as e:
        team.fail_from(e, "making the process group failed on rank 0")
        raise
    return parallel, team


def next_message(inbox):
    """The next (unpickled) message from the process that started this one; exits this process when
    that one is gone (checked every second while waiting)."""
    import multiprocessing

    while True:
        try:
            return pickle.loads(inbox.get(timeout=1.0))
        except queue.Empty:
            parent = multiprocessing.parent_process()
            if parent is not None and not parent.is_alive():
                os._exit(1)


def _receive(inbox, mirrors: dict):
    """The next message from rank 0; exits the process when rank 0 is gone or says ``exit``. A ``drop``
    (rank 0's run was collected: its ``weakref.finalize`` sends it whenever the collector runs, so also in
    the middle of another run's call, between a callback's messages) is carried out here and the next
    message returned: ``mirrors`` loses that run, whose KV is freed."""
    while True:
        message = next_message(inbox)
        if message[0] == "exit":  # (also while waiting for a callback of a call rank 0 gave up)
            os._exit(0)
        if message[0] != "drop":
            return message
        mirror = mirrors.pop(message[1], None)
        if mirror is not None:
            for node in list(mirror.run.kv.segments):
                mirror.run.kv.free(node)


def _worker_main(engine_class, rank, world, port, model, dtype, device, options, vocab_parallel, inbox,
                 errors) -> None:
    try:
        from treegen.runtime.distributed import init_parallel, join_local_group
        from treegen.runtime.loader import load_model
        from treegen.runtime.mirror import Mirror

        torch.set_num_threads(max(1, torch.get_num_threads() // world))
        fault = os.environ.get(FAULT_ENV, "")
        fail_at = int(fault.split(":")[1]) if fault.split(":")[0] == str(rank) else None
        if fail_at == 0:
            raise RuntimeError(f"injected failure on rank {rank} while starting ({FAULT_ENV})")
        join_local_group(rank, world, port, device)
        parallel = init_parallel(tensor_parallel=world, data_parallel=1, device=device, vocab_parallel=vocab_parallel)
        engine = engine_class(*load_model(model, dtype=dtype, device=parallel.device, tp=parallel.tensor),
                              parallel=parallel, **options)
        mirrors: dict[int, Mirror] = {}
        receive = lambda: _receive(inbox, mirrors)  # noqa: E731 - (drops carried out inside: see _receive)
        calls = 0
        while True:
            message = receive()
            kind = message[0]
            if kind == "start":
                mirrors[message[1]] = Mirror(engine, receive, message[2])
            elif kind == "call":
                calls += 1
                if calls == fail_at:
                    raise RuntimeError(f"injected failure on rank {rank} ({FAULT_ENV})")
                _, run_id, method, args, ops, tree, expected = message
                mirrors[run_id].call(method, args, ops, tree, expected)
            else:
                raise RuntimeError(f"unexpected message {kind!r} from rank 0 between calls")
    except BaseException:  # noqa: BLE001 - reported to rank 0, then this process ends
        errors.put((rank, "failed", traceback.format_exc()))
        errors.close()
        errors.join_thread()
        os._exit(1)


__all__ = ["FAULT_ENV", "Team", "WorkerError", "join_or_kill", "next_message", "start_team"]
