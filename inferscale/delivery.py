"""An encode Job's last step: deliver the blobs it wrote (in its own emptyDir) to the serving pod the operator
chose, ``POST <url>`` = ``http://<pod>:<internal port>/internal/v1/ingest/<tenant>/<user>``, with the Job's
upload credential (inferscale/uploadtoken.py, a mounted file) as the bearer. The body is one tar archive
(inferscale/store/ingest.py) streamed from a temp file; a refusal (4xx) fails at once, an unreachable or busy
pod is retried a few times, then the Job fails (the operator re-creates it after an edit, or its deadline)."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx

from inferscale.errors import ConfigError, TransferError
from inferscale.fleettls import FleetTls
from inferscale.secretfile import read_secret
from inferscale.store.ingest import write_archive

ATTEMPTS = 4
CHUNK = 1 << 20


def _chunks(f: IO[bytes]) -> Iterator[bytes]:
    f.seek(0)
    while chunk := f.read(CHUNK):
        yield chunk


def deliver(url: str, credential_file: str, directory: Path, names: list[str], tls: FleetTls | None = None,
            timeout_s: float = 300.0) -> int:
    """Upload `names` (blob files of `directory`) to `url`; the pod's answer's block count (the user's total).
    With `tls` the URL must be https and the pod's certificate is checked against the fleet CA for its name."""
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--deliver {url!r}: expected an http(s) URL of a serving pod's ingest route")
    if tls is not None and not url.startswith("https://"):
        raise ConfigError(f"--deliver {url!r}: TLS is configured (--tls-ca-file), so the URL must be https")
    verify = True if tls is None else tls.client_context()
    extensions = {} if tls is None else {"sni_hostname": tls.server_name}
    token = read_secret(credential_file, "--upload-credential-file")
    with tempfile.TemporaryFile() as archive, httpx.Client(timeout=timeout_s, verify=verify) as client:
        write_archive(directory, names, archive)
        for attempt in range(ATTEMPTS):
            try:
                r = client.post(url, content=_chunks(archive), extensions=extensions,
                                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/x-tar",
                                         "Content-Length": str(archive.seek(0, 2))})
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e}"
            else:
                if r.status_code == 200:
                    return int(r.json().get("blocks") or 0)
                why = f"HTTP {r.status_code}: {r.text[:300]}"
                if r.status_code < 500 and r.status_code != 429:
                    raise TransferError(f"delivery to {url} refused: {why}")
            time.sleep(min(2 ** attempt, 8))
    raise TransferError(f"delivery to {url} failed {ATTEMPTS} times; last: {why}")
