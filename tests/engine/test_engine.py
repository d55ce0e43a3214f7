"""LLMEngine behaviour: stops, limits, errors, abort, failed steps and seeded sampling."""

from __future__ import annotations

import time

import pytest
import torch

from stallfree.core import RequestRejected as CoreRequestRejected
from stallfree.engine import (
    ContextLengthExceeded,
    EngineError,
    InvalidPrompt,
    RequestRejected,
    SamplingParams,
    StepFailed,
)

# Every test here runs the real model (loaded once, several seconds on 2 cores): not in the quick set.
pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0)
PARIS = "The capital of France is"  # greedy: " Paris.\n\nThe answer is: 2"


def test_text_streams_and_finishes_with_length(make_engine, run_to_end):
    """A greedy request streams " Paris." token by token and finishes with reason "length"."""
    eng = make_engine()
    eng.add_request("a", PARIS, SamplingParams(max_tokens=2, **GREEDY))
    outs = run_to_end(eng)["a"]
    assert [o.new_token_ids for o in outs] == [[7042], [30]]
    assert [o.text for o in outs] == [" Paris", "."]
    assert [o.finished for o in outs] == [False, True]
    assert outs[-1].finish_reason == "length"
    assert (outs[-1].num_prompt_tokens, outs[-1].num_generated) == (5, 2)


def test_max_tokens_one_finishes_on_prefill_step(make_engine):
    """max_tokens=1: the first token comes out of the prefill step, which also finishes it."""
    eng = make_engine()
    eng.add_request("a", PARIS, SamplingParams(max_tokens=1, **GREEDY))
    (out,) = eng.step()
    assert (out.new_token_ids, out.text, out.finished) == ([7042], " Paris", True)
    assert out.finish_reason == "length"
    assert not eng.has_unfinished()


def test_stop_string_cuts_text_and_stops(make_engine, run_to_end):
    """A stop string ends the request with "stop"; the text returned ends before it."""
    eng = make_engine()
    eng.add_request("a", PARIS, SamplingParams(max_tokens=10, stop=["\n\nThe"], **GREEDY))
    outs = run_to_end(eng)["a"]
    assert "".join(o.text for o in outs) == " Paris."
    assert outs[-1].finish_reason == "stop"
    # " Paris", ".", "\n", "\n", "The": the fifth token completes the stop string.
    assert [t for o in outs for t in o.new_token_ids] == [7042, 30, 198, 198, 504]


def test_stop_token_id_excluded_from_text(make_engine, run_to_end):
    """A stop token id ends the request; the token is returned but its text is not."""
    eng = make_engine()
    eng.add_request("a", PARIS, SamplingParams(max_tokens=10, stop_token_ids=[30], **GREEDY))
    outs = run_to_end(eng)["a"]
    assert [t for o in outs for t in o.new_token_ids] == [7042, 30]
    assert "".join(o.text for o in outs) == " Paris"
    assert outs[-1].finish_reason == "stop"


def test_eos_stops_chat_unless_ignored(make_engine, run_to_end):
    """The chat answer ends at <|im_end|> (EOS id 2) with "stop"; with ignore_eos it runs to length."""
    eng = make_engine()
    prompt = eng.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    eng.add_request("a", prompt, SamplingParams(max_tokens=20, **GREEDY))
    eng.add_request("b", prompt, SamplingParams(max_tokens=14, ignore_eos=True, **GREEDY))
    outs = run_to_end(eng)
    a = outs["a"]
    assert a[-1].new_token_ids == [2] and a[-1].finish_reason == "stop"
    assert "".join(o.text for o in a) == "The answer to this classic math problem is 4."
    assert len(outs["b"]) == 14 and outs["b"][-1].finish_reason == "length"
    assert 2 in [t for o in outs["b"] for t in o.new_token_ids]


def test_chat_template_renders_default_system_prompt(make_engine):
    """SmolLM2's template adds its default system turn and the assistant opening."""
    eng = make_engine()
    text = eng.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert eng.tokenizer.encode("<|im_start|>user")[0] == 1


