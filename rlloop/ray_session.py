"""A local Ray's lifetime in a run: started once, kept while the loop rebuilds its cluster (a trainer rank's death
rebuilds the actors, not Ray), stopped at the end; and what a killed earlier run left behind, ended at that start.

When the driver that started a local Ray dies without `ray.shutdown()`, its GCS and raylet exit with it, but each
node's `ray::DashboardAgent` and `ray::RuntimeEnvAgent` first try to report the raylet's death to the GCS, which is
gone, and wait out that report's hard-coded 60 s timeout (ray/_private/utils.py `publish_error_to_driver`). By
Ray's own rule (process_watcher.py: an agent whose parent is no longer its raylet kills itself) they are already
doomed; the driver that starts the next local Ray ends them at once instead.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from contextlib import contextmanager

import psutil

from rlloop.config import Config
from rlloop.errors import ClusterError

log = logging.getLogger(__name__)

NAMESPACE = "rlloop"  # the run's named actors (the Ray sync mailbox) live here

AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def orphaned_agents() -> list[psutil.Process]:
    """This user's Ray agents whose parent is not a raylet any more (re-parented to init or a subreaper)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "uids"]):
        try:
            title = (proc.info["cmdline"] or [""])[0]
            if title not in AGENTS or proc.info["uids"].real != os.getuid():
                continue
            parent = proc.parent()
            if parent is None or "raylet" not in parent.name():
                found.append(proc)
        except psutil.Error:  # gone, or not ours to inspect
            continue
    return found


def reap_orphaned_agents(timeout: float = 5.0) -> int:
    """SIGKILL the orphaned agents and wait for them; returns how many there were."""
    procs = orphaned_agents()
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=timeout)
    if procs:
        log.info("ended %d Ray agent(s) left by a killed earlier run", len(procs))
    return len(procs)


def ray_address(cfg: Config) -> str | None:
    """The Ray cluster to connect to: `cluster.address`, else $RAY_ADDRESS (a Ray job's); None starts a local one."""
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    return None if address in ("", "local") else address  # Ray's "local" is a Ray of the run's own, as is none


def local_ray(cfg: Config) -> bool:
    """Whether this driver's Ray is one started in this process (no `cluster.address`, no RAY_ADDRESS): its resources
    are the host's and stay so, where a cluster it connects to may have an autoscaler that adds nodes."""
    return ray_address(cfg) is None


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """A head at `host:port` must answer: ray.init retries an unreachable one for minutes, printing only Ray's
    "Failed to connect to GCS" warnings. Other forms (ray://, auto) are Ray's to resolve."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or "/" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ClusterError(
            f"no Ray head answers at {address} (cluster.address or RAY_ADDRESS): {e}; start one there (`ray start "
            "--head`), or leave both unset to start a local Ray"
        ) from None


# Ray 2.60 turns token authentication on in a driver that joins by `auto` once ~/.ray/auth_token exists (any local
# Ray writes it); a head started with it off cannot reach such a driver, and every actor is cancelled before it runs
AUTH_HINT = (
    "a head started with RAY_AUTH_MODE=disabled needs RAY_AUTH_MODE=disabled in this driver's environment too (and "
    "one with token authentication, the same token: RAY_AUTH_TOKEN or ~/.ray/auth_token)"
)


def _check_actors_start(address: str, timeout_s: float = 120.0) -> None:
    """An actor must start on the joined cluster: with the driver's and the head's authentication at odds, each one
    the run created was cancelled at once, and the run spent its restarts on "a trainer actor died during setup"."""
    import ray

    @ray.remote(num_cpus=0)
    class Probe:
        def ping(self) -> bool:
            return True

    probe, cancelled = Probe.remote(), None
    try:
        ray.get(probe.ping.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        log.warning("the Ray at %s has not started a probe actor in %.0f s; going on", address, timeout_s)
    except ray.exceptions.RayActorError as e:
        cancelled = e
    ray.kill(probe)
    if cancelled is not None:
        ray.shutdown()
        raise ClusterError(
            f"the Ray at {address} (cluster.address or RAY_ADDRESS) took this driver but cancelled its first actor "
            f"({type(cancelled).__name__}): {AUTH_HINT}"
        )


def _no_token_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def start_ray(cfg: Config) -> bool:
    """Connect to `cluster.address` (or RAY_ADDRESS), or start a local Ray, first ending the agents a killed earlier
    run left (`reap_orphaned_agents`); returns whether this process started it (and so must stop it)."""
    import ray

    address = ray_address(cfg)
    if address is None:
        reap_orphaned_agents()
    else:
        check_reachable(address)
    log.info("starting a local Ray" if address is None else f"connecting to Ray at {address}")
    # Ray's notice that the local Ray it starts has token authentication on (its default since 2.5x) is not the
    # user's to act on: the driver starts that Ray and stops it at the end
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(_no_token_notice)
    on_sigterm = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(  # "local": a Ray of its own, even where a `ray start` head runs on this host (ray.init would join it)
            address=address or "local",
            namespace=NAMESPACE,
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
    except BaseException as e:  # Ctrl-C midway: a local Ray half started must not outlive the driver
        if address is None and ray.is_initialized():
            ray.shutdown()
        if isinstance(e, Exception):  # a head that refuses us (its token authentication), a local start timed out
            where = f"the Ray at {address} (cluster.address or RAY_ADDRESS)" if address else "a local Ray"
            hint = f"; {AUTH_HINT}" if address else ""
            raise ClusterError(f"cannot start or join {where}: {type(e).__name__}: {e}{hint}") from e
        raise
    if address is not None:
        _check_actors_start(address)
    if callable(on_sigterm) and threading.current_thread() is threading.main_thread():
        # ray.init installs a handler that aborts the driver on SIGTERM; keep the caller's (rlloop.run's: unwind and
        # clean up like Ctrl-C)
        signal.signal(signal.SIGTERM, on_sigterm)
    return address is None


@contextmanager
def ray_session(cfg: Config):
    """Ray for every `Cluster` built inside (none without `cluster.use_ray`, or if Ray is up already), stopped at the
    end if this started it: a cluster rebuilt after a trainer rank's death reuses it instead of restarting Ray."""
    if not cfg.cluster.use_ray:
        yield
        return
    import ray

    owns = not ray.is_initialized() and start_ray(cfg)
    try:
        yield
    finally:
        if owns and ray.is_initialized():
            ray.shutdown()
