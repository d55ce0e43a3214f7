"""The size of a LoRA adapter and the price of its GEMMs in a step, from the model's dimensions.

Imports allowed: the standard library, stallfree.core and stallfree.costmodel.

An adapter of rank r on a linear layer W (d_in -> d_out) is two matrices, A (r x d_in, the "shrink")
and B (d_out x r, the "expand"): r x (d_in + d_out) parameters (Hu et al., "LoRA", ICLR 2022).
The target modules are every linear layer of a decoder layer ("all-linear", the widest common
choice; PEFT's target_modules="all-linear"): q, k, v, o and, for a dense MLP, gate (when gated), up
and down. A mixture-of-experts model's adapters cover its attention projections only (one adapter
per expert is not modelled); multi-head latent attention models are refused.

Tensor parallelism (vLLM's sharded LoRA layers, vllm/lora/layers): a column-parallel layer (q, k, v,
gate, up) keeps A whole on every GPU and shards B by output; a row-parallel layer (o, down) shards A
by input and keeps B whole. So one GPU holds, per layer,

    r x [ sum over column layers of (d_in + d_out / tp) + sum over row layers of (d_in / tp + d_out) ]

parameters, in the adapter's dtype (2 bytes: bf16, vLLM's LoRA dtype for a bf16 or FP8 model).

A step's LoRA GEMMs (Punica's SGMV/BGMV kernels, Chen et al., MLSys'24; S-LoRA, Sheng et al., MLSys'24):
each token with an adapter costs 2 FLOP per adapter parameter on its GPU (the shrink and the expand,
one multiply-add each), and each distinct adapter in the step is read from GPU memory once. Priced
by the roofline (Williams et al., CACM 2009): max(FLOP / bf16 peak, bytes / memory bandwidth), added
to the step (the kernels run beside each base GEMM, not overlapped with it).
"""

from __future__ import annotations

from dataclasses import dataclass

from stallfree.costmodel.errors import CostModelError
from stallfree.costmodel.hardware import GPUSpec
from stallfree.costmodel.model import ModelSpec

__all__ = ["LORA_DTYPE_BYTES", "LoraShape", "lora_shape"]

#: Bytes per adapter parameter: bf16 (vLLM's lora_dtype "auto" is the model's activation dtype, bf16).
LORA_DTYPE_BYTES = 2


@dataclass(frozen=True, slots=True)
class LoraShape:
    """One adapter's size and the price of its GEMMs, for one model, rank, TP degree and GPU.

    Attributes:
        rank: r.
        tp: tensor-parallel GPUs.
        modules: the target modules, names.
        params_total: parameters of the whole adapter (all GPUs' shares, A and B once).
        params_per_gpu: parameters one GPU holds (the module docstring's formula).
        bytes_total: params_total x 2 bytes: what is read from storage.
        bytes_per_gpu: params_per_gpu x 2 bytes: what each GPU copies over its host link.
        peak_flops: the GPU's bf16 peak, FLOP/s.
        mem_bw: the GPU's memory bandwidth, B/s.
    """

    rank: int
    tp: int
    modules: tuple[str, ...]
    params_total: int
    params_per_gpu: float
    bytes_total: int
    bytes_per_gpu: float
    peak_flops: float
    mem_bw: float

    def gemm_time(self, lora_tokens: int, num_adapters: int) -> float:
        """Seconds of one step's LoRA GEMMs on one GPU: max(2 x params_per_gpu x lora_tokens / peak,
        num_adapters x bytes_per_gpu / mem_bw); 0 when no token has an adapter.

        Args:
            lora_tokens: tokens of the step (decode tokens and chunk tokens) whose request has an adapter.
            num_adapters: distinct adapters among them.
        """
        if lora_tokens <= 0:
            return 0.0
        flops = 2.0 * self.params_per_gpu * lora_tokens
        return max(flops / self.peak_flops, num_adapters * self.bytes_per_gpu / self.mem_bw)


def lora_shape(model: ModelSpec, gpu: GPUSpec, tp: int, rank: int) -> LoraShape:
    """The LoraShape of rank-`rank` all-linear adapters on `model` over `tp` GPUs of `gpu`.

    Example: Llama 3.3 70B (80 layers, hidden 8,192, 64 x 128 query and 8 x 128 KV heads, MLP 28,672),
    rank 16: 16 x 161,792 x 80 = 207.1 M parameters (414 MB); on TP 4, 16 x 83,456 x 80 = 106.8 M per
    GPU (213.6 MB), 3.3 ms over a 64 GB/s host link.

    Raises:
        CostModelError: rank or tp not an integer >= 1, or a multi-head latent attention model.
    """
    for name, v in (("lora rank", rank), ("tp", tp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise CostModelError(f"{name} must be an integer >= 1, got {v!r}")
    if model.kv_lora_rank:
        raise CostModelError(f"model {model.key!r}: LoRA adapters are priced for grouped-query attention "
                             "models; multi-head latent attention is not modelled")
    h, q, kv = model.hidden_size, model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    # (name, d_in, d_out, column-parallel)
    layers: list[tuple[str, int, int, bool]] = [
        ("q_proj", h, q, True), ("k_proj", h, kv, True), ("v_proj", h, kv, True), ("o_proj", q, h, False)]
    if not model.num_experts:
        i = model.intermediate_size
        if model.gated_mlp:
            layers.append(("gate_proj", h, i, True))
        layers += [("up_proj", h, i, True), ("down_proj", i, h, False)]
    total = rank * model.num_layers * sum(d_in + d_out for _, d_in, d_out, _ in layers)
    per_gpu = rank * model.num_layers * sum(
        (d_in + d_out / tp) if col else (d_in / tp + d_out) for _, d_in, d_out, col in layers)
    return LoraShape(
        rank=rank, tp=tp, modules=tuple(n for n, *_ in layers), params_total=total, params_per_gpu=per_gpu,
        bytes_total=total * LORA_DTYPE_BYTES, bytes_per_gpu=per_gpu * LORA_DTYPE_BYTES,
        peak_flops=gpu.bf16_flops_per_s, mem_bw=gpu.mem_bw_bytes_per_s,
    )
