"""Default ports of every service, defined once (CLIs, configuration defaults, the Helm chart).

Every service binds 127.0.0.1 by default; 0 anywhere means "let the OS pick" (tests).
"""

GENERATE_PORT = 50061  # the public Generate API (proto/sssd/v1/generate.proto)
DRAFTER_PORT = 50051  # the SSSD drafter service (proto/sssd/v1/drafter.proto)
INDEXER_PORT = 50071  # the indexer's gRPC health service
INDEXER_METRICS_PORT = 9108  # the indexer's Prometheus endpoint
RAY_DASHBOARD_PORT = 8265  # the local Ray cluster's dashboard
RAY_METRICS_PORT = 8080  # the local Ray node's Prometheus endpoint (decode/prefill metrics)
REDIS_PORT = 6379  # the embedded redis-server of the live datastore
