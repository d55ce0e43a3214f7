"""Names of models and GPUs as Hugging Face, vLLM and nvidia-smi spell them, onto our presets: rules, not
string rewrites one by one ("meta-llama/Llama-2-70b-chat-hf" -> llama-2-70b, "NVIDIA H100 80GB HBM3" ->
h100-sxm), with a note where a GPU preset is only the nearest one.

Imports allowed: the standard library and stallfree.costmodel.
"""

from __future__ import annotations

import os
import re
from importlib import resources

from stallfree.costmodel.errors import CostModelError
from stallfree.costmodel.model import get_model

__all__ = ["GPU_NAMES", "GPU_RULES", "gpu_match", "reduce_model_name", "resolve_model"]

#: GPU names as runs and benchmark rows spell them (lower case, '-' and '_' alike, spaces removed) -> our
#: preset, for names the rules of `gpu_match` do not cover.
GPU_NAMES: dict[str, str] = {
    "nvidiageforcertx4090": "rtx-4090",
    "rtx4090": "rtx-4090",
    "rtxpro6000": "rtx-pro-6000",
    "nvidiartxpro6000blackwellserveredition": "rtx-pro-6000",
    "nvidiartxpro6000blackwellworkstationedition": "rtx-pro-6000",
    "rtxpro6000server": "rtx-pro-6000",
    "h100sxm": "h100-sxm",
    "nvidiah10080gbhbm3": "h100-sxm",
    "h200sxm": "h200",
    "nvidiah200": "h200",
    "b200sxm": "b200",
    "a100sxm": "a100-sxm-80gb",
    "nvidiaa100sxm480gb": "a100-sxm-80gb",
    "l40s": "l40s",
    "nvidial40s": "l40s",
}

#: What vLLM (torch.cuda.get_device_name) and nvidia-smi print, reduced by `_gpu_key` (lower case, "nvidia"
#: and "geforce" dropped, no spaces, '-' or '_'), matched in this order by the first pattern found in it ->
#: (our preset, why it is only the nearest preset, or None when it is the GPU itself). Which names these
#: products print is from memory of nvidia-smi output (flagged as such in docs/fidelity.md); the
#: datasheet figures in the notes are NVIDIA's product pages, also from memory.
GPU_RULES: tuple[tuple[str, str, str | None], ...] = (
    ("h100nvl", "h100-sxm",
     "H100 NVL (94 GB, PCIe card with NVLink bridge pairs) priced as the H100 SXM: no NVL preset; its HBM3 "
     "bandwidth (3.9 TB/s) is nearer the SXM's (3.35) than the PCIe card's (2.0), its tensor peak lower"),
    ("h100pcie", "h100-pcie", None),
    ("h100", "h100-sxm", None),  # "H100 80GB HBM3" is the SXM module; "H100 SXM5 80GB" likewise
    ("h200nvl", "h200",
     "H200 NVL (PCIe card, 600 W) priced as the H200 SXM: same memory, lower power and tensor clocks"),
    ("h200", "h200", None),
    ("gb200", "gb200", None),
    ("b200", "b200", None),
    ("h20", "h20", None),
    ("a100", "a100-sxm-80gb", None),  # refined by _a100_note (40 GB, PCIe)
    ("l40s", "l40s", None),
    ("l40", "l40", None),
    ("l4", "l4", None),
    ("a10g", "a10g", None),
    ("a10", "a10g",
     "A10 priced as the A10G: the same GA102 chip with 24 GB of GDDR6 at 600 GB/s; the A10's clocks and "
     "power (150 W) differ from the A10G's"),
    ("a40", "a40", None),
    ("rtxpro6000", "rtx-pro-6000", None),
    ("rtx4090", "rtx-4090", None),
    ("4090", "rtx-4090", None),
    ("mi300x", "mi300x", None),
)

#: Suffixes of a Hugging Face model name that do not change the architecture (lower case, removed in a
#: loop from the end): chat and instruct tunes, release tags, the "-hf" of converted checkpoints.
_MODEL_SUFFIXES = re.compile(r"(-instruct|-chat|-hf|-base|-it|-v0\.\d|-\d{4}|-fp8-dynamic|-fp8)$")


