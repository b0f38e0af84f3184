"""Snapshots of a session's state keyed by the token prefix they hold, so that a prompt extending a cached
prefix restores it and prefills only the rest.

`PrefixCache` keeps snapshots (lily._core.Snapshot: KV rows, Gated DeltaNet conv and recurrent states) in
memory under a byte budget, evicting the least recently used. With a `cache_dir` every snapshot is also
written to disk (by a background thread: a temporary file, then an atomic rename) and the files found
there at start-up are indexed, so a restarted process resumes a conversation without re-reading it. A
file that is truncated, corrupt, hostile or written for another model is skipped with one warning line;
nothing is ever unpickled. Only regular files are opened (a symlink to one is followed; FIFOs, devices and
directories are skipped without being opened), and every read is bounded by the file's size and by the
limits below (header bytes, token count; a header must be a flat JSON object).

File format (`<key>.lilycache`): the magic `LILYPFX1`, a little-endian u64 header length, a UTF-8 JSON
header {"fingerprint", "tokens", "snapshot_bytes", "crc32"}, the tokens as little-endian int32, then the
snapshot's own self-describing bytes (Snapshot.to_bytes). crc32 covers the tokens and the snapshot bytes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import stat
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lily import _core

log = logging.getLogger(__name__)

MAGIC = b"LILYPFX1"
SUFFIX = ".lilycache"
_MAX_HEADER = 1 << 16
_MAX_TOKENS = 1 << 24  # far above any context length


def largest_snapshot_bytes(config: dict, max_context: int) -> int:
    """An upper bound of Snapshot.to_bytes() for a model's state at up to `max_context` tokens (fp32 activations,
    the widest a backend keeps): what a cache file's snapshot may be, so that a bigger one is never read."""
    layers = config["num_hidden_layers"]
    attn = layers // config.get("full_attention_interval", 4)
    gdn = layers - attn
    nk, nv, dk, dv = (config["linear_num_key_heads"], config["linear_num_value_heads"], config["linear_key_head_dim"],
                      config["linear_value_head_dim"])
    kv = attn * 2 * max_context * config["num_key_value_heads"] * config["head_dim"] * 4
    conv = gdn * (config.get("linear_conv_kernel_dim", 4) - 1) * (2 * nk * dk + nv * dv) * 4
    return kv + conv + gdn * nv * dv * dk * 4 + 4 * max_context + 8 * (attn + 2 * gdn) + 4096


def model_fingerprint(model) -> str:
    """Identity of a loaded model for cache files: the fingerprint of its weights' content (Model.fingerprint:
    config, tensor names, dtypes and shapes, sampled bytes of every tensor; not file names or times, which a
    copy keeps for other weights) and the backend (whose state layout the snapshots hold). A snapshot is only
    ever restored into the same model, which Session.restore checks again."""
    ident = {"weights": model.fingerprint, "backend": model.backend}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]


@dataclass(eq=False)
class _Entry:
    key: str
    tokens: np.ndarray                    # int32, the prefix the snapshot holds
    snapshot: _core.Snapshot | None = None  # in memory, or None
    nbytes: int = 0                       # memory held while in memory
    path: Path | None = None              # on disk, or None
    file_bytes: int = 0
    writing: bool = False                 # a disk write is queued or running
    used: int = 0                         # LRU clock of the last use


class CorruptFile(ValueError):
    pass


