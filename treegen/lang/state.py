"""A program's branches: :class:`State` (what a program's function holds: ``s += text``, ``s.fork(n)``, ``s.join``,
``gen`` / ``select`` queued on it, variables read back), :class:`ForkGroup`, the values that stand for work not
done yet (a queued ``gen``'s, a join's list, a reduction computed when read), and :class:`TokenStream`.

Each state points at a node of its run's sharing tree. Text ops are applied at once; ``gen`` and ``select`` are
queued on the state (with anything appended after them) and run as jobs of the engine's run by the state's
:class:`~treegen.lang.program_run.ProgramRun`, which also settles a program's reductions when it is done.
"""

from __future__ import annotations

from typing import Any

from treegen.lang import reduce, views
from treegen.lang.chat import role_affixes
from treegen.lang.ir import Gen, Reduce, RoleBegin, RoleEnd, Select, Text, as_ops
from treegen.runtime.requests import GenRequest, ScoreRequest
from treegen.runtime.sampler import branch_key
from treegen.tree.sharing_tree import SharingTree

class StopTrace(Exception):
    """Raised while tracing when the program needs a value only running can produce."""


class UnsetVariableError(KeyError):
    """Reading a variable no gen, select or join has set."""

    def __str__(self) -> str:
        return self.args[0]


class _Pending:
    """Marker value: produced by a queued gen/select. One per gen/select (never shared), so a branch that
    sets a variable again while tracing is seen to set it (a join compares values by identity)."""

    def __repr__(self) -> str:
        return "<pending>"



class _Joined:
    """Marker value: the list of ``name`` over joined branch states, resolved on read."""

    def __init__(self, states: list["State"], name: str) -> None:
        self.states, self.name = states, name


class _Reduced:
    """Marker value: a :class:`~treegen.lang.ir.Reduce` over joined branches, computed once, when first
    read (or when the program finishes), with ``info[name]`` set on ``owner``, the state joined into.

    The marker stays in the variables (of ``owner``, and of the states forked from it afterwards, which
    inherit it) and reading gives its value, so every state holding it reads the same value and a join
    can tell an inherited reduction from a variable the branches set.
    """

    def __init__(self, owner: "State", name: str, children: list["State"], spec: Reduce) -> None:
        self.owner, self.name, self.children, self.spec = owner, name, children, spec
        self.done, self.value = False, None

    def __getstate__(self) -> dict:
        """Sent once computed, with the reduction's kind and source only (its functions stay here)."""
        from types import SimpleNamespace

        self.get()
        return dict(self.__dict__, spec=SimpleNamespace(kind=self.spec.kind, source=self.spec.source))

    def get(self):
        """The value, computed on the first call (which may run queued generation)."""
        if not self.done:
            self.value, self.owner.info[self.name] = _compute_reduction(self.name, self.spec, self.children)
            self.done = True
        return self.value

    def __repr__(self) -> str:
        if self.done:
            return f"<{self.spec.kind} of {self.spec.source!r}: {self.value!r:.60}>"
        return f"<{self.spec.kind} of {self.spec.source!r}, computed when read>"


