"""Tensor parallel driven from one process: the workers' tree runs mirror the user's, call for call.

Started from a plain Python process (:mod:`treegen.runtime.workers`), only rank 0 runs the user's
programs. The engine's host decisions (scheduling, plans, KV slots, sampling) depend only on the
sequence of calls made on a :class:`~treegen.runtime.tree_run.TreeRun` and the sharing tree they see,
so each worker keeps a mirror run and replays rank 0's:

* **operations** — ``submit``, ``cancel``, ``free`` and ``kv.free``, made by program code between
  calls or by a job's callback during one — are logged on rank 0 (a :class:`LeaderRun`) and shipped
  in order; the sharing tree (which the language layer edits freely) is shipped whole with them;
* **calls** that run forward passes — ``advance``, ``prefill`` — start on every rank at once; the
  model's all-reduces keep them in step (``execute`` is its submissions and advances, each mirrored);
* **callbacks** (``on_done`` / ``on_tokens`` of a job, where rank 0's language layer resumes
  programs and queues work) happen at the same point on every rank: rank 0 runs its callback and
  sends what it did (operations, tree, or the exception it raised); the worker's stand-in callback
  waits for that message and applies it at the same point of its own call, so both runs unwind the
  same way.

Every message carries a check (the job and a digest of its result, forward passes and callbacks of
the previous call); a worker that sees a difference stops with :class:`DivergenceError`. A call on
rank 0 that fails for any reason other than one of its callbacks raising leaves the ranks out of
step: the workers are stopped and the engine refuses further work.
"""

from __future__ import annotations

import itertools
import weakref
import zlib

from treegen.runtime.tree_run import TreeRun
from treegen.runtime.requests import Job

_run_ids = itertools.count()


class DivergenceError(RuntimeError):
    """A worker's mirror run no longer matches rank 0's (a bug: the ranks would compute different things)."""


class MirroredError(RuntimeError):
    """Raised in a worker's callback where rank 0's callback raised, so the worker's call unwinds alike."""


def digest(value) -> int:
    """A stable check of a job's result or streamed tokens (identical on every rank when in step)."""
    if hasattr(value, "tokens"):
        value = value.tokens
    return zlib.crc32(repr(value).encode())


class LeaderRun(TreeRun):
    """Rank 0's tree run: a :class:`TreeRun` whose operations, calls and callbacks the workers mirror."""

    def __init__(self, engine, team) -> None:
        super().__init__(engine)
        self.team, self.id = team, next(_run_ids)
        self._ops: list[tuple] = []
        self._quiet = 0  # > 0 inside a call or an operation: what the runtime does itself is not logged
        self._callbacks = 0
        self._fingerprint = (0, 0, "ok")
        self._callback_error: BaseException | None = None
        self._jobs: dict[int, int] = {}  # id(job) -> its index in submission order
        team.send(("start", self.id, self.join_phases))
        weakref.finalize(self, team.send_quietly, ("drop", self.id))
        kv_free = self.kv.free

        def free(node: int) -> None:
            self._log(("kv_free", node))
            kv_free(node)

        self.kv.free = free

    def _log(self, op: tuple) -> None:
        if not self._quiet:
            self._ops.append(op)

    def _take_ops(self) -> list[tuple]:
        ops, self._ops = self._ops, []
        return ops

    # operations ----------------------------------------------------------------------------------
    def submit(self, request, on_done=None, on_tokens=None) -> Job:
        self.team.check()
        index = len(self._jobs)
        self._quiet += 1
        try:
            job = super().submit(request, on_done=self._wrap("done", index, on_done),
                                 on_tokens=self._wrap("tokens", index, on_tokens))
        finally:
            self._quiet -= 1
        self._jobs[id(job)] = index
        # the job's place in the queue as rank 0 gave it (a worker's tree is rank 0's only at the next call)
        self._log(("submit", request, on_done is not None, on_tokens is not None, self.scheduler.priority_of(job)))
        return job

    def cancel(self, job: Job) -> None:
        if not job.done:
            self._log(("cancel", self._jobs[id(job)]))
        self._quiet += 1
        try:
            super().cancel(job)
        finally:
            self._quiet -= 1

    def free(self, node: int) -> None:
        self._log(("free", node, sorted(self.tree.subtree(node)[1:])))
        self._quiet += 1
        try:
            super().free(node)
        finally:
            self._quiet -= 1

    def split(self, node: int, length: int) -> int:
        head = super().split(node, length)  # (the tree goes whole with the next call; the KV's split is an operation)
        self._log(("kv_split", node, head, length))
        return head

    def _wrap(self, kind: str, index: int, callback):
        if callback is None:
            return None

        def mirrored(value) -> None:
            saved, self._quiet = self._quiet, 0  # what the callback does is the program's: logged
            self._callbacks += 1
            error = None
            try:
                callback(value)
            except BaseException as e:  # noqa: BLE001 - sent to the workers, then raised here
                error = self._callback_error = e
            finally:
                self._quiet = saved
            ops = self._take_ops()
            tree = self.tree.graph if kind == "done" or ops else None
            self.team.send(("callback", kind, index, digest(value.result if kind == "done" else value), ops, tree,
                            None if error is None else f"{type(error).__name__}: {error}"))
            if error is not None:
                raise error

        return mirrored

    # calls ----------------------------------------------------------------------------------------
    def _call(self, method: str, *args):
        self.team.check()
        if self._quiet:
            raise RuntimeError(f"TreeRun.{method} called from a job's callback: not supported with tensor-parallel "
                               f"workers")
        self.team.send(("call", self.id, method, args, self._take_ops(), self.tree.graph, self._fingerprint))
        self._quiet += 1
        self._callbacks, self._callback_error, outcome = 0, None, "raised"
        try:
            result = getattr(TreeRun, method)(self, *args)
            outcome = "ok"
            return result
        except BaseException as e:
            if e is not self._callback_error:  # the workers did not fail alike: the ranks are out of step
                self.team.fail_from(e, f"TreeRun.{method} failed on rank 0")
            raise
        finally:
            self._quiet -= 1
            self._fingerprint = (self.forward_passes, self._callbacks, outcome)

    def advance(self, until=None) -> list[Job]:
        # (``until`` is not mirrored: rank 0 alone would stop early; the loop runs until a job completes)
        return self._call("advance")

    def prefill(self, nodes: list[int]):
        return self._call("prefill", list(nodes))

    def execute(self, gens, scores):
        # not one mirrored call: TreeRun.execute submits (each logged) and advances (each a mirrored call)
        return TreeRun.execute(self, gens, scores)


