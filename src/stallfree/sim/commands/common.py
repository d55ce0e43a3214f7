"""What the simulator's commands share: the workload and hardware options, the error guard that
turns expected errors into one line and an exit status, and the value types of their options.

Imports allowed: the standard library, stallfree._argtypes, stallfree.core and stallfree.sim.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stallfree._argtypes import list_items
from stallfree._files import writable_file_problem
from stallfree.core.errors import InvalidConfig, StallfreeError
from stallfree.flags import KNOBS, flag_text
from stallfree.sim.defaults import BATCHING_MODES, EXECUTORS
from stallfree.sim.outputs.wording import rate_text, share_text

if TYPE_CHECKING:
    from stallfree.sim.studies.executors import Executor

# The simulator's modules (workloads, setup, runs, executors) are imported where a command runs, never
# here: building the parsers (`stallfree simulate --help`) must stay cheap.

__all__ = [
    "CliError",
    "ENGINE_DEFAULT_WHY",
    "EXIT_SERVED_NOTHING",
    "OUT_FILES",
    "PROGRESS_DELAY_S",
    "ProgressLine",
    "add_executor_flags",
    "counted",
    "duration",
    "ensure_writable_dir",
    "ensure_writable_file",
    "executor_from_args",
    "flag_message",
    "flag_words",
    "guard",
    "modes",
    "positive_duration",
    "rate_text",
    "share_text",
    "refuse_writing_the_trace",
    "rejection_warning",
    "served_nothing",
    "warn_rejections",
]


#: How a behaviour knob's default is worded in --help: the pricing engine's (docs/simulator.md).
ENGINE_DEFAULT_WHY = ("the engine whose kernel tables price the run (vLLM >= 0.14.0: on); the contract's "
                      "(off) under --kernels none")


def counted(n: int, noun: str) -> str:
    """A count and its noun, singular for one: "1 simulation", "2 simulations" (nouns that take an s)."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


