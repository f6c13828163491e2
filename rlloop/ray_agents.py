"""End the agents a SIGKILLed local Ray leaves behind, so a killed run leaves nothing once the next one starts.

When the driver that started a local Ray dies without `ray.shutdown()`, its GCS and raylet exit with it, but each
node's `ray::DashboardAgent` and `ray::RuntimeEnvAgent` first try to report the raylet's death to the GCS, which is
gone, and wait out that report's hard-coded 60 s timeout (ray/_private/utils.py `publish_error_to_driver`). By
Ray's own rule (process_watcher.py: an agent whose parent is no longer its raylet kills itself) they are already
doomed; the driver that starts the next local Ray ends them at once instead.
"""

from __future__ import annotations

import logging
import os

import psutil

log = logging.getLogger(__name__)

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
