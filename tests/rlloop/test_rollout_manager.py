"""RolloutManager.collect on the real tiny model: grouping, DAPO dynamic sampling, overlong shaping, the train batch."""

import json
from contextlib import closing, contextmanager
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from rlloop.cluster import Cluster
from rlloop.config import load_config
from rlloop.data import Prompt, load_datasets
from rlloop.loop import rollout_schedule
from rlloop.rollout_manager import RolloutManager, RolloutTally, distinct, rollout_metrics, sampling_seed, top_up
from rlloop.schedules import FullyAsyncRollout
from rollout import Completion

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "grpo_dapo_tiny.yaml")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = load_config(
        TINY,
        [
            "rollout.backend=hf",
            "cluster.use_ray=false",
            "sync.transport=disk",
            f"run.dir={tmp_path_factory.mktemp('run')}",
        ],
    )
    cluster = Cluster(cfg)
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    yield cluster, tok
    cluster.close()


def run_collect(setup, overrides):
    cluster, tok = setup
    cfg = load_config(TINY, ["rollout.backend=hf", "cluster.use_ray=false", *overrides])
    data, _ = load_datasets(cfg, tok)
    with closing(RolloutManager(cfg, cluster, tok, data)) as rollout:
        batch = rollout.collect(1)
    return cfg, (batch.samples, batch.metrics)


@pytest.mark.parametrize("std_scale", [True, False])
def test_groups_rewards_and_advantages(setup, std_scale):
    """Advantages as GRPO defines them, written out here: the group's mean subtracted, divided by the group's
    (Bessel) std + 1e-4 unless grpo.std_scale is off (Dr.GRPO)."""
    cfg, (samples, metrics) = run_collect(setup, ["rollout.prompts_per_step=6", f"grpo.std_scale={std_scale}"])
    g = cfg.rollout.group_size
    assert len(samples.prompts) == 6 and len(samples.completions) == 6 * g
    for j, c in enumerate(samples.completions):  # each completion answers its own group's prompt
        assert c.prompt_index == j // g and c.sample_index == j % g
    groups = samples.rewards.astype(np.float64).reshape(-1, g)
    want = groups - groups.mean(axis=1, keepdims=True)
    if std_scale:
        want /= groups.std(axis=1, ddof=1, keepdims=True) + 1e-4
    assert (groups.std(axis=1) > 0).any()  # some group carries a signal, whose scale the two modes differ in
    np.testing.assert_allclose(samples.advantages, want.reshape(-1), rtol=1e-6, atol=1e-6)
    batch = samples.to_train_batch()
    assert batch.prompts[g] == samples.prompts[1].token_ids and batch.responses[0] == samples.completions[0].token_ids
    assert metrics["rollout/raw_reward"] == pytest.approx(float(samples.raw_rewards.mean()))


# 12 prompts a step in pairs, dynamic sampling over up to 4 rounds
DYNAMIC_PAIRS = [
    "rollout.prompts_per_step=12",
    "rollout.group_size=2",
    "grpo.dynamic_sampling=true",
    "grpo.max_sampling_rounds=4",
]


def test_dynamic_sampling_trains_exactly_prompts_per_step_groups_when_it_has_more(setup):
    """Pairs under a reward that fails on about half the responses: the first round keeps some groups, the next
    over-samples by the fraction kept and ends with more than a step takes; the step trains on exactly
    rollout.prompts_per_step of them, and counts those it leaves."""
    cfg, (samples, metrics) = run_collect(
        setup, [*DYNAMIC_PAIRS, "reward.fn=tests.rlloop.reward_fns:fails_on_odd_length", "reward.failure_reward=-1"]
    )
    assert len(samples.prompts) == metrics["rollout/groups_kept"] == 12
    assert len(samples.completions) == 12 * cfg.rollout.group_size
    # the informative groups left over are counted: with them, the informative share of the groups generated
    informative = 12 + metrics["rollout/groups_surplus"]
    generated = informative / (1 - metrics["rollout/zero_std_ratio"])
    assert metrics["rollout/groups_surplus"] >= 1 and generated == pytest.approx(round(generated), abs=1e-6)


