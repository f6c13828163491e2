"""What the driver does with an actor that fails: an engine that dies is rebuilt in place whichever of the driver's
calls finds it dead, and the run goes on (the calls and settings that the end-to-end fault tests in
tests/e2e/test_actor_deaths.py, split engine and trainer through shm, do not reach; the engine is killed with
`ray.kill`, as a SIGKILL would); an actor that cannot start is one clear error."""

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from rlloop.cluster import Cluster  # noqa: E402
from rlloop.config import load_config  # noqa: E402
from rlloop.engine_pool import RestartCount  # noqa: E402
from rlloop.errors import ActorDied, ClusterError, TrainerDied  # noqa: E402
from rlloop.ray_sync import get_mailbox  # noqa: E402
from rollout import SamplingParams  # noqa: E402
from trainer import NonFiniteTraining, TrainBatch  # noqa: E402
from weight_sync import Sender, encode_payload_into, payload_nbytes  # noqa: E402

pytestmark = pytest.mark.xdist_group("ray")  # starts Ray: one at a time (tests/conftest.py)

TINY = Path(__file__).resolve().parents[2] / "examples" / "grpo_dapo_tiny.yaml"
PROMPT, SHORT = [5, 6, 7], SamplingParams(max_new_tokens=4)


def sampled_batch(cluster: Cluster) -> TrainBatch:
    """Two samples of PROMPT from the cluster's engines, as a batch to train on (advantages +1 and -1)."""
    out, _ = cluster.generate([PROMPT], 2, SHORT)
    return TrainBatch([PROMPT] * 2, [c.token_ids for c in out], [1.0, -1.0])


def kill_engine(engine) -> None:
    """`ray.kill`, and wait until the engine is gone: the kill is asynchronous, and a call made right after it was
    now and then still served (a loaded CI host), so the call under test did not find the engine dead."""
    ray.kill(engine)
    with pytest.raises(ray.exceptions.RayActorError):
        for _ in range(600):  # a probe an engine answers at once (its programs are compiled)
            ray.get(engine.warmup.remote(), timeout=60)


def test_the_runs_mailbox_outlives_an_engine_that_dies(ray_cluster, tmp_path):
    """Through the Ray transport the trainer's next push must still find the mailbox. A Ray actor lives as long as
    whoever created it: the first engine to ask did, before the driver made it, and after that engine's death the
    push failed as if the trainer had died (a rebuild of the whole cluster)."""
    cfg = load_config(TINY, ["sync.transport=ray", "run.max_restarts=1", f"run.dir={tmp_path}"])
    cluster = Cluster(cfg)
    try:
        cluster.warmup()
        kill_engine(cluster.engines[0])
        out, _ = cluster.generate([PROMPT], 2, SHORT)  # on the rebuilt engine
        assert cluster.restarts == 1 and len(out) == 2
        assert cluster.sync_weights(version=1)["sync/rollout_version"] == 1
    finally:
        cluster.close()


def test_an_engines_refused_versions_still_count_after_it_is_rebuilt(ray_cluster, tmp_path):
    """sync/refused counts over every engine the run has had: a rebuilt engine's receiver counts from 0, so the dead
    one's refusals are kept apart and added (they had vanished at the new engine's first pull)."""
    cfg = load_config(TINY, ["sync.transport=ray", "sync.delta=false", "run.max_restarts=1", f"run.dir={tmp_path}"])
    cluster = Cluster(cfg)
    try:
        cluster.warmup()
        manifest, blobs = Sender()._encode({"w": np.arange(64, dtype=np.float32)}, 1)[:2]
        payload = np.empty(payload_nbytes(manifest), np.uint8)
        encode_payload_into(payload, manifest, blobs)
        payload[-1] ^= 0x10  # a flipped byte in the tensor data, posted as version 1
        mailbox = get_mailbox(cluster.sync_run_id)
        writer, _ = ray.get(mailbox.latest.remote())  # the trainer's sender's
        ray.get(mailbox.post.remote(writer, 1, [ray.put(payload)]))
        assert cluster.pull_weights()["sync/refused"] == 1
        kill_engine(cluster.engines[0])
        batch = sampled_batch(cluster)  # on the rebuilt engine
        assert cluster.restarts == 1
        cluster.start_train_step(batch, publish=2).result()
        metrics = cluster.pull_weights()  # the new engine's first report: it has refused nothing itself
        assert metrics["sync/refused"] == 1 and metrics["sync/rollout_version"] == 2
    finally:
        cluster.close()


