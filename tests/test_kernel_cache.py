"""numba's kernel cache is keyed on every source file of the package (waste/kernel_cache.py): a change to any file
(not only the kernel's own) starts a fresh cache directory."""
import os
import subprocess
import sys

from waste import kernel_cache


def test_digest_follows_every_file(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    first = kernel_cache.digest(tmp_path)
    assert kernel_cache.digest(tmp_path) == first
    st = os.stat(tmp_path / "sub" / "b.py")
    os.utime(tmp_path / "sub" / "b.py", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    touched = kernel_cache.digest(tmp_path)
    assert touched != first
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    assert kernel_cache.digest(tmp_path) not in (first, touched)


def _cache_dir(env):
    code = "import os, waste, numba; print(os.environ['NUMBA_CACHE_DIR']); print(numba.config.CACHE_DIR)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_numba_uses_the_digest_directory_unless_told(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["WASTE_CACHE_DIR"] = str(tmp_path)
    ours = str(tmp_path / "numba" / kernel_cache.digest())
    assert _cache_dir(env) == [ours, ours]
    assert (tmp_path / "numba" / kernel_cache.digest()).is_dir()
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "mine")
    assert _cache_dir(env) == [str(tmp_path / "mine")] * 2
