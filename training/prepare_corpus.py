"""Assemble the training corpus: the CPython standard library's `.py` sources plus the pure-Python
sources of permissively licensed packages installed beside it.

    python3.11 training/prepare_corpus.py --out .scratch/corpus --pack .scratch/pycode-v2.tar.xz

Everything is read from the interpreter that runs this (no download): its standard library
(`sysconfig.get_paths()["stdlib"]`, PSF License) and, unless --stdlib-only, the installed distributions
named in PACKAGES (their `.py` files as listed in each distribution's RECORD), each checked to be at the
pinned version so that the same command always selects the same files. Files are taken in sorted order
of their corpus path: stdlib files keep their path relative to the stdlib root (as in the first corpus, so
they fall into the same split), package files are named `site-packages/<path in site-packages>`. The
split is a hash of that path alone.

What is left out, and why:
  stdlib (as in the first corpus, tiny-py-moe-v1):
  * site-packages/, dist-packages/: third-party code; encodings/: generated codec tables;
  * __pycache__/, `_sysconfigdata*` (the build machine's paths), anything not ending in `.py`;
  packages:
  * vendored code (`_vendor/`, `vendor/`, `_vendored/`, `third_party/`): other projects, other licences;
  * files over MAX_PACKAGE_FILE_BYTES and the generated-data files in GENERATED (tables, generated
    parsers, benchmark inputs) and transformers' `modular_*.py` (near-copies of the generated
    `modeling_*.py` files next to them);
  * empty files, and files whose bytes equal an earlier file of the corpus (vendored or copied twice);
  all:
  * files that are not valid UTF-8, contain NUL bytes or contain the separator token.

The packed tarball (--pack) is byte-reproducible: SOURCE.json (the per-source record) first, then the
members in reading order (the stdlib sorted by path, then each package in PACKAGES order, its files sorted),
mtime 0, uid/gid 0, no owner names, xz (preset 9, extreme) written by Python's lzma. Read back, the corpus
is sorted by path again.
"""
from __future__ import annotations

import argparse
import fnmatch
import hashlib
import io
import json
import os
import platform
import sys
import sysconfig
import tarfile

EXCLUDED_DIRS = ("site-packages", "dist-packages", "encodings", "__pycache__")
EXCLUDED_PREFIXES = ("_sysconfigdata",)  # generated at build time, holds the build machine's paths
VENDORED_DIRS = ("_vendor", "vendor", "_vendored", "third_party", "__pycache__")
MAX_PACKAGE_FILE_BYTES = 500_000
GENERATED = (  # fnmatch patterns on the path inside site-packages
    "torch/testing/_internal/generated/*",
    "torch/sparse/_triton_ops_meta.py",
    "transformers/*/modular_*.py",
    "pygments/lexers/_*_builtins.py",
    "pygments/lexers/_mapping.py",
    "idna/idnadata.py",
    "idna/uts46data.py",
    "sympy/parsing/*/_antlr/*",
    "sympy/polys/benchmarks/bench_solvers.py",
)
PACK_SOURCE = "SOURCE.json"
SEPARATOR = "<|endoftext|>"
PKG_PREFIX = "site-packages/"

# (distribution, pinned version, licence as read from its metadata and licence files). Only licences that
# allow redistribution and use without copyleft: BSD, MIT, Apache-2.0, PSF. The version pin makes the
# selection reproducible; a different installed version is an error.
PACKAGES = (
    ("attrs", "26.1.0", "MIT"),
    ("charset-normalizer", "3.4.7", "MIT"),
    ("click", "8.5.1", "BSD-3-Clause"),
    ("flask", "3.1.3", "BSD-3-Clause"),
    ("huggingface-hub", "2.4.0", "Apache-2.0"),
    ("idna", "3.20", "BSD-3-Clause"),
    ("itsdangerous", "2.2.0", "BSD-3-Clause"),
    ("jinja2", "3.1.6", "BSD-3-Clause"),
    ("markupsafe", "3.0.3", "BSD-3-Clause"),
    ("mpmath", "1.3.0", "BSD-3-Clause"),
    ("networkx", "3.6.1", "BSD-3-Clause"),
    ("numpy", "2.4.6", "BSD-3-Clause AND 0BSD AND MIT AND Zlib AND CC0-1.0"),
    ("packaging", "26.2", "Apache-2.0 OR BSD-2-Clause"),
    ("pip", "23.2.1", "MIT"),
    ("pluggy", "1.6.0", "MIT"),
    ("pydantic", "2.13.4", "MIT"),
    ("pydantic-core", "2.46.4", "MIT"),
    ("pygments", "2.20.0", "BSD-2-Clause"),
    ("pytest", "9.0.3", "MIT"),
    ("requests", "2.34.2", "Apache-2.0"),
    ("rich", "15.0.0", "MIT"),
    ("safetensors", "0.8.0", "Apache-2.0"),
    ("scipy", "1.17.1", "BSD-3-Clause (bundled parts: see scipy's LICENSES_bundled.txt; BSD/MIT/BSL-1.0)"),
    ("setuptools", "84.2.1", "MIT"),
    ("sympy", "1.14.0", "BSD-3-Clause"),
    ("tokenizers", "0.23.3", "Apache-2.0"),
    ("torch", "2.13.0+cpu", "BSD-3-Clause (metadata: Apache-2.0 AND Apache-2.0 WITH LLVM-exception AND BSD-2-Clause AND BSD-3-Clause AND BSL-1.0 AND MIT)"),
    ("transformers", "5.24.0", "Apache-2.0"),
    ("urllib3", "2.7.0", "MIT"),
    ("werkzeug", "3.1.8", "BSD-3-Clause"),
)

