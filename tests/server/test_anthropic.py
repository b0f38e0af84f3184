"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens): requests turned into the chat template's
terms (checked against the OpenAI path's), then end to end through the official `anthropic` client on the shared
tiny-model server: answers, streaming events, thinking, a tool-use round trip that continues the saved state,
stop sequences, token counting, the API key, and bad requests answered in Anthropic's error shape."""
import json

import anthropic
import pytest

from lily.generate import GenerationResponse, stream_generate
from lily.server import Engine, RequestError
from lily.server import openai as openai_api
from lily.server.anthropic import normalize_messages, parse_messages_request
from lily.server.protocol import render_conversation
from live_server import MAX_CONTEXT, WEATHER, LiveServer, Script, words

WEATHER_TOOL = {"name": "get_weather", "description": "Weather forecast for a city.",
                "input_schema": WEATHER["function"]["parameters"]}
NO_THINKING = {"type": "disabled"}
GREEDY = {"temperature": 0}


@pytest.fixture
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _dumps(content) -> list[dict]:
    """Content blocks as JSON, whichever client type holds them (a streamed text block is a ParsedTextBlock)."""
    return [b.model_dump(exclude_none=True) for b in content]


def _body(**fields) -> dict:
    return {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **fields}


# -- requests, without a server ----------------------------------------------------------------------------

CONVERSATION = {
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=5e3a1;\nBe brief."},
               {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need the tool.", "signature": ""},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 2}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no such city", "is_error": True},
            {"type": "text", "text": "And tomorrow?"}]}]}
# The same conversation as the OpenAI chat API takes it.
OPENAI_MESSAGES = [
    {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Let me check.", "reasoning_content": "Need the tool.", "tool_calls": [
        {"id": "toolu_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "toolu_2", "content": "no such city"},
    {"role": "user", "content": "And tomorrow?"}]


def test_messages_become_what_the_openai_path_gives(tiny_model):
    messages = normalize_messages(CONVERSATION)
    assert messages == openai_api.normalize_messages(OPENAI_MESSAGES)
    assert messages[0] == {"role": "system", "content": "Be brief.\n\nUse tools."}  # no billing line
    assert messages[-3:] == [{"role": "tool", "content": "18 C", "tool_call_id": "toolu_1"},
                             {"role": "tool", "content": "no such city", "tool_call_id": "toolu_2"},
                             {"role": "user", "content": "And tomorrow?"}]
    req = parse_messages_request({**CONVERSATION, "max_tokens": 5, "tools": [WEATHER_TOOL]}, tiny_model)
    assert req.tools == [WEATHER]
    chat = openai_api.parse_chat_request({"messages": OPENAI_MESSAGES, "tools": [WEATHER]}, tiny_model)
    assert render_conversation(tiny_model, req.messages, req.tools, req.template_kwargs) == \
        openai_api.render_chat(tiny_model, chat)
    assert normalize_messages({"system": "x-anthropic-billing-header: a=1;\n", "messages": [
        {"role": "user", "content": []}]}) == [{"role": "user", "content": ""}]


def test_settings_tools_and_thinking(tiny_model):
    req = parse_messages_request(_body(temperature=0.3, top_p=0.7, top_k=7, max_tokens=9, stop_sequences=["END"],
                                       stream=True, metadata={"user_id": "u"}, service_tier="auto",
                                       tools=[WEATHER_TOOL], tool_choice={"type": "auto"}), tiny_model)
    assert req.sampling.params == {"temperature": 0.3, "top_p": 0.7, "top_k": 7, "stop": ["END"],
                                   "top_logprobs": 0}
    assert (req.sampling.max_tokens, req.stream, req.tools, req.template_kwargs) == (9, True, [WEATHER], {})
    assert parse_messages_request(_body(tools=[WEATHER_TOOL], tool_choice={"type": "none"}), tiny_model).tools is None
    for thinking, kwargs in (({"type": "enabled", "budget_tokens": 1024}, {"enable_thinking": True}),
                             ({"type": "adaptive"}, {"enable_thinking": True}),
                             (NO_THINKING, {"enable_thinking": False})):
        assert parse_messages_request(_body(thinking=thinking), tiny_model).template_kwargs == kwargs
    no_description = {"name": "f", "input_schema": {"type": "object"}}
    assert parse_messages_request(_body(tools=[no_description]), tiny_model).tools == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(RequestError, match="does not constrain decoding") as err:
        parse_messages_request(_body(tool_choice={"type": "any"}), tiny_model)
    assert err.value.param == "tool_choice.type"


# -- the official client, end to end -------------------------------------------------------------------------

def test_create_with_string_and_block_content(client, tiny_model):
    text = words()
    r = client.messages.create(model="tiny", max_tokens=6, system="Be brief.", messages=[
        {"role": "user", "content": text}], thinking=NO_THINKING, extra_body=GREEDY)
    prompt = tiny_model.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}], enable_thinking=False)
    assert r.type == "message" and r.role == "assistant" and r.model == "tiny" and r.id.startswith("msg_")
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert 1 <= r.usage.output_tokens <= 6 and r.usage.cache_creation_input_tokens == 0
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(tiny_model.tokenizer.encode(prompt))
    assert [b.type for b in r.content] in (["text"], [])
    # The same request in blocks renders the same prompt: the same greedy answer, its prefix from saved state.
    blocks = client.messages.create(
        model="tiny", max_tokens=6, system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": text[:3]},
                                               {"type": "text", "text": text[3:]}]}],
        thinking=NO_THINKING, extra_body=GREEDY)
    assert blocks.content == r.content and blocks.stop_reason == r.stop_reason
    assert blocks.usage.input_tokens + blocks.usage.cache_read_input_tokens == \
        r.usage.input_tokens + r.usage.cache_read_input_tokens
    assert blocks.usage.cache_read_input_tokens > 0


