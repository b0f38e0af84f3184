"""Hostile requests to the Anthropic Messages API (/v1/messages, /v1/messages/count_tokens): whatever the body, the
answer is a complete reply or a 4xx in Anthropic's error shape, never a 500, and the server keeps serving. The
generator and the fuzz bounds are test_serving.py's (LILY_FUZZ_SECONDS=<s> runs for about that long)."""
from hypothesis import strategies as st

from live_server import WEATHER, fetch
from test_serving import HOSTILE, JSON, TEXT, _encode, _replace, _still_serving, fuzz, live  # noqa: F401 (fixture)

TOOL = {"name": "get_weather", "description": "Weather forecast for a city.",
        "input_schema": WEATHER["function"]["parameters"]}

# A valid body (a random subset of its fields, plausible values), then most often a field or two replaced by hostile
# values (absurd numbers, arbitrary JSON, lone surrogates, deep nesting), now and then not an object at all.
TEXT_BLOCK = st.builds(lambda t: {"type": "text", "text": t}, TEXT)
TOOL_USE = st.builds(lambda call_id, city: {"type": "tool_use", "id": call_id, "name": "get_weather",
                                            "input": {"city": city}}, TEXT, TEXT)
TOOL_RESULT = st.builds(lambda call_id, content, error: {"type": "tool_result", "tool_use_id": call_id,
                                                         "content": content, "is_error": error},
                        TEXT, TEXT | st.lists(TEXT_BLOCK, max_size=2), st.booleans())
THINKING = st.builds(lambda t: {"type": "thinking", "thinking": t, "signature": ""}, TEXT)
MESSAGES = st.lists(st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, TEXT | st.lists(TEXT_BLOCK | TOOL_RESULT, max_size=3)),
    st.builds(lambda c: {"role": "assistant", "content": c},
              TEXT | st.lists(THINKING | TEXT_BLOCK | TOOL_USE | st.just({"type": "redacted_thinking", "data": "x"}),
                              max_size=3))), max_size=3).map(lambda ms: ms + [{"role": "user", "content": "hi"}])
OPTIONAL = {
    "model": st.just("tiny"), "system": TEXT | st.lists(TEXT_BLOCK, max_size=2),
    "tools": st.lists(st.just(TOOL), max_size=1),
    "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "none"},
                                    {"type": "auto", "disable_parallel_tool_use": True}]),
    "thinking": st.sampled_from([{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"},
                                 {"type": "adaptive"}]),
    "temperature": st.floats(0, 1), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50),
    "stop_sequences": st.lists(TEXT.filter(bool), max_size=2), "metadata": JSON, "service_tier": st.just("auto")}
BODY = st.fixed_dictionaries({"messages": MESSAGES, "max_tokens": st.integers(1, 3), "stream": st.booleans()},
                             optional=OPTIONAL)
FIELDS = ["messages", "max_tokens", "model", "system", "tools", "tool_choice", "thinking", "temperature", "top_p",
          "top_k", "stop_sequences", "stream", "metadata", "output_config", "mcp_servers"]
NESTED_PATHS = st.sampled_from([
    ("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"), ("messages", 0, "content", 0),
    ("messages", 0, "content", 0, "type"), ("messages", 0, "content", 0, "text"),
    ("messages", 0, "content", 0, "input"), ("messages", 0, "content", 0, "content"), ("system", 0),
    ("system", 0, "text"), ("tools", 0), ("tools", 0, "input_schema"), ("tools", 0, "type"),
    ("thinking", "type"), ("thinking", "budget_tokens"), ("tool_choice", "type")])
REQUESTS = st.tuples(st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]), BODY,
                     st.dictionaries(st.sampled_from(FIELDS), HOSTILE, max_size=2),
                     st.lists(st.tuples(NESTED_PATHS, HOSTILE), max_size=2), st.integers(0, 19), HOSTILE)


def _check_answer(status: int, body) -> None:
    if status == 200:
        if isinstance(body, str):  # a stream: complete, no error event
            assert body.rstrip().endswith('data: {"type": "message_stop"}') and "event: error" not in body, body[-500:]
        else:
            assert body.get("type") == "message" or set(body) == {"input_tokens"}, body
        return
    assert status in (400, 404, 413), (status, body)
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["message"], body


def test_fuzz_messages_requests_never_get_a_500_and_the_server_keeps_serving(live):
    def check(request):
        route, body, fields, nested, dice, junk = request
        body = {**body, **fields}
        for path, value in nested:
            body = _replace(body, path, value)
        if dice == 13:  # now and then, not an object, or an object of anything (hypothesis favours 0 and 19)
            body = junk
        status, answer = fetch(live.port, "POST", route, _encode(body))
        _check_answer(status, answer)

    fuzz(check, REQUESTS, examples=100)
    status, answer = fetch(live.port, "POST", "/v1/messages", {"max_tokens": 5, "thinking": {"type": "disabled"},
                                                               "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and answer["content"] == [{"type": "text", "text": "ok"}], answer
    _still_serving(live.port)
