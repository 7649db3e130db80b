"""`inferscale operator [flags]`: run the operator. Flags override the INFERSCALE_* environment."""

from __future__ import annotations

import argparse
import logging
import sys

import kopf

from inferscale.errors import ConfigError

from . import settings as settings_mod
from .handlers import register


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="inferscale operator", description=__doc__)
    p.add_argument("-n", "--namespace", action="append", default=[],
                   help="watch only these namespaces; repeatable; default: the INFERSCALE_TENANTS allow-list")
    p.add_argument("--peering", default=None, metavar="NAME",
                   help="Kopf peering object name for several replicas; default: standalone")
    p.add_argument("--liveness", default=None, metavar="URL", help="e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("-v", "--verbose", action="store_true")
    settings_mod.add_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        cfg = settings_mod.from_args(args)
    except ConfigError as e:
        print(f"inferscale operator: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    registry = register(kopf.OperatorRegistry(), cfg)
    # Only the tenants are watched (the chart grants namespaced RBAC there and nowhere else). With no tenant at all,
    # watch the platform namespace, where no UserMemory is ever acted on: nothing is served.
    namespaces = args.namespace or list(cfg.tenants) or [cfg.job_namespace]
    if not cfg.tenants:
        logging.getLogger(__name__).warning("INFERSCALE_TENANTS is empty: no namespace is a tenant; nothing is encoded")
    kopf.run(
        registry=registry,
        clusterwide=False,
        namespaces=namespaces,
        standalone=args.peering is None,
        peering_name=args.peering,
        liveness_endpoint=args.liveness,
    )
    return 0
