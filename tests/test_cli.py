"""The `lily` command (python -m lily and the console script): generate, chat over stdin and its commands, the
backend line, bad model paths and the other errors a user meets first. Interactive use (Ctrl-C in a terminal) is
tests/test_cli_terminal.py."""

import io
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import lily
from lily.tiny import build_tiny, write_checkpoint

STATS = re.compile(r"\[\w+ \| prompt (\d+) tokens \((\d+) cached\) [\d.]+ tok/s \| generated (\d+) tokens [\d.]+ "
                   r"tok/s \| finish (\w+) \| peak [\d.]+ GB\]")


def _run(argv: list[str], stdin: str = "") -> tuple[int, str, str]:
    """Runs a command; returns (exit status, stdout, stderr), decoded without newline translation."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    p = subprocess.run(argv, input=stdin.encode(), capture_output=True, timeout=120, env=env)
    return p.returncode, p.stdout.decode("utf-8"), p.stderr.decode("utf-8")


GENERATE_ARGS = ["generate", "--model", "tiny", "--prompt", "hi", "--max-tokens", "8", "--seed", "0"]


def _check_generate(tiny_model, code: int, out: str, err: str) -> None:
    assert code == 0, err
    responses = list(lily.stream_generate(tiny_model, [{"role": "user", "content": "hi"}], max_tokens=8, seed=0))
    assert out == "".join(r.text for r in responses) + "\n"
    stats = STATS.search(err)
    assert stats, err
    assert err.startswith("lily: tiny on cpu (") and stats.group(0).startswith("[cpu | "), err
    prompt_tokens, cached, generated, finish = stats.groups()
    assert int(prompt_tokens) == responses[-1].prompt_tokens and int(cached) == 0
    assert int(generated) == len(responses) and finish == responses[-1].finish_reason


def test_help_says_what_each_default_is():
    code, out, _ = _run([sys.executable, "-m", "lily", "generate", "--help"])
    assert code == 0
    text = " ".join(out.split())
    assert "--seed SEED random seed (default: a fresh one for each reply" in text
    assert "--max-context N context limit of the session in tokens (default: the model's" in text
    assert "--max-tokens N most tokens to generate per reply (default: max_new_tokens" in text


def test_python_m_lily_generate(tiny_model):
    _check_generate(tiny_model, *_run([sys.executable, "-m", "lily", *GENERATE_ARGS]))


@pytest.mark.skipif(shutil.which("lily") is None, reason="the `lily` console script is not on PATH")
def test_console_script_generate(tiny_model):
    _check_generate(tiny_model, *_run([shutil.which("lily"), *GENERATE_ARGS]))


def test_prompt_and_system_from_a_file_or_stdin(tiny_model, tmp_path):
    """--prompt-file, --prompt - and --system-file give the same reply as the text on the command line; a prompt past
    the kernel's 128 KiB cap on one argument gets through a file; a missing or non-UTF-8 file is a one-line error."""
    system = "You are terse. " * 20
    inline = _run([sys.executable, "-m", "lily", *GENERATE_ARGS, "--system", system])
    assert inline[0] == 0, inline[2]
    (tmp_path / "p.txt").write_text("hi")
    (tmp_path / "s.txt").write_text(system)
    args = ["generate", "--model", "tiny", "--max-tokens", "8", "--seed", "0", "--system-file", str(tmp_path / "s.txt")]
    assert _run([sys.executable, "-m", "lily", *args, "--prompt-file", str(tmp_path / "p.txt")])[1] == inline[1]
    assert _run([sys.executable, "-m", "lily", *args, "--prompt", "-"], stdin="hi")[1] == inline[1]
    # 270 KB, past argv's cap: the whole file arrives (one token a character in the tiny tokenizer), which the context
    # check reports at once instead of a minute of prefill
    (tmp_path / "big.txt").write_text("x" * 270_000)
    code, out, err = _run([sys.executable, "-m", "lily", "generate", "--model", "tiny", "--max-tokens", "1", "--raw",
                           "--prompt-file", str(tmp_path / "big.txt")])
    assert code == 2 and "prompt of 270000 tokens exceeds the context limit" in err, err
    code, _, err = _run([sys.executable, "-m", "lily", "generate", "--prompt-file", str(tmp_path / "nope.txt")])
    assert code == 2 and f"--prompt-file {tmp_path / 'nope.txt'}: No such file or directory" in err, err
    (tmp_path / "bin.txt").write_bytes(b"ok \xff\xfe")
    code, _, err = _run([sys.executable, "-m", "lily", "chat", "--system-file", str(tmp_path / "bin.txt")])
    assert code == 2 and f"--system-file {tmp_path / 'bin.txt'}: not UTF-8 text (invalid start byte at byte 3)" in err
    code, _, err = _run([sys.executable, "-m", "lily", "generate", "--prompt", "a", "--prompt-file", "b"])
    assert code == 2 and "not allowed with argument" in err


