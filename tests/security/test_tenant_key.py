"""Issue 24 #2: an encode Job's key seals its tenant's blobs and nothing else (inferscale/tenantkey.py)."""

from __future__ import annotations

import pytest

from inferscale.errors import BlobAuthError, ConfigError
from inferscale.sealing import Binding, Keyring, new_key_line, open_blob, seal
from inferscale.tenantkey import derive_text, from_text

FP = "fp-1"


def _fleet() -> Keyring:
    return Keyring.from_text(new_key_line("k2") + new_key_line("k1"))


def test_a_tenant_key_seals_what_the_fleet_kek_opens_and_holds_no_kek() -> None:
    fleet = _fleet()
    text = derive_text(fleet, "acme")
    tenant = from_text(text, "tenant-key")
    assert tenant.current == "k2" and tenant.tenant == "acme"
    for kek in fleet.keys.values():
        assert kek not in tenant.keys.values(), "the file holds derived keys, never a KEK"
    blob = seal(b"acme's kv", tenant, Binding("acme", "alice", "m1", FP))
    assert bytes(open_blob(blob, fleet, tenant="acme", user="alice", item="m1", fingerprint=FP)) == b"acme's kv"
    # ...and what the fleet seals for this tenant, the Job's key opens (a re-encode reads nothing, but it could).
    back = seal(b"x", fleet, Binding("acme", "bob", "m2", FP))
    assert bytes(open_blob(back, tenant, tenant="acme", user="bob", item="m2", fingerprint=FP)) == b"x"


def test_a_tenant_key_neither_seals_nor_opens_another_tenants_blobs() -> None:
    fleet = _fleet()
    acme = from_text(derive_text(fleet, "acme"), "tenant-key")
    other = seal(b"globex secret", fleet, Binding("globex", "carol", "m1", FP))
    with pytest.raises((ConfigError, BlobAuthError)):
        open_blob(other, acme, tenant="globex", user="carol", item="m1", fingerprint=FP)
    with pytest.raises(ConfigError, match="tenant 'acme'"):
        seal(b"forged", acme, Binding("globex", "carol", "m1", FP))
    # Relabelling the file does not help: its keys are acme's, so globex's blobs still do not open.
    relabelled = from_text(derive_text(fleet, "acme").replace("tenant=acme", "tenant=globex", 1), "forged")
    with pytest.raises(BlobAuthError):
        open_blob(other, relabelled, tenant="globex", user="carol", item="m1", fingerprint=FP)
