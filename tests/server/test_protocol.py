"""Request validation: malformed JSON, wrong types, ranges, unknown and unsupported fields."""

from __future__ import annotations

import json

import pytest

from stallfree.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse_request


def _err(body: object, cls: type = CompletionRequest) -> ApiError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(ApiError) as info:
        parse_request(raw, cls)
    assert info.value.status == 400
    return info.value


def test_malformed_json_is_400():
    """A body that is not JSON is a 400 saying so, with no parameter."""
    err = _err(b'{"prompt": "hi",')
    assert "malformed JSON" in err.message
    assert err.param is None
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_non_object_body_is_400():
    """A JSON array body is a 400 naming the type it got."""
    assert "got list" in _err([1, 2]).message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "5"),
        ("max_tokens", 0),
        ("max_tokens", 2.5),
        ("temperature", 2.5),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("stream", "yes"),
        ("prompt", 5),
        ("stop_token_ids", [-1]),
    ],
    ids=lambda v: repr(v),
)
def test_bad_value_names_the_parameter(field, value):
    """A wrong type or an out-of-range value is a 400 whose param is the field."""
    body = {"prompt": "hi", field: value}
    err = _err(body)
    assert err.param == field
    assert field in err.message


@pytest.mark.parametrize(
    ("field", "value"),
    [("n", 2), ("best_of", 3), ("logprobs", 1), ("echo", True), ("presence_penalty", 0.5),
     ("logit_bias", {"1": 2.0}), ("suffix", "x")],
    ids=lambda v: repr(v),
)
def test_unsupported_feature_is_400_not_ignored(field, value):
    """An OpenAI field we do not implement, at a non-neutral value, is a 400 naming it."""
    err = _err({"prompt": "hi", field: value})
    assert err.param == field
    assert "not supported" in err.message


def test_unsupported_fields_at_neutral_values_are_accepted():
    """n=1, best_of=1, logprobs=null and zero penalties are what we do anyway, so they pass."""
    body = {"prompt": "hi", "n": 1, "best_of": 1, "logprobs": None, "presence_penalty": 0,
            "frequency_penalty": 0.0, "echo": False}
    req = parse_request(json.dumps(body).encode(), CompletionRequest)
    assert req.n == 1 and req.presence_penalty == 0.0


def test_unknown_field_is_400():
    """A field that is neither OpenAI's nor a vLLM extra we know is a 400 naming it."""
    err = _err({"prompt": "hi", "beam_width": 4})
    assert err.param == "beam_width"


def test_int_accepted_for_float_field():
    """JSON 1 is a valid temperature (strict types still allow int for float)."""
    req = parse_request(b'{"prompt": "hi", "temperature": 1}', CompletionRequest)
    assert req.temperature == 1.0


def test_stream_options_without_stream_is_400():
    """stream_options only make sense with stream=true."""
    err = _err({"prompt": "hi", "stream_options": {"include_usage": True}})
    assert err.param == "stream_options"


def test_chat_message_role_error_names_the_message():
    """A bad role names messages[0].role."""
    err = _err({"messages": [{"role": "robot", "content": "hi"}]}, ChatCompletionRequest)
    assert err.param == "messages[0].role"


def test_chat_logprobs_true_is_400():
    """Chat logprobs=true is refused, naming logprobs."""
    err = _err({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, ChatCompletionRequest)
    assert err.param == "logprobs"


def test_chat_max_completion_tokens_wins():
    """max_completion_tokens overrides max_tokens, as in OpenAI's API."""
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 5, "max_completion_tokens": 7}
    req = parse_request(json.dumps(body).encode(), ChatCompletionRequest)
    assert req.effective_max_tokens() == 7
    assert req.messages[0].text() == "ab"
