"""The command line as a new user meets it (issue 17): flags refused with the server's own limits, the context
enforced, an unquoted prompt explained, the default model for every verb, config.json errors named, every file of
a container checksummed, and a damaged default model rebuilt."""
import json
import shutil

import pytest

from waste.cli import build_parser, main
from waste.container import open_container
from waste.container.verify import verify
from waste.convert.convert import convert


def run_cli(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:            # `waste verify` exits 1 when it finds damage
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv, flag", [
    (["run", "x", "-n", "-5"], "-n"),
    (["run", "x", "-n", "0"], "-n"),
    (["run", "x", "--temperature", "-1"], "--temperature"),
    (["run", "x", "--temperature", "nan"], "--temperature"),
    (["run", "x", "--top-p", "2"], "--top-p"),
    (["run", "x", "--top-p", "0"], "--top-p"),
    (["run", "x", "--min-p", "1.5"], "--min-p"),
    (["run", "x", "--context", "0"], "--context"),
    (["run", "x", "--threads", "0"], "--threads"),
    (["chat", "--top-p", "2"], "--top-p"),
    (["chat", "-n", "-1"], "-n"),
    (["bench", "-n", "0"], "-n"),
    (["plan", "--context", "0"], "--context"),
    (["serve", "--threads", "0"], "--threads"),
])
def test_out_of_range_flags_are_refused_by_name(capsys, argv, flag):
    code, out, err = run_cli(capsys, *argv)
    assert code == 1 and err.startswith(f"waste: error: {flag} ") and out == "", err


def test_run_enforces_the_context(capsys, releases):
    c = releases["qwen3_moe"][2]                     # max_position_embeddings 512
    code, _, err = run_cli(capsys, "run", c, "def f(x):", "--context", "16", "-n", "64")
    assert code == 1 and "-n is 64" in err and "16-token context" in err and "--context" in err, err
    code, _, err = run_cli(capsys, "run", c, "def f(x):", "-n", "5000")
    assert code == 1 and "-n is 5000" in err and "512-token context" in err and "max_position_embeddings" in err, err
    code, out, err = run_cli(capsys, "run", c, "def f(x):", "--context", "32", "-n", "4", "--temperature", "0")
    assert code == 0 and out.startswith("def f(x):"), err


def test_an_unquoted_prompt_is_explained(capsys):
    code, _, err = run_cli(capsys, "run", "def", "fibonacci")
    assert code == 1 and "no such model: def" in err and "quote it: waste run 'def fibonacci'" in err
    code, _, err = run_cli(capsys, "run", "/no/such.waste", "hi")
    assert code == 1 and "no such model: /no/such.waste" in err and "quote" not in err


def test_run_usage_line():
    run = build_parser()._subparsers._group_actions[0].choices["run"]
    assert run.format_usage().strip() == "usage: waste run [MODEL] PROMPT [options]"


@pytest.fixture(scope="module")
def default_cache(tmp_path_factory):
    """A user cache holding the default model, converted once for this module."""
    import os

    root = tmp_path_factory.mktemp("cache")
    old = os.environ.get("WASTE_CACHE_DIR")
    os.environ["WASTE_CACHE_DIR"] = str(root)
    from waste.default_model import default_model_path

    path = default_model_path()
    yield path
    if old is None:
        os.environ.pop("WASTE_CACHE_DIR")
    else:
        os.environ["WASTE_CACHE_DIR"] = old


def test_info_plan_and_verify_default_to_the_bundled_model(capsys, default_cache):
    code, out, _ = run_cli(capsys, "info")
    assert code == 0 and f"{default_cache} (the default model" in out and "WASTE_CACHE_DIR" in out
    assert "on disk" in out
    code, out, _ = run_cli(capsys, "plan")
    trunk = [line for line in out.splitlines() if line.startswith("trunk ")]
    assert code == 0 and len(trunk) == 1 and "in memory" in trunk[0] and "on disk" in trunk[0], out
    code, out, _ = run_cli(capsys, "verify", "-q")
    assert code == 0 and f"OK: every checksum in {default_cache} matches" in out