def test_context_length_exceeded_names_both_numbers(make_engine):
    """A prompt plus max_tokens beyond 8192 is refused with the model's limit and both counts."""
    eng = make_engine()
    with pytest.raises(ContextLengthExceeded) as err:
        eng.add_request("a", [100] * 8000, SamplingParams(max_tokens=500))
    assert str(err.value).startswith(
        "This model's maximum context length is 8192 tokens. However, you requested 8500 tokens "
        "(8000 in the messages, 500 in the completion)."
    )
    assert (err.value.prompt_tokens, err.value.max_tokens, err.value.max_model_len) == (8000, 500, 8192)
    assert isinstance(err.value, ValueError) and not eng.has_unfinished()


def test_never_fits_kv_is_rejected(make_engine):
    """A request larger than the KV cache is rejected at add with the core's RequestRejected (one class, the
    engine's name for it the same), and nothing is queued."""
    eng = make_engine(kv_tokens=64)
    with pytest.raises(CoreRequestRejected, match="kv_tokens = 64"):
        eng.add_request("a", [100] * 60, SamplingParams(max_tokens=10))
    assert RequestRejected is CoreRequestRejected
    assert not eng.has_unfinished()
    assert not eng.has_unfinished()


@pytest.mark.parametrize(
    ("prompt", "match"),
    [("", "empty"), ([], "empty"), ([1, 49152], "49152 is outside"), ([1, -1], "-1 is outside"),
     (3.5, "string or a list"), ([1, True], "string or a list")],
    ids=["empty_text", "empty_ids", "id_too_big", "id_negative", "float", "bool_id"],
)
def test_bad_prompts_are_refused(make_engine, prompt, match):
    """Empty prompts, out-of-vocabulary ids and wrong types raise InvalidPrompt; nothing is queued."""
    eng = make_engine()
    with pytest.raises(InvalidPrompt, match=match):
        eng.add_request("a", prompt, SamplingParams())
    assert not eng.has_unfinished() and eng.scheduler.num_waiting == 0


def test_duplicate_live_rid_is_refused(make_engine):
    """Adding a rid that is still live raises InvalidPrompt and leaves the first request alone."""
    eng = make_engine()
    eng.add_request("a", PARIS, SamplingParams(max_tokens=3))
    with pytest.raises(InvalidPrompt, match="already live"):
        eng.add_request("a", PARIS, SamplingParams(max_tokens=3))
    assert eng.scheduler.num_waiting == 1


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "decoding"])
def test_abort_releases_kv_and_keeps_others(make_engine, run_to_end, when):
    """Aborting a waiting, mid-prefill or decoding request frees its KV blocks; the other request
    still gets its exact greedy output."""
    eng = make_engine(token_budget=4, max_seqs=1 if when == "waiting" else 2)
    eng.add_request("keep", PARIS, SamplingParams(max_tokens=3, **GREEDY))
    eng.add_request("x", "Write a haiku about the sea.", SamplingParams(max_tokens=5, **GREEDY))
    steps = {"waiting": 1, "mid_prefill": 2, "decoding": 5}[when]
    outs: dict = {}
    for _ in range(steps):
        for o in eng.step():
            outs.setdefault(o.rid, []).append(o)
    eng.abort("x")
    for rid, more in run_to_end(eng).items():
        outs.setdefault(rid, []).extend(more)
    assert [t for o in outs["keep"] for t in o.new_token_ids] == [7042, 30, 198]
    assert all(not o.finished for o in outs.get("x", []))
    assert eng.scheduler.kv_free == eng.scheduler.stats().kv_total
    assert eng.scheduler.stats().num_free_blocks == eng.kv.num_blocks == len(eng.scheduler.free_block_ids())
    eng.abort("x")  # already gone: a no-op
    with pytest.raises(KeyError):
        eng.abort("never-added")