def test_streamed_thinking_and_text(client, script):
    script.reply = lambda prompt: "Thinking it over.\n</think>\n\nHello there!"
    kwargs = dict(model="tiny", max_tokens=50, messages=[{"role": "user", "content": words()}],
                  thinking={"type": "enabled", "budget_tokens": 1024})
    events = list(client.messages.create(**kwargs, stream=True))
    assert script.prompts[-1].endswith("<|im_start|>assistant\n<think>\n")
    kinds = [(e.type, getattr(e, "index", None)) for e in events]
    blocks = [k for k in kinds if k[0] != "content_block_delta"]
    assert blocks == [("message_start", None), ("content_block_start", 0), ("content_block_stop", 0),
                      ("content_block_start", 1), ("content_block_stop", 1), ("message_delta", None),
                      ("message_stop", None)]
    deltas = [(e.index, e.delta.type) for e in events if e.type == "content_block_delta"]
    thinking = [kind for index, kind in deltas if index == 0]
    assert deltas == [(0, kind) for kind in thinking] + [(1, "text_delta")] * (len(deltas) - len(thinking))
    assert set(thinking[:-1]) == {"thinking_delta"} and thinking[-1] == "signature_delta"
    assert len(thinking) < len(deltas)
    assert events[1].content_block.type == "thinking" and events[1].content_block.thinking == ""
    start = events[0].message
    assert start.content == [] and start.stop_reason is None and start.usage.input_tokens > 0
    assert events[-2].delta.stop_reason == "end_turn" and events[-2].usage.output_tokens > 1

    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello there!"
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == \
        [("thinking", "Thinking it over."), ("text", "Hello there!")]
    assert final.content[0].signature == "" and final.stop_reason == "end_turn"
    whole = client.messages.create(**kwargs)
    assert _dumps(whole.content) == _dumps(final.content) and whole.usage.output_tokens == final.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens

    script.reply = lambda prompt: "Plain answer."
    r = client.messages.create(**{**kwargs, "thinking": NO_THINKING})
    assert [(b.type, b.text) for b in r.content] == [("text", "Plain answer.")]
    assert script.prompts[-1].endswith("<think>\n\n</think>\n\n")


