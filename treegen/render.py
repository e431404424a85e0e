"""Rich views for the command line: a sharing tree with its KV bytes, a run's results, live progress."""

from __future__ import annotations

import threading
import time
from typing import Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.text import Text
from rich.table import Table
from rich.tree import Tree

from treegen.lang.tg.lower import Branch
from treegen.lang.tg.program import TgResult
from treegen.tree.sharing_tree import KVShape, SharingTree, TreeStats


def excerpt(text, width: int = 48) -> str:
    """One line, newlines shown as \\n, cut to ``width`` characters with an ellipsis."""
    s = repr(text) if not isinstance(text, str) else repr(text)[1:-1] if text else "''"
    return s if len(s) <= width else s[: width - 1] + "…"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("ch") else "s")


# the sharing tree ----------------------------------------------------------------------------------
def sharing_tree_view(tree: SharingTree, kv: KVShape, tokenizer, title: str, max_children: int = 8) -> Tree:
    """Per node: id, a text excerpt, tokens (+ budget still to generate), branches below, KV bytes."""
    view = Tree(escape(title), guide_style="dim")
    roots = [n for n in tree.live_nodes() if tree.parent(n) is None]

    def label(n: int) -> str:
        data = tree.graph.nodes[n]
        text = escape(excerpt(tokenizer.decode(data["tokens"]))) if data["tokens"] else "[dim](empty)[/]"
        budget = f" [yellow]+{data['gen_budget']} gen[/]" if data["gen_budget"] else ""
        kind = " [magenta]choice[/]" if data["kind"] == "choice" else ""
        kv_bytes = human_bytes(tree.size(n) * kv.bytes_per_token)
        return (f"[bold]#{n}[/]{kind} [green]{text}[/] [dim]·[/] {len(data['tokens'])} tok{budget} [dim]·[/] "
                f"{_plural(tree.branches_below(n), 'branch')} [dim]·[/] [cyan]{kv_bytes}[/]")

    def add(parent: Tree, n: int) -> None:
        node = parent.add(label(n))
        kids = [c for c in tree.children(n) if not tree.graph.nodes[c]["pruned"]]
        for c in kids[:max_children]:
            add(node, c)
        if len(kids) > max_children:
            rest = kids[max_children:]
            more = sum(tree.branches_below(c) for c in rest)
            node.add(f"[dim]… {len(rest)} more nodes here ({_plural(more, 'branch')}); --max-children shows more[/]")

    for r in roots:
        add(view, r)
    return view


def stats_table(stats: TreeStats) -> Table:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column(style="dim")
    table.add_row("nodes", str(stats.nodes), "")
    table.add_row("branches", str(stats.branches), "")
    table.add_row("KV stored", human_bytes(stats.stored_bytes), f"{stats.stored_tokens} tokens, each node once")
    table.add_row("KV unshared", human_bytes(stats.unshared_bytes),
                  f"{stats.unshared_tokens} tokens, every branch its own copy")
    table.add_row("saving", f"{100 * stats.saving:.1f} %",
                  f"{human_bytes(stats.unshared_bytes - stats.stored_bytes)} less")
    return table


# results ---------------------------------------------------------------------------------------------
def _detail(info: dict) -> str:
    kind = info.get("reduction")
    if kind == "vote" and "votes" in info:
        votes = ", ".join(f"{excerpt(a, 16)}×{c}" for a, c in info["votes"].items()) or "no answers"
        return f"votes: {votes}"
    if kind == "best" and info.get("winners"):
        return f"branch {info['winners'][0]}"
    if kind == "top_k" and "winners" in info:
        return "branches " + ", ".join(map(str, info["winners"]))
    if kind is not None:
        return ""
    if "choice_index" in info:
        return "select"
    if "finish_reason" in info:
        return f"{info['tokens']} tok, {info['finish_reason']}"
    return ""


def _variables_label(result: TgResult, b: Branch, width: int) -> str:
    parts = []
    for name, value in result.variables(b).items():
        if name in b.bindings:
            continue
        detail = _detail(b.state.info.get(name, {}))
        detail = f" [dim]({escape(detail)})[/]" if detail else ""
        parts.append(f"[bold]{name}[/] = [green]{escape(excerpt(value, width))}[/]{detail}")
    return "\n".join(parts)


