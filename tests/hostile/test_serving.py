"""Hostile inputs to the serving side (issue 9): what `lily serve` guarantees, whatever a client, the model or the
cache directory sends it. Each guarantee is one test or one fuzz target (docs/security.md says the same to users):

* Cache directory: any entry of --cache-dir (a FIFO, a device, a directory, a dangling symlink, a header nested
  60,000 deep, an absurd token count, random damage, a copy of another file) is skipped with one warning line;
  start-up never blocks or fails; a file whose checksum or snapshot does not check out is a cache miss, never
  restored; a new directory and its files are readable by their owner only.
* Model output: the reasoning and tool-call parsers return text or a tool call for any output, never raise, and
  take time linear in the output (an integer of 5,000 digits, arrays nested 100,000 deep, JSON-form calls nested
  ~1,000 deep, 200,000 parameters, a 1.6 MB call streamed a token at a time); streaming in any chunks gives the
  one-shot result; a request whose model says such things is answered whole, not with a 500 or a cut stream.
* Requests: every bad request is a 4xx that names the field (JSON nested deeper than 64 levels, lone UTF-16
  surrogates, NaN, numbers a 32-bit float or int cannot hold, in the HTTP API and in lily.SamplingParams); no body
  makes the server answer 500 or stop serving.
* Sizes: a body over MAX_BODY_BYTES is refused from its Content-Length; a prompt whose size proves it longer than
  the context is refused before it is tokenised, and never reaches the worker.
* /metrics counts a request, and the tokens it used, before the response's last byte.

Fuzz targets run a bounded number of examples (a few seconds each); LILY_FUZZ_SECONDS=<s> runs each for about
that long instead.
"""

import json
import logging
import math
import os
import queue
import re
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lily
from lily import _core
from lily.parsers import MAX_JSON_DEPTH, Delta, OutputParser, parse_output
from lily import prefix_cache
from lily.prefix_cache import MAGIC, SUFFIX, PrefixCache, largest_snapshot_bytes
from lily.sampling import SamplingParams
from lily.server import MAX_BODY_BYTES, Engine
from lily.tiny import TINY_TEXT_CONFIG, build_tiny
from live_server import MAX_CONTEXT, WEATHER, LiveServer, Script, fetch

FUZZ_SECONDS = float(os.environ.get("LILY_FUZZ_SECONDS", "0"))
REAL_TEMPLATE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "qwen3.6" / "chat_template.jinja"


def fuzz(check, *strategies, examples: int) -> None:
    """Runs `check` on `examples` examples drawn from `strategies` (or, with LILY_FUZZ_SECONDS, on fresh batches of
    them until that many seconds have passed). Failures are shrunk and reported by hypothesis."""
    test = settings(max_examples=examples, deadline=None, database=None, derandomize=False,
                    suppress_health_check=list(HealthCheck))(given(*strategies)(check))
    end = time.monotonic() + FUZZ_SECONDS
    test()
    while time.monotonic() < end:
        test()


# -- cache directory --------------------------------------------------------------------------------------------

FP = "hostile-fingerprint"


def _state(model, n: int, seed: int):
    s = model.session(max_context=256)
    s.prefill([(seed * 7 + i * 13) % model.n_valid for i in range(n)])
    return s.snapshot()


def _good_file(model, directory: Path, n: int = 6, seed: int = 1) -> tuple[Path, list[int]]:
    """A valid cache file for fingerprint FP in `directory`, and its tokens."""
    snap = _state(model, n, seed)
    cache = PrefixCache(0, fingerprint=FP, cache_dir=directory)
    cache.insert(snap)
    cache.close()
    (path,) = [p for p in directory.glob("*" + SUFFIX) if p.stat().st_size]
    return path, snap.tokens


def _file_with_header(header: bytes, rest: bytes = b"") -> bytes:
    return MAGIC + struct.pack("<Q", len(header)) + header + rest


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lily.prefix_cache" and r.levelno == logging.WARNING]


def _start_in_thread(directory: Path):
    """Builds a PrefixCache on `directory` in a thread; (thread, result dict) — a blocked start-up shows as a thread
    still alive."""
    result = {}

    def run():
        try:
            result["cache"] = PrefixCache(1 << 30, fingerprint=FP, cache_dir=directory)
        except BaseException as e:  # reported by the test
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=30)
    return thread, result


def test_a_fifo_in_the_cache_dir_does_not_block_start_up(tiny_model, tmp_path, caplog):
    good, tokens = _good_file(tiny_model, tmp_path)
    fifo = tmp_path / ("fifo" + SUFFIX)
    os.mkfifo(fifo)
    caplog.set_level(logging.WARNING, logger="lily.prefix_cache")
    thread, result = _start_in_thread(tmp_path)
    if thread.is_alive():  # blocked in open(): a writer end releases it
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(timeout=30)
        pytest.fail("the cache start-up blocked on a FIFO")
    assert "error" not in result, result
    cache = result["cache"]
    assert cache.disk_entries == 1 and cache.lookup(tokens + [1]).tokens == tokens
    assert [w for w in _warnings(caplog) if "fifo" in w] == [f"prefix cache: skipping {fifo}: not a regular file "
                                                            f"(mode {stat.filemode(os.stat(fifo).st_mode)})"]
    cache.close()


def test_a_header_nested_60000_deep_is_skipped_with_one_warning(tiny_model, tmp_path, caplog):
    good, tokens = _good_file(tiny_model, tmp_path)
    deep = tmp_path / ("deep" + SUFFIX)
    deep.write_bytes(_file_with_header(b"[" * 60_000))
    caplog.set_level(logging.WARNING, logger="lily.prefix_cache")
    cache = PrefixCache(1 << 30, fingerprint=FP, cache_dir=tmp_path)
    assert _warnings(caplog) == [f"prefix cache: skipping {deep}: unreadable header: nested too deeply"]
    assert cache.lookup(tokens + [1]).tokens == tokens
    cache.close()


