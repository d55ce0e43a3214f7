"""The measured-kernel tables a KernelCostModel prices from: building the package's compiled engine for
a model, GPU, engine version, tp and dtypes (load_tables), once per process and, between processes,
from a small file on disk; the version slots (resolve_version); and the errors when the package or
its tables are missing (KernelsUnavailable).

Imports allowed: the standard library and stallfree.costmodel (errors, kernel_maps); the package
`aiconfigurator_core` (aiconfigurator-core, Apache-2.0, NVIDIA; the optional extra `kernels`) lazily,
inside the functions that need it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stallfree.costmodel.errors import CostModelError
from stallfree.costmodel.kernel_maps import KV_DTYPE_MODES, PACKAGE_CONFIGS, PACKAGE_FP8_CONFIGS, quant_modes

__all__ = [
    "BALANCED_ROUTING_MAX_EXPERTS",
    "KernelTables",
    "KernelsUnavailable",
    "allreduce_curve",
    "balanced_from",
    "cache_dir",
    "comm_version_at_or_below",
    "kernels_installed",
    "load_tables",
    "nccl_allreduce_curve",
    "cache_dir",
    "kernels_installed",
    "load_tables",
    "package_config",
    "resolve_version",
]

# The op classes of a model the composition knows; any other (linear attention, ...) is refused.
# OverlapOp: the package's decode MoE block, shared experts run beside the routed ones (DeepSeek).
_SHARED_OPS = frozenset({"Embedding", "ElementWise", "GEMM", "CustomAllReduce", "P2P", "NCCL", "MoE", "MoEDispatch",
                         "OverlapOp"})

# Bumped when the meaning of a cached entry changes, so that older entries are built afresh.
_FORMAT = "6"

#: An MoE with at most this many routed experts (Mixtral-8x7B and -8x22B) has a second set of tables with the
#: package's "balanced" routing beside its default power-law skew (alpha 1.2, aiconfigurator-core
#: sdk/models/moe.py `_power_law_alpha = 1.2`); stallfree.costmodel.kernels prices a step's MoE from it once
#: the step routes at least 2 tokens to each expert on average (tokens x top-k >= 2 x experts). Why: with 8
#: experts a serving batch reaches every one of them, and the package's skewed rows for Mixtral's shape at
#: TP 2 (H100, vLLM 0.24.0 moe_perf) are 1.15-1.38 times its balanced rows at 48-192 tokens, against
#: 1.03-1.14 at TP 4 and 0.99-1.15 at TP 8: the power law priced Mixtral's TP 2 decode steps up to 23% above
#: balanced routing where TP 4 and 8 move 0-8% (benchmarks/kernels_vs_estimator.py --moe). Below that many
#: tokens a batch cannot spread (at 1-4 tokens the balanced rows are the slower ones), so the skewed rows stay.
#: Many-expert routers (Qwen3-30B-A3B: 128 experts, top-8) keep the power law throughout.
BALANCED_ROUTING_MAX_EXPERTS = 8


class KernelsUnavailable(CostModelError):
    """The measured-kernel backend cannot price this configuration: the package is not installed, the
    GPU or engine has no tables, or the version is not one of the package's slots. The message says why."""


def kernels_installed() -> bool:
    """Return whether the optional package aiconfigurator-core can be imported (does not import it)."""
    from importlib.util import find_spec

    try:
        return find_spec("aiconfigurator_core") is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a broken entry in sys.modules
        return False


@dataclass(frozen=True, slots=True)
class KernelTables:
    """One compiled engine of the package for a model, system, engine version and parallelism, with
    the positions of its ops; built once per process per key (load_tables) and shared.

    Attributes:
        handle: the package's compiled engine (aiconfigurator_core.AicEngine) for the model.
        system, engine, version: the package's system name, engine, and the literal version.
        shared: context-op indices priced at the step's T tokens.
        logits: the lm_head GEMM's context-op index, or -1 when the package's model has none (its
            MoE family): `logits_json` then holds the same GEMM (vocab / tp x hidden, bf16), built by us.
        chunk_attention: the (first) context attention op's index.
        decode_attention: the (first) generation attention op's index.
        chunk_attentions, decode_attentions: every attention op's index, for models with more than
            one kind of layer (gpt-oss and Llama 4: windowed and full layers, each op summed over its
            own layers); () means the one above. For MLA models the op is the package's whole MLA
            block (its projections and attention, measured as one module), priced per chunk.
        decode_shared: generation-op indices priced at B tokens for a step of decodes only, where the
            package's decode graph differs from its prefill graph (DeepSeek's shared experts overlap
            the routed ones in decode: OverlapOp); None where the context ops serve both.
    """

    handle: Any
    system: str
    engine: str
    version: str
    shared: tuple[int, ...]
    logits: int
    chunk_attention: int
    decode_attention: int
    logits_json: str | None = None
    chunk_attentions: tuple[int, ...] = ()
    decode_attentions: tuple[int, ...] = ()
    decode_shared: tuple[int, ...] | None = None