class PrefixCache:
    """Longest-prefix cache of session snapshots. `max_bytes`: memory budget (snapshot bytes plus tokens);
    `cache_dir`: persist snapshots there, at most `max_disk_bytes` (None: unbounded); `fingerprint`: the
    model's identity (model_fingerprint), written into files and required of files read back.
    Thread-safe."""

    def __init__(self, max_bytes: int, *, fingerprint: str, cache_dir: str | Path | None = None,
                 max_disk_bytes: int | None = None, max_snapshot_bytes: int | None = None):
        if max_bytes < 0:
            raise ValueError(f"PrefixCache: max_bytes must be >= 0, got {max_bytes}")
        if max_disk_bytes is not None and max_disk_bytes < 0:
            raise ValueError(f"PrefixCache: max_disk_bytes must be >= 0 or None, got {max_disk_bytes}")
        self.max_bytes, self.max_disk_bytes, self.fingerprint = max_bytes, max_disk_bytes, fingerprint
        self.max_snapshot_bytes = max_snapshot_bytes  # a file's snapshot larger than this is never read
        self.dir = Path(cache_dir) if cache_dir is not None else None
        self._lock = threading.RLock()
        self._entries: dict[str, _Entry] = {}
        self._memory: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._clock = 0
        self.bytes = self.disk_bytes = 0
        self.hits = self.misses = self.evictions = 0
        self._writes: queue.Queue | None = None
        if self.dir is not None:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # the files hold the cached prompts' tokens
            self._scan()
            self._writes = queue.Queue()
            self._writer = threading.Thread(target=self._write_loop, name="lily-prefix-cache-writer", daemon=True)
            self._writer.start()

    # -- public API --------------------------------------------------------------------------------------

    @property
    def entries(self) -> int:
        """Snapshots held in memory."""
        return len(self._memory)

    @property
    def disk_entries(self) -> int:
        with self._lock:
            return sum(e.path is not None for e in self._entries.values())

    def lookup(self, tokens: Sequence[int], longer_than: int = 0) -> _core.Snapshot | None:
        """The snapshot (for Session.restore; it holds its tokens) of the longest cached prefix strictly shorter than
        `tokens` (at least one token is left to prefill) and longer than `longer_than`; None if there is none.
        Every cached prefix of `tokens` counts as used."""
        t = np.asarray(tokens, dtype=np.int32)
        with self._lock:
            while True:
                matches = sorted((e for e in self._entries.values()
                                  if (e.snapshot is not None or e.path is not None) and len(e.tokens) < len(t)
                                  and np.array_equal(e.tokens, t[:len(e.tokens)])), key=lambda e: len(e.tokens))
                for e in matches:
                    self._touch(e)
                if not matches or len(matches[-1].tokens) <= longer_than:
                    self.misses += 1
                    return None
                best = matches[-1]
                snapshot = best.snapshot if best.snapshot is not None else self._load(best)
                if snapshot is not None:
                    self.hits += 1
                    return snapshot

    def insert(self, snapshot: _core.Snapshot) -> None:
        """Caches `snapshot` as the state after the tokens it holds."""
        t = np.array(snapshot.tokens, dtype=np.int32)
        key = self._key(t)
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                e = self._entries[key] = _Entry(key, t)
                if self._writes is not None:
                    e.writing = True
                    self._writes.put((e, snapshot))
            self._touch(e)
            if e.snapshot is None:
                self._keep_in_memory(e, snapshot)
            self._forget_if_nowhere(e)

    def flush(self) -> None:
        """Waits until every queued disk write is done."""
        if self._writes is not None:
            self._writes.join()

    def close(self) -> None:
        """Finishes the disk writes and stops the writer thread."""
        if self._writes is not None:
            self._writes.join()
            self._writes.put(None)
            self._writer.join()
            self._writes = None

    # -- memory --------------------------------------------------------------------------------------------

    def _key(self, t: np.ndarray) -> str:
        data = self.fingerprint.encode() + b"\0" + t.astype("<i4").tobytes()
        return hashlib.blake2b(data, digest_size=16).hexdigest()

    def _touch(self, e: _Entry) -> None:
        self._clock += 1
        e.used = self._clock
        if e.snapshot is not None:
            self._memory.move_to_end(e.key)

    def _keep_in_memory(self, e: _Entry, snapshot: _core.Snapshot) -> None:
        size = snapshot.nbytes + e.tokens.nbytes
        if size > self.max_bytes:
            return
        e.snapshot, e.nbytes = snapshot, size
        self._memory[e.key] = e
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._memory.popitem(last=False)
            self.bytes -= old.nbytes
            old.snapshot, old.nbytes = None, 0
            self.evictions += 1
            self._forget_if_nowhere(old)

    def _forget_if_nowhere(self, e: _Entry) -> None:
        if e.snapshot is None and e.path is None and not e.writing:
            self._entries.pop(e.key, None)

    # -- disk ----------------------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Indexes this model's cache files (oldest first); skips any other file with one warning line."""
        found = []
        for path in self.dir.glob("*" + SUFFIX):
            try:
                with _open_regular(path) as f:
                    header, tokens = _read_header(f, self.max_snapshot_bytes)
                    info = os.fstat(f.fileno())
                if header["fingerprint"] != self.fingerprint:
                    raise CorruptFile("written for another model")
            except Exception as err:  # whatever one file holds, the start-up goes on
                log.warning("prefix cache: skipping %s: %s", path, _reason(err))
                continue
            found.append((info.st_mtime_ns, path, tokens, info.st_size))
        for _, path, tokens, size in sorted(found, key=lambda x: x[0]):
            key = self._key(tokens)
            if key in self._entries:  # a copy (or a link) of a file already indexed
                log.warning("prefix cache: skipping %s: the same prefix as %s", path, self._entries[key].path)
                continue
            e = _Entry(key, tokens, path=path, file_bytes=size)
            self._entries[e.key] = e
            self.disk_bytes += e.file_bytes
            self._touch(e)
        self._evict_disk()

    def _load(self, e: _Entry) -> _core.Snapshot | None:
        """The snapshot of a disk entry (kept in memory if it fits); None, and the file dropped, if it is bad."""
        try:
            with _open_regular(e.path) as f:
                header, tokens = _read_header(f, self.max_snapshot_bytes)
                if header["fingerprint"] != self.fingerprint or not np.array_equal(tokens, e.tokens):
                    raise CorruptFile("its header changed since it was indexed")
                payload = f.read(header["snapshot_bytes"])
            if zlib.crc32(payload, zlib.crc32(tokens.astype("<i4").tobytes())) != header["crc32"]:
                raise CorruptFile("checksum mismatch")
            try:
                snapshot = _core.Snapshot.from_bytes(payload)
            except ValueError as err:
                raise CorruptFile(str(err)) from err
            if not np.array_equal(np.asarray(snapshot.tokens, dtype=np.int32), tokens):
                raise CorruptFile(f"the snapshot holds other tokens than the header ({snapshot.position} against "
                                  f"{len(tokens)})")
            os.utime(e.path)
        except Exception as err:  # a bad file is a cache miss, never a failed request
            log.warning("prefix cache: skipping %s: %s", e.path, _reason(err))
            self._drop_file(e)
            self._forget_if_nowhere(e)
            return None
        self._keep_in_memory(e, snapshot)
        return snapshot

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                self._write(*item)
            finally:
                self._writes.task_done()

    def _write(self, e: _Entry, snapshot: _core.Snapshot) -> None:
        path = self.dir / (e.key + SUFFIX)
        tmp = self.dir / f".{e.key}.{os.getpid()}.tmp"
        try:
            payload = snapshot.to_bytes()
            tokens = e.tokens.astype("<i4").tobytes()
            header = json.dumps({"fingerprint": self.fingerprint, "tokens": len(e.tokens),
                                 "snapshot_bytes": len(payload),
                                 "crc32": zlib.crc32(payload, zlib.crc32(tokens))}).encode()
            with open(tmp, "wb", opener=lambda p, flags: os.open(p, flags, 0o600)) as f:  # private, as the dir
                f.write(MAGIC + struct.pack("<Q", len(header)) + header)
                f.write(tokens)
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            size = path.stat().st_size
        except OSError as err:
            log.warning("prefix cache: cannot write %s: %s", path, err)
            tmp.unlink(missing_ok=True)
            with self._lock:
                e.writing = False
                self._forget_if_nowhere(e)
            return
        with self._lock:
            e.writing, e.path, e.file_bytes = False, path, size
            self.disk_bytes += size
            self._evict_disk()

    def _evict_disk(self) -> None:
        if self.max_disk_bytes is None:
            return
        while self.disk_bytes > self.max_disk_bytes:
            oldest = min((e for e in self._entries.values() if e.path is not None), key=lambda e: e.used)
            self._drop_file(oldest)
            self._forget_if_nowhere(oldest)

    def _drop_file(self, e: _Entry) -> None:
        try:
            e.path.unlink(missing_ok=True)
        except OSError as err:
            log.warning("prefix cache: cannot remove %s: %s", e.path, err)
        self.disk_bytes -= e.file_bytes
        e.path, e.file_bytes = None, 0


