"""GRPO policy loss against hand-computed numbers and against TRL's definitions re-derived in plain Python loops.

`reference_loss` below re-derives GRPOTrainer's per-token loss and aggregations (docs/design.md §4) token by token
with the math module, independently of trainer/loss.py's tensor code, over cases (KL estimators, TIS, entropy) that
tests/trainer/test_trl_parity.py, against TRL's own `_compute_loss`, does not reach.
"""

import itertools
import math

import numpy as np
import pytest
import torch

from trainer.loss import LossConfig, kl_penalty, policy_loss

LN = math.log


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


# ---------------------------------------------------------------- hand-computed cases


@pytest.mark.parametrize(
    "ratio, adv, expected, grad_flows",
    [
        (1.5, +1.0, -1.28, False),  # above 1 + ε_high with A > 0: clipped to 1.28, no gradient
        (1.5, -1.0, +1.5, True),  # above with A < 0: the unclipped term is the min, gradient flows
        (0.5, -1.0, +0.8, False),  # below 1 − ε_low with A < 0: clipped to 0.8
        (0.5, +1.0, -0.5, True),  # below with A > 0: unclipped
        (1.1, +2.0, -2.2, True),  # inside the trust region
    ],
)
def test_clipping_both_sides(ratio, adv, expected, grad_flows):
    cfg = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, loss_agg="bnpo", tis_cap=None)
    logp = t([[LN(ratio)]]).requires_grad_()
    loss, m = policy_loss(logp, t([[0.0]]), t([adv]), t([[1.0]]), cfg)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    loss.backward()
    # d/dlogp of −s·A is −A·s when the unclipped term is active, else 0.
    assert logp.grad.item() == pytest.approx(-adv * ratio if grad_flows else 0.0, abs=1e-12)
    assert m["pg_clipfrac"].item() == (0.0 if grad_flows else 1.0)
    assert m["ppo_kl"].item() == pytest.approx(-LN(ratio), abs=1e-12)


