"""lily.chat.render must equal transformers' apply_chat_template(tokenize=False) byte for byte."""

import copy
import json
import random
from pathlib import Path

import pytest

from lily import chat
from lily.tiny_tokenizer import TINY_CHAT_TEMPLATE, make_tokenizer_json
from lily.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEMPLATE_PATH = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "qwen3.6" / "chat_template.jinja"
needs_template = pytest.mark.skipif(not TEMPLATE_PATH.is_file(), reason=f"real chat template absent: {TEMPLATE_PATH}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A model directory as shipped: tokenizer.json, tokenizer_config.json (Qwen's special tokens), template."""
    d = tmp_path_factory.mktemp("tok")
    (d / "tokenizer.json").write_text(make_tokenizer_json(), encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": 262144}
    (d / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if TEMPLATE_PATH.is_file():
        (d / "chat_template.jinja").write_text(TEMPLATE_PATH.read_text(encoding="utf-8"), encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def lily_tok(model_dir):
    return Tokenizer.from_dir(model_dir)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather and forecast for a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "City name, e.g. Zürich"},
        "days": {"type": "integer", "description": "Forecast length <= 7"}}}}}
SEARCH = {"type": "function", "function": {
    "name": "web_search", "description": "Search the web & return the top results.",
    "parameters": {"type": "object", "required": ["query"], "properties": {
        "query": {"type": "string"}, "top_k": {"type": "number"}, "safe": {"type": "boolean"},
        "sites": {"type": "array", "items": {"type": "string"}}}}}}
