"""The attack matrix reuses the operator's fixtures: KMock, stand-in serving pods, the real operator (KopfRunner)."""

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

cluster = operator_test_conftest.cluster
standins = operator_test_conftest.standins
operator = operator_test_conftest.operator
