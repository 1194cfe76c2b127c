"""``--compile-cache``: where inductor's and Triton's caches go, the key subfolder, and a corrupt, stale or
unusable cache ignored with one line and rebuilt -- never a crash."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from scalefold.compilation import cache as cc


def _configure(root, **kw):
    lines: list[str] = []
    env: dict[str, str] = kw.pop("env", {})
    result = cc.configure_compile_cache(root, env=env, log=lines.append, **kw)
    return result, env, lines


def test_folders_key_and_environment(tmp_path):
    c, env, lines = _configure(tmp_path / "cache", rank=3)
    key = cc.cache_key()
    assert c.path == tmp_path / "cache" / cc.key_name(key) and lines == [] and not c.warm
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(c.path / "inductor")
    assert env["TRITON_CACHE_DIR"] == str(c.path / "triton" / "rank3")  # Triton's per rank
    assert json.loads((c.path / cc.MANIFEST).read_text()) == key
    for part in ("torch", "triton", "device"):
        assert str(key[part]).replace(" ", "-") in c.path.name or part == "device"
    assert "/" not in c.path.name


def test_rank_comes_from_the_launcher(tmp_path):
    assert cc.rank_from_env({"SLURM_PROCID": "5"}) == 5
    assert cc.rank_from_env({"RANK": "2", "SLURM_PROCID": "5"}) == 2
    assert cc.rank_from_env({}) is None
    _, env, _ = _configure(tmp_path, env={"SLURM_PROCID": "7"})
    assert env["TRITON_CACHE_DIR"].endswith("rank7")


def test_default_root_and_off(tmp_path):
    assert cc.default_cache_root({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "scalefold" / "compile"
    c, env, _ = _configure(None, env={"XDG_CACHE_HOME": str(tmp_path)})
    assert c.root == tmp_path / "scalefold" / "compile"
    off, env, _ = _configure("off")
    assert off.path is None and env == {} and "off" in off.describe()


def test_second_run_is_warm(tmp_path):
    first, _, _ = _configure(tmp_path)
    (first.inductor_dir / "fxgraph").mkdir()
    (first.inductor_dir / "fxgraph" / "entry").write_bytes(b"compiled")
    second, _, lines = _configure(tmp_path)
    assert second.warm and second.path == first.path and lines == []
    assert "warm" in second.describe()


@pytest.mark.parametrize("damage", ["garbage record", "no record", "other torch", "not an object"])
def test_corrupt_or_stale_folder_is_rebuilt_with_one_line(tmp_path, damage):
    first, _, _ = _configure(tmp_path)
    (first.inductor_dir / "stale.so").write_bytes(b"old")
    record = first.path / cc.MANIFEST
    if damage == "garbage record":
        record.write_bytes(b"\x00\xff{")
    elif damage == "no record":
        record.unlink()
    elif damage == "other torch":
        record.write_text(json.dumps({**cc.cache_key(), "torch": "1.0.0"}))
    else:
        record.write_text("[1, 2]")
    again, env, lines = _configure(tmp_path)
    assert len(lines) == 1 and str(again.path) in lines[0] and "rebuilding" in lines[0], lines
    if damage == "other torch":
        assert "stale" in lines[0] and "1.0.0" in lines[0]
    assert not again.warm and not (again.inductor_dir / "stale.so").exists()
    assert json.loads(record.read_text()) == cc.cache_key()


def test_unusable_root_falls_back_to_a_temporary_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    c, env, lines = _configure(blocker / "cache")
    assert len(lines) == 1 and "unusable" in lines[0] and str(blocker) in lines[0]
    assert c.path.is_dir() and Path(env["TORCHINDUCTOR_CACHE_DIR"]).is_dir()


def _warm(tmp_path):
    c, _, _ = _configure(tmp_path)
    (c.inductor_dir / "bad.so").write_bytes(b"garbage")
    return cc.CompileCache(c.root, c.path, c.inductor_dir, c.triton_dir, warm=True)


def _failing_once(exc: BaseException):
    calls = []

    def fn():
        calls.append(1)
        if len(calls) == 1:
            raise exc
        return "compiled"

    return fn, calls


def _loader_error(c) -> Exception:
    """What inductor raises for a corrupt compiled kernel: its own error, caused by the loader's."""
    try:
        try:
            raise ImportError(f"{c.inductor_dir}/ab/cab.so: invalid ELF header")
        except ImportError as inner:
            raise RuntimeError("backend='inductor' raised:\nmore") from inner
    except RuntimeError as outer:
        return outer


