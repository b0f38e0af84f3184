"""Continuing a conversation from the state after its reply (lily.conversation): the new turns render as the chat
template renders them in the whole conversation, a tool result continues as well as a user message, and the
server's store finds a conversation by its messages whichever fields a client drops."""
from pathlib import Path

import numpy as np
import pytest

import lily
from lily.conversation import Conversation, Conversations, reply_end, turns_after_reply

REAL_TEMPLATE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "qwen3.6" / "chat_template.jinja"
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
CALL = {"role": "assistant", "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"q": "river"}}}]}


# What of the real template's ways matters here, for where it is absent: tools in a system block at the start, a tool
# result rendered inside a user turn, and a conversation without a user message refused.
QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{%- for t in tools %}{{- t.function.name }}{%- endfor %}"
    "{{- '</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- if messages | selectattr('role', 'equalto', 'user') | list | length == 0 %}"
    "{{- raise_exception('No user query found in messages.') }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{{- '<tool_call>' + c.function.name + '</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


@pytest.fixture(params=["tiny", "qwen-like", "qwen3.6"])
def model(request) -> lily.Model:
    """The tiny model with its own template, a Qwen-like one, or the real one (a model of its own each: the template
    is changed)."""
    m = lily.load("tiny")
    if request.param == "qwen-like":
        m.tokenizer.chat_template = QWEN_LIKE_TEMPLATE
    elif request.param == "qwen3.6":
        if not REAL_TEMPLATE.is_file():
            pytest.skip(f"the real chat template is not at {REAL_TEMPLATE}")
        m.tokenizer.chat_template = REAL_TEMPLATE.read_text(encoding="utf-8")
    return m


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("history, new", [
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
     [{"role": "user", "content": "again"}]),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}, CALL],
     [{"role": "tool", "content": "a stream"}]),
    ([{"role": "user", "content": "hi"}, CALL],
     [{"role": "tool", "content": "one"}, {"role": "tool", "content": "two"}]),
    ([{"role": "user", "content": "hi"}, CALL],
     [{"role": "tool", "content": "one"}, {"role": "user", "content": "thanks"}]),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"},
      {"role": "assistant", "content": "c", "reasoning_content": "thought"}],
     [{"role": "user", "content": "d"}]),
])
def test_new_turns_render_as_in_the_whole_conversation(model, history, new, tools, thinking):
    tok, kwargs = model.tokenizer, {"enable_thinking": thinking}
    whole = tok.apply_chat_template(history + new, tools=tools, add_generation_prompt=True, **kwargs)
    text = turns_after_reply(tok, new, tools, kwargs)
    assert text and whole.endswith(text) and whole[:-len(text)].endswith("<|im_end|>\n")
    assert text.startswith("<|im_start|>") and "<tools>" not in text and "<|im_start|>system" not in text
    assert text.count("<|im_end|>") == whole[-len(text):].count("<|im_end|>") >= 1


def test_a_tool_result_continues_the_state_with_the_tools_given_once(model, rng):
    """The session's second turn, a tool result, reads only that turn: the tools' system block is not repeated (it
    was, when the new messages were rendered alone) and the result is not refused (it was, by the real template:
    'No user query found')."""
    session = model.session()
    msgs = [{"role": "user", "content": "Look up river."}]
    other_eos = model.tokenizer.token_to_id("<|endoftext|>")
    for _ in range(20):  # a reply that <|endoftext|> ends is not continued (test_a_reply_cut_by_a_stop_string_...)
        first = list(session.stream_generate(msgs, tools=TOOLS, max_tokens=5, seed=int(rng.integers(2**31))))
        if first[-1].token != other_eos:
            break
    held = list(session.tokens)
    msgs += [{"role": "assistant", "content": "".join(r.text for r in first)},
             {"role": "tool", "content": "a natural stream of water"}]
    ids = session.continuation(msgs, TOOLS)
    assert ids is not None and ids[:len(held)] == held
    text = model.tokenizer.decode(ids)
    assert text.count("<tools>") == (1 if "<tools>" in model.tokenizer.chat_template else 0)
    assert text.endswith(turns_after_reply(model.tokenizer, msgs[-1:], TOOLS, {}))
    second = list(session.stream_generate(msgs, tools=TOOLS, max_tokens=2, temperature=0))
    assert second[0].cached_tokens == len(held) and second[0].prompt_tokens == len(ids)
    assert session.continuation(msgs, None) is None  # other tools: another prompt
    assert session.continuation(msgs[:1] + [{"role": "user", "content": "x"}] + msgs[2:], TOOLS) is None