def test_a_reward_that_fails_on_every_sample_ends_the_run(setup):
    """Every sample given reward.failure_reward: every advantage is 0, and the run went on, learning nothing, to a
    job that succeeded. A step's worth of failed samples in a row is a RewardError naming the function and the
    failure; one that fails on some (the dynamic-sampling test above) goes on, and so does a small round (a top-up
    of two prompts) whose answers the function cannot read, until the failures in a row make a step's worth."""
    from rlloop.errors import RewardError

    fn = "tests.rlloop.reward_fns:always_raises"
    broken = rf"reward.fn {fn} failed on each of the last 48 samples \(the last raised KeyError: 'answer'\)"
    with pytest.raises(RewardError, match=broken):
        run_collect(setup, ["rollout.prompts_per_step=6", f"reward.fn={fn}"])

    cluster, tok = setup
    cfg = load_config(
        TINY, ["rollout.backend=hf", "cluster.use_ray=false", "rollout.prompts_per_step=6", f"reward.fn={fn}"]
    )
    data, _ = load_datasets(cfg, tok)
    two = data.next_batch(2)
    with closing(RolloutManager(cfg, cluster, tok, data)) as rollout:
        for _ in range(2):  # 16, then 32 failed samples in a row: fewer than a step's 48
            rollout.generate(two, 8, rollout.sampling(0))
        with pytest.raises(RewardError, match="failed on each of the last 48 samples"):
            rollout.generate(two, 8, rollout.sampling(0))


def test_dynamic_sampling_keeps_only_informative_groups(setup):
    # pairs: with the warm start's ~0.15 accuracy about 3 groups in 4 agree on their reward and carry no signal
    cfg, (samples, metrics) = run_collect(setup, DYNAMIC_PAIRS)
    groups = samples.raw_rewards.reshape(-1, cfg.rollout.group_size)
    assert len(groups) == metrics["rollout/groups_kept"] <= 12
    assert all(g.std() > 0 for g in groups)
    assert 0 < metrics["rollout/zero_std_ratio"] < 1  # some groups were dropped, and some kept


def test_a_short_batch_too_small_for_the_trainer_ranks_trains_nothing(setup, caplog):
    """Dynamic sampling may keep fewer samples than there are trainer ranks (2-sample groups, 4 ranks): each rank
    needs one, so the step trains on nothing rather than fail the run; one more group is enough."""
    cluster, tok = setup
    overrides = ["rollout.backend=hf", "cluster.use_ray=true", "cluster.train_chips=4", "rollout.group_size=2"]
    cfg = load_config(TINY, [*overrides, "rollout.prompts_per_step=4", "grpo.dynamic_sampling=true"])
    data, _ = load_datasets(cfg, tok)
    with closing(RolloutManager(cfg, cluster, tok, data)) as rollout:
        groups, stats = rollout.groups(data.next_batch(2), seed=3)
        tally = RolloutTally()
        tally.add(groups, stats)
        short = rollout.batch(1, groups[:1], tally)
        assert short.samples is None and short.metrics["rollout/groups_kept"] == 1
        assert "step 1 kept 1 groups, too few for 4 trainer ranks: it trains on nothing" in caplog.text
        assert len(rollout.batch(1, groups, tally).samples.completions) == 4


def test_evaluation_takes_the_first_max_prompts_that_fit(setup, tmp_path):
    """Eval rows longer than data.max_prompt_len are skipped, not counted against eval.max_prompts: with the first
    two rows too long, the evaluation scores rows 2 and 3, as an eval file of those two rows alone does (it had no
    prompt, and failed, before)."""
    cluster, tok = setup
    rows = [json.loads(line) for line in (ROOT / "rlloop/assets/tiny/data/eval.jsonl").read_text().splitlines()[:4]]
    for row in rows[:2]:
        row["prompt"][0]["content"] *= 4  # > 128 characters: longer than the tiny recipe's max_prompt_len

    def evaluate(rows: list[dict], name: str) -> tuple[float, int]:
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        overrides = ["rollout.backend=hf", "cluster.use_ray=false", f"eval.path={path}", "eval.max_prompts=2"]
        cfg = load_config(TINY, overrides)
        data, eval_data = load_datasets(cfg, tok)
        with closing(RolloutManager(cfg, cluster, tok, data, eval_data)) as rollout:
            return rollout.evaluate()[f"eval/{cfg.eval.name}"], eval_data.dropped

    (score, dropped), (alone, _), (one, _) = (evaluate(r, f"eval_{len(r)}.jsonl") for r in (rows, rows[2:], rows[3:]))
    assert dropped == 2 and score == alone
    assert alone != one  # the score tells one prompt from two


