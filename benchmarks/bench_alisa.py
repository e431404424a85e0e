"""Long generations past the KV budget (issue 19): dense with grouping, offload, recompute, SWA — each
against dense with an unlimited budget in the same run.

Random weights of a real model shape (speed does not depend on the weights), bf16, EOS ignored so every
gen makes exactly its ``max_tokens``; token ids are their own text (``IdTokenizer``). The workload:

* **follow-up** (branches that continue): a shared prompt (2K tokens), ``branches`` branches below it,
  each generating ``new_tokens`` (gen ``a``, *not final*: its KV is read again), then appending one
  token and generating ``follow_up`` more that read its answer (gen ``b``, final). Live KV at the end
  of the first gens is prompt + branches x new_tokens — the *dense need*;
* **final** (today's grouping can run it): the same tokens as one final gen per branch.

Modes, each under a KV budget of ``budget_fraction`` (default a third) of the dense need measured by
the unlimited run (``Engine(kv_budget_bytes=...)``):

* ``dense-unlimited`` — the baseline: every ratio is to its tokens/s (follow-up workload, no budget);
* ``dense-grouping`` — today's behaviour (``offload="off"``): the final workload in memory groups,
  and the follow-up workload, which it refuses (recorded with the error);
* ``offload`` — ``offload="host"``: idle branches' KV to pinned host memory and back;
* ``auto`` — ``offload="auto"``: host or recompute per node from the measured rates (recorded);
* ``recompute`` — ``offload="recompute"``: idle KV dropped and prefilled again;
* ``swa`` — sparse window attention (``kv_keep``, built beside this work): run when ``SamplingParams``
  or ``GenRequest`` has a ``kv_keep`` field, else skipped with a message;
* ``swa-int8`` — the same over an INT8 KV cache (``Engine(kv_dtype="int8")``; ALISA's third part): half
  the bytes a token, so the same budget holds twice the tokens.

tokens/s = generated tokens / wall time (prefill, transfers and recompute included), after a warm-up
(kernels compiled, offload rates measured). The offload modes' engines pin their host memory when made
(``--host-reserve``, default what the run may offload: vLLM's swap space), outside the timed run; rows give
that time (``host_reserve_s``) and the ratio with it counted (``ratio_with_host_reserve``). ``tokens_identical`` compares every branch's tokens with
the unlimited run's (bf16 kernels are not batch-invariant, so a greedy near-tie may flip under a
different batch composition; the fp32 GPU test checks exact equality). JSON after every case:
``benchmarks/results/alisa_<shape>.json``.

    python benchmarks/bench_alisa.py --shape llama3-8b                       # 64 branches x 2,048
    python benchmarks/bench_alisa.py --shape llama3-8b --branches 64 128 --new-tokens 4096
    python benchmarks/bench_alisa.py --tiny --out /tmp/alisa_tiny.json       # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch
import transformers

from treegen.runtime import scheduler
from treegen.runtime.engine import Engine, GenRequest
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.model import LlamaFamilyModel
from treegen.runtime.offload import default_host_bytes
from treegen.runtime.sampler import SamplingParams
from bench_end_to_end import SHAPES, config_of  # benchmarks/
from plotting import pyplot, save

MODES = ("dense-unlimited", "dense-grouping", "offload", "auto", "recompute", "swa", "swa-int8")
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=8192)


def swa_field() -> str | None:
    """Where the sparse-window option lives, if this build has it: "params", "request" or None."""
    if "kv_keep" in {f.name for f in dataclasses.fields(SamplingParams)}:
        return "params"
    if "kv_keep" in {f.name for f in dataclasses.fields(GenRequest)}:
        return "request"
    return None


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def workload(engine: Engine, *, prompt: list[int], branches: int, new: int, follow_up: int, final_only: bool,
             kv_keep: float | None = None) -> tuple[dict, object]:
    """Run one workload to its end; returns (per branch → its tokens, the run)."""
    run = engine.start()
    root = run.tree.add_node(None, prompt)
    leaves = [run.tree.add_node(root) for _ in range(branches)]
    out: dict[int, list[int]] = {}
    where = swa_field() if kv_keep is not None else None

    def request(leaf: int, max_tokens: int, key: int, final: bool) -> GenRequest:
        extra = {"kv_keep": kv_keep} if where == "params" else {}
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)
        return GenRequest(leaf, params, key=key, final=final, **({"kv_keep": kv_keep} if where == "request" else {}))

    def second(i: int, leaf: int):
        def on_done(job) -> None:
            if job.error is not None:
                errors.append(job.error)
                return
            out[i] = list(job.result.tokens)
            run.tree.extend(leaf, [7])  # the follow-up reads the answer: one more token, then gen b
            run.submit(request(leaf, follow_up, key=10_000 + i, final=True),
                       on_done=lambda j: out.__setitem__(i, out[i] + list(j.result.tokens)) if j.error is None
                       else errors.append(j.error))
        return on_done

    errors: list[BaseException] = []
    for i, leaf in enumerate(leaves):
        if final_only:
            run.submit(request(leaf, new + follow_up, key=i, final=True),
                       on_done=lambda j, i=i: out.__setitem__(i, list(j.result.tokens)) if j.error is None
                       else errors.append(j.error))
        else:
            run.submit(request(leaf, new, key=i, final=False), on_done=second(i, leaf))
    while run.busy() and not errors and run.advance():
        pass
    if errors:
        raise errors[0]
    return out, run


def host_reserve(args, offload: str, need: int, budget: int | None) -> int:
    """Bytes of host memory the engine pins when made (``Engine(host_reserve_bytes=)``): ``--host-reserve`` GiB,
    or with ``auto`` the dense need (the workload's whole KV: a run never holds more on the host; the dense
    need less the budget is not enough — evictions free more than the last slot needs, and spans do not cross
    chunks), at most the host cap; none without a budget or offload to the host."""
    if budget is None or offload not in ("host", "auto"):
        return 0
    want = need if args.host_reserve == "auto" else int(float(args.host_reserve) * 2**30)
    return min(want, args.offload_bytes if args.offload_bytes is not None else default_host_bytes())


def measure(model, args, mode: str, branches: int, new: int, prompt: list[int], budget: int | None,
            reference: dict | None, slice_tokens: int | None = scheduler.SLICE_TOKENS, need: int = 0) -> dict:
    device = model.device
    offload = {"dense-unlimited": "off", "dense-grouping": "off", "offload": "host", "auto": "auto",
               "recompute": "recompute", "swa": "auto", "swa-int8": "auto"}[mode]
    reserve = host_reserve(args, offload, need, budget)
    engine = Engine(model, IdTokenizer(), kv_budget_bytes=budget, offload=offload, slice_tokens=slice_tokens,
                    host_reserve_bytes=reserve, **({"kv_dtype": "int8"} if mode == "swa-int8" else {}),
                    **({"offload_bytes": args.offload_bytes} if args.offload_bytes is not None else {}))
    kv_keep = args.kv_keep if mode in ("swa", "swa-int8") else None
    row = {"mode": mode, "branches": branches, "new_tokens": new, "follow_up": args.follow_up, "prompt": len(prompt),
           "budget_fraction": None if budget is None else args.budget_fraction, "budget_bytes": budget,
           "offload": offload, "kv_dtype": "int8" if mode == "swa-int8" else None,
           # host memory pinned when the engine was made (start-up, outside the timed run; see tok_s_with_host_reserve)
           "host_reserve_bytes": reserve, "host_reserve_s": engine.host_reserve_seconds}
    if kv_keep is not None:
        row["kv_keep"] = kv_keep
    # warm-up: compile this shape's kernels (a small batch), and measure the offload rates once
    workload(engine, prompt=prompt, branches=min(branches, 8), new=8, follow_up=2, final_only=False, kv_keep=kv_keep)
    if offload == "auto":
        row["rates"] = dataclasses.asdict(engine.offload_rates)
    cases = [("final", True), ("follow-up", False)] if mode == "dense-grouping" else [("follow-up", False)]
    rows = []
    for name, final_only in cases:
        r = dict(row, workload=name)
        gc.collect()
        sync(device)
        start = time.perf_counter()
        try:
            out, run = workload(engine, prompt=prompt, branches=branches, new=new, follow_up=args.follow_up,
                                final_only=final_only, kv_keep=kv_keep)
        except MemoryError as e:
            r.update(tok_s=None, ratio_to_dense_unlimited=None, refused=str(e))
            rows.append(r)
            continue
        sync(device)
        elapsed = time.perf_counter() - start
        made = sum(len(t) for t in out.values())
        assert made == branches * (new + args.follow_up), (made, branches, new)
        r.update(seconds=elapsed, tokens=made, tok_s=made / elapsed,
                 tok_s_with_host_reserve=made / (elapsed + engine.host_reserve_seconds),
                 peak_kv_bytes=run.scheduler.peak_slots * run.kv.bytes_per_token,
                 memory_waits=run.scheduler.memory_waits, decode_phases=len(run.decode_phases),
                 forward_passes=run.forward_passes, mixed_steps=run.mixed_steps, **run.offload_stats,
                 # the engine's host time by part (s): SWA's compactions ("swa") and the phases' graph
                 # captures ("capture") are what sparse window attention adds; phases captured / replaying kept graphs
                 engine_host_s={k: round(v, 3) for k, v in run.host_seconds.items()},
                 phases_captured=run.decoder.captured_phases, phases_replaying_kept=run.decoder.kept_phases,
                 swa_compactions=run.swa_compactions, slice_tokens=engine.slice_tokens, pauses=run.decoder.pauses)
        if reference is not None and not final_only:  # (the final workload's tokens differ by design)
            r["tokens_identical"] = sum(out[i] == reference[i] for i in out) / len(out)
        elif reference is None:
            r["_out"] = out
        rows.append(r)
        del run
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model (CPU smoke test; small defaults)")
    parser.add_argument("--branches", type=int, nargs="+", default=None, help="default 64 (tiny: 8)")
    parser.add_argument("--new-tokens", type=int, nargs="+", default=None, help="default 2048 (tiny: 48)")
    parser.add_argument("--prompt", type=int, default=None, help="shared prompt tokens (default 2048; tiny: 64)")
    parser.add_argument("--follow-up", type=int, default=None, help="tokens of each follow-up gen (default 16; tiny 4)")
    parser.add_argument("--budget-fraction", type=float, default=1 / 3)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--kv-keep", type=float, default=0.3, help="swa mode's caching ratio")
    parser.add_argument("--offload-bytes", type=int, default=None, help="host memory cap for offloaded KV")
    parser.add_argument("--slice-tokens", type=int, nargs="+", default=[scheduler.SLICE_TOKENS],
                        help="Engine(slice_tokens=) for the offload modes (one run each; 0: whole reservations, "
                             "nothing sliced)")
    parser.add_argument("--host-reserve", default="auto",
                        help="GiB of host memory the offload modes' engines pin when made (Engine(host_reserve_bytes=), "
                             "outside the timed run; rows also give the ratio with it counted); auto: the dense need; "
                             "0: none (the runs pin as they offload)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    tiny = args.tiny
    args.branches = args.branches or ([8] if tiny else [64])
    args.new_tokens = args.new_tokens or ([48] if tiny else [2048])
    args.prompt = args.prompt or (64 if tiny else 2048)
    args.follow_up = args.follow_up or (4 if tiny else 16)
    shape = "tiny" if tiny else args.shape
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    if tiny:
        model = LlamaFamilyModel.random(transformers.LlamaConfig(**TINY), dtype=torch.float32, device=device)
    else:
        model = LlamaFamilyModel.random(config_of(shape), dtype=torch.bfloat16, device=device)
    if {"swa", "swa-int8"} & set(args.modes) and swa_field() is None:
        print("swa: skipped — this build has no kv_keep option (SamplingParams / GenRequest); it comes with the "
              "sparse-window-attention work of issue 19")
        args.modes = [m for m in args.modes if m not in ("swa", "swa-int8")]
    prompt = torch.randint(1, model.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    rows: list[dict] = []
    for branches in args.branches:
        for new in args.new_tokens:
            print(f"{time.strftime('%H:%M:%S')} {branches} branches x {new} new tokens, dense unlimited", flush=True)
            (base,) = measure(model, args, "dense-unlimited", branches, new, prompt, None, None)
            if "_out" not in base:  # refused: no baseline for this size (the row says why)
                rows.append(base)
                print(f"dense-unlimited refused {branches} x {new}: {base['refused']}", flush=True)
                write(args, shape, rows)
                continue
            reference = base.pop("_out")
            base.update(ratio_to_dense_unlimited=1.0, tokens_identical=1.0)
            need = base["peak_kv_bytes"]
            base["dense_need_bytes"] = need
            rows.append(base)
            print(json.dumps(base), flush=True)
            write(args, shape, rows)
            budget = int(need * args.budget_fraction)
            for mode in args.modes:
                if mode == "dense-unlimited":
                    continue
                for slice_tokens in args.slice_tokens if mode in ("offload", "auto", "recompute") else [None]:
                    # (the engine's option: 0 is None, whole reservations; modes without offload keep the default)
                    engine_slices = scheduler.SLICE_TOKENS if slice_tokens is None else slice_tokens or None
                    print(f"{time.strftime('%H:%M:%S')} {mode}, budget {budget / 2**30:.2f} GiB"
                          + (f", slices of {slice_tokens}" if slice_tokens is not None else ""), flush=True)
                    for r in measure(model, args, mode, branches, new, prompt, budget, reference, engine_slices,
                                     need=need):
                        r["dense_need_bytes"] = need
                        if r.get("tok_s") is not None:
                            r["ratio_to_dense_unlimited"] = r["tok_s"] / base["tok_s"]
                            r["ratio_with_host_reserve"] = r["tok_s_with_host_reserve"] / base["tok_s"]
                        rows.append(r)
                        print(json.dumps(r), flush=True)
                        write(args, shape, rows)  # after every case: a run cut short keeps what it measured
    print(f"\n## {shape}, {'fp32' if tiny else 'bf16'} — long generations under a KV budget of "
          f"{args.budget_fraction:.2f} of the dense need\n")
    print("| mode | workload | branches | new tokens | tok/s | ratio to dense unlimited | identical | GiB offloaded | "
          "tokens recomputed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tok = "refused" if r.get("tok_s") is None else f"{r['tok_s']:,.0f}"
        ratio = "-" if r.get("ratio_to_dense_unlimited") is None else f"{r['ratio_to_dense_unlimited']:.2f}"
        same = "-" if r.get("tokens_identical") is None else f"{r['tokens_identical']:.2f}"
        print(f"| {r['mode']} | {r['workload']} | {r['branches']} | {r['new_tokens']} | {tok} | {ratio} | {same} | "
              f"{r.get('bytes_offloaded', 0) / 2**30:.2f} | {r.get('tokens_recomputed', 0)} |")
    out = write(args, shape, rows)
    plot(rows, out.with_suffix(".png"), f"{shape}, budget {args.budget_fraction:.2f} of the dense need, "
                                        f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}")


def _label(r: dict) -> str:
    """A row's bar: its mode and workload, and an offload mode's slice size."""
    slices = r.get("slice_tokens") if r["mode"] in ("offload", "auto", "recompute") else None
    return f"{r['mode']}\n({r['workload']}" + (f", slices {slices})" if slices else ")")


def plot(rows: list[dict], out: Path, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    cases = sorted({(r["branches"], r["new_tokens"]) for r in rows})
    labels = [_label(r) for r in rows if r["mode"] != "dense-unlimited"]
    labels = list(dict.fromkeys(labels))
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(labels)), 4))
    width = 0.8 / max(1, len(cases))
    for k, (b, n) in enumerate(cases):
        ratios = {_label(r): r.get("ratio_to_dense_unlimited") or 0 for r in rows
                  if (r["branches"], r["new_tokens"]) == (b, n) and r["mode"] != "dense-unlimited"}
        ax.bar([i + k * width for i in range(len(labels))], [ratios.get(lab, 0) for lab in labels], width,
               label=f"{b} x {n}")
    ax.axhline(0.5, color="grey", linestyle="--", linewidth=1, label="target 0.5")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, fontsize=8)
    ax.set_ylabel("tokens/s / dense unlimited")
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    save(fig, out)


def write(args, shape: str, rows: list[dict]) -> Path:
    cuda = torch.cuda.is_available()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    result = {"benchmark": "alisa", "shape": shape, "config": TINY if args.tiny else SHAPES[shape],
              "dtype": "float32" if args.tiny else "bfloat16",
              "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "versions": {"torch": torch.__version__, "triton": triton_version,
                           "transformers": transformers.__version__, "cuda": torch.version.cuda,
                           "python": platform.python_version()},
              "method": "tokens/s = generated tokens / wall time (prefill, KV transfers and recompute included), "
                        "after a warm-up; budget = budget_fraction x the unlimited run's peak KV; same process",
              "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]}
    out = Path(args.out or Path(__file__).parent / "results" / f"alisa_{shape}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
