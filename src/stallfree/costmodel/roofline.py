"""The roofline cost model (CostModel): a step's time in seconds from its tokens, for a model, GPU,
dtypes and tensor-parallel degree.

Size: this module is over 400 lines because it is one class whose pricing methods (step_time,
breakdown, max_tokens_within, the capacity) share private coefficients worked out once at
construction; splitting them apart would expose those coefficients. The pieces that stand alone
(StepCost, argument checks, largest_fitting) live in parts.py.

Imports allowed: the standard library, stallfree.core (StepPlan) and stallfree.costmodel.

Full mode, per GPU of a TP group of n (constants written out; L layers, h hidden, n_q heads, d head
dim, V vocab, T tokens in the step, S tokens that sample, N_act active decoder-layer parameters):
    FLOPs      = 2 x N_act x T                                (linear layers; Kaplan et al. 2020)
               + 2 x V x h x S                                (lm_head, sampled positions only)
               + 4 x L x n_q x d x pairs                      (QK^T and AV; a chunk of c tokens at
                 offset p has c x p + c(c+1)/2 (query, key) pairs, a decode at context p has p + 1)
    compute_s  = FLOPs_linear / (n x peak(dtype) x mfu) + FLOPs_head_and_attention / (n x peak(bf16) x mfu)
    bytes      = weights x w_bytes / n   (lm_head and embedding in 16 bits when the weights are 8-bit;
                                          MoE: dense weights + E(1 - (1 - k/E)^T) experts per layer)
               + (KV read + T written) x 2 x L x ceil(n_kv / n) x d x kv_bytes
    memory_s   = bytes / (HBM bandwidth x mbu)
    comm_s     = 2 x L x [2(n-1)/n x T x h x 2 B / (link bandwidth x link_util) + latency]   (n > 1)
    fixed_s    = overhead_s + kernel_launch_s x (KERNELS_PER_LAYER x L + 1)
                 + per_token_s x T + per_seq_s x B                (B sequences in the step)
    step_s     = max(compute_s, memory_s) + comm_s + fixed_s
Newer architectures (ModelSpec): 4 x n_q x d becomes attention_flops_per_pair (MLA: 2 n_q (d_n + d_r)
+ 2 n_q d_v), and a decode's pairs weigh decode_flops_per_pair / attention_flops_per_pair (MLA's
absorbed form); the KV term's 2 x L x ceil(n_kv / n) x d becomes L x (r_kv + d_r) for MLA, not divided
by n; windowed layers (a fraction f of the layers, window W) see min(x, W) keys at position x, so
pairs and cached KV read are (1 - f) x full + f x windowed; shared experts and dense layers are in the
weights every step reads, and only the routed experts of the MoE layers are read in part.
Expert parallelism and data-parallel attention (ep, dp_attention = D; an MoE model, pp 1): a replica
is G = tp x D GPUs in D attention ranks of tp GPUs, run in lockstep with the step's sequences split
evenly (the slowest rank is the mean one: routing and sequence imbalance are not priced). Per GPU:
dense weights / tp (each rank holds them) + routed experts / G; dense FLOPs and attention pairs, sampled
tokens, KV read and written on T / D tokens; routed-expert FLOPs on T / G tokens' worth (all T tokens
reach the experts); KV per token / D (each rank keeps its own sequences, so MLA's replicated latent is
stored once per rank, not once per GPU of a tp group). Communication per token: the attention (and
dense-MLP) all-reduce within tp on T / D tokens; for each MoE layer, with ep > 1 an all-to-all
dispatch and combine, 2 x k x (ep - 1) / ep x h x 2 B per token over G GPUs at the group's bandwidth
(each of a token's k experts counted apart: an upper bound, as DeepEP sends a token once per GPU), and
with ep 1 an all-gather and reduce-scatter over G, 2 (G - 1) / G x h x 2 B per token.
Sources: roofline (Williams et al., CACM 2009; LLM-Viewer, Yuan et al. 2024); attention FLOPs (PaLM,
arXiv 2204.02311, App. B); two all-reduces per layer (Megatron-LM, arXiv 1909.08053, section 3); ring
all-reduce time (NVIDIA nccl-tests doc/PERFORMANCE.md); KV bytes = 2 x L x n_kv x d x bytes.

Design mode is docs/DESIGN.md section 2's arithmetic: FLOPs = 2 x total parameters x T at the dtype's peak,
bytes = total parameters x w_bytes, no attention, no KV, no communication, no overhead.

Efficiency factors default to 1.0 and every overhead term to 0, so the defaults are floors (the
fastest the hardware allows), never predictions of a real engine; calibrate.py fits them to
measurements. The overhead terms have the shape of the costs they stand for: a fixed cost per kernel
launch (so an 80-layer 70B model pays 2.5 x what a 32-layer 7B model pays), a cost per token
(element-wise kernels between the GEMMs, whose work grows with the tokens), a cost per sequence
(sampling, input preparation and output processing on the CPU; per-sequence attention set-up), and
one per step (scheduling).
"""

from __future__ import annotations

import warnings
from array import array
from collections.abc import Callable
from itertools import accumulate
from typing import Any, cast

from stallfree.core.plan import StepPlan
from stallfree.costmodel.errors import CostModelError, CostModelMemoryError, CostModelWarning, FieldName
from stallfree.costmodel.hardware import (
    CALIBRATION_KEYWORDS,
    DTYPE_BYTES,
    FOUR_BIT_DTYPES,
    GPUSpec,
    canonical_dtype,
    get_gpu,
)
from stallfree.costmodel.model import ModelSpec, get_model
from stallfree.costmodel.parts import (
    StepCost,
    _check_count,
    _check_fraction,
    _check_nonneg,
    _check_tp,
    largest_fitting,
)

__all__ = [
    "EFFICIENCY_KEYWORDS",
    "KERNELS_PER_LAYER",
    "MODES",
    "CostModel",
    "StepCost",
    "largest_fitting",
    "moe_split_problem",
    "split_without_experts",
]

MODES = ("full", "design")

#: Kernel launches per decoder layer in a Llama-style layer as profiled by Vidur (MLSys 2024): input
#: norm, QKV GEMM, rotary, attention, output GEMM, post-attention norm, gate/up GEMM, activation,
#: down GEMM, residual add. The embedding adds one launch per step.
KERNELS_PER_LAYER = 10

#: The keyword arguments that scale or add to the floor (CostModel.from_names accepts these): the keys of a
#: GPU's calibration block.
EFFICIENCY_KEYWORDS = CALIBRATION_KEYWORDS

