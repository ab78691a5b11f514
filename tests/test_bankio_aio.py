"""Demand reads through Linux AIO (runtime/bankio.py's DirectAio, issued from the decoding thread, landed by a
reaper thread): the same bits as the reader threads whatever order the reads land in, a damaged record still
stops the step and is read again once asked for, and a clean fallback where AIO or O_DIRECT is missing."""
import os
import shutil

import pytest
import torch

import waste
from waste.container import open_container
from waste.errors import DamagedContainer
from waste.runtime import bankio
from waste.runtime.bankio import DirectAio
from waste.runtime.cache import ExpertCache

FAMILY = "kimi_linear"


def _aio_here(path) -> bool:
    aio = DirectAio.open()
    if aio is None:
        return False
    aio.close()
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except (OSError, AttributeError):
        return False
    return True


@pytest.fixture
def container(releases):
    c = releases[FAMILY][2]
    if not _aio_here(next(iter(sorted((c / "experts").glob("*.bank"))))):
        pytest.skip("no Linux AIO or no O_DIRECT on the test's filesystem")
    return c


def decode(c, n=8, **kw):
    ids = list(range(5, 30))
    with waste.load(c, dtype="float32", preload=False, **kw) as eng:
        m, st = eng.model, eng.model.new_state()
        logits = [m.forward(torch.tensor(ids), st, 0)]
        for i in range(n):
            logits.append(m.forward(logits[-1][-1:].argmax(-1), st, len(ids) + i))
        return torch.cat(logits), eng.experts.aio is not None, eng.experts.stats.misses


def working_set(c) -> int:
    with waste.load(c, dtype="float32", preload=False) as eng:
        return eng.plan.working_set_bytes


def test_reads_land_in_any_order_with_the_same_bits(container, monkeypatch):
    ref, _, _ = decode(container, budget=None)
    small = working_set(container)
    monkeypatch.setenv("WASTE_AIO", "0")
    threads, on, _ = decode(container, budget=small, threads=1)
    assert not on and torch.equal(threads, ref)
    monkeypatch.delenv("WASTE_AIO")
    submit = DirectAio.submit
    # each layer call's reads queued last first, so they tend to land in the reverse of the reader threads' order
    monkeypatch.setattr(DirectAio, "submit", lambda self, reads: (submit(self, reads[::-1]), len(reads))[1]
                        if len(reads) > 1 else submit(self, reads))
    reversed_, on, misses = decode(container, budget=small)
    assert on and misses > 0 and torch.equal(reversed_, ref)


def _first_bank(c):
    cont = open_container(c)
    layer = min(cont.banks)
    bank = cont.banks[layer]
    return cont, layer, bank


def test_a_damaged_record_under_aio_stops_the_call_and_is_read_again(container, tmp_path):
    dst = tmp_path / "copy.waste"
    shutil.copytree(container, dst)
    cont, layer, bank = _first_bank(dst)
    path, off = bank.path, bank.offset(3) + 100
    with open(path, "r+b") as f:
        f.seek(off)
        good = f.read(1)
        f.seek(off)
        f.write(bytes([good[0] ^ 0x10]))
    cache = ExpertCache(cont, None, torch.float32, threads=1, preload=False)
    try:
        assert cache.aio is not None
        idx = [torch.tensor([[3]])]
        with pytest.raises(DamagedContainer, match="checksum"):
            list(cache.resident(layer, idx))
        assert (layer, 3) not in cache.slot_of and (layer, 3) not in cache.loading    # forgotten
        with open(path, "r+b") as f:
            f.seek(off)
            f.write(good)
        misses = cache.stats.misses
        groups = list(cache.resident(layer, idx))
        assert cache.stats.misses == misses + 1 and groups[-1][0][0].item() == cache.slot_of[(layer, 3)]
    finally:
        cache.close()
        cont.close()


def test_the_checksum_is_taken_before_a_repack_rewrites_the_slot(container, monkeypatch):
    """A record rewritten for a kernel's layout at fill (q4 on AVX2) must not be checked after the rewrite."""
    import waste.runtime.cache as cache_mod

    def scribble(parts, fmt, shapes):
        for p in parts.values():
            for t in p.values():
                t.view(torch.uint8).fill_(0xA5)
    monkeypatch.setattr(cache_mod, "prepare_record", scribble)
    cont, layer, _ = _first_bank(container)
    cache = ExpertCache(cont, None, torch.float32, threads=1, preload=False)
    try:
        cache.repack = True
        assert cache.aio is not None
        list(cache.resident(layer, [torch.tensor([[0, 1, 2]])]))      # no DamagedContainer
        assert all((layer, e) in cache.slot_of for e in (0, 1, 2))
    finally:
        cache.close()
        cont.close()


def test_a_read_the_kernel_refuses_falls_back_to_the_readers_pread(container, monkeypatch):
    """An AIO read that fails (here: a misaligned buffer, EINVAL) is read again by the reader's own pread."""
    request = bankio.BankReader.request
    monkeypatch.setattr(bankio.BankReader, "request", lambda self, e, slot: (lambda r: (r[0], r[1] + 1, *r[2:]))(
        request(self, e, slot)))
    cont, layer, _ = _first_bank(container)
    cache = ExpertCache(cont, None, torch.float32, threads=1, preload=False)
    try:
        assert cache.aio is not None
        groups = list(cache.resident(layer, [torch.tensor([[0, 4]])]))
        assert sum((g[0][0] >= 0).sum().item() for g in groups) == 2
        for e in (0, 4):
            rec = torch.empty(cont.banks[layer].record_bytes, dtype=torch.uint8)
            cont.banks[layer].read_into(e, rec)
            assert torch.equal(cache.slot_tensor(cache.slot_of[(layer, e)]), rec)
    finally:
        cache.close()
        cont.close()


def test_without_aio_or_o_direct_the_reader_threads_read_the_same_bits(container, monkeypatch, tmp_path):
    ref, _, _ = decode(container, budget=None)
    small = working_set(container)
    out, on, _ = decode(container, budget=small, direct=False)       # buffered reads: no AIO (it would block)
    assert not on and torch.equal(out, ref)
    monkeypatch.setattr(bankio, "_SYSCALL", None)                    # a kernel or platform without Linux AIO
    out, on, _ = decode(container, budget=small)
    assert not on and torch.equal(out, ref)
    monkeypatch.undo()
    real_open = os.open

    def refuse_direct(path, flags, *a):      # as tmpfs did before Linux 6.6, and some network filesystems do
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a)
    monkeypatch.setattr(bankio.os, "open", refuse_direct)
    out, on, _ = decode(container, budget=small)
    assert not on and torch.equal(out, ref)
