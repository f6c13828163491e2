"""Placement on a fake 4-chip TPU host: the recipe's 2 + 2 split gives each actor its own chips."""

import sys
from pathlib import Path

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from rlloop.config import load_config
from rlloop.placement import actor_options, plan_placement

pytestmark = pytest.mark.xdist_group("ray")  # starts Ray: one at a time (tests/conftest.py)

REAL = Path(__file__).resolve().parents[2] / "examples" / "grpo_dapo.yaml"


@ray.remote
def visible_chips() -> str:
    import os

    return os.environ.get("TPU_VISIBLE_CHIPS", "")


@pytest.fixture(scope="module")
def fake_tpu_host():
    ray.init(
        address="local", num_cpus=4, num_gpus=2, resources={"TPU": 4}, include_dashboard=False, configure_logging=False
    )
    yield
    ray.shutdown()


def test_recipe_plan_splits_four_chips_two_and_two(fake_tpu_host):
    cfg = load_config(REAL)
    plan = plan_placement(cfg.cluster, same_host=cfg.sync.transport == "shm")
    assert plan.strategy == "STRICT_PACK" and sum(b.get("TPU", 0) for b in plan.bundles) == 4
    pg = placement_group(plan.bundles, strategy=plan.strategy)
    try:
        ray.get(pg.ready(), timeout=60)
        rollout = ray.get(visible_chips.options(**actor_options(plan, plan.rollout_bundles[0], pg)).remote())
        ranks = ray.get([visible_chips.options(**actor_options(plan, b, pg)).remote() for b in plan.trainer_bundles])
        chips = [set(rollout.split(","))] + [set(r.split(",")) for r in ranks]
        assert [len(c) for c in chips] == [2, 1, 1]
        assert set.union(*chips) == {"0", "1", "2", "3"}  # disjoint, all four used
    finally:
        remove_placement_group(pg)


@ray.remote
def environment(*names: str) -> tuple[str, ...]:
    import os
    import sys

    return (sys.executable, *(os.environ.get(n, "") for n in names))


def test_each_role_runs_in_its_own_runtime_env(fake_tpu_host, tmp_path):
    """cluster.rollout_runtime_env / trainer_runtime_env: an interpreter of the role's own (jax[tpu] and torch_tpu
    want different libtpu versions; here a link to this one) and env_vars over rlloop's."""
    python = tmp_path / "engine-env" / "python"
    python.parent.mkdir()
    python.symlink_to(sys.executable)
    cfg = load_config(
        REAL,
        [
            f"cluster.rollout_runtime_env={{py_executable: {python}, env_vars: {{OMP_NUM_THREADS: '7'}}}}",
            "cluster.trainer_runtime_env={env_vars: {ROLE: trainer}}",
        ],
    )
    plan = plan_placement(cfg.cluster, same_host=True)
    pg = placement_group(plan.bundles, strategy=plan.strategy)
    ours = {"OMP_NUM_THREADS": "1", "RLLOOP_CPUS": "0"}
    try:
        ray.get(pg.ready(), timeout=60)
        runs = [
            environment.options(**actor_options(plan, b, pg, ours, role, env)).remote(
                "OMP_NUM_THREADS", "RLLOOP_CPUS", "ROLE"
            )
            for b, role, env in [
                (plan.rollout_bundles[0], "rollout", cfg.cluster.rollout_runtime_env),
                (plan.trainer_bundles[0], "trainer", cfg.cluster.trainer_runtime_env),
            ]
        ]
        engine, rank = ray.get(runs, timeout=120)
    finally:
        remove_placement_group(pg)
    assert engine == (str(python), "7", "0", "")  # its interpreter; its OMP_NUM_THREADS over ours
    assert rank == (sys.executable, "1", "0", "trainer")


def test_a_plan_larger_than_the_host_does_not_fit(fake_tpu_host):
    cfg = load_config(REAL, ["cluster.rollout_chips=4"])
    plan = plan_placement(cfg.cluster, same_host=True)
    assert plan.total()["TPU"] == 6  # 4 + the recipe's 2 trainer chips
    assert ray.cluster_resources()["TPU"] == 4  # what the Cluster refuses at once: the next test


