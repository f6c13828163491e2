"""When generation runs relative to training: the three `loop.mode`s, each a source of one training batch per step.

    sync        generate step k, then train it (on-policy: samples are the weights of step k - 1).
    async       slime's train_async: as soon as step k's samples are in, step k + 1 starts generating on the
                engines' current weights while step k trains; before step k + 2 generates, the engines load what
                step k produced ("sync generate before update weights"), waiting for it if the loop has queued
                step k + 1's training behind step k's (`trained`). Samples are one version stale.
    fully_async Miles' --fully-async / PipelineRL: a producer thread keeps the engines generating, chunk after
                chunk, into a buffer of groups; the engines load new weights between decode dispatches (a sample
                may span versions; both ends are recorded); the trainer takes a batch as soon as one is buffered,
                dropping groups whose first version lags its own by more than `loop.max_staleness`. DAPO's dynamic
                sampling filters at buffer entry.

Every source returns `StepRollout`s (rlloop/rollout_manager.py) and knows where the data must resume after a crash:
`resume_state()` is the data cursor of the oldest prompt not yet trained on (in flight or buffered), so a checkpoint
plus `--resume` neither loses a prompt nor trains on one twice. The async sources run the driver-side work
(generation calls, decoding, rewards) in a background thread; engines and trainer are separate actors, so their
chips work at the same time. docs/design.md §9.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext
from typing import NamedTuple

from rlloop.profiling import profile_dir
from rlloop.rollout_manager import Group, RolloutManager, RolloutTally, StepRollout, oversampled, sampling_seed


class RolloutSchedule:
    """What each source of batches (a `loop.mode`, or --debug train-only's replay) answers the loop."""

    overlapped = False  # whether the engines generate the next batch while the trainer trains

    def next(self, step: int) -> StepRollout:
        """Step `step`'s batch: rollout, rewards and advantages."""
        raise NotImplementedError

    def trained(self, step: int, published: bool = True) -> None:
        """The loop's word that `step` has trained and, if `published`, published its weights (a step that changed
        nothing publishes nothing). It may come from another thread, and out of order with the step before."""

    def training_failed(self, step: int, error: BaseException) -> None:
        """The loop's word that `step`'s training raised `error`; the loop raises it when it waits for the step. Only
        a schedule whose `next` waits on the trainer's weights passes it on."""

    def paused(self):
        """Around the loop's evaluation, which loads the newest weights: no generation starts inside."""
        return nullcontext()

    def resume_state(self) -> dict:
        """The data cursor of the oldest prompt not yet trained on, for a checkpoint."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop what runs in the background; a generation under way finishes."""


class SyncRollout(RolloutSchedule):
    """`loop.mode: sync`. Step k's batch is generated when the loop asks for it, on the weights of step k - 1."""

    def __init__(self, manager: RolloutManager):
        self.manager = manager

    def next(self, step: int) -> StepRollout:
        return self.manager.collect(step)

    def trained(self, step: int, published: bool = True) -> None:
        self.manager.record_publication(step, published)

    def resume_state(self) -> dict:
        return self.manager.data.state_dict()


class Pending(NamedTuple):
    """A step whose generation the async schedule has started."""

    step: int
    cursor: dict  # the data cursor before it drew: its resume point
    batch: Future  # its StepRollout


class AsyncRollout(RolloutSchedule):
    """`loop.mode: async`. Step k's batch was generated while step k - 1 trained."""

    overlapped = True

    def __init__(self, manager: RolloutManager, start: int = 0):
        self.manager = manager
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rlloop-rollout")
        self.pending: Pending | None = None
        self.trained_through, self.closing = start, False  # the last step whose weights are published
        self.done: set[int] = set()  # steps past trained_through that are done, out of order
        self.cond = threading.Condition()

    def _start(self, step: int) -> None:
        cursor = self.manager.data.state_dict()  # taken before the thread draws: the resume point of `step`
        self.pending = Pending(step, cursor, self.pool.submit(self._pull_and_collect, step))

    def trained(self, step: int, published: bool = True) -> None:
        """Steps are trained in order, but a step that trains nothing is done at once, while the one before it still
        trains: `trained_through` moves only over steps all done (it jumped, and the next generation pulled before
        the step before had published, on older weights than the schedule calls for)."""
        self.manager.record_publication(step, published)
        with self.cond:
            self.done.add(step)
            while self.trained_through + 1 in self.done:
                self.trained_through += 1
                self.done.discard(self.trained_through)
            self.cond.notify_all()

    def _pull_and_collect(self, step: int) -> StepRollout:
        """In the rollout thread: once step - 2 has trained and published (the loop may start this while it still
        trains, with step - 1 queued behind it), the engines load its weights and generate `step`; those of step - 2
        even if step - 1 has published too by then (a pull delayed past a train step made a run differ from its
        rerun). The load is off the training path: the trainer is on step - 1, whose weights come a whole train
        step later. After a checkpoint the step waits for the checkpoint's own weights: a run resumed from it
        has no older ones, so both generate the step from the same weights and the resumed run goes on exactly as
        the uninterrupted one (an overlap given up every run.save_every steps)."""
        newest = step - 1 if self.manager.cfg.run.saves_at(step - 1) else step - 2
        with self.cond:
            self.cond.wait_for(lambda: self.closing or self.trained_through >= newest)
            if self.closing:
                raise RuntimeError(f"the run stopped before step {step} was generated")
        pulled = self.manager.cluster.pull_weights(at_most=newest)
        batch = self.manager.collect(step)
        batch.metrics |= pulled
        return batch

    @contextmanager
    def paused(self):
        """Around the loop's evaluation of step k, which loads k's weights: step k + 1, generated on k - 1's, is done
        first (a pull delayed past the evaluation's found k's loaded, and generated on them). It costs the evaluation
        nothing: on the engines its calls would queue behind that generation anyway."""
        if self.pending is not None:
            wait([self.pending.batch])
        yield

    def next(self, step: int) -> StepRollout:
        if self.pending is None or self.pending.step != step:
            self._start(step)
        batch = self.pending.batch.result()
        if step < self.manager.cfg.run.steps:
            self._start(step + 1)
        else:
            self.pending = None
        return batch

    def resume_state(self) -> dict:
        return self.pending.cursor if self.pending is not None else self.manager.data.state_dict()

    def close(self) -> None:
        # Let a generation in flight finish (its actor calls cannot be cancelled), then stop the thread; one still
        # waiting for its weights (a step that failed to train) gives up.
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.pool.shutdown(wait=True, cancel_futures=True)


class FullyAsyncRollout(RolloutSchedule):
    """`loop.mode: fully_async`. A producer thread generates chunks of `prompts_per_step` prompts back to back, with
    in-flight weight updates, up to one batch ahead of the trainer and no further than `loop.max_staleness` allows
    (AReaL's staleness-aware admission): a chunk whose groups the trainer would take when they are already too stale
    is not started until newer weights exist. Generating it anyway only to drop it wasted the engine's time and the
    prompts (a third of each tiny run's groups were dropped)."""

    overlapped = True

    def __init__(self, manager: RolloutManager, start: int = 0):
        # --debug rollout-only trains nothing, so its engines keep the one policy there is and no sample is stale
        # (counted against step - 1, every one was from step 3 on, and `next` waited forever for a fresh group)
        trains = manager.cfg.run.debug != "rollout-only"
        self.manager, self.max_staleness = manager, manager.cfg.loop.max_staleness if trains else math.inf
        self.want = manager.cfg.rollout.prompts_per_step
        self.version = start  # the newest weight version published or seen on a sample
        self.training: set[int] = set()  # steps taken by the trainer and not yet trained
        self.first = start + 1  # the first step this run trains
        self.asking = start + 1  # the step whose batch `next` takes now or next
        self.starving = False  # `next` waits on an empty buffer: a chunk starts whatever its staleness
        self.taken_now = 0  # groups the `next` under way has taken already
        self.buffer: deque[Group] = deque()
        self.tally = RolloutTally()  # what was generated since the last batch was taken
        self.in_flight_cursor: dict | None = None
        self.dropped_stale = self.dropped_zero_std = 0
        # DAPO's dynamic sampling: a step that has waited for `max_sampling_rounds` chunks and still lacks groups (the
        # rest agreed on their reward) trains on what it has, as `collect` does after its rounds (verl's
        # max_num_gen_batches), rather than draw on, or wait for ever on a policy that no longer disagrees with itself
        grpo = manager.cfg.grpo
        self.give_up_after = grpo.max_sampling_rounds if grpo.dynamic_sampling else math.inf
        self.rounds = 0  # chunks started since the last batch was taken: at most give_up_after a step
        self.groups_made = self.groups_kept = 0  # over the run: the share dynamic sampling keeps
        self.error: BaseException | None = None
        self.stopping = self.pausing = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._produce, name="rlloop-producer", daemon=True)
        self.thread.start()

    def _produce(self) -> None:
        # Chunks are numbered on from the step the run starts at: a resumed run's chunks get new sampling seeds, not
        # those of the first run's first chunks again.
        cfg, chunk = self.manager.cfg, self.first - 1
        try:
            while True:
                with self.cond:
                    # Back-pressure: at most one batch waits in the buffer, and a chunk starts only if it would be
                    # fresh enough when taken.
                    self.cond.wait_for(
                        lambda: (
                            self.stopping
                            or (
                                not self.pausing
                                and len(self.buffer) < self.want
                                and self.rounds < self.give_up_after
                                and self._admits()
                            )
                        )
                    )
                    if self.stopping:
                        return
                    self.in_flight_cursor = self.manager.data.state_dict()
                    prompts = self.manager.data.next_batch(self._chunk_prompts())
                    self.rounds += 1
                chunk += 1
                # the chunk step `chunk` takes, unless groups were dropped (rlloop/profiling.py)
                profile = profile_dir(cfg, chunk)
                groups, stats = self.manager.groups(prompts, sampling_seed(cfg.run.seed, -chunk), True, profile)
                with self.cond:
                    self.tally.add(groups, stats)
                    self.version = max([self.version] + [c.last_weight_version for g in groups for c in g.completions])
                    kept = 0
                    for grp in groups:
                        if cfg.grpo.dynamic_sampling and grp.zero_std:
                            self.dropped_zero_std += 1
                        else:
                            self.buffer.append(grp)
                            kept += 1
                    self.groups_made, self.groups_kept = self.groups_made + len(groups), self.groups_kept + kept
                    self.in_flight_cursor = None
                    self.cond.notify_all()
        except BaseException as e:  # surfaced in the trainer's thread by next()
            with self.cond:
                self.error = e
                self.cond.notify_all()

    @contextmanager
    def paused(self):
        """No chunk starts inside (the loop's evaluation: its generation has the engines to itself, and is not queued
        behind a chunk on them); the one under way, if any, finishes."""
        with self.cond:
            self.pausing = True
        try:
            yield
        finally:
            with self.cond:
                self.pausing = False
                self.cond.notify_all()

    def _admits(self) -> bool:
        """Whether a new chunk's groups would be at most `max_staleness` updates behind the trainer that takes them:
        behind the `buffer` groups and those the `next` under way has taken (`taken_now`: with dynamic sampling a step
        takes groups of several chunks), its last one goes to step `asking + (taken_now + buffer + want - 1) // want`,
        and it starts on version `version` or newer. A trainer waiting on an empty buffer (`starving`: not one whose
        wait is over, the buffer filled before it woke) is served at once unless a step in training may publish the
        weights that make the chunk fresh enough (at max_staleness 0, a chunk started before step k's weights were
        out was generated only to be dropped, two chunks a step). None starts whose groups no step of the run takes."""
        if self.asking + (len(self.buffer) + self.taken_now) // self.want > self.manager.cfg.run.steps:
            return False  # its groups would go to steps past the run's last: generated only to be thrown away
        starved = self.starving and not self.buffer and not self.training
        return starved or self._fresh_enough()

    def _fresh_enough(self) -> bool:
        last_step = self.asking + (len(self.buffer) + self.taken_now + self.want - 1) // self.want
        return self.manager.updates_behind(self.version, last_step) <= self.max_staleness

    def _rounds_spent(self) -> bool:
        """Whether the step has had its `max_sampling_rounds` chunks, the last one finished."""
        return self.rounds >= self.give_up_after and self.in_flight_cursor is None

    def _chunk_prompts(self) -> int:
        """A batch's worth of prompts; for a chunk admitted only because the trainer starves, the groups its step
        still lacks over the share of groups dynamic sampling has kept, as sync's rounds over-sample (`top_up`): a
        whole chunk's surplus would be too stale for the step after (at max_staleness 0, over a third of the groups
        were generated only to be dropped), and the bare shortfall trained short steps."""
        if self._fresh_enough():
            return self.want
        return oversampled(self.want - self.taken_now, self.groups_kept, self.groups_made, self.want)

    def next(self, step: int) -> StepRollout:
        """The oldest `prompts_per_step` fresh groups; blocks until the producer has them, or with dynamic sampling
        until the `max_sampling_rounds` chunks started since the last batch was taken have finished (then fewer, or
        none: the step trains short or not)."""
        taken: list[Group] = []
        with self.cond:
            self.asking = step
            while len(taken) < self.want:
                self.starving = not self.buffer
                self.cond.notify_all()
                self.cond.wait_for(lambda: self.buffer or self.error is not None or self._rounds_spent())
                self.starving = False
                if self.error is not None:
                    raise self.error
                if not self.buffer:  # dynamic sampling found nothing to learn from in its rounds
                    break
                grp = self.buffer.popleft()
                self.cond.notify_all()  # room in the buffer: the producer may go on
                if self.manager.updates_behind(grp.first_version, step) > self.max_staleness:
                    self.dropped_stale += 1
                else:
                    taken.append(grp)
                    self.taken_now = len(taken)
            tally, self.tally = self.tally, RolloutTally()
            counts = {
                "rollout/stale_groups_dropped": self.dropped_stale,
                "rollout/zero_std_groups_dropped": self.dropped_zero_std,
            }
            self.asking, self.rounds = step + 1, 0
            self.taken_now = 0
            self.training.add(step)
            self.cond.notify_all()
        batch = self.manager.batch(step, taken, tally)
        batch.metrics |= counts | self.manager.cluster.sync_metrics()  # the engines pulled as they generated
        return batch

    def training_failed(self, step: int, error: BaseException) -> None:
        """A `next` waiting for groups that only the failed step's weights would have let start gets `error`; the step
        stays in training, so no chunk starts on its account."""
        with self.cond:
            self.error = self.error or error
            self.cond.notify_all()

    def trained(self, step: int, published: bool = True) -> None:
        """The engines take new weights as they are published; a chunk held back as too stale may start now."""
        with self.cond:
            self.training.discard(step)
            self.manager.record_publication(step, published)
            if published:
                self.version = max(self.version, step)
            self.cond.notify_all()

    def resume_state(self) -> dict:
        with self.cond:
            if self.buffer:
                return self.buffer[0].prompt.cursor
            return self.in_flight_cursor or self.manager.data.state_dict()

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join()
