"""Which cache slot to give up: LFRU, frequency with aging plus recency.

Each slot keeps a score that decays by half every `half_life` tokens and grows by one per use, so it reads
"how often, lately". The victim is the lowest score; ties go to the least recently used. half_life -> 0 is
plain LRU (every score but the current token's decays to nothing); half_life -> infinity is LFU.
"""
from __future__ import annotations

import numpy as np

LFRU_HALF_LIFE = 8.0   # tokens; the measured best of 2, 8, 32 and infinity (docs/LEARNED.md §3)


class LFRU:
    def __init__(self, n_slots: int, half_life: float = LFRU_HALF_LIFE):
        self.freq = np.zeros(n_slots)
        self.last = np.zeros(n_slots)
        self.decay = 0.5 ** (1.0 / half_life) if half_life > 0 else 0.0
        self.now = 0.0

    def score(self, slots):
        return self.freq[slots] * self.decay ** (self.now - self.last[slots])

    def touch(self, slot: int) -> None:
        self.freq[slot] = self.score(slot) + 1.0
        self.last[slot] = self.now

    def reset(self, slot: int) -> None:
        self.freq[slot] = 0.0

    def victims(self, candidates: np.ndarray, n: int) -> np.ndarray:
        """The n candidates to evict, lowest score first, least recently used among equals."""
        order = np.lexsort((self.last[candidates], self.score(candidates)))[:n]
        return candidates[order]

    def advance(self, dt: float) -> None:
        self.now += dt
