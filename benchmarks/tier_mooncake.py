"""The CPU KV tier against a GPU-only cache of the same total size, on the bundled Mooncake trace.

For X = 0, 1x, 4x, 16x of the default GPU cache G (the default replica's KV, Llama 3.3 70B on
4 x H100 SXM, FP8), at --rate-scale 0.5, blocks of 128, budget 2048, paged KV with prefix caching:
a run with GPU cache G and a CPU tier of X tokens (its copies priced over the host link), and beside
it a GPU-only run with G + X tokens. Prints one JSON line per run and writes them all to OUT.

    python benchmarks/tier_mooncake.py [OUT.json] [--cli] [--rate-scale X]

--cli prices steps as `stallfree simulate` does by default (vLLM's measured kernel tables and engine
profile where aiconfigurator-core is installed, and that engine's default scheduling behaviour);
without it, as the library's Setup does (the floor roofline, or the GPU's calibration). --rate-scale
(default 0.5) replays the trace at that share of its rate: under --cli the replica (G alone) sustains
about 1.03 requests/s on this trace, so 0.2 (0.68 requests/s) keeps it loaded but not saturated.
Runs one after another (each replays the whole trace; minutes
each on a loaded machine).
"""

from __future__ import annotations

import json
import sys
import time

from stallfree.sim.inputs.options import HardwareOptions, WorkloadOptions
from stallfree.sim.inputs.setup import Setup
from stallfree.sim.outputs.report import summarize_result
from stallfree.sim.run.simulator import simulate


def make_setup(kv: int | None, cpu: int, cli: bool, rate_scale: float = 0.5) -> Setup:
    if not cli:
        return Setup(WorkloadOptions(trace="mooncake", rate_scale=rate_scale), HardwareOptions(kv_tokens=kv),
                     TIERED(cpu))
    from stallfree.cli import build_parser
    from stallfree.sim.commands.setup_args import hardware_options, workload_options

    argv = ["simulate", "--trace", "mooncake", "--rate-scale", str(rate_scale), "--kv-policy", "paged",
            "--block-size", "128", "--enable-prefix-caching"] + (["--kv-tokens", str(kv)] if kv else [])
    args = build_parser().parse_args(argv)
    return Setup(workload_options(args), hardware_options(args), TIERED(cpu))


def TIERED(cpu: int) -> dict[str, object]:  # noqa: N802 - reads as the constant it stands for
    """The scheduler fields of this benchmark: paged, 128-token blocks, caching, a CPU tier of `cpu` tokens."""
    return {"kv_policy": "paged", "block_size": 128, "enable_prefix_caching": True, "cpu_kv_tokens": cpu}


def run(kv: int | None, cpu: int, cli: bool = False, rate_scale: float = 0.5) -> dict[str, object]:
    setup = make_setup(kv, cpu, cli, rate_scale)
    t0 = time.perf_counter()
    res = simulate(setup.workload, setup.config("chunked", 2048), setup.cost_model,
                   max_model_len=setup.context_length)
    s = summarize_result(res, None, None)
    tier = res.kv_tier or {}
    return {
        "gpu_kv_tokens": setup.kv_tokens, "cpu_kv_tokens": setup.cpu_kv_tokens,
        "kv_bytes_per_token": setup.kv_bytes_per_token,
        "host_GiB": setup.cpu_kv_tokens * setup.kv_bytes_per_token / 2**30,
        "hit_first": res.prefix_cache_hit_rate_first_admission, "hit_all": res.prefix_cache_hit_rate,
        "hit_first_gpu": tier.get("first_admission_hit_rate_gpu", res.prefix_cache_hit_rate_first_admission),
        "hit_first_cpu": tier.get("first_admission_hit_rate_cpu", 0.0),
        "hit_all_gpu": tier.get("hit_rate_gpu", res.prefix_cache_hit_rate),
        "hit_all_cpu": tier.get("hit_rate_cpu", 0.0),
        "bound": res.prefix_cache_hit_rate_bound,
        "ttft_p50_ms": s.get("median_ttft_ms"), "ttft_p99_ms": s.get("p99_ttft_ms"),
        "req_per_s": s.get("request_throughput"), "out_tok_per_s": s.get("output_throughput"),
        "preemptions": res.num_preemptions, "kv_loads": tier.get("kv_loads", 0),
        "kv_offloads": tier.get("kv_offloads", 0), "rejected": len(res.rejected),
        "wall_s": time.perf_counter() - t0, "hardware": setup.hardware,
    }


def main() -> None:
    cli = "--cli" in sys.argv
    rest = [a for a in sys.argv[1:] if a != "--cli"]
    rate_scale = 0.5
    if "--rate-scale" in rest:
        i = rest.index("--rate-scale")
        rate_scale = float(rest[i + 1])
        del rest[i:i + 2]
    out = rest[0] if rest else "tier_mooncake.json"
    g = make_setup(None, 0, cli, rate_scale).kv_tokens
    plan = [(g, 0)]
    for k in (1, 4, 16):
        plan += [(g, k * g), (g + k * g - (k * g) % 128, 0)]
    rows = []
    for kv, cpu in plan:
        rows.append(run(kv, cpu, cli, rate_scale))
        print(json.dumps(rows[-1]), flush=True)
        with open(out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