_TABLES: dict[tuple[str, ...], KernelTables] = {}


def _import_package() -> Any:
    try:
        import aiconfigurator_core  # noqa: F401
        from aiconfigurator_core.sdk import engine as aic_engine
    except ImportError as exc:
        raise KernelsUnavailable(
            "the measured-kernel tables need the optional package aiconfigurator-core "
            f"(pip install 'stallfree[kernels]'): {exc}"
        ) from None
    return aic_engine


def resolve_version(system: str, engine: str, version: str) -> str:
    """Return the literal version of `engine` on `system` for a slot name ('current', 'previous',
    'next') or a literal version the package serves.

    Raises:
        KernelsUnavailable: the package is missing, the system has no tables for the engine, or the
            version is not served (the message lists the slots and their versions).
    """
    _import_package()
    from aiconfigurator_core.sdk import perf_database

    slots = perf_database.get_version_slots(system, engine) or {}
    if not slots:
        raise KernelsUnavailable(f"the package has no {engine} tables for {system}")
    if version in slots:
        return str(slots[version])
    if version in slots.values():
        return version
    listed = ", ".join(f"{k} = {v}" for k, v in slots.items())
    raise KernelsUnavailable(f"--kernels {engine}:{version}: {system} serves {engine} versions {listed}")


def _index_ops(ops: Sequence[Any], owner: str) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    shared, logits, attention = [], -1, []
    for i, op in enumerate(ops):
        kind, name = type(op).__name__, str(getattr(op, "_name", ""))
        if kind in ("ContextAttention", "GenerationAttention") or (kind == "FallbackOp" and "mla" in name):
            attention.append(i)
        elif kind == "GEMM" and "logits" in name:
            logits = i
        elif kind in _SHARED_OPS:
            shared.append(i)
        else:
            raise CostModelError(f"{owner}: op {name!r} of kind {kind} is not one the kernel composition prices")
    if not attention:
        raise CostModelError(f"{owner}: no attention op among the package's ops")
    return tuple(shared), logits, tuple(attention)


def package_config(key: str, dtype: str = "bf16") -> dict[str, Any] | None:
    """Return the public config.json the package bundles for our preset `key` (kernel_maps.PACKAGE_CONFIGS;
    for fp8 weights the FP8 checkpoint's, kernel_maps.PACKAGE_FP8_CONFIGS, where there is one), as a dict,
    or None when it bundles none or the package is absent (does not import the package)."""
    stem = (PACKAGE_FP8_CONFIGS.get(key) if dtype == "fp8" else None) or PACKAGE_CONFIGS.get(key)
    if stem is None:
        return None
    from importlib.util import find_spec

    try:
        found = find_spec("aiconfigurator_core")
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    path = Path(next(iter(found.submodule_search_locations))) / "model_configs" / f"{stem}_config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config.json (Llama 4 nests it under text_config)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def _is_moe(config: dict[str, Any]) -> bool:
    return any(_text_config(config).get(k) for k in ("num_local_experts", "n_routed_experts", "num_experts"))


