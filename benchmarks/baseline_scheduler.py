"""A straightforward implementation of the scheduler contract, kept as the speed baseline.

It scans the whole running list every step (the way most schedulers are first written): each decode
is a dict whose counters are bumped one by one, and finished requests are found by checking every
running request. Its plans are lists of (rid, num_tokens, is_prefill) tuples.
"""

from __future__ import annotations

from collections import deque


class ScanScheduler:
    """Contract-equivalent scheduler that does O(running) Python work per step."""

    def __init__(self, token_budget: int, max_seqs: int, kv_tokens: int) -> None:
        self.token_budget = token_budget
        self.max_seqs = max_seqs
        self.kv_free = kv_tokens
        self.waiting: deque[dict] = deque()
        self.running: list[dict] = []

    def add(self, rid, prompt_len: int, max_new: int) -> None:
        self.waiting.append({"rid": rid, "prompt": prompt_len, "max_new": max_new, "done": 0, "gen": 0})

    def schedule(self) -> list[tuple]:
        left = self.token_budget
        plan = []
        for r in self.running:
            if r["done"] == r["prompt"] and left > 0:
                plan.append((r, 1, False))
                left -= 1
        for r in self.running:
            if r["done"] < r["prompt"] and left > 0:
                n = min(r["prompt"] - r["done"], left)
                plan.append((r, n, True))
                left -= n
        while left > 0 and self.waiting and len(self.running) < self.max_seqs:
            r = self.waiting[0]
            need = r["prompt"] + r["max_new"]
            if need > self.kv_free:
                break
            self.waiting.popleft()
            self.kv_free -= need
            self.running.append(r)
            n = min(r["prompt"], left)
            plan.append((r, n, True))
            left -= n
        return plan

    def complete(self, plan: list[tuple]) -> list:
        emitted = []
        for r, n, is_prefill in plan:
            if is_prefill:
                r["done"] += n
                if r["done"] == r["prompt"]:
                    r["gen"] = 1
                    emitted.append(r["rid"])
            else:
                r["gen"] += 1
                emitted.append(r["rid"])
        keep = []
        for r in self.running:
            if r["gen"] >= r["max_new"]:
                self.kv_free += r["prompt"] + r["max_new"]
            else:
                keep.append(r)
        self.running = keep
        return emitted
