"""LoRA adapters in the engine: PEFT folders read and checked against the base model, kept in host memory,
put on the device for the steps that use them, and applied per token row in a batch that mixes adapters.

Imports allowed: the standard library, torch, safetensors, stallfree.engine.

An adapter is a PEFT folder: `adapter_config.json` (`r`, `lora_alpha`, `target_modules`, `use_rslora`) and
`adapter_model.safetensors`, whose tensors are named
`base_model.model.model.layers.{i}.{module}.lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]).
A targeted projection W [out, in] of layer i then computes x W^T + s (x A^T) B^T, s = lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora), which equals the merged weight W + s B A (Hu et al., 2021, LoRA).

Module names: PEFT names the Hugging Face Llama modules; the engine reads a GGUF file's tensors under the
same names (weights.py), so the map is:

| PEFT module | Hugging Face tensor | GGUF tensor | engine's fused matmul (rows) |
| --- | --- | --- | --- |
| `self_attn.q_proj` | `model.layers.{i}.self_attn.q_proj.weight` | `blk.{i}.attn_q.weight` | `qkv` [0, H*D) |
| `self_attn.k_proj` | `...k_proj.weight` | `blk.{i}.attn_k.weight` | `qkv` [H*D, (H+Hkv)*D) |
| `self_attn.v_proj` | `...v_proj.weight` | `blk.{i}.attn_v.weight` | `qkv` [(H+Hkv)*D, (H+2Hkv)*D) |
| `self_attn.o_proj` | `...o_proj.weight` | `blk.{i}.attn_output.weight` | `o` |
| `mlp.gate_proj` | `...gate_proj.weight` | `blk.{i}.ffn_gate.weight` | `gate_up` [0, F) |
| `mlp.up_proj` | `...up_proj.weight` | `blk.{i}.ffn_up.weight` | `gate_up` [F, 2F) |
| `mlp.down_proj` | `...down_proj.weight` | `blk.{i}.ffn_down.weight` | `down` |

llama.cpp's converter permutes the rows of attn_q and attn_k for its RoPE layout; the engine's GGUF reader
undoes it (weights.py), so lora_B's rows, in Hugging Face order, apply to the engine's rows as they are.
The embedding and LM head take no adapter (PEFT's `modules_to_save` and DoRA are refused).

Memory: every loaded adapter is kept in host memory (float32); at most `max_loras` of them are on the
device at once (the scheduler's limit per step, vLLM's --max-loras), in the model's dtype, the least
recently used given back first, as the simulator models residency (stallfree.sim.run.lora). On a CPU the
"device" copy is the dtype-converted one.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stallfree.engine.config import ModelConfig
from stallfree.engine.errors import InvalidLoraAdapter, UnknownLora
from stallfree.engine.outputs import LoraInfo

__all__ = ["PEFT_MODULES", "LoraAdapter", "LoraManager", "LoraStep", "random_peft_adapter", "read_peft_adapter"]

#: PEFT module name -> (the engine's fused matmul, the module's place in it). Order is the fused rows'.
PEFT_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}
_PREFIX = {"q_proj": "self_attn.", "k_proj": "self_attn.", "v_proj": "self_attn.", "o_proj": "self_attn.",
           "gate_proj": "mlp.", "up_proj": "mlp.", "down_proj": "mlp."}


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each PEFT module of the base model."""
    d, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q),
            "gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)}


@dataclass(slots=True)
class LoraAdapter:
    """One loaded adapter, its weights fused to the engine's matmuls.

    Attributes:
        name: the name it is served under.
        lora_id: the id the scheduler counts it by (Request.lora), unique for the engine's life (vLLM's
            lora_int_id): a name unloaded and loaded again gets a new one.
        path: its folder.
        rank: r (rows of lora_A), tokens-independent.
        alpha: lora_alpha; scaling = alpha / r (alpha / sqrt(r) with use_rslora).
        modules: the PEFT modules it targets, sorted.
        layers: per layer, fused matmul name -> (A [R, in], B [out, R] already times the scaling), float32 on
            the host; R = r x the modules fused there that it targets.
        nbytes: host bytes of its weights.
    """

    name: str
    lora_id: int
    path: str
    rank: int
    alpha: float
    scaling: float
    modules: tuple[str, ...]
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(repr=False)
    nbytes: int = 0


