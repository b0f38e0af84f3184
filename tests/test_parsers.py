"""The reasoning and Qwen3-Coder tool-call parsers (lily.parsers) on a corpus of real-shaped model outputs: the
whole-text result against the expected split, and every streaming chunking against the whole-text result."""

import json
import random
import secrets

import pytest

from lily.parsers import (Delta, OutputParser, ToolCall, convert_argument, parse_output, parse_tool_call,
                          prompt_opens_thinking)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}}}}
EDIT = {"type": "function", "function": {
    "name": "edit_file",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}, "line": {"type": ["integer", "null"]},
        "ratio": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}},
        "options": {"type": "object", "properties": {"force": {"type": "boolean"}}},
        "zip": {"type": "string"}, "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}
TOOLS = [WEATHER, EDIT, SEARCH]


def call(name: str, **params) -> str:
    """A call in the model's own format (as the real chat template renders one)."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


PARIS = call("get_weather", city="Paris", days="2")
CODE = 'def f(a, b):\n    if a < b and b > 0:\n        return "<ok>"\n    return None\n'

# (id, output, reasoning start, tools, expected reasoning, content, [(name, arguments)])
CORPUS = [
    ("think-then-answer", "The user greets me.\nI should reply politely.\n</think>\n\nHello! How can I help you today?",
     True, None, "The user greets me.\nI should reply politely.", "Hello! How can I help you today?", []),
    ("no-thinking", "Paris is the capital of France.", False, None, "", "Paris is the capital of France.", []),
    ("reasoning-cut-off", "Let me think about this carefully.\nFirst, 17 is", True, None,
     "Let me think about this carefully.\nFirst, 17 is", "", []),
    ("model-opens-think", "<think>\nShort thought.\n</think>\n\nAnswer.", False, None, "Short thought.", "Answer.", []),
    ("think-tag-mid-text", "Use the <think> tag to reason.", False, None, "", "Use the <think> tag to reason.", []),
    ("single-call", "The user wants the weather.\n</think>\n\n" + PARIS, True, TOOLS,
     "The user wants the weather.", "", [("get_weather", {"city": "Paris", "days": 2})]),
    ("prose-before-call", "Need data.\n</think>\n\nLet me check the forecast for you.\n\n" + PARIS, True, TOOLS,
     "Need data.", "Let me check the forecast for you.", [("get_weather", {"city": "Paris", "days": 2})]),
    ("several-calls", "Two cities.\n</think>\n\n" + PARIS + "\n" + call("get_weather", city="Rome", metric="true")
     + "\n" + call("search", query="best café in Rome"), True, TOOLS, "Two cities.", "",
     [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome", "metric": True}),
      ("search", {"query": "best café in Rome"})]),
    ("call-inside-reasoning", "I will look it up first.\n" + call("search", query="lily inference engine"), True,
     TOOLS, "I will look it up first.", "", [("search", {"query": "lily inference engine"})]),
    ("call-inside-reasoning-then-answer", "Checking.\n" + call("search", query="x") + "\nDone.\n</think>\n\nOK.",
     True, TOOLS, "Checking.\n\nDone.", "OK.", [("search", {"query": "x"})]),
    ("typed-arguments", "</think>\n\n" + call(
        "edit_file", path="src/a.py", content=CODE, line="null", ratio="0.75", tags='["x", "y"]',
        options='{"force": true}', zip="01234", limit="10"), True, TOOLS, "", "",
     [("edit_file", {"path": "src/a.py", "content": CODE, "line": None, "ratio": 0.75, "tags": ["x", "y"],
                     "options": {"force": True}, "zip": "01234", "limit": 10})]),
    ("value-not-fitting-type", call("get_weather", city="Oslo", days="two"), False, TOOLS, "", "",
     [("get_weather", {"city": "Oslo", "days": "two"})]),
    ("unknown-function", call("launch", target="moon", count="3"), False, TOOLS, "", "",
     [("launch", {"target": "moon", "count": "3"})]),
    ("json-form", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon", "days": 3}}\n</tool_call>',
     False, TOOLS, "", "", [("get_weather", {"city": "Lyon", "days": 3})]),
    ("bare-function", "Sure.\n<function=get_weather>\n<parameter=city>\nNice\n</parameter>\n</function>", False,
     TOOLS, "", "Sure.", [("get_weather", {"city": "Nice"})]),
    ("missing-close-parameter",
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</function>\n</tool_call>", False, TOOLS, "", "",
     [("get_weather", {"city": "Bern"})]),
    ("missing-close-tool-call", "<tool_call>\n<function=search>\n<parameter=query>\nq\n</parameter>\n</function>",
     False, TOOLS, "", "", [("search", {"query": "q"})]),
    ("no-parameters", "<tool_call>\n<function=search>\n</function>\n</tool_call>", False, TOOLS, "", "",
     [("search", {})]),
    ("malformed-block", "Trying.\n<tool_call>\nnot a call at all\n</tool_call>", False, TOOLS, "",
     "Trying.\n<tool_call>\nnot a call at all\n</tool_call>", []),
    ("junk-after-function", "<tool_call>\n<function=search>\n</function>\noops\n</tool_call>", False, TOOLS, "",
     "<tool_call>\n<function=search>\n</function>\noops\n</tool_call>", []),
    ("call-cut-off", "Wait.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", True, TOOLS,
     "Wait.", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", []),
    ("unclosed-then-new-call", "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n</function>\n"
     + call("search", query="B"), False, TOOLS, "", "",
     [("get_weather", {"city": "A"}), ("search", {"query": "B"})]),
    ("tools-off", "Here: " + PARIS, False, None, "", "Here: " + PARIS, []),
    ("angle-brackets-in-prose", "</think>\n\nIf a < b then <b>bold</b> and <tool>x</tool> <function f>.", True,
     TOOLS, "", "If a < b then <b>bold</b> and <tool>x</tool> <function f>.", []),
    ("unicode", "Überlegung: 你好 🚀\n</think>\n\nΓεια σου — ça va? " + call("search", query="日本語 テキスト"),
     True, TOOLS, "Überlegung: 你好 🚀", "Γεια σου — ça va?", [("search", {"query": "日本語 テキスト"})]),
    ("empty", "", True, TOOLS, "", "", []),
]
IDS = [c[0] for c in CORPUS]


def _result(delta: Delta) -> tuple[str, str, list[tuple[str, dict]]]:
    return delta.reasoning, delta.content, [(c.name, json.loads(c.arguments)) for c in delta.tool_calls]


def _stream(chunks, reasoning: bool, tools) -> tuple[str, str, list[tuple[str, dict]]]:
    parser = OutputParser(reasoning=reasoning, tools=tools)
    out = Delta()
    for chunk in chunks:
        out += parser.feed(chunk)
    out += parser.finish()
    return _result(out)


@pytest.mark.parametrize("case", CORPUS, ids=IDS)
def test_whole_output(case):
    _, text, reasoning, tools, want_reasoning, want_content, want_calls = case
    got = parse_output(text, reasoning=reasoning, tools=tools)
    assert (got.reasoning, got.content) == (want_reasoning, want_content)
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == want_calls
    assert len({c.id for c in got.tool_calls}) == len(got.tool_calls)


@pytest.mark.parametrize("case", CORPUS, ids=IDS)
def test_every_chunking_matches_the_whole_output(case):
    _, text, reasoning, tools, *_ = case
    parser = OutputParser(reasoning=reasoning, tools=tools)
    whole_delta = parser.feed(text)
    whole_delta += parser.finish()
    whole = _result(whole_delta)
    assert _stream(list(text), reasoning, tools) == whole, "one character at a time"
    for cut in range(len(text) + 1):
        assert _stream([text[:cut], text[cut:]], reasoning, tools) == whole, f"split at {cut}"
    seed = secrets.randbits(32)
    rng = random.Random(seed)
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 12))))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert _stream(chunks, reasoning, tools) == whole, f"seed {seed}: chunks {chunks!r}"


@pytest.mark.parametrize("case", CORPUS, ids=IDS)
def test_token_by_token_as_the_model_streams(case, tiny_model):
    """Text arrives as the detokenizer yields it for the tiny tokenizer's tokens (tags are single tokens)."""
    _, text, reasoning, tools, *_ = case
    detok = tiny_model.tokenizer.detokenizer()
    chunks = [detok.add(t) for t in tiny_model.tokenizer.encode(text)] + [detok.flush()]
    assert "".join(chunks) == text
    parser = OutputParser(reasoning=reasoning, tools=tools)
    whole = parser.feed(text)
    whole += parser.finish()
    assert _stream(chunks, reasoning, tools) == _result(whole)


