"""The scheduler's decisions as plain data, on a sharing tree and a KV store alone (no model)."""

import pytest
import torch

from treegen.runtime.device_memory import UNRELEASABLE_CACHE, activation_margin, growth_on_device
from treegen.runtime.kv_store import KVStore
from treegen.runtime.requests import GenRequest, Job, ScoreRequest
from treegen.runtime.sampler import SamplingParams
from treegen.runtime.scheduler import SHRINK_AFTER_STEPS, KVBudget, Scheduler
from treegen.tree.sharing_tree import SharingTree


def setup(budget_slots=None, token_budget=1000, max_batch=None):
    tree = SharingTree()
    kv = KVStore(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu", initial_slots=16)
    per = kv.bytes_per_token
    total = None if budget_slots is None else budget_slots * per
    return tree, kv, Scheduler(tree, kv, lambda: KVBudget(total, per), token_budget, max_batch)


def computed(kv, step):
    """What the engine's forward pass does to the store: the step's rows now have KV."""
    for n, i in step.rows:
        kv.segments[n].computed = max(kv.segments[n].computed, i + 1)


def gen(node, max_tokens=4, final=False):
    return Job(GenRequest(node, SamplingParams(max_tokens=max_tokens), key=0, final=final))


def test_a_step_prefills_each_shared_node_once_parents_first():
    tree, kv, sched = setup()
    root = tree.add_node(None, [1, 2, 3])
    a, b = tree.add_node(root, [4]), tree.add_node(root, [5, 6])
    jobs = [gen(a), gen(b)]
    for j in jobs:
        sched.submit(j)
    step = sched.next_step(live=0)
    assert step.admitted == jobs and step.ready == jobs
    assert step.rows == [(root, 0), (root, 1), (root, 2), (a, 0), (b, 0), (b, 1)]
    assert kv.segments[a].capacity == 1 + 4 and kv.segments[root].capacity == 3  # prompt + max_tokens
    assert not sched.has_work() and sched.next_step(live=2).rows == []


def test_a_conditioning_token_with_kv_is_run_again_and_scores_ride_the_same_step():
    tree, kv, sched = setup()
    root = tree.add_node(None, [1, 2])
    kv.reserve(root, 2)
    kv.segments[root].computed = 2  # already computed
    child = tree.add_node(root)  # an empty fork child: its first token comes from root's last
    choices = (tree.add_node(root, [7, 8], kind="choice"), tree.add_node(root, [9], kind="choice"))
    sched.submit(gen(child))
    sched.submit(Job(ScoreRequest(root, choices)))
    step = sched.next_step(live=0)
    assert step.rows == [(root, 1), (choices[0], 0), (choices[0], 1), (choices[1], 0)]
    assert len(step.ready) == 2


def test_admission_waits_for_memory_and_refuses_what_never_fits():
    tree, kv, sched = setup(budget_slots=20)
    root = tree.add_node(None, [1, 2, 3, 4])
    leaves = [tree.add_node(root) for _ in range(4)]
    jobs = [gen(n, max_tokens=6, final=True) for n in leaves]
    big = gen(tree.add_node(None, [1]), max_tokens=30)
    for j in jobs + [big]:
        sched.submit(j)
    step = sched.next_step(live=0)
    assert step.refused == [big]  # shallowest, so looked at first: more than the whole budget
    assert step.admitted == jobs[:2]  # 4 + 6 + 6 = 16 of 20 slots; a third would need 22
    assert sched.memory_waits == 1 and kv.slots_reserved() == 16
    for n in leaves[:2]:  # those two finish and free their KV
        kv.free(n)
    step = sched.next_step(live=0)
    assert step.admitted == jobs[2:] and step.refused == []
    assert "max_tokens=30) needs 31 tokens" in str(big.error) and "the whole KV budget of 20 tokens" in str(big.error)
    assert sched.peak_slots <= 20


def test_work_that_cannot_fit_while_nothing_runs_is_refused_not_waited_for():
    tree, kv, sched = setup(budget_slots=12)
    root = tree.add_node(None, [1, 2])
    kv.reserve(root, 10)  # held by a branch that continues
    job = gen(tree.add_node(root), max_tokens=4)
    sched.submit(job)
    step = sched.next_step(live=0)
    assert step.refused == [job] and "held by branches that continue" in str(job.error)


def test_max_batch_and_the_token_budget_bound_a_step():
    tree, kv, sched = setup(token_budget=6, max_batch=3)
    root = tree.add_node(None, [1, 2, 3])
    jobs = [gen(tree.add_node(root, [4, 5])) for _ in range(4)]
    for j in jobs:
        sched.submit(j)
    step = sched.next_step(live=1)  # one branch already decodes: two more fit the batch
    assert step.admitted == jobs[:2]
    assert step.ready == jobs[:1]  # 3 + 2 rows fill the 6-row budget with the decode row; the next waits
    computed(kv, step)
    step = sched.next_step(live=2)  # the first job decodes now: the batch is full
    assert step.ready == jobs[1:2] and step.rows == [(jobs[1].request.node, 0), (jobs[1].request.node, 1)]
    assert [j for j in sched.waiting] == jobs[2:]


def test_waiting_work_goes_shallowest_first_then_scores_then_longest_then_oldest():
    """A program's first fork before another's follow-up (deeper: its chain of dependent work is
    shorter), a score before gens at its depth, long gens before short ones, then arrival order."""
    tree, kv, sched = setup(max_batch=1)
    root = tree.add_node(None, [1, 2])
    thought = tree.add_node(root, [3])
    follow_up = gen(tree.add_node(thought), max_tokens=50)  # depth 3
    short, long_, also_short = (gen(tree.add_node(root), max_tokens=m) for m in (4, 9, 4))  # depth 2
    score = Job(ScoreRequest(root, (tree.add_node(root, [7], kind="choice"),)))
    for j in (follow_up, short, long_, also_short, score):
        sched.submit(j)
    assert sched.waiting == [score, long_, short, also_short, follow_up]
    step = sched.next_step(live=0)  # the batch holds one gen: the score rides along
    assert step.admitted == [score, long_]
    assert sched.cancel(short) and sched.waiting == [also_short, follow_up]


def test_work_from_an_earlier_aging_window_goes_first_whatever_its_depth():
    from treegen.runtime.scheduler import AGING_STEPS

    tree, kv, sched = setup()
    root = tree.add_node(None, [1])
    deep = gen(tree.add_node(tree.add_node(root, [2])))
    sched.submit(deep)
    sched.tick(AGING_STEPS)
    shallow = gen(tree.add_node(None, [3]), max_tokens=100)
    sched.submit(shallow)
    assert sched.waiting == [deep, shallow]


def test_a_phase_ends_when_half_is_done_or_enough_new_work_waits():
    tree, kv, sched = setup(max_batch=100)
    assert not sched.phase_should_end(64, 40)
    assert sched.phase_should_end(64, 32)  # half finished
    # with nothing waiting, a young phase of short answers runs on rather than set up a smaller one
    assert not sched.phase_should_end(64, 32, steps=SHRINK_AFTER_STEPS - 1)
    assert sched.phase_should_end(64, 32, steps=SHRINK_AFTER_STEPS) and sched.phase_should_end(64, 0, steps=1)
    # ... nor one that can run only a few steps more (its rows' budgets end it soon)
    assert not sched.phase_should_end(64, 32, steps=SHRINK_AFTER_STEPS, left=SHRINK_AFTER_STEPS - 1)
    assert sched.phase_should_end(64, 32, steps=SHRINK_AFTER_STEPS, left=SHRINK_AFTER_STEPS)
    for _ in range(2):
        sched.submit(gen(tree.add_node(None, [1])))
    assert sched.phase_should_end(64, 32, steps=1)  # work waits: half done makes room for it at once
    assert sched.phase_should_end(64, 32, steps=1, left=1)
    assert not sched.phase_should_end(64, 60)  # 4 finished + 2 new < half the phase
    assert not sched.phase_should_end(64, 35) and sched.phase_should_end(64, 34)  # 30 finished + 2 new: half
    sched.tick(64)
    assert sched.phase_should_end(64, 60)  # new work waited long enough


def test_a_new_job_ahead_of_one_that_did_not_fit_is_not_taken_for_blocked():
    tree, kv, sched = setup(budget_slots=20)
    root = tree.add_node(None, [1, 2, 3, 4])
    sched.submit(gen(tree.add_node(root), max_tokens=12))
    sched.next_step(live=0)  # 4 + 12 = 16 of 20 slots
    deep = gen(tree.add_node(tree.add_node(root, [5])), max_tokens=8)  # would need 9 more: waits
    sched.submit(deep)
    sched.next_step(live=1)
    assert sched.memory_blocked and sched.waiting == [deep]
    assert not sched.phase_should_end(4, 3)  # what waits cannot join: no reason to end the phase yet
    shallow = gen(tree.add_node(root), max_tokens=2)  # fits, and goes first (shallower)
    sched.submit(shallow)
    assert sched.waiting[0] is shallow and not sched.memory_blocked
    assert sched.phase_should_end(4, 3) and sched.next_step(live=1).admitted == [shallow]


@pytest.mark.parametrize("seed", range(3))
def test_the_free_list_stays_sorted_merged_and_disjoint(seed):
    """Random reserves (new, grown in place or moved) and frees: the free spans stay sorted, merged and
    disjoint from every segment; the index by length and the total agree with them; a new segment goes
    to the best fit (the smallest span that holds it, the first of equal ones)."""
    import random

    rng = random.Random(seed)
    kv = KVStore(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu", initial_slots=64)
    for step in range(600):
        if kv.segments and rng.random() < 0.45:
            kv.free(rng.choice(sorted(kv.segments)))
        elif kv.segments and rng.random() < 0.2:  # grow one: in place when the span after it is free, else moved
            node = rng.choice(sorted(kv.segments))
            kv.ensure_free(8)
            kv.reserve(node, kv.segments[node].capacity + rng.randint(1, 8))
        else:
            length = rng.randint(1, 8)
            kv.ensure_free(8)
            fits = [(n, s) for s, n in kv.free_spans.by_start if n >= length]
            seg = kv.reserve(step, length)
            if fits:
                assert seg.start == min(fits)[1]
        spans = kv.free_spans.by_start
        assert kv.free_spans.by_length == sorted((n, s) for s, n in spans)
        assert kv.slots_free() == sum(n for _, n in spans)
        assert spans == sorted(spans)
        assert all(a[0] + a[1] < b[0] for a, b in zip(spans, spans[1:]))  # merged: never touching
        owned = sorted((s.start, s.start + s.capacity) for s in kv.segments.values())
        everything = sorted(owned + [(s, s + n) for s, n in spans])
        assert all(a[1] <= b[0] for a, b in zip(everything, everything[1:]))


def test_a_pool_grows_on_a_device_only_as_far_as_the_activations_margin_allows():
    """The sizing of a device pool's growth, at the numbers of an out-of-memory seen on an H100 (Llama-3-8B,
    128 KiB a token, 256 sliced gens): the geometric growth asked for stops where the activations' margin
    begins; what must be gained may go past the margin; what does not fit at all names its bytes."""
    gib, per = 2**30, 128 * 2**10
    total, copy, free = int(79.18 * gib), int(15.75 * gib), int(31.2 * gib)  # a pool of ~258K slots
    margin = activation_margin(total)
    assert margin == int(0.1 * total)
    # asked to double: before, it took all but 1,024 slots of the free memory (new keys 23.5 GiB, ~0.4 GiB short)
    grown = growth_on_device(1000, 258_000, per_token=per, copy=copy, free=free, device_total=total)
    assert grown == (free - copy - margin) // per
    assert free - copy - grown * per >= margin
    # the slots it must gain are given even past the margin, while they and the copy fit (all but 1 GiB)
    must = (free - copy - UNRELEASABLE_CACHE) // per
    assert growth_on_device(must, 258_000, per_token=per, copy=copy, free=free, device_total=total) == must
    with pytest.raises(MemoryError, match=r"needs 30\.20 GiB more for 118375 token slots .* plus a copy .* "
                                          r"31\.20 GiB is free on cuda:0, less 1 GiB"):
        growth_on_device(must + 1, 258_000, per_token=per, copy=copy, free=free, device_total=total, where="cuda:0")
    # a small device keeps 4 GiB
    assert activation_margin(16 * gib) == 4 * gib


def test_free_device_memory_counts_only_cache_the_allocator_can_give_back(monkeypatch):
    """At the numbers of an out-of-memory seen on an H100: 14.4 GiB cached but in segments partly in use
    (inactive split blocks) are not free for a pool; whole unused segments are."""
    import torch

    from treegen.runtime import device_memory

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(20.5 * gib), int(79.2 * gib)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 58 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 41 * gib)
    split = {"current": 14 * gib}
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device: {"inactive_split_bytes": {"all": split}})
    assert device_memory.device_free("cuda:0") == (int(20.5 * gib) + 3 * gib, int(79.2 * gib))
    split["current"] = 18 * gib  # (never below what the device reports)
    assert device_memory.device_free("cuda:0")[0] == int(20.5 * gib)


