"""Errors and warnings raised by the cost model.

Imports allowed: the standard library only.

Hierarchy::

    CostModelError (ValueError)    an unknown model or GPU name (the message lists the known ones), a
                                   configuration that cannot run (weights that do not fit, a TP degree
                                   that does not divide the heads), a bad size, a bad data file
      CostModelMemoryError         the weights (or the weights and one token of KV) do not fit in a GPU's
                                   memory; `with_pp` also names pp where more pipeline stages would make room
      CostModelFileError           a data file named on the command line is missing or cannot be opened
                                   (the commands exit 2, a usage error)
      CostModelDataError           a data file's contents are malformed or past a size limit (the commands
                                   exit 2, as for any unusable input)
    CostModelWarning (UserWarning) a configuration the cost model prices with a stated simplification
                                   (FP8 weights on a GPU without FP8 units run at the BF16 peak)
"""

from __future__ import annotations

from stallfree.core.errors import StallfreeError

__all__ = ["CostModelDataError", "CostModelError", "CostModelFileError", "CostModelMemoryError", "CostModelWarning"]


class CostModelError(StallfreeError, ValueError):
    """A bad name, size or configuration; the message names the field and the value."""


class CostModelMemoryError(CostModelError):
    """The weights, or the weights and one token of KV, do not fit in a GPU's memory. The message says what
    makes room in the terms every caller has (tp, the weight dtype); `with_pp` is the same message naming pp
    as well where more pipeline stages would make room (each stage holds its share of the layers), for the
    callers that offer pp, else None."""

    def __init__(self, message: str, with_pp: str | None = None) -> None:
        super().__init__(message)
        self.with_pp = with_pp


class CostModelFileError(CostModelError):
    """A data file (a step CSV, a model or GPU JSON) is missing, a directory or cannot be opened; the
    message names the path and the reason."""


class CostModelDataError(CostModelError):
    """A data file could be opened but its contents are malformed (not UTF-8, not CSV or JSON, a missing
    column, a bad value); the message names the path and, where there is one, the line and column."""


class CostModelWarning(UserWarning):
    """The configuration is priced, but under a simplification the message states."""