@pytest.mark.parametrize(
    "ratio, adv, expected, grad_flows",
    [
        (5.0, -1.0, +3.0, False),  # A < 0 and s far above 1: the loss stops at −c·A, no gradient
        (2.0, -1.0, +2.0, True),  # A < 0, s below c: the plain surrogate, gradient flows
        (5.0, +1.0, -1.28, False),  # A > 0: only the ordinary clip
    ],
)
def test_dual_clip_bounds_negative_advantages(ratio, adv, expected, grad_flows):
    cfg = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, clip_ratio_c=3.0, loss_agg="bnpo", tis_cap=None)
    logp = t([[LN(ratio)]]).requires_grad_()
    loss, m = policy_loss(logp, t([[0.0]]), t([adv]), t([[1.0]]), cfg)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    loss.backward()
    assert logp.grad.item() == pytest.approx(-adv * ratio if grad_flows else 0.0, abs=1e-12)
    assert m["pg_clipfrac_lower"].item() == (1.0 if (adv < 0 and not grad_flows) else 0.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        LossConfig(clip_ratio_c=1.0)


def test_aggregations_on_hand_numbers():
    # Ratio 1 everywhere, so ℓ = −A per token. Sequence 0 has 2 tokens with A=1, sequence 1 has 1 token with A=−3.
    logp = t([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    adv, mask = t([1.0, -3.0]), t([[1, 1, 0], [1, 0, 0]])
    expected = {
        "grpo": ((-1 - 1) / 2 + 3 / 1) / 2,  # 1.0: mean of per-sequence means
        "bnpo": (-1 - 1 + 3) / 3,  # 1/3: over the 3 real tokens
        "dr_grpo": (-1 - 1 + 3) / (2 * 4),  # 0.125 with max_completion_len 4
        "dapo": (-1 - 1 + 3) / 10,  # 0.1 with 10 tokens in the whole generation batch
    }
    for agg, value in expected.items():
        cfg = LossConfig(loss_agg=agg, tis_cap=None)
        loss, m = policy_loss(
            logp, logp, adv, mask, cfg, total_tokens=10 if agg == "dapo" else None, max_completion_len=4
        )
        assert loss.item() == pytest.approx(value, abs=1e-12), agg
        assert m["pg_loss"].item() == pytest.approx(value, abs=1e-12), agg


def test_kl_estimators_on_hand_numbers():
    logp, ref = t([LN(0.5)]), t([LN(0.25)])  # log π/πref = ln 2
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(0.6931471805599453)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * 0.6931471805599453**2)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 + 0.6931471805599453 - 1)
    # All three vanish at πθ = πref, and k3 stays >= 0 on the other side too.
    for est in ("k1", "k2", "k3"):
        assert kl_penalty(ref, ref, est).item() == 0.0
    assert kl_penalty(ref, logp, "k3").item() == pytest.approx(2.0 - 0.6931471805599453 - 1)


def test_kl_term_added_with_coefficient():
    cfg = LossConfig(loss_agg="bnpo", kl_coef=0.1, kl_estimator="k2", tis_cap=None)
    logp, ref = t([[LN(0.5), LN(0.5)]]), t([[LN(0.25), LN(0.5)]])
    loss, m = policy_loss(logp, logp, t([0.0]), t([[1, 1]]), cfg, ref_logp=ref)
    assert m["kl_loss"].item() == pytest.approx(0.5 * LN(2) ** 2 / 2)  # unscaled, token mean
    assert loss.item() == pytest.approx(0.1 * 0.5 * LN(2) ** 2 / 2)


def test_tis_weight_is_capped_and_logged():
    cfg = LossConfig(loss_agg="bnpo", tis_cap=2.0)
    old = t([[0.0, 0.0]])
    rollout = t([[-LN(3.0), -LN(1.5)]])  # πold/πrollout = 3 (capped to 2) and 1.5
    logp = old.clone().requires_grad_()
    loss, m = policy_loss(logp, old, t([1.0]), t([[1, 1]]), cfg, rollout_logp=rollout)
    assert loss.item() == pytest.approx((-2.0 - 1.5) / 2)
    assert m["logprob_abs_diff"].item() == pytest.approx((LN(3.0) + LN(1.5)) / 2)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-2.0 / 2, -1.5 / 2])  # the weight carries no gradient itself
    no_tis, _ = policy_loss(
        old, old, t([1.0]), t([[1, 1]]), LossConfig(loss_agg="bnpo", tis_cap=None), rollout_logp=rollout
    )
    assert no_tis.item() == pytest.approx(-1.0)


def test_gspo_uses_one_sequence_ratio():
    cfg = LossConfig(loss_agg="bnpo", importance_level="sequence", tis_cap=None)
    logp = t([[0.1, 0.3, 5.0]]).requires_grad_()  # third token is padding and must not count
    loss, _ = policy_loss(logp, t([[0.0, 0.0, 0.0]]), t([1.0]), t([[1, 1, 0]]), cfg)
    s = math.exp(0.2)  # exp of the mean log-ratio over the 2 real tokens
    assert loss.item() == pytest.approx(-s)
    loss.backward()
    # ∂/∂logp_t of −exp(mean) = −s/2 for each real token (shared ratio), 0 for padding.
    assert logp.grad[0].tolist() == pytest.approx([-s / 2, -s / 2, 0.0])


def test_entropy_bonus_and_metric():
    ent = t([[1.0, 3.0, 100.0]]).requires_grad_()
    mask = t([[1, 1, 0]])
    zero = t([[0.0, 0.0, 0.0]])
    loss, m = policy_loss(zero, zero, t([0.0]), mask, LossConfig(loss_agg="bnpo", entropy_coef=0.01), entropy=ent)
    assert m["entropy"].item() == pytest.approx(2.0)
    assert loss.item() == pytest.approx(-0.01 * 2.0)
    loss.backward()
    assert ent.grad[0].tolist() == pytest.approx([-0.005, -0.005, 0.0])


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="loss_agg"):
        LossConfig(loss_agg="mean")
    with pytest.raises(ValueError, match="kl_estimator"):
        LossConfig(kl_estimator="k4")
    with pytest.raises(ValueError, match="importance_level"):
        LossConfig(importance_level="batch")