def test_entries_that_are_not_regular_files_are_skipped_unopened(tiny_model, tmp_path, caplog):
    good, tokens = _good_file(tiny_model, tmp_path)
    (tmp_path / ("a-directory" + SUFFIX)).mkdir()
    os.mkfifo(tmp_path / "fifo-target")
    links = {"to-a-directory": tmp_path / ("a-directory" + SUFFIX), "to-a-fifo": tmp_path / "fifo-target",
             "to-a-device": Path("/dev/zero"), "dangling": tmp_path / "nothing-here",
             "to-the-good-file": good}
    for name, target in links.items():
        os.symlink(target, tmp_path / (name + SUFFIX))
    caplog.set_level(logging.WARNING, logger="lily.prefix_cache")
    thread, result = _start_in_thread(tmp_path)
    if thread.is_alive():
        os.close(os.open(tmp_path / "fifo-target", os.O_WRONLY | os.O_NONBLOCK))
        thread.join(timeout=30)
        pytest.fail("the cache start-up blocked on a symlink to a FIFO")
    cache = result["cache"]
    skipped = sorted(re.match(r"prefix cache: skipping .*/(.*)\.lilycache: (.*)", w).groups()
                     for w in _warnings(caplog))
    duplicate = [name for name, why in skipped if why.startswith("the same prefix as")]
    assert len(duplicate) == 1 and duplicate[0] in (good.stem, "to-the-good-file")  # one of the two is indexed
    assert [name for name, _ in skipped if name not in duplicate] == \
        ["a-directory", "dangling", "to-a-device", "to-a-directory", "to-a-fifo"]
    assert all("not a regular file" in why or "No such file" in why for name, why in skipped
               if name not in duplicate), skipped
    assert cache.disk_entries == 1 and cache.lookup(tokens + [1]).tokens == tokens
    cache.close()


def test_a_snapshot_larger_than_the_model_makes_is_never_read(tiny_model, tmp_path, caplog):
    """A file whose header is consistent with its size but whose snapshot is larger than any state of the model
    (here 8 GB, a sparse file) is skipped at start-up: reading it whole on the first lookup could take the memory."""
    tokens = [1, 2, 3]
    size = 8 << 30
    header = json.dumps({"fingerprint": FP, "tokens": len(tokens), "snapshot_bytes": size, "crc32": 0}).encode()
    path = tmp_path / ("huge" + SUFFIX)
    path.write_bytes(_file_with_header(header, struct.pack("<3i", *tokens)))
    os.truncate(path, path.stat().st_size + size)  # a hole: no disk used
    limit = largest_snapshot_bytes(tiny_model.config, 256)
    caplog.set_level(logging.WARNING, logger="lily.prefix_cache")
    cache = PrefixCache(1 << 30, fingerprint=FP, cache_dir=tmp_path, max_snapshot_bytes=limit)
    try:
        assert cache.disk_entries == 0 and cache.lookup(tokens + [1]) is None
        assert _warnings(caplog) == [f"prefix cache: skipping {path}: a snapshot of {size} bytes, more than this "
                                     f"model's largest ({limit})"]
    finally:
        cache.close()
    good, good_tokens = _good_file(tiny_model, tmp_path / "ok")  # a real one is within the bound
    bounded = PrefixCache(1 << 30, fingerprint=FP, cache_dir=good.parent, max_snapshot_bytes=limit)
    assert bounded.lookup(good_tokens + [1]).tokens == good_tokens
    bounded.close()


@pytest.mark.parametrize("header,why", [
    (json.dumps({"fingerprint": FP, "tokens": 1 << 40, "snapshot_bytes": 0, "crc32": 0}).encode(),
     "malformed header"),
    (json.dumps({"fingerprint": FP, "tokens": 10**4000, "snapshot_bytes": 0, "crc32": 0}).encode(),
     "malformed header"),
    (b'{"fingerprint": "' + b"9" * 5000 + b'", "tokens": 1e999}', "malformed header"),
    (b'{"tokens": ' + b"9" * 5000 + b"}", "unreadable header: Exceeds the limit"),
    (b"\xff\xfe{}", "unreadable header"),
    (b"[" * 500 + b"]" * 500, "malformed header"),
], ids=["tokens-2**40", "tokens-4000-digits", "inf", "int-digit-limit", "not-utf8", "nested-500"])
def test_absurd_headers_are_skipped_with_one_warning(tiny_model, tmp_path, caplog, header, why):
    good, tokens = _good_file(tiny_model, tmp_path)
    bad = tmp_path / ("bad" + SUFFIX)
    bad.write_bytes(_file_with_header(header, b"\0" * 64))
    caplog.set_level(logging.WARNING, logger="lily.prefix_cache")
    cache = PrefixCache(1 << 30, fingerprint=FP, cache_dir=tmp_path)
    (warning,) = _warnings(caplog)
    assert warning.startswith(f"prefix cache: skipping {bad}: {why}") and len(warning) < 400, warning
    assert cache.disk_entries == 1 and cache.lookup(tokens + [1]).tokens == tokens
    cache.close()


def test_an_unexpected_error_reading_one_file_skips_only_that_file(tiny_model, tmp_path, caplog, monkeypatch):
    good, tokens = _good_file(tiny_model, tmp_path)
    odd = tmp_path / ("odd" + SUFFIX)
    odd.write_bytes(good.read_bytes())
    real_read = prefix_cache._read_header

    def failing_read(f, *args):
        if os.path.samestat(os.fstat(f.fileno()), os.stat(odd)):
            raise MemoryError("simulated")
        return real_read(f, *args)

    monkeypatch.setattr(prefix_cache, "_read_header", failing_read)
    caplog.set_level(logging.WARNING, logger="lily.prefix_cache")
    cache = PrefixCache(1 << 30, fingerprint=FP, cache_dir=tmp_path)
    assert _warnings(caplog) == [f"prefix cache: skipping {odd}: MemoryError: simulated"]
    assert cache.lookup(tokens + [1]).tokens == tokens
    cache.close()


