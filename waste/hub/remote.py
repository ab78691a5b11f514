"""One model repository on the Hub, through huggingface_hub: its file list with sizes and hashes, small files
read into memory, safetensors headers by range request, and a file's bytes from an offset (resume).

huggingface_hub owns the HTTP: auth (HF_TOKEN or its login), redirects (the token is dropped when an LFS file
redirects to another host), retries of transient errors within a call. Its errors become WasteErrors here, with
what to do; a 401 says both things it can mean (no such repo, or private/gated without a token).
"""
from __future__ import annotations

import hashlib
import io
import os
import sys
from dataclasses import dataclass

from tqdm import tqdm

from ..errors import WasteError


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    algo: str           # "sha256" for LFS files, "git-sha1" (git's blob id) for the rest: what the Hub publishes
    digest: str


def hasher(rf: RemoteFile):
    """sha256 for LFS files; git's blob id (sha1 of "blob SIZE\\0" + bytes) for the others."""
    if rf.algo == "sha256":
        return hashlib.sha256()
    h = hashlib.sha1()
    h.update(b"blob %d\0" % rf.size)
    return h


class _Silent(tqdm):
    """huggingface_hub's own per-file bar, switched off: waste draws one bar for the whole fetch."""

    def __init__(self, *a, **k):
        k["disable"] = True
        super().__init__(*a, **k)


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _transport_errors() -> tuple:
    try:
        import httpx2 as hx
    except ImportError:   # older huggingface_hub releases use httpx
        import httpx as hx
    return (hx.TransportError,)


class Remote:
    def __init__(self, repo: str, revision: str | None = None):
        from huggingface_hub import HfApi, get_token

        self.repo, self.revision = repo, revision or "main"
        self.endpoint, self.token = endpoint(), get_token()
        self.api = HfApi(endpoint=self.endpoint, token=self.token)
        self.commit: str | None = None
        self.files: dict[str, RemoteFile] = {}

    def describe(self) -> "Remote":
        """Resolve the revision to a commit and list every file with its size and hash."""
        with self.errors():
            info = self.api.model_info(self.repo, revision=self.revision, files_metadata=True)
        self.commit = info.sha
        for s in info.siblings or []:
            if s.rfilename.startswith("/") or ".." in s.rfilename.split("/"):
                raise WasteError(f"the Hub listed a file {s.rfilename!r} for {self.repo} outside the repository: refused")
            if s.lfs is not None:
                self.files[s.rfilename] = RemoteFile(s.rfilename, s.lfs.size, "sha256", s.lfs.sha256)
            elif s.size is not None and s.blob_id:
                self.files[s.rfilename] = RemoteFile(s.rfilename, s.size, "git-sha1", s.blob_id)
        if not self.commit or not self.files:
            raise WasteError(f"the Hub listed no files for {self.repo} at {self.revision}: is it a model repository?")
        return self

    def url(self, path: str) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(self.repo, path, revision=self.commit, endpoint=self.endpoint)

    def download(self, path: str, sink, offset: int = 0) -> None:
        """Write the file's bytes from `offset` on into `sink` (a Range request when offset > 0)."""
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils import build_hf_headers

        headers = build_hf_headers(token=self.token)
        headers["Accept-Encoding"] = "identity"     # the bytes as stored: a resumed range must line up
        with self.errors(path):
            try:
                http_get(self.url(path), sink, resume_size=offset, headers=headers,
                         expected_size=self.files[path].size, displayed_filename=path, tqdm_class=_Silent)
            except ValueError as e:     # http_get refuses a file over 50 GB from its start without hf_xet
                raise WasteError(f"{self.repo}/{path}: {e}") from None

    def read(self, path: str, attempts: int = 3) -> bytes:
        """A small file, into memory (config.json, the safetensors index), checked like a fetched one."""
        rf = self.files[path]
        for _ in range(attempts):
            buf = io.BytesIO()
            try:
                self.download(path, buf)
            except OSError as e:      # http_get's size check
                if e.errno is not None:
                    raise
                continue
            h = hasher(rf)
            h.update(buf.getvalue())
            if h.hexdigest() == rf.digest:
                return buf.getvalue()
            print(f"waste: {path} came back with another {rf.algo} than the Hub lists: reading it again",
                  file=sys.stderr)
        raise WasteError(f"{self.repo}/{path} came back {attempts} times with another size or hash than the Hub "
                         f"lists: try again later")

    def safetensors_header(self, path: str) -> dict[str, tuple[str, list[int]]]:
        """Tensor name -> (dtype, shape) of one remote safetensors file, read by range request."""
        with self.errors(path):
            meta = self.api.parse_safetensors_file_metadata(self.repo, path, revision=self.commit)
        return {k: (t.dtype, list(t.shape)) for k, t in meta.tensors.items()}

    def errors(self, path: str | None = None):
        return _HubErrors(self, path)


class _HubErrors:
    """Turns huggingface_hub's exceptions into one WasteError each, naming the repo and what to do."""

    def __init__(self, remote: Remote, path: str | None):
        self.r, self.path = remote, path

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or isinstance(e, (WasteError, KeyboardInterrupt)):
            return False
        from huggingface_hub import errors as he

        r, what = self.r, f"{self.r.repo}/{self.path}" if self.path else self.r.repo
        status = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(e, he.OfflineModeIsEnabled):
            raise WasteError(f"HF_HUB_OFFLINE is set, so waste does not ask the Hub about {r.repo}: unset it to fetch, "
                             f"or run a model already in the cache (`waste list`)") from None
        if isinstance(e, he.GatedRepoError):
            msg = (f"{r.repo} is gated: accept its terms at {r.endpoint}/{r.repo} with your account, then set HF_TOKEN "
                   f"to one of your tokens (or run `hf auth login`)")
        elif isinstance(e, he.RepositoryNotFoundError):
            if r.token:
                msg = (f"{r.repo}: the Hub answered {status}: no such model, or the token in use (HF_TOKEN or `hf auth "
                       f"login`) cannot read it. Check the name, and that the token has access")
            else:
                msg = (f"{r.repo}: the Hub answered {status}: no such model (nor a directory of that name here), "
                       f"or it is private or gated and no token "
                       f"was sent. Check the name; for a private or gated model set HF_TOKEN to an access token (or "
                       f"run `hf auth login`)")
        elif isinstance(e, he.RevisionNotFoundError):
            msg = f"{r.repo} has no revision {r.revision!r}: give a branch, tag or commit of it with --revision"
        elif isinstance(e, he.RemoteEntryNotFoundError):
            msg = f"{what}: the Hub has no such file at {r.commit or r.revision} (404): the release is incomplete"
        elif isinstance(e, he.HfHubHTTPError):
            msg = f"{what}: the Hub answered {status}: {str(e).splitlines()[0]}; try again later"
        elif isinstance(e, _transport_errors()):
            msg = f"cannot reach the Hub at {r.endpoint} ({type(e).__name__}: {e}): check the network or HF_ENDPOINT"
        else:
            return False
        raise _Retryable(msg, status) if status is None or status >= 500 or status == 429 else WasteError(msg) from None


class _Retryable(WasteError):
    """A failure that a later attempt may not meet (network, 5xx, 429)."""

    def __init__(self, msg: str, status: int | None):
        super().__init__(msg)
        self.status = status
