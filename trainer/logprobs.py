"""Per-token log-probabilities (and entropies) of response tokens under a Hugging Face causal LM.

The rollout engine samples from softmax(logits / temperature); the trainer must score the same distribution, in
fp32 whatever the model dtype, or the importance ratios drift (docs/design.md §4). The projection onto the vocabulary
dominates memory (at 32k tokens per micro-batch and Qwen3's 151,936-token vocabulary, a full fp32 [B, L, V] logits
tensor is ~20 GB), so it is never made:

- the model's backbone (`model.get_decoder()`) runs without its LM head and returns hidden states;
- only the hidden states at the positions that predict a real response token are kept (`response_mask`; padding is
  never projected);
- they go through the LM head (`model.get_output_embeddings()`, tied or not) in fp32, `hidden.float() @
  weight.float().T`, chunk by chunk of `chunk_size` positions, and each chunk's log-softmax and entropy (§4.5:
  `H = logsumexp(z) − Σ softmax(z)·z` at `z = logits / T`) are taken from that chunk's logits alone;
- each chunk runs under non-reentrant activation checkpointing, so the backward pass recomputes one chunk's
  [chunk, V] logits at a time instead of keeping every chunk's alive.

Peak memory beyond the backbone is therefore a few [chunk, V] fp32 tensors, plus, for a non-fp32 model, one fp32
copy of the LM head weight (its gradient is then summed over the chunks in fp32 too). For bf16 models the logits come
from bf16 hidden states and bf16 weights upcast to fp32, not from bf16 logits.
"""

import torch
from torch.utils.checkpoint import checkpoint

from trainer.batching import MicroBatch
from trainer.config import chunk_elements
from trainer.model_support import unapplied_logit_scaling
from trainer.shared_prompts import shared_prompt_mask


def default_chunk_size(vocab_size: int, device: str = "cpu") -> int:
    return max(1, chunk_elements(device) // vocab_size)


def lm_head_on_tensor_cores(device: torch.device, dtype: str) -> None:
    """Let CUDA run the LM head's fp32 matmuls in TF32 when the model computes in bf16 (`dtype`).

    Those matmuls' inputs are then bf16 values upcast, which TF32 holds exactly: the forward's products stay exact
    and only the accumulation order moves (on an H200, log-probs moved by at most 7e-6, against 2e-6 from re-chunking
    alone), while the backward rounds the fp32 logit gradient to TF32's 10-bit mantissa, finer than the bf16 it meets
    next. 1.38x on an H200 train step of Qwen3-0.6B shapes. torch's switch is process-wide, and the LM head's are
    the only fp32 matmuls of a bf16 model; an fp32 model (or CPU) keeps full fp32."""
    if device.type == "cuda" and dtype != "float32":
        torch.backends.cuda.matmul.allow_tf32 = True


def _chunk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, H] hidden states → log π(target) [n] and, when `with_entropy`, the entropy [n] (else an empty tensor),
    from fp32 logits z = (hidden @ weight.T + bias) / T that exist only inside this call."""
    z = hidden.float() @ weight.T if bias is None else torch.addmm(bias, hidden.float(), weight.T)
    z.div_(temperature)  # in place: the matmul saves its inputs, not its output
    log_norm = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm
    # Nothing below is saved for the log-probs' backward, so a checkpoint's recomputation stops before it unless the
    # entropy carries a gradient.
    if not with_entropy:
        return logp, z.new_empty(0)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        probs = torch.softmax(z, dim=-1)
        # Without a graph the product can overwrite the softmax; with one, softmax's backward needs it.
        entropy = log_norm - (probs.mul_(z) if not torch.is_grad_enabled() else probs * z).sum(-1)
    return logp, entropy


def response_logprobs(
    model: torch.nn.Module,
    mb: MicroBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(response token | prefix) as a [B, R] fp32 tensor aligned with `mb.response_mask`, plus the entropy of
    each of those next-token distributions when `with_entropy` (else None). Padding positions hold 0; mask them.
    Log-probs are differentiable when called with grad enabled; the entropy only with `entropy_grad` (it is usually
    just logged). `chunk_size` positions are projected onto the vocabulary at a time (default: `default_chunk_size`).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    config = getattr(model, "config", None)
    if knob := unapplied_logit_scaling(config):  # a scaling of the logits the chunked head would miss
        raise NotImplementedError(f"response_logprobs does not apply the model's {knob}")
    head = model.get_output_embeddings()
    weight, bias = head.weight, getattr(head, "bias", None)
    chunk_size = chunk_size or default_chunk_size(weight.shape[0], weight.device.type)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    device = weight.device
    input_ids = mb.input_ids.to(device)
    mask = mb.response_mask.to(device)
    samples, cols = mask.nonzero(as_tuple=True)  # every real response token: sample, index t within the response
    # Response token t of a sample sits in row row_of at column response_start + t and is predicted from the column
    # before it (position c predicts token c + 1), except the first, which its prompt's last token predicts: the
    # column before, unless the row's earlier responses sit between them (shared prompts).
    rows = mb.row_of.to(device)[samples]
    target_cols = mb.response_start.to(device)[samples] + cols
    predictor_cols = torch.where(cols == 0, mb.context_end.to(device)[samples], target_cols - 1)
    if predictor_cols.numel() and int(predictor_cols.min()) < 0:
        raise ValueError("a response token at column 0 has no context to be predicted from")

    inputs = dict(input_ids=input_ids, attention_mask=mb.attention_mask.to(device))
    if mb.segments is not None:
        attention = getattr(config, "_attn_implementation", None)
        inputs["attention_mask"] = shared_prompt_mask(mb.segments.to(device), attention, weight.dtype)
        inputs["position_ids"] = mb.position_ids.to(device)
    out = model.get_decoder()(**inputs, use_cache=False)
    hidden = out.last_hidden_state[rows, predictor_cols]  # [N, H], in the model's dtype
    targets = input_ids[rows, target_cols]  # [N]
    del out

    weight32 = weight.float()  # once, not per chunk: its gradient is summed over the chunks in fp32
    bias32 = bias.float() if bias is not None else None
    checkpointed = torch.is_grad_enabled() and (hidden.requires_grad or weight32.requires_grad)
    logps, entropies = [hidden.new_empty(0, dtype=torch.float32)], [hidden.new_empty(0, dtype=torch.float32)]
    for lo in range(0, hidden.shape[0], chunk_size):
        args = (hidden[lo : lo + chunk_size], weight32, bias32, targets[lo : lo + chunk_size])
        args += (temperature, with_entropy, entropy_grad)
        if checkpointed:
            # a chunk draws nothing: no RNG state to keep and set again around its recompute (the set rewinds torch's
            # global RNG under any other thread of the process drawing from it)
            logp, entropy = checkpoint(_chunk_logprobs, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            logp, entropy = _chunk_logprobs(*args)
        logps.append(logp)
        entropies.append(entropy)

    def scatter(values: list[torch.Tensor]) -> torch.Tensor:  # [N] values back to the [B, R] layout, 0 elsewhere
        return torch.zeros(mask.shape, dtype=torch.float32, device=device).index_put((samples, cols), torch.cat(values))

    return scatter(logps), scatter(entropies) if with_entropy else None
