"""Lossless KV offload and recompute (issue 19): the scheduler's policy as plain data without a model,
then a tiny random model whose workload of branches that continue is 3x the KV budget."""

import random
import traceback

import pytest
import torch

import treegen
from treegen.runtime.engine import Engine
from treegen.runtime.kv_store import KVStore
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.offload import OffloadPolicy, OffloadRates
from treegen.runtime.requests import GenRequest, Job, ScoreRequest
from treegen.runtime.sampler import SamplingParams
from treegen.runtime.scheduler import KVBudget, Scheduler
from treegen.tree.sharing_tree import SharingTree

HOST = OffloadPolicy("host", host_bytes=2**30)


def setup(budget_slots, policy=HOST, kv_dtype=None):
    from treegen.kernels.kv_quant import kv_format

    tree = SharingTree()
    fmt = kv_format(kv_dtype, torch.float32, "cpu")
    kv = KVStore(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu", initial_slots=8, fmt=fmt)
    per = kv.bytes_per_token
    return tree, kv, Scheduler(tree, kv, lambda: KVBudget(budget_slots * per, per), 1000, offload=policy)


def value(node, i):
    return float(1000 * node + i + 1)


def pools(kv):
    """(pool, sign) of every pool the store has (an 8-bit format's scales too)."""
    return [(kv.k, 1), (kv.v, -1)] + ([(kv.k_scale, 1), (kv.v_scale, -1)] if kv.k_scale is not None else [])


def fits(pool, x):
    return x % 101 if pool.dtype == torch.int8 else x  # (int8 values: still unique per node and slot nearby)


def compute(kv, rows):
    """A fake forward pass: row (node, i) writes value(node, i) into every pool at its slot."""
    for n, i in rows:
        seg = kv.segments[n]
        for pool, sign in pools(kv):
            pool[:, seg.start + i] = fits(pool, sign * value(n, i))
        seg.computed = max(seg.computed, i + 1)


def check(kv, nodes):
    """Every written slot of ``nodes`` holds what the fake forward wrote there (nothing lost or moved wrong)."""
    for n in nodes:
        seg = kv.segments[n]
        if not seg.computed:
            continue
        for pool, sign in pools(kv):
            want = torch.tensor([float(fits(pool, sign * value(n, i))) for i in range(seg.computed)])
            got = pool[:, seg.start : seg.start + seg.computed].float().reshape(pool.shape[0], seg.computed, -1)
            assert torch.equal(got, want[None, :, None].expand_as(got)), f"node {n}"


def gen(node, max_tokens=4, final=False):
    return Job(GenRequest(node, SamplingParams(max_tokens=max_tokens), key=0, final=final))


def finish(tree, kv, job, tokens):
    """A gen that drew ``tokens``: they join its node, KV written for all but the last (as the decoder does)."""
    node = job.request.node
    tree.extend(node, tokens)
    compute(kv, [(node, i) for i in range(kv.computed(node), len(tree.tokens(node)) - 1)])
    job.done = True
    if job.request.final:
        kv.free(node)


def test_idle_branches_go_to_the_host_least_recently_used_first_and_come_back_before_they_are_read():
    tree, kv, sched = setup(budget_slots=20)
    root = tree.add_node(None, [1, 2, 3, 4])
    a, b = tree.add_node(root), tree.add_node(root)
    first = [gen(a, 6), gen(b, 6)]
    for j in first:
        sched.submit(j)
    step = sched.next_step(live=0)
    assert step.admitted == first and step.offloaded == []  # 4 + 6 + 6 = 16 of 20 slots
    compute(kv, step.rows)
    sched.next_step(live=2, reading=[a, b])
    for j, toks in zip(first, ([5, 6, 7], [8, 9])):
        finish(tree, kv, j, toks)  # both continue later (not final): their KV stays
    sched.next_step(live=1, reading=[b])  # b was read more recently than a
    c = tree.add_node(root)
    sched.submit(gen(c, 6))
    step = sched.next_step(live=0)
    assert step.offloaded == [a] and step.dropped == [] and len(step.admitted) == 1  # 16 + 6 > 20: a leaves
    assert a in kv.offloaded and a not in kv.segments and kv.host_bytes == 2 * kv.bytes_per_token
    compute(kv, step.rows)
    finish(tree, kv, step.admitted[0], [1])
    tree.extend(a, [11])  # a's program appends, then generates again: a comes back; b (idle, used before c) leaves
    again = gen(a, 3, final=True)
    sched.submit(again)
    step = sched.next_step(live=0)
    assert step.restored == [a] and step.offloaded == [b] and step.admitted == [again]
    assert kv.computed(a) == 2 and step.rows == [(a, 2), (a, 3)]  # only what a never had KV for is run
    check(kv, [root, a])
    assert kv.slots_reserved() <= 20 and sched.peak_slots <= 20
    n = kv.counters
    assert (n.nodes_offloaded, n.nodes_restored, n.bytes_restored) == (2, 1, 2 * kv.bytes_per_token)


def test_nodes_of_waiting_jobs_leave_after_the_idle_ones_the_one_read_last_first():
    tree, kv, sched = setup(budget_slots=12)
    x, y, z = (tree.add_node(None, [1, 2, 3]) for _ in range(3))
    compute(kv, [])
    for n in (x, y, z):
        kv.reserve(n, 3)
        compute(kv, [(n, i) for i in range(3)])
    sched.next_step(live=0, reading=[x])  # x used most recently, y and z never
    later = [gen(tree.add_node(z), 1), gen(tree.add_node(y), 1)]
    head = gen(tree.add_node(None, [5, 6]), 2)
    for j in [head, *later]:
        sched.submit(j)
    step = sched.next_step(live=0)
    # head needs 4 of the 3 free: x (no waiting job reads it) leaves, although used last
    assert step.offloaded == [x]
    # a job after head needs 2 of 1 free...: z's job is in the queue before y's, so y leaves first
    assert step.offloaded[1:2] in ([y], [])


def test_recompute_is_chosen_when_cheaper_than_the_transfer_and_past_the_host_cap():
    def run(policy, host_cap_tokens=None):
        tree, kv, sched = setup(budget_slots=10, policy=policy)
        old = tree.add_node(None, [1, 2, 3, 4, 5, 6])
        kv.reserve(old, 6)
        compute(kv, [(old, i) for i in range(6)])
        sched.submit(gen(tree.add_node(None, [7]), 5))
        return sched.next_step(live=0), kv

    per = setup(1)[1].bytes_per_token
    cheap_copy = OffloadRates(to_host=1e9, to_device=1e9, prefill_tokens=1e3)
    slow_copy = OffloadRates(to_host=1e3, to_device=1e3, prefill_tokens=1e6)
    step, kv = run(OffloadPolicy("auto", 2**20, rates=lambda: cheap_copy))
    assert step.offloaded and not step.dropped
    step, kv = run(OffloadPolicy("auto", 2**20, rates=lambda: slow_copy))
    assert step.dropped and not step.offloaded and kv.counters.tokens_dropped == 6
    step, kv = run(OffloadPolicy("auto", 5 * per, rates=lambda: cheap_copy))  # 6 tokens do not fit 5 on the host
    assert step.dropped and not step.offloaded
    step, kv = run(OffloadPolicy("recompute"))
    assert step.dropped and not step.offloaded


def test_a_dropped_node_is_prefilled_again_when_read():
    tree, kv, sched = setup(budget_slots=10, policy=OffloadPolicy("recompute"))
    old = tree.add_node(None, [1, 2, 3, 4, 5, 6])
    kv.reserve(old, 6)
    compute(kv, [(old, i) for i in range(6)])
    sched.submit(gen(tree.add_node(None, [7]), 5, final=True))
    step = sched.next_step(live=0)
    compute(kv, step.rows)
    finish(tree, kv, step.admitted[0], [1])
    child = tree.add_node(old, [8])
    sched.submit(gen(child, 2))
    step = sched.next_step(live=0)
    assert step.recomputed == [old] and step.rows[:6] == [(old, i) for i in range(6)]
    compute(kv, step.rows)
    check(kv, [old, child])
    assert (kv.counters.nodes_recomputed, kv.counters.tokens_recomputed) == (1, 6)


def test_refusals_name_the_sizes():
    tree, kv, sched = setup(budget_slots=10)
    big = gen(tree.add_node(None, [1, 2]), 20)
    sched.submit(big)
    assert sched.next_step(live=0).refused == [big]
    assert "needs 22 tokens" in str(big.error) and "whole KV budget of 10 tokens" in str(big.error)
    assert "offload cannot help" in str(big.error)
    # host mode past its capacity: idle KV could leave, but the host has no room for it
    per = kv.bytes_per_token
    tree, kv, sched = setup(budget_slots=10, policy=OffloadPolicy("host", host_bytes=3 * per))
    old = tree.add_node(None, [1, 2, 3, 4, 5, 6])
    kv.reserve(old, 6)
    compute(kv, [(old, i) for i in range(6)])
    job = gen(tree.add_node(None, [7]), 5)
    sched.submit(job)
    step = sched.next_step(live=0)
    assert step.refused == [job] and not step.offloaded and old in kv.segments
    assert "offload capacity" in str(job.error) and "raise offload_bytes" in str(job.error)


def test_a_phase_is_not_ended_for_work_that_waits_for_memory_until_some_is_freed():
    tree, kv, sched = setup(budget_slots=12, policy=OffloadPolicy())
    root = tree.add_node(None, [1, 2, 3, 4])
    running = gen(tree.add_node(root), 5)
    sched.submit(running)
    compute(kv, sched.next_step(live=0).rows)
    other = tree.add_node(None, [9])
    kv.reserve(other, 1)
    for _ in range(3):
        sched.submit(gen(tree.add_node(root), 5))
    sched.next_step(live=1, reading=[running.request.node])
    assert sched.memory_blocked and sched.memory_waits == 1
    sched.tick(100)
    assert not sched.phase_should_end(8, 8)  # nothing finished or freed: the waiting work could not join
    assert sched.phase_should_end(8, 7)  # a branch finished (its KV can go) and the work waited long enough
    kv.free(other)
    assert sched.phase_should_end(8, 8)  # memory was freed meanwhile


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("mode", ["host", "recompute"])
def test_a_random_stream_never_exceeds_the_budget_and_loses_no_kv(mode, kv_dtype):
    """Forks, appends, gens that continue (not final) or end, selects, on a random tree under a small
    budget: before every step, each node a ready job reads holds exactly the KV written for it."""
    rng = random.Random(5)
    budget = 40
    tree, kv, sched = setup(budget, OffloadPolicy(mode, host_bytes=2**30), kv_dtype)
    toks = lambda n: [rng.randrange(100) for _ in range(n)]  # noqa: E731
    nodes = [tree.add_node(None, toks(rng.randint(2, 6))) for _ in range(3)]
    busy: set[int] = set()  # nodes an open job generates into or selects after
    moved = 0
    for _ in range(300):
        free = [n for n in nodes if n not in busy]
        op = rng.random()
        if op < 0.25 and free:
            nodes.append(tree.add_node(rng.choice(free), toks(rng.randint(0, 3))))
        elif op < 0.35:
            leaf = rng.choice([n for n in free if not tree.children(n)] or [None])
            if leaf is not None:
                tree.extend(leaf, toks(1))
        elif op < 0.75:
            leaf = rng.choice([n for n in free if not tree.children(n)] or [None])
            if leaf is not None:
                if rng.random() < 0.2:
                    job = Job(ScoreRequest(leaf, tuple(tree.add_node(leaf, toks(2), kind="choice") for _ in range(2))))
                else:
                    job = gen(leaf, rng.randint(1, 6), final=rng.random() < 0.3)
                busy.add(leaf)
                sched.submit(job)
        step = sched.next_step(live=0)
        moved += len(step.offloaded) + len(step.dropped)
        assert kv.slots_reserved() <= budget
        for job in step.refused:
            busy.discard(job.request.node if job.is_gen else job.request.parent)
        reads = {n for j in step.ready for n in sched.nodes(j)}
        assert not reads & set(kv.offloaded)
        rows = set(step.rows)
        for n in reads:  # what has no KV is in the step's rows
            assert all((n, i) in rows for i in range(kv.computed(n), len(tree.tokens(n))))
        check(kv, reads)
        compute(kv, step.rows)
        for job in step.ready:
            if job.is_gen:
                node = job.request.node
                finish(tree, kv, job, toks(rng.randint(1, job.request.params.max_tokens)))
                if job.request.final:  # (finish freed its KV)
                    nodes.remove(node)
                    tree.prune(node)
                busy.discard(node)
            else:
                for c in job.request.choices:
                    kv.free(c)
                    tree.prune(c)
                busy.discard(job.request.parent)
    assert moved > 10
    if mode == "host":
        assert kv.counters.nodes_restored > 0
    else:
        assert kv.counters.nodes_recomputed > 0


# -------------------------------------------------------------------------------------------------
# end to end, a tiny random model


from test_continuous import model  # noqa: E402,F401 - the same tiny random model (a module fixture)


PREFIX = " " + " ".join(str(random.Random(3).randrange(1, 300)) for _ in range(16))


@treegen.program
def follow_up(s, problems, width, first, second, temperature):
    """Problems x width branches; each branch's answer is read again by its follow-up gen (not final)."""
    s += PREFIX
    p = s.fork(problems, content=lambda i: f" {i + 1} {i + 2} {i + 3}")
    b = p.fork(width)
    b += treegen.gen("a", max_tokens=first, temperature=temperature, ignore_eos=True)
    b += " 7"
    b += treegen.gen("b", max_tokens=second, temperature=temperature, ignore_eos=True)
    p.join(b)
    s.join(p)
    return s["a"], s["b"]


ARGS = dict(problems=2, width=4, first=16, second=4)


def live_kv_tokens(root) -> int:
    """Tokens of KV the workload holds at once when nothing is freed early: every node's tokens."""
    tree = root._run.tree
    return sum(len(tree.tokens(n)) for n in tree.graph)


@pytest.fixture(scope="module")
def unlimited(model):
    return {t: follow_up.run(Engine(model, IdTokenizer()), temperature=t, seed=4, **ARGS) for t in (0.0, 0.8)}


@pytest.mark.parametrize("mode, temperature", [("host", 0.0), ("host", 0.8), ("recompute", 0.0), ("recompute", 0.8),
                                               ("auto", 0.0)])
def test_a_workload_3x_the_budget_gives_the_unlimited_runs_tokens(model, unlimited, mode, temperature):
    want = unlimited[temperature]
    per = Engine(model, IdTokenizer()).kv_shape.bytes_per_token
    need = live_kv_tokens(want)
    budget = need // 3 * per  # a third of what the workload holds when nothing leaves
    engine = Engine(model, IdTokenizer(), kv_budget_bytes=budget, offload=mode)
    got = follow_up.run(engine, temperature=temperature, seed=4, **ARGS)
    assert got.ret_value == want.ret_value
    run = got._run.tree_run
    stats = run.offload_stats
    assert run.scheduler.peak_slots * per <= budget
    if mode == "recompute":
        assert stats["nodes_dropped"] > 0 and stats["tokens_recomputed"] > 0 and stats["nodes_offloaded"] == 0
    else:  # on the CPU a copy is far cheaper than a prefill: auto moves KV to the host
        assert stats["nodes_offloaded"] > 0 and stats["bytes_restored"] > 0 and stats["nodes_dropped"] == 0
    if mode == "auto":
        assert engine.offload_rates.prefill_tokens > 0


@pytest.mark.parametrize("mode", ["auto", "host"])
def test_when_the_host_runs_out_of_memory_auto_recomputes_and_host_says_so(model, unlimited, mode, monkeypatch, caplog):
    """The host gives memory for three offloaded nodes, then no more (as pinning fails when the machine's
    memory is locked up): ``"auto"`` drops the node it could not place and the rest, warns once, recomputes
    from then on (nothing more goes to the host), and gives the unlimited run's tokens; ``"host"`` stops with the error naming the node."""
    from treegen.runtime.host_arena import HostArena
    from treegen.runtime.kv_host import HostMemoryError

    take, taken = HostArena.take, []

    def scarce(self, nbytes):
        if len(taken) >= 3:
            raise RuntimeError("could not allocate 64 MiB of pinned host memory (injected)")
        taken.append(nbytes)
        return take(self, nbytes)

    monkeypatch.setattr(HostArena, "take", scarce)
    want = unlimited[0.0]
    per = Engine(model, IdTokenizer()).kv_shape.bytes_per_token
    engine = Engine(model, IdTokenizer(), kv_budget_bytes=live_kv_tokens(want) // 3 * per, offload=mode)
    if mode == "host":
        with pytest.raises(HostMemoryError, match=r"offloading node \d+'s KV .* needs host memory: could not allocate"):
            follow_up.run(engine, temperature=0.0, seed=4, **ARGS)
        return
    with caplog.at_level("WARNING", logger="treegen.runtime.eviction"):
        got = follow_up.run(engine, temperature=0.0, seed=4, **ARGS)
    assert got.ret_value == want.ret_value
    run = got._run.tree_run
    stats = run.offload_stats
    assert stats["nodes_offloaded"] == 3 and stats["nodes_dropped"] > 0 and stats["tokens_recomputed"] > 0
    assert run.scheduler.host_fallbacks == 1 and "offload to the host failed" in caplog.text


def test_with_offload_off_the_same_workload_is_refused(model, unlimited):
    per = Engine(model, IdTokenizer()).kv_shape.bytes_per_token
    budget = live_kv_tokens(unlimited[0.0]) // 3 * per
    with pytest.raises(MemoryError, match="held by branches that continue afterwards"):
        follow_up.run(Engine(model, IdTokenizer(), kv_budget_bytes=budget, offload="off"), temperature=0.0, seed=4,
                      **ARGS)


def test_8bit_kv_round_trips_through_the_host(model):
    args = dict(ARGS, width=4)
    want = follow_up.run(Engine(model, IdTokenizer(), kv_dtype="int8"), temperature=0.0, seed=4, **args)
    per = Engine(model, IdTokenizer(), kv_dtype="int8").kv_shape.bytes_per_token
    engine = Engine(model, IdTokenizer(), kv_dtype="int8", kv_budget_bytes=live_kv_tokens(want) // 3 * per,
                    offload="host")
    got = follow_up.run(engine, temperature=0.0, seed=4, **args)
    assert got.ret_value == want.ret_value
    assert got._run.tree_run.offload_stats["nodes_restored"] > 0


def test_offload_options_are_checked(model):
    with pytest.raises(ValueError, match="offload must be one of"):
        Engine(model, IdTokenizer(), offload="disk")
    with pytest.raises(ValueError, match="offload_bytes must be an integer >= 0"):
        Engine(model, IdTokenizer(), offload_bytes=-1)
    for bad in (0, -5, 2.5, True, "512"):
        with pytest.raises(ValueError, match="slice_tokens must be a positive integer or None"):
            Engine(model, IdTokenizer(), slice_tokens=bad)
    assert Engine(model, IdTokenizer(), slice_tokens=None).slice_tokens is None
    for bad in (-1, 2.5, True, "1"):
        with pytest.raises(ValueError, match="host_reserve_bytes must be an integer >= 0"):
            Engine(model, IdTokenizer(), host_reserve_bytes=bad)
    for mode in ("off", "recompute"):
        with pytest.raises(ValueError, match=f"host_reserve_bytes=4096 with offload='{mode}': no KV goes to the host"):
            Engine(model, IdTokenizer(), offload=mode, host_reserve_bytes=4096)
    with pytest.raises(ValueError, match="host_reserve_bytes=8192 is more than offload_bytes=4096"):
        Engine(model, IdTokenizer(), offload_bytes=4096, host_reserve_bytes=8192)


def test_a_sparse_window_compacted_node_goes_to_the_host_and_back_with_its_dropped_count():
    """A segment compacted by sparse window attention keeps ``dropped`` through offload and restore (its
    mask positions depend on it), is never dropped for recompute (a prefill would make dense KV), and a
    "recompute"-only policy leaves it in place."""
    kv = KVStore(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu", initial_slots=64)
    kv.reserve(5, 10)
    for layer in range(2):
        x = torch.arange(8, dtype=torch.float32).repeat_interleave(4).reshape(8, 1, 4) + 100 * layer
        kv.write(layer, torch.arange(kv.segments[5].start, kv.segments[5].start + 8), x, -x)
    kv.segments[5].computed = 8
    kv.keep(5, torch.tensor([0, 3, 6, 7]))
    before = [kv.layer(layer)[0][kv.segments[5].start:kv.segments[5].start + 4].clone() for layer in range(2)]
    assert (kv.segments[5].computed, kv.segments[5].dropped) == (4, 4)
    with pytest.raises(RuntimeError, match="compacted by sparse window attention"):
        kv.drop(5)
    policy = OffloadPolicy("auto", 1 << 20, rates=lambda: None)
    assert policy.to_host(4, 100, 1 << 20, None, recomputable=False) is True
    assert policy.to_host(4, 100, 10, None, recomputable=False) is None  # no room on the host: stays
    assert OffloadPolicy("recompute", 1 << 20, rates=lambda: None).to_host(4, 100, 1 << 20, None,
                                                                        recomputable=False) is None
    kv.offload(5)
    assert 5 not in kv.segments and kv.dropped(5) == 4  # (the host copy keeps it: what a restore needs is held)
    kv.restore({5: 6})
    seg = kv.segments[5]
    assert (seg.computed, seg.dropped, seg.capacity) == (4, 4, 6)
    for layer in range(2):
        assert torch.equal(kv.layer(layer)[0][seg.start:seg.start + 4], before[layer])


def test_evictions_are_carried_out_together_at_the_end_of_the_admission_pass(monkeypatch):
    """Jobs admitted one after another in one pass, each evicting idle nodes: one offload call moves every
    node the pass evicts; while the pass runs, a node whose eviction it decided counts as gone (a job
    reading it needs its slots again, and it is restored)."""
    tree, kv, sched = setup(budget_slots=16)
    idle = [tree.add_node(None, [1, 2, 3]) for _ in range(4)]
    for n in idle:
        kv.reserve(n, 3)
        compute(kv, [(n, i) for i in range(3)])
    calls = []
    real = kv.offload
    monkeypatch.setattr(kv, "offload", lambda nodes: calls.append(list(nodes)) or real(nodes))
    jobs = [gen(tree.add_node(None, [7]), 4) for _ in range(3)]  # 5 slots each: 12 + 15 > 16
    for j in jobs:
        sched.submit(j)
    step = sched.next_step(live=0)
    assert step.admitted == jobs and len(calls) == 1 and calls[0] == step.offloaded and len(step.offloaded) >= 3
    assert kv.slots_reserved() <= 16
    z = jobs[0].request.node  # (white box: as if this pass had decided to evict it)
    reader = gen(tree.add_node(z, [8]), 1)
    assert z in kv.segments and z not in sched.need(reader)
    sched._evicting = {z: True}
    assert sched.need(reader)[z] == len(tree.tokens(z))
    sched._evicting = {}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sliced_gens_pause_when_short_of_memory_and_give_the_unlimited_runs_tokens(model, temperature, monkeypatch):
    """Gens longer than a slice reserve one slice at a time: where a third of the workload's KV fits, the
    branches furthest along decode on while the others wait on the host (staggered lengths), in fewer forward
    passes than whole reservations (rounds of the branches that fit), with the unlimited run's tokens."""
    args = dict(ARGS, first=48, second=2)
    want = follow_up.run(Engine(model, IdTokenizer()), temperature=temperature, seed=4, **args)
    per = Engine(model, IdTokenizer()).kv_shape.bytes_per_token
    budget = live_kv_tokens(want) // 3 * per
    passes = {}
    for slice_tokens in (8, None):  # (None: nothing is sliced)
        engine = Engine(model, IdTokenizer(), kv_budget_bytes=budget, offload="host", slice_tokens=slice_tokens)
        got = follow_up.run(engine, temperature=temperature, seed=4, **args)
        assert got.ret_value == want.ret_value
        run = got._run.tree_run
        assert run.scheduler.peak_slots * per <= budget
        assert (run.decoder.pauses > 0) == (slice_tokens == 8)
        assert not run.decoder.paused and not run.scheduler.has_work()
        passes[slice_tokens] = run.forward_passes
    assert passes[8] < passes[None]


def test_a_sliced_gen_is_admitted_only_if_it_fits_whole_at_its_end(model, monkeypatch):
    """Slicing never starts what cannot finish: a gen whose whole length passes the budget is refused at
    once, with the sizes, even though its first slice would fit; one that fits only without the room its node's
    last move needs (its whole length and the range held meanwhile) is not sliced, and completes."""
    per = Engine(model, IdTokenizer()).kv_shape.bytes_per_token
    engine = Engine(model, IdTokenizer(), kv_budget_bytes=40 * per, offload="host", slice_tokens=8)
    run = engine.start()
    leaf = run.tree.add_node(run.tree.add_node(None, list(range(5, 15))), [])
    job = run.submit(GenRequest(leaf, SamplingParams(max_tokens=64, ignore_eos=True), key=0))
    while not job.done and run.advance():
        pass
    assert isinstance(job.error, MemoryError) and "more than the whole KV budget" in str(job.error)
    assert run.decoder.pauses == 0
    run = engine.start()  # 4 + 30 fit 40; 4 + 2 x 30 would not: whole reservation
    leaf = run.tree.add_node(run.tree.add_node(None, [1, 2, 3, 4]), [])
    job = run.submit(GenRequest(leaf, SamplingParams(max_tokens=30, ignore_eos=True), key=0))
    while not job.done and run.advance():
        pass
    assert job.error is None and len(job.result.tokens) == 30 and run.decoder.pauses == 0


def _two_growing_branches(budget_slots):
    """A root of 2 tokens, branches a and b of 6 tokens each (their KV written), and an idle node x of 1 token
    after them (so neither can grow in place); a gen of 4 more tokens into a and into b, submitted."""
    tree, kv, sched = setup(budget_slots=budget_slots)
    root = tree.add_node(None, [1, 2])
    a, b, x = tree.add_node(root, [3] * 6), tree.add_node(root, [4] * 6), tree.add_node(root, [5])
    compute(kv, [])
    for n, length in ((root, 2), (a, 6), (b, 6), (x, 1)):
        kv.reserve(n, length)
        compute(kv, [(n, i) for i in range(length)])
    jobs = [gen(a, 4), gen(b, 4)]
    for j in jobs:
        sched.submit(j)
    return tree, kv, sched, (root, a, b, x), jobs


@pytest.mark.parametrize("budget", [29, 28])
def test_growing_nodes_count_what_they_gain_and_the_pass_keeps_room_for_the_largest_move(budget):
    """Each branch gains 4 slots, and the pass keeps 6 free for the larger range held while a node moves (its new
    range is taken before the old one is given back): 15 held + 8 + 6 = 29. Under 29 both grow and nothing
    leaves; under 28 the idle node goes to the host first. (Counting each new range whole, 15 + 10 + 10 = 35,
    would have let one in.)"""
    tree, kv, sched, (root, a, b, x), jobs = _two_growing_branches(budget)
    assert [sched.need(j) for j in jobs] == [{a: 4}, {b: 4}] and [sched.moving(j) for j in jobs] == [6, 6]
    step = sched.next_step(live=0)
    assert step.admitted == jobs
    assert step.offloaded == ([] if budget == 29 else [x])
    assert kv.slots_reserved() == 15 + 8 - (budget == 28) <= budget and sched.peak_slots <= budget
    assert kv.segments[a].capacity == kv.segments[b].capacity == 10
    check(kv, [root, a, b])


@pytest.mark.parametrize("extend", [True, False], ids=["next-slice-at-once", "pause"])
def test_a_sliced_branch_pauses_at_its_slice_end_also_in_steps_that_prefill_other_work(model, monkeypatch, extend):
    """A branch whose decode phase ended early for new work keeps drawing a token in each step that prefills that
    work: where its slice ends there too, it is given its next slice at once (memory to spare) or, when the
    scheduler will not (``extend`` off: as when work waits), it pauses — so its node only ever grows through
    the scheduler (never in ``plan_rows``, outside the budget's accounting), and gives the tokens of an
    unsliced run."""
    from treegen.runtime import scheduler

    if not extend:
        monkeypatch.setattr(scheduler.Scheduler, "extend", lambda self, job, drawn: False)

    def run_once(slice_tokens):
        per = Engine(model, IdTokenizer()).kv_shape.bytes_per_token
        engine = Engine(model, IdTokenizer(), kv_budget_bytes=2000 * per, offload="host", max_prefill_tokens=8,
                        slice_tokens=slice_tokens)
        run = engine.start()
        tree, kv = run.tree, run.kv
        root = tree.add_node(None, [1, 2, 3, 4])
        leaf = tree.add_node(root, [])
        reserve, outside = kv.reserve, []

        def watched(node, length):  # (a growth of the branch's node from plan_rows: outside the scheduler)
            seg = kv.segments.get(node)
            if node == leaf and seg is not None and seg.capacity < length and any(
                    frame.name == "plan_rows" for frame in traceback.extract_stack()):
                outside.append((seg.capacity, length))
            return reserve(node, length)

        kv.reserve = watched
        extra = []

        def on_tokens(tokens):  # short gens arrive while it decodes: several steps that prefill them follow
            if len(tokens) == 3 and not extra:
                for i in range(12):
                    node = tree.add_node(root, [10 + i] * 8)
                    extra.append(run.submit(GenRequest(node, SamplingParams(max_tokens=2, ignore_eos=True), key=100 + i)))

        job = run.submit(GenRequest(leaf, SamplingParams(max_tokens=64, ignore_eos=True), key=0), on_tokens=on_tokens)
        while run.busy() and run.advance():
            pass
        assert job.error is None and all(j.error is None for j in extra) and not outside
        return job.result.tokens, [j.result.tokens for j in extra], run.decoder.pauses

    sliced, plain = run_once(8), run_once(None)
    assert sliced[:2] == plain[:2] and (sliced[2] > 0) == (not extend) and plain[2] == 0


@pytest.mark.parametrize("budget_now", [200, 30])
def test_a_next_slice_that_would_grow_the_pool_asks_for_the_budget_of_now(budget_now):
    """``Scheduler.extend`` gives a slice at once only within the budget: when the pool must grow for it, the
    budget is asked again (on a device a grown pool is a copy, dearer the larger the pool: the admission's
    figure is stale; seen on an H100, out of memory). With the budget still 200 slots the slice is given and the
    pool grows; shrunk to 30 since the admission (18 held, the node's new range 16), it is refused (the branch
    will pause) and the pool stays."""
    tree, kv, _ = setup(None)
    per, budget = kv.bytes_per_token, [200]
    sched = Scheduler(tree, kv, lambda: KVBudget(budget[0] * per, per), 1000, offload=HOST, slice_tokens=8)
    leaf = tree.add_node(tree.add_node(None, list(range(10))), [])
    job = gen(leaf, 40)
    sched.submit(job)
    step = sched.next_step(live=0)
    assert [j is job for j in step.admitted] == [True] and kv.segments[leaf].capacity == 8  # its first slice
    while kv.slots_free():  # the pool is full: the next slice must grow it
        kv.reserve(tree.add_node(None, [1]), kv.free_spans.largest())
    slots = kv.num_slots
    budget[0] = budget_now
    given = sched.extend(job, 8)
    assert given == (budget_now == 200)
    assert kv.segments[leaf].capacity == (16 if given else 8)
    assert (kv.num_slots > slots) == given and kv.slots_reserved() <= budget_now
