"""What the handlers do: encode what changed, place the blocks, purge them. Level-based and idempotent.

Every step derives from the object as it is now (spec + status), never from the event that woke us, so
a handler killed at any point and called again does the remaining work only:
- "what is already encoded" is `status.encoded` ({id: {hash, node}}), written only after a Job
  succeeded, so a restart re-derives the same changed set, the same Job name, and gets 409;
- pulls and purges are idempotent on the serving pods.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import kopf

from inferscale import tenantkey, uploadtoken
from inferscale.sealing import Keyring

from . import fleet, jobs, placement, quota, records
from .kube import Kube
from .servers import ServerCallError, ServerClient, ServingPod, serving_pods
from .settings import Settings
from .spec import SpecError, parse
from .status import ENCODED, PLACED, READY, VALID, condition, not_ready, set_condition

Body = Mapping[str, Any]


@dataclasses.dataclass
class Placed:
    placements: list[dict[str, Any]]
    phase: str  # Ready or Degraded
    reason: str
    message: str
    tokens: int | None  # from the pulls made now; None when no pod reported it


async def reconcile(cfg: Settings, kube: Kube, body: Body, patch: kopf.Patch, logger: logging.Logger) -> None:
    meta = body["metadata"]
    tenant, name, gen = meta["namespace"], meta["name"], meta.get("generation")
    status: Mapping[str, Any] = body.get("status") or {}
    conds: list[dict[str, Any]] = list(status.get("conditions") or [])

    uid = str(meta.get("uid") or "")
    if not tenant_allowed(cfg, tenant):
        return  # not a tenant: never encoded, never written to (the handlers' filter already skips it)

    try:
        desired = await asyncio.to_thread(parse, body.get("spec") or {}, cfg.models,
                                          functools.partial(_read_ref, cfg, kube, tenant))
        record = await asyncio.to_thread(records.claim, kube, cfg, tenant, desired.user_id, name, uid)
    except SpecError as e:
        # Only the verdict changes: encoded items and placements stay, so the last good
        # version keeps serving until the user fixes the spec.
        prev = condition(conds, VALID) or {}
        again = (status.get("phase") == "Failed" and status.get("observedGeneration") == gen
                 and (prev.get("status"), prev.get("reason"), prev.get("message")) == ("False", e.reason, e.message))
        patch.status.update(phase="Failed", message=e.message, observedGeneration=gen,
                            conditions=not_ready(set_condition(conds, VALID, False, e.reason, e.message, gen),
                                                 e.reason, e.message, gen))
        if not again:  # a retry (the timer's, for a missing reference) that fails the same way posts no new Event
            kopf.warn(body, reason=e.reason, message=e.message)
        return
    conds = set_condition(conds, VALID, True, "SpecValid", f"{len(desired.items)} item(s)", gen)

    hashes = desired.item_hashes()
    chash = desired.content_hash()
    encoded = trusted_encoded(status.get("encoded") or {}, record)
    changed = sorted(i for i, h in hashes.items() if (encoded.get(i) or {}).get("hash") != h)
    removed = sorted(set(encoded) - set(hashes))
    job_ref: Mapping[str, Any] | None = status.get("job")

    if changed:
        jns = cfg.job_namespace
        jname = jobs.job_name(tenant, name, uid, chash, changed)
        live = await asyncio.to_thread(kube.read_job, jns, jname)
        if live is None:
            # Every item, in spec order (the changed ones are encoded behind the items before them), in a ConfigMap
            # made before the Job: one too large fails here, before any Job holds a GPU.
            items_cm = jobs.configmap_manifest(jname, cfg, tenant, name, uid, list(desired.items.values()))
            if jobs.configmap_bytes(items_cm) > jobs.CONFIGMAP_MAX_BYTES:
                msg = (f"the items file is {jobs.configmap_bytes(items_cm)} bytes, more than a ConfigMap holds "
                       f"({jobs.CONFIGMAP_MAX_BYTES}); encode fewer or shorter items per UserMemory")
                return _fail(patch, body, conds, gen, ENCODED, "ItemsTooLarge", msg)
            delivery = await _delivery(cfg, kube, tenant, desired.user_id, desired.node_selector,
                                       status.get("placements") or [])
            if delivery is None:  # the Job would have nowhere to deliver: no GPU is held until there is a pod
                return await _queued(cfg, body, patch, status, conds, gen, "no serving pod is ready to take the "
                                     "encoded blobs")
            credential = uploadtoken.mint(uploadtoken.upload_key(cfg.internal_token), tenant, desired.user_id, jname,
                                          int(cfg.encode_deadline_seconds) + jobs.CREDENTIAL_MARGIN_S)
            job = jobs.job_manifest(jname, tenant, name, uid, desired.user_id, desired.model, changed, cfg,
                                    delivery, credential)
            key = await asyncio.to_thread(_key_secret, cfg, jname, tenant, name, uid, credential)
            why = await asyncio.to_thread(quota.start_encode, kube, cfg, tenant, items_cm, job, key)
            if why:
                return await _queued(cfg, body, patch, status, conds, gen, why)
            kopf.info(body, reason="EncodeStarted", message=f"Job {jname} encodes {len(changed)} item(s)")
            live = await asyncio.to_thread(kube.read_job, jns, jname)
            if live is not None and jobs.made_by_us(live, cfg, tenant, uid, "encode"):
                await asyncio.to_thread(kube.patch_configmap, jns, jname, jobs.owner_reference(live))
                if key is not None:
                    await asyncio.to_thread(kube.patch_secret, jns, jname, jobs.owner_reference(live))
        if live is None:  # deleted right behind our back: the next try re-creates it
            raise kopf.TemporaryError(f"Job {jname} vanished", delay=cfg.job_poll_seconds)
        if not jobs.made_by_us(live, cfg, tenant, uid, "encode"):
            msg = f"Job {jns}/{jname} exists but was not created by the operator for this UserMemory; not trusted"
            return _fail(patch, body, conds, gen, ENCODED, "ForeignJob", msg)
        phase, why = jobs.job_phase(live)
        job_ref = {"name": jname, "items": len(changed), "phase": phase}
        if phase == "Running":
            msg = f"Job {jname} encodes {len(changed)} item(s)"
            update_changed(patch, status, phase="Encoding", message=msg, job=job_ref,
                           conditions=set_condition(conds, ENCODED, False, "Encoding", msg, gen))
            raise kopf.TemporaryError(f"waiting for Job {jname}", delay=cfg.job_poll_seconds)
        # The Job is done with its items file: no ConfigMap of memory texts outlives it (nor any older one).
        await asyncio.to_thread(fleet.delete_items_configmaps, kube, cfg, uid)
        await asyncio.to_thread(fleet.delete_key_secrets, kube, cfg, uid)
        if phase == "Failed":
            return _fail(patch, body, conds, gen, ENCODED, "EncodeJobFailed", f"Job {jname} failed: {why}", job=job_ref)
        holder, node = jobs.delivered_to(live)  # the operator's own annotations on a Job it made
        record = await asyncio.to_thread(records.add_node, kube, cfg, record, node)
        job_ref = {**job_ref, "node": node, "pod": holder}
        for i in changed:
            encoded[i] = {"hash": hashes[i], "node": node, "pod": holder}
        kopf.info(body, reason="Encoded", message=f"Job {jname} encoded {len(changed)} item(s) and delivered them "
                                                  f"to {holder or '?'}")
    for i in removed:
        encoded.pop(i, None)
    conds = set_condition(conds, ENCODED, True, "Encoded", f"{len(encoded)} item(s) encoded", gen)

    placed = await place(cfg, kube, body, desired.user_id, desired.replicas, desired.node_selector,
                         encoded, set(changed), removed, status.get("placements") or [], logger)
    counts = dict(status.get("counts") or {})
    patch.status.update(
        phase=placed.phase, message=placed.message, observedGeneration=gen, contentHash=chash,
        model=desired.model, job=dict(job_ref) if job_ref else None,
        # Merge-patch semantics: a key set to None is deleted from the map.
        encoded={**{i: None for i in removed}, **encoded},
        **placed_fields(placed, len(encoded), counts),
        conditions=_placed_conditions(conds, placed, gen),
    )


def _key_secret(cfg: Settings, jname: str, tenant: str, cr_name: str, uid: str,
                credential: str) -> dict[str, Any] | None:
    """The Job's Secret of its tenant's derived keys and its upload credential (with INFERSCALE_KEK_FILE), else None
    (the Jobs then run beside the platform's Secrets, where the operator may create none)."""
    if not cfg.kek_file:
        return None
    tenant_keys = tenantkey.derive_text(Keyring.load(cfg.kek_file), tenant)
    return jobs.key_secret_manifest(jname, cfg, tenant, cr_name, uid, tenant_keys, credential)


async def _delivery(cfg: Settings, kube: Kube, tenant: str, user: str, node_selector: Mapping[str, str],
                    previous: Sequence[Mapping[str, Any]]) -> jobs.Delivery | None:
    """The serving pod a new encode Job delivers to: one already holding the user if any (placement stays put),
    else the placement's first choice among the ready pods on the user's nodes; None when there is none."""
    _, candidates = await _serving(cfg, kube, node_selector)
    chosen = placement.choose(1, candidates, [_prev_key(e) for e in previous], {})
    if not chosen:
        return None
    pod = chosen[0]
    tls = cfg.tls
    return jobs.Delivery(f"{pod.endpoint}/internal/v1/ingest/{tenant}/{user}", placement.pod_key(pod), pod.node,
                         *(("", "") if tls is None else (tls.ca_file.read_text(), tls.server_name)))


def _fail(patch: kopf.Patch, body: Body, conds: list[dict[str, Any]], gen: int | None, cond: str, reason: str,
          msg: str, **fields: Any) -> None:
    """Failed at this generation for `reason` (condition `cond` False, not Ready), with a Warning Event."""
    patch.status.update(phase="Failed", message=msg, observedGeneration=gen, **fields,
                        conditions=not_ready(set_condition(conds, cond, False, reason, msg, gen), reason, msg, gen))
    kopf.warn(body, reason=reason, message=msg)


async def _queued(cfg: Settings, body: Body, patch: kopf.Patch, status: Mapping[str, Any],
                  conds: list[dict[str, Any]], gen: int | None, why: str) -> None:
    """The tenant's encode bound is reached (quota.py): Pending, a Warning when it starts waiting, retried later."""
    msg = f"waiting to encode: {why}"
    if (condition(conds, ENCODED) or {}).get("reason") != "EncodeQueued":
        kopf.warn(body, reason="EncodeQueued", message=msg)
    update_changed(patch, status, phase="Pending", message=msg,
                   conditions=set_condition(conds, ENCODED, False, "EncodeQueued", msg, gen))
    # Not every job poll: a queue of many objects would list the tenant's Jobs many times a second.
    raise kopf.TemporaryError(msg, delay=max(cfg.job_poll_seconds, cfg.recheck_seconds))


def trusted_encoded(encoded: Mapping[str, Any], record: records.UserRecord) -> dict[str, dict[str, str]]:
    """`status.encoded` with each item's node kept only when the operator's record has it (the status is writable by
    the tenant: a forged node must not pick where a pull is sourced from)."""
    out: dict[str, dict[str, str]] = {}
    for item, entry in encoded.items():
        entry = dict(entry or {})
        if entry.get("node") not in record.nodes:
            # The only node the user's Jobs ran on is where this item is; with several, unknown.
            entry["node"] = record.nodes[0] if len(record.nodes) == 1 else ""
        out[item] = entry
    return out


def tenant_allowed(cfg: Settings, namespace: str) -> bool:
    """Tenants are an explicit allow-list (INFERSCALE_TENANTS); the platform namespace is never one."""
    return namespace in cfg.tenants and namespace != cfg.job_namespace


def _read_ref(cfg: Settings, kube: Kube, tenant: str, kind: str, name: str, key: str) -> str:
    if kind == "Secret" and not cfg.read_tenant_secrets:
        # The operator reads no Secret on a tenant's behalf unless the platform team enabled it (and granted it).
        raise SpecError("SecretsNotEnabled", f"spec.memoriesFrom.secretKeyRef ({name}) is disabled on this platform "
                                             "(INFERSCALE_READ_TENANT_SECRETS); use configMapKeyRef or memories")
    return kube.read_key(tenant, kind, name, key)


def update_changed(patch: kopf.Patch, status: Mapping[str, Any], **fields: Any) -> None:
    """Patch only the status fields that differ: a retry loop then writes nothing new."""
    for k, v in fields.items():
        if status.get(k) != v:
            patch.status[k] = v


def placed_fields(placed: Placed, items: int, counts: Mapping[str, Any]) -> dict[str, Any]:
    tokens = placed.tokens if placed.tokens is not None else int(counts.get("tokens") or 0)
    size = max((int(p.get("bytes") or 0) for p in placed.placements), default=0)
    return {
        "placements": placed.placements,
        "nodes": ",".join(sorted({p["node"] for p in placed.placements})),
        "counts": {"items": items, "tokens": tokens, "bytes": size},
    }


def _placed_conditions(conds: list[dict[str, Any]], placed: Placed, gen: int | None) -> list[dict[str, Any]]:
    ok = placed.phase == "Ready"
    conds = set_condition(conds, PLACED, ok, placed.reason, placed.message, gen)
    return set_condition(conds, READY, ok, placed.reason, placed.message, gen)


async def _serving(cfg: Settings, kube: Kube, node_selector: Mapping[str, str]) -> tuple[list[ServingPod], list[ServingPod]]:
    """(all serving pods, those on nodes matching the user's node selector)."""
    raw = await asyncio.to_thread(kube.list_pods, cfg.server_namespace, cfg.server_selector)
    pods = serving_pods(raw, cfg.internal_port, nixl_port=cfg.nixl_port, scheme=cfg.internal_scheme)
    if not node_selector:
        return pods, pods
    labels: dict[str, dict[str, str] | None] = {}
    for node in sorted({p.node for p in pods}):
        labels[node] = await asyncio.to_thread(kube.node_labels, node)
    return pods, [p for p in pods if (lab := labels.get(p.node)) is not None
                  and all(lab.get(k) == v for k, v in node_selector.items())]


def _prev_key(entry: Mapping[str, Any]) -> str:
    return placement.key(str(entry.get("namespace") or ""), str(entry.get("pod") or ""))


def holds(entry: Mapping[str, Any] | None, pod: ServingPod) -> bool:
    """Whether a recorded placement still describes this pod (same uid: not a recreated namesake)."""
    return entry is not None and (not entry.get("uid") or not pod.uid or entry.get("uid") == pod.uid)


async def place(cfg: Settings, kube: Kube, body: Body, user: str, replicas: int, node_selector: Mapping[str, str],
                encoded: Mapping[str, Mapping[str, str]], changed: set[str], removed: Sequence[str],
                previous: Sequence[Mapping[str, Any]], logger: logging.Logger) -> Placed:
    """Bring the chosen serving pods up to date and return the new placement.

    A pod that already held the user gets only `changed` items (and a purge of `removed`); a new one
    gets everything encoded. A pod that fails a call is skipped and another one chosen.
    """
    tenant = body["metadata"]["namespace"]
    all_pods, candidates = await _serving(cfg, kube, node_selector)
    prev = {_prev_key(e): e for e in previous}
    everyone = {placement.pod_key(p): p for p in all_pods}
    tokens: int | None = None

    async with ServerClient(cfg) as client:
        await fleet.publish_peers(client, all_pods, logger)
        caps = await asyncio.gather(*(client.capacity(p) for p in candidates), return_exceptions=True)
        usable: list[ServingPod] = []
        free: dict[str, int] = {}
        for pod, cap in zip(candidates, caps):
            if isinstance(cap, BaseException):
                logger.warning(f"skipping serving pod {pod.namespace}/{pod.name}: {cap}")
                continue
            usable.append(pod)
            free[placement.pod_key(pod)] = placement.free_from_capacity(cap)

        def source(node: str, holder: str, target: ServingPod) -> dict[str, Any]:
            # The pod the Job delivered to holds the blobs (no peer: it answers from its store); any other pod
            # fetches them from it over NIXL, else from another pod that holds the user.
            if placement.pod_key(target) == holder or (not holder and node == target.node):
                return {"node": node, "peer": None}
            held = everyone.get(holder)
            if held is None or held.node != node:  # gone, or not on the node the operator's record has
                held = next((p for k, p in everyone.items() if k in prev and holds(prev[k], p) and p != target),
                            None)
            return {"node": node, "peer": held.peer if held is not None else None}

        async def sync(pod: ServingPod) -> dict[str, Any]:
            nonlocal tokens
            held = prev.get(placement.pod_key(pod))
            fresh = not holds(held, pod)
            if not fresh and removed:
                await client.purge(pod, tenant, user, list(removed))
            ids = sorted(encoded) if fresh else sorted(changed & set(encoded))
            # `peer`: where other pods pull this user from (informational: servers never read the status).
            entry: dict[str, Any] = {"node": pod.node, "pod": pod.name, "namespace": pod.namespace, "uid": pod.uid,
                                     **({"peer": pod.peer} if pod.peer else {}),
                                     "tier": (held or {}).get("tier", "dram"), "bytes": int((held or {}).get("bytes") or 0)}
            groups: dict[tuple[str, str], list[str]] = {}
            for i in ids:
                groups.setdefault((encoded[i].get("node", ""), str(encoded[i].get("pod") or "")), []).append(i)
            for (node, holder), group in sorted(groups.items()):
                resp = await client.pull(pod, tenant, user, source(node, holder, pod), group)
                entry["tier"] = resp.get("tier") or entry["tier"]
                entry["bytes"] = int(resp.get("bytes") or 0)
                if isinstance(resp.get("tokens"), int):
                    tokens = max(tokens or 0, resp["tokens"])
            if fresh and not ids:
                entry["bytes"] = 0
            return entry

        done: dict[str, dict[str, Any]] = {}
        excluded: set[str] = set()
        # The pods the Jobs delivered to hold the blobs already: they stay chosen behind the current placement.
        current = [*prev, *(h for h in sorted({str(e.get("pod") or "") for e in encoded.values()})
                            if h in everyone and h not in prev)]
        while True:
            chosen = placement.choose(replicas, [p for p in usable if placement.pod_key(p) not in excluded],
                                      current, free)
            pending = [p for p in chosen if placement.pod_key(p) not in done]
            if not pending:
                break
            for pod in pending:
                try:
                    done[placement.pod_key(pod)] = await sync(pod)
                except ServerCallError as e:
                    excluded.add(placement.pod_key(pod))
                    kopf.warn(body, reason="PullFailed", message=str(e))

        # Pods that held the user but are no longer chosen: drop the blocks there.
        chosen_keys = {placement.pod_key(p) for p in chosen}
        if changed or removed:  # any other pod may hold an on-demand copy of the old version: it refetches
            await fleet.drop_elsewhere(client, all_pods, chosen_keys | set(prev), tenant, user, logger)
        for k, entry in prev.items():
            pod = everyone.get(k)
            if k not in chosen_keys and pod is not None and holds(entry, pod):
                try:
                    await client.purge(pod, tenant, user, None)
                except ServerCallError as e:
                    logger.warning(f"could not purge the dropped placement: {e}")

    placements = [done[placement.pod_key(p)] for p in chosen]
    if len(placements) >= replicas:
        phase, reason = "Ready", "Placed"
    elif not candidates:
        phase, reason = "Degraded", "NoServingPods"
    else:
        phase, reason = "Degraded", "InsufficientReplicas"
    message = f"{len(placements)}/{replicas} replica(s) on {', '.join(p['pod'] for p in placements) or 'no pod'}"
    if [_prev_key(e) for e in previous] != [placement.key(p["namespace"], p["pod"]) for p in placements]:
        kopf.info(body, reason="Placed", message=message)
    return Placed(placements, phase, reason, message, tokens)


# Failures the cluster can fix without a spec change (the ConfigMap/Secret or key is created, or labelled as a memories
# source, later): the timer retries. DuplicateUserId too: once the object holding the userId is deleted, the next tick
# lets this one claim it.
RETRIED_REASONS = frozenset({"ReferenceNotFound", "ReferenceNotOptedIn", "DuplicateUserId"})


def waits_for_reference(body: Body) -> bool:
    """Failed at the current generation because a referenced ConfigMap/Secret (or its key) is missing."""
    status: Mapping[str, Any] = body.get("status") or {}
    valid = condition(status.get("conditions"), VALID) or {}
    return (status.get("phase") == "Failed" and status.get("observedGeneration") == body["metadata"].get("generation")
            and valid.get("status") == "False" and valid.get("reason") in RETRIED_REASONS)


async def recheck(cfg: Settings, kube: Kube, body: Body, patch: kopf.Patch, logger: logging.Logger,
                  retrying: bool = False) -> None:
    """The timer. Failed for a missing reference: reconcile again (every tick, i.e. every INFERSCALE_RECHECK_SECONDS),
    so creating the ConfigMap/Secret later brings it to Ready. Settled: if a serving pod holding the user is gone,
    go Degraded, then re-place.

    `retrying`: the previous tick raised. A reconcile started here that is still Encoding raised "waiting for Job",
    and no change handler follows that Job: the timer keeps reconciling until it is done.
    """
    meta, spec = body["metadata"], body.get("spec") or {}
    status: Mapping[str, Any] = body.get("status") or {}
    if waits_for_reference(body) or (retrying and status.get("phase") in ("Encoding", "Pending")):
        await reconcile(cfg, kube, body, patch, logger)
        return
    # Only settled objects: while a change is being handled, the change handler owns the placement.
    if status.get("phase") not in ("Ready", "Degraded") or status.get("observedGeneration") != meta.get("generation"):
        return
    tenant, name, gen = meta["namespace"], meta["name"], meta.get("generation")
    placement_spec = spec.get("placement") or {}
    replicas = int(placement_spec.get("replicas") or 1)
    selector = dict(placement_spec.get("nodeSelector") or {})
    previous = list(status.get("placements") or [])
    every, serving_here = await _serving(cfg, kube, selector)
    async with ServerClient(cfg) as client:  # a new or restarted pod learns its peers within a tick
        await fleet.publish_peers(client, every, logger)
    alive = {placement.pod_key(p): p for p in serving_here}
    kept = [e for e in previous if (pod := alive.get(_prev_key(e))) is not None and holds(e, pod)]
    lost = [e for e in previous if e not in kept]
    if not lost and len(kept) >= replicas:
        return
    conds = list(status.get("conditions") or [])
    if lost:
        msg = f"serving pod(s) gone: {', '.join(str(e.get('pod')) for e in lost)}; re-placing"
        conds = set_condition(conds, PLACED, False, "PodLost", msg, gen)
        conds = set_condition(conds, READY, False, "PodLost", msg, gen)
        # Written at once (not via `patch`, which lands when the handler returns) so that
        # the Degraded state is visible while re-placing.
        await asyncio.to_thread(kube.patch_status, tenant, name,
                                {"phase": "Degraded", "message": msg, "conditions": conds,
                                 "placements": kept, "nodes": ",".join(sorted({str(e.get("node")) for e in kept}))})
        kopf.warn(body, reason="PodLost", message=msg)
    record = await asyncio.to_thread(records.find_own, kube, cfg, tenant, str(meta.get("uid") or ""))
    if record is None or record.user_id != spec.get("userId"):
        return  # not this object's user (never claimed, or a changed id the next reconcile refuses)
    encoded = trusted_encoded(status.get("encoded") or {}, record)
    placed = await place(cfg, kube, body, str(spec.get("userId")), replicas, selector, encoded, set(), [], kept, logger)
    patch.status.update(phase=placed.phase, message=placed.message,
                        **placed_fields(placed, len(encoded), status.get("counts") or {}),
                        conditions=_placed_conditions(conds, placed, gen))