class TokenStream:
    """What ``on_tokens`` hears while a branch generates: the branch ``state``, the variable
    ``name``, and every token id drawn so far; ``text`` decodes them (when read)."""

    def __init__(self, state: "State", name: str, tokens: tuple[int, ...]) -> None:
        self.state, self.name, self.tokens = state, name, tokens

    @property
    def program(self) -> int:
        return self.state.program

    @property
    def path(self) -> tuple:
        """The branch's fork indices from its program's root."""
        return self.state.path

    @property
    def text(self) -> str:
        return self.state._run.tokenizer.decode(list(self.tokens), skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"TokenStream(program={self.program}, path={self.state.path}, name={self.name!r}, tokens={len(self.tokens)})"


class State:
    """A stream of tokens in a program; ``s += ...`` appends, ``s[name]`` reads a variable. ``run``: the
    :class:`~treegen.lang.program_run.ProgramRun` it belongs to (which makes the states; not imported here:
    the run depends on its states, not the reverse)."""

    def __init__(self, run, *, node: int | None, path: tuple, variables: dict, chatting: bool,
                 seed: int | None = None, program: int = 0) -> None:
        self._run = run
        self.program = program  # the index of the program (root) it belongs to, in its run
        self.node = node
        self.path = path  # fork indices from the program's root: seeds derive from it (not the batch position)
        self.seed = run.seed if seed is None else seed
        self.origin = node  # the first node of this branch (made by its fork): what prune() frees
        self.vars: dict[str, Any] = variables
        self.info: dict[str, dict] = {}  # per variable: finish_reason, scores, ...
        self.pending: list = []
        self._chatting = chatting  # a chat message has been emitted (templates treat the first apart)
        self._message_first: list[bool] = []
        self._gens = 0
        self._closed: str | None = None
        self._after_select = False  # tracing only: the continuation depends on the winner
        self._job = None  # the engine job of pending[0], once submitted
        self.ret_value = None  # a root: what the program function returned
        self.error: BaseException | None = None  # a root in a batch: why the program failed
        run.states.append(self)
        run.states_of.setdefault(program, []).append(self)

    # appending --------------------------------------------------------------------------------
    def __iadd__(self, item) -> "State":
        for op in as_ops(item):
            self._append(op)
        return self

    def _append(self, op) -> None:
        self._check_open()
        if self._run.tracing:
            if self._after_select:
                raise StopTrace("the program continues after a select")
            self._apply(op)
        elif self.pending or isinstance(op, (Gen, Select)):
            self.pending.append(op)
            if isinstance(op, (Gen, Select)):
                self.vars[op.name] = _Pending()
        else:
            self._apply(op)

    def _check_open(self) -> None:
        if self._run.finished:
            raise RuntimeError("the program has finished; this state accepts no more text")
        if self._closed == "pruned":
            raise RuntimeError("this branch was pruned; it accepts no more text")
        if self._closed:
            raise RuntimeError(f"this branch was {self._closed}; append to it before joining")

    def _leaf(self) -> int:
        """The node this state appends to, created when the current one is shared (has children)."""
        tree = self._run.tree
        if self.node is None:
            self.node = self.origin = self._run.add_node(self.program, None, self._run.bos)
        elif tree.children(self.node):
            self.node = self._run.add_node(self.program, self.node)
        return self.node

    def _release_leaf(self) -> None:
        """A joined branch reads no more KV: once its work is done, its own leaf's KV is freed (its
        last queued gen is submitted final, which frees it when it completes)."""
        run = self._run
        if run.tree_run is not None and not self.pending and self.node is not None and not run.tree.children(self.node):
            run.tree_run.kv.free(self.node)  # (a joined branch's leaf is its own: fork made it for it)

    def _apply_immediate(self) -> None:
        while self.pending and not isinstance(self.pending[0], (Gen, Select)):
            self._apply(self.pending.pop(0))

    def _apply(self, op) -> None:
        tree, run = self._run.tree, self._run
        if isinstance(op, Text):
            tree.extend(self._leaf(), run.tokenize(op.text))
        elif isinstance(op, RoleBegin):
            self._message_first.append(not self._chatting)
            self._chatting = True
            tree.extend(self._leaf(), run.tokenize(role_affixes(run.tokenizer, op.role, self._message_first[-1])[0]))
        elif isinstance(op, RoleEnd):
            first = self._message_first.pop() if self._message_first else False
            # a gen that ended on EOS left it out of the context: the message's end adds its end-of-turn. One that
            # ended on it otherwise (a stop string that is the end-of-turn's text, ignore_eos) has it there already
            ids = run.tokenize(role_affixes(run.tokenizer, op.role, first)[1])
            leaf = self._leaf()
            done = tree.tokens(leaf)[-1:]
            if ids[:1] == done and done[0] in run.eos:
                ids = ids[1:]
            tree.extend(leaf, ids)
        elif isinstance(op, Gen):  # tracing: book the budget
            tree.graph.nodes[self._leaf()]["gen_budget"] += op.params.max_tokens
            self.vars[op.name] = _Pending()
        elif isinstance(op, Select):  # tracing: show the alternatives
            self._add_choices(op)
            self.vars[op.name] = _Pending()
            self._after_select = True

    def _add_choices(self, op: Select) -> tuple[int, ...]:
        base = self._leaf() if self.node is None else self.node
        out = []
        for choice in op.choices:
            ids = self._run.tokenize(choice)
            if not ids:
                raise ValueError(f"select({op.name!r}): choice {choice!r} has no tokens")
            out.append(self._run.add_node(self.program, base, ids, kind="choice"))
        return tuple(out)

    def _request(self, op, final: bool = False):
        if isinstance(op, Gen):
            leaf = self._leaf()
            self._run.tree.graph.nodes[leaf]["gen_budget"] += op.params.max_tokens
            seed = op.params.seed if op.params.seed is not None else self.seed
            key = branch_key(seed, self.path + ("gen", self._gens))
            self._gens += 1
            return GenRequest(leaf, op.params, key, final=final)
        return ScoreRequest(self.node if self.node is not None else self._leaf(), self._add_choices(op))

    def _complete(self, op, result, request) -> None:
        tree = self._run.tree
        if isinstance(op, Gen):
            tree.graph.nodes[self.node]["gen_budget"] -= op.params.max_tokens
            self.vars[op.name] = result.text
            start = tree.path_length(self.node) - len(result.context)  # (the node holds the context, EOS left out)
            self.info[op.name] = {"finish_reason": result.finish_reason, "tokens": len(result.tokens), "start": start,
                                  "logprob": sum(result.logprobs) / len(result.logprobs) if result.logprobs else None,
                                  "max_tokens": op.params.max_tokens, "stop": op.params.stop}
            if result.ends_on_eos:  # the gen's last token, left out of the context (see gen_tokens)
                self.info[op.name]["eos"] = result.tokens[-1]
            if op.params.constraint is not None:  # False: max_tokens cut the text short of its constraint
                self.info[op.name].update(constraint=str(op.params.constraint), constraint_met=result.constraint_met)
            if result.kv_keep is not None:  # generated with sparse window attention (lossy)
                self.info[op.name].update(kv_keep=result.kv_keep, kv_dropped=result.kv_dropped)
            return
        request_choices = list(request.choices)  # (not the node's last children: a later program may sit beside them)
        best = max(range(len(op.choices)), key=lambda i: (result[i], -i))
        for i, node in enumerate(request_choices):
            if i != best:
                self._run.tree_run.free(node)
        self.node = request_choices[best]
        self.vars[op.name] = op.choices[best]
        self.info[op.name] = {"scores": dict(zip(op.choices, result)), "choice_index": best}

    # forks and joins --------------------------------------------------------------------------
    def fork(self, n: int, content=None) -> "ForkGroup":
        """``n`` branches continuing from here. ``content``: appended to each branch — one item for
        all, a list with one item per branch, or a function of the branch index."""
        self._check_open()
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"fork(n): n must be an integer >= 1, got {n!r}")
        if self.pending:
            self._run.flush()
        if self._run.tracing and self._after_select:
            raise StopTrace("the program forks after a select")
        base = self._leaf() if self.node is None else self.node
        tree = self._run.tree
        branches = []
        for i in range(n):
            # attention="flat" (a baseline): no sharing, every branch starts from its own copy
            node = self._run.add_node(self.program, None if self._run.flat else base,
                                      tree.path_tokens(base) if self._run.flat else ())
            branches.append(State(self._run, node=node, path=self.path + (i,), variables=dict(self.vars),
                                  chatting=self._chatting, seed=self.seed, program=self.program))
        group = ForkGroup([self], [branches])
        if content is not None:
            group += content
        return group

    def join(self, branches: "ForkGroup", **reductions) -> None:
        """Gather every variable of ``branches`` (forked from this state) into lists on this state.

        ``reductions``: new variables made from those lists, e.g. ``answer=treegen.vote("reasoning",
        extract=r"answer is (\\d+)")`` (see :class:`~treegen.lang.ir.Reduce`, which also describes what
        ``info[name]`` then holds); computed when first read, or when the program finishes."""
        if not isinstance(branches, ForkGroup):
            raise TypeError(f"join expects the branches returned by fork(), got {type(branches).__name__}")
        if branches.parents != [self]:
            raise ValueError("join: these branches were not forked from this state")
        branches._join_into([self], reductions)

    def _join_children(self, children: list["State"], reductions: dict | None = None) -> None:
        names: list[str] = []
        for child in children:
            names += [k for k in child.vars if k not in names and (k not in self.vars or child.vars[k] is not self.vars[k])]
            child._closed = "joined"
            child._release_leaf()
        for name, spec in (reductions or {}).items():
            _check_reduction(name, spec, names)
        for name in names:
            self.vars[name] = _Joined(children, name)
            self.info[name] = {"branches": len(children)}
        for name, spec in (reductions or {}).items():
            self.vars[name] = _Reduced(self, name, children, spec)
            self.info[name] = {"reduction": spec.kind, "source": spec.source, "branches": len(children)}
            fork_node = self._run.tree.parent(children[0].origin) if children and children[0].origin is not None else None
            if fork_node is not None:  # the compiled tree shows what the join computes
                self._run.tree.graph.nodes[fork_node].setdefault("reductions", []).append(
                    {"name": name, "kind": spec.kind, "source": spec.source,
                     "by": spec.by if isinstance(spec.by, str) else getattr(spec.by, "__name__", None)})

    def prune(self) -> int:
        """Drop this branch now: free the KV of every node it made (from its fork down, including its
        own sub-branches), which then accept no more text. Queued work runs first, so the branch's
        variables stay readable. Returns the bytes of KV freed. Pruning a root drops the whole program.

        Tree search keeps the best branches and prunes the rest: the kept ones continue from the KV
        they have (nothing is computed again), the pruned ones' memory is free for the next level.
        """
        if self._closed == "pruned":
            return 0
        if self._run.finished:
            raise RuntimeError("the program has finished; its KV is already free")
        if self.pending:
            self._run.flush()
        if self.origin is None:  # a root that never appended anything
            self._closed = "pruned"
            return 0
        run, tree = self._run, self._run.tree
        gone = set(tree.subtree(self.origin))
        freed = 0
        if run.tree_run is not None:
            # only what no other program reaches: prefix sharing may have put another program's
            # nodes below this one's (a root whose prompt is a prefix of another program's)
            mine = run._nodes_of.get(self.program, set())
            gone = {n for n in gone if n in mine and run._users.get(n, 1) <= 1}
            kv = run.tree_run.kv
            freed = sum(kv.segments[n].computed for n in gone if n in kv.segments) * kv.bytes_per_token  # held KV
            for n in gone:
                kv.free(n)
                tree.graph.nodes[n]["pruned"] = True
        else:
            tree.prune(self.origin)
        for st in run.states_of.get(self.program, run.states):  # (a program's states stay in it)
            if st.node in gone:
                st._closed = "pruned"
        return freed

    def __setitem__(self, name: str, value) -> None:
        """Set a variable from Python (a reduction's result, a score): ``s["best"] = ...``."""
        self._check_open()
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"a variable name must be an identifier string, got {name!r}")
        self.vars[name] = value

    # reading ----------------------------------------------------------------------------------
    def __getitem__(self, name: str):
        if name not in self.vars:
            have = ", ".join(sorted(self.vars)) or "none"
            raise UnsetVariableError(f"variable {name!r} is not set (set variables: {have})")
        value = self.vars[name]
        if isinstance(value, _Pending):
            self._run.flush()
            value = self.vars[name]
        if isinstance(value, _Joined):
            return [child[name] for child in value.states]
        if isinstance(value, _Reduced):
            return value.get()
        return value

    def __contains__(self, name: str) -> bool:
        return name in self.vars

    @property
    def variables(self) -> dict[str, Any]:
        """Every variable, resolved (runs what is queued)."""
        return {k: self[k] for k in self.vars}

    @property
    def tree(self) -> SharingTree:
        return self._run.tree

    def tokens(self) -> list[int]:
        """This state's whole token sequence (root to its node)."""
        if self.pending:
            self._run.flush()
        return self._run.tree.path_tokens(self.node) if self.node is not None else []

    def text(self) -> str:
        return self._run.tokenizer.decode(self.tokens())

    def gen_tokens(self, name: str) -> list[int]:
        """The token ids this state's gen ``name`` drew, its final EOS included. The context (:meth:`tokens`)
        holds them from ``info[name]["start"]`` on, but for that EOS (``info[name]["eos"]``): later text
        follows the gen's text, not an end-of-text mark (a chat message's end adds its own end-of-turn)."""
        info = self.info.get(name)
        if info is None or "finish_reason" not in info:
            raise KeyError(f"{name!r} is not a finished gen of this state")
        eos = [info["eos"]] if "eos" in info else []
        start = info["start"]
        return self.tokens()[start:start + info["tokens"] - len(eos)] + eos

    def __repr__(self) -> str:
        return f"State(path={self.path}, node={self.node}, variables={sorted(self.vars)})"

    # notebook and IPython views: rendered by the "result" view registered in treegen.lang.views
    def _repr_html_(self) -> str | None:
        return views.html("result", self)

    def _repr_pretty_(self, p, cycle) -> None:
        shown = views.text("result", self)
        p.text(shown if shown is not None else repr(self))


