"""`lily bench`: the sweep of the public default path, its JSON and plot, the ablation table, and the roofline sums
(architecture.md §10) it divides by."""
import argparse
import importlib
import json
import sys
from pathlib import Path

import pytest

import lily
from lily import bench
from lily.cli import main


def test_rooflines_match_the_spec():
    c = bench.FULL_TEXT_CONFIG
    assert bench.prefill_flops(c, 4096) == pytest.approx(21.8e12, rel=0.01)
    assert bench.decode_bytes(c, 4096) == pytest.approx(1.88e9, rel=0.01)
    assert bench.decode_bytes(c, 131072) == pytest.approx(4.48e9, rel=0.01)


def test_bench_measures_the_default_path(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", "tiny", "--lengths", "24,40", "--decode-tokens", "8", "--greedy",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    model = lily.load("tiny")
    assert result["path"] == "default" and result["backend"] == model.backend
    assert result["prefill_chunk"] == model.core.default_prefill_chunk and result["disabled"] == []
    assert [r["length"] for r in result["results"]] == [24, 40]
    for r in result["results"]:
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["decode_greedy_tok_s"] > 0
        assert r["decode_tokens"] == 8  # EOS ids are ignored: every length generates its count
        assert r["prefill_tok_s"] == pytest.approx(r["length"] / r["ttft_s"])
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert "L=    24: prefill" in capsys.readouterr().out


def test_bench_reports_medians_of_repeats(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", "tiny", "--lengths", "24", "--decode-tokens", "8", "--repeats", "3",
                 "--out", str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["runs"] == 3 and len(r["samples"]["prefill_tok_s"]) == 3
    for key in ("prefill_tok_s", "decode_tok_s"):
        assert r[key] == pytest.approx(sorted(r["samples"][key])[1])
    assert main(["bench", "--model", "tiny", "--lengths", "24", "--repeats", "0", "--out", str(out)]) == 2
    assert "--repeats must be at least 1" in capsys.readouterr().err


def test_ablate_writes_one_row_per_switch(tmp_path, capsys):
    """A row per switch; the sweep runs again only for the switches that act on the backend (none acts on the CPU
    reference: each would repeat the all-on sweep)."""
    out = tmp_path / "ablation.json"
    assert main(["bench", "--model", "tiny", "--ablate", "--lengths", "24", "--decode-tokens", "6",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    names = [n for n, _, _ in lily.optimisations()]
    assert result["backend"] == "cpu" and list(result["runs"]) == ["all on"]
    assert list(result["switches"]) == names and not any(s["acts_here"] for s in result["switches"].values())
    table = capsys.readouterr().out
    for n in names:
        assert f"| `{n}` |" in table and "does not act on cpu, not run" in table
    assert table.count("— (not on this backend)") == 2 * len(names)


def test_a_switch_acts_on_the_backends_its_entry_names():
    assert bench.acts_on("cuda,metal", "metal") and bench.acts_on("cuda", "cuda") and not bench.acts_on("cuda", "cpu")
    assert not bench.acts_on("metal", "cuda") and not bench.acts_on("cuda,metal", "cudam")
    backends = {n: b for n, b, _ in lily.optimisations()}
    assert backends["attn_simdgroup"] == "metal" and backends["pdl"] == "cuda"


def test_bench_serve_sets_the_server_against_the_library(capsys, monkeypatch):
    """benchmarks/bench_serve.py (issue 10's serving bar): prompts of exactly the asked length through both paths."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench_serve = importlib.import_module("bench_serve")
    args = argparse.Namespace(model="tiny", backend="cpu", lengths=[48, 96], repeats=1, out=None)
    result = bench_serve.run(args)
    assert [p["length"] for p in result["points"]] == [48, 96]
    for p in result["points"]:
        assert p["prompt_tokens"] == p["length"]
        assert p["server_ttft_ms"] > 0 and p["library_ttft_ms"] > 0
        assert p["overhead_pct"] == pytest.approx(100 * (p["server_ttft_ms"] / p["library_ttft_ms"] - 1))
    assert "L=    48 (48 prompt tokens): server" in capsys.readouterr().out
    for name in ("bench_serve", "bench_agent"):  # the scripts' modules, not to be found by later imports
        monkeypatch.delitem(sys.modules, name)
