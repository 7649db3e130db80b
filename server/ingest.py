"""``POST /internal/v1/ingest/{tenant}/{user}``: an encode Job delivers its sealed blobs to this pod
(docs/interfaces.md, "Serving pod internal API"). Bearer: the Job's upload credential (inferscale/uploadtoken.py),
minted by the operator for exactly this tenant, user and Job, never the internal token.

The body is a tar archive of ``<item><SUFFIX>`` blobs (inferscale/store/ingest.py), streamed into a spool file
and counted against ``INFERSCALE_INGEST_MAX_BYTES`` (413 past it, nothing stored); every blob is opened under
the tenant's key, bound to this tenant, user and item, before any is stored.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable

from fastapi import APIRouter, Request

from inferscale import uploadtoken
from inferscale.server.auth import bearer
from inferscale.server.httperrors import ApiError
from inferscale.server.internal import pod_tier
from inferscale.server.schemas import ErrorBody, PullResult
from inferscale.store.ingest import read_archive

router = APIRouter(prefix="/internal/v1", tags=["internal"],
                   responses={s: {"model": ErrorBody} for s in (400, 401, 403, 413)})
SPOOL_IN_MEMORY = 8 << 20  # beyond this a delivery spools to /tmp


def upload_checker(internal_token: str) -> Callable[[str, str, str | None], None]:
    """The check of a delivery's credential against the path's tenant and user (the guard's and the route's)."""
    key = uploadtoken.upload_key(internal_token)

    def check(tenant: str, user: str, token: str | None) -> None:
        uploadtoken.verify(key, token, tenant, user)

    return check


@router.post("/ingest/{tenant}/{user}", response_model=PullResult)
async def ingest(tenant: str, user: str, request: Request) -> PullResult:
    """Store the delivered blobs as this user's current versions on this pod (disk and DRAM). All or nothing."""
    st = request.app.state
    upload_checker(st.settings.internal_token or "")(tenant, user, bearer(request))  # again: not only the guard's
    t0, limit = time.perf_counter(), st.settings.ingest_max_bytes
    with tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY) as spool:
        total = 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise ApiError(413, f"delivery over {limit} bytes (INFERSCALE_INGEST_MAX_BYTES)",
                               code="request_too_large")
            spool.write(chunk)
        spool.seek(0)
        images = await asyncio.to_thread(read_archive, tenant, user, spool, st.store.keyring)
    result = await asyncio.to_thread(st.store.import_images, tenant, user, images, t0)
    await asyncio.to_thread(st.fleet.forget, tenant, user)  # a peer index cached here predates this version
    return PullResult(tenant=tenant, user=user, blocks=result.total_blocks, bytes=result.total_bytes,
                      tokens=result.total_tokens, tier=pod_tier(st))