class ForkGroup:
    """Branches made by ``fork``: ``+=`` appends to each; iterate or index for single branches."""

    def __init__(self, parents: list[State], children: list[list[State]]) -> None:
        self.parents, self.children = parents, children
        self.states = [s for group in children for s in group]
        self._joined = False

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def __getitem__(self, i: int) -> State:
        return self.states[i]

    def __iadd__(self, item) -> "ForkGroup":
        if isinstance(item, list) and len(item) != len(self.states):
            raise ValueError(f"a per-branch list must have one item per branch: {len(item)} items for {len(self.states)} branches")
        for i, st in enumerate(self.states):
            st += item[i] if isinstance(item, list) else item(i) if callable(item) else item
        return self

    def fork(self, n: int, content=None) -> "ForkGroup":
        """Fork every branch ``n`` ways (nested fork); join the result back with ``self.join(...)``."""
        groups = [st.fork(n, content) for st in self.states]
        return ForkGroup(list(self.states), [g.states for g in groups])

    def join(self, branches: "ForkGroup", **reductions) -> None:
        """Gather each nested group into lists on its own parent branch (``reductions`` as in
        :meth:`State.join`, computed per parent branch)."""
        if not isinstance(branches, ForkGroup):
            raise TypeError(f"join expects the branches returned by fork(), got {type(branches).__name__}")
        if branches.parents != self.states:
            raise ValueError("join: these branches were not forked from this group")
        branches._join_into(self.states, reductions)

    def _join_into(self, parents: list[State], reductions: dict | None = None) -> None:
        if self._joined:
            raise ValueError("join: these branches were already joined")
        self._joined = True
        for parent, children in zip(parents, self.children):
            parent._join_children(children, reductions)


