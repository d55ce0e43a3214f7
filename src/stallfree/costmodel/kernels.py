"""Steps priced from measured GPU kernels (KernelCostModel): a cost model whose step time is composed
from the kernel tables of aiconfigurator-core (Apache-2.0, NVIDIA), per engine (vLLM, SGLang,
TensorRT-LLM) and engine version, for our scheduler's exact plans.

Imports allowed: the standard library, stallfree.core and stallfree.costmodel; the package
`aiconfigurator_core` (the optional extra `kernels`) only through kernel_tables, lazily, on the first
build, so that importing stallfree never needs it.

Composition of one step (all terms read from the package's measured tables through its compiled
op-list evaluation, `AicEngine.evaluate_context_ops` / `evaluate_generation_ops`, milliseconds
converted to seconds; T tokens in the step, S tokens that sample, B decodes):
    shared(T)      every op of the model's context op list except attention and the lm_head GEMM,
                   at T tokens: embedding, norms, QKV / output / MLP GEMMs (or the MoE experts), the
                   activation, the TP all-reduces, each summed over the layers by the package
    logits(S)      the lm_head GEMM at the S sampled positions (0 when nothing samples)
    chunk(c, p)    prefill attention of one chunk of c tokens at offset p (p tokens already cached),
                   for every chunk of the plan
    decode(B, s_i) decode attention: each decode i, with s_i = start_i + 1 keys, is priced as its
                   share (1/B) of a batch of B decodes all at s_i
    step_s = shared(T) + logits(S) + sum over chunks of chunk(c, p) + sum_i decode(B, s_i) / B
All-reduce of another engine version (`comm_version`): the tables price the all-reduces of their own
version. A run of an older engine whose own all-reduce the package measured on the same system (its
comm/<engine>/<version>/ folders, kept as backward-fill sources, not version slots) has them priced
from that table instead: each all-reduce op of shared(T) scaled by run(x) / own(x), x = T x hidden bf16
elements, both curves linear between the measured sizes. On H100 and H200 (NVLink) vLLM 0.19.0's
and 0.24.0's curves agree within a few percent; on 2 x RTX PRO 6000 (PCIe, no NVLink) vLLM 0.19.0's is
2.8 times 0.24.0's at the sizes of a decode step (docs/fidelity.md).
vLLM on more than two PCIe-only GPUs (kernel_maps.PCIE_ONLY_SYSTEMS: L40S, RTX PRO 6000) all-reduces
with NCCL, its custom all-reduce being off there: the all-reduce ops are then scaled the same way onto
the package's NCCL table of the system (`comm_table` 'nccl').
Models built by the package's own classes (kernel_tables.package_config: DeepSeek, Kimi, Qwen3, gpt-oss,
Llama 4): chunk and decode sum every attention op (windowed and full layers); for MLA the op is the whole
MLA block (projections included); a step of decodes only takes shared(T) from the package's decode graph
where it differs (DeepSeek's shared experts overlapping the routed ones: decode_shared_s).
The package's own step estimator prices all decodes of a step at one context and a prefill as one
prompt split evenly; the composition above agrees with it exactly where the shapes agree (decodes of
equal contexts; one whole prompt), which the tests check.

Data-parallel attention (dp_attention = D > 1; an MoE model): the replica is D attention ranks of tp GPUs
run in lockstep (every MoE layer exchanges tokens between all of them), simulated as one replica whose
scheduler holds every rank's sequences (KV capacity, the roofline's, is D ranks' worth). The tables are
the package's for attention_dp_size D (moe_tp_size = tp x D / ep): one rank's op list, its MoE and dispatch
ops counting the tokens of all D ranks (the package scales them by D itself). A step is priced as one
rank's even share of it, each count rounded up (ceil(x / D)):
    step_s = shared(ceil(T / D)) + logits(ceil(S / D)) + sum over chunks of chunk(c, p) / D
             + (1 / B) sum_i decode(ceil(B / D), s_i)
so the attention kernels see one rank's batch, the experts all T tokens, and the ranks' prefill work is
spread evenly over them. Why an even share, prefill chunks included: the engines balance the ranks
(requests assigned to the least loaded rank; TensorRT-LLM's and SGLang's attention-DP schedulers hold
prompts back so that the ranks prefill together), so over a run every rank carries 1 / D of the prefill
work; pricing a chunk as one rank's alone while the others wait prices the unbalanced engine, and on the
package's attention-DP rows (DeepSeek-R1 on 8 H200s as 8 ranks, TensorRT-LLM, 6 rows) it left a median
TPOT error of 60%, the even share 10% (docs/fidelity.md). What it leaves out: the wait of a prompt held
back for balancing (its TTFT) and imbalance between ranks. The package's estimator, whose batch is one
rank's (bs per rank, every rank alike), is matched exactly where the shapes agree: B = b x D decodes of
equal contexts against its decode of b, and D whole prompts of p tokens against its prefill of one prompt
of p (benchmarks/kernels_vs_estimator.py --dp).

Buckets (the cache): the chunk offset p and the decode keys s are priced by linear interpolation
between KNOTS (every CONTEXT_BUCKET = 256 tokens up to 1,024, then two per doubling), the package
being asked at the knots only; T, S, B and the chunk length c are exact. The error this adds is measured in
benchmarks/bench_kernels.py and stated in docs/costmodel.md.

Runs (the step cache, on by default): the decodes' partition over the knot intervals is kept for the
scheduler's current tuple of decode offsets while no decode crosses a knot (decode_runs.DecodeRuns), and
the cached terms of a decode-only step are read without a method call each; the price is the same float
as without it, bit for bit.
`step_cache=False` (or STALLFREE_KERNEL_STEP_CACHE=0 in the environment) prices every step afresh
(benchmarks/priced_step.py measures both).
"""

