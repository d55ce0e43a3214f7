"""One flag vocabulary for every command: each scheduler knob has one flag, vLLM's name where vLLM has
the knob, and is parsed into one stallfree.core.SchedulerConfig.

Imports allowed: the standard library, stallfree._argtypes and stallfree.core (every subpackage's CLI
may import this leaf module; every subpackage may import the core).

A command says which knobs it has and their defaults (`add_scheduler_flags`), and reads them back as
the fields of a SchedulerConfig (`scheduler_options`, `scheduler_config`). The names users typed before
the vocabulary was one (`--budget`, `--token-budget`, `--max-seqs`, `--scheduler`, `--prefix-caching`)
still work for one release: each prints one line naming its replacement. A knob given under two of its
names is a usage error naming both. Errors from the library name SchedulerConfig fields; `flag_text`
words them as the flags of this vocabulary.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stallfree._argtypes import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_fraction,
    positive_int,
    tenant_weights,
    token_count,
)
from stallfree.core.config import SchedulerConfig

__all__ = [
    "KNOBS",
    "Knob",
    "add_renamed",
    "add_scheduler_flags",
    "flag_text",
    "given",
    "knob_flag",
    "scheduler_config",
    "scheduler_options",
]


#: Isolation between tenants under --fairness vtc when the command line does not set it (SchedulerConfig's
#: tenant_chunk_tokens and tenant_burst_tokens; the library's own default is off). Chosen on
#: benchmarks/tenants_sim.py's two-tenant traces under the default kernel pricing (docs/scheduling.md,
#: "Isolation"): with steps held to 768 tokens while another tenant is active (a multiple of the 256-row
#: tiles the measured GEMMs are priced in) and B = 2,048, the light tenant's p99 TTFT was 1.5-1.8x its p99
#: alone at 0.976-0.991 of FCFS's throughput, against ~5x without isolation.
VTC_CHUNK_TOKENS = 768
VTC_BURST_TOKENS = 2048
_VTC_DEFAULTS = ("tenant_chunk_tokens", "tenant_burst_tokens")


@dataclass(frozen=True, slots=True)
class Knob:
    """One scheduler knob on the command line.

    Attributes:
        flag: its name (vLLM's where vLLM has the knob).
        dest: the SchedulerConfig field it sets, or the command's own name for a knob that is not a field
            (async_scheduling, kv_tokens sizing, GiB of host memory); the attribute on the parsed namespace.
        help: what it means everywhere (a command adds why its default is what it is).
        kind: "int" (>= 1), "count" (>= 0), "tokens" (a count of tokens >= 1 with vLLM's suffixes: k, m, g
            decimal; K, M, G binary), "float" (> 0), "fraction" (>= 0), "share" (in (0, 1]), "weights"
            (NAME=WEIGHT,... each > 0),
            "bool" (--flag / --no-flag) or "choice".
        choices: the values of a "choice" knob.
        aliases: older names, accepted with one deprecation line naming `flag`.
        core: True when dest is a SchedulerConfig field.
        metavar: the value's name in --help.
        everywhere: every command that builds its scheduler from scheduler_options (simulate, sweep, tune,
            plan, serve, generate) has it with SchedulerConfig's default, without listing it: a new core
            option is declared here once and reaches every such command.
    """

    flag: str
    dest: str
    help: str
    kind: str = "int"
    choices: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    core: bool = True
    metavar: str | None = None
    everywhere: bool = False


_KNOB_LIST = (
    Knob("--max-num-batched-tokens", "token_budget", "token budget: the most tokens in one step", metavar="N",
         kind="tokens", aliases=("--token-budget", "--budget")),
    Knob("--max-num-seqs", "max_seqs", "the most running requests", metavar="N", aliases=("--max-seqs",)),
    Knob("--kv-policy", "kv_policy", "reserve: KV for prompt + max_new reserved at admission (the contract); "
         "paged: KV blocks taken as tokens are computed, preemption by recompute",
         kind="choice", choices=("reserve", "paged"), aliases=("--scheduler",)),
    Knob("--block-size", "block_size", "tokens per KV block", metavar="N"),
    Knob("--watermark", "watermark", "paged: fraction of KV blocks kept free at admission", kind="fraction",
         metavar="F"),
    Knob("--enable-prefix-caching", "enable_prefix_caching",
         "paged: reuse the KV blocks of cached prompt prefixes", kind="bool", aliases=("--prefix-caching",)),
    Knob("--scheduling-policy", "policy", "fcfs, or priority (lower values first, with aging)", kind="choice",
         choices=("fcfs", "priority")),
    Knob("--max-num-partial-prefills", "max_num_partial_prefills", "prompts partially prefilled at once "
         "(1: the contract)", metavar="K"),
    Knob("--max-long-partial-prefills", "max_long_partial_prefills", "of those, at most L long ones "
         "(default 1)", metavar="L"),
    Knob("--long-prefill-token-threshold", "long_prefill_token_threshold", "a prompt is long while more than T "
         "of its tokens are left (default: 4%% of --max-model-len)", metavar="T", kind="tokens"),
    Knob("--max-model-len", "max_model_len", "context length, tokens: prompt + max_new at most this",
         metavar="N", kind="tokens"),
    Knob("--kv-tokens", "kv_tokens", "KV cache capacity, tokens (overrides the sizing from memory)", metavar="N",
         kind="tokens"),
    Knob("--cpu-kv-tokens", "cpu_kv_tokens", "prefix caching: a CPU KV tier of N tokens (whole blocks): blocks "
         "the GPU evicts are kept in host memory and loaded back on a hit", metavar="N", kind="tokens"),
    Knob("--kv-offloading-size", "kv_offloading_size", "prefix caching: the CPU KV tier in GiB of host memory "
         "summed over the tensor-parallel ranks (converted with the model's KV bytes per token)", kind="float",
         core=False, metavar="GiB"),
    Knob("--gpu-memory-utilization", "gpu_memory_utilization", "fraction of GPU memory for weights and KV cache "
         "(sizes the KV cache)", kind="share", core=False, metavar="F"),
    Knob("--async-scheduling", "async_scheduling", "plan each step while the previous one runs, as vLLM's "
         "--async-scheduling (its default from 0.14.0): a request arriving during a step joins one step later",
         kind="bool", core=False),
    Knob("--max-loras", "max_loras", "the most distinct LoRA adapters among the running requests, so in one "
         "step (vLLM's --max-loras); none: no limit", metavar="N"),
    Knob("--max-lora-passes", "max_lora_passes", "with --max-loras: the most steps a request whose adapter "
         "cannot join may be passed over by later requests before it blocks the queue (0: strict FCFS)",
         kind="count", metavar="N"),
    Knob("--max-cpu-loras", "max_cpu_loras", "with --max-loras: LoRA adapters kept in host memory per replica "
         "(vLLM's --max-cpu-loras)", core=False, metavar="N"),
    Knob("--lora-rank", "lora_rank", "with --max-loras: the adapters' rank r, which sizes their loads and GEMMs "
         "(vLLM's --max-lora-rank bounds it)", core=False, metavar="R"),
    Knob("--fairness", "fairness", "fcfs: one queue, first come first served (the contract); vtc: admission takes "
         "the oldest request of the tenant with the least weighted service in tokens (virtual token counter), "
         "FCFS within a tenant", kind="choice", choices=("fcfs", "vtc"), everywhere=True),
    Knob("--tenant-weights", "tenant_weights", "vtc: tenant weights as NAME=WEIGHT,... (each > 0; a tenant not "
         "named weighs 1)", kind="weights", metavar="NAME=W,...", everywhere=True),
    Knob("--tenant-chunk-tokens", "tenant_chunk_tokens", "vtc: a prompt chunk of a tenant that leads (another "
         "tenant with requests running or waiting was served fewer tokens) keeps the step within C tokens "
         "(decodes and earlier chunks counted; at least C/4), and a less-served tenant's request set aside "
         "beside a partial prefill has its step alone; 0: off "
         f"(default under --fairness vtc: {VTC_CHUNK_TOKENS}, off with a CPU KV tier)", kind="count", metavar="C",
         everywhere=True),
    Knob("--tenant-burst-tokens", "tenant_burst_tokens", "vtc: a tenant that was idle may be served B tokens "
         "before the others are served again (its counter is lifted B / weight below theirs; default under "
         f"--fairness vtc: {VTC_BURST_TOKENS})", kind="count", metavar="B", everywhere=True),
    Knob("--enable-chunked-prefill", "enable_chunked_prefill", "accepted for vLLM's command lines: chunked "
         "prefill is always on here (the token budget is spent in chunks)", kind="bool", core=False),
)

#: Every knob by its dest.
KNOBS: Mapping[str, Knob] = {k.dest: k for k in _KNOB_LIST}

_TYPES = {"int": positive_int, "count": non_negative_int, "tokens": token_count, "float": positive_float,
          "fraction": non_negative_float, "share": positive_fraction, "weights": tenant_weights}


def knob_flag(dest: str) -> str:
    """The flag of a knob by its dest (a SchedulerConfig field), e.g. "token_budget" -> --max-num-batched-tokens.

    Raises:
        KeyError: no knob has that dest.
    """
    return KNOBS[dest].flag


def _note_name(parser: argparse.ArgumentParser, namespace: argparse.Namespace, dest: str, name: str,
               canonical: str, aliases: Sequence[str]) -> None:
    """Record which name set `dest`; refuse a second name for it; print the deprecation line of an alias."""
    seen = namespace.__dict__.setdefault("_knob_names", {})
    first = seen.get(dest)
    if first is not None and first != name:
        parser.error(f"{first} and {name} set the same option ({canonical}): give it once")
    seen[dest] = name
    if name in aliases:
        print(f"warning: {name} is deprecated and will be removed; use {canonical}", file=sys.stderr)


class _KnobAction(argparse.Action):
    """A valued knob: stores the value, notes the name used (two names: a usage error; an alias: a warning)."""

    def __init__(self, option_strings: Sequence[str], dest: str, canonical: str = "",
                 aliases: Sequence[str] = (), **kw: Any) -> None:
        super().__init__(option_strings, dest, **kw)
        self.canonical, self.aliases = canonical, tuple(aliases)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        _note_name(parser, namespace, self.dest, option_string or self.canonical, self.canonical, self.aliases)
        setattr(namespace, self.dest, values)


class _BoolKnobAction(argparse.BooleanOptionalAction):
    """An on/off knob (--flag / --no-flag); a bare alias (--prefix-caching) turns it on."""

    def __init__(self, option_strings: Sequence[str], dest: str, canonical: str = "",
                 aliases: Sequence[str] = (), **kw: Any) -> None:
        super().__init__([canonical], dest, **kw)
        self.option_strings = [*self.option_strings, *aliases]
        self.canonical, self.aliases = canonical, tuple(aliases)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        name = option_string or self.canonical
        _note_name(parser, namespace, self.dest, name.replace("--no-", "--", 1), self.canonical, self.aliases)
        setattr(namespace, self.dest, not name.startswith("--no-"))


def add_renamed(group: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str, *aliases: str,
                **kw: Any) -> None:
    """Add a valued flag of a command's own under its name and older `aliases`, each alias accepted with
    one deprecation line; the flag under two of its names is a usage error naming both."""
    group.add_argument(flag, *aliases, action=_KnobAction, canonical=flag, aliases=aliases, **kw)


def add_scheduler_flags(
    group: argparse.ArgumentParser | argparse._ArgumentGroup,
    defaults: Mapping[str, Any],
    why: Mapping[str, str] | None = None,
    with_aliases: bool = True,
    shared: bool = True,
) -> None:
    """Add the knobs named in `defaults` (by dest) to a command, each under its one flag and its aliases.

    The knobs a command has are remembered on the parser (`scheduler_options` reads those back), so a
    command without a knob leaves the field to SchedulerConfig's default or to the caller.

    Args:
        group: the parser or an argument group of it.
        defaults: dest -> the command's default (None: not given; for an on/off knob, False or True).
        shared: also add each `everywhere` knob the command does not have yet (False for a command that
            does not pass scheduler_options on, e.g. `validate`'s fixed replay and `demo`).
        with_aliases: False to leave out the older names (a command where one of them names another
            option, as `validate --token-budget` names its engine run's budget).
        why: dest -> the command's words on its default ("default 512: ..."), in place of "default X";
            a %% is written %%%%.

    Raises:
        KeyError: a dest that is no knob.
    """
    why = why or {}
    known = group._defaults.setdefault("_scheduler_knobs", ())  # an argument group shares its parser's defaults
    if shared:
        defaults = {**defaults, **{k.dest: _default_of(k) for k in _KNOB_LIST
                                   if k.everywhere and k.dest not in known and k.dest not in defaults}}
    for dest, default in defaults.items():
        knob = KNOBS[dest]
        if not with_aliases:
            knob = Knob(knob.flag, knob.dest, knob.help, knob.kind, knob.choices, (), knob.core, knob.metavar)
        text = knob.help
        if dest in why:
            text += f" ({why[dest]})"
        elif knob.kind != "bool" and default is not None:
            text += f" (default {default})"
        if knob.kind == "tokens":
            text += "; k, m, g = 10^3, 10^6, 10^9 and K, M, G = 2^10, 2^20, 2^30 tokens, as vLLM"
        if knob.aliases:
            text += f"; formerly {', '.join(knob.aliases)}"
        common: dict[str, Any] = {"dest": dest, "default": default, "help": text,
                                  "canonical": knob.flag, "aliases": knob.aliases}
        if knob.kind == "bool":
            group.add_argument(knob.flag, *knob.aliases, action=_BoolKnobAction, **common)
        elif knob.kind == "choice":
            group.add_argument(knob.flag, *knob.aliases, action=_KnobAction, choices=knob.choices, **common)
        else:
            group.add_argument(knob.flag, *knob.aliases, action=_KnobAction, type=_TYPES[knob.kind],
                               metavar=knob.metavar, **common)
    group._defaults["_scheduler_knobs"] = (*known, *defaults)


def _default_of(knob: Knob) -> Any:
    """SchedulerConfig's own default of a core knob's field (None for one without)."""
    field = SchedulerConfig.__dataclass_fields__.get(knob.dest)
    if field is None or knob.dest in _VTC_DEFAULTS:
        return None  # scheduler_options fills it: its default depends on --fairness
    return field.default


def given(args: argparse.Namespace, dest: str) -> str | None:
    """The name under which a knob was typed on the command line (its flag or an alias), or None."""
    names: dict[str, str] = vars(args).get("_knob_names", {})
    return names.get(dest)


def scheduler_options(args: argparse.Namespace) -> dict[str, Any]:
    """The SchedulerConfig fields the command's knobs set: each core knob the command has, with the value
    given or the command's default; a knob left at None is left out (the field's own default applies).
    Under fairness "vtc" the isolation knobs not given are VTC_CHUNK_TOKENS (none with a CPU KV tier, which
    the cap does not go with) and VTC_BURST_TOKENS; a tenant_chunk_tokens of 0 is left out (off)."""
    knobs = vars(args).get("_scheduler_knobs", ())
    options = {d: v for d in knobs if KNOBS[d].core and (v := vars(args)[d]) is not None}
    if options.get("fairness") == "vtc":
        tier = vars(args).get("cpu_kv_tokens") or vars(args).get("kv_offloading_size")
        if "tenant_chunk_tokens" not in options:
            if tier:
                print(f"note: --fairness vtc: isolation's step cap (--tenant-chunk-tokens, {VTC_CHUNK_TOKENS} by "
                      "default) stays off with a CPU KV tier, which turns off the set-aside it is part of",
                      file=sys.stderr)
            else:
                options["tenant_chunk_tokens"] = VTC_CHUNK_TOKENS
        options.setdefault("tenant_burst_tokens", VTC_BURST_TOKENS)
    if options.get("tenant_chunk_tokens") == 0:
        del options["tenant_chunk_tokens"]  # 0: isolation off (SchedulerConfig's None)
    return options


def scheduler_config(args: argparse.Namespace, **fields: Any) -> SchedulerConfig:
    """The SchedulerConfig of a parsed command line: its knobs (scheduler_options), then `fields` (what the
    command worked out itself, e.g. kv_tokens from the model and the memory) over them.

    Raises:
        InvalidConfig: a field out of range or options that do not go together, naming the field
            (flag_text words it as flags).
    """
    return SchedulerConfig(**{**scheduler_options(args), **fields})


_FIELD = re.compile(r"\b(" + "|".join(sorted((k.dest for k in _KNOB_LIST), key=len, reverse=True)) + r")\b")


def flag_text(message: str) -> str:
    """A library message worded in flags: every SchedulerConfig field a knob sets becomes its flag
    ("token_budget must be >= 1" -> "--max-num-batched-tokens must be >= 1")."""
    return _FIELD.sub(lambda m: KNOBS[m.group(1)].flag, message)