def test_fuzz_damaged_cache_files_are_skipped_or_restored_exactly(tiny_model, tmp_path_factory):
    """Random damage to a valid file (bytes changed, cut, grown, the header rewritten; with the checksum resealed or
    not): start-up never raises, and a lookup gives either nothing or the file's own tokens, never an exception."""
    template_dir = tmp_path_factory.mktemp("template")
    good, tokens = _good_file(tiny_model, template_dir, n=5)
    original = good.read_bytes()
    (header_len,) = struct.unpack("<Q", original[len(MAGIC):len(MAGIC) + 8])
    body_start = len(MAGIC) + 8 + header_len
    header = json.loads(original[len(MAGIC) + 8:body_start])
    header_values = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=8),
                              st.just(FP), st.lists(st.integers(), max_size=3))
    new_headers = st.dictionaries(st.sampled_from(["fingerprint", "tokens", "snapshot_bytes", "crc32", "x"]),
                                  header_values, max_size=5).map(lambda h: {**header, **h})

    def check(new_header, reseal, edits, cut, extra):
        body = bytearray(original[body_start:])  # the tokens, then the snapshot
        fields = header if new_header is None else new_header
        if reseal:  # damage that the checksum does not see: reading the snapshot must find it, or restore it as is
            for pos, value in edits:
                body[pos % len(body)] = value
            fields = {**fields, "crc32": zlib.crc32(bytes(body))}
        raw = bytearray(_file_with_header(json.dumps(fields).encode(), bytes(body)))
        if not reseal:
            for pos, value in edits:
                raw[pos % len(raw)] = value
        directory = tmp_path_factory.mktemp("case")
        (directory / ("case" + SUFFIX)).write_bytes(bytes(raw[:len(raw) - cut]) + extra)
        cache = PrefixCache(1 << 30, fingerprint=FP, cache_dir=directory)
        try:
            hit = cache.lookup(tokens + [1])
            assert hit is None or hit.tokens == tokens
        finally:
            cache.close()

    fuzz(check, st.none() | new_headers, st.booleans(),
         st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=4), st.integers(0, 64) | st.just(0),
         st.binary(max_size=16), examples=150)


def test_copies_of_one_file_are_indexed_once(tiny_model, tmp_path, caplog):
    good, tokens = _good_file(tiny_model, tmp_path)
    copy = tmp_path / ("copy" + SUFFIX)
    copy.write_bytes(good.read_bytes())
    os.utime(copy, ns=(good.stat().st_atime_ns, good.stat().st_mtime_ns + 10**9))
    caplog.set_level(logging.WARNING, logger="lily.prefix_cache")
    size = good.stat().st_size
    cache = PrefixCache(1 << 30, fingerprint=FP, cache_dir=tmp_path, max_disk_bytes=3 * size // 2)
    assert _warnings(caplog) == [f"prefix cache: skipping {copy}: the same prefix as {good}"]
    assert (cache.disk_entries, cache.disk_bytes) == (1, size) and cache.lookup(tokens + [1]).tokens == tokens
    cache.close()
    # A budget below one file: the indexed one is dropped; the copy never counted, so nothing is left to drop.
    caplog.clear()
    cache = PrefixCache(1 << 30, fingerprint=FP, cache_dir=tmp_path, max_disk_bytes=size // 2)
    assert (cache.disk_entries, cache.disk_bytes) == (0, 0)
    cache.close()


def test_a_new_cache_dir_and_its_files_are_private(tiny_model, tmp_path):
    """The files hold the token ids of cached prompts: only their owner may read them."""
    directory = tmp_path / "new" / "cache"
    good, _ = _good_file(tiny_model, directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700 and stat.S_IMODE(good.stat().st_mode) == 0o600


def _serve_cli(cache_dir: Path) -> tuple[subprocess.Popen, int, list[str]]:
    """`lily serve` on `cache_dir`: (process, port, the stderr lines before it served); fails if it does not serve
    within 60 s."""
    proc = subprocess.Popen([sys.executable, "-m", "lily", "serve", "--model", "tiny", "--port", "0",
                             "--max-context", str(MAX_CONTEXT), "--cache-dir", str(cache_dir),
                             "--log-level", "warning"], stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    seen, end = [], time.monotonic() + 60
    while time.monotonic() < end:
        try:
            line = lines.get(timeout=max(end - time.monotonic(), 0.01))
        except queue.Empty:
            break
        if match := re.search(r"serving tiny at http://127\.0\.0\.1:(\d+)/v1", line):
            return proc, int(match.group(1)), seen
        seen.append(line)
    proc.kill()
    proc.wait()
    pytest.fail("the server did not start:\n" + "".join(seen))


def test_the_server_starts_whatever_the_cache_dir_holds(tiny_model, tmp_path):
    os.mkfifo(tmp_path / ("fifo" + SUFFIX))
    (tmp_path / ("deep" + SUFFIX)).write_bytes(_file_with_header(b"[" * 60_000))
    (tmp_path / ("dir" + SUFFIX)).mkdir()
    os.symlink("/dev/zero", tmp_path / ("zero" + SUFFIX))
    (tmp_path / ("junk" + SUFFIX)).write_bytes(os.urandom(100))
    proc, port, stderr = _serve_cli(tmp_path)
    try:
        status, body = fetch(port, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 2})
        assert status == 200, body
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    warnings = [line for line in stderr if "prefix cache: skipping" in line]
    assert sorted(re.search(r"/(\w+)\.lilycache:", w).group(1) for w in warnings) == \
        ["deep", "dir", "fifo", "junk", "zero"], stderr


# -- model output ------------------------------------------------------------------------------------------------

NUMBERS = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer"}, "x": {"type": "number"}, "a": {"type": "array"}, "o": {"type": "object"},
    "u": {"anyOf": [{"type": "integer"}, {"type": "array"}, {"type": "string"}]}}}}}


