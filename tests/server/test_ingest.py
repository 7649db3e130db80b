"""An encode Job's delivery (``POST /internal/v1/ingest/{tenant}/{user}``): only its own upload credential, for
exactly its tenant and user and not expired, stores anything; every blob is verified before any is stored."""

from __future__ import annotations

import io
import tarfile
import time

import httpx
import pytest

from inferscale import sealing, uploadtoken
from inferscale.delivery import deliver
from inferscale.engine.template import MemoryItem
from inferscale.errors import BlobAuthError, InvalidInputError, TransferError
from inferscale.kvformat import SUFFIX, save_block
from inferscale.store.ingest import read_archive, write_archive

KEY = uploadtoken.upload_key("internal-secret")  # the live server's internal token (tests/server/conftest.py)


def _encode(tmp_path, tiny_engine, embedder, keyring=None, user="melanie"):
    out = tmp_path / "out"
    items = [MemoryItem("d1", "melanie keeps bees"), MemoryItem("d2", "melanie sails on sundays")]
    names = [save_block(b, out, keyring=keyring, tenant="globex" if keyring else None,
                        user=user if keyring else None).name
             for b in tiny_engine.encode(items, embed=embedder.embed)]
    return out, names


def _archive(out, names) -> bytes:
    buf = io.BytesIO()
    write_archive(out, names, buf)
    return buf.getvalue()


def _post(live, tenant, user, token, body: bytes):
    return httpx.post(f"{live.internal_url}/internal/v1/ingest/{tenant}/{user}", content=body, timeout=30,
                      headers={"Authorization": f"Bearer {token}"})


def test_a_job_delivers_its_blobs_and_they_serve(live, tiny_engine, embedder, tmp_path):
    out, names = _encode(tmp_path, tiny_engine, embedder)
    cred = tmp_path / "cred"
    cred.write_text(uploadtoken.mint(KEY, "globex", "melanie", "job-1", 60))
    cred.chmod(0o600)
    assert deliver(f"{live.internal_url}/internal/v1/ingest/globex/melanie", str(cred), out, names) == 2
    g = live.client("globex").chat.completions.create(model="gemma-3-270m", user="melanie", max_tokens=3,
                                                      messages=[{"role": "user", "content": "what are her hobbies?"}])
    assert g.model_extra["inferscale"]["items"]
    # The operator's pull afterwards (no peer, no dir on this pod) finds them held and answers the totals.
    r = httpx.post(live.internal_url + "/internal/v1/pull", headers={"Authorization": "Bearer internal-secret"},
                   json={"tenant": "globex", "user": "melanie", "items": ["d1", "d2"],
                         "source": {"node": "node-x", "dir": "/nowhere/globex/melanie", "peer": None}})
    assert r.status_code == 200 and r.json()["blocks"] == 2, r.text
    httpx.post(live.internal_url + "/internal/v1/purge", headers={"Authorization": "Bearer internal-secret"},
               json={"tenant": "globex", "user": "melanie", "items": None})


def test_a_credential_uploads_for_its_own_tenant_and_user_only(live, tiny_engine, embedder, tmp_path):
    out, names = _encode(tmp_path, tiny_engine, embedder)
    body = _archive(out, names)
    token = uploadtoken.mint(KEY, "globex", "melanie", "job-1", 60)
    for tenant, user in (("globex", "bob"), ("acme", "melanie")):
        r = _post(live, tenant, user, token, body)
        assert r.status_code == 403 and r.json()["error"]["code"] == "upload_not_permitted", r.text
    assert httpx.get(live.url + "/v1/memories/bob", headers=live.headers("globex")).status_code == 404
    assert httpx.get(live.url + "/v1/memories/melanie", headers=live.headers("acme")).status_code == 404


