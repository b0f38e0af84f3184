"""The rewrite step of the Metal CPU harness: a .metal file becomes C++ that clang compiles against the shim
(include/metal_stdlib), with `#line` directives so every diagnostic and every reported barrier points into the
.metal file.

    rewrite.py FILE.metal OUT.cpp          C++ for the harness build: the kernels plus an entry wrapper and a
                                           registration for every kernel (plain [[kernel]] functions and each
                                           host_name instantiation)
    rewrite.py --index OUT.cpp STEM...     metal_emu::register_all_kernels() calling each file's registration
    rewrite.py --lint FILE.metal...        -fsyntax-only with device/constant/threadgroup as clang address
                                           spaces: passing a pointer to the wrong address space is an error

The source rewrites (each keeps the line count): `threadgroup T x[N];` at kernel scope becomes a reference to
storage the scheduler gives each threadgroup, and `template [[host_name("n")]] [[kernel]] decltype(f<A>) f<A>;`
loses its attributes; `[[threadgroup(i)]]` becomes `[[threadgroup_index(i)]]` (the keyword is a macro).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HARNESS = Path(__file__).resolve().parent
REPO = HARNESS.parents[2]
ATTRIBUTES = ("threadgroup_position_in_grid", "thread_position_in_threadgroup", "thread_index_in_threadgroup",
              "threads_per_threadgroup", "threadgroups_per_grid", "thread_position_in_grid",
              "simdgroup_index_in_threadgroup", "thread_index_in_simdgroup", "simdgroups_per_threadgroup",
              "threads_per_simdgroup")
KEYWORDS = ("device", "constant", "threadgroup", "thread", "kernel")

# A kernel function: `[[kernel]]` (or `kernel`), optionally `[[kernel, max_total_threads_per_threadgroup(N)]]`.
KERNEL_RE = re.compile(r"(?:\[\[\s*kernel\s*(?:,\s*max_total_threads_per_threadgroup\s*\(\s*(\d+)\s*\)\s*)?\]\]"
                       r"|\bkernel\b)\s*void\s+(\w+)\s*\(")
INSTANCE_RE = re.compile(r"template\s*(\[\[\s*host_name\s*\(\s*\"([^\"]+)\"\s*\)\s*\]\]\s*\[\[\s*kernel\s*\]\])"
                         r"\s*decltype\s*\(\s*((\w+)\s*<[^;]*?>)\s*\)[^;]*;")
TG_DECL_RE = re.compile(r"^([ \t]*)threadgroup[ \t]+([A-Za-z_][\w:<>, ]*?)[ \t]+([A-Za-z_]\w*)[ \t]*"
                        r"((?:\[[^\]\n]+\][ \t]*)*);", re.M)
ATTR_RE = re.compile(r"\[\[\s*(\w+)\s*(?:\(\s*(\d+)\s*\))?\s*\]\]")


class RewriteError(Exception):
    pass


@dataclass
class Entry:
    name: str   # host name
    expr: str   # the function (or template specialisation) to call
    fn: str     # the function's name, whose parameter list gives the bindings
    line: int
    max_threads: int = 1024  # the function's max_total_threads_per_threadgroup, else Metal's limit


def blank_comments(text: str) -> str:
    """The text with comments replaced by spaces (newlines kept), so offsets and lines stay valid."""
    def blank(m):
        return re.sub(r"[^\n]", " ", m.group(0))
    return re.sub(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\])*\"", lambda m: m.group(0) if m.group(0)[0] == '"'
                  else blank(m), text, flags=re.S)


def split_params(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([<":
            depth += 1
        elif ch in ")]>":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [p.strip() for p in out + [cur] if p.strip()]


def binding(param: str, where: str) -> str:
    attrs = [m for m in ATTR_RE.finditer(param)]
    if len(attrs) != 1:
        raise RewriteError(f"{where}: parameter '{' '.join(param.split())}' needs exactly one [[...]] attribute")
    name, index = attrs[0].group(1), attrs[0].group(2)
    if name == "buffer" and index is not None:
        return f"metal_emu::Buf<{index}>"
    if name == "threadgroup" and index is not None:
        return f"metal_emu::Tg<{index}>"
    if name in ATTRIBUTES and index is None:
        return f"metal_emu::At<metal_emu::Attr::{name}>"
    raise RewriteError(f"{where}: attribute [[{attrs[0].group(0)[2:-2].strip()}]] is not in the harness's MSL subset")


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def rewrite(path: Path, lint: bool = False) -> str:
    text = path.read_text()
    code = blank_comments(text)
    rel = os.path.relpath(path.resolve(), REPO) if path.resolve().is_relative_to(REPO) else str(path)
    stem = re.sub(r"\W", "_", path.stem)

    # Kernel functions and their bindings; template kernels are registered through their instantiations.
    bindings, limits, entries = {}, {}, []
    for m in KERNEL_RE.finditer(code):
        fn, depth, i = m.group(2), 1, m.end()
        limits[fn] = int(m.group(1) or 1024)
        if not 1 <= limits[fn] <= 1024:
            raise RewriteError(f"{rel}:{line_of(code, m.start())}: max_total_threads_per_threadgroup({m.group(1)}) "
                               f"of {fn} is not in 1..1024")
        while depth:
            if i >= len(code):
                raise RewriteError(f"{rel}:{line_of(code, m.start())}: unbalanced parameter list of {fn}")
            depth += {"(": 1, ")": -1}.get(code[i], 0)
            i += 1
        where = f"{rel}:{line_of(code, m.start())}: kernel {fn}"
        bindings[fn] = [binding(p, where) for p in split_params(code[m.end():i - 1])]
        head = code[max(code.rfind(";", 0, m.start()), code.rfind("}", 0, m.start())) + 1:m.start()]
        if not re.search(r"\btemplate\s*<", head):
            entries.append(Entry(fn, fn, fn, line_of(code, m.start()), limits[fn]))

    # Instantiations: strip their attributes, register each host name.
    out = list(text)
    for m in INSTANCE_RE.finditer(code):
        name, expr, fn = m.group(2), " ".join(m.group(3).split()), m.group(4)
        if fn not in bindings:
            raise RewriteError(f"{rel}:{line_of(code, m.start())}: {name} instantiates {fn}, which is not a "
                               "[[kernel]] template of this file")
        entries.append(Entry(name, expr, fn, line_of(code, m.start()), limits[fn]))
        out[m.start(1):m.end(1)] = [" "] * (m.end(1) - m.start(1))

    # `threadgroup T x[N];` → a reference to this threadgroup's storage (same line).
    for m in reversed(list(TG_DECL_RE.finditer(code))):
        indent, typ, name, dims = m.group(1), m.group(2).strip(), m.group(3), m.group(4).strip()
        decl = (f"{indent}static char metal_emu_tg_{name}; "
                f"auto& {name} = ::metal_emu::tg_ref<threadgroup {typ}{dims}>(&metal_emu_tg_{name});")
        out[m.start():m.end()] = list(decl)
    body = re.sub(r"\[\[\s*threadgroup\s*\(", "[[threadgroup_index(", "".join(out))  # `threadgroup` is a macro

    if len({e.name for e in entries}) != len(entries):
        raise RewriteError(f"{rel}: a kernel name is registered twice")
    lines = [f"// Generated from {rel} by tests/metal/harness/rewrite.py; do not edit.",
             "#include <metal_stdlib>", f"namespace lily_metal_{stem} {{", f'#line 1 "{rel}"', body,
             f"}}  // namespace lily_metal_{stem}"]
    if not lint:
        lines += [f"#undef {k}" for k in KEYWORDS]
        for i, e in enumerate(entries):
            lines += [f"static void metal_emu_entry_{i}(const metal_emu::Bindings& b, const metal_emu::Pos& p) {{",
                      f"  metal_emu::invoke<{', '.join(bindings[e.fn])}>(&lily_metal_{stem}::{e.expr}, b, p);", "}"]
        lines.append(f"void metal_emu_register_{stem}() {{")
        lines += [f'  metal_emu::register_kernel({{"{e.name}", metal_emu_entry_{i}, {{"{rel}", {e.line}}}, '
                  f'{e.max_threads}}});'
                  for i, e in enumerate(entries)]
        lines.append("}")
    return "\n".join(lines) + "\n"


def index(stems: list[str]) -> str:
    names = [re.sub(r"\W", "_", s) for s in stems]
    return "\n".join(["// Generated by tests/metal/harness/rewrite.py --index; do not edit.", '#include "scheduler.h"',
                      *[f"void metal_emu_register_{n}();" for n in names],
                      "void metal_emu::register_all_kernels() {", *[f"  metal_emu_register_{n}();" for n in names],
                      "}"]) + "\n"


def compiler() -> str:
    for c in (os.environ.get("LILY_METAL_CLANG"), "clang++-19", "clang++"):
        if c and shutil.which(c):
            return c
    raise RewriteError("no clang++ found for the lint (set LILY_METAL_CLANG)")


def lint(paths: list[Path]) -> int:
    """Compiles each file in lint mode; prints clang's diagnostics and returns the number of failing files."""
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for path in paths:
            src = Path(tmp) / f"{path.stem}.lint.cpp"
            src.write_text(rewrite(path, lint=True))
            r = subprocess.run([compiler(), "-std=c++17", "-fsyntax-only", "-DLILY_METAL_LINT", "-Wno-unknown-attributes",
                                f"-I{HARNESS / 'include'}", f"-I{path.resolve().parent}", str(src)],
                               capture_output=True, text=True, cwd=REPO)
            if r.returncode:
                failed += 1
                sys.stderr.write(r.stderr)
    return failed


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["--lint"]:
            return 1 if lint([Path(p) for p in argv[1:]]) else 0
        if argv[:1] == ["--index"]:
            Path(argv[1]).write_text(index(argv[2:]))
        elif len(argv) == 2:
            Path(argv[1]).write_text(rewrite(Path(argv[0])))
        else:
            sys.stderr.write(__doc__)
            return 2
    except RewriteError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
