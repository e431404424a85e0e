"""The ``treegen`` command line: check, show and run ``.tg`` programs.

    treegen check FILE... [--var k=v ...]          parse and validate (no model)
    treegen show FILE [--var k=v ...] [--model M]  the compiled sharing tree and its KV bytes
    treegen run FILE [--var k=v ...] [--model M] [--seed S] [--json OUT]
    treegen run FILE --batch INPUTS.jsonl ...       one program per line of parameter values, one workload

Results go to stdout, diagnostics (errors, progress) to stderr. Exit status: 0 success, 1 a failure
while running (in a batch: any program failed; the others still finish and are written), 2 a mistake
in the program, its parameters or the command line, 130 interrupted. With ``--batch``, ``--json OUT``
is JSON Lines written as each program finishes (finish order), so a stopped run leaves every finished
program's result in OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback

from treegen.runtime.engine import MODEL_DTYPES

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
_MODEL_HELP = "a local Hugging Face checkpoint directory or hub id (default: the embedded SmolLM2-135M-Instruct)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="treegen", description="Check, show and run .tg prompt programs over an explicit sharing tree.",
        epilog="Exit status: 0 ok, 1 failure while running, 2 mistake in the program or the command, 130 interrupted.")
    p.add_argument("--version", action="version", version=f"treegen {_version()}")
    p.add_argument("--traceback", action="store_true", help="show Python tracebacks of internal failures")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    c = sub.add_parser("check", help="parse and validate .tg files (no model)",
                       description="Parse and validate .tg files, with their includes; no model is loaded.")
    c.add_argument("files", nargs="+", metavar="FILE")
    c.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                   help="check with this parameter value (repeatable, as run takes it; for every FILE): a value the "
                        "program cannot use (a fork count of 0, ...) is an error where it is used")
    c.set_defaults(func=cmd_check)

    def common(q):
        q.add_argument("file", metavar="FILE", help="a .tg program")
        q.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                       help="set a parameter (repeatable); lists as JSON: --var items='[\"a\", \"b\"]'")
        q.add_argument("--model", default=None, metavar="M", help=_MODEL_HELP)
        q.add_argument("--dtype", choices=MODEL_DTYPES, default="float32",
                       help="precision of the model (and of its KV cache unless --kv-dtype) (default float32)")
        q.add_argument("--kv-dtype", choices=["auto", "int8", "fp8"], default="auto",
                       help="how the KV cache is stored: auto (the model's dtype), int8 or fp8 (8 bits a value "
                            "plus a scale per token and KV head: about half the memory)")
        q.add_argument("--max-children", type=int, default=8, metavar="N",
                       help="children shown per node, branches per fork (default 8)")

    s = sub.add_parser("show", help="print the compiled sharing tree with KV bytes (no weights loaded)",
                       description="Compile FILE with the model's tokenizer and config (no weights) and print its "
                                   "sharing tree: per node a text excerpt, tokens, branches below and KV bytes; "
                                   "then totals and the saving against storing every branch separately.")
    common(s)
    s.set_defaults(func=cmd_show)

    r = sub.add_parser("run", help="run a program on a model",
                       description="Run FILE on a model and print its results as a tree.")
    common(r)
    r.add_argument("--seed", type=int, default=0, help="program seed (default 0)")
    r.add_argument("--json", metavar="OUT", help="write the executed tree (every branch's text and variables) "
                                                 "as JSON to OUT ('-' for stdout); with --batch, JSON Lines: one "
                                                 "object per input, written as soon as that program finishes, so "
                                                 "in finish order, not input order (each has 'index', 0-based, and "
                                                 "'line' in JSONL; a failed one has 'error')")
    r.add_argument("--batch", metavar="JSONL",
                   help="run the program once per line of JSONL (a JSON object of parameter values, over the "
                        "--var values) as one workload: shared prompt prefixes are found and stored once; "
                        "a program that fails is reported and the others finish (exit status 1). '-': lines read "
                        "from standard input as they come (a pipe), each program started when its line arrives and "
                        "its prompt's prefix read from the programs before it where they share one")
    r.add_argument("--device", default="cpu", help="torch device (default cpu)")
    r.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallel: split the model over N GPUs (under torchrun, one process per GPU; "
                        "else this process starts the other ranks itself)")
    r.add_argument("--vocab-parallel", choices=["auto", "on", "off"], default="auto",
                   help="with --tp: split the LM head by vocabulary over the ranks (on: each rank computes the logits "
                        "of its share of the tokens; the tokens drawn are the same) or keep it whole on every rank "
                        "(off); auto (default) splits it wherever the vocabulary splits")
    r.add_argument("--dp", type=int, default=None, metavar="N",
                   help="data parallel: N model replicas, a --batch split across them by shared prefixes, results "
                        "streamed back as each program finishes (under torchrun default: the processes it started / "
                        "--tp, rank 0 alone prints and writes --json; else this process starts N replica processes "
                        "of --tp ranks each, on GPUs 0..N*tp-1 on CUDA)")
    r.add_argument("--implementation", choices=["auto", "fast", "generic"], default="auto",
                   help="which forward runs the model: auto (treegen's fast forward where it runs the model, else "
                        "the generic path: transformers' own modules with tree attention), fast or generic")
    r.add_argument("--kv-keep", type=_kv_keep, default=None, metavar="R",
                   help="sparse window attention (lossy) for every gen that names no kv_keep: each branch keeps "
                        "this fraction in (0, 1] of its own KV, its recent tokens and those it attended to most "
                        "(default: exact attention)")
    r.add_argument("--jump-forward", action="store_true",
                   help="constrained gens start with the text their constraint forces written at once (prefilled, "
                        "not decoded; tokenized as the tokenizer writes it, not as the model would draw it)")
    r.add_argument("--max-program-tokens", type=_positive, default=None, metavar="N",
                   help="stop a program that generates more than N tokens in all (its own error; the others go on; "
                        "default 1,000,000)")
    r.add_argument("--no-progress", action="store_true", help="no progress display")
    r.set_defaults(func=cmd_run)
    return p


def _token_limit(args) -> int:
    """``--max-program-tokens``, or the API's default."""
    from treegen.lang.batch import DEFAULT_MAX_PROGRAM_TOKENS

    return DEFAULT_MAX_PROGRAM_TOKENS if args.max_program_tokens is None else args.max_program_tokens


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _kv_keep(text: str) -> float:
    from treegen.runtime.swa import check_kv_keep

    try:
        return check_kv_keep(float(text), "--kv-keep")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e) if "must be" in str(e) else f"--kv-keep must be a number, got {text!r}")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("treegen")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "unknown"


