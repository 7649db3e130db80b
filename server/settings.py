"""The server's one settings object: defaults, then ``INFERSCALE_*`` environment variables, then CLI flags."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError, model_validator

from inferscale.contract import (DEFAULT_ENGINE, DEFAULT_KV_DTYPE, DEFAULT_MODE, DEFAULT_RECOMPUTE_RATIO, EngineName,
                                 KVDtype, Mode)
from inferscale.errors import ConfigError
from inferscale.fleettls import FleetTls
from inferscale.secretfile import read_secret
from inferscale.store.peer_protocol import MIN_SECRET_CHARS

DEFAULT_MODEL = "gemma-3-270m"

# field name -> environment variable (docs/interfaces.md, "Environment"; the rest are server extras).
ENV = {
    "data_dir": "INFERSCALE_DATA_DIR",
    "model": "INFERSCALE_MODEL",
    "host": "INFERSCALE_HOST",
    "port": "INFERSCALE_PORT",
    "tenants_file": "INFERSCALE_TENANTS_FILE",
    "kek_file": "INFERSCALE_KEK_FILE",
    "device": "INFERSCALE_DEVICE",
    "dram_budget_bytes": "INFERSCALE_DRAM_BUDGET_BYTES",
    "gpu_budget_bytes": "INFERSCALE_GPU_BUDGET_BYTES",
    "nixl_port": "INFERSCALE_NIXL_PORT",
    "internal_token": "INFERSCALE_INTERNAL_TOKEN",
    "internal_token_file": "INFERSCALE_INTERNAL_TOKEN_FILE",
    "internal_port": "INFERSCALE_INTERNAL_PORT",
    "peer_secret": "INFERSCALE_PEER_SECRET",
    "peer_secret_file": "INFERSCALE_PEER_SECRET_FILE",
    "tls_cert_file": "INFERSCALE_TLS_CERT_FILE",
    "tls_key_file": "INFERSCALE_TLS_KEY_FILE",
    "tls_ca_file": "INFERSCALE_TLS_CA_FILE",
    "tls_server_name": "INFERSCALE_TLS_SERVER_NAME",
    "metrics_token": "INFERSCALE_METRICS_TOKEN",
    "metrics_token_file": "INFERSCALE_METRICS_TOKEN_FILE",
    "shutdown_grace_s": "INFERSCALE_SHUTDOWN_GRACE_S",
    "ucx_port_range": "INFERSCALE_UCX_PORT_RANGE",
    "node_name": "INFERSCALE_NODE_NAME",
    "pod_name": "INFERSCALE_POD_NAME",
    "kv_host_path": "INFERSCALE_KV_HOST_PATH",
    "kv_dtype": "INFERSCALE_KV_DTYPE",
    "ingest_max_bytes": "INFERSCALE_INGEST_MAX_BYTES",
    "default_k": "INFERSCALE_DEFAULT_K",
    "default_mode": "INFERSCALE_DEFAULT_MODE",
    "max_k": "INFERSCALE_MAX_K",
    "max_tokens": "INFERSCALE_MAX_TOKENS",
    "max_in_flight": "INFERSCALE_MAX_IN_FLIGHT",
    "max_active": "INFERSCALE_MAX_ACTIVE",
    "kv_slots": "INFERSCALE_KV_SLOTS",
    "kv_slot_tokens": "INFERSCALE_KV_SLOT_TOKENS",
    "kv_cache_bytes": "INFERSCALE_KV_CACHE_BYTES",
    "step_tokens": "INFERSCALE_STEP_TOKENS",
    "chunk_tokens": "INFERSCALE_CHUNK_TOKENS",
    "max_queued_per_tenant": "INFERSCALE_MAX_QUEUED_PER_TENANT",
    "queue_timeout_s": "INFERSCALE_QUEUE_TIMEOUT_S",
    "torch_threads": "INFERSCALE_TORCH_THREADS",
    "step_time_s": "INFERSCALE_STEP_TIME_S",
    "tenant_max_memories": "INFERSCALE_TENANT_MAX_MEMORIES",
    "tenant_max_disk_bytes": "INFERSCALE_TENANT_MAX_DISK_BYTES",
    "tenant_dram_bytes": "INFERSCALE_TENANT_DRAM_BYTES",
    "tenant_encode_tokens_per_minute": "INFERSCALE_TENANT_ENCODE_TOKENS_PER_MINUTE",
    "console_traces": "INFERSCALE_CONSOLE_TRACES",
    "engine": "INFERSCALE_ENGINE",
    "trtllm_model": "INFERSCALE_TRTLLM_MODEL",
    "trtllm_tokens_per_block": "INFERSCALE_TRTLLM_TOKENS_PER_BLOCK",
}


class Settings(BaseModel):
    model_config = {"extra": "forbid"}

    data_dir: Path = Path("~/.local/share/inferscale").expanduser()
    model: str = DEFAULT_MODEL
    # What serves questions (inferscale.engine.backend): the project's PyTorch loop, or TensorRT-LLM in-process
    # with the InferScale connector; memories are encoded by the project's model either way.
    engine: EngineName = DEFAULT_ENGINE
    trtllm_model: str | None = None  # what TensorRT-LLM loads (HF dir or name); None = ``model``
    trtllm_tokens_per_block: int = Field(32, ge=1)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    tenants_file: Path | None = None  # default: <data_dir>/tenants.json
    kek_file: Path | None = None  # key-encryption keys sealing blobs at rest; default: <data_dir>/kek, created
    device: str | None = None  # cpu | cuda; None = cuda when available
    dram_budget_bytes: int = Field(2 << 30, ge=0)
    gpu_budget_bytes: int = Field(0, ge=0)
    nixl_port: int = Field(5555, ge=0, le=65535)
    # The internal plane (operator -> server): its own listener, its own token; None = no internal listener.
    internal_token: str | None = None
    internal_port: int = Field(8001, ge=0, le=65535)
    # Either credential may come from a file instead (a mounted Secret, not an environment variable).
    internal_token_file: Path | None = None
    # The peer plane (server <-> server): MACs peer requests (never sent); None = no peer service.
    peer_secret: str | None = None
    peer_secret_file: Path | None = None
    # TLS of the internal listener and the peer control channel (inferscale/fleettls.py): all four, or none.
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None  # refused when others can read it
    tls_ca_file: Path | None = None
    tls_server_name: str | None = None  # the name the fleet certificate holds, which peers check
    # Bearer token of GET /metrics (Prometheus); None = /metrics is not served (it shows every tenant's activity).
    metrics_token: str | None = None
    metrics_token_file: Path | None = None
    # A graceful shutdown (SIGTERM, or the engine worker failed) waits this long for open requests and streams,
    # then cancels them: below the pod's terminationGracePeriodSeconds (30 s by default).
    shutdown_grace_s: float = Field(20.0, gt=0, le=3600)
    # UCX's TCP data ports (UCX_TCP_PORT_RANGE), so a NetworkPolicy can name them.
    ucx_port_range: str = Field("5556-5599", pattern=r"^[0-9]{1,5}-[0-9]{1,5}$")
    node_name: str = Field(default_factory=lambda: os.uname().nodename)
    pod_name: str = ""
    # The node's KV hostPath root (encoding Jobs write <root>/<tenant>/<user>): a purge may delete such a dir.
    kv_host_path: Path = Path("/var/lib/inferscale/kv")
    # The format this server encodes memories in (inferscale.kvquant); blocks of every format are injected.
    kv_dtype: KVDtype = DEFAULT_KV_DTYPE
    # Request defaults and the per-tenant limits a tenants-file entry does not override.
    default_k: int = Field(20, ge=0)
    default_mode: Mode = DEFAULT_MODE
    recompute_ratio: float = Field(DEFAULT_RECOMPUTE_RATIO, ge=0.0, le=1.0)
    default_max_tokens: int = Field(64, ge=1)
    max_k: int = Field(64, ge=0)
    max_tokens: int = Field(512, ge=1)
    max_in_flight: int = Field(32, ge=1)
    # Per-tenant budgets a tenants-file entry does not override (README, "Tenants file").
    tenant_max_memories: int = Field(100_000, ge=0)
    tenant_max_disk_bytes: int = Field(64 << 30, ge=0)
    tenant_dram_bytes: int | None = Field(None, ge=0)  # None: a tenant may use the whole DRAM budget
    tenant_encode_tokens_per_minute: int = Field(1_000_000, ge=0)
    # The engine's scheduler (inferscale/engine/scheduler.py): sequences in flight (decoded in one batch; with
    # --engine trtllm, TensorRT-LLM's max_batch_size), the token budget of one step, the largest prompt chunk per
    # turn, and each tenant's bounded queue.
    max_active: int = Field(64, ge=1)
    # The decode slots' K/V reserved before the server listens (sequences x tokens each; 16 x 2,048: 604 MB of bf16
    # for Gemma-3-270M): past it the pool grows by reallocation, which stalls the step it falls in for every tenant
    # (inferscale/engine/slots.py).
    kv_slots: int = Field(16, ge=1)
    kv_slot_tokens: int = Field(2048, ge=1)
    # The K/V the running requests may hold together (their slots'), each counted at its prompt + max_tokens from
    # admission (inferscale/engine/capacity.py): a request waits for room; one needing more than all of it is
    # refused (400). It holds the reservation above. 4 GiB: 233,016 tokens of Gemma-3-270M in bf16.
    kv_cache_bytes: int = Field(4 << 30, ge=1)
    step_tokens: int = Field(512, ge=1)
    chunk_tokens: int = Field(128, ge=1)
    max_queued_per_tenant: int = Field(64, ge=1)
    queue_timeout_s: float = Field(30.0, gt=0)
    step_time_s: float = Field(0.25, gt=0)  # a step's target wall time (scheduler.py: what an arrival waits for)
    torch_threads: int = Field(0, ge=-1)  # torch's CPU threads; 0: every core; -1: 1 or all, tuned (engine/threads.py)
    console_traces: bool = False
    max_body_bytes: int = Field(16 << 20, ge=1024)
    # The largest delivery an encode Job may upload (server/ingest.py): spooled to the pod's /tmp while verified.
    ingest_max_bytes: int = Field(1 << 30, ge=1024)

    @model_validator(mode="after")
    def _credentials_from_files(self) -> Settings:
        """INFERSCALE_INTERNAL_TOKEN_FILE / INFERSCALE_PEER_SECRET_FILE / INFERSCALE_METRICS_TOKEN_FILE: read (private
        files only) into the values; then the peer secret's own rules, whichever way it came."""
        for value, path in (("internal_token", "internal_token_file"), ("peer_secret", "peer_secret_file"),
                            ("metrics_token", "metrics_token_file")):
            file = getattr(self, path)
            if file is None:
                continue
            if getattr(self, value) is not None:
                raise ConfigError(f"set {ENV[value]} or {ENV[path]}, not both")
            setattr(self, value, read_secret(file, ENV[path]))
        self._check_peer_secret()
        _ = self.fleet_tls  # refused at start when only part is set or a file is unusable
        return self

    @property
    def fleet_tls(self) -> FleetTls | None:
        """The fleet's TLS files (checked); None when none are set (plain TCP on both planes)."""
        return FleetTls.from_files(self.tls_ca_file, self.tls_server_name, self.tls_cert_file, self.tls_key_file,
                                   server=True)

    def _check_peer_secret(self) -> None:
        """The peer plane's secret must not open the internal plane (nor be guessable): a holder of the operator's
        token is not thereby a peer."""
        if self.peer_secret is None:
            return
        if self.peer_secret == self.internal_token:
            raise ConfigError(f"{ENV['peer_secret']} must differ from {ENV['internal_token']}")
        if len(self.peer_secret) < MIN_SECRET_CHARS:
            raise ConfigError(f"{ENV['peer_secret']} must be at least {MIN_SECRET_CHARS} characters")

    @property
    def tenant_budgets(self) -> dict[str, int | None]:
        """The defaults of the per-tenant budget fields of the tenants file."""
        return {"max_memories": self.tenant_max_memories, "max_disk_bytes": self.tenant_max_disk_bytes,
                "dram_bytes": self.tenant_dram_bytes,
                "encode_tokens_per_minute": self.tenant_encode_tokens_per_minute}

    @property
    def tenants_path(self) -> Path:
        return self.tenants_file or self.data_dir / "tenants.json"

    @property
    def kek_path(self) -> Path:
        return self.kek_file or self.data_dir / "kek"

    @property
    def store_dir(self) -> Path:
        return self.data_dir / "store"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides) -> Settings:
        """Environment first, then ``overrides`` (CLI flags; ``None`` values are ignored)."""
        env = os.environ if env is None else env
        values: dict = {name: env[var] for name, var in ENV.items() if env.get(var, "") != ""}
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**values)
        except ValidationError as e:
            first = e.errors()[0]
            name = str(first["loc"][0]) if first["loc"] else "?"
            where = ENV.get(name, name)
            raise ConfigError(f"setting {where}: {first['msg']}") from None