class Mirror:
    """A worker's copy of one of rank 0's tree runs, replaying the messages of ``receive()``."""

    def __init__(self, engine, receive, join_phases: bool) -> None:
        self.run = TreeRun(engine)
        self.run.join_phases = join_phases  # rank 0's (the environment each process read may differ)
        self.receive = receive
        self.jobs: list[Job] = []
        self.callbacks = 0
        self.fingerprint = (0, 0, "ok")

    def apply(self, ops: list[tuple]) -> None:
        run = self.run
        for op in ops:
            if op[0] == "submit":
                _, request, done, tokens, priority = op
                index = len(self.jobs)
                job = Job(request, on_done=self._stand_in("done", index) if done else None,
                          on_tokens=self._stand_in("tokens", index) if tokens else None)
                self.jobs.append(job)
                run.scheduler.submit(job, priority)
            elif op[0] == "cancel":
                run.cancel(self.jobs[op[1]])
            elif op[0] == "kv_free":
                run.kv.free(op[1])
            elif op[0] == "kv_split":
                _, node, head, length = op
                run.kv.split(node, head, length)
                if node in run.scheduler.last_used:
                    run.scheduler.last_used[head] = run.scheduler.last_used[node]
            elif op[0] == "free":
                for n in [op[1], *op[2]]:
                    run.kv.free(n)
                run.tree.prune(op[1])
            else:
                raise DivergenceError(f"unknown operation {op[0]!r} from rank 0")

    def _stand_in(self, kind: str, index: int):
        def callback(value) -> None:
            self.callbacks += 1
            message = self.receive()
            mine = ("callback", kind, index, digest(value.result if kind == "done" else value))
            if message[0] != "callback" or tuple(message[:4]) != mine:
                raise DivergenceError(f"out of step with rank 0: this worker reached {mine[:3]} "
                                      f"(digest {mine[3]}), rank 0 sent {tuple(message[:4])}")
            _, _, _, _, ops, tree, error = message
            self.apply(ops)
            if tree is not None:
                self.run.tree.graph = tree
            if error is not None:
                raise MirroredError(f"rank 0's callback raised {error}")

        return callback

    def call(self, method: str, args: tuple, ops: list[tuple], tree, expected: tuple) -> None:
        """Run ``method`` as rank 0 does; a failure other than a mirrored callback error propagates."""
        if expected != self.fingerprint:
            raise DivergenceError(f"out of step with rank 0 after the last call: (forward passes, callbacks, outcome) "
                                  f"here {self.fingerprint}, on rank 0 {expected}")
        self.apply(ops)
        self.run.tree.graph = tree
        self.callbacks, outcome = 0, "raised"
        try:
            getattr(self.run, method)(*args)
            outcome = "ok"
        except MirroredError:
            pass
        finally:
            self.fingerprint = (self.run.forward_passes, self.callbacks, outcome)


__all__ = ["DivergenceError", "LeaderRun", "Mirror", "MirroredError", "digest"]