# split by sha256(corpus path): bucket = first 8 hex digits as int, mod 1000
TEST_BUCKETS = range(0, 20)    # 2 %: held-out text for the reported loss/perplexity and routing trace
VAL_BUCKETS = range(20, 30)    # 1 %: validation during training (checkpoint selection)


def split_of(relpath: str) -> str:
    b = int(hashlib.sha256(relpath.encode("utf-8")).hexdigest()[:8], 16) % 1000
    if b in TEST_BUCKETS:
        return "test"
    if b in VAL_BUCKETS:
        return "val"
    return "train"


def top_level(path: str) -> str | None:
    """The first component of a site-packages path (a package folder or a module file), None for stdlib."""
    return path[len(PKG_PREFIX):].split("/")[0] if path.startswith(PKG_PREFIX) else None


def source_of(path: str, top_to_dist: dict) -> str:
    """'stdlib' or the distribution a site-packages path belongs to."""
    t = top_level(path)
    return "stdlib" if t is None else top_to_dist.get(t, t)


def _wanted_stdlib(rel: str) -> bool:
    parts = rel.split("/")
    return (rel.endswith(".py") and not any(p in EXCLUDED_DIRS for p in parts[:-1])
            and not parts[-1].startswith(EXCLUDED_PREFIXES))


def _package_exclusion(rel: str, size: int) -> str | None:
    parts = rel.split("/")
    if any(p in VENDORED_DIRS for p in parts[:-1]):
        return "vendored"
    if any(fnmatch.fnmatchcase(rel, pat) for pat in GENERATED):
        return "generated data"
    if size > MAX_PACKAGE_FILE_BYTES:
        return f"over {MAX_PACKAGE_FILE_BYTES} bytes"
    if size == 0:
        return "empty"
    return None


def this_python() -> dict:
    return {"python_version": platform.python_version(), "python_implementation": platform.python_implementation(),
            "sys_version": sys.version}


def _metadata_licence(dist) -> str:
    m = dist.metadata
    lic = m.get("License-Expression") or (m.get("License") or "").strip().splitlines()[:1]
    if isinstance(lic, list):
        lic = lic[0] if lic else ""
    cls = [c.split("::")[-1].strip() for c in (m.get_all("Classifier") or []) if c.startswith("License ::")]
    return "; ".join(x for x in [lic[:120]] + cls if x)