def test_a_rebuilt_engine_generates_on_the_version_it_held_not_the_trainers_newer_one(ray_cluster, tmp_path):
    """In the async mode step k is generated on step k - 2's weights while the trainer is past them. An engine that
    dies meanwhile is rebuilt on the version it held, read back from the transport: it was given the trainer's
    newer weights, and the step's samples were not those of a run nobody touched."""
    cfg = load_config(TINY, ["run.max_restarts=1", f"run.dir={tmp_path}"])
    cluster = Cluster(cfg)
    try:
        cluster.warmup()
        batch = sampled_batch(cluster)
        cluster.start_train_step(batch, publish=1).result()
        assert cluster.pull_weights()["sync/rollout_version"] == 1
        cluster.start_train_step(batch, publish=2).result()  # the trainer moves on; the engine stays on version 1
        kill_engine(cluster.engines[0])
        again, _ = cluster.generate([PROMPT], 2, SHORT)
        assert cluster.restarts == 1 and {c.weight_version for c in again} == {1}
        assert cluster.pull_weights()["sync/rollout_version"] == 2  # and it follows the trainer from there
    finally:
        cluster.close()


def test_a_colocated_engine_found_dead_by_its_sleep_or_wake_is_rebuilt(ray_cluster, tmp_path):
    """Colocated, the engines are put to sleep before each training and woken before they load its weights. An engine
    that either call finds dead was a ClusterError that ended the run, however many restarts were left."""
    cfg = load_config(
        TINY, ["cluster.colocate=true", "cluster.cpus_per_actor=2", "run.max_restarts=2", f"run.dir={tmp_path}"]
    )
    cluster = Cluster(cfg)
    try:
        cluster.warmup()
        batch = sampled_batch(cluster)
        kill_engine(cluster.engines[0])
        cluster.start_train_step(batch, publish=1).result()  # puts the engines to sleep first
        assert cluster.restarts == 1
        kill_engine(cluster.engines[0])
        assert cluster.pull_weights()["sync/rollout_version"] == 1  # wakes them first
        assert cluster.restarts == 2
        assert cluster.generate([PROMPT], 2, SHORT)[0][0].weight_version == 1
    finally:
        cluster.close()


def test_an_engine_found_dead_by_two_threads_restarts_once_and_one_dead_with_the_trainer_is_the_trainer_s_death(
    ray_cluster, tmp_path
):
    """The async modes' rollout thread generates while the loop's eval pull waits behind it on the same engine; the
    engine dies. Each thread used to restart it, the second killing the first's new engine: two or three of
    run.max_restarts for one death. (The pull, queued behind 48 batches, waits as long as they may take: ~2 s on a
    fast host, so that the kill 0.6 s in lands during the generation; 16 batches ended before it on an Intel Xeon.)
    Then engine and trainer die together (the OOM killer): the rebuilt engine's weights, from the trainer (the
    transport no longer holds its version), never come. That is the trainer's death, which the loop heals from the
    last checkpoint; it was taken for the new engine's, which was killed and restarted until run.max_restarts ended
    the run."""
    overrides = ["rollout.backend=hf", "rollout.max_batch=8", "rollout.decode_buckets=[8]", "run.max_restarts=3"]
    cfg = load_config(TINY, [*overrides, f"run.dir={tmp_path}"])
    cluster = Cluster(cfg)
    prompts = [[5 + i % 7, 6, 7, 8, 9] for i in range(48)]
    long = SamplingParams(max_new_tokens=16, ignore_eos=True)
    try:
        cluster.warmup()
        with ThreadPoolExecutor(1) as rollout_thread:
            generation = rollout_thread.submit(cluster.generate, prompts, 8, long)
            time.sleep(0.3)  # its 48 batches are queued on the engine
            threading.Timer(0.3, ray.kill, [cluster.engines[0]]).start()
            cluster.pull_weights()
            out, _ = generation.result()
        assert len(out) == 48 * 8 and cluster.restarts == 1

        assert cluster.sync_weights(version=1)["sync/rollout_version"] == 1
        for version in (2, 3):  # shm holds the last two: the engine's version 1 is gone, the trainer must give it
            cluster.push_weights(version)
        ray.kill(cluster.trainers[0])
        kill_engine(cluster.engines[0])
        with pytest.raises(TrainerDied, match="a trainer actor died while rollout engine 0 restarted"):
            cluster.generate([PROMPT], 2, SHORT)
        assert cluster.restarts == 2
    finally:
        cluster.close()