TOOL_REPLY = ("The user wants the forecast, so I call the tool.\n</think>\n\nLet me check.\n\n<tool_call>\n"
              "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
              "</function>\n</tool_call>")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_use_round_trip_continues_the_saved_state(client, script, stream):
    script.feed = True  # the state holds the reply, as after a real generation
    script.reply = lambda prompt: TOOL_REPLY
    messages = [{"role": "user", "content": f"What's the weather in Paris for two days? {words()}"}]
    kwargs = dict(model="tiny", max_tokens=200, tools=[WEATHER_TOOL])
    if stream:
        with client.messages.stream(messages=messages, **kwargs) as s:
            inputs = [e.partial_json for e in s if e.type == "input_json"]
            r = s.get_final_message()
        assert [json.loads(i) for i in inputs] == [{"city": "Paris", "days": 2}]
    else:
        r = client.messages.create(messages=messages, **kwargs)
    assert r.stop_reason == "tool_use"
    thinking, text, call = r.content
    assert thinking.thinking == "The user wants the forecast, so I call the tool." and text.text == "Let me check."
    assert call.type == "tool_use" and call.id.startswith("toolu_") and call.name == "get_weather"
    assert call.input == {"city": "Paris", "days": 2}

    messages += [{"role": "assistant", "content": _dumps(r.content)},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": '{"temp_c": 18, "sky": "clear"}'}]}]
    script.reply = lambda prompt: "The tool answered.\n</think>\n\nIt will be 18 °C and clear in Paris."
    r2 = client.messages.create(messages=messages, **kwargs)
    assert r2.stop_reason == "end_turn" and [b.type for b in r2.content] == ["thinking", "text"]
    assert r2.content[1].text == "It will be 18 °C and clear in Paris."
    assert '{"temp_c": 18, "sky": "clear"}<|im_end|>\n<|im_start|>assistant\n<think>\n' in script.prompts[-1]
    # Continued from the state after the first reply: its prompt and all of its reply but the last token (not fed).
    first = r.usage.input_tokens + r.usage.cache_read_input_tokens
    assert r2.usage.cache_read_input_tokens == first + r.usage.output_tokens - 1


def test_a_claude_code_turn_with_the_real_template_continues_the_state(real_template_model):
    """Claude Code's shape: a billing line first in the system prompt, new in every request; a system reminder as a
    text block; a tool loop. With the real chat template the second turn prefills only the tool result."""
    model = real_template_model
    script = Script(lambda prompt: TOOL_REPLY, feed=True)
    live = LiveServer(Engine(model, max_context=2048, generate_fn=script))
    try:
        client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=120)
        reminder = {"type": "text", "text": "<system-reminder>Be careful.</system-reminder>"}
        messages = [{"role": "user", "content": [reminder, {"type": "text", "text": "What's the weather in Paris?"}]}]

        def create(nonce: str):
            system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; cch={nonce};"},
                      {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}]
            return client.messages.create(model="tiny", max_tokens=500, system=system, tools=[WEATHER_TOOL],
                                          messages=messages)

        r = create("5e3a1")
        assert r.stop_reason == "tool_use" and "x-anthropic-billing-header" not in script.prompts[-1]
        messages += [{"role": "assistant", "content": _dumps(r.content)},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": r.content[-1].id,
                                                   "content": "18 C"}]}]
        script.reply = lambda prompt: "Done.\n</think>\n\nIt is 18 C."
        r2 = create("0aa9f")
        assert script.prompts[-1].endswith("<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n"
                                           "<|im_start|>assistant\n<think>\n")
        first = r.usage.input_tokens + r.usage.cache_read_input_tokens
        assert r2.usage.cache_read_input_tokens == first + r.usage.output_tokens - 1
        assert r2.usage.input_tokens < 40
    finally:
        live.close()