@pytest.mark.parametrize("deterministic", ["eval.temperature=0", "eval.top_p=0.01"])
def test_evaluation_samples_with_its_own_temperature_and_top_p(setup, deterministic):
    """eval.temperature and eval.top_p, not the rollout's: greedy (or a top_p that keeps only the likeliest token)
    scores the same whatever the seed, where the rollout's T=1, top_p=1 does not."""
    cluster, tok = setup

    def score(seed: int, *overrides: str) -> float:
        evals = ["eval.max_prompts=16", "eval.samples=4", f"run.seed={seed}"]
        cfg = load_config(TINY, ["rollout.backend=hf", "cluster.use_ray=false", *evals, *overrides])
        data, eval_data = load_datasets(cfg, tok)
        with closing(RolloutManager(cfg, cluster, tok, data, eval_data)) as rollout:
            return rollout.evaluate()[f"eval/{cfg.eval.name}"]

    assert len({score(seed) for seed in (1, 2, 3)}) > 1  # sampled: the seed shows
    assert len({score(seed, deterministic) for seed in (1, 2, 3)}) == 1


def test_evaluation_takes_each_distinct_prompt_once():
    """A file that repeats its rows (as some AIME copies do, 32 times) costs what one without the repeats costs: the
    same prompt with another answer is another question."""
    rows = [([1, 2], "3"), ([1, 2], "3"), ([4], "5"), ([1, 2], "4"), ([4], "5"), ([1, 2, 3], "3")]
    prompts = [Prompt(i, ids, answer, []) for i, (ids, answer) in enumerate(rows)]
    assert [p.index for p in distinct(prompts)] == [0, 2, 3, 5]


@pytest.mark.parametrize("penalty", [1.0, 0.5])
def test_overlong_shaping_penalises_truncated_responses(setup, penalty):
    cfg, (samples, metrics) = run_collect(
        setup,
        [
            "rollout.prompts_per_step=2",
            "rollout.max_response_len=4",
            "grpo.overlong_buffer=2",
            f"grpo.overlong_penalty={penalty}",
        ],
    )
    assert metrics["rollout/truncated_ratio"] == 1.0  # "Answer: N" needs more than 4 tokens
    np.testing.assert_allclose(samples.rewards, samples.raw_rewards - penalty)


def test_sampling_seeds_never_repeat_across_steps_rounds_and_chunks():
    seeds = [sampling_seed(7, step, r) for step in range(1, 60) for r in range(150)]  # past a flat step * 101 + r
    seeds += [sampling_seed(7, -chunk) for chunk in range(1, 5000)]  # fully_async chunks
    assert len(set(seeds)) == len(seeds)


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


def test_staleness_counts_weight_updates_not_steps(setup):
    """The engines hold version 0. At step 2 the trainer holds step 1's update, unless step 1 published nothing (it
    kept no group, or its update was non-finite): then the samples of version 0 are as fresh as can be. Counted in
    steps they were one stale, and fully_async logged staleness above the bound its own check had held."""
    cluster, tok = setup
    cfg = load_config(TINY, ["rollout.backend=hf", "cluster.use_ray=false", "rollout.prompts_per_step=2"])
    staleness = []
    for published in (True, False):
        data, _ = load_datasets(cfg, tok)
        with closing(RolloutManager(cfg, cluster, tok, data)) as rollout:
            rollout.record_publication(1, published)
            metrics = rollout.collect(2).metrics
        assert metrics["rollout/weight_version"] == 0
        staleness.append(metrics["rollout/staleness/max"])
    assert staleness == [1, 0]


@contextmanager
def schedule_of(setup, overrides: list[str]):
    """The `loop.mode` schedule `overrides` set, over the module's cluster with its own manager and data, closed
    after; yields (manager, schedule)."""
    cluster, tok = setup
    cfg = load_config(TINY, ["rollout.backend=hf", "cluster.use_ray=false", *overrides])
    data, _ = load_datasets(cfg, tok)
    with closing(RolloutManager(cfg, cluster, tok, data)) as rollout, closing(rollout_schedule(rollout)) as schedule:
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


