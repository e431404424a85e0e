"""Accuracy of sparse window attention (ALISA SWA, issue 19) against dense attention and a recent-window baseline.

Model: the embedded SmolLM2-135M-Instruct, fp32 on the CPU by default, or ``--model`` (a local checkpoint or a
hub id: the paper's comparison is with 6.7B-33B models; ``--device cuda --dtype bfloat16`` on a GPU). Every method runs on the same loaded weights.

Methods, at each keep ratio r (``--ratios``, default 0.1 0.2 0.3 0.4 0.5):

* ``swa``: treegen's SWA (:mod:`treegen.runtime.swa`) — every ``--every`` steps the branch's own KV is
  compacted to ``ceil(r * n)`` of its ``n`` tokens: the most recent half plus the earlier tokens with the
  largest attention weight over the last ``--history`` steps (ALISA Algorithm 1), chosen by each layer and
  KV head on its own weights;
* ``swa_shared`` (``--methods``): the same rule with one kept set for every layer and head, ranked by the
  weight summed over them (the runtime's choice before 2026-11-26);
* ``window``: the plain recent-window baseline (Longformer's local attention, ALISA's comparison) —
  the same schedule and the same number of kept tokens, all of them the most recent;
* ``dense``: exact attention (the reference).

The compactions run through the runtime's own pieces (``TreeRun.plan_rows`` with its compacted-segment
positions, :class:`~treegen.runtime.swa.QueryRecorder`, :func:`~treegen.runtime.swa.own_attention`,
:func:`~treegen.runtime.swa.alisa_select`, :meth:`KVStore.keep`), one token per forward pass, so the
cache really is sparse while the sequence grows. Between compactions a branch holds up to ``--every``
more tokens than its budget; the JSON gives each run's mean held fraction of the own tokens.

Measured:

1. **Perplexity on the fixed text** (``benchmarks/data/persuasion_ch1.txt``, see its README): its first
   ``--text-seqs`` x ``--text-tokens`` tokens as that many sequences, teacher-forced token by token. Each
   sequence's first ``--sink`` tokens are a dense root node (a shared prompt: shared nodes stay dense);
   the rest is the branch's own leaf, which SWA sparsifies.
2. **Perplexity on long generations**: ``--gen-seqs`` prompts of ``--prompt-tokens`` text tokens (dense
   root), each continued by the model itself, dense, sampled at temperature ``--temperature``
   (``--gen-tokens`` tokens, EOS ignored); the continuation is then teacher-forced under every method.
3. **Greedy agreement with dense** through the engine itself (``gen(kv_keep=r)`` in decode phases, CUDA
   graphs on a GPU): the same prompts, ``--greedy-tokens`` greedy tokens; tokens until the first
   divergence from the dense generation.

ALISA's comparison point: Figure 8 of the paper (OPT / LLaMA / Pythia 6.7B-33B, input length 2048), which
gives no table; the text states that at 80% KV sparsity (keep 0.2) SWA stays within "less than 5% drop for
most tasks" and about 3% perplexity increase on Alpaca, while local (recent-window) attention degrades
sharply already at 20% sparsity. A 135M model is far less sparse in its attention than those (the paper:
larger models are sparser), so larger increases are expected here; the comparison that transfers is SWA
against the window baseline at the same ratio.

The committed ``results/alisa_swa_accuracy_cpu.json`` (and ``.png``) came from (3 min on 2 cores):

    HF_HUB_OFFLINE=1 python benchmarks/swa_accuracy.py --threads 2 --text-seqs 3 --gen-seqs 3 \
        --gen-tokens 320 --text-tokens 325 --greedy-tokens 192 --ratios 0.1 0.2 0.3 0.5 --methods swa window
    options: --methods swa swa_shared window  --no-greedy  --every 32 --history 8  --device cuda --dtype bfloat16  --out PATH  --no-plot

Every sequence (text and generation) steps together in one tree run, so ``--text-tokens`` must be
``--sink + 1 + --gen-tokens``. Between compactions a branch holds up to ``--every`` tokens more than its
budget, so with sequences this short the held fraction (``mean_held_fraction``) is well above the keep
ratio (0.45 at keep 0.3); on long generations it approaches it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from kv_quant_accuracy import DTYPES, TEXT, device_slug, until_divergence  # noqa: E402
from plotting import pyplot, save  # noqa: E402

from treegen.runtime import swa  # noqa: E402
from treegen.runtime.engine import Engine, GenRequest  # noqa: E402
from treegen.runtime.loader import load_model  # noqa: E402
from treegen.runtime.sampler import SamplingParams  # noqa: E402


def head_select(importance, written: int, tokens: int, keep: float) -> torch.Tensor:
    """The runtime's SWA, choosing per layer and KV head (H2O's granularity): ALISA's rule on each one's own
    attention weights (``own_attention(per_head=True)``, ``[layers, kv_heads, written]``), kept sets
    ``[layers, kv_heads, m]``."""
    return swa.alisa_select(importance, written, tokens, keep)


def shared_select(importance, written: int, tokens: int, keep: float) -> torch.Tensor:
    """One kept set for all layers and heads, from the weight summed over them (``[written]``)."""
    return swa.alisa_select(importance, written, tokens, keep)


def recent_select(importance, written: int, tokens: int, keep: float) -> torch.Tensor:
    """The recent-window baseline: the last ``kept_count(keep, tokens)`` slots."""
    m = swa.kept_count(keep, tokens)
    return torch.arange(max(0, written - m), written, device=importance.device)


def teacher_forced(engine: Engine, prompts: list[list[int]], continuations: list[list[int]], methods: list,
                   every: int, history: int) -> list[list[dict]]:
    """Per method, per sequence: the NLL of every continuation token given its prompt (a dense root, shared
    by every method's branch of that sequence) and the continuation before it (the branch's own leaf,
    compacted every ``every`` steps under a method with a keep ratio). ``methods``: ``(keep, select)``
    pairs (keep None: dense). All branches of all methods step together in one tree run, one token each
    per forward pass."""
    run = engine.start()
    tree, kv, model = run.tree, run.kv, run.model
    roots = [tree.add_node(None, p[:-1]) for p in prompts]
    run.prefill(roots)
    leaves = [[tree.add_node(root) for root in roots] for _ in methods]
    flat = [leaf for per in leaves for leaf in per]
    feed = [[p[-1]] + c[:-1] for p, c in zip(prompts, continuations)] * len(methods)  # token fed at each step
    targets = torch.tensor([c for c in continuations] * len(methods), device=model.device)  # [rows, steps]
    steps = targets.shape[1]
    sparse = [j for j, (keep, _) in enumerate(methods) for _ in prompts if keep is not None]
    rows_sparse = [i for i, (keep, _) in enumerate((m for m in methods for _ in prompts)) if keep is not None]
    recorder = swa.QueryRecorder(num_layers=model.num_layers, rows=rows_sparse, history=history,
                                 num_heads=model.num_heads, head_dim=model.head_dim, dtype=model.dtype,
                                 device=model.device)
    nll = torch.zeros(len(flat), dtype=torch.float64)
    held = torch.zeros(len(flat), dtype=torch.float64)
    since = 0
    for t in range(steps):
        for leaf, f in zip(flat, feed):
            tree.extend(leaf, [f[t]])
        input_ids, slots, plan = run.plan_rows([(leaf, len(tree.tokens(leaf)) - 1) for leaf in flat])
        logits = model.forward(input_ids, plan.query_pos, run.attend_fn(plan, slots, recorder))
        nll -= logits.double().log_softmax(-1).gather(1, targets[:, t: t + 1]).squeeze(1).cpu()
        held += torch.tensor([kv.segments[leaf].computed / kv.computed(leaf) for leaf in flat], dtype=torch.float64)
        recorder.advance()
        since += 1
        if since == every or t == steps - 1:
            ring, taken = recorder.steps(since, since)
            nodes = [flat[i] for i in rows_sparse]
            base = [tree.position(n) + len(tree.tokens(n)) - since for n in nodes]
            queries = [recorder.q[:, ring, c] for c in range(len(nodes))]
            select = {i: methods[j] for i, j in zip(rows_sparse, sparse)}
            weights = {}
            for chooser, per_head in ((shared_select, False), (head_select, True)):
                need = [c for c, i in enumerate(rows_sparse) if select[i][1] is chooser]
                weights.update(zip(need, swa.own_attention(kv, tree, model, [nodes[c] for c in need],
                                                           [queries[c] for c in need],
                                                           [[base[c] + s for s in taken] for c in need],
                                                           per_head=per_head)))
            for c, (i, n) in enumerate(zip(rows_sparse, nodes)):
                seg, (keep, sel) = kv.segments[n], select[i]
                w = weights.get(c, torch.zeros(seg.computed, device=kv.device))
                kv.keep(n, sel(w, seg.computed, seg.tokens, keep))
            since = 0
            recorder.slot.zero_()
        if (t + 1) % 64 == 0:
            print(f"  step {t + 1}/{steps}", flush=True)
    out = []
    for j in range(len(methods)):
        per = []
        for b in range(len(prompts)):
            i = j * len(prompts) + b
            per.append({"nll": nll[i].item(), "positions": steps, "held": held[i].item() / steps})
        out.append(per)
    return out


def summarise(per: list[dict]) -> dict:
    positions = sum(p["positions"] for p in per)
    nll = sum(p["nll"] for p in per)
    return {"positions": positions, "mean_nll": nll / positions, "perplexity": math.exp(nll / positions),
            "mean_held_fraction": statistics.fmean(p["held"] for p in per)}


def generate(engine: Engine, prompts, tokens: int, temperature: float, keeps: list) -> list[list[tuple[int, ...]]]:
    """Per keep ratio in ``keeps`` (None: dense), the generation after every prompt; all in one tree run
    (the prompts are shared roots), through the engine's own decode phases."""
    run = engine.start()
    roots = [run.tree.add_node(None, p) for p in prompts]
    reqs = []
    for j, keep in enumerate(keeps):
        params = SamplingParams(max_tokens=tokens, temperature=temperature, ignore_eos=True, kv_keep=keep)
        reqs += [GenRequest(run.tree.add_node(root), params, key=1000 + i, final=True) for i, root in enumerate(roots)]
    results, _ = run.execute(reqs, [])
    return [[r.tokens for r in results[j * len(prompts): (j + 1) * len(prompts)]] for j in range(len(keeps))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="a local checkpoint directory or hub id (default: the embedded SmolLM2-135M-Instruct) — "
                             "ALISA's comparison is with 6.7B-33B models; --device cuda --dtype bfloat16 for those")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--ratios", type=float, nargs="*", default=[0.1, 0.2, 0.3, 0.5])
    parser.add_argument("--text-seqs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--text-tokens", type=int, default=389, help="tokens per text sequence (sink included)")
    parser.add_argument("--sink", type=int, default=4, help="dense root tokens of each text sequence")
    parser.add_argument("--gen-seqs", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--gen-tokens", type=int, default=384)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--greedy-tokens", type=int, default=256)
    parser.add_argument("--every", type=int, default=swa.DEFAULT_EVERY)
    parser.add_argument("--history", type=int, default=swa.DEFAULT_HISTORY)
    parser.add_argument("--methods", nargs="+", default=["swa", "window"], choices=["swa", "swa_shared", "window"],
                        help="sparse methods to compare with dense (swa_shared: one kept set for all layers and heads)")
    parser.add_argument("--no-greedy", action="store_true", help="skip the greedy-agreement generations")
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    t_all = time.perf_counter()
    model, tokenizer = load_model(args.model, dtype=DTYPES[args.dtype], device=args.device)
    model_name = args.model or "SmolLM2-135M-Instruct (embedded)"
    device = model.device
    engine = Engine(model, tokenizer, kv_keep_every=args.every, kv_keep_history=args.history)
    ids = tokenizer(TEXT.read_text(encoding="utf-8"), add_special_tokens=False).input_ids
    need = args.text_seqs * args.text_tokens
    if need > len(ids):
        parser.error(f"--text-seqs x --text-tokens = {need} exceeds the text's {len(ids)} tokens")
    stride = len(ids) // args.text_seqs  # sequences spread over the text
    text_seqs = [ids[i * stride: i * stride + args.text_tokens] for i in range(args.text_seqs)]
    if args.text_tokens - args.sink - 1 != args.gen_tokens:
        parser.error("all sequences step together: --text-tokens must be --sink + 1 + --gen-tokens")
    text_prompts = [s[: args.sink + 1] for s in text_seqs]  # the root is sink tokens; the last is fed first
    text_conts = [s[args.sink + 1:] for s in text_seqs]
    gap = (len(ids) - args.prompt_tokens) // max(1, args.gen_seqs)
    gen_prompts = [ids[i * gap: i * gap + args.prompt_tokens] for i in range(args.gen_seqs)]
    print(f"model {model_name} ({args.dtype}) on {device}; text {args.text_seqs} x {args.text_tokens} "
          f"tokens; generations {args.gen_seqs} x {args.gen_tokens} (prompt {args.prompt_tokens}); "
          f"every {args.every}, history {args.history}", flush=True)

    rows = []
    with torch.no_grad():
        start = time.perf_counter()
        gens = [list(g) for g in generate(engine, gen_prompts, args.gen_tokens, args.temperature, [None])[0]]
        print(f"sampled the continuations in {time.perf_counter() - start:.1f} s", flush=True)
        start = time.perf_counter()
        greedy = None if args.no_greedy else generate(engine, gen_prompts, args.greedy_tokens, 0.0, [None, *args.ratios])
        greedy_seconds = time.perf_counter() - start
        print(f"greedy generations in {greedy_seconds:.1f} s", flush=True)
        choosers = {"swa": head_select, "swa_shared": shared_select, "window": recent_select}
        methods = [("dense", None, None)] + [(name, r, choosers[name]) for r in args.ratios for name in args.methods]
        start = time.perf_counter()
        per = teacher_forced(engine, text_prompts + gen_prompts, text_conts + gens,
                             [(r, sel) for _, r, sel in methods], args.every, args.history)
        tf_seconds = time.perf_counter() - start
        print(f"teacher-forced in {tf_seconds:.1f} s", flush=True)
        nt = len(text_prompts)
        for (name, r, _), results in zip(methods, per):
            rows.append({"method": name, "kv_keep": r, "text": summarise(results[:nt]),
                         "generations": summarise(results[nt:])})
        ref = rows[0]
        for row in rows[1:]:
            for part in ("text", "generations"):
                row[part]["ppl_delta_pct"] = 100 * (row[part]["perplexity"] / ref[part]["perplexity"] - 1)
        for r, out in zip(args.ratios, greedy[1:] if greedy is not None and "swa" in args.methods else []):
            agree = [until_divergence(a, b) for a, b in zip(out, greedy[0])]
            row = next(x for x in rows if x["method"] == "swa" and x["kv_keep"] == r)
            row["greedy"] = {"prompts": len(agree), "new_tokens": args.greedy_tokens,
                             "tokens_until_divergence_mean": statistics.fmean(agree),
                             "tokens_until_divergence_min": min(agree),
                             "fraction_identical": sum(a == args.greedy_tokens for a in agree) / len(agree),
                             "token_agreement": statistics.fmean(
                                 sum(x == y for x, y in zip(a, b)) / len(b) for a, b in zip(out, greedy[0])),
                             "per_prompt": agree}

    print("\n| method | kv_keep | held (text) | text ppl | Δ | generations ppl | Δ | greedy until divergence "
          "(mean / min of " f"{args.greedy_tokens}) | token agreement |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t, g = r["text"], r["generations"]
        d1 = f"{t['ppl_delta_pct']:+.2f}%" if "ppl_delta_pct" in t else "—"
        d2 = f"{g['ppl_delta_pct']:+.2f}%" if "ppl_delta_pct" in g else "—"
        gr = r.get("greedy")
        gs = f"{gr['tokens_until_divergence_mean']:.1f} / {gr['tokens_until_divergence_min']}" if gr else "—"
        ga = f"{100 * gr['token_agreement']:.1f}%" if gr else "—"
        print(f"| {r['method']} | {r['kv_keep'] if r['kv_keep'] is not None else '—'} | "
              f"{t['mean_held_fraction']:.2f} | {t['perplexity']:.3f} | {d1} | {g['perplexity']:.3f} | {d2} | {gs} | {ga} |")

    device_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    result = {
        "benchmark": "alisa_swa_accuracy",
        "device": device_name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "torch_threads": torch.get_num_threads(),
        "model": model_name, "dtype": args.dtype,
        "text": {"file": str(TEXT.relative_to(HERE.parent)), "sequences": args.text_seqs,
                 "tokens_per_sequence": args.text_tokens, "dense_root_tokens": args.sink},
        "generations": {"sequences": args.gen_seqs, "prompt_tokens": args.prompt_tokens, "tokens": args.gen_tokens,
                        "temperature": args.temperature, "greedy_tokens": args.greedy_tokens},
        "method": {"every": args.every, "history": args.history,
                   "selection": "ALISA Algorithm 1: ceil(r*n) kept, ceil/2 most recent + the rest by attention "
                                "weight summed over the last `history` steps, each layer and KV head its own set "
                                "(its weights summed over its group's query heads)",
                   "swa_shared": "the same rule, one kept set for all layers and heads (weights summed over them)",
                   "baseline": "recent window: the same count and schedule, most recent tokens only"},
        "paper_reference": "ALISA Figure 8 / section VI-C: at 80% KV sparsity (keep 0.2) SWA within <5% drop for "
                           "most tasks, ~3% perplexity increase on Alpaca (OPT/LLaMA/Pythia 6.7B-33B, length 2048); "
                           "local attention degrades sharply from 20% sparsity",
        "rows": rows,
        "seconds": {"teacher_forced": round(tf_seconds, 1), "greedy": round(greedy_seconds, 1),
                    "total": round(time.perf_counter() - t_all, 1)},
    }
    slug = "" if args.model is None else "_" + Path(str(args.model)).name.lower()  # (a checkpoint's own file)
    out = Path(args.out) if args.out else HERE / "results" / f"alisa_swa_accuracy{slug}_{device_slug(device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    plt = None if args.no_plot else pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, part, title in ((axes[0], "text", "fixed text"), (axes[1], "generations", "long generations")):
            for name, style, label in (("swa", "o-", "SWA (per layer and head)"),
                                       ("swa_shared", "^-", "SWA (one set for all layers)"),
                                       ("window", "s--", "recent window")):
                pts = [(r["kv_keep"], r[part]["ppl_delta_pct"]) for r in rows if r["method"] == name]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
            ax.axhline(0, color="grey", lw=0.8)
            ax.set_xlabel("kv_keep (fraction of the branch's own KV kept)")
            ax.set_ylabel("perplexity increase over dense (%)")
            ax.set_yscale("symlog", linthresh=1)
            ax.set_title(f"{model_name}, {title}")
            ax.legend()
        save(fig, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