# ---------------------------------------------------------------- random cases vs a per-token Python reference


def reference_loss(logp, old, adv, lengths, cfg, ref=None, rollout=None, ent=None, total_tokens=None, max_len=None):
    """TRL's GRPO loss, one token at a time with floats. Returns (loss, d loss / d logp as nested lists)."""
    B = len(lengths)
    per_tok, grad_tok = [], []
    for b in range(B):
        n = lengths[b]
        log_ratios = [logp[b][k] - old[b][k] for k in range(n)]
        row_loss, row_grad = [], []
        for k in range(n):
            if cfg.importance_level == "sequence":
                s = math.exp(sum(log_ratios) / n)
            else:
                s = math.exp(log_ratios[k])
            A = adv[b]
            clipped = min(max(s, 1 - cfg.clip_eps_low), 1 + cfg.clip_eps_high)
            unclipped_active = s * A <= clipped * A
            pg = -min(s * A, clipped * A)
            if cfg.clip_ratio_c is not None and A < 0 and pg > -A * cfg.clip_ratio_c:  # dual-clip (verl's form)
                pg, unclipped_active = -A * cfg.clip_ratio_c, False
            w = 1.0 if rollout is None or cfg.tis_cap is None else min(math.exp(old[b][k] - rollout[b][k]), cfg.tis_cap)
            loss = pg * w
            if cfg.importance_level == "sequence":
                # Every token's ℓ depends on every logp of its sequence through the mean; collected below.
                dpg_ds = -A if unclipped_active else 0.0
                row_grad.append(("seq", dpg_ds * w * s / n))
            else:
                row_grad.append(("tok", (-A * s if unclipped_active else 0.0) * w))
            if ref is not None and cfg.kl_coef:
                d = logp[b][k] - ref[b][k]
                k_val, k_grad = {
                    "k1": (d, 1.0),
                    "k2": (0.5 * d * d, d),
                    "k3": (math.exp(-d) + d - 1, 1 - math.exp(-d)),
                }[cfg.kl_estimator]
                loss += cfg.kl_coef * k_val
                row_grad[-1] = row_grad[-1] + (cfg.kl_coef * k_grad,)
            if ent is not None:
                loss -= cfg.entropy_coef * ent[b][k]
            row_loss.append(loss)
        per_tok.append(row_loss)
        grad_tok.append(row_grad)
    n_tok = sum(lengths)
    T = max(lengths)
    weights = []  # d loss / d ℓ_bk
    for b in range(B):
        if cfg.loss_agg == "grpo":
            weights.append(1.0 / (lengths[b] * B))
        elif cfg.loss_agg == "bnpo":
            weights.append(1.0 / n_tok)
        elif cfg.loss_agg == "dr_grpo":
            weights.append(1.0 / (B * (max_len or T)))
        else:
            weights.append(1.0 / (total_tokens or n_tok))
    loss = sum(weights[b] * sum(per_tok[b]) for b in range(B))
    grad = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for k, g in enumerate(grad_tok[b]):
            kind, value, *kl = g
            if kind == "seq":
                for j in range(lengths[b]):
                    grad[b][j] += weights[b] * value
            else:
                grad[b][k] += weights[b] * value
            if kl:
                grad[b][k] += weights[b] * kl[0]
    return loss, grad


CASES = list(
    itertools.product(
        ["grpo", "bnpo", "dr_grpo", "dapo"], ["k1", "k2", "k3"], ["token", "sequence"], [None, 2.0], [None, 1.4]
    )
)


