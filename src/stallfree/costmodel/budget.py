"""The token budget priced in milliseconds: per budget, the step time, the decode-only step time and the
steps (and time) to a long prompt's first token, in design and full mode side by side.

Imports allowed: the standard library and stallfree.costmodel.

A step at budget B with D running decodes holds the D decodes and a chunk of B - D prompt tokens
(contract step 1 then 2/3 of docs/DESIGN.md section 1), so a prompt of P tokens needs ceil(P / (B - D))
steps to its first token; TTFT is the sum of those steps' times, each chunk at its own offset, the
decodes held at their given context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from stallfree.costmodel.errors import CostModelError
from stallfree.costmodel.roofline import CostModel, StepCost

__all__ = ["BudgetRow", "KernelFigures", "ModeFigures", "budget_rows", "kernel_figures"]


@dataclass(frozen=True, slots=True)
class ModeFigures:
    """One mode's figures for one budget (seconds).

    Attributes:
        step_s: a full step: the decodes plus a (budget - decodes)-token chunk at offset 0.
        decode_step_s: a step of the decodes alone.
        ttft_s: sum of the step times until the prompt's last chunk has run.
        parts: the full step's compute, memory and communication parts.
    """

    step_s: float
    decode_step_s: float
    ttft_s: float
    parts: StepCost


@dataclass(frozen=True, slots=True)
class BudgetRow:
    """Figures for one token budget (tokens), in each mode."""

    budget: int
    steps_to_first_token: int
    design: ModeFigures
    full: ModeFigures


def _figures(cm: CostModel, budget: int, decodes: int, context: int, prompt: int) -> ModeFigures:
    chunk = budget - decodes
    ttft = 0.0
    for start in range(0, prompt, chunk):
        size = min(chunk, prompt - start)
        ttft += cm.prefill_step_time(size, start, decodes, context, is_last=start + size == prompt)
    parts = cm.prefill_breakdown(chunk, 0, decodes, context, is_last=False)
    return ModeFigures(
        step_s=cm.prefill_step_time(chunk, 0, decodes, context, is_last=False),
        decode_step_s=cm.decode_step_time(decodes, context),
        ttft_s=ttft,
        parts=parts,
    )


def budget_rows(
    full: CostModel, budgets: list[int], decodes: int, context: int, prompt: int
) -> list[BudgetRow]:
    """Return one BudgetRow per budget, pricing each in design mode and with `full` (its efficiencies).

    Args:
        full: the full-mode cost model; design mode is full.replace(mode='design').
        budgets: token budgets (tokens per step), each > decodes.
        decodes: decodes running in every step.
        context: tokens each decode has in its KV cache.
        prompt: the arriving prompt's length, tokens (>= 1).

    Raises:
        CostModelError: an empty budget list, a budget <= decodes (no room for the prompt), a
            negative decode count or context, or a prompt < 1.
    """
    if not budgets:
        raise CostModelError("budgets: give at least one token budget")
    for name, value, low in (("decodes", decodes, 0), ("context", context, 0), ("prompt", prompt, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise CostModelError(f"{name} must be an integer >= {low}, got {value!r}")
    for b in budgets:
        if isinstance(b, bool) or not isinstance(b, int) or b <= decodes:
            raise CostModelError(
                f"budget {b!r} leaves no room for the prompt after {decodes} decodes; "
                "budgets must exceed --decodes"
            )
    design = full.replace(mode="design")
    rows = []
    for b in budgets:
        chunk = b - decodes
        rows.append(
            BudgetRow(
                budget=b,
                steps_to_first_token=-(-prompt // chunk),
                design=_figures(design, b, decodes, context, prompt),
                full=_figures(full, b, decodes, context, prompt),
            )
        )
    return rows


class _Prices(Protocol):
    def prefill_step_time(
        self, num_tokens: int, start: int = 0, num_decodes: int = 0, context_len: int = 0, is_last: bool = True
    ) -> float: ...

    def decode_step_time(self, num_decodes: int, context_len: int) -> float: ...


@dataclass(frozen=True, slots=True)
class KernelFigures:
    """A measured-kernel cost model's figures for one budget (seconds), as ModeFigures without parts.

    Attributes:
        budget: the token budget, tokens.
        step_s, decode_step_s, ttft_s: as ModeFigures.
    """

    budget: int
    step_s: float
    decode_step_s: float
    ttft_s: float


def kernel_figures(
    cm: _Prices, budgets: list[int], decodes: int, context: int, prompt: int
) -> list[KernelFigures]:
    """Return the step, decode-step and TTFT times of each budget priced by `cm` (a KernelCostModel;
    any model with CostModel's prefill_step_time and decode_step_time), in the steps of budget_rows.

    Raises:
        CostModelError: as budget_rows (call it first: it checks the arguments).
    """
    out = []
    for b in budgets:
        chunk = b - decodes
        if chunk < 1:
            raise CostModelError(f"budget {b!r} leaves no room for the prompt after {decodes} decodes")
        ttft = 0.0
        for start in range(0, prompt, chunk):
            size = min(chunk, prompt - start)
            ttft += cm.prefill_step_time(size, start, decodes, context, is_last=start + size == prompt)
        out.append(
            KernelFigures(
                b, cm.prefill_step_time(chunk, 0, decodes, context, is_last=False),
                cm.decode_step_time(decodes, context), ttft,
            )
        )
    return out
