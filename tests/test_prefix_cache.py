"""lily.prefix_cache: longest-prefix lookup, LRU eviction by bytes, exact restore, and disk persistence (atomic
writes, corrupt and foreign files skipped with a warning)."""

import logging
import os

import numpy as np
import pytest

import lily
from lily.prefix_cache import SUFFIX, PrefixCache, model_fingerprint
from lily.tiny import build_tiny, write_checkpoint

FP = "test-fingerprint"


def _ids(rng, model, n) -> list[int]:
    return rng.integers(0, model.n_valid, n).tolist()


def _state(model, ids):
    """The snapshot after prefilling `ids` into a fresh session."""
    s = model.session(max_context=256)
    s.prefill(ids)
    return s.snapshot()


def _next_logits(model, snap, more) -> np.ndarray:
    s = model.session(max_context=256)
    s.restore(snap)
    return s.prefill(more)


def _size(snap) -> int:
    return snap.nbytes + 4 * snap.position


def test_lookup_returns_the_longest_strict_prefix(tiny_model, rng):
    ids = _ids(rng, tiny_model, 24)
    cache = PrefixCache(1 << 30, fingerprint=FP)
    for n in (5, 12, 20):
        cache.insert(_state(tiny_model, ids[:n]))
    assert cache.entries == 3
    assert cache.lookup(ids).tokens == ids[:20]
    assert cache.lookup(ids[:20]).tokens == ids[:12]  # strict: at least one token is left to prefill
    other = (ids[11] + 1) % tiny_model.n_valid
    assert cache.lookup(ids[:11] + [other] + ids[12:]).tokens == ids[:5]
    assert cache.lookup(ids[:5]) is None
    assert cache.lookup(ids, longer_than=20) is None and cache.lookup(ids, longer_than=19).tokens == ids[:20]
    assert cache.lookup([(ids[0] + 1) % tiny_model.n_valid] + ids[1:]) is None
    assert (cache.hits, cache.misses) == (4, 3)


def test_a_restored_snapshot_continues_exactly(tiny_model, rng):
    ids, more = _ids(rng, tiny_model, 16), _ids(rng, tiny_model, 6)
    s = tiny_model.session(max_context=256)
    s.prefill(ids)
    cache = PrefixCache(1 << 30, fingerprint=FP)
    cache.insert(s.snapshot())
    want = s.prefill(more)
    snap = cache.lookup(ids + more)
    assert snap.tokens == ids
    np.testing.assert_array_equal(_next_logits(tiny_model, snap, more), want)


def test_lru_eviction_by_bytes(tiny_model, rng):
    a, b, c = (_state(tiny_model, _ids(rng, tiny_model, 8)) for _ in range(3))
    size = _size(a)
    assert _size(b) == _size(c) == size
    cache = PrefixCache(2 * size, fingerprint=FP)
    cache.insert(a)
    cache.insert(b)
    assert cache.lookup(a.tokens + [1]) is not None  # a is now more recent than b
    cache.insert(c)
    assert cache.evictions == 1 and cache.entries == 2 and cache.bytes == 2 * size
    assert cache.lookup(b.tokens + [1]) is None
    assert cache.lookup(a.tokens + [1]).tokens == a.tokens and cache.lookup(c.tokens + [1]).tokens == c.tokens


def test_a_snapshot_over_the_budget_is_not_kept(tiny_model, rng):
    snap = _state(tiny_model, _ids(rng, tiny_model, 6))
    cache = PrefixCache(_size(snap) - 1, fingerprint=FP)
    cache.insert(snap)
    assert cache.entries == 0 and cache.bytes == 0 and cache.lookup(snap.tokens + [1]) is None


def test_budgets_must_not_be_negative():
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(-1, fingerprint=FP)


def test_disk_round_trip_across_instances(tiny_model, rng, tmp_path):
    ids, more = _ids(rng, tiny_model, 14), _ids(rng, tiny_model, 5)
    snap = _state(tiny_model, ids)
    first = PrefixCache(1 << 30, fingerprint=FP, cache_dir=tmp_path)
    first.insert(snap)
    first.close()
    files = list(tmp_path.iterdir())
    assert [f.suffix for f in files] == [SUFFIX], files  # no temporary file left behind
    assert first.disk_entries == 1 and first.disk_bytes == files[0].stat().st_size

    second = PrefixCache(1 << 30, fingerprint=FP, cache_dir=tmp_path)
    assert second.entries == 0 and second.disk_entries == 1
    got = second.lookup(ids + more)
    assert got.tokens == ids and second.entries == 1 and not got.on_device  # loaded into (host) memory
    np.testing.assert_array_equal(_next_logits(tiny_model, got, more), _next_logits(tiny_model, snap, more))
    second.close()