def random_peft_adapter(folder: str | Path, config: ModelConfig, modules: Sequence[str], rank: int, alpha: float,
                        seed: int, b_std: float = 0.02) -> dict[str, torch.Tensor]:
    """Write a PEFT adapter with seeded random weights for a base model of shape `config` (for tests,
    benchmarks, and trying adapters without a trained one): adapter_config.json and adapter_model.safetensors.

    A ~ N(0, 1/in) [r, in] and B ~ N(0, b_std^2) [out, r] per targeted module and layer (PEFT initialises
    B to zero, so that a fresh adapter changes nothing; a random B makes its effect visible).

    Returns:
        The tensors written, by PEFT's names (float32).

    Raises:
        InvalidLoraAdapter: a module that is not one of PEFT_MODULES.
    """
    from safetensors.torch import save_file

    shapes = _shapes(config)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(config.num_layers):
        for m in modules:
            if m not in PEFT_MODULES:
                raise InvalidLoraAdapter(f"module {m!r} is not one of {sorted(PEFT_MODULES)}")
            out, inp = shapes[m]
            base = f"base_model.model.model.layers.{i}.{_PREFIX[m]}{m}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) / inp ** 0.5
            tensors[f"{base}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * b_std
    where = Path(folder)
    where.mkdir(parents=True, exist_ok=True)
    meta = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules), "bias": "none",
            "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}
    (where / "adapter_config.json").write_text(json.dumps(meta))
    save_file(tensors, str(where / "adapter_model.safetensors"))
    return tensors


def _target_modules(raw: object, where: Path) -> list[str]:
    """PEFT's target_modules: a list of module names, or a regex string over full module names."""
    if isinstance(raw, str):
        import re

        try:
            pattern = re.compile(raw)
        except re.error as exc:
            raise InvalidLoraAdapter(f"{where}: target_modules {raw!r} is not a valid pattern ({exc})") from None
        found = [m for m in PEFT_MODULES if pattern.search(f"model.layers.0.{_PREFIX[m]}{m}") or raw == m]
        if not found:
            raise InvalidLoraAdapter(f"{where}: target_modules {raw!r} matches no module of the base model "
                                     f"(one of {sorted(PEFT_MODULES)})")
        return found
    if not isinstance(raw, list) or not raw or not all(isinstance(m, str) for m in raw):
        raise InvalidLoraAdapter(f"{where}: target_modules must be a non-empty list of module names, got {raw!r:.80}")
    names = [m.rsplit(".", 1)[-1] for m in raw]
    bad = [m for m in names if m not in PEFT_MODULES]
    if bad:
        raise InvalidLoraAdapter(f"{where}: target module {bad[0]!r} does not match the base model, whose "
                                 f"modules are {sorted(PEFT_MODULES)}")
    return sorted(set(names), key=list(PEFT_MODULES).index)