def test_a_local_ray_refuses_a_plan_it_cannot_hold_at_once(fake_tpu_host, tmp_path):
    """A Ray started here never grows: the Cluster names the chip settings and what is short at once, instead of
    waiting out the placement group's timeout (two minutes) as it must for a cluster that may scale up."""
    from rlloop.cluster import Cluster
    from rlloop.errors import ClusterError

    tiny = Path(__file__).resolve().parents[2] / "examples" / "grpo_dapo_tiny.yaml"
    cfg = load_config(
        tiny, ["cluster.device=tpu", "cluster.rollout_chips=4", "cluster.train_chips=1", f"run.dir={tmp_path}"]
    )
    short = r"needs TPU 5 \(it has 4\).*cluster\.rollout_chips=4, cluster\.train_chips=1"
    with pytest.raises(ClusterError, match=short) as refused:
        Cluster(cfg)
    assert "colocate=true" not in str(refused.value)  # which TPUs refuse: no advice to take it


def test_a_joined_cluster_waits_placement_timeout_s_then_names_the_settings(fake_tpu_host, tmp_path):
    """A Ray cluster this process joined (cluster.address, a Ray job) may still grow: the plan waits for it
    cluster.placement_timeout_s (a fixed two minutes before, too short for a TPU node pool, long on a static
    cluster), and then says which settings make the plan."""
    from rlloop.cluster import Cluster
    from rlloop.errors import ClusterError

    tiny = Path(__file__).resolve().parents[2] / "examples" / "grpo_dapo_tiny.yaml"
    overrides = ["cluster.device=tpu", "cluster.rollout_chips=4", "cluster.address=auto"]
    cfg = load_config(tiny, [*overrides, "cluster.placement_timeout_s=2", f"run.dir={tmp_path}"])
    waited = r"within cluster\.placement_timeout_s=2; .*cluster\.rollout_chips=4, cluster\.train_chips=1"
    with pytest.raises(ClusterError, match=waited):
        Cluster(cfg)


def test_two_runs_of_one_name_share_a_cluster(fake_tpu_host, tmp_path):
    """Seeds of one recipe, each in its own run.dir, on one Ray cluster: the second failed to start, its placement
    group named after run.name, which the first already held."""
    from rlloop.cluster import Cluster

    tiny = Path(__file__).resolve().parents[2] / "examples" / "grpo_dapo_tiny.yaml"
    clusters = []
    try:
        for seed in (1, 2):
            cfg = load_config(tiny, [f"run.seed={seed}", f"run.dir={tmp_path / str(seed)}", "rollout.backend=hf"])
            clusters.append(Cluster(cfg))
        assert len({c.pg.id for c in clusters}) == 2
    finally:
        for c in clusters:
            c.close()


@ray.remote
def visible_gpus() -> str:
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES", "")


def test_colocated_plan_puts_both_roles_on_the_same_chips(fake_tpu_host):
    """Two GPUs, an engine and a trainer rank on each: each pair sees its own GPU (with a two-chip engine, Ray gave
    it one GPU and both ranks the other, which the config now refuses)."""
    cfg = load_config(REAL, ["cluster.colocate=true", "cluster.device=gpu", "cluster.rollout_engines=2"])
    plan = plan_placement(cfg.cluster, same_host=True)
    assert plan.bundles == [{"CPU": 2.0, "GPU": 1.0}] * 2
    assert plan.rollout_bundles == [0, 1] and plan.trainer_bundles == [0, 1]
    assert "bundle 1: rollout engine 1 + trainer rank 1" in plan.describe()
    pg = placement_group(plan.bundles, strategy=plan.strategy)
    try:
        ray.get(pg.ready(), timeout=60)
        engines = [visible_gpus.options(**actor_options(plan, b, pg, role="rollout")).remote() for b in (0, 1)]
        ranks = [visible_gpus.options(**actor_options(plan, b, pg, role="trainer")).remote() for b in (0, 1)]
        engines, ranks = ray.get(engines, timeout=60), ray.get(ranks, timeout=60)
        assert sorted(engines) == ["0", "1"] and ranks == engines
    finally:
        remove_placement_group(pg)


def test_colocated_cpu_plan_gives_both_roles_all_the_cores_of_a_host_the_split_plan_overfills(fake_tpu_host):
    """On CPU a chip is `cpus_per_actor` cores: colocated, engine and trainer take turns on the same 4 cores of this
    4-CPU host; split, they would need 8."""
    over = ["cluster.device=cpu", "cluster.rollout_chips=1", "cluster.train_chips=1", "cluster.cpus_per_actor=4"]
    split = plan_placement(load_config(REAL, over).cluster, same_host=True)
    assert split.total() == {"CPU": 8.0}
    plan = plan_placement(load_config(REAL, [*over, "cluster.colocate=true"]).cluster, same_host=True)
    assert plan.bundles == [{"CPU": 4.0}] and plan.rollout_bundles == plan.trainer_bundles == [0]
    pg = placement_group(plan.bundles, strategy=plan.strategy)
    try:
        ray.get(pg.ready(), timeout=60)
        actors = [visible_chips.options(**actor_options(plan, 0, pg, role=r)).remote() for r in ("rollout", "trainer")]
        ready, _ = ray.wait(actors, num_returns=2, timeout=60)
        assert len(ready) == 2
    finally:
        remove_placement_group(pg)


