"""Where numba keeps the compiled kernels: a directory named by the state of every source file of the package.

numba decides that a cached kernel is still good from its own file's modification time alone. Most of our kernels
inline helpers and LLVM IR from other files (quant/q4_int8.py into layers/cpu_kernels.py, ...): after a change to a
helper's file (a `git pull`, an edit) the old machine code would load, silently giving other bits than the source.
Keying the whole cache on every file's (path, mtime, size) makes any change start a fresh cache. Set NUMBA_CACHE_DIR to choose
the place yourself (then nothing here applies).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

KEEP = 4                        # cache directories of other source states kept (other checkouts, branches)
PACKAGE = Path(__file__).resolve().parent


def digest(root: Path = PACKAGE) -> str:
    """A short hash of every .py file's relative path, modification time and size under root."""
    h = hashlib.blake2b(digest_size=8)
    for p in sorted(root.rglob("*.py")):
        st = p.stat()
        h.update(f"{p.relative_to(root)}\0{st.st_mtime_ns}\0{st.st_size}\n".encode())
    return h.hexdigest()


def base() -> Path:
    if os.environ.get("WASTE_CACHE_DIR"):
        return Path(os.environ["WASTE_CACHE_DIR"]) / "numba"
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("waste")) / "numba"


def setup() -> None:
    """Point numba's cache at base()/digest() (before any kernel module is imported: numba reads it when a cached
    function is defined), and drop the oldest directories beyond KEEP others that no process used for a day."""
    if "NUMBA_CACHE_DIR" in os.environ:
        return
    root = base()
    here = root / digest()
    os.environ["NUMBA_CACHE_DIR"] = str(here)
    import sys

    if "numba" in sys.modules:              # imported before us: its config has already read the environment
        sys.modules["numba"].config.CACHE_DIR = str(here)
    if here.is_dir():
        return
    try:
        here.mkdir(parents=True, exist_ok=True)
        others = sorted((p for p in root.iterdir() if p.is_dir() and p != here), key=lambda p: p.stat().st_mtime)
        for p in others[:-KEEP] if len(others) > KEEP else []:
            if time.time() - p.stat().st_mtime > 86400:
                shutil.rmtree(p, ignore_errors=True)
    except OSError:
        pass                                # an unwritable cache: numba then compiles in every process