def _consoles():
    from rich.console import Console

    return Console(), Console(stderr=True)


def _load(path: str):
    from treegen.lang.tg import load

    return load(path)


def _short(value, width: int = 32) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"


# commands -------------------------------------------------------------------------------------------
def cmd_check(args) -> int:
    from treegen.lang.tg import TgError

    status = EXIT_OK
    for path in args.files:
        try:
            prog = _load(path)
            prog.check_values(prog.parse_vars(args.var))
        except TgError as e:
            print(e, file=sys.stderr)
            status = EXIT_USAGE
            continue
        params = ", ".join(f"{n}: {s.type}" + ("" if s.required else f" = {_short(s.default)}")
                           for n, s in prog.params.items())
        print(f"{path}: ok" + (f" (parameters: {params})" if params else ""))
    return status


def cmd_show(args) -> int:
    import torch

    from treegen.kernels.kv_quant import kv_format
    from treegen.render import sharing_tree_view, stats_table
    from treegen.runtime.loader import load_config, load_tokenizer
    from treegen.tree.sharing_tree import KVShape

    prog = _load(args.file)
    values = prog.parse_vars(args.var)
    prog.bind(values)  # report parameter mistakes before loading anything
    prog.check_values(values)
    tokenizer = load_tokenizer(args.model)
    fmt = kv_format(None if args.kv_dtype == "auto" else args.kv_dtype, getattr(torch, args.dtype))
    kv = KVShape.from_config(load_config(args.model), fmt.bytes_per_value, fmt.scale_bytes)
    compiled = prog.compile(tokenizer=tokenizer, **values)
    out, err = _consoles()
    model = args.model or "SmolLM2-135M-Instruct (embedded)"
    title = f"{args.file} · {model} · {kv.bytes_per_token} B of KV per token ({fmt.name})"
    out.print(sharing_tree_view(compiled.tree, kv, tokenizer, title, args.max_children))
    out.print(stats_table(compiled.stats(kv)))
    if not compiled.complete:
        out.print(f"[yellow]partial tree:[/] it grows while running, from {compiled.stopped_at}", highlight=False)
    return EXIT_OK


