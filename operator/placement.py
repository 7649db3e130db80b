"""Choosing which serving pods hold a user's blocks. Pure: the handler gathers the inputs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from .servers import ServingPod


def key(namespace: str, name: str) -> str:
    return f"{namespace}/{name}"


def pod_key(pod: ServingPod) -> str:
    return key(pod.namespace, pod.name)


def choose(replicas: int, candidates: Sequence[ServingPod], current: Sequence[str],
           free_bytes: Mapping[str, int]) -> list[ServingPod]:
    """Pick `replicas` pods.

    1. Pods of the current placement that are still candidates stay (a stable placement means no
       needless pulls and no cold caches).
    2. The rest are filled one by one: first a node that holds no replica yet (a node loss then costs
       one replica, not all), then the most free capacity (unknown capacity counts as none), then by
       name so the choice is deterministic.
    """
    by_key = {pod_key(p): p for p in candidates}
    chosen: list[ServingPod] = [by_key[k] for k in dict.fromkeys(current) if k in by_key][:replicas]
    taken = {pod_key(p) for p in chosen}
    per_node = Counter(p.node for p in chosen)
    rest = [p for p in candidates if pod_key(p) not in taken]
    while len(chosen) < replicas and rest:
        best = min(rest, key=lambda p: (per_node[p.node], -free_bytes.get(pod_key(p), 0), p.node, p.name))
        rest.remove(best)
        chosen.append(best)
        per_node[best.node] += 1
    return chosen


def free_from_capacity(capacity: Mapping[str, object]) -> int:
    used, cap = capacity.get("bytes_used"), capacity.get("bytes_capacity")
    if isinstance(used, int) and isinstance(cap, int):
        return max(cap - used, 0)
    return 0
