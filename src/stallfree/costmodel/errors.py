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

from collections.abc import Callable
from typing import Any

from stallfree.core.errors import StallfreeError

__all__ = ["CostModelDataError", "CostModelError", "CostModelFileError", "CostModelMemoryError", "CostModelWarning",
           "FieldName"]

#: What a caller calls a cost-model field: "tp" -> "--tp" for a command's flag; `str` keeps the field's name.
FieldName = Callable[[str], str]


class CostModelError(StallfreeError, ValueError):
    """A bad name, size or configuration; the message names the field and the value. `wording`, where set,
    builds the same message with each field named by a FieldName (named()), for a command to say its flags."""

    def __init__(self, message: str, wording: Callable[[FieldName], str] | None = None) -> None:
        super().__init__(message)
        self.wording = wording

    def __reduce__(self) -> tuple[Any, ...]:
        # The wording is a closure, which does not pickle: an error sent from a worker process keeps its message.
        return type(self), self.args

    def named(self, name: FieldName) -> str:
        """The message with its fields (tp, pp, ep, dp_attention, ...) named by `name`; the message itself
        where it was raised without a wording (or came back from another process without one)."""
        wording: Callable[[FieldName], str] | None = getattr(self, "wording", None)
        return str(self) if wording is None else wording(name)


class CostModelMemoryError(CostModelError):
    """The weights, or the weights and one token of KV, do not fit in a GPU's memory. The message says what
    makes room in the terms every caller has (tp, the weight dtype); `with_pp` is the same message naming pp
    as well where more pipeline stages would make room (each stage holds its share of the layers), for the
    callers that offer pp, else None. `wording(name, with_pp)` builds either with the fields named by `name`
    (named(), named_with_pp())."""

    def __init__(self, message: str, with_pp: str | None = None,
                 wording: Callable[[FieldName, bool], str] | None = None) -> None:
        super().__init__(message, None if wording is None else lambda name: wording(name, False))
        self.with_pp = with_pp
        self.pp_wording = wording

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.with_pp)

    def named_with_pp(self, name: FieldName) -> str | None:
        """with_pp with its fields named by `name`; None where more stages would not make room."""
        wording: Callable[[FieldName, bool], str] | None = getattr(self, "pp_wording", None)
        if self.with_pp is None or wording is None:
            return self.with_pp
        return wording(name, True)


class CostModelFileError(CostModelError):
    """A data file (a step CSV, a model or GPU JSON) is missing, a directory or cannot be opened; the
    message names the path and the reason."""


class CostModelDataError(CostModelError):
    """A data file could be opened but its contents are malformed (not UTF-8, not CSV or JSON, a missing
    column, a bad value); the message names the path and, where there is one, the line and column."""


class CostModelWarning(UserWarning):
    """The configuration is priced, but under a simplification the message states."""
