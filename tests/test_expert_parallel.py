"""Expert parallel (runtime/parallel.py) over gloo with 2 processes started by torchrun: on each family's fixture the
logits and tokens of rank 0 are bit-identical to one process's (prefill, decode, two sequences batched, a budget
that streams on every rank, a placement from a routing trace); the CLI's run, bench, plan and serve under it; the
placement's own rules; refusals by name."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fixtures import TOKENIZER_TEXT, save_release

import ep_worker
from waste.engine import Engine
from waste.errors import WasteError
from waste.runtime import parallel

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRACE = ROOT / "benchmarks" / "traces" / "tiny-py-moe-heldout.json"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]),
       "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """subprocess.run, where a command cut at its timeout fails with the end of what it printed (ep_worker says
    which model it was at), not with the timeout alone."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=kw.pop("env", ENV), timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        tail = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x for x in (e.stdout, e.stderr) if x)
        pytest.fail(f"{' '.join(cmd[:6])} ... still running after {timeout:.0f} s; its last output:\n{tail[-3000:]}")


def torchrun(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args], timeout)


def waste_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "waste", *args], capture_output=True, text=True, env=ENV,
                          timeout=300)


@pytest.fixture(scope="module")
def containers(releases, tmp_path_factory):
    """name -> container: every family's fixture (K3 with its experts in mxfp4, as released)."""
    from k3_release import write_release
    from test_oracle_deepseek import deepseek_model
    from test_oracle_glm5 import glm5_model

    from waste.convert.convert import convert
    from waste.convert.synthetic import write_tokenizer

    root = tmp_path_factory.mktemp("ep")
    out = {name: releases[name][2] for name in ("qwen3_moe", "kimi_linear")}
    for name, build in (("deepseek_v3", deepseek_model), ("glm5_next", glm5_model)):
        src = save_release(build(), root / name)
        out[name] = convert(src, root / f"{name}.waste", experts="bf16", trunk="bf16", progress=False)
    src = write_release(root / "kimi_k3", "mxfp4")
    write_tokenizer(src, TOKENIZER_TEXT, vocab_size=300)
    out["kimi_k3"] = convert(src, root / "kimi_k3.waste", experts="auto", trunk="bf16", progress=False)
    out["qwen3_moe_q4"] = convert(releases["qwen3_moe"][1], root / "q4.waste", experts="q4", trunk="bf16",
                                  progress=False)
    return out


def test_each_family_is_bit_identical_to_one_process(containers, tmp_path):
    ws = {}
    for name, path in containers.items():
        with Engine.load(path, dtype="float32", preload=False) as eng:
            ws[name] = eng.plan.working_set_bytes
    items = [f"{n}={p}" for n, p in containers.items()]
    # a third of a working set on each rank: it streams and evicts its share all the time
    items.append(f"qwen3_moe_small={containers['qwen3_moe']}@{ws['qwen3_moe'] // 3}")
    items.append(f"deepseek_v3_small={containers['deepseek_v3']}@{ws['deepseek_v3'] // 3}")
    items.append(f"qwen3_moe_trace={containers['qwen3_moe']}+trace:{TRACE}")
    (tmp_path / "ep").mkdir()
    (tmp_path / "one").mkdir()
    r = torchrun(str(HERE / "ep_worker.py"), str(tmp_path / "ep"), "--expert-parallel", "2", *items)
    assert r.returncode == 0, r.stderr[-3000:]
    # one process, as a user runs it: a fresh one on one thread (as torchrun starts the workers), not this pytest
    # process, whose earlier tests leave thread and kernel state behind (in two full-suite runs this process's q4
    # decode step differed from the workers' in the last bits; run alone it agreed: the cause is not traced)
    r = run([sys.executable, str(HERE / "ep_worker.py"), str(tmp_path / "one"), *items], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for item in items:
            name = item.partition("=")[0]
            want = torch.load(tmp_path / "one" / f"{name}.pt")
            got = torch.load(tmp_path / "ep" / f"{name}.pt")
            for k in ("prefill", "greedy", "batch_a", "batch_b", "next_a", "next_b"):
                assert torch.equal(got[k], want[k]), (name, k)
            assert len(got["greedy"]) == 10
            if name.endswith("_small"):
                assert got["misses"] > 0 and got["evictions"] > 0        # rank 0 really streamed its share
    finally:
        torch.set_num_threads(threads)


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL); CI has none")


