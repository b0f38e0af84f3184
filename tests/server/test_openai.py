"""The OpenAI API (/v1/chat/completions, /v1/completions) through the official `openai` client and raw HTTP, on the
shared tiny-model server: answers, streaming, logprobs, tool calls and reasoning end to end, request settings that
reach the sampler and the template, and bad requests answered with OpenAI errors while the server keeps serving."""
import json

import openai
import pytest

from lily.server import RequestError, normalize_messages, parse_chat_request, render_chat
from live_server import MAX_CONTEXT, NO_THINKING, WEATHER, chat_body, prefix_tokens, words


def test_chat_completion_greedy_with_logprobs(client, tiny_model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": words()}]
    r = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=6, logprobs=True,
                                       top_logprobs=3, extra_body=NO_THINKING)
    prompt = tiny_model.tokenizer.apply_chat_template(messages, enable_thinking=False)
    assert r.object == "chat.completion" and r.model == "tiny" and r.id.startswith("chatcmpl-")
    assert r.usage.prompt_tokens == len(tiny_model.tokenizer.encode(prompt))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.tool_calls is None
    entries = choice.logprobs.content
    assert 1 <= r.usage.completion_tokens <= 6
    assert len(entries) == r.usage.completion_tokens - (choice.finish_reason == "stop")
    for e in entries:  # greedy: every token is the most likely one
        assert len(e.top_logprobs) == 3 and e.logprob == e.top_logprobs[0].logprob <= 0
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)


def test_streaming_gives_the_same_answer_as_non_streaming(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": words()}], temperature=0, max_tokens=8,
                  extra_body=NO_THINKING)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert not chunks[-1].choices and all(c.usage is None for c in chunks[:-1])
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    # The second request found the conversation's first turn in the cache.
    assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


def test_completions(client, tiny_model):
    prompt = "Once upon a time " + words()
    whole = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=6, logprobs=2, echo=True)
    choice = whole.choices[0]
    assert whole.object == "text_completion" and choice.text.startswith(prompt)
    assert whole.usage.prompt_tokens == len(tiny_model.tokenizer.encode(prompt))
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == whole.usage.completion_tokens - (choice.finish_reason == "stop")
    # Two alternatives may decode to the same text (partial UTF-8 bytes): the legacy format keys them by text.
    assert lp.text_offset[0] == len(prompt) and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    streamed = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=6, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == choice.text[len(prompt):]
    ids = tiny_model.tokenizer.encode(prompt)
    by_ids = client.completions.create(model="tiny", prompt=ids, temperature=0, max_tokens=6)
    assert by_ids.choices[0].text == choice.text[len(prompt):] and by_ids.usage.prompt_tokens == len(ids)


def test_logprobs_carry_the_bytes_of_tokens_that_split_a_character(client, tiny_model, rng):
    """A third of the tiny vocabulary are parts of UTF-8 characters. Their `bytes` are their own (joined, they are the
    text), and their names escape the partial bytes, so that the alternatives at one position stay distinct (as
    "\ufffd" they collided, and the legacy dict lost entries)."""
    seed = int(rng.integers(2**31))
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": words()}], temperature=1,
                                       max_tokens=32, logprobs=True, top_logprobs=5, seed=seed, extra_body=NO_THINKING)
    entries = r.choices[0].logprobs.content
    text = b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace")
    assert text.strip() == (r.choices[0].message.content or "").strip()
    for e in entries:
        assert len({t.token for t in e.top_logprobs}) == 5
        for t in e.top_logprobs:
            assert bytes(t.bytes).decode("utf-8", "backslashreplace") == t.token
    legacy = client.completions.create(model="tiny", prompt=words(), temperature=1, max_tokens=32, logprobs=5,
                                       seed=seed)
    assert all(len(top) == 5 for top in legacy.choices[0].logprobs.top_logprobs)


TOOL_REPLY = ("The user wants the forecast, so I call the tool.\n</think>\n\nLet me check.\n\n<tool_call>\n"
              "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
              "</function>\n</tool_call>")


