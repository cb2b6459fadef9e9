import errno
import socket

"""Default ports of every service, defined once (CLIs, configuration defaults, the Helm chart).

Every service binds 127.0.0.1 by default; 0 anywhere means "let the OS pick" (tests).
"""

GENERATE_PORT = 50061  # the public Generate API (proto/sssd/v1/generate.proto)
HTTP_PORT = 8000  # the OpenAI-compatible HTTP API, in the same process as the Generate API
DRAFTER_PORT = 50051  # the SSSD drafter service (proto/sssd/v1/drafter.proto)
SPECULATOR_PORT = 50081  # the SSD speculator service (proto/sssd/v1/speculator.proto)
INDEXER_PORT = 50071  # the indexer's gRPC health service
INDEXER_METRICS_PORT = 9108  # the indexer's Prometheus endpoint
SPECULATOR_METRICS_PORT = 9109  # the speculator's Prometheus endpoint
RAY_DASHBOARD_PORT = 8265  # the local Ray cluster's dashboard
RAY_METRICS_PORT = 8080  # the local Ray node's Prometheus endpoint (decode/prefill metrics)
REDIS_PORT = 6379  # the embedded redis-server of the live datastore


def busy_ports(host: str, ports: dict[str, int]) -> list[str]:
    """What stops a stack from binding `ports` ({flag: port}) on `host`, one line per problem:
    a port another process holds, or one port given to two flags. Port 0 (any) is skipped. Run
    before starting anything, so that the cause is named before a dependency (Ray, Redis) dies
    on it with an error of its own."""
    problems, owners = [], {}
    for flag, port in ports.items():
        if port == 0:
            continue
        if port in owners:
            problems.append(f"port {port} is given to both {owners[port]} and {flag}")
            continue
        owners[port] = flag
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError as exc:
                reason = "is in use by another process" if exc.errno == errno.EADDRINUSE \
                    else f"cannot be bound ({exc.strerror})"
                problems.append(f"port {port} ({flag}) {reason}; pick another with {flag} PORT")
    return problems