LABELS = ["cluster.rollout_resources={node_a: 0.01}", "cluster.trainer_resources={node_a: 0.01}"]


@pytest.mark.parametrize(
    "overrides",
    [
        ["cluster.device=gpu", "cluster.colocate=true", "cluster.rollout_engines=2", *LABELS],
        ["cluster.device=cpu", "cluster.colocate=true", "cluster.rollout_engines=1", LABELS[1]],
        ["cluster.device=cpu", "cluster.colocate=true", "cluster.rollout_engines=2", *LABELS],
        ["cluster.device=tpu", *LABELS],
        ["cluster.device=gpu", "cluster.rollout_engines=2", *LABELS],
    ],
    ids=["gpu-colocated", "cpu-colocated-tp2", "cpu-colocated", "tpu-split", "gpu-split"],
)
def test_every_actor_of_a_bundle_gets_what_it_asks_for(overrides):
    """A node label in cluster.*_resources is asked by each actor: a colocated bundle held it once, so its second
    actor (or a tp engine's second rank) was never scheduled and the run waited out actor_start_timeout_s."""
    plan = plan_placement(load_config(REAL, overrides).cluster, same_host=True)
    asked = [{} for _ in plan.bundles]
    for role, b in plan.roles().items():
        request = plan.rollout_request if role.startswith("rollout") else plan.trainer_request
        for key, value in (request if request is not None else plan.bundles[b]).items():
            asked[b][key] = asked[b].get(key, 0.0) + value
    for bundle, want in zip(plan.bundles, asked):
        assert all(want[key] <= bundle.get(key, 0.0) + 1e-9 for key in want), (bundle, want)
    assert any("node_a" in want for want in asked)


def qwen3_dir(tmp_path: Path, hidden: int, heads: int, kv_heads: int) -> str:
    import transformers

    transformers.Qwen3Config(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=32,
    ).save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize(
    "shape, cores, devices",
    [
        ((256, 4, 2), 2, 2),  # wide enough, splits over 2: a single-threaded device per core
        ((256, 4, 2), 3, 1),  # 4 heads do not split over 3 cores: one device on all of them
        ((64, 4, 2), 2, 1),  # the tiny model's width: too little work per step to split
    ],
)
def test_a_cpu_engine_runs_a_device_per_core_where_the_model_splits(tmp_path, shape, cores, devices):
    from rlloop.placement import actor_env

    over = [f"model.path={qwen3_dir(tmp_path, *shape)}", "cluster.device=cpu", f"cluster.cpus_per_actor={cores}"]
    for layout in (["cluster.colocate=true"], []):
        cfg = load_config(REAL, [*over, *layout, "cluster.rollout_chips=1", "cluster.train_chips=1"])
        plan = plan_placement(cfg.cluster, same_host=True)
        assert plan.bundles[plan.rollout_bundles[0]] == {"CPU": float(cores)}
        assert cfg.engine_config().tp == devices
        flags = actor_env(cfg, cores, rollout=True, cores=range(cores))["XLA_FLAGS"].split()
        eigen_threads = "true" if cores > devices else "false"  # a device with cores to itself uses them all
        assert flags == [
            f"--xla_force_host_platform_device_count={devices}",
            f"--xla_cpu_multi_thread_eigen={eigen_threads}",
        ]
    # on accelerators the mesh is the chips, whatever the host cores
    assert load_config(REAL, [*over, "cluster.device=gpu"]).engine_config().tp == 2


def test_a_cpu_engine_of_two_chips_gets_the_cores_of_both():
    cfg = load_config(REAL, ["cluster.device=cpu", "cluster.cpus_per_actor=2", "cluster.rollout_chips=2"])
    plan = plan_placement(cfg.cluster, same_host=True)
    assert [plan.bundles[b] for b in plan.rollout_bundles] == [{"CPU": 4.0}]
    assert [plan.bundles[b] for b in plan.trainer_bundles] == [{"CPU": 2.0}, {"CPU": 2.0}]
    assert [plan.cores(b) for b in range(3)] == [range(0, 4), range(4, 6), range(6, 8)]


