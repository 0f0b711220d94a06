"""A throwaway PKI for TLS tests (and the README's mTLS example): one CA, certificates it signs.

Every certificate names ``localhost`` and ``127.0.0.1`` (what the tests dial) plus the extra names asked
for, and may serve as both a server and a client certificate (one certificate per process, as Tandem uses
it). Run as a script to write a CA and certificates for a local deployment:

    python -m tests.security.certs DIR gateway prefill-0 decode-0
"""

from __future__ import annotations

import datetime
import ipaddress
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    """What the tests use: the cluster's CA, two members' certificates, and an intruder's."""

    ca: Path
    server: Issued  # a node's (or the gateway's) certificate
    client: Issued  # another cluster member's
    rogue: Issued  # signed by a CA the cluster does not trust


class CertificateAuthority:
    """A self-signed CA in ``directory`` (``<name>-ca.pem``) that issues ``<name>.pem`` + ``<name>.key``."""

    def __init__(self, directory: Path, name: str = "tandem-test") -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                      .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                      .not_valid_before(now - datetime.timedelta(minutes=5))
                      .not_valid_after(now + datetime.timedelta(days=1))
                      .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                      .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                   content_commitment=False, key_encipherment=False,
                                                   data_encipherment=False, key_agreement=False,
                                                   encipher_only=False, decipher_only=False), critical=True)
                      .sign(self._key, hashes.SHA256()))
        self.ca = directory / f"{name}-ca.pem"
        self.ca.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, hosts: tuple[str, ...] = ()) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(self._cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(self._key, hashes.SHA256()))
        issued = Issued(self.directory / f"{name}.pem", self.directory / f"{name}.key")
        issued.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        issued.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()))
        issued.key.chmod(0o600)
        return issued


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m tests.security.certs DIR NAME [NAME...]", file=sys.stderr)
        return 2
    authority = CertificateAuthority(Path(argv[0]), "tandem")
    print(f"CA: {authority.ca}")
    for name in argv[1:]:
        issued = authority.issue(name)
        print(f"{name}: {issued.cert} {issued.key}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
