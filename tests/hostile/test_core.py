"""What Lily's core and Python API guarantee against hostile use: threads, files that change under a loaded model,
malformed checkpoints and snapshots, wrong token ids (issue 9). Read the test names as the list of guarantees:

- A session is one conversation, never shared: a call made while another thread is inside it raises
  SessionConflictError, and a generation whose session was changed between its steps raises it at its next
  step. Nothing is corrupted and nothing is silently wrong: every generation that finishes is the right one.
- The model owns what it reads: clearing or dropping the checkpoint's dict frees nothing the core uses.
- A weights file overwritten in place under a loaded model is refused before each generation (Python API, CLI,
  server: 503) naming the file; where a SIGBUS still happens, one line naming the mapped file is printed.
- Cached state is identified by the weights' content (Model.fingerprint), not file times: weights swapped for
  others of the same size with their mtime kept never restore the old model's state; a Snapshot carries the
  fingerprint and restore refuses another model's, or a token list that is not the snapshot's.
- Token ids are integers: floats, strings, bools and 2-D input are refused, naming the problem.
- Every malformed checkpoint file, absurd size or non-regular file is a CheckpointError naming the file and the
  field (and the limit), before anything is sized from it and without blocking.
- Fuzzing: the safetensors parser and Snapshot.from_bytes raise only their documented error on any input.
  LILY_FUZZ_SECONDS (default 3) sets the time per target.

Crashes are tested in subprocesses, so that a regression fails the test instead of killing pytest.
"""

import asyncio
import json
import math
import os
import secrets
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lily
from lily import _core
from lily.prefix_cache import PrefixCache, model_fingerprint
from lily.safetensors_io import (DTYPES, CheckpointChangedError, CheckpointError, parse_safetensors,
                                 read_safetensors, write_safetensors)
from lily.tiny import build_tiny, write_checkpoint
from lily.tiny_tokenizer import tiny_vocab_size

SHARD = "model.safetensors"
FUZZ_SECONDS = float(os.environ.get("LILY_FUZZ_SECONDS", "3"))


# -- shared helpers -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_dir(tmp_path_factory) -> Path:
    return write_checkpoint(build_tiny(seed=secrets.randbits(32)), tmp_path_factory.mktemp("good") / "model")


@pytest.fixture
def model_dir(good_dir, tmp_path) -> Path:
    """A copy of the good checkpoint, for the test to change."""
    return Path(shutil.copytree(good_dir, tmp_path / "model"))


@pytest.fixture(scope="module")
def endless_model() -> lily.Model:
    """The tiny model without end-of-sequence ids: a generation stops only at max_tokens, so a test can count on
    its next step (the random weights may pick an EOS id first)."""
    model = lily.load("tiny")
    model.eos_token_ids = []
    return model


@pytest.fixture
def prompt() -> list[int]:
    return np.random.default_rng(secrets.randbits(64)).integers(0, tiny_vocab_size(), 6).tolist()


def _greedy(model, prompt, **kwargs) -> str:
    return lily.generate(model, prompt, max_tokens=6, temperature=0.0, **kwargs)