def _xml_call(**params) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>"


def _json_call(arguments: str) -> str:
    return '<tool_call>\n{"name": "f", "arguments": ' + arguments + "}\n</tool_call>"


HOSTILE_OUTPUTS = [
    # (id, model output, the arguments of the one call it is, or None: it is text)
    ("integer-5000-digits", _xml_call(n="9" * 5000), {"n": "9" * 5000}),
    ("integer-4300-digits", _xml_call(n="7" * 4300), {"n": int("7" * 4300)}),
    ("number-5000-digits", _xml_call(x="9" * 5000), {"x": "9" * 5000}),
    ("union-5000-digits", _xml_call(u="-" + "1" * 5000), {"u": "-" + "1" * 5000}),
    ("array-1000-deep", _xml_call(a="[" * 1000 + "]" * 1000), {"a": "[" * 1000 + "]" * 1000}),
    ("array-100000-deep", _xml_call(a="[" * 100_000 + "]" * 100_000), {"a": "[" * 100_000 + "]" * 100_000}),
    ("array-deeper-than-the-limit", _xml_call(a="[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)),
     {"a": "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)}),
    ("array-at-the-limit", _xml_call(a="[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH),
     {"a": json.loads("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)}),
    ("object-1000-deep", _xml_call(o='{"a": ' * 1000 + "1" + "}" * 1000), {"o": '{"a": ' * 1000 + "1" + "}" * 1000}),
    ("json-call-1000-deep", _json_call('{"a": ' + "[" * 1000 + "]" * 1000 + "}"), None),
    ("json-call-100000-deep", _json_call('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"), None),
    ("json-call-string-arguments-deep", _json_call(json.dumps("[" * 5000 + "]" * 5000)), None),
    ("json-call-huge-integer", _json_call('{"a": ' + "9" * 5000 + "}"), None),
]


@pytest.mark.parametrize("text,arguments", [c[1:] for c in HOSTILE_OUTPUTS], ids=[c[0] for c in HOSTILE_OUTPUTS])
def test_the_parser_turns_hostile_output_into_text_or_a_call(text, arguments):
    whole = parse_output(text, tools=[NUMBERS])
    if arguments is None:
        assert whole.tool_calls == [] and whole.content == text.strip()
    else:
        (call,) = whole.tool_calls
        assert (call.name, json.loads(call.arguments)) == ("f", arguments) and whole.content == ""
    parser = OutputParser(tools=[NUMBERS])  # streamed a few characters at a time
    out = parser.feed("")
    for i in range(0, len(text), 997):
        out += parser.feed(text[i:i + 997])
    out += parser.finish()
    assert (out.content, [(c.name, c.arguments) for c in out.tool_calls]) == \
        (whole.content, [(c.name, c.arguments) for c in whole.tool_calls])


def test_a_call_with_many_parameters_parses_in_linear_time():
    text = "<tool_call>\n<function=f>\n" + "<parameter=n>1\n" * 200_000 + "</function>\n</tool_call>"
    start = time.perf_counter()
    (call,) = parse_output(text, tools=[NUMBERS]).tool_calls
    assert json.loads(call.arguments) == {"n": 1}
    assert time.perf_counter() - start < 10  # quadratic: minutes


def test_a_long_streamed_call_parses_in_linear_time():
    parser = OutputParser(tools=[NUMBERS])
    parser.feed("<tool_call>\n<function=f>\n<parameter=x>\n")
    start = time.perf_counter()
    for _ in range(320_000):  # 1.6 MB, a token at a time
        parser.feed("abcd ")
    out = parser.feed("\n</parameter>\n</function>\n</tool_call>")
    out += parser.finish()
    assert json.loads(out.tool_calls[0].arguments) == {"x": "abcd " * 320_000}
    assert time.perf_counter() - start < 10  # quadratic: about a minute


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_a_reply_with_hostile_calls_is_answered_whole(tiny_model, stream):
    """The model's output reaches the client as calls or text, never as a 500 or a stream cut short."""
    reply = ("Let me see.\n</think>\n\n" + _xml_call(n="9" * 5000, a="[" * 1000 + "]" * 1000) + "\n"
             + _json_call('{"a": ' + "[" * 1000 + "]" * 1000 + "}"))
    server = LiveServer(Engine(tiny_model, max_context=16384, generate_fn=Script(lambda prompt: reply)))
    try:
        status, body = _post(server.port, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "go"}], "tools": [NUMBERS], "stream": stream})
    finally:
        server.close()
    assert status == 200, body
    if stream:
        assert body.rstrip().endswith("data: [DONE]") and '"error"' not in body
        chunks = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        calls = [call for d in deltas for call in d.get("tool_calls", [])]
        content = "".join(d.get("content") or "" for d in deltas)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        message = body["choices"][0]["message"]
        calls, content, finish = message["tool_calls"], message["content"], body["choices"][0]["finish_reason"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"n": "9" * 5000, "a": "[" * 1000 + "]" * 1000}]
    assert content.startswith('<tool_call>\n{"name": "f"') and finish == "tool_calls"


FRAGMENTS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<function=f>", "<function=get_weather>",
             "<function=", "</function>", "<parameter=n>", "<parameter=a>", "<parameter=u>", "<parameter=city>",
             "<parameter=days>", "</parameter>", "\n", "\n\n", " ", "\t", "Paris", "12", "-3.5", "1e999", "null",
             "true", "[1, 2]", '{"a": 1}', "[[[", "]]]", "{", "}", '"', '{"name": "f", "arguments": {"n": 1}}',
             '{"name": "f", "arguments": "{\\"n\\": 2}"}', "<", ">", "/", "=", "<tool", "_call>", "think>", "é",
             "\u00a0", "\ufffd", "9" * 4400, "[" * 1100, "]" * 1100, "<tool_call>\n<function=f>\n",
             "<parameter=n>\n" + "9" * 4400 + "\n</parameter>\n", "<parameter=a>\n" + "[" * 1100 + "]" * 1100,
             '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * 1100 + "]" * 1100 + "}}</tool_call>"]
VALUES = st.sampled_from(["Paris", "12", "-0", "1e999", "nan", "true", "null", "[1, {}]", '{"k": [null]}', "9" * 4301,
                          "[" * 1000 + "]" * 1000, '{"a": ' * 999 + "1" + "}" * 999, "\n", ""]) | st.text(max_size=6)
XML_CALLS = st.builds(lambda name, params, closed: f"<tool_call>\n<function={name}>\n" + "".join(
    f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params) + ("</function>\n</tool_call>" if closed else ""),
    st.sampled_from(["f", "get_weather", "other"]),
    st.lists(st.tuples(st.sampled_from(["n", "x", "a", "o", "u", "city", "days"]), VALUES), max_size=3), st.booleans())
JSON_CALLS = st.builds(lambda name, args: f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>',
                       st.sampled_from(["f", "search", ""]), VALUES)
MODEL_OUTPUTS = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=6) | XML_CALLS | JSON_CALLS,
                         max_size=30).map("".join)


def test_fuzz_streamed_parsing_equals_one_shot_and_never_raises():
    def check(text, reasoning, tools, data):
        whole = parse_output(text, reasoning=reasoning, tools=tools)
        step = data.draw(st.integers(1, 12))  # every `step` characters, or at random points
        cuts = data.draw(st.just(list(range(step, len(text), step))) |
                         st.lists(st.integers(0, len(text)), max_size=10).map(sorted))
        parser, out, prev = OutputParser(reasoning=reasoning, tools=tools), Delta(), 0
        for cut in cuts + [len(text)]:
            out += parser.feed(text[prev:cut])
            prev = cut
        out += parser.finish()
        assert (out.reasoning, out.content, [(c.name, c.arguments) for c in out.tool_calls]) == \
            (whole.reasoning, whole.content, [(c.name, c.arguments) for c in whole.tool_calls])
        for call in whole.tool_calls:
            assert isinstance(json.loads(call.arguments), dict)

    fuzz(check, MODEL_OUTPUTS, st.booleans(), st.sampled_from([None, [], [NUMBERS, WEATHER]]), st.data(),
         examples=600)


# -- one server for the request tests: the tiny model, scripted replies that still build the core sampler -------

class CheckedScript(Script):
    """A Script whose model says `reply`, after building the core sampler from the request's settings as the real
    generator does (so settings the core would refuse fail here too)."""

    def __call__(self, model, prompt_ids, *, session, sampling, progress=None):
        _core.Sampler(sampling.to_core(), model.vocab_size, model.n_valid)
        return super().__call__(model, prompt_ids, session=session, sampling=sampling, progress=progress)


@pytest.fixture(scope="module")
def live():
    """A server of a smaller tiny model (the CPU prefill is most of a valid request's time), with the real chat
    template where it is found, scripted to say 'ok'."""
    model = lily.Model(build_tiny(text_config={**TINY_TEXT_CONFIG, "num_hidden_layers": 4, "num_experts": 4,
                                               "num_experts_per_tok": 2}))
    if REAL_TEMPLATE.is_file():
        model.tokenizer.chat_template = REAL_TEMPLATE.read_text(encoding="utf-8")
    engine = Engine(model, max_context=MAX_CONTEXT, cache=PrefixCache(64 << 20, fingerprint="hostile"),
                    generate_fn=CheckedScript(lambda prompt: "ok"))
    server = LiveServer(engine)
    yield server
    server.close()


def _post(port: int, path: str, body) -> tuple[int, dict | str]:
    """(status, JSON or text): `body` a dict (sent as JSON, NaN allowed) or raw bytes."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return fetch(port, "POST", path, data)


def _assert_error(status: int, body, param) -> None:
    assert 400 <= status < 500, (status, body)
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"], body
    assert body["error"]["param"] == param, body
    assert "incompatible function arguments" not in body["error"]["message"]


def _still_serving(port: int) -> None:
    """A request through the worker is answered (a short one: the tiny model's prefill is slow)."""
    status, body = _post(port, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert status == 200, body


def _chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **fields}


def _deep_schema(n: int) -> dict:
    schema = {"type": "string"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                         "properties": {"x": schema}}}}


BAD = "/v1/chat/completions"
HOSTILE_REQUESTS = [
    # (id, route, body, the field the error must name)
    ("json-1000-deep", BAD, b'{"messages": ' + b"[" * 1000 + b"]" * 1000 + b"}", "messages"),
    ("json-100000-deep", BAD, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "messages"),
    ("json-deeper-than-the-limit", BAD, b'{"messages": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}",
     "messages[0]"),
    ("tool-schema-300-deep", BAD, _chat(tools=[_deep_schema(300)]), "tools[0]"),
    ("template-kwargs-300-deep", BAD, _chat(chat_template_kwargs={"x": _deep_schema(300)}), "chat_template_kwargs"),
    ("history-arguments-1000-deep", BAD, _chat(messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[" * 1000 + "]" * 1000}}]}]),
     "messages[1].tool_calls[0].function.arguments"),
    ("history-arguments-surrogate", BAD, _chat(messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": "\\ud800"}'}}]}]),
     "messages[1].tool_calls[0].function.arguments.a"),
    ("lone-surrogate-content", BAD, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
     "messages[0].content"),
    ("lone-low-surrogate-part", BAD,
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages[0].content[0].text"),
    ("surrogate-bytes", BAD, b'{"messages": [{"role": "user", "content": "a\xed\xa0\x80b"}]}', None),
    ("surrogate-key", BAD, b'{"messages": [{"role": "user", "content": "x", "\\ud800": 1}]}', "messages[0].\\ud800"),
    ("surrogate-tool-name", BAD, _chat(tools=[{"type": "function", "function": {"name": "\ud800"}}]),
     "tools[0].function.name"),
    ("surrogate-stop", BAD, _chat(stop="\udc00"), "stop"),
    ("surrogate-model", BAD, _chat(model="\ud800"), "model"),
    ("surrogate-prompt", "/v1/completions", {"prompt": "\ud800", "max_tokens": 1}, "prompt"),
    ("nan", BAD, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', None),
    ("infinity", BAD, b'{"messages": [{"role": "user", "content": "x"}], "top_p": -Infinity}', None),
    ("integer-5000-digits", BAD, b'{"messages": [], "seed": ' + b"9" * 5000 + b"}", None),
    ("temperature-1e308", BAD, _chat(temperature=1e308), "temperature"),
    ("temperature-1e-45", BAD, _chat(temperature=1e-45), "temperature"),
    ("temperature-huge-integer", BAD, _chat(temperature=10**400), "temperature"),
    ("presence-penalty-1e308", BAD, _chat(presence_penalty=1e308), "presence_penalty"),
    ("frequency-penalty-1e308", BAD, _chat(frequency_penalty=-1e308), "frequency_penalty"),
    ("repetition-penalty-1e-45", BAD, _chat(repetition_penalty=1e-45), "repetition_penalty"),
    ("repetition-penalty-1e308", BAD, _chat(repetition_penalty=1e308), "repetition_penalty"),
    ("top-p-1e-50", BAD, _chat(top_p=1e-50), "top_p"),
    ("top-k-2**31", BAD, _chat(top_k=2**31), "top_k"),
    ("top-k-2**64", BAD, _chat(top_k=2**64), "top_k"),
    ("max-tokens-2**31", BAD, _chat(max_tokens=2**31), "max_tokens"),
    ("max-completion-tokens-2**70", BAD, _chat(max_completion_tokens=2**70), "max_completion_tokens"),
    ("completion-top-k-2**31", "/v1/completions", {"prompt": "x", "top_k": 2**31}, "top_k"),
    ("completion-temperature-1e-45", "/v1/completions", {"prompt": "x", "temperature": 1e-45}, "temperature"),
    ("completion-token-2**70", "/v1/completions", {"prompt": [1, 2**70]}, "prompt"),
]


@pytest.fixture(scope="module")
def real_live(tiny_model):
    """A server that generates with the real generator (the core sampler), for settings only it would refuse."""
    server = LiveServer(Engine(tiny_model, max_context=MAX_CONTEXT))
    yield server
    server.close()


@pytest.mark.parametrize("path,body,param", [c[1:] for c in HOSTILE_REQUESTS], ids=[c[0] for c in HOSTILE_REQUESTS])
def test_hostile_requests_get_a_4xx_naming_the_field(real_live, path, body, param):
    status, err = _post(real_live.port, path, body)
    _assert_error(status, err, param)
    _still_serving(real_live.port)


def test_the_deepest_json_allowed_renders(live):
    # A schema as deep as a body may carry reaches the chat template and renders (or is refused for its length).
    status, body = _post(live.port, BAD, _chat(tools=[_deep_schema(MAX_JSON_DEPTH - 7)]))
    assert status == 200 or body["error"]["code"] == "context_length_exceeded", body


def test_encoding_a_lone_surrogate_is_a_value_error_saying_where(tiny_model):
    with pytest.raises(ValueError, match=r"lone UTF-16 surrogate \('\\udc80'\) at character 3"):
        tiny_model.tokenizer.encode("abc\udc80")
    with pytest.raises(ValueError, match="lone UTF-16 surrogate"):
        lily.generate(tiny_model, "x\ud800", max_tokens=1)


def test_sampling_settings_out_of_32_bit_range_are_value_errors_naming_the_field(tiny_model):
    cases = {"temperature": [1e308, 1e-45, 10**400, True, "hot"], "top_k": [2**31, 2**64, 1.5],
             "max_tokens": [2**31, 10**5000], "top_p": [1e-50], "repetition_penalty": [1e-45, 1e308],
             "presence_penalty": [1e308, -math.inf], "frequency_penalty": [1e308]}
    for name, values in cases.items():
        for value in values:
            with pytest.raises(ValueError, match=f"^SamplingParams.{name} must be") as err:
                SamplingParams(**{name: value})
            assert len(str(err.value)) < 200
    for name in ("top_k", "max_tokens"):  # through the generator too: no nanobind signature
        with pytest.raises(ValueError, match=f"SamplingParams.{name}"):
            lily.generate(tiny_model, "hi", **{name: 2**31})


# A request generator: a valid body of either route (a random subset of its fields, plausible values), then most
# often one or two fields replaced by hostile values (absurd numbers, arbitrary JSON, lone surrogates, deep nesting),
# sometimes a body that is not an object at all.
SURROGATE_TEXT = st.builds(lambda a, s, b: a + s + b, st.text(max_size=4),
                           st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), st.text(max_size=4))
TEXT = st.text(max_size=12) | st.sampled_from(["", "hi", "<|im_end|>", "<think>", "</think>", "<tool_call>",
                                                "\u1100\u1161", "{{ raise_exception('x') }}"])
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | TEXT, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=10)
NUMBER = st.sampled_from([0, 1, -1, 0.5, 2, 1e-45, 1e-5, 1e5, 1e308, -1e308, 2**31 - 1, 2**31, 2**63, 2**64,
                          10**400, math.nan, math.inf, -math.inf]) | st.integers() | st.floats()
DEEP = st.sampled_from([MAX_JSON_DEPTH - 2, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 300, 999, 1000, 5000]).map(
    lambda n: f"__DEEP_{n}__")
HOSTILE = NUMBER | JSON | DEEP | SURROGATE_TEXT


def _message(role: str, content, extra: dict | None = None) -> dict:
    return {"role": role, "content": content, **(extra or {})}


CALL = st.builds(lambda city, call_id: {"id": call_id, "type": "function", "function": {
    "name": "get_weather", "arguments": json.dumps({"city": city})}}, TEXT, TEXT)
CONVERSATION = st.lists(st.one_of(
    st.builds(_message, st.just("user"), TEXT | st.lists(st.builds(lambda t: {"type": "text", "text": t}, TEXT),
                                                         min_size=1, max_size=2)),
    st.builds(_message, st.sampled_from(["system", "developer"]), TEXT),
    st.builds(_message, st.just("assistant"), TEXT | st.none(), st.fixed_dictionaries(
        {}, optional={"reasoning_content": TEXT, "tool_calls": st.lists(CALL, max_size=2)})),
    st.builds(_message, st.just("tool"), TEXT, st.fixed_dictionaries({}, optional={"tool_call_id": TEXT}))),
    min_size=1, max_size=4).map(lambda ms: ms + [_message("user", "hi")])
COMMON = {"model": st.just("tiny"), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
          "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1), "presence_penalty": st.floats(-2, 2),
          "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
          "seed": st.integers(0, 2**64 - 1), "stop": TEXT.filter(bool) | st.lists(TEXT.filter(bool), max_size=2),
          "max_tokens": st.integers(1, 3), "stream": st.booleans(),
          "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "n": st.just(1),
          "response_format": st.just({"type": "text"})}
CHAT = st.fixed_dictionaries({"messages": CONVERSATION}, optional={
    **COMMON, "tools": st.lists(st.sampled_from([WEATHER, NUMBERS]), max_size=2),
    "tool_choice": st.sampled_from(["auto", "none"]), "enable_thinking": st.booleans(),
    "chat_template_kwargs": st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans(),
                                                                "preserve_thinking": st.booleans()}),
    "logprobs": st.just(True), "top_logprobs": st.integers(0, 20), "max_completion_tokens": st.integers(1, 3)})
COMPLETION = st.fixed_dictionaries({"prompt": TEXT.filter(bool) | st.lists(st.integers(0, 400), min_size=1,
                                                                             max_size=6)},
                                   optional={**COMMON, "logprobs": st.integers(0, 20), "echo": st.booleans()})
FIELDS = sorted({*COMMON, "messages", "tools", "tool_choice", "chat_template_kwargs", "logprobs", "top_logprobs",
                 "max_completion_tokens", "enable_thinking", "prompt", "echo", "suffix", "logit_bias", "best_of",
                 "functions"})
# Hostile values where a field nests: inside messages, tools and tool calls.
NESTED_PATHS = st.sampled_from([("messages", 0, "content"), ("messages", 0, "role"), ("messages", 0),
                                ("messages", 0, "tool_calls"), ("tools", 0), ("tools", 0, "function", "parameters"),
                                ("stream_options", "include_usage"), ("chat_template_kwargs", "enable_thinking")])


def _replace(body: dict, path: tuple, value) -> dict:
    """`body` with the value at `path` replaced, where the path exists (or the first step added)."""
    body = json.loads(json.dumps(body))
    node = body
    for step in path[:-1]:
        if isinstance(node, dict) and step in node or isinstance(node, list) and isinstance(step, int) \
                and step < len(node):
            node = node[step]
        else:
            return body
    if isinstance(node, dict) or isinstance(node, list) and isinstance(path[-1], int) and path[-1] < len(node):
        node[path[-1]] = value
    return body


REQUESTS = st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions"]), CHAT, COMPLETION,
                     st.dictionaries(st.sampled_from(FIELDS), HOSTILE, max_size=2),
                     st.lists(st.tuples(NESTED_PATHS, HOSTILE), max_size=2), st.integers(0, 19), HOSTILE)


def _encode(body) -> bytes:
    """JSON bytes of a generated body, NaN and Infinity written as Python does, __DEEP_n__ as n nested arrays."""
    data = json.dumps(body).encode()
    return re.sub(rb'"__DEEP_(\d+)__"', lambda m: b"[" * int(m.group(1)) + b"]" * int(m.group(1)), data)


def _check_answer(status: int, body) -> None:
    if status == 200:
        if isinstance(body, str):  # a stream: complete, no error event
            assert body.rstrip().endswith("data: [DONE]") and '"error"' not in body, body[-500:]
        return
    assert status in (400, 404, 413), (status, body)
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"], body


def test_fuzz_requests_never_get_a_500_and_the_server_keeps_serving(live):
    def check(request):
        route, chat, completion, fields, nested, dice, junk = request
        body = {**(chat if route == "/v1/chat/completions" else completion), **fields}
        for path, value in nested:
            body = _replace(body, path, value)
        if dice == 13:  # now and then, not an object, or an object of anything (hypothesis favours 0 and 19)
            body = junk
        status, answer = fetch(live.port, "POST", route, _encode(body))
        _check_answer(status, answer)

    fuzz(check, REQUESTS, examples=150)
    _still_serving(live.port)


def test_fuzz_get_routes(live):
    def check(name):
        quoted = urllib.parse.quote(name, safe="", errors="surrogatepass")
        for path in (f"/v1/models/{quoted}", f"/v1/{quoted}", f"/{quoted}"):
            status, body = fetch(live.port, "GET", path)
            assert status in (200, 404, 405), (path, status, body)

    fuzz(check, SURROGATE_TEXT | TEXT | st.sampled_from(["models", "health", "metrics", "chat/completions"]),
         examples=100)
    assert fetch(live.port, "GET", "/health") == (200, {"status": "ok"})


# -- sizes: refused before they cost anything -----------------------------------------------------------------

def test_a_body_over_the_limit_is_refused_from_its_content_length(live):
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=10)
    try:  # the body is never sent: the answer must not wait for it
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1))
        head = sock.recv(65536)
    finally:
        sock.close()
    assert head.startswith(b"HTTP/1.1 413"), head
    assert MAX_BODY_BYTES <= 16 << 20
    _still_serving(live.port)


