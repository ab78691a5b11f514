import os
import sys
from pathlib import Path

import pytest
import torch

sys.modules.setdefault("fla", None)
sys.path.insert(0, str(Path(__file__).parent))
if not torch.cuda.is_available():
    # the triton kernels (tests/test_moe_triton.py) run in triton's interpreter here; it is chosen as a kernel is
    # defined, and some tests import triton before that module does, so the whole session sets it first
    os.environ.setdefault("TRITON_INTERPRET", "1")

import waste  # noqa: E402,F401  (sets MKL's reproducible mode before any test's first matmul: waste/__init__.py)
from waste import triton_launch  # noqa: E402

# on a GPU every fast launch also asks triton's JIT which kernel it would have run (a wrong key fails the test)
triton_launch.CHECK = True


@pytest.fixture(scope="session")
def releases(tmp_path_factory):
    """Built once per session: family -> (HF model in float32, release directory, converted container)."""
    from fixtures import kimi_linear_model, qwen3_moe_model, save_release

    from waste.convert.convert import convert

    root = tmp_path_factory.mktemp("releases")
    out = {}
    for name, build in (("qwen3_moe", qwen3_moe_model), ("kimi_linear", kimi_linear_model)):
        m = build()
        src = save_release(m, root / name)
        out[name] = (m, src, convert(src, root / f"{name}.waste", experts="bf16", trunk="bf16", progress=False))
    return out


@pytest.fixture(scope="module")
def qwen3(releases, tmp_path_factory):
    """Per module: the Qwen3-MoE release with Qwen3's own template (serve_util.qwen3_container), loaded and served
    on a uvicorn thread: (ThreadServer, Engine). A skip when the template is absent. (test_chat.py has its own.)"""
    from serve_util import QWEN3, ThreadServer, qwen3_container

    import waste
    from waste.serve.app import ServerState

    if not QWEN3.is_file():
        pytest.skip(f"{QWEN3} is absent")
    eng = waste.load(qwen3_container(releases, tmp_path_factory.mktemp("qwen3_served")))
    srv = ThreadServer(ServerState(engine=eng))
    yield srv, eng
    srv.stop()
    eng.close()
