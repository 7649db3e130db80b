"""Status helpers: Kubernetes-style conditions (lastTransitionTime moves only when the status flips)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

# Condition types, in the order they are listed.
VALID, ENCODED, PLACED, READY, PURGED = "Valid", "Encoded", "Placed", "Ready", "Purged"
_ORDER = {VALID: 0, ENCODED: 1, PLACED: 2, READY: 3, PURGED: 4}


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(conditions: Sequence[Mapping[str, Any]], type_: str, ok: bool | None, reason: str,
                  message: str, generation: int | None) -> list[dict[str, Any]]:
    """A new list with condition `type_` set (True/False/Unknown for ok=True/False/None)."""
    value = "Unknown" if ok is None else ("True" if ok else "False")
    out: list[dict[str, Any]] = []
    found = False
    for cond in conditions:
        cond = dict(cond)
        if cond.get("type") == type_:
            found = True
            if cond.get("status") != value:
                cond["lastTransitionTime"] = now()
            cond.update(status=value, reason=reason, message=message[:1024])
            if generation is not None:
                cond["observedGeneration"] = generation
        out.append(cond)
    if not found:
        new: dict[str, Any] = {"type": type_, "status": value, "reason": reason, "message": message[:1024],
                               "lastTransitionTime": now()}
        if generation is not None:
            new["observedGeneration"] = generation
        out.append(new)
    return sorted(out, key=lambda c: _ORDER.get(str(c.get("type")), 99))


def not_ready(conditions: Sequence[Mapping[str, Any]], reason: str, message: str,
              generation: int | None) -> list[dict[str, Any]]:
    """Ready=False for this generation: a spec that failed is not ready, even while the blocks of the last good
    version keep serving (Ready never reports an older generation as current)."""
    return set_condition(conditions, READY, False, reason,
                         f"{message} (the last good version, if any, keeps serving)", generation)


def condition(conditions: Sequence[Mapping[str, Any]] | None, type_: str) -> Mapping[str, Any] | None:
    for cond in conditions or ():
        if cond.get("type") == type_:
            return cond
    return None
