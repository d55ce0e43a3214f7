"""The HTTP routes in process (httpx ASGITransport) over the fake engine.

Expected texts are worked out by hand from FakeEngine: the fake writes FakeEngine.TEXT
("the quick brown fox jumps over the lazy dog. ", 45 characters) from offset sum(prompt code points)
mod 45. For the prompt "hi": 104 + 105 = 209, 209 mod 45 = 29, so the output starts "r the lazy".
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from server.fake_engine import FakeEngine
from server.helpers import asgi_client, run, sse_events


def _post(client, path, body):
    return client.post(path, json=body)


def test_completion_text_and_usage():
    """A 5-token completion of "hi" is "r the", finish "length", usage 2 + 5."""

    async def go():
        async with asgi_client(FakeEngine()) as c:
            r = await _post(c, "/v1/completions", {"prompt": "hi", "max_tokens": 5})
            assert r.status_code == 200
            body = r.json()
            assert body["object"] == "text_completion"
            assert body["model"] == "fake-model"
            assert body["choices"][0]["text"] == "r the"
            assert body["choices"][0]["finish_reason"] == "length"
            assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}

    run(go())


def test_token_id_prompt_equals_text_prompt():
    """Token ids [104, 105] and a batch of one ["hi"] give the same text as "hi"."""

    async def go():
        async with asgi_client(FakeEngine()) as c:
            texts = []
            for prompt in ([104, 105], ["hi"], [[104, 105]]):
                r = await _post(c, "/v1/completions", {"prompt": prompt, "max_tokens": 5})
                texts.append(r.json()["choices"][0]["text"])
            assert texts == ["r the"] * 3

    run(go())


def test_chat_completion_uses_template():
    """The chat prompt is the template "<user>hi\\n<assistant>" (20 tokens); 3 tokens come back."""

    async def go():
        async with asgi_client(FakeEngine()) as c:
            r = await _post(
                c, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            )
            body = r.json()
            assert r.status_code == 200
            assert body["object"] == "chat.completion"
            assert body["choices"][0]["message"]["role"] == "assistant"
            assert body["usage"] == {"prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23}
            ids = [ord(ch) for ch in "<user>hi\n<assistant>"]
            start = sum(ids) % len(FakeEngine.TEXT)
            assert body["choices"][0]["message"]["content"] == (FakeEngine.TEXT * 2)[start : start + 3]

    run(go())


def test_stream_concatenation_equals_whole_text():
    """Streamed deltas concatenate to the non-streamed text; finish_reason appears once, last; then [DONE]."""

    async def go():
        async with asgi_client(FakeEngine()) as c:
            for max_tokens in (1, 3, 12):
                whole = (await _post(c, "/v1/completions", {"prompt": "hi", "max_tokens": max_tokens})).json()
                r = await _post(
                    c, "/v1/completions", {"prompt": "hi", "max_tokens": max_tokens, "stream": True}
                )
                assert r.headers["content-type"].startswith("text/event-stream")
                events = sse_events(r.text)
                assert events[-1] == "[DONE]"
                chunks = events[:-1]
                assert "".join(ch["choices"][0]["text"] for ch in chunks) == whole["choices"][0]["text"]
                reasons = [ch["choices"][0]["finish_reason"] for ch in chunks]
                assert reasons == [None] * (len(chunks) - 1) + ["length"]
                assert all(ch["choices"][0]["text"] for ch in chunks)  # no empty deltas, last token kept
                assert len(chunks) == max_tokens

    run(go())


def test_stream_include_usage_final_chunk():
    """With stream_options.include_usage the last chunk before [DONE] has empty choices and the usage."""

    async def go():
        async with asgi_client(FakeEngine()) as c:
            r = await _post(
                c,
                "/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
            events = sse_events(r.text)
            assert events[-1] == "[DONE]"
            usage = events[-2]
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
            assert usage["usage"]["prompt_tokens"] == 20
            first = events[0]["choices"][0]
            assert first["delta"] == {"role": "assistant", "content": ""}
            assert all(e["usage"] is None for e in events[:-2])
            content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-2])
            assert len(content) == 4
            assert events[-3]["choices"][0]["finish_reason"] == "length"

    run(go())


def test_stop_string_eos_and_stop_token_ids():
    """stop " t" cuts "r the" to "r"; EOS as 3rd token: 2 characters, 3 tokens; a stop token id ends it."""

    async def go():
        async with asgi_client(FakeEngine()) as c:
            r = (await _post(c, "/v1/completions", {"prompt": "hi", "max_tokens": 10, "stop": " t"})).json()
            assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == ("r", "stop")
            assert r["usage"]["completion_tokens"] == 3
        async with asgi_client(FakeEngine(eos_after=3)) as c:
            r = (await _post(c, "/v1/completions", {"prompt": "hi", "max_tokens": 10})).json()
            assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == ("r ", "stop")
            assert r["usage"]["completion_tokens"] == 3
            r = (
                await _post(c, "/v1/completions", {"prompt": "hi", "max_tokens": 5, "ignore_eos": True})
            ).json()
            assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 5
            r = (
                await _post(
                    c,
                    "/v1/completions",
                    {"prompt": "hi", "max_tokens": 2, "stop_token_ids": [ord(" ")], "ignore_eos": True},
                )
            ).json()
            assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == ("r ", "stop")

    run(go())


def test_sampling_fields_reach_the_engine():
    """temperature, top_p, top_k, min_p, seed and stop reach SamplingParams; top_k -1 means off (default)."""

    async def go():
        eng = FakeEngine()
        async with asgi_client(eng) as c:
            body = {
                "prompt": "hi",
                "max_tokens": 2,
                "temperature": 0.5,
                "top_p": 0.9,
                "top_k": 7,
                "min_p": 0.1,
                "seed": 42,
                "stop": "zz",
            }
            assert (await _post(c, "/v1/completions", body)).status_code == 200
            p = eng.params[eng.added[-1]]
            assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, list(p.stop)) == (
                0.5,
                0.9,
                7,
                0.1,
                42,
                ["zz"],
            )
            assert (
                await _post(c, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_k": -1})
            ).status_code == 200
            assert eng.params[eng.added[-1]].top_k == 0

    run(go())


def test_context_length_errors_b19():
    """max_model_len 64, budget 8: 70 + 1 and 60 + 10 are 400s with numbers; 40 + 10 is chunked, served."""

    async def go():
        eng = FakeEngine(token_budget=8, max_seqs=4, kv_tokens=64, max_model_len=64)
        async with asgi_client(eng) as c:
            r = await _post(c, "/v1/completions", {"prompt": "a" * 70, "max_tokens": 1})
            err = r.json()["error"]
            assert (
                r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "prompt"
            )
            assert "maximum context length is 64 tokens" in err["message"]
            assert "requested 71 tokens (70 in the prompt, 1 in the completion)" in err["message"]
            r = await _post(c, "/v1/completions", {"prompt": "a" * 60, "max_tokens": 10})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "max_tokens"
            assert "requested 70 tokens (60 in the prompt, 10 in the completion)" in err["message"]
            assert eng.added == []  # nothing was queued
            r = await _post(c, "/v1/completions", {"prompt": "a" * 40, "max_tokens": 10})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10

    run(go())


def test_default_max_tokens_bounded_by_context_and_kv():
    """Without max_tokens a request gets default_max_tokens, bounded by max_model_len and KV capacity."""

    async def go():
        eng = FakeEngine(kv_tokens=50, max_model_len=64)
        async with asgi_client(eng, default_max_tokens=8) as c:
            r = await _post(c, "/v1/completions", {"prompt": "hi"})
            assert r.json()["usage"]["completion_tokens"] == 8
            r = await _post(c, "/v1/completions", {"prompt": "a" * 45})  # 50 - 45 = 5 tokens of KV left
            assert r.json()["usage"]["completion_tokens"] == 5
            r = await _post(
                c, "/v1/completions", {"prompt": "a" * 30, "max_tokens": 30}
            )  # 60 > 50: never fits
            err = r.json()["error"]
            assert (
                r.status_code == 400 and err["param"] == "max_tokens" and "KV capacity 50" in err["message"]
            )

    run(go())


def test_empty_prompt_is_400_and_server_lives_b18():
    """An empty prompt is a 400 (not a 500); /health stays ok and the next request is served."""

    async def go():
        async with asgi_client(FakeEngine()) as c:
            r = await _post(c, "/v1/completions", {"prompt": "", "max_tokens": 20})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
            assert (await c.get("/health")).status_code == 200
            r = await _post(c, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "r "

    run(go())


def test_bad_requests_name_the_parameter():
    """Wrong types, ranges, unsupported features and batches are 400s naming the parameter; none queued."""

    async def go():
        eng = FakeEngine()
        async with asgi_client(eng) as c:
            cases = [
                ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
                ({"prompt": "hi", "temperature": 3}, "temperature"),
                ({"prompt": "hi", "n": 2}, "n"),
                ({"prompt": "hi", "best_of": 2}, "best_of"),
                ({"prompt": "hi", "logprobs": 2}, "logprobs"),
                ({"prompt": ["a", "b"]}, "prompt"),
                ({"prompt": [-1]}, "prompt"),
                ({"max_tokens": 3}, "prompt"),
            ]
            for body, param in cases:
                r = await _post(c, "/v1/completions", body)
                assert r.status_code == 400, body
                assert r.json()["error"]["param"] == param, body
            r = await c.post(
                "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
            )
            assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
            assert eng.added == []

    run(go())


def test_unknown_model_is_404_and_models_route():
    """/v1/models lists the served names with max_model_len; an unknown model is a 404 naming `model`."""

    async def go():
        async with asgi_client(FakeEngine(max_model_len=128), served_model_names=("tiny", "alias")) as c:
            data = (await c.get("/v1/models")).json()["data"]
            assert [m["id"] for m in data] == ["tiny", "alias"] and data[0]["max_model_len"] == 128
            r = await _post(c, "/v1/completions", {"model": "gpt-4", "prompt": "hi"})
            assert r.status_code == 404 and r.json()["error"]["param"] == "model"
            r = await _post(c, "/v1/completions", {"model": "alias", "prompt": "hi", "max_tokens": 1})
            assert r.status_code == 200 and r.json()["model"] == "tiny"

    run(go())


def test_priority_passed_or_refused():
    """priority reaches the engine under --scheduling-policy priority; under fcfs only priority 0 is accepted
    (any other value would be silently ignored, so it is a 400 naming the field)."""

    async def go():
        eng = FakeEngine(scheduling_policy="priority")
        async with asgi_client(eng) as c:
            assert (
                await _post(c, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "priority": 3})
            ).status_code == 200
            assert eng.priorities[eng.added[-1]] == 3
        eng = FakeEngine(scheduling_policy="fcfs")
        async with asgi_client(eng) as c:
            r = await _post(c, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "priority": 3})
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
            assert (
                await _post(c, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "priority": 0})
            ).status_code == 200

    run(go())


def test_step_failure_is_500_then_server_serves():
    """An exception inside a step fails that request with a 500 error object; the next request is served."""

    async def go():
        eng = FakeEngine()
        async with asgi_client(eng) as c:
            eng.fail_next_steps = 1
            r = await _post(c, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            assert "injected step failure" in r.json()["error"]["message"]
            r = await _post(c, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "r th"
            assert (await c.get("/health")).status_code == 200

    run(go())


def test_engine_dead_after_repeated_failures():
    """Three consecutive failed steps mark the engine dead: /health and new requests answer 503.

    The dead engine keeps its failed plan in flight, so its KV is not checked; the request was aborted.
    """

    async def go():
        eng = FakeEngine()
        async with asgi_client(eng, check_free=False) as c:
            eng.fail_next_steps = 3
            codes = [
                (await _post(c, "/v1/completions", {"prompt": "hi", "max_tokens": 4})).status_code
                for _ in range(3)
            ]
            # The first request fails; the engine retries the failed plan (without it) twice more,
            # failing each time, and is declared dead: later requests are refused.
            assert codes == [500, 503, 503]
            assert (await c.get("/health")).status_code == 503
            assert (await _post(c, "/v1/completions", {"prompt": "hi", "max_tokens": 4})).status_code == 503
            assert set(eng.aborted) == set(eng.added)  # none left running

    run(go())


def test_metrics_parse_and_count():
    """/metrics parses; counters, TTFT/ITL counts and gauges match three requests of 1, 3 and 5 tokens."""

    async def go():
        async with asgi_client(FakeEngine()) as c:
            for n in (1, 3, 5):
                assert (
                    await _post(c, "/v1/completions", {"prompt": "hi", "max_tokens": n})
                ).status_code == 200
            text = (await c.get("/metrics")).text
        samples = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        lab = (("model_name", "fake-model"),)
        assert samples[("stallfree_generation_tokens_total", lab)] == 9
        assert samples[("stallfree_prompt_tokens_total", lab)] == 6
        assert samples[("stallfree_time_to_first_token_seconds_count", lab)] == 3
        assert samples[("stallfree_inter_token_latency_seconds_count", lab)] == 0 + 2 + 4
        assert samples[("stallfree_time_per_output_token_seconds_count", lab)] == 2
        assert samples[("stallfree_e2e_request_latency_seconds_count", lab)] == 3
        assert samples[("stallfree_num_requests_running", lab)] == 0
        assert samples[("stallfree_num_requests_waiting", lab)] == 0
        assert samples[("stallfree_kv_cache_usage_ratio", lab)] == 0.0
        assert samples[("stallfree_preemptions_total", lab)] == 0
        assert samples[("stallfree_request_success_total", (("finished_reason", "length"),) + lab)] == 3
        assert samples[("stallfree_tokens_per_step_count", lab)] == 1 + 3 + 5

    run(go())