def _conversation(messages, tools=None, n=5) -> Conversation:
    return Conversation(tuple(messages), tools, {}, np.arange(n, dtype=np.int32), 7, False)


def test_the_store_finds_the_longest_conversation_a_request_extends():
    store = Conversations(max_entries=3)
    reply = {"role": "assistant", "content": "c", "reasoning_content": "r",
             "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}
    short = _conversation([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    long = _conversation([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                          {"role": "user", "content": "q"}, reply], n=9)
    store.record(short)
    store.record(long)
    # The client sends the reply back without its reasoning, with its arguments as a JSON string and another id.
    echoed = {"role": "assistant", "content": "c",
              "tool_calls": [{"id": "call_9", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    request = list(long.messages[:-1]) + [echoed, {"role": "tool", "content": "2"}]
    assert store.find(request) is long
    assert store.find(list(short.messages) + [{"role": "user", "content": "z"}]) is short
    assert store.find(list(long.messages)) is short  # nothing after its own reply: only the shorter one continues
    assert store.find(list(short.messages)) is None
    assert store.find(request, tools=TOOLS) is None  # rendered with tools: another prompt
    assert store.find(request, template_kwargs={"enable_thinking": False}) is None
    changed = [dict(request[0], content="A")] + request[1:]
    assert store.find(changed) is None
    other_reply = list(long.messages[:-1]) + [dict(echoed, content="C"), {"role": "tool", "content": "2"}]
    assert store.find(other_reply) is short  # the last reply differs: the earlier conversation still matches
    for i in range(3):  # bounded: the least recently used go first
        store.record(_conversation([{"role": "user", "content": str(i)}, {"role": "assistant", "content": "x"}]))
    assert len(store) == 3 and store.find(request) is None


def test_a_reply_cut_by_a_stop_string_or_another_end_token_is_not_continued(rng):
    """The state holds a stop string's text, which the caller never got, and a reply that <|endoftext|> ended has no
    <|im_end|>: continuing either would prompt with another conversation than the messages say, so the next call
    renders the messages whole."""
    model = lily.load("tiny")
    msgs = [{"role": "user", "content": "Say something."}]
    for _ in range(20):  # a reply of two characters at least, for the stop string
        seed = int(rng.integers(2**31))
        text = model.session().generate(msgs, max_tokens=8, seed=seed)
        if len(text) >= 2:
            break
    session = model.session()
    stopped = list(session.stream_generate(msgs, max_tokens=8, seed=seed, stop=[text[:2]]))
    assert stopped[-1].finish_reason == "stop" and "".join(r.text for r in stopped) == ""
    assert session.messages is None
    assert session.continuation(msgs + [{"role": "assistant", "content": ""}, {"role": "user", "content": "x"}]) \
        is None
    im_end, endoftext = model.tokenizer.token_to_id("<|im_end|>"), model.tokenizer.token_to_id("<|endoftext|>")
    eos = model.eos_token_ids
    assert reply_end(im_end, eos, im_end, False) is True
    assert reply_end(endoftext, eos, im_end, False) is None
    assert reply_end(5, eos, im_end, False) is False and reply_end(None, eos, im_end, False) is False
    assert reply_end(5, eos, im_end, True) is None


def test_a_session_keeps_its_own_copy_of_the_conversation(rng):
    """Editing the messages, tools or the returned `messages` after a reply changes the caller's lists, not the
    conversation the state holds: an edited history is another conversation, rendered whole."""
    model = lily.load("tiny")
    session = model.session()
    tools = [dict(TOOLS[0], function=dict(TOOLS[0]["function"]))]
    msgs = [{"role": "user", "content": "Hi"}]
    for _ in range(20):  # a reply that <|endoftext|> ends is not kept at all
        reply = session.generate(msgs, tools=tools, max_tokens=3, seed=int(rng.integers(2**31)))
        if session.conversation is not None:
            break
    kept = session.messages
    msgs[0]["content"] = "Hello"
    session.messages[0]["content"] = "Hey"
    tools[0]["function"]["name"] = "renamed"
    assert session.messages == kept and kept[0]["content"] == "Hi"
    edited = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "again"}]
    assert session.continuation(edited, tools) is None
    original = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply},
                {"role": "user", "content": "again"}]
    assert session.continuation(original, TOOLS) is not None


def test_a_session_of_another_model_is_refused():
    a, b = lily.load("tiny"), lily.load("tiny")
    with pytest.raises(ValueError, match="another model"):
        lily.generate(a, "Hello", session=b.session(), max_tokens=2)
