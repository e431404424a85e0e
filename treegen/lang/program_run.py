"""Executes IR ops on a sharing tree: the run of one or many programs (their states, forks, joins, and the jobs
that run gen/select).

Each :class:`~treegen.lang.state.State` points at a node of the run's sharing tree. Text ops are applied at once;
``gen`` and ``select`` are queued on the state (with anything appended after them). Once submitted, a state's
next queued op becomes a job of the engine's run (:meth:`~treegen.runtime.tree_run.TreeRun.submit`) and
the one after it is submitted when that job completes; reading a value waits for the reading program's
own states only (:meth:`ProgramRun.flush`).

Without an engine (tracing, used to compile a tree before running) ``gen`` only books its token budget
in the tree, and anything that needs a generated value stops the trace with :class:`~treegen.lang.state.StopTrace`.
"""

from __future__ import annotations

import functools
import itertools
from typing import Callable

from treegen.lang.ir import Gen
from treegen.lang.state import State, StopTrace, TokenStream, _settle_reductions
from treegen.tree.passes import match_prefix
from treegen.tree.sharing_tree import SharingTree

class ProgramRun:
    """One execution (or trace) of one or many programs: tokenizer, tree, engine run, and the states.

    Queued ``gen`` / ``select`` ops become jobs of the engine's run (:meth:`TreeRun.submit
    <treegen.runtime.tree_run.TreeRun.submit>`), a state's next op submitted as soon as its previous
    one completes. A program that needs a value waits for **its own** states only: in a batch its
    thread pauses while the engine keeps running everything else (:mod:`treegen.lang.batch`).
    """

    def __init__(self, *, tokenizer, engine, seed: int, max_program_tokens: int | None = None) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        if max_program_tokens is not None and (not isinstance(max_program_tokens, int) or max_program_tokens < 1):
            raise ValueError(f"max_program_tokens must be a positive integer or None, got {max_program_tokens!r}")
        self.tokenizer, self.engine, self.seed = tokenizer, engine, seed
        self.tree_run = engine.start() if engine is not None else None
        self.tree = self.tree_run.tree if self.tree_run else SharingTree()
        self.tracing = engine is None
        self.flat = engine is not None and engine.attention == "flat"
        self.states: list[State] = []
        ids = tokenizer("x").input_ids if tokenizer.bos_token_id is not None else []
        self.bos = [ids[0]] if ids and ids[0] == tokenizer.bos_token_id else []
        self.finished = False
        self.eos = set(engine.model.eos_token_ids) if engine is not None else set()
        if tokenizer.eos_token_id is not None:
            self.eos.add(tokenizer.eos_token_id)
        self.roots: list[State] = []
        # batch runs (treegen/lang/batch.py): the cooperative program threads, and the compiler passes
        # applied to the roots before anything runs (None: no pass)
        self.scheduler = None
        self.share_prefixes = False
        self.min_shared_saving: int | None = None
        self.passes_done = False
        self.pass_report: dict = {}
        # per program (root index): its states, whether its function returned, tokens generated
        self.states_of: dict[int, list[State]] = {}
        self._busy_hint: dict[int, int] = {}  # per program: where in states_of its last busy state was found
        self._returned: set[int] = set()
        self._tokens: dict[int, int] = {}
        self.max_program_tokens = max_program_tokens  # None: no limit
        # programs done: bodies that returned (or failed) and whose every gen/select has run
        self.programs_done = 0
        self._done: set[int] = set()
        self.on_programs: Callable[[int, int], None] | None = None  # on_programs(done, total) when it changes
        self.on_result: Callable[[int, "State"], None] | None = None  # on_result(index, root) per finished program
        self.on_tokens: Callable[[TokenStream], None] | None = None
        # KV references: how many unfinished programs reach each node (freed at 0), and each one's nodes
        self._users: dict[int, int] = {}
        self._nodes_of: dict[int, set[int]] = {}
        self.hold_submissions = False  # a batch starting: the passes must see every program first
        self._arriving: set[int] = set()  # programs started after the passes, not yet attached (see attach)
        self.touched: set[int] = set()  # programs whose jobs completed or failed since the driver looked
        self._error: BaseException | None = None  # a job's error, raised by flush (single runs)
        self.callback_error: Exception | None = None  # on_result/on_programs raised (a batch stops)

    def __getstate__(self) -> dict:
        """A finished run travels between processes (data-parallel replicas' results) without what
        belongs to its process: the engine and its KV, the tokenizer (the receiver sets its own),
        the callbacks."""
        if not self.finished:
            raise RuntimeError("only a finished program run can be sent to another process")
        state = dict(self.__dict__)
        for name in ("engine", "tree_run", "tokenizer", "scheduler", "on_programs", "on_result", "on_tokens"):
            state[name] = None
        return state

    def root(self, seed: int | None = None) -> "State":
        """A new root state (a program); ``seed`` overrides the run's seed for its branches."""
        state = State(self, node=None, path=(), variables={}, chatting=False, seed=seed, program=len(self.roots))
        self.roots.append(state)
        return state

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def add_node(self, program: int, parent: int | None, tokens=(), kind: str = "text") -> int:
        """A new tree node made by ``program`` (counted as its user until the program is done)."""
        node = self.tree.add_node(parent, tokens, kind=kind)
        self._users[node] = 1
        self._nodes_of.setdefault(program, set()).add(node)
        return node

    # programs ------------------------------------------------------------------------------------
    def program_returned(self, root: "State", value=None) -> None:
        """The body of the program at ``root`` returned ``value`` (kept as ``root.ret_value``). Its
        queued work runs with the last op of each state marked final; it is done once nothing it
        queued is left (at once, or when its jobs complete)."""
        root.ret_value = value
        self._returned.add(root.program)
        if not self.tracing:
            self.submit(root.program)
        self._check_done(root.program)

    def program_failed(self, root: "State", error: BaseException) -> None:
        """The program at ``root`` raised (or was stopped): record it, cancel its jobs, free its KV.
        Other programs are not affected."""
        if root.program in self._done:
            return
        root.error = error
        for st in self.states_of.get(root.program, []):
            if st._job is not None and self.tree_run is not None:
                self.tree_run.cancel(st._job)
            st._job, st.pending = None, []
        self._returned.add(root.program)
        self._finish_program(root.program)

    def program_busy(self, program: int) -> bool:
        """Some state of ``program`` has queued work (or a job running). Asked after each of its jobs completes:
        the scan starts where it last found a busy state (still busy until its own job completes), so a fork
        of N branches finishing one after another costs O(N) in all, not O(N^2) (a fork of 1,024 spent ~40 ms
        of host time in these scans as its last block settled)."""
        states = self.states_of.get(program, ())
        start = self._busy_hint.get(program, 0)
        if start >= len(states):
            start = 0
        for i in itertools.chain(range(start, len(states)), range(start)):
            if states[i].pending:
                self._busy_hint[program] = i
                return True
        return False

    def is_done(self, program: int) -> bool:
        """The program's function returned (or it failed) and nothing it queued is left."""
        return program in self._done

    def _check_done(self, program: int) -> None:
        if program in self._returned and program not in self._done and not self.program_busy(program):
            self._finish_program(program)

    def _finish_program(self, program: int) -> None:
        """Settle the program's reductions, free the KV no unfinished program reaches, report it."""
        root = self.roots[program]
        self._done.add(program)
        if root.error is None and self.scheduler is not None:  # (a single run settles them in finish())
            try:
                _settle_reductions(self.states_of.get(program, []))
            except Exception as e:  # a reduction's own error (bad extract result, ...) fails this program only
                root.error = e
        self._release(program)
        self.programs_done = len(self._done)
        try:
            if self.on_result is not None:
                self.on_result(program, root)
            if self.on_programs is not None:
                self.on_programs(self.programs_done, len(self.roots))
        except Exception as e:  # the caller's own code (writing results, ...): the batch stops with it
            if self.scheduler is None:
                raise
            self.callback_error = self.callback_error or e

    def _release(self, program: int) -> None:
        if self.tree_run is None:
            return
        for node in self._nodes_of.pop(program, ()):
            self._users[node] = self._users.get(node, 1) - 1
            if self._users[node] <= 0:
                self.tree_run.kv.free(node)

    def _count_users(self) -> None:
        """Recount which programs reach which nodes (after the passes restructured the tree)."""
        self._nodes_of = {}
        for st in self.states:
            if st.node is not None and st.node in self.tree.graph:
                self._nodes_of.setdefault(st.program, set()).update(self.tree.path(st.node))
        self._users = {}
        for nodes in self._nodes_of.values():
            for n in nodes:
                self._users[n] = self._users.get(n, 0) + 1

    # running queued work ----------------------------------------------------------------------
    def submit(self, program: int | None = None) -> None:
        """Submit the next queued op of each state (of ``program``, or all) that has none running;
        the first call runs the passes (held while a batch starts)."""
        if self.hold_submissions:
            return
        if not self.passes_done:
            self.passes_done = True
            self.run_passes()
        for st in self.states_of.get(program, []) if program is not None else list(self.states):
            self._submit_state(st)

    def arrived(self, program: int) -> None:
        """``program`` starts while the run is under way (an input that arrived later): its prompt is
        looked up in the live tree when it first submits work (:meth:`attach`)."""
        self._arriving.add(program)

    def attach(self, program: int) -> None:
        """Radix reuse for a program that arrived while the run is under way (the passes, which merge the
        roots of the programs present at the start, are over): its root node — its prompt up to its first
        ``gen`` / ``select``, nothing computed yet — moves below the deepest node of the live tree whose path
        its tokens continue (:func:`~treegen.tree.passes.match_prefix`), keeping only the tokens after it,
        so KV already computed (or queued) for that prefix is read, not computed again. Where it shares
        only the first part of a node, that node is split there (:meth:`TreeRun.split`: its slots are
        divided, nothing recomputed) when the shared part is worth a node of its own by the passes' rule
        (``min_shared_saving`` against shared tokens x (branches below it, the new program's too, - 1)). Only
        nodes some unfinished program still reaches and that have children (so no longer grow) are matched: a
        program that generates straight after its prompt, without a fork, shares it with no later program."""
        self._arriving.discard(program)
        node = self.roots[program].origin
        if node is None or self.flat or not self.share_prefixes or self.tree_run is None:
            return
        tree, kv = self.tree, self.tree_run.kv
        if tree.parent(node) is not None or node in kv.segments or node in kv.offloaded:
            return
        mine = self._nodes_of.setdefault(program, set())
        data = tree.graph.nodes

        def usable(n: int) -> bool:
            return n not in mine and self._users.get(n, 0) > 0 and not data[n]["pruned"] and bool(tree.children(n))

        tokens = tree.tokens(node)
        match = match_prefix(tree, tokens, usable)
        parent, matched = match.parent, match.matched
        if match.partial is not None and self.tree_run.can_split(match.partial, match.partial_length):
            # the passes' rule on the tree as it would be: (branches below it - 1) x tokens, the new program's own
            # branches (its forks before its first work) counted
            need, length = self.min_shared_saving, match.partial_length
            if need is None or length * (tree.branches_below(match.partial, -(-need // length)) +
                                         tree.branches_below(node) - 1) >= need:
                parent = self.tree_run.split(match.partial, match.partial_length)
                self._users[parent] = self._users[match.partial]
                for nodes in self._nodes_of.values():
                    if match.partial in nodes:
                        nodes.add(parent)
                matched += match.partial_length
        if parent is None:
            return
        data[node]["tokens"] = tokens[matched:]
        tree.set_parent(node, parent)
        for n in tree.path(parent):
            self._users[n] = self._users.get(n, 0) + 1
            mine.add(n)
        self.pass_report["attached_tokens"] = self.pass_report.get("attached_tokens", 0) + matched

    def _submit_state(self, st: "State") -> None:
        if st.program in self._arriving:
            self.attach(st.program)
        if st._job is not None or st._closed == "pruned":
            return
        st._apply_immediate()
        if not st.pending:
            return
        # the branch takes nothing more after its last op: the program returned, or it was joined
        final = (st.program in self._returned or st._closed == "joined") and len(st.pending) == 1
        op = st.pending[0]
        request = st._request(op, final=final)
        stream = None
        if self.on_tokens is not None and isinstance(op, Gen):
            stream = functools.partial(self._stream, st, op.name)
        try:
            st._job = self.tree_run.submit(request, on_done=lambda job, st=st: self._on_done(st, job), on_tokens=stream)
        except (ValueError, RuntimeError) as e:
            st.pending = []
            self._fail(st.program, e)

    def _stream(self, st: "State", name: str, tokens) -> None:
        """The caller's ``on_tokens`` hears a branch's tokens. Its own error, in a batch, stops the batch with it
        (``callback_error``, as ``on_result``'s) — not raised inside the engine's step, where it would read as a
        fault of the engine."""
        try:
            self.on_tokens(TokenStream(st, name, tokens))
        except Exception as e:
            if self.scheduler is None:
                raise
            self.callback_error = self.callback_error or e

    def _on_done(self, st: "State", job) -> None:
        """A state's job completed: record its value, submit the state's next op."""
        st._job = None
        self.touched.add(st.program)
        if job.error is not None:
            st.pending = []
            self._fail(st.program, job.error)
            return
        op = st.pending.pop(0)
        st._complete(op, job.result, job.request)
        if isinstance(op, Gen):
            used = self._tokens[st.program] = self._tokens.get(st.program, 0) + len(job.result.tokens)
            if self.max_program_tokens is not None and used > self.max_program_tokens:
                self._fail(st.program, RuntimeError(
                    f"program {st.program} generated {used} tokens, past its limit max_program_tokens="
                    f"{self.max_program_tokens}; it was stopped (raise the limit if this is intended)"))
                return
        self._submit_state(st)
        if st._closed == "joined":
            st._release_leaf()
        self._check_done(st.program)

    def _fail(self, program: int, error: BaseException) -> None:
        """A job of ``program`` failed: in a batch the program fails alone (its thread is stopped);
        a single program raises at its next read."""
        self.touched.add(program)
        if self.scheduler is not None:
            self.scheduler.stop(program)
            self.program_failed(self.roots[program], error)
        else:
            self._error = error

    def flush(self, final: bool = False) -> None:
        """Run queued gen/select ops until the waiting program (or, outside a batch, every state) has
        none left. Other programs keep running meanwhile; see the class docstring.

        ``final``: the program has returned (see :meth:`program_returned`)."""
        if self.tracing:
            raise StopTrace("a generated value is read")
        if self.scheduler is not None and self.scheduler.in_program():
            self.scheduler.wait()  # the batch submits this program's work and resumes it when done
            return
        # (an error already kept is raised below: a request refused when submitted — a gen past the model's
        # context queued last, submitted when the program returned — is not lost)
        self.submit()
        while any(st.pending for st in self.states) and self._error is None:
            if not self.tree_run.advance():
                raise RuntimeError("queued work is left but the engine has nothing to run")
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def run_passes(self) -> None:
        """Before anything is computed: merge the programs' roots by common token prefix and drop
        shared nodes too small to be worth an attention step (see :mod:`treegen.tree.passes`)."""
        from treegen.tree.passes import share_prefixes, simplify

        for st in self.states:
            st._apply_immediate()
        if not self.flat:
            report: dict = {}
            roots = sorted({st.node for st in self.roots if st.node is not None and self.tree.parent(st.node) is None})
            if self.share_prefixes and len(roots) > 1:
                report["shared_nodes"] = share_prefixes(self.tree, roots)
            if self.min_shared_saving is not None:
                keep = {n for st in self.states for n in (st.node, st.origin) if n is not None}
                computed = self.tree_run.kv.computed if self.tree_run is not None else (lambda n: 0)
                report["simplified"] = simplify(self.tree, min_saving=self.min_shared_saving, keep=keep, computed=computed)
            self.pass_report = report
        self._count_users()

    def finish(self) -> None:
        """Flush, then free all KV, the pool's memory included (the values stay readable; states accept no
        more ops)."""
        for root in self.roots:
            if root.program not in self._returned:
                self.program_returned(root)
        self.flush(final=True)
        # every value is there now: settle the reductions (cheap, no model)
        _settle_reductions([st for st in self.states if self.roots[st.program].error is None])
        for root in self.roots:
            self._check_done(root.program)
        kv = self.tree_run.kv
        for node in sorted({*kv.segments, *kv.offloaded}):
            kv.free(node)
        kv.release()  # (the states keep this run: its pool would live as long as the results)
        self.finished = True


    def abandon(self) -> None:
        """The engine failed mid-run (its state may be half updated): free what KV can be freed, the pool's
        memory included (the finished programs' values stay readable), and accept no more ops."""
        self.finished = True
        for st in self.states:  # (their jobs are gone with the engine's state; results then pickle)
            if st.program not in self._done:
                st._job, st.pending = None, []
        kv = self.tree_run.kv if self.tree_run is not None else None
        if kv is not None:
            try:
                for node in sorted({*kv.segments, *kv.offloaded}):
                    kv.free(node)
                kv.release()
            except Exception:  # noqa: BLE001 - the engine's own error is the one raised; the pool goes with the run
                pass