def test_chat_over_stdin_reuses_the_first_turn():
    code, out, err = _run([sys.executable, "-m", "lily", "chat", "--model", "tiny", "--max-tokens", "6", "--seed", "1",
                           "--stats"], stdin="Hello there\nAnd what next?\n")
    assert code == 0, err
    assert out.count(">> ") == 3  # two turns, then the prompt that meets EOF
    turns = STATS.findall(err)
    assert len(turns) == 2, err
    (prompt1, cached1, generated1, _), (prompt2, cached2, _, _) = turns
    assert int(cached1) == 0
    # The second prompt is the first conversation plus one more message: its start is already in the session.
    assert int(prompt2) > int(prompt1) + int(generated1)
    assert int(cached2) > 0, f"second turn reused nothing: {err}"


def test_bad_model_path_exits_2(tmp_path):
    missing = tmp_path / "no-such-model"
    code, out, err = _run([sys.executable, "-m", "lily", "generate", "--model", str(missing), "--prompt", "hi"])
    assert code == 2
    assert str(missing) in err and "lily: error" in err
    assert out == ""


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "hi", "--temperature", "-1"], "--temperature must be"),
    (["generate", "--prompt", "hi", "--max-tokens", "0"], "--max-tokens must be"),
    (["generate", "--prompt", "hi", "--max-context", "-1"], "--max-context must be at least 1"),
    (["chat", "--top-p", "2"], "--top-p must be"),
    (["generate", "--prompt", "hi", "--raw", "--system", "s"], "--raw feeds the prompt as is"),
])
def test_bad_flags_are_refused_before_the_model_loads(tmp_path, argv, message):
    """The model named does not exist: the flag is what the error is about, so it was checked first."""
    code, out, err = _run([sys.executable, "-m", "lily", *argv, "--model", str(tmp_path / "absent")], stdin="hi\n")
    assert code == 2 and message in err and "absent" not in err and "SamplingParams" not in err, err


@pytest.mark.parametrize("flag, value", [("--port", "99999"), ("--port", "-5"), ("--cache-gb", "-1"),
                                         ("--cache-dir-gb", "inf")])
def test_serve_refuses_a_bad_port_or_budget_before_loading(flag, value):
    code, out, err = _run([sys.executable, "-m", "lily", "serve", "--model", "tiny", flag, value])
    assert code == 2 and f"argument {flag}" in err and "Traceback" not in err, err


def test_chat_goes_on_when_a_message_outgrows_the_context():
    code, out, err = _run([sys.executable, "-m", "lily", "chat", "--model", "tiny", "--max-context", "60",
                           "--max-tokens", "5", "--seed", "1"],
                          stdin="hello\nsecond message here\nthird message is here\n/reset\nagain\n")
    assert code == 0, err
    assert "exceeds the context limit" in err and "/reset starts a new conversation" in err
    assert out.count(">> ") == 6  # every line read, then the prompt that meets EOF