def test_tool_call_round_trip(client, script, tiny_model):
    messages = [{"role": "user", "content": "What's the weather in Paris for two days?"}]
    script.reply = lambda prompt: TOOL_REPLY
    r = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.content == "Let me check."
    assert msg.model_extra["reasoning_content"] == "The user wants the forecast, so I call the tool."
    (call,) = msg.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}

    streamed = list(client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], stream=True))
    deltas = [d for c in streamed for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == \
        [(0, "get_weather", {"city": "Paris", "days": 2})]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == "Let me check."

    messages += [msg.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18, "sky": "clear"}'}]
    script.reply = lambda prompt: "The tool answered.\n</think>\n\nIt will be 18 °C and clear in Paris."
    r2 = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER])
    assert r2.choices[0].finish_reason == "stop" and r2.choices[0].message.tool_calls is None
    assert r2.choices[0].message.content == "It will be 18 °C and clear in Paris."
    assert '{"temp_c": 18, "sky": "clear"}' in script.prompts[-1]
    # The scripted reply is not fed, so the state held the first prompt, which the template (thinking kept after a
    # tool result) renders again as the start of this one.
    tok = tiny_model.tokenizer
    first_prompt = tok.encode(tok.apply_chat_template(messages[:1], tools=[WEATHER], add_generation_prompt=True))
    assert r2.usage.prompt_tokens_details.cached_tokens == len(first_prompt)


def test_reasoning_is_separate_and_enable_thinking_is_honoured(client, script):
    script.reply = lambda prompt: "Thinking it over.\n</think>\n\nHello!"
    messages = [{"role": "user", "content": words()}]
    r = client.chat.completions.create(model="tiny", messages=messages)
    assert (r.choices[0].message.content, r.choices[0].message.model_extra["reasoning_content"]) == \
        ("Hello!", "Thinking it over.")
    assert script.prompts[-1].endswith("<|im_start|>assistant\n<think>\n")
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, stream=True))
    assert "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks) == \
        "Thinking it over."

    script.reply = lambda prompt: "Plain answer."
    for extra in (NO_THINKING, {"enable_thinking": False}):
        r = client.chat.completions.create(model="tiny", messages=messages, extra_body=extra)
        assert r.choices[0].message.content == "Plain answer."
        assert r.choices[0].message.model_extra["reasoning_content"] is None
        assert script.prompts[-1].endswith("<think>\n\n</think>\n\n")


def test_request_settings_reach_the_sampler_and_the_template(client, script, tiny_model):
    script.reply = lambda prompt: "ok"
    client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}, {"role": "system", "content": "Late rule."},
                                {"role": "developer", "content": "Dev rule."}],
        temperature=0.3, top_p=0.7, presence_penalty=0.5, frequency_penalty=0.25, seed=11, stop=["END", "STOP"],
        max_completion_tokens=9, logprobs=True, top_logprobs=4, logit_bias={"5": -100, "17": 2.5},
        extra_body={"top_k": 7, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 3})
    p = script.sampling[-1]
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.presence_penalty, p.frequency_penalty,
            p.repetition_penalty, p.seed, p.stop, p.max_tokens, p.top_logprobs, p.logit_bias, p.ignore_eos,
            p.min_tokens) == \
        (0.3, 0.7, 7, 0.05, 0.5, 0.25, 1.1, 11, ["END", "STOP"], 9, 4, {5: -100.0, 17: 2.5}, True, 3)
    # System messages anywhere are merged into one at the start.
    assert script.prompts[-1].startswith("<|im_start|>system\nLate rule.\n\nDev rule.<|im_end|>\n<|im_start|>user\nhi")
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert script.sampling[-1].max_tokens == MAX_CONTEXT - len(tiny_model.tokenizer.encode(script.prompts[-1]))


def test_max_tokens_cuts_the_reply(client, script):
    script.reply = lambda prompt: "one two three four five six seven"
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=3,
                                       extra_body=NO_THINKING)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert "one two three four five six seven".startswith(r.choices[0].message.content)


