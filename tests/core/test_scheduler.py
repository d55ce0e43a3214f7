"""Contract rules of the reservation Scheduler, one behaviour per test."""

from __future__ import annotations

import pytest

from factories import make_scheduler, run_to_end
from stallfree import (
    FinishReason,
    InvalidConfig,
    PagedScheduler,
    Request,
    RequestRejected,
    RequestStatus,
    Scheduler,
    SchedulerStateError,
)


def make_paged():
    """A PagedScheduler with small defaults (budget 8, 4 slots, 64 blocks of 4 tokens, no watermark)."""
    return PagedScheduler(8, 4, 64, 4, 0.0)


def snapshot(s: Scheduler):
    """Everything observable about a scheduler's state, for 'nothing changed' checks."""
    live = {}
    for rid in list(s._live):
        st = s.request_state(rid)
        live[rid] = (st.status, st.num_prefilled, st.num_generated, st.admitted_step)
    return (s.kv_free, s.num_waiting, s.num_running, s.step, s.has_unfinished(), live)


# ---------------------------------------------------------------- construction and add()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("token_budget", 0),
        ("token_budget", -3),
        ("max_seqs", 0),
        ("kv_tokens", 0),
        ("token_budget", True),
        ("max_seqs", 2.0),
        ("kv_tokens", "100"),
        ("token_budget", None),
    ],
    ids=["budget-0", "budget-neg", "seqs-0", "kv-0", "budget-bool", "seqs-float", "kv-str", "budget-none"],
)
def test_bad_config_names_field_and_value(field, value):
    """A constructor argument that is not an integer >= 1 raises InvalidConfig naming it and its value."""
    kw = {"token_budget": 8, "max_seqs": 4, "kv_tokens": 100, field: value}
    with pytest.raises(InvalidConfig, match=field) as exc:
        Scheduler(**kw)
    assert repr(value) in str(exc.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prompt_len", 0),
        ("prompt_len", -1),
        ("max_new", 0),
        ("prompt_len", True),
        ("max_new", 1.5),
        ("prompt_len", "4"),
        ("priority", 1.0),
    ],
    ids=["prompt-0", "prompt-neg", "max_new-0", "prompt-bool", "max_new-float", "prompt-str", "prio-float"],
)
def test_bad_request_field_rejected_before_queueing(field, value):
    """A bad Request field raises RequestRejected (a ValueError) naming it, at construction and again at
    add() for a Request whose field was set around the constructor; nothing queued is lost."""
    kw = {"rid": "bad", "prompt_len": 4, "max_new": 3, field: value}
    with pytest.raises(RequestRejected, match=field):
        Request(**kw)
    s = make_scheduler()
    s.add(Request("ok", 4, 3))
    before = snapshot(s)
    bad = Request("bad", 4, 3)
    object.__setattr__(bad, field, value)  # as a deserializer that skips __post_init__ might leave it
    with pytest.raises(RequestRejected, match=field):
        s.add(bad)
    assert snapshot(s) == before
    assert "bad" not in s._live
    assert isinstance(RequestRejected("x"), ValueError)


def test_duplicate_live_rid_rejected_and_state_unchanged():
    """Adding a rid that is already live raises and leaves the queue as it was."""
    s = make_scheduler()
    s.add(Request(1, 4, 3))
    before = snapshot(s)
    with pytest.raises(RequestRejected, match="already live"):
        s.add(Request(1, 5, 5))
    assert snapshot(s) == before


def test_never_fits_rejected_with_numbers():
    """prompt_len + max_new > kv_tokens is rejected at add() with both numbers; a fitting request still runs."""
    s = make_scheduler(kv_tokens=32)
    with pytest.raises(RequestRejected, match=r"30 \+ 3 = 33, 33 tokens of KV > kv_tokens = 32"):
        s.add(Request(1, 30, 3))
    s.add(Request(2, 29, 3))  # exactly 32: fits
    _, first, finish = run_to_end(s)
    assert first == {2: 3} and finish == {2: 5}


def test_add_requires_request_object():
    """add() of something that is not a Request raises RequestRejected."""
    with pytest.raises(RequestRejected, match="Request"):
        make_scheduler().add((1, 4, 3))


# ---------------------------------------------------------------- step order


def test_decodes_come_first_oldest_admitted_first():
    """Decodes lead the batch in admission order, before the partial prefill and admissions."""
    s = make_scheduler(token_budget=16, kv_tokens=200)
    for rid in ("a", "b", "c"):
        s.add(Request(rid, 2, 10))
    s.complete(s.schedule())
    s.add(Request("long", 40, 2))
    plan = s.schedule()
    assert [(c.rid, c.num_tokens, c.is_prefill) for c in plan] == [
        ("a", 1, False),
        ("b", 1, False),
        ("c", 1, False),
        ("long", 13, True),
    ]
    assert [c.start for c in plan.decodes] == [2, 2, 2]
    assert plan.decode_context_sum == 6


