"""Which actor gets which chips: a Ray placement-group plan from `cluster.device` and the chip counts.

Each of the `rollout_engines` engines holds `rollout_chips / rollout_engines` chips (tensor parallel inside JAX, in
its own mesh); the trainer runs one rank per chip (`train_chips` ranks, torch.distributed). On `cpu` a "chip" is
`cpus_per_actor` cores. The shm transport needs both sides on one host, so its plan packs strictly.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlloop.config import ClusterSection

RESOURCE = {"tpu": "TPU", "gpu": "GPU", "cpu": None}


@dataclass
class Placement:
    bundles: list[dict[str, float]]
    rollout_bundles: list[int]  # one per rollout engine
    trainer_bundles: list[int]  # one per trainer rank
    strategy: str
    device: str

    @property
    def rollout_bundle(self) -> int:
        """The first engine's bundle (the only one with `cluster.rollout_engines: 1`)."""
        return self.rollout_bundles[0]

    def total(self) -> dict[str, float]:
        """What the whole plan asks for, summed over its bundles."""
        out: dict[str, float] = {}
        for bundle in self.bundles:
            for key, value in bundle.items():
                out[key] = out.get(key, 0.0) + value
        return out

    def roles(self) -> list[str]:
        """Who holds each bundle, in bundle order."""
        return [
            f"rollout engine {self.rollout_bundles.index(i)}"
            if i in self.rollout_bundles
            else f"trainer rank {self.trainer_bundles.index(i)}"
            for i in range(len(self.bundles))
        ]

    def describe(self) -> str:
        lines = [f"placement group ({self.strategy}), device {self.device}:"]
        for i, (who, bundle) in enumerate(zip(self.roles(), self.bundles)):
            lines.append(f"  bundle {i}: {who:<16} {bundle}")
        return "\n".join(lines)


def plan_placement(cluster: ClusterSection, same_host: bool) -> Placement:
    """`rollout_engines` engine bundles of `rollout_chips / rollout_engines` chips each, then one bundle per rank."""
    accel = RESOURCE[cluster.device]
    cpus = float(cluster.cpus_per_actor)
    engines = cluster.rollout_engines
    if accel is None:
        engine = {"CPU": cpus}
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
