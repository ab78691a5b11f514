"""The model cache: ORG/NAME -> a container (fetching and converting once), `waste list`, `waste rm`."""
from __future__ import annotations

import fcntl
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import WasteError
from ..units import fmt_bytes
from .fetch import STATE, Release, check_disk, fetch_release, select_files


def cache_root() -> Path:
    from ..default_model import cache_dir

    return cache_dir()


def release_dir(repo: str) -> Path:
    return cache_root() / "hub" / repo.replace("/", "--")


def _formats(experts: str | None, trunk: str | None) -> tuple[str, str]:
    from ..quant.formats import DEFAULT_TRUNK

    return experts or "auto", trunk or DEFAULT_TRUNK


def container_path(repo: str, commit: str, experts: str | None, trunk: str | None) -> Path:
    e, t = _formats(experts, trunk)
    return cache_root() / f"{repo.replace('/', '--')}-{commit[:12]}-{e}-{t}.waste"


def _state(root: Path) -> dict:
    try:
        return json.loads((root / STATE).read_text())
    except (OSError, ValueError):
        return {}


def _matches(revision: str | None, rev: str | None, commit: str | None) -> bool:
    return revision is None or revision == rev or bool(commit and len(revision) >= 7 and commit.startswith(revision))


def prepare(repo: str, revision: str | None = None, dest: Path | None = None, experts: str | None = None,
            trunk: str | None = None, context: int = 4096, budget: int | None = None, dtype: str = "auto"):
    """Everything checked before a byte of weights moves: the listing, the converter's name and shape checks,
    the memory plan (refuses when this machine cannot run the model) and the disk (release + container)."""
    from .estimate import estimate
    from .remote import Remote

    remote = Remote(repo, revision).describe()
    text, weights, _ = select_files(remote)
    est = estimate(remote, text, weights, *_formats(experts, trunk))
    try:
        est.plan(dtype, context, None, budget)
    except WasteError as e:
        raise WasteError(f"{repo} cannot run on this machine, so nothing was downloaded: {e}") from None
    root = Path(dest).expanduser() if dest else release_dir(repo)
    rel = Release(root, remote)
    files = text + weights
    missing = sum(rf.size - rel.present(rf) for rf in files)
    out = container_path(repo, remote.commit, experts, trunk)
    check_disk(repo, root, missing, est.release_bytes, out, 0 if (out / "manifest.json").is_file() else
               est.container_bytes)
    return remote, root, files, est


def fetch(repo: str, revision: str | None = None, dest: Path | None = None, experts: str | None = None,
          trunk: str | None = None, progress: bool = True, context: int = 4096, budget: int | None = None) -> Path:
    remote, root, files, _ = prepare(repo, revision, dest, experts, trunk, context, budget)
    return fetch_release(remote, root, files, progress)


def find_container(repo: str, revision: str | None, experts: str | None, trunk: str | None,
                   dest: Path | None = None) -> tuple[Path | None, dict]:
    """(the container to use without asking the Hub, or None; the local release's state when it is complete
    and matches). The complete release's commit wins; else the newest container converted from the repo."""
    st = _state(Path(dest).expanduser() if dest else release_dir(repo))
    if st.get("complete") and st.get("repo") == repo and _matches(revision, st.get("revision"), st.get("commit")):
        return container_path(repo, st["commit"], experts, trunk), st
    e, t = _formats(experts, trunk)
    found = []
    for c in cache_root().glob(f"{repo.replace('/', '--')}-*-{e}-{t}.waste"):
        hub = _manifest(c).get("provenance", {}).get("hub") or {}
        if hub.get("repo") == repo and _matches(revision, hub.get("revision"), hub.get("commit")):
            found.append(c)
    return (max(found, key=lambda p: p.stat().st_mtime) if found else None), {}


def ensure_container(repo: str, revision: str | None = None, dest: Path | None = None, experts: str | None = None,
                     trunk: str | None = None, context: int = 4096, budget: int | None = None, dtype: str = "auto",
                     progress: bool = True) -> Path:
    """The container for ORG/NAME: the cached one, else fetched (if needed) and converted once."""
    from ..convert.convert import convert

    out, st = find_container(repo, revision, experts, trunk, dest)
    if out is not None and (out / "manifest.json").is_file():
        return out
    if st:      # the release is here and complete: convert it, no Hub needed
        root, commit, rev = Path(dest).expanduser() if dest else release_dir(repo), st["commit"], st.get("revision")
    else:
        remote, root, files, _ = prepare(repo, revision, dest, experts, trunk, context, budget, dtype)
        out, commit, rev = container_path(repo, remote.commit, experts, trunk), remote.commit, remote.revision
        if not (out / "manifest.json").is_file():
            fetch_release(remote, root, files, progress)
    if not (out / "manifest.json").is_file():
        e, t = _formats(experts, trunk)
        print(f"waste: converting {repo} into {out} (once)", file=sys.stderr)
        convert(root, out, experts=e, trunk=t, force=True, progress=progress,
                provenance={"hub": {"repo": repo, "revision": rev, "commit": commit}})
    return out


