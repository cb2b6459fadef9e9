"""uvicorn serving the HTTP API on a thread of its own, on a socket bound before it starts (so a
port in use is named at once), over TLS with the gRPC API's files where they are set."""

from __future__ import annotations

import socket
import ssl
import threading
import time

import uvicorn

from sssd.common.rpc.tls import TlsFiles
from sssd.verifier.serving.http_api.app import OpenAIApi


class HttpServer:
    """uvicorn serving an OpenAIApi on a thread of its own; over TLS with the same files as the
    gRPC API (SSSD_TLS_CERT/KEY; with SSSD_TLS_CA clients must present a certificate)."""

    def __init__(self, api: OpenAIApi, host: str, port: int, tls: TlsFiles | None = None) -> None:
        self.api = api
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as exc:
            self._socket.close()
            raise RuntimeError(f"the HTTP API cannot bind {host}:{port} ({exc.strerror}): move "
                               "it with --http-port, or turn it off with --no-http") from None
        self._socket.listen(256)
        self.host = host
        self.port = self._socket.getsockname()[1]
        self.tls = tls if tls is not None and tls.serves_tls else None
        secure = {}
        if self.tls is not None:
            secure = {"ssl_certfile": self.tls.cert, "ssl_keyfile": self.tls.key}
            if self.tls.ca:
                secure |= {"ssl_ca_certs": self.tls.ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        config = uvicorn.Config(api.app, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=1, access_log=False, **secure)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._socket]},
                                        name="http-api", daemon=True)

    def start(self) -> "HttpServer":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started and self._thread.is_alive() and \
                time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            raise RuntimeError(f"the HTTP API did not start on {self.host}:{self.port}")
        return self

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()
        self.api.close()
