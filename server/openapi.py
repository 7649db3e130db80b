"""The served OpenAPI document, with integer bounds as the models declare them.

FastAPI passes its document through its own ``Schema`` model, whose ``maximum``/``minimum`` are floats: ``seed``'s
``2**63 - 1`` came out as ``9.223372036854776e+18`` (2**63), and a client generating requests from the document
(schemathesis 4.32) sent ``9223372036854775999`` as schema-valid, which the server rightly refuses. The bounds are put
back from pydantic's own JSON schema of the same models (exact integers), node by node where both documents agree.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.routing import compile_path

BOUNDS = ("maximum", "minimum", "exclusiveMaximum", "exclusiveMinimum")
REF_TEMPLATE = "#/components/schemas/{model}"
HTTP_METHODS = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})


def install(app: FastAPI, models: Iterable[type[BaseModel]]) -> None:
    """Serve ``app``'s document with ``models``' integer bounds exact (built once, on the first request for it)."""
    models = list(models)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = exact_bounds(FastAPI.openapi(app), models)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customize the document


def exact_bounds(doc: dict, models: Iterable[type[BaseModel]]) -> dict:
    """``doc`` with each float bound that stands for one of ``models``' integer bounds replaced by that integer."""
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF_TEMPLATE)
    exact = defs.get("$defs", {})
    for name, schema in doc.get("components", {}).get("schemas", {}).items():
        source = exact.get(name.removesuffix("-Input"))
        if source is not None:
            _restore(schema, source)
    return doc


def _restore(served: object, exact: object) -> None:
    if isinstance(served, dict) and isinstance(exact, dict):
        for key, value in exact.items():
            if key not in served:
                continue
            if (key in BOUNDS and isinstance(value, int) and not isinstance(value, bool)
                    and isinstance(served[key], float) and float(value) == served[key]):
                served[key] = value
            else:
                _restore(served[key], value)
    elif isinstance(served, list) and isinstance(exact, list) and len(served) == len(exact):
        for s, e in zip(served, exact):
            _restore(s, e)


def documented_paths(app) -> list[tuple[re.Pattern, str, frozenset[str]]]:
    """(regex, template, methods) of each path of ``app``'s document, in its order: what a request path is matched
    against where the router's own choice is not at hand (the access log, a 405's Allow)."""
    paths = app.openapi().get("paths", {}) if hasattr(app, "openapi") else {}
    return [(compile_path(p)[0], p, frozenset(m.upper() for m in ops if m in HTTP_METHODS)) for p, ops in paths.items()]