def _reason(err: Exception) -> str:
    return str(err) if isinstance(err, (OSError, CorruptFile)) else f"{type(err).__name__}: {err}"


def _open_regular(path: Path):
    """`path` opened for reading if it is a regular file (or a symlink to one); CorruptFile otherwise. A FIFO,
    device or directory is never opened (opening a FIFO blocks until a writer comes; a device may act)."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise CorruptFile(f"not a regular file (mode {stat.filemode(info.st_mode)})")
    # O_NONBLOCK: should the path have been swapped for a FIFO since the stat, the open still returns at once.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptFile("not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _read_header(f, max_snapshot_bytes: int | None = None) -> tuple[dict, np.ndarray]:
    """Reads and checks a cache file's header and tokens (a snapshot of more than `max_snapshot_bytes` is refused
    before it is read); leaves `f` at the snapshot bytes."""
    head = f.read(len(MAGIC) + 8)
    if len(head) < len(MAGIC) + 8 or head[:len(MAGIC)] != MAGIC:
        raise CorruptFile("not a Lily prefix-cache file (bad magic)")
    (n,) = struct.unpack("<Q", head[len(MAGIC):])
    if n > _MAX_HEADER:
        raise CorruptFile(f"header of {n} bytes is too long")
    try:
        header = json.loads(f.read(n).decode("utf-8"))
    except RecursionError:
        raise CorruptFile("unreadable header: nested too deeply") from None
    except ValueError as err:
        raise CorruptFile(f"unreadable header: {err}") from err
    fields = {"fingerprint": str, "tokens": int, "snapshot_bytes": int, "crc32": int}
    if not isinstance(header, dict) or any(type(header.get(k)) is not t for k, t in fields.items()) \
            or not 0 <= header["tokens"] <= _MAX_TOKENS or header["snapshot_bytes"] < 0:
        raise CorruptFile(f"malformed header {_short(header)}")
    if max_snapshot_bytes is not None and header["snapshot_bytes"] > max_snapshot_bytes:
        raise CorruptFile(f"a snapshot of {header['snapshot_bytes']} bytes, more than this model's largest "
                          f"({max_snapshot_bytes})")
    expected = len(MAGIC) + 8 + n + 4 * header["tokens"] + header["snapshot_bytes"]
    actual = os.fstat(f.fileno()).st_size
    if actual != expected:
        raise CorruptFile(f"{actual} bytes, the header describes {expected}")
    tokens = np.frombuffer(f.read(4 * header["tokens"]), dtype="<i4").astype(np.int32)
    return header, tokens


def _short(value) -> str:
    try:
        text = repr(value)
    except ValueError:  # an integer too long for repr
        return "(unprintable)"
    return text if len(text) <= 200 else text[:197] + "..."
