"""The vLLM versions the adapter is written against, checked when stallfree.integrations.vllm is imported.

Imports allowed: the standard library and stallfree.core (vLLM itself only inside `check_vllm`).

The adapter calls vLLM's scheduler internals (its KV cache manager, its preemption path, the helpers that
build a SchedulerOutput), which vLLM does not keep stable between releases, so it accepts exactly the minor
versions it was written and tested against: vLLM 0.33 and 0.34 (the `vllm` extra pins `vllm>=0.33,<0.35`);
what differs between them is in stallfree.integrations.vllm._compat.
"""

from __future__ import annotations

from stallfree.core.errors import StallfreeError

__all__ = ["SUPPORTED", "SUPPORTED_RANGE", "VLLMVersionError", "check_vllm"]

#: (major, minor) of the vLLM releases the adapter supports.
SUPPORTED = ((0, 33), (0, 34))
#: The same as a pip requirement (the `vllm` extra's).
SUPPORTED_RANGE = "vllm>=0.33,<0.35"


class VLLMVersionError(StallfreeError, ImportError):
    """The installed vLLM is not a version the adapter supports; the message names both versions."""


def _major_minor(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def check_vllm(version: str | None = None) -> str:
    """Return the installed vLLM's version if the adapter supports it.

    Args:
        version: a version string to check instead of the installed one (for tests).

    Raises:
        ModuleNotFoundError: vLLM is not installed (name "vllm"); the message says how to install it.
        VLLMVersionError: it is another version than 0.33.x or 0.34.x; the message names the installed one.
    """
    if version is None:
        try:
            import vllm
        except ModuleNotFoundError as exc:
            if exc.name != "vllm":
                raise
            raise ModuleNotFoundError(
                "stallfree.integrations.vllm needs vLLM 0.33 or 0.34 (pip install 'stallfree[vllm]'), "
                "which is not installed",
                name="vllm",
            ) from None
        version = str(getattr(vllm, "__version__", "unknown"))
    if _major_minor(version) not in SUPPORTED:
        names = " and ".join(f"{a}.{b}.x" for a, b in SUPPORTED)
        raise VLLMVersionError(
            f"stallfree.integrations.vllm supports vLLM {names}, but vLLM {version} is installed: install "
            f"'{SUPPORTED_RANGE}' (the `vllm` extra), or use vLLM's own scheduler"
        )
    return version
