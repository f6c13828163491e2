"""Which actor gets which chips: a Ray placement-group plan from `cluster.device` and the chip counts.

One rollout engine holds `rollout_chips` chips (tensor parallel inside JAX); the trainer runs one rank per chip
(`train_chips` ranks, torch.distributed). On `cpu` a "chip" is `cpus_per_actor` cores. The shm transport needs both
sides on one host, so its plan packs strictly.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlloop.config import ClusterSection

RESOURCE = {"tpu": "TPU", "gpu": "GPU", "cpu": None}


@dataclass
class Placement:
    bundles: list[dict[str, float]]
    rollout_bundle: int
    trainer_bundles: list[int]
    strategy: str
    device: str

    def describe(self) -> str:
        lines = [f"placement group ({self.strategy}), device {self.device}:"]
        for i, bundle in enumerate(self.bundles):
            who = "rollout engine" if i == self.rollout_bundle else f"trainer rank {self.trainer_bundles.index(i)}"
            lines.append(f"  bundle {i}: {who:<16} {bundle}")
        return "\n".join(lines)


def plan_placement(cluster: ClusterSection, same_host: bool) -> Placement:
    accel = RESOURCE[cluster.device]
    cpus = float(cluster.cpus_per_actor)
    if accel is None:
        rollout = {"CPU": cpus}
        ranks = [{"CPU": cpus} for _ in range(cluster.train_chips)]
    else:
        rollout = {"CPU": cpus, accel: float(cluster.rollout_chips)}
        ranks = [{"CPU": cpus, accel: 1.0} for _ in range(cluster.train_chips)]
    return Placement(
        bundles=[rollout, *ranks],
        rollout_bundle=0,
        trainer_bundles=list(range(1, 1 + len(ranks))),
        strategy="STRICT_PACK" if same_host else "PACK",
        device=cluster.device,
    )


def actor_options(plan: Placement, bundle: int, pg, env: dict[str, str] | None = None) -> dict:
    """`ray.remote(...).options(**this)` for the actor of `bundle` in the placement group `pg` made from `plan`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    res = dict(plan.bundles[bundle])
    return {
        "num_cpus": res.pop("CPU", 0),
        "num_gpus": res.pop("GPU", 0),
        "resources": res,
        "runtime_env": {"env_vars": env or {}},
        "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, bundle),
    }