def test_failed_step_is_retried_and_abort_recovers(make_engine, run_to_end, monkeypatch):
    """A step whose forward pass raises leaves no request advanced; aborting the culprit and
    stepping again finishes the others with their exact outputs."""
    eng = make_engine(token_budget=64)
    eng.add_request("good", PARIS, SamplingParams(max_tokens=3, **GREEDY))
    eng.add_request("bad", "Write a haiku about the sea.", SamplingParams(max_tokens=3, **GREEDY))
    real = eng.model.forward
    calls = {"n": 0}

    def broken(batch, kv):
        calls["n"] += 1
        if batch.num_tokens > 5:  # the step holding "bad"'s prompt
            raise RuntimeError("boom")
        return real(batch, kv)

    monkeypatch.setattr(eng.model, "forward", broken)
    with pytest.raises(StepFailed) as err:
        eng.step()
    assert set(err.value.rids) == {"good", "bad"} and isinstance(err.value.__cause__, RuntimeError)
    with pytest.raises(StepFailed):  # the same plan again
        eng.step()
    eng.abort("bad")
    outs = run_to_end(eng)
    assert [t for o in outs["good"] for t in o.new_token_ids] == [7042, 30, 198]
    assert "bad" not in outs
    assert eng.scheduler.kv_free == eng.scheduler.stats().kv_total
    assert eng.scheduler.stats().num_free_blocks == eng.kv.num_blocks == len(eng.scheduler.free_block_ids())


def test_seeded_sampling_is_reproducible_and_batch_independent(make_engine, run_to_end):
    """The same seed gives the same sampled tokens alone and batched with other requests."""
    params = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    first = make_engine(max_seqs=1)
    first.add_request("s", PARIS, params)
    alone = [t for o in run_to_end(first)["s"] for t in o.new_token_ids]
    second = make_engine(token_budget=3, max_seqs=3)
    second.add_request("other", "1, 2, 3,", SamplingParams(max_tokens=4, temperature=0.7))
    second.add_request("s", PARIS, params)
    batched = [t for o in run_to_end(second)["s"] for t in o.new_token_ids]
    assert len(alone) == 6 and batched == alone


def test_multibyte_text_is_never_cut(make_engine, run_to_end):
    """Generated text that has characters spanning several byte tokens never shows U+FFFD and
    concatenates to the decode of all tokens."""
    eng = make_engine()
    prompt = eng.apply_chat_template([{"role": "user", "content": "Write three emoji: 🎉🚀🌟"}])
    eng.add_request("e", prompt, SamplingParams(max_tokens=24, ignore_eos=True, **GREEDY))
    outs = run_to_end(eng)["e"]
    ids = [t for o in outs for t in o.new_token_ids]
    text = "".join(o.text for o in outs)
    assert "\ufffd" not in text
    assert text == eng.tokenizer.decode(ids)
    assert any(ord(ch) > 0xFFFF for ch in text)  # the model did answer with emoji


def test_engine_reports_model_facts(make_engine):
    """The engine exposes the model's name, context length and EOS ids, and the scheduler's state."""
    eng = make_engine(token_budget=32, max_seqs=3, kv_tokens=1000)
    assert (eng.model_name, eng.max_model_len, eng.eos_token_ids) == ("SmolLM2-135M-Instruct", 8192, (2,))
    assert (eng.scheduler.stats().kv_total, eng.scheduler.num_running, eng.scheduler.num_waiting) == (63 * 16, 0, 0)
    assert eng.kv.num_blocks == eng.scheduler.stats().num_free_blocks == 63  # ceil(1000 / 16): the scheduler's pool
    assert eng.step() == [] and eng.last_plan.num_tokens == 0