def reduce_model_name(hf_name: str) -> tuple[str, str | None]:
    """("meta-llama/Llama-2-70b-chat-hf" ->) ("llama-2-70b", None); ("...-FP8" ->) (..., "fp8"): the
    organisation dropped, a "meta-" prefix dropped, the suffixes of _MODEL_SUFFIXES removed."""
    base = hf_name.lower().rstrip("/").rsplit("/", 1)[-1].replace("_", "-")
    base = base.removeprefix("meta-")
    fixed = None
    while True:
        m = _MODEL_SUFFIXES.search(base)
        if m is None or m.start() == 0:
            break
        if m.group(0).startswith("-fp8"):
            fixed = "fp8"
        base = base[:m.start()]
    return base, fixed


def resolve_model(name: str) -> tuple[str, str | None]:
    """Return (our preset key or a config.json path, the weights' dtype when the name fixes it) for a model
    name: a preset name or a path as given; a Hugging Face id reduced (reduce_model_name) onto a preset key
    or one of the configs in costmodel/data/configs/ (models without a preset); else the name as given
    (get_model then names what it does not know)."""
    if name.endswith(".json"):
        return name, None
    try:
        return get_model(name).key, None
    except CostModelError:
        pass
    reduced, fixed = reduce_model_name(name)
    try:
        return get_model(reduced).key, fixed
    except CostModelError:
        pass
    ours = resources.files("stallfree.costmodel").joinpath("data", "configs", reduced, "config.json")
    if ours.is_file():
        return str(ours), fixed
    return name, None


def _key(name: str) -> str:
    return name.lower().replace("_", "-").replace(" ", "")


def _gpu_key(device: str) -> str:
    k = device.lower()
    for word in ("nvidia", "geforce", "tesla"):
        k = k.replace(word, "")
    return "".join(ch for ch in k if ch.isalnum() or ch == ".")


def gpu_match(device: str, memory_bytes: float | None = None) -> tuple[str, str | None]:
    """Return (our GPU preset, a note) for a device name as vLLM, nvidia-smi or a benchmark row spells
    it ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "NVIDIA L40S", "h200_sxm", "RTXPRO6000", ...).

    The note is None where the preset is that GPU, else why the preset is only the nearest one (an H100
    NVL, an A100 of 40 GB or on PCIe, an A10): the replay then takes the run's own memory size
    (`memory_bytes`, torch's total memory) for its KV capacity, and its steps are priced as the preset's.
    A name that matches nothing is returned as given with no note (our own preset names pass through;
    the cost model names an unknown one). So is a path (a name ending in .json, or one with a directory
    in it): the user's GPU file is read as that file, never as the preset its name happens to contain
    ("/tmp/a100_floor.json" is not the A100 preset).
    """
    if _is_path(device):
        return device, None
    if device in GPU_NAMES.values():
        return device, None
    table = GPU_NAMES.get(_key(device).replace("-", ""))
    if table is not None:
        return table, None
    k = _gpu_key(device)
    for pattern, preset, note in GPU_RULES:
        if pattern in k:
            if preset == "a100-sxm-80gb":
                note = _a100_note(k, memory_bytes)
            return preset, note
    return device, None


def _is_path(name: str) -> bool:
    """Whether `name` is a file's path rather than a GPU's name: it ends in .json (as get_gpu reads a
    file) or names a directory ("/", or the platform's separator)."""
    return name.lower().endswith(".json") or "/" in name or os.sep in name


def _a100_note(k: str, memory_bytes: float | None) -> str | None:
    small = "40gb" in k or (memory_bytes is not None and memory_bytes < 60e9)
    pcie = "pcie" in k
    if not small and not pcie:
        return None
    what = " and ".join(w for w, on in (("40 GB", small), ("PCIe", pcie)) if on)
    return (f"A100 {what} priced as the A100 SXM4 80GB (the only A100 preset and tables): "
            + ("its 40 GB hold less KV than the preset's 80 (`validate --against` derives KV from the run's "
               "own memory; elsewhere give --kv-tokens), and HBM2 at 1.56 TB/s against the 80 GB's 2.04 "
               "makes its decode steps slower than priced" if small else
               "its 80 GB PCIe card runs at 300 W with HBM2e at 1.94 TB/s")
            + ("; its GPUs talk over PCIe, not NVLink, so all-reduces at TP > 1 are priced fast" if pcie else ""))


