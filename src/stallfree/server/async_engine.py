"""The background engine loop: one task that steps the engine while there is work, in a worker thread,
and hands each request's outputs to an async iterator.

Requests join and leave only between steps: add_request() and abort() queue their change and the loop
applies it before the next step, so the engine is never called from two threads at once and the event
loop never waits on a forward pass. A client that goes away has its request aborted; its KV is freed
at the next step boundary.

Imports allowed: the standard library and the torch-free stallfree.core.errors, stallfree.engine.errors
and stallfree.engine.outputs. The engine is an EngineClient (stallfree.engine.outputs): LLMEngine, or a
test fake implementing the same protocol; the loop reads nothing else of it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import AsyncIterator, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from stallfree.core import Request as CoreRequest
from stallfree.core.errors import StallfreeError
from stallfree.core.request import DEFAULT_TENANT
from stallfree.engine.errors import StepFailed
from stallfree.engine.outputs import Admission, EngineClient, EngineStats

__all__ = [
    "AsyncEngine",
    "EngineDead",
    "QueueFull",
    "RequestFailed",
    "RequestRecord",
    "RequestStream",
    "StepFailed",
    "StepObserver",
]

logger = logging.getLogger("stallfree.server")

# After this many consecutive failed steps the engine is declared dead: every request fails and new
# ones are refused, rather than spinning on an engine whose state is broken.
_MAX_CONSECUTIVE_FAILURES = 3


class QueueFull(StallfreeError):
    """max_waiting requests will wait already and this one would too; it was not queued (HTTP 429)."""


class RequestFailed(StepFailed):
    """One request failed in the engine while the step went on (its output had finish_reason "error",
    e.g. its sampling failed); a StepFailed, so routes answer it as they answer a failed step (500)."""


class EngineDead(StallfreeError, RuntimeError):
    """The engine loop has stopped (shut down, or too many consecutive failed steps)."""


@dataclass(slots=True)
class RequestRecord:
    """Timestamps and counts of one request, for latency metrics.

    Units: times are seconds from time.perf_counter(); counts are tokens.
    """

    rid: Hashable
    arrival: float
    num_prompt_tokens: int = 0
    num_generated: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    tenant: str = DEFAULT_TENANT
    lora: str | None = None  # the LoRA adapter's name; None: the base model


class StepObserver(Protocol):
    """What the loop reports to (the Prometheus metrics implement it)."""

    def on_tokens(self, record: RequestRecord, num_new: int, now: float) -> None:
        """A request emitted `num_new` tokens at `now` (record not yet updated)."""

    def on_finish(self, record: RequestRecord) -> None:
        """A request ended (record complete, finish_reason set): "stop" or "length" from the engine,
        "abort" (the client left, or aborted it) or "error" (a failed step, a dead engine). Every
        request the engine accepted ends here exactly once."""

    def on_step(self, stats: EngineStats, duration_s: float) -> None:
        """A step ended after `duration_s` seconds; `stats` is the engine's snapshot after it."""

    def on_queue_change(self, stats: EngineStats) -> None:
        """Requests were added or aborted between steps; `stats` is the engine's snapshot after that."""


@dataclass(slots=True)
class _Pending:
    rid: Hashable
    prompt: Any
    params: Any
    priority: int
    num_prompt_tokens: int
    max_tokens: int
    future: asyncio.Future[None]
    cache_salt: str | None = None
    core: CoreRequest | None = None  # the scheduler's Request for it, for the admission test (max_waiting)
    tenant: str | None = None
    lora: str | None = None


@dataclass(slots=True)
class _Live:
    record: RequestRecord
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)


class RequestStream:
    """An async iterator over one request's RequestOutput objects; it ends after the finished one.

    Raises (from iteration):
        StepFailed: a step that held this request raised, or (RequestFailed) the engine failed this
            request alone.
        EngineDead: the engine loop stopped before the request finished.

    Leaving the iteration early (break, cancellation, a client disconnect) aborts the request.
    """

    def __init__(self, owner: AsyncEngine, rid: Hashable, live: _Live) -> None:
        self.rid = rid
        self.record = live.record
        self._owner = owner
        self._queue = live.queue
        self._done = False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        try:
            while not self._done:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self._done = True
                    raise item
                if item.finished:
                    self._done = True
                yield item
        finally:
            if not self._done:
                self._done = True
                self._owner.abort(self.rid)

    def abort(self) -> None:
        """Abort the request (a no-op once it finished)."""
        if not self._done:
            self._done = True
            self._owner.abort(self.rid)