from __future__ import annotations

import json
import os
import re
from bisect import bisect_left, bisect_right
from itertools import accumulate
from typing import Any

from stallfree.core.plan import StepPlan
from stallfree.costmodel.decode_runs import DecodeRuns
from stallfree.costmodel.errors import CostModelError
from stallfree.costmodel.hardware import GPUSpec
from stallfree.costmodel.kernel_maps import (
    ENGINES,
    KV_DTYPE_MODES,
    PCIE_ONLY_SYSTEMS,
    WEIGHT_DTYPE_MODES,
    config_from_spec,
    system_for,
)
from stallfree.costmodel.kernel_tables import (
    KernelsUnavailable,
    KernelTables,
    allreduce_curve,
    balanced_from,
    comm_version_at_or_below,
    kernels_installed,
    load_tables,
    nccl_allreduce_curve,
    package_config,
)
from stallfree.costmodel.model import ModelSpec, get_model
from stallfree.costmodel.roofline import CostModel
from stallfree.costmodel.step_prices import KernelStepPrices

__all__ = [
    "CONTEXT_BUCKET",
    "KNOTS",
    "KernelCostModel",
    "KernelTables",
    "KernelsUnavailable",
    "STEP_CACHE_ENV",
    "kernels_installed",
    "step_cache_default",
]

#: The finest knot spacing of the decode keys and chunk offsets, tokens (see KNOTS).
CONTEXT_BUCKET = 256


def _knots(limit: int = 1 << 22) -> tuple[int, ...]:
    """Knots every CONTEXT_BUCKET tokens up to 1,024, then two per doubling (1,536, 2,048, 3,072,
    4,096, 6,144, ...) up to `limit` tokens: attention time is close to linear in the keys at long
    contexts, where wider spacing adds little error and fewer knots are spanned per step."""
    out, at = [0], 0
    while at < limit:
        at += CONTEXT_BUCKET if at < 1024 else (1 << (at.bit_length() - 1)) // 2
        out.append(at)
    return tuple(out)


