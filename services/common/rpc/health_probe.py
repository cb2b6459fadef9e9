"""`sssd-health-probe`: one gRPC health check of a local service, for exec probes.

Kubernetes' built-in gRPC probe speaks plaintext only, so a service that serves TLS is probed
with this command instead (the Helm chart does it when `tls.secretName` is set):

    sssd-health-probe --port 50051 --server-name demo-sssd-serve-drafter

It dials 127.0.0.1:PORT with the TLS files of SSSD_TLS_CERT / _KEY / _CA (plaintext when no CA
is set), asks grpc.health.v1.Health/Check for the service (default "", the whole server) and
exits 0 when it answers SERVING, 1 when it answers anything else or does not answer within
--timeout, with one line on stderr saying which.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sssd.common.rpc.tls import TlsFiles, channel


def check(port: int, service: str = "", timeout_s: float = 2.0, server_name: str | None = None,
          host: str = "127.0.0.1") -> str | None:
    """None when the service answers SERVING, else why not (one line)."""
    tls = TlsFiles.from_env()
    if server_name:
        tls = dataclasses.replace(tls, server_name=server_name)
    with channel(f"{host}:{port}", tls) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return f"{host}:{port}: {exc.code().name}: {exc.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{host}:{port}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sssd-health-probe", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True, help="the service's port on 127.0.0.1")
    parser.add_argument("--service", default="", help='health service name (default "": all)')
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds (default 2)")
    parser.add_argument("--server-name", default=None,
                        help="name to verify in the server's certificate (default: "
                        "SSSD_TLS_SERVER_NAME, else 127.0.0.1)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    try:
        problem = check(args.port, args.service, args.timeout, args.server_name)
    except ValueError as exc:  # unreadable TLS files
        problem = str(exc)
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
