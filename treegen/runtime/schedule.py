"""Planning KV memory for a batch of generation requests, and grouping them when it does not fit.

Before anything runs, the KV a batch needs is known from the tree: every node on the requests' paths
that has no KV yet, plus each generating branch's prompt run and ``max_tokens``. When that exceeds the
budget, requests are run in groups, in tree order (so the branches of one subtree run together), and
after a group its branches' KV — and any shared node no later group reads — is freed. Grouping is only
possible for *final* requests (the branch takes no more text afterwards, e.g. the last ``gen`` of a
finished program): otherwise their KV must outlive the group, and a clear MemoryError is raised
before anything runs. A workload never runs out of memory half way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVBudget:
    """Bytes the KV cache may use in all (``None``: no limit, e.g. on the CPU) and per token."""

    total_bytes: int | None
    bytes_per_token: int


def request_slots(tree, kv, gens, scores) -> dict[int, int]:
    """Slots each node needs for these requests: unallocated path nodes, and every gen's reservation."""
    need = {n: len(tree.tokens(n)) for w in [g.node for g in gens] + [c for s in scores for c in s.choices]
            for n in tree.path(w) if n not in kv.segments}
    for g in gens:
        need[g.node] = len(tree.tokens(g.node)) + g.params.max_tokens
    return need


def schedule(tree, kv, gens: list, scores: list, budget: KVBudget) -> list[list]:
    """Split ``gens`` into groups that each fit the budget (scores go with the first group).

    Returns ``[gens]`` when everything fits. Raises MemoryError naming the sizes otherwise, when the
    requests are not all final or when one request alone does not fit.
    """
    need = request_slots(tree, kv, gens, scores)
    if budget.total_bytes is None:
        return [list(gens)]
    held = kv.bytes_reserved()
    room = budget.total_bytes - held
    total = sum(need.values()) * budget.bytes_per_token
    if total <= room:
        return [list(gens)]
    if not all(g.final for g in gens) or scores:
        raise MemoryError(
            f"these requests need {total / 2**30:.2f} GiB of KV and {room / 2**30:.2f} GiB is left of the "
            f"budget; they cannot run in groups because their branches continue afterwards"
        )
    def cost(g, counted: set[int]) -> dict[int, int]:
        """Slots ``g`` adds to a group that already counts the nodes ``counted``."""
        extra = {n: len(tree.tokens(n)) for n in tree.path(g.node) if n not in kv.segments and n not in counted}
        extra[g.node] = len(tree.tokens(g.node)) + g.params.max_tokens
        return extra

    groups: list[list] = [[]]
    counted: set[int] = set()
    slots = 0
    for g in sorted(gens, key=lambda g: g.node):
        extra = cost(g, counted)
        if sum(cost(g, set()).values()) * budget.bytes_per_token > room:
            raise MemoryError(f"one branch needs {sum(cost(g, set()).values()) * budget.bytes_per_token / 2**30:.2f} "
                              f"GiB of KV, more than the {room / 2**30:.2f} GiB left of the budget")
        if groups[-1] and (slots + sum(extra.values())) * budget.bytes_per_token > room:
            # a new group counts its shared path nodes again: a safe over-estimate, since those
            # nodes stay allocated while later groups read them
            groups.append([])
            counted, slots = set(), 0
            extra = cost(g, counted)
        groups[-1].append(g)
        counted |= set(extra)
        slots += sum(extra.values())
    return groups


def release_after(tree, kv, done: list, later: list) -> None:
    """Free the KV of finished final requests ``done`` and of every node on their paths that no
    request in ``later`` groups reads."""
    keep = {n for g in later for n in tree.path(g.node)}
    for g in done:
        for n in tree.path(g.node):
            if n not in keep:
                kv.free(n)