PYTHON = {"type": "function", "function": {
    "name": "run_python", "description": "Run code.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}, "env": {"type": "object"}}}}}
TOOLS = [WEATHER, SEARCH, PYTHON]

WEATHER_CALL = {"type": "function", "id": "call_1",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
SEARCH_CALL = {"function": {"name": "web_search", "arguments": {
    "query": "H200 \"memory\" bandwidth\nper GPU", "top_k": 2.5, "safe": False, "sites": ["nvidia.com", "wiki"]}}}
PYTHON_CALL = {"name": "run_python", "arguments": {"code": "print('héllo')\n", "env": {"A": 1, "B": None}}}

U, S = {"role": "user", "content": "What is the weather in Paris?"}, {"role": "system", "content": "Be brief."}

CASES = {
    "single_turn": ([{"role": "user", "content": "Hi"}], {}),
    "system_prompt": ([S, U], {}),
    "thinking_off": ([S, {"role": "user", "content": "Hi"}], {"enable_thinking": False}),
    "thinking_on": ([U], {"enable_thinking": True}),
    "tools_with_system": ([S, U], {"tools": TOOLS}),
    "tools_no_system": ([U], {"tools": TOOLS, "enable_thinking": False}),
    "assistant_tool_calls": ([U, {"role": "assistant", "content": "Let me check.",
                                  "tool_calls": [WEATHER_CALL, SEARCH_CALL, PYTHON_CALL]}], {"tools": TOOLS}),
    "tool_call_without_content": ([U, {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]},
                                   {"role": "tool", "content": '{"temp": 18}'}], {"tools": [WEATHER]}),
    "several_tool_results": ([U, {"role": "assistant", "content": "", "reasoning_content": "Need tools.",
                                  "tool_calls": [WEATHER_CALL, SEARCH_CALL]},
                              {"role": "tool", "content": '{"temp": 18, "sky": "clear"}'},
                              {"role": "tool", "content": "1. nvidia.com: 4.8 TB/s"},
                              {"role": "assistant", "content": "18 °C and clear.", "reasoning_content": "Done."},
                              {"role": "user", "content": "Thanks! And tomorrow?"}], {"tools": TOOLS}),
    "reasoning_history": ([S, {"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "4", "reasoning_content": "Simple sum: 4."},
                           {"role": "user", "content": "Times 3?"},
                           {"role": "assistant", "content": "12", "reasoning_content": "4*3 = 12."},
                           {"role": "user", "content": "Now weather?"},
                           {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
                            "tool_calls": [WEATHER_CALL]},
                           {"role": "tool", "content": "sunny"}], {}),
    "think_in_content": ([{"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "<think>\nGreeting.\n</think>\n\nHello!"},
                          {"role": "user", "content": "Again"},
                          {"role": "assistant", "content": "<think>Once more.</think>Hello again!"}],
                         {"add_generation_prompt": False}),
    "preserve_thinking": ([{"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "4", "reasoning_content": "Simple sum."},
                           {"role": "user", "content": "And 3+3?"}], {"preserve_thinking": True}),
    "no_generation_prompt": ([S, U, {"role": "assistant", "content": "Sunny, 18 °C."}],
                             {"add_generation_prompt": False}),
    "unicode": ([{"role": "system", "content": "  Répondez en français. 🇫🇷  "},
                 {"role": "user", "content": "你好！Привет! مرحبا 👨‍👩‍👧 e\u0301 \u200b tab\tend\n"}], {}),
    "reasoning_alias_and_parts": ([{"role": "user", "content": [{"type": "text", "text": "Part one. "},
                                                                {"type": "text", "text": "Part two."}]},
                                   {"role": "assistant", "content": "Done.", "reasoning": "Via alias."}],
                                  {"add_generation_prompt": False, "preserve_thinking": True}),
}


def _both(hf, lily_tok, messages, kwargs):
    kwargs = {"add_generation_prompt": True, **kwargs}
    expected = hf.apply_chat_template(copy.deepcopy(messages), tokenize=False, **copy.deepcopy(kwargs))
    before = copy.deepcopy(messages)
    got = lily_tok.apply_chat_template(messages, **kwargs)
    assert messages == before, "render must not modify the caller's messages"
    return expected, got


@needs_template
@pytest.mark.parametrize("name", CASES)
def test_matches_transformers(hf, lily_tok, name):
    messages, kwargs = CASES[name]
    expected, got = _both(hf, lily_tok, messages, kwargs)
    assert got == expected


@needs_template
def test_reasoning_dropped_before_last_query_kept_after(hf, lily_tok):
    messages, kwargs = CASES["reasoning_history"]
    _, got = _both(hf, lily_tok, messages, kwargs)
    assert "Simple sum" not in got and "4*3" not in got
    assert "<|im_start|>assistant\n<think>\nCall the tool.\n</think>\n\n<tool_call>" in got
    _, preserved = _both(hf, lily_tok, messages, {"preserve_thinking": True})
    assert "<think>\nSimple sum: 4.\n</think>\n\n4<|im_end|>" in preserved


@needs_template
def test_documented_prompt_forms(lily_tok):
    hi = [{"role": "user", "content": "Hi"}]
    assert lily_tok.apply_chat_template(hi) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert lily_tok.apply_chat_template(hi, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def _random_text(rng):
    pieces = ["hello", "x = f(1, 2)", "你好", "😀", "é", " ", "\n", "<", "&", '"q"', "tab\t", "Ωμέγα", "42"]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))


def _random_conversation(rng):
    messages = [{"role": "system", "content": _random_text(rng)}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": _random_text(rng) or "q"})
        if rng.random() < 0.5:
            calls = [{"function": {"name": rng.choice(["get_weather", "web_search"]), "arguments": {
                "city": _random_text(rng), "n": rng.randint(-5, 5), "f": rng.random(), "ok": rng.random() < 0.5}}}
                for _ in range(rng.randint(1, 3))]
            messages.append({"role": "assistant", "content": _random_text(rng),
                             "reasoning_content": _random_text(rng), "tool_calls": calls})
            messages += [{"role": "tool", "content": _random_text(rng)} for _ in calls]
        messages.append({"role": "assistant", "content": _random_text(rng), "reasoning_content": _random_text(rng)})
    return messages


@needs_template
@pytest.mark.parametrize("seed", range(12))
def test_random_conversations_match_transformers(hf, lily_tok, seed):
    rng = random.Random(seed)
    kwargs = {"add_generation_prompt": rng.random() < 0.5, "enable_thinking": rng.random() < 0.5,
              "preserve_thinking": rng.random() < 0.3}
    if rng.random() < 0.5:
        kwargs["tools"] = rng.sample(TOOLS, rng.randint(1, 3))
    expected, got = _both(hf, lily_tok, _random_conversation(rng), kwargs)
    assert got == expected


def test_environment_features_match_transformers(tmp_path):
    """Block whitespace control, tojson options and HTML characters, loop controls, namespaces, None-valued
    keys, the tokenizer's special tokens, and a template read from tokenizer_config.json."""
    template = (
        "  {% if messages %}\n  {{ messages | length }}\n  {% endif %}\n"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{{ m | tojson }}|{{ m | tojson(indent=2, sort_keys=True) }}\n{% endfor %}"
        "{{ ns.n }} {{ eos_token }} {{ pad_token }} {{ bos_token is defined }} {{ tools | tojson }}"
        "{{ custom | tojson(separators=(',', ':')) }}"
    )
    (tmp_path / "tokenizer.json").write_text(make_tokenizer_json(n_merges=20), encoding="utf-8")
    config = {"eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
              "pad_token": "<|endoftext|>",
              "bos_token": None, "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    messages = [{"role": "user", "content": "<b>&'\"é😀</b>", "extra": [1, 2.5, None], "name": None},
                {"role": "assistant", "content": "z", "reasoning_content": "r"}, {"role": "user", "content": "c"}]
    kwargs = {"tools": [WEATHER], "custom": {"k": [1, "ü"]}, "add_generation_prompt": False}
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    expected = hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(messages, **kwargs) == expected
    assert chat.render(template, messages, eos_token="<|im_end|>", pad_token="<|endoftext|>", **kwargs) == expected


@needs_template
def test_system_message_not_first_is_a_clear_error(hf, lily_tok):
    messages = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "late"}]
    with pytest.raises(Exception, match="System message must be at the beginning"):
        hf.apply_chat_template(messages, tokenize=False)
    with pytest.raises(ValueError, match="chat template error: System message must be at the beginning"):
        lily_tok.apply_chat_template(messages)


@needs_template
def test_other_template_errors(lily_tok):
    with pytest.raises(ValueError, match="No user query found"):
        lily_tok.apply_chat_template([{"role": "system", "content": "only"}])
    with pytest.raises(ValueError, match="Unexpected message role"):
        lily_tok.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "robot", "content": "x"}])
    with pytest.raises(TypeError, match=r"messages\[0\] must be a dict"):
        lily_tok.apply_chat_template(["Hi"])
    with pytest.raises(TypeError, match=r"tools\[1\] must be a JSON-schema dict"):
        lily_tok.apply_chat_template([{"role": "user", "content": "Hi"}], tools=[WEATHER, print])


