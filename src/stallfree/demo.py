"""`stallfree demo`: a scripted workload through the Scheduler, printing each step's plan.

Imports allowed: stallfree.core and the standard library.
"""

from __future__ import annotations

import argparse

from stallfree.core import Request, Scheduler
from stallfree.flags import add_scheduler_flags

__all__ = ["register", "run_demo"]


def run_demo(token_budget: int = 8) -> list[str]:
    """Run the design's hand trace plus a few arrivals; return one line per step.

    The script: a 4-token prompt (max_new 6) arrives at step 0, a 20-token prompt (max_new 3) at
    step 1, and a 3-token prompt (max_new 2) at step 3, with budget `token_budget` (tokens).
    """
    sched = Scheduler(token_budget=token_budget, max_seqs=4, kv_tokens=64)
    arrivals = {0: [Request("a", 4, 6)], 1: [Request("b", 20, 3)], 3: [Request("c", 3, 2)]}
    lines = []
    while sched.has_unfinished() or sched.step <= max(arrivals):
        for req in arrivals.get(sched.step, []):
            sched.add(req)
        plan = sched.schedule()
        emitted = sched.complete(plan)
        entries = " ".join(
            f"{c.rid}:{'prefill' if c.is_prefill else 'decode'}x{c.num_tokens}" for c in plan
        )
        done = " ".join(f"{rid}({why})" for rid, why in sched.last_finished.items())
        lines.append(
            f"step {plan.step:2d} | {plan.num_tokens:2d}/{token_budget} tokens | {entries or '-':40s}"
            f" | emitted {','.join(map(str, emitted)) or '-'}"
            f"{' | finished ' + done if done else ''} | kv_free {sched.kv_free}"
        )
    return lines




def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `demo` subcommand."""
    p = sub.add_parser("demo", help="print each step's plan for a small scripted workload")
    add_scheduler_flags(p, {"token_budget": 8}, why={"token_budget": "default 8: small enough to read every chunk"},
                        shared=False)
    p.set_defaults(func=lambda a: print("\n".join(run_demo(a.token_budget))) or 0)
