"""`waste fetch ORG/NAME`: download what conversion needs, resumable across processes, every file checked.

Before a byte of weights moves: the file list and sizes (one API call), config.json and the safetensors headers
(range requests) give the container's size and the memory plan; the fetch is refused, with the numbers, when the
disk cannot hold release + container or when the plan says this machine cannot run the model.

Each file is written to `.waste-partial/NAME.<hash>.part` in the release directory and resumed from its length by
the next fetch, in this process or another (huggingface_hub's own partial files are per process). A partial
longer than the file is deleted (a longer-than-Content-Length shard made every retry fail, seeds'
fetch_weights.sh). The bytes are hashed as they arrive (sha256 for LFS files, git's blob sha1 for the others:
what the Hub publishes); a file that does not match is deleted and fetched again, up to ATTEMPTS times. A
verified file is recorded in `.waste-fetch.json` with its size and mtime, so a later fetch does not re-hash it.
"""
from __future__ import annotations

import errno
import fcntl
import fnmatch
import json
import os
import shutil
import sys
import time
from pathlib import Path

from tqdm import tqdm

from ..errors import WasteError
from ..units import fmt_bytes
from .remote import Remote, RemoteFile, _Retryable, hasher

STATE = ".waste-fetch.json"
PARTIAL = ".waste-partial"
ATTEMPTS = 3
RETRY_SLEEP = 2.0       # seconds, doubled per attempt (tests lower it)
INDEX = "model.safetensors.index.json"
# What conversion reads besides the weights (convert/source.py, convert/text_files.py, text/tokenizer.py)
TEXT_PATTERNS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "tiktoken.model", "*.tiktoken", "tokenization_*.py",
                 "chat_template.jinja", "chat_template.json", "chat.json", "additional_chat_templates/*.jinja",
                 "preprocessor_config.json", "processor_config.json", INDEX)


