"""Hostile requests to the Responses API (/v1/responses), with the guarantees of test_serving.py: every bad request
is a 4xx in OpenAI's error shape that names the field (nesting past the limit, lone UTF-16 surrogates, NaN, absurd
numbers, wrong types anywhere in the input items and tools), no body makes the server answer 500 or stop serving,
and no id makes GET or DELETE /v1/responses/{id} fail. The fuzz targets run a bounded number of examples (a few
seconds); LILY_FUZZ_SECONDS=<s> runs each for about that long instead."""
import json
import urllib.parse

import pytest
from hypothesis import strategies as st

from lily.parsers import MAX_JSON_DEPTH
from live_server import WEATHER, fetch
from test_serving import (HOSTILE, SURROGATE_TEXT, TEXT, _encode, _post, _replace, _still_serving, fuzz,
                          live)  # noqa: F401 (live: the fixture, a server scripted to say 'ok')

ROUTE = "/v1/responses"
TOOL = {"type": "function", **WEATHER["function"]}


def _body(**fields) -> dict:
    return {"input": "hi", "max_output_tokens": 1, **fields}


def _with_call(arguments: str) -> dict:
    return _body(input=[{"role": "user", "content": "x"},
                        {"type": "function_call", "call_id": "c", "name": "f", "arguments": arguments}])


