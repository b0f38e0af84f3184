"""The backend a model gets when none is named, what lily.backends() reports, and where the choice is shown: the
`lily` commands' first line, the generate stats line, generate(verbose=True). conftest.py pins LILY_BACKEND=cpu for
the other tests; these unset it where they test the default itself."""
import os
import re
import shutil
import subprocess
import sys

import pytest

import lily
from lily import backend as backend_module
from lily.backend import BackendInfo


def _info(name, usable, compiled=True, reason="", device=""):
    return BackendInfo(name, compiled, usable, "" if usable else reason or "no device", device if usable else "")


def test_backends_report_every_backend_in_preference_order():
    infos = lily.backends()
    assert [b.name for b in infos] == ["cuda", "metal", "cpu"]
    for b in infos:
        assert b.usable == (b.reason == "") and (b.device != "") == b.usable
        assert b.compiled or not b.usable
        if not b.compiled:
            assert b.reason.startswith("not compiled into this build of Lily")
    cpu = infos[-1]
    assert cpu.usable and cpu.compiled and "threads" in cpu.device
    assert lily.backend_names() == [b.name for b in infos if b.compiled]
    assert str(cpu) == f"cpu: usable ({cpu.device})"


def test_cuda_status_names_the_reason(monkeypatch):
    """Where the CUDA backend is compiled in but cannot run, the reason is one the user can act on."""
    cuda = lily.backends()[0]
    if not cuda.compiled or cuda.usable:
        pytest.skip(f"the CUDA backend is {'usable here' if cuda.usable else 'not compiled in'}")
    known = ("no CUDA driver is installed", "no CUDA GPU found", "the NVIDIA driver is too old",
             "is older than the GPUs this build's kernels are compiled for", "CUDA cannot start: ")
    assert cuda.reason.startswith(known), cuda.reason
    monkeypatch.delenv("LILY_BACKEND")
    assert lily.default_backend() != "cuda"
    with pytest.raises(ValueError) as e:
        lily.load("tiny", backend="cuda")
    assert str(e.value) == f"backend 'cuda' cannot run here: {cuda.reason}"


# Stand-ins for libcuda.so.1: a driver too old for this build's CUDA runtime, and a driver that finds no GPU.
FAKE_DRIVERS = {
    "too old": ("int cuDriverGetVersion(int* v) { *v = 11080; return 0; }\nint cuInit(unsigned f) { return 0; }\n",
                r"the NVIDIA driver is too old: it supports CUDA 11\.8, and this build of Lily needs a driver for "
                r"CUDA \d+\.\d+ or newer; update the NVIDIA driver"),
    "no device": ("int cuDriverGetVersion(int* v) { *v = 99000; return 0; }\nint cuInit(unsigned f) { return 100; }\n",
                  r"no CUDA GPU found \(the NVIDIA driver, CUDA 99\.0, is installed but reports no device\)"),
}


@pytest.mark.parametrize("driver", FAKE_DRIVERS)
def test_cuda_reasons_with_a_stand_in_driver(tmp_path, driver):
    """The CUDA runtime is static and loads libcuda.so.1 itself: a stand-in library on LD_LIBRARY_PATH plays a driver
    that is too old or sees no GPU, and the reason says so. Needs a CUDA build without a usable GPU, and a C compiler."""
    cuda = lily.backends()[0]
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cuda.compiled or cuda.usable or cc is None:
        pytest.skip("needs the CUDA backend compiled in, no usable GPU, and a C compiler")
    source, reason = FAKE_DRIVERS[driver]
    (tmp_path / "fake.c").write_text(source)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so.1"), str(tmp_path / "fake.c")],
                   check=True)
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", "import lily; print(lily.backends()[0].reason)"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert re.fullmatch(reason, p.stdout.strip()), p.stdout + p.stderr


@pytest.mark.parametrize("usable, expected", [(("cuda", "metal", "cpu"), "cuda"), (("metal", "cpu"), "metal"),
                                              (("cpu",), "cpu")])
def test_auto_takes_the_first_usable_backend(monkeypatch, usable, expected):
    fake = [_info(n, n in usable, device="dev") for n in ("cuda", "metal", "cpu")]
    monkeypatch.setattr(backend_module, "backends", lambda: fake)
    monkeypatch.delenv("LILY_BACKEND")
    assert backend_module.resolve_backend(None) == backend_module.resolve_backend("auto") == expected
    monkeypatch.setenv("LILY_BACKEND", "cpu")  # the environment chooses when the caller does not
    assert backend_module.resolve_backend(None) == "cpu" and backend_module.resolve_backend("metal") == "metal"


