"""Which actor gets which chips: a Ray placement-group plan from `cluster.device` and the chip counts.

Each of the `rollout_engines` engines holds `rollout_chips / rollout_engines` chips (tensor parallel inside JAX, in
its own mesh); the trainer runs one rank per chip (`train_chips` ranks, torch.distributed). On `cpu` a "chip" is
`cpus_per_actor` cores. The shm transport needs both sides on one host, so its plan packs strictly. `actor_env` is
the environment an actor starts with: on CPU hosts it pins the actor to its bundle's cores. `check_cluster_fits`
and `check_one_node_fits` refuse, before the placement group waits, a plan the Ray cluster cannot hold.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from rlloop.config import ClusterSection, Config
from rlloop.errors import ClusterError
from rlloop.model_shape import engine_tp
from rlloop.workers import CPU_AFFINITY_ENV

# Passed to every actor: offline switches, tokens and caches must reach workers on other nodes too.
FORWARDED_ENV = (
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_HOME",
    "HF_TOKEN",
    "WANDB_MODE",
    "PYTHONPATH",
)
# The JAX platform of each device (a GPU's is found: cuda or rocm), set for the actors, never the driver's: a driver
# started with JAX_PLATFORMS=cpu (it never starts JAX itself) had a TPU engine generate on the host's CPU, silently
JAX_PLATFORM = {"tpu": "tpu", "cpu": "cpu"}

RESOURCE = {"tpu": "TPU", "gpu": "GPU", "cpu": None}


@dataclass
class Placement:
    bundles: list[dict[str, float]]
    rollout_bundles: list[int]  # one per rollout engine
    trainer_bundles: list[int]  # one per trainer rank
    strategy: str
    device: str
    # What one actor of each role asks for; its whole bundle unless colocated, where the roles split each bundle.
    rollout_request: dict[str, float] | None = None
    trainer_request: dict[str, float] | None = None

    def total(self) -> dict[str, float]:
        """What the whole plan asks for, summed over its bundles."""
        return summed(self.bundles)

    def shortfall(self, have: dict[str, float]) -> dict[str, tuple[float, float]]:
        """What the plan asks for beyond the resources `have` (a Ray node's or cluster's): key -> (need, have)."""
        return {key: (need, have.get(key, 0.0)) for key, need in self.total().items() if have.get(key, 0.0) < need}

    def roles(self) -> dict[str, int]:
        """Each actor's name ("rollout engine 0", "trainer rank 1") and its bundle: the engines, then the ranks."""
        engines = {f"rollout engine {e}": b for e, b in enumerate(self.rollout_bundles)}
        return engines | {f"trainer rank {r}": b for r, b in enumerate(self.trainer_bundles)}

    def holders(self) -> list[list[str]]:
        """Who is placed in each bundle, in bundle order (two roles per bundle when colocated)."""
        out: list[list[str]] = [[] for _ in self.bundles]
        for role, bundle in self.roles().items():
            out[bundle].append(role)
        return out

    def cores(self, bundle: int) -> range:
        """On a CPU host, `bundle`'s cores: bundles take consecutive cores in plan order, which an actor maps onto its
        host's modulo their number (rlloop.workers.limit_threads); the two roles of a colocated bundle share them."""
        first = int(sum(b.get("CPU", 0) for b in self.bundles[:bundle]))
        return range(first, first + int(self.bundles[bundle].get("CPU", 1)))

    def describe(self) -> str:
        lines = [f"placement group ({self.strategy}), device {self.device}:"]
        for i, (who, bundle) in enumerate(zip(self.holders(), self.bundles)):
            lines.append(f"  bundle {i}: {' + '.join(who):<16} {bundle}")
        return "\n".join(lines)