def one_and_two_processes(items: list[str], out: Path, device: str) -> None:
    """ep_worker over items in one process and in two under torchrun (NCCL + a GPU each on cuda), each into its
    own folder of out, both started fresh: then rank 0's tensors against the one process's, by name."""
    for d in ("one", "two"):
        (out / d).mkdir()
    one = run([sys.executable, str(HERE / "ep_worker.py"), str(out / "one"), "--device", device, *items], 600)
    assert one.returncode == 0, one.stderr[-3000:]
    two = torchrun(str(HERE / "ep_worker.py"), str(out / "two"), "--device", device, "--expert-parallel", "2",
                   *items, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    for item in items:
        name = item.partition("=")[0]
        want, got = (torch.load(out / d / f"{name}.pt") for d in ("one", "two"))
        for k in ("prefill", "greedy", "batch_a", "batch_b", "next_a", "next_b"):
            assert torch.equal(got[k], want[k]), (name, k)


@TWO_GPUS
def test_each_family_is_bit_identical_on_two_gpus(containers, tmp_path):
    """NCCL between 2 GPUs, one process per GPU, float32 compute: rank 0's logits and tokens against one process on
    one GPU (run by hand on the 2-GPU machine; docs/LEARNED.md §11)."""
    one_and_two_processes([f"{n}={p}" for n, p in containers.items()], tmp_path, "cuda")


def test_cli_run_bench_and_plan(releases):
    m = str(releases["qwen3_moe"][2])
    one = waste_cli("run", m, "hello world", "-n", "12", "--temperature", "0")
    assert one.returncode == 0, one.stderr
    two = torchrun("-m", "waste", "run", m, "hello world", "-n", "12", "--temperature", "0", "--expert-parallel", "2")
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout and len(one.stdout) > len("hello world\n")

    bench = ("bench", m, "-n", "4", "--prompt-len", "8", "--json")
    b = torchrun("-m", "waste", *bench, "--expert-parallel", "2", "--placement", f"trace:{TRACE}")
    assert b.returncode == 0, b.stderr[-3000:]
    r, one = json.loads(b.stdout), json.loads(waste_cli(*bench).stdout)
    ep = r["expert_parallel"]
    assert ep["processes"] == 2 and ep["placement"] == f"trace:{TRACE}"
    with Engine.load(m, preload=False) as eng:
        n_moe = len(parallel.moe_layers(eng.container))
    assert ep["rounds"] == 5 * n_moe and ep["bytes_sent"] > 0           # one exchange per MoE layer per forward
    # each rank made only its own experts resident: over the ranks, one process's distinct experts per layer call
    assert [x["rank"] for x in ep["ranks"]] == [0, 1] and all(x["hits"] + x["misses"] > 0 for x in ep["ranks"])
    assert sum(x["hits"] + x["misses"] for x in ep["ranks"]) == sum(one[p]["hits"] + one[p]["misses"]
                                                                    for p in ("prefill", "decode"))
    assert r["bank_bytes"] * 2 == one["bank_bytes"]

    p = waste_cli("plan", m, "--expert-parallel", "2", "--placement", f"trace:{TRACE}", "--json")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    one_plan = json.loads(waste_cli("plan", m, "--json").stdout)
    assert [r["experts_per_layer"] for r in plan["ranks"]] == [[4] * n_moe, [4] * n_moe]   # 8 experts, 2 ranks
    for r in plan["ranks"]:
        assert r["plan"]["bank_bytes"] * 2 == one_plan["bank_bytes"]
        assert r["plan"]["usable_source"].endswith("/ 2 processes")
    assert abs(sum(r["pair_share"] for r in plan["ranks"]) - 1) < 1e-9
    assert 1 <= plan["layer_peak"] <= plan["by_id"]["layer_peak"]


def test_serve_under_expert_parallel_answers_as_one_process(releases):
    import httpx

    m = str(releases["qwen3_moe"][2])
    body = {"model": "m", "prompt": "hello", "max_tokens": 10, "temperature": 0}
    one = waste_cli("run", m, "hello", "-n", "10", "--temperature", "0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "waste",
           "serve", m, "--port", "0", "--model-name", "m", "--expert-parallel", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        url, lines = None, []
        deadline = time.time() + 120
        while url is None and time.time() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "waste: serving" in line and " at " in line:
                url = line.split(" at ")[1].split()[0].removesuffix("/v1")
        assert url, "".join(lines)
        for _ in range(600):
            if httpx.get(url + "/health").status_code == 200:
                break
            time.sleep(0.1)
        for _ in range(2):                  # twice: the other rank answers every request's layers
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert "hello" + r.json()["choices"][0]["text"] == one.stdout.rstrip("\n")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_placement_rules():
    assert parallel.place({1: 8, 2: 6}, 2) == {1: [0, 0, 0, 0, 1, 1, 1, 1], 2: [0, 0, 0, 1, 1, 1]}
    count = [50, 40, 1, 1, 30, 2, 2, 2, 20]                # 9 experts over 3 ranks
    total = [0, 0, 0]
    owner = parallel.balance(count, 3, total)
    assert sorted(owner.count(r) for r in range(3)) == [3, 3, 3]
    assert len({owner[e] for e in (0, 1, 4)}) == 3      # the three hottest on three ranks
    assert total == [sum(c for c, r in zip(count, owner) if r == q) for q in range(3)]
    trace = parallel.traces.load(TRACE)
    layers = {i: 16 for i in range(8)}
    owner = parallel.place(layers, 4, f"trace:{TRACE}", 2)
    assert owner == parallel.place(layers, 4, f"trace:{TRACE}", 2)          # the same on every rank
    count = parallel.frequencies(layers, trace, 2)
    for l, o in owner.items():
        hot = sorted(range(16), key=lambda e: -count[l][e])[:4]
        assert len({o[e] for e in hot}) == 4
    with pytest.raises(WasteError, match="only 8 experts per layer"):
        parallel.place({1: 8}, 16)
    with pytest.raises(WasteError, match="--placement 'hot'"):
        parallel.check_placement("hot")


def test_refusals_by_name(releases, tmp_path, capsys, monkeypatch):
    from waste.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    m = str(releases["qwen3_moe"][2])
    cases = [(["run", m, "hi", "--expert-parallel", "2"], "torchrun --nproc-per-node 2 -m waste"),
             (["plan", m, "--expert-parallel", "2", "--placement", f"trace:{tmp_path / 'none.json'}"],
              "record one with `waste bench --record-trace"),
             (["plan", m, "--expert-parallel", "2", "--placement", "hot"], "use id (experts in blocks of ids)"),
             (["route-diff", m, m, "hi", "--expert-parallel", "2"], "route-diff has no --expert-parallel"),
             (["plan", m, "--expert-parallel", "9"], "only 8 experts per layer")]
    for argv, why in cases:
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith("waste: error: ") and why in err, (argv, err)


def test_a_stuck_process_is_a_clear_error_not_a_stall():
    """A rank that never answers: after WASTE_EP_TIMEOUT seconds the waiting rank stops with one line naming its rank,
    the MoE layer and the step (NCCL's or gloo's own timeout would be 30 minutes of silence, or a hang)."""
    # without the watch this runs into run()'s limit (the group's own timeout is a year) and fails there
    r = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             str(HERE / "ep_stall.py")], 300, env={**ENV, "WASTE_EP_TIMEOUT": "3"})
    assert r.returncode != 0 and "not reached" not in r.stdout
    assert "waste: error: expert parallel: rank 0 waited 3 s in the sizes before MoE layer 7" in r.stderr, r.stderr