@pytest.mark.parametrize("agg, est, level, cap, dual", CASES)
def test_random_batches_match_reference_and_analytic_gradient(agg, est, level, cap, dual):
    rng = np.random.default_rng(CASES.index((agg, est, level, cap, dual)) // 2)  # the same batch with and without
    B, T = 4, 6
    lengths = [6, 3, 1, 5]
    mask = np.array([[1.0] * n + [0.0] * (T - n) for n in lengths])
    old = rng.normal(-2.0, 0.5, (B, T))
    logp = old + rng.normal(0.0, 0.3, (B, T))  # ratios spread over both clip boundaries
    logp[3, 0] = old[3, 0] + 0.7  # s ≈ 2 with A < 0: past the dual clip's bound
    ref = old + rng.normal(0.0, 0.2, (B, T))
    rollout = old + rng.normal(0.0, 0.8, (B, T))  # some TIS weights above the cap
    ent = rng.uniform(0.5, 3.0, (B, T))
    adv = [1.3, -0.7, 0.4, -2.0]
    cfg = LossConfig(
        loss_agg=agg,
        kl_coef=0.05,
        kl_estimator=est,
        importance_level=level,
        tis_cap=cap,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        clip_ratio_c=dual,
        entropy_coef=0.01,
    )
    want_loss, want_grad = reference_loss(
        logp.tolist(),
        old.tolist(),
        adv,
        lengths,
        cfg,
        ref=ref.tolist(),
        rollout=rollout.tolist(),
        ent=ent.tolist(),
        total_tokens=40,
        max_len=8,
    )
    x = torch.tensor(logp, requires_grad=True)
    loss, m = policy_loss(
        x,
        t(old),
        t(adv),
        t(mask),
        cfg,
        ref_logp=t(ref),
        rollout_logp=t(rollout),
        entropy=t(ent),
        total_tokens=40 if agg == "dapo" else None,
        max_completion_len=8 if agg == "dr_grpo" else None,
    )
    loss.backward()
    assert loss.item() == pytest.approx(want_loss, rel=1e-10, abs=1e-12)
    np.testing.assert_allclose(x.grad.numpy() * mask, np.array(want_grad), rtol=1e-9, atol=1e-12)
    assert float(x.grad[mask == 0].abs().max()) == 0.0
    # Metrics are token means over the mask.
    n = mask.sum()
    assert m["ppo_kl"].item() == pytest.approx(((old - logp) * mask).sum() / n)
    assert m["logprob_abs_diff"].item() == pytest.approx((np.abs(old - rollout) * mask).sum() / n)
    assert m["entropy"].item() == pytest.approx((ent * mask).sum() / n)
    if dual is not None and level == "token":  # the dual clip acts on this batch's tokens of A < 0 with s > 1.4
        capped = (np.exp(logp - old) > dual) & (np.array(adv)[:, None] < 0) & (mask == 1)
        assert capped.any() and m["pg_clipfrac_lower"].item() == pytest.approx(capped.sum() / n)


def test_micro_batch_losses_sum_to_the_batch_loss():
    """Given the batch-level constants, per-micro-batch losses add up exactly to the whole batch's loss."""
    rng = np.random.default_rng(0)
    B, T = 6, 5
    lengths = [5, 2, 4, 1, 3, 5]
    mask = t([[1.0] * n + [0.0] * (T - n) for n in lengths])
    old = t(rng.normal(-2, 0.5, (B, T)))
    logp = old + t(rng.normal(0, 0.3, (B, T)))
    adv = t(rng.normal(0, 1, B))
    for agg in ("grpo", "bnpo", "dr_grpo", "dapo"):
        cfg = LossConfig(loss_agg=agg, tis_cap=None)
        whole, _ = policy_loss(logp, old, adv, mask, cfg)
        norms = dict(total_sequences=B, total_tokens=float(mask.sum()), max_completion_len=T)
        parts = sum(
            policy_loss(logp[s], old[s], adv[s], mask[s], cfg, **norms)[0]
            for s in (slice(0, 2), slice(2, 3), slice(3, 6))
        )
        assert parts.item() == pytest.approx(whole.item(), rel=1e-12), agg