HOSTILE_REQUESTS = [
    # (id, body, the field the error must name)
    ("json-100000-deep", b'{"input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "input"),
    ("json-deeper-than-the-limit", b'{"input": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}", "input[0]"),
    ("arguments-1000-deep", _with_call("[" * 1000 + "]" * 1000), "input[1].arguments"),
    ("arguments-surrogate", _with_call('{"a": "\\ud800"}'), "input[1].arguments.a"),
    ("arguments-nan", _with_call('{"a": NaN}'), "input[1].arguments"),
    ("arguments-not-an-object", _with_call("[1]"), "input[1].arguments"),
    ("lone-surrogate-input", b'{"input": "a\\ud800b"}', "input"),
    ("lone-surrogate-part", b'{"input": [{"role": "user", "content": [{"type": "input_text", "text": "\\udfff"}]}]}',
     "input[0].content[0].text"),
    ("surrogate-instructions", b'{"input": "x", "instructions": "\\udc00"}', "instructions"),
    ("surrogate-tool-name", _body(tools=[{"type": "function", "name": "\ud800"}]), "tools[0].name"),
    ("tool-schema-300-deep", _body(tools=[{**TOOL, "parameters": json.loads("[" * 300 + "]" * 300)}]), "tools[0]"),
    ("nan-temperature", b'{"input": "x", "temperature": NaN}', None),
    ("temperature-1e308", _body(temperature=1e308), "temperature"),
    ("top-p-1e-50", _body(top_p=1e-50), "top_p"),
    ("max-output-tokens-2**70", _body(max_output_tokens=2**70), "max_output_tokens"),
    ("previous-id-not-a-string", _body(previous_response_id=["resp_x"]), "previous_response_id"),
    ("role-a-list", _body(input=[{"role": [], "content": "hi"}]), "input[0].role"),
    ("role-an-object", _body(input=[{"type": "message", "role": {"a": 1}, "content": "hi"}]), "input[0].role"),
    ("metadata-not-an-object", _body(metadata="x"), "metadata"),
    ("reasoning-not-an-object", _body(reasoning="high"), "reasoning"),
    ("output-not-text", _body(input=[{"role": "user", "content": "x"},
                                     {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                                     {"type": "function_call_output", "call_id": "c", "output": {"a": 1}}]),
     "input[2].output"),
]


@pytest.mark.parametrize("body,param", [c[1:] for c in HOSTILE_REQUESTS], ids=[c[0] for c in HOSTILE_REQUESTS])
def test_hostile_requests_get_a_4xx_naming_the_field(live, body, param):
    status, err = _post(live.port, ROUTE, body)
    assert 400 <= status < 500, (status, err)
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"], err
    assert err["error"]["param"] == param, err
    _still_serving(live.port)


# A request generator: a valid body (a random subset of the fields, input items that fit together), then most often
# one or two fields replaced by hostile values, at the top or inside the items and tools; sometimes not an object.
def _call(call_id: str, city: str, output) -> list[dict]:
    return [{"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": json.dumps({"city": city})},
            {"type": "function_call_output", "call_id": call_id, "output": output}]


TEXT_PARTS = st.lists(st.builds(lambda t: {"type": "input_text", "text": t}, TEXT), min_size=1, max_size=2)
ITEMS = st.one_of(
    st.builds(lambda role, content: [{"role": role, "content": content}],
              st.sampled_from(["user", "system", "developer"]), TEXT | TEXT_PARTS),
    st.builds(lambda t: [{"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": t, "annotations": []}]}], TEXT),
    st.builds(lambda t, summary: [{"type": "reasoning", "summary": summary,
                                   "content": [{"type": "reasoning_text", "text": t}]}],
              TEXT, st.lists(st.builds(lambda t: {"type": "summary_text", "text": t}, TEXT), max_size=1)),
    st.builds(_call, TEXT.filter(bool), TEXT, TEXT | TEXT_PARTS))
INPUT = TEXT | st.lists(ITEMS, min_size=1, max_size=4).map(
    lambda groups: [item for group in groups for item in group] + [{"role": "user", "content": "hi"}])
EFFORTS = ["none", "minimal", "low", "medium", "high", "xhigh", "max"]
REQUEST = st.fixed_dictionaries({"input": INPUT}, optional={
    "model": st.just("tiny"), "instructions": TEXT, "tools": st.lists(st.just(TOOL), max_size=1),
    "tool_choice": st.sampled_from(["auto", "none"]), "max_output_tokens": st.integers(1, 3),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "store": st.booleans(),
    "reasoning": st.fixed_dictionaries({}, optional={"effort": st.sampled_from(EFFORTS),
                                                     "summary": st.sampled_from(["auto", "concise", "detailed"])}),
    "metadata": st.dictionaries(TEXT, TEXT, max_size=2), "parallel_tool_calls": st.booleans(),
    "text": st.just({"format": {"type": "text"}}), "truncation": st.just("disabled"), "user": TEXT,
    "include": st.just(["reasoning.encrypted_content"]), "previous_response_id": st.just("resp_missing")})
FIELDS = ["input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p", "stream",
          "store", "reasoning", "metadata", "parallel_tool_calls", "text", "truncation", "user", "include",
          "previous_response_id", "background", "conversation", "prompt", "top_logprobs", "model"]
NESTED_PATHS = st.sampled_from([
    ("input", 0), ("input", 0, "role"), ("input", 0, "type"), ("input", 0, "content"),
    ("input", 0, "content", 0, "text"), ("input", 0, "call_id"), ("input", 0, "name"), ("input", 0, "arguments"),
    ("input", 1, "output"), ("input", 1, "call_id"), ("input", 0, "summary"), ("tools", 0), ("tools", 0, "type"),
    ("tools", 0, "name"), ("tools", 0, "parameters"), ("reasoning", "effort"), ("text", "format"),
    ("metadata", "k")])
REQUESTS = st.tuples(REQUEST, st.booleans(), st.dictionaries(st.sampled_from(FIELDS), HOSTILE, max_size=2),
                     st.lists(st.tuples(NESTED_PATHS, HOSTILE), max_size=2), st.booleans(), st.integers(0, 19),
                     HOSTILE)


def _check_answer(status: int, body) -> str | None:
    """Checks an answer; returns the id of a response it stored, if any."""
    if status == 200:
        if isinstance(body, str):  # a stream: complete, no failure
            last = body.strip().rsplit("\n\n", 1)[-1]
            assert last.startswith(("event: response.completed", "event: response.incomplete")), body[-500:]
            assert "response.failed" not in body, body[-500:]
            return None
        assert body["object"] == "response" and body["status"] in ("completed", "incomplete"), body
        return body["id"] if body["store"] else None
    assert status in (400, 404, 413), (status, body)
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"], body
    return None


def test_fuzz_requests_never_get_a_500_and_the_server_keeps_serving(live):
    stored = []

    def check(request):
        body, stream, fields, nested, continue_stored, dice, junk = request
        if continue_stored and stored:  # a conversation that continues a stored response
            body = {**body, "previous_response_id": stored[-1]}
        body = {**body, "stream": stream, **fields}
        for path, value in nested:
            body = _replace(body, path, value)
        if dice == 13:  # now and then, not an object, or an object of anything
            body = junk
        status, answer = fetch(live.port, "POST", ROUTE, _encode(body))
        if (rid := _check_answer(status, answer)) is not None:
            stored.append(rid)

    fuzz(check, REQUESTS, examples=60)
    _still_serving(live.port)
    assert _post(live.port, ROUTE, _body())[0] == 200


def test_fuzz_response_ids(live):
    status, body = _post(live.port, ROUTE, _body())
    assert status == 200, body
    real = body["id"]

    def check(name):
        path = "/v1/responses/" + urllib.parse.quote(name, safe="", errors="surrogatepass")
        for method in ("GET", "DELETE"):
            status, answer = fetch(live.port, method, path)
            if "/" in name:  # not an id: another route (Starlette redirects a trailing slash)
                assert status in (307, 404), (method, path, status, answer)
            else:
                assert status == 404 and answer["error"]["param"] == "response_id", (method, path, status, answer)

    names = (SURROGATE_TEXT | TEXT | st.sampled_from(["resp_", "resp_" + "0" * 32, "..", "%00", real[:-1]])).filter(
        lambda name: name and name != real)  # "": /v1/responses/, redirected to the POST route
    fuzz(check, names, examples=60)
    assert fetch(live.port, "GET", f"/v1/responses/{real}")[0] == 200
    assert fetch(live.port, "DELETE", f"/v1/responses/{real}")[0] == 200
    assert fetch(live.port, "GET", f"/v1/responses/{real}")[0] == 404
