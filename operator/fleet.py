"""The operator's side of the fleet path: publish each serving pod's peers, and keep every tier clean.

- Peers: every serving pod is told the others' peer addresses (podIP + INFERSCALE_NIXL_PORT, from the pod's status)
  over the internal API, so a pod that lacks a user asks them in turn (inferscale/store/fleet.py). Only the operator sets
  them: the tenant-writable UserMemory status never names a peer to a server.
- Invalidation: after an edit, every pod outside the placement drops the user entirely (it may hold an on-demand
  copy of an older version) and fetches the current one on its next request; the placement pods are brought up to
  date by the pulls themselves.
- Items ConfigMaps (every memory text) are deleted once their Job is done, and any superseded one of the object;
  so are the Jobs' key Secrets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence

from .kube import Kube
from .servers import ServerCallError, ServerClient, ServingPod
from .settings import LABEL_OWNER_UID, LABEL_ROLE, Settings

# pod uid -> (the peer list last published to it, when): a recheck tick publishes only what changed, and again
# after REPUBLISH_SECONDS (a restarted container keeps its pod uid but forgot its peers).
_published: dict[str, tuple[list[str], float]] = {}
REPUBLISH_SECONDS = 120.0


def peers_of(pod: ServingPod, pods: Sequence[ServingPod]) -> list[str]:
    """The peer addresses a pod should ask: every other serving pod's, in a stable order."""
    others = {p.peer for p in pods if p.peer and (p.namespace, p.name) != (pod.namespace, pod.name)}
    return sorted(others - {pod.peer})


async def publish_peers(client: ServerClient, pods: Sequence[ServingPod], logger: logging.Logger,
                        force: bool = False) -> int:
    """Send each pod its peers when they changed since the last time; returns pods updated. A pod that fails is
    retried on the next call (a server from before the fleet path answers 404: logged, not fatal)."""
    async def one(pod: ServingPod) -> bool:
        peers = peers_of(pod, pods)
        key = pod.uid or f"{pod.namespace}/{pod.name}"
        last = _published.get(key)
        if not force and last is not None and last[0] == peers and time.monotonic() - last[1] < REPUBLISH_SECONDS:
            return False
        try:
            await client.set_peers(pod, peers)
        except ServerCallError as e:
            logger.warning(f"could not publish peers: {e}")
            return False
        _published[key] = (peers, time.monotonic())
        return True

    return sum(await asyncio.gather(*(one(p) for p in pods)))


async def drop_elsewhere(client: ServerClient, pods: Iterable[ServingPod], keep: set[str], tenant: str, user: str,
                         logger: logging.Logger) -> None:
    """Purge the user from every pod whose key is not in ``keep`` (on-demand copies of an older version)."""
    others = [p for p in pods if f"{p.namespace}/{p.name}" not in keep]
    results = await asyncio.gather(*(client.purge(p, tenant, user, None) for p in others), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            logger.warning(f"could not drop a stale copy: {r}")


def delete_items_configmaps(kube: Kube, cfg: Settings, uid: str, keep: str | None = None) -> int:
    """Delete the object's items ConfigMaps (memory texts) in the platform namespace, but ``keep``."""
    n = 0
    for cm in kube.list_configmaps(cfg.job_namespace, f"{LABEL_OWNER_UID}={uid},{LABEL_ROLE}=items"):
        name = (cm.get("metadata") or {}).get("name")
        if name and name != keep:
            kube.delete_configmap(cfg.job_namespace, name)
            n += 1
    return n


def delete_key_secrets(kube: Kube, cfg: Settings, uid: str) -> int:
    """Delete the object's Job key Secrets (its tenant's derived keys) once its Job is done.

    Only an operator with INFERSCALE_KEK_FILE makes such Secrets. Without one its Jobs share the platform namespace,
    whose Secrets are the platform's: there the operator has no right on Secrets (the chart grants none), so it
    lists none."""
    if not cfg.kek_file:
        return 0
    names = kube.list_secret_names(cfg.job_namespace, f"{LABEL_OWNER_UID}={uid},{LABEL_ROLE}=key")
    for name in names:
        kube.delete_secret(cfg.job_namespace, name)
    return len(names)
