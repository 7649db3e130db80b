"""The attack matrix reuses the operator's fixtures: KMock, stand-in serving pods, the real operator (KopfRunner).

Loaded under its own module name (not `conftest`): tests/operator's modules import their conftest by that name, and a
second conftest here would shadow it when both directories are collected together.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_OPERATOR_TESTS = Path(__file__).resolve().parents[1] / "operator"
sys.path.insert(0, str(_OPERATOR_TESTS))  # operator_fakes

_spec = importlib.util.spec_from_file_location("operator_test_conftest", _OPERATOR_TESTS / "conftest.py")
assert _spec is not None and _spec.loader is not None
operator_test_conftest = importlib.util.module_from_spec(_spec)
sys.modules["operator_test_conftest"] = operator_test_conftest
_spec.loader.exec_module(operator_test_conftest)

JOB_NS = operator_test_conftest.JOB_NS
TENANT = operator_test_conftest.TENANT
Cluster = operator_test_conftest.Cluster
running_operator = operator_test_conftest.running_operator
wait_for = operator_test_conftest.wait_for
cluster = operator_test_conftest.cluster
standins = operator_test_conftest.standins
operator = operator_test_conftest.operator
