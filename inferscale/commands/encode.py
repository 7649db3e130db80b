"""``inferscale encode ITEMS.jsonl --out DIR``: memories → one KV blob per item (atomic writes, 0600).

With ``--kek-file F --tenant T --user U`` (an encoding Job) the blobs are sealed for that tenant and user
(``inferscale.sealing``): the only form a server's Job-dir import accepts. Without them, plain blobs for local use.
With ``--deliver URL --upload-credential-file F`` (what the operator's encode Job runs) the blobs written are then
uploaded to that serving pod's ingest route (inferscale/delivery.py); ``--out`` is then the Job's own emptyDir."""

from __future__ import annotations

import argparse
from pathlib import Path

from inferscale.contract import DEFAULT_KV_DTYPE, KV_DTYPES
from inferscale.errors import ConfigError, MemoryItemError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help="JSONL, one {id, text, timestamp?} object a line")
    p.add_argument("--out", required=True, help="directory for the blobs (<id> + inferscale.kvformat.SUFFIX)")
    p.add_argument("--model", default=None, help="model name or path (default: the embedded gemma-3-270m)")
    p.add_argument("--only", default=None,
                   help="comma-separated ids: encode these (the changed items) and the items encoded behind them; "
                        "the others serve as context only")
    p.add_argument("--context-tokens", type=int, default=None,
                   help="encode each item behind up to this many tokens of the items before it (default 256)")
    p.add_argument("--embed", action="store_true", help="also store each item's retrieval embedding")
    p.add_argument("--batch-tokens", type=int, default=1024, help="tokens packed into one forward pass")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--kv-dtype", default=DEFAULT_KV_DTYPE, choices=KV_DTYPES,
                   help="how the blobs store K/V (inferscale.kvquant): bf16 = the model's dtype, uncompressed; int8/fp8 "
                        "per token, int4 groups: compact, dequantized at injection (default %(default)s)")
    p.add_argument("--kek-file", default=None,
                   help="KEK file (<key-id>:<base64 of 32 bytes> a line), or the tenant's key file (inferscale/"
                        "tenantkey.py; what the operator hands an encode Job): seal the blobs for --tenant/--user")
    p.add_argument("--tenant", default=None, help="the tenant the sealed blobs belong to (with --kek-file)")
    p.add_argument("--user", default=None, help="the user the sealed blobs belong to (with --kek-file)")
    p.add_argument("--deliver", default=None,
                   help="then upload the blobs to this serving pod's /internal/v1/ingest/<tenant>/<user> URL")
    p.add_argument("--upload-credential-file", default=None,
                   help="the Job's upload credential (inferscale/uploadtoken.py), the bearer of --deliver")
    p.add_argument("--tls-ca-file", default=None,
                   help="an https --deliver: the fleet CA the serving pod's certificate must chain to")
    p.add_argument("--tls-server-name", default=None,
                   help="an https --deliver: the name that certificate must carry (sent as SNI; the URL holds an IP)")


def _keyring(args: argparse.Namespace):
    """The keyring to seal with, or None for plain blobs; all three sealing flags or none."""
    given = [f for f, v in (("--kek-file", args.kek_file), ("--tenant", args.tenant), ("--user", args.user)) if v]
    if not given:
        return None
    if len(given) != 3:
        raise ConfigError(f"{', '.join(given)} given: sealing needs --kek-file, --tenant and --user together")
    from inferscale.contract import id_problem
    from inferscale.tenantkey import load_for

    for kind, value in (("tenant", args.tenant), ("user", args.user)):
        problem = id_problem(f"{kind} name", value)
        if problem:
            raise ConfigError(f"invalid {problem}")
    return load_for(args.kek_file, args.tenant)  # the KEK, or (in a cluster) the tenant's derived keys only


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from inferscale.engine import Engine, read_jsonl
    from inferscale.kvformat import save_block

    keyring = _keyring(args)  # before any model work: a bad flag costs nothing
    if bool(args.deliver) != bool(args.upload_credential_file):
        raise ConfigError("--deliver and --upload-credential-file go together")
    from inferscale.fleettls import FleetTls

    tls = FleetTls.from_files(args.tls_ca_file, args.tls_server_name, server=False)  # both or neither
    items = read_jsonl(args.input)
    only = None
    if args.only:
        only = {s for s in args.only.split(",") if s}
        missing = only - {i.id for i in items}
        if missing:
            raise MemoryItemError(f"--only names ids not in {args.input}: {', '.join(sorted(missing))}")
    if args.context_tokens is not None and args.context_tokens < 0:
        raise ConfigError(f"--context-tokens {args.context_tokens}: expected 0 or more")
    engine = Engine.load(args.model, device=args.device, dtype=args.dtype, kv_dtype=args.kv_dtype)
    embed = None
    if args.embed:
        from inferscale.retrieval import Embedder

        embed = Embedder().embed
    # encode() checks every item before any work and blobs are written only after all encoded: a bad item
    # leaves the directory untouched.
    out = Path(args.out)
    with tqdm(total=len(only) if only else len(items), unit="item", desc="encoding") as bar:
        blocks = engine.encode(items, only=only, context_tokens=args.context_tokens, batch_tokens=args.batch_tokens,
                               on_progress=bar.update, embed=embed)
    written = [save_block(block, out, keyring=keyring, tenant=args.tenant, user=args.user).name for block in blocks]
    tokens = sum(b.num_tokens for b in blocks)
    print(f"encoded {len(blocks)} items ({tokens} tokens, {sum(b.nbytes for b in blocks)} bytes) into {out}")
    if args.deliver and written:
        from inferscale.delivery import deliver

        total = deliver(args.deliver, args.upload_credential_file, out, written, tls)
        print(f"delivered {len(written)} blobs to {args.deliver} (the user now has {total} there)")
    return 0