# Activations cross the all-reduce in 16 bits (bf16/fp16) even when weights are 8-bit.
_ACT_BYTES = 2
#: From this many steps on, plain_decode_times prices with numpy arrays (fewer, it loops): numpy's dozen
#: small operations cost about 11 us a call, a step in Python about 0.23 us, even at about 48 (measured
#: with timeit, 8 decodes: 16 steps 12.6 us with numpy, 3.9 us looping; 64 steps 11.1 / 14.1 us).
_VECTOR_STEPS = 48
#: The same for plain_decode_ends, whose loop costs about 0.13 us a step (64 steps: 11.0 us with numpy,
#: 8.8 us looping; 96 steps: 11.2 / 12.8 us).
_VECTOR_ENDS = 80
#: How far one side of a plain decode step's roofline must lead the other at both ends of a run for the other
#: to be skipped (plain_decode_ends): far above float rounding (~1e-16), far below any real gap.
_LEAD = 1.0 + 1e-9


class CostModel:
    """Predicts the time of one step (one forward pass over a StepPlan) on a TP group of GPUs.

    It owns the coefficients worked out once from the specs, so that pricing a plan costs a handful
    of float operations and never loops over its decodes (it reads num_decodes and
    decode_context_sum). It is immutable after construction; it never touches a scheduler.

    Args:
        model: a ModelSpec (get_model gives the presets).
        gpu: a GPUSpec (get_gpu gives the presets).
        tp: tensor-parallel degree (GPUs in the group).
        dtype: weight dtype, 'bf16', 'fp16', 'fp8', 'int8', 'int4', 'mxfp4' or 'nvfp4'. 8-bit means W8A8
            GEMMs at the 8-bit peak; on a GPU without FP8 units (A100) FP8 runs at the BF16 peak, with a
            CostModelWarning. 4-bit weights (hardware.DTYPE_BYTES: 4.125 to 4.5 bits with their scales)
            are read at that size; mxfp4 and nvfp4 GEMMs run at the FP4 peak where the GPU has FP4
            units (Blackwell), and otherwise int4 and mxfp4 run weight-only at the 16-bit peak. Every
            decoder weight is priced at the dtype (gpt-oss keeps its attention in bf16: 0.8% of its
            weights, under-read); embedding and lm_head are 16-bit.
        kv_dtype: KV cache dtype; None means the activation dtype (bf16 under 8-bit weights, as
            vLLM's kv_cache_dtype 'auto').
        mode: 'full' or 'design' (see the module docstring).
        mfu, mbu, link_util: fractions of the peak FLOP/s, memory bandwidth and link bandwidth reached,
            in (0, 1]; 1.0 makes the model a floor.
        overhead_s: fixed time added to every non-empty step, seconds (full mode only).
        allreduce_latency_s: fixed time per all-reduce call, seconds (full mode, tp > 1).
        kernel_launch_s: fixed time per kernel launch, seconds; a step launches
            KERNELS_PER_LAYER x L + 1 kernels (full mode only).
        per_token_s: time per token in the step, seconds, beyond the roofline (full mode only).
        per_seq_s: time per sequence in the step (each decode and each prefill chunk), seconds
            (full mode only).
        pp: pipeline-parallel degree (stages of tp GPUs each). One batch passes through the stages in
            turn, so a step's compute and memory time are those of tp GPUs over all layers, plus pp - 1
            activation sends (T x h x 2 B each) over the GPU link, or the network where a send crosses
            nodes (GPUSpec.gpus_per_node, internode_bw_bytes_per_s); weights and KV per GPU are the
            largest stage's. A tp group larger than a node all-reduces at the network's bandwidth.
        ep: expert parallelism of an MoE model: the routed experts are split ep ways, each expert over
            tp x dp_attention / ep GPUs; the MoE layers exchange tokens by all-to-all (module docstring).
        dp_attention: data-parallel attention ranks of an MoE model, each of tp GPUs holding the dense
            weights and its own sequences' KV; the experts are split over all tp x dp_attention GPUs.

    Raises:
        CostModelError: a bad mode or dtype; a 4-bit kv_dtype; ep or dp_attention that do not split
            the model (_check_moe_split names the field and value); 4-bit weights the GPU cannot run
            (GPUSpec.check_weight_dtype names dtype and GPU); tp that does not divide the heads; an efficiency out of
            (0, 1]; a negative (or non-finite) overhead term; weights that do not fit in the GPUs' memory.
    """

    #: step_time depends on the plan alone and changes nothing (a simulator may price steps ahead).
    pure_step_time = True
    #: plain_decode_times prices many steps for about the cost of one (numpy arrays from _VECTOR_STEPS).
    plain_decode_times_vectorized = True

    __slots__ = (
        "model",
        "gpu",
        "tp",
        "dtype",
        "kv_dtype",
        "mode",
        "mfu",
        "mbu",
        "link_util",
        "overhead_s",
        "allreduce_latency_s",
        "kernel_launch_s",
        "per_token_s",
        "per_seq_s",
        "kernel_launches",
        "pp",
        "ep",
        "dp_attention",
        "warnings",
        "weight_bytes_per_gpu",
        "kv_bytes_per_token_per_gpu",
        "_c_tok",
        "_c_samp",
        "_c_pair",
        "_w_dec",
        "_win",
        "_win_frac",
        "_m_fixed",
        "_m_head",
        "_m_kv",
        "_m_expert",
        "_experts",
        "_route_keep",
        "_x_tok",
        "_a_step",
        "_over",
        "_o_tok",
        "_o_seq",
        "_inv_mfu",
        "_inv_mbu",
        "_inv_link",
        "_f_tok",
        "_f_samp",
        "_f_pair",
        "_b_fixed",
        "_b_head",
        "_b_kv",
        "_b_expert",
        "_short_terms",
    )

    def __init__(
        self,
        model: ModelSpec,
        gpu: GPUSpec,
        tp: int = 1,
        dtype: str = "bf16",
        kv_dtype: str | None = None,
        mode: str = "full",
        mfu: float = 1.0,
        mbu: float = 1.0,
        link_util: float = 1.0,
        overhead_s: float = 0.0,
        allreduce_latency_s: float = 0.0,
        kernel_launch_s: float = 0.0,
        per_token_s: float = 0.0,
        per_seq_s: float = 0.0,
        pp: int = 1,
        ep: int = 1,
        dp_attention: int = 1,
    ) -> None:
        if mode not in MODES:
            raise CostModelError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        _check_tp(model, tp)
        self._short_terms: dict[int, tuple[float, ...]] = {}  # plain_decode_ends's, by decodes per step
        self.model, self.gpu, self.tp, self.mode = model, gpu, tp, mode
        self.dtype = canonical_dtype("dtype", dtype)
        wb = DTYPE_BYTES[self.dtype]
        # The activation (and attention) dtype: 16-bit under 8-bit weights.
        act = self.dtype if wb == 2 else "bf16"
        self.kv_dtype = act if kv_dtype is None else canonical_dtype("kv_dtype", kv_dtype)
        if self.kv_dtype in FOUR_BIT_DTYPES:
            raise CostModelError(
                f"kv_dtype {self.kv_dtype} is a 4-bit weight format; the KV cache is bf16, fp16, fp8 or int8"
            )
        gpu.check_weight_dtype(self.dtype)
        self.mfu, self.mbu = _check_fraction("mfu", mfu), _check_fraction("mbu", mbu)
        self.link_util = _check_fraction("link_util", link_util)
        self.overhead_s = _check_nonneg("overhead_s", overhead_s)
        self.allreduce_latency_s = _check_nonneg("allreduce_latency_s", allreduce_latency_s)
        self.kernel_launch_s = _check_nonneg("kernel_launch_s", kernel_launch_s)
        self.per_token_s = _check_nonneg("per_token_s", per_token_s)
        self.per_seq_s = _check_nonneg("per_seq_s", per_seq_s)
        self.kernel_launches = KERNELS_PER_LAYER * model.num_layers + 1
        notes: list[str] = []
        peak_lin = gpu.peak_flops(self.dtype)
        if peak_lin is None and self.dtype in FOUR_BIT_DTYPES:
            peak_lin = gpu.peak_flops(act)  # weight-only (W4A16): the GEMM runs at the 16-bit peak
        if peak_lin is None:
            notes.append(
                f"{gpu.key} has no {self.dtype} units: {self.dtype} weights are priced at the {act} peak "
                "(dequantized to 16 bits before the GEMM)"
            )
            peak_lin = gpu.peak_flops(act)
        peak_16 = gpu.peak_flops(act)
        assert peak_lin is not None and peak_16 is not None
        self.warnings = tuple(notes)
        for note in notes:
            warnings.warn(note, CostModelWarning, stacklevel=3)

        m, n = model, tp
        self.pp = _check_count("pp", pp, 1)
        if pp > m.num_layers:
            def too_many(n: FieldName) -> str:
                return f"{n('pp')} {pp} is more than the {m.num_layers} layers of {m.key}"

            raise CostModelError(too_many(str), too_many)
        self.ep, self.dp_attention = _check_moe_split(m, tp, pp, ep, dp_attention)
        stage_layers = -(-m.num_layers // pp)  # the largest stage holds ceil(L / pp) layers
        head_b = 2 if wb < 2 else wb  # embedding and lm_head stay 16-bit under 8- and 4-bit weights
        head_untied = 0 if m.tie_word_embeddings else m.lm_head_params
        big = m.embed_params + head_untied
        # With pp > 1 the embedding sits on the first stage and the lm_head on the last.
        big_stage = big if pp == 1 else max(m.embed_params, head_untied)
        self.weight_bytes_per_gpu = (
            (m.total_params - big) * wb * stage_layers / m.num_layers + big_stage * head_b
        ) / n
        if self.weight_bytes_per_gpu > gpu.mem_bytes and dp_attention == 1:  # dp: _split_moe checks
            need = self.weight_bytes_per_gpu
            raise self._memory_error(
                lambda f: f"{m.key} weights in {self.dtype} need {need / 1e9:.1f} GB per GPU "
                f"at {f('tp')} {n}" + (f", {f('pp')} {pp}" if pp > 1 else "") + ", "
                f"more than the {gpu.mem_bytes / 1e9:.0f} GB of one {gpu.key}; "
            )
        # GQA heads split (or replicated when tp > n_kv); an MLA latent is whole on every rank.
        kv_all_layers = int(m.kv_bytes_per_token(DTYPE_BYTES[self.kv_dtype], n))
        self.kv_bytes_per_token_per_gpu = kv_all_layers * stage_layers // m.num_layers

        # Work per GPU (FLOP and bytes) per token, per sampled token, per (query, key) pair, per step.
        design = mode == "design"
        self._f_tok = 2.0 * (m.total_params if design else m.active_layer_params) / n
        self._f_samp = 0.0 if design else 2.0 * m.vocab_size * m.hidden_size / n
        self._f_pair = 0.0 if design else float(m.num_layers * m.attention_flops_per_pair) / n
        # A decode's pairs weigh decode_flops_per_pair / attention_flops_per_pair (1 but for MLA).
        self._w_dec = m.decode_flops_per_pair / m.attention_flops_per_pair
        # Windowed layers: their share of the layers, and the window W in tokens.
        self._win = m.sliding_window
        self._win_frac = m.num_window_layers / m.num_layers
        self._experts = 0 if design else m.num_experts
        expert_w = m.routed_expert_params
        if design:
            self._b_fixed, self._b_head, self._b_kv, self._b_expert = m.total_params * wb / n, 0.0, 0.0, 0.0
        else:
            self._b_fixed = (m.layer_params - expert_w) * wb / n
            self._b_head = m.lm_head_params * head_b / n
            self._b_kv = float(kv_all_layers)  # a step passes through every stage in turn
            self._b_expert = m.num_moe_layers * m.expert_params_per_layer * wb / n
        self._route_keep = 1.0 - m.experts_per_token / m.num_experts if m.num_experts else 1.0
        # Seconds at efficiency 1.0; the step formula scales them by the inverse efficiencies.
        bw = gpu.mem_bw_bytes_per_s
        self._c_tok = self._f_tok / peak_lin
        self._c_samp = self._f_samp / peak_16
        self._c_pair = self._f_pair / peak_16
        self._m_fixed, self._m_head = self._b_fixed / bw, self._b_head / bw
        self._m_kv, self._m_expert = self._b_kv / bw, self._b_expert / bw
        calls = 2 * m.num_layers if (n > 1 and not design) else 0
        self._x_tok = calls * 2.0 * (n - 1) / n * m.hidden_size * _ACT_BYTES / gpu.allreduce_bw(n)
        self._a_step = calls * self.allreduce_latency_s
        if pp > 1 and not design:
            # pp - 1 sends of each token's activations between stages, in turn (one batch in flight);
            # stages are placed node by node, so ceil(tp x pp / gpus_per_node) - 1 of them cross nodes.
            remote = min(pp - 1, -(-(n * pp) // gpu.gpus_per_node) - 1)
            per_tok = m.hidden_size * _ACT_BYTES
            self._x_tok += remote * per_tok / gpu.p2p_bw(True) + (pp - 1 - remote) * per_tok / gpu.p2p_bw(False)
        if (ep > 1 or dp_attention > 1) and not design:
            self._split_moe(m, gpu, wb, head_b, kv_all_layers, peak_lin)
        self._over = 0.0 if design else self.overhead_s + self.kernel_launch_s * self.kernel_launches
        self._o_tok = 0.0 if design else self.per_token_s
        self._o_seq = 0.0 if design else self.per_seq_s
        self._inv_mfu, self._inv_mbu, self._inv_link = 1.0 / self.mfu, 1.0 / self.mbu, 1.0 / self.link_util

    def _memory_error(self, facts: Callable[[FieldName], str], more: str | None = None) -> CostModelMemoryError:
        """`facts` (worded with the fields named by a FieldName) then what makes room: raise tp, or use weights
        one size smaller (_smaller_weights: none under 4-bit weights) or a higher `more` (a field: "raise tp,
        use 8-bit weights or a higher gpu_memory_utilization"); with_pp names pp beside tp where a stage could
        hold fewer layers (pp below the layers, and no expert or attention split: those are priced at pp 1
        only). The error's wording names every field by the caller's names (CostModelError.named)."""
        smaller = self._smaller_weights()
        pp_helps = self.pp < self.model.num_layers and self.ep == 1 and self.dp_attention == 1

        def message(n: FieldName, with_pp: bool) -> str:
            uses = ([f"{smaller} weights"] if smaller else []) + ([f"a higher {n(more)}"] if more else [])
            parallel = f"raise {n('tp')} or {n('pp')}" if with_pp else f"raise {n('tp')}"
            if not uses:
                return facts(n) + parallel
            joint = ", " if len(uses) > 1 else ", or " if with_pp else " or "
            return f"{facts(n)}{parallel}{joint}use {' or '.join(uses)}"

        return CostModelMemoryError(message(str, False), message(str, True) if pp_helps else None,
                                    lambda n, with_pp: message(n, with_pp and pp_helps))

    def _smaller_weights(self) -> str | None:
        """The weights one size smaller to suggest where memory runs short: 8-bit under 16-bit weights,
        4-bit under 8-bit where this GPU runs a 4-bit dtype (GPUSpec.check_weight_dtype); None under
        4-bit weights, which have nothing smaller."""
        wb = DTYPE_BYTES[self.dtype]
        if wb == 2:
            return "8-bit"
        if wb == 1:
            for four_bit in FOUR_BIT_DTYPES:
                try:
                    self.gpu.check_weight_dtype(four_bit)
                except CostModelError:
                    continue
                return "4-bit"
        return None

    def _split_moe(
        self, m: ModelSpec, gpu: GPUSpec, wb: float, head_b: float, kv_all_layers: int, peak_lin: float
    ) -> None:
        """Re-work the per-GPU coefficients for expert parallelism and data-parallel attention (the
        module docstring's "Expert parallelism and data-parallel attention"); pp is 1 here."""
        tp, dp, ep = self.tp, self.dp_attention, self.ep
        g = tp * dp  # GPUs of the replica; the experts are split over all of them (ep x moe_tp)
        routed = m.routed_expert_params
        routed_active = m.num_moe_layers * m.experts_per_token * m.expert_params_per_layer
        head_untied = 0 if m.tie_word_embeddings else m.lm_head_params
        big = m.embed_params + head_untied
        self.weight_bytes_per_gpu = ((m.total_params - big - routed) * wb + big * head_b) / tp + routed * wb / g
        if self.weight_bytes_per_gpu > gpu.mem_bytes:
            need = self.weight_bytes_per_gpu

            def too_big(n: FieldName) -> str:
                return (f"{m.key} weights in {self.dtype} need {need / 1e9:.1f} GB per GPU at {n('tp')} {tp}, "
                        f"{n('dp_attention')} {dp}, {n('ep')} {ep}, more than the {gpu.mem_bytes / 1e9:.0f} GB of "
                        f"one {gpu.key}")

            raise CostModelError(too_big(str), too_big)
        # Each attention rank holds its own sequences' KV; spread over the ranks, a token costs 1/dp.
        self.kv_bytes_per_token_per_gpu = -(-kv_all_layers // dp)  # rounded up: never over the capacity
        # Per GPU, a step's T tokens: dense work on its rank's T/dp, expert work 1/g of all T.
        self._f_tok = 2.0 * (m.active_layer_params - routed_active) / (tp * dp) + 2.0 * routed_active / g
        self._c_tok = self._f_tok / peak_lin
        self._f_samp /= dp
        self._c_samp /= dp
        self._f_pair /= dp
        self._c_pair /= dp
        self._b_fixed = (m.layer_params - routed) * wb / tp
        self._b_kv = kv_all_layers / dp
        self._b_expert = m.num_moe_layers * m.expert_params_per_layer * wb / g
        bw = gpu.mem_bw_bytes_per_s
        self._m_fixed, self._m_kv, self._m_expert = self._b_fixed / bw, self._b_kv / bw, self._b_expert / bw
        per_tok = m.hidden_size * _ACT_BYTES
        # Attention and dense-MLP all-reduces within each rank's tp GPUs, on its T/dp tokens.
        dense_calls = m.num_layers + m.num_dense_layers
        x = dense_calls * 2.0 * (tp - 1) / tp * per_tok / gpu.allreduce_bw(tp) / dp if tp > 1 else 0.0
        if ep > 1:  # dispatch and combine: each token to k experts, (ep - 1) / ep of them on other GPUs
            x += m.num_moe_layers * 2.0 * m.experts_per_token * (ep - 1) / ep * per_tok / g / gpu.allreduce_bw(g)
        else:  # experts tensor-parallel over all g GPUs: all-gather then reduce-scatter of all T tokens
            x += m.num_moe_layers * 2.0 * (g - 1) / g * per_tok / gpu.allreduce_bw(g)
        self._x_tok = x
        self._a_step = 2 * m.num_layers * self.allreduce_latency_s

    @property
    def gpus(self) -> int:
        """GPUs of the replica: tp x pp x dp_attention."""
        return self.tp * self.pp * self.dp_attention

    @classmethod
    def from_names(
        cls,
        model: str | ModelSpec,
        gpu: str | GPUSpec,
        tp: int = 1,
        dtype: str = "bf16",
        kv_dtype: str | None = None,
        mode: str = "full",
        pp: int = 1,
        ep: int = 1,
        dp_attention: int = 1,
        **efficiency: float,
    ) -> CostModel:
        """Build a CostModel from preset names (or .json paths); `efficiency` takes the
        EFFICIENCY_KEYWORDS (mfu, mbu, link_util, overhead_s, allreduce_latency_s, kernel_launch_s,
        per_token_s, per_seq_s).

        Raises:
            CostModelError: an unknown name (the message lists the known ones), an unknown keyword,
                or any error of the constructor.
        """
        allowed = set(EFFICIENCY_KEYWORDS)
        unknown = sorted(set(efficiency) - allowed)
        if unknown:
            raise CostModelError(
                f"unknown keyword(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}"
            )
        return cls(get_model(model), get_gpu(gpu), tp, dtype, kv_dtype, mode, pp=pp, ep=ep, dp_attention=dp_attention,
                   **efficiency)

    def replace(self, **changes: Any) -> CostModel:
        """Return a copy with some constructor arguments changed (e.g. mode='design', mfu=0.6)."""
        args: dict[str, Any] = {
            "model": self.model,
            "gpu": self.gpu,
            "tp": self.tp,
            "dtype": self.dtype,
            "kv_dtype": self.kv_dtype,
            "mode": self.mode,
            "mfu": self.mfu,
            "mbu": self.mbu,
            "link_util": self.link_util,
            "overhead_s": self.overhead_s,
            "allreduce_latency_s": self.allreduce_latency_s,
            "kernel_launch_s": self.kernel_launch_s,
            "per_token_s": self.per_token_s,
            "per_seq_s": self.per_seq_s,
            "pp": self.pp,
            "ep": self.ep,
            "dp_attention": self.dp_attention,
        }
        args.update(changes)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CostModelWarning)  # already warned for this configuration
            return CostModel(**args)

    def __repr__(self) -> str:
        return (
            f"CostModel({self.model.key}, {self.gpu.key}, tp={self.tp}, pp={self.pp}, "
            + (f"ep={self.ep}, dp_attention={self.dp_attention}, " if self.ep > 1 or self.dp_attention > 1 else "")
            + f"dtype={self.dtype}, "
            f"kv_dtype={self.kv_dtype}, mode={self.mode}, mfu={self.mfu}, mbu={self.mbu}, "
            f"link_util={self.link_util}, overhead_s={self.overhead_s}, "
            f"kernel_launch_s={self.kernel_launch_s}, per_token_s={self.per_token_s}, "
            f"per_seq_s={self.per_seq_s})"
        )

    # ---- pricing -------------------------------------------------------------------------------
    def _chunk(self, n: int, p: int) -> tuple[float, float]:
        """Return (attention pairs, cached tokens read) of a prefill chunk of n tokens at offset p,
        averaged over the layers: a windowed layer's query at position x (1-based) sees min(x, W) keys
        and reads at most W cached tokens."""
        pairs = n * p + n * (n + 1) * 0.5
        if not self._win_frac:
            return pairs, float(p)
        w, a, b = self._win, p + 1, p + n
        if b <= w:
            win = pairs
        elif a >= w:
            win = float(n * w)
        else:
            win = (a + w) * (w - a + 1) * 0.5 + (b - w) * w
        f = self._win_frac
        return pairs + f * (win - pairs), p + f * (min(p, w) - p)

    def _decodes(self, nd: int, dcs: int, pairs: float, tokens: float | None = None) -> tuple[float, float]:
        """Return (weighted attention pairs, cached tokens read) of nd decodes (of `tokens` tokens in all,
        None: one each) whose contexts sum to dcs and whose full-attention pairs are `pairs`. A windowed
        layer sees at most W keys per decode token: min(pairs, tokens x W), exact once every context is
        at least W. MLA decodes weigh decode_flops_per_pair / attention_flops_per_pair."""
        kv = float(dcs)
        if self._win_frac:
            w, f = self._win, self._win_frac
            pairs += f * (min(pairs, (nd if tokens is None else tokens) * w) - pairs)
            kv += f * (min(kv, nd * w) - kv)
        return pairs * self._w_dec, kv

    def _price(self, tokens: int, pairs: float, kv_read: float, sampled: int, seqs: int) -> float:
        """Seconds for a step of `tokens` tokens, `pairs` attention pairs, `kv_read` cached tokens
        read, `sampled` sampled tokens and `seqs` sequences (the step formula of the module docstring)."""
        compute = (self._c_tok * tokens + self._c_samp * sampled + self._c_pair * pairs) * self._inv_mfu
        memory = self._m_fixed + self._m_kv * (kv_read + tokens)
        if sampled:
            memory += self._m_head
        if self._experts:
            memory += self._m_expert * self._experts * (1.0 - self._route_keep**tokens)
        memory *= self._inv_mbu
        return (
            (compute if compute > memory else memory)
            + self._x_tok * tokens * self._inv_link
            + self._a_step
            + self._over
            + self._o_tok * tokens
            + self._o_seq * seqs
        )

    def step_time(self, plan: StepPlan) -> float:
        """Return the predicted time of one step, in seconds (0.0 for an empty plan).

        Reads plan.num_tokens, num_decodes and decode_context_sum, and each prefill chunk's
        num_tokens, start and is_last; never iterates the decodes. Decodes with more than one token
        (speculative) are priced as if each had the mean token count.
        """
        tokens = plan.num_tokens
        if tokens <= 0:
            return 0.0
        nd = plan.num_decodes
        dcs = plan.decode_context_sum
        decode_tokens = tokens
        pairs = 0.0
        sampled = nd
        seqs = nd
        kv_read = 0.0
        for c in plan.prefills:
            seqs += 1
            n = c.num_tokens
            decode_tokens -= n
            cp, ck = self._chunk(n, c.start)
            pairs += cp
            kv_read += ck
            if c.is_last:
                sampled += 1
        if nd:
            if decode_tokens == nd:
                dp = float(dcs + nd)
            else:
                k = decode_tokens / nd
                dp = k * dcs + decode_tokens * (k + 1) * 0.5
            dp, dk = self._decodes(nd, dcs, dp, decode_tokens)
            pairs += dp
            kv_read += dk
        return self._price(tokens, pairs, kv_read, sampled, seqs)

    def _plain_terms(self, nd: int) -> tuple[float, ...]:
        """_decodes and _price written out for a plain decode step of `nd` decodes (no sliding window): the
        terms that do not change with the context, worked out once: base, c_pair, inv_mfu, w_dec, m_fixed,
        m_kv, m_head, inv_mbu, experts (0.0: none), link, a_step, over, per_tok, per_seq."""
        experts = self._m_expert * self._experts * (1.0 - self._route_keep**nd) if self._experts else 0.0
        return (self._c_tok * nd + self._c_samp * nd, self._c_pair, self._inv_mfu, self._w_dec, self._m_fixed,
                self._m_kv, self._m_head, self._inv_mbu, experts, self._x_tok * nd * self._inv_link,
                self._a_step, self._over, self._o_tok * nd, self._o_seq * nd)

    def _short_ends_terms(self, nd: int) -> tuple[float, ...]:
        """plain_decode_ends's terms for `nd` decodes where a step is max(compute, memory) plus at most one
        more term (no experts; at most one of link, all-reduce, overhead, per token, per sequence, since
        adding 0.0 changes no float): base, c_pair, inv_mfu, w_dec, m_fixed, m_kv, m_head, inv_mbu and
        that term (0.0: none); () otherwise."""
        base, c_pair, inv_mfu, w_dec, m_fixed, m_kv, m_head, inv_mbu, experts, *rest = self._plain_terms(nd)
        tail = [v for v in rest if v]
        if self._experts or len(tail) > 1:
            return ()
        return (base, c_pair, inv_mfu, w_dec, m_fixed, m_kv, m_head, inv_mbu, tail[0] if tail else 0.0)

    def _plain_array(self, nd: int, offset_sum: int, step: int, count: int) -> Any:
        """The prices, s, of `count` plain decode steps from `step` (plain_decode_times) as a numpy array:
        numpy's elementwise operations round each result as Python's do, so the same floats."""
        import numpy as np

        base, c_pair, inv_mfu, w_dec, m_fixed, m_kv, m_head, inv_mbu, experts, *tail = self._plain_terms(nd)
        contexts = np.arange(step, step + count, dtype=np.int64) * nd + offset_sum
        flops = (base + c_pair * ((contexts + nd).astype(np.float64) * w_dec)) * inv_mfu
        bytes_s = m_fixed + m_kv * (contexts.astype(np.float64) + nd)
        bytes_s += m_head
        if self._experts:
            bytes_s += experts
        bytes_s *= inv_mbu
        t = np.where(flops > bytes_s, flops, bytes_s)
        for term in tail:  # link, all-reduce, overhead, per token, per sequence: in that order
            t += term
        return t

    def plain_decode_times(self, offsets: tuple[int, ...], offset_sum: int, step: int, count: int) -> list[float]:
        """Return step_time of each of `count` decode-only steps, seconds, the first numbered `step`: the
        decodes of StepPlan offsets `offsets` (summing to `offset_sum`), one token each (a scheduler's
        plain decode steps, stallfree.core.plain_steps). The same floats as step_time of their plans,
        without a plan per step.
        """
        nd = len(offsets)
        if not nd:
            return [0.0] * count
        out: list[float] = []
        if not self._win_frac:
            if count >= _VECTOR_STEPS:
                return cast(list[float], self._plain_array(nd, offset_sum, step, count).tolist())
            base, c_pair, inv_mfu, w_dec, m_fixed, m_kv, m_head, inv_mbu, experts, link, a_step, over, per_tok, \
                per_seq = self._plain_terms(nd)
            has_experts = bool(self._experts)
            for s in range(step, step + count):
                dcs = offset_sum + nd * s
                compute = (base + c_pair * (float(dcs + nd) * w_dec)) * inv_mfu
                memory = m_fixed + m_kv * (float(dcs) + nd)
                memory += m_head
                if has_experts:
                    memory += experts
                memory *= inv_mbu
                out.append((compute if compute > memory else memory) + link + a_step + over + per_tok + per_seq)
            return out
        decodes, price = self._decodes, self._price
        for s in range(step, step + count):
            dcs = offset_sum + nd * s
            dp, dk = decodes(nd, dcs, float(dcs + nd), nd)
            out.append(price(nd, dp, dk, nd, nd))
        return out

    def plain_decode_ends(self, num_decodes: int, offset_sum: int, step: int, count: int, start: float) -> array[float]:
        """Return when each of `count` decode-only steps ends, s, run back to back from `start`, s: the
        steps plain_decode_times prices (`num_decodes` decodes whose StepPlan offsets sum to `offset_sum`,
        the first step numbered `step`), each starting as the previous ends. The same floats as
        itertools.accumulate(plain_decode_times(...), initial=start) without its first: start + t0, then
        + t1, ..., added in that order (numpy's cumsum adds in order too)."""
        if not num_decodes or self._win_frac:
            times = self.plain_decode_times((0,) * num_decodes, offset_sum, step, count)
            out = array("d", accumulate(times, initial=start))
            del out[0]
            return out
        nd = num_decodes
        if count >= _VECTOR_ENDS:
            import numpy as np

            t = self._plain_array(nd, offset_sum, step, count)
            t[0] += start
            np.cumsum(t, out=t)
            return array("d", t.tobytes())
        out = array("d")
        append = out.append
        end = start
        # The decode pairs of step s, float(dcs + nd): exact below 2**53, so one more step adds nd exactly.
        x = float(offset_sum + nd * step + nd)
        short = self._short_terms.get(nd)
        if short is None:
            short = self._short_terms[nd] = self._short_ends_terms(nd)
        if short:
            base, c_pair, inv_mfu, w_dec, m_fixed, m_kv, m_head, inv_mbu, last = short
            # Both sides of the roofline are linear in the pairs: one that leads the other by _LEAD at the
            # run's first and last steps leads at every step between (rounding moves each by ~1e-16 of
            # itself), so the other is not worked out. The same floats as the loop after these two.
            x1 = x + nd * (count - 1)
            c0, c1 = (base + c_pair * (x * w_dec)) * inv_mfu, (base + c_pair * (x1 * w_dec)) * inv_mfu
            m0, m1 = (m_fixed + m_kv * x + m_head) * inv_mbu, (m_fixed + m_kv * x1 + m_head) * inv_mbu
            if m0 > c0 * _LEAD and m1 > c1 * _LEAD:
                for _ in range(count):
                    end += (m_fixed + m_kv * x + m_head) * inv_mbu + last
                    append(end)
                    x += nd
                return out
            if c0 > m0 * _LEAD and c1 > m1 * _LEAD:
                for _ in range(count):
                    end += (base + c_pair * (x * w_dec)) * inv_mfu + last
                    append(end)
                    x += nd
                return out
            for _ in range(count):
                compute = (base + c_pair * (x * w_dec)) * inv_mfu
                memory = (m_fixed + m_kv * x + m_head) * inv_mbu
                end += (compute if compute > memory else memory) + last
                append(end)
                x += nd
            return out
        base, c_pair, inv_mfu, w_dec, m_fixed, m_kv, m_head, inv_mbu, experts, link, a_step, over, per_tok, \
            per_seq = self._plain_terms(nd)
        has_experts = bool(self._experts)
        for _ in range(count):
            compute = (base + c_pair * (x * w_dec)) * inv_mfu
            memory = m_fixed + m_kv * x + m_head
            if has_experts:
                memory += experts
            memory *= inv_mbu
            end += (compute if compute > memory else memory) + link + a_step + over + per_tok + per_seq
            append(end)
            x += nd
        return out

    def decode_step_time(self, num_decodes: int, context_len: int) -> float:
        """Return the time of a decode-only step, seconds: `num_decodes` decodes, each with
        `context_len` tokens already in the KV cache (0.0 when num_decodes is 0).

        Raises:
            CostModelError: a negative count or context.
        """
        _check_count("num_decodes", num_decodes)
        _check_count("context_len", context_len)
        if not num_decodes:
            return 0.0
        pairs, kv_read = self._decodes(num_decodes, num_decodes * context_len, num_decodes * (context_len + 1.0))
        return self._price(num_decodes, pairs, kv_read, num_decodes, num_decodes)

    def prefill_step_time(
        self,
        num_tokens: int,
        start: int = 0,
        num_decodes: int = 0,
        context_len: int = 0,
        is_last: bool = True,
    ) -> float:
        """Return the time of a step holding one prefill chunk plus decodes, seconds.

        Args:
            num_tokens: tokens in the chunk (>= 1).
            start: tokens of that prompt already in the KV cache (the chunk's offset).
            num_decodes: decodes in the same step, each with `context_len` tokens in the KV cache.
            is_last: the chunk ends its prompt and samples a token (adds one lm_head position).

        Raises:
            CostModelError: num_tokens < 1, or a negative start, count or context.
        """
        pairs, kv = self._prefill_counts(num_tokens, start, num_decodes, context_len)
        return self._price(num_tokens + num_decodes, pairs, kv, num_decodes + bool(is_last), num_decodes + 1)

    def attention_counts(
        self, prefill_tokens: int, prefill_start: int, num_decodes: int, decode_tokens: int, decode_context_sum: int
    ) -> tuple[float, float]:
        """Return (attention pairs, cached tokens read) as this model prices them, for a step of one
        prefill chunk of `prefill_tokens` at offset `prefill_start` (0 tokens: none) and `num_decodes`
        decodes of `decode_tokens` tokens in all whose contexts sum to `decode_context_sum`.

        For full-attention GQA models these are the plain counts (c x p + c(c+1)/2 per chunk, p + 1 per
        decode token); windowed layers and MLA's decode weight change them as in step_time. Calibration
        (fit.py) prices measured steps through this.
        """
        pairs = kv = 0.0
        if prefill_tokens:
            pairs, kv = self._chunk(prefill_tokens, prefill_start)
        if num_decodes:
            k = decode_tokens / num_decodes
            dp = k * decode_context_sum + decode_tokens * (k + 1) * 0.5
            dp, dk = self._decodes(num_decodes, decode_context_sum, dp, decode_tokens)
            pairs += dp
            kv += dk
        return pairs, kv

    def prefill_breakdown(
        self, num_tokens: int, start: int = 0, num_decodes: int = 0, context_len: int = 0, is_last: bool = True
    ) -> StepCost:
        """Return the parts of prefill_step_time(...) (same arguments): compute, memory, communication,
        overhead, and the work.

        Raises:
            CostModelError: num_tokens < 1, or a negative start, count or context.
        """
        pairs, kv = self._prefill_counts(num_tokens, start, num_decodes, context_len)
        return self.breakdown_counts(num_tokens + num_decodes, pairs, kv, num_decodes + bool(is_last), num_decodes + 1)

    def _prefill_counts(self, num_tokens: int, start: int, num_decodes: int, context_len: int) -> tuple[float, float]:
        """(attention pairs, cached tokens read) of one chunk of `num_tokens` at offset `start` beside
        `num_decodes` decodes of `context_len` each, as prefill_step_time and prefill_breakdown price them.

        Raises:
            CostModelError: num_tokens < 1, or a negative start, count or context.
        """
        _check_count("num_tokens", num_tokens, 1)
        _check_count("start", start)
        _check_count("num_decodes", num_decodes)
        _check_count("context_len", context_len)
        cp, ck = self._chunk(num_tokens, start)
        dp, dk = self._decodes(num_decodes, num_decodes * context_len, num_decodes * (context_len + 1.0))
        return cp + dp, ck + dk

    def breakdown(self, plan: StepPlan) -> StepCost:
        """Return the parts of step_time(plan): compute, memory, communication, overhead, and the work."""
        tokens = plan.num_tokens
        if tokens <= 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        pairs, kv_read = self._decodes(
            plan.num_decodes, plan.decode_context_sum, float(plan.decode_context_sum + plan.num_decodes)
        )
        sampled = plan.num_decodes
        seqs = plan.num_decodes
        for c in plan.prefills:
            cp, ck = self._chunk(c.num_tokens, c.start)
            pairs += cp
            kv_read += ck
            sampled += c.is_last
            seqs += 1
        return self.breakdown_counts(tokens, pairs, kv_read, sampled, seqs)

    def breakdown_counts(
        self, tokens: int, pairs: float, kv_read: float, sampled: int, seqs: int | None = None
    ) -> StepCost:
        """Return the parts of a step given its counts: tokens, attention (query, key) pairs, cached
        tokens read from the KV cache, tokens that sample, and sequences (None: as many as sample)."""
        if tokens <= 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        c, m, x, a = self.components(tokens, pairs, kv_read, sampled)
        compute, memory = c * self._inv_mfu, m * self._inv_mbu
        comm = x * self._inv_link + a
        flops = self._f_tok * tokens + self._f_samp * sampled + self._f_pair * pairs
        nbytes = self._b_fixed + self._b_kv * (kv_read + tokens) + (self._b_head if sampled else 0.0)
        if self._experts:
            nbytes += self._b_expert * self._experts * (1.0 - self._route_keep**tokens)
        over = self._over + self._o_tok * tokens + self._o_seq * (sampled if seqs is None else seqs)
        total = max(compute, memory) + comm + over
        return StepCost(compute, memory, comm, over, total, flops, nbytes)

    def components(
        self, tokens: int, pairs: float, kv_read: float, sampled: int
    ) -> tuple[float, float, float, float]:
        """Return the step's (compute, memory, link, latency) seconds at efficiency 1.0, for calibration:
        step_s = max(compute / mfu, memory / mbu) + link / link_util + latency + the overhead terms."""
        compute = self._c_tok * tokens + self._c_samp * sampled + self._c_pair * pairs
        memory = self._m_fixed + self._m_kv * (kv_read + tokens) + (self._m_head if sampled else 0.0)
        if self._experts:
            memory += self._m_expert * self._experts * (1.0 - self._route_keep**tokens)
        return compute, memory, self._x_tok * tokens, self._a_step

    # ---- capacity and budgets ------------------------------------------------------------------
    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9) -> int:
        """Return the tokens of KV cache that fit beside the weights on the TP group.

        Per GPU: (memory x gpu_memory_utilization - weights / tp) // (2 x L x ceil(n_kv / tp) x d x
        kv_bytes). Activations and workspaces are not subtracted, so this is an upper bound.

        Raises:
            CostModelError: gpu_memory_utilization outside (0, 1], or no room for one token of KV.
        """
        util = _check_fraction("gpu_memory_utilization", gpu_memory_utilization)
        free = self.gpu.mem_bytes * util - self.weight_bytes_per_gpu
        if free < self.kv_bytes_per_token_per_gpu:
            raise self._memory_error(
                lambda n: f"no room for KV: {self.model.key} weights take "
                f"{self.weight_bytes_per_gpu / 1e9:.1f} GB per GPU, "
                f"{util} x {self.gpu.mem_bytes / 1e9:.0f} GB leaves {max(free, 0.0) / 1e9:.1f} GB; ",
                "gpu_memory_utilization",
            )
        return int(free // self.kv_bytes_per_token_per_gpu)

    def max_tokens_within(
        self, target_s: float, num_decodes: int, decode_context_sum: int, chunk_start: int = 0
    ) -> int:
        """Return the most tokens a step may hold (the decodes plus one prefill chunk at offset
        `chunk_start`) with a predicted time <= target_s; 0 when the decodes alone exceed it.

        The chunk is assumed to sample (a conservative lm_head position). Step time grows with the
        chunk, so this is a binary search of at most ~31 pricings; the result is capped at 2^30.

        Raises:
            CostModelError: target_s <= 0, or a negative count, context sum or offset.
        """
        if isinstance(target_s, bool) or not isinstance(target_s, int | float) or not target_s > 0:
            raise CostModelError(f"target_s must be > 0 seconds, got {target_s!r}")
        _check_count("num_decodes", num_decodes)
        _check_count("decode_context_sum", decode_context_sum)
        _check_count("chunk_start", chunk_start)
        nd = num_decodes
        base_pairs, base_kv = self._decodes(nd, decode_context_sum, float(decode_context_sum + nd))

        def fits(total: int) -> bool:
            c = total - nd
            if c <= 0:
                return self._price(total, base_pairs, base_kv, nd, nd) <= target_s
            cp, ck = self._chunk(c, chunk_start)
            return self._price(total, base_pairs + cp, base_kv + ck, nd + 1, nd + 1) <= target_s

        return largest_fitting(fits, max(nd, 1))


def split_without_experts(model: ModelSpec, ep: int, dp_attention: int) -> tuple[str, int, str] | None:
    """ep or dp_attention above 1 on a model without experts: (the field, "ep" before "dp_attention", its
    value, why it cannot be priced), for a command to name the field by its flag; None otherwise."""
    if model.num_experts or (ep == 1 and dp_attention == 1):
        return None
    field, value = ("ep", ep) if ep > 1 else ("dp_attention", dp_attention)
    return field, value, (f"{model.key} has no experts; expert parallelism and data-parallel attention are for MoE "
                          "models (a dense model's data parallelism is more replicas)")


def _check_moe_split(model: ModelSpec, tp: int, pp: int, ep: int, dp_attention: int) -> tuple[int, int]:
    """Check expert parallelism `ep` and data-parallel attention ranks `dp_attention` against the model
    and tp; return them.

    Raises:
        CostModelError: either below 1 or not an integer; either above 1 for a dense model; ep not
            dividing the routed experts or the replica's tp x dp_attention GPUs; either above 1 with pp > 1.
            The message names the field and the value.
    """
    _check_count("ep", ep, 1)
    _check_count("dp_attention", dp_attention, 1)
    problem = moe_split_problem(model, tp, pp, ep, dp_attention)
    if problem is not None:
        raise CostModelError(problem, lambda n: moe_split_problem(model, tp, pp, ep, dp_attention, name=n) or problem)
    return ep, dp_attention


def moe_split_problem(model: ModelSpec, tp: int, pp: int, ep: int, dp_attention: int,
                      name: Callable[[str], str] | None = None) -> str | None:
    """Why expert parallelism `ep` and data-parallel attention ranks `dp_attention` (counts >= 1) cannot be
    priced with this model, tp and pp, or None where they can: above 1 on a dense model
    (split_without_experts), either above 1 with pp > 1, ep not dividing the routed experts or the replica's
    tp x dp_attention GPUs.

    Args:
        name: what to call each field (a command's flag: "ep" -> "--ep"), or None for the cost model's own
            field names. Named so, the message leaves out a split at 1 where the fields' wording lists both
            ("--ep 2 is not priced with --pp 2", against "ep 2 and dp_attention 1 are not priced with pp 2").
    """
    if ep == 1 and dp_attention == 1:
        return None
    n = name or str
    dense = split_without_experts(model, ep, dp_attention)
    if dense is not None:
        field, value, why = dense
        return f"{n(field)} {value}: {why}"
    if pp > 1:
        splits = [f"{n(f)} {v}" for f, v in (("ep", ep), ("dp_attention", dp_attention)) if name is None or v > 1]
        return (f"{' and '.join(splits)} {'are' if len(splits) > 1 else 'is'} not priced with {n('pp')} {pp}; "
                f"use {n('pp')} 1")
    if model.num_experts % ep:
        return f"{n('ep')} {ep} does not divide the {model.num_experts} routed experts of {model.key}"
    gpus = tp * dp_attention
    if gpus % ep:
        return (f"{n('ep')} {ep} does not divide the replica's {gpus} GPUs ({n('tp')} {tp} x {n('dp_attention')} "
                f"{dp_attention}); the experts are split {n('ep')} ways, each over {n('tp')} x "
                f"{n('dp_attention')} / {n('ep')} GPUs")
    return None