BAD_REQUESTS = [
    ("malformed-json", b'{"model": "tiny", "messages": [', 400, None, None),
    ("not-an-object", b"[1, 2]", 400, None, None),
    ("no-messages", {"model": "tiny"}, 400, "messages", None),
    ("empty-messages", chat_body(messages=[]), 400, "messages", None),
    ("bad-role", chat_body(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role", None),
    ("content-type", chat_body(messages=[{"role": "user", "content": 42}]), 400, "messages[0].content", None),
    ("image", chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     400, "messages[0].content", None),
    ("temperature-string", chat_body(temperature="hot"), 400, "temperature", None),
    ("temperature-negative", chat_body(temperature=-1), 400, "temperature", None),
    ("top-p-zero", chat_body(top_p=0), 400, "top_p", None),
    ("max-tokens-bool", chat_body(max_tokens=True), 400, "max_tokens", None),
    ("max-tokens-zero", chat_body(max_tokens=0), 400, "max_tokens", None),
    ("stop-empty", chat_body(stop=[""]), 400, "stop", None),
    ("n", chat_body(n=2), 400, "n", None),
    ("tool-choice-required", chat_body(tools=[WEATHER], tool_choice="required"), 400, "tool_choice", None),
    ("bad-tool", chat_body(tools=[{"type": "function"}]), 400, "tools[0]", None),
    ("tool-parameters-not-object", chat_body(tools=[{"type": "function", "function": {"name": "f",
                                                                                    "parameters": "notobj"}}]),
     400, "tools[0].function.parameters", None),
    ("text-part-without-text", chat_body(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400,
     "messages[0].content", None),
    ("bad-arguments", chat_body(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]), 400,
     "messages[1].tool_calls[0].function.arguments", None),
    ("top-logprobs-without-logprobs", chat_body(top_logprobs=2), 400, "top_logprobs", None),
    ("json-schema", chat_body(response_format={"type": "json_object"}), 400, "response_format", None),
    ("ignore-eos-type", chat_body(ignore_eos="yes"), 400, "ignore_eos", None),
    ("logit-bias-key", chat_body(logit_bias={"hello": 1}), 400, "logit_bias", None),
    ("logit-bias-outside-vocabulary", chat_body(logit_bias={"99999999": 1}), 400, "logit_bias", None),
    ("logit-bias-range", chat_body(logit_bias={"5": 101}), 400, "logit_bias", None),
    ("logit-bias-value", chat_body(logit_bias={"5": "up"}), 400, "logit_bias", None),
    ("logit-bias-array", chat_body(logit_bias=[5, 1]), 400, "logit_bias", None),
    ("min-tokens-negative", chat_body(min_tokens=-1), 400, "min_tokens", None),
    ("thinking-not-bool", chat_body(chat_template_kwargs={"enable_thinking": "no"}), 400,
     "chat_template_kwargs.enable_thinking", None),
    ("unknown-model", chat_body(model="gpt-4o"), 404, "model", "model_not_found"),
    ("over-long", chat_body(messages=[{"role": "user", "content": "word " * MAX_CONTEXT}]), 400, "messages",
     "context_length_exceeded"),
]


@pytest.mark.parametrize("body,status,param,code", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_chat_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, param, code):
    got, err = server.request("POST", "/v1/chat/completions", body)
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    assert err["error"]["type"] == "invalid_request_error"
    assert (err["error"]["param"], err["error"]["code"]) == (param, code)
    assert server.request("POST", "/v1/chat/completions", chat_body())[0] == 200


def test_bad_completion_requests_and_routes(server, tiny_model):
    cases = [{"prompt": ["a", "b"]}, {"prompt": [tiny_model.n_valid]}, {"prompt": ""},
             {"prompt": "x", "logprobs": 21}, {"prompt": "x", "suffix": "y"}, {"prompt": "x", "best_of": 2}]
    for body in cases:
        got, err = server.request("POST", "/v1/completions", {"model": "tiny", **body})
        assert got == 400 and err["error"]["message"], (body, err)
    assert server.request("GET", "/v1/nothing")[0] == 404
    assert server.request("GET", "/v1/chat/completions")[0] == 405
    assert server.request("GET", "/v1/models/gpt-4o")[0] == 404
    assert server.request("POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})[0] == 200


def test_openai_client_raises_on_errors(client):
    with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=3)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])


def test_openai_history_renders_with_the_real_template(real_template_model):
    model = real_template_model
    body = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": None, "reasoning_content": "Need the tool.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
        {"role": "system", "content": "Be brief."}], "tools": [WEATHER]}
    req = parse_chat_request(body, model)
    assert req.messages[0] == {"role": "system", "content": "Be brief."}
    text = render_chat(model, req)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
                           + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>")
    assert "</IMPORTANT>\n\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n" in text
    assert text.endswith(
        "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n{\"temp\": 18}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")
    assert normalize_messages([{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}])[0] == \
        {"role": "system", "content": "d"}
    no_query = parse_chat_request({"messages": [{"role": "assistant", "content": "x"}]}, model)
    with pytest.raises(RequestError, match="No user query found") as err:
        render_chat(model, no_query)
    assert err.value.status == 400 and err.value.param == "messages"


def test_message_without_content_is_refused():
    """As OpenAI's API and the Python API (lily.chat.check_messages): only an assistant turn with tool calls may leave
    its content out."""
    with pytest.raises(RequestError, match=r"'messages\[1\].content' is missing") as err:
        normalize_messages([{"role": "system", "content": "s"}, {"role": "user"}])
    assert err.value.status == 400 and err.value.param == "messages[1].content"
    assert normalize_messages([{"role": "user", "content": "u"}, {"role": "assistant", "content": None,
                                                                  "tool_calls": []}])[1]["content"] == ""
