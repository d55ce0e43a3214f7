"""How the reports write a rate and a share, the same in the commands' lines and tables and in the plots'
titles (stallfree.sim.commands.common re-exports rate_text for the commands).

Imports allowed: the standard library.
"""

from __future__ import annotations

import math

__all__ = ["rate_text", "share_text"]


def rate_text(rate: float) -> str:
    """A rate in requests/s as the reports write it: two decimals ("6.60"), or two significant digits below
    0.1 req/s ("0.0040"), where two decimals would read a light load as 0.00."""
    if 0 < rate < 0.1:
        return f"{rate:.{1 - math.floor(math.log10(rate))}f}"
    return f"{rate:,.2f}"


def share_text(share: float) -> str:
    """A fraction as a whole percentage, "under 1%" where that would round a share that is there to 0%."""
    return "under 1%" if 0 < share < 0.005 else f"{share:.0%}"
