"""The InferScale operator: reconciles UserMemory objects (crds/usermemory.yaml).

`kopf run -m inferscale.operator` imports this package: the handlers are registered into Kopf's default
registry here, with settings from the environment. `main(argv)` (the `inferscale operator` subcommand)
builds its own registry from flags + environment instead.
"""

from __future__ import annotations

import kopf

from .handlers import register
from .cli import main
from .settings import Settings

register(kopf.get_default_registry(), Settings.from_env())

__all__ = ["main", "register", "Settings"]