def select_files(remote: Remote) -> tuple[list[RemoteFile], list[RemoteFile], dict | None]:
    """(text files, weight files, the index) of what conversion needs; refuses a release it cannot convert."""
    files = remote.files
    if "config.json" not in files:
        raise WasteError(f"{remote.repo} has no config.json: it is not a Hugging Face model release waste can convert")
    text = [f for p, f in sorted(files.items()) if any(fnmatch.fnmatchcase(p, pat) for pat in TEXT_PATTERNS)]
    index = None
    if INDEX in files:
        try:
            index = json.loads(remote.read(INDEX))
            shards = sorted(set(index["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as e:
            raise WasteError(f"{remote.repo}/{INDEX} is not a safetensors index ({e})") from None
        missing = [s for s in shards if s not in files]
        if missing:
            raise WasteError(f"{remote.repo}/{INDEX} names {len(missing)} shard(s) the repository does not have: "
                             f"{', '.join(missing[:5])}: the release is incomplete, nothing was downloaded")
    else:
        shards = sorted(p for p in files if p.endswith(".safetensors") and "/" not in p)
    if not shards:
        raise WasteError(f"{remote.repo} has no .safetensors weights at its top level: waste converts safetensors "
                         f"releases")
    return text, [files[s] for s in shards], index


class _Sink:
    """The partial file as http_get writes it: hashes and counts the bytes on their way to disk."""

    def __init__(self, f, rf: RemoteFile, bar):
        self.f, self.rf, self.bar = f, rf, bar
        self.h = hasher(rf)

    def write(self, b) -> int:
        self.f.write(b)
        if self.h is not None:
            self.h.update(b)
        self.bar.update(len(b))
        return len(b)

    def tell(self) -> int:
        return self.f.tell()

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.f.seek(pos, whence)

    def digest(self) -> str | None:
        """The hex digest of everything written (None when a truncation mid-file lost track)."""
        return self.h.hexdigest() if self.h is not None else None

    def truncate(self, size: int | None = None) -> int:
        # http_get truncates when a server ignores the Range and sends the whole file again
        self.digest()
        end = self.f.truncate(size)
        self.h = hasher(self.rf) if end == 0 else None
        return end


def hash_file(path: Path, rf: RemoteFile, bar=None, h=None) -> str:
    h = h or hasher(rf)
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
            if bar is not None:
                bar.update(len(chunk))
    return h.hexdigest()


class Release:
    """A release directory being fetched: its state file, partial files, lock."""

    def __init__(self, root: Path, remote: Remote):
        self.root, self.remote, self.progress = root, remote, False
        self.state_path = root / STATE
        self.state = {"repo": remote.repo, "files": {}}
        if self.state_path.is_file():
            try:
                old = json.loads(self.state_path.read_text())
                if old.get("repo") == remote.repo:
                    self.state = old
            except ValueError:
                pass

    def lock(self):
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.root / ".waste-fetch.lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise WasteError(f"another waste process is fetching into {self.root}: wait for it to finish") from None

    def unlock(self) -> None:
        self._lock.close()

    def save(self, complete: bool = False) -> None:
        self.state.update(revision=self.remote.revision, commit=self.remote.commit, complete=complete)
        tmp = self.state_path.with_name(STATE + ".tmp")
        tmp.write_text(json.dumps(self.state, indent=1) + "\n")
        os.replace(tmp, self.state_path)

    def partial(self, rf: RemoteFile) -> Path:
        return self.root / PARTIAL / f"{rf.path.replace('/', '--')}.{rf.digest[:16]}.part"

    def recorded(self, rf: RemoteFile) -> bool:
        """Verified by an earlier fetch and not touched since (size and mtime as recorded)."""
        rec, p = self.state["files"].get(rf.path), self.root / rf.path
        if not rec or rec.get("digest") != rf.digest or not p.is_file():
            return False
        st = p.stat()
        return st.st_size == rf.size and st.st_mtime_ns == rec.get("mtime_ns")

    def record(self, rf: RemoteFile) -> None:
        self.state["files"][rf.path] = {"size": rf.size, "algo": rf.algo, "digest": rf.digest,
                                        "mtime_ns": (self.root / rf.path).stat().st_mtime_ns}
        self.save()

    def present(self, rf: RemoteFile) -> int:
        """Bytes of this file already here (whole or partial) that the download will not fetch again."""
        if self.recorded(rf):
            return rf.size
        for p in (self.root / rf.path, self.partial(rf)):
            if p.is_file() and p.stat().st_size <= rf.size:
                return p.stat().st_size
        return 0


def _say(msg: str) -> None:
    print(f"waste: {msg}", file=sys.stderr)


def fetch_release(remote: Remote, root: Path, files: list[RemoteFile], progress: bool = True) -> Path:
    """Bring `files` into `root`, each verified; resumes what an earlier (killed) fetch left."""
    rel = Release(root, remote)
    rel.progress = progress
    rel.lock()
    try:
        return _fetch_locked(rel, files, progress)
    except KeyboardInterrupt:       # we download on the main thread, so Ctrl-C lands here at once
        _say(f"fetch stopped; what arrived stays in {root / PARTIAL}: the same command resumes it")
        raise
    finally:
        rel.unlock()


def _fetch_locked(rel: "Release", files: list[RemoteFile], progress: bool) -> Path:
    root, remote = rel.root, rel.remote
    todo = []
    for rf in files:
        if rel.recorded(rf):
            continue
        dst = root / rf.path
        rec = rel.state["files"].get(rf.path)
        if dst.is_file() and rec and rec.get("digest") != rf.digest:
            _say(f"{rf.path} changed on the Hub since the last fetch ({rel.state.get('commit', '?')[:12]}): fetching "
                 f"the new one")
            dst.unlink()
        if dst.is_file():              # there but not recorded: check it, keep it if it is right
            size = dst.stat().st_size
            if size > rf.size:
                _say(f"{rf.path} is {size} bytes, longer than the Hub's {rf.size}: deleted, fetching it again")
                dst.unlink()
            elif size < rf.size:       # an interrupted copy: resume it as a partial
                rel.partial(rf).parent.mkdir(parents=True, exist_ok=True)
                os.replace(dst, rel.partial(rf))
            else:
                with tqdm(total=size, unit="B", unit_scale=True, desc=f"checking {rf.path}", disable=not progress,
                          leave=False) as bar:
                    got = hash_file(dst, rf, bar)
                if got == rf.digest:
                    rel.record(rf)
                    continue
                _say(f"{rf.path} does not match the Hub's {rf.algo} ({got[:12]}... != {rf.digest[:12]}...): deleted, "
                     f"fetching it again")
                dst.unlink()
        todo.append(rf)
    total = sum(rf.size for rf in todo)
    have = sum(rel.present(rf) for rf in todo)
    if todo:
        _say(f"fetching {len(todo)} file(s) of {remote.repo} ({fmt_bytes(total - have)} to download"
             f"{f', resuming {fmt_bytes(have)} already here' if have else ''}) into {root}")
    with tqdm(total=total, initial=have, unit="B", unit_scale=True, desc="downloading",
              disable=not progress or not todo, smoothing=0.1) as bar:
        t = time.monotonic()
        for rf in todo:
            _fetch_one(rel, rf, bar)
        moved, dt = total - have, time.monotonic() - t
    _forget_old(rel, files)
    rel.save(complete=True)
    _say(f"{remote.repo}@{remote.commit[:12]}: {len(files)} files checked against the Hub's hashes"
         + (f"; {fmt_bytes(moved)} downloaded in {dt:.0f} s ({fmt_bytes(moved / max(dt, 1e-3))}/s)" if todo else ""))
    return root


def _forget_old(rel: Release, files: list[RemoteFile]) -> None:
    """Once complete: delete what an earlier revision left (files waste fetched that this one does not list, and
    partial downloads), so that a release directory holds one revision."""
    keep = {rf.path for rf in files}
    for path in [p for p in rel.state["files"] if p not in keep]:
        (rel.root / path).unlink(missing_ok=True)
        del rel.state["files"][path]
    shutil.rmtree(rel.root / PARTIAL, ignore_errors=True)


def _fetch_one(rel: Release, rf: RemoteFile, bar) -> None:
    part, dst = rel.partial(rf), rel.root / rf.path
    part.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, ATTEMPTS + 1):
        have = part.stat().st_size if part.is_file() else 0
        if have > rf.size:
            _say(f"the partial {part.name} is {have} bytes, longer than {rf.path} ({rf.size}): deleted, starting over")
            part.unlink()
            have = 0
        with open(part, "ab") as f:
            sink = _Sink(f, rf, bar)
            if have:       # the resumed prefix is hashed first, so that the whole file is checked
                with tqdm(total=have, unit="B", unit_scale=True, desc=f"checking what is here of {rf.path}",
                          disable=not rel.progress, leave=False) as check:
                    hash_file(part, rf, check, sink.h)
            try:
                if have < rf.size:
                    rel.remote.download(rf.path, sink, offset=have)
            except _Retryable as e:
                if attempt == ATTEMPTS:
                    raise WasteError(f"{e} (gave up after {ATTEMPTS} attempts; run the same command again to resume "
                                     f"from {fmt_bytes(part.stat().st_size)})") from None
                _say(f"{e}: retrying in {RETRY_SLEEP * 2 ** (attempt - 1):.0f} s")     # the partial stays
                time.sleep(RETRY_SLEEP * 2 ** (attempt - 1))
                continue
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise WasteError(f"the disk holding {rel.root} is full while writing {rf.path}: free space and "
                                     f"run the same command again to resume") from None
                if e.errno is not None:
                    raise
                # http_get's size check: the server sent a body of another length than the Hub lists
                _say(f"{rf.path}: {str(e).splitlines()[0]}; deleted, fetching it again")
                f.close()
                _rewind(bar, part.stat().st_size)
                part.unlink()
                if attempt == ATTEMPTS:
                    raise WasteError(f"{rf.path} of {rel.remote.repo} came back {ATTEMPTS} times with another size "
                                     f"than the Hub lists ({rf.size} bytes): try again later") from None
                continue
            f.flush()
            got = sink.digest()
        size = part.stat().st_size
        if got is None and size == rf.size:
            got = hash_file(part, rf)
        if size == rf.size and got == rf.digest:
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(part, dst)
            rel.record(rf)
            return
        why = (f"is {size} bytes, the Hub lists {rf.size}" if size != rf.size else
               f"has {rf.algo} {got[:12]}..., the Hub lists {rf.digest[:12]}...")
        _say(f"{rf.path} {why}: deleted, fetching it again" if attempt < ATTEMPTS else f"{rf.path} {why}")
        _rewind(bar, size)
        part.unlink()
    raise WasteError(f"{rf.path} of {rel.remote.repo} failed its check {ATTEMPTS} times (size or hash differs from "
                     f"the Hub's listing): the server or the network is damaging it; try again later")


def _rewind(bar, n: int) -> None:
    bar.update(-n)


def disk_free(path: Path) -> int:
    """Free bytes on the filesystem that holds `path` (or would: its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def _device(path: Path) -> int:
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return p.stat().st_dev


def check_disk(repo: str, release_root: Path, release_missing: int, release_total: int,
               container_path: Path | None, container_bytes: int) -> None:
    """Refuse, with the numbers, when the release's missing bytes plus the container do not fit."""
    need: dict[int, list] = {}
    dev = _device(release_root)
    need.setdefault(dev, [release_root, 0, []])
    need[dev][1] += release_missing
    need[dev][2].append(f"{fmt_bytes(release_missing)} still to download of the {fmt_bytes(release_total)} release")
    if container_path is not None and container_bytes:
        dev = _device(container_path)
        need.setdefault(dev, [container_path, 0, []])
        need[dev][1] += container_bytes
        need[dev][2].append(f"about {fmt_bytes(container_bytes)} for the converted container")
    for where, n, parts in need.values():
        free = disk_free(where)
        if n > free:
            raise WasteError(f"not enough disk for {repo}: it needs {fmt_bytes(n)} ({' + '.join(parts)}) but the "
                             f"filesystem of {where} has {fmt_bytes(free)} free. Free {fmt_bytes(n - free)}, or put "
                             f"the release elsewhere with --dir DIR (containers go into WASTE_CACHE_DIR); nothing "
                             f"was downloaded")
