"""A real InferScale server in its own process (tiny random-weight engine, real offline embedder, uvicorn on
loopback), so an attack test can read the server's RSS from /proc/<pid>/status. Prints ``READY <port>``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for tiny_models


def main(data_dir: str, keys_json: str) -> None:
    import socket

    import uvicorn

    import tiny_models
    from inferscale.retrieval import Embedder
    from inferscale.server.app import create_app
    from inferscale.server.auth import hash_key
    from inferscale.server.settings import Settings
    from inferscale.store import KVStore

    data = Path(data_dir)
    tenants = data / "tenants.json"
    tenants.write_text(json.dumps({t: [hash_key(k)] for t, k in json.loads(keys_json).items()}))
    settings = Settings(data_dir=data, tenants_file=tenants, default_max_tokens=4)
    store = KVStore(settings.store_dir, dram_budget_bytes=16 << 20, node="abuse", nixl=False)
    app = create_app(settings, engine=tiny_models.engine("gemma3"), embedder=Embedder(), store=store)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    print(f"READY {port}", flush=True)
    server.run()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