def test_default_kv_tokens_fit_two_gib(model, checkpoint):
    """kv_tokens=None on CPU gives 2 GiB of float32 KV: 2**31 // 46,080 B/token = 46,603 tokens, held
    in ceil(46,603 / 16) = 2,913 blocks of 16 = 46,608 tokens."""
    from stallfree.engine import LLMEngine

    eng = LLMEngine(model, checkpoint.tokenizer)
    assert min(8192 * 64, 2**31 // (2 * 30 * 3 * 64 * 4)) == 46603
    assert eng.scheduler.stats().kv_total == 2913 * 16 and eng.kv.num_blocks == 2913
    assert (eng.info.token_budget, eng.info.max_seqs) == (512, 64)
    with pytest.warns(DeprecationWarning, match="LLMEngine"):  # the former keyword form, one release more
        old = LLMEngine(model, checkpoint.tokenizer, token_budget=16, max_seqs=64)
    assert old.scheduler.stats().kv_total == 2913 * 16 and old.info.token_budget == 16


def test_device_and_dtype_names_are_checked():
    """Unknown dtypes, and cuda without a GPU, are refused with the value named."""
    from stallfree.engine.engine import resolve_device, resolve_dtype

    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("float32") is torch.float32
    with pytest.raises(EngineError, match="'int3'"):
        resolve_dtype("int3")
    assert resolve_device("cpu").type == "cpu"
    if not torch.cuda.is_available():
        assert resolve_device(None).type == "cpu"
        with pytest.raises(EngineError, match="CUDA is not available"):
            resolve_device("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_greedy_matches_cpu_prefix(run_to_end):
    """On a GPU in bf16 the bundled model still answers " Paris" to the France prompt."""
    from stallfree.engine import LLMEngine

    eng = LLMEngine.from_pretrained(token_budget=64, max_seqs=4, kv_tokens=4096, device="cuda",
                                    dtype="bf16")
    eng.add_request("a", PARIS, SamplingParams(max_tokens=2, **GREEDY))
    assert run_to_end(eng)["a"][0].text == " Paris"


class _TableScheduler:
    """A stand-in for the paged scheduler: the reservation Scheduler plus block tables it owns,
    handed out from the top of the pool so that they differ from the engine's own allocator."""

    def __init__(self, token_budget, max_seqs, num_blocks, block_size):
        from stallfree.core import Scheduler

        self._s = Scheduler(token_budget, max_seqs, num_blocks * block_size)
        self.block_size, self.num_blocks = block_size, num_blocks
        self._free = list(range(num_blocks))
        self._tables = {}

    def __getattr__(self, name):
        return getattr(self._s, name)

    @property
    def config(self):
        # The engine reads the block size from the scheduler's config: this stand-in's tables use its own.
        from types import SimpleNamespace

        return SimpleNamespace(**{**self._s.config.as_dict(), "block_size": self.block_size})

    def stats(self):
        import dataclasses

        return dataclasses.replace(self._s.stats(), num_blocks=self.num_blocks)

    def schedule(self):
        plan = self._s.schedule()
        for c in plan:
            table = self._tables.setdefault(c.rid, [])
            while len(table) * self.block_size < c.start + c.num_tokens:
                table.append(self._free.pop())
        return plan

    def complete(self, plan, stopped=()):
        emitted = self._s.complete(plan, stopped)
        for rid in self._s.last_finished:
            self._free.extend(self._tables.pop(rid, []))
        return emitted

    def block_table(self, rid):
        return self._tables[rid]


def test_engine_follows_scheduler_block_tables(model, checkpoint, run_to_end):
    """With a scheduler that owns block tables, the engine writes and reads KV where they say and
    still gets the exact greedy outputs."""
    from stallfree.engine import LLMEngine

    sched = _TableScheduler(token_budget=3, max_seqs=2, num_blocks=8, block_size=4)
    eng = LLMEngine(model, checkpoint.tokenizer, scheduler=sched)
    assert eng.kv.num_slots == 32 and eng.block_size == 4
    eng.add_request("a", PARIS, SamplingParams(max_tokens=3, **GREEDY))
    eng.add_request("b", "1, 2, 3, 4,", SamplingParams(max_tokens=3, **GREEDY))
    outs = run_to_end(eng)
    assert [t for o in outs["a"] for t in o.new_token_ids] == [7042, 30, 198]
    assert [t for o in outs["b"] for t in o.new_token_ids] == [216, 37, 28]
    assert sorted(sched._free) == list(range(8))


@pytest.mark.parametrize("seed", [2**64, -1], ids=["too-big", "negative"])
def test_out_of_range_seed_is_refused_and_the_engine_keeps_working(make_engine, seed):
    """A seed outside [0, 2**64) is a ValueError naming seed; nothing is queued and later requests run."""
    eng = make_engine()
    with pytest.raises(ValueError, match="seed"):
        eng.add_request("bad", "Hello", SamplingParams(max_tokens=2, temperature=0.7, seed=seed))
    assert not eng.has_unfinished() and eng.scheduler.num_waiting == 0
    eng.add_request("ok", "Hello", SamplingParams(max_tokens=2, temperature=0))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert sum(len(o.new_token_ids) for o in outs) == 2


def test_untokenizable_prompt_is_an_invalid_prompt(make_engine):
    """A prompt with a lone surrogate is refused as InvalidPrompt (a ValueError), with nothing queued."""
    eng = make_engine()
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request("x", "\udc00", SamplingParams(max_tokens=2))
    assert not eng.has_unfinished()


@pytest.mark.parametrize(
    ("max_tokens", "stop"),
    [(1, dict(stop_token_ids=[7042])), (2, dict(stop_token_ids=[30])), (1, dict(stop=["Par"])),
     (2, dict(stop=["."]))],
    ids=["token-on-prefill", "token-on-decode", "string-on-prefill", "string-on-decode"],
)
def test_stop_on_the_last_allowed_token_is_stop(make_engine, run_to_end, max_tokens, stop):
    """Issue 19 item 10: a stop token or string on the max_tokens-th token finishes with "stop", whether
    that token came from the last prefill chunk (max_tokens 1: " Paris") or from a decode (max_tokens 2:
    "."), as OpenAI and vLLM report it."""
    eng = make_engine()
    eng.add_request("a", PARIS, SamplingParams(max_tokens=max_tokens, **stop, **GREEDY))
    outs = run_to_end(eng)["a"]
    assert len(outs) == max_tokens
    assert outs[-1].finished and outs[-1].finish_reason == "stop"


@pytest.mark.parametrize("stop", ["he an", "is:", " Paris.\n"], ids=["b37-split", "end", "first"])
def test_b37_no_part_of_a_stop_string_is_ever_streamed(make_engine, run_to_end, stop):
    """Case B37: a stop string split across tokens ("he an" spans "The" | " answer") is never partly
    streamed: every prefix of the deltas is a prefix of the final text, which ends before the stop string."""
    eng = make_engine()
    eng.add_request("ref", PARIS, SamplingParams(max_tokens=8, **GREEDY))
    full = "".join(o.text for o in run_to_end(eng)["ref"])
    assert full == " Paris.\n\nThe answer is:"
    eng.add_request("a", PARIS, SamplingParams(max_tokens=8, stop=[stop], **GREEDY))
    outs = run_to_end(eng)["a"]
    text = "".join(o.text for o in outs)
    assert text == full[: full.index(stop)]
    assert outs[-1].finish_reason == "stop"
    sent = ""
    for o in outs:
        sent += o.text
        assert text.startswith(sent) and stop not in sent


def test_engine_follows_a_reservation_schedulers_tables(model, checkpoint, run_to_end):
    """A reservation Scheduler (budget 4, blocks of 4, 32 tokens) passed in: the cache is its 8 blocks, the
    greedy outputs are exact, and every block is back in its pool at the end."""
    from stallfree import Scheduler
    from stallfree.engine import LLMEngine

    sched = Scheduler(4, 2, 32, block_size=4)  # chunks aligned to blocks (the default with a block_size)
    eng = LLMEngine(model, checkpoint.tokenizer, scheduler=sched)
    assert (eng.kv.num_blocks, eng.block_size, eng.kv_policy) == (8, 4, "reserve")
    eng.add_request("a", PARIS, SamplingParams(max_tokens=3, **GREEDY))
    outs = run_to_end(eng)
    assert [t for o in outs["a"] for t in o.new_token_ids] == [7042, 30, 198]
    assert sched.stats().num_free_blocks == 8 == len(sched.free_block_ids())


def test_engine_refuses_a_scheduler_without_block_tables(model, checkpoint):
    """A reservation Scheduler built without a block_size hands out no tables: InvalidConfig names it."""
    from stallfree import InvalidConfig, Scheduler
    from stallfree.engine import LLMEngine

    with pytest.raises(InvalidConfig, match="block_table"):
        LLMEngine(model, checkpoint.tokenizer, scheduler=Scheduler(8, 2, 64))


# ---------------------------------------------------------------- issue 37: one request's sampling fault fails it alone


def test_sampling_fault_fails_one_request_and_not_the_step(make_engine, run_to_end, monkeypatch):
    """When sampling one request's row raises (injected: any row with temperature 1.3), that request ends
    with finish_reason "error", no token and an error text, its KV is released, and the greedy request
    batched with it generates exactly the tokens it generates alone; temperature 1e-40 is greedy."""
    from stallfree.engine import engine as engine_mod
    from stallfree.engine.sampling import sample_tokens

    def faulty(logits, params, gens):
        if any(p.temperature == 1.3 for p in params):
            raise RuntimeError("index -1 is out of bounds for dimension 1")
        return sample_tokens(logits, params, gens)

    alone = make_engine()
    alone.add_request("a", "The capital of France is", SamplingParams(max_tokens=6, temperature=0))
    want = [t for o in run_to_end(alone)["a"] for t in o.new_token_ids]

    monkeypatch.setattr(engine_mod, "sample_tokens", faulty)
    eng = make_engine()
    eng.add_request("a", "The capital of France is", SamplingParams(max_tokens=6, temperature=0))
    eng.add_request("bad", "Hello", SamplingParams(max_tokens=6, temperature=1.3))
    eng.add_request("tiny", "The capital of France is", SamplingParams(max_tokens=6, temperature=1e-40))
    outs = run_to_end(eng)
    assert [t for o in outs["a"] for t in o.new_token_ids] == want
    assert [t for o in outs["tiny"] for t in o.new_token_ids] == want
    (last,) = outs["bad"]
    assert (last.finished, last.finish_reason, last.new_token_ids) == (True, "error", [])
    assert "sampling failed" in last.error and "temperature=1.3" in last.error
    assert eng.scheduler.kv_free == eng.scheduler.stats().kv_total and not eng.has_unfinished()


def test_tenant_reaches_the_scheduler_and_a_queue_timeout_ends_with_no_token(make_engine, run_to_end):
    """Under fairness="vtc" a request's tenant is counted by the scheduler; with one slot and a 1 s queue
    limit on a clock the test moves, a request still waiting 2 s after its arrival ends with one output:
    no token, finish_reason "timeout"; its neighbour finishes as usual and nothing is left."""
    now = [0.0]
    eng = make_engine(max_seqs=1, fairness="vtc", max_queue_time_s=1.0, clock=lambda: now[0])
    now[0] = time.monotonic()  # the engine stamps arrivals with time.monotonic()
    eng.add_request("a", PARIS, SamplingParams(max_tokens=3, **GREEDY), tenant="alice")
    eng.add_request("b", PARIS, SamplingParams(max_tokens=2, **GREEDY), tenant="bob")
    first = eng.step()  # a's prefill; b waits for the slot
    assert [o.rid for o in first] == ["a"]
    now[0] += 2.0
    outs = run_to_end(eng)
    assert [(o.new_token_ids, o.finish_reason) for o in outs["b"]] == [([], "timeout")]
    assert outs["a"][-1].finish_reason == "length"
    assert eng.scheduler.stats().tenant_served_tokens == {"alice": 7}  # 5 prompt tokens + 2 decodes
    assert not eng.has_unfinished()
