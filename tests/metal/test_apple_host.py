"""What of the Apple host side of the Metal backend can be checked without a Mac.

* csrc/backend/metal/metal_backend.mm compiles (syntax and semantics, ARC included) as Objective-C++ with clang-19
  against the minimal stub headers of tests/metal/apple_stubs, which declare only what it uses, with Apple's names.
  Not checked: that Apple's real headers and frameworks agree with the stubs, linking, and any run on a GPU.
* metal/metal.cmake's build half, configured in a stand-in project with clang-19 as the Objective-C++ compiler and a
  stand-in `xcrun` that records its calls: every kernel file is compiled to .air with -fno-fast-math, all of them
  are linked into lily.metallib, which installs into lily/, and the .mm and the embedded sources compile.
  Not checked: Apple's `metal` and `metallib` tools themselves.
* metal/metal.cmake, run as a script, embeds each metal/*.metal file with its headers inlined: every line of the
  result maps back to its origin through the #line directives, each header appears once, and the embedded kernels
  are self-contained (the CPU harness's lint compiles them alone). The generated .cpp links against the
  declarations of metal_backend.mm.
"""

import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HOST = REPO / "csrc" / "backend" / "metal" / "metal_backend.mm"
STUBS = Path(__file__).resolve().parent / "apple_stubs"
METAL_CMAKE = REPO / "metal" / "metal.cmake"
REWRITE = Path(__file__).resolve().parent / "harness" / "rewrite.py"
OBJCXX_FLAGS = ["-std=c++17", "-x", "objective-c++", "-fobjc-arc", "-fobjc-runtime=macosx-13.0", "-fblocks"]


def clang() -> str:
    path = shutil.which("clang++-19")
    if path is None:
        pytest.skip("clang++-19 is not installed (apt-get install -y clang-19)")
    return path


def clang_objcxx() -> str:
    """clang++-19 if it can check Objective-C++ with ARC here, else the test is skipped."""
    clang_path = clang()
    probe = subprocess.run([clang_path, *OBJCXX_FLAGS, "-fsyntax-only", "-"], input="@class NSObject;\nint x;\n",
                           capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"clang++-19 cannot check Objective-C++ with ARC here: {probe.stderr.strip()}")
    return clang_path


def cmake() -> str:
    path = shutil.which("cmake")
    if path is None:
        pytest.skip("cmake is not installed")
    return path


def embed(metal_dir: Path, out: Path) -> subprocess.CompletedProcess:
    """Runs metal/metal.cmake as the embedding script."""
    return subprocess.run([cmake(), f"-DLILY_METAL_DIR={metal_dir}", f"-DLILY_EMBED_OUT={out}", "-P", str(METAL_CMAKE)],
                          capture_output=True, text=True)


def one_line(message: str) -> str:
    """CMake wraps its messages: compare them with the whitespace collapsed."""
    return " ".join(message.split())