def read_peft_adapter(path: str | Path, name: str, lora_id: int, config: ModelConfig,
                      max_lora_rank: int) -> LoraAdapter:
    """Read a PEFT adapter folder and check it against the base model.

    Args:
        path: the folder holding adapter_config.json and adapter_model.safetensors.
        name: the name it will be served under.
        lora_id: its id (LoraAdapter.lora_id).
        config: the base model's shape.
        max_lora_rank: the largest rank accepted (vLLM's --max-lora-rank).

    Raises:
        InvalidLoraAdapter: the folder or a file is missing or unreadable; r is not an integer >= 1 or is above
            max_lora_rank; a target module is not one of the base model's; a tensor is missing or its shape
            is not [r, in] / [out, r] of the base model's module; the layer index is past the model's layers;
            DoRA, modules_to_save, bias training or per-module ranks are asked for. The message names the
            folder and the offending value.
    """
    where = Path(path)
    cfg_file, weights_file = where / "adapter_config.json", where / "adapter_model.safetensors"
    if not where.is_dir():
        raise InvalidLoraAdapter(f"LoRA adapter {name!r}: {str(where)!r} is not a folder")
    for f in (cfg_file, weights_file):
        if not f.is_file():
            raise InvalidLoraAdapter(f"LoRA adapter {name!r}: {str(where)!r} has no {f.name}")
    try:
        meta = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidLoraAdapter(f"LoRA adapter {name!r}: {cfg_file} cannot be read as JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise InvalidLoraAdapter(f"LoRA adapter {name!r}: {cfg_file} is not a JSON object")
    r = meta.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise InvalidLoraAdapter(f"LoRA adapter {name!r}: r must be an integer >= 1, got {r!r}")
    if r > max_lora_rank:
        raise InvalidLoraAdapter(f"LoRA adapter {name!r}: rank r={r} is above --max-lora-rank {max_lora_rank}")
    alpha = meta.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise InvalidLoraAdapter(f"LoRA adapter {name!r}: lora_alpha must be a finite number, got {alpha!r}")
    for key, off in (("use_dora", False), ("modules_to_save", None), ("rank_pattern", {}), ("alpha_pattern", {}),
                     ("fan_in_fan_out", False)):
        if meta.get(key, off) not in (off, None, [], {}, False):
            raise InvalidLoraAdapter(f"LoRA adapter {name!r}: {key}={meta[key]!r:.80} is not supported")
    if meta.get("bias", "none") != "none":
        raise InvalidLoraAdapter(f"LoRA adapter {name!r}: bias={meta['bias']!r} is not supported (only 'none')")
    modules = _target_modules(meta.get("target_modules"), where)
    scaling = alpha / math.sqrt(r) if meta.get("use_rslora") else alpha / r
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(weights_file))
    except Exception as exc:  # noqa: BLE001 - any reader error is this adapter's fault
        raise InvalidLoraAdapter(f"LoRA adapter {name!r}: {weights_file} cannot be read ({exc})") from None
    layers = _fuse(tensors, name, modules, r, scaling, config)
    nbytes = sum(t.numel() * 4 for layer in layers for pair in layer.values() for t in pair)
    return LoraAdapter(name, lora_id, str(where), r, float(alpha), float(scaling), tuple(modules), layers, nbytes)