def result_view(result: TgResult, max_children: int = 8, width: int = 60) -> Tree:
    """The run as a tree: the root's variables, then each fork's branches with theirs."""
    view = Tree(f"[bold]{escape(result.program.path)}[/] [dim](seed {result.seed})[/]", guide_style="dim")
    top = _variables_label(result, result.root, width)
    if top:
        view.add(top)

    def add_forks(node: Tree, b: Branch) -> None:
        for run in b.forks:
            fork_node = node.add(f"[blue]{escape(run.label)}[/]")
            for child in run.branches[:max_children]:
                binds = " ".join(f"{k}={escape(excerpt(v, 24))}" for k, v in child.bindings.items())
                head = f"[bold]\\[{child.index}][/] {binds}".rstrip()
                body = _variables_label(result, child, width)
                sub = fork_node.add(head + ("\n" + body if body else ""))
                add_forks(sub, child)
            if len(run.branches) > max_children:
                fork_node.add(f"[dim]… {len(run.branches) - max_children} more branches (--json has them all)[/]")

    add_forks(view, result.root)
    return view


# progress ---------------------------------------------------------------------------------------------
class TreeWatch:
    """Progress of a run, drawn from a helper thread while the program runs in the main thread.

    What it shows is read from the run's sharing tree (``watch(tree)`` hands it over): tokens the
    tree holds, the growth rate of that count (the decode rate while branches generate), live
    branches, and branches with a ``gen`` in flight (nodes with a generation budget). Reading the tree
    covers prefill, ``select`` and decoding alike; the engine's ``on_step`` hook, which the notebook
    bars use (:mod:`treegen.display.progress`), reports one decode phase at a time. For batch runs,
    :meth:`programs` (``run_batch(..., on_programs=watch.programs)``) adds how many programs are done.
    """

    def __init__(self) -> None:
        self.tree: SharingTree | None = None
        self.programs_done: tuple[int, int] | None = None  # (done, total) in a batch run

    def __call__(self, tree: SharingTree) -> None:
        self.tree = tree

    def programs(self, done: int, total: int) -> None:
        """``on_programs`` of a batch run: ``done`` of ``total`` programs have finished."""
        self.programs_done = (done, total)

    def sample(self) -> tuple[int, int, int] | None:
        """(tokens, live branches, generating) or None when the tree changed under the read."""
        if self.tree is None:
            return None
        g = self.tree.graph
        try:
            nodes = list(g.nodes(data=True))
            parents = {u for u, v in list(g.edges()) if not g.nodes[v]["pruned"]}
        except RuntimeError:  # mutated while reading; try at the next tick
            return None
        tokens = sum(len(d["tokens"]) for _, d in nodes)
        live = [n for n, d in nodes if not d["pruned"]]
        branches = sum(1 for n in live if n not in parents)
        generating = sum(1 for _, d in nodes if d["gen_budget"] > 0 and not d["pruned"])
        return tokens, branches, generating

    def describe(self, sample: tuple[int, int, int], rate: float) -> str:
        """One status line: programs done (batch runs), branches generating / live, tokens, tokens/s."""
        tokens, branches, generating = sample
        live = _plural(branches, "branch")
        what = f"generating {generating}/{live}" if generating else f"running · {live}"
        line = f"{what} · {tokens} tokens · {rate:.1f} tok/s"
        if self.programs_done is not None:
            done, total = self.programs_done
            line = f"{done}/{total} programs done · {line}"
        return line

    def run(self, work: Callable[[], object], console: Console, enabled: bool = True):
        """Run ``work()`` in the calling thread, showing progress on ``console`` from a helper thread
        (redrawn four times a second, never per token); return its result or raise its error.

        The work runs in the calling (main) thread so that Ctrl-C interrupts the work itself: a batch
        stops and raises :class:`~treegen.lang.batch.BatchInterrupted` with what had finished."""
        if not enabled:
            return work()
        columns = (SpinnerColumn(), _ProgramsBar(bar_width=20), TextColumn("{task.description}"), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task("loading the model", total=None)
            stop = threading.Event()

            def update() -> None:
                last, rate = None, 0.0
                while not stop.wait(0.25):
                    if self.programs_done is not None:  # the bar: programs done of the batch
                        progress.update(task, completed=self.programs_done[0], total=self.programs_done[1])
                    s = self.sample()
                    if s is None:
                        if self.programs_done is not None and self.tree is None:  # (no tree here: data-parallel replicas)
                            progress.update(task, description=f"{self.programs_done[0]}/{self.programs_done[1]} "
                                                              f"programs done")
                        continue
                    now = time.perf_counter()
                    if last is not None and s[2] and now > last[0]:
                        rate = 0.7 * rate + 0.3 * max(s[0] - last[1], 0) / (now - last[0])
                    last = (now, s[0])
                    progress.update(task, description=self.describe(s, rate))

            thread = threading.Thread(target=update, name="treegen-progress", daemon=True)
            thread.start()
            try:
                return work()
            finally:
                stop.set()
                thread.join()


class _ProgramsBar(BarColumn):
    """A bar of programs done, drawn only when there is a total (a batch run)."""

    def render(self, task):
        return super().render(task) if task.total is not None else Text("")
