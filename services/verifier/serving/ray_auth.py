"""Starting a local Ray cluster, or joining one, with token authentication.

Authentication: Ray 2.59+ turns token authentication on by default for a new local cluster, and
this deployment keeps it on by default (`RayConfig.auth = "token"`): Ray's GCS, raylet and
object-manager ports listen on every interface even when the node address is 127.0.0.1 (checked
with `ss -ltnp` on Ray 2.60), so a cluster without auth is open to anyone who can reach the
machine. The token is `auth_token`, else RAY_AUTH_TOKEN, else, for a new local cluster, a fresh
random one (written to `token_file` when set, mode 0600, for the dashboard's login); joining a
cluster (`address`) without one leaves it to Ray (RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token).
`auth = "disabled"` is an explicit opt-out for machines whose network is closed otherwise; it is
refused when `host` is not a loopback address. The Prometheus endpoint needs no token.
"""

from __future__ import annotations

import logging
import os
import secrets
import time

import ray
import ray._raylet as raylet

from sssd.verifier.serving.config import RayConfig

logger = logging.getLogger(__name__)

NAMESPACE = "sssd"


def configure_auth(config: RayConfig) -> str | None:
    """Sets Ray's auth variables for this process and its children; returns the file a newly
    generated token was written to, if any."""
    os.environ["RAY_AUTH_MODE"] = config.auth
    if config.auth == "disabled":
        os.environ.pop("RAY_AUTH_TOKEN", None)
        _reload_ray_auth()
        logger.warning("Ray token authentication is disabled: Ray's ports listen on every "
                       "interface, so only do this on a machine whose network is closed")
        return None
    token = config.auth_token or os.environ.get("RAY_AUTH_TOKEN")
    written = None
    if not token and config.address is None:
        token = secrets.token_hex(32)
        if config.token_file:
            path = os.path.abspath(config.token_file)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "w") as f:
                f.write(token + "\n")
            written = path
    if token:
        os.environ["RAY_AUTH_TOKEN"] = token
    _reload_ray_auth()
    return written


def _reload_ray_auth() -> None:
    """Ray reads RAY_AUTH_MODE and the token once, when its core is first used in a process;
    make an already imported Ray see the values just set (the same refresh Ray does when it
    turns token auth on itself)."""
    raylet.Config.initialize("")
    raylet.AuthenticationTokenLoader.instance().reset_cache()


def init_ray(config: RayConfig) -> dict:
    """Starts a local Ray cluster (or joins `config.address`) with the configured auth mode;
    returns where its dashboard and Prometheus endpoint are."""
    token_file = configure_auth(config)
    if config.address is not None:
        context = ray.init(address=config.address, namespace=NAMESPACE,
                           log_to_driver=False, configure_logging=False)
        return {"dashboard": context.dashboard_url, "metrics": None, "auth": config.auth}
    for attempt in (1, 2, 3):
        try:
            context = _init_local(config)
            break
        except Exception as exc:  # noqa: BLE001 - Ray raises bare Exceptions while starting
            # Seen here on Ray 2.60, each on the first start after another cluster had just
            # stopped: the raylet not registering within Ray's fixed 30 s, the dashboard's
            # process gone before it wrote its log. A fresh start right after works.
            if attempt == 3:
                raise
            logger.warning("the local Ray cluster did not start (%s); starting it again", exc)
            ray.shutdown()
            time.sleep(2.0)
    dashboard = f"http://{context.dashboard_url}" if context.dashboard_url else None
    return {"dashboard": dashboard, "auth": config.auth, "token_file": token_file,
            "metrics": f"http://{config.host}:{config.metrics_port}/metrics"}


def _init_local(config: RayConfig):
    return ray.init(
        num_cpus=config.num_cpus or os.cpu_count() or 1,
        namespace=NAMESPACE,
        include_dashboard=config.dashboard_port > 0,
        dashboard_host=config.host,
        dashboard_port=config.dashboard_port or None,
        object_store_memory=config.object_store_bytes,
        _node_ip_address=config.host,
        _metrics_export_port=config.metrics_port,
        _system_config={"metrics_report_interval_ms": config.metrics_report_interval_ms},
        log_to_driver=False,
        configure_logging=False,
    )
