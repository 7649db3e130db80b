"""Operator settings: environment variables (docs/interfaces.md), overridable by command-line flags."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from inferscale.contract import DEFAULT_KV_DTYPE, KV_DTYPES, is_valid_tenant
from inferscale.errors import ConfigError
from inferscale.fleettls import FleetTls
from inferscale.secretfile import read_secret

GROUP = "inferscale.io"
VERSION = "v1alpha1"
PLURAL = "usermemories"
# Label/annotation keys the operator puts on what it creates (and finds it back by).
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"
APP_NAME = "inferscale"
LABEL_TENANT = "inferscale.io/tenant"
LABEL_USERMEMORY = "inferscale.io/usermemory"
# The UserMemory's uid: a Job or record carries it so the operator only ever trusts what it made for that object.
LABEL_OWNER_UID = "inferscale.io/owner-uid"
# What an object in the platform namespace is to the operator: "encode", "cleanup", "items", "key", "user-record".
LABEL_ROLE = "inferscale.io/role"
MANAGED_BY = "inferscale-operator"
# A ConfigMap/Secret in a tenant namespace opts in to being read as `memoriesFrom` with this label set to "true": the
# operator reads with its own rights, which may exceed those of the tenant's users, so it reads only what the tenant
# marked as memories (never, say, another application's Secret named by a UserMemory).
LABEL_MEMORIES_SOURCE = "inferscale.io/memories-source"
ANNOTATION_ENDPOINT = "inferscale.io/endpoint"
FINALIZER = "inferscale.io/purge"


@dataclasses.dataclass(frozen=True)
class Settings:
    server_selector: str = "app.kubernetes.io/name=inferscale,app.kubernetes.io/component=server"
    server_namespace: str = ""  # empty: serving pods in all namespaces
    # The servers' internal listener (/internal/v1/*), separate from the tenant API port.
    internal_port: int = 8001
    # The servers' NIXL peer control port: a pod's peer address is its podIP and this port (no annotation).
    nixl_port: int = 5555
    internal_token: str = ""
    # TLS to the servers' internal port (inferscale/fleettls.py): the CA that signed their certificate and the name
    # it holds; both, or neither (plain HTTP).
    tls_ca_file: str = ""
    tls_server_name: str = ""
    # The tenant namespaces the operator serves. Empty: none (a UserMemory anywhere else is never touched).
    tenants: tuple[str, ...] = ()
    # Where encode/cleanup Jobs, their items ConfigMaps and the per-user records live: the platform's namespace,
    # which tenants cannot write to. Never a tenant namespace.
    job_namespace: str = "inferscale-system"
    # memoriesFrom.secretKeyRef is honoured only when the platform team opts in (the operator then reads tenant
    # Secrets on the tenant's behalf, and the chart grants it `get` on secrets in the tenant namespaces).
    read_tenant_secrets: bool = False
    # Job bounds (the chart's encoder.* values): wall-clock limit and resources of one encode Job.
    encode_deadline_seconds: int = 3600
    encoder_resources: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {
        "requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"memory": "16Gi"}})
    # Per-tenant bounds on encode work (quota.py): Jobs running at once, and the items they encode together.
    max_encode_jobs_per_tenant: int = 2
    max_encode_items_per_tenant: int = 2000
    # The chart's KEK Secret (key `kek`), mounted into encode Jobs; empty: blobs are not sealed (development only).
    kek_secret: str = ""
    # The KEK file, mounted on the operator: each encode Job then gets a Secret of its own holding only its tenant's
    # derived keys (inferscale/tenantkey.py), never the KEK. Set this or kek_secret, not both.
    kek_file: str = ""
    # The uid/gid the image runs as; Jobs run as this (non-root) user.
    run_as_user: int = 10001
    encoder_image: str = "inferscale/inferscale:latest"
    encoder_node_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    encoder_tolerations: Sequence[Mapping[str, Any]] = ()
    encoder_gpus: int = 1
    # The size limit of an encode Job's own emptyDirs (its blobs, and /tmp where it packs them to deliver).
    encoder_out_size: str = "4Gi"
    models: tuple[str, ...] = ("gemma-3-270m",)
    # The KV storage format encode Jobs write (``encode --kv-dtype``): the fleet's INFERSCALE_KV_DTYPE.
    kv_dtype: str = DEFAULT_KV_DTYPE
    recheck_seconds: float = 30.0
    # How often a waiting handler looks at its encode Job again.
    job_poll_seconds: float = 5.0
    # Timeout of one call to a serving pod's internal API.
    http_timeout_seconds: float = 30.0
    # How long deleting a UserMemory waits for a node-cleanup Job (a node with the Job's output but no serving pod).
    cleanup_timeout_seconds: float = 300.0
    # How long a deletion may keep retrying before it gives up with a Warning and releases the finalizer: a purge
    # that can never succeed must not block the tenant's namespace deletion forever.
    purge_timeout_seconds: float = 900.0
    # How often the operator looks for UserMemory objects gone without their finalizer (a tenant removed it) and
    # purges their user from its records (orphans.py); a DELETED event also starts a sweep at once.
    orphan_sweep_seconds: float = 60.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        d = cls()

        def get(name: str) -> str | None:
            value = env.get(name)
            return value if value not in (None, "") else None

        try:
            return cls(
                server_selector=get("INFERSCALE_SERVER_SELECTOR") or d.server_selector,
                server_namespace=env.get("INFERSCALE_SERVER_NAMESPACE", d.server_namespace),
                internal_port=int(get("INFERSCALE_INTERNAL_PORT") or d.internal_port),
                nixl_port=int(get("INFERSCALE_NIXL_PORT") or d.nixl_port),
                internal_token=_internal_token(env, get("INFERSCALE_INTERNAL_TOKEN_FILE")),
                tls_ca_file=env.get("INFERSCALE_TLS_CA_FILE", d.tls_ca_file),
                tls_server_name=env.get("INFERSCALE_TLS_SERVER_NAME", d.tls_server_name),
                tenants=_csv(get("INFERSCALE_TENANTS")),
                job_namespace=get("INFERSCALE_JOB_NAMESPACE") or d.job_namespace,
                read_tenant_secrets=_bool(get("INFERSCALE_READ_TENANT_SECRETS"), "INFERSCALE_READ_TENANT_SECRETS"),
                encode_deadline_seconds=int(get("INFERSCALE_ENCODE_DEADLINE_SECONDS") or d.encode_deadline_seconds),
                encoder_resources=(_json_obj(get("INFERSCALE_ENCODER_RESOURCES"), "INFERSCALE_ENCODER_RESOURCES")
                                   or d.encoder_resources),
                max_encode_jobs_per_tenant=int(get("INFERSCALE_MAX_ENCODE_JOBS_PER_TENANT")
                                               or d.max_encode_jobs_per_tenant),
                max_encode_items_per_tenant=int(get("INFERSCALE_MAX_ENCODE_ITEMS_PER_TENANT")
                                                or d.max_encode_items_per_tenant),
                kek_secret=env.get("INFERSCALE_KEK_SECRET", d.kek_secret),
                kek_file=env.get("INFERSCALE_KEK_FILE", d.kek_file),
                run_as_user=int(get("INFERSCALE_RUN_AS_USER") or d.run_as_user),
                encoder_image=get("INFERSCALE_ENCODER_IMAGE") or d.encoder_image,
                encoder_node_selector=_json_dict(get("INFERSCALE_ENCODER_NODE_SELECTOR"), "INFERSCALE_ENCODER_NODE_SELECTOR"),
                encoder_tolerations=_json_list(get("INFERSCALE_ENCODER_TOLERATIONS"), "INFERSCALE_ENCODER_TOLERATIONS"),
                encoder_gpus=int(get("INFERSCALE_ENCODER_GPUS") or d.encoder_gpus),
                encoder_out_size=get("INFERSCALE_ENCODER_OUT_SIZE") or d.encoder_out_size,
                models=_csv(get("INFERSCALE_MODELS")) or d.models,
                kv_dtype=get("INFERSCALE_KV_DTYPE") or d.kv_dtype,
                recheck_seconds=float(get("INFERSCALE_RECHECK_SECONDS") or d.recheck_seconds),
                job_poll_seconds=float(get("INFERSCALE_JOB_POLL_SECONDS") or d.job_poll_seconds),
                http_timeout_seconds=float(get("INFERSCALE_HTTP_TIMEOUT_SECONDS") or d.http_timeout_seconds),
                purge_timeout_seconds=float(get("INFERSCALE_PURGE_TIMEOUT_SECONDS") or d.purge_timeout_seconds),
                orphan_sweep_seconds=float(get("INFERSCALE_ORPHAN_SWEEP_SECONDS") or d.orphan_sweep_seconds),
            ).checked()
        except ValueError as e:
            raise ConfigError(f"operator settings: {e}") from e

    def checked(self) -> Settings:
        if self.max_encode_jobs_per_tenant < 1 or self.max_encode_items_per_tenant < 1:
            raise ConfigError("INFERSCALE_MAX_ENCODE_JOBS_PER_TENANT and INFERSCALE_MAX_ENCODE_ITEMS_PER_TENANT "
                              "must be >= 1")
        _ = self.tls  # both TLS settings or neither, and a CA file that loads
        if self.kek_file and self.kek_secret:
            raise ConfigError("set INFERSCALE_KEK_FILE (Jobs get their tenant's derived keys) or INFERSCALE_KEK_SECRET "
                              "(Jobs mount the KEK), not both")
        if self.encoder_gpus < 0:
            raise ConfigError("INFERSCALE_ENCODER_GPUS must be >= 0")
        if self.recheck_seconds <= 0 or self.job_poll_seconds <= 0:
            raise ConfigError("INFERSCALE_RECHECK_SECONDS and INFERSCALE_JOB_POLL_SECONDS must be > 0")
        if min(self.purge_timeout_seconds, self.encode_deadline_seconds, self.orphan_sweep_seconds) <= 0:
            raise ConfigError("INFERSCALE_PURGE_TIMEOUT_SECONDS, INFERSCALE_ENCODE_DEADLINE_SECONDS and "
                              "INFERSCALE_ORPHAN_SWEEP_SECONDS must be > 0")
        if self.run_as_user <= 0:
            raise ConfigError(f"INFERSCALE_RUN_AS_USER must be a non-root uid, not {self.run_as_user}")
        bad = [t for t in self.tenants if not is_valid_tenant(t)]
        if bad:
            raise ConfigError(f"INFERSCALE_TENANTS: not namespace names: {', '.join(map(repr, bad))}")
        if not is_valid_tenant(self.job_namespace):
            raise ConfigError(f"INFERSCALE_JOB_NAMESPACE is not a namespace name: {self.job_namespace!r}")
        if self.job_namespace in self.tenants:
            raise ConfigError(f"INFERSCALE_JOB_NAMESPACE {self.job_namespace!r} must not be a tenant: tenants must "
                              "not be able to write where Jobs and records live")
        if not self.models:
            raise ConfigError("INFERSCALE_MODELS must name at least one model")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"INFERSCALE_KV_DTYPE {self.kv_dtype!r}: expected one of {', '.join(KV_DTYPES)}")
        return self

    @functools.cached_property  # built (and its files checked) once; FleetTls re-reads the CA when it changes
    def tls(self) -> FleetTls | None:
        """How the servers' internal API is verified; None: plain HTTP (development without the chart's TLS)."""
        return FleetTls.from_files(self.tls_ca_file, self.tls_server_name, server=False)

    @property
    def internal_scheme(self) -> str:
        return "http" if self.tls is None else "https"


def _internal_token(env: Mapping[str, str], file: str | None) -> str:
    """INFERSCALE_INTERNAL_TOKEN, or the private file INFERSCALE_INTERNAL_TOKEN_FILE names (a mounted Secret)."""
    if file is None:
        return env.get("INFERSCALE_INTERNAL_TOKEN", "")
    if env.get("INFERSCALE_INTERNAL_TOKEN"):
        raise ConfigError("set INFERSCALE_INTERNAL_TOKEN or INFERSCALE_INTERNAL_TOKEN_FILE, not both")
    return read_secret(file, "INFERSCALE_INTERNAL_TOKEN_FILE")


def _csv(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def _bool(value: str | None, name: str) -> bool:
    if value is None:
        return False
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no"):
        return False
    raise ValueError(f"{name} must be true or false, not {value!r}")


def _json_obj(value: str | None, name: str) -> dict[str, Any]:
    if not value:
        return {}
    parsed = json.loads(value)
    if not isinstance(parsed, dict):
        raise ValueError(f"{name} must be a JSON object")
    return parsed


def _json_dict(value: str | None, name: str) -> dict[str, str]:
    if not value:
        return {}
    parsed = json.loads(value)
    if not isinstance(parsed, dict) or not all(isinstance(v, str) for v in parsed.values()):
        raise ValueError(f"{name} must be a JSON object of strings")
    return parsed


def _json_list(value: str | None, name: str) -> list[dict[str, Any]]:
    if not value:
        return []
    parsed = json.loads(value)
    if not isinstance(parsed, list) or not all(isinstance(v, dict) for v in parsed):
        raise ValueError(f"{name} must be a JSON list of objects")
    return parsed


# Flags mirror the environment variables; a flag given wins over its variable.
_FLAGS: dict[str, str] = {
    "--server-selector": "INFERSCALE_SERVER_SELECTOR",
    "--server-namespace": "INFERSCALE_SERVER_NAMESPACE",
    "--internal-port": "INFERSCALE_INTERNAL_PORT",
    "--tenants": "INFERSCALE_TENANTS",
    "--job-namespace": "INFERSCALE_JOB_NAMESPACE",
    "--read-tenant-secrets": "INFERSCALE_READ_TENANT_SECRETS",
    "--encode-deadline-seconds": "INFERSCALE_ENCODE_DEADLINE_SECONDS",
    "--encoder-resources": "INFERSCALE_ENCODER_RESOURCES",
    "--kek-secret": "INFERSCALE_KEK_SECRET",
    "--kek-file": "INFERSCALE_KEK_FILE",
    "--max-encode-jobs-per-tenant": "INFERSCALE_MAX_ENCODE_JOBS_PER_TENANT",
    "--max-encode-items-per-tenant": "INFERSCALE_MAX_ENCODE_ITEMS_PER_TENANT",
    "--purge-timeout-seconds": "INFERSCALE_PURGE_TIMEOUT_SECONDS",
    "--orphan-sweep-seconds": "INFERSCALE_ORPHAN_SWEEP_SECONDS",
    "--encoder-image": "INFERSCALE_ENCODER_IMAGE",
    "--encoder-node-selector": "INFERSCALE_ENCODER_NODE_SELECTOR",
    "--encoder-tolerations": "INFERSCALE_ENCODER_TOLERATIONS",
    "--encoder-gpus": "INFERSCALE_ENCODER_GPUS",
    "--models": "INFERSCALE_MODELS",
    "--recheck-seconds": "INFERSCALE_RECHECK_SECONDS",
    "--job-poll-seconds": "INFERSCALE_JOB_POLL_SECONDS",
}


def add_flags(parser: argparse.ArgumentParser) -> None:
    for flag, var in _FLAGS.items():
        parser.add_argument(flag, dest=var, default=None, metavar="VALUE", help=f"overrides ${var}")


def from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Settings:
    merged = dict(os.environ if env is None else env)
    for var in _FLAGS.values():
        value = getattr(args, var, None)
        if value is not None:
            merged[var] = value
    return Settings.from_env(merged)