def test_expandable_segments_are_read_from_the_allocator_settings(monkeypatch):
    """Under expandable segments a grown pool counts a copy of all its old tensors, not only the largest."""
    from treegen.runtime import device_memory

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    assert not device_memory.expandable_segments()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512, expandable_segments:True")
    assert device_memory.expandable_segments()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert not device_memory.expandable_segments()


def test_reserving_no_slots_is_refused_by_name():
    _, kv, _ = setup()
    with pytest.raises(ValueError, match=r"reserve\(node 7\) needs a positive length, got 0"):
        kv.reserve(7, 0)
    assert kv.segments == {}


def test_a_segment_grows_in_place_when_the_span_after_it_is_free():
    kv = KVStore(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu", initial_slots=64)
    a = kv.reserve(0, 8)
    kv.k[0, a.start : a.start + 5] = 7.0
    a.computed = 5
    kv.reserve(1, 8)
    kv.free(1)  # the span after node 0 is free again
    grown = kv.reserve(0, 20)
    assert grown.start == a.start and grown.capacity == 20 and (kv.k[0, :5] == 7.0).all()
    kv.reserve(2, 4)  # now something sits right after it: growing again moves it, with its KV
    moved = kv.reserve(0, 30)
    assert moved.start != a.start and moved.computed == 5 and (kv.k[0, moved.start : moved.start + 5] == 7.0).all()
    assert kv.slots_reserved() == 30 + 4


def _written_segments(kv, nodes, rng):
    """Segments of 1-9 slots for ``nodes``, each written in part: slot ``i`` of node ``n`` holds
    ``i + 100 n + layer`` in the keys and ``-(i + 100 n)`` in the values (see _check_written)."""
    for node in nodes:
        seg = kv.reserve(node, rng.randint(1, 9))
        seg.computed = rng.randint(0, seg.capacity)
        for layer in range(2):
            kv.k[layer, seg.start : seg.start + seg.computed] = torch.arange(seg.computed)[:, None, None] + 100 * node + layer
            kv.v[layer, seg.start : seg.start + seg.computed] = -(torch.arange(seg.computed)[:, None, None] + 100 * node)


def _check_written(kv, node):
    seg = kv.segments[node]
    for layer in range(2):
        want = torch.arange(seg.computed, dtype=torch.float32) + 100 * node
        assert torch.equal(kv.k[layer, seg.start : seg.start + seg.computed, 0, 0], want + layer), node
        assert torch.equal(kv.v[layer, seg.start : seg.start + seg.computed, 0, 1], -want), node


@pytest.mark.parametrize("chunk", [3, 7, 16384, None])
def test_compaction_keeps_every_written_token_of_many_segments(chunk):
    """Many segments with holes between them (some written in part, some not at all) compacted in index
    batches of ``chunk`` slots, batches cutting through segments: every written slot reads back its own
    values at its new place, the segments are packed from slot 0 in their old order, and one free span
    is left at the end."""
    import random

    rng = random.Random(chunk)
    kv = KVStore(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu", initial_slots=512)
    _written_segments(kv, range(40), rng)
    for node in range(0, 40, 3):
        kv.free(node)
    order = sorted(kv.segments, key=lambda n: kv.segments[n].start)
    moving = sum(kv.segments[n].computed for i, n in enumerate(order)
                 if kv.segments[n].start != sum(kv.segments[m].capacity for m in order[:i]))
    kv._compact(chunk=chunk)
    assert kv.slots_moved == moving
    pos = 0
    for node in order:
        seg = kv.segments[node]
        assert seg.start == pos
        pos += seg.capacity
        _check_written(kv, node)
    assert kv.free_spans.by_start == [(pos, kv.num_slots - pos)]


def _check_tiles(kv):
    """The free spans and the segments tile the pool: sorted, none empty or touching, no overlap."""
    spans = kv.free_spans.by_start
    assert all(n > 0 for _, n in spans) and all(a[0] + a[1] < b[0] for a, b in zip(spans, spans[1:]))
    assert sorted((n, s) for s, n in spans) == kv.free_spans.by_length
    tiles = sorted([*spans, *((seg.start, seg.capacity) for seg in kv.segments.values())])
    assert all(a[0] + a[1] == b[0] for a, b in zip(tiles, tiles[1:])) and tiles[0][0] == 0
    assert tiles[-1][0] + tiles[-1][1] == kv.num_slots and kv.free_spans.total == sum(n for _, n in spans)


@pytest.mark.parametrize("seed", range(8))
def test_compaction_for_room_closes_the_cheapest_run_of_holes_only(seed):
    """Compacting for ``room`` slots packs down only the segments between the free spans of the run that
    holds ``room`` free slots with the fewest written slots inside (checked against every run), leaving one
    span of at least ``room``; every written slot reads back its own values; the rest stays in place."""
    import random

    rng = random.Random(seed)
    kv = KVStore(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu", initial_slots=400)
    _written_segments(kv, range(80), rng)
    for node in rng.sample(range(80), 30):
        kv.free(node)
    spans = list(kv.free_spans.by_start)
    room = rng.randint(1, kv.free_spans.total)
    before = {node: seg.start for node, seg in kv.segments.items()}
    cheapest = min(sum(seg.computed for seg in kv.segments.values() if spans[i][0] < seg.start < spans[j][0])
                   for i in range(len(spans)) for j in range(i, len(spans))
                   if sum(n for _, n in spans[i : j + 1]) >= room)
    kv._compact(chunk=rng.choice([3, None]), room=room)
    _check_tiles(kv)
    assert kv.slots_moved == cheapest and kv.free_spans.largest() >= room
    assert sum(kv.segments[node].computed for node in kv.segments if kv.segments[node].start != before[node]) == cheapest
    for node in kv.segments:
        _check_written(kv, node)


def test_a_node_that_fits_no_hole_compacts_once_for_all_that_ensure_free_announced():
    """ensure_free announces the slots an admission will place; the first node that fits no hole makes
    room for the rest at once (one compaction), closing holes near the pool's start only as far as needed."""
    kv = KVStore(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu", initial_slots=400)
    for node in range(40):
        kv.reserve(node, 10).computed = 10
    for node in range(1, 40, 2):  # holes of 10 slots: 200 free, none longer than 10
        kv.free(node)
    kv.ensure_free(4 * 30)
    for node in range(100, 104):
        kv.reserve(node, 30)
    assert kv.compactions == 1 and kv.slots_moved < 20 * 10 and kv.upcoming == 0
    assert kv.segments[38].start == 380  # the segments past the run closed stay
    _check_tiles(kv)


def test_a_job_left_out_of_a_full_step_does_not_count_its_nodes_as_taken():
    """A token budget that holds the first and third jobs' rows but not the second's long own node: the
    node the second shares with the third (``x``) is not taken for already in the step (the third job's
    rows include it), and the second job's rows come whole in the next step."""
    tree, kv, sched = setup(token_budget=9)
    root = tree.add_node(None, [1, 2, 3])
    a = tree.add_node(root, [4])
    x = tree.add_node(root, [5, 6])
    big, b = tree.add_node(x, list(range(10, 20))), tree.add_node(x, [7])
    for node in (a, big, b):
        sched.submit(gen(node))
    step = sched.next_step(live=0)
    assert [j.request.node for j in step.ready] == [a, b]
    assert step.rows == [(root, 0), (root, 1), (root, 2), (a, 0), (x, 0), (x, 1), (b, 0)]
    computed(kv, step)
    step = sched.next_step(live=0)
    assert [j.request.node for j in step.ready] == [big]
    assert step.rows == [(big, i) for i in range(10)]


def test_a_restore_copies_per_layer_when_few_nodes_come_back_and_in_fewer_groups_when_many_do():
    from treegen.runtime.kv_host import RESTORE_COPIES, layer_groups

    for layers in (1, 5, 32, 80):
        for copies in (1, 2, 8, 64, 400, 10_000):
            groups = layer_groups(layers, copies)
            assert groups[0][0] == 0 and groups[-1][1] == layers  # every layer once, in order
            assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(groups, groups[1:] + [(layers, layers + 1)]))
            assert len(groups) * copies <= max(RESTORE_COPIES, copies)
    assert layer_groups(32, 2) == [(i, i + 1) for i in range(32)]
    assert len(layer_groups(32, 64)) == RESTORE_COPIES // 64 and layer_groups(32, 400) == [(0, 32)]