def test_syntax_error_and_missing_template():
    with pytest.raises(ValueError, match="syntax error at line 2"):
        chat.render("ok\n{% if %}", [{"role": "user", "content": "Hi"}])
    tok = Tokenizer.from_json(make_tokenizer_json(n_merges=20))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_tiny_chat_template():
    tok = Tokenizer.from_json(make_tokenizer_json(n_merges=20), chat_template=TINY_CHAT_TEMPLATE)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": None, "tool_calls": []}, {"role": "tool", "content": "T"}]
    # after the last user message an assistant turn keeps its thinking block, empty here, as Qwen's template does
    body = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n" \
           "<|im_start|>assistant\n<think>\n\n</think>\n\n<|im_end|>\n<|im_start|>tool\nT<|im_end|>\n"
    assert tok.apply_chat_template(messages) == body + "<|im_start|>assistant\n<think>\n"
    earlier = [messages[1], {"role": "assistant", "content": "A", "reasoning_content": "R"}, messages[1]]
    assert tok.apply_chat_template(earlier, add_generation_prompt=False) == \
        "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    assert tok.apply_chat_template(messages, enable_thinking=False) == \
        body + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == body
    with pytest.raises(ValueError, match="Unexpected message role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


@pytest.mark.parametrize("message, problem", [
    ({"role": "user"}, r"messages\[1\] \(user\) has no content: every message needs a 'content'"),
    ({"role": "user", "content": None}, r"messages\[1\] \(user\) has no content"),
    ({"role": "assistant", "reasoning_content": "r"}, r"messages\[1\] \(assistant\) has no content"),
    ({"role": "user", "content": 7}, r"messages\[1\].content must be a string or a list of content parts, got int"),
    ({"content": "x"}, r"messages\[1\].role is missing"),
])
def test_message_without_content_is_refused(message, problem):
    """transformers renders such a message as an empty turn, without a word; Lily refuses it, naming it."""
    tok = Tokenizer.from_json(make_tokenizer_json(n_merges=20), chat_template=TINY_CHAT_TEMPLATE)
    with pytest.raises(ValueError, match=problem):
        tok.apply_chat_template([{"role": "system", "content": "S"}, message])
    # An assistant turn that only calls tools may leave its content out, as in OpenAI's API.
    tok.apply_chat_template([{"role": "user", "content": "U"}, {"role": "assistant", "tool_calls": []}])


def test_generate_refuses_a_message_without_content(tiny_model):
    import lily

    with pytest.raises(ValueError, match=r"messages\[0\] \(user\) has no content"):
        lily.generate(tiny_model, [{"role": "user", "text": "hi"}], max_tokens=1)
