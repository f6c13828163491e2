"""The loop modes' batch sources on the real tiny model: when async and fully_async may generate (the weights they
wait for, a step that published nothing, a resumed run), where a checkpoint taken mid-flight resumes the data, a
resumed fully_async run's chunk seeds, and what the loop's queued training (start_training) tells its schedule (a step
that published nothing, one whose training raised) and logs."""

from contextlib import closing, contextmanager
from types import SimpleNamespace

import pytest

from rlloop import loop
from rlloop.config import load_config
from rlloop.data import load_datasets
from rlloop.loop import rollout_schedule, start_training
from rlloop.rollout_manager import RolloutManager
from rlloop.schedules import FullyAsyncRollout
from tests.rlloop.conftest import TINY


def test_a_resumed_fully_async_run_draws_new_samples_for_its_first_chunk(setup):
    """Chunks are numbered on from the step a run starts at: started at step 5 on the same weights and prompts, the
    first chunk must not be sampled with the seed of a fresh run's first chunk (and so be the same tokens)."""
    cluster, tok = setup
    # the engines keep version 0: staleness allowed past the resumed step's 5 versions
    overrides = ["rollout.backend=hf", "cluster.use_ray=false", "rollout.prompts_per_step=2", "loop.max_staleness=8"]
    cfg = load_config(TINY, overrides)
    tokens = []
    for start in (0, 0, 5):
        data, _ = load_datasets(cfg, tok)  # each from the top: the same prompts
        with closing(RolloutManager(cfg, cluster, tok, data)) as rollout:
            source = FullyAsyncRollout(rollout, start=start)
            try:
                batch = source.next(start + 1)
            finally:
                source.close()
        tokens.append([c.token_ids for c in batch.samples.completions])
    assert tokens[0] == tokens[1]  # a chunk's samples are its seed's: the same start draws the same
    assert tokens[2] != tokens[0]


@contextmanager
def schedule_of(setup, overrides: list[str], start: int = 0):
    """The `loop.mode` schedule `overrides` set for a run that has trained `start` steps, over the module's cluster
    with its own manager and data, closed after; yields (manager, schedule)."""
    cluster, tok = setup
    cfg = load_config(TINY, ["rollout.backend=hf", "cluster.use_ray=false", *overrides])
    data, _ = load_datasets(cfg, tok)
    with (
        closing(RolloutManager(cfg, cluster, tok, data)) as rollout,
        closing(rollout_schedule(rollout, start)) as schedule,
    ):
        yield rollout, schedule


def test_fully_async_takes_a_step_that_published_nothing_for_no_newer_weights(setup):
    """A step that trains nothing is done at once, while the step before it still trains: the newest weights the
    producer admits chunks by stay the last published ones. Taken for step 3's, a chunk one update too stale (step
    2's is still to come) was started, only to be dropped."""
    fully_async = ["loop.mode=fully_async", "rollout.prompts_per_step=2", "loop.max_staleness=0"]
    with schedule_of(setup, fully_async) as (rollout, source):
        source.trained(1)
        source.trained(3, published=False)  # step 2 still trains
        assert source.version == 1
        assert rollout.updates_behind(source.version, 4) == 1  # step 2's update


def test_async_generates_a_step_only_once_every_step_before_its_weights_is_done(setup):
    """A step that trains nothing (dynamic sampling kept no group) is done at once, while the step before it still
    trains: that let the next generation pull before the step before had published, on older weights than the
    async schedule calls for (and than a run resumed at that point would use)."""
    with schedule_of(setup, ["loop.mode=async"]) as (rollout, schedule):
        schedule.trained(1)
        schedule.trained(3, published=False)  # step 2 still training
        assert schedule.trained_through == 1
        schedule.trained(2)
        assert schedule.trained_through == 3 and rollout.unpublished == {3}


def _drawn_from(cfg, tok, cursor, n):
    data, _ = load_datasets(cfg, tok)
    data.load_state_dict(cursor)
    return [p.index for p in data.next_batch(n)]


def test_a_resumed_async_run_waits_for_no_weights_before_its_checkpoints(setup):
    """Resumed after step 5, async generates step 6 on the checkpoint's weights at once, and step 6's training moves
    the weights it has on to 6. Counted from step 0 instead, the run's first generation waited for steps 1 to 4,
    which it never trains, and hung."""
    with schedule_of(setup, ["loop.mode=async", "rollout.prompts_per_step=2", "run.steps=8"], start=5) as (_, schedule):
        schedule.trained(6)
        assert schedule.trained_through == 6
        assert len(schedule.next(7).samples.prompts) == 2  # waits for step 5's weights: the checkpoint's