class AsyncEngine:
    """Own the engine and the one task that steps it; serve requests as async iterators.

    The engine is touched only by the loop: add_request and abort calls are queued and applied
    between steps on the event loop thread, and step() runs in a single dedicated worker thread.

    Args:
        engine: the engine (an EngineClient).
        max_waiting: the most requests that may wait for admission. A request that would wait (the
            next step will not admit it, for want of a slot, KV or budget, or because others wait
            ahead of it) is refused with QueueFull when this many will wait already; one that the
            next step will admit is never refused. None means unbounded.
        observer: receives per-token, per-request and per-step events (metrics).
        clock: the time source in seconds (time.perf_counter).
        max_waiting_tokens: the most prompt tokens of requests added and not yet at their first token
            (waiting, or in prefill); a request whose prompt would take them past it is refused with
            QueueFull. None means unbounded.
    """

    def __init__(
        self,
        engine: EngineClient,
        max_waiting: int | None = None,
        observer: StepObserver | None = None,
        clock: Callable[[], float] = time.perf_counter,
        max_waiting_tokens: int | None = None,
    ) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.max_waiting_tokens = max_waiting_tokens
        #: Prompt tokens of the requests added and not yet at their first token, in all and per tenant.
        self.queued_tokens = 0
        self.queued_tokens_by_tenant: dict[str, int] = {}
        #: LoRA adapter name -> its requests added and not ended (waiting or running); 0 stays listed.
        self.active_by_lora: dict[str, int] = {}
        self.observer = observer
        self.clock = clock
        self.num_steps = 0
        self.num_failed_steps = 0
        self.dead_reason: str | None = None
        self._pending: dict[Hashable, _Pending] = {}
        self._aborts: set[Hashable] = set()
        self._live: dict[Hashable, _Live] = {}
        self._added: set[Hashable] = set()
        # The engine's state as read after the last step or queue change (never during a step).
        self._stats: EngineStats = engine.stats()
        self._admission: Admission = engine.admission()
        self._lora = engine.info.enable_lora
        #: The engine's served LoRA adapters (LoraInfo) as read after the last step or change ([] without LoRA).
        self.lora_snapshot: list[Any] = engine.lora_adapters() if self._lora else []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._stopping = False
        # Calls to run on the engine at the next step boundary (LoRA loads and unloads), with their futures.
        self._calls: list[tuple[Callable[[], Any], asyncio.Future[Any]]] = []

    # ------------------------------------------------------------------ state

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted: queued here for the next step boundary plus waiting in the engine."""
        return len(self._pending) + self._stats.num_waiting

    @property
    def num_will_wait(self) -> int:
        """Requests that will still wait after the next step: those the engine will not admit, plus the
        ones queued here that will not fit what it leaves (in order; once one waits, all behind it do)."""
        return self._pending_waiting(None)[0]

    @property
    def stats(self) -> EngineStats:
        """The engine's snapshot after the last step or queue change."""
        return self._stats

    @property
    def num_live(self) -> int:
        """Requests this loop is serving (pending, waiting or running)."""
        return len(self._pending) + len(self._live)

    @property
    def is_running(self) -> bool:
        """True while the loop task is alive and the engine is not dead."""
        return self._task is not None and not self._task.done() and self.dead_reason is None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the loop task in the running event loop (idempotent)."""
        if self._task is not None and not self._task.done():
            return
        if self._stopping or self.dead_reason is not None:
            raise EngineDead(self.dead_reason or "the engine loop was stopped")
        self._wake = asyncio.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stallfree-step")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="stallfree-engine-loop")

    async def stop(self, outcome: str = "error", message: str = "the server is shutting down") -> None:
        """Finish the step in flight, fail every live request with EngineDead(message), and stop the loop.

        Args:
            outcome: the finish_reason the live requests end with ("error"; "abort" when a graceful
                shutdown's deadline cuts them).
            message: the EngineDead message their clients get.
        """
        self._stopping = True
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        self._fail_all(EngineDead(message), outcome)
        self._abort_all_added()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ------------------------------------------------------------------ requests

    async def add_request(
        self, rid: Hashable, prompt: Any, params: Any, *, num_prompt_tokens: int = 0, max_tokens: int = 0,
        priority: int = 0, cache_salt: str | None = None, tenant: str | None = None, lora: str | None = None,
    ) -> RequestStream:
        """Queue a request for the next step boundary; return its stream once the engine accepted it.

        Args:
            rid: a unique request id.
            prompt: a string or a list of token ids, passed to engine.add_request.
            params: the engine's SamplingParams.
            num_prompt_tokens: prompt length in tokens (for metrics).
            max_tokens: its max_tokens (kept with the request; whether it will wait is the engine's
                admission rule's answer, Admission).
            priority: passed to engine.add_request.
            cache_salt: passed to engine.add_request (its prefix-cache salt) when not None.
            tenant: passed to engine.add_request (the API key's tenant) when not None.
            lora: passed to engine.add_request (the LoRA adapter's name) when not None.

        Raises:
            QueueFull: max_waiting requests will wait already and this one would too, or its prompt tokens
                would take the prompt tokens not yet prefilled past max_waiting_tokens; nothing was queued.
            EngineDead: the loop has stopped.
            Exception: whatever engine.add_request raised (ValueError for a bad request).
        """
        if self.dead_reason is not None or self._stopping:
            raise EngineDead(self.dead_reason or "the server is shutting down")
        if rid in self._pending or rid in self._live:
            raise ValueError(f"request id {rid!r} is already in use")
        core = self._admission.request(rid, prompt, params, priority, cache_salt,
                                       **({} if tenant is None else {"tenant": tenant}),
                                       **({} if lora is None else {"lora": lora}))
        mwt = self.max_waiting_tokens
        if mwt is not None and self.queued_tokens + num_prompt_tokens > mwt:
            raise QueueFull(
                f"the server is overloaded: {self.queued_tokens} prompt tokens wait to be prefilled and this "
                f"request brings {num_prompt_tokens} (--max-waiting-tokens {mwt}); retry later"
            )
        if self.max_waiting is not None:
            ahead, waits = self._pending_waiting(core)
            if waits and ahead >= self.max_waiting:
                raise QueueFull(
                    f"the server is overloaded: {ahead} request(s) will wait for admission "
                    f"(--max-waiting {self.max_waiting}); retry later"
                )
        self.start()
        assert self._wake is not None
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        record = RequestRecord(rid, self.clock(), num_prompt_tokens=num_prompt_tokens,
                               tenant=tenant or DEFAULT_TENANT, lora=lora)
        self._pending[rid] = _Pending(rid, prompt, params, priority, num_prompt_tokens, max_tokens, future,
                                      cache_salt, core, tenant, lora)
        self._queue_tokens(record, num_prompt_tokens)
        self._count_lora(record, 1)
        live = _Live(record)
        self._live[rid] = live
        self._wake.set()
        try:
            await future
        except asyncio.CancelledError:
            self.abort(rid)
            raise
        except BaseException:
            if self._live.pop(rid, None) is not None:
                self._count_lora(record, -1)
            raise
        return RequestStream(self, rid, live)

    async def call_between_steps(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the engine at the next step boundary (never during a step) and return its result,
        or raise what it raised; used for LoRA loads and unloads, which leave the running requests alone.

        Raises:
            EngineDead: the loop has stopped.
            Exception: whatever fn raised.
        """
        if self.dead_reason is not None or self._stopping:
            raise EngineDead(self.dead_reason or "the server is shutting down")
        self.start()
        assert self._wake is not None
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls.append((fn, future))
        self._wake.set()
        return await future

    def _apply_calls(self) -> bool:
        if not self._calls:
            return False
        calls, self._calls = self._calls, []
        for fn, future in calls:
            if future.done():
                continue
            try:
                future.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - handed to the caller, the loop goes on
                future.set_exception(exc)
        return True

    def abort(self, rid: Hashable) -> None:
        """Abort a request at the next step boundary (its KV is freed then); no-op if unknown.

        It ends with finish_reason "abort" (observer.on_finish), unless it already ended.
        """
        if rid in self._live or rid in self._pending:
            self._end(rid, "abort")
            self._aborts.add(rid)
            if self._wake is not None:
                self._wake.set()

    async def generate(self, rid: Hashable, prompt: Any, params: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """Add a request (keywords as add_request) and yield its RequestOutput objects; leaving early aborts it."""
        stream = await self.add_request(rid, prompt, params, **kwargs)
        async for out in stream:
            yield out

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        try:
            while not self._stopping:
                self._wake.clear()
                changed = self._apply_aborts() | self._apply_calls() | self._apply_adds()
                if changed:
                    self._read_engine()
                    if self.observer is not None:
                        self.observer.on_queue_change(self._stats)
                if not self.engine.has_unfinished():
                    if not self._pending and not self._aborts and not self._calls:
                        await self._wake.wait()
                    continue
                start = self.clock()
                try:
                    outputs = await loop.run_in_executor(self._executor, self.engine.step)
                except Exception as exc:  # noqa: BLE001 - any step failure must not kill the server
                    self._on_step_failure(exc)
                    continue
                self.num_failed_steps = 0
                self.num_steps += 1
                self._dispatch(outputs, self.clock())
                self._read_engine()
                if self.observer is not None:
                    self.observer.on_step(self._stats, self.clock() - start)
                if not outputs and not self._stats.last_step_tokens:
                    await asyncio.sleep(0.001)  # an empty step: let the event loop breathe
        except Exception as exc:  # noqa: BLE001 - a bug here must fail requests, not hang them
            logger.exception("engine loop crashed")
            self.dead_reason = f"the engine loop crashed: {exc!r}"
            self._fail_all(EngineDead(self.dead_reason))

    def _apply_aborts(self) -> bool:
        if not self._aborts:
            return False
        for rid in self._aborts:
            pending = self._pending.pop(rid, None)
            if pending is not None:
                if not pending.future.done():
                    pending.future.cancel()
                continue
            if rid in self._added:
                self._added.discard(rid)
                try:
                    self.engine.abort(rid)
                except KeyError:
                    pass  # it finished in the step that just ended
        self._aborts.clear()
        return True

    def _apply_adds(self) -> bool:
        if not self._pending:
            return False
        pending, self._pending = self._pending, {}
        for p in pending.values():
            try:
                extra: dict[str, Any] = {} if p.cache_salt is None else {"cache_salt": p.cache_salt}
                if p.tenant is not None:
                    extra["tenant"] = p.tenant
                if p.lora is not None:
                    extra["lora"] = p.lora
                self.engine.add_request(p.rid, p.prompt, p.params, priority=p.priority, **extra)
            except Exception as exc:  # noqa: BLE001 - the handler turns it into an HTTP error
                gone = self._live.pop(p.rid, None)
                if gone is not None:
                    self._queue_tokens(gone.record, -gone.record.num_prompt_tokens)
                    self._count_lora(gone.record, -1)
                if not p.future.done():
                    p.future.set_exception(exc)
                continue
            self._added.add(p.rid)
            if not p.future.done():
                p.future.set_result(None)
        return True

    def _read_engine(self) -> None:
        """Read the engine's stats and admission rule (on the loop, between steps)."""
        self._stats = self.engine.stats()
        self._admission = self.engine.admission()
        if self._lora:
            self.lora_snapshot = self.engine.lora_adapters()

    def _pending_waiting(self, new: CoreRequest | None) -> tuple[int, bool]:
        """(how many requests will wait after the engine's next step, those queued here included; whether
        `new`, queued behind them, adds one more): the engine's own admission rule as of the last step
        boundary (Admission.waiting_after, the scheduler planning that step on a copy), so exact under
        both KV policies, priority, cached prefixes and partial prefills. A request the engine would
        refuse (None) is left out. Cost: a copy of the scheduler and a schedule() on it, twice with `new`."""
        adm = self._admission
        queued = [p.core for p in self._pending.values() if p.core is not None]
        ahead = adm.waiting_after(queued)
        if new is None:
            return ahead, False
        return ahead, adm.waiting_after([*queued, new]) > ahead

    def _queue_tokens(self, rec: RequestRecord, delta: int) -> None:
        """Count prompt tokens not yet prefilled (added, no first token yet), in all and per tenant."""
        self.queued_tokens += delta
        by = self.queued_tokens_by_tenant
        by[rec.tenant] = by.get(rec.tenant, 0) + delta

    def _count_lora(self, rec: RequestRecord, delta: int) -> None:
        """Count a request of a LoRA adapter in or out of active_by_lora."""
        if rec.lora is not None:
            self.active_by_lora[rec.lora] = self.active_by_lora.get(rec.lora, 0) + delta

    def _dispatch(self, outputs: list[Any], now: float) -> None:
        obs = self.observer
        for out in outputs:
            live = self._live.get(out.rid)
            if live is None:
                if out.finished:
                    self._added.discard(out.rid)
                continue  # aborted by us; the engine's last word is not needed
            rec = live.record
            n_new = len(out.new_token_ids)
            if out.num_prompt_tokens:
                rec.num_prompt_tokens = out.num_prompt_tokens
            if n_new:
                if obs is not None:
                    obs.on_tokens(rec, n_new, now)
                if rec.first_token_time is None:
                    rec.first_token_time = now
                    self._queue_tokens(rec, -rec.num_prompt_tokens)
                rec.last_token_time = now
            rec.num_generated = out.num_generated
            if out.finished and out.finish_reason == "error":
                # This request alone failed in the engine (its sampling): an error to it, not to the step.
                self._added.discard(out.rid)
                self._end(out.rid, "error", now)
                live.queue.put_nowait(RequestFailed(getattr(out, "error", None) or "the request failed",
                                                    (out.rid,)))
                continue
            live.queue.put_nowait(out)
            if out.finished:
                self._added.discard(out.rid)
                self._end(out.rid, out.finish_reason or "stop", now)

    def _on_step_failure(self, exc: Exception) -> None:
        """Fail the requests of the failed step (all added ones when the engine does not say which)."""
        self.num_failed_steps += 1
        logger.error("engine step failed: %r", exc, exc_info=exc)
        rids = exc.rids if isinstance(exc, StepFailed) and exc.rids else None
        affected = set(rids) & self._added if rids is not None else set(self._added)
        err = StepFailed(f"the engine failed while running this request: {exc}", tuple(affected))
        err.__cause__ = exc
        for rid in affected:
            self._added.discard(rid)
            live = self._end(rid, "error")
            if live is not None:
                live.queue.put_nowait(err)
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - already gone is fine; the KV check is the engine's
                pass
        self._read_engine()
        if self.num_failed_steps >= _MAX_CONSECUTIVE_FAILURES:
            self.dead_reason = f"{self.num_failed_steps} consecutive engine steps failed; last: {exc!r}"
            self._stopping = True
            self._fail_all(EngineDead(self.dead_reason))
            self._abort_all_added()

    def _abort_all_added(self) -> None:
        """Abort in the engine every request we added (no step may be in flight)."""
        for rid in list(self._added):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - unknown or already gone; nothing more to return
                pass
        self._added.clear()

    def _fail_all(self, err: BaseException, outcome: str = "error") -> None:
        for _, future in self._calls:
            if not future.done():
                future.set_exception(err)
        self._calls.clear()
        for p in self._pending.values():
            if not p.future.done():
                p.future.set_exception(err)
        self._pending.clear()
        for rid in list(self._live):
            live = self._end(rid, outcome)
            assert live is not None
            live.queue.put_nowait(err)

    def _end(self, rid: Hashable, reason: str, now: float | None = None) -> _Live | None:
        """Take a request out of the live set and report its outcome once; None if it was not live."""
        live = self._live.pop(rid, None)
        if live is not None:
            rec = live.record
            if rec.first_token_time is None:
                self._queue_tokens(rec, -rec.num_prompt_tokens)
            rec.finish_time = self.clock() if now is None else now
            rec.finish_reason = reason
            self._count_lora(rec, -1)
            if self.observer is not None:
                self.observer.on_finish(rec)
        return live