@pytest.fixture
def counted_server(new_tiny_model):
    """A server whose tokenizer records the length of every text it encodes."""
    model = new_tiny_model()
    encoded, encode = [], model.tokenizer.encode

    def counting(text):
        encoded.append(len(text))
        return encode(text)

    model.tokenizer.encode = counting
    server = LiveServer(Engine(model, max_context=MAX_CONTEXT, generate_fn=Script(lambda prompt: "ok")))
    yield server, model, encoded
    server.close()


@pytest.mark.parametrize("route,field", [("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")])
def test_a_prompt_surely_too_long_is_refused_before_it_is_tokenised(counted_server, route, field):
    server, model, encoded = counted_server
    text = "the quick brown fox " * 200_000  # 4 MB: at least 4e6 / (the longest token's bytes) tokens
    body = {"messages": [{"role": "user", "content": text}]} if field == "messages" else {"prompt": text}
    start = time.perf_counter()
    status, err = _post(server.port, route, body)
    took = time.perf_counter() - start
    assert status == 400 and err["error"]["code"] == "context_length_exceeded" and err["error"]["param"] == field
    assert re.search(rf"maximum context length is {MAX_CONTEXT} tokens, and the prompt has at least \d+ tokens",
                     err["error"]["message"])
    assert not [n for n in encoded if n >= len(text)], "the worker tokenised it"
    assert took < 10, took
    _still_serving(server.port)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_tokenising_a_long_prompt_holds_up_no_other_request(new_tiny_model, route):
    """A prompt whose length only its tokens tell (the early bound lets it pass) is tokenised in its request's own
    thread, not by the engine's worker: a short request sent meanwhile is answered first. (A 16 MB prompt held the
    worker for ~20 s before it was refused.)"""
    model = new_tiny_model()
    started, release = threading.Event(), threading.Event()
    encode = model.tokenizer.encode

    def slow(text):  # stands for the seconds a long text takes
        if len(text) > 100_000:
            started.set()
            release.wait(60)
        return encode(text)

    model.tokenizer.encode = slow
    server = LiveServer(Engine(model, max_context=150_000, generate_fn=Script(lambda prompt: "ok")))
    text = "x" * 200_000  # 200,000 tokens (one a character), at least 200,000 / the longest token's bytes
    body = {"messages": [{"role": "user", "content": text}]} if route.endswith("chat/completions") else {
        "prompt": text}
    long = {}
    sender = threading.Thread(target=lambda: long.update(answer=_post(server.port, route, body)))
    try:
        sender.start()
        assert started.wait(30)
        assert _post(server.port, "/v1/completions", {"prompt": "hi", "max_tokens": 1})[0] == 200
        assert not long, "the long prompt was answered first"
    finally:
        release.set()
        sender.join(60)
        server.close()
    status, err = long["answer"]
    assert status == 400 and err["error"]["code"] == "context_length_exceeded", err


