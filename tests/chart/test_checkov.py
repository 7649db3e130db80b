"""checkov on every rendering of the chart and on the operator's Job manifests (issue 24).

The bar: none of BAR fails anywhere (CKV_K8S_43 with image digests set). Any other failed check must be listed,
with its reason, in the table "checkov checks that do not apply" of charts/inferscale/README.md; OPEN names the
bar checks still failing, with the finding that fixes them, and must shrink as they are fixed (a check listed
there that passes fails this test too).

checkov runs from its own venv (scripts/setup.sh makes .venv-tools; $INFERSCALE_CHECKOV overrides). Missing, the
test skips locally and fails under CI=true.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_chart as chart  # noqa: E402  (helm, template_args, docs, workload, effective_env)

BAR = {"CKV_K8S_25", "CKV_K8S_35", "CKV_K8S_43", "CKV2_K8S_6"}
# Bar checks that still fail, and what fixes them: {check: (resource fragment, why)}.
OPEN: dict[str, tuple[str, str]] = {}
DIGEST = "sha256:" + "ab" * 32
PINNED = (f"image.digest={DIGEST}", f"operator.image.digest={DIGEST}", "tenants={acme,globex}")
# name -> (values files, --set values, --api-versions): the values files and the variants tests/chart renders.
RENDERINGS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    **{v.removesuffix(".yaml"): ((v,), PINNED, ()) for v in chart.VALUES_FILES},
    "daemonset-secrets": (("values.yaml",), (*PINNED, "server.kind=DaemonSet", "operator.readTenantSecrets=true"),
                          ()),
    "jobs-namespace-named": (("values.yaml",), (*PINNED, "encoder.namespace=batch", "encoder.createNamespace=false"),
                             ()),
    "otel-monitor": (("values.yaml",), (*PINNED, "serviceMonitor.enabled=true", "otel.enabled=true",
                                        "otel.endpoint=http://otel:4318", "otel.headersSecret.name=otlp-auth",
                                        "internalToken.existingSecret=tok", "apiKeys.existingSecret=keys"),
                     (chart.SM_API,)),
}


def checkov_bin() -> str:
    explicit = os.environ.get("INFERSCALE_CHECKOV")
    local = chart.ROOT / ".venv-tools" / "bin" / "checkov"
    found = explicit or (str(local) if local.exists() else shutil.which("checkov"))
    if not found:
        msg = "checkov not found: run scripts/setup.sh (it makes .venv-tools) or set INFERSCALE_CHECKOV"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return found


def job_manifests(rendered: list[dict]) -> list[dict]:
    """The operator's encode Jobs, made by its own code from the settings the chart gives it (its credential from
    its own Secret, with its tenant's derived keys)."""
    from inferscale.operator import jobs
    from inferscale.operator.settings import Settings

    env = {k: str(v) for k, v in chart.effective_env(rendered, chart.workload(rendered, "operator")).items()
           if isinstance(v, str) and not k.endswith("_FILE") and not k.startswith("INFERSCALE_TLS_")}
    cfg = Settings.from_env(env)  # the files are not here; the Job's TLS comes with its Delivery as the operator makes it
    to = jobs.Delivery("https://10.0.0.1:8001/internal/v1/ingest/acme/u", "ns/server-0", "node-1",
                       "-----BEGIN CERTIFICATE-----", "inferscale-headless.ns.svc")
    return [jobs.job_manifest("acme-u-enc-0123456789", "acme", "u", "uid-1", "u", cfg.models[0], ["m1"], cfg, to,
                              "isu1.claims.mac")]


def accepted_in_readme() -> dict[str, str]:
    """{check id: reason} from the chart README's table of checks that do not apply."""
    text = (chart.CHART / "README.md").read_text()
    section = text.split("### checkov checks that do not apply", 1)[1].split("\n#", 1)[0]
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| `(CKV2?_K8S_\d+)` \|[^|]*\|([^|]+)\|", section,
                                                                  re.M)}


@pytest.fixture(scope="module")
def failures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[tuple[str, str]]]:
    """{rendering: {(check id, resource)}} of the failed checks."""
    exe = checkov_bin()
    out: dict[str, set[tuple[str, str]]] = {}
    root = tmp_path_factory.mktemp("checkov")
    for name, (files, sets, api) in RENDERINGS.items():
        m = chart.docs(*files, sets=sets, api_versions=api)
        d = root / name
        d.mkdir()
        (d / "chart.yaml").write_text(yaml.safe_dump_all(m))
        (d / "jobs.yaml").write_text(yaml.safe_dump_all(job_manifests(m)))
    proc = subprocess.run([exe, "-d", str(root), "--framework", "kubernetes", "-o", "json", "--quiet", "--compact"],
                          capture_output=True, text=True, timeout=600)
    assert proc.stdout.strip(), f"checkov printed nothing: {proc.stderr[-2000:]}"
    reports = json.loads(proc.stdout)
    for report in reports if isinstance(reports, list) else [reports]:
        for c in report["results"]["failed_checks"]:
            rendering = Path(c["file_path"]).parts[1] if c["file_path"].startswith("/") else c["file_path"]
            out.setdefault(rendering, set()).add((c["check_id"], c["resource"]))
    for name in RENDERINGS:
        out.setdefault(name, set())
    return out


def test_no_bar_check_fails_on_any_rendering_or_job(failures: dict[str, set[tuple[str, str]]]) -> None:
    bad = {(r, cid, res) for r, fs in failures.items() for cid, res in fs if cid in BAR and cid not in OPEN}
    assert not bad, f"checks of the bar fail: {sorted(bad)}"
    for cid, (fragment, why) in OPEN.items():
        still = [res for fs in failures.values() for c, res in fs if c == cid and fragment in res]
        assert still, f"{cid} passes now ({why}): remove it from OPEN and the README"


def test_every_other_failed_check_is_listed_in_the_readme(failures: dict[str, set[tuple[str, str]]]) -> None:
    accepted = accepted_in_readme()
    assert accepted and all(accepted.values()), "the README table gives a reason for each check"
    unlisted = {(cid, res) for fs in failures.values() for cid, res in fs if cid not in BAR | set(accepted)}
    assert not unlisted, f"failed checks neither fixed nor listed in charts/inferscale/README.md: {sorted(unlisted)}"
    failing = {cid for fs in failures.values() for cid, _ in fs}
    assert not set(accepted) - failing - set(OPEN), "a check listed in the README passes now: drop it from the table"


def test_the_job_manifests_are_checked_with_their_policy(failures: dict[str, set[tuple[str, str]]]) -> None:
    """Control: the Jobs really are in the scan (checkov names their resources), and CKV2_K8S_6 sees the chart's
    Jobs NetworkPolicy for them (it would fail for a Job with no policy selecting it)."""
    jobs_seen = {res for fs in failures.values() for _, res in fs if res.startswith("Job.")}
    assert jobs_seen, "the operator's Job manifests were not scanned"