def test_partial_prefill_before_new_admissions():
    """A prompt started last step gets the budget before a newer arrival starts."""
    s = make_scheduler(token_budget=8)
    s.add(Request("first", 12, 2))
    s.complete(s.schedule())  # 8 of 12
    s.add(Request("second", 6, 2))
    plan = s.schedule()
    assert [(c.rid, c.num_tokens, c.start, c.is_last) for c in plan.prefills] == [
        ("first", 4, 8, True),
        ("second", 4, 0, False),
    ]
    assert plan.admitted == ("second",)


def test_head_that_does_not_fit_blocks_admission():
    """Strict FCFS: a head blocked on KV stops admission even though a smaller request behind it fits."""
    s = make_scheduler(token_budget=16, kv_tokens=30)
    s.add(Request("big", 4, 20))  # 24 of 30
    s.complete(s.schedule())
    s.add(Request("blocked", 4, 6))  # needs 10 > 6 free
    s.add(Request("small", 2, 2))  # needs 4: would fit, must not skip ahead
    plan = s.schedule()
    assert plan.admitted == ()
    assert s.num_waiting == 2


def test_slot_limit_blocks_admission():
    """running == max_seqs stops admission with budget and KV to spare."""
    s = make_scheduler(token_budget=16, max_seqs=2)
    for rid in range(3):
        s.add(Request(rid, 2, 5))
    plan = s.schedule()
    assert plan.admitted == (0, 1) and s.num_running == 2 and s.num_waiting == 1


def test_no_zero_token_first_chunk():
    """When the decodes spend the whole budget nothing is admitted, not even with 0 tokens."""
    s = make_scheduler(token_budget=2, max_seqs=4)
    s.add(Request(1, 1, 5))
    s.add(Request(2, 1, 5))
    s.complete(s.schedule())
    s.add(Request(3, 4, 2))
    plan = s.schedule()
    assert plan.decode_rids == (1, 2) and plan.prefills == () and s.num_waiting == 1


def test_budget_one_crowds_out_prefill():
    """With budget 1 a running decode takes the step and the partial prefill waits."""
    s = make_scheduler(token_budget=1)
    s.add(Request("a", 1, 3))
    s.add(Request("b", 3, 1))
    plans, first, finish = run_to_end(s)
    assert plans[0] == [("a", 1)] and plans[1] == [("a", 1)] and plans[2] == [("a", 1)]
    assert plans[3] == [("b", 1)] and first["b"] == 5 and finish == {"a": 2, "b": 5}


def test_max_new_one_leaves_on_prompt_step():
    """A request with max_new == 1 finishes on the step its prompt finishes and frees its KV then."""
    s = make_scheduler(token_budget=8, kv_tokens=100)
    s.add(Request(1, 12, 1))
    s.complete(s.schedule())
    plan = s.schedule()
    assert s.complete(plan) == (1,)
    assert s.last_finished == {1: FinishReason.LENGTH}
    assert s.kv_free == 100 and not s.has_unfinished()


def test_kv_released_at_finish_not_at_prompt_end():
    """The reservation is held until the last token, not returned when the prompt completes."""
    s = make_scheduler(token_budget=8, kv_tokens=100)
    s.add(Request(1, 4, 3))
    frees = []
    while s.has_unfinished():
        s.complete(s.schedule())
        frees.append(s.kv_free)
    assert frees == [93, 93, 100]


# ---------------------------------------------------------------- early stop and abort


def test_eos_as_first_token():
    """A request stopped on its first token finishes that step with reason stop and one token."""
    s = make_scheduler(kv_tokens=50)
    s.add(Request(1, 4, 10))
    plan = s.schedule()
    assert s.complete(plan, stopped=[1]) == (1,)
    assert s.last_finished == {1: FinishReason.STOP}
    assert s.kv_free == 50 and not s.has_unfinished()


def test_early_stop_of_a_decode_frees_kv_and_slot():
    """A decode named in stopped finishes that step; its slot and KV go to the head of the queue next step."""
    s = make_scheduler(token_budget=8, max_seqs=1, kv_tokens=20)
    s.add(Request(1, 4, 10))
    s.add(Request(2, 4, 10))
    s.complete(s.schedule())
    plan = s.schedule()
    assert s.complete(plan, stopped={1}) == (1,)
    assert s.kv_free == 20
    assert s.schedule().admitted == (2,)


