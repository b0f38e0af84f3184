"""Where each decode kernel's loads sit against its PDL wait, from the SASS (needs cuobjdump: CUDA machines only).

Every decode kernel issues what it may before `pdl_wait()` (common.cuh's rule: weights, a layer's own state) so that
those loads overlap its predecessor's tail. The compiler keeps them there only if nothing pulls them across the
wait, and a register count does not show where they went. For each kernel instance that waits (`ACQBULK`, the SASS
of `griddepcontrol.wait`), this prints its instruction count, where its waits are, the global loads (`LDG`, and the
copies into shared memory: `LDGSTS` for cp.async, `UBLKCP` for bulk copies, `UTMALDG` for TMA) between the start or
the previous wait and each wait, the loads after the last wait, and the instructions between the first wait and the
first load after it (the chain a late block starts on). Program order is not path order: a kernel whose paths each
wait (the MoE gate+up kernel's routed and shared-expert warps) lists one segment per path.

    python benchmarks/probes/sass_waits.py [SO_OR_DIR] [--filter SUBSTRING] [--dump DIR]

SO_OR_DIR: the extension module (or a directory holding an installed `lily`; default: the imported one's).
"""
import argparse
import re
import subprocess
import sys
from pathlib import Path


def module_path(arg: str | None) -> Path:
    if arg is None:
        import lily._core as core
        return Path(core.__file__)
    p = Path(arg)
    if p.is_dir():
        found = sorted(p.glob("lily/_core*.so")) or sorted(p.glob("**/_core*.so"))
        if not found:
            sys.exit(f"no lily/_core*.so under {p}")
        return found[0]
    return p


def functions(sass: str) -> dict[str, list[str]]:
    """Function name (mangled) → its SASS instruction lines."""
    out: dict[str, list[str]] = {}
    name = None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = m.group(1)
            out[name] = []
        elif name and re.match(r"\s*/\*[0-9a-f]{4,}\*/", line):
            out[name].append(line.split("*/", 1)[1].split(";")[0].strip())
    return out


def demangle(names: list[str]) -> dict[str, str]:
    try:
        done = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
        return dict(zip(names, done.stdout.splitlines()))
    except (OSError, subprocess.CalledProcessError):
        return {n: n for n in names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("module", nargs="?")
    ap.add_argument("--filter", default="", help="only kernels whose demangled name contains this")
    ap.add_argument("--dump", help="write each listed kernel's SASS to DIR/<n>.sass")
    args = ap.parse_args()
    so = module_path(args.module)
    sass = subprocess.run(["cuobjdump", "-sass", str(so)], capture_output=True, text=True, check=True).stdout
    funcs = functions(sass)
    names = demangle(list(funcs))
    is_load = re.compile(r"\b(LDG|LDGSTS|UBLKCP|UTMALDG)(\.|\b)")
    rows = []
    for mangled, ins in funcs.items():
        waits = [i for i, s in enumerate(ins) if "ACQBULK" in s]
        name = names[mangled]
        if not waits or args.filter not in name:
            continue
        loads = [i for i, s in enumerate(ins) if is_load.search(s)]
        bounds = [-1] + waits
        before = [sum(bounds[j] < i < bounds[j + 1] for i in loads) for j in range(len(waits))]
        after = [i for i in loads if i > waits[-1]]
        first = next((i for i in loads if i > waits[0]), None)
        gap = first - waits[0] if first is not None else -1
        rows.append((name, len(ins), waits, before, len(after), gap))
    rows.sort(key=lambda r: r[0])
    print(f"{so}\n{'kernel':<100} {'instr':>6} {'waits at':>10} {'loads before':>12} {'after':>5} {'gap':>4}")
    for i, (name, n, waits, before, after, gap) in enumerate(rows):
        short = name if len(name) <= 100 else name[:97] + "..."
        at = ",".join(map(str, waits))
        pre = ",".join(map(str, before))
        print(f"{short:<100} {n:>6} {at:>10} {pre:>12} {after:>5} {gap:>4}")
        if args.dump:
            d = Path(args.dump)
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{i:03d}.sass").write_text(name + "\n" + "\n".join(funcs[mangled]) + "\n")

if __name__ == "__main__":
    main()
