"""The OpenAI Responses API (/v1/responses) through the official `openai` client and raw HTTP, on the shared tiny-model
server: input items turned into the chat template's messages exactly as a chat request's are, answers and their
event streams, reasoning, a tool-call round trip, stored responses continued from the engine's saved state, and bad
requests answered with OpenAI errors naming the field while the server keeps serving."""
import json

import openai
import pytest

from lily.server import normalize_messages
from lily.server.responses import (StoredResponse, StoredResponses, input_messages, parse_responses_request,
                                   with_instructions)
from lily.server.protocol import render_conversation
from live_server import MAX_CONTEXT, NO_THINKING, WEATHER, words

TOOL = {"type": "function", **WEATHER["function"]}  # the same tool in the Responses API's (flat) shape
TOOL_REPLY = ("The user wants the forecast, so I call the tool.\n</think>\n\nLet me check.\n\n<tool_call>\n"
              "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
              "</function>\n</tool_call>")
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\n{}\n</parameter>\n</function>\n</tool_call>"

# A history in Responses items, and the same history as chat messages.
ITEMS = [
    {"type": "message", "role": "developer", "content": "Use tools."},
    {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}]},
    {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Need the tool."}]},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Lyon", "days": 2}'},
    {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 18}'},
    {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Both known."}]},
    {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
     "content": [{"type": "output_text", "text": "18 °C and rain.", "annotations": []}]},
    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "dropped: no assistant turn follows"}]},
    {"role": "user", "content": "Thanks!"}]
CHAT = [
    {"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Use tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "Need the tool.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Lyon", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    {"role": "assistant", "content": "18 °C and rain.", "reasoning_content": "Both known."},
    {"role": "user", "content": "Thanks!"}]


def test_input_items_become_the_messages_a_chat_request_gives():
    assert with_instructions("Be brief.", input_messages(ITEMS, [])) == normalize_messages(CHAT)
    assert input_messages("hi", []) == [{"role": "user", "content": "hi"}]
    assert with_instructions(None, input_messages([{"role": "user", "content": "u"}], [])) == \
        [{"role": "user", "content": "u"}]


def test_a_request_becomes_template_terms_and_its_settings_are_echoed(tiny_model):
    body = {"input": "hi", "instructions": "Be brief.", "tools": [TOOL], "max_output_tokens": 7, "temperature": 0.2,
            "top_p": 0.9, "reasoning": {"effort": "none", "summary": "auto"}, "metadata": {"k": "v"},
            "parallel_tool_calls": False, "store": False, "user": "u1"}
    req = parse_responses_request(body, tiny_model, StoredResponses())
    assert req.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert req.tools == [WEATHER] and req.template_kwargs == {"enable_thinking": False}
    assert (req.sampling.max_tokens, req.sampling.params["temperature"], req.sampling.params["top_p"]) == (7, 0.2, 0.9)
    assert (req.store, req.one_call, req.stream) == (False, True, False)
    assert req.echo == {"instructions": "Be brief.", "max_output_tokens": 7, "metadata": {"k": "v"},
                        "parallel_tool_calls": False, "previous_response_id": None,
                        "reasoning": {"effort": "none", "summary": "auto"}, "store": False, "temperature": 0.2,
                        "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [TOOL], "top_p": 0.9,
                        "truncation": "disabled", "user": "u1"}
    thinking = {effort: parse_responses_request({"input": "x", "reasoning": {"effort": effort}}, tiny_model,
                                                StoredResponses()).template_kwargs
                for effort in ("minimal", "low", "high", None)}
    assert thinking == {"minimal": {"enable_thinking": False}, "low": {"enable_thinking": True},
                        "high": {"enable_thinking": True}, None: {}}
    assert parse_responses_request({"input": "x", "tools": [TOOL], "tool_choice": "none"}, tiny_model,
                                   StoredResponses()).tools is None


def test_a_previous_response_is_continued_without_its_instructions(tiny_model):
    stored = StoredResponses(max_entries=2)
    history = [{"role": "system", "content": "From input."}, {"role": "user", "content": "a"},
               {"role": "assistant", "content": "b", "tool_calls": [
                   {"type": "function", "function": {"name": "f", "arguments": {}}, "id": "call_9"}]}]
    stored.put("resp_1", StoredResponse({}, history))
    req = parse_responses_request({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "r"}],
                                   "previous_response_id": "resp_1", "instructions": "New."}, tiny_model, stored)
    assert req.messages == [{"role": "system", "content": "New.\n\nFrom input."}, *history[1:],
                            {"role": "tool", "content": "r", "tool_call_id": "call_9"}]
    assert req.messages[2] is history[2]  # shared with the stored conversation, not copied
    stored.put("resp_2", StoredResponse({}, []))
    stored.get("resp_1")  # used: now the most recent
    stored.put("resp_3", StoredResponse({}, []))
    assert (stored.get("resp_2"), stored.get("resp_1") is not None) == (None, True)