def _settle_reductions(states) -> None:
    """Compute every reduction the ``states`` hold (each once; raises a reduction's own error)."""
    for st in states:
        for value in list(st.vars.values()):
            if isinstance(value, _Reduced):
                value.get()


def _check_reduction(name: str, spec, names: list[str]) -> None:
    """A join's reduction: a Reduce, a fresh identifier, reading variables the branches set."""
    if not isinstance(spec, Reduce):
        raise TypeError(f"join: {name}= must be a reduction such as treegen.vote(...), got {type(spec).__name__}")
    if not name.isidentifier() or name in names:
        raise ValueError(f"join: reduction name {name!r} must be a new identifier (the branches set: {', '.join(names)})")
    reads = [spec.source] + ([spec.by] if isinstance(spec.by, str) and spec.by != "logprob" else [])
    for var in reads:
        if var not in names:
            raise ValueError(f"join: reduction {name!r} reads {var!r}, which the branches do not set "
                             f"(they set: {', '.join(names) or 'nothing'})")


def _compute_reduction(name: str, spec: Reduce, children: list[State]) -> tuple[Any, dict]:
    """(value, info) of reduction ``name`` over the joined ``children`` (see :class:`~treegen.lang.ir.Reduce`
    for ``info``); the rules are :mod:`treegen.lang.reduce`'s. Reading the values may run queued work.

    A value the rules reject (a score that is a list, text to vote on that is not text) raises an error
    naming the reduction, at ``spec.where`` when the front end gave one."""
    values = [child[spec.source] for child in children]
    scores = None
    if spec.kind in ("best", "top_k") and not callable(spec.by):
        scores = ([child.info.get(spec.source, {}).get("logprob") for child in children] if spec.by == "logprob"
                  else [child[spec.by] for child in children])
    info: dict = {"reduction": spec.kind, "source": spec.source, "branches": len(children)}
    # constrained gens cut short (max_tokens) or at a dead end: their text is an incomplete prefix, no answer
    unmet = {i for i, child in enumerate(children) if child.info.get(spec.source, {}).get("constraint_met") is False}
    if unmet:
        info["incomplete"] = sorted(unmet)
    try:
        if spec.kind == "collect":
            result = reduce.collect(values)
        elif spec.kind == "concat":
            result = spec.sep.join(str(v) for v in values)
        elif spec.kind == "vote":
            answers = [reduce.extract(v, spec.extract) for v in values]  # once: extract may be a function
            answers = [None if i in unmet else a for i, a in enumerate(answers)]  # (incomplete: no answer)
            result = reduce.vote(answers)
            info["votes"] = reduce.tally(answers)
            info["winners"] = [i for i, a in enumerate(answers) if a is not None and a == result]
        else:
            if scores is None:  # (an incomplete text is not scored: a `by` that parses it could fail on it)
                scores = [None if i in unmet else spec.by(v) for i, v in enumerate(values)]
            # (the rules' checks, by name; incomplete texts are never picked: best is None when every branch's is)
            reduce.top_k(values, scores, spec.k) if spec.kind == "top_k" else reduce.best(values, scores)
            ranked = [i for i in reduce.ranking(scores) if i not in unmet]
            result = ([values[i] for i in ranked[: spec.k]] if spec.kind == "top_k"
                      else values[ranked[0]] if ranked else None)
            info["scores"] = [reduce.score(x) for x in scores]
            info["winners"] = ranked[: 1 if spec.kind == "best" else spec.k]
    except (ValueError, TypeError) as e:
        message = f"reduction {name!r} ({spec.kind} of {spec.source!r}): {e}"
        if spec.where is not None:
            raise spec.where.error(message) from e
        raise (ValueError if isinstance(e, ValueError) else TypeError)(message) from e
    return result, info
