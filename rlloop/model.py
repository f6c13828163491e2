"""The model a run names, checked from the driver before any actor starts or any weight is read.

`check_model` reads `config.json` (as JSON: no model code runs, no weights load) and checks what the engine and
trainer would otherwise trip over minutes later inside an actor: missing weight files, an architecture the JAX
decoder does not implement, custom code (`auto_map`) without `model.trust_remote_code`, a context shorter than
`data.max_prompt_len + rollout.max_response_len`. `load_tokenizer` returns the tokenizer after checking it has a
chat template and ids inside the model's vocabulary. Every problem is a `ModelError` naming the key (exit code 2);
the usual cause is a hub id with no network.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from rlloop.config import Config, ModelSection
from rlloop.errors import ModelError
from rlloop.model_shape import engine_tp
from trainer.model_support import position_bias_from_columns, sliding_window_layers, unapplied_logit_scaling

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")  # what the engine (safetensors) and trainer read
SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def is_local(source: str) -> bool:
    """A path on this machine (or meant to be one) rather than a hub id."""
    return Path(source).exists() or source.startswith(("/", "."))


def _offline_hint(key: str, source: str) -> str:
    return f"\n(offline? download it beforehand, e.g. `hf download {source}`, or set {key} to a local directory)"


def _no_remote_code(key: str, where: str, hf: dict, model: ModelSection) -> None:
    if hf.get("auto_map") and not model.trust_remote_code:
        raise ModelError(
            f"{key}: {where} maps to code shipped with the checkpoint (auto_map: {sorted(hf['auto_map'])}), which "
            "runs only with model.trust_remote_code: true; set it if you trust this checkpoint's code"
        )


def read_model_config(model: ModelSection) -> tuple[dict, str]:
    """`config.json` of `model.path` (a local dir, or a hub id: downloaded or from the cache) as a dict, and where
    it was read; checks that it needs no remote code unless allowed."""
    source = model.path
    if is_local(source):
        if not Path(source).is_dir():
            raise ModelError(f"model.path: {source!r} is not a directory")
        file = Path(source) / "config.json"
        if not file.is_file():
            raise ModelError(
                f"model.path: cannot load {source!r}: no config.json in it (a Hugging Face model directory holds "
                "config.json, the weights and the tokenizer files)"
            )
    else:
        from huggingface_hub import hf_hub_download

        try:
            file = Path(hf_hub_download(source, "config.json"))
        except Exception as e:  # offline, unknown repo, gated, ...: the hub raises many kinds
            reason = " ".join(str(e).split())[:400] or type(e).__name__
            raise ModelError(
                f"model.path: cannot load {source!r}: {reason}{_offline_hint('model.path', source)}"
            ) from None
    try:
        hf = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"model.path: {file}: not a readable JSON model config: {e}") from None
    if not isinstance(hf, dict):
        raise ModelError(f"model.path: {file}: expected a JSON object, got {type(hf).__name__}")
    _no_remote_code("model.path", str(file), hf, model)
    return hf, str(file)


def _check_weights(path: Path) -> None:
    for index in SHARD_INDEXES:
        if (path / index).is_file():
            try:
                weight_map = json.loads((path / index).read_text())["weight_map"]
                shards = set(weight_map.values())
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ModelError(
                    f"model.path: {path / index} is not a readable shard index ({type(e).__name__}: {e}); an "
                    "interrupted download?"
                ) from None
            missing = sorted(s for s in shards if not (path / s).is_file())
            if missing:
                raise ModelError(
                    f"model.path: {path / index} lists {len(missing)} weight file(s) that are not there: "
                    f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} (an interrupted download?)"
                )
            return
    if not any(next(path.glob(p), None) for p in WEIGHT_PATTERNS):
        raise ModelError(
            f"model.path: {str(path)!r} has no weight files ({' or '.join(WEIGHT_PATTERNS)}); the trainer starts "
            "from them"
        )


def _check_engine_tp(cfg: Config, shape, where: str) -> None:
    """An engine splits heads and MLP channels over its chips (tensor parallel, rollout.sharding.check_tp): each of
    those sizes must divide by its tp (rlloop.model_shape.engine_tp), cluster.rollout_chips / rollout_engines."""
    tp = engine_tp(cfg)
    if shape.splits_over(tp):
        return
    c = cfg.cluster
    sizes = ", ".join(f"{name}={size}" for name, size in shape.tp_sizes().items() if size % tp)
    chips = c.rollout_chips
    engines = next(n for n in range(1, chips + 1) if chips % n == 0 and shape.splits_over(chips // n))  # n=chips: tp 1
    raise ModelError(
        f"cluster.rollout_chips={chips} over cluster.rollout_engines={c.rollout_engines} gives each engine {tp} "
        f"chips (its tensor-parallel size), but {where} has {sizes}, which cannot be split {tp} ways; give each "
        f"engine a number of chips that divides them (e.g. cluster.rollout_engines={engines})"
    )


def check_model(cfg: Config) -> dict:
    """Everything about `model.path` that can be known from its config.json and file list; returns config.json."""
    from rollout.model_config import FAMILIES, ModelConfig

    hf, where = read_model_config(cfg.model)
    if is_local(cfg.model.path):
        _check_weights(Path(cfg.model.path))
    if cfg.rollout.backend == "jax":  # the reference HF backend runs any transformers causal LM
        model_type, archs = hf.get("model_type"), hf.get("architectures") or []
        if model_type not in FAMILIES:
            raise ModelError(
                f"model.path: {where} is model_type {model_type!r} ({', '.join(archs) or 'no architectures'}): the "
                f"JAX decoder (rollout.backend: jax) supports model_type {', '.join(FAMILIES)} (Qwen3ForCausalLM, "
                "Qwen2ForCausalLM, LlamaForCausalLM)"
            )
        try:
            shape = ModelConfig.from_hf_dict(hf)  # the decoder's own checks: activation, RoPE type, required fields
        except KeyError as e:
            raise ModelError(f"model.path: {where} lacks {e.args[0]!r}") from None
        except (ValueError, TypeError) as e:
            raise ModelError(f"model.path: {where}: {e}") from None
        _check_engine_tp(cfg, shape, where)
    built = _as_transformers_builds_it(hf, where)
    if knob := unapplied_logit_scaling(built):
        raise ModelError(
            f"model.path: {where} sets {knob}={getattr(built, knob)}, a scaling of the logits that the trainer's "
            "log-probs do not apply (they would not be the model's); this model is not supported"
        )
    if cfg.train.share_prompts and sliding_window_layers(built):
        raise ModelError(
            f"train.share_prompts: {where} has sliding-window attention layers (layer_types "
            f"{getattr(built, 'layer_types', None)}, sliding_window {built.sliding_window}), which shared-prompt rows "
            "cannot train; set train.share_prompts=false"
        )
    if cfg.train.share_prompts and position_bias_from_columns(built):
        raise ModelError(
            f"train.share_prompts: {where} has ALiBi position biases ({built.model_type}), which follow a key's column "
            "in the row, not its position: shared-prompt rows would score later responses wrong; set "
            "train.share_prompts=false"
        )
    vocab = hf.get("vocab_size")
    if isinstance(vocab, int) and (past := [i for i in cfg.rollout.stop_token_ids if i >= vocab]):
        raise ModelError(f"rollout.stop_token_ids: {past} are not token ids of {where} (vocab_size {vocab})")
    context = hf.get("max_position_embeddings")
    need = cfg.data.max_prompt_len + cfg.rollout.max_response_len
    if isinstance(context, int) and need > context:
        raise ModelError(
            f"data.max_prompt_len + rollout.max_response_len = {cfg.data.max_prompt_len} + "
            f"{cfg.rollout.max_response_len} = {need} tokens, beyond the model's max_position_embeddings {context} "
            f"({where}); lower one of them"
        )
    return hf


def _as_transformers_builds_it(hf: dict, where: str):
    """config.json as the trainer's model will see it (transformers resolves settings such as Qwen2's
    `use_sliding_window` there); a model_type transformers does not know (remote code) as written. A field transformers
    refuses (`"head_dim": null`) is a ModelError: the trainer's model would not load."""
    import transformers

    hf = copy.deepcopy(hf)  # transformers fills in the dicts it is given (rope_scaling)
    try:
        try:
            return transformers.AutoConfig.for_model(**hf)
        except (ValueError, KeyError, TypeError):
            return transformers.PretrainedConfig(**hf)
    except Exception as e:  # huggingface_hub's StrictDataclassError for a field's type, and whatever a config raises
        raise ModelError(f"model.path: {where}: transformers cannot read it: {' '.join(str(e).split())}") from None


