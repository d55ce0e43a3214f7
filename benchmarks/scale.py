"""Benchmark: CPU seconds and peak memory of large simulations, this tree's `src` beside an older one.

Run:
    git archive main src | tar -x -C /tmp/old            # an older tree's sources (OLD_SRC = /tmp/old/src)
    PYTHONPATH=src python benchmarks/scale.py --against /tmp/old/src [--quick] [--rounds 1] [--split] [--json]
    STALLFREE_COMPILE=1 pip install --no-deps --target /tmp/native .   # the compiled build (docs/install.md)
    PYTHONPATH=src python benchmarks/scale.py --tree /tmp/native --against src ...   # compiled beside pure

Each run is one `python -m stallfree simulate ...` process per tree, the trees alternating run by run
(old, new, old, new, ...) so that both see the same machine load; its CPU seconds (user + system) and
peak resident memory come from the kernel's accounting of that child (os.wait4's rusage: ru_maxrss),
its wall seconds from the clock. With several rounds each figure is the median over them. Where both
trees ran a `--json` command, their figures are compared (every key but the wall times, `*wall_s`:
"same json"), and where they differ a line names the keys (a capacity estimate that changed on purpose
shows there as `runs[0].capacity_req_s` and `runs[0].load` alone).

The runs (`simulate` options; `--kernels none` is the roofline-family pricing, no option the default
pricing, vLLM's kernel tables where aiconfigurator-core is installed):
    100k x 32        --synthetic poisson --rate 300 --num-requests 100000 --replicas 32
                     --router least-outstanding --json --kernels none --no-range
    100k x 32 kern   the same with the default pricing
    1M x 64 (long)   --synthetic poisson --rate 600 --num-requests 1000000 --replicas 64
                     --router least-outstanding --json --kernels none --no-range  (skipped by --quick)
    100k x 32 no records   the 100k x 32 run with --no-records (this tree alone: an older one may lack
                     the flag; its figures agree with the run with records within the stated bounds)
    1M x 64 no rec (long)  the 1M x 64 run with --no-records (this tree alone)
    day (long)       --synthetic poisson --rate 100 --num-requests 8640000 --replicas 64
                     --router least-outstanding --json --kernels none --no-range --no-records: a day at
                     100 requests/s (this tree alone; skipped by --quick; its wall time is the figure to
                     read; with records it would hold about a billion step rows)
    default          `stallfree simulate` (the bundled Azure trace, default pricing)
    replay 9k        --num-requests 9000 --kernels vllm --json: the bundled Azure conversation trace's
                     first 9,000 requests replayed with kernel pricing
    trace .gz (long) --trace BIG.csv.gz --num-requests 100000 --replicas 32 --router least-outstanding
                     --json --kernels none --no-range: a large gzipped CSV trace (arrival_time,
                     prompt_len, output_len; Poisson arrivals at 300/s, lengths drawn from the bundled
                     trace's, seeded), generated once in the temporary folder, --trace-mb MB of text
                     (default 200, about 9 M rows). The reader decompresses and parses it line by line
                     (never the whole text in memory) and keeps every row (it sorts them by arrival),
                     then the first 100,000 requests run: the figure to read is what reading the whole
                     file costs. stallfree reads at most 1 GiB of text from one trace file
                     (stallfree._files.MAX_FILE_CHARS): a larger --trace-mb is refused in one line.

A child whose address space passes --mem-limit-gb (default 8) fails with a MemoryError instead of
taking the machine's memory; the table then says so.

With --split each child also reports the CPU seconds spent inside the event loop (every call of
stallfree.sim.run.loop.EventLoop.run, timed by time.process_time around it; a run with a range replays
it three times): the table's "loop s" columns, the rest being start-up, loading, workload and summary. A
compiled build's EventLoop takes no wrapper, so its loop column reads "-".
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

HERE = Path(__file__).resolve().parent

_CLUSTER = ["--synthetic", "poisson", "--rate", "300", "--num-requests", "100000", "--replicas", "32",
            "--router", "least-outstanding", "--json"]
#: (name, simulate options, long)
RUNS: tuple[tuple[str, list[str], bool], ...] = (
    ("100k x 32", [*_CLUSTER, "--kernels", "none", "--no-range"], False),
    ("100k x 32 kern", [*_CLUSTER, "--no-range"], False),
    ("1M x 64 (long)", ["--synthetic", "poisson", "--rate", "600", "--num-requests", "1000000", "--replicas", "64",
                        "--router", "least-outstanding", "--json", "--kernels", "none", "--no-range"], True),
    ("100k x 32 no records", [*_CLUSTER, "--kernels", "none", "--no-range", "--no-records"], False),
    ("1M x 64 no rec (long)", ["--synthetic", "poisson", "--rate", "600", "--num-requests", "1000000", "--replicas",
                               "64", "--router", "least-outstanding", "--json", "--kernels", "none", "--no-range",
                               "--no-records"], True),
    ("day 100/s x 64 (long)", ["--synthetic", "poisson", "--rate", "100", "--num-requests", "8640000", "--replicas",
                               "64", "--router", "least-outstanding", "--json", "--kernels", "none", "--no-range",
                               "--no-records"], True),
    ("default", [], False),
    ("replay 9k", ["--num-requests", "9000", "--kernels", "vllm", "--json"], False),
    ("trace .gz (long)", ["--trace", "{trace}", "--num-requests", "100000", "--replicas", "32", "--router",
                          "least-outstanding", "--json", "--kernels", "none", "--no-range"], True),
)


def write_trace(path: Path, megabytes: float, seed: int = 0) -> int:
    """Write a gzipped CSV trace of about `megabytes` MB of text to `path`, streamed (never held):
    arrival_time (Poisson at 300/s), prompt_len and output_len (pairs drawn from the bundled Azure
    trace). Returns its rows."""
    import gzip
    import random

    sys.path.insert(0, str(HERE.parent / "src"))
    from stallfree.sim.inputs.traces import load_bundled

    wl = load_bundled()
    pairs = list(zip(wl.prompt_lens, wl.output_lens, strict=True))
    rng = random.Random(seed)
    limit, written, rows, t = int(megabytes * 1e6), 0, 0, 0.0
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=1, newline="") as fh:
        fh.write("arrival_time,prompt_len,output_len\n")
        while written < limit:
            lines = []
            for _ in range(10_000):
                t += rng.expovariate(300.0)
                p, o = pairs[rng.randrange(len(pairs))]
                lines.append(f"{t:.6f},{p},{o}\n")
            block = "".join(lines)
            fh.write(block)
            written += len(block)
            rows += len(lines)
    return rows


#: Run as `python -c _TIMED_LOOP simulate ARGS` (--split): the CLI with EventLoop.run timed, the CPU
#: seconds inside it written to $SCALE_LOOP_FILE at exit.
_TIMED_LOOP = """
import os, runpy, sys, time
from stallfree.sim.run import loop
untimed, spent = loop.EventLoop.run, [0.0]
def run(self):
    t = time.process_time()
    try:
        return untimed(self)
    finally:
        spent[0] += time.process_time() - t