def test_stop_sequences(client):
    for _ in range(10):  # a greedy answer, and two characters first said a third of the way in or later
        kwargs = dict(model="tiny", max_tokens=24, messages=[{"role": "user", "content": words()}],
                      thinking=NO_THINKING, extra_body=GREEDY)
        text = "".join(b.text for b in client.messages.create(**kwargs).content)
        at = next((i for i in range(len(text) // 3, len(text) - 2)
                   if text.find(text[i:i + 2]) == i and not any(c.isspace() for c in text[i:i + 2])), None)
        if at is not None:
            break
    else:
        pytest.fail("the tiny model said too little to pick a stop sequence from")
    stop = text[at:at + 2]
    r = client.messages.create(**kwargs, stop_sequences=["never-said", stop])
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    assert text.startswith(r.content[0].text) and stop not in r.content[0].text
    with client.messages.stream(**kwargs, stop_sequences=[stop]) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence, _dumps(final.content)) == ("stop_sequence", stop, _dumps(r.content))


def test_max_tokens_and_the_context_window(client, script):
    script.reply = lambda prompt: "one two three four five six seven"
    r = client.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "count"}],
                               thinking=NO_THINKING)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3
    script.reply = lambda prompt: "word " * MAX_CONTEXT
    r = client.messages.create(model="tiny", max_tokens=100_000, messages=[{"role": "user", "content": "go"}],
                               thinking=NO_THINKING)
    assert r.stop_reason == "model_context_window_exceeded"
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens + r.usage.output_tokens == MAX_CONTEXT


def test_count_tokens_equals_the_prompt_of_a_real_request(client, script):
    script.reply = lambda prompt: "ok"
    kwargs = dict(model="tiny", system=[{"type": "text", "text": "Be brief."}], tools=[WEATHER_TOOL],
                  messages=[{"role": "user", "content": [{"type": "text", "text": words(6)}]}], thinking=NO_THINKING)
    counted = client.messages.count_tokens(**kwargs).input_tokens
    r = client.messages.create(max_tokens=2, **kwargs)
    assert counted == r.usage.input_tokens + r.usage.cache_read_input_tokens
    assert client.messages.count_tokens(**{**kwargs, "thinking": {"type": "adaptive"}}).input_tokens == counted - 4


def test_api_key_by_x_api_key_and_bearer(tiny_model):
    live = LiveServer(Engine(tiny_model, max_context=MAX_CONTEXT), api_key="sekrit")
    try:
        def create(**auth):
            c = anthropic.Anthropic(base_url=live.url, max_retries=0, timeout=120, **auth)
            return c.messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "hi"}])

        assert create(api_key="sekrit").type == "message"
        assert create(auth_token="sekrit").type == "message"
        with pytest.raises(anthropic.AuthenticationError) as err:
            create(api_key="wrong")
        assert err.value.status_code == 401 and err.value.body["type"] == "error"
        assert err.value.body["error"]["type"] == "authentication_error"
        status, body = live.request("POST", "/v1/messages/count_tokens", _body())
        assert status == 401 and body["error"]["type"] == "authentication_error"
    finally:
        live.close()


