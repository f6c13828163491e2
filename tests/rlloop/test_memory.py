"""The memory plan (rlloop/memory.py): its figures equal what the engine and the trainer then allocate, the worked
example of the docs comes out as stated, and a plan that does not fit is a config error naming the fix."""

from pathlib import Path

import pytest

from rlloop.config import load_config
from rlloop.memory import plan_memory
from rlloop.placement import actor_env
from rlloop.run import main
from trainer import LossConfig, TrainBatch, Trainer, TrainerConfig
from trainer.memory import trainer_memory

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REAL, TINY = str(EXAMPLES / "grpo_dapo.yaml"), str(EXAMPLES / "grpo_dapo_tiny.yaml")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_allocates_what_the_plan_says(dtype):
    """On CPU a bf16 engine holds its KV cache in fp32 (rollout.cost.cache_dtype): the plan counts it so."""
    from rollout.engine import JaxEngine

    cfg = load_config(TINY, [f"model.dtype={dtype}"])
    engine = JaxEngine(cfg.engine_config())
    engine.warmup()
    assert engine.device_bytes() == plan_memory(cfg).engine["total"]  # JAX's live arrays: weights + KV cache


@pytest.mark.parametrize("dtype,kl_coef", [("float32", 0.0), ("bfloat16", 0.0), ("bfloat16", 0.05)])
def test_the_trainer_holds_the_state_the_plan_says(dtype, kl_coef):
    """With a KL term the trainer also holds a frozen reference copy of the model."""
    cfg = load_config(TINY, [f"model.dtype={dtype}", f"grpo.kl_coef={kl_coef}"])
    trainer = Trainer(cfg.trainer_config())
    trainer.train_step(TrainBatch([[5, 6, 7]] * 4, [[8, 9]] * 4, [1.0, -1.0, 0.5, -0.5]))
    held = trainer.state_nbytes()  # what train/state_bytes_per_rank logs: the step's fp32 gradients included
    assert held["total"] == plan_memory(cfg).trainer["state"]