@pytest.mark.parametrize("device, platform", [("tpu", "tpu"), ("cpu", "cpu"), ("gpu", None)])
def test_an_actor_runs_jax_on_its_device_whatever_the_driver_s_jax_platforms(monkeypatch, device, platform):
    """The driver's JAX_PLATFORMS was forwarded: started with JAX_PLATFORMS=cpu, it had a TPU engine generate on
    the host's CPU without a word. A GPU's platform is left to JAX to find (cuda or rocm)."""
    from rlloop.placement import actor_env

    monkeypatch.setenv("JAX_PLATFORMS", "cpu" if device != "cpu" else "tpu")
    cfg = load_config(REAL, [f"cluster.device={device}"])
    for rollout in (True, False):
        assert actor_env(cfg, 1, rollout=rollout, cores=range(1)).get("JAX_PLATFORMS") == platform


def test_a_cluster_address_where_no_ray_answers_is_one_clear_error(tmp_path):
    """ray.init retried it for minutes (ten, once), printing only Ray's "Failed to connect to GCS" warnings."""
    import socket

    from rlloop.errors import ClusterError
    from rlloop.ray_session import start_ray

    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = load_config(REAL, [f"cluster.address=127.0.0.1:{port}", f"run.dir={tmp_path}"])
    with pytest.raises(
        ClusterError, match=rf"no Ray head answers at 127.0.0.1:{port} \(cluster.address or RAY_ADDRESS"
    ):
        start_ray(cfg)  # before ray.init: the suite's Ray, where one runs in this worker, is not touched


@pytest.mark.parametrize("colocate", [False, True])
def test_a_plan_whose_roles_must_share_a_host_packs_them_strictly(colocate):
    """sync.transport=shm needs the engines and the trainer ranks on one host (same_host): STRICT_PACK, colocated
    or not; otherwise Ray may PACK them across nodes."""
    over = ["cluster.device=gpu", "cluster.rollout_engines=2"] + (["cluster.colocate=true"] if colocate else [])
    cluster = load_config(REAL, over).cluster
    assert plan_placement(cluster, same_host=True).strategy == "STRICT_PACK"
    assert plan_placement(cluster, same_host=False).strategy == "PACK"


def test_a_cluster_with_exactly_what_the_plan_asks_holds_it():
    """shortfall names only what the plan asks beyond what there is: a host of exactly the plan's resources is
    not short (the local Ray was refused for holding the recipe's plan exactly), one chip less is."""
    plan = plan_placement(load_config(REAL).cluster, same_host=True)
    total = plan.total()
    assert plan.shortfall(dict(total)) == {}
    assert plan.shortfall({**total, "TPU": total["TPU"] - 1}) == {"TPU": (total["TPU"], total["TPU"] - 1)}
    assert plan.shortfall({"CPU": total["CPU"]}) == {"TPU": (total["TPU"], 0.0)}


def test_each_cpu_actor_is_pinned_to_its_own_bundle_s_cores():
    """On a CPU host every actor's environment names its bundle's cores (plan.cores): the engine the first four,
    each trainer rank the next two, none shared; pinned to cores 0.. each, they all piled onto the same ones."""
    from rlloop.placement import actor_env
    from rlloop.workers import CPU_AFFINITY_ENV

    cfg = load_config(REAL, ["cluster.device=cpu", "cluster.cpus_per_actor=2", "cluster.rollout_chips=2"])
    plan = plan_placement(cfg.cluster, same_host=True)
    pinned = {
        role: actor_env(cfg, 2, rollout=role.startswith("rollout"), cores=plan.cores(b))[CPU_AFFINITY_ENV]
        for role, b in plan.roles().items()
    }
    assert pinned == {"rollout engine 0": "0,1,2,3", "trainer rank 0": "4,5", "trainer rank 1": "6,7"}


def test_a_cpu_engine_of_the_narrowest_width_that_splits_gets_a_device_per_core(tmp_path):
    """CPU_TP_MIN_HIDDEN is the narrowest width measured faster split (128 to 768 ran 1.12-1.42x): a model of
    exactly that width splits over the cores; one narrower does not."""
    from rlloop.model_shape import CPU_TP_MIN_HIDDEN

    over = ["cluster.device=cpu", "cluster.cpus_per_actor=2", "cluster.rollout_chips=1", "cluster.train_chips=1"]
    wide = load_config(REAL, [*over, f"model.path={qwen3_dir(tmp_path / 'w', CPU_TP_MIN_HIDDEN, 4, 2)}"])
    assert wide.engine_config().tp == 2
    narrow = load_config(REAL, [*over, f"model.path={qwen3_dir(tmp_path / 'n', CPU_TP_MIN_HIDDEN - 32, 4, 2)}"])
    assert narrow.engine_config().tp == 1