def test_an_engine_rebuilt_in_rollout_only_keeps_the_model_s_weights(ray_cluster, tmp_path):
    """--debug rollout-only has no trainer to take weights from (an IndexError ended the run). And the driver's
    restarts go on with a cluster rebuilt after a trainer's death: they are bounded by run.max_restarts together (a
    new cluster had a new allowance), and counted on from the run's (an engine's restart before the trainer's death
    was lost from rollout/engine_restarts)."""
    overrides = ["rollout.backend=hf", "run.debug=rollout-only", "run.max_restarts=2", f"run.dir={tmp_path}"]
    cfg = load_config(TINY, overrides)
    count = RestartCount(before=5, done=1)  # the run's restarts before this driver, and this driver's so far
    cluster = Cluster(cfg, count)
    try:
        cluster.warmup()
        kill_engine(cluster.engines[0])
        out, _ = cluster.generate([PROMPT], 2, SHORT)
        assert cluster.restarts == 7 and len(out) == 2
        kill_engine(cluster.engines[0])
        with pytest.raises(ActorDied, match="rollout engine 0: its actor died during generate"):
            cluster.generate([PROMPT], 2, SHORT)
    finally:
        cluster.close()


def test_an_actor_that_cannot_start_is_one_cluster_error_naming_why(ray_cluster, tmp_path):
    """A sync.dir that cannot be made (here a file's path) fails the trainer's setup: a ClusterError that says which
    actor, which call and the OSError, where a remote traceback came through before."""
    (tmp_path / "file").touch()
    cfg = load_config(TINY, ["sync.transport=disk", f"sync.dir={tmp_path / 'file'}", f"run.dir={tmp_path / 'run'}"])
    why = r"a trainer actor's setup\(\) raised NotADirectoryError: .*file"
    with pytest.raises(ClusterError, match=why):
        Cluster(cfg)


def test_a_trainer_hung_while_an_engine_restarts_is_the_trainers_hang_not_the_engines(ray_cluster, tmp_path):
    """A rebuilt engine whose version the transport no longer holds loads the trainer's current weights. A trainer
    that never gives them (hung, or behind a train step longer than cluster.actor_timeout_s) was taken for the new
    engine's hang: the engine was killed and rebuilt until run.max_restarts ended the run, where the trainer's hang is
    healed by rebuilding the cluster from the last checkpoint."""
    overrides = ["run.max_restarts=3", "cluster.actor_timeout_s=10", f"run.dir={tmp_path}"]
    cluster = Cluster(load_config(TINY, overrides))
    try:
        cluster.warmup()
        assert cluster.sync_weights(version=1)["sync/rollout_version"] == 1
        for version in (2, 3):  # shm holds the last two: the engine's version 1 is gone, the trainer must give it
            cluster.push_weights(version)
        os.kill(ray.get(cluster.trainers[0].__ray_call__.remote(lambda self: os.getpid())), signal.SIGSTOP)
        kill_engine(cluster.engines[0])
        with pytest.raises(TrainerDied, match=r"a trainer actor hung \(no answer in 10 s\) while rollout engine 0"):
            cluster.generate([PROMPT], 2, SHORT)
        assert cluster.restarts == 1
    finally:
        cluster.close()
    assert not list(Path("/dev/shm").glob(f"rlloop_{cluster.sync_run_id}_*"))  # the killed trainer's are gone too