def plan_placement(cluster: ClusterSection, same_host: bool) -> Placement:
    """`rollout_engines` engine bundles of `rollout_chips / rollout_engines` chips each, then one bundle per rank;
    colocated, the ranks share the engines' bundles instead (see `colocated_plan`)."""
    accel = RESOURCE[cluster.device]
    cpus = float(cluster.cpus_per_actor)
    engines = cluster.rollout_engines
    if cluster.colocate:
        return colocated_plan(cluster, accel, cpus, same_host)
    if accel is None:  # a chip is cpus_per_actor cores
        engine = {"CPU": cpus * (cluster.rollout_chips // engines)}
        rank = {"CPU": cpus}
    else:
        engine = {"CPU": cpus, accel: float(cluster.rollout_chips // engines)}
        rank = {"CPU": cpus, accel: 1.0}
    engine |= cluster.rollout_resources
    rank |= cluster.trainer_resources
    bundles = [dict(engine) for _ in range(engines)] + [dict(rank) for _ in range(cluster.train_chips)]
    return Placement(
        bundles=bundles,
        rollout_bundles=list(range(engines)),
        trainer_bundles=list(range(engines, len(bundles))),
        strategy="STRICT_PACK" if same_host else "PACK",
        device=cluster.device,
    )


def colocated_plan(cluster: ClusterSection, accel: str | None, cpus: float, same_host: bool) -> Placement:
    """Miles/slime's colocation: bundle i holds engine i (tp chips) and the tp trainer ranks of those chips. Each
    role asks for half of the chips it uses, so Ray lets both onto the same chips (on GPUs tp is 1: Ray grants a
    fraction of one GPU or whole ones, rlloop.config); they take turns (the engine frees
    its memory while the trainer steps, the trainer offloads while the engine generates). On CPU that makes each
    role compute on all of the bundle's cores in its turn (`cpus_per_actor` threads), where the split plan gives
    each its own cores and leaves them idle while the other works."""
    tp = cluster.rollout_chips // cluster.rollout_engines
    if accel is None:  # the chips are the cores: tp chips of cpus_per_actor cores, half of them asked by each role
        bundle = {"CPU": cpus * tp}
        rollout_request, trainer_request = {"CPU": cpus * tp / 2}, {"CPU": cpus / 2}
    else:  # accelerator chips, and each role's own host cores besides
        bundle = {"CPU": cpus * (1 + tp), accel: float(tp)}
        rollout_request, trainer_request = {"CPU": cpus, accel: tp / 2}, {"CPU": cpus, accel: 0.5}
    # Custom resources (a node's label) are asked by each actor of the bundle, the engine and its tp ranks alike: held
    # once, the bundle's second asker was never scheduled
    bundle = summed([bundle, cluster.rollout_resources, *[cluster.trainer_resources] * tp])
    return Placement(
        bundles=[dict(bundle) for _ in range(cluster.rollout_engines)],
        rollout_bundles=list(range(cluster.rollout_engines)),
        trainer_bundles=[r // tp for r in range(cluster.train_chips)],
        strategy="STRICT_PACK" if same_host else "PACK",
        device=cluster.device,
        rollout_request=rollout_request | cluster.rollout_resources,
        trainer_request=trainer_request | cluster.trainer_resources,
    )


def summed(resources: list[dict[str, float]]) -> dict[str, float]:
    """Ray resource requests added up, key by key."""
    out: dict[str, float] = {}
    for r in resources:
        for key, value in r.items():
            out[key] = out.get(key, 0.0) + value
    return out


def actor_options(
    plan: Placement, bundle: int, pg, env: dict[str, str] | None = None, role: str = "", runtime_env: dict | None = None
) -> dict:
    """`ray.remote(...).options(**this)` for the actor of `bundle` in the placement group `pg` made from `plan`
    (`role` "rollout" or "trainer" picks a colocated plan's share of the bundle), in `runtime_env` (the role's
    cluster.*_runtime_env) with `env` under its env_vars."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    request = {"rollout": plan.rollout_request, "trainer": plan.trainer_request}.get(role)
    res = dict(request if request is not None else plan.bundles[bundle])
    runtime_env = dict(runtime_env or {})
    runtime_env["env_vars"] = {**(env or {}), **runtime_env.get("env_vars", {})}
    return {
        "num_cpus": res.pop("CPU", 0),
        "num_gpus": res.pop("GPU", 0),
        "resources": res,
        "runtime_env": runtime_env,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, bundle),
    }


def cpu_engine_xla_flags(devices: int, cores: int) -> str:
    """XLA flags of a rollout engine on `cores` CPU cores: `devices` host devices (its tensor-parallel mesh,
    `engine_tp`: one per core where the model splits that way), and Eigen's thread pool only when a device
    has more than one core to itself."""
    return (
        f"--xla_force_host_platform_device_count={devices} "
        f"--xla_cpu_multi_thread_eigen={'true' if cores > devices else 'false'}"
    )


# The share of a GPU of its own that the engine's JAX takes at start (what vLLM's gpu_memory_utilization defaults to):
# the rest is CUDA's context and cuBLAS/cuDNN workspaces. The memory plan checks the engine against this share.
ENGINE_GPU_MEM_FRACTION = 0.9


def actor_env(cfg: Config, threads: int, rollout: bool, cores: range) -> dict[str, str]:
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    env.update({"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"})
    # An actor's progress bars (transformers' "Loading weights", a download's) reach the driver's terminal line by
    # line, through the run's own bar; the driver says what the actors do (rlloop.loop)
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if platform := JAX_PLATFORM.get(cfg.cluster.device):
        env["JAX_PLATFORMS"] = platform
    if cfg.cluster.device == "cpu":
        # A CPU "chip" is cores of its own (its bundle's): XLA and torch size their pools from the cores a process
        # may run on, so without pinning every actor spreads over every core and they slow each other down.
        env[CPU_AFFINITY_ENV] = ",".join(map(str, cores))
        if rollout:
            env["XLA_FLAGS"] = cpu_engine_xla_flags(engine_tp(cfg), len(cores))
    if cfg.cluster.device == "gpu" and rollout:
        env |= jax_gpu_env(cfg.cluster.colocate)
    return env


def jax_gpu_env(colocated: bool) -> dict[str, str]:
    """How an engine's JAX takes GPU memory. Colocated: JAX would grab 75% of the GPU at start and its pooling
    allocator never hands freed memory back, so the engine's release() must return its cache and weights to CUDA
    for the trainer sharing the GPU to use. A GPU of its own: JAX's pool, allocated at start, is all the engine can
    use (75% unless told otherwise)."""
    if colocated:
        return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}
    return {"XLA_PYTHON_CLIENT_MEM_FRACTION": str(ENGINE_GPU_MEM_FRACTION)}


def check_cluster_fits(plan, cluster) -> None:
    """Refuse a plan that asks for more of some resource than the whole Ray cluster has, naming the chip settings. Only
    for a Ray this process started (fixed resources): a cluster with an autoscaler may still grow to hold it, which
    the placement group's timeout waits for."""
    import ray

    if short := plan.shortfall(ray.cluster_resources()):
        lacking = ", ".join(f"{key} {need:g} (it has {got:g})" for key, (need, got) in short.items())
        raise ClusterError(
            f"the local Ray cannot hold the placement plan: it needs {lacking}. {plan_settings(cluster)}, or give "
            f"cluster.address a Ray cluster that has them.\n{plan.describe()}"
        )


def plan_settings(cluster) -> str:
    """The settings a placement plan comes from, to name in an error about it."""
    share = "" if cluster.device == "tpu" or cluster.colocate else " (cluster.colocate=true shares the chips)"
    return (
        f"The plan comes from cluster.device={cluster.device}, cluster.rollout_chips={cluster.rollout_chips}, "
        f"cluster.train_chips={cluster.train_chips}, cluster.rollout_engines={cluster.rollout_engines}, "
        f"cluster.cpus_per_actor={cluster.cpus_per_actor} and cluster.colocate={str(cluster.colocate).lower()}; "
        f"lower them{share}"
    )


def check_one_node_fits(plan) -> None:
    """shm needs every role on one host: refuse, naming sync.transport, a plan that fits the cluster only across
    nodes (custom node resources in different places, or more chips than any one node has)."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if all(plan.shortfall(node) for node in nodes) and not plan.shortfall(ray.cluster_resources()):
        raise ClusterError(
            f"sync.transport=shm needs the rollout engines and the trainer ranks on one node, but no node of this "
            f"Ray cluster can hold the whole plan {plan.total()}; use sync.transport=disk (a directory every node "
            f"can read, sync.dir) or sync.transport=ray (the object store).\n{plan.describe()}"
        )