class CliError(StallfreeError):
    """A user error to print as one line; `code` is the exit status (the commands' rule: 2 for any input
    error, 1 for a failure while running, 3 for SLOs missed, 4 for a run that served nothing)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def duration(text: str) -> float:
    """An argparse type: a non-negative duration ("200ms", "1s", bare = ms), in seconds."""
    from stallfree.core.metrics import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def think_time(text: str) -> float | str:
    """An argparse type for --think-time: a duration ("200ms", "1s", bare = ms), in seconds, or a think-time
    distribution in seconds for --synthetic sessions ("fixed:S", "uniform:LO,HI", "exponential:MEAN",
    "lognormal:MEDIAN,SIGMA"; stallfree.sim.inputs.sessions.parse_think_spec), kept as its text."""
    if ":" in text:
        from stallfree.sim.inputs.sessions import parse_think_spec

        try:
            parse_think_spec(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text.strip()
    return duration(text)


def positive_duration(text: str) -> float:
    """An argparse type: a duration > 0 ("50ms", "1s", bare = ms), in seconds.

    Raises:
        argparse.ArgumentTypeError: anything else, in one message that says what is accepted (not
            duration's "finite and >= 0" for a negative value, which would suggest that 0 is).
    """
    problem = f"must be a duration > 0 (50ms, 1s; bare = ms), got {text!r}"
    try:
        value = duration(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(problem) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(problem)
    return value


#: Below these, an SLO read as milliseconds is likely meant as seconds: warn (TTFT, TPOT), in s.
_SLO_WARN_BELOW = {"--slo-ttft": 0.010, "--slo-tpot": 0.001}


def _slo(flag: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = positive_duration(text)
        if value < _SLO_WARN_BELOW[flag] and text.strip()[-1:].isdigit():  # a bare number, read as ms
            print(f"warning: {flag} {text} is read as {value * 1e3:g} ms (a bare number is ms); "
                  f"write {text.strip().lower().removesuffix('ms')}s for seconds", file=sys.stderr)
        return value

    parse.__name__ = "duration"  # argparse names the type in its error: "invalid duration value"
    return parse


def slo_ttft(text: str) -> float:
    """An argparse type for --slo-ttft: a duration > 0, s; under 10 ms, one warning line on stderr
    saying how it was read (a bare number is ms), since a TTFT objective that small is seldom meant."""
    return _slo("--slo-ttft")(text)


def slo_tpot(text: str) -> float:
    """An argparse type for --slo-tpot: a duration > 0, s; under 1 ms, one warning line on stderr."""
    return _slo("--slo-tpot")(text)


def modes(text: str) -> list[str]:
    """An argparse type: a comma-separated list of batching modes."""
    found = list_items(text)
    if not found:
        raise argparse.ArgumentTypeError(f"expected batching modes ({', '.join(BATCHING_MODES)}), got {text!r}")
    for m in found:
        if m not in BATCHING_MODES:
            raise argparse.ArgumentTypeError(f"unknown batching mode {m!r} (choose from {', '.join(BATCHING_MODES)})")
    return found


#: The exit status of a run that served no request (every one rejected or refused): the figures describe nothing.
EXIT_SERVED_NOTHING = 4


def served_nothing(command: str, rows: list[dict[str, Any]]) -> int | None:
    """EXIT_SERVED_NOTHING, with one line on stderr saying why, when no run of `rows` (summaries or sweep rows)
    completed a request; None when any did. The report has been printed by then: its rejection lines name
    the reasons (over the context length, never fits the KV cache)."""
    if not rows or any(r.get("completed") for r in rows):
        return None
    rejected = sum(int(r.get("rejected") or 0) for r in rows)
    why = f" ({rejected:,} requests rejected: see the lines above)" if rejected else ""
    print(f"stallfree {command}: error: no run served any request{why}; nothing to report (exit "
          f"{EXIT_SERVED_NOTHING})", file=sys.stderr)
    return EXIT_SERVED_NOTHING


def rejection_warning(label: str, num_requests: int, by_reason: dict[str, int], first: str | None) -> str:
    """The one-line warning for rejected requests: how many, of how many, by reason, and the first reason."""
    total = sum(by_reason.values())
    reasons = ", ".join(f"{n:,} {_REASON_TEXT.get(k, k)}" for k, n in sorted(by_reason.items()))
    text = f"warning: {label}: rejected {total:,} of {num_requests:,} requests ({reasons})"
    return text + (f"; first: {first}" if first else "")


def warn_rejections(rows: list[dict[str, Any]], num_requests: int) -> None:
    """Print one warning line on stderr when any run of a sweep or a tune rejected requests."""
    hit = [r for r in rows if r.get("rejected")]
    if not hit:
        return
    first = hit[0]
    label = (f"{len(hit)} of {counted(len(rows), 'run')} rejected requests; the first, budget "
             f"{first.get('token_budget'):,}")
    print(rejection_warning(label, num_requests, first.get("rejected_by_reason") or {}, None), file=sys.stderr)


_REASON_TEXT = {
    "context_length": "over the context length (context_length)",
    "kv_capacity": "never fit the KV cache (kv_capacity)",
}


def ensure_writable_dir(path: Path, flag: str) -> None:
    """Check that `path` can be created (with parents) and a file written in it, leaving nothing behind.

    The directories it makes for the check are removed again, so that a run which then fails, is
    interrupted (Ctrl-C) or is killed (SIGTERM) leaves no empty `path`: the writers create it when they
    write the first file.

    Raises:
        CliError: it is a file, or cannot be created or written (exit 1), naming the flag and the reason.
    """
    if path.exists() and not path.is_dir():
        raise CliError(f"{flag} {path}: exists and is not a directory", 2)
    made: list[Path] = []  # the missing directories, outermost first
    for parent in [path, *path.parents]:
        if parent.exists():
            break
        made.insert(0, parent)
    try:
        for d in made:
            d.mkdir()
        probe = path / ".stallfree-write-check"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise CliError(f"{flag} {path}: cannot write there ({exc.strerror or exc})", 2) from None
    finally:
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:
                pass


def ensure_writable_file(path: Path, flag: str, suffixes: tuple[str, ...] = (".csv", ".json")) -> None:
    """Check, before anything runs, that `path` can be written as one of `suffixes`: a name ending in one
    of them, not a directory, in a directory that exists, and a file the process can open for writing (it is
    opened for appending, which changes nothing, and removed again if it did not exist: permission bits do
    not tell, e.g. for root under /proc, or for a name too long).

    Raises:
        CliError: otherwise, naming the flag, the path and the reason (stallfree._files.writable_file_problem;
            exit 2).
    """
    problem = writable_file_problem(path, flag, suffixes)
    if problem is not None:
        raise CliError(problem, 2)


#: The files each command's --out DIR may write (shell patterns: a tag names the run).
OUT_FILES = {
    "simulate": ("summary.json", "requests-*.csv", "steps-*.csv", "cdf.png", "timeline.png", "autoscale.png"),
    "sweep": ("sweep.csv", "sweep.json", "tradeoff.png", "cdf.png", "kv_sweep.json", "kv_sweep.png",
              "cpu_tier_sweep.json", "cpu_tier_sweep.png"),
    "tune": ("tune.json", "tune.png"),
    "plan": ("plan.json", "plan.csv", "plan.png"),
}


def refuse_writing_the_trace(args: argparse.Namespace, path: Path, flag: str,
                             names: tuple[str, ...] | None = None) -> None:
    """Refuse an output path that would overwrite the --trace file, before anything runs.

    Args:
        path: the file an option writes (`names` None), or the directory it writes `names` in (shell
            patterns, as OUT_FILES).
        flag: the option, as the message names it.

    Raises:
        CliError: the file written (or one of `names` in the directory) is the --trace file, the same
            file by another path or link included (exit 2).
    """
    trace = getattr(args, "trace", None)
    if not trace or not Path(trace).is_file():
        return  # no trace file: the bundled trace, a name such as 'mooncake', or a missing file
    trace_path = Path(trace)

    def same(a: Path, b: Path) -> bool:
        try:
            return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
        except OSError:
            return False

    if names is None:
        hit = same(path, trace_path)
    else:
        hit = same(path, trace_path.parent) and any(fnmatch.fnmatchcase(trace_path.name, n) for n in names)
    if hit:
        where = "is the --trace file" if names is None else f"would overwrite the --trace file {trace}"
        raise CliError(f"{flag} {path}: {where}; give another path", 2)


def add_executor_flags(p: argparse.ArgumentParser) -> None:
    """Add --executor and --ray-address (sweep, tune)."""
    p.add_argument(
        "--executor", choices=EXECUTORS, default="process",
        help="where the simulations run: process (a pool of --jobs workers, the default), ray (one Ray task "
        "each) or serial (this process)",
    )
    p.add_argument(
        "--ray-address", metavar="ADDR",
        help="--executor ray: the cluster (HOST:PORT, ray://HOST:PORT or auto; default RAY_ADDRESS, else a "
        "local Ray instance)",
    )


def executor_from_args(args: argparse.Namespace) -> Executor:
    """The executor of --executor, --jobs and --ray-address.

    Raises:
        CliError: Ray missing, an address with another executor, --jobs above 1 with the serial one, or a Ray
            head that does not answer (exit 2).
    """
    from stallfree.sim.studies.executors import ExecutorError, make_executor

    if args.executor == "serial" and args.jobs is not None and args.jobs > 1:
        raise CliError(f"--jobs {args.jobs} sizes a pool of worker processes; --executor serial runs every "
                       "simulation in this process: drop one of them", 2)
    try:
        return make_executor(args.executor, args.jobs or os.cpu_count() or 1, args.ray_address)
    except ExecutorError as exc:
        raise CliError(flag_message(exc), 2) from None


#: The flag of each option whose field name is not the flag's name with underscores (the others are
#: "--" + the field with dashes: `cpu_kv_tokens` is --cpu-kv-tokens).
_FIELD_FLAGS = {"kv_offloading_gib": "--kv-offloading-size", "kv_sizes": "--kv-tokens",
                "cpu_sizes": "--cpu-kv-tokens", "address": "--ray-address"}

#: A field named in a library message: `name`, or `name`=value ('quoted' or up to a blank or : ; ).
_FIELD_MENTION = re.compile(r"`(\w+)`(?:=('[^']*'|[^\s:;)]+))?")


def flag_words(message: str) -> str:
    """A library error's message worded in flags, as a user typed them. The simulator's library names
    each option by its field in backticks (stallfree.sim.inputs.options.SetupError); each becomes its flag, and
    `field`=value becomes "--flag value" (`kv_policy`='paged' is "--kv-policy paged"). The rest of the
    text is kept, and a message without backticked fields comes back unchanged."""

    def flag(m: re.Match[str]) -> str:
        name, value = m.group(1), m.group(2)
        text = _FIELD_FLAGS.get(name) or (KNOBS[name].flag if name in KNOBS else "--" + name.replace("_", "-"))
        return text if value is None else f"{text} {value.strip(chr(39))}"

    return _FIELD_MENTION.sub(flag, message)


def flag_message(exc: BaseException) -> str:
    """flag_words of an exception's message."""
    return flag_words(str(exc))


def guard(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Wrap a command so that expected errors become one line on stderr and an exit status."""

    def run(args: argparse.Namespace) -> int:
        prog = f"stallfree {args.command}"
        try:
            return int(func(args))
        except CliError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return exc.code
        except BrokenPipeError:
            raise  # the reader went away (`stallfree simulate | head`): stallfree.cli.main stops quietly
        except (StallfreeError, ValueError, OSError, RuntimeError) as exc:
            # Imported here, once a command has failed: they are the simulator's (cheap --help).
            from stallfree.sim.inputs.options import SetupError
            from stallfree.sim.inputs.workload import TraceError, TraceFileError
            from stallfree.sim.run.result import SimulationError
            from stallfree.sim.studies.executors import ExecutorError

            if isinstance(exc, TraceFileError):  # the file --trace names is missing or unreadable: name the flag
                hint = (" (the bundled traces: leave --trace out for the Azure 2023 conversation trace, or "
                        "--trace mooncake)") if "not found" in str(exc) else ""
                print(f"{prog}: error: --trace: {flag_message(exc)}{hint}", file=sys.stderr)
                return 2
            if isinstance(exc, TraceError):  # a malformed trace: its message names the file and line
                print(f"{prog}: error: {flag_message(exc)}", file=sys.stderr)
                return 2
            if isinstance(exc, SetupError):
                print(f"{prog}: error: {flag_message(exc)}", file=sys.stderr)
                return 2 if exc.usage else 1
            if isinstance(exc, InvalidConfig):  # a scheduler field out of range: the flags as typed
                print(f"{prog}: error: {flag_text(str(exc))}", file=sys.stderr)
                return 2
            if isinstance(exc, (SimulationError, ValueError, OSError, ExecutorError)):
                print(f"{prog}: error: {flag_message(exc)}", file=sys.stderr)
                return 1
            raise

    return run


def progress_bar() -> Any:
    """A transient rich progress bar on stderr ("simulating", bar, done/total, elapsed); off when stderr
    is not a terminal, where the bar could not be erased and would leave a blank line before whatever
    the command prints next (an error, the report)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("simulating"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not sys.stderr.isatty(),
    )


#: Seconds a command runs before its progress line appears: shorter runs print nothing extra.
PROGRESS_DELAY_S = 10.0


class ProgressLine:
    """A one-line status on stderr for a long run ("simulating: <phase>, 12 s"): it appears once the run
    has taken `delay` seconds, is redrawn every `interval` seconds from a background thread and is
    erased when the block ends, so the report that follows starts on a clean line. Nothing is written
    when the stream is not a terminal (a pipe, a file, a test's capture), so redirected output and
    --json are the same with or without it.

    Args:
        what: the first word of the line.
        delay: seconds before the line first appears (PROGRESS_DELAY_S by default).
        interval: seconds between redraws.
        stream: where to draw (sys.stderr, read when the block starts, by default).
    """

    def __init__(self, what: str = "simulating", delay: float | None = None, interval: float = 1.0,
                 stream: Any = None) -> None:
        import threading

        self.what, self.interval, self._phase = what, interval, ""
        self.delay = PROGRESS_DELAY_S if delay is None else delay
        self._stream, self._stop = stream, threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._drawn = False
        self._start = 0.0

    def phase(self, text: str) -> None:
        """Name what the run is doing now; the next redraw shows it."""
        self._phase = text

    @property
    def current(self) -> str:
        """The phase named last ("" before any)."""
        return self._phase

    def __enter__(self) -> ProgressLine:
        import threading
        import time

        if self._stream is None:
            self._stream = sys.stderr
        isatty = getattr(self._stream, "isatty", None)
        if callable(isatty) and isatty():
            self._start = time.monotonic()
            if self.delay <= 0:
                self._draw()
            self._thread = threading.Thread(target=self._draw_loop, name="stallfree-progress", daemon=True)
            self._thread.start()
        return self

    def _draw(self) -> None:
        """Draw the line once (unless the block has ended)."""
        import time

        elapsed = time.monotonic() - self._start
        text = f"{self.what}: {self._phase}, {elapsed:.0f} s" if self._phase else f"{self.what}, {elapsed:.0f} s"
        with self._lock:
            if self._stop.is_set():
                return
            # "\r" back to the line's start, "\x1b[K" erases what a longer line left.
            self._stream.write(f"\r{text}\x1b[K")
            self._stream.flush()
            self._drawn = True

    def _draw_loop(self) -> None:
        # With no delay the first line is drawn by __enter__ itself, so it is there however short the run.
        if self.delay > 0:
            if self._stop.wait(self.delay):
                return
            self._draw()
        while not self._stop.wait(self.interval):
            self._draw()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._drawn:
                self._stream.write("\r\x1b[K")
                self._stream.flush()
                self._drawn = False
