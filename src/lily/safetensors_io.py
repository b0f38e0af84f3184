"""A small, strict reader and writer for the safetensors container (architecture.md §9.6).

File layout: `u64 little-endian N`, then `N` bytes of UTF-8 JSON header, then the raw data. Each header
entry is `name -> {"dtype", "shape", "data_offsets": [begin, end]}`, offsets relative to the first
byte after the header; the optional `"__metadata__"` entry maps strings to strings.

NumPy has no bfloat16, so BF16 tensors are `np.uint16` arrays holding the raw bits (`bf16_to_float32`
and `float32_to_bf16` convert). Reading maps the file read-only and returns zero-copy views; a tensor
is copied only when its data is not aligned to its item size.

Every file is opened without blocking and refused unless it is a regular file (a FIFO or a directory is an
error, never a hang), and every header is parsed within limits (MAX_HEADER_BYTES, MAX_DIMS, nesting): a
malformed file is a CheckpointError naming it, never another exception.
"""

import json
import math
import mmap
import os
import stat
import struct
import weakref
from pathlib import Path

import numpy as np

# The safetensors format's own limit on the header (the reference implementation refuses larger ones).
MAX_HEADER_BYTES = 100_000_000
# Dimensions of one tensor (Lily's have at most 3).
MAX_DIMS = 8


class CheckpointError(ValueError):
    """A checkpoint file, tensor or config field is malformed; the message names which one."""


class CheckpointChangedError(CheckpointError):
    """A weights file changed on disk while a model was reading it in place; the message names the file."""


def open_regular(path: str | Path):
    """Opens `path` for reading as a binary file object, refusing anything but a regular file without blocking
    (O_NONBLOCK: opening a FIFO returns at once). CheckpointError names the file and the problem."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be opened ({e.strerror or e})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a file"
        raise CheckpointError(f"{path}: not a regular file ({kind})")
    return os.fdopen(fd, "rb")


class MappedFile:
    """A safetensors file mapped read-only: its tensors (zero-copy views), a uint8 view of the whole mapping, and
    the open file with its status at load, so that `changed()` can tell whether the mapped bytes may have changed
    since: the file was truncated, or written in place (even with its modification time put back, as `cp -p`
    does: its status-change time tells). Replacing the file by a rename, or removing it, leaves the mapped bytes
    as they were and is no change."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open_regular(self.path) as f:
            self._fd = os.dup(f.fileno())  # kept open for changed(): the mapped file, wherever its name now points
        weakref.finalize(self, os.close, self._fd)
        self.status = self._status()
        size = self.status[0]
        if size < 8:
            raise CheckpointError(f"{self.path}: not a safetensors file: {size} bytes, shorter than the 8-byte "
                                  "header length")
        self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
        self.view = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors = parse_safetensors(self._map, self.path)

    def _status(self) -> tuple[int, int, int, int]:
        st = os.fstat(self._fd)
        return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink

    def changed(self) -> str | None:
        """None if the mapped file is as it was at load; else how it changed."""
        (size0, mtime0, ctime0, links0), (size, mtime, ctime, links) = self.status, self._status()
        if size != size0:
            return f"its size changed from {size0} to {size} bytes"
        if mtime != mtime0:
            return "it was modified"
        if ctime != ctime0 and links == links0:  # a link count change (rename over it, rm, ln) also sets ctime
            return "its status changed: written in place with its modification time put back, or chmod/chown"
        return None


# safetensors dtype name -> little-endian NumPy dtype. BF16 and U16 both read as uint16.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}