def test_short_outputs_in_every_three_way_split():
    text = "ab\n</think>\n\n" + call("search", query="q") + "\nok"
    whole = _stream([text], True, TOOLS)
    assert whole == ("ab", "ok", [("search", {"query": "q"})])
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert _stream([text[:i], text[i:j], text[j:]], True, TOOLS) == whole, (i, j)


def test_prompt_opens_thinking_on_rendered_prompts(tiny_model):
    msgs = [{"role": "user", "content": "Hi"}]
    tok = tiny_model.tokenizer
    assert prompt_opens_thinking(tok.apply_chat_template(msgs))
    assert not prompt_opens_thinking(tok.apply_chat_template(msgs, enable_thinking=False))
    assert not prompt_opens_thinking("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    # A <think> in an earlier turn does not count.
    assert not prompt_opens_thinking("<|im_start|>user\n<think><|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("value,schema,expected", [
    ("42", {"type": "integer"}, 42), ("-7", {"type": "integer"}, -7), ("3.0", {"type": "integer"}, 3),
    ("3.5", {"type": "integer"}, "3.5"), ("2.5e3", {"type": "number"}, 2500.0), ("17", {"type": "number"}, 17),
    ("nan", {"type": "number"}, "nan"), ("True", {"type": "boolean"}, True), ("no", {"type": "boolean"}, "no"),
    ("null", {"type": ["string", "null"]}, None), ("null", {"type": "string"}, "null"),
    ("[1, 2]", {"type": "array"}, [1, 2]), ('{"a": 1}', {"type": "array"}, '{"a": 1}'),
    ('{"a": [1]}', {"properties": {}}, {"a": [1]}), ("5", {"enum": [1, 5]}, 5), ("x", {"enum": ["x"]}, "x"),
    ("007", {"type": "string"}, "007"), ("12", None, "12"), ("12", {}, "12"),
    ("1", {"oneOf": [{"type": "boolean"}, {"type": "integer"}]}, 1),
])
def test_convert_argument(value, schema, expected):
    assert convert_argument(value, schema) == expected
    assert type(convert_argument(value, schema)) is type(expected)