def test_async_resumes_at_the_prompts_of_the_step_generated_ahead(setup):
    """A checkpoint after step 1 in async, taken once step 2 (generated ahead) has drawn its prompts: the resumed run
    draws those prompts again (step 2 trains after the checkpoint). The e2e resume tests reach this only when their
    thread timing puts the draw before the checkpoint, which it did in none of them."""
    with schedule_of(setup, ["loop.mode=async", "rollout.prompts_per_step=2", "run.steps=4"]) as (rollout, schedule):
        schedule.next(1)  # starts step 2 in the rollout thread (step 0's weights: no wait)
        ahead = schedule.pending.batch.result()  # step 2 has drawn its prompts, not trained on them
        cursor = schedule.resume_state()
    assert _drawn_from(rollout.cfg, setup[1], cursor, 2) == [p.index for p in ahead.samples.prompts]


def test_fully_async_resumes_at_the_oldest_buffered_prompt(setup):
    """fully_async's checkpoint with groups buffered and not trained: the resumed run draws the oldest of them first."""
    fully_async = ["loop.mode=fully_async", "rollout.prompts_per_step=2", "loop.max_staleness=8"]
    with schedule_of(setup, fully_async) as (rollout, source):
        source.next(1)
        with source.cond:  # the producer buffers the next chunk
            assert source.cond.wait_for(lambda: len(source.buffer) == source.want, timeout=120)
            buffered = [g.prompt.index for g in source.buffer]
        cursor = source.resume_state()
    assert _drawn_from(rollout.cfg, setup[1], cursor, 2) == buffered


def test_a_step_that_applied_no_update_publishes_nothing_and_its_schedule_hears_so(setup):
    """A non-finite step (here: finite advantages that overflow the fp32 loss) changes no weight: the trainer
    publishes nothing, and the schedule hears `trained(step, published=False)` as soon as the step is done, so that
    later samples count no update for it (their staleness)."""
    with schedule_of(setup, ["loop.mode=async", "rollout.prompts_per_step=2"]) as (rollout, schedule):
        batch = schedule.next(1)
        batch.samples.advantages[:] = 3e38
        metrics = start_training(rollout.cfg, setup[0], 1, batch.samples, schedule)(0.0)
        assert metrics["train/skipped_steps"] == metrics["train/minibatches"]
        with schedule.cond:
            assert schedule.cond.wait_for(lambda: schedule.trained_through == 1, timeout=60)
        assert rollout.unpublished == {1}


def test_a_step_whose_training_raises_ends_the_wait_for_its_weights(setup):
    """A step whose training raised (here: a sample the trainer refuses) publishes nothing, ever: the schedule hears
    `training_failed`, so that a fully_async `next` waiting for groups that only that step's weights would admit (at
    max_staleness 0, every chunk after step 1's) raises the step's error instead of waiting for ever."""
    fully_async = ["loop.mode=fully_async", "rollout.prompts_per_step=2", "loop.max_staleness=0"]
    with schedule_of(setup, fully_async) as (rollout, source):
        batch = source.next(1)
        batch.samples.completions[0].logprobs[0] = float("nan")
        with pytest.raises(ValueError, match="non-finite"):
            start_training(rollout.cfg, setup[0], 1, batch.samples, source)(0.0)
        with source.cond:  # the future's callbacks may run just after its waiter wakes
            assert source.cond.wait_for(lambda: source.error is not None, timeout=60)
        with pytest.raises(ValueError, match="non-finite"):
            source.next(2)


def test_a_steps_train_and_sync_seconds_split_the_drivers_wait_at_the_push(setup, monkeypatch):
    """The driver's wait for a step (sync mode), on a fake clock: its `queued` seconds and its wait for the trainer
    are train_s but for the push the trainer reports (perf/push_s), which is sync_s with the engines' pull after. A
    push longer than the driver waited counts only what it waited."""
    with schedule_of(setup, ["rollout.prompts_per_step=2"]) as (rollout, schedule):
        for step, queued, reads in ((1, 5.0, [10.0, 12.5, 12.5, 13.0]), (2, 0.0, [20.0, 20.0, 20.0, 20.25])):
            samples = schedule.next(step).samples
            # the clock's reads in the wait: its start, the result, the pull's start and end
            monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=iter(reads).__next__))
            metrics = start_training(rollout.cfg, setup[0], step, samples, schedule)(queued)
            push, blocked, pull = metrics["perf/push_s"], queued + reads[1] - reads[0], reads[3] - reads[2]
            assert push > 0
            assert metrics["perf/train_s"] == pytest.approx(blocked - min(push, blocked))
            assert metrics["perf/sync_s"] == pytest.approx(min(push, blocked) + pull)