# NumPy dtype -> the name written by default (uint16 means BF16 in Lily).
_DEFAULT_NAMES: dict[np.dtype, str] = {
    np.dtype(dt).newbyteorder("="): name for name, dt in DTYPES.items() if name != "U16"
}


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (uint16) -> float32 values (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values -> BF16 bit patterns (uint16), rounding to nearest even; NaN stays NaN."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(np.asarray(x, dtype=np.float32)), np.uint16(0x7FC0), rounded)


def _parse_header(path: Path, buf) -> tuple[dict, int]:
    """Returns (header dict without __metadata__, absolute offset of the data section)."""
    if len(buf) < 8:
        raise CheckpointError(f"{path}: not a safetensors file: {len(buf)} bytes, shorter than the 8-byte header "
                              "length")
    (n,) = struct.unpack("<Q", buf[:8])
    if n > len(buf) - 8:
        raise CheckpointError(f"{path}: corrupt safetensors header: header length {n} runs past the end of the "
                              f"{len(buf)}-byte file")
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(f"{path}: corrupt safetensors header: header length {n} exceeds the limit of "
                              f"{MAX_HEADER_BYTES} bytes")
    try:
        header = json.loads(bytes(buf[8:8 + n]).decode("utf-8"))
    except RecursionError:
        raise CheckpointError(f"{path}: corrupt safetensors header: JSON nested too deeply") from None
    except ValueError as e:  # not UTF-8, not JSON, or an integer past Python's digit limit
        raise CheckpointError(f"{path}: corrupt safetensors header: not UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: JSON is a {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{path}: corrupt safetensors header: __metadata__ must map strings to strings")
    return header, 8 + n


def _check_entry(path: Path, name: str, entry) -> tuple[np.dtype, tuple[int, ...], int, int]:
    where = f"{path}: tensor {_brief(name)}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: header entry is not an object")
    for field in ("dtype", "shape", "data_offsets"):
        if field not in entry:
            raise CheckpointError(f"{where}: header entry has no '{field}'")
    if not isinstance(entry["dtype"], str) or entry["dtype"] not in DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {_brief(entry['dtype'])} (known: {', '.join(DTYPES)})")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: bad shape {_brief(shape)}")
    if len(shape) > MAX_DIMS:
        raise CheckpointError(f"{where}: shape has {len(shape)} dimensions, more than the limit of {MAX_DIMS}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int and o >= 0 for o in offsets)
            or offsets[1] < offsets[0]):
        raise CheckpointError(f"{where}: bad data_offsets {_brief(offsets)}")
    dtype = DTYPES[entry["dtype"]]
    expected = math.prod(shape) * dtype.itemsize  # exact: no int64 wrap-around
    if offsets[1] - offsets[0] != expected:
        raise CheckpointError(f"{where}: {offsets[1] - offsets[0]} data bytes, but {entry['dtype']} {shape} "
                              f"needs {expected}")
    return dtype, tuple(shape), offsets[0], offsets[1]


def _brief(value) -> str:
    text = repr(value) if not isinstance(value, (list, dict)) or len(value) <= 16 else f"<{len(value)} items>"
    return text if len(text) <= 120 else text[:117] + "..."


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Maps a .safetensors file read-only and returns name -> array (zero-copy views).

    Raises CheckpointError naming the file (and tensor) for every malformed header, dtype, shape or offset,
    including a truncated file. The mapping stays alive as long as any returned array does.
    """
    return MappedFile(path).tensors


def parse_safetensors(buf, path: str | Path = "<bytes>") -> dict[str, np.ndarray]:
    """The tensors of a safetensors image in `buf` (bytes, mmap, memoryview) as zero-copy views of it; `path`
    names it in errors. Any malformed input raises CheckpointError, and nothing else."""
    path = Path(path) if not isinstance(path, Path) else path
    header, data_start = _parse_header(path, buf)
    data_len = len(buf) - data_start
    entries = sorted(((_check_entry(path, name, e), name) for name, e in header.items()), key=lambda x: x[0][2])
    tensors, prev_end, prev_name = {}, 0, None
    for (dtype, shape, begin, end), name in entries:
        if begin < prev_end:
            raise CheckpointError(f"{path}: tensor '{name}': data_offsets [{begin}, {end}] overlap tensor "
                                  f"'{prev_name}' (ends at {prev_end})")
        if end > data_len:
            raise CheckpointError(f"{path}: truncated file: tensor '{name}' needs data bytes [{begin}, {end}) but "
                                  f"the data section has only {data_len} bytes")
        count = (end - begin) // dtype.itemsize
        arr = np.frombuffer(buf, dtype=dtype, count=count, offset=data_start + begin)
        if (data_start + begin) % dtype.itemsize:
            arr = arr.copy()
        tensors[name] = arr.reshape(shape)
        prev_end, prev_name = end, name
    return tensors


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], dtypes: dict[str, str] | None = None,
                      metadata: dict[str, str] | None = None) -> None:
    """Writes `tensors` as a safetensors file.

    uint16 arrays are written as BF16 unless `dtypes` names another dtype for them (e.g. "U16"). The
    header is space-padded so that the data starts at a multiple of 8 bytes, and tensors are laid out
    by decreasing item size, so every tensor is aligned to its item size.
    """
    path, dtypes = Path(path), dtypes or {}
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    layout, offset = [], 0
    for name in sorted(tensors, key=lambda k: (-tensors[k].dtype.itemsize, k)):
        arr = tensors[name]
        dtype_name = dtypes.get(name) or _DEFAULT_NAMES.get(arr.dtype.newbyteorder("="))
        if dtype_name not in DTYPES or DTYPES[dtype_name].newbyteorder("=") != arr.dtype.newbyteorder("="):
            raise CheckpointError(f"{path}: tensor '{name}': cannot write a {arr.dtype} array as {dtype_name!r}")
        nbytes = arr.size * arr.dtype.itemsize
        header[name] = {"dtype": dtype_name, "shape": list(arr.shape), "data_offsets": [offset, offset + nbytes]}
        layout.append((arr, DTYPES[dtype_name]))
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for arr, dtype in layout:
            f.write(np.ascontiguousarray(arr, dtype=dtype).data)
