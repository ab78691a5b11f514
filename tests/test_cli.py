"""The command line as a user meets it: real subprocesses, clear errors, never a traceback."""
import json
import os
import shutil
import subprocess
import sys

import pytest


def waste(*args, env=None, check=False):
    e = dict(os.environ, **(env or {}))
    p = subprocess.run([sys.executable, "-m", "waste", *map(str, args)], capture_output=True, text=True, env=e,
                       timeout=600)
    assert "Traceback" not in p.stderr, p.stderr
    if check:
        assert p.returncode == 0, p.stderr
    return p


@pytest.fixture
def damaged(tmp_path, releases):
    dst = tmp_path / "copy.waste"
    shutil.copytree(releases["kimi_linear"][2], dst)
    return dst


def test_missing_directory():
    p = waste("run", "/nonexistent/model.waste", "hi")
    assert p.returncode == 1 and "no such model: /nonexistent/model.waste" in p.stderr


def test_convert_unsupported_family(tmp_path, releases):
    src = tmp_path / "src"
    shutil.copytree(releases["qwen3_moe"][1], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "falcon"
    (src / "config.json").write_text(json.dumps(cfg))
    p = waste("convert", src, tmp_path / "o.waste")
    assert p.returncode == 1 and "unsupported model_type 'falcon'" in p.stderr and "kimi_linear" in p.stderr


def test_truncated_bank_is_refused(damaged):
    bank = damaged / "experts" / "layer_002.bank"
    data = bank.read_bytes()
    bank.write_bytes(data[:-5000])
    p = waste("run", damaged, "hello", "-n", "2")
    assert p.returncode == 1 and "layer_002.bank" in p.stderr and "truncated" in p.stderr
    v = waste("verify", damaged, "-q")
    assert v.returncode == 1 and "layer_002.bank" in v.stdout


def test_flipped_byte_is_named_by_verify_and_refused_by_run(damaged):
    c = json.loads((damaged / "manifest.json").read_text())
    bank = damaged / "experts" / "layer_003.bank"
    data = bytearray(bank.read_bytes())
    header = os.path.getsize(bank) - 8 * c["experts"]["record_bytes"]
    data[header + 5 * c["experts"]["record_bytes"] + 100] ^= 0x10     # expert 5, inside its payload
    bank.write_bytes(bytes(data))
    v = waste("verify", damaged, "-q")
    assert v.returncode == 1
    assert "experts/layer_003.bank (layer 3): expert record(s) 5 fail their checksum" in v.stdout
    for e in range(8):   # damage every expert of the layer, so that whichever a token routes to is caught
        data[header + e * c["experts"]["record_bytes"] + 100] ^= 0x10 if e != 5 else 0
    bank.write_bytes(bytes(data))
    for preload in ("0", "1"):
        p = waste("run", damaged, "hello", "-n", "2", env={"WASTE_PRELOAD": preload})
        assert p.returncode == 1 and "of layer 3" in p.stderr and "checksum" in p.stderr


def test_verify_and_info_on_a_good_container(releases):
    c = releases["kimi_linear"][2]
    assert "OK" in waste("verify", c, "-q", check=True).stdout
    out = waste("info", c, check=True).stdout
    for word in ("kimi_linear", "3 kda", "2 mla", "4 moe", "8 routed", "top-2", "2 shared", "active per token", "bf16"):
        assert word in out, word
    d = json.loads(waste("info", c, "--json", check=True).stdout)
    assert d["params"]["total"] > d["params"]["active"] > 0


def test_run_prints_text_then_stats(releases):
    p = waste("run", releases["qwen3_moe"][2], "def f(x):", "-n", "8", check=True)
    assert p.stdout.startswith("def f(x):")
    assert "prompt" in p.stderr and "tok/s" in p.stderr and "experts" in p.stderr and "hit" in p.stderr


def test_run_with_only_a_prompt_uses_the_default_model(tmp_path):
    p = waste("run", "def fibonacci(n):", "-n", "4", env={"WASTE_CACHE_DIR": str(tmp_path)}, check=True)
    assert p.stdout.startswith("def fibonacci(n):")
    assert any(tmp_path.glob("*.waste/manifest.json"))


def test_damaged_trunk_tensor_is_named_by_verify_and_refused_by_run(damaged):
    """A flipped byte inside one trunk tensor's data: `verify` names the tensor, `run` refuses with the reason."""
    from safetensors import safe_open

    trunk = damaged / json.loads((damaged / "manifest.json").read_text())["trunk"]["file"]
    raw = bytearray(trunk.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + header_len])
    with safe_open(str(trunk), "pt") as h:
        name = sorted(k for k in h.keys() if "layers.1." in k and h.get_slice(k).get_shape()[-1] >= 16)[0]
    start = 8 + header_len + header[name]["data_offsets"][0]
    raw[start + 3] ^= 0x40
    trunk.write_bytes(bytes(raw))
    v = waste("verify", damaged, "-q")
    assert v.returncode == 1 and name in v.stdout, v.stdout
    p = waste("run", damaged, "hello", "-n", "2")
    assert p.returncode == 1 and p.stderr.startswith("waste: error: ") and name in p.stderr, p.stderr


@pytest.mark.parametrize("where,what", [(0, "bad magic"), (40, "header")])
def test_damaged_bank_header_is_named_by_verify_and_refused_by_run(damaged, where, what):
    """The bank's magic, or a byte of its header past the fixed fields (the record layout and its CRC table)."""
    bank = damaged / "experts" / "layer_002.bank"
    raw = bytearray(bank.read_bytes())
    raw[where] ^= 0x01
    bank.write_bytes(bytes(raw))
    for args in (("run", damaged, "hello", "-n", "2"), ("verify", damaged, "-q")):
        p = waste(*args)
        out = p.stdout + p.stderr
        assert p.returncode == 1 and "layer_002.bank" in out and what in out, out


def test_top_k_samples_and_experts_per_token_routes(releases):
    """--top-k is sampling's (top-1 at any temperature is the greedy text) and says so; routing each token to K
    experts is --experts-per-token, checked against the release's number; serve and bench name the new flag."""
    c = releases["qwen3_moe"][2]
    greedy = waste("run", c, "def f(x):", "-n", "12", "--temperature", "0", check=True)
    top1 = waste("run", c, "def f(x):", "-n", "12", "--temperature", "1.5", "--top-k", "1", "--seed", "3", check=True)
    assert top1.stdout == greedy.stdout
    assert "--experts-per-token K" in top1.stderr and "--experts-per-token" not in greedy.stderr
    routed = waste("run", c, "def f(x):", "-n", "12", "--temperature", "0", "--experts-per-token", "1", check=True)
    assert routed.stdout != greedy.stdout        # one expert instead of the release's two changes the text
    p = waste("run", c, "hi", "--experts-per-token", "3")
    assert p.returncode == 1 and "--experts-per-token 3: choose 1 to 2" in p.stderr
    p = waste("serve", c, "--top-k", "1", "--port", "0")
    assert p.returncode == 1 and "waste serve has no --top-k" in p.stderr and "--experts-per-token K" in p.stderr