def load_tokenizer(model: ModelSection):
    """The tokenizer of `model.tokenizer` (default `model.path`), after checking that `model.path` holds a model
    config; it must have a chat template (prompts are chat messages) and ids inside the model's vocabulary."""
    from transformers import AutoTokenizer

    hf, where = read_model_config(model)
    key = "model.tokenizer" if model.tokenizer else "model.path"
    source = model.tokenizer or model.path
    local = is_local(source)
    if local and not Path(source).is_dir():
        raise ModelError(f"{key}: {source!r} is not a directory")
    if local and (Path(source) / "tokenizer_config.json").is_file():
        try:
            tok_cfg = json.loads((Path(source) / "tokenizer_config.json").read_text())
        except (OSError, ValueError) as e:
            raise ModelError(f"{key}: {source}/tokenizer_config.json is not readable JSON: {e}") from None
        _no_remote_code(key, f"{source}/tokenizer_config.json", tok_cfg if isinstance(tok_cfg, dict) else {}, model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=model.trust_remote_code)
    except Exception as e:  # OSError, ValueError, and whatever a malformed tokenizer file makes the backend raise
        reason = " ".join(str(e).split())[:400] or type(e).__name__
        raise ModelError(
            f"{key}: cannot load {source!r}: {reason}{'' if local else _offline_hint(key, source)}"
        ) from None
    if not tokenizer.chat_template:
        raise ModelError(
            f"{key}: the tokenizer in {source!r} has no chat template; prompts are rendered as chat messages with it. "
            "Use the instruct / chat tokenizer (model.tokenizer), or add a chat_template.jinja next to it"
        )
    vocab_size = hf.get("vocab_size")
    top = max(tokenizer.get_vocab().values(), default=-1)
    if isinstance(vocab_size, int) and top >= vocab_size:
        raise ModelError(
            f"{key}: the tokenizer's ids go up to {top} but {where} has vocab_size {vocab_size}: they do not belong "
            "together (token ids past the embedding table); point model.tokenizer at the model's own tokenizer"
        )
    return tokenizer


