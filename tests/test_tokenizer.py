"""lily.tokenizer on the synthetic Qwen-layout tokenizer of lily.tiny_tokenizer."""

import json
import random
import unicodedata

import pytest

from lily.tiny_tokenizer import (QWEN35_SPLIT_REGEX, TINY_ADDED_TOKENS, TINY_CHAT_TEMPLATE, TINY_NON_SPECIAL_TOKENS,
                                 make_tokenizer_json, tiny_vocab_size)
from lily.tokenizer import Tokenizer

N_MERGES = 300


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_json(make_tokenizer_json(N_MERGES))


TEXTS = {
    "ascii": "The quick brown fox jumps over the lazy dog. It's 12:30, isn't it?",
    "code": "def f(x):\n\treturn {'a': [x ** 2, x // 3]}  # comment\r\n\n    pass\n",
    "cjk": "你好，世界！こんにちは。안녕하세요. 机器学习",
    "emoji": "😀🎉🚀 👍🏽 👨‍👩‍👧 ❤️ 🇫🇷",
    "mixed": "Grüße, e\u0301 (NFC→é), Ελληνικά, مرحبا, नमस्ते, ∑∫√ <b>&amp;</b> \u200b\u00a0 end  \n",
}


def _random_text(rng: random.Random, n: int) -> str:
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x4E00, 0x4FFF), (0x1F300, 0x1F64F), (0x0300, 0x036F)]
    chars = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        chars.append(chr(rng.randint(lo, hi)) if rng.random() < 0.9 else rng.choice(["\n", " ", "\t", "<think>"]))
    return "".join(chars)


@pytest.mark.parametrize("name", TEXTS)
def test_round_trip(tok, name):
    text = TEXTS[name]
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)


def test_round_trip_random_text(tok):
    rng = random.Random(1)
    for _ in range(20):
        text = unicodedata.normalize("NFC", _random_text(rng, rng.randint(1, 60)))
        assert tok.decode(tok.encode(text)) == text


def test_layout_and_added_tokens(tok):
    assert tok.vocab_size == tiny_vocab_size(N_MERGES) == 256 + N_MERGES + 33
    assert len(TINY_ADDED_TOKENS) == 33 and TINY_ADDED_TOKENS[0] == "<|endoftext|>"
    for k, name in enumerate(TINY_ADDED_TOKENS):
        token_id = 256 + N_MERGES + k
        assert tok.token_to_id(name) == token_id
        ids = tok.encode(f"a {name}b")
        assert ids.count(token_id) == 1 and len(ids) == 4, (name, ids)
    assert tok.token_to_id("not a token") is None
    assert tok.encode("12345") == [tok.token_to_id(d) for d in "12345"]  # digits split one at a time