def balanced_from(config: dict[str, Any]) -> int | None:
    """The least tokens of a step whose MoE is priced on balanced routing (BALANCED_ROUTING_MAX_EXPERTS):
    ceil(2 x experts / top-k) for an MoE of at most that many experts, else None (the power law always)."""
    experts = _num_experts(config)
    topk = _text_config(config).get("num_experts_per_tok")
    if not 0 < experts <= BALANCED_ROUTING_MAX_EXPERTS or not isinstance(topk, int) or topk < 1:
        return None
    return -(-2 * experts // topk)


def _num_experts(config: dict[str, Any]) -> int:
    """The routed experts of an MoE config (0 when it names none)."""
    text = _text_config(config)
    for k in ("num_local_experts", "n_routed_experts", "num_experts"):
        v = text.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 0


def cache_dir() -> Path:
    """Return the folder of compiled engines kept between processes: $STALLFREE_CACHE_DIR/kernels,
    else $XDG_CACHE_HOME/stallfree/kernels, else ~/.cache/stallfree/kernels."""
    root = os.environ.get("STALLFREE_CACHE_DIR")
    if root:
        return Path(root) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "stallfree" / "kernels"


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("aiconfigurator-core")
    except PackageNotFoundError:
        return "absent"


def load_tables(
    config: dict[str, Any], system: str, engine: str, version: str, tp: int, dtype: str, kv_dtype: str,
    ep: int = 1, dp_attention: int = 1, routing: str | None = None,
) -> KernelTables:
    """Return the compiled engine for a model config, system, engine version, TP degree, expert
    parallelism `ep` and data-parallel attention ranks `dp_attention` (the package's moe_ep_size and
    attention_dp_size; moe_tp_size = tp x dp_attention / ep): built once per process per key, then shared.
    With dp_attention > 1 the package's op list is one attention rank's: its attention, dense GEMMs and
    all-reduces are asked at that rank's tokens, its MoE ops count every rank's (the package scales the
    tokens of its MoE and dispatch ops by attention_dp_size itself).

    Building asks the package to resolve the version slot, load its database and compile the model
    (3 to 5 s on a 2-core machine); the compiled spec is then kept on disk (cache_dir(), keyed by every
    argument and the package's version, so a new package release builds afresh), and a later process
    only loads it (about 1 s: the engine reads its tables).

    Raises:
        KernelsUnavailable: as resolve_version.
        CostModelError: the package cannot build the model (the message carries its reason), or the
            model holds an op the composition does not price.
    """
    text = json.dumps(config, sort_keys=True)
    key = (text, system, engine, version, str(tp), dtype, kv_dtype) + ((f"ep{ep}",) if ep > 1 else ()) + (
        (f"dp{dp_attention}",) if dp_attention > 1 else ()) + ((f"routing-{routing}",) if routing else ())
    found = _TABLES.get(key)
    if found is not None:
        return found
    digest = hashlib.sha256(json.dumps([*key, _package_version(), _FORMAT]).encode()).hexdigest()[:32]
    path = cache_dir() / f"{digest}.json"
    tables = _load_cached(path)
    if tables is None:
        tables, spec = _build_tables(config, text, system, engine, version, tp, dtype, kv_dtype, ep, dp_attention,
                                     routing)
        _store(path, tables, spec)
    _TABLES[key] = tables
    return tables


def _store(path: Path, tables: KernelTables, spec: str) -> None:
    meta = {"spec": spec, "system": tables.system, "engine": tables.engine, "version": tables.version,
            "shared": list(tables.shared), "logits": tables.logits, "chunk_attention": tables.chunk_attention,
            "decode_attention": tables.decode_attention, "logits_json": tables.logits_json,
            "chunk_attentions": list(tables.chunk_attentions), "decode_attentions": list(tables.decode_attentions),
            "decode_shared": None if tables.decode_shared is None else list(tables.decode_shared)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(meta), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache only costs the next process the build


def _load_cached(path: Path) -> KernelTables | None:
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    try:
        import aiconfigurator_core  # only the compiled extension: the SDK's Python modules are not needed
    except ImportError:
        return None
    try:
        handle = aiconfigurator_core.AicEngine.from_spec(
            bytes(aiconfigurator_core.engine_spec_bincode_from_json(meta["spec"])), None
        )
        shared = tuple(int(i) for i in meta["shared"])
        handle.evaluate_context_ops(list(shared), batch_size=1, s=1)  # the engine loads its tables now
        ds = meta.get("decode_shared")
        return KernelTables(handle, str(meta["system"]), str(meta["engine"]), str(meta["version"]), shared,
                            int(meta["logits"]), int(meta["chunk_attention"]), int(meta["decode_attention"]),
                            meta["logits_json"], tuple(int(i) for i in meta.get("chunk_attentions", ())),
                            tuple(int(i) for i in meta.get("decode_attentions", ())),
                            None if ds is None else tuple(int(i) for i in ds))
    except Exception:  # a stale or damaged entry: build afresh
        return None


def _build_tables(
    config: dict[str, Any], text: str, system: str, engine: str, version: str, tp: int, dtype: str,
    kv_dtype: str, ep: int = 1, dp_attention: int = 1, routing: str | None = None,
) -> tuple[KernelTables, str]:
    literal = resolve_version(system, engine, version)
    aic = _import_package()
    import aiconfigurator_core
    from aiconfigurator_core.sdk import perf_database
    from aiconfigurator_core.sdk.config_builders import build_model_config
    from aiconfigurator_core.sdk.models import get_model as aic_model

    quiet = logging.getLogger("aiconfigurator_core")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its loader logs a line per fallback table it reads
    try:
        with warnings.catch_warnings(), tempfile.TemporaryDirectory(prefix="stallfree-kernels-") as folder:
            warnings.simplefilter("ignore")
            with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
                f.write(text)
            moe = _is_moe(config)
            gemm_mode, moe_mode = quant_modes(dtype, config, moe, system, engine)
            mc = build_model_config(
                tp_size=tp, pp_size=1, attention_dp_size=dp_attention,
                moe_tp_size=tp * dp_attention // ep if moe else 1, moe_ep_size=ep,
                gemm_quant_mode=gemm_mode, kvcache_quant_mode=KV_DTYPE_MODES[kv_dtype],
                fmha_quant_mode=None, moe_quant_mode=moe_mode,
                comm_quant_mode=None, forward_model=None, attention_backend=None,
            )
            if moe and routing:
                mc.workload_distribution = routing  # the package's MoE routing ("balanced"), not its default
            database = perf_database.get_database(system, engine, literal)
            # The package's own guard: an FP8 attention inferred from the checkpoint (DeepSeek's) where
            # the tables hold bf16 attention only is priced in bf16, as its estimator does.
            from aiconfigurator_core.sdk.models.helpers import resolve_context_fmha_by_data

            resolve_context_fmha_by_data(mc, folder, database, engine, is_context_role=True)
            model = aic_model(folder, mc, engine)
            spec = aic.build_engine_spec_json(
                model, model_path=folder, system=system, backend=engine, backend_version=literal,
                kv_block_size=None, systems_path=None, nextn=0, database=database,
            )
            handle = aiconfigurator_core.AicEngine.from_spec(
                bytes(aiconfigurator_core.engine_spec_bincode_from_json(spec)), None
            )
            owner = f"{engine} {literal} on {system}"
            shared, logits, chunk = _index_ops(model.context_ops, owner)
            gen_shared, _, decode = _index_ops(model.generation_ops, owner)
            overlapped = any(type(model.generation_ops[i]).__name__ == "OverlapOp" for i in gen_shared)
            logits_json = None
            if logits < 0:  # the package's MoE models leave out the lm_head: the Llama family's GEMM
                from aiconfigurator_core.sdk import common
                from aiconfigurator_core.sdk.operations.gemm import GEMM

                lm = _text_config(config)
                head = GEMM("context_logits_gemm", 1, int(lm["vocab_size"]) // tp, int(lm["hidden_size"]),
                            common.GEMMQuantMode.bfloat16)
                logits_json = aic.build_ops_json([head])
            handle.evaluate_context_ops(list(shared), batch_size=1, s=1)  # the engine loads its tables now
            # Every attention op once, so that a table the package lacks is refused here, not mid-run.
            handle.evaluate_context_ops(list(chunk), batch_size=1, s=16, prefix=0)
            handle.evaluate_generation_ops(list(decode), batch_size=1, s=16)
    except CostModelError:
        raise
    except Exception as exc:  # the package's own errors: report them as ours, with its reason
        raise CostModelError(f"the kernel tables cannot price this model on {system} ({engine}): {exc}") from None
    finally:
        quiet.setLevel(level)
    tables = KernelTables(handle, system, engine, literal, shared, logits, chunk[0], decode[0], logits_json,
                          chunk if len(chunk) > 1 else (), decode if len(decode) > 1 else (),
                          gen_shared if overlapped else None)
    return tables, str(spec)


def _version_key(text: str) -> tuple[int, ...]:
    """Order '0.19.0' < '0.24.0' < '1.3.0rc20' by their numbers (a release candidate's 'rcN' reads as N)."""
    return tuple(int(n) for n in re.findall(r"\d+", text))


def _comm_root(system: str, engine: str) -> Path | None:
    try:
        import aiconfigurator_core
    except ImportError:
        return None
    root = Path(aiconfigurator_core.__file__).parent / "systems" / "data" / system / "comm" / engine
    return root if root.is_dir() else None


def comm_version_at_or_below(system: str, engine: str, version: str) -> str | None:
    """Return the newest engine version <= `version` for which the package measured `engine`'s own
    all-reduce on `system` (its systems/data/<system>/comm/<engine>/<v>/custom_allreduce_perf.parquet),
    or None when there is none (or no package). These folders are not version slots: the package keeps
    them as backward-fill sources."""
    root = _comm_root(system, engine)
    if root is None or not version or not re.search(r"\d", version):
        return None
    want = _version_key(version)
    found = [d.name for d in root.iterdir()
             if (d / "custom_allreduce_perf.parquet").is_file() and _version_key(d.name) <= want]
    return max(found, key=_version_key) if found else None


_CURVES: dict[tuple[str, str, str, int], tuple[tuple[int, ...], tuple[float, ...]]] = {}


def allreduce_curve(system: str, engine: str, version: str, tp: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Return the package's measured all-reduce of `engine` `version` on `tp` GPUs of `system`: message
    sizes (bf16 elements, increasing) and latencies (ms), under CUDA graphs where the table has them
    (the `<engine>_graph` rows, which are what the package's own step pricing reads).

    Raises:
        KernelsUnavailable: no package, or no such table or no rows for `tp` GPUs.
    """
    key = (system, engine, version, tp)
    found = _CURVES.get(key)
    if found is not None:
        return found
    root = _comm_root(system, engine)
    path = None if root is None else root / version / "custom_allreduce_perf.parquet"
    if path is None or not path.is_file():
        raise KernelsUnavailable(f"the package has no measured {engine} {version} all-reduce for {system}")
    import pyarrow.parquet as pq  # type: ignore[import-untyped]  # a dependency of aiconfigurator-core

    rows = pq.read_table(path).to_pylist()
    rows = [r for r in rows if int(r.get("num_gpus", 0)) == tp and r.get("allreduce_dtype", "bfloat16") == "bfloat16"]
    graph = [r for r in rows if str(r.get("backend", "")).endswith("_graph")]
    rows = graph or rows
    if not rows:
        raise KernelsUnavailable(f"the package's {engine} {version} all-reduce on {system} has no rows for tp={tp}")
    by_size: dict[int, float] = {}
    for r in rows:
        by_size.setdefault(int(r["message_size"]), float(r["latency"]))
    sizes = tuple(sorted(by_size))
    found = _CURVES[key] = (sizes, tuple(by_size[s] for s in sizes))
    return found


def nccl_allreduce_curve(system: str, tp: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Return the package's measured NCCL all-reduce on `tp` GPUs of `system` (its newest
    systems/data/<system>/comm/nccl/<version>/nccl_perf.parquet, half precision): message sizes (elements,
    increasing) and latencies (ms), as allreduce_curve.

    Raises:
        KernelsUnavailable: no package, no NCCL table for the system, or no rows for `tp` GPUs.
    """
    key = (system, "nccl", "", tp)
    found = _CURVES.get(key)
    if found is not None:
        return found
    root = _comm_root(system, "nccl")
    tables = [] if root is None else [d for d in root.iterdir() if (d / "nccl_perf.parquet").is_file()]
    if not tables:
        raise KernelsUnavailable(f"the package has no measured NCCL all-reduce for {system}")
    import pyarrow.parquet as pq  # a dependency of aiconfigurator-core

    newest = max(tables, key=lambda d: _version_key(d.name))
    rows = [r for r in pq.read_table(newest / "nccl_perf.parquet").to_pylist()
            if r.get("op_name") == "all_reduce" and r.get("nccl_dtype") == "half" and int(r.get("num_gpus", 0)) == tp]
    if not rows:
        raise KernelsUnavailable(f"the package's NCCL all-reduce on {system} has no rows for tp={tp}")
    by_size = {int(r["message_size"]): float(r["latency"]) for r in rows}
    sizes = tuple(sorted(by_size))
    found = _CURVES[key] = (sizes, tuple(by_size[s] for s in sizes))
    return found
