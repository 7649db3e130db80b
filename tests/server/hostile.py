"""Hypothesis strategies for hostile request bodies, derived from the server's request schemas (the pydantic models
in inferscale.server.schemas): a valid base body with some of the model's fields replaced by the edges of their
own constraints (ge/le/gt/lt, lengths: on and just past them), or by anything JSON can hold (huge, tiny and
non-finite numbers, wrong types, odd text, nesting). Nested models (messages, inferscale, items) are built the same
way. Bodies are serialized with NaN/Infinity literals, which Python's JSON parser (hence the server's) accepts."""

from __future__ import annotations

import json
import typing

from hypothesis import strategies as st
from pydantic import BaseModel
from pydantic.fields import FieldInfo

# Integers past what int64, uint64 and float64 hold, and floats at the edges of float32/float64.
EDGE_INTS = [0, -1, 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, -(2**64), 10**40]
EDGE_FLOATS = [0.0, -0.0, 5e-324, 1e-300, 1e-45, 1e-6, 1e-3, 0.5, 1.0000001, 3.5e38, 1e308, float("nan"),
               float("inf"), float("-inf")]
ODD_TEXT = ["", " ", "\u0000", "\u202e", "\ufffd", "Z\u0336\u0335", "\U0001f600", "<bos>", "<eos>", "%40", "../..",
            "a" * 5000]

scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from(EDGE_INTS), st.integers(), st.sampled_from(EDGE_FLOATS),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(ODD_TEXT), st.text(max_size=40))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)


def dumps(body: object) -> str:
    return json.dumps(body, allow_nan=True)


def _models_in(annotation) -> tuple[type[BaseModel] | None, bool]:
    """(the BaseModel in ``annotation``, whether it is a list of them): ``list[ChatMessage]``, ``X | None``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    for arg in typing.get_args(annotation):
        model, listed = _models_in(arg)
        if model is not None:
            return model, listed or typing.get_origin(annotation) is list
    return None, False


def _edges(field: FieldInfo) -> list:
    """The field's own bounds, on them and just past them."""
    out: list = []
    for m in field.metadata:
        for name in ("ge", "le", "gt", "lt"):
            v = getattr(m, name, None)
            if isinstance(v, (int, float)):
                out += [v, v - 1, v + 1, v * 2 + 1, -v] + ([v - 1e-9, v + 1e-9] if isinstance(v, float) else [])
        for name in ("min_length", "max_length"):
            n = getattr(m, name, None)
            if isinstance(n, int) and n <= 20_000:
                out += ["x" * (n + 1), ["x"] * (n + 1), "x" * max(n - 1, 0)]
    return out


def field_values(field: FieldInfo, depth: int = 0) -> st.SearchStrategy:
    choices = [json_values]
    edges = _edges(field)
    if edges:
        choices.append(st.sampled_from(edges))
    model, listed = _models_in(field.annotation)
    if model is not None and depth < 2:
        inner = bodies(model, BASES.get(model.__name__, {}), depth + 1)
        choices.append(st.lists(inner, min_size=1, max_size=3) if listed else inner)
    return st.one_of(choices)


def _number_edges(field: FieldInfo) -> list | None:
    """A numeric field's own edges and those of its type (float64's for a float, int64's for an int), else None."""
    types = (field.annotation, *typing.get_args(field.annotation))
    if float in types:
        return _edges(field) + EDGE_FLOATS
    return _edges(field) + EDGE_INTS if int in types else None


def bodies(model: type[BaseModel], base: dict, depth: int = 0) -> st.SearchStrategy[dict]:
    """``base`` with either one numeric field at the edges of its range or of int64/float64 (each such case
    reaches the engine unless that one value is refused), or 1-4 of ``model``'s fields (or an unknown one) set to
    anything hostile."""
    names = sorted(model.model_fields) + ["not_a_field"]
    values = {n: field_values(model.model_fields[n], depth) if n in model.model_fields else json_values
              for n in names}
    anything = st.lists(st.sampled_from(names), min_size=1, max_size=4, unique=True).flatmap(
        lambda chosen: st.fixed_dictionaries({n: values[n] for n in chosen}))
    numeric = {n: st.sampled_from(e) for n, f in model.model_fields.items() if (e := _number_edges(f))}
    one_number = st.sampled_from(sorted(numeric)).flatmap(lambda n: numeric[n].map(lambda v: {n: v})) \
        if numeric else st.nothing()
    return st.one_of(one_number, one_number, anything).map(lambda extra: {**base, **extra})  # 2:1


# A valid body per model: what hostile fields are layered on (so each case reaches past the first check).
BASES = {
    "ChatCompletionRequest": {"model": "gemma-3-270m", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2},
    "ChatMessage": {"role": "user", "content": "who went camping?"},
    "MemoryItemIn": {"id": "m1", "text": "caroline went camping"},
    "PutMemories": {"items": [{"id": "m1", "text": "caroline went camping"}]},
}
# Path segments for /v1/memories/{user}: the contract maps any string; these try to be something else.
users = st.one_of(st.sampled_from(["alice@example.com", "..", "%2e%2e", "a/b", "a%2Fb", "\u0000", " ", "x" * 300,
                                   "caroline", "\U0001f600"]), st.text(min_size=1, max_size=20))
