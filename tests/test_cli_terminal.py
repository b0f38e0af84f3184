"""The `lily` command in a terminal, driven through a pseudo-terminal (pexpect) as a user types: Ctrl-C (the terminal
sends SIGINT) stops a long prefill within one chunk, stops a chat reply and keeps the conversation, drops a message
still being read, and twice at an empty prompt leaves; a long prefill shows its progress on stderr."""
import os
import re
import subprocess
import sys
import time

import pytest

import lily

pexpect = pytest.importorskip("pexpect")
# pexpect forks the terminal's child from this multi-threaded process (the CPU backend's pool); the child only
# execs Python, so Python 3.12's warning about forking with threads does not apply.
pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of forkpty:DeprecationWarning")

CHUNK = 64
ENV = {**os.environ, "PYTHONIOENCODING": "utf-8", "PYTHONUNBUFFERED": "1", "TERM": "xterm"}
RATE = re.compile(r"([\d,]+) tok/s")


def _spawn(*args: str, timeout: float = 120):
    return pexpect.spawn(sys.executable, ["-m", "lily", *args], env=ENV, encoding="utf-8", codec_errors="replace",
                         timeout=timeout, dimensions=(40, 250))


def _finish(child, timeout: float = 60) -> int:
    child.expect(pexpect.EOF, timeout=timeout)
    child.close()
    return child.exitstatus


def _text(tiny_model, tokens: int) -> str:
    """A prompt of about `tokens` tokens of the tiny tokenizer."""
    unit = "hello world "
    per_unit = len(tiny_model.tokenizer.encode(unit * 10)) / 10
    return unit * max(1, int(tokens / per_unit))


@pytest.fixture(scope="module")
def tokens_per_second(tiny_model) -> float:
    """The tiny model's prefill speed here, in CHUNK-token steps (the tests size their prompts by it)."""
    import numpy as np

    ids = np.random.default_rng().integers(0, tiny_model.n_valid, 2 * CHUNK)
    t0 = time.perf_counter()
    tiny_model.session(prefill_chunk=CHUNK).feed(ids)
    return 2 * CHUNK / (time.perf_counter() - t0)


def test_ctrl_c_stops_a_long_prefill_within_one_chunk(tiny_model, tokens_per_second, tmp_path):
    prompt = _text(tiny_model, max(4000, 60 * tokens_per_second))  # a minute of prefill or more: past argv's 128 KiB
    (tmp_path / "prompt.txt").write_text(prompt)
    child = _spawn("generate", "--model", "tiny", "--prefill-chunk", str(CHUNK), "--prompt-file",
                   str(tmp_path / "prompt.txt"))
    child.expect(r"\] prefill [\d,]+/[\d,]+ tokens, [\d,]+ tok/s, .* left \(Ctrl-C stops\)")  # the bar, after ~2 s
    rate = float(RATE.search(child.after).group(1).replace(",", ""))
    t0 = time.perf_counter()
    child.sendintr()
    child.expect(r"lily: interrupted while reading the prompt \(([\d,]+) tokens read\)", timeout=60)
    elapsed = time.perf_counter() - t0
    read = int(child.match.group(1).replace(",", ""))
    assert _finish(child) == 130
    assert read % CHUNK == 0 and 0 < read < len(tiny_model.tokenizer.encode(prompt))
    assert elapsed < 3 * CHUNK / rate + 5.0, (elapsed, rate)  # the chunk in flight, then out (slack for load)