def test_items_render_with_the_real_template_as_the_chat_request_does(real_template_model):
    model = real_template_model
    req = parse_responses_request({"input": ITEMS, "instructions": "Be brief.", "tools": [TOOL]}, model,
                                  StoredResponses())
    text = render_conversation(model, req.messages, req.tools, req.template_kwargs)
    assert text == render_conversation(model, normalize_messages(CHAT), [WEATHER], {})
    assert "<parameter=city>\nLyon\n</parameter>\n<parameter=days>\n2\n</parameter>" in text


BAD_REQUESTS = [
    ("no-input", {}, 400, "input", None),
    ("empty-input", {"input": []}, 400, "input", None),
    ("item-not-object", {"input": ["hi"]}, 400, "input[0]", None),
    ("bad-role", {"input": [{"role": "tool", "content": "x"}]}, 400, "input[0].role", None),
    ("no-content", {"input": [{"role": "user"}]}, 400, "input[0].content", None),
    ("image", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input[0].content[0]", None),
    ("part-text", {"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]}, 400,
     "input[0].content[0].text", None),
    ("item-type", {"input": [{"type": "web_search_call", "id": "x"}]}, 400, "input[0].type", None),
    ("call-without-name", {"input": [{"role": "user", "content": "x"},
                                     {"type": "function_call", "call_id": "c", "arguments": "{}"}]}, 400,
     "input[1].name", None),
    ("call-bad-arguments", {"input": [{"role": "user", "content": "x"}, {
        "type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]}, 400, "input[1].arguments", None),
    ("output-for-no-call", {"input": [{"role": "user", "content": "x"}, {
        "type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "other", "output": "r"}]}, 400, "input[2].call_id", None),
    ("reasoning-part", {"input": [{"type": "reasoning", "summary": [{"type": "summary_text"}]},
                                  {"role": "user", "content": "x"}]}, 400, "input[0].summary[0].text", None),
    ("tool-type", {"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type", None),
    ("tool-chat-shape", {"input": "x", "tools": [WEATHER]}, 400, "tools[0].name", None),
    ("tool-choice-required", {"input": "x", "tools": [TOOL], "tool_choice": "required"}, 400, "tool_choice", None),
    ("tool-choice-function", {"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "f"}}, 400,
     "tool_choice", None),
    ("effort", {"input": "x", "reasoning": {"effort": "extreme"}}, 400, "reasoning.effort", None),
    ("json-schema", {"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, 400, "text.format",
     None),
    ("truncation-auto", {"input": "x", "truncation": "auto"}, 400, "truncation", None),
    ("background", {"input": "x", "background": True}, 400, "background", None),
    ("logprobs", {"input": "x", "include": ["message.output_text.logprobs"]}, 400, "include", None),
    ("metadata-value", {"input": "x", "metadata": {"k": 1}}, 400, "metadata.k", None),
    ("max-output-tokens-zero", {"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens", None),
    ("temperature-string", {"input": "x", "temperature": "hot"}, 400, "temperature", None),
    ("instructions-type", {"input": "x", "instructions": ["x"]}, 400, "instructions", None),
    ("unknown-previous", {"input": "x", "previous_response_id": "resp_nothing"}, 404, "previous_response_id",
     "previous_response_not_found"),
    ("unknown-model", {"input": "x", "model": "gpt-4o"}, 404, "model", "model_not_found"),
    ("over-long", {"input": "word " * MAX_CONTEXT}, 400, "input", "context_length_exceeded"),
]


@pytest.mark.parametrize("body,status,param,code", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_requests_get_openai_errors_naming_the_field_and_the_server_keeps_serving(server, body, status, param,
                                                                                       code):
    got, err = server.request("POST", "/v1/responses", {"max_output_tokens": 2, **body})
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    assert (err["error"]["type"], err["error"]["param"], err["error"]["code"]) == \
        ("invalid_request_error", param, code)
    assert server.request("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 1})[0] == 200


def test_create_answers_as_chat_completions_does(client, tiny_model):
    instructions, question = words(3), words()
    r = client.responses.create(model="tiny", input=question, instructions=instructions, temperature=0,
                                max_output_tokens=6, reasoning={"effort": "none"}, metadata={"run": "1"})
    chat = client.chat.completions.create(model="tiny", temperature=0, max_tokens=6, extra_body=NO_THINKING,
                                          messages=[{"role": "system", "content": instructions},
                                                    {"role": "user", "content": question}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    (message,) = r.output
    assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    assert r.output_text == chat.choices[0].message.content  # the same greedy reply, through the same template
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert (r.instructions, r.max_output_tokens, r.temperature, r.metadata, r.store, r.tool_choice, r.tools,
            r.reasoning.effort) == (instructions, 6, 0, {"run": "1"}, True, "auto", [], "none")


def test_item_input_and_the_reply_settings_reach_the_template_and_sampler(client, script):
    script.reply = lambda prompt: "ok"
    client.responses.create(model="tiny", instructions="Rules.", top_p=0.5, max_output_tokens=9, input=[
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "reply"},
        {"role": "developer", "content": "Dev rule."}, {"role": "user", "content": "second"}])
    assert script.prompts[-1] == ("<|im_start|>system\nRules.\n\nDev rule.<|im_end|>\n<|im_start|>user\nfirst"
                                  "<|im_end|>\n<|im_start|>assistant\nreply<|im_end|>\n<|im_start|>user\nsecond"
                                  "<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert (script.sampling[-1].top_p, script.sampling[-1].max_tokens) == (0.5, 9)
    client.responses.create(model="tiny", input="x", reasoning={"effort": "minimal"})
    assert script.prompts[-1].endswith("<think>\n\n</think>\n\n")
    client.responses.create(model="tiny", input="x", reasoning={"effort": "high"})
    assert script.prompts[-1].endswith("<|im_start|>assistant\n<think>\n")


def test_a_streamed_reasoning_and_text_reply(client, script):
    script.reply = lambda prompt: "Thinking it over.\n</think>\n\nHello there!"
    with client.responses.stream(model="tiny", input=words()) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    reasoning_deltas = kinds.count("response.reasoning_text.delta")
    text_deltas = kinds.count("response.output_text.delta")
    assert reasoning_deltas > 1 and text_deltas > 1  # the tiny model's tokens are short: many deltas
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     *["response.reasoning_text.delta"] * reasoning_deltas,
                     "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * text_deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    reasoning, message = final.output
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Thinking it over."
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "Thinking it over.")]
    assert final.output_text == "Hello there!" and message.status == "completed"
    assert [e.item.id for e in events if e.type == "response.output_item.done"] == [reasoning.id, message.id]
    assert final.usage.output_tokens_details.reasoning_tokens > 0
    stored = client.responses.retrieve(final.id)
    assert stored.output[0] == reasoning and (stored.output[1].id, stored.output_text) == (message.id, "Hello there!")


def test_a_tool_call_round_trip_continues_from_the_saved_state(client, script):
    script.feed = True  # the state holds the reply, as the real generator's does
    script.reply = lambda prompt: TOOL_REPLY
    question = f"What's the weather in Paris for two days? {words()}"
    first = client.responses.create(model="tiny", input=question, tools=[TOOL])
    assert [item.type for item in first.output] == ["reasoning", "message", "function_call"]
    call = first.output[2]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris", "days": 2})
    assert first.output_text == "Let me check." and first.status == "completed"

    with client.responses.stream(model="tiny", input=question, tools=[TOOL]) as stream:
        events = list(stream)
    args = [e for e in events if e.type.startswith("response.function_call_arguments.")]
    assert [(e.type, json.loads(e.delta if e.type.endswith("delta") else e.arguments)) for e in args] == \
        [("response.function_call_arguments.delta", {"city": "Paris", "days": 2}),
         ("response.function_call_arguments.done", {"city": "Paris", "days": 2})]

    script.reply = lambda prompt: "The tool answered.\n</think>\n\nIt will be 18 °C and clear in Paris."
    second = client.responses.create(model="tiny", previous_response_id=first.id, tools=[TOOL], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 18, "sky": "clear"}'}])
    assert second.output_text == "It will be 18 °C and clear in Paris." and second.previous_response_id == first.id
    assert script.prompts[-1].endswith('{"temp_c": 18, "sky": "clear"}<|im_end|>\n<|im_start|>assistant\n<think>\n')
    # The first turn came from the state held after its reply: all of it but the reply's last token (not fed).
    assert second.usage.input_tokens_details.cached_tokens == first.usage.input_tokens + first.usage.output_tokens - 1


def test_a_stateless_client_resending_the_items_continues_too(client, script):
    script.feed = True
    script.reply = lambda prompt: TOOL_REPLY
    items = [{"role": "user", "content": f"Weather? {words()}"}]
    first = client.responses.create(model="tiny", input=items, tools=[TOOL], store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"type": "function_call_output", "call_id": first.output[-1].call_id, "output": "sunny"})
    script.reply = lambda prompt: "Sunny."
    second = client.responses.create(model="tiny", input=items, tools=[TOOL], store=False)
    assert second.usage.input_tokens_details.cached_tokens == first.usage.input_tokens + first.usage.output_tokens - 1


def test_store_retrieve_delete(server, client, script):
    script.reply = lambda prompt: "stored"
    r = client.responses.create(model="tiny", input=words())
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    status, deleted = server.request("DELETE", f"/v1/responses/{r.id}")
    assert (status, deleted) == (200, {"id": r.id, "object": "response", "deleted": True})
    for method in ("GET", "DELETE"):
        status, err = server.request(method, f"/v1/responses/{r.id}")
        assert status == 404 and err["error"]["param"] == "response_id", err
    with pytest.raises(openai.NotFoundError, match="Previous response"):
        client.responses.create(model="tiny", input="x", previous_response_id=r.id)
    unstored = client.responses.create(model="tiny", input="x", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_previous_response_id_over_three_turns(client, script, tiny_model):
    script.feed = True
    script.reply = lambda prompt: "Reply " + words(2)
    turn = client.responses.create(model="tiny", input=words(), instructions="Be brief.")
    for _ in range(2):
        previous = turn
        turn = client.responses.create(model="tiny", input=words(), previous_response_id=previous.id,
                                       instructions="Be brief.")
        assert turn.usage.input_tokens_details.cached_tokens == \
            previous.usage.input_tokens + previous.usage.output_tokens - 1
    assert script.prompts[-1].count("<think>\nReply ") == 2  # both replies, as the state holds them
    # Instructions are not carried over: a turn without them renders no system message.
    client.responses.create(model="tiny", input="last", previous_response_id=turn.id)
    assert script.prompts[-1].startswith("<|im_start|>user\n")


def test_max_output_tokens_makes_the_response_incomplete(client, script):
    script.reply = lambda prompt: "one two three four five six seven"
    r = client.responses.create(model="tiny", input="count", max_output_tokens=3, reasoning={"effort": "none"})
    assert (r.status, r.incomplete_details.reason, r.output[0].status) == ("incomplete", "max_output_tokens",
                                                                           "incomplete")
    assert r.usage.output_tokens == 3 and "one two three four five six seven".startswith(r.output_text)
    with client.responses.stream(model="tiny", input="count", max_output_tokens=3) as stream:
        last = list(stream)[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"


def test_parallel_tool_calls_false_returns_one_call(client, script):
    script.reply = lambda prompt: CALL.format("Paris") + "\n" + CALL.format("Lyon")
    both = client.responses.create(model="tiny", input="x", tools=[TOOL], reasoning={"effort": "none"})
    assert [json.loads(item.arguments)["city"] for item in both.output] == ["Paris", "Lyon"]
    one = client.responses.create(model="tiny", input="x", tools=[TOOL], reasoning={"effort": "none"},
                                  parallel_tool_calls=False)
    assert [json.loads(item.arguments)["city"] for item in one.output] == ["Paris"]
    assert one.parallel_tool_calls is False


def test_an_engine_failure_mid_stream_is_a_failed_event(server, script):
    def failing(prompt):
        raise RuntimeError("the backend broke")

    script.reply = failing
    status, text = server.request("POST", "/v1/responses", {"input": "x", "stream": True})
    assert status == 200
    events = [(block.split("\n")[0], json.loads(block.split("\n")[1][len("data: "):]))
              for block in text.strip().split("\n\n")]
    assert [name for name, _ in events] == ["event: response.created", "event: response.in_progress",
                                            "event: response.failed"]
    failed = events[-1][1]
    assert failed["response"]["status"] == "failed" and failed["response"]["error"]["code"] == "server_error"
    assert "the backend broke" in failed["response"]["error"]["message"]
    script.reply = lambda prompt: "fine"
    assert server.request("POST", "/v1/responses", {"input": "x"})[0] == 200
