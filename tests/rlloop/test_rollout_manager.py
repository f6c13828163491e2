"""RolloutManager.collect on the real tiny model: grouping, DAPO dynamic sampling, overlong shaping, the train batch,
the evaluation (the loop modes' batch sources: test_schedules.py)."""

import json
from contextlib import closing

import numpy as np
import pytest

from rlloop.config import load_config
from rlloop.data import Prompt, load_datasets
from rlloop.rollout_manager import (
    Group,
    RolloutManager,
    RolloutTally,
    distinct,
    rollout_metrics,
    sampling_seed,
    top_up,
)
from rollout import Completion
from tests.rlloop.conftest import ROOT, TINY


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


def test_dynamic_sampling_over_samples_by_the_kept_fraction():
    assert top_up(want=12, kept=0, drawn=0) == 12  # the first round draws the batch
    assert top_up(want=12, kept=6, drawn=12) == 12  # half kept: 6 missing / 0.5
    assert top_up(want=12, kept=9, drawn=12) == 4  # 3 missing / 0.75
    assert top_up(want=12, kept=1, drawn=12) == 12  # never more than a batch per round
    assert top_up(want=12, kept=0, drawn=12) == 12


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


def test_advantages_are_computed_from_the_overlong_shaped_rewards(setup):
    """DAPO's overlong shaping is a reward term: the group advantages are GRPO's over the shaped rewards (the trainer
    is told to prefer the shorter of two right answers), not over the reward function's raw ones. With the last 12 of
    16 tokens penalised, responses of different lengths in a group get different penalties."""
    cfg, (samples, _) = run_collect(setup, ["rollout.prompts_per_step=6", "grpo.overlong_buffer=12"])
    g = cfg.rollout.group_size
    penalty = (samples.rewards - samples.raw_rewards).astype(np.float64).reshape(-1, g)
    assert (penalty.std(axis=1) > 0).any()  # shaping changed the spread within some group
    groups = samples.rewards.astype(np.float64).reshape(-1, g)
    want = (groups - groups.mean(axis=1, keepdims=True)) / (groups.std(axis=1, ddof=1, keepdims=True) + 1e-4)
    want[(groups == groups[:, :1]).all(axis=1)] = 0.0
    np.testing.assert_allclose(samples.advantages, want.reshape(-1), rtol=1e-5, atol=1e-6)


def test_dynamic_sampling_draws_only_what_the_kept_fraction_says_is_missing(setup):
    """After a round, the next draws the missing groups over the share kept so far (`top_up`), not a whole batch
    again. Replayed round by round with the same seeds (a generation is its seed's), collect must have drawn those
    counts, and some round less than a batch."""
    cluster, tok = setup
    overrides = ["rollout.backend=hf", "cluster.use_ray=false", *DYNAMIC_PAIRS]
    overrides += ["reward.fn=tests.rlloop.reward_fns:fails_on_odd_length", "reward.failure_reward=-1"]
    cfg = load_config(TINY, overrides)
    want = cfg.rollout.prompts_per_step
    data, _ = load_datasets(cfg, tok)
    with closing(RolloutManager(cfg, cluster, tok, data)) as rollout:
        rollout.collect(1)
    drawn_by_collect = data.state_dict()["position"]  # no prompt is too long: each draw moves it by one

    replay, _ = load_datasets(cfg, tok)
    draws, kept = [], 0
    with closing(RolloutManager(cfg, cluster, tok, replay)) as rollout:
        for round_ in range(cfg.grpo.max_sampling_rounds):
            draws.append(top_up(want, kept, sum(draws)))
            groups, _ = rollout.groups(replay.next_batch(draws[-1]), sampling_seed(cfg.run.seed, 1, round_))
            kept += sum(not grp.zero_std for grp in groups)
            if kept >= want:
                break
    assert drawn_by_collect == sum(draws), draws
    assert min(draws) < want, draws  # the kept fraction cut some round's draw


def test_evaluation_counts_a_wrong_answer_of_reward_0_as_wrong(setup):
    """Held-out accuracy is the share of samples the reward calls right. `math` scores a wrong answer 0 (DAPO -1):
    accuracy must be the share that scored 1, which the same generation (its seed's) gives again here."""
    cluster, tok = setup
    overrides = ["rollout.backend=hf", "cluster.use_ray=false", "reward.fn=math", "eval.max_prompts=8"]
    cfg = load_config(TINY, overrides)
    data, eval_data = load_datasets(cfg, tok)
    with closing(RolloutManager(cfg, cluster, tok, data, eval_data)) as rollout:
        accuracy = rollout.evaluate()[f"eval/{cfg.eval.name}"]
        prompts = [eval_data.get(i) for i in range(cfg.eval.max_prompts)]  # the tiny eval rows all fit, each once
        again = rollout.generate(prompts, cfg.eval.samples, rollout.sampling(cfg.run.seed, evaluating=True))
    assert set(again.rewards.tolist()) <= {0.0, 1.0} and (again.rewards == 0.0).any()  # some wrong answers
    assert accuracy == pytest.approx(float((again.rewards == 1.0).mean()))


def test_a_steps_tally_sums_every_round():
    """A dynamic-sampling step's rollout time, tokens and rewards are those of all its rounds, kept or not."""

    def group(rewards, length):
        done = [Completion(0, j, [5] * length, [-1.0] * length, "stop", 0, 0) for j in range(len(rewards))]
        return Group(Prompt(0, [1, 2], "3", []), done, ["x"] * len(rewards), np.array(rewards, np.float32))

    tally = RolloutTally()
    tally.add([group([1.0, -1.0], 3)], {"wall_s": 1.5, "busy_s": 1.0})
    tally.add([group([1.0, 1.0], 5)], {"wall_s": 2.5, "busy_s": 2.0})
    m = tally.metrics()
    assert m["perf/rollout_s"] == 1.5 + 2.5 and m["perf/rollout_busy_s"] == 1.0 + 2.0
    assert m["rollout/tokens"] == 2 * 3 + 2 * 5
    assert m["perf/rollout_tok_per_s"] == pytest.approx(16 / 4.0)
    assert m["rollout/raw_reward"] == pytest.approx(0.5) and m["rollout/zero_std_ratio"] == 0.5