def test_fuzz_min_tokens_is_a_lower_bound(tiny_model):
    """The early length check refuses only prompts that are too long: Tokenizer.min_tokens never exceeds the token
    count, for any text (Unicode normalisation, added tokens and partial UTF-8 tokens included)."""
    tok = tiny_model.tokenizer
    pieces = st.sampled_from(["<|im_start|>", "<|im_end|>", "<think>", "\u1100\u1161\u11a8", "e\u0301", "\u0958",
                              "   ", "\n\n\n", "=====", "日本語", "😀", "ﬁ", "Å", ">\u0338"]) | st.text(max_size=8)

    def check(parts):
        text = "".join(parts)
        assert tok.min_tokens(text) <= len(tok.encode(text))

    fuzz(check, st.lists(pieces, max_size=30), examples=500)


# -- /metrics ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_metrics_count_a_request_before_its_response_ends(live, monkeypatch, stream):
    engine = live.engine
    record = engine._record

    def slow_record(*args):  # the worker is slow to count: the response must still wait for it
        time.sleep(0.5)
        record(*args)

    end = time.monotonic() + 30
    while (engine.running or engine.queued) and time.monotonic() < end:  # an earlier request's counting is over
        time.sleep(0.01)
    monkeypatch.setattr(engine, "_record", slow_record)
    before = {name: live.metric(name) for name in ("lily_generation_tokens_total", "lily_prompt_tokens_total")}
    requests_before = _request_count(live.port)
    status, body = _post(live.port, "/v1/chat/completions", _chat(max_tokens=3, stream=stream,
                                                                   stream_options={"include_usage": True}))
    assert status == 200
    usage = json.loads(body.split("data: ")[-2])["usage"] if stream else body["usage"]
    assert live.metric("lily_generation_tokens_total") == before["lily_generation_tokens_total"] + \
        usage["completion_tokens"]
    assert live.metric("lily_prompt_tokens_total") == before["lily_prompt_tokens_total"] + usage["prompt_tokens"]
    assert _request_count(live.port) == requests_before + 1


def _request_count(port: int) -> float:
    status, text = fetch(port, "GET", "/metrics")
    match = re.search(r'^lily_requests_total\{endpoint="/v1/chat/completions",status="200"\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0
