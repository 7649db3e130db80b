"""The control plane's certificates, made at start: one CA, the API server's serving certificate, client certificates
(CN = user, O = groups, as kube-apiserver's x509 authenticator reads them) and the service-account signing key."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DAY = datetime.timedelta(days=1)


def _pem_key(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class CertificateAuthority:
    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "inferscale-e2e-ca")])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(self.key.public_key())
                     .serial_number(x509.random_serial_number()).not_valid_before(now - DAY)
                     .not_valid_after(now + 30 * DAY)
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                  content_commitment=False, key_encipherment=False,
                                                  data_encipherment=False, key_agreement=False, encipher_only=False,
                                                  decipher_only=False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.cert_file = self.dir / "ca.crt"
        self.cert_file.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, *, cn: str, groups: tuple[str, ...] = (), server_names: tuple[str, ...] = (),
              server_ips: tuple[str, ...] = (), client_too: bool = False) -> tuple[Path, Path]:
        """A leaf certificate (client, or server when names/IPs are given, and then client as well with
        ``client_too``); returns (cert file, key file)."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([*(x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups),
                             x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        now = datetime.datetime.now(datetime.timezone.utc)
        server = bool(server_names or server_ips)
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(self.cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - DAY).not_valid_after(now + 30 * DAY)
                   .add_extension(x509.ExtendedKeyUsage(
                       [*([ExtendedKeyUsageOID.SERVER_AUTH] if server else []),
                        *([ExtendedKeyUsageOID.CLIENT_AUTH] if client_too or not server else [])]), critical=False))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [*(x509.DNSName(n) for n in server_names), *(x509.IPAddress(ipaddress.ip_address(i))
                                                              for i in server_ips)]), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        cert_file, key_file = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(_pem_key(key))
        key_file.chmod(0o600)
        return cert_file, key_file


def fleet_tls_files(directory: Path, server_name: str) -> dict[str, Path]:
    """The serving pods' TLS files as the chart makes them (templates/tls.yaml: genCA, genSignedCert): a CA of
    their own and one certificate for the fleet's name (and its subdomains), for server and client use.
    Keys: ca, cert, key."""
    ca = CertificateAuthority(directory)
    cert, key = ca.issue("fleet", cn=server_name, server_names=(server_name, f"*.{server_name}"), client_too=True)
    return {"ca": ca.cert_file, "cert": cert, "key": key}


def service_account_keys(directory: Path) -> tuple[Path, Path]:
    """The key pair the API server signs service-account tokens with (and verifies them by); (private, public)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private, public = Path(directory) / "sa.key", Path(directory) / "sa.pub"
    private.write_bytes(_pem_key(key))
    private.chmod(0o600)
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public