def test_bad_backend_names(monkeypatch):
    with pytest.raises(ValueError, match=r"^unknown backend 'gpu' \(Lily has auto, cuda, metal, cpu; compiled"):
        lily.load("tiny", backend="gpu")
    monkeypatch.setenv("LILY_BACKEND", "gpu")
    with pytest.raises(ValueError, match=r"^LILY_BACKEND=gpu: unknown backend 'gpu'"):
        lily.load("tiny")


def test_an_unusable_backend_from_the_environment_names_the_variable(monkeypatch):
    """LILY_BACKEND set long ago in a shell profile: the error says where the backend came from, and why not."""
    unusable = [b for b in lily.backends() if not b.usable]
    if not unusable:
        pytest.skip("every backend can run here")
    b = unusable[0]
    monkeypatch.setenv("LILY_BACKEND", b.name)
    with pytest.raises(ValueError) as e:
        lily.load("tiny")
    assert str(e.value) == f"LILY_BACKEND={b.name}: backend '{b.name}' cannot run here: {b.reason}"
    code = subprocess.run([sys.executable, "-m", "lily", "generate", "--prompt", "hi"], capture_output=True, text=True,
                          timeout=120)
    assert code.returncode == 2 and code.stderr.strip() == f"lily: error: {e.value}"


def test_load_without_a_backend_takes_the_default(monkeypatch):
    monkeypatch.delenv("LILY_BACKEND")
    model = lily.load("tiny")
    first = next(b for b in lily.backends() if b.usable)
    assert model.backend == lily.default_backend() == first.name and model.device == first.device
    assert f"backend={first.name} ({first.device})" in repr(model)


def test_the_commands_say_which_backend_runs():
    env_cpu = ["-m", "lily", "generate", "--model", "tiny", "--prompt", "hi", "--max-tokens", "1"]
    p = subprocess.run([sys.executable, *env_cpu], capture_output=True, text=True, timeout=120)
    cpu = lily.backends()[-1]
    assert p.returncode == 0 and p.stderr.splitlines()[0] == f"lily: tiny on cpu ({cpu.device})", p.stderr
    assert "[cpu | prompt " in p.stderr


def test_serve_and_bench_say_which_backend_runs(tmp_path):
    cpu = lily.backends()[-1]
    proc = subprocess.Popen([sys.executable, "-m", "lily", "serve", "--model", "tiny", "--port", "0", "--log-level",
                             "warning"], stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()
    finally:
        proc.kill()
        proc.wait()
    assert first == f"lily: tiny on cpu ({cpu.device})\n"
    p = subprocess.run([sys.executable, "-m", "lily", "bench", "--model", "tiny", "--lengths", "8", "--decode-tokens",
                        "2", "--out", str(tmp_path / "b.json")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith(f"lily bench: cpu on {cpu.device}, "), p.stdout + p.stderr
    assert (tmp_path / "b.json").is_file()


def test_auto_on_cpu_says_why_a_compiled_gpu_backend_was_passed_over(monkeypatch, capsys):
    from lily import cli

    passed_over = [_info("cuda", False, reason="no CUDA driver is installed (libcuda.so.1 …)")]
    monkeypatch.setattr(cli, "unusable_gpus", lambda: passed_over)
    monkeypatch.delenv("LILY_BACKEND")
    cli._announce("tiny", "cpu", "x86_64, 2 threads", None)
    assert capsys.readouterr().err == ("lily: tiny on cpu (x86_64, 2 threads); cuda is compiled in but cannot run "
                                       "here: no CUDA driver is installed (libcuda.so.1 …)\n")
    cli._announce("tiny", "cpu", "x86_64, 2 threads", "cpu")  # asked for: no excuses
    assert capsys.readouterr().err == "lily: tiny on cpu (x86_64, 2 threads)\n"


def test_verbose_generate_names_the_backend(tiny_model, capsys):
    lily.generate(tiny_model, "hi", max_tokens=2, verbose=True)
    err = capsys.readouterr().err
    assert f"Backend: cpu ({tiny_model.device})\nPrompt: " in err