def embedded_sources(metal_dir: Path, work: Path) -> dict[str, str]:
    """Runs the embedding script on metal_dir, links the generated .cpp with the declarations copied from
    metal_backend.mm into a program that writes each entry out, and returns file name -> embedded text."""
    generated = work / "embedded.cpp"
    r = embed(metal_dir, generated)
    assert r.returncode == 0, r.stderr
    declarations = re.search(r"struct EmbeddedSource \{.*?extern const size_t kNumEmbeddedSources;",
                             HOST.read_text(), re.S)
    assert declarations, "metal_backend.mm no longer declares EmbeddedSource / kEmbeddedSources"
    driver = work / "driver.cpp"
    driver.write_text(
        "#include <cstddef>\n#include <fstream>\n#include <string>\n"
        "namespace lily { namespace metal {\n" + declarations.group(0) + "\n} }\n"
        "int main(int, char** argv) {\n"
        "  for (size_t i = 0; i < lily::metal::kNumEmbeddedSources; ++i)\n"
        "    std::ofstream(std::string(argv[1]) + \"/\" + lily::metal::kEmbeddedSources[i].file)\n"
        "        << lily::metal::kEmbeddedSources[i].text;\n}\n")
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++-19")
    if compiler is None:
        pytest.skip("no C++ compiler")
    exe = work / "driver"
    r = subprocess.run([compiler, "-std=c++17", "-Wall", "-Wextra", "-Werror", str(driver), str(generated),
                        "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = work / "sources"
    out.mkdir()
    subprocess.run([str(exe), str(out)], check=True)
    return {p.name: p.read_text() for p in sorted(out.iterdir())}


def check_line_map(text: str, metal_dir: Path) -> None:
    """Every line of an embedded source is the line of the file that its #line directives name (lines left
    empty by a removed `#pragma once` or an inlined header's last newline excepted)."""
    originals: dict[str, list[str]] = {}
    where, number = None, 0
    for line in text.split("\n"):
        m = re.fullmatch(r'#line (\d+) "([^"]+)"', line)
        if m:
            where, number = m.group(2), int(m.group(1))
            continue
        assert where is not None, "the embedded source does not start with a #line directive"
        if where not in originals:
            originals[where] = (metal_dir / where).read_text().split("\n")
        original = originals[where]
        if line:
            assert number <= len(original) and original[number - 1] == line, \
                f"{where}:{number}: the embedded line {line!r} is not the original"
        else:
            assert number > len(original) or original[number - 1].strip() in ("", "#pragma once"), \
                f"{where}:{number}: the original line {original[number - 1]!r} went missing"
        number += 1


def test_host_compiles_against_the_stub_headers():
    r = subprocess.run([clang_objcxx(), *OBJCXX_FLAGS, "-fsyntax-only", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror",
                        f"-I{STUBS}", f"-I{REPO / 'csrc'}", str(HOST)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_the_stubs_declare_only_what_the_host_uses():
    host = HOST.read_text()
    stubs = "\n".join(p.read_text() for p in sorted(STUBS.rglob("*.h")))
    methods = re.findall(r"^[-+] \([^)]*\)\s*(\w+)", stubs, re.M)
    # The property name is the last word before the `;`, or before a trailing NS_... attribute macro.
    properties = re.findall(r"^@property \([^)]*\) .*?\b(\w+)(?: NS_\w+)?;", stubs, re.M)
    constants = re.findall(r"^\s+(MTL\w+) =", stubs, re.M)
    assert methods and properties and constants
    unused = [name for name in methods + properties + constants if not re.search(rf"\b{name}\b", host)]
    assert unused == [], f"stub declarations metal_backend.mm does not use: {unused}"


def test_embedding_inlines_each_header_once_and_keeps_lines(tmp_path):
    metal = tmp_path / "metal"
    metal.mkdir()
    tag = [secrets.token_hex(4) for _ in range(4)]
    (metal / "common.h").write_text(f"#pragma once\n// common {tag[0]}\n#include <metal_stdlib>\n"
                                    f"inline float c_{tag[0]}() {{ return 1.0f; }}\n")
    (metal / "k_args.h").write_text(f'#pragma once\n#include "common.h"\nstruct KArgs_{tag[1]} {{\n  int n;\n}};\n')
    (metal / "a.metal").write_text(f'// a {tag[2]}\n#include "common.h"\n#include "k_args.h"\n\n'
                                   f"kernel void a_{tag[2]}() {{}}\n// tail {tag[2]}\n")
    (metal / "b.metal").write_text(f'#include "k_args.h"\n// b {tag[3]}\n')
    sources = embedded_sources(metal, tmp_path)
    assert sorted(sources) == ["a.metal", "b.metal"]
    for name, text in sources.items():
        assert '#include "' not in text and "#pragma once" not in text
        assert text.count(f"// common {tag[0]}") == 1 and text.count(f"struct KArgs_{tag[1]}") == 1
        check_line_map(text, metal)
    assert f"kernel void a_{tag[2]}()" in sources["a.metal"] and f"// b {tag[3]}" in sources["b.metal"]
    # common.h comes before k_args.h in b.metal too, since k_args.h includes it first.
    b = sources["b.metal"]
    assert b.index(f"// common {tag[0]}") < b.index(f"struct KArgs_{tag[1]}")


def test_embedding_reports_a_missing_header(tmp_path):
    name = f"missing_{secrets.token_hex(4)}.h"
    (tmp_path / "a.metal").write_text(f'#include "{name}"\n')
    r = embed(tmp_path, tmp_path / "out.cpp")
    assert r.returncode != 0 and f'a.metal includes "{name}", which is not in' in one_line(r.stderr)


def test_embedding_rejects_text_that_would_end_the_raw_string(tmp_path):
    (tmp_path / "a.metal").write_text(f'// {secrets.token_hex(4)} )lily_metal" \n')
    r = embed(tmp_path, tmp_path / "out.cpp")
    assert r.returncode != 0 and "which ends the raw string literal" in one_line(r.stderr)


def test_embedded_kernels_are_self_contained(tmp_path):
    metal = REPO / "metal"
    kernels = sorted(p.name for p in metal.glob("*.metal"))
    assert kernels, "metal/ has no .metal kernels"
    sources = embedded_sources(metal, tmp_path)
    assert sorted(sources) == kernels
    for text in sources.values():
        assert '#include "' not in text
        check_line_map(text, metal)
    clang()  # the lint compiles with it
    r = subprocess.run([sys.executable, str(REWRITE), "--lint", *(str(tmp_path / "sources" / k) for k in kernels)],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr


FAKE_XCRUN = """#!/bin/sh
# Records its arguments, then writes the file named after -o (as xcrun metal / metallib would).
echo "$@" >> "$XCRUN_LOG"
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
[ -z "$out" ] || echo "$@" > "$out"
"""


def test_metal_cmake_builds_the_metallib_and_the_host(tmp_path):
    kernels = sorted((REPO / "metal").glob("*.metal"))
    assert kernels, "metal/ has no .metal kernels"
    clang_path = clang_objcxx()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "xcrun").write_text(FAKE_XCRUN)
    (bin_dir / "xcrun").chmod(0o755)
    log = tmp_path / "xcrun.log"
    project = tmp_path / "project"
    project.mkdir()
    (project / "core.cpp").write_text("int lily_core_stand_in() { return 0; }\n")
    (project / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.18)\nproject(stand_in LANGUAGES CXX)\nset(CMAKE_CXX_STANDARD 17)\n"
        "add_library(lily_core STATIC core.cpp)\n"
        f'target_include_directories(lily_core PUBLIC "{REPO / "csrc"}")\n'
        f'include("{METAL_CMAKE}")\n')
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "XCRUN_LOG": str(log)}
    build = tmp_path / "build"
    # On Linux the Objective-C runtime must be named for ARC, and the stub headers stand in for Apple's.
    r = subprocess.run([cmake(), "-S", str(project), "-B", str(build), f"-DCMAKE_CXX_COMPILER={clang_path}",
                        f"-DCMAKE_OBJCXX_COMPILER={clang_path}",
                        f"-DCMAKE_OBJCXX_FLAGS=-fobjc-runtime=macosx-13.0 -fblocks -I{STUBS}"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([cmake(), "--build", str(build), "--target", "lily_core", "-j", "2"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = log.read_text().splitlines()
    airs = []
    for kernel in kernels:
        compiles = [c for c in calls if f" -c {kernel} " in c]
        assert len(compiles) == 1 and compiles[0].startswith("-sdk macosx metal ") and "-fno-fast-math" in compiles[0]
        airs.append(compiles[0].split(" -o ")[1])
    links = [c for c in calls if c.startswith("-sdk macosx metallib ")]
    assert len(links) == 1 and links[0].endswith(f"-o {build / 'lily.metallib'}")
    assert sorted(links[0].split()[3:-2]) == sorted(airs)
    assert list(build.rglob("metal_backend.mm.o")) and list(build.rglob("lily_metal_sources.cpp.o"))
    r = subprocess.run([cmake(), "--install", str(build), "--prefix", str(tmp_path / "installed")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "installed" / "lily" / "lily.metallib").read_text() == (build / "lily.metallib").read_text()