def _stdlib_files(root: str) -> list[tuple[str, str]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for fn in filenames:
            full = os.path.join(dirpath, fn)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if _wanted_stdlib(rel) and os.path.isfile(full):
                out.append((rel, full))
    return sorted(out)


def _package_files(packages) -> tuple[list[tuple[str, str, str]], list[dict], list[tuple[str, str]]]:
    """[(corpus path, file on disk, dist)], per-dist info, [(path, why)] excluded before reading."""
    import importlib.metadata as md

    files, info, skipped = [], [], []
    for name, version, licence in packages:
        dist = md.distribution(name)
        if dist.version != version:
            raise SystemExit(f"{name} is {dist.version} here, the corpus pins {version}")
        site = os.path.realpath(str(dist.locate_file("")))
        n, tops = 0, set()
        for f in sorted(dist.files or [], key=str):
            rel = str(f).replace(os.sep, "/")
            if not rel.endswith(".py") or rel.startswith("../"):
                continue
            full = os.path.realpath(str(dist.locate_file(f)))
            if not os.path.isfile(full):
                continue
            why = _package_exclusion(rel, os.path.getsize(full))
            if why:
                skipped.append((PKG_PREFIX + rel, why))
                continue
            files.append((PKG_PREFIX + rel, full, name))
            tops.add(rel.split("/")[0])
            n += 1
        info.append({"dist": name, "version": version, "licence": licence, "metadata_licence": _metadata_licence(dist),
                     "site_packages": site, "py_files_listed": n, "top_level": sorted(tops)})
    return files, info, skipped


def collect(root: str | None = None, max_files: int | None = None, packages=PACKAGES) -> dict:
    """Read the corpus and return {"root", "source", "files": [{path, bytes, sha256, split, source, text}], "skipped"}.

    `root` is a stdlib folder (default: this interpreter's, plus `packages` from its site-packages) or a
    tarball made by --pack (then exactly its members are the corpus)."""
    root = os.path.realpath(root or sysconfig.get_paths()["stdlib"])
    skipped = []
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
                elif m.name.endswith(".py"):
                    blobs[m.name] = data
        source = dict(source or {}, packed_tarball=os.path.basename(root), packed_tarball_sha256=_sha256_path(root))
        entries = [(rel, None, None) for rel in sorted(blobs)]
        read = lambda rel, full: blobs[rel]  # noqa: E731
        dedup = False  # the packer already did it
    else:
        source = dict(this_python(), stdlib_root=root)
        entries = [(rel, full, None) for rel, full in _stdlib_files(root)]
        if packages:
            pfiles, pinfo, pskipped = _package_files(packages)
            entries += pfiles
            skipped += pskipped
            source["packages"] = pinfo
            source["package_rules"] = {"vendored_dirs": list(VENDORED_DIRS), "max_file_bytes": MAX_PACKAGE_FILE_BYTES,
                                       "generated": list(GENERATED),
                                       "duplicates": "a package file whose bytes equal an earlier corpus file's is left out"}

        def read(rel, full):
            with open(full, "rb") as f:
                return f.read()
        dedup = True
    top_to_dist = {t: p["dist"] for p in source.get("packages", []) for t in p.get("top_level", [])}
    files, seen = [], {}
    for rel, full, _ in entries:
        raw = read(rel, full)
        digest = hashlib.sha256(raw).hexdigest()
        if dedup and rel.startswith(PKG_PREFIX) and digest in seen:
            skipped.append((rel, f"duplicate of {seen[digest]}"))
            continue
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
        seen.setdefault(digest, rel)
        files.append({"path": rel, "bytes": len(raw), "sha256": digest, "split": split_of(rel),
                      "source": source_of(rel, top_to_dist), "text": text})
        if max_files and len(files) >= max_files:
            break
    # duplicates are found in reading order (stdlib first, then the packages in PACKAGES order), which is
    # also the order of the packed tarball's members; the corpus itself (manifest, digests, the order of the
    # text) is sorted by path, the same whether it is read from the folders or from the tarball
    pack_order = [f["path"] for f in files]
    files.sort(key=lambda f: f["path"])
    return {"root": root, "source": source, "files": files, "skipped": skipped, "top_to_dist": top_to_dist,
            "pack_order": pack_order}


def _digest(files) -> str:
    return hashlib.sha256("".join(f"{f['path']}\t{f['sha256']}\n" for f in files).encode()).hexdigest()


def summary(corpus: dict) -> dict:
    """Counts and digests over the sorted (path, sha256) lists: what the run record keeps."""
    out = {
        "source": "CPython standard library .py files (PSF License) and the .py files of permissively licensed "
                  "packages (see per_source)",
        **{k: v for k, v in corpus["source"].items() if k != "packages"},
        "read_from": corpus["root"],
        "excluded_dirs": list(EXCLUDED_DIRS),
        "excluded_name_prefixes": list(EXCLUDED_PREFIXES),
        "skipped": [f"{p} ({why})" for p, why in corpus["skipped"]] + corpus["source"].get("skipped_when_packed", []),
        "split_rule": "bucket = int(sha256(path)[:8], 16) % 1000; test: 0-19, val: 20-29, train: rest",
        "separator": SEPARATOR,
    }
    files = corpus["files"]
    out["all"] = {"files": len(files), "bytes": sum(f["bytes"] for f in files),
                  "sha256_of_path_sha256_list": _digest(files)}
    for sp in ("train", "val", "test"):
        fs = [f for f in files if f["split"] == sp]
        out[sp] = {"files": len(fs), "bytes": sum(f["bytes"] for f in fs), "sha256_of_path_sha256_list": _digest(fs)}
    fs = [f for f in files if f["split"] == "test" and f["source"] == "stdlib"]
    out["test_stdlib"] = {"files": len(fs), "bytes": sum(f["bytes"] for f in fs), "sha256_of_path_sha256_list": _digest(fs)}
    pinfo = {p["dist"]: p for p in corpus["source"].get("packages", [])}
    skipped_paths = [p for p, _ in corpus["skipped"]] + [x.split(" (")[0] for x in corpus["source"].get("skipped_when_packed", [])]
    per = []
    for src in sorted({f["source"] for f in files}, key=lambda s: (s != "stdlib", s)):
        fs = [f for f in files if f["source"] == src]
        row = {"source": src, "files": len(fs), "bytes": sum(f["bytes"] for f in fs),
               "sha256_of_path_sha256_list": _digest(fs),
               "skipped": sum(1 for p in skipped_paths if source_of(p, corpus["top_to_dist"]) == src)}
        if src in pinfo:
            row.update(version=pinfo[src]["version"], licence=pinfo[src]["licence"])
        elif src == "stdlib":
            row.update(version=corpus["source"].get("python_version"), licence="PSF-2.0")
        per.append(row)
    out["per_source"] = per
    out["packages"] = list(pinfo.values())
    return out


def manifest_tsv(corpus: dict) -> str:
    """One line a file: path, bytes, sha256, split (sorted by path)."""
    head = "# path\tbytes\tsha256\tsplit\n"
    return head + "".join(f"{f['path']}\t{f['bytes']}\t{f['sha256']}\t{f['split']}\n" for f in corpus["files"])


def split_texts(corpus: dict, split: str, source: str | None = None) -> list[str]:
    return [f["text"] for f in corpus["files"] if f["split"] == split and (source is None or f["source"] == source)]


def _sha256_path(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def pack(corpus: dict, path: str) -> None:
    """Write the selected files to a deterministic tarball (sorted, mtime 0, root-owned) with SOURCE.json.

    `.tar.xz` (lzma preset 9|extreme) or `.tar.gz` (gzip, mtime 0) by the name's ending."""
    import gzip
    import lzma

    with open(path, "wb") as raw:
        if path.endswith(".xz"):
            comp = lzma.LZMAFile(raw, mode="wb", format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64,
                                 preset=9 | lzma.PRESET_EXTREME)
        else:
            comp = gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0)
        with comp, tarfile.open(fileobj=comp, mode="w", format=tarfile.PAX_FORMAT) as tf:
            def add(name, data):
                ti = tarfile.TarInfo(name)
                ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = len(data), 0, 0o644, 0, 0, "", ""
                tf.addfile(ti, io.BytesIO(data))

            source = json.loads(json.dumps(corpus["source"]))
            source["skipped_when_packed"] = [f"{p} ({why})" for p, why in corpus["skipped"]]
            if source.get("packages"):  # paths of the packing machine (the stdlib-only pack of v1 kept its root)
                for p in source["packages"]:
                    p.pop("site_packages", None)
                source.pop("stdlib_root", None)
            add(PACK_SOURCE, json.dumps(source, indent=1, sort_keys=True).encode())
            by_path = {f["path"]: f for f in corpus["files"]}
            for path in corpus.get("pack_order") or sorted(by_path):
                add(path, by_path[path]["text"].encode("utf-8"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for manifest.tsv, summary.json and {train,val,test}.txt")
    ap.add_argument("--root", default=None, help="stdlib folder or a tarball made by --pack (default: this interpreter's stdlib)")
    ap.add_argument("--stdlib-only", action="store_true", help="the first corpus: no packages")
    ap.add_argument("--pack", default=None, help="also write the selected files to this .tar.xz / .tar.gz (with SOURCE.json)")
    ap.add_argument("--text", action="store_true", help="also write the split texts, files joined by the separator")
    a = ap.parse_args(argv)
    corpus = collect(a.root, packages=() if a.stdlib_only else PACKAGES)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "manifest.tsv"), "w") as f:
        f.write(manifest_tsv(corpus))
    s = summary(corpus)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(s, f, indent=1)
    if a.pack:
        pack(corpus, a.pack)
        print(f"packed {len(corpus['files'])} files into {a.pack} ({os.path.getsize(a.pack):,} bytes, "
              f"sha256 {_sha256_path(a.pack)})")
    if a.text:
        for sp in ("train", "val", "test"):
            with open(os.path.join(a.out, f"{sp}.txt"), "w") as f:
                f.write(SEPARATOR.join(split_texts(corpus, sp)))
    print(json.dumps({k: s.get(k) for k in ("python_version", "all", "train", "val", "test", "test_stdlib")}, indent=1))
    for row in s["per_source"]:
        print(f"{row['source']:22s} {row['files']:6d} files {row['bytes']:>12,d} bytes  skipped {row['skipped']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
