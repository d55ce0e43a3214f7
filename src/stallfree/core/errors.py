"""Exceptions raised by the scheduler core.

Imports allowed: the standard library only.

Hierarchy::

    StallfreeError                   base of every error the project raises on purpose (core, cost model,
    │                                simulator, engine, server): `except StallfreeError` catches them all
    └── SchedulerError               base of everything stallfree.core raises on purpose
    ├── RequestRejected (ValueError)  add() refused a request: bad field, duplicate rid, can never fit
    ├── InvalidConfig (ValueError)    a constructor argument is out of range or of the wrong type
    └── SchedulerStateError (RuntimeError)
                                      a call out of order: schedule() twice without complete(),
                                      complete() of a stale plan, a bad `stopped` rid

Every error is raised before any state changes, so the caller may catch it and carry on.
"""

from __future__ import annotations

__all__ = ["InvalidConfig", "RequestRejected", "SchedulerError", "SchedulerStateError", "StallfreeError"]


class StallfreeError(Exception):
    """Base class of every error stallfree raises on purpose, in every package (docs/server.md lists them)."""


class SchedulerError(StallfreeError):
    """Base class of the errors stallfree.core raises on purpose."""


class RequestRejected(SchedulerError, ValueError):
    """add() refused a request; the message names the field and its value. Nothing was queued."""


class InvalidConfig(SchedulerError, ValueError):
    """A scheduler was constructed with a value out of range; the message names it."""


class SchedulerStateError(SchedulerError, RuntimeError):
    """A call came out of order (schedule() twice, complete() of a stale plan); nothing changed."""


def check_positive_int(field: str, value: object, exc: type[ValueError] = InvalidConfig) -> int:
    """Return `value` if it is an int >= 1 (bools are not ints here).

    Raises:
        exc (InvalidConfig by default): `value` is not an int, is a bool, or is < 1; the message
            names `field` and `value`.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise exc(f"{field} must be an integer >= 1, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise exc(f"{field} must be an integer >= 1, got {value!r}")
    return value