def cmd_run(args) -> int:
    import torch

    from treegen.render import TreeWatch, result_view
    from treegen.runtime.engine import Engine

    prog = _load(args.file)
    values = prog.parse_vars(args.var)
    if not args.batch:  # (with --batch each line binds its values over these: a parameter may come from the lines)
        prog.bind(values)
    # (a value the program cannot use: reported where it is used, before loading; with --batch the lines may give
    # what a default would: defaults are checked where a line leaves them in use, when it binds)
    prog.check_values(values, defaults=not args.batch)
    batch = None
    if args.batch == "-" and ((args.dp or 1) > 1 or os.environ.get("WORLD_SIZE", "1") != "1"):
        print("treegen: error: --batch - (inputs read as they come) runs on one process and one replica: data parallel "
              "and torchrun launches split a batch known whole — give --batch a file", file=sys.stderr)
        return EXIT_USAGE
    if args.batch == "-":
        stream = _StdinBatch(values, prog=prog)
        batch = stream, stream.lines
    elif args.batch:
        batch = _read_batch(prog, args.batch, values)
    if args.json and args.json != "-" and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        print(f"treegen: error: --json {args.json}: no such folder", file=sys.stderr)
        return EXIT_USAGE
    out, err = _consoles()
    if os.environ.get("RANK", "0") != "0":  # another rank of a torchrun launch: rank 0 prints and writes
        from rich.console import Console

        out, args.json, args.no_progress = Console(file=open(os.devnull, "w")), None, True
    watch = TreeWatch()
    dtype = getattr(torch, args.dtype)

    def load():
        _quiet_transformers()
        return Engine.load(args.model, dtype=dtype, device=args.device, tensor_parallel=args.tp,
                           data_parallel=args.dp, implementation=args.implementation,
                           vocab_parallel={"on": True, "off": False}.get(args.vocab_parallel, "auto"),
                           kv_dtype=None if args.kv_dtype == "auto" else args.kv_dtype, kv_keep=args.kv_keep,
                           jump_forward=args.jump_forward)

    if batch is not None:
        return _run_batch(args, prog, *batch, load, watch, out, err)

    def work():
        engine = load()
        start = time.perf_counter()
        return (prog.run(engine, seed=args.seed, watch=watch, max_program_tokens=_token_limit(args), **values),
                time.perf_counter() - start)

    result, seconds = watch.run(work, err, enabled=not args.no_progress)
    if args.json:
        text = json.dumps(result.to_json(), indent=2, ensure_ascii=False)
        if args.json == "-":
            print(text)
            return EXIT_OK
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    out.print(result_view(result, args.max_children))
    tokens = sum(len(d["tokens"]) for _, d in result.state.tree.graph.nodes(data=True))
    err.print(f"[dim]ran in {seconds:.1f} s · {tokens} tokens in the tree"
              + (f" · wrote {args.json}" if args.json else "") + "[/]", highlight=False)
    return EXIT_OK


class _StdinBatch:
    """``--batch -``: JSON Lines read from standard input as they come (a pipe fed by another process):
    each line's program starts when the line arrives and the engine has room (:mod:`treegen.lang.arrivals`),
    its result is written as soon as it finishes. A line that is not a JSON object, or whose values do
    not bind, fails its program alone. ``lines``: the line number of each input taken so far."""

    def __init__(self, values: dict, stream=None, prog=None) -> None:
        self.values, self.stream, self.prog = values, stream if stream is not None else sys.stdin, prog
        self.lines: list[int] = []

    def __iter__(self):
        from treegen.lang.tg import TgError

        for i, line in enumerate(self.stream, 1):
            if not line.strip():
                continue
            self.lines.append(i)  # (before the input is handed over: describe(i) reads it)
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                yield TgError(f"--batch - line {i}: not JSON: {e.msg} (column {e.colno})")
                continue
            if not isinstance(item, dict):
                yield TgError(f"--batch - line {i}: each line must be a JSON object of parameter values")
                continue
            if self.prog is not None:  # values that do not bind: named by this line (not the .tg's first parameter)
                try:
                    self.prog.bind(self.values | item)
                except TgError as e:
                    yield TgError(f"--batch - line {i}: {e.message}")
                    continue
            yield self.values | item


