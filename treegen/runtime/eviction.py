"""Making room for a job that does not fit: which idle nodes' KV leaves the GPU, and carrying it out
(:class:`Evictions`, a base of :class:`~treegen.runtime.scheduler.Scheduler`; see "offload / recompute" in
its module doc).

An admission pass short of memory lists the *idle* nodes once (:class:`IdleNodes`: not read by live branches
or admitted work), in eviction order — nodes no waiting job reads, least recently used first; then those read by
waiting jobs, the one read last first — and takes from that order as each job needs room; the
:class:`~treegen.runtime.offload.OffloadPolicy` decides per node whether its KV goes to the host or is dropped
(to be prefilled again). The pass's evictions are carried out together at its end: one batched offload, then
the drops (:meth:`Evictions._carry_out`).

The scheduler's own parts it uses: ``tree``, ``kv``, ``offload`` (the policy), ``waiting``, ``admitted``,
``nodes``, ``last_used``, ``_reading`` (the live branches' nodes), ``_rates`` and ``host_fallbacks``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from treegen.runtime.kv_host import HostMemoryError

logger = logging.getLogger(__name__)


@dataclass
class IdleNodes:
    """One admission pass's view of the KV that may leave the GPU: ``protected`` nodes (read by running or
    admitted work; it grows as jobs are admitted) and the others' eviction ``order``, sorted once a pass —
    the order of the nodes left does not change within it, so each eviction goes on from ``cursor``
    instead of listing and sorting every segment for each job (a CPU replay of a thousand-branch search short of
    memory, ``benchmarks/dynamic_schedule_cpu.py --kv-budget-mb``: 34.9 -> 8.7 ms a scheduling call)."""

    protected: set[int]
    order: list[int]
    cursor: int = 0
    # the evictions decided in this pass, carried out together at its end (one batched offload: see
    # Evictions._evict): node → to the host (True) or dropped (False), and the slots and host bytes they free
    evicting: dict[int, bool] = field(default_factory=dict)
    freed: int = 0
    host_bytes: int = 0


class Evictions:
    """Choosing idle nodes to evict and carrying the evictions out (see module doc)."""

    def _idle_nodes(self, taken) -> "IdleNodes":
        """The nodes that are not idle (read by live branches, admitted jobs, jobs taken this step) and the
        idle ones, those holding KV, in eviction order: nodes no waiting job reads, least recently used
        first; then those read by waiting jobs, the one read last first."""
        protected = {n for leaf in self._reading for n in self.tree.path(leaf)}
        for job in [*self.admitted, *(j for j, _ in taken)]:
            protected.update(self.nodes(job))
        first: dict[int, int] = {}  # each node a waiting job reads: the queue position of the first such job
        for i, job in enumerate(self.waiting):
            for n in self.nodes(job):
                first.setdefault(n, i)
        order = [n for n in self.kv.segments if n not in protected]
        order.sort(key=lambda n: (n in first, -first.get(n, 0), self.last_used.get(n, -1), n))
        return IdleNodes(protected, order)

    def _evict(self, deficit: int, idle: "IdleNodes", also: set[int], step) -> int | None:
        """Free at least ``deficit`` slots by moving idle nodes' KV to the host or dropping it (the
        policy decides per node), in ``idle``'s order, none of ``also`` (the nodes of the job admitted);
        None, moving nothing, when the idle nodes cannot free that much. Returns the slots freed."""
        kv, policy = self.kv, self.offload
        per = kv.bytes_per_token
        if policy.mode == "auto" and self._rates is None:
            self._rates = policy.rates()
        host_free = policy.host_bytes - kv.host_bytes - idle.host_bytes
        plan, freed = [], 0
        i = idle.cursor
        while i < len(idle.order) and freed < deficit:
            n = idle.order[i]
            i += 1
            seg = kv.segments.get(n)
            if seg is None or n in idle.evicting or n in idle.protected or n in also:
                continue  # moved already, or read by work admitted since the order was made, or by this job
            to_host = policy.to_host(seg.computed, seg.computed * per, host_free, self._rates,
                                     recomputable=not seg.dropped)
            if to_host is None:
                continue  # no room on the host, and recomputing is not allowed (or not exact)
            plan.append((n, to_host))
            freed += seg.capacity
            host_free -= seg.computed * per if to_host else 0
        if freed < deficit:
            return None
        # every node before ``i`` is moved now, or stays passed over for the rest of this admission pass
        # (protection only grows, the host's room only shrinks, and this job's nodes are protected next)
        idle.cursor = i
        for n, to_host in plan:
            idle.evicting[n] = to_host
            idle.host_bytes += kv.segments[n].computed * per if to_host else 0
        idle.freed += freed
        return freed

    def _carry_out(self, idle: "IdleNodes", step) -> None:
        """The evictions this admission pass decided, together: one offload call for every node going to the
        host (its copies batched: on an H100 host, Llama-3-8B short of memory made ~2,700 offload calls of a
        node or two, 1.8 s of host time while the GPU waited), then the drops."""
        to_host = [n for n, host in idle.evicting.items() if host]
        try:
            self.kv.offload(to_host)
        except HostMemoryError as e:
            left = [n for n in to_host if n in self.kv.segments]  # (those before it are on the host)
            if self.offload.mode != "auto" or any(self.kv.dropped(n) for n in left):
                raise  # ("host" keeps its promise; a node sparse window attention compacted cannot be recomputed)
            # the host has no more memory: this node and the rest are dropped and prefilled again when read, and
            # "auto" recomputes from now on (no host cap left; what is on the host comes back as it is read)
            logger.warning("treegen: offload to the host failed (%s); dropping %d nodes to recompute instead, and "
                           "recomputing from now on", e, len(left))
            self.offload = dataclasses.replace(self.offload, host_bytes=0)
            self.host_fallbacks += 1
            for n in left:
                idle.evicting[n] = False
            to_host = [n for n in to_host if n not in left]
        step.offloaded += to_host
        for n, host in idle.evicting.items():
            if not host:
                self.kv.drop(n)
                step.dropped.append(n)
