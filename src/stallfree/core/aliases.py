"""The Scheduler's former spellings, kept for one release: each reads the one place the value now lives
(`config`, `stats()` or the `kv_manager`) and warns with DeprecationWarning naming it.

Imports allowed: the standard library and stallfree.core only.

A Scheduler reads each figure one way (`stats()`) and each option one way (`config`); docs/DESIGN.md
section 4's names (kv_free, num_waiting, num_running, has_unfinished(), request_state()) are not aliases.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

__all__ = ["DeprecatedAlias", "SchedulerAliases", "deprecated_aliases"]

T = TypeVar("T")


class DeprecatedAlias(Generic[T]):
    """A read-only class attribute that warns (DeprecationWarning) and returns `read(instance)`.

    Args:
        new: the spelling to use instead, as the warning names it (e.g. "scheduler.config.token_budget").
        read: a function of the instance that returns the value.
    """

    __slots__ = ("new", "read", "name")

    def __init__(self, new: str, read: Callable[[Any], T]) -> None:
        self.new = new
        self.read = read
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> DeprecatedAlias[T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...
    def __get__(self, obj: object, owner: type | None = None) -> T | DeprecatedAlias[T]:
        """Warn and read the value (the descriptor itself when read on the class)."""
        if obj is None:
            return self
        warnings.warn(
            f"Scheduler.{self.name} is deprecated and goes in the next release; use {self.new}",
            DeprecationWarning, stacklevel=2)
        return self.read(obj)

    def __set__(self, obj: object, value: object) -> None:
        """Refuse: the alias is read-only (AttributeError naming the spelling that holds the value)."""
        raise AttributeError(f"Scheduler.{self.name} is read-only (and deprecated); it reads {self.new}")


def deprecated_aliases(cls: type) -> list[str]:
    """The names of the DeprecatedAlias attributes of `cls` (and its bases), sorted."""
    return sorted({n for k in cls.__mro__ for n, v in vars(k).items() if isinstance(v, DeprecatedAlias)})


def _stat(name: str) -> DeprecatedAlias[Any]:
    return DeprecatedAlias(f"scheduler.stats().{name}", lambda s: getattr(s.stats(), name))


def _option(name: str) -> DeprecatedAlias[Any]:
    return DeprecatedAlias(f"scheduler.config.{name}", lambda s: getattr(s.config, name))


class SchedulerAliases:
    """The former spellings of Scheduler's options and figures (a base of Scheduler; each warns once read).

    Options read `config` (align_chunks and the partial-prefill limits resolved: config.chunks_aligned,
    config.partial_prefill_limits); figures read `stats()`; the per-request KV questions read `kv_manager`;
    has_request(rid) is `rid in scheduler`.
    """

    token_budget = _option("token_budget")
    max_seqs = _option("max_seqs")
    block_size = _option("block_size")
    aging_interval = _option("aging_interval")
    clock = _option("clock")
    decode_overflow = _option("decode_overflow")
    num_spec_tokens = _option("num_spec_tokens")
    priority_ties = _option("priority_ties")
    policy = _option("policy")
    kv_policy = _option("kv_policy")
    enable_prefix_caching = _option("enable_prefix_caching")
    max_num_partial_prefills = _option("max_num_partial_prefills")
    watermark = DeprecatedAlias("scheduler.config.watermark", lambda s: float(s.config.watermark))
    align_chunks = DeprecatedAlias("scheduler.config.chunks_aligned", lambda s: s.config.chunks_aligned)
    max_long_partial_prefills = DeprecatedAlias(
        "scheduler.config.partial_prefill_limits[1]", lambda s: s.config.partial_prefill_limits[1])
    long_prefill_token_threshold = DeprecatedAlias(
        "scheduler.config.partial_prefill_limits[2]", lambda s: s.config.partial_prefill_limits[2])
    kv_total = _stat("kv_total")
    num_blocks = _stat("num_blocks")
    watermark_blocks = _stat("watermark_blocks")
    num_free_blocks = _stat("num_free_blocks")
    num_used_blocks = _stat("num_used_blocks")
    num_evictable_blocks = _stat("num_evictable_blocks")
    num_evictions = _stat("num_evictions")
    num_preemptions = _stat("num_preemptions")
    num_recomputed_tokens = _stat("num_recomputed_tokens")
    prefix_cache_queries = _stat("prefix_cache_queries")
    prefix_cache_hits = _stat("prefix_cache_hits")
    prefix_cache_first_queries = _stat("prefix_cache_first_queries")
    prefix_cache_first_hits = _stat("prefix_cache_first_hits")
    now = _stat("now")
    blocks_needed = DeprecatedAlias("scheduler.kv_manager.blocks_needed", lambda s: s.kv_manager.blocks_needed)
    kv_needed = DeprecatedAlias("scheduler.kv_manager.kv_needed_for", lambda s: s.kv_manager.kv_needed_for)
    has_request = DeprecatedAlias("`rid in scheduler`", lambda s: s.__contains__)
    priority_key = DeprecatedAlias("scheduler.waiting_order() (the order the key gives)", lambda s: s._priority_key)