def test_parse_tool_call_cut_short_needs_its_function_closed():
    body = "\n<function=search>\n<parameter=query>\nq\n</parameter>\n"
    assert parse_tool_call(body, {}, closed=False) is None
    assert json.loads(parse_tool_call(body, {}, closed=True).arguments) == {"query": "q"}
    assert json.loads(parse_tool_call(body + "</function>\n", {}, closed=False).arguments) == {"query": "q"}


def test_a_parsed_call_round_trips_through_the_real_template(real_template_model):
    """The template renders a parsed call back to the exact text the model wrote (architecture.md §11.3)."""
    model = real_template_model
    reply = "Need the tool.\n</think>\n\n" + PARIS
    parsed = parse_output(reply, reasoning=True, tools=TOOLS)
    calls = [{"type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
             for c in parsed.tool_calls]
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": parsed.content, "reasoning_content": parsed.reasoning,
                 "tool_calls": calls},
                {"role": "tool", "content": '{"temp": 18}'}]
    text = model.tokenizer.apply_chat_template(messages, tools=TOOLS)
    assert ("<|im_start|>assistant\n<think>\n" + reply + "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
            '{"temp": 18}\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n') in text


def test_tool_call_to_openai():
    c = ToolCall("f", '{"a": 1}')
    assert c.id.startswith("call_") and c.to_openai(2) == {
        "index": 2, "id": c.id, "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
