"""The simulator's own defaults, each written once (the core scheduler's are SchedulerConfig's, in
stallfree.core.config): the token budget and sequence limit of its commands and studies, the KV block
size, and the bundled trace's replay speed-up; and the names and defaults the commands' --help shows (batching
modes, executors, routers and their knobs, the time budget's cap, the LoRA rank, the P:D search's grids), kept
here so that building a parser imports none of the simulator (each is importable from its old module too).

Imports allowed: the standard library and the leaf stallfree._default_replica (the default replica, which
`budget` shares), so that building a parser imports none of the simulator.
"""

from __future__ import annotations

from stallfree._default_replica import DEFAULT_REPLICA

__all__ = [
    "BATCHING_MODES",
    "DEFAULT_ATTAINMENT",
    "DEFAULT_ADAPTER_SLOTS",
    "DEFAULT_AFFINITY_LOAD_FACTOR",
    "DEFAULT_AFFINITY_LOAD_MARGIN",
    "DEFAULT_AGGREGATED_BUDGETS",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_DECODE_BUDGETS",
    "DEFAULT_LORA_RANK",
    "DEFAULT_MAX_REPLICAS",
    "DEFAULT_MAX_SEQS",
    "DEFAULT_PREFILL_BUDGETS",
    "DEFAULT_PREFIX_THRESHOLD",
    "DEFAULT_RATE_SCALE",
    "DEFAULT_REPLICA",
    "DEFAULT_ROUTER_SEED",
    "DEFAULT_ROUTERS",
    "DEFAULT_SCALE_DOWN_DELAY_S",
    "DEFAULT_SCALE_INTERVAL_S",
    "DEFAULT_SESSION_LOAD_FACTOR",
    "DEFAULT_SESSION_LOAD_MARGIN",
    "DEFAULT_TIE_TOLERANCE",
    "DEFAULT_TOKEN_BUDGET",
    "DEFAULT_WINDOW_S",
    "EXECUTORS",
    "JOBS_LIMIT",
    "REPLICA_LIMIT",
    "ROUTERS",
    "SCALE_DECISION_LIMIT",
    "SEARCH_REPLICA_LIMIT",
    "TIME_BUDGET_CAP",
    "WINDOW_LIMIT",
]

#: Tokens per step when none is given (vLLM's max_num_batched_tokens default for chunked prefill).
DEFAULT_TOKEN_BUDGET = 2048

#: The most running requests per replica when none is given (vLLM's max_num_seqs default).
DEFAULT_MAX_SEQS = 256

#: Tokens per KV block of the paged scheduler (vLLM's default block size).
DEFAULT_BLOCK_SIZE = 16

#: The default speed-up of the bundled trace (docs/simulator.md explains the choice): under the commands'
#: default pricing (vLLM's kernel tables and the vllm engine profile) the default replica (Llama 3.3 70B,
#: 4 x H100 SXM, FP8) completes about 11.2 req/s when saturated, and 1.4 x the trace's 5.53 req/s =
#: 7.74 req/s is 69% of that: busy but stable (at 3, the scale before kernel pricing, it is 148%).
DEFAULT_RATE_SCALE = 1.4

#: Batching modes: the contract (chunked prefill) and the two baselines of stallfree.sim.run.baselines.
BATCHING_MODES = ("chunked", "prefill-first", "no-chunk")

#: Executor names for the command line; "process" is the default.
EXECUTORS = ("process", "ray", "serial")

#: prefix-affinity: tokens of cached prefix a replica must hold to win the request (default 256:
#: sixteen 16-token blocks, so that a shared system prompt counts but a chance one-block match does not).
DEFAULT_PREFIX_THRESHOLD = 256

#: prefix-affinity load cap: a replica may win a request for its cached prefix only while its
#: unfinished requests are at most max(load_factor x the least loaded replica's, that + load_margin).
#: The defaults (1.5 and 4 requests) are this project's choice from the grid measured on the Mooncake
#: trace in docs/cluster.md (the best hit rate there, at least-outstanding's TTFT). The rule has the
#: shape of SGLang's cache-aware router's (cache affinity while loads are within a relative or an
#: absolute margin, else the shortest queue), which compares the most and least loaded workers
#: rather than the candidate and the least loaded.
DEFAULT_AFFINITY_LOAD_FACTOR = 1.5

DEFAULT_AFFINITY_LOAD_MARGIN = 4

#: adapter-affinity: adapters a replica is taken to hold when the replicas' max_loras is not given to
#: make_router (the command line gives it: --max-loras).
DEFAULT_ADAPTER_SLOTS = 4

