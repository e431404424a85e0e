"""Live progress while a program generates: a tqdm bar per batched generation phase.

The engine reports decoding through one callback (the hook the runtime calls; see :class:`TreeProgress`)::

    on_step(live_branches: int, tokens_done: int, tokens_budget: int) -> None

called during one ``TreeRun.execute`` call (here a *phase*: one batch of ``gen`` requests decoded
together) after its first sampled token and after every host sync of the decode loop:
``live_branches`` still generating, ``tokens_done`` tokens generated so far in this phase over all
branches, ``tokens_budget`` = ``tokens_done`` plus what the live branches may still generate (their
``max_tokens`` left). The last call of a phase, and only it, has ``live_branches == 0`` (then
``tokens_budget == tokens_done``); the next call starts a new phase.

A batch run (``run_batch``) also reports programs done through its ``on_programs(done, total)``
argument; :meth:`TreeProgress.programs` draws them as one more bar that stays for the whole run::

    with progress(engine) as bars:
        results = prog.run_batch(engine, inputs, on_programs=bars.programs)

``tqdm.auto`` draws the notebook widget bar in Jupyter (with ``ipywidgets``) and a text bar elsewhere.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable


class TreeProgress:
    """Turns ``on_step`` calls into one progress bar per phase.

    A bar's total is the phase's token budget at its first step; its position is the budget used up:
    tokens generated plus the ``max_tokens`` that branches ending early (EOS, stop string) gave back,
    so every bar ends full. ``bar_factory`` (default ``tqdm.auto.tqdm``) is called with ``total``,
    ``desc``, ``unit`` and ``leave`` keywords.
    """

    def __init__(self, *, desc: str = "generating", leave: bool = True, bar_factory: Callable | None = None) -> None:
        if bar_factory is None:
            from tqdm.auto import tqdm as bar_factory
        self.desc, self.leave, self.bar_factory = desc, leave, bar_factory
        self.bar = None
        self.programs_bar = None  # batch runs: programs done of the batch
        self.phases = 0
        self._total = 0
        self._over = True  # the previous call closed its phase (or there was none)

    def on_step(self, live_branches: int, tokens_done: int, tokens_budget: int) -> None:
        if self._over and live_branches == 0:  # a phase that ended at its first token: nothing to show
            return
        if self._over:  # a new phase: a new bar
            self._close_bar()
            self.phases += 1
            self._total = tokens_budget
            desc = f"{self.desc} ({live_branches} branch{'es' if live_branches != 1 else ''})"
            if self.phases > 1:
                desc = f"{self.desc} phase {self.phases} ({live_branches} branch{'es' if live_branches != 1 else ''})"
            self.bar = self.bar_factory(total=tokens_budget, desc=desc, unit="tok", leave=self.leave)
        used = min(self._total, self._total - tokens_budget + tokens_done)
        self.bar.n = used
        self.bar.set_postfix(live=live_branches, generated=tokens_done, refresh=False)
        self.bar.refresh()
        self._over = live_branches == 0
        if self._over:
            self._close_bar()

    # the hook is called like a function too
    __call__ = on_step

    def programs(self, done: int, total: int) -> None:
        """``on_programs`` of a batch run: a bar of ``done`` of ``total`` programs (made at the first call)."""
        if self.programs_bar is None:
            self.programs_bar = self.bar_factory(total=total, desc="programs done", unit="program", leave=self.leave)
        self.programs_bar.n = min(done, total)
        self.programs_bar.refresh()

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        self._close_bar()
        if self.programs_bar is not None:
            self.programs_bar.close()
            self.programs_bar = None

    def __enter__(self) -> "TreeProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextmanager
def progress(engine, **kwargs):
    """``with progress(engine): result = prog.run(engine, ...)`` shows bars while it generates.

    Sets ``engine.on_step`` (the runtime's progress hook) for the duration and restores the previous
    value after; ``kwargs`` go to :class:`TreeProgress`.
    """
    bar = TreeProgress(**kwargs)
    previous = getattr(engine, "on_step", None)
    engine.on_step = bar.on_step
    try:
        yield bar
    finally:
        engine.on_step = previous
        bar.close()