def _fuse(tensors: dict[str, torch.Tensor], name: str, modules: Sequence[str], r: int, scaling: float,
          cfg: ModelConfig) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Per layer, fused matmul -> (A [R, in], s x B [out_fused, R]) with zeros where a module is not targeted."""
    shapes = _shapes(cfg)
    seen: set[str] = set()
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    for i in range(cfg.num_layers):
        fused: dict[str, tuple[list[torch.Tensor], list[tuple[int, torch.Tensor]]]] = {}
        for m in modules:
            base = f"base_model.model.model.layers.{i}.{_PREFIX[m]}{m}"
            pair = []
            for part, want in (("lora_A", (r, shapes[m][1])), ("lora_B", (shapes[m][0], r))):
                key = f"{base}.{part}.weight"
                t = tensors.get(key)
                if t is None:
                    raise InvalidLoraAdapter(f"LoRA adapter {name!r}: tensor {key!r} is missing")
                if tuple(t.shape) != want:
                    raise InvalidLoraAdapter(f"LoRA adapter {name!r}: {key} is {list(t.shape)}, the base model "
                                             f"needs {list(want)} (rank {r})")
                seen.add(key)
                pair.append(t.float())
            target, slot = PEFT_MODULES[m]
            a_parts, b_parts = fused.setdefault(target, ([], []))
            a_parts.append(pair[0])
            b_parts.append((slot, pair[1] * scaling))
        layer = {}
        for target, (a_parts, b_parts) in fused.items():
            a = torch.cat(a_parts)
            members = [m for m in PEFT_MODULES if PEFT_MODULES[m][0] == target]
            outs = [shapes[m][0] for m in members]
            b = torch.zeros(sum(outs), a.shape[0])
            for j, (slot, bm) in enumerate(b_parts):
                row0 = sum(outs[:slot])
                b[row0:row0 + bm.shape[0], j * r:(j + 1) * r] = bm
            layer[target] = (a.contiguous(), b.contiguous())
        layers.append(layer)
    extra = sorted(k for k in tensors if k not in seen)
    if extra:
        raise InvalidLoraAdapter(f"LoRA adapter {name!r}: tensor {extra[0]!r} matches no target module of the "
                                 f"base model ({len(extra)} such tensors)")
    return layers


#: An adapter's weights per layer: fused matmul name -> (A [R, in], scaled B [out, R]).
LayerWeights = list[dict[str, tuple[torch.Tensor, torch.Tensor]]]


class LoraStep:
    """The adapters of one step and the token rows of each: adds s (x A^T) B^T to those rows of each
    targeted matmul's output.

    Args:
        groups: (rows [n] int64 on the device, the adapter's per-layer device weights) per adapter in the
            step; base-model rows are in no group.
        num_tokens: T, rows of the step's flat batch.

    Shapes: x [T, in] -> out [T, out] (added to in place).
    """

    __slots__ = ("groups", "whole")

    def __init__(self, groups: list[tuple[torch.Tensor, list[dict[str, tuple[torch.Tensor, torch.Tensor]]]]],
                 num_tokens: int) -> None:
        self.groups = groups
        # One adapter on every row: no gather or scatter.
        self.whole = len(groups) == 1 and int(groups[0][0].shape[0]) == num_tokens

    def add(self, layer: int, target: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Add each adapter's delta for fused matmul `target` of `layer` to its rows of `out`."""
        for rows, weights in self.groups:
            pair = weights[layer].get(target)
            if pair is None:
                continue
            a, b = pair
            if self.whole:
                out = out + (x @ a.T) @ b.T
            else:
                out = out.index_add(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
        return out


class LoraManager:
    """The engine's adapters: which names are served, their host weights, their device copies.

    It owns the adapters; the engine tells it which requests hold which adapter (acquire, release), so an
    adapter unloaded while requests use it keeps its weights until the last of them ends.

    Args:
        config: the base model's shape.
        max_loras: the most adapters on the device at once (the scheduler's max_loras); None: no limit.
        max_lora_rank: the largest rank accepted.
        device, dtype: where and in which dtype the step's adapters are.
    """

    def __init__(self, config: ModelConfig, max_loras: int | None, max_lora_rank: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config = config
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.device, self.dtype = device, dtype
        self._by_name: dict[str, LoraAdapter] = {}
        self._by_id: dict[Hashable, LoraAdapter] = {}
        self._users: dict[Hashable, int] = {}
        self._retired: set[Hashable] = set()
        self._resident: OrderedDict[Hashable, list[dict[str, tuple[torch.Tensor, torch.Tensor]]]] = OrderedDict()
        self._next_id = 1
        self.num_requests: dict[str, int] = {}
        self.num_loads: dict[str, int] = {}

    # ------------------------------------------------------------------ served names

    def read(self, name: str, path: str | Path) -> LoraAdapter:
        """Read and check an adapter without serving it (thread-safe: touches nothing of the manager's
        but the id counter). Raises InvalidLoraAdapter (read_peft_adapter's, or a bad or served name)."""
        self._check_new_name(name)
        lora_id = self._next_id
        self._next_id += 1
        return read_peft_adapter(path, name, lora_id, self.config, self.max_lora_rank)

    def _check_new_name(self, name: str) -> None:
        if not isinstance(name, str) or not name or len(name) > 128 or any(c.isspace() for c in name):
            raise InvalidLoraAdapter(f"LoRA adapter name must be a non-empty string of at most 128 characters "
                                     f"without spaces, got {name!r:.80}")
        if name in self._by_name:
            raise InvalidLoraAdapter(f"LoRA adapter {name!r} is already served (from {self._by_name[name].path})")

    def add(self, adapter: LoraAdapter) -> None:
        """Serve a read adapter under its name. Raises InvalidLoraAdapter when the name is served already."""
        self._check_new_name(adapter.name)
        self._by_name[adapter.name] = adapter
        self._by_id[adapter.lora_id] = adapter
        self.num_requests.setdefault(adapter.name, 0)
        self.num_loads.setdefault(adapter.name, 0)

    def remove(self, name: str) -> None:
        """Stop serving `name`: new requests naming it are refused; running ones finish with it.

        Raises:
            InvalidLoraAdapter: no adapter of that name is served.
        """
        adapter = self._by_name.pop(name, None) if isinstance(name, str) else None
        if adapter is None:
            raise InvalidLoraAdapter(f"LoRA adapter {name!r:.80} is not served; served adapters: "
                                     f"{sorted(self._by_name) or 'none'}")
        self._retired.add(adapter.lora_id)
        self._drop_if_unused(adapter.lora_id)

    def id_of(self, name: str) -> int:
        """The lora_id of served adapter `name`. Raises UnknownLora listing the served names."""
        adapter = self._by_name.get(name)
        if adapter is None:
            raise UnknownLora(name, tuple(self._by_name))
        return adapter.lora_id

    def name_of(self, lora_id: Hashable) -> str:
        """The name of adapter `lora_id` (served or retiring)."""
        return self._by_id[lora_id].name

    def served(self) -> list[LoraInfo]:
        """The served adapters, by name."""
        return [LoraInfo(a.name, a.path, a.rank, a.lora_id, self.num_requests.get(a.name, 0),
                         self.num_loads.get(a.name, 0)) for a in sorted(self._by_name.values(), key=lambda a: a.name)]

    @property
    def num_held(self) -> int:
        """Adapters whose weights are held (served, or unloaded with requests still running)."""
        return len(self._by_id)

    @property
    def num_resident(self) -> int:
        """Adapters with a device copy now."""
        return len(self._resident)

    # ------------------------------------------------------------------ requests

    def acquire(self, lora_id: Hashable) -> None:
        """A request with adapter `lora_id` was added."""
        self._users[lora_id] = self._users.get(lora_id, 0) + 1
        name = self._by_id[lora_id].name
        self.num_requests[name] = self.num_requests.get(name, 0) + 1

    def release(self, lora_id: Hashable) -> None:
        """A request with adapter `lora_id` ended."""
        n = self._users.get(lora_id, 0) - 1
        if n > 0:
            self._users[lora_id] = n
        else:
            self._users.pop(lora_id, None)
            self._drop_if_unused(lora_id)

    def _drop_if_unused(self, lora_id: Hashable) -> None:
        if lora_id in self._retired and not self._users.get(lora_id):
            self._retired.discard(lora_id)
            self._resident.pop(lora_id, None)
            self._by_id.pop(lora_id, None)

    # ------------------------------------------------------------------ a step

    def step(self, entries: Sequence[tuple[Hashable | None, int]], device: torch.device) -> LoraStep | None:
        """The step's LoraStep from its entries in flat-batch order ((adapter id or None, tokens) each), the
        adapters put on the device first; None when no entry has an adapter."""
        rows: dict[Hashable, list[int]] = {}
        t = 0
        for lora_id, n in entries:
            if lora_id is not None:
                rows.setdefault(lora_id, []).extend(range(t, t + n))
            t += n
        if not rows:
            return None
        groups = [(torch.tensor(r, dtype=torch.int64, device=device), self._on_device(lid, set(rows)))
                  for lid, r in rows.items()]
        return LoraStep(groups, t)

    def _on_device(self, lora_id: Hashable, needed: set[Hashable]) -> LayerWeights:
        """The device copy of `lora_id`, loaded (and counted) when it has none; the least recently used copy
        that this step does not need is given back first when max_loras copies are held."""
        hit = self._resident.get(lora_id)
        if hit is not None:
            self._resident.move_to_end(lora_id)
            return hit
        if self.max_loras is not None:
            for old in list(self._resident):
                if len(self._resident) < self.max_loras:
                    break
                if old not in needed:
                    del self._resident[old]
        adapter = self._by_id[lora_id]
        copy = [{k: (a.to(self.device, self.dtype), b.to(self.device, self.dtype)) for k, (a, b) in layer.items()}
                for layer in adapter.layers]
        self._resident[lora_id] = copy
        self.num_loads[adapter.name] = self.num_loads.get(adapter.name, 0) + 1
        return copy
