"""A tenant's key file: the wrapping keys HKDF(KEK, tenant) of one tenant, pre-derived, without the KEK itself.

An encode Job seals one tenant's user's blobs; it needs the tenant's wrapping key under the current KEK id, never the
fleet-wide KEK, from which every tenant's key follows. The operator derives the tenant's keys (`derive_text`) and
hands the Job this file; HKDF is one-way, so the file opens and seals that tenant's blobs and nothing else: a blob of
another tenant is wrapped under a key the file does not hold, and asking it for one is a ConfigError.

Format: a first line `tenant=<name>`, then `<key-id>:<base64 of the 32-byte wrapping key>` a line, current first (the
KEK file's order). `load_for` reads either this or a KEK file, so `inferscale encode --kek-file` takes both.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from pathlib import Path

from inferscale.errors import ConfigError
from inferscale.sealing import Keyring
from inferscale.secretfile import read_secret

_HEADER = "tenant="


@dataclass
class TenantKeyring(Keyring):
    """Wrapping keys of `tenant` only, by KEK id (`keys` holds them in place of KEKs)."""

    tenant: str = ""

    def wrapping_key(self, kid: str, tenant: str) -> bytes:
        if tenant != self.tenant:
            raise ConfigError(f"key file {self.source} holds tenant {self.tenant!r}'s keys only, not {tenant!r}'s")
        return self.keys[kid]


def derive_text(keyring: Keyring, tenant: str) -> str:
    """The tenant key file for `tenant` under every KEK of `keyring`, current first."""
    lines = [f"{_HEADER}{tenant}\n"]
    lines += [f"{kid}:{base64.b64encode(keyring.wrapping_key(kid, tenant)).decode()}\n" for kid in keyring.keys]
    return "".join(lines)


def from_text(text: str, source: str) -> TenantKeyring:
    first, _, rest = text.partition("\n")
    tenant = first.strip().removeprefix(_HEADER)
    if not first.startswith(_HEADER) or not tenant:
        raise ConfigError(f"tenant key file {source}: the first line must be {_HEADER}<tenant>")
    keys = Keyring.from_text(rest, source).keys
    return TenantKeyring(keys, source, tenant=tenant)


def load_for(path: str | os.PathLike, tenant: str) -> Keyring:
    """A KEK file, or a tenant key file for `tenant` (ConfigError when it is another tenant's)."""
    text = read_secret(path, "KEK file")
    if not text.startswith(_HEADER):
        return Keyring.load(path)
    keyring = from_text(text, str(Path(path)))
    if keyring.tenant != tenant:
        raise ConfigError(f"key file {path} is tenant {keyring.tenant!r}'s, not {tenant!r}'s")
    return keyring