def test_a_bad_timeout_is_refused_by_name():
    env = {"WORLD_SIZE": "2", "RANK": "0", "WASTE_EP_TIMEOUT": "soon"}
    with pytest.raises(WasteError, match="WASTE_EP_TIMEOUT='soon': give the seconds"):
        parallel.ExpertParallel.start(env, 2)


def test_uneven_shares_are_bit_identical(releases, tmp_path):
    """Rank 0 with a quarter of every layer's experts, rank 1 with the rest (what a rank 0 short of room beside the
    trunk gets): the same bits as one process, and rank 0 really held fewer."""
    m = str(releases["qwen3_moe"][2])
    (tmp_path / "ep").mkdir()
    r = torchrun(str(HERE / "ep_worker.py"), str(tmp_path / "ep"), "--expert-parallel", "2", "--weights", "1,3",
                 f"q={m}")
    assert r.returncode == 0, r.stderr[-3000:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = ep_worker.run_one(f"q={m}", None)
    finally:
        torch.set_num_threads(threads)
    got = torch.load(tmp_path / "ep" / "q.pt")
    for k in ("prefill", "greedy", "batch_a", "batch_b", "next_a", "next_b"):
        assert torch.equal(got[k], want[k]), k
    assert got["held"] * 4 == want["held"]                    # 8 experts a layer: 2 on rank 0, 6 on rank 1


def test_shares_follow_each_ranks_room():
    assert parallel.counts(8, 2) == [4, 4] and parallel.counts(9, 4) == [3, 2, 2, 2]
    assert parallel.counts(8, 2, [0.25, 0.75]) == [2, 6]
    # remainders to the largest fractions, ties to the lower rank
    assert parallel.counts(896, 8, [1, 4, 4, 4, 4, 4, 4, 4]) == [31] + [124] * 4 + [123] * 3
    assert parallel.weights_for([50, 50], 100) is None                  # each holds an even share: even
    assert parallel.weights_for([10, 90], 100) == [0.1, 0.9]
    owner = parallel.place({1: 8, 2: 8}, 2, "id", None, [0.25, 0.75])
    assert owner == {1: [0, 0, 1, 1, 1, 1, 1, 1], 2: [0, 0, 1, 1, 1, 1, 1, 1]}
    owner = parallel.place({i: 16 for i in range(8)}, 2, f"trace:{TRACE}", 2, [0.25, 0.75])
    assert all(o.count(0) == 4 for o in owner.values())


def test_plan_gives_rank_0_fewer_experts_where_the_trunk_leaves_it_less_room(tmp_path):
    """waste plan --expert-parallel on a random model sized for GPUs: ranks other than 0 hold no trunk, so where rank
    0 has no room for an even share beside it, it gets fewer experts, and the plan says whether every rank fits."""
    cfg = tmp_path / "q.json"
    from waste.convert.synthetic import qwen3_moe_config

    # a 1.1 GB trunk (a 262144-row vocabulary), 0.8 GB of experts: on 4.5 GB GPUs (2 GiB of each reserved) rank 0
    # has room for about 0.66 GB of experts beside the trunk, less than half the bank; on 8 GB GPUs for all of it
    cfg.write_text(json.dumps(qwen3_moe_config(vocab_size=262144, hidden_size=1024, moe_intermediate_size=1024,
                                               num_hidden_layers=4, num_experts=64)))
    plans = {}
    for gpu in ("4500M", "8G"):
        p = waste_cli("plan", f"random:{cfg}", "--expert-parallel", "2", "--device", "cuda", "--vram", gpu, "--json")
        assert p.returncode == 0, p.stderr
        plans[gpu] = json.loads(p.stdout)
    small, big = plans["4500M"], plans["8G"]
    assert [r["trunk"] for r in small["ranks"]] == [True, False]
    assert small["ranks"][0]["plan"]["trunk_bytes"] > 0 == small["ranks"][1]["plan"]["trunk_bytes"]
    e0, e1 = (sum(r["experts_per_layer"]) for r in small["ranks"])
    assert e0 < e1 and e0 + e1 == 4 * 64 and small["weights"] is not None
    assert [sum(r["experts_per_layer"]) for r in big["ranks"]] == [128, 128] and big["weights"] is None
    assert big["fits"] and big["gpu_bytes"] == 8 << 30
    # in host memory (5 GB between 2 processes) rank 1 has room for 1.2 of its 1.5 GB: said so, and why it matters
    p = waste_cli("plan", f"random:{cfg}", "--expert-parallel", "2", "--device", "cpu", "--ram", "5G")
    assert p.returncode == 0, p.stderr
    last = p.stdout.splitlines()[-1]
    # (rank 0 may be short too: its room depends on this process's measured baseline, which the kernels it loads move)
    assert last.startswith("does not fit resident: ") and "rank 1 holds " in last
    assert p.stdout.splitlines()[-1].endswith("(a random model needs them all: refused)")
