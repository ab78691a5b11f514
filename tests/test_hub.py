"""Models from the Hub: the real huggingface_hub client against a Hub-compatible server on 127.0.0.1
(tests/hub_server.py) serving a tiny release built here. No traffic leaves the machine."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hub_server import HubServer
from waste.cli import main
from waste.convert.synthetic import qwen3_moe_config, write_random_qwen3_moe

REPO = "org/tiny"
SHARD = "model-00001.safetensors"
NEEDED = {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
          "tokenizer_config.json", "model-00000.safetensors", "model-00001.safetensors", "model-00002.safetensors",
          "model-00003.safetensors"}
DOWNLOADED = NEEDED - {"config.json", "model.safetensors.index.json"}    # the two read (into memory) to plan


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    src = write_random_qwen3_moe(tmp_path_factory.mktemp("hub") / "src", qwen3_moe_config(), seed=0,
                                 shard_bytes=150_000)
    (src / "README.md").write_text("# tiny\n")
    (src / "pytorch_model.bin").write_bytes(b"\0" * 1000)      # not needed by conversion: never fetched
    assert {p.name for p in src.iterdir()} >= NEEDED
    return src


@pytest.fixture
def hub(release, tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    from waste.hub import fetch

    monkeypatch.setenv("WASTE_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):     # tests/text/conftest.py sets both
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(hc, "HF_TOKEN_PATH", str(tmp_path / "no-token"))   # no token of this machine's user
    monkeypatch.setattr(fetch, "RETRY_SLEEP", 0.0)
    with HubServer() as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        h.repo = h.add(REPO, release)
        yield h


def rel_dir(tmp_path) -> Path:
    return tmp_path / "cache" / "hub" / "org--tiny"


def body_gets(hub, path: str) -> list[dict]:
    """Downloads of a file's bytes (not the header range reads the plan makes)."""
    return [r for r in hub.blob_gets(hub.repo, path) if r["range"] not in ("bytes=0-100000",)]


def same_as_release(root: Path, release: Path, names=NEEDED) -> None:
    got = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")
           and ".waste-partial" not in p.parts}
    assert got == set(names)
    for n in names:
        assert (root / n).read_bytes() == (release / n).read_bytes(), n