def check_stop_ids(cfg: Config, tokenizer) -> None:
    """The ids that end a response (the model's EOS ids, the tokenizer's and `rollout.stop_token_ids`) fit the JAX
    engine's row of MAX_STOP_IDS: past it every generate call failed, once the cluster had started."""
    from rollout.model_config import eos_token_ids
    from rollout.types import MAX_STOP_IDS

    extra = set(cfg.rollout.stop_token_ids)
    if cfg.rollout.backend != "jax" or cfg.rollout.ignore_eos or not extra:  # under ignore_eos the extra ids alone
        return
    hf, _ = read_model_config(cfg.model)
    own = {*eos_token_ids(hf, _generation_config(cfg.model.path)), *stop_token_ids(tokenizer)}
    if len(own | extra) > MAX_STOP_IDS:
        raise ModelError(
            f"rollout.stop_token_ids: with the model's and the tokenizer's EOS ids {sorted(own)}, {len(own | extra)} "
            f"ids end a response, past the JAX engine's {MAX_STOP_IDS}; give at most {MAX_STOP_IDS - len(own)}"
        )


def _generation_config(source: str) -> dict | None:
    """generation_config.json of a model directory or hub id, if it has one (the engine reads its EOS ids there)."""
    try:
        if is_local(source):
            file = Path(source) / "generation_config.json"
        else:
            from huggingface_hub import hf_hub_download

            file = Path(hf_hub_download(source, "generation_config.json"))
        return json.loads(file.read_text())
    except Exception:  # none, or unreadable: config.json's eos_token_id stands, as for the engine
        return None


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """The tokenizer's EOS id. The engines add the model's own EOS ids (generation_config.json, e.g. Qwen3's 151645
    and 151643), so those are read in one place, rollout's model config."""
    return () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)
