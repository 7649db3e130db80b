"""Kopf wiring: which events call which step of `reconcile`, and the Kopf settings.

Handlers are registered by `register(registry, settings)` rather than at import, so `main()` can build
a registry from its flags, and tests from their environment, while `kopf run -m inferscale.operator`
still finds them in the default registry (see __init__).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import kopf

from . import purge, reconcile
from .orphans import Sweeper
from .kube import Kube, api_client, connection_info
from .settings import FINALIZER, GROUP, PLURAL, VERSION, Settings

RESOURCE = (GROUP, VERSION, PLURAL)


def _lock(memo: kopf.Memo, body: Any) -> asyncio.Lock:
    # The timer runs concurrently with the change handlers of the same object (Kopf does not
    # serialise them): both write placements, so they take turns.
    key = body["metadata"].get("uid") or f"{body['metadata']['namespace']}/{body['metadata']['name']}"
    locks: dict[str, asyncio.Lock] = memo.locks
    return locks.setdefault(key, asyncio.Lock())


def register(registry: kopf.OperatorRegistry, cfg: Settings) -> kopf.OperatorRegistry:
    # A failed call (API hiccup, serving pod down) is retried soon, not after Kopf's default minute.
    backoff = max(cfg.job_poll_seconds, 1.0)

    def is_tenant(namespace: str | None, **_: Any) -> bool:
        # Tenants are an explicit allow-list: a UserMemory anywhere else gets no finalizer, no Job, no status write.
        return namespace is not None and reconcile.tenant_allowed(cfg, namespace)

    @kopf.on.login(registry=registry, retries=3, backoff=1)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(api_client())

    @kopf.on.startup(registry=registry, backoff=1)
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        # The namespaces to serve are the explicit tenant list: never list or watch namespaces cluster-wide (the chart
        # grants no such right), nor re-scan CRDs.
        settings.scanning.disabled = True
        # Progress and the diff base in annotations: the status schema is ours and has no `kopf` field.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="inferscale.io")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="inferscale.io")
        # Events are posted explicitly (kopf.info/warn); Kopf's own log lines are not turned into
        # Events, or every "waiting for Job" retry would post one.
        settings.posting.level = logging.INFO
        settings.posting.loggers = False
        # A deletion that lands while the recheck timer runs waits for the timer to exit before the finalizer goes;
        # Kopf re-checks that every 60 s by default, which held such a deletion up for a whole minute.
        settings.background.cancellation_polling = 1.0
        memo.cfg = cfg
        memo.kube = Kube(await asyncio.to_thread(api_client))
        memo.locks = {}
        # Objects gone without their finalizer (orphans.py): swept now, on every DELETED event, and periodically.
        memo.sweeper = Sweeper(cfg, memo.kube, logger)
        memo.sweep_task = asyncio.create_task(memo.sweeper.run(), name="inferscale-orphan-sweep")
        logger.info(f"inferscale operator: models={','.join(cfg.models)} image={cfg.encoder_image} "
                    f"tenants={','.join(cfg.tenants) or '(none)'} jobs in {cfg.job_namespace}")

    @kopf.on.resume(*RESOURCE, registry=registry, id="reconcile", backoff=backoff, when=is_tenant)
    @kopf.on.create(*RESOURCE, registry=registry, id="reconcile", backoff=backoff, when=is_tenant)
    @kopf.on.update(*RESOURCE, registry=registry, id="reconcile", backoff=backoff, field="spec",
                    when=is_tenant)
    async def on_change(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: logging.Logger,
                        **_: Any) -> None:
        async with _lock(memo, body):
            await reconcile.reconcile(memo.cfg, memo.kube, body, patch, logger)

    @kopf.on.delete(*RESOURCE, registry=registry, id="purge", backoff=backoff, when=is_tenant)
    async def on_delete(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: logging.Logger,
                        **_: Any) -> None:
        async with _lock(memo, body):
            await purge.purge(memo.cfg, memo.kube, body, patch, logger)

    def is_deletion(type: str | None, namespace: str | None, **_: Any) -> bool:
        # Only DELETED events call the handler (Kopf logs every call: one per status patch would be noise).
        return type == "DELETED" and is_tenant(namespace)

    @kopf.on.event(*RESOURCE, registry=registry, id="gone", when=is_deletion)
    async def on_event(memo: kopf.Memo, **_: Any) -> None:
        memo.sweeper.wake()  # with or without our purge: the sweeper finds out which, from the records

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        task = getattr(memo, "sweep_task", None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @kopf.timer(*RESOURCE, registry=registry, id="recheck", interval=cfg.recheck_seconds,
                initial_delay=cfg.recheck_seconds, when=is_tenant)
    async def on_timer(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: logging.Logger, retry: int,
                       **_: Any) -> None:
        if body["metadata"].get("deletionTimestamp"):
            return
        async with _lock(memo, body):
            # retry > 0: the last tick raised (e.g. TemporaryError "waiting for Job" of a reconcile it started).
            await reconcile.recheck(memo.cfg, memo.kube, body, patch, logger, retrying=retry > 0)

    return registry