def test_plan_fetch_convert_run_list_rm(hub, release, tmp_path, capsys):
    # plan from the Hub's metadata alone: nothing downloaded, nothing written
    assert main(["plan", REPO, "--json"]) == 0
    hub_plan = json.loads(capsys.readouterr().out)
    assert not (tmp_path / "cache").exists()
    assert not any(body_gets(hub, n) for n in NEEDED if n.endswith(".safetensors"))
    assert hub_plan["hub"]["commit"] == hub.repo.commit and hub_plan["hub"]["family"] == "qwen3_moe"

    assert main(["fetch", REPO]) == 0
    out, err = capsys.readouterr()
    root = rel_dir(tmp_path)
    assert out.strip() == str(root)
    same_as_release(root, release)
    st = json.loads((root / ".waste-fetch.json").read_text())
    assert st["complete"] and st["commit"] == hub.repo.commit and set(st["files"]) == NEEDED
    assert {st["files"]["config.json"]["algo"], st["files"][SHARD]["algo"]} == {"git-sha1", "sha256"}

    before = {n: len(body_gets(hub, n)) for n in DOWNLOADED}
    assert main(["fetch", REPO]) == 0           # again: every file recorded as verified, no bytes move
    assert {n: len(body_gets(hub, n)) for n in DOWNLOADED} == before
    capsys.readouterr()

    assert main(["run", REPO, "def f", "-n", "4", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def f") and "converting org/tiny" in err
    (container,) = (tmp_path / "cache").glob("*.waste")
    assert container.name == f"org--tiny-{hub.repo.commit[:12]}-auto-q8.waste"
    m = json.loads((container / "manifest.json").read_text())
    assert m["provenance"]["hub"] == {"repo": REPO, "revision": "main", "commit": hub.repo.commit}

    # the container is the one `waste convert` makes of the release itself
    from waste.convert.convert import convert

    local = convert(release, tmp_path / "local.waste", progress=False)
    ml = json.loads((local / "manifest.json").read_text())
    assert m["trunk"]["crc32"] == ml["trunk"]["crc32"] and m["experts"] == ml["experts"]
    for bank in sorted((container / "experts").iterdir()):
        assert bank.read_bytes() == (local / "experts" / bank.name).read_bytes()

    # the plan made before downloading is the container's plan (the process baseline aside)
    assert main(["plan", str(container), "--json"]) == 0
    cont_plan = json.loads(capsys.readouterr().out)
    for k in ("trunk_bytes", "state_bytes", "scratch_bytes", "record_bytes", "working_set_bytes", "bank_bytes",
              "budget_bytes", "resident"):
        assert hub_plan[k] == cont_plan[k], k
    size = sum(p.stat().st_size for p in container.rglob("*") if p.is_file())
    assert abs(hub_plan["hub"]["container_bytes"] - size) / size < 0.05, (hub_plan["hub"]["container_bytes"], size)

    n_log = len(hub.log)          # converted once: later runs, info and --convert-only ask nothing of the Hub
    assert main(["run", REPO, "def f", "-n", "4", "--temperature", "0"]) == 0
    assert main(["info", REPO]) == 0
    assert main(["serve", REPO, "--convert-only"]) == 0
    assert main(["chat", REPO, "--convert-only"]) == 0
    out, err = capsys.readouterr()
    assert "converting" not in err and "qwen3_moe" in out and out.strip().endswith(str(container))
    assert len(hub.log) == n_log

    assert main(["list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[REPO]["kind"] == "release" and rows[REPO]["family"] == "qwen3_moe"
    assert rows[container.name]["kind"] == "container" and "experts q4, trunk q8" == rows[container.name]["formats"]
    assert main(["list"]) == 0
    assert REPO in capsys.readouterr().out

    from waste.units import fmt_bytes

    assert main(["rm", REPO, "--release-only"]) == 0      # the container runs without its release
    out = capsys.readouterr().out
    assert f"removed {root}" in out and out.strip().endswith(f"freed {fmt_bytes(rows[REPO]['bytes'])}")
    assert not root.exists() and container.exists()
    n_log = len(hub.log)
    assert main(["run", REPO, "def f", "-n", "4", "--temperature", "0"]) == 0
    assert len(hub.log) == n_log and "converting" not in capsys.readouterr().err
    assert main(["rm", REPO]) == 0
    out = capsys.readouterr().out
    assert f"removed {container}" in out and out.strip().endswith(f"freed {fmt_bytes(rows[container.name]['bytes'])}")
    assert not container.exists()
    assert main(["rm", REPO]) == 1
    assert "nothing named 'org/tiny' in the cache" in capsys.readouterr().err


def fetch_until_a_third(hub, tmp_path, sig):
    """A real `waste fetch` process, sent `sig` once a third of SHARD is on disk; (process, the partial file)."""
    hub.repo.faults[SHARD] = ["slow"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]), HF_HOME=str(tmp_path / "hf"))
    # huggingface_hub writes in 10 MB pieces; this tiny shard needs smaller ones to be half-written
    code = ("import huggingface_hub.constants as c; c.DOWNLOAD_CHUNK_SIZE = 4096; "
            "import sys; from waste.cli import main; sys.exit(main(['fetch', 'org/tiny']))")
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    part_dir = rel_dir(tmp_path) / ".waste-partial"
    deadline = time.time() + 60
    parts = []
    while time.time() < deadline and p.poll() is None:
        parts = list(part_dir.glob(f"{SHARD}.*.part")) if part_dir.is_dir() else []
        if parts and parts[0].stat().st_size >= len(hub.repo.files[SHARD]) // 3:
            break
        time.sleep(0.02)
    p.send_signal(sig)
    p.wait(timeout=30)
    assert parts, p.stderr.read().decode()[-2000:]
    return p, parts[0]


def test_a_new_revision_replaces_the_old(hub, release, tmp_path, capsys):
    assert main(["fetch", REPO]) == 0
    old = hub.repo.commit
    files = dict(hub.repo.files)
    index = json.loads(files["model.safetensors.index.json"])
    index["weight_map"] = {k: v.replace("00003", "00004") for k, v in index["weight_map"].items()}
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    files["model-00004.safetensors"] = files.pop("model-00003.safetensors")      # a renamed shard
    hub.repo = hub.add(REPO, files=files)
    assert hub.repo.commit != old
    assert main(["fetch", REPO]) == 0
    root = rel_dir(tmp_path)
    assert json.loads((root / ".waste-fetch.json").read_text())["commit"] == hub.repo.commit
    assert (root / "model-00004.safetensors").is_file() and not (root / "model-00003.safetensors").exists()
    err = capsys.readouterr().err
    assert "model.safetensors.index.json changed on the Hub since the last fetch" in err
    assert "fetching 2 file(s)" in err and len(body_gets(hub, SHARD)) == 1   # the index and the renamed shard


def test_killed_fetch_resumes(hub, release, tmp_path, capsys):
    """A fetch killed half way through a shard; the next fetch asks for the rest only."""
    p, part = fetch_until_a_third(hub, tmp_path, signal.SIGKILL)
    size = len(hub.repo.files[SHARD])
    part_dir = part.parent
    have = part.stat().st_size
    assert 0 < have < size and not (rel_dir(tmp_path) / SHARD).exists()

    assert main(["fetch", REPO]) == 0
    err = capsys.readouterr().err
    assert "resuming" in err
    resumed = body_gets(hub, SHARD)[-1]
    assert resumed["range"] == f"bytes={have}-" and resumed["sent"] == size - have
    same_as_release(rel_dir(tmp_path), release)
    assert not list(part_dir.glob("*.part"))


def test_ctrl_c_stops_the_fetch_at_once(hub, release, tmp_path, capsys):
    p, part = fetch_until_a_third(hub, tmp_path, signal.SIGINT)
    err = p.stderr.read().decode()
    assert p.returncode == 130 and "fetch stopped" in err and "waste: interrupted" in err and "Traceback" not in err
    assert part.is_file() and 0 < part.stat().st_size < len(hub.repo.files[SHARD])


def test_hub_unavailable_is_retried(hub, release, tmp_path, capsys):
    hub.repo.faults["tokenizer.json"] = ["unavailable"]
    assert main(["fetch", REPO]) == 0
    assert "org/tiny/tokenizer.json: the Hub answered 503" in capsys.readouterr().err
    same_as_release(rel_dir(tmp_path), release)
    hub.repo.faults["tokenizer.json"] = ["unavailable"] * 3
    (rel_dir(tmp_path) / "tokenizer.json").unlink()
    assert main(["fetch", REPO]) == 1
    assert "gave up after 3 attempts; run the same command again" in capsys.readouterr().err


def test_wrong_hash_is_deleted_and_fetched_again(hub, release, tmp_path, capsys):
    hub.repo.faults[SHARD] = ["corrupt"]
    hub.repo.faults["tokenizer_config.json"] = ["corrupt"]   # a git-sha1 (non-LFS) file too
    hub.repo.faults["config.json"] = ["corrupt"]             # read to plan, before the download: checked too
    assert main(["fetch", REPO]) == 0
    err = capsys.readouterr().err
    assert f"{SHARD} has sha256" in err and "tokenizer_config.json has git-sha1" in err
    assert "fetching it again" in err and "config.json came back with another git-sha1" in err
    assert len(body_gets(hub, SHARD)) == 2
    same_as_release(rel_dir(tmp_path), release)

    # damaged on disk after the fetch (and touched, so the record no longer vouches for it): found, re-fetched
    f = rel_dir(tmp_path) / SHARD
    data = bytearray(f.read_bytes())
    data[100] ^= 1
    f.write_bytes(bytes(data))
    assert main(["fetch", REPO]) == 0
    assert "does not match the Hub's sha256" in capsys.readouterr().err
    same_as_release(rel_dir(tmp_path), release)

    # damaged every time: a clear error after the attempts, nothing left that looks fetched
    hub.repo.faults["model-00002.safetensors"] = ["corrupt"] * 3
    (rel_dir(tmp_path) / "model-00002.safetensors").unlink()
    assert main(["fetch", REPO]) == 1
    err = capsys.readouterr().err
    assert "waste: error: model-00002.safetensors of org/tiny failed its check 3 times" in err
    assert "Traceback" not in err and not (rel_dir(tmp_path) / "model-00002.safetensors").exists()


def test_over_long_shard(hub, release, tmp_path, capsys):
    # the server sends more bytes than the Hub lists (once): deleted, fetched again
    hub.repo.faults[SHARD] = ["overlong"]
    assert main(["fetch", REPO]) == 0
    err = capsys.readouterr().err
    assert "Consistency check failed" in err and "deleted, fetching it again" in err
    same_as_release(rel_dir(tmp_path), release)

    # a shard on disk longer than the Hub's size (the fetch_weights.sh failure), not recorded as verified
    root = rel_dir(tmp_path)
    (root / ".waste-fetch.json").unlink()
    with open(root / SHARD, "ab") as f:
        f.write(b"\0" * 512)
    # and a partial left longer than its file
    other = "model-00002.safetensors"
    (root / other).unlink()
    sha = hashlib.sha256(hub.repo.files[other]).hexdigest()
    (root / ".waste-partial").mkdir()
    (root / ".waste-partial" / f"{other}.{sha[:16]}.part").write_bytes(b"\1" * (len(hub.repo.files[other]) + 7))
    assert main(["fetch", REPO]) == 0
    err = capsys.readouterr().err
    assert f"{SHARD} is {len(hub.repo.files[SHARD]) + 512} bytes, longer than the Hub's" in err
    assert "longer than model-00002.safetensors" in err
    same_as_release(root, release)


def test_missing_files(hub, release, tmp_path, capsys):
    # the index names a shard the repository does not have: refused before any download
    del hub.repo.files["model-00003.safetensors"]
    assert main(["fetch", REPO]) == 1
    err = capsys.readouterr().err
    assert "names 1 shard(s) the repository does not have: model-00003.safetensors" in err
    assert "nothing was downloaded" in err and not (tmp_path / "cache").exists()

    # listed but not served (404)
    hub.repo.files["model-00003.safetensors"] = (release / "model-00003.safetensors").read_bytes()
    hub.repo.faults["tokenizer_config.json"] = ["missing"]
    assert main(["fetch", REPO]) == 1
    err = capsys.readouterr().err
    assert "org/tiny/tokenizer_config.json: the Hub has no such file" in err and "Traceback" not in err

    # a revision the repository does not have
    assert main(["fetch", REPO, "--revision", "nope"]) == 1
    assert "org/tiny has no revision 'nope'" in capsys.readouterr().err

    # not a model release at all
    hub.add("org/notes", files={"README.md": b"hi"})
    assert main(["fetch", "org/notes"]) == 1
    assert "org/notes has no config.json" in capsys.readouterr().err


def test_private_repo_needs_a_token(hub, release, tmp_path, capsys, monkeypatch):
    hub.add("org/secret", release, private=True)
    assert main(["fetch", "org/secret"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("waste: error: org/secret: the Hub answered 401")
    assert "private or gated and no token was sent" in err and "HF_TOKEN" in err and "Traceback" not in err
    assert main(["plan", "org/secret"]) == 1              # plan asks the Hub the same way
    assert "401" in capsys.readouterr().err

    hub.add("org/gated", release, gated=True)
    assert main(["plan", "org/gated"]) == 1
    assert "org/gated is gated: accept its terms at" in capsys.readouterr().err

    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    assert main(["fetch", "org/secret"]) == 1
    assert "the token in use (HF_TOKEN or `hf auth login`) cannot read it" in capsys.readouterr().err

    monkeypatch.setenv("HF_TOKEN", hub.token)
    n = len(hub.log)
    assert main(["fetch", "org/secret", "--dir", str(tmp_path / "secret")]) == 0
    same_as_release(tmp_path / "secret", release)
    log = hub.log[n:]
    # the token goes to the Hub, never to the host an LFS file redirects to
    assert all(r["auth"] for r in log if r["host"].startswith("127.0.0.1") and "/api/agent" not in r["path"])
    lfs = [r for r in log if r["host"].startswith("localhost")]
    assert lfs and not any(r["auth"] for r in lfs)


def test_not_enough_disk_statvfs_hook(hub, release, tmp_path, capsys, monkeypatch):
    """The filesystem's free space as statvfs reports it (shutil.disk_usage), replaced by a hook."""
    import shutil
    from collections import namedtuple

    du = namedtuple("usage", "total used free")
    free = {"n": 300_000}
    monkeypatch.setattr(shutil, "disk_usage", lambda p: du(10 ** 9, 10 ** 9 - free["n"], free["n"]))
    assert main(["fetch", REPO]) == 1
    err = capsys.readouterr().err
    assert "waste: error: not enough disk for org/tiny: it needs" in err
    assert "still to download of the" in err and "for the converted container" in err
    assert "300.00 KB free" in err and "nothing was downloaded" in err
    assert not any(body_gets(hub, n) for n in DOWNLOADED) and not rel_dir(tmp_path).exists()

    # the release alone would fit; release + container does not
    release_bytes = sum(len(hub.repo.files[n]) for n in NEEDED)
    free["n"] = release_bytes + 1000
    assert main(["fetch", REPO]) == 1
    assert "not enough disk" in capsys.readouterr().err
    free["n"] = release_bytes + 10 ** 6
    assert main(["fetch", REPO]) == 0


def test_not_enough_disk_tmpfs(hub, release, tmp_path, capsys):
    """A real small filesystem (tmpfs, where this machine lets us mount one): release fits, container does not."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    release_bytes = sum(len(hub.repo.files[n]) for n in NEEDED)
    size_k = (release_bytes + 60_000) // 1024
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_k}k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()}); the statvfs-hook test covers it")
    try:
        os.environ["WASTE_CACHE_DIR"] = str(mnt / "cache")   # restored by the fixture's monkeypatch
        assert main(["fetch", REPO]) == 1
        err = capsys.readouterr().err
        assert "not enough disk" in err and "for the converted container" in err
        assert not any(body_gets(hub, n) for n in DOWNLOADED) and not (mnt / "cache" / "hub").exists()
        # the release alone goes elsewhere with --dir: the container still has to fit in the cache
        assert main(["fetch", REPO, "--dir", str(tmp_path / "rel")]) == 0
        same_as_release(tmp_path / "rel", release)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_machine_that_cannot_run_it_is_refused_first(hub, tmp_path, capsys, monkeypatch):
    from waste.runtime import plan

    monkeypatch.setattr(plan, "ram_bytes", lambda: 64 << 20)
    monkeypatch.setattr(plan, "cgroup_limit", lambda: None)
    assert main(["fetch", REPO]) == 1
    err = capsys.readouterr().err
    assert "org/tiny cannot run on this machine, so nothing was downloaded: not enough memory" in err
    assert not any(body_gets(hub, n) for n in DOWNLOADED) and not rel_dir(tmp_path).exists()


def test_offline_mode_is_named(hub, capsys, monkeypatch):
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    assert main(["run", REPO, "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("waste: error: HF_HUB_OFFLINE is set, so waste does not ask the Hub about org/tiny")
    assert "Traceback" not in err


def test_names():
    from waste.hub import is_repo_id

    assert is_repo_id("moonshotai/Kimi-Linear-48B-A3B-Instruct")
    assert not is_repo_id("model.waste") and not is_repo_id("a/b.waste") and not is_repo_id("tests")
    assert not is_repo_id("./a/b") and not is_repo_id("/abs/path") and not is_repo_id(None)
