"""The decode step without CUDA graphs against the same step graphed (issue 17: "an eager step not
several times a graphed one"), and where an eager step's host time goes.

A decode phase replays a captured CUDA graph; steps that are not captured (mixed steps that prefill
new work beside the decoding branches, phases too short to be worth a capture, engines with
``cuda_graphs=False``) launch every kernel from Python, and at small and medium batch the GPU then
waits for the host. Measured here on treegen's runtime with random weights of a real shape, bf16,
greedy, a shared prompt and ``batch`` branches, EOS ignored:

* step time = (time(new tokens) - time(1 token)) / (new - 1), graphed and eager (``cuda_graphs``), with
  Triton kernels launched through :mod:`treegen.kernels.launch` ("fast") and through Triton's own path,
  the two interleaved over ``--repeats`` rounds (the host's speed drifts between runs); medians reported;
* the host microseconds of each piece of a forward (matrix product, fused ops, tree attention, a bare
  launch both ways), and a phase capture's cost (recording = one Python forward, instantiation, replay);
* a cProfile of an eager run: the functions with the most own time, and Triton launches per forward.

    python benchmarks/bench_eager_step.py --shape tinyllama-1.1b --batches 16 64 256 --repeats 3
    python benchmarks/bench_eager_step.py --captures-only   # A/B of two checkouts: run each in turn
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import datetime
import io
import json
import platform
import pstats
import time
from pathlib import Path

import torch
import transformers
import triton

from bench_end_to_end import config_of, timed_run  # benchmarks/
from plotting import pyplot, save
from treegen.kernels.launch import set_fast_launch
from treegen.runtime.engine import Engine
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.model import LlamaFamilyModel


def step_time(engine: Engine, batch: int, prompt: list[int], new: int) -> float:
    """Seconds per decode step (the first token's excluded)."""
    timed_run(engine, batch=batch, prompt=prompt, new=8, flat=False)  # warm-up: compile, capture
    t1, _ = timed_run(engine, batch=batch, prompt=prompt, new=1, flat=False)
    tn, _ = timed_run(engine, batch=batch, prompt=prompt, new=new, flat=False)
    return (tn - t1) / (new - 1)


def profile_eager(engine: Engine, batch: int, prompt: list[int], new: int, top: int) -> dict:
    """cProfile of one eager run: the ``top`` functions by own time, and the Triton kernels launched."""
    prof = cProfile.Profile()
    prof.enable()
    timed_run(engine, batch=batch, prompt=prompt, new=new, flat=False)
    prof.disable()
    stream = io.StringIO()
    stats = pstats.Stats(prof, stream=stream)
    stats.sort_stats("tottime").print_stats(top)
    launches = sum(calls[1] for (path, _, name), calls in stats.stats.items()  # (every kernel has a Launcher)
                   if name == "launch" and path.endswith("launch.py"))
    return {"profile": stream.getvalue(), "triton_launches": launches}


def host_costs(model, batch: int, prefix: int, calls: int = 400) -> dict:
    """Host microseconds per call of an eager forward's pieces at ``batch`` decode rows below one
    ``prefix``-token segment (the GPU keeps up: each is timed as the host's time to enqueue ``calls``)."""
    import triton.runtime.driver as driver

    from treegen.kernels import fused_ops
    from treegen.kernels.tree_attention import plan_tree_attention, tree_attention

    dev, dt = model.device, model.dtype
    hidden, nh, nkv, hd = model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim
    h = torch.randn(batch, hidden, device=dev, dtype=dt)
    y = torch.randn(batch, hidden, device=dev, dtype=dt)
    w = torch.ones(hidden, device=dev, dtype=dt)
    L = model.layers[0]
    qkv = torch.randn(batch, nh + 2 * nkv, hd, device=dev, dtype=dt)
    cos = torch.randn(batch, hd, device=dev, dtype=dt)
    slots_n = prefix + batch
    k_cache = torch.randn(slots_n, nkv, hd, device=dev, dtype=dt)
    v_cache = torch.randn(slots_n, nkv, hd, device=dev, dtype=dt)
    slots = torch.arange(prefix, prefix + batch, device=dev)
    plan = plan_tree_attention(segment_parent=[-1] + [0] * batch, segment_start=[0] + list(range(prefix, prefix + batch)),
                               segment_len=[prefix] + [1] * batch, segment_pos=[0] + [prefix] * batch,
                               query_segment=list(range(1, batch + 1)), query_pos=[prefix] * batch, device=dev,
                               backend="triton", num_heads=nh, num_kv_heads=nkv, dtype=dt)
    q = qkv[:, :nh]
    plain = dataclasses.replace(plan, triton=dataclasses.replace(plan.triton, use_tma=False))
    gate_up = torch.randn(batch, 2 * model.intermediate_size, device=dev, dtype=dt)
    kern = fused_ops._add_rms_norm_kernel
    args = (h, y, w, h, hidden, h.stride(0), y.stride(0), h.stride(0), 1e-5)
    kw = dict(HAS_Y=True, BLOCK=triton.next_power_of_2(hidden), num_warps=4)
    compiled = kern[(batch,)](*args, **kw)
    device = driver.active.get_current_device()
    binder = kern.device_caches[device][-1]
    bound, _, _ = binder(*args, **kw)
    values = list(bound.values())
    stream = driver.active.get_current_stream(device)

    def direct():
        compiled.run(batch, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *values)

    pieces = {
        "F.linear qkv": lambda: torch.nn.functional.linear(h, L.qkv_w, L.qkv_b),
        "add_rms_norm (wrapper)": lambda: fused_ops.add_rms_norm(h, y, w, 1e-5),
        "add_rms_norm kernel[grid] (JIT launch)": lambda: kern[(batch,)](*args, **kw),
        "add_rms_norm compiled.run (direct)": direct,
        "binder only (specialization)": lambda: binder(*args, **kw),
        "rope_ (wrapper, cache store)": lambda: fused_ops.rope_(qkv, cos, cos, nh, nkv, store=(k_cache, v_cache, slots)),
        "silu_mul (wrapper)": lambda: fused_ops.silu_mul(gate_up),
        "tree_attention (dispatcher)": lambda: tree_attention(q, k_cache, v_cache, plan, 0.1),
        "tree_attention, plan without TMA": lambda: tree_attention(q, k_cache, v_cache, plain, 0.1),
        "torch.empty_like": lambda: torch.empty_like(h),
    }
    out = {}
    for name, fn in pieces.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out[name] = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
        print(f"  {name:45s} {out[name]:7.1f} us", flush=True)
    return out


def capture_costs(model, batch: int, prefix: int, rounds: int = 5) -> dict:
    """Host milliseconds of one decode forward (``batch`` rows below a ``prefix``-token segment, the
    fused path writing the KV): run eagerly, recorded into a CUDA graph (the Python forward while
    capturing), the graph's instantiation (``capture_end``), and a replay (GPU time). Medians of
    ``rounds``; the graphs are captured as a phase's are (no warm-up run: kernels compiled before)."""
    import statistics

    from treegen.kernels.tree_attention import plan_tree_attention, tree_attention

    dev, dt = model.device, model.dtype
    nkv, hd = model.num_kv_heads, model.head_dim
    slots_n = prefix + batch
    k_cache = torch.zeros(model.num_layers, slots_n, nkv, hd, device=dev, dtype=dt)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(prefix, prefix + batch, device=dev)
    plan = plan_tree_attention(segment_parent=[-1] + [0] * batch, segment_start=[0] + list(range(prefix, prefix + batch)),
                               segment_len=[prefix] + [1] * batch, segment_pos=[0] + [prefix] * batch,
                               query_segment=list(range(1, batch + 1)), query_pos=[prefix] * batch, device=dev,
                               backend="triton", num_heads=model.num_heads, num_kv_heads=nkv, dtype=dt)
    ids = torch.randint(0, model.vocab_size, (batch,), device=dev)

    def attend(i, q, k, v):
        return tree_attention(q, k_cache[i], v_cache[i], plan, model.attn_scale)

    attend.cache = lambda i: (k_cache[i], v_cache[i], slots)

    def forward():
        return model.forward(ids, plan.query_pos, attend)

    times = {"eager_ms": [], "record_ms": [], "instantiate_ms": [], "replay_ms": []}
    forward()
    torch.cuda.synchronize()
    for _ in range(rounds):
        t0 = time.perf_counter()
        forward()
        times["eager_ms"].append((time.perf_counter() - t0) * 1e3)  # (the host's part: no sync)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        ctx = torch.cuda.graph(graph)
        ctx.__enter__()
        t0 = time.perf_counter()
        forward()
        t1 = time.perf_counter()
        ctx.__exit__(None, None, None)
        t2 = time.perf_counter()
        times["record_ms"].append((t1 - t0) * 1e3)
        times["instantiate_ms"].append((t2 - t1) * 1e3)
        graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times["replay_ms"].append((time.perf_counter() - t0) * 1e3)
        del graph
    return {k: statistics.median(v) for k, v in times.items()}


def medians(rows: list[dict]) -> list[dict]:
    """Per launch mode and batch, the median over the rounds of the step times and their ratio."""
    import statistics

    out = []
    for launch in dict.fromkeys(r["launch"] for r in rows):
        for batch in dict.fromkeys(r["batch"] for r in rows):
            mine = [r for r in rows if r["launch"] == launch and r["batch"] == batch]
            g = statistics.median(r["graphed_step_ms"] for r in mine)
            e = statistics.median(r["eager_step_ms"] for r in mine)
            out.append({"launch": launch, "batch": batch, "graphed_step_ms": g, "eager_step_ms": e,
                        "eager_over_graphed": e / g, "rounds": len(mine)})
    return out


def plot(result: dict, path: Path) -> None:
    """Eager and graphed step times by batch, one line per launch mode (medians over the rounds)."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for launch in dict.fromkeys(r["launch"] for r in result["medians"]):
        mine = [r for r in result["medians"] if r["launch"] == launch]
        ax.plot([r["batch"] for r in mine], [r["eager_step_ms"] for r in mine], marker="o",
                label=f"eager, {launch} launches")
    graphed = [r for r in result["medians"] if r["launch"] == result["medians"][0]["launch"]]
    ax.plot([r["batch"] for r in graphed], [r["graphed_step_ms"] for r in graphed], marker="s", color="k",
            label="CUDA graph")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("branches (decode rows)")
    ax.set_ylabel("decode step, ms")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{result['shape']}, {result['device']}: eager vs graphed step")
    ax.legend()
    save(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tinyllama-1.1b")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--profile-batch", type=int, default=64)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--launch", choices=["fast", "triton", "both"], default="both",
                    help="Triton kernels launched through treegen.kernels.launch (fast) or Triton's own path")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of the launch modes, interleaved")
    ap.add_argument("--label", default="", help="appended to the JSON name (an A/B variant)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--captures-only", action="store_true",
                    help="only the eager forward / capture host costs, printed as JSON (A/B of two checkouts)")
    ap.add_argument("--plot", type=Path, help="only plot this JSON result (adds its medians if missing)")
    args = ap.parse_args()
    if args.plot is not None:
        result = json.loads(args.plot.read_text())
        result.setdefault("medians", medians(result["rows"]))
        args.plot.write_text(json.dumps(result, indent=1) + "\n")
        plot(result, args.plot.with_suffix(".png"))
        return

    config = config_of(args.shape)
    model = LlamaFamilyModel.random(config, dtype=torch.bfloat16, device="cuda")
    prompt = torch.randint(0, model.vocab_size, (args.prefix,), generator=torch.Generator().manual_seed(0)).tolist()
    if args.captures_only:
        print(json.dumps({b: capture_costs(model, b, args.prefix, rounds=9) for b in args.batches}))
        return
    graphed, eager = Engine(model, IdTokenizer()), Engine(model, IdTokenizer(), cuda_graphs=False)
    rows, costs, captures, prof = [], {}, {}, None
    modes = ["fast", "triton"] if args.launch == "both" else [args.launch]
    for launch in modes * args.repeats:  # (interleaved: the host's speed drifts between runs)
        set_fast_launch(launch == "fast")
        for batch in args.batches:
            g = step_time(graphed, batch, prompt, args.new)
            e = step_time(eager, batch, prompt, args.new)
            rows.append({"launch": launch, "batch": batch, "graphed_step_ms": g * 1e3, "eager_step_ms": e * 1e3,
                         "eager_over_graphed": e / g})
            print(f"{launch:6s} batch {batch:5d}: graphed {g * 1e3:6.2f} ms  eager {e * 1e3:6.2f} ms  ({e / g:.1f}x)",
                  flush=True)
        print(f"host microseconds per call, batch {args.profile_batch}, {launch} launches:")
        costs.setdefault(launch, []).append(host_costs(model, args.profile_batch, args.prefix))
        if launch not in captures:
            captures[launch] = {b: capture_costs(model, b, args.prefix) for b in args.batches}
            print(f"capture costs, {launch} launches: {captures[launch]}", flush=True)
        if prof is None:
            prof = profile_eager(eager, args.profile_batch, prompt, 16, args.top)
    forwards = 16  # one per token (the run's first token comes from the prefill's forward)
    print(prof["profile"])
    print(f"Triton launches per forward: {prof['triton_launches'] / forwards:.0f}")
    device = torch.cuda.get_device_name()
    out = {
        "benchmark": "eager_step", "shape": args.shape, "dtype": "bfloat16", "device": device,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
                     "cuda": torch.version.cuda, "python": platform.python_version()},
        "method": "step = (t(new) - t(1)) / (new - 1) of a whole run (shared prompt, batch branches, greedy, EOS "
                  "ignored); graphed = Engine default, eager = cuda_graphs=False; profile: cProfile of one eager run",
        "prefix": args.prefix, "new": args.new, "rows": rows, "medians": medians(rows),
        "profile_batch": args.profile_batch, "host_us_per_call": costs, "capture_ms": captures, "triton_launches_per_forward": prof["triton_launches"] / forwards,
        "profile_top": prof["profile"].splitlines()[:args.top + 12],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "h200" if "H200" in device else "h100" if "H100" in device else device.replace(" ", "_")
    path = args.out / f"eager_step_{args.shape}_{tag}{'_' + args.label if args.label else ''}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    plot(out, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
