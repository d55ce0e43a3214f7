"""How the reports write a rate and a share, the same in the commands' lines and tables and in the plots'
titles (stallfree.sim.commands.common re-exports rate_text for the commands).

Imports allowed: the standard library.
"""

from __future__ import annotations

import math

__all__ = ["rate_text", "share_text"]


def rate_text(rate: float, decimals: int = 2) -> str:
    """A rate (requests/s, or per GPU) as the reports write it: `decimals` decimals ("6.60" at two), or two
    significant digits where those would show fewer ("0.0040" below 0.1 req/s at two; "0.00062" below 0.01 at
    three), so that a light load never reads 0.00."""
    if 0 < rate < 10.0 ** (1 - decimals):
        return f"{rate:.{1 - math.floor(math.log10(rate))}f}"
    return f"{rate:,.{decimals}f}"


def share_text(share: float) -> str:
    """A fraction as a whole percentage, "under 1%" where that would round a share that is there to 0%."""
    return "under 1%" if 0 < share < 0.005 else f"{share:.0%}"