def _read_batch(prog, path: str, values: dict) -> tuple[list[dict], list[int]]:
    """The JSONL inputs of ``--batch``: per line a JSON object of parameter values over ``values``;
    returns them and their line numbers (blank lines are skipped)."""
    from treegen.lang.tg import TgError
    from treegen.lang.tg.errors import Pos, Source

    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise TgError(f"--batch {path}: {e.strerror}", prog._where()) from None
    source, out, numbers = Source(path, "\n".join(lines)), [], []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise TgError(f"--batch: not JSON: {e.msg}", Pos(source, i, e.colno)) from None
        if not isinstance(item, dict):
            raise TgError("--batch: each line must be a JSON object of parameter values", Pos(source, i, 1))
        try:
            prog.bind(values | item)
        except TgError as e:  # (pointed at the input's line, not at the parameter's declaration)
            raise TgError(f"--batch {path} line {i}: {e.message}", Pos(source, i, 1)) from None
        out.append(values | item)
        numbers.append(i)
    if not out:
        raise TgError(f"--batch {path}: no inputs", prog._where())
    return out, numbers


class _JsonLines:
    """``--json OUT`` of a batch: one JSON object per line, written and flushed as each program
    finishes, so the file is valid JSON Lines holding every finished program whenever the run stops.
    Thread-safe; after :meth:`close` (or a failed write) further lines are dropped."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.saved = "were written to stdout" if path == "-" else f"are in {path}"  # "their results ..."
        self.file = sys.stdout if path == "-" else open(path, "w", encoding="utf-8")
        self.lock = threading.Lock()
        self.closed = False
        self.error: OSError | None = None

    def write(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with self.lock:
            if self.closed or self.error is not None:
                return
            try:
                self.file.write(line)
                self.file.flush()
            except OSError as e:  # reported when the run ends; the run goes on
                self.error = e

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            try:
                if self.file is not sys.stdout:
                    self.file.close()
                else:
                    self.file.flush()
            except OSError as e:
                self.error = self.error or e


def _error_text(e: BaseException) -> str:
    """``ExceptionType: message`` on one line (a ``.tg`` error with its ``file:line:col``)."""
    from treegen.lang.tg import TgError

    message = f"{e.pos}: {e.message}" if isinstance(e, TgError) and e.pos is not None else str(e)
    return f"{type(e).__name__}: {' '.join(message.splitlines())}"


def _run_batch(args, prog, inputs, lines: list[int], load, watch, out, err) -> int:
    """``treegen run --batch``: results go to ``--json`` as each program finishes (JSON Lines, finish
    order); failed programs are reported and the others finish (exit 1); Ctrl-C exits 130. ``inputs``: a
    list, or the lines of standard input as they come (``lines`` then grows as they are read)."""
    from treegen.lang.batch import InputsFailed, ProgramError
    from treegen.lang.tg.program import _clean
    from treegen.render import result_view

    source = "<stdin>" if args.batch == "-" else args.batch

    class _Where:  # input i's place: FILE:LINE (read when asked: standard input's lines come as the run goes)
        def __getitem__(self, i: int) -> str:
            return f"{source}:{lines[i]}"

    where = _Where()
    sink = _JsonLines(args.json) if args.json else None
    results: dict = {}  # index -> TgResult, as they finish
    clock: dict = {}

    def on_result(i: int, result) -> None:
        results[i] = result
        if result.error is not None:
            err.print(f"treegen: input {where[i]} (index {i}) failed: {_error_text(result.error)}",
                      markup=False, highlight=False, soft_wrap=True)
        if sink is None:
            return
        if result.error is None:
            try:
                sink.write({"index": i, "line": lines[i], **result.to_json()})
                return
            except Exception as e:  # noqa: BLE001 - this result alone is lost; the batch goes on
                result.state.error = RuntimeError(f"its result could not be saved: {_error_text(e)}")
                err.print(f"treegen: input {where[i]} (index {i}) failed: {_error_text(result.error)}",
                          markup=False, highlight=False, soft_wrap=True)
        # a failed program: what identifies it, and why (its variables may be missing or unfinished)
        sink.write({"index": i, "line": lines[i], "program": prog.path, "seed": result.seed,
                    "parameters": _clean(result.values), "error": _error_text(result.error)})

    def work() -> None:
        engine = load()
        clock["start"] = time.perf_counter()
        prog.run_batch(engine, inputs, seed=args.seed, watch=watch, on_programs=watch.programs, on_result=on_result,
                       describe=lambda i: f"{i} (input {where[i]})", max_program_tokens=_token_limit(args))

    failure = None
    try:
        watch.run(work, err, enabled=not args.no_progress)
    except ProgramError as e:
        failure = e
        if args.traceback or os.environ.get("TREEGEN_TRACEBACK"):
            traceback.print_exc()
    except KeyboardInterrupt:  # BatchInterrupted, or Ctrl-C while loading the model
        if sink is not None:
            sink.close()
        total = len(lines)  # (inputs read so far: standard input's may not all have come)
        done = len(results)
        failed = sum(r.error is not None for r in results.values())
        what = f"{done} of {total} programs had finished" + (f" ({failed} failed)" if failed else "")
        if sink is not None and done:
            what += f"; their results {sink.saved}"
        elif not done:
            what = f"no program of {total} had finished"
        print(f"treegen: interrupted: {what}", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if sink is not None:
            sink.close()
    seconds = time.perf_counter() - clock.get("start", time.perf_counter())
    total = len(lines)
    failed = sorted(i for i, r in results.items() if r.error is not None)
    if args.json != "-":
        for i in range(total):
            out.rule(f"input {i + 1} of {total} ({where[i]})")
            r = results.get(i)
            if r is None or r.error is not None:
                out.print(f"failed: {_error_text(r.error) if r is not None else 'no result'}",
                          style="red", markup=False, highlight=False)
            else:
                out.print(result_view(r, args.max_children))
        trees = list({id(r.state.tree): r.state.tree for r in results.values()}.values())
        tokens = sum(len(d["tokens"]) for tree in trees for _, d in tree.graph.nodes(data=True))
        held_in = "the tree" if len(trees) <= 1 else "the programs' trees (data-parallel replicas)"
        err.print(f"[dim]{total} programs ran in {seconds:.1f} s as one workload · {tokens} tokens in {held_in}"
                  + (f" · wrote {args.json}" if sink is not None and sink.error is None else "") + "[/]",
                  highlight=False)
    status = EXIT_OK
    if sink is not None and sink.error is not None:
        print(f"treegen: error: --json {args.json}: {sink.error.strerror or sink.error}", file=sys.stderr)
        status = EXIT_FAILURE
    if failure is not None and (not failed or isinstance(failure, InputsFailed)):
        # (every failed program is reported through on_result; reading the inputs failing is not a program's error)
        print(f"treegen: error: {failure if not failed else f'reading the inputs: {failure.error}'}", file=sys.stderr)
        status = EXIT_FAILURE
    if failed:
        names = ", ".join(f"{where[i]} (index {i})" for i in failed[:5]) + (", ..." if len(failed) > 5 else "")
        saved = f"; their results {sink.saved}" if sink is not None and sink.error is None else ""
        print(f"treegen: error: {len(failed)} of {total} programs failed: {names}; "
              f"the other {total - len(failed)} finished{saved}", file=sys.stderr)
        status = EXIT_FAILURE
    return status


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:  # noqa: BLE001 - cosmetic only
        pass


# entry point ----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (argparse exits with 2 on usage errors)."""
    args = _parser().parse_args(argv)
    from treegen.lang.tg import TgError
    from treegen.runtime.distributed import DistributedError
    from treegen.runtime.model_config import ModelNotFoundError, UnsupportedModelError
    from treegen.runtime.shard import TensorParallelError

    try:
        return args.func(args)
    except TgError as e:
        print(e, file=sys.stderr)
        return EXIT_USAGE
    except (ModelNotFoundError, UnsupportedModelError, TensorParallelError, DistributedError) as e:
        print(f"treegen: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # e.g. --json into a missing folder
        print(f"treegen: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("treegen: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - a failure while running, reported without a traceback
        if args.traceback or os.environ.get("TREEGEN_TRACEBACK"):
            traceback.print_exc()
        print(f"treegen: error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILURE


def run_cli() -> None:
    """Console-script entry point."""
    sys.exit(main())


if __name__ == "__main__":
    run_cli()
