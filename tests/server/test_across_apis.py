"""One engine, one prefix cache and one way to continue a conversation for every API: a tool loop begun through one
API and continued through another continues the state the engine held after the reply, whichever API sent it."""
import json

import anthropic
import pytest

from live_server import WEATHER, client_for, words

TOOL_REPLY = ('The user wants the forecast.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n'
              '<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>')
RESULT = '{"temp_c": 18}'


@pytest.fixture
def clients(server):
    return client_for(server.url), anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                                                       timeout=120)


@pytest.mark.parametrize("second_api", ["messages", "responses", "chat"])
def test_a_tool_loop_moves_between_apis_without_reading_the_conversation_again(clients, script, second_api):
    openai_client, anthropic_client = clients
    script.feed = True  # the state holds the reply, as after a real generation
    script.reply = lambda prompt: TOOL_REPLY
    question = f"What's the weather in Paris? {words()}"
    first = openai_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}],
                                                  tools=[WEATHER], max_tokens=200)
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    held = first.usage.prompt_tokens + first.usage.completion_tokens - 1  # all of the reply but its last token

    script.reply = lambda prompt: "The tool answered.\n</think>\n\nIt is 18 °C."
    if second_api == "messages":
        tool = {"name": "get_weather", "description": WEATHER["function"]["description"],
                "input_schema": WEATHER["function"]["parameters"]}
        r = anthropic_client.messages.create(model="tiny", max_tokens=200, tools=[tool], messages=[
            {"role": "user", "content": question},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": first.choices[0].message.model_extra["reasoning_content"],
                 "signature": ""},
                {"type": "text", "text": first.choices[0].message.content},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT}]}])
        cached, text = r.usage.cache_read_input_tokens, r.content[-1].text
    elif second_api == "responses":
        tool = {"type": "function", **WEATHER["function"]}
        r = openai_client.responses.create(model="tiny", tools=[tool], store=False, input=[
            {"role": "user", "content": question},
            {"role": "assistant", "content": first.choices[0].message.content},
            {"type": "function_call", "call_id": call.id, "name": "get_weather", "arguments": call.function.arguments},
            {"type": "function_call_output", "call_id": call.id, "output": RESULT}])
        cached, text = r.usage.input_tokens_details.cached_tokens, r.output_text
    else:
        r = openai_client.chat.completions.create(model="tiny", tools=[WEATHER], max_tokens=200, messages=[
            {"role": "user", "content": question},
            {"role": "assistant", "content": first.choices[0].message.content, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": RESULT}])
        cached, text = r.usage.prompt_tokens_details.cached_tokens, r.choices[0].message.content
    assert text == "It is 18 °C."
    assert cached == held  # continued from the state after the first reply: nothing of it read again