@pytest.mark.parametrize("bad", ["waiting", "unknown", "prefilling-not-last"])
def test_stopped_rid_that_did_not_sample_is_an_error_and_changes_nothing(bad):
    """stopped may only name requests that sampled in the plan; otherwise nothing changes."""
    s = make_scheduler(token_budget=8, max_seqs=2)
    s.add(Request("d", 1, 5))
    s.complete(s.schedule())
    s.add(Request("p", 20, 2))
    s.add(Request("w", 4, 2))
    plan = s.schedule()
    rid = {"waiting": "w", "unknown": "zz", "prefilling-not-last": "p"}[bad]
    before = snapshot(s)
    with pytest.raises(SchedulerStateError, match="did not sample"):
        s.complete(plan, stopped=["d", rid])
    assert snapshot(s) == before
    assert s.complete(plan) == ("d",)  # the plan is still in flight and completes normally


@pytest.mark.parametrize("make", [make_scheduler, make_paged], ids=["reserve", "paged"])
def test_schedule_twice_and_stale_or_double_complete_are_errors(make):
    """schedule() twice, completing a stale plan, twice, or another scheduler's plan raise and change nothing
    (both schedulers share this lifecycle)."""
    s = make()
    s.add(Request(1, 4, 3))
    plan = s.schedule()
    with pytest.raises(SchedulerStateError, match="twice"):
        s.schedule()
    s.complete(plan)
    before = snapshot(s)
    with pytest.raises(SchedulerStateError):
        s.complete(plan)
    assert snapshot(s) == before
    other = make()
    with pytest.raises(SchedulerStateError):
        s.complete(other.schedule())


def test_abort_waiting_request():
    """Aborting a waiting request removes it from the queue; nothing was reserved."""
    s = make_scheduler(kv_tokens=50)
    s.add(Request(1, 4, 3))
    s.abort(1)
    assert s.num_waiting == 0 and s.kv_free == 50 and not s.has_unfinished()
    assert s.schedule().num_tokens == 0


def test_abort_prefilling_request_frees_kv_and_partial_state():
    """Aborting a partly prefilled request frees its reservation and lets the next prompt start."""
    s = make_scheduler(token_budget=8, kv_tokens=64)
    s.add(Request(1, 30, 4))
    s.add(Request(2, 6, 2))
    s.complete(s.schedule())
    s.abort(1)
    assert s.kv_free == 64 and s.num_running == 0
    plan = s.schedule()
    assert [(c.rid, c.num_tokens) for c in plan] == [(2, 6)]


def test_abort_decoding_request():
    """Aborting a decoding request removes it from the next step's decodes and returns its KV."""
    s = make_scheduler(kv_tokens=50)
    s.add(Request(1, 4, 10))
    s.add(Request(2, 4, 10))
    s.complete(s.schedule())
    s.abort(1)
    assert s.kv_free == 36 and s.last_finished == {}
    assert s.schedule().decode_rids == (2,)


def test_abort_in_flight_takes_effect_at_complete():
    """A request aborted while its plan is in flight keeps its KV until complete() and emits nothing."""
    s = make_scheduler(kv_tokens=50)
    s.add(Request(1, 4, 10))
    s.add(Request(2, 4, 10))
    s.complete(s.schedule())
    plan = s.schedule()
    s.abort(1)
    assert s.kv_free == 22  # still reserved: the engine may be writing its KV
    assert s.complete(plan) == (2,)
    assert s.last_finished == {1: FinishReason.ABORT}
    assert s.kv_free == 36 and s.schedule().decode_rids == (2,)


def test_abort_finished_is_noop_and_unknown_raises():
    """abort() of a finished rid does nothing; of a rid never added raises KeyError naming it."""
    s = make_scheduler(kv_tokens=50)
    s.add(Request(1, 4, 1))
    s.complete(s.schedule())
    s.abort(1)
    assert s.kv_free == 50
    with pytest.raises(KeyError, match="nope"):
        s.abort("nope")


def test_finished_request_is_forgotten_and_rid_reusable():
    """Once reported finished a request is no longer live; its rid may be added again."""
    s = make_scheduler()
    s.add(Request(7, 2, 1))
    s.complete(s.schedule())
    with pytest.raises(KeyError):
        s.request_state(7)
    s.add(Request(7, 3, 2))
    assert s.request_state(7).status is RequestStatus.WAITING


