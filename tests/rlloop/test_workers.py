"""The worker processes' memory settings (freed memory is reused instead of being mapped and page-faulted anew, the
long-lived heap is kept out of the garbage collector's full collections), what a trainer rank publishes, when an
engine generating with in-flight updates takes new weights, and the engines' receivers counted together."""

import gc
import os
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest
import torch

import rlloop.workers
from rlloop.cluster import Cluster
from rlloop.config import load_config
from rlloop.workers import RolloutWorker, TrainerWorker
from rollout import EngineConfig, SamplingParams
from rollout.weights import load_safetensors_dir
from trainer import TrainBatch, TrainerConfig
from weight_sync import SyncConfig, make_sender

TINY = Path(__file__).resolve().parents[2] / "examples" / "grpo_dapo_tiny.yaml"

# 64 MiB blocks malloc'd, written and freed eight times, as a training step's activations are: the pages faulted in by
# the last four (16,384 pages each when they are fresh). Plain malloc, not torch tensors: torch asks for 64-byte
# alignment, glibc over-allocates for it and parks the spare tail in its per-thread cache, and whether that tail then
# keeps the freed block from merging (so the next block of the same size comes from fresh pages) depends on how full
# the cache happens to be. Training steps reuse their memory all the same (1.1M faults per 30M-parameter step before,
# 0.09M after); this checks the setting itself, which does not depend on the heap's state.
PROGRAM = """
import ctypes, ctypes.util, resource, sys
from rlloop.workers import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
for step in range(8):
    if step == 4:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(64 << 20)
    ctypes.memset(block, 1, 64 << 20)
    libc.free(block)
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True).stdout
    kept, count = out.split()
    return kept, int(count)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_freed_memory_is_reused_without_page_faults():
    assert faults("default")[1] > 4 * 16_000  # glibc maps a fresh region for every one
    kept, count = faults("keep")
    assert kept == "True" and count < 16_000  # at most one of them


# A worker freezes its heap once its long-lived state is built (rlloop.workers.freeze_heap): garbage cycles from the
# build must be collected first (frozen, they would never be), and what is alive must leave the collected generations.
FREEZE_PROGRAM = """
import gc, weakref
from rlloop.workers import freeze_heap
class Node: pass
cycle = Node(); cycle.me = cycle; cycle_ref = weakref.ref(cycle); del cycle
model = [Node() for _ in range(1000)]
before = gc.get_freeze_count()
freeze_heap()
print(cycle_ref() is None, gc.get_freeze_count() - before >= 1000, any(o is model for o in gc.get_objects()))
"""


def test_freezing_the_heap_collects_garbage_first_and_takes_the_live_objects_out_of_collections():
    out = subprocess.run([sys.executable, "-c", FREEZE_PROGRAM], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "False"]


def test_a_rank_publishes_after_a_step_only_when_the_step_changed_the_weights(tiny_qwen3_dir, tmp_path, monkeypatch):
    """The loop queues `push_weights(version, if_updated=True)` behind each train step (Cluster.start_train_step):
    after a step that raised or was skipped as non-finite it must publish nothing, so that the engines keep the last
    good weights."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what the worker sets (limit_threads); restored after the test
    threads = torch.get_num_threads()
    sync = SyncConfig(run_id="run", transport="disk", dir=str(tmp_path), delta=False, keyframe_every=1, keep=2)
    worker = TrainerWorker(TrainerConfig(tiny_qwen3_dir, lr=1e-3), 0, 1, sync)
    try:
        worker.setup()
        batch = TrainBatch([[5, 6, 7]] * 4, [[8, 9], [10], [11, 12, 13], [14]], [1.0, -1.0, 0.5, -0.5])
        worker.train_step(batch)
        assert worker.push_weights(1, if_updated=True)["sync/version"] == 1
        with pytest.raises(ValueError, match="advantages"):  # a bad batch: the step raises before touching anything
            worker.train_step(TrainBatch(batch.prompts, batch.responses, batch.advantages[:3]))
        assert worker.push_weights(2, if_updated=True) is None and worker.sender.version == 1
        with torch.no_grad():  # one poisoned weight: every gradient from here on is NaN, and the step is skipped
            worker.trainer.model.get_decoder().norm.weight[0] = float("nan")
        assert worker.train_step(batch)["train/skipped_steps"] == 1
        assert worker.push_weights(3, if_updated=True) is None and worker.sender.version == 1
    finally:
        torch.set_num_threads(threads)  # the worker set one thread for this process