try:
    loop.EventLoop.run = run
except TypeError:  # the compiled build: its classes take no new attributes (no split, "-" in the table)
    spent[0] = None
sys.argv[0] = "stallfree"
try:
    runpy.run_module("stallfree", run_name="__main__", alter_sys=True)
finally:
    with open(os.environ["SCALE_LOOP_FILE"], "w") as fh:
        fh.write(repr(spent[0]))
"""


def measure(src: Path, args: list[str], mem_limit_bytes: int, out_path: str, split: bool = False) -> dict[str, Any]:
    """Run `python -m stallfree simulate ARGS` with PYTHONPATH=src; return its CPU s, peak MB, wall s
    (and with `split`, loop_s: the CPU seconds inside EventLoop.run).

    Its stdout goes to `out_path`; stderr is kept for the error message. Returns `error` (the last
    line of stderr) when the process fails.
    """
    env = dict(os.environ, PYTHONPATH=str(src))
    loop_file = out_path + ".loop"
    env["SCALE_LOOP_FILE"] = loop_file
    entry = ["-c", _TIMED_LOOP] if split else ["-m", "stallfree"]

    def limit() -> None:  # in the child, before exec
        resource.setrlimit(resource.RLIMIT_AS, (mem_limit_bytes, mem_limit_bytes))

    with open(out_path, "wb") as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, *entry, "simulate", *args], env=env, stdout=out,
                                stderr=err, preexec_fn=limit)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, so that Popen does not wait again
        err.seek(0)
        tail = err.read().decode(errors="replace").strip().splitlines()
    result: dict[str, Any] = {"cpu_s": usage.ru_utime + usage.ru_stime, "peak_mb": usage.ru_maxrss / 1024,
                              "wall_s": wall}
    if proc.returncode:
        result["error"] = tail[-1] if tail else f"exit {proc.returncode}"
    elif split:
        spent = ast.literal_eval(Path(loop_file).read_text(encoding="utf-8"))
        result["loop_s"] = None if spent is None else float(spent)
    return result


def _figures(text: str) -> Any:
    """The figures of a `--json` output: the parsed JSON without the keys ending in 'wall_s' (the
    wall time a simulation took, which differs from run to run)."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if not k.endswith("wall_s")}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    try:
        return strip(json.loads(text))
    except ValueError:
        return text