@pytest.mark.parametrize("token", [
    uploadtoken.mint(uploadtoken.upload_key("another-platform"), "globex", "melanie", "job-1", 60),  # forged
    uploadtoken.mint(KEY, "globex", "melanie", "job-1", 60, now=time.time() - 3600),  # expired
    "internal-secret",  # the internal token itself is no upload credential
    "isk-globex-key",  # nor a tenant key
    "isu1.e30.AAAA",  # nor a made-up one
])
def test_forged_expired_and_other_credentials_are_refused(live, tiny_engine, embedder, tmp_path, token):
    out, names = _encode(tmp_path, tiny_engine, embedder)
    r = _post(live, "globex", "melanie", token, _archive(out, names))
    assert r.status_code == 401, r.text
    assert httpx.get(live.url + "/v1/memories/melanie", headers=live.headers("globex")).status_code == 404


def test_an_upload_credential_opens_no_other_internal_route(live):
    token = uploadtoken.mint(KEY, "globex", "melanie", "job-1", 60)
    for path in ("/internal/v1/capacity", "/internal/v1/peers"):
        assert httpx.get(live.internal_url + path, headers={"Authorization": f"Bearer {token}"}).status_code == 401
    r = httpx.post(live.internal_url + "/internal/v1/purge", headers={"Authorization": f"Bearer {token}"},
                   json={"tenant": "globex", "user": "melanie", "items": None})
    assert r.status_code == 401


def test_a_delivery_over_the_limit_stores_nothing(live, tiny_engine, embedder, tmp_path, monkeypatch):
    out, names = _encode(tmp_path, tiny_engine, embedder)
    body = _archive(out, names)
    monkeypatch.setattr(live.settings, "ingest_max_bytes", 4096)
    token = uploadtoken.mint(KEY, "globex", "melanie", "job-1", 60)
    r = httpx.post(f"{live.internal_url}/internal/v1/ingest/globex/melanie", timeout=30,  # chunked: no length
                   content=iter([body[i:i + 1024] for i in range(0, len(body), 1024)]),
                   headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 413, r.text
    assert httpx.get(live.url + "/v1/memories/melanie", headers=live.headers("globex")).status_code == 404


def test_an_archive_with_a_link_or_a_path_is_refused(live, tmp_path):
    token = uploadtoken.mint(KEY, "globex", "melanie", "job-1", 60)
    for member in (tarfile.TarInfo("d1" + SUFFIX), tarfile.TarInfo("../acme/d1" + SUFFIX)):
        if not member.name.startswith(".."):
            member.type, member.linkname = tarfile.SYMTYPE, "/etc/passwd"
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.addfile(member, io.BytesIO(b""))
        r = _post(live, "globex", "melanie", token, buf.getvalue())
        assert r.status_code == 400 and r.json()["error"]["param"] == "body", r.text


def test_a_sealed_blob_for_another_user_is_refused_and_nothing_is_stored(tiny_engine, embedder, tmp_path):
    keyring = sealing.Keyring.from_text(sealing.new_key_line())
    out, names = _encode(tmp_path, tiny_engine, embedder, keyring, user="melanie")
    body = io.BytesIO(_archive(out, names))
    assert len(read_archive("globex", "melanie", body, keyring)) == 2
    with pytest.raises(BlobAuthError):
        read_archive("globex", "bob", io.BytesIO(body.getvalue()), keyring)
    with pytest.raises(InvalidInputError):
        read_archive("globex", "melanie", io.BytesIO(b"not a tar" * 100), keyring)


def test_deliver_fails_at_once_on_a_refusal(live, tiny_engine, embedder, tmp_path):
    out, names = _encode(tmp_path, tiny_engine, embedder)
    cred = tmp_path / "cred"
    cred.write_text(uploadtoken.mint(KEY, "globex", "melanie", "job-1", 60))
    cred.chmod(0o600)
    with pytest.raises(TransferError, match="403"):
        deliver(f"{live.internal_url}/internal/v1/ingest/globex/bob", str(cred), out, names)