def _chat(stdin: str, *flags: str) -> tuple[int, str, str]:
    return _run([sys.executable, "-m", "lily", "chat", "--model", "tiny", "--max-tokens", "3", "--seed", "1", "--stats",
                 *flags], stdin=stdin)


def test_chat_commands():
    code, out, err = _chat("/help\n/frobnicate now\n//slash\n/reset\nhello\n/quit\nnever sent\n")
    assert code == 0, err
    assert "/reset" in err and "/exit, /quit" in err and "Ctrl-C" in err  # /help lists the commands
    assert "unknown command '/frobnicate': /help lists the commands" in err
    assert "[conversation cleared]" in err
    turns = STATS.findall(err)
    assert len(turns) == 2, err  # "//slash" and "hello": the commands and the line after /quit are not sent
    assert int(turns[1][1]) == 0  # /reset emptied the session: the second turn reuses nothing
    assert out.count(">> ") == 6  # one prompt per line read, up to /quit


@pytest.mark.parametrize("leave", ["/exit", "/quit", "exit", "quit", ""])
def test_chat_leaves(leave):
    code, out, err = _chat(f"{leave}\nnever sent\n" if leave else "")  # "": end of input (Ctrl-D)
    assert code == 0, err
    assert not STATS.findall(err) and out.count(">> ") == 1


def test_slash_message_is_sent_without_the_escape(tiny_model):
    code, out, _ = _run([sys.executable, "-m", "lily", "chat", "--model", "tiny", "--max-tokens", "5", "--seed", "3"],
                        stdin="//etc/hosts\n")
    reply = "".join(r.text for r in lily.stream_generate(tiny_model, [{"role": "user", "content": "/etc/hosts"}],
                                                          max_tokens=5, seed=3))
    assert code == 0 and out == f">> {reply}\n>> \n"


def test_ctrl_c_as_the_first_text_is_shown_stops_the_reply_not_the_prefill(tiny_model, monkeypatch):
    """Python raises a Ctrl-C that comes while the reply's first text is written when print returns: the text is on
    the screen, so the reply was interrupted (not the prefill, which would drop a message the user saw answered)."""
    from types import SimpleNamespace

    from lily import cli

    class Terminal(io.StringIO):
        interrupted = False

        def flush(self):
            if self.getvalue() and not self.interrupted:
                self.interrupted = True
                raise KeyboardInterrupt

    monkeypatch.setattr(sys, "stdout", Terminal())
    args = SimpleNamespace(**{name: None for name, _ in cli.SAMPLING_FLAGS}, max_tokens=8, stop=None, no_thinking=False)
    args.seed = 0
    text, where = cli._run(tiny_model, tiny_model.session(), [{"role": "user", "content": "hi"}], args, stats=False)
    shown = sys.stdout.getvalue()
    assert where == "reply" and text and shown == text + "\n"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_checkpoint(build_tiny(), tmp_path_factory.mktemp("tiny-ckpt"))


def _copy(src, dst, edit=None):
    shutil.copytree(src, dst)
    if edit:
        edit(dst)
    return dst


def test_checkpoint_without_chat_template_points_to_raw(tiny_dir, tmp_path):
    bare = _copy(tiny_dir, tmp_path / "bare", lambda d: (d / "chat_template.jinja").unlink())
    code, out, err = _run([sys.executable, "-m", "lily", "generate", "--model", str(bare), "--prompt", "hi"])
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == (f"lily: error: {bare}: the checkpoint has no chat template (no chat_template.jinja, "
                                    "no chat_template in tokenizer_config.json): use --raw to feed the prompt as is")
    code, _, err = _run([sys.executable, "-m", "lily", "chat", "--model", str(bare)], stdin="hi\n")
    assert code == 2 and "lily chat needs one; `lily generate --raw` runs a prompt as is" in err
    code, out, err = _run([sys.executable, "-m", "lily", "generate", "--model", str(bare), "--prompt", "hi", "--raw",
                           "--max-tokens", "2"])
    assert code == 0 and "generated 2 tokens" in err, err
    model = lily.load(bare)  # the Python API says the same, without a command line to point to
    with pytest.raises(ValueError, match=r"no chat template .* give the prompt as text or token ids instead \(on the "
                                         r"command line: lily generate --raw\)"):
        lily.generate(model, [{"role": "user", "content": "hi"}], max_tokens=2)