BAD_REQUESTS = [
    ("malformed-json", b'{"model": "tiny", "messages": [', 400, "not valid JSON"),
    ("no-max-tokens", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, 400, "'max_tokens'"),
    ("max-tokens-zero", _body(max_tokens=0), 400, "'max_tokens'"),
    ("no-messages", {"model": "tiny", "max_tokens": 2}, 400, "'messages'"),
    ("bad-role", _body(messages=[{"role": "system", "content": "x"}]), 400, "'messages.0.role'"),
    ("content-number", _body(messages=[{"role": "user", "content": 42}]), 400, "'messages.0.content'"),
    ("image", _body(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]), 400,
     "'messages.1.content.0.type': 'image' blocks are not supported here (this model reads text only)"),
    ("document", _body(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]), 400,
     "'messages.0.content.0.type'"),
    ("tool-use-from-user", _body(messages=[{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]), 400, "'messages.0.content.0.type'"),
    ("text-not-string", _body(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]), 400,
     "'messages.0.content.0.text'"),
    ("tool-result-image", _body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                                        "content": [{"type": "image"}]}]}]), 400,
     "'messages.0.content.0.content.0.type'"),
    ("tool-result-no-id", _body(messages=[{"role": "user", "content": [{"type": "tool_result"}]}]), 400,
     "'messages.0.content.0.tool_use_id'"),
    ("tool-use-input", _body(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}, {"role": "user", "content": "b"}]), 400,
     "'messages.1.content.0.input'"),
    ("prefill", _body(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "The"}]), 400,
     "'messages.1': the last message must be the user's"),
    ("system-number", _body(system=42), 400, "'system'"),
    ("system-image", _body(system=[{"type": "image"}]), 400, "'system.0.type'"),
    ("thinking-type", _body(thinking={"type": "deep"}), 400, "'thinking.type'"),
    ("thinking-budget", _body(thinking={"type": "enabled"}), 400, "'thinking.budget_tokens'"),
    ("tool-choice-any", _body(tools=[WEATHER_TOOL], tool_choice={"type": "any"}), 400, "cannot force a tool call"),
    ("tool-choice-tool", _body(tools=[WEATHER_TOOL], tool_choice={"type": "tool", "name": "get_weather"}), 400,
     "tool_choice 'tool' is not supported"),
    ("server-tool", _body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400, "'tools.0.type'"),
    ("no-schema", _body(tools=[{"name": "f"}]), 400, "'tools.0.input_schema'"),
    ("stop-empty", _body(stop_sequences=[""]), 400, "'stop_sequences'"),
    ("temperature", _body(temperature="hot"), 400, "'temperature'"),
    ("stream", _body(stream="yes"), 400, "'stream'"),
    ("structured", _body(output_config={"format": {"type": "json_schema", "schema": {}}}), 400,
     "'output_config.format'"),
    ("unknown-model", _body(model="claude-sonnet-4-5"), 404, "does not exist"),
    ("over-long", _body(messages=[{"role": "user", "content": "word " * MAX_CONTEXT}]), 400,
     "maximum context length"),
]


@pytest.mark.parametrize("body,status,says", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_requests_get_anthropic_errors_and_the_server_keeps_serving(server, body, status, says):
    got, err = server.request("POST", "/v1/messages", body)
    assert got == status, err
    assert set(err) == {"type", "error"} and err["type"] == "error" and set(err["error"]) == {"type", "message"}
    assert err["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert says in err["error"]["message"], err
    assert server.request("POST", "/v1/messages", _body())[0] == 200


def test_other_routes_and_methods_under_messages(server):
    for method, path, status in (("GET", "/v1/messages", 405), ("GET", "/v1/messages/count_tokens", 405),
                                 ("POST", "/v1/messages/batches", 404), ("GET", "/v1/messages/x/y", 404)):
        got, err = server.request(method, path)
        assert got == status and err["type"] == "error", (method, path, err)
        assert err["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    got, err = server.request("POST", "/v1/messages/count_tokens", {"model": "tiny", "messages": []})
    assert got == 400 and err["error"]["type"] == "invalid_request_error" and "'messages'" in err["error"]["message"]


def test_the_client_raises_on_errors(client):
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model="tiny", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.NotFoundError, match="does not exist"):
        client.messages.create(model="other", max_tokens=1, messages=[{"role": "user", "content": "x"}])


def test_an_error_mid_stream_is_an_error_event(client, server):
    def failing(model, prompt_ids, *, session, sampling, progress=None):
        yield GenerationResponse("Hel", 1, -0.5, prompt_tokens=len(prompt_ids))
        raise RuntimeError("the backend fell over")

    server.engine.generate_fn = failing
    try:
        with pytest.raises(anthropic.APIStatusError, match="the backend fell over") as err:
            list(client.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                                        stream=True))
        assert err.value.body["error"]["type"] == "api_error"
    finally:
        server.engine.generate_fn = stream_generate
    assert client.messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
