r"""Constrained decoding throughput on one GPU against unconstrained sampling, in one run; and (``--host-only``)
the host's time per constrained step by part, on the CPU.

Random weights of a real model shape (speed does not depend on the weights), bf16, one shared prompt
below ``batch`` branches sampling at temperature 1, CUDA graphs on. The vocabulary is
:class:`~treegen.runtime.piece_tokenizer.PieceTokenizer`'s synthetic one of the model's size (the
grammar needs token texts; no tokenizer is downloaded). The constraints:

* ``none``  — no constraint (the decoder's usual phases: host sync every 8 steps, pipelined);
* realistic answer formats, which end (EOS) when complete, after a few to a few dozen tokens:
  ``answer`` — the regex ``The answer is (0|[1-9][0-9]{0,3})\.``; ``json_answer`` — a JSON object
  ``{"answer": integer, "unit": one of three, "sure": boolean}``; ``choice`` — one of four short answers;
* a stress case (labelled ``stress`` in the rows; the only constraints of the first results): each asks
  for more text than ``new`` tokens can hold, so it is never complete, the grammar never allows EOS and
  every branch makes exactly ``new`` tokens (``finish_reason="length"``, ``constraint_met=False``):
  ``regex`` — ``[a-z0-9 ,.]{N,}``; ``json`` — ``{"reasoning": string of minLength N, "answer": integer}``.

A constraint that a token automaton serves (``Engine.automaton``: the ``answer`` regex, ``choice``, ``json_answer``) is
measured twice, by the automaton and by xgrammar's matchers (an engine with ``token_automata=False`` on
the same model); ``served_by`` in the rows says which. Phases with xgrammar's constraints sync with the host every step (each matcher must see its token before the next
mask): the step runs as two CUDA graphs, forward and pick (mask + sample), and the host advances the
matchers and fills step t's masks while step t's forward runs. Decode tok/s = (tokens made - batch) /
(t(run) - t(1 token)), as in bench_end_to_end.py, the median of ``--repeats`` runs after a warm-up of the
same runs (steady state: the phases' CUDA graphs are captured by the warm-up); ``ratio_to_unconstrained`` is against ``none`` at
the same batch in the same run; for the realistic formats the same token work: measured right after the
constrained run, each branch unconstrained (EOS ignored) making exactly as many tokens as its constrained
answer did, so both runs end their branches at the same steps (a short answer's run is mostly fixed costs —
prefill, phase set-up — which the baseline then pays too). Every constrained
sample is checked: a realistic one matches its constraint (complete, or cut short by ``max_tokens``
with ``constraint_met=False``); a stress one is a prefix the grammar accepts (the matcher took every
token) and the JSON starts ``{"reasoning": "``. ``host_ms_per_step`` splits the host's time per
constrained step (``Decoder.constrained_host``): ``wait`` for the step's tokens, matcher ``accept`` (with
the next masks' fill, one pass), ``fill`` (a phase's first masks only), mask ``upload``, ``settle`` (appending tokens, finishing branches), ``launch`` (graph
replays), ``other`` (the loop's own Python).

``--host-only`` runs the real decode loop on the CPU (settling blocks of 8 steps, as on a GPU) with a one-layer
random model of a real vocabulary size (``--vocabs``; its forward and sampling are the "device" work, reported as ``launch`` and not
counted as host time; greedy, as sampling at temperature 1 costs the CPU seconds a step): the host's ms per constrained step by part, the part that must fit under a
GPU's forward for constrained decode to run at the unconstrained speed.

    python benchmarks/bench_constrained.py --shape tinyllama-1.1b --batches 64 128 256 512 1024
    python benchmarks/bench_constrained.py --shape llama3-8b --batches 64 128 256 512 1024
    python benchmarks/bench_constrained.py --host-only --vocabs 32000 128256 --batches 256 1024
    python benchmarks/bench_constrained.py --constraints none answer json_answer choice --jump-forward

``--jump-forward``: the constrained gens start with the text their constraint forces written at once
(``Engine(jump_forward=True)``: prefilled with the prompt, not decoded); their baseline is the same token work
as before (each branch as many tokens as its answer, forced ones included), so the ratio says what the
steps it saves are worth.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
if "--cpu-time" in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle torch threads sleep: they would count as host CPU

import torch
import transformers
import triton
from transformers import LlamaConfig

from treegen.runtime.constraint import Constraint
from treegen.runtime.engine import Engine, GenRequest
from treegen.runtime.model import LlamaFamilyModel
from treegen.runtime.piece_tokenizer import PieceTokenizer
from treegen.runtime.sampler import SamplingParams
from bench_end_to_end import SHAPES  # benchmarks/bench_end_to_end.py

LONGEST_PIECE = 9  # PieceTokenizer's pieces have at most 9 characters (" " + 8 letters)


STRESS = ("regex", "json")
REALISTIC = ("answer", "json_answer", "choice")
ANSWER_REGEX = r"The answer is (0|[1-9][0-9]{0,3})\."
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9999},
                                                  "unit": {"enum": ["cows", "dollars", "apples"]},
                                                  "sure": {"type": "boolean"}},
                 "required": ["answer", "unit", "sure"], "additionalProperties": False}
CHOICES = ["A", "B", "C", "D) none of the above"]


def constraints(new: int) -> dict[str, Constraint | None]:
    least = LONGEST_PIECE * new + 1  # more characters than `new` tokens can write: never complete
    schema = {"type": "object", "properties": {"reasoning": {"type": "string", "minLength": least},
                                               "answer": {"type": "integer"}},
              "required": ["reasoning", "answer"], "additionalProperties": False}
    return {"none": None, "answer": Constraint.of(regex=ANSWER_REGEX),
            "json_answer": Constraint.of(json_schema=ANSWER_SCHEMA), "choice": Constraint.of(choices=CHOICES),
            "regex": Constraint.of(regex=f"[a-z0-9 ,.]{{{least},}}"), "json": Constraint.of(json_schema=schema)}


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_run(engine: Engine, *, batch: int, prompt: list[int], new: int, constraint,
              temperature: float = 1.0, lengths: list[int] | None = None) -> tuple[float, list, object]:
    """One run of ``batch`` branches below ``prompt``, each making ``new`` tokens at most (``lengths[i]``
    for branch i when given: unconstrained, EOS ignored, exactly that many)."""
    synchronize()
    start = time.perf_counter()
    run = engine.start()
    root = run.tree.add_node(None, prompt)
    leaves = [run.tree.add_node(root) for _ in range(batch)]
    lengths = lengths or [new] * batch
    results, _ = run.execute([GenRequest(leaf, SamplingParams(max_tokens=n, temperature=temperature,
                                                              ignore_eos=constraint is None, constraint=constraint),
                                         key=i, final=True) for i, (leaf, n) in enumerate(zip(leaves, lengths))], [])
    synchronize()
    return time.perf_counter() - start, results, run


def check(results, name: str, new: int) -> None:
    """A stress or unconstrained sample made ``new`` tokens; a stress one is an incomplete, accepted
    prefix; a realistic one matches its constraint unless cut short (then it says so)."""
    for r in results:
        if name == "none" or name in STRESS:
            assert len(r.tokens) == new, (name, len(r.tokens), r.finish_reason)
        if name in STRESS:
            # the matcher accepted every token (else the run raised); the text is what the grammar began
            assert r.constraint_met is False and r.finish_reason == "length", (name, r)
        if name == "regex":
            assert re.fullmatch(r"[a-z0-9 ,.]*", r.text), r.text[:80]
        if name == "json":
            assert r.text.startswith('{"reasoning": "'), r.text[:80]
        if name in REALISTIC:
            assert len(r.tokens) <= new and (r.constraint_met or r.finish_reason == "length"), (name, r)
            if r.constraint_met:
                if name == "answer":
                    assert re.fullmatch(ANSWER_REGEX, r.text), r.text
                elif name == "choice":
                    assert r.text in CHOICES, r.text
                else:
                    value = json.loads(r.text)
                    assert set(value) == {"answer", "unit", "sure"} and value["unit"] in ANSWER_SCHEMA[
                        "properties"]["unit"]["enum"] and isinstance(value["sure"], bool), r.text


def host_parts(run) -> dict:
    steps = max(run.decoder.constrained_steps, 1)
    parts = {k: 1e3 * v / steps for k, v in run.decoder.constrained_host.items()}
    parts["host_total"] = sum(v for k, v in parts.items() if k != "launch")
    return parts


def measure(engine: Engine, name: str, constraint, batch: int, prompt: list[int], new: int,
            warm: bool = True, temperature: float = 1.0, lengths: list[int] | None = None, repeats: int = 1) -> dict:
    """One point: the median of ``repeats`` timed runs (each a 1-token run and the full run), after one
    warm-up of exactly the same runs (kernels, grammar, and the phases' CUDA graphs: steady state, the
    graphs a first run captures are not counted in any row). ``lengths``: per-branch token counts for an
    unconstrained baseline (see timed_run)."""
    def pair():
        """One timed pair; the run's figures taken and the run dropped at once (a run holds its KV pool:
        keeping the repeats' runs alive held several pools, and the 8B shape's 1,024 ran out of memory)."""
        t1 = timed_run(engine, batch=batch, prompt=prompt, new=1, constraint=constraint, temperature=temperature)[0]
        tn, results, run = timed_run(engine, batch=batch, prompt=prompt, new=new, constraint=constraint,
                                     temperature=temperature, lengths=lengths)
        if lengths is None:  # every sample of every run valid
            check(results, name, new)
        else:
            assert [len(r.tokens) for r in results] == lengths, "the baseline made other lengths than asked"
        figures = {"forward_passes": run.forward_passes, "constrained_steps": run.decoder.constrained_steps,
                   "decode_phases": len(run.decode_phases), "host_ms_per_step": host_parts(run),
                   "host_accept_s": run.host_seconds["accept"], "host_capture_s": run.host_seconds["capture"],
                   "host_s": {k: round(v, 4) for k, v in run.host_seconds.items()}, "phase_passes": list(run.phase_passes),
                   "early_ends": run.decoder.early_ends, "memory_waits": run.scheduler.memory_waits}
        del run
        gc.collect()
        return tn - t1, t1, tn, [r.tokens for r in results], [r.constraint_met for r in results], figures

    if warm:
        pair()
    pairs = sorted((pair() for _ in range(max(repeats, 1))), key=lambda p: p[0])
    decode_s = [p[0] for p in pairs]
    _, t1, tn, tokens, met, figures = pairs[len(pairs) // 2]
    made = sum(len(t) for t in tokens)
    row = {"constraint": name, "kind": "stress" if name in STRESS else "realistic" if name in REALISTIC else "none",
           "batch": batch, "prefix": len(prompt), "new": new, "tokens_made": made,
           "longest": max(len(t) for t in tokens), "complete_share": sum(bool(m) for m in met) / len(met),
           "total_s": tn, "prefill_s": t1, "tok_s": (made - batch) / (tn - t1), **figures, "decode_s_runs": decode_s}
    if name in REALISTIC:
        row["lengths"] = [len(t) for t in tokens]  # (for its baseline; taken out of the row there)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama-1.1b")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--constraints", nargs="+", default=["none", *REALISTIC, *STRESS],
                        choices=["none", *REALISTIC, *STRESS])
    parser.add_argument("--host-only", action="store_true",
                        help="the host's ms per constrained step on the CPU (a one-layer model of each --vocabs size)")
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32000, 128256], help="--host-only vocabulary sizes")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time the host's parts by the process's CPU time, not the wall clock (a shared machine)")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="instead of the table: profile one run of each --constraints at the first of --batches "
                             "(GPU busy time per step, the GPU's idle gaps, kernel time by name) into FILE (JSON)")
    parser.add_argument("--jump-forward", action="store_true",
                        help="constrained gens write the text their constraint forces at once (prefilled, not "
                             "decoded; rows say jump_forward); the baseline makes as many tokens per branch")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per point (the median is reported)")
    parser.add_argument("--label", default="", help="a name for this run in the results file (e.g. before/after)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", nargs="+", default=None, metavar="JSON", help="only draw the plots of these results")
    args = parser.parse_args()
    if args.plot:
        for f in args.plot:
            plot(Path(f))
        return
    if args.cpu_time:
        import treegen.runtime.constrained_steps as constrained_steps

        constrained_steps.CLOCK = time.process_time
    if args.host_only:
        return host_only(args)

    config = LlamaConfig(**SHAPES[args.shape])
    model = LlamaFamilyModel.random(config, dtype=torch.bfloat16, device="cuda")
    tokenizer = PieceTokenizer(config.vocab_size)
    engine = Engine(model, tokenizer, jump_forward=args.jump_forward)
    # the same model with every constraint on xgrammar's matchers: the A/B of what token automata change
    matchers_only = Engine(model, tokenizer, token_automata=False, jump_forward=args.jump_forward)
    prompt = torch.randint(3, config.vocab_size, (args.prefix,), generator=torch.Generator().manual_seed(0)).tolist()
    chosen = {k: v for k, v in constraints(args.new).items() if k in args.constraints}
    compile_s = compile_all(engine, chosen)
    if args.trace:
        return trace(engine, chosen, args.batches[0], prompt, args.new, Path(args.trace))
    rows = []
    for batch in args.batches:
        for name, c in chosen.items():
            served = ["none"] if c is None else ["automaton", "xgrammar"] if engine.automaton(c) else ["xgrammar"]
            for by in served:
                try:
                    rows.append(measure(matchers_only if by == "xgrammar" else engine, name, c, batch, prompt, args.new,
                                        repeats=args.repeats))
                    rows[-1]["served_by"] = by
                    rows[-1]["jump_forward"] = args.jump_forward and c is not None
                    if name in REALISTIC:  # its baseline: the same token work, each branch as long as its answer
                        base = measure(engine, "none", None, batch, prompt, args.new, lengths=rows[-1].pop("lengths"),
                                       repeats=args.repeats)
                        rows[-1]["ratio_to_unconstrained"] = rows[-1]["tok_s"] / base["tok_s"]
                        rows[-1]["unconstrained_tok_s"] = base["tok_s"]
                        rows[-1]["unconstrained_decode_s"] = base["total_s"] - base["prefill_s"]
                        rows[-1]["unconstrained_figures"] = {k: base[k] for k in (
                            "forward_passes", "decode_phases", "phase_passes", "host_s", "decode_s_runs")}
                except torch.cuda.OutOfMemoryError as e:
                    rows.append({"constraint": name, "batch": batch, "served_by": by,
                                 "skipped": f"out of memory: {str(e)[:200]}"})
                    gc.collect()
                    torch.cuda.empty_cache()
                base = next((r for r in rows if r["constraint"] == "none" and r["batch"] == batch and "tok_s" in r), None)
                if name not in REALISTIC and base and "tok_s" in rows[-1]:
                    rows[-1]["ratio_to_unconstrained"] = rows[-1]["tok_s"] / base["tok_s"]
                print({k: v for k, v in rows[-1].items() if k != "host_ms_per_step"}, flush=True)
                write_json(args, rows, compile_s)

    names = [(n, by) for n, c in chosen.items()
             for by in (["none"] if c is None else ["automaton", "xgrammar"] if engine.automaton(c) else ["xgrammar"])]
    print(f"\n## {args.shape}, bf16, prefix {args.prefix}, {args.new} new tokens at most, temperature 1 — decode "
          "tokens/s (ratio to unconstrained; stress: regex, json; @: what served the constraint)\n")
    print("| batch | " + " | ".join(f"{n}@{by}" for n, by in names) + " |")
    print("|---|" + "---|" * len(names))
    for batch in args.batches:
        by_key = {(r["constraint"], r.get("served_by")): r for r in rows if r["batch"] == batch}
        cells = [f"{by_key[k]['tok_s']:,.0f} ({by_key[k].get('ratio_to_unconstrained', 1.0):.2f})"
                 if "tok_s" in by_key.get(k, {}) else "-" for k in names]
        print(f"| {batch} | " + " | ".join(cells) + " |")
    print(f"grammar compile s: {compile_s}")
    out = write_json(args, rows, compile_s)
    print(f"wrote {out}")
    plot(out)


def plot(result_file: Path) -> None:
    """Each constraint's ratio to unconstrained decode, per batch (bars), the 0.9 target as a line: a PNG
    beside the JSON."""
    from plotting import pyplot, save  # benchmarks/

    plt = pyplot()
    if plt is None:
        return
    result = json.loads(Path(result_file).read_text())
    rows = [r for r in result["rows"] if "ratio_to_unconstrained" in r and r["constraint"] != "none"]
    names = list(dict.fromkeys(f"{r['constraint']}@{r['served_by']}" for r in rows))
    batches = sorted({r["batch"] for r in rows})
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(names) * len(batches) / 2, 3.6))
    width = 0.8 / len(batches)
    for k, batch in enumerate(batches):
        ratio = {f"{r['constraint']}@{r['served_by']}": r["ratio_to_unconstrained"] for r in rows if r["batch"] == batch}
        ax.bar([i + (k - (len(batches) - 1) / 2) * width for i in range(len(names))],
               [ratio.get(n, 0.0) for n in names], width, label=f"{batch} branches")
    ax.axhline(0.9, color="black", linestyle="--", linewidth=0.8, label="target 0.9")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("constrained / unconstrained tok/s")
    ax.set_title(f"{result['shape']}, {result['device']}", fontsize=9)
    ax.legend(fontsize=8)
    save(fig, Path(result_file).with_suffix(".png"))


def trace(engine: Engine, chosen: dict, batch: int, prompt: list[int], new: int, out: Path) -> None:
    """Each constraint's run (after a warm-up) under the PyTorch profiler, and a realistic one's baseline (the
    same token work unconstrained): where a step's time goes on the GPU — its busy time per decode step
    (kernels and copies, union), idle gaps, kernel time by name."""
    from torch.profiler import ProfilerActivity, profile

    from trace_dynamic import union  # benchmarks/

    result = {"benchmark": "constrained_trace", "batch": batch, "new": new, "device": torch.cuda.get_device_name(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "runs": {}}

    def traced(label: str, c, lengths=None) -> list[int]:
        timed_run(engine, batch=batch, prompt=prompt, new=new, constraint=c, lengths=lengths)  # warm-up
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall, results, run = timed_run(engine, batch=batch, prompt=prompt, new=new, constraint=c, lengths=lengths)
        gpu, by_name = [], {}
        for e in prof.profiler.kineto_results.events():
            if "CUDA" in str(e.device_type()) and e.duration_ns() > 0:
                gpu.append((e.start_ns(), e.end_ns()))
                by_name[e.name()[:90]] = by_name.get(e.name()[:90], 0.0) + e.duration_ns() / 1e6
        busy = union(gpu)
        gaps = sorted(((b[0] - a[1]) / 1e3 for a, b in zip(busy, busy[1:]) if b[0] > a[1]), reverse=True)
        steps = run.forward_passes
        result["runs"][label] = {
            "wall_ms": 1e3 * wall, "forward_passes": steps, "constrained_steps": run.decoder.constrained_steps,
            "decode_phases": len(run.decode_phases), "phase_passes": list(run.phase_passes),
            "host_s": {k: round(v, 4) for k, v in run.host_seconds.items()},
            "tokens_made": sum(len(r.tokens) for r in results),
            "gpu_span_ms": (busy[-1][1] - busy[0][0]) / 1e6, "gpu_busy_ms": sum(e - s for s, e in busy) / 1e6,
            "gpu_busy_ms_per_step": sum(e - s for s, e in busy) / 1e6 / max(steps, 1),
            "gpu_idle_ms": sum(gaps) / 1e3, "largest_gaps_us": [round(g, 1) for g in gaps[:20]],
            "gaps_over_100us": sum(g > 100 for g in gaps),
            "kernel_ms_by_name": {k: round(v, 2) for k, v in sorted(by_name.items(), key=lambda x: -x[1])[:25]},
            "host_ms_per_step": host_parts(run) if run.decoder.constrained_steps else None}
        print(label, {k: v for k, v in result["runs"][label].items() if k != "kernel_ms_by_name"}, flush=True)
        lengths = [len(r.tokens) for r in results]
        del run, results
        gc.collect()
        return lengths

    for name, c in chosen.items():
        lengths = traced(name, c)
        if name in REALISTIC:  # and its baseline: the same token work unconstrained (see measure)
            traced(name + "_baseline", None, lengths)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def compile_all(engine: Engine, chosen: dict) -> dict:
    compile_s = {}
    for name, c in chosen.items():
        if c is not None:
            started = time.perf_counter()
            engine.grammars.compile(c)
            compile_s[name] = time.perf_counter() - started
            automaton = engine.automaton(c)  # (its token automaton, if one serves it: built on first use)
            if automaton is not None:
                compile_s[name + "_automaton"] = automaton.build_seconds
    return compile_s


def host_only(args) -> None:
    """The host's ms per constrained step by part, the real decode loop on the CPU (see the module doc)."""
    from treegen.runtime.decode import Decoder

    init = Decoder.__init__

    def gpu_blocks(self, run) -> None:  # the host settles blocks of 8 steps, as on a GPU (the CPU's default: 1)
        init(self, run)
        self.sync_every = 8

    Decoder.__init__ = gpu_blocks
    rows, compile_s = [], {}
    for vocab in args.vocabs:
        config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
        model = LlamaFamilyModel.random(config, dtype=torch.float32, device="cpu")
        # xgrammar's matchers for every constraint: their host time per step is what this measures
        engine = Engine(model, PieceTokenizer(vocab), cuda_graphs=False, token_automata=False)
        prompt = torch.randint(3, vocab, (args.prefix,), generator=torch.Generator().manual_seed(0)).tolist()
        chosen = {k: v for k, v in constraints(args.new).items() if k in args.constraints and v is not None}
        compile_s[vocab] = compile_all(engine, chosen)
        for batch in args.batches:
            for name, c in chosen.items():
                # greedy: sampling at temperature 1 over [batch, vocab] costs the CPU seconds a step (device work)
                row = measure(engine, name, c, batch, prompt, args.new, warm=False, temperature=0.0)
                row["vocab"] = vocab
                row.pop("lengths", None)
                del row["tok_s"]  # (the CPU's model work is no measure of anything)
                rows.append(row)
                shown = " ".join(f"{k} {v:.2f}" for k, v in row["host_ms_per_step"].items())
                print(f"vocab {vocab} batch {batch} {name}: {row['constrained_steps']} steps, "
                      f"ms/step: {shown}", flush=True)
                write_json(args, rows, compile_s, host_only=True)
    print(f"\n## host ms per constrained step (CPU: {os.cpu_count()} cores), {args.label}\n")
    print("| vocab | batch | constraint | steps | wait | accept | fill | upload | settle | other | host total |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        h = r["host_ms_per_step"]
        print(f"| {r['vocab']} | {r['batch']} | {r['constraint']} | {r['constrained_steps']} | " + " | ".join(
            f"{h[k]:.2f}" for k in ("wait", "accept", "fill", "upload", "settle", "other", "host_total")) + " |")
    print(f"wrote {write_json(args, rows, compile_s, host_only=True)}")


def write_json(args, rows: list[dict], compile_s: dict, host_only: bool = False) -> Path:
    """The results so far (written after every point: a run cut short keeps what it measured)."""
    result = {"benchmark": "constrained_host" if host_only else "constrained", "label": args.label,
              "shape": None if host_only else args.shape,
              "config": "one layer, hidden 16, fp32" if host_only else SHAPES[args.shape],
              "dtype": "float32" if host_only else "bfloat16",
              "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)" if host_only
              else torch.cuda.get_device_name(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "versions": {"torch": torch.__version__, "triton": triton.__version__,
                           "transformers": transformers.__version__, "xgrammar": importlib.metadata.version("xgrammar"),
                           "cuda": torch.version.cuda, "python": platform.python_version()},
              "clock": "process CPU time" if args.cpu_time else "wall",
              "method": ("host ms per constrained step by part (Decoder.constrained_host / constrained_steps), the real "
                         "decode loop on the CPU settling blocks of 8 steps (as on a GPU), no CUDA graphs, greedy; launch = the CPU model's forward and sampling "
                         "(device work here), not in host_total" if host_only else
                         "decode tok/s = (tokens made - batch)/(t(new)-t(1)); temperature 1; stress constraints: every "
                         "branch makes exactly new tokens (the constraint needs more text than new tokens hold); "
                         "realistic ones end at EOS when complete, their baseline is the same token work: unconstrained, "
                         "EOS ignored, each branch as many tokens as its constrained answer; per point one warm-up of the same "
                         "runs (CUDA graphs captured), then the median of `repeats` runs (decode_s_runs: each run's "
                         "t(new)-t(1))"),
              "repeats": getattr(args, "repeats", 1),
              "constraints": {k: (str(v) if v is not None else None) for k, v in constraints(args.new).items()},
              "grammar_compile_s": compile_s, "rows": rows}
    name = f"constrained_host_{args.label or 'cpu'}.json" if host_only else f"constrained_{args.shape}.json"
    out = Path(args.out or Path(__file__).parent / "results" / name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