def test_max_tokens_default_is_the_checkpoints_max_new_tokens_else_256(tiny_dir, tmp_path):
    code, out, _ = _run([sys.executable, "-m", "lily", "generate", "--help"])
    assert code == 0 and ("--max-tokens N most tokens to generate per reply (default: max_new_tokens of the model's "
                          "generation_config.json, else 256)") in " ".join(out.split()), out

    def cap(d):
        gen = json.loads((d / "generation_config.json").read_text())
        (d / "generation_config.json").write_text(json.dumps({**gen, "max_new_tokens": 3}))

    capped = _copy(tiny_dir, tmp_path / "capped", cap)
    model = lily.load(capped)
    model.eos_token_ids = []  # the count must not depend on an early EOS
    assert len(list(lily.stream_generate(model, "hi"))) == 3
    assert len(list(lily.stream_generate(model, "hi", max_tokens=5))) == 5
    uncapped = lily.load(tiny_dir)
    uncapped.eos_token_ids = []
    assert lily.SamplingParams.from_generation_config(uncapped.generation_config).max_tokens == 256
    for extra, count in (([], 3), (["--max-tokens", "4"], 4)):
        code, _, err = _run([sys.executable, "-m", "lily", "generate", "--model", str(capped), "--prompt", "hi",
                             "--temperature", "0", *extra])
        stats = STATS.search(err)
        assert code == 0 and stats and (int(stats.group(3)) == count or stats.group(4) == "stop"), err


def test_bad_max_new_tokens_names_the_field(tiny_dir, tmp_path):
    def bad(d):
        (d / "generation_config.json").write_text(json.dumps({"max_new_tokens": 0}))

    broken = _copy(tiny_dir, tmp_path / "broken", bad)
    with pytest.raises(lily.CheckpointError, match=r"generation_config.json: max_new_tokens must be an integer in "
                                                   r"\[1, 2147483647\], got 0"):
        lily.load(broken)


@pytest.mark.parametrize("how", ["offline", "unreachable"])
def test_hub_id_that_cannot_be_fetched_fails_in_one_line(tmp_path, how):
    cache = tmp_path / "hf-cache"
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.update({"HF_HUB_OFFLINE": "1"} if how == "offline" else {"HF_ENDPOINT": "http://127.0.0.1:9"})
    p = subprocess.run([sys.executable, "-m", "lily", "generate", "--model", "someorg/no-such-model", "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.splitlines()) == 1, p.stderr
    line = p.stderr.strip()
    assert line.startswith("lily: error: someorg/no-such-model: it is not in the Hugging Face cache (" + str(cache))
    assert ("HF_HUB_OFFLINE is set" if how == "offline" else "the hub could not be reached (") in line
    assert "to run a model from a local directory, pass its path instead" in line
    # The Python API raises the same one line, with no chained traceback.
    code = ("import lily\ntry:\n    lily.load('someorg/no-such-model')\nexcept FileNotFoundError as e:\n"
            "    print(e.__cause__, e.__suppress_context__, e)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **env})
    assert p.stdout.strip() == "None True " + line[len("lily: error: "):], p.stderr


def test_forcing_an_unusable_backend_says_why():
    for info in lily.backends():
        if info.usable:
            continue
        code, out, err = _run([sys.executable, "-m", "lily", "generate", "--backend", info.name, "--prompt", "hi"])
        assert code == 2 and out == ""
        assert err.strip() == f"lily: error: backend '{info.name}' cannot run here: {info.reason}"
    code, _, err = _run([sys.executable, "-m", "lily", "generate", "--backend", "gpu", "--prompt", "hi"])
    assert code == 2 and err.strip().startswith("lily: error: unknown backend 'gpu' (Lily has auto, cuda, metal, cpu")
