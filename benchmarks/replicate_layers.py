"""A deeper container from a converted one, its layers repeated: the 30B shape's 48 layers without a 48-layer source.

    python benchmarks/replicate_layers.py SRC.waste DST.waste --layers 48

Layer L of DST is layer L mod (SRC's layers): its trunk tensors renamed (CRC-32s carried over), its expert bank
copied with the layer number in the header rewritten (and the header's CRC-32). Every (layer, expert) is its own
record in its own bank file, so a decode step reads as many distinct bytes as the real model: what the GPU
benchmarks need (issue 14 (a): the 48-layer q4 container is 16 GB; a random bf16 release of it is 58 GB, more than
the GPU machine's disk holds beside it). Weights repeat every SRC layers, so routing repeats with them: speed, not
quality. For families whose config is the plain per-layer list (qwen3_moe, mixtral, glm4_moe, ...). Not a test.
"""
from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from waste.container.bank import HEADER_FIXED  # noqa: E402
from waste.container.manifest import MANIFEST, file_table  # noqa: E402


def renumber_bank(src: Path, dst: Path, layer: int) -> None:
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:
        fixed = HEADER_FIXED.unpack(f.read(HEADER_FIXED.size))
        hbytes = fixed[2]
        f.seek(0)
        head = bytearray(f.read(hbytes))
        HEADER_FIXED.pack_into(head, 0, *fixed[:3], layer, *fixed[4:8], 0)
        struct.pack_into("<I", head, HEADER_FIXED.size - 4, zlib.crc32(bytes(head)))
        f.seek(0)
        f.write(head)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--layers", type=int, required=True)
    a = ap.parse_args()
    m = json.loads((a.src / MANIFEST).read_text())
    cfg, n_src, n = m["config"], m["config"]["num_layers"], a.layers
    if any(k in cfg for k in ("mhc", "attn_res_block_size")) or len(cfg.get("layers", [])) != n_src:
        sys.exit(f"{m['family']}: its config is not a plain per-layer list; only such families replicate")
    a.dst.mkdir(parents=True, exist_ok=False)
    (a.dst / "experts").mkdir()
    for rel in m["files"]:          # the text files as they are
        if not rel.startswith("experts/") and rel != m["trunk"]["file"]:
            shutil.copyfile(a.src / rel, a.dst / rel)
    # the trunk: layer L's tensors are layer L mod n_src's
    crc, tensors = {}, {}
    with safe_open(a.src / m["trunk"]["file"], "pt") as f:
        meta = f.metadata()
        for name in f.keys():
            parts = name.split(".")
            if parts[0] != "layers":
                tensors[name], crc[name] = f.get_tensor(name), m["trunk"]["crc32"][name]
                continue
            for L in range(int(parts[1]), n, n_src):
                new = ".".join(["layers", str(L), *parts[2:]])
                tensors[new], crc[new] = f.get_tensor(name).clone(), m["trunk"]["crc32"][name]
    save_file(tensors, a.dst / m["trunk"]["file"], metadata=meta)
    m["trunk"].update(crc32=crc, bytes=(a.dst / m["trunk"]["file"]).stat().st_size)
    q = m["trunk"].get("quantized") or {}
    m["trunk"]["quantized"] = {".".join(["layers", str(L), *k.split(".")[2:]]) if k.startswith("layers.") else k: v
                               for k, v in q.items() for L in (range(int(k.split(".")[1]), n, n_src)
                                                                if k.startswith("layers.") else [None])}
    layers = {}
    for L in range(n):
        info = m["experts"]["layers"].get(str(L % n_src))
        if info is None:
            continue
        rel = f"experts/layer_{L:03d}.bank"
        renumber_bank(a.src / info["file"], a.dst / rel, L)
        layers[str(L)] = {**info, "file": rel}
        print(f"layer {L}: {rel} from layer {L % n_src}", flush=True)
    m["experts"].update(layers=layers, bytes=m["experts"]["bytes"] // max(len(m["experts"]["layers"]), 1) * len(layers))
    cfg.update(num_layers=n, layers=[cfg["layers"][L % n_src] for L in range(n)])
    scale = n / n_src
    m["params"] = {k: int(v * scale) if k != "trunk" else v for k, v in m["params"].items()}
    m["provenance"] = {**m["provenance"], "replicated": f"{a.src} x {n} layers (benchmarks/replicate_layers.py)"}
    m["files"] = file_table(a.dst, m)
    (a.dst / MANIFEST).write_text(json.dumps(m, indent=1))
    print(f"{a.dst}: {n} layers, {m['experts']['bytes'] / 1e9:.2f} GB of experts", flush=True)


if __name__ == "__main__":
    main()
