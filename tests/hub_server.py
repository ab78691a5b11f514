"""A Hub-compatible HTTP server on 127.0.0.1 for the tests: the endpoints huggingface_hub's client uses to list a
model repository and download its files, no more.

  GET  /api/models/ORG/NAME[/revision/REV][?blobs=true]   model info: commit sha, private, siblings with
                                                           size, blobId and lfs {sha256, size} when blobs=true
  HEAD|GET /ORG/NAME/resolve/REV/PATH     X-Repo-Commit, ETag; a plain file is served here; an LFS file
                                           redirects (302) to /lfs/SHA256 on the host name `localhost` (another
                                           origin than 127.0.0.1, as the Hub's CDN is) with X-Linked-Size/-Etag
  GET  /lfs/SHA256                        the LFS blob, with Range
Private repos want `Authorization: Bearer TOKEN`; a missing repo or a private one without it answers 401 with
X-Error-Code RepoNotFound, as the Hub does. Faults injected per file (each consumed by one GET of its bytes):
corrupt (one byte changed), overlong (extra bytes, Content-Length says so), slow (sent in small timed pieces),
missing (404 although listed), unavailable (one 503 from resolve). Every request is logged: (method, path, range, authorization present, bytes sent).
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", "tokenizer.json")


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str
    private: bool = False
    gated: bool = False
    faults: dict[str, list] = field(default_factory=dict)   # path -> faults, consumed in order

    def is_lfs(self, path: str) -> bool:
        return path.endswith(LFS_SUFFIXES)


class HubServer:
    def __init__(self, token: str = "hf_test_token"):
        self.repos: dict[str, Repo] = {}
        self.token = token
        self.log: list[dict] = []
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def add(self, repo_id: str, folder: Path | None = None, files: dict[str, bytes] | None = None,
            private: bool = False, gated: bool = False) -> Repo:
        files = dict(files or {})
        if folder is not None:
            files.update({p.relative_to(folder).as_posix(): p.read_bytes()
                          for p in sorted(Path(folder).rglob("*")) if p.is_file()})
        commit = hashlib.sha1(repr(sorted((k, git_sha1(v)) for k, v in files.items())).encode()).hexdigest()
        self.repos[repo_id] = Repo(files, commit, private, gated)
        return self.repos[repo_id]

    def gets(self, path_suffix: str) -> list[dict]:
        """Logged GETs that carried file bytes whose URL ends with path_suffix (the resolve URL or an LFS blob)."""
        return [r for r in self.log if r["method"] == "GET" and r["path"].endswith(path_suffix)]

    def blob_gets(self, repo: Repo, path: str) -> list[dict]:
        key = hashlib.sha256(repo.files[path]).hexdigest() if repo.is_lfs(path) else f"/resolve/{repo.commit}/{path}"
        return [r for r in self.log if r["method"] == "GET" and r["path"].endswith(key) and r["sent"] > 0]


def _handler(hub: HubServer):
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_HEAD(self):
            self._route(head=True)

        def do_GET(self):
            self._route(head=False)

        def _record(self, sent: int):
            with hub.lock:
                hub.log.append({"method": self.command, "path": urlsplit(self.path).path,
                                "range": self.headers.get("Range"), "auth": "Authorization" in self.headers,
                                "host": self.headers.get("Host"), "sent": sent})

        def _reply(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, str(v))
            if "Content-Length" not in (headers or {}):
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)
            self._record(0 if head else len(body))

        def _error(self, status: int, code: str, msg: str, head: bool, commit: str | None = None):
            h = {"X-Error-Code": code, "X-Error-Message": msg, "Content-Type": "application/json"}
            if commit:
                h["X-Repo-Commit"] = commit
            self._reply(status, json.dumps({"error": msg}).encode(), h, head)

        def _repo(self, repo_id: str, head: bool) -> Repo | None:
            repo = hub.repos.get(repo_id)
            authed = self.headers.get("Authorization") == f"Bearer {hub.token}"
            if repo is None or (repo.private and not authed):
                # the Hub's answer for a missing repo and for a private one without a (good) token is the same
                status = 404 if authed else 401
                self._error(status, "RepoNotFound", "Repository not found", head)
                return None
            if repo.gated and not authed:
                self._error(403, "GatedRepo", "Access to this model is restricted", head)
                return None
            return repo

        def _route(self, head: bool):
            u = urlsplit(self.path)
            parts = [unquote(p) for p in u.path.split("/")[1:]]
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo = self._repo(f"{parts[2]}/{parts[3]}", head)
                if repo is not None:
                    self._info(f"{parts[2]}/{parts[3]}", repo, parts[4:], "blobs" in parse_qs(u.query), head)
                return
            if parts[:1] == ["lfs"] and len(parts) == 2:
                for repo in hub.repos.values():
                    for path, data in repo.files.items():
                        if repo.is_lfs(path) and hashlib.sha256(data).hexdigest() == parts[1]:
                            return self._bytes(repo, path, data, head)
                return self._reply(404, b"no such blob", head=head)
            if len(parts) >= 5 and parts[2] == "resolve":
                repo = self._repo(f"{parts[0]}/{parts[1]}", head)
                if repo is None:
                    return
                rev, path = parts[3], "/".join(parts[4:])
                if rev not in ("main", repo.commit):
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
                faults = repo.faults.get(path) or []
                if faults and faults[0] == "unavailable":
                    faults.pop(0)
                    return self._error(503, "Unavailable", "Service unavailable", head, repo.commit)
                if path not in repo.files or (faults and faults[0] == "missing"):
                    return self._error(404, "EntryNotFound", "Entry not found", head, repo.commit)
                data = repo.files[path]
                if repo.is_lfs(path):
                    sha = hashlib.sha256(data).hexdigest()
                    return self._reply(302, b"", {"Location": f"http://localhost:{hub.port}/lfs/{sha}",
                                                  "X-Repo-Commit": repo.commit, "ETag": f'"{git_sha1(data)}"',
                                                  "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": len(data)}, head)
                return self._bytes(repo, path, data, head, {"X-Repo-Commit": repo.commit,
                                                            "ETag": f'"{git_sha1(data)}"'})
            self._reply(404, b"not found", head=head)

        def _info(self, repo_id: str, repo: Repo, rest: list[str], blobs: bool, head: bool):
            if rest and (rest[0] != "revision" or rest[1] not in ("main", repo.commit)):
                return self._error(404, "RevisionNotFound", "Invalid rev id", head)
            siblings = []
            for path, data in sorted(repo.files.items()):
                s = {"rfilename": path}
                if blobs:
                    s.update(size=len(data), blobId=git_sha1(data))
                    if repo.is_lfs(path):
                        s["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                siblings.append(s)
            body = json.dumps({"_id": repo_id, "id": repo_id, "modelId": repo_id, "sha": repo.commit,
                               "private": repo.private, "gated": False, "disabled": False, "downloads": 0,
                               "likes": 0, "tags": [], "siblings": siblings}).encode()
            self._reply(200, body, {"Content-Type": "application/json"}, head)

        def _bytes(self, repo: Repo, path: str, data: bytes, head: bool, extra: dict | None = None):
            h = dict(extra or {}, **{"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"})
            start, end, status = 0, len(data) - 1, 200
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes="):
                a, _, b = rng[6:].partition("-")
                start, end = int(a), min(int(b) if b else len(data) - 1, len(data) - 1)
                if start >= len(data):
                    return self._reply(416, b"", {"Content-Range": f"bytes */{len(data)}"}, head)
                status = 206
                h["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            body = data[start:end + 1]
            fault = None
            if not head and repo.faults.get(path) and rng != "bytes=0-100000" and not (rng or "").startswith("bytes=8-"):
                fault = repo.faults[path].pop(0)       # header reads (range requests) are not hit
            if fault == "corrupt":
                body = body[:len(body) // 2] + bytes([body[len(body) // 2] ^ 0xFF]) + body[len(body) // 2 + 1:]
            elif fault == "overlong":
                body = body + b"\0" * 4096
            h["Content-Length"] = len(body)
            self.send_response(status)
            for k, v in h.items():
                self.send_header(k, str(v))
            self.end_headers()
            sent = 0
            if not head:
                step = 4096 if fault == "slow" else 1 << 20
                try:
                    for i in range(0, len(body), step):
                        self.wfile.write(body[i:i + step])
                        self.wfile.flush()
                        sent += len(body[i:i + step])
                        if fault == "slow":
                            time.sleep(0.03)
                except (BrokenPipeError, ConnectionResetError):
                    pass
            self._record(sent)

    return H


if __name__ == "__main__":     # python tests/hub_server.py FOLDER ORG/NAME: serve one folder until killed
    import sys

    with HubServer() as hub:
        hub.add(sys.argv[2], Path(sys.argv[1]))
        print(hub.url, flush=True)
        hub.thread.join()
