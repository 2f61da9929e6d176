"""TLS for the endpoint picker's gRPC port: a given certificate, or one generated at start.

Gateways reach an Inference Extension picker over TLS with an empty validation context
(GIE's and llm-d-router's reference Envoys, Envoy AI Gateway's generated cluster, Istio's
DestinationRule with ``insecureSkipVerify``): they encrypt but do not check who answers.
So a picker without a configured certificate makes a self-signed one for itself when it
starts, in memory, as the reference pickers do; one mounted from a Secret wins.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc

VALID_DAYS = 3650  # nobody checks it; a certificate that expires under a running pod helps no one


def self_signed(names: tuple[str, ...] = ("localhost",)) -> tuple[bytes, bytes]:
    """A fresh P-256 key and a self-signed certificate for ``names``: (cert PEM, key PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    sans: list[x509.GeneralName] = []
    for n in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            sans.append(x509.DNSName(n))
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def certificate(cert_file: str | None = None, key_file: str | None = None,
                names: tuple[str, ...] = ("localhost",)) -> tuple[bytes, bytes]:
    """The picker's (cert PEM, key PEM): the files when both are given, else generated."""
    if bool(cert_file) != bool(key_file):
        raise ValueError("a TLS certificate needs both --picker-cert and --picker-key")
    if cert_file and key_file:
        return Path(cert_file).read_bytes(), Path(key_file).read_bytes()
    return self_signed(names)


def server_credentials(cert_file: str | None = None, key_file: str | None = None,
                       names: tuple[str, ...] = ("localhost",)) -> grpc.ServerCredentials:
    """The credentials of the picker's TLS port on grpcio."""
    cert, key = certificate(cert_file, key_file, names)
    return grpc.ssl_server_credentials([(key, cert)])