def test_dynamic_sampling_over_samples_by_the_kept_fraction():
    assert top_up(want=12, kept=0, drawn=0) == 12  # the first round draws the batch
    assert top_up(want=12, kept=6, drawn=12) == 12  # half kept: 6 missing / 0.5
    assert top_up(want=12, kept=9, drawn=12) == 4  # 3 missing / 0.75
    assert top_up(want=12, kept=1, drawn=12) == 12  # never more than a batch per round
    assert top_up(want=12, kept=0, drawn=12) == 12


def _drawn_from(cfg, tok, cursor, n):
    data, _ = load_datasets(cfg, tok)
    data.load_state_dict(cursor)
    return [p.index for p in data.next_batch(n)]


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


def test_a_batch_of_mixed_versions_reports_its_oldest():
    """rollout/weight_version is the oldest version a step's samples started on (fully_async mixes them in a batch),
    and staleness is counted per sample."""
    done = [Completion(0, j, [5, 6], [-1.0, -1.0], "stop", v, v + 1) for j, v in enumerate([3, 1, 2])]
    m = rollout_metrics(done, lambda v: 4 - v)
    assert m["rollout/weight_version"] == 1
    assert m["rollout/staleness/max"] == 3 and m["rollout/staleness/mean"] == 2
    assert m["rollout/versions_spanned_ratio"] == 1.0


def test_rollout_stop_token_ids_end_responses_as_eos_does(setup):
    """rollout.stop_token_ids: a response ends at the first of them, which it keeps as its last token, and is the same
    sample up to there as without them (same seeds)."""
    _, tok = setup
    space = tok.convert_tokens_to_ids(" ")
    common = ["rollout.prompts_per_step=4", "run.seed=3"]
    _, (plain, _) = run_collect(setup, common)
    _, (stopped, _) = run_collect(setup, [*common, f"rollout.stop_token_ids=[{space}]"])
    cut = 0
    for a, b in zip(plain.completions, stopped.completions):
        if space in a.token_ids:
            end = a.token_ids.index(space) + 1
            assert (b.token_ids, b.finish_reason) == (a.token_ids[:end], "stop")
            cut += end < len(a.token_ids)
        else:
            assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason)
    assert cut > 0  # the tiny model answers "Answer: 7" or "The sum is 7": most contain a space
    # ignore_eos runs past EOS, not past the ids asked for by name
    _, (past_eos, _) = run_collect(setup, [*common, f"rollout.stop_token_ids=[{space}]", "rollout.ignore_eos=true"])
    for c in past_eos.completions:
        assert (c.finish_reason, c.token_ids.index(space) if space in c.token_ids else None) in (
            ("stop", len(c.token_ids) - 1),
            ("length", None),
        )
    assert any(c.finish_reason == "stop" for c in past_eos.completions)


def test_evaluation_samples_with_its_own_settings_and_stops_at_eos(setup):
    """eval took rollout.top_k and rollout.ignore_eos: a benchmark's ignore_eos ran every eval response past its end
    of turn, and the reward read what came after."""
    cluster, tok = setup
    rollout_side = ["rollout.top_k=20", "rollout.ignore_eos=true", "rollout.top_p=0.9", "rollout.stop_token_ids=[7]"]
    for eval_side, top_k, top_p in [(["eval.top_p=null"], 20, 0.9), (["eval.top_k=5", "eval.top_p=0.5"], 5, 0.5)]:
        overrides = ["rollout.backend=hf", "cluster.use_ray=false", "eval.temperature=0.6", *rollout_side, *eval_side]
        cfg = load_config(TINY, overrides)
        data, _ = load_datasets(cfg, tok)
        with closing(RolloutManager(cfg, cluster, tok, data)) as rollout:
            train, evaluation = rollout.sampling(3), rollout.sampling(3, evaluating=True)
        assert (train.temperature, train.top_k, train.top_p, train.ignore_eos) == (1.0, 20, 0.9, True)
        assert train.stop_token_ids == (7,)  # under ignore_eos only the ids asked for by name stop it
        assert (evaluation.temperature, evaluation.top_k, evaluation.top_p) == (0.6, top_k, top_p)
        assert not evaluation.ignore_eos and set(evaluation.stop_token_ids) == {*rollout.stop_ids, 7}