def test_pre_tokenizer_matches_regex():
    regex = pytest.importorskip("regex")
    import tokenizers
    pre = tokenizers.Tokenizer.from_str(make_tokenizer_json(N_MERGES)).pre_tokenizer
    inverse = {c: b for b, c in _gpt2_bytes_to_unicode().items()}

    def pieces(text):
        return [bytes(inverse[c] for c in piece).decode() for piece, _ in pre.pre_tokenize_str(text)]

    # Marks join letter runs, digits split one at a time, contractions are case-insensitive.
    assert pieces("I'LL don't x12 e\u0301\r\n\n  (a)=>b") == \
        ["I", "'LL", " don", "'t", " x", "1", "2", " e\u0301", "\r\n\n", " ", " (", "a", ")=>", "b"]
    text = "I'LL  don't x1234 café\u0301s\r\n\n  (a+b)=>c;\tend?!  \n 你好😀\u00a0"
    assert pieces(text) == regex.findall(QWEN35_SPLIT_REGEX, text)


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte→character map, written out independently of lily.tokenizer."""
    bs = [*range(33, 127), *range(161, 173), *range(174, 256)]
    cs = bs + [256 + n for n in range(256 - len(bs))]
    return dict(zip(bs + [b for b in range(256) if b not in bs], map(chr, cs)))


def test_skip_special_tokens(tok):
    text = "<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>\nx\n</tool_call><|im_end|><|endoftext|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == \
        "assistant\n<think>\nhm\n</think>\n\n<tool_call>\nx\n</tool_call>"
    for name in TINY_ADDED_TOKENS:
        kept = tok.decode([tok.token_to_id(name)], skip_special_tokens=True)
        assert kept == (name if name in TINY_NON_SPECIAL_TOKENS else "")
    with pytest.raises(ValueError, match="must be >= 0"):
        tok.decode([5, -1])


def _stream(tok, ids, skip_special_tokens=False):
    detok = tok.detokenizer(skip_special_tokens)
    pieces = [detok.add(i) for i in ids]
    return pieces, detok.flush()


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_stream_equals_full_decode_for_random_ids(tok, skip_special_tokens):
    rng = random.Random(2)
    for _ in range(200):
        # Ids past the vocabulary (embedding padding rows) are ignored by both paths.
        ids = [rng.randrange(tok.vocab_size + 8) for _ in range(rng.randint(1, 40))]
        pieces, tail = _stream(tok, ids, skip_special_tokens)
        assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip_special_tokens), ids


def test_stream_of_valid_text_never_yields_replacement_char(tok):
    rng = random.Random(3)
    split_chars = 0
    for _ in range(100):
        text = unicodedata.normalize("NFC", _random_text(rng, rng.randint(1, 50))).replace("\ufffd", "")
        ids = tok.encode(text)
        pieces, tail = _stream(tok, ids)
        assert tail == ""
        shown = ""
        for piece in pieces:
            assert "\ufffd" not in piece
            shown += piece
            assert text.startswith(shown)
        assert shown == text
        split_chars += pieces.count("")
    assert split_chars > 50, "the test texts must include characters split across tokens"


def test_flush_of_incomplete_character(tok):
    ids = tok.encode("ok 😀")
    pieces, tail = _stream(tok, ids[:-1])
    assert "".join(pieces) == "ok " and tail == "\ufffd" == tok.decode(ids[:-1])[-1]
    detok = tok.detokenizer()
    assert [detok.add(i) for i in ids][-1] == "😀" and detok.flush() == ""


def test_make_tokenizer_json_is_deterministic():
    assert make_tokenizer_json(50, seed=4) == make_tokenizer_json(50, seed=4)
    assert make_tokenizer_json(50, seed=4) != make_tokenizer_json(50, seed=5)
    config = json.loads(make_tokenizer_json(50))
    assert config["normalizer"]["type"] == "NFC" and config["decoder"]["type"] == "ByteLevel"
    assert [t["content"] for t in config["added_tokens"]] == TINY_ADDED_TOKENS
    with pytest.raises(ValueError, match="merges"):
        make_tokenizer_json(100_000)


def _write_dir(tmp_path, **files):
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    return tmp_path


def test_from_dir_reads_template_and_config(tmp_path):
    config = {"chat_template": "from config", "eos_token": "<|im_end|>",
              "added_tokens_decoder": {str(256 + 40 + 2): {"content": "<|im_end|>", "special": True}}}
    d = _write_dir(tmp_path, **{"tokenizer.json": make_tokenizer_json(40),
                                "tokenizer_config.json": json.dumps(config)})
    assert Tokenizer.from_dir(d).chat_template == "from config"
    _write_dir(d, **{"chat_template.jinja": TINY_CHAT_TEMPLATE})
    tok = Tokenizer.from_dir(d)
    assert tok.chat_template == TINY_CHAT_TEMPLATE and tok.vocab_size == tiny_vocab_size(40)
    config["chat_template"] = [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]
    (d / "chat_template.jinja").unlink()
    _write_dir(d, **{"tokenizer_config.json": json.dumps(config)})
    assert Tokenizer.from_dir(d).chat_template == "d"


def test_from_dir_adds_tokens_listed_only_in_config(tmp_path):
    new_id = tiny_vocab_size(40)
    config = {"added_tokens_decoder": {str(new_id): {"content": "<|extra|>", "special": True}}}
    d = _write_dir(tmp_path, **{"tokenizer.json": make_tokenizer_json(40), "tokenizer_config.json": json.dumps(config)})
    tok = Tokenizer.from_dir(d)
    assert tok.token_to_id("<|extra|>") == new_id and tok.encode("a<|extra|>")[-1] == new_id
    assert tok.decode([new_id], skip_special_tokens=True) == ""


@pytest.mark.parametrize("case, error, match", [
    ("missing", FileNotFoundError, r"tokenizer\.json not found"),
    ("corrupt", ValueError, r"tokenizer\.json: cannot read JSON"),
    ("not_a_tokenizer", ValueError, r"tokenizer\.json: not a valid tokenizer"),
    ("corrupt_config", ValueError, r"tokenizer_config\.json: cannot read JSON"),
    ("wrong_added_id", ValueError, r"tokenizer_config\.json: added token '<think>' has id 7"),
    ("bad_template_list", ValueError, r"tokenizer_config\.json: chat_template must be"),
])
def test_from_dir_errors_name_the_file(tmp_path, case, error, match):
    good = make_tokenizer_json(40)
    files = {
        "missing": {},
        "corrupt": {"tokenizer.json": good[: len(good) // 2]},
        "not_a_tokenizer": {"tokenizer.json": json.dumps({"model": {"type": "Nope"}})},
        "corrupt_config": {"tokenizer.json": good, "tokenizer_config.json": "{ not json"},
        "wrong_added_id": {"tokenizer.json": good, "tokenizer_config.json": json.dumps(
            {"added_tokens_decoder": {"7": {"content": "<think>", "special": False}}})},
        "bad_template_list": {"tokenizer.json": good, "tokenizer_config.json": json.dumps(
            {"chat_template": [{"name": "tool_use", "template": "t"}]})},
    }[case]
    with pytest.raises(error, match=match) as info:
        Tokenizer.from_dir(_write_dir(tmp_path, **files))
    assert str(tmp_path) in str(info.value)


def test_from_json_errors():
    with pytest.raises(ValueError, match="invalid tokenizer JSON"):
        Tokenizer.from_json("{}")
    with pytest.raises(TypeError, match="encode expects a str"):
        Tokenizer.from_json(make_tokenizer_json(10)).encode(b"bytes")