def test_compile_with_rebuild_empties_a_warm_cache_on_a_cache_error_and_retries(tmp_path):
    c = _warm(tmp_path)
    lines = []
    fn, calls = _failing_once(_loader_error(c))
    assert cc.compile_with_rebuild(fn, c, log=lines.append) == "compiled"
    assert len(calls) == 2 and len(lines) == 1 and "rebuilding" in lines[0] and "backend='inductor'" in lines[0]
    assert not (c.inductor_dir / "bad.so").exists()
    cold = cc.CompileCache(c.root, c.path, c.inductor_dir, c.triton_dir, warm=False)
    with pytest.raises(RuntimeError):  # a cold cache is not the culprit: the error stands
        cc.compile_with_rebuild(lambda: (_ for _ in ()).throw(_loader_error(c)), cold, log=lines.append)
    for exc in (EOFError("Ran out of input"), OSError(f"cannot read {c.triton_dir}/x/kernel.cubin")):
        assert cc.is_cache_error(exc, c)


@pytest.mark.parametrize("error", ["oom", "cuda_oom_message", "capture", "capture_wrapping_a_loader_error", "bug"])
def test_compile_with_rebuild_never_rebuilds_on_an_oom_a_capture_error_or_a_bug(tmp_path, error):
    """An out-of-memory, a failed CUDA-graph capture or a plain bug in a warm cache: raised at once, ``fn``
    called once, the cache untouched (no second try that doubles the time to failure, no cold next run)."""
    c = _warm(tmp_path)
    exc = {
        "oom": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        "cuda_oom_message": RuntimeError(f"CUDA error: out of memory (while loading {c.inductor_dir}/k.so)"),
        "capture": RuntimeError("CUDA error: operation not permitted when stream is capturing"),
        "capture_wrapping_a_loader_error": RuntimeError("CUDA graph capture failed"),
        "bug": RuntimeError("C++ compile error\nmore"),
    }[error]
    if error == "capture_wrapping_a_loader_error":
        exc.__cause__ = ImportError("x.so: invalid ELF header")
    lines = []
    fn, calls = _failing_once(exc)
    with pytest.raises(type(exc)):
        cc.compile_with_rebuild(fn, c, log=lines.append)
    assert calls == [1] and lines == [] and (c.inductor_dir / "bad.so").exists()
    assert not cc.is_cache_error(exc, c)


def test_corrupt_files_in_a_real_inductor_cache_do_not_crash(tmp_path):
    """The end-to-end case: compile with inductor into the cache (one cold compile, then the folder copied), in
    one copy overwrite the compiled kernels (``.so``: without :func:`compile_with_rebuild` this fails the
    compilation), in the other every cached file, with garbage; compile again from each in a fresh process: it
    computes the right numbers (kernels: after one line, rebuilt)."""
    import shutil

    script = textwrap.dedent("""
        import sys, torch
        from scalefold.compilation.cache import compile_with_rebuild, configure_compile_cache
        configure_compile_cache(sys.argv[1])
        f = torch.compile(lambda x: torch.sigmoid(x) * x + 1.0, dynamic=True)
        x = torch.linspace(-1, 1, 8)
        y = compile_with_rebuild(lambda: f(x))
        assert torch.allclose(y, torch.sigmoid(x) * x + 1.0)
        print("ok")
    """)  # fmt: skip

    def run(root):
        return subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True, timeout=900)

    kernels, everything = tmp_path / "kernels", tmp_path / "everything"
    first = run(kernels)  # the kernels' copy stays where it was compiled: its entries point at its own files
    assert first.returncode == 0 and "ok" in first.stdout, first.stderr[-2000:]
    shutil.copytree(kernels, everything)
    for root, damage in ((kernels, "kernels"), (everything, "everything")):
        files = [p for p in root.rglob("*") if p.is_file() and p.name != cc.MANIFEST and "locks" not in p.parts]
        assert any(p.suffix == ".so" for p in files), files
        for p in files:
            if damage == "everything" or p.suffix == ".so":
                p.write_bytes(b"garbage")
        second = run(root)
        assert second.returncode == 0 and "ok" in second.stdout, (damage, second.stderr[-2000:])
        if damage == "kernels":
            assert "compiling from it failed" in second.stderr and "rebuilding it" in second.stderr, second.stderr[-2000:]
