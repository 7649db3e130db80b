"""The server's one settings object: defaults, then ``INFERSCALE_*`` environment variables, then CLI flags."""

from __future__ import annotations

import os
from pathlib import Path
from pydantic import BaseModel, Field, ValidationError

from inferscale.contract import DEFAULT_KV_DTYPE, DEFAULT_MODE, DEFAULT_RECOMPUTE_RATIO, KVDtype, Mode
from inferscale.errors import ConfigError

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
    "internal_port": "INFERSCALE_INTERNAL_PORT",
    "peer_secret": "INFERSCALE_PEER_SECRET",
    "ucx_port_range": "INFERSCALE_UCX_PORT_RANGE",
    "node_name": "INFERSCALE_NODE_NAME",
    "pod_name": "INFERSCALE_POD_NAME",
    "kv_host_path": "INFERSCALE_KV_HOST_PATH",
    "kv_dtype": "INFERSCALE_KV_DTYPE",
    "default_k": "INFERSCALE_DEFAULT_K",
    "default_mode": "INFERSCALE_DEFAULT_MODE",
    "max_k": "INFERSCALE_MAX_K",
    "max_tokens": "INFERSCALE_MAX_TOKENS",
    "max_in_flight": "INFERSCALE_MAX_IN_FLIGHT",
    "max_active": "INFERSCALE_MAX_ACTIVE",
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
}


class Settings(BaseModel):
    model_config = {"extra": "forbid"}

    data_dir: Path = Path("~/.local/share/inferscale").expanduser()
    model: str = DEFAULT_MODEL
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
    # The peer plane (server <-> server): MACs peer requests (never sent); None = no peer service.
    peer_secret: str | None = None
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
    # The engine's scheduler (inferscale/engine/scheduler.py): sequences in flight (decoded in one batch), the
    # token budget of one step, the largest prompt chunk per turn, and each tenant's bounded queue.
    max_active: int = Field(64, ge=1)
    step_tokens: int = Field(128, ge=1)
    chunk_tokens: int = Field(128, ge=1)
    max_queued_per_tenant: int = Field(64, ge=1)
    queue_timeout_s: float = Field(30.0, gt=0)
    step_time_s: float = Field(0.25, gt=0)  # a step's target wall time (scheduler.py: what an arrival waits for)
    torch_threads: int = Field(0, ge=0)  # torch's CPU threads; 0: all usable cores but one (engine/threads.py)
    console_traces: bool = False
    max_body_bytes: int = Field(16 << 20, ge=1024)

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