def test_an_engine_rebuilt_from_the_trainers_weights_carries_the_version_last_pushed(ray_cluster, tmp_path):
    """A rebuilt engine whose version the transport no longer holds loads the trainer's current weights, which are the
    last version it pushed (here pushes with no train step between: the version is the push's, not a step count).
    Its samples must carry that version, which staleness and the rollout records are counted from, and the next
    version pushed must reach it."""
    cluster = Cluster(load_config(TINY, ["run.max_restarts=1", f"run.dir={tmp_path}"]))
    try:
        cluster.warmup()
        assert cluster.sync_weights(version=1)["sync/rollout_version"] == 1
        for version in (2, 3):  # shm holds the last two: the engine's version 1 is gone, the trainer must give it
            cluster.push_weights(version)
        kill_engine(cluster.engines[0])
        out, _ = cluster.generate([PROMPT], 2, SHORT)
        assert cluster.restarts == 1 and {c.weight_version for c in out} == {3}
        # and it follows the trainer from there: the next push is a keyframe (the new engine's receiver has no base
        # for a delta on version 3), loaded at the next pull
        assert cluster.sync_weights(version=4)["sync/rollout_version"] == 4
    finally:
        cluster.close()


def test_a_trainer_found_dead_by_any_call_is_the_trainers_death(ray_cluster, tmp_path):
    """A trainer rank found dead by a call (here a push) is TrainerDied, which the loop heals by rebuilding the cluster
    from the last checkpoint; an ActorDied (an engine's) would end the run."""
    cluster = Cluster(load_config(TINY, ["sync.transport=disk", f"run.dir={tmp_path}"]))
    try:
        cluster.warmup()
        ray.kill(cluster.trainers[0])
        with pytest.raises(TrainerDied, match=r"a trainer actor died during push_weights\(\)"):
            cluster.push_weights(1)
    finally:
        cluster.close()


def test_a_train_step_that_fails_after_the_runs_start_keeps_its_own_error(ray_cluster, tmp_path):
    """Only a call of the run's start that raises is folded into one ClusterError line. Later, a trainer that stops
    on non-finite steps (train.max_bad_steps) must raise NonFiniteTraining, as without Ray: the CLI labels it a
    "training error"; as a ClusterError it was told as the cluster's fault."""
    cfg = load_config(TINY, ["train.max_bad_steps=1", f"run.dir={tmp_path}"])
    cluster = Cluster(cfg)
    try:
        cluster.warmup()
        batch = sampled_batch(cluster)
        assert cluster.start_train_step(batch, publish=1).result().published  # the start's step, healthy
        overflowing = TrainBatch(batch.prompts, batch.responses, [3e38, 3e38])  # finite, but its fp32 loss is not
        with pytest.raises(NonFiniteTraining) as raised:
            cluster.start_train_step(overflowing, publish=2).result()
        assert not isinstance(raised.value, ClusterError)
    finally:
        cluster.close()


def test_a_trainer_that_hangs_mid_run_is_given_up_on_after_actor_timeout_s(ray_cluster, tmp_path):
    """cluster.actor_timeout_s bounds a call after the run's start; the longer actor_start_timeout_s is only for the
    start's calls (setup, warm-up, the first step). A trainer that stops answering mid-run is the trainer's hang
    (TrainerDied: the loop rebuilds the cluster) once actor_timeout_s has passed, and it is killed."""
    overrides = ["rollout.backend=hf", "cluster.actor_timeout_s=5", "cluster.actor_start_timeout_s=120"]
    cluster = Cluster(load_config(TINY, [*overrides, f"run.dir={tmp_path}"]))
    try:
        cluster.warmup()
        os.kill(ray.get(cluster.trainers[0].__ray_call__.remote(lambda self: os.getpid())), signal.SIGSTOP)
        with pytest.raises(TrainerDied, match=r"a trainer actor hung \(no answer in 5 s\) during push_weights\(\)"):
            cluster.push_weights(1)
    finally:
        cluster.close()
