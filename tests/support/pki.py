"""Certificates for the TLS tests: certificate authorities made on the fly."""

import datetime
import ipaddress

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def make_ca(directory, name: str, server_names=()):
    """A self-signed CA named `name` in `directory`, with a server certificate (127.0.0.1,
    localhost and `server_names`) and a client certificate it signed: {"ca": path,
    "server": (cert, key), "client": (cert, key)}."""


    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} test CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .sign(ca_key, hashes.SHA256()))

    def pem_key(key):
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    def issue(common_name: str, usages, sans):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                               common_name)]))
                   .issuer_name(ca_name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        cert_path = directory / f"{name}-{common_name}.crt"
        key_path = directory / f"{name}-{common_name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(pem_key(key))
        return str(cert_path), str(key_path)

    ca_path = directory / f"{name}-ca.crt"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    # The server certificate may also identify its process as a client (one identity per
    # service, as `sssd up --tls-*` uses it).
    server = issue("server", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                   [x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.DNSName("localhost"), *map(x509.DNSName, server_names)])
    client = issue("client", [ExtendedKeyUsageOID.CLIENT_AUTH], [])
    return {"ca": str(ca_path), "server": server, "client": client}


@pytest.fixture(scope="session")
def ca_factory():
    """make_ca, for a test that needs a CA of its own (other server names)."""
    return make_ca


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """Two unrelated CAs, "ours" and "theirs", each with server and client certificates."""
    directory = tmp_path_factory.mktemp("pki")
    return {"ours": make_ca(directory, "ours"), "theirs": make_ca(directory, "theirs")}