def test_request_state_tracks_progress():
    """request_state reports status, prefilled and generated counts and the admission/first-token steps."""
    s = make_scheduler(token_budget=8)
    s.add(Request(1, 10, 5))
    s.complete(s.schedule())
    st = s.request_state(1)
    assert (st.status, st.num_prefilled, st.num_generated, st.admitted_step) == (RequestStatus.PREFILLING, 8, 0, 0)
    s.complete(s.schedule())
    s.complete(s.schedule())
    st = s.request_state(1)
    assert (st.status, st.num_prefilled, st.num_generated, st.first_token_step) == (RequestStatus.DECODING, 10, 2, 1)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"rid": float("nan")}, "rid"),
        ({"arrival": float("nan")}, "arrival"),
        ({"arrival": float("-inf")}, "arrival"),
        ({"arrival": "x"}, "arrival"),
        ({"arrival": True}, "arrival"),
    ],
    ids=["nan-rid", "nan-arrival", "inf-arrival", "str-arrival", "bool-arrival"],
)
def test_request_rid_and_arrival_validated(kw, field):
    """A NaN rid (never equal to itself) or a non-finite arrival is rejected when the Request is made."""
    with pytest.raises(RequestRejected, match=field):
        Request(**{"rid": 1, "prompt_len": 3, "max_new": 2, **kw})


@pytest.mark.parametrize("bad", [None, "plan", 3], ids=["none", "str", "int"])
def test_complete_of_something_that_is_not_a_plan(bad):
    """complete() of a non-plan raises SchedulerStateError, with or without a plan in flight, and changes nothing."""
    s = make_scheduler()
    s.add(Request(1, 4, 3))
    with pytest.raises(SchedulerStateError, match="plan in flight"):
        s.complete(bad)
    plan = s.schedule()
    with pytest.raises(SchedulerStateError, match="plan in flight"):
        s.complete(bad)
    assert s.complete(plan) == (1,)  # the 4-token prompt fits the budget: its first token comes out


def test_stopped_as_a_string_is_refused():
    """stopped="ab" is not read as the rids 'a' and 'b'."""
    s = make_scheduler()
    s.add(Request("a", 2, 3))
    plan = s.schedule()
    with pytest.raises(SchedulerStateError, match="string"):
        s.complete(plan, stopped="a")
    assert s.complete(plan) == ("a",)


@pytest.mark.parametrize("kw", [{"stopped": 5}, {"stopped": None}, {"num_accepted": 5}, {"num_accepted": ["a"]}])
def test_stopped_or_num_accepted_of_the_wrong_kind_is_refused_and_nothing_changes(kw):
    """A number for stopped, or anything but a mapping for num_accepted, is a SchedulerStateError naming the
    argument (not a TypeError from inside), and the plan can still be completed."""
    s = make_scheduler()
    s.add(Request("a", 2, 3))
    plan = s.schedule()
    with pytest.raises(SchedulerStateError, match=next(iter(kw))):
        s.complete(plan, **kw)
    assert s.complete(plan) == ("a",)


def test_clock_returning_nan_is_refused_before_anything_changes():
    """A clock that returns NaN makes schedule() raise with nothing in flight; a good reading then works."""
    now = [float("nan")]
    s = Scheduler(8, 2, 100, policy="priority", aging_interval=1.0, clock=lambda: now[0])
    s.add(Request("a", 2, 2, arrival=0.0))
    with pytest.raises(SchedulerStateError, match="clock"):
        s.schedule()
    assert s.num_waiting == 1
    now[0] = 1.0
    assert s.schedule().admitted == ("a",)


def test_an_unhashable_rid_is_an_unknown_rid_not_a_type_error():
    """A list given where a rid goes is never a live rid: the verbs raise what they raise for an unknown rid
    (KeyError naming it; complete() a SchedulerStateError for `stopped`), and nothing changes."""
    s = make_scheduler()
    s.add(Request("a", 2, 3))
    for verb in (lambda: s.abort([1]), lambda: s.stop_after([1], 1), lambda: s.request_state([1]),
                 lambda: s.take_back([1], 0), lambda: s.set_draft_tokens([1], 1)):
        with pytest.raises(KeyError, match=r"\[1\]"):
            verb()
    plan = s.schedule()
    with pytest.raises(SchedulerStateError, match=r"stopped names rid \[1\]"):
        s.complete(plan, stopped=[[1]])
    assert s.complete(plan) == ("a",)


def test_an_unknown_option_is_named_with_the_options_there_are():
    """Scheduler(..., bogus=1) says Scheduler() got an unexpected option and lists SchedulerConfig's fields."""
    with pytest.raises(TypeError, match=r"Scheduler\(\) got an unexpected option 'bogus'.*token_budget"):
        Scheduler(8, 8, 100, bogus=1)