def test_the_reference_recipe_fits_a_tpu_v7x_chip_and_not_an_h200(capsys):
    """Qwen3-4B, max_batch 256 x (1,024 + 8,192) positions in bf16: 36 layers x 2 (K, V) x 8 KV heads x 128 x 2
    bytes = 147,456 bytes per position, 348 GB in all, 174 GB per chip at TP 2."""
    plan = plan_memory(load_config(REAL))  # the shipped copy of Qwen3-4B's config.json: no download
    assert plan.engine["kv_cache"] == 256 * 9216 * 147_456 // 2
    assert plan.engine["kv_cache"] / 1e9 == pytest.approx(173.95, abs=0.01) and not plan.fixes
    assert main([REAL, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "KV cache 173.95 GB" in out and "of 192.0 GB" in out

    assert main([REAL, "cluster.device_memory_gb=141", "--dry-run"]) == 2
    err = capsys.readouterr().err
    # weights 4.41 GB a chip: the embedding (0.78 GB) whole on both, the rest halved
    assert "weights 4.41 GB" in err and "exceeds 141.0 GB by 37.4 GB" in err and "rollout.max_batch <= 201 fits" in err
    # and the suggested fix does fit, one more row does not
    assert not plan_memory(load_config(REAL, ["cluster.device_memory_gb=141", "rollout.max_batch=201"])).fixes
    assert plan_memory(load_config(REAL, ["cluster.device_memory_gb=141", "rollout.max_batch=202"])).fixes


def test_an_engine_on_a_gpu_of_its_own_has_jax_s_share_of_it(capsys):
    """178 GB of engine fits a 190-GB chip, but not 0.9 x 190 = 171 GB: what JAX takes of a GPU at start (its
    XLA_PYTHON_CLIENT_MEM_FRACTION, set for the engine's actor); colocated, the engine allocates as it goes."""
    gpu = ["cluster.device_memory_gb=190", "cluster.device=gpu"]
    assert not plan_memory(load_config(REAL, ["cluster.device_memory_gb=190"])).fixes
    colocated = [*gpu, "cluster.colocate=true", "cluster.rollout_engines=2", "rollout.max_batch=128"]  # 178 GB
    assert not plan_memory(load_config(REAL, colocated)).fixes.get("rollout")
    fix = plan_memory(load_config(REAL, gpu)).fixes["rollout"]
    assert "exceeds 171.0 GB (0.9 of it: JAX's share)" in fix
    rows = int(fix.split("rollout.max_batch <= ")[1].split()[0])
    assert not plan_memory(load_config(REAL, [*gpu, f"rollout.max_batch={rows}"])).fixes.get("rollout")
    assert plan_memory(load_config(REAL, [*gpu, f"rollout.max_batch={rows + 1}"])).fixes.get("rollout")
    env = actor_env(load_config(REAL, gpu), threads=1, rollout=True, cores=range(1))
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9"
    # colocated, it takes memory as it goes and gives it back (release()), for the trainer on the same GPU
    env = actor_env(load_config(REAL, colocated), threads=1, rollout=True, cores=range(1))
    assert (env["XLA_PYTHON_CLIENT_PREALLOCATE"], env["XLA_PYTHON_CLIENT_ALLOCATOR"]) == ("false", "platform")
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env


def test_a_trainer_that_does_not_fit_names_its_keys(capsys):
    """Gradient checkpointing is named only where it is off (the recipe turns it on)."""
    assert main([REAL, "cluster.device_memory_gb=40", "rollout.max_batch=16", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "trainer:" in err and "train.micro_batch_tokens" in err and "train.parallel: fsdp" in err
    assert "gradient_checkpointing" not in err
    assert (
        main([REAL, "cluster.device_memory_gb=40", "rollout.max_batch=16", "train.gradient_checkpointing=false"]) == 2
    )
    assert "set train.gradient_checkpointing: true" in capsys.readouterr().err


def test_a_trainer_whose_state_alone_does_not_fit_is_told_how_many_ranks_do():
    """It was told to lower train.micro_batch_tokens, which cannot help: the state (parameters, fp32 masters,
    gradients, AdamW) is what does not fit. The rank count named is the fewest whose plan fits and that splits the
    batch (3 would fit, and does not split 256 samples)."""
    over = ["cluster.device_memory_gb=32", "rollout.max_batch=8", "train.micro_batch_tokens=1024"]
    fix = plan_memory(load_config(REAL, over)).fixes["trainer"]
    assert "its state alone (32.2 GB) does not fit: shard over 4 ranks" in fix and "micro_batch_tokens" not in fix
    four = plan_memory(load_config(REAL, [*over, "cluster.train_chips=4"]))
    assert "trainer" not in four.fixes and four.trainer["total"] <= 32e9


def test_a_debug_mode_plans_only_the_role_it_starts():
    """--debug train-only starts no engine and rollout-only no trainer: the absent role's memory refused the run."""
    small = ["cluster.device_memory_gb=40", "rollout.max_batch=16"]  # the trainer does not fit, the engine does
    assert set(plan_memory(load_config(REAL, small)).fixes) == {"trainer"}
    assert not plan_memory(load_config(REAL, [*small, "run.debug=rollout-only"])).fixes
    big = ["cluster.device_memory_gb=80"]  # the engine does not fit, the trainer does
    assert set(plan_memory(load_config(REAL, big)).fixes) == {"rollout"}
    assert not plan_memory(load_config(REAL, [*big, "run.debug=train-only", "run.replay=/tmp"])).fixes


def test_weights_that_alone_do_not_fit_a_chip_ask_for_more_chips_not_fewer_rows(capsys):
    assert main([REAL, "cluster.device_memory_gb=4", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "the weights alone (4.4 GB) do not fit: more chips per engine" in err and "max_batch <=" not in err


def test_a_sample_longer_than_the_micro_batch_budget_is_planned_whole():
    """Packing gives a 9,216-token sample a micro-batch of its own however low train.micro_batch_tokens is: the
    plan's activations stop shrinking there, so its advice to lower the budget never plans less than runs."""
    activations = [
        plan_memory(load_config(REAL, [f"train.micro_batch_tokens={t}"])).trainer["activations"]
        for t in (1024, 9216, 18432)
    ]
    assert activations[0] == activations[1] < activations[2]


def test_a_cpu_host_counts_every_device_of_an_engine(capsys):
    """Recipe shapes on one CPU host: the engine needs the same memory split over 2 chips as over 2 cores each a
    device of its own, and as on 1 device but for the tensors each device holds whole (the embedding: Qwen3-4B's,
    151,936 x 2,560 in bf16, 0.78 GB); the host's check counts all of its devices."""
    host = ["cluster.device=cpu", "cluster.device_memory_gb=4", "cluster.train_chips=1", "rollout.max_batch=16"]
    layouts = [
        ["cluster.rollout_chips=1"],
        ["cluster.rollout_chips=2"],
        ["cluster.rollout_chips=1", "cluster.cpus_per_actor=2"],
    ]
    needs = []
    for layout in layouts:
        cfg = load_config(REAL, [*host, *layout])
        plan = plan_memory(cfg)
        needs.append(plan.fixes["host"].split(" GB of")[0])
    assert [load_config(REAL, [*host, *layout]).engine_config().tp for layout in layouts] == [1, 2, 2]
    needs = [float(n.rsplit(" ", 1)[1]) for n in needs]
    assert needs[1] == needs[2] and needs[1] - needs[0] == pytest.approx(151_936 * 2_560 * 2 / 1e9, abs=0.05), needs


def test_a_cpu_host_counts_every_engine_and_every_trainer_rank():
    """One CPU host holds all the actors: two engines and two trainer ranks need twice an engine's and twice a
    rank's memory. A host of just that much fits; a host a little smaller is refused, naming the total."""
    layout = ["cluster.device=cpu", "cluster.rollout_chips=2", "cluster.rollout_engines=2", "cluster.train_chips=2"]
    small = [*layout, "rollout.max_batch=16"]
    plan = plan_memory(load_config(REAL, [*small, "cluster.device_memory_gb=1"]))
    assert load_config(REAL, small).engine_config().tp == 1
    need = 2 * plan.engine["total"] + 2 * plan.trainer["total"]
    assert f"all actors together need {need / 1e9:.1f} GB" in plan.fixes["host"]
    assert not plan_memory(load_config(REAL, [*small, f"cluster.device_memory_gb={need / 1e9 * 1.01}"])).fixes
    assert plan_memory(load_config(REAL, [*small, f"cluster.device_memory_gb={need / 1e9 * 0.99}"])).fixes["host"]


def test_a_trainer_rank_on_a_gpu_has_all_of_it_not_jax_s_share():
    """JAX's 0.9 share of a GPU (XLA_PYTHON_CLIENT_MEM_FRACTION) is set for the engine's actor only: a trainer rank
    on a GPU of its own may use all of it, so a rank that needs 95% of the GPU fits."""
    gpu = ["cluster.device=gpu", "rollout.max_batch=8", "cluster.device_memory_gb=null"]
    unchecked = plan_memory(load_config(REAL, gpu))
    assert unchecked.device_bytes is None and not unchecked.fixes
    memory_gb = unchecked.trainer["total"] / 0.95 / 1e9
    assert unchecked.engine["total"] < 0.9 * memory_gb * 1e9  # the engine fits JAX's share
    plan = plan_memory(load_config(REAL, [*gpu, f"cluster.device_memory_gb={memory_gb}"]))
    assert not plan.fixes, plan.fixes
    # the same rank on a GPU 10% smaller than it needs is refused
    smaller = plan_memory(load_config(REAL, [*gpu, f"cluster.device_memory_gb={memory_gb * 0.95 * 0.9}"]))
    assert "trainer" in smaller.fixes


def test_the_rank_count_a_trainer_is_told_to_shard_over_is_a_config_that_loads_and_fits():
    """The named rank count must split the batch into train.minibatches equal shares per rank too: 192 samples in
    64 minibatches split over 3 ranks (3 x 64 = 192), not 2 (2 x 64 = 128 does not divide 192), though 2 would fit."""
    over = ["cluster.device_memory_gb=48", "rollout.max_batch=8", "train.micro_batch_tokens=1024"]
    over += ["cluster.train_chips=1", "rollout.prompts_per_step=24", "train.minibatches=64"]
    fix = plan_memory(load_config(REAL, over)).fixes["trainer"]
    ranks = int(fix.split("shard over ")[1].split()[0])
    sharded = plan_memory(load_config(REAL, [*over, f"cluster.train_chips={ranks}", "train.parallel=fsdp"]))
    assert "trainer" not in sharded.fixes and sharded.trainer["total"] <= 48e9


def test_a_chip_with_room_for_one_row_is_told_one_row_fits_not_that_the_weights_do_not():
    """The weights fit and leave room for one row of KV cache (max_seq_len positions) and a half: the fix is
    rollout.max_batch <= 1, which fits; 'the weights alone do not fit' would send the user to buy chips."""
    plan = plan_memory(load_config(REAL))
    per_row = plan.engine["kv_cache"] // load_config(REAL).rollout.max_batch  # per chip, tp applied
    memory_gb = (plan.engine["weights"] + 1.5 * per_row) / 1e9
    fix = plan_memory(load_config(REAL, [f"cluster.device_memory_gb={memory_gb}"])).fixes["rollout"]
    assert "rollout.max_batch <= 1 fits" in fix and "the weights alone" not in fix
    one = plan_memory(load_config(REAL, [f"cluster.device_memory_gb={memory_gb}", "rollout.max_batch=1"]))
    assert "rollout" not in one.fixes


def test_an_fsdp_rank_holds_fp32_shards_of_the_reference_model_whatever_the_dtype():
    """Under fsdp the shards are fp32 (the masters, and the KL term's reference copy of the model, loaded in fp32 and
    sharded alike: trainer/policy_model.py): a rank's state is the same in bf16 as in fp32, 16 bytes per parameter plus
    4 for the reference, over the ranks."""

    shape = dict(params=1_000_000, hidden=64, intermediate=128, layers=2, vocab=128, world_size=2)
    state = {
        dtype: trainer_memory(TrainerConfig("m", dtype=dtype, parallel="fsdp", loss=LossConfig(kl_coef=0.05)), **shape)[
            "state"
        ]
        for dtype in ("float32", "bfloat16")
    }
    assert state["bfloat16"] == state["float32"] == 1_000_000 * (16 + 4) // 2


def test_checkpointed_activations_are_each_layers_input_and_one_layers_recompute():
    """With gradient checkpointing a micro-batch keeps each layer's input (tokens x hidden values) and, during the
    backward, one layer's recomputed intermediates: what one layer of the un-checkpointed model keeps."""

    layers, tokens, hidden = 4, 1000, 64
    shape = dict(params=1_000_000, hidden=hidden, intermediate=128, layers=layers, vocab=128)
    for dtype, item in (("float32", 4), ("bfloat16", 2)):
        cfg = dict(micro_batch_tokens=tokens, dtype=dtype, device="cuda")  # no CPU attention copies
        plain = trainer_memory(TrainerConfig("m", **cfg), **shape)["activations"]
        ckpt = trainer_memory(TrainerConfig("m", gradient_checkpointing=True, **cfg), **shape)["activations"]
        assert plain % layers == 0
        assert ckpt == layers * tokens * hidden * item + plain // layers, dtype


@pytest.mark.parametrize("checkpointed", [True, False])
def test_only_a_cpu_rank_below_fp32_counts_attentions_fp32_copies_once(checkpointed):
    """On a GPU a bf16 micro-batch keeps the same activations as an fp32 one at half the bytes; on CPU below fp32 the
    attention backward adds its fp32 copies (trainer/cpu_flash.py: 4 fp32 tensors of q's and of k's widths), made and
    freed by one layer at a time, so once, with gradient checkpointing or without (they were counted once per layer
    without it)."""

    tokens, q_size, kv_size = 1000, 128, 64
    shape = dict(params=1_000_000, hidden=64, intermediate=128, layers=2, vocab=128, q_size=q_size, kv_size=kv_size)
    act = {
        (device, dtype): trainer_memory(
            TrainerConfig(
                "m", device=device, dtype=dtype, micro_batch_tokens=tokens, gradient_checkpointing=checkpointed
            ),
            **shape,
        )["activations"]
        for device in ("cpu", "cuda")
        for dtype in ("float32", "bfloat16")
    }
    assert act["cuda", "bfloat16"] * 2 == act["cuda", "float32"] == act["cpu", "float32"]
    assert act["cpu", "bfloat16"] - act["cuda", "bfloat16"] == tokens * 4 * (q_size + kv_size) * 4