def test_an_in_flight_generation_starts_on_the_version_pushed_just_before_it(tiny_qwen3_dir, tmp_path, monkeypatch):
    """Between decode dispatches the engine looks for new weights at most every IN_FLIGHT_POLL_S, but always before a
    generation's first dispatch: fully_async's next chunk, started right after a push, is the new version's from its
    first token (set here to an hour, so that only that first look can see it)."""
    monkeypatch.setattr(rlloop.workers, "IN_FLIGHT_POLL_S", 3600.0)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    sync = SyncConfig(
        run_id=f"test-workers-{os.getpid()}", transport="shm", dir=str(tmp_path), delta=False, keyframe_every=1, keep=2
    )
    sender = make_sender(sync)
    engine = EngineConfig(
        str(tiny_qwen3_dir),
        max_batch=4,
        max_seq_len=32,
        prefill_buckets=(16,),
        decode_buckets=(4,),
        steps_per_dispatch=2,
    )
    worker = RolloutWorker(engine, "jax", sync)
    weights = load_safetensors_dir(str(tiny_qwen3_dir))
    try:
        for version in (1, 2, 3):
            sender.push(weights, version)
            out, _ = worker.generate([[5, 6, 7]], 2, SamplingParams(max_new_tokens=8), in_flight_updates=True)
            assert [(c.weight_version, c.last_weight_version) for c in out] == [(version, version)] * 2
    finally:
        sender.close()
        worker.close()
        torch.set_num_threads(threads)


def tpu_devices(*coords) -> list:
    """What jax.local_devices() gives on a TPU host (faked here): a v7x chip's two TensorCores share its coords."""
    from types import SimpleNamespace

    return [SimpleNamespace(coords=c) for c in coords]


