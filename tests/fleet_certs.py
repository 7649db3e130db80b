"""The fleet's TLS files for tests (a CA and the serving pods' certificate), made by e2e/pki.py, the one maker."""

from __future__ import annotations

import atexit
import functools
import shutil
import sys
import tempfile
from pathlib import Path

from inferscale.fleettls import FleetTls

sys.path.append(str(Path(__file__).resolve().parents[1] / "e2e"))
from pki import fleet_tls_files  # noqa: E402

SERVER_NAME = "inferscale-headless.inferscale-system.svc"  # the chart's <fullname>-headless.<namespace>.svc


def make_fleet_tls(directory: Path, server_name: str = SERVER_NAME) -> FleetTls:
    """A fresh CA under ``directory`` and the fleet certificate it signed, as a serving pod's FleetTls."""
    files = fleet_tls_files(Path(directory), server_name)
    return FleetTls(files["ca"], server_name, files["cert"], files["key"])


@functools.cache
def shared_fleet_tls() -> FleetTls:
    """One FleetTls for a whole test session (picklable: a spawned peer node gets it in its options)."""
    directory = Path(tempfile.mkdtemp(prefix="inferscale-tls-"))
    atexit.register(shutil.rmtree, directory, True)
    return make_fleet_tls(directory)