def test_snapshots_evicted_from_memory_stay_on_disk(tiny_model, rng, tmp_path):
    snap = _state(tiny_model, _ids(rng, tiny_model, 7))
    cache = PrefixCache(0, fingerprint=FP, cache_dir=tmp_path)
    cache.insert(snap)
    cache.flush()
    assert cache.entries == 0 and cache.disk_entries == 1
    assert cache.lookup(snap.tokens + [3]).tokens == snap.tokens
    cache.close()


def test_disk_budget_drops_the_least_recently_used_file(tiny_model, rng, tmp_path):
    states = [_state(tiny_model, _ids(rng, tiny_model, 9)) for _ in range(3)]
    probe = PrefixCache(0, fingerprint=FP, cache_dir=tmp_path / "probe")
    probe.insert(states[0])
    probe.close()
    file_size = probe.disk_bytes
    # Room for two files, not three (their headers differ by a few bytes).
    cache = PrefixCache(0, fingerprint=FP, cache_dir=tmp_path / "cache", max_disk_bytes=5 * file_size // 2)
    for snap in states[:2]:
        cache.insert(snap)
        cache.flush()
    assert cache.lookup(states[0].tokens + [1]) is not None  # the first is now the more recent
    cache.insert(states[2])
    cache.flush()
    assert cache.disk_entries == 2 and abs(cache.disk_bytes - 2 * file_size) < 16
    assert len(list((tmp_path / "cache").glob("*" + SUFFIX))) == 2
    assert cache.lookup(states[1].tokens + [1]) is None
    assert cache.lookup(states[2].tokens + [1]) is not None and cache.lookup(states[0].tokens + [1]) is not None
    cache.close()


def test_corrupt_and_foreign_files_are_skipped_with_a_warning(tiny_model, rng, tmp_path, caplog):
    states = [_state(tiny_model, _ids(rng, tiny_model, 6 + i)) for i in range(4)]
    ours = PrefixCache(0, fingerprint=FP, cache_dir=tmp_path)
    for snap in states[:3]:
        ours.insert(snap)
    ours.close()
    theirs = PrefixCache(0, fingerprint="another-model", cache_dir=tmp_path)
    theirs.insert(states[3])
    theirs.close()
    files = sorted(tmp_path.glob("*" + SUFFIX), key=lambda f: f.stat().st_size)
    truncated, flipped, good, foreign = files[0], files[1], files[2], files[3]
    # Files grow with the prefix: the 6-, 7- and 8-token ones are ours, the 9-token one is the other model's.
    truncated.write_bytes(truncated.read_bytes()[:-10])
    data = bytearray(flipped.read_bytes())
    data[-100] ^= 0xFF
    flipped.write_bytes(bytes(data))
    (tmp_path / ("garbage" + SUFFIX)).write_bytes(rng.bytes(300))

    caplog.set_level(logging.WARNING, logger="lily.prefix_cache")
    cache = PrefixCache(1 << 30, fingerprint=FP, cache_dir=tmp_path)
    text = caplog.text
    assert f"skipping {truncated}" in text and "garbage" + SUFFIX in text
    assert f"skipping {foreign}: written for another model" in text
    assert cache.disk_entries == 2  # the flipped file's damage is found when it is read

    caplog.clear()
    assert cache.lookup(states[1].tokens + [1]) is None
    assert f"skipping {flipped}: checksum mismatch" in caplog.text and not flipped.exists()
    assert cache.lookup(states[2].tokens + [1]).tokens == states[2].tokens
    assert foreign.exists() and good.exists()
    cache.close()


def test_model_fingerprint_follows_the_weights_content(tiny_model, tmp_path):
    path = write_checkpoint(build_tiny(), tmp_path / "ckpt")
    on_disk = lily.load(path)
    assert model_fingerprint(tiny_model) == model_fingerprint(lily.load("tiny"))
    assert model_fingerprint(on_disk) == model_fingerprint(tiny_model)  # the same weights, from a file or not
    assert model_fingerprint(lily.Model(build_tiny(seed=1))) != model_fingerprint(tiny_model)
    shard = next(path.glob("*.safetensors"))
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 1_000_000_000))  # touched: same content
    assert model_fingerprint(lily.load(path)) == model_fingerprint(on_disk)