@pytest.mark.parametrize(
    "chips, devices, tp",
    [
        (1, tpu_devices((0, 0, 0), (0, 0, 0)), 2),  # v7x: a chip's two TensorCores are two devices
        (2, tpu_devices((0, 0, 0), (1, 0, 0)), 2),  # v6e: one device a chip
        (2, tpu_devices((0, 0, 0), (0, 0, 0), (1, 0, 0), (1, 0, 0)), None),  # 2 KV heads do not split over 4
    ],
    ids=["v7x", "v6e", "v7x-heads-do-not-split"],
)
def test_a_tpu_engine_spans_every_device_of_its_chips(monkeypatch, tiny_qwen3_dir, chips, devices, tp):
    """The engine's mesh is every device JAX shows of its chips (TPU hardware faked), counted from the devices: an
    actor given every chip of its host has no TPU_VISIBLE_CHIPS (Ray leaves it out), and used half of them. A model
    whose heads do not split over the TensorCores is one clear error, where the engine failed at tp = 2 x chips."""
    import jax

    monkeypatch.delenv("TPU_VISIBLE_CHIPS", raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(jax, "local_devices", lambda: devices)
    engine = EngineConfig(model_path=str(tiny_qwen3_dir), tp=chips)
    if tp is None:
        with pytest.raises(ValueError, match="tp=4: the model's num_key_value_heads=2 do not split over 4; give each"):
            rlloop.workers.over_every_tensorcore(engine)
    else:
        assert rlloop.workers.over_every_tensorcore(engine).tp == tp


def test_a_version_refused_by_two_engines_counts_twice(tmp_path):
    """`sync/refused` adds up every engine's receiver (it was engine 0's count alone): two local engines, one
    version with a flipped byte in its weights file, pulled once."""
    overrides = ["cluster.use_ray=false", "rollout.backend=hf", "cluster.rollout_chips=2", "cluster.rollout_engines=2"]
    cfg = load_config(TINY, overrides + ["sync.transport=disk", "sync.delta=false", f"run.dir={tmp_path}"])
    with closing(Cluster(cfg)) as cluster:
        cluster.warmup()
        cluster.push_weights(1)
        sync = cfg.sync_config()
        weights = Path(sync.dir) / sync.run_id / "v000000000001" / "weights.safetensors"
        flipped = bytearray(weights.read_bytes())
        flipped[-5] ^= 0x55
        weights.write_bytes(bytes(flipped))
        pulled = cluster.pull_weights()
    assert pulled["sync/refused"] == 2 and pulled["rollout/engine_1/version"] == 0  # both kept what they had


def test_each_generate_call_shares_its_prompts_as_if_the_engines_were_idle(tmp_path):
    """Two local engines: work handed out is taken back in full once a call returns (prompt + response tokens x
    n samples), so the same call made again is shared out the same way: 3 equal prompts, 2 to engine 0 and 1 to
    engine 1, every time (work left over counted against an idle engine skewed the next calls)."""
    overrides = ["cluster.use_ray=false", "cluster.rollout_chips=2", "cluster.rollout_engines=2"]
    cfg = load_config(TINY, overrides + [f"run.dir={tmp_path}"])
    n, new = 2, 4
    sampling = SamplingParams(max_new_tokens=new, ignore_eos=True, seed=3)
    with closing(Cluster(cfg)) as cluster:
        cluster.warmup()
        shares = []
        for _ in range(3):
            completions, stats = cluster.pool.generate([[5, 6, 7]] * 3, n, sampling)
            assert len(completions) == 3 * n and all(len(c.token_ids) == new for c in completions)
            shares.append((stats["engine_0/tokens"] / (n * new), stats["engine_1/tokens"] / (n * new)))
    assert shares == [(2, 1)] * 3


def test_a_rank_publishes_a_step_that_applied_some_of_its_minibatches(tiny_qwen3_dir, tmp_path, monkeypatch):
    """With train.minibatches=2 a step whose second update overflows (finite advantages, non-finite fp32 loss) still
    applied its first: the weights changed, so the push queued behind the step must publish them (else the engines
    keep generating on the version before, and the step counts as one that published nothing)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    sync = SyncConfig(run_id="run", transport="disk", dir=str(tmp_path), delta=False, keyframe_every=1, keep=2)
    worker = TrainerWorker(TrainerConfig(tiny_qwen3_dir, lr=1e-3, minibatches=2), 0, 1, sync)
    try:
        worker.setup()
        before = {k: v.copy() for k, v in worker.trainer.export_weights().items()}
        batch = TrainBatch([[5, 6, 7]] * 4, [[8, 9], [10], [11, 12, 13], [14]], [1.0, -1.0, 3e38, 3e38])
        metrics = worker.train_step(batch)
        assert metrics["train/minibatches"] == 2 and metrics["train/skipped_steps"] == 1
        after = worker.trainer.export_weights()
        assert any(not (before[k] == after[k]).all() for k in before)  # the first update was applied
        pushed = worker.push_weights(1, if_updated=True)
        assert pushed is not None and pushed["sync/version"] == 1 and worker.sender.version == 1
    finally:
        torch.set_num_threads(threads)


def test_a_cluster_step_that_applied_no_update_publishes_nothing_and_says_so(tmp_path):
    """Cluster.start_train_step queues the push behind the step with if_updated: a step whose every update was skipped
    (finite advantages, non-finite fp32 loss) publishes nothing and reports published=False, so the engines keep the
    weights they have and the loop counts the step as unpublished (rlloop/rollout_manager.py staleness); the next
    healthy step publishes its version."""
    overrides = ["cluster.use_ray=false", "rollout.backend=hf", "sync.transport=disk", f"run.dir={tmp_path}"]
    with closing(Cluster(load_config(TINY, overrides))) as cluster:
        cluster.warmup()
        prompts, responses = [[5, 6, 7]] * 4, [[8, 9], [10], [11, 12, 13], [14]]
        skipped = cluster.start_train_step(TrainBatch(prompts, responses, [3e38] * 4), publish=1).result()
        assert skipped.metrics["train/skipped_steps"] == skipped.metrics["train/minibatches"]
        assert not skipped.published and cluster.trainers[0].sender.version is None
        assert cluster.pull_weights()["sync/rollout_version"] == 0
        healthy = cluster.start_train_step(TrainBatch(prompts, responses, [1.0, -1.0, 0.5, -0.5]), publish=2).result()
        assert healthy.published and cluster.pull_weights()["sync/rollout_version"] == 2


# An actor pins itself to the cores of its "chip" (RLLOOP_CPUS, from the placement plan), counted among the cores its
# process may use and modulo their number: a node inside a cpuset (a container given cores 4-7) or with fewer cores
# than the plan assumed must still get cores it has.
PIN_PROGRAM = """
import os
from rlloop.workers import limit_threads
allowed = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {allowed[-1]})  # a process allowed one core, not core 0
os.environ["RLLOOP_CPUS"] = "0,3"  # its chip's cores: the first, and one past what this node has
limit_threads(1, torch_pools=False)
print(sorted(os.sched_getaffinity(0)) == [allowed[-1]], os.environ["OMP_NUM_THREADS"])
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="2+ cores")
def test_an_actor_pins_itself_to_the_cores_it_is_allowed_counted_modulo_their_number():
    out = subprocess.run([sys.executable, "-c", PIN_PROGRAM], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "1"]


def test_an_in_process_cluster_whose_trainer_cannot_start_closes_its_engines(tmp_path, monkeypatch):
    """Without Ray the engines are built, and freeze this process's heap (freeze_heap), before the trainer starts: a
    trainer that cannot start must close them and give the heap back to the collector, or everything the failed start
    built stays in memory for the rest of the process."""
    closed = []
    monkeypatch.setattr(RolloutWorker, "close", lambda self, real=RolloutWorker.close: closed.append(real(self)))

    def cannot_start(self):
        raise RuntimeError("the trainer cannot start")

    monkeypatch.setattr(TrainerWorker, "setup", cannot_start)
    gc.unfreeze()  # whatever an earlier test left frozen
    overrides = ["cluster.use_ray=false", "cluster.rollout_chips=2", "cluster.rollout_engines=2", f"run.dir={tmp_path}"]
    with pytest.raises(RuntimeError, match="the trainer cannot start"):
        Cluster(load_config(TINY, overrides))
    assert len(closed) == 2 and gc.get_freeze_count() == 0