def _manifest(c: Path) -> dict:
    try:
        return json.loads((c / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}


def disk_bytes(p: Path) -> int:
    """Bytes a file or directory takes on disk (what removing it frees)."""
    if p.is_file():
        return p.stat().st_blocks * 512
    return sum(f.stat().st_blocks * 512 for f in p.rglob("*") if f.is_file() and not f.is_symlink())


@dataclass
class Entry:
    name: str           # what `waste rm` takes
    kind: str           # release, container, partial
    path: Path
    bytes: int
    formats: str
    family: str
    source: str


def list_cache() -> list[Entry]:
    root = cache_root()
    out = []
    for d in sorted((root / "hub").glob("*")):
        if not d.is_dir():
            continue
        st = _state(d)
        repo = st.get("repo") or d.name.replace("--", "/", 1)
        try:
            family = json.loads((d / "config.json").read_text()).get("model_type", "?")
        except (OSError, ValueError):
            family = "?"
        status = f"{(st.get('commit') or '?')[:12]}" + ("" if st.get("complete") else " (incomplete: `waste fetch` "
                                                                                    "resumes it)")
        out.append(Entry(repo, "release", d, disk_bytes(d), "as released", family, status))
    for c in sorted(root.glob("*.waste")):
        m = _manifest(c)
        if not m:
            continue
        prov = m.get("provenance", {})
        hub = prov.get("hub")
        src = f"{hub['repo']}@{hub['commit'][:12]}" if hub else str(prov.get("source", "?"))
        fmts = f"experts {m.get('experts', {}).get('format', '?')}, trunk {m.get('trunk', {}).get('format', '?')}"
        out.append(Entry(c.name, "container", c, disk_bytes(c), fmts, m.get("family", "?"), src))
    for c in sorted(root.glob("*.waste.partial-*")):
        out.append(Entry(c.name, "partial", c, disk_bytes(c), "-", "-", "an interrupted conversion"))
    return out


def remove(name: str, release_only: bool = False) -> list[tuple[Path, int]]:
    """Remove a cache entry by its `waste list` name: ORG/NAME is the release and (unless release_only) every
    container converted from it; a container's name removes that container. Returns (path, bytes freed)."""
    root = cache_root()
    targets = []
    if "/" in name:
        d = release_dir(name)
        if d.is_dir():
            _not_busy(d)
            targets.append(d)
        if not release_only:
            targets += [c for c in sorted(root.glob("*.waste"))
                        if (_manifest(c).get("provenance", {}).get("hub") or {}).get("repo") == name]
    else:
        for cand in (root / name, root / f"{name}.waste"):
            if cand.is_dir() and cand.parent == root and (cand.name.endswith(".waste") or ".waste.partial-" in
                                                          cand.name):
                targets.append(cand)
                break
    if not targets:
        raise WasteError(f"nothing named {name!r} in the cache ({root}): `waste list` shows what there is")
    freed = []
    for t in targets:
        n = disk_bytes(t)
        shutil.rmtree(t)
        freed.append((t, n))
    return freed


def _not_busy(d: Path) -> None:
    lock = d / ".waste-fetch.lock"
    if not lock.is_file():
        return
    with open(lock) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise WasteError(f"a waste process is fetching into {d}: stop it first") from None


def describe(entries: list[Entry]) -> list[str]:
    if not entries:
        return [f"the cache ({cache_root()}) holds no models"]
    rows = [("NAME", "KIND", "SIZE", "FORMATS", "FAMILY", "FROM")]
    rows += [(e.name, e.kind, fmt_bytes(e.bytes), e.formats, e.family, e.source) for e in entries]
    w = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(r[i].ljust(w[i]) for i in range(5)) + "  " + r[5] for r in rows]
    return lines + [f"{len(entries)} {'entry' if len(entries) == 1 else 'entries'}, {fmt_bytes(sum(e.bytes for e in entries))} in {cache_root()}"]


def plan(repo: str, revision: str | None = None, experts: str | None = None, trunk: str | None = None,
         dtype: str = "auto", context: int = 4096, ram: int | None = None, budget: int | None = None,
         prefill_chunk: int | None = None):
    """`waste plan ORG/NAME`: (the memory plan, the estimate, the remote) from the Hub's metadata alone."""
    from .estimate import estimate
    from .remote import Remote

    remote = Remote(repo, revision).describe()
    text, weights, _ = select_files(remote)
    est = estimate(remote, text, weights, *_formats(experts, trunk))
    return est.plan(dtype, context, ram, budget, prefill_chunk), est, remote
