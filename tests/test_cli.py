"""The `lily` command (python -m lily and the console script): generate, chat over stdin, bad model paths."""

import os
import re
import shutil
import subprocess
import sys

import pytest

import lily

STATS = re.compile(r"\[prompt (\d+) tokens \((\d+) cached\) [\d.]+ tok/s \| generated (\d+) tokens [\d.]+ tok/s \| "
                   r"finish (\w+) \| peak [\d.]+ GB\]")


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
    prompt_tokens, cached, generated, finish = stats.groups()
    assert int(prompt_tokens) == responses[-1].prompt_tokens and int(cached) == 0
    assert int(generated) == len(responses) and finish == responses[-1].finish_reason


def test_python_m_lily_generate(tiny_model):
    _check_generate(tiny_model, *_run([sys.executable, "-m", "lily", *GENERATE_ARGS]))


@pytest.mark.skipif(shutil.which("lily") is None, reason="the `lily` console script is not on PATH")
def test_console_script_generate(tiny_model):
    _check_generate(tiny_model, *_run([shutil.which("lily"), *GENERATE_ARGS]))


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