def _differences(old: Any, new: Any, path: str = "") -> list[str]:
    """The paths (`runs[0].load`) at which two parsed `--json` outputs differ, in order."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in dict.fromkeys([*old, *new])
                for d in _differences(old.get(k), new.get(k), f"{path}.{k}" if path else k)]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (o, n) in enumerate(zip(old, new, strict=True)) for d in _differences(o, n, f"{path}[{i}]")]
    return [] if old == new else [path or "(the whole output)"]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _median_of(values: Any) -> float | None:
    """The median of `values`, or None where a run has no such figure (the loop's split of a compiled build)."""
    known = [v for v in values if v is not None]
    return median(known) if known else None


def main() -> int:
    """Run the table (or JSON with --json)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", type=Path, help="an older tree's src folder (OLD_SRC)")
    ap.add_argument("--tree", type=Path, default=HERE.parent / "src",
                    help="the folder `stallfree` is imported from for the new side (default this tree's src; "
                    "a compiled build's install folder, e.g. NATIVE from `STALLFREE_COMPILE=1 pip install "
                    "--no-deps --target NATIVE .`)")
    ap.add_argument("--quick", action="store_true", help="skip the long runs (1M requests and a day on 64 replicas)")
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="run only this run (its name in the table; repeatable)")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds per run (default 1)")
    ap.add_argument("--mem-limit-gb", type=float, default=8.0, help="address-space limit of each child (GB)")
    ap.add_argument("--trace-mb", type=float, default=200.0,
                    help="the trace run's .gz trace, MB of text (default 200; stallfree reads at most 1 GiB)")
    ap.add_argument("--split", action="store_true",
                    help="also report each run's CPU seconds inside the event loop (EventLoop.run)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    trees = [("new", a.tree.resolve())]
    if a.against is not None:
        trees.insert(0, ("old", a.against.resolve()))
    limit = int(a.mem_limit_gb * 1e9)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        for name, args, long in RUNS:
            if (a.quick and long) or (a.only and name not in a.only):
                continue
            if "{trace}" in args:
                trace = os.path.join(tmp, "trace.csv.gz")
                if not os.path.exists(trace):
                    t0 = time.perf_counter()
                    num = write_trace(Path(trace), a.trace_mb)
                    print(f"  wrote {trace}: {num:,} rows, {os.path.getsize(trace) / 1e6:,.0f} MB gzipped, "
                          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
                args = [trace if x == "{trace}" else x for x in args]
            # A run without records is this tree's alone (an older one may not have the flag).
            run_trees = trees[-1:] if "--no-records" in args else trees
            got: dict[str, list[dict[str, Any]]] = {t: [] for t, _ in trees}
            outputs: dict[str, str] = {}
            for r in range(a.rounds):
                for tree, src in run_trees:
                    path = os.path.join(tmp, f"{tree}-{r}.out")
                    got[tree].append(measure(src, args, limit, path, a.split))
                    outputs[tree] = path
                    print(f"  {name} [{tree}] round {r + 1}: {got[tree][-1]}", file=sys.stderr)
            row: dict[str, Any] = {"run": name, "command": "stallfree simulate " + " ".join(args)}
            for tree, _ in trees:
                if not got[tree]:
                    row[tree] = {"error": "not run (--no-records)"}
                    continue
                ok = [m for m in got[tree] if "error" not in m]
                keys = ("cpu_s", "peak_mb", "wall_s", "loop_s") if a.split else ("cpu_s", "peak_mb", "wall_s")
                row[tree] = ({k: _median_of(m[k] for m in ok) for k in keys} if ok
                             else {"error": got[tree][-1]["error"]})
            if "--json" in args and len(trees) == 2 and all("error" not in row[t] for t, _ in trees):
                old_json, new_json = (_figures(Path(outputs[t]).read_text(encoding="utf-8")) for t in ("old", "new"))
                row["same_json"] = old_json == new_json
                row["json_differs_at"] = _differences(old_json, new_json)
            rows.append(row)
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    names = [t for t, _ in trees]
    head = f"{'run':<22}" + "".join(f"{t + ' CPU s':>11}{t + ' peak MB':>14}{t + ' wall s':>12}"
                                    + (f"{t + ' loop s':>12}" if a.split else "") for t in names)
    if len(names) == 2:
        head += f"{'CPU new/old':>12}{'mem new/old':>12}{'same json':>10}"
    print(head)
    for row in rows:
        line = f"{row['run']:<22}"
        for t in names:
            f = row[t]
            if "error" in f:
                line += f"{'failed: ' + f['error'][:33]:>37}" + (" " * 12 if a.split else "")
            else:
                line += f"{f['cpu_s']:>11.1f}{f['peak_mb']:>14.0f}{f['wall_s']:>12.1f}"
                if a.split:
                    line += f"{_fmt(f['loop_s'], '.1f'):>12}"
        if len(names) == 2:
            old, new = row["old"], row["new"]
            both = "error" not in old and "error" not in new
            line += f"{_fmt(new['cpu_s'] / old['cpu_s'] if both else None, '.2f'):>12}"
            line += f"{_fmt(new['peak_mb'] / old['peak_mb'] if both else None, '.2f'):>12}"
            same = row.get("same_json")
            line += f"{'-' if same is None else ('yes' if same else 'NO'):>10}"
        print(line)
    for row in rows:
        if row.get("json_differs_at"):
            where = row["json_differs_at"]
            more = f" and {len(where) - 6:,} more" if len(where) > 6 else ""
            print(f"{row['run']}: the --json outputs differ at {', '.join(where[:6])}{more}")
    print("commands: " + "; ".join(f"{r['run']}: {r['command']}" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
