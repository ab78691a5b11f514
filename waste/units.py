"""Byte sizes as people write and read them."""
from __future__ import annotations

import re

from .errors import WasteError

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """Plain bytes or a K/M/G/T suffix (binary: 8G = 8 GiB)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise WasteError(f"cannot read size {text!r}: use plain bytes or a K/M/G/T suffix, e.g. 8G or 512M")
    return int(float(m[1]) * _UNITS[m[2].upper()])


def fmt_bytes(n: float) -> str:
    """Decimal units, two decimals: 1.23 GB."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"
