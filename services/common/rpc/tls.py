"""gRPC TLS for every service and client, from configuration.

Every server command takes `--tls-cert`, `--tls-key` and `--tls-ca`; every client takes a
`TlsFiles`. Both default to the environment, so one set of variables configures a whole
deployment (mount a Secret and set them, as the Helm chart does with `tls.secretName`;
`sssd up` passes its environment to its children and Ray workers):

    SSSD_TLS_CERT         PEM certificate chain of this process (server, or client for mTLS)
    SSSD_TLS_KEY          its PEM private key
    SSSD_TLS_CA           PEM CA bundle that verifies the other side
    SSSD_TLS_SERVER_NAME  clients: the name to check in the server's certificate, when the
                          address dialled is not in it

A server with a certificate and key serves TLS only; with a CA as well it also requires a client
certificate signed by it (mutual TLS). A client with a CA speaks TLS and verifies the server;
with a certificate and key as well it presents them. With none of it set, everything stays
plaintext on loopback, as before (services bind 127.0.0.1 unless told otherwise).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

# A neighbour on the same node or rack: after it restarts, reconnect within a second (gRPC's
# default backoff grows to two minutes, all of them without speculation). Starting a batch of
# long prompts may exceed gRPC's default 4 MiB message limit.
CLIENT_CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1),
                          ("grpc.max_receive_message_length", -1),
                          ("grpc.initial_reconnect_backoff_ms", 100),
                          ("grpc.min_reconnect_backoff_ms", 100),
                          ("grpc.max_reconnect_backoff_ms", 1000)]


ENV = {"cert": "SSSD_TLS_CERT", "key": "SSSD_TLS_KEY", "ca": "SSSD_TLS_CA",
       "server_name": "SSSD_TLS_SERVER_NAME"}


@dataclass(frozen=True)
class TlsFiles:
    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("TLS needs both a certificate and its key (--tls-cert and "
                             "--tls-key, or SSSD_TLS_CERT and SSSD_TLS_KEY); got only the "
                             + ("certificate" if self.cert else "key"))

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "TlsFiles":
        environ = os.environ if environ is None else environ
        return cls(**{name: environ.get(variable) or None for name, variable in ENV.items()})

    @property
    def serves_tls(self) -> bool:
        return bool(self.cert)

    @property
    def dials_tls(self) -> bool:
        return bool(self.ca)

    def _read(self, name: str) -> bytes | None:
        path = getattr(self, name)
        if not path:
            return None
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"TLS {name} file {path}: {exc.strerror or exc}") from exc
        if b"-----BEGIN" not in data:
            raise ValueError(f"TLS {name} file {path} is not PEM")
        return data

    def server_credentials(self) -> grpc.ServerCredentials:
        if not self.serves_tls:
            raise ValueError("a TLS server needs --tls-cert and --tls-key")
        ca = self._read("ca")
        return grpc.ssl_server_credentials([(self._read("key"), self._read("cert"))],
                                           root_certificates=ca,
                                           require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        if not self.dials_tls:
            raise ValueError("a TLS client needs a CA (--tls-ca or SSSD_TLS_CA)")
        return grpc.ssl_channel_credentials(root_certificates=self._read("ca"),
                                            private_key=self._read("key"),
                                            certificate_chain=self._read("cert"))

    def channel_options(self) -> list[tuple[str, str]]:
        if self.dials_tls and self.server_name:
            return [("grpc.ssl_target_name_override", self.server_name)]
        return []


def resolve(tls: TlsFiles | None) -> TlsFiles:
    return TlsFiles.from_env() if tls is None else tls


def bind(server: grpc.Server, address: str, tls: TlsFiles | None = None) -> int:
    """Adds the listening port (TLS when configured); returns the port bound."""
    tls = resolve(tls)
    if tls.serves_tls:
        return server.add_secure_port(address, tls.server_credentials())
    return server.add_insecure_port(address)


def channel(target: str, tls: TlsFiles | None = None,
            options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A channel to `target`, TLS when a CA is configured."""
    tls = resolve(tls)
    options = list(options) + tls.channel_options()
    if tls.dials_tls:
        return grpc.secure_channel(target, tls.channel_credentials(), options=options)
    return grpc.insecure_channel(target, options=options)


def aio_channel(target: str, tls: TlsFiles | None = None,
                options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    tls = resolve(tls)
    options = list(options) + tls.channel_options()
    if tls.dials_tls:
        return grpc.aio.secure_channel(target, tls.channel_credentials(), options=options)
    return grpc.aio.insecure_channel(target, options=options)


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    """--tls-cert, --tls-key, --tls-ca (defaults: SSSD_TLS_CERT, SSSD_TLS_KEY, SSSD_TLS_CA)."""
    group = parser.add_argument_group("TLS (defaults from SSSD_TLS_CERT/_KEY/_CA)")
    for name, text in (("cert", "PEM certificate chain: serve TLS"),
                       ("key", "PEM private key of --tls-cert"),
                       ("ca", "PEM CA bundle: require client certificates signed by it")):
        group.add_argument(f"--tls-{name}", default=os.environ.get(ENV[name]) or None, help=text)


def tls_from_args(args: argparse.Namespace) -> TlsFiles:
    """The flags' TlsFiles, also exported to this process's environment, so the clients it
    creates (and its children) dial with the same files."""
    tls = TlsFiles(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca,
                   server_name=os.environ.get(ENV["server_name"]) or None)
    for name in ("cert", "key", "ca"):
        value = getattr(tls, name)
        if value:
            os.environ[ENV[name]] = str(Path(value).resolve())
    if tls.serves_tls:
        tls.server_credentials()  # unreadable or non-PEM files fail at start, with the name
    return tls