#: Positions (tokens) of the knots between which decode keys and chunk offsets are interpolated.
KNOTS = _knots()
_KEY = 1 << 12  # cache key = count x _KEY + knot index (len(KNOTS) < _KEY)
_ALLREDUCE_OP = re.compile(r"_ar(_\d+)?$")  # the package's all-reduce op names: context_ar_1, context_embedding_ar

#: The environment variable that turns the step cache off ('0', 'off', 'false' or 'no'; module docstring).
STEP_CACHE_ENV = "STALLFREE_KERNEL_STEP_CACHE"


def step_cache_default() -> bool:
    """Return whether a KernelCostModel built without `step_cache` keeps its step cache: True unless
    the environment variable STEP_CACHE_ENV says '0', 'off', 'false' or 'no' (any case)."""
    return os.environ.get(STEP_CACHE_ENV, "").strip().lower() not in ("0", "off", "false", "no")


def _at(curve: tuple[tuple[int, ...], tuple[float, ...]], x: float) -> float:
    """Latency (ms) of a measured all-reduce curve at `x` elements: linear between its sizes, the
    first value below them, proportional to the size beyond the last."""
    sizes, lat = curve
    i = bisect_left(sizes, x)
    if i == 0:
        return lat[0]
    if i == len(sizes):
        return lat[-1] * x / sizes[-1]
    x0, x1 = sizes[i - 1], sizes[i]
    return lat[i - 1] + (lat[i] - lat[i - 1]) * (x - x0) / (x1 - x0)


