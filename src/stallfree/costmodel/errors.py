"""Errors and warnings raised by the cost model.

Imports allowed: the standard library only.

Hierarchy::

    CostModelError (ValueError)    an unknown model or GPU name (the message lists the known ones), a
                                   configuration that cannot run (weights that do not fit, a TP degree
                                   that does not divide the heads), a bad size, a bad data file
    CostModelWarning (UserWarning) a configuration the cost model prices with a stated simplification
                                   (FP8 weights on a GPU without FP8 units run at the BF16 peak)
"""

from __future__ import annotations

from stallfree.core.errors import StallfreeError

__all__ = ["CostModelError", "CostModelWarning"]


class CostModelError(StallfreeError, ValueError):
    """A bad name, size or configuration; the message names the field and the value."""


class CostModelWarning(UserWarning):
    """The configuration is priced, but under a simplification the message states."""
