"""A streamed CPU decode step's threads each on a CPU of their own (runtime/affinity.py): the decoding thread's mask is
restored after the step, threads started inside it are not left on its one CPU, and the bits do not change."""
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import waste
from waste.runtime.affinity import decoding_cpu, pool_pinner, unpinned, usable_cpus

CPUS = usable_cpus()
two = pytest.mark.skipif(len(CPUS) < 2, reason="needs two usable CPUs")


def test_nothing_is_pinned_without_a_cpu_for_every_thread():
    assert pool_pinner(len(CPUS)) is None
    with decoding_cpu(len(CPUS) + 1):
        assert usable_cpus() == CPUS


@two
def test_the_decoding_thread_is_pinned_for_the_block_and_given_its_cpus_back():
    with ThreadPoolExecutor(1, initializer=pool_pinner(1)) as pool:
        assert pool.submit(usable_cpus).result() == [CPUS[1]]
    with decoding_cpu(2):
        assert usable_cpus() == [CPUS[0]]
        with ThreadPoolExecutor(1, initializer=unpinned(CPUS)) as readers:     # started inside: widened again
            assert readers.submit(usable_cpus).result() == CPUS
    assert usable_cpus() == CPUS


@two
def test_a_streamed_decode_is_the_same_bits_pinned_or_not(releases, monkeypatch):
    c = releases["qwen3_moe"][2]
    ids = list(range(5, 25))
    with waste.load(c, dtype="float32", budget="1G", preload=False) as probe:
        ws = probe.plan.working_set_bytes
    saved, out = torch.get_num_threads(), {}
    try:
        torch.set_num_threads(2)
        for pin in ("0", "1"):
            monkeypatch.setenv("WASTE_PIN", pin)
            with waste.load(c, dtype="float32", budget=ws, preload=False) as eng:
                m, st = eng.model, eng.model.new_state()
                assert m.expert_pool is not None and m.pin_cpus == (pin == "1")
                logits = [m.forward(torch.tensor(ids), st, 0)]
                for i in range(6):
                    logits.append(m.forward(logits[-1][-1:].argmax(-1), st, len(ids) + i))
                    assert sorted(os.sched_getaffinity(0)) == CPUS
                out[pin] = torch.cat(logits)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(out["0"], out["1"])