def _run_python(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (a crash there fails the test, not pytest)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


def _overwrite_in_place(shard: Path, data: bytes) -> None:
    """Writes `data` over `shard` through the same inode and puts its times back, as `cp -p` or `rsync -a
    --inplace` do."""
    st_ = shard.stat()
    with open(shard, "r+b") as f:
        f.write(data)
        f.truncate(len(data))
    os.utime(shard, ns=(st_.st_atime_ns, st_.st_mtime_ns))


def _other_weights(tmp_path: Path) -> bytes:
    """A shard of other random weights with the same tensors, shapes and size as the good checkpoint's."""
    return (write_checkpoint(build_tiny(seed=secrets.randbits(32)), tmp_path / "other") / SHARD).read_bytes()


# -- sessions and threads -----------------------------------------------------------------------------------

def test_threads_sharing_a_session_are_refused_and_never_corrupt_it():
    """Four threads generating on one session (the heap corruption of issue 9), and four prefilling one core
    session: each call either gives the right answer or raises SessionConflictError; the process survives and the
    session's tokens agree with its state. Four threads with sessions of their own on the same model all succeed
    (calls on one model's backend run one at a time)."""
    result = _run_python("""
        import json, threading
        import numpy as np
        import lily

        model = lily.load("tiny")
        prompts = [[10 + i, 40 + i, 70 + i, 100 + i] for i in range(4)]
        want = [lily.generate(model, p, max_tokens=12, temperature=0.0) for p in prompts]
        session = model.session()
        outcomes, barrier = [], threading.Barrier(4)

        def generate(i):
            barrier.wait()
            for _ in range(6):
                try:
                    outcomes.append(session.generate(prompts[i], max_tokens=12, temperature=0.0) == want[i])
                except lily.SessionConflictError:
                    outcomes.append("conflict")

        core, fed = model.core.session(max_context=4096), []

        def prefill(i):
            barrier.wait()
            for _ in range(25):
                try:
                    core.prefill(np.arange(i, i + 4, dtype=np.int32))
                    fed.append(4)
                except lily.SessionConflictError:
                    pass

        own = []

        def own_session(i):  # sessions of their own on one model: they may run at once, and all are right
            barrier.wait()
            s = model.session()
            for _ in range(3):
                own.append(s.generate(prompts[i], max_tokens=12, temperature=0.0) == want[i])
                s.reset()

        for target in (generate, prefill, own_session):
            threads = [threading.Thread(target=target, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        consistent = session.core.position == len(session.tokens)
        after = session.generate(prompts[0], max_tokens=12, temperature=0.0) == want[0]
        print(json.dumps({"outcomes": outcomes, "own": own, "consistent": consistent, "after": after,
                          "core_position": core.position, "fed": sum(fed)}))
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert False not in report["outcomes"], report  # every generation that finished is the right one
    assert report["own"] == [True] * 12, report
    assert report["consistent"] and report["after"], report
    assert report["core_position"] == report["fed"], report  # no prefill lost or half-applied


def test_interleaved_generations_on_one_session_end_the_older_one(endless_model, prompt):
    session = endless_model.session()
    older = session.stream_generate(prompt, max_tokens=6, temperature=0.0)
    next(older)
    other = prompt[::-1] + [1]
    newer = session.stream_generate(other, max_tokens=6, temperature=0.0)
    first = next(newer)
    with pytest.raises(lily.SessionConflictError, match="session was changed since this generation's last step"):
        next(older)
    assert first.text + "".join(r.text for r in newer) == _greedy(endless_model, other)
    assert session.core.position == len(session.tokens)


@pytest.mark.parametrize("change", ["prefill", "reset", "restore", "core prefill", "another generator"])
def test_any_change_between_steps_ends_a_generation(endless_model, prompt, change):
    session = endless_model.session()
    session.prefill(prompt[:2])
    snap = session.snapshot()
    stream = session.stream_generate(prompt, max_tokens=8, temperature=0.0)
    next(stream)
    if change == "prefill":
        session.prefill([5])
    elif change == "reset":
        session.reset()
    elif change == "restore":
        session.restore(snap)
    elif change == "core prefill":
        session.core.prefill(np.array([5], np.int32))
    else:
        other = _core.Generator(session.core, lily.SamplingParams().to_core(), [], 4, endless_model.n_valid)
        other.prefill(np.array([7], np.int32))
    with pytest.raises(lily.SessionConflictError):
        next(stream)
    # The session is usable, and a new generation on it is right.
    session.reset()
    assert _greedy(endless_model, prompt, session=session) == _greedy(endless_model, prompt)


def test_a_generator_runs_one_prompt(tiny_model, prompt):
    s = tiny_model.core.session(max_context=64)
    gen = _core.Generator(s, lily.SamplingParams(temperature=0.0).to_core(), [], 4, tiny_model.n_valid)
    gen.prefill(np.array(prompt, np.int32))
    with pytest.raises(ValueError, match="already called"):
        gen.prefill(np.array(prompt, np.int32))


# -- the model owns what it reads ----------------------------------------------------------------------------

def test_the_model_keeps_its_arrays_alive(good_dir):
    """`ck.tensors.clear()` after lily.Model(ck) segfaulted (mapped checkpoint) or gave NaN logits (in memory)."""
    result = _run_python(f"""
        import gc
        import numpy as np
        import lily
        from lily.loader import load_checkpoint
        from lily.tiny import build_tiny

        for make in (lambda: load_checkpoint({str(good_dir)!r}), lambda: build_tiny(seed=5)):
            ck = make()
            m = lily.Model(ck)
            want = m.logits([1, 2, 3])
            ck.tensors.clear()
            del ck
            gc.collect()
            junk = [np.full(1 << 16, np.nan, np.float32) for _ in range(256)]  # reuse freed memory
            got = m.logits([1, 2, 3])
            assert np.isfinite(got).all() and np.array_equal(got, want), "logits changed"
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


# -- weights files changed under a loaded model ------------------------------------------------------------

def test_a_weights_file_overwritten_in_place_is_refused(good_dir, model_dir, prompt, tmp_path):
    model = lily.load(model_dir)
    assert [str(f.path) for f in model.mapped_files] == [str(model_dir / SHARD)] and model.core.reads_host_weights
    before = _greedy(model, prompt)
    session = model.session()
    _overwrite_in_place(model_dir / SHARD, _other_weights(tmp_path))  # same size, mtime kept (cp -p)
    for call in (lambda: _greedy(model, prompt), lambda: model.logits([1, 2]), lambda: session.prefill([1, 2])):
        with pytest.raises(CheckpointChangedError) as info:
            call()
        assert f"{model_dir / SHARD}: the weights file changed on disk while the model was reading it in place " \
               "(its status changed: written in place with its modification time put back" in str(info.value)
    with open(model_dir / SHARD, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(CheckpointChangedError, match="its size changed from .* to 1000 bytes"):
        model.check_files()
    assert session.tokens == [] and session.core.position == 0
    assert _greedy(lily.load(good_dir), prompt) == before  # the process goes on: the good copy loads and runs


def test_a_weights_file_replaced_by_rename_is_no_change(model_dir, prompt, tmp_path):
    """The advised way to replace weights: the loaded model keeps reading the file it mapped."""
    model = lily.load(model_dir)
    before = _greedy(model, prompt)
    fresh = model_dir / "model.safetensors.new"
    fresh.write_bytes(_other_weights(tmp_path))
    os.replace(fresh, model_dir / SHARD)
    model.check_files()
    assert _greedy(model, prompt) == before
    assert lily.load(model_dir).fingerprint != model.fingerprint


def test_the_cli_refuses_a_changed_weights_file(model_dir, tmp_path, monkeypatch, capsys):
    from lily import cli

    lines = iter(["hello", "again"])

    def fake_input(_prompt):
        line = next(lines)
        if line == "again":
            _overwrite_in_place(model_dir / SHARD, _other_weights(tmp_path))
        return line

    monkeypatch.setattr("builtins.input", fake_input)
    assert cli.main(["chat", "--model", str(model_dir), "--max-tokens", "3"]) == 2
    err = capsys.readouterr().err
    assert f"lily: error: {model_dir / SHARD}: the weights file changed on disk" in err


def test_the_server_refuses_requests_after_a_weights_file_changed(model_dir, tmp_path):
    from lily.server import Engine, Job, Prompt, Sampling

    engine = Engine(lily.load(model_dir), max_context=64)
    engine.start()

    async def ask():
        job = Job(lambda m: Prompt([1, 2, 3], ""), Sampling({"temperature": 0.0}, 3), "prompt")
        engine.submit(job)
        while True:
            kind, value = await job.next()
            if kind in ("done", "error"):
                return kind, value

    try:
        assert asyncio.run(ask())[0] == "done"
        _overwrite_in_place(model_dir / SHARD, _other_weights(tmp_path))
        for _ in range(2):  # every request, and the engine keeps answering
            kind, error = asyncio.run(ask())
            assert kind == "error" and error.status == 503, (kind, error)
            assert f"{model_dir / SHARD}: the weights file changed on disk" in error.message
    finally:
        engine.close()


def test_a_sigbus_prints_one_line_naming_the_mapped_file(model_dir):
    """Truncated under a model that reads it in place, past the checks (the core called directly)."""
    shard = model_dir / SHARD
    result = _run_python(f"""
        import numpy as np
        import lily

        model = lily.load({str(model_dir)!r})
        with open({str(shard)!r}, "r+b") as f:
            f.truncate(4096)
        model.core.session(max_context=16).prefill(np.array([1, 2, 3], np.int32))
        print("not reached")
    """)
    assert result.returncode == -signal.SIGBUS, (result.returncode, result.stderr[-2000:])
    fatal = [line for line in result.stderr.splitlines() if line.startswith("lily: fatal:")]
    assert fatal == [f"lily: fatal: SIGBUS reading the memory-mapped weights file {shard}: it was truncated or "
                     "overwritten in place while the model was loaded (replace a weights file by writing a new file "
                     "and renaming it over the old one)"], result.stderr[-2000:]


# -- fingerprints, snapshots and restore ---------------------------------------------------------------------

def test_swapped_weights_with_the_same_size_and_mtime_never_restore_old_state(model_dir, tmp_path, prompt):
    old = lily.load(model_dir)
    cache_dir = tmp_path / "cache"
    cache = PrefixCache(1 << 30, fingerprint=model_fingerprint(old), cache_dir=cache_dir)
    session = old.session()
    session.prefill(prompt)
    snapshot = session.snapshot()
    cache.insert(snapshot)
    cache.close()

    _overwrite_in_place(model_dir / SHARD, _other_weights(tmp_path))  # same size, mtime kept
    new = lily.load(model_dir)
    assert new.fingerprint != old.fingerprint and model_fingerprint(new) != model_fingerprint(old)
    same = PrefixCache(1 << 30, fingerprint=model_fingerprint(old), cache_dir=cache_dir)
    assert same.lookup(prompt + [1]) is not None  # the file is there: only the fingerprint tells the models apart
    same.close()
    swapped = PrefixCache(1 << 30, fingerprint=model_fingerprint(new), cache_dir=cache_dir)
    assert swapped.lookup(prompt + [1]) is None
    swapped.close()
    with pytest.raises(ValueError, match="snapshot was made by another model"):
        new.session().restore(snapshot)


def test_the_fingerprint_does_not_depend_on_where_or_when_the_file_was_written(good_dir, tmp_path):
    copy = Path(shutil.copytree(good_dir, tmp_path / "copy"))
    os.utime(copy / SHARD, ns=(1, 1))
    assert lily.load(copy).fingerprint == lily.load(good_dir).fingerprint
    assert lily.Model(build_tiny(seed=1)).fingerprint != lily.Model(build_tiny(seed=2)).fingerprint


def test_restore_refuses_a_snapshot_of_another_model_of_the_same_shape(tiny_model, prompt):
    other = lily.Model(build_tiny(seed=99))
    s = other.session()
    s.prefill(prompt)
    target = tiny_model.session()
    target.prefill(prompt[:3])
    with pytest.raises(ValueError, match="snapshot was made by another model"):
        target.restore(s.snapshot())
    with pytest.raises(ValueError, match="snapshot was made by another model"):
        target.core.restore(_core.Snapshot.from_bytes(s.core.snapshot().to_bytes()))
    assert target.core.position == 3 and target.tokens == prompt[:3]  # unchanged


@pytest.mark.parametrize("edit", ["position", "token"])
def test_a_snapshot_carries_its_tokens_and_bad_ones_are_refused(tiny_model, prompt, edit):
    """The tokens a state holds travel with it (a restore cannot be given other ones, as it once could: a list that
    did not match the snapshot's position was taken); bytes whose position disagrees with their tokens, or whose
    tokens are outside the vocabulary, are refused and the session is unchanged."""
    s = tiny_model.session()
    s.prefill(prompt)
    snap = s.snapshot()
    assert snap.tokens == prompt and snap.position == len(prompt)
    data = bytearray(snap.to_bytes())
    (fp_len,) = struct.unpack_from("<I", data, 12)
    at = 16 + fp_len  # the position, then the tokens
    if edit == "position":
        struct.pack_into("<i", data, at, len(prompt) - 1)
        with pytest.raises(ValueError, match="snapshot data is corrupt"):
            _core.Snapshot.from_bytes(bytes(data))
    else:
        struct.pack_into("<i", data, at + 4, tiny_model.vocab_size)
        bad = _core.Snapshot.from_bytes(bytes(data))
        s.prefill([3])
        with pytest.raises(ValueError, match=f"token id {tiny_model.vocab_size} at index 0 is outside the vocabulary"):
            s.restore(bad)
        assert s.core.position == len(prompt) + 1 and s.tokens == prompt + [3]  # unchanged


def test_snapshot_bytes_carry_the_fingerprint_and_old_versions_are_refused(tiny_model, prompt):
    s = tiny_model.core.session(max_context=64)
    s.prefill(np.array(prompt, np.int32))
    data = s.snapshot().to_bytes()
    back = _core.Snapshot.from_bytes(data)
    assert back.fingerprint == tiny_model.fingerprint and back.position == len(prompt)
    (fp_len,) = struct.unpack_from("<I", data, 12)
    version1 = data[:8] + struct.pack("<I", 1) + data[16 + fp_len:]  # the layout before the fingerprint
    with pytest.raises(ValueError, match="version 1 is no longer supported"):
        _core.Snapshot.from_bytes(version1)
    version2 = data[:8] + struct.pack("<I", 2) + data[12:]  # before the tokens
    with pytest.raises(ValueError, match="version 2 is no longer supported"):
        _core.Snapshot.from_bytes(version2)


# -- session sizes ------------------------------------------------------------------------------------------------

BAD_SIZES = [
    ("max_context", -1, "max_context must be None or an integer in [1, 262144], got -1"),
    ("max_context", 2**31, "max_context must be None or an integer in [1, 262144], got 2147483648"),
    ("max_context", 2**64, "max_context must be None or an integer in [1, 262144], got 18446744073709551616"),
    ("max_context", 1.5, "max_context must be None or an integer in [1, 262144], got float 1.5"),
    ("max_context", True, "max_context must be None or an integer in [1, 262144], got bool True"),
    ("prefill_chunk", -1, "prefill_chunk must be None or an integer in [1, 2147483647], got -1"),
    ("prefill_chunk", 2**31, "prefill_chunk must be None or an integer in [1, 2147483647], got 2147483648"),
    ("prefill_chunk", "64", "prefill_chunk must be None or an integer in [1, 2147483647], got str '64'"),
]


@pytest.mark.parametrize("name, value, message", BAD_SIZES, ids=[f"{n}={v!r}" for n, v, _ in BAD_SIZES])
def test_session_sizes_out_of_range_are_value_errors_naming_the_argument(tiny_model, name, value, message):
    """A negative max_context was silently the model's full context, and 2**31 or a float was nanobind's
    'incompatible function arguments' with the core's signature (the CLI's --max-context, the server's too)."""
    with pytest.raises(ValueError) as info:
        tiny_model.session(**{name: value})
    assert str(info.value) == f"Model.session: {message}"
    if name == "prefill_chunk":
        with pytest.raises(ValueError, match=f"Model.logits: {name} must be"):
            tiny_model.logits([1, 2], prefill_chunk=value)
    for good in (None, 0, 1, 64, np.int64(64)):  # 0 (as None) is the default
        tiny_model.session(**{name: good})


# -- stop strings -------------------------------------------------------------------------------------------------

def test_a_stop_list_past_the_limit_is_a_value_error_naming_the_limit(endless_model):
    """Every stop string is searched for at every token: 2.6 million of them (a 16 MB request body) cost 0.3 s a
    token, holding the server's worker for hours on a long reply. The count is bounded, the strings' lengths are
    not (a long stop string costs nothing per token)."""
    from lily.sampling import MAX_STOPS

    assert MAX_STOPS >= 16
    for stops in (["zq"] * (MAX_STOPS + 1), [f"s{i}" for i in range(300_000)]):
        with pytest.raises(ValueError, match=rf"^SamplingParams.stop must be a list of at most {MAX_STOPS} non-empty "
                                             rf"strings, got a list of {len(stops)} strings$"):
            lily.SamplingParams(stop=stops)
        with pytest.raises(ValueError, match="SamplingParams.stop"):
            lily.generate(endless_model, "hi", max_tokens=2, stop=stops)
    stops = [f"never-{i}" for i in range(MAX_STOPS - 1)] + ["x" * 100_000]
    assert lily.generate(endless_model, [1, 2, 3], max_tokens=6, temperature=0.0, stop=stops) == \
        _greedy(endless_model, [1, 2, 3])


# -- long texts ---------------------------------------------------------------------------------------------------

def test_tokenising_a_long_text_lets_other_threads_run(tiny_model):
    """Tokenizer.encode of a long text held the GIL throughout (tokenizers' encode does not release it): a prompt of
    a few MB froze every other thread of the process, the server's event loop included (/health took 6 s)."""
    rng = np.random.default_rng(1)
    text = "".join(rng.choice(list("!#$%&()*+,-./:;<=>?@[]^_{|}~ ab"), 1_000_000))
    ticks, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        time.sleep(0.05)
        before = ticks[0]
        t0 = time.perf_counter()
        ids = tiny_model.tokenizer.encode(text)
        took, during = time.perf_counter() - t0, ticks[0] - before
    finally:
        stop.set()
        thread.join()
    assert ids == tiny_model.tokenizer._tok.encode(text, add_special_tokens=False).ids
    assert during >= min(20, took * 100), (during, took)  # with the GIL held: 0-2 ticks
    with pytest.raises(ValueError, match="lone UTF-16 surrogate"):
        tiny_model.tokenizer.encode(text + "\ud800")


# -- token ids -------------------------------------------------------------------------------------------------

BAD_TOKENS = [
    ([1, 1.9], "token ids[1] must be an integer, got float 1.9"),
    ([1, "12"], "token ids[1] must be an integer, got str '12'"),
    ([True, 2], "token ids[0] must be an integer, got bool True"),
    ([[1, 2], [3, 4]], "token ids[0] must be an integer, got list"),
    (np.array([[1, 2], [3, 4]]), "token ids must be one-dimensional, got shape (2, 2)"),
    (np.array([1.0, 2.0]), "token ids must be integers, got an array of float64"),
    (np.array([True]), "token ids must be integers, got an array of bool"),
    ("12", "token ids must be a sequence of integers, got a str"),
    (12, "token ids must be a sequence of integers, got int"),
    ([1, -1], "token ids[1] = -1 is outside [0, 2**31)"),
    ([1, 2**40], "token ids[1] = 1099511627776 is outside [0, 2**31)"),
    ([1, 2**70], "token ids[1] = 1180591620717411303424 is outside [0, 2**31)"),
    (np.array([3, 2**33]), "token ids[1] = 8589934592 is outside [0, 2**31)"),
]


@pytest.mark.parametrize("ids, message", BAD_TOKENS, ids=[repr(m) for _, m in BAD_TOKENS])
def test_token_ids_must_be_integers(tiny_model, ids, message):
    session = tiny_model.session()
    for call in (session.prefill, tiny_model.logits):
        with pytest.raises(ValueError) as info:
            call(ids)
        assert message in str(info.value)
    if not isinstance(ids, str):  # a string prompt is text
        with pytest.raises(ValueError, match="prompt token ids"):
            _greedy(tiny_model, ids)
    assert session.core.position == 0 and session.tokens == []


@pytest.mark.parametrize("ids", [np.array([4, 5, 6], np.int64), np.array([4, 5, 6], np.uint16), (4, 5, 6),
                                 [np.int64(4), np.int32(5), 6], range(4, 7)])
def test_integer_sequences_and_arrays_are_accepted(tiny_model, ids):
    np.testing.assert_array_equal(tiny_model.logits(ids), tiny_model.logits([4, 5, 6]))


# -- malformed checkpoints: one table ------------------------------------------------------------------------

def _config(d: Path, edit) -> None:
    path = d / "config.json"
    config = json.loads(path.read_text())
    edit(config["text_config"])
    path.write_text(json.dumps(config))


def _layers(d: Path, n: int) -> None:
    _config(d, lambda c: (c.pop("layer_types"), c.update(num_hidden_layers=n)))


def _config_text(d: Path, key: str, literal: str) -> None:
    """Sets text_config.key to a raw JSON literal (Infinity, NaN, 1e400, a 5000-digit integer, nesting)."""
    path = d / "config.json"
    config = json.loads(path.read_text())
    config["text_config"][key] = "@@"
    path.write_text(json.dumps(config).replace('"@@"', literal))


def _header(d: Path, edit=None, raw: bytes | None = None) -> None:
    """Rewrites the shard's header: `edit(header dict)` or raw header bytes; the data is kept."""
    path = d / SHARD
    data = path.read_bytes()
    (n,) = struct.unpack_from("<Q", data)
    if raw is None:
        header = json.loads(data[8:8 + n])
        edit(header)
        raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _first_tensor(header: dict) -> dict:
    return next(v for k, v in sorted(header.items()) if k != "__metadata__")


def _index(d: Path, text: str | None = None, shard: str | None = None) -> None:
    """Adds model.safetensors.index.json: raw text, or a weight map pointing every tensor at `shard`."""
    if text is None:
        text = json.dumps({"weight_map": {k: shard for k in read_safetensors(d / SHARD)}})
    (d / "model.safetensors.index.json").write_text(text)


def _replace(path: Path, kind: str) -> None:
    path.unlink()
    os.mkdir(path) if kind == "directory" else os.mkfifo(path)


def _generation(d: Path, text: str) -> None:
    (d / "generation_config.json").write_text(text)


DEEP = "[" * 100_000
DIGITS = "9" * 5000
LOADER_CASES = [
    # JSON files: nesting and integer digits (RecursionError / ValueError without a file name before)
    ("config nested", lambda d: (d / "config.json").write_text(DEEP), "config.json: not valid JSON (nested too deeply)"),
    ("config digits", lambda d: _config_text(d, "vocab_size", DIGITS), "config.json: not valid JSON (Exceeds the limit"),
    ("index nested", lambda d: _index(d, DEEP), "model.safetensors.index.json: not valid JSON (nested too deeply)"),
    ("index digits", lambda d: _index(d, '{"weight_map": {"a": ' + DIGITS + "}}"),
     "model.safetensors.index.json: not valid JSON (Exceeds the limit"),
    ("header nested", lambda d: _header(d, raw=DEEP.encode()), "model.safetensors: corrupt safetensors header: JSON nested too deeply"),
    ("header digits", lambda d: _header(d, raw=b'{"a": ' + DIGITS.encode() + b"}"),
     "model.safetensors: corrupt safetensors header: not UTF-8 JSON (Exceeds the limit"),
    ("generation nested", lambda d: _generation(d, DEEP), "generation_config.json: not valid JSON (nested too deeply)"),
    # tensor shapes whose size overflows (a reshape error and an OverflowError before)
    ("shape 2**62+1", lambda d: _header(d, lambda h: _first_tensor(h).update(shape=[2**62 + 1, 4])),
     "model.safetensors: tensor 'language_model.lm_head.biases': "),
    ("shape 2**62+1 size", lambda d: _header(d, lambda h: _first_tensor(h).update(shape=[2**62 + 1, 4])),
     "but BF16 [4611686018427387905, 4] needs 36893488147419103240"),
    ("shape 2**64", lambda d: _header(d, lambda h: _first_tensor(h).update(shape=[2**64, 1])),
     "but BF16 [18446744073709551616, 1] needs 36893488147419103232"),
    ("shape of 9 dims", lambda d: _header(d, lambda h: _first_tensor(h).update(shape=[1] * 9)),
     "shape has 9 dimensions, more than the limit of 8"),
    ("dtype a list", lambda d: _header(d, lambda h: _first_tensor(h).update(dtype=["F32"])), "unknown dtype ['F32']"),
    # files that are not regular files (a TypeError, or a hang on a FIFO, before)
    ("shard a directory", lambda d: _replace(d / SHARD, "directory"), "model.safetensors: not a regular file (a directory)"),
    ("shard a FIFO", lambda d: _replace(d / SHARD, "fifo"), "model.safetensors: not a regular file (a FIFO)"),
    ("indexed shard a FIFO", lambda d: (_index(d, shard="part.safetensors"), os.mkfifo(d / "part.safetensors")),
     "part.safetensors: not a regular file (a FIFO)"),
    ("config a FIFO", lambda d: _replace(d / "config.json", "fifo"), "config.json: not a regular file (a FIFO)"),
    ("index a FIFO", lambda d: os.mkfifo(d / "model.safetensors.index.json"),
     "model.safetensors.index.json: not a regular file (a FIFO)"),
    ("generation a FIFO", lambda d: _replace(d / "generation_config.json", "fifo"),
     "generation_config.json: not a regular file (a FIFO)"),
    ("index leaves the directory", lambda d: _index(d, shard="../model/model.safetensors"),
     "is not a file name inside the model directory"),
    # absurd sizes, refused before anything is sized from them, naming the field and the limit
    ("vocab 10**12", lambda d: _config(d, lambda c: c.update(vocab_size=10**12)),
     "text_config.vocab_size is 1000000000000, out of range: the limit is 2147483647"),
    ("layers 10**9", lambda d: _layers(d, 10**9),
     "text_config.num_hidden_layers is 1000000000, out of range: the limit is 512"),
    ("layers 2**31-1", lambda d: _layers(d, 2**31 - 1),
     "text_config.num_hidden_layers is 2147483647, out of range: the limit is 512"),
    ("layers past the tensors", lambda d: _layers(d, 500),
     "checkpoint is missing tensor 'model.layers.8."),
    # values that loaded and then failed (or misbehaved) at every use
    ("eps inf", lambda d: _config_text(d, "rms_norm_eps", "Infinity"),
     "text_config.rms_norm_eps must be a finite positive number, got inf"),
    ("eps nan", lambda d: _config_text(d, "rms_norm_eps", "NaN"), "text_config.rms_norm_eps must be a positive number, got nan"),
    ("theta inf", lambda d: _config(d, lambda c: c["rope_parameters"].update(rope_theta=math.inf)),
     "text_config.rope_parameters.rope_theta must be a finite positive number, got inf"),
    ("theta 1e400", lambda d: (_config(d, lambda c: c.pop("rope_parameters")), _config_text(d, "rope_theta", "1e400")),
     "rope_theta must be a finite positive number, got inf"),
    ("model_type nested", lambda d: _config_text(d, "model_type", "[" * 500 + "]" * 500),
     "text_config.model_type must be 'qwen3_5_moe_text', got an array of 1 items"),
    ("temperature 'hot'", lambda d: _generation(d, '{"temperature": "hot"}'),
     "generation_config.json: temperature must be a number, got 'hot'"),
    ("top_p 7", lambda d: _generation(d, '{"top_p": 7}'), "generation_config.json: top_p must be in (0, 1], got 7"),
    ("do_sample 'yes'", lambda d: _generation(d, '{"do_sample": "yes"}'),
     "generation_config.json: do_sample must be true or false, got 'yes'"),
]


@pytest.mark.parametrize("edit, message", [c[1:] for c in LOADER_CASES], ids=[c[0] for c in LOADER_CASES])
def test_malformed_checkpoints_are_clear_errors(model_dir, edit, message):
    edit(model_dir)
    outcome = []
    loader = threading.Thread(target=lambda: outcome.append(_load(model_dir)), daemon=True)
    t0 = time.monotonic()
    loader.start()
    loader.join(60)
    if loader.is_alive():  # blocked (on a FIFO): unblock it, then fail
        for fifo in model_dir.iterdir():
            if fifo.is_fifo():
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("loading blocked")
    assert time.monotonic() - t0 < 20, "refused, but not before doing work the size implied"
    (error,) = outcome
    assert isinstance(error, ValueError), repr(error)  # CheckpointError (a ValueError) where Python found it
    assert message in str(error), str(error)
    if isinstance(error, CheckpointError):
        assert str(model_dir) in str(error), str(error)


def _load(path: Path):
    try:
        lily.load(path)
    except Exception as e:  # noqa: BLE001 - the type is what the test checks
        return e
    return None


@pytest.mark.parametrize("field, value, message", [
    ("vocab_size", 10**12, "config.json: field text_config.vocab_size = 1000000000000 is out of range (the limit is "
                           "2147483647)"),
    ("vocab_size", 2**64, "config.json: field text_config.vocab_size is out of range"),
    ("num_hidden_layers", 2**31 - 1, "text_config.num_hidden_layers (2147483647) exceeds the limit of 512 layers"),
    ("hidden_size", True, "config.json: field text_config.hidden_size must be an integer"),
    ("rms_norm_eps", math.inf, "rms_norm_eps must be a finite positive number, got inf"),
    ("rope_theta", math.nan, "rope_theta must be a finite positive number, got nan"),
    ("head_dim", 2**29, "config.json: text_config sizes: 2 * num_attention_heads * head_dim = 4294967296 exceeds the "
                        "limit of 2147483647"),
])
def test_the_core_checks_config_values_itself(field, value, message):
    ck = build_tiny()
    config = {k: v for k, v in ck.config.items() if isinstance(v, (int, float, bool))}
    config[field] = value
    with pytest.raises(ValueError) as info:
        _core.Model(config, ck.tensors, ck.files)
    assert message in str(info.value)


# -- fuzzing ---------------------------------------------------------------------------------------------------

def _fuzz(strategy, check) -> None:
    """Runs `check` on examples of `strategy` for FUZZ_SECONDS (at least one batch of examples)."""
    @settings(max_examples=50, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def batch(example):
        check(example)

    end = time.monotonic() + FUZZ_SECONDS
    while True:
        batch()
        if time.monotonic() >= end:
            return


def _safetensors_bytes(tensors: dict) -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        write_safetensors(Path(d) / "t.safetensors", tensors)
        return (Path(d) / "t.safetensors").read_bytes()


_VALID = _safetensors_bytes({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(5, dtype=np.uint16),
                             "c": np.zeros((0, 4), np.int8)})
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=6),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
                     max_leaves=12)
_ENTRY = st.fixed_dictionaries({
    "dtype": st.sampled_from([*DTYPES, "F8", ""]) | _JSON,
    "shape": st.lists(st.integers(-1, 2**65), max_size=10) | _JSON,
    "data_offsets": st.lists(st.integers(-1, 2**65), min_size=0, max_size=3) | _JSON,
})


def _header_image(draw_header, length, data) -> bytes:
    raw = json.dumps(draw_header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def _mutated(edits: list[tuple[int, int]], cut: int) -> bytes:
    data = bytearray(_VALID[:cut])
    for at, byte in edits:
        if at < len(data):
            data[at] = byte
    return bytes(data)


_SAFETENSORS = st.one_of(
    st.binary(max_size=300),
    st.builds(_header_image, st.dictionaries(st.text(max_size=6) | st.just("__metadata__"), _ENTRY | _JSON, max_size=4),
              st.none() | st.integers(0, 2**64 - 1), st.binary(max_size=200)),
    st.builds(_mutated, st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), max_size=6),
              st.integers(0, len(_VALID))),
    st.integers(1, 200_000).map(lambda n: struct.pack("<Q", n) + b"[" * n),
)


def test_fuzz_the_safetensors_parser():
    def check(data: bytes):
        try:
            tensors = parse_safetensors(data, "<fuzz>")
        except CheckpointError:
            return
        for name, a in tensors.items():  # what it returns is what the header says, inside the buffer
            assert isinstance(name, str) and a.nbytes <= len(data)

    _fuzz(_SAFETENSORS, check)


def test_fuzz_snapshot_from_bytes(tiny_model):
    s = tiny_model.core.session(max_context=64)
    s.prefill(np.arange(3, dtype=np.int32))
    valid = s.snapshot().to_bytes()
    target = tiny_model.core.session(max_context=64)

    def mutate(edits, cut):
        data = bytearray(valid[:cut])
        for at, value in edits:
            if at < len(data):
                data[at:at + 8] = value
        return bytes(data)

    at = st.integers(0, 200) | st.integers(0, len(valid))
    value = st.binary(min_size=1, max_size=8) | st.sampled_from([b"\xff" * 8, struct.pack("<Q", 2**63),
                                                                 struct.pack("<I", 2**31)])
    snapshots = st.one_of(
        st.binary(max_size=200).map(lambda b: valid[:12] + b),
        st.builds(mutate, st.lists(st.tuples(at, value), max_size=4), st.integers(0, len(valid)) | st.just(len(valid))),
    )

    def check(data: bytes):
        try:
            snap = _core.Snapshot.from_bytes(data)
        except ValueError:
            return
        try:
            target.restore(snap)
        except ValueError:
            pass

    _fuzz(snapshots, check)

