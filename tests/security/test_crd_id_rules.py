"""One id rule for CRD, operator, server and store (inferscale.contract), and the CRD's CEL guards (issue 11).

KMock evaluates no CEL: here the CRD text keeps the contract's rules; e2e/test_real_apiserver.py has a real API
server refuse `userId: "a..b"` and a changed userId; the operator side (what happens when such an object reaches
it anyway) is in test_operator_attacks.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from inferscale.contract import ID_CEL_RULE, ID_PATTERN, is_valid_id

ROOT = Path(__file__).resolve().parents[2]
CRDS = [ROOT / "crds" / "usermemory.yaml", ROOT / "charts" / "inferscale" / "crds" / "usermemory.yaml"]


def spec_schema(path: Path) -> dict[str, Any]:
    (version,) = yaml.safe_load(path.read_text())["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


def rules(field: dict[str, Any]) -> list[str]:
    return [v["rule"] for v in field.get("x-kubernetes-validations") or []]


@pytest.mark.parametrize("path", CRDS, ids=lambda p: str(p.relative_to(ROOT)))
def test_crd_id_fields_follow_the_contract(path: Path) -> None:
    spec = spec_schema(path)
    user, item = spec["properties"]["userId"], spec["properties"]["memories"]["items"]["properties"]["id"]
    for field in (user, item):
        assert field["pattern"] == ID_PATTERN and ID_CEL_RULE in rules(field)
    assert "self == oldSelf" in rules(user), "spec.userId is immutable"


@pytest.mark.parametrize("value", ["a..b", "..", "a/b", "a\n", "-a", "", "x" * 129])
def test_the_contract_refuses_ids_that_climb_or_smuggle(value: str) -> None:
    assert not is_valid_id(value)