def test_a_damaged_default_model_is_rebuilt(capsys, default_cache):
    from waste.default_model import default_model_path

    tok = default_cache / "tokenizer.json"
    data = bytearray(tok.read_bytes())
    data[len(data) // 2] ^= 0x01
    tok.write_bytes(bytes(data))
    code, out, err = run_cli(capsys, "verify", "-q")
    assert code == 1 and "tokenizer.json fails its checksum" in out and "rm -rf" in out and "`waste info`" in out
    assert default_model_path() == default_cache
    err = capsys.readouterr().err
    assert "fails its checks (tokenizer.json fails its checksum (SHA-256)); rebuilding it" in err, err
    assert verify(default_cache, progress=False) == []


def test_verify_checks_every_file(tmp_path, releases):
    c = tmp_path / "c.waste"
    shutil.copytree(releases["qwen3_moe"][2], c)
    files = json.loads((c / "manifest.json").read_text())["files"]
    assert "tokenizer.json" in files and "sha256" in files["tokenizer.json"]
    assert "trunk.safetensors" in files and "sha256" not in files["trunk.safetensors"]   # its tensors' CRCs cover it
    assert verify(c, progress=False) == []
    (c / "tokenizer.json").write_text((c / "tokenizer.json").read_text().replace('"', "'", 1))
    assert verify(c, progress=False) == ["tokenizer.json fails its checksum (SHA-256)"]
    (c / "tokenizer.json").unlink()
    assert verify(c, progress=False) == ["tokenizer.json is missing"]


def test_a_v1_container_still_opens_and_verify_says_what_it_cannot_check(tmp_path, releases):
    c = tmp_path / "old.waste"
    shutil.copytree(releases["qwen3_moe"][2], c)
    m = json.loads((c / "manifest.json").read_text())
    del m["files"]
    m["format_version"] = 1
    (c / "manifest.json").write_text(json.dumps(m))
    open_container(c).close()
    notes = []
    assert verify(c, progress=False, notes=notes) == [] and "no checksums for its text files" in notes[0]
    m["format_version"] = 99
    (c / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(Exception, match="container format v99; this waste reads v1, v2: re-convert"):
        open_container(c)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(hidden_size="abc"), "hidden_size must be a positive integer, not 'abc'"),
    (lambda c: c.update(num_experts_per_tok=True), "num_experts_per_tok must be a positive integer, not True"),
    (lambda c: c.update(rms_norm_eps="1e-6"), "rms_norm_eps must be a number"),
    (lambda c: c.pop("num_hidden_layers"), "has no num_hidden_layers"),
    (lambda c: c.pop("moe_intermediate_size"), "has no 'moe_intermediate_size', which a qwen3_moe release needs"),
    (lambda c: c.update(mlp_only_layers=5), "wrong type or shape for a qwen3_moe release"),
])
def test_config_errors_name_the_key(capsys, tmp_path, releases, edit, message):
    src = tmp_path / "src"
    shutil.copytree(releases["qwen3_moe"][1], src)
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (src / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "o.waste")
    assert code == 1 and message in err and not (tmp_path / "o.waste").exists(), err


def test_manifest_files_match_what_convert_wrote(tmp_path, releases):
    """The table is the converter's own record, checked against the bytes independently here."""
    import hashlib

    out = convert(releases["qwen3_moe"][1], tmp_path / "o.waste", experts="bf16", trunk="bf16", progress=False)
    files = json.loads((out / "manifest.json").read_text())["files"]
    on_disk = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert sorted(files) == [p for p in on_disk if p != "manifest.json"]
    for rel, want in files.items():
        data = (out / rel).read_bytes()
        assert want["bytes"] == len(data)
        if "sha256" in want:
            assert want["sha256"] == hashlib.sha256(data).hexdigest()