#: session-affinity load cap: a session leaves its replica only while that replica's unfinished
#: requests exceed max(2 x the least loaded replica's, that + 16). Looser than prefix-affinity's, since
#: moving a session throws its whole history's KV away (thousands of tokens to recompute, where a
#: shared prefix is cached on several replicas). This project's choice, measured in docs/simulator.md
#: ("Sessions"): on its conversation workload on 4 replicas the prefix-affinity cap (1.5, 4) moved
#: turns and cost 2.2 points of hit rate and more than doubled the p99 TTFT (237 against 108 ms);
#: (2, 16) moved none there.
DEFAULT_SESSION_LOAD_FACTOR = 2.0

DEFAULT_SESSION_LOAD_MARGIN = 16

#: random router: the default seed.
DEFAULT_ROUTER_SEED = 0

#: Router names for the command line.
ROUTERS = ("round-robin", "least-outstanding", "least-kv", "prefix-affinity", "random", "vllm-dp",
           "session-affinity", "adapter-affinity")

#: The default cap of a step's budget in time budget mode, tokens: far above what a step within a
#: TPOT-sized target holds, so that the target is what limits it.
TIME_BUDGET_CAP = 65536

#: vLLM's default max_lora_rank (EngineArgs.max_lora_rank = 16).
DEFAULT_LORA_RANK = 16

#: The P:D search's default token budget grids (tokens per step), small on purpose: each point is a
#: whole simulation. Aggregated: 1,024 to 4,096 around the default 2,048 (smaller: lower TPOT, less
#: throughput). Prefill side: 2,048 and 8,192 (no decodes share its steps, so larger chunks cost no
#: TPOT). Decode side: 128 (at most 128 requests fed per step, under the default max_seqs 256) and
#: 2,048 (no limit below max_seqs). These are this project's choices, not measured optima.
DEFAULT_AGGREGATED_BUDGETS = (1024, 2048, 4096)

DEFAULT_PREFILL_BUDGETS = (2048, 8192)

DEFAULT_DECODE_BUDGETS = (128, 2048)


#: --autoscale: seconds between decisions: KEDA's default pollingInterval (30 s).
DEFAULT_SCALE_INTERVAL_S = 30.0
#: The scale-down stabilisation window, s: the Kubernetes HPA's default
#: (--horizontal-pod-autoscaler-downscale-stabilization, 5 minutes).
DEFAULT_SCALE_DOWN_DELAY_S = 300.0
#: Attainment windows of the report, s.
DEFAULT_WINDOW_S = 300.0
#: The most scaling decisions one autoscaled run makes (its span / --scale-interval): each costs microseconds
#: (about 1 ms with 4,096 replica slots), and an interval of nanoseconds asked for billions. A million is 347
#: days of trace at the default 30 s, a day at 0.09 s.
SCALE_DECISION_LIMIT = 1_000_000
#: The most SLO attainment windows one autoscaled run reports (its span / --window): each is a row of the
#: summary and of --json (about 110 bytes of JSON), and a window of nanoseconds asked for 136 GiB. A million
#: is nine years of trace at the default 300 s, a day at 0.09 s.
WINDOW_LIMIT = 1_000_000
#: The most replicas a run or a search takes (--replicas, --autoscale's MAX, --disaggregate's P + D, plan's
#: --max-replicas): 64 times the largest fleet the docs and benchmarks run (64 replicas, plan's default
#: --max-replicas). Every slot is a whole simulated engine built up front: 4,096 replicas take about a
#: second on 30 requests (3 s autoscaled); 100,000 took 20 s, and more than 45 s autoscaled or split.
REPLICA_LIMIT = 4096
#: The most replicas `--disaggregate search` splits: it simulates every P:D split of them, each over a grid of
#: budgets (4 (N - 1) + 3 runs of N replicas by default), so its work grows as N squared: 32 replicas took 10 s
#: on 30 requests, and 4,096 would take days. 64 (plan's default --max-replicas) is 8 times the largest the docs
#: search; plan searches larger fleets (its splits bounded by each side's capacity).
SEARCH_REPLICA_LIMIT = 64
#: The most worker processes --jobs starts (sweep, tune, plan). A pool started by fork (Linux's default)
#: starts all its workers at once, each importing the simulator: --jobs 100000 forked until the machine ran
#: out of memory or processes. 1,024 is four times the cores of the largest single machines sold today.
JOBS_LIMIT = 1024

#: plan (and tune): the share of all requests that must meet both SLOs, the largest replica count tried per
#: shape, and the routers tried, the first leading the search.
DEFAULT_ATTAINMENT = 0.99
DEFAULT_MAX_REPLICAS = 64
DEFAULT_ROUTERS = ("least-outstanding", "round-robin", "least-kv")

#: tune: Goodputs within this fraction of the highest are tied: the end of a trace (when the last request
#: finishes) moves goodput by a few parts in 10^4 between budgets that serve the same requests.
DEFAULT_TIE_TOLERANCE = 0.001
