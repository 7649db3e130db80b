"""Parse and validate a UserMemory spec into the desired state, and hash it.

The CRD schema rejects malformed manifests before they reach the operator; this module catches what a
schema cannot see (unknown model, a missing ConfigMap key, a bad JSONL line) and names the problem in
one line, so the handler can put it into a condition.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from inferscale.contract import CONTEXT_ITEMS, id_problem

MAX_TEXT = 8192
# An encode Job encodes each item behind up to CONTEXT_ITEMS items before it in the spec (the engine's
# context_items). So an item's hash covers those items too: editing, inserting or removing an item re-encodes the
# items behind it, and nothing a user removed lives on in their KV.


class SpecError(Exception):
    """The spec passed the schema but cannot be acted on. `reason` is a CamelCase condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclasses.dataclass(frozen=True)
class Item:
    id: str
    text: str
    timestamp: str | None = None

    def as_json(self) -> dict[str, str]:
        d = {"id": self.id, "text": self.text}
        if self.timestamp is not None:
            d["timestamp"] = self.timestamp
        return d


@dataclasses.dataclass(frozen=True)
class Desired:
    user_id: str
    model: str
    items: Mapping[str, Item]
    replicas: int
    node_selector: Mapping[str, str]

    def item_hashes(self) -> dict[str, str]:
        """{id: hash of the model, the item and the CONTEXT_ITEMS items before it}, in spec order."""
        items = list(self.items.values())
        return {item.id: item_hash(self.model, item, items[max(0, n - CONTEXT_ITEMS):n]) for n, item in enumerate(items)}

    def content_hash(self) -> str:
        return content_hash(self.model, self.item_hashes())


# (kind, name, key) -> the key's text; raises SpecError when absent. Kind is "ConfigMap" or "Secret".
RefReader = Callable[[str, str, str], str]


def item_hash(model: str, item: Item, context: Sequence[Item] = ()) -> str:
    # The model is part of the hash: a blob encoded for another model is useless, so a model
    # change re-encodes every item.
    raw = json.dumps([model, item.id, item.text, item.timestamp, [[c.id, c.text, c.timestamp] for c in context]],
                     ensure_ascii=False)
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def content_hash(model: str, hashes: Mapping[str, str]) -> str:
    raw = json.dumps([model, sorted(hashes.items())])
    return hashlib.sha256(raw.encode()).hexdigest()


def parse_item(obj: Any, where: str) -> Item:
    if not isinstance(obj, dict):
        raise SpecError("InvalidMemory", f"{where}: not a JSON object")
    iid, text, ts = obj.get("id"), obj.get("text"), obj.get("timestamp")
    problem = id_problem("id", iid)
    if problem:
        raise SpecError("InvalidMemory", f"{where}: bad {problem}")
    if not isinstance(text, str) or not text.strip():
        raise SpecError("InvalidMemory", f"{where}: item {iid!r} has empty text")
    if len(text) > MAX_TEXT:
        raise SpecError("InvalidMemory", f"{where}: item {iid!r} text longer than {MAX_TEXT} characters")
    if ts is not None and not isinstance(ts, str):
        raise SpecError("InvalidMemory", f"{where}: item {iid!r} timestamp must be a string")
    return Item(iid, text, ts)


def parse_jsonl(text: str, source: str) -> list[Item]:
    items: list[Item] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecError("InvalidMemory", f"{source} line {n}: malformed JSON ({e.msg})") from None
        items.append(parse_item(obj, f"{source} line {n}"))
    return items


def parse(spec: Mapping[str, Any], models: tuple[str, ...], read_ref: RefReader,
          now: datetime.datetime | None = None) -> Desired:
    user_id = spec.get("userId")
    problem = id_problem("spec.userId", user_id)
    if problem:
        raise SpecError("InvalidSpec", problem)
    model = spec.get("model")
    if model not in models:
        raise SpecError("UnknownModel", f"spec.model {model!r} is not served here (known: {', '.join(models)})")
    assert isinstance(model, str)

    items: dict[str, Item] = {}
    ref = spec.get("memoriesFrom")
    if ref:
        kind, key_ref = ("ConfigMap", ref.get("configMapKeyRef")) if "configMapKeyRef" in ref \
            else ("Secret", ref.get("secretKeyRef"))
        if not isinstance(key_ref, dict) or not key_ref.get("name") or not key_ref.get("key"):
            raise SpecError("InvalidSpec", "spec.memoriesFrom needs configMapKeyRef or secretKeyRef with name and key")
        text = read_ref(kind, key_ref["name"], key_ref["key"])
        for item in parse_jsonl(text, f"{kind} {key_ref['name']} key {key_ref['key']}"):
            if item.id in items:
                raise SpecError("InvalidMemory", f"{kind} {key_ref['name']}: duplicate id {item.id!r}")
            items[item.id] = item

    inline = spec.get("memories")
    if inline is None and not ref:
        raise SpecError("InvalidSpec", "spec needs memories or memoriesFrom")
    seen: set[str] = set()
    for n, obj in enumerate(inline or []):
        item = parse_item(obj, f"spec.memories[{n}]")
        if item.id in seen:
            raise SpecError("InvalidMemory", f"spec.memories[{n}]: duplicate id {item.id!r}")
        seen.add(item.id)
        items[item.id] = item  # inline wins over the referenced set on equal ids

    items = _retain(items, spec.get("retention") or {}, now or datetime.datetime.now(datetime.timezone.utc))

    placement = spec.get("placement") or {}
    replicas = placement.get("replicas", 1)
    if not isinstance(replicas, int) or replicas < 1:
        raise SpecError("InvalidSpec", f"spec.placement.replicas must be >= 1, got {replicas!r}")
    selector = placement.get("nodeSelector") or {}
    return Desired(user_id, model, dict(sorted(items.items())), replicas, dict(selector))


def _parse_ts(ts: str | None) -> datetime.datetime | None:
    if not ts:
        return None
    try:
        parsed = datetime.datetime.fromisoformat(ts.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.timezone.utc)


def _retain(items: dict[str, Item], retention: Mapping[str, Any], now: datetime.datetime) -> dict[str, Item]:
    max_age = retention.get("maxAgeDays")
    if max_age:
        cutoff = now - datetime.timedelta(days=int(max_age))
        # Items without a parseable timestamp are kept: age unknown is not "too old".
        items = {i: it for i, it in items.items()
                 if (t := _parse_ts(it.timestamp)) is None or t >= cutoff}
    max_items = retention.get("maxItems")
    if max_items and len(items) > int(max_items):
        epoch = datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)
        newest = sorted(items.values(), key=lambda it: (_parse_ts(it.timestamp) or epoch, it.id), reverse=True)
        items = {it.id: it for it in newest[: int(max_items)]}
    return items