def test_prefill_progress_without_a_terminal(tiny_model, tokens_per_second):
    """Where stderr is not a terminal: a line every few seconds, and a last one when the prefill is done."""
    prompt = _text(tiny_model, 5 * tokens_per_second)  # about 5 s of prefill
    p = subprocess.run([sys.executable, "-m", "lily", "generate", "--model", "tiny", "--prefill-chunk", str(CHUNK),
                        "--max-tokens", "1", "--prompt", "-"], input=prompt, capture_output=True, text=True, env=ENV,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    progress = [line for line in lines if line.startswith("prefill ")]
    assert progress, p.stderr
    assert all(re.fullmatch(r"prefill [\d,]+/[\d,]+ tokens, [\d,]+ tok/s, .+ left", line) for line in progress[:-1])
    assert re.fullmatch(r"prefill ([\d,]+)/\1 tokens, [\d,]+ tok/s, done", progress[-1]), progress[-1]
    assert "\x1b" not in p.stderr and "\r" not in p.stderr  # no terminal controls in a log


def test_short_prefill_shows_no_progress():
    p = subprocess.run([sys.executable, "-m", "lily", "generate", "--model", "tiny", "--max-tokens", "1", "--prompt",
                        "hi"], capture_output=True, text=True, env=ENV, timeout=120)
    assert p.returncode == 0 and "prefill" not in p.stderr, p.stderr


def _long_reply_seed(tiny_model, message: str) -> tuple[int, str]:
    """A seed whose reply to `message` has no EOS in its first 48 tokens (the tiny model's weights are random), and
    the text the terminal shows once the reply's first three tokens (or more, to the first that adds text) are out:
    seeing it proves the reply has started and the state holds some of its tokens."""
    for seed in range(20):
        rs = list(lily.stream_generate(tiny_model, [{"role": "user", "content": message}], max_tokens=48, seed=seed))
        if rs[-1].finish_reason == "length":
            k = next(k for k in range(3, len(rs)) if rs[k - 1].text)
            return seed, "".join(r.text for r in rs[:k]).replace("\n", "\r\n")
    pytest.fail("no seed in 0..19 gives a reply of 48 tokens without EOS")


STATS = re.compile(r"\[cpu \| prompt (\d+) tokens \((\d+) cached\)")


def test_ctrl_c_in_chat_stops_the_reply_and_keeps_the_conversation(tiny_model):
    message = "Tell me a story"
    seed, start = _long_reply_seed(tiny_model, message)
    child = _spawn("chat", "--model", "tiny", "--seed", str(seed), "--max-tokens", "100000", "--stats")
    child.expect(">> ")
    child.sendline(message)
    child.expect(message + r"\r\n")  # the echo of the line typed
    # The reply has started and its first tokens are in the state. (Not just its first character: a Ctrl-C then can
    # land before the first token is fed, the host loop feeding each token as it samples the next, and the next turn
    # rightly reuses the prompt alone; under load that failed the assertion below.)
    child.expect_exact(start)
    child.sendintr()
    child.expect(r"\[interrupted: the reply so far stays in the conversation\]")
    child.expect(">> ")
    child.sendline("And then?")
    child.expect(STATS)  # the second turn's stats
    prompt2, cached2 = int(child.match.group(1)), int(child.match.group(2))
    first_prompt = len(tiny_model.encode_prompt([{"role": "user", "content": message}]))
    # The state went on from the interrupted reply: the first prompt and the reply's tokens were not read again.
    assert cached2 > first_prompt and prompt2 > cached2
    child.expect(">> ")
    child.sendline("/exit")
    assert _finish(child) == 0


def test_ctrl_c_while_chat_reads_a_message_drops_it(tiny_model, tokens_per_second, tmp_path):
    (tmp_path / "system.txt").write_text(_text(tiny_model, max(2000, 60 * tokens_per_second)))
    child = _spawn("chat", "--model", "tiny", "--prefill-chunk", str(CHUNK), "--max-tokens", "2", "--stats",
                   "--system-file", str(tmp_path / "system.txt"))
    child.expect(">> ")
    child.sendline("hi")
    child.expect(r"prefill [\d,]+/[\d,]+ tokens")
    child.sendintr()
    child.expect(r"\[interrupted: that message is dropped; the next reply reads the conversation again\]",
                 timeout=60)
    child.expect(">> ")
    child.sendeof()  # Ctrl-D leaves
    assert _finish(child) == 0


def test_ctrl_c_twice_at_an_empty_prompt_leaves():
    child = _spawn("chat", "--model", "tiny")
    child.expect(">> ")
    child.send("half a thought")
    child.expect("half a thought")  # echoed by readline: the text is in the line being edited
    child.sendintr()  # with text typed: the line is dropped, nothing else
    child.expect(">> ")
    child.sendintr()
    child.expect(r"\(to leave, press Ctrl-C again, or Ctrl-D, or type /exit\)")
    child.expect(">> ")
    child.sendintr()
    assert _finish(child, timeout=30) == 0
