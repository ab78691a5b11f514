"""Assemble the training corpus: the Python standard library's own `.py` sources.

The corpus is whatever `sysconfig.get_paths()["stdlib"]` holds on the machine that runs this, so it
needs no download; its licence is the PSF License (the standard library's). Files are taken in sorted
order of their path relative to the stdlib root, read as UTF-8, and assigned to a split by a hash of
that relative path alone, so the same stdlib always gives the same corpus and the same split.

    python3 training/prepare_corpus.py --out .scratch/corpus      # writes manifest.tsv + summary.json

What is left out, and why:
  * site-packages/, dist-packages/: third-party code under other licences;
  * encodings/: mostly generated codec tables (256-entry maps), not code anyone writes;
  * __pycache__/ and anything not ending in `.py`;
  * files that are not valid UTF-8 or contain NUL bytes (a few deliberately broken test inputs).
Everything else, the test suite, idlelib, tkinter and lib2to3 included, goes in: the stdlib is small
(~10-30 MB of source) and a 15 M-parameter model is data-limited on it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import sysconfig
import tarfile

EXCLUDED_DIRS = ("site-packages", "dist-packages", "encodings", "__pycache__")
EXCLUDED_PREFIXES = ("_sysconfigdata",)  # generated at build time, holds the build machine's paths
PACK_SOURCE = "SOURCE.json"
SEPARATOR = "<|endoftext|>"

# split by sha256(relative path): bucket = first 8 hex digits as int, mod 1000
TEST_BUCKETS = range(0, 20)    # 2 %: held-out text for the reported loss/perplexity and routing trace
VAL_BUCKETS = range(20, 30)    # 1 %: validation during training (checkpoint selection)


def split_of(relpath: str) -> str:
    b = int(hashlib.sha256(relpath.encode("utf-8")).hexdigest()[:8], 16) % 1000
    if b in TEST_BUCKETS:
        return "test"
    if b in VAL_BUCKETS:
        return "val"
    return "train"


def _wanted(rel: str) -> bool:
    parts = rel.split("/")
    return (rel.endswith(".py") and not any(p in EXCLUDED_DIRS for p in parts[:-1])
            and not parts[-1].startswith(EXCLUDED_PREFIXES))


def this_python() -> dict:
    return {"python_version": platform.python_version(), "python_implementation": platform.python_implementation(),
            "sys_version": sys.version}


def collect(root: str | None = None, max_files: int | None = None) -> dict:
    """Read the corpus and return {"root", "source", "files": [{path, bytes, sha256, split, text}], "skipped"}.

    `root` is a stdlib folder (default: this interpreter's) or a tarball made by --pack."""
    root = os.path.realpath(root or sysconfig.get_paths()["stdlib"])
    if os.path.isfile(root):
        with tarfile.open(root, "r:*") as tf:
            blobs = {}
            source = None
            for m in tf.getmembers():
                if not m.isfile():
                    continue
                data = tf.extractfile(m).read()
                if m.name == PACK_SOURCE:
                    source = json.loads(data)
                else:
                    blobs[m.name] = data
        source = dict(source or {}, packed_tarball=os.path.basename(root), packed_tarball_sha256=_sha256_path(root))
        read = blobs.__getitem__
        rels = sorted(r for r in blobs if _wanted(r))
    else:
        source = dict(this_python(), stdlib_root=root)
        rels = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
            for fn in filenames:
                full = os.path.join(dirpath, fn)
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                if _wanted(rel) and os.path.isfile(full):
                    rels.append(rel)
        rels.sort()

        def read(rel):
            with open(os.path.join(root, rel), "rb") as f:
                return f.read()
    files, skipped = [], []
    for rel in rels:
        raw = read(rel)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append((rel, "not utf-8"))
            continue
        if "\x00" in text:
            skipped.append((rel, "NUL byte"))
            continue
        if SEPARATOR in text:
            skipped.append((rel, "contains the separator token"))
            continue
        files.append({"path": rel, "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest(),
                      "split": split_of(rel), "text": text})
        if max_files and len(files) >= max_files:
            break
    return {"root": root, "source": source, "files": files, "skipped": skipped}


def summary(corpus: dict) -> dict:
    """Counts and a digest over the sorted (path, sha256) list: what the run record keeps."""
    out = {
        "source": "Python standard library .py files (PSF License)",
        **corpus["source"],
        "read_from": corpus["root"],
        "excluded_dirs": list(EXCLUDED_DIRS),
        "excluded_name_prefixes": list(EXCLUDED_PREFIXES),
        "skipped": [f"{p} ({why})" for p, why in corpus["skipped"]] + corpus["source"].get("skipped_when_packed", []),
        "split_rule": "bucket = int(sha256(relpath)[:8], 16) % 1000; test: 0-19, val: 20-29, train: rest",
        "separator": SEPARATOR,
    }
    all_lines = "".join(f"{f['path']}\t{f['sha256']}\n" for f in corpus["files"])
    out["all"] = {"files": len(corpus["files"]), "bytes": sum(f["bytes"] for f in corpus["files"]),
                  "sha256_of_path_sha256_list": hashlib.sha256(all_lines.encode()).hexdigest()}
    for sp in ("train", "val", "test"):
        fs = [f for f in corpus["files"] if f["split"] == sp]
        lines = "".join(f"{f['path']}\t{f['sha256']}\n" for f in fs)
        out[sp] = {"files": len(fs), "bytes": sum(f["bytes"] for f in fs),
                   "sha256_of_path_sha256_list": hashlib.sha256(lines.encode()).hexdigest()}
    return out


def manifest_tsv(corpus: dict) -> str:
    """One line a file: path, bytes, sha256, split (sorted by path)."""
    head = "# path\tbytes\tsha256\tsplit\n"
    return head + "".join(f"{f['path']}\t{f['bytes']}\t{f['sha256']}\t{f['split']}\n" for f in corpus["files"])


def split_texts(corpus: dict, split: str) -> list[str]:
    return [f["text"] for f in corpus["files"] if f["split"] == split]


def _sha256_path(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def pack(corpus: dict, path: str) -> None:
    """Write the selected files to a deterministic tarball (sorted, mtime 0, root-owned) with SOURCE.json."""
    import gzip
    import io

    with open(path, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tf:
        def add(name, data):
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = len(data), 0, 0o644, 0, 0, "", ""
            tf.addfile(ti, io.BytesIO(data))

        source = dict(corpus["source"], skipped_when_packed=[f"{p} ({why})" for p, why in corpus["skipped"]])
        add(PACK_SOURCE, json.dumps(source, indent=1, sort_keys=True).encode())
        for f in corpus["files"]:
            add(f["path"], f["text"].encode("utf-8"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for manifest.tsv, summary.json and {train,val,test}.txt")
    ap.add_argument("--root", default=None, help="stdlib folder or a tarball made by --pack (default: this interpreter's stdlib)")
    ap.add_argument("--pack", default=None, help="also write the selected files to this .tar.gz (with SOURCE.json)")
    ap.add_argument("--text", action="store_true", help="also write the split texts, files joined by the separator")
    a = ap.parse_args(argv)
    corpus = collect(a.root)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "manifest.tsv"), "w") as f:
        f.write(manifest_tsv(corpus))
    s = summary(corpus)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(s, f, indent=1)
    if a.pack:
        pack(corpus, a.pack)
        print(f"packed {len(corpus['files'])} files into {a.pack} (sha256 {_sha256_path(a.pack)})")
    if a.text:
        for sp in ("train", "val", "test"):
            with open(os.path.join(a.out, f"{sp}.txt"), "w") as f:
                f.write(SEPARATOR.join(split_texts(corpus, sp)))
    print(json.dumps({k: s.get(k) for k in ("python_version", "read_from", "all", "train", "val", "test")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
