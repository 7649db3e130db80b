"""The chart's TLS (issue 24, finding 9): a CA and the fleet certificate made by helm, mounted as files into the
servers (certificate, key, CA) and the operator (CA only), named to both by INFERSCALE_TLS_*; a certificate that
really serves the internal API and the peer channel under the name the clients check."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

from cryptography import x509

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_chart import container, docs, effective_env, one, workload  # noqa: E402

SERVER_NAME = "inferscale-headless.inferscale.svc"  # <fullname>-headless.<namespace>.svc


def _tls_volume(w: dict) -> tuple[dict, dict]:
    spec = w["spec"]["template"]["spec"]
    volume = next(v for v in spec["volumes"] if v["name"] == "tls")
    mount = next(v for v in container(w)["volumeMounts"] if v["name"] == "tls")
    return volume, mount


def _files(tmp_path: Path, secret: dict) -> dict[str, Path]:
    out = {}
    for key, b64 in secret["data"].items():
        out[key] = tmp_path / key
        out[key].write_bytes(base64.b64decode(b64))
        out[key].chmod(0o600)
    return out


def test_tls_secret_and_mounts_by_default(tmp_path):
    m = docs("values.yaml")
    secret, ca_secret = one(m, "Secret", "-tls"), one(m, "Secret", "-tls-ca")
    assert secret["type"] == ca_secret["type"] == "kubernetes.io/tls"
    assert set(secret["data"]) == {"ca.crt", "tls.crt", "tls.key"} and secret["data"]["ca.crt"] == ca_secret["data"][
        "tls.crt"]
    srv, op = workload(m, "server"), workload(m, "operator")
    (sv, sm), (ov, om) = _tls_volume(srv), _tls_volume(op)
    assert sv["secret"]["secretName"] == ov["secret"]["secretName"] == secret["metadata"]["name"]
    assert [i["key"] for i in sv["secret"]["items"]] == ["ca.crt", "tls.crt", "tls.key"]
    assert [i["key"] for i in ov["secret"]["items"]] == ["ca.crt"]  # the operator never holds the fleet's key
    assert sv["secret"]["defaultMode"] == 0o440 and "subPath" not in sm and "subPath" not in om  # rotation in place
    assert sm["readOnly"] and om["readOnly"]
    s_env, o_env = effective_env(m, srv), effective_env(m, op)
    assert s_env["INFERSCALE_TLS_SERVER_NAME"] == o_env["INFERSCALE_TLS_SERVER_NAME"] == SERVER_NAME
    assert s_env["INFERSCALE_TLS_CA_FILE"] == o_env["INFERSCALE_TLS_CA_FILE"] == f"{sm['mountPath']}/ca.crt"
    assert s_env["INFERSCALE_TLS_KEY_FILE"] == f"{sm['mountPath']}/tls.key"
    assert "INFERSCALE_TLS_KEY_FILE" not in o_env and "INFERSCALE_TLS_CERT_FILE" not in o_env
    # No CA key reaches any pod: the CA Secret is mounted nowhere.
    ca_name = ca_secret["metadata"]["name"]
    for w in (srv, op):
        assert ca_name not in str(w["spec"]["template"]["spec"]["volumes"])


def test_the_rendered_certificate_serves_both_planes_under_the_server_name(tmp_path):
    """What helm's genCA/genSignedCert made loads in the fleet's TLS code, names the headless Service (and the
    pods under it), is for server and client use, and carries a peer session and an operator call."""
    from inferscale.fleettls import FleetTls
    from inferscale.store import peer

    files = _files(tmp_path, one(docs("values.yaml"), "Secret", "-tls"))
    cert = x509.load_pem_x509_certificate(files["tls.crt"].read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName)
    assert SERVER_NAME in names and f"*.{SERVER_NAME}" in names and f"{SERVER_NAME}.cluster.local" in names
    usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert {x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH} <= usages
    tls = FleetTls.from_files(files["ca.crt"], SERVER_NAME, files["tls.crt"], files["tls.key"], server=True)
    server = peer.PeerServer("127.0.0.1", 0, lambda m, s: {"ok": True}, "p" * 32, timeout_s=5.0, tls=tls)
    try:
        assert peer.request(f"127.0.0.1:{server.port}", {"op": "ping"}, 5.0, "p" * 32, tls) == {"ok": True}
    finally:
        server.close()


def test_each_render_issues_a_new_certificate_under_its_own_ca():
    """helm template has no cluster to look the CA up in; installs keep it (lookup), every render re-issues the
    fleet certificate: rotation by re-rendering."""
    a, b = (one(docs("values.yaml", sets=(f"tls.certDays={d}",)), "Secret", "-tls") for d in (30, 31))
    assert a["data"]["tls.crt"] != b["data"]["tls.crt"]


def test_tls_can_be_brought_or_turned_off():
    m = docs("values.yaml", sets=("tls.existingSecret=fleet-cert-manager",))
    assert not [x for x in m if x["kind"] == "Secret" and "-tls" in x["metadata"]["name"]]
    assert _tls_volume(workload(m, "server"))[0]["secret"]["secretName"] == "fleet-cert-manager"
    m = docs("values.yaml", sets=("tls.serverName=fleet.example.internal",))
    cert = x509.load_pem_x509_certificate(base64.b64decode(one(m, "Secret", "-tls")["data"]["tls.crt"]))
    assert cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName) == ["fleet.example.internal", "*.fleet.example.internal"]
    assert effective_env(m, workload(m, "operator"))["INFERSCALE_TLS_SERVER_NAME"] == "fleet.example.internal"
    off = docs("values.yaml", sets=("tls.enabled=false",))
    assert not [x for x in off if x["kind"] == "Secret" and "-tls" in x["metadata"]["name"]]
    for c in ("server", "operator"):
        w = workload(off, c)
        assert "tls" not in [v["name"] for v in w["spec"]["template"]["spec"]["volumes"]]
        assert not [k for k in effective_env(off, w) if k.startswith("INFERSCALE_TLS_")]