class KernelCostModel:
    """Prices a step from measured kernel tables (the composition of the module docstring).

    Owns its caches (per process, never shared between models) and a roofline CostModel of the same
    configuration, which checks the configuration and answers the KV capacity. It never touches a
    scheduler. Pickles as its arguments: a worker process rebuilds it (once per process per key).

    Args:
        model: the ModelSpec (a preset, or a config file's).
        gpu: the GPUSpec; it must map onto a system with tables (kernel_maps.SYSTEMS).
        tp: tensor-parallel GPUs.
        dtype: weight dtype, 'bf16', 'fp16' or 'fp8' (per-tensor FP8 GEMMs).
        kv_dtype: KV cache dtype, or None for the activation dtype (bf16).
        engine: 'vllm', 'sglang' or 'trtllm'.
        version: a slot ('current', 'previous', 'next') or a literal version the package serves.
        comm_version: the engine version of the run being priced (a measured run's own), or None: the
            all-reduces are then priced from the package's table of the newest version <= it that was
            measured on this system, where that is not the table the priced version reads (module
            docstring); `comm_table` names it ('nccl' for vLLM on more than two PCIe-only GPUs, whatever
            the version; None when unchanged).
        ep: expert parallelism: the routed experts split over ep of the tp GPUs, each expert over
            tp / ep of them (the package's moe_ep_size and moe_tp_size).
        dp_attention: data-parallel attention ranks D of an MoE model, each of tp GPUs (the package's
            attention_dp_size); the replica is tp x D GPUs, a step priced as one rank's even share of it
            (module docstring). The split is checked by the roofline (CostModel: a dense model, ep not
            dividing tp x D, pp > 1 are refused, naming the field and the value).
        config: the model's config.json as a dict (a user's file), or None: the public config.json the
            package bundles for a preset that has one (kernel_maps.PACKAGE_CONFIGS: DeepSeek-V3,
            Kimi-K2, Qwen3, gpt-oss, Llama 4), else one written from `model`.
        step_cache: keep the decodes' partition over the knots across steps (module docstring; the
            same prices, faster), or None for step_cache_default() (the environment's switch).

    Raises:
        KernelsUnavailable: no package, no tables for the GPU or engine, a version not served.
        CostModelError: any error of CostModel (tp, memory), a dtype the tables do not price, or a
            model the package cannot build.
    """

    #: step_time depends on the plan alone; its caches only remember work (a simulator may price ahead).
    pure_step_time = True

    def __init__(
        self,
        model: ModelSpec,
        gpu: GPUSpec,
        tp: int = 1,
        dtype: str = "bf16",
        kv_dtype: str | None = None,
        engine: str = "vllm",
        version: str = "current",
        config: dict[str, Any] | None = None,
        comm_version: str | None = None,
        ep: int = 1,
        dp_attention: int = 1,
        step_cache: bool | None = None,
    ) -> None:
        self.roofline = CostModel(model, gpu, tp, dtype, kv_dtype, ep=ep, dp_attention=dp_attention)
        self.model, self.gpu, self.tp = model, gpu, tp
        self.ep, self.dp_attention = self.roofline.ep, self.roofline.dp_attention
        self.dtype, self.kv_dtype = self.roofline.dtype, self.roofline.kv_dtype
        if engine not in ENGINES:
            raise CostModelError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        if self.dtype not in WEIGHT_DTYPE_MODES:
            raise CostModelError(
                f"dtype {self.dtype!r} has no kernel tables here; priced: {', '.join(WEIGHT_DTYPE_MODES)}"
            )
        if self.kv_dtype not in KV_DTYPE_MODES:
            raise CostModelError(
                f"kv_dtype {self.kv_dtype!r} has no kernel tables here; priced: {', '.join(KV_DTYPE_MODES)}"
            )
        self.engine, self.requested_version = engine, version
        self._config = dict(config) if config is not None else _config_for(model, self.dtype)
        self.tables = load_tables(
            self._config, system_for(gpu.key), engine, version, tp, self.dtype, self.kv_dtype, ep, self.dp_attention
        )
        self.version = self.tables.version
        # A few-expert MoE (Mixtral) prices a step that spreads over every expert from balanced routing
        # (kernel_tables.BALANCED_ROUTING_MAX_EXPERTS says why); smaller steps keep the package's skew.
        self.balanced_from = balanced_from(self._config)
        self._balanced = None if self.balanced_from is None else load_tables(
            self._config, system_for(gpu.key), engine, version, tp, self.dtype, self.kv_dtype, ep, self.dp_attention,
            routing="balanced")
        self.comm_version = comm_version
        self.comm_table: str | None = None
        self._ar_curves: tuple[Any, Any] | None = None
        if tp > 1:
            system = self.tables.system
            ours = comm_version_at_or_below(system, engine, self.version)
            theirs = comm_version_at_or_below(system, engine, comm_version) if comm_version else None
            target = None
            if engine == "vllm" and tp > 2 and system in PCIE_ONLY_SYSTEMS:
                target, self.comm_table = nccl_allreduce_curve(system, tp), "nccl"
            elif theirs is not None and theirs != ours:
                target, self.comm_table = allreduce_curve(system, engine, theirs, tp), theirs
            if target is not None and ours is not None:
                self._ar_curves = (target, allreduce_curve(system, engine, ours, tp))
            else:
                self.comm_table = None
        self._shared_c: dict[int, float] = {}
        self._logits_c: dict[int, float] = {}
        self._chunk_c: dict[int, float] = {}
        self._decode_c: dict[int, float] = {}
        self._decode_shared_c: dict[int, float] = {}
        self._sorted: tuple[Any, list[int], list[int]] | None = None
        self.step_cache = step_cache_default() if step_cache is None else bool(step_cache)
        # shared(T) of a decode-only step, read in the step cache's path without decode_shared_s's call.
        self._decode_only_c = self._shared_c if self.tables.decode_shared is None else self._decode_shared_c
        self._runs, self._prices = self._step_cache()

    def _step_cache(self) -> tuple[DecodeRuns, KernelStepPrices]:
        """A new decode runs cache and the step prices that read it with this model's caches."""
        runs = DecodeRuns(KNOTS, self._decode_c, _KEY)
        return runs, KernelStepPrices(
            runs, KNOTS, _KEY, self._chunk_c, self._decode_only_c, self._shared_c, self._logits_c, self.chunk_exact_s,
            self._decode_knot, self.decode_shared_s, self.shared_s, self.logits_s)

    def bind_replica(self, res: object) -> KernelCostModel:
        """This model for one replica of a cluster that shares it (stallfree.sim.run.replica.Replica binds
        each): the same tables and price caches, with a step cache of its own (decode_runs.DecodeRuns keeps
        one tuple of decode offsets, and replicas stepping in turn would replace each other's every step).
        The same prices, bit for bit. `res` (the replica's result) is not read."""
        view = object.__new__(type(self))
        for name, value in vars(self).items():  # one by one, in order: the instance layout of __init__'s
            setattr(view, name, value)
        view._sorted = None
        view._runs, view._prices = view._step_cache()
        return view

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (
            _rebuild,
            (self.model, self.gpu, self.tp, self.dtype, self.kv_dtype, self.engine, self.requested_version,
             self._config, self.comm_version, self.ep, self.dp_attention, self.step_cache),
        )

    def __repr__(self) -> str:
        return (
            f"KernelCostModel({self.model.key}, {self.gpu.key}, tp={self.tp}, dtype={self.dtype}, "
            f"kv_dtype={self.kv_dtype}, "
            + (f"ep={self.ep}, dp_attention={self.dp_attention}, " if self.ep > 1 or self.dp_attention > 1 else "")
            + f"{self.engine} {self.version} on {self.tables.system})"
        )

    @property
    def description(self) -> str:
        """One line naming the tables: 'measured vllm 0.24.0 kernels (aiconfigurator-core)', the package's
        system named only where its name is not our GPU's ('(aiconfigurator-core, its rtx_pro_6000_server
        tables)'), so that a report spells a GPU once."""
        system = self.tables.system
        where = "" if system.replace("_", "-") == self.gpu.key else f", its {system} tables"
        line = f"measured {self.engine} {self.version} kernels (aiconfigurator-core{where})"
        if self.comm_table == "nccl":
            line += ", all-reduce from NCCL's table (vLLM's own is off on more than two PCIe-only GPUs)"
        elif self.comm_table is not None:
            line += f", all-reduce from {self.engine} {self.comm_table}'s table"
        return line

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9) -> int:
        """Return the KV capacity in tokens (the roofline CostModel's, which see)."""
        return self.roofline.kv_capacity_tokens(gpu_memory_utilization)

    def clear_caches(self) -> None:
        """Forget every cached price (the next steps ask the package again; for benchmarks)."""
        self._shared_c.clear()
        self._logits_c.clear()
        self._chunk_c.clear()
        self._decode_c.clear()
        self._decode_shared_c.clear()
        self._sorted = None
        self._runs.clear()

    # ---- the package's tables, in seconds --------------------------------------------------------
    def shared_s(self, tokens: int) -> float:
        """Return shared(T) of the module docstring, seconds, for T = `tokens` >= 1 (cached, exact)."""
        t = self._shared_c.get(tokens)
        if t is None:
            tb = self.tables
            if self._balanced is not None and self.balanced_from is not None and tokens >= self.balanced_from:
                tb = self._balanced
            r = tb.handle.evaluate_context_ops(list(tb.shared), batch_size=1, s=tokens)
            t = self._shared_c[tokens] = self._with_run_allreduce(r, tokens) * 1e-3
        return t

    def _with_run_allreduce(self, ops: Any, tokens: int) -> float:
        """Sum the package's evaluated (op, ms, ...) rows, ms, with each all-reduce scaled onto the run's
        all-reduce table where one applies (`comm_table`; the module docstring)."""
        ms = float(sum(v[1] for v in ops))
        if self._ar_curves is not None:
            x = tokens * self.model.hidden_size
            scale = _at(self._ar_curves[0], x) / _at(self._ar_curves[1], x)
            ms += (scale - 1.0) * sum(v[1] for v in ops if _ALLREDUCE_OP.search(str(v[0])))
        return ms

    def decode_shared_s(self, tokens: int) -> float:
        """Return shared(T) of a step of decodes only, seconds: the package's decode graph where it
        differs from its prefill graph (KernelTables.decode_shared: DeepSeek's shared experts beside
        the routed ones), else shared_s (cached, exact)."""
        ops = self.tables.decode_shared
        if ops is None:
            return self.shared_s(tokens)
        t = self._decode_shared_c.get(tokens)
        if t is None:
            r = self.tables.handle.evaluate_generation_ops(list(ops), batch_size=tokens, s=1)
            t = self._decode_shared_c[tokens] = self._with_run_allreduce(r, tokens) * 1e-3
        return t

    def logits_s(self, sampled: int) -> float:
        """Return logits(S), seconds: the lm_head GEMM at `sampled` positions (0.0 for none; cached)."""
        if sampled <= 0:
            return 0.0
        t = self._logits_c.get(sampled)
        if t is None:
            tb = self.tables
            if tb.logits_json is not None:
                r = tb.handle.evaluate_ops_json(tb.logits_json, is_context=True, batch_size=1, s=sampled, x=sampled)
            else:
                r = tb.handle.evaluate_context_ops([tb.logits], batch_size=1, s=sampled, x=sampled)
            t = self._logits_c[sampled] = r[0][1] * 1e-3
        return t

    def chunk_exact_s(self, num_tokens: int, start: int) -> float:
        """Return the prefill attention of one chunk, seconds, straight from the package (no cache)."""
        tb = self.tables
        r = tb.handle.evaluate_context_ops(
            list(tb.chunk_attentions or (tb.chunk_attention,)), batch_size=1, s=num_tokens, prefix=start
        )
        return sum(float(v[1]) for v in r) * 1e-3

    def decode_exact_s(self, batch: int, keys: int) -> float:
        """Return the decode attention of `batch` decodes each attending to `keys` keys, seconds (no cache)."""
        tb = self.tables
        r = tb.handle.evaluate_generation_ops(
            list(tb.decode_attentions or (tb.decode_attention,)), batch_size=batch, s=max(keys, 1)
        )
        return sum(float(v[1]) for v in r) * 1e-3

    def _decode_knot(self, batch: int, k: int) -> float:
        key = batch * _KEY + k
        t = self._decode_c.get(key)
        if t is None:
            t = self._decode_c[key] = self.decode_exact_s(batch, KNOTS[k])
        return t

    def chunk_s(self, num_tokens: int, start: int) -> float:
        """Return chunk(c, p), seconds: linear between the offset knots around `start` (cached; read by the
        step prices, step_prices.KernelStepPrices.chunk_s)."""
        return self._prices.chunk_s(num_tokens, start)

    def decode_attention_s(self, plan: StepPlan) -> float:
        """Return sum_i decode(B, s_i) / B of the module docstring, seconds, with s_i = start_i + 1 and
        decode(B, .) linear between KNOTS (with D attention ranks, decode(ceil(B / D), .): one rank's
        batch); O(B log B + knots spanned x log B) per step, the sorted starts being kept while
        the scheduler reuses its tuple of decode offsets."""
        nd = plan.num_decodes
        if not nd:
            return 0.0
        nb = -(-nd // self.dp_attention)  # the batch the attention kernels see: one rank's
        offs = plan.decode_offsets
        cached = self._sorted
        if cached is None or cached[0] is not offs:
            ordered = sorted(offs)
            cached = self._sorted = (offs, ordered, [0, *accumulate(ordered)])
        _, ordered, prefix = cached
        shift = plan.step + 1  # keys of a decode = its start + 1 = offset + step + 1
        knots, cache, base = KNOTS, self._decode_c, nb * _KEY
        k = bisect_right(knots, ordered[0] + shift) - 1
        last = bisect_right(knots, ordered[-1] + shift) - 1
        total, i = 0.0, 0
        lo = cache.get(base + k)
        if lo is None:
            lo = self._decode_knot(nb, k)
        while True:
            hi = cache.get(base + k + 1)
            if hi is None:
                hi = self._decode_knot(nb, k + 1)
            j = nd if k == last else bisect_left(ordered, knots[k + 1] - shift, i)
            if j > i:
                n, at = j - i, knots[k]
                keys = prefix[j] - prefix[i] + n * shift
                total += n * lo + (keys - n * at) * (hi - lo) / (knots[k + 1] - at)
            if k >= last:
                break
            i, k, lo = j, k + 1, hi
        return total / nd

    # ---- pricing ---------------------------------------------------------------------------------
    def step_time(self, plan: StepPlan) -> float:
        """Return the predicted time of one step, seconds (0.0 for an empty plan).

        Speculative decodes (more than one token each) count all their tokens in shared(T) and one
        query each in the decode attention. With the step cache (`step_cache`) the same float comes
        from the cached runs (module docstring); without it, from step_time_uncached.
        """
        if not self.step_cache:
            return self.step_time_uncached(plan)
        if self.dp_attention > 1:
            nd = plan.num_decodes
            if plan.num_tokens <= 0:
                return 0.0
            t = self._runs.total(plan.decode_offsets, plan.step + 1, -(-nd // self.dp_attention), self._decode_knot,
                                 plan.decode_offsets_sorted) / nd if nd else 0.0
            return t + self._ranks_s(plan, [self.chunk_s(c.num_tokens, c.start) for c in plan.prefills])
        return self._prices.step_time(plan)

    def plain_decode_times(
        self, offsets: tuple[int, ...], offset_sum: int, step: int, count: int
    ) -> list[float] | None:
        """Return step_time of each of `count` decode-only steps, seconds, the first numbered `step`: the
        decodes of StepPlan offsets `offsets` (the plans' own tuple: the step cache keys on it), one token
        each (a scheduler's plain decode steps, stallfree.core.plain_steps). The same floats as step_time
        of their plans; None (price the plans) without the step cache or with several attention ranks.
        """
        if not self.step_cache or self.dp_attention > 1 or not offsets:
            return None
        return self._prices.plain_decode_times(offsets, step, count)

    def step_time_uncached(self, plan: StepPlan) -> float:
        """Return step_time(plan) without the step cache, seconds: the decodes sorted and each knot
        interval bisected afresh (the pricing with `step_cache` off; the same float)."""
        tokens = plan.num_tokens
        if tokens <= 0:
            return 0.0
        sampled = plan.num_decodes
        t = self.decode_attention_s(plan)
        d = self.dp_attention
        if d > 1:
            return t + self._ranks_s(plan, [self.chunk_s(c.num_tokens, c.start) for c in plan.prefills])
        if not plan.prefills:
            return t + self.decode_shared_s(tokens) + self.logits_s(sampled)
        for c in plan.prefills:
            t += self.chunk_s(c.num_tokens, c.start)
            sampled += c.is_last
        return t + self.shared_s(tokens) + self.logits_s(sampled)

    def _ranks_s(self, plan: StepPlan, chunks: list[float]) -> float:
        """With D > 1 attention ranks: every term of the module docstring's step but the decode attention,
        seconds, given each prefill chunk's attention (`chunks`, seconds)."""
        d = self.dp_attention
        sampled = plan.num_decodes + sum(c.is_last for c in plan.prefills)
        t = self.logits_s(-(-sampled // d))
        per = -(-plan.num_tokens // d)
        if not plan.prefills:
            return t + self.decode_shared_s(per)
        return t + self.shared_s(per) + sum(chunks) / d

    def step_time_exact(self, plan: StepPlan) -> float:
        """Return step_time(plan) without buckets: every chunk and every decode's keys asked of the
        package as they are (slow: for measuring the error the buckets add)."""
        tokens = plan.num_tokens
        if tokens <= 0:
            return 0.0
        nd = plan.num_decodes
        sampled = nd
        t = 0.0
        if nd:
            nb = -(-nd // self.dp_attention)
            t += sum(self.decode_exact_s(nb, s + 1) for s in plan.decode_starts) / nd
        if self.dp_attention > 1:
            return t + self._ranks_s(plan, [self.chunk_exact_s(c.num_tokens, c.start) for c in plan.prefills])
        if not plan.prefills:
            return t + self.decode_shared_s(tokens) + self.logits_s(sampled)
        for c in plan.prefills:
            t += self.chunk_exact_s(c.num_tokens, c.start)
            sampled += c.is_last
        return t + self.shared_s(tokens) + self.logits_s(sampled)

    def decode_step_time(self, num_decodes: int, context_len: int) -> float:
        """Return the time of a decode-only step of `num_decodes` decodes, each with `context_len`
        tokens already in the KV cache, seconds (0.0 for none; exact, no buckets). With D attention ranks
        the decodes are the replica's, split evenly: one rank's ceil(num_decodes / D) are priced.

        Raises:
            CostModelError: a negative count or context.
        """
        if num_decodes < 0 or context_len < 0:
            raise CostModelError(f"num_decodes and context_len must be >= 0, got {num_decodes}, {context_len}")
        if not num_decodes:
            return 0.0
        nb = -(-num_decodes // self.dp_attention)
        return self.decode_shared_s(nb) + self.logits_s(nb) + self.decode_exact_s(nb, context_len + 1)

    def prefill_step_time(
        self, num_tokens: int, start: int = 0, num_decodes: int = 0, context_len: int = 0, is_last: bool = True
    ) -> float:
        """Return the time of a step holding one prefill chunk of `num_tokens` tokens at offset `start`
        plus `num_decodes` decodes with `context_len` tokens each in the KV cache, seconds (exact, no
        buckets; the arguments of CostModel.prefill_step_time). With D attention ranks the step is the
        replica's, priced as one rank's even share (module docstring).

        Raises:
            CostModelError: num_tokens < 1, or a negative start, count or context.
        """
        if num_tokens < 1 or min(start, num_decodes, context_len) < 0:
            raise CostModelError(
                f"num_tokens must be >= 1 and start, num_decodes, context_len >= 0, got "
                f"{num_tokens}, {start}, {num_decodes}, {context_len}"
            )
        d = self.dp_attention
        t = self.shared_s(-(-(num_tokens + num_decodes) // d)) + self.logits_s(-(-(num_decodes + int(is_last)) // d))
        if num_decodes:
            t += self.decode_exact_s(-(-num_decodes // d), context_len + 1)
        return t + self.chunk_exact_s(num_tokens, start) / d


def _config_for(model: ModelSpec, dtype: str = "bf16") -> dict[str, Any]:
    """Return the config.json handed to the package for a preset: its bundled public one where it
    has it (the package's own model class then builds MLA, shared experts, windowed layers), else
    one written from the ModelSpec (kernel_maps.config_from_spec, which refuses what it cannot write)."""
    from stallfree.costmodel.model import list_models

    found = package_config(model.key, dtype) if model.key in list_models() and get_model(model.key) == model else None
    return found if found is not None else config_from_spec(model)


_MODELS: dict[str, KernelCostModel] = {}


def _rebuild(
    model: ModelSpec, gpu: GPUSpec, tp: int, dtype: str, kv_dtype: str, engine: str, version: str,
    config: dict[str, Any], comm_version: str | None = None, ep: int = 1, dp_attention: int = 1,
    step_cache: bool = True,
) -> KernelCostModel:
    """Unpickle a KernelCostModel: one instance per process per configuration, so that a worker
    process running many sweep points loads the tables once and keeps its price caches warm."""
    key = repr((model, gpu, tp, dtype, kv_dtype, engine, version, json.dumps(config, sort_keys=True), comm_version, ep,
                dp_attention, step_cache))
    found = _MODELS.get(key)
    if found is None:
        found = _MODELS[key] = KernelCostModel(model, gpu, tp, dtype, kv_dtype, engine, version, config, comm_version,
                                                   ep=ep, dp_attention=dp_attention, step_cache=step_cache)
    return found
