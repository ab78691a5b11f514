"""Images where users meet them, on the tiny GLM-5.3-Flash release with a vision tower (tests/vision_release.py):
`image_url` parts on a real `waste serve` through the openai client (data: URLs, http(s) URLs from a local HTTP
server, --no-image-urls), `waste run --image`, `/image` in `waste chat`, `waste info` and `waste plan`. Each path's
reply is the one Engine.chat gives for the same image (greedy)."""
import base64
import http.server
import io
import json
import os
import subprocess
import sys
import threading
from argparse import Namespace

import numpy as np
import pytest
from serve_util import ProcessServer
from vision_release import build

import waste

PIL = pytest.importorskip("PIL.Image")
openai = pytest.importorskip("openai")


def png() -> bytes:
    b = io.BytesIO()
    PIL.fromarray(np.random.RandomState(5).randint(0, 256, (90, 120, 3), dtype=np.uint8)).save(b, "PNG")
    return b.getvalue()


PNG = png()
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()


def ask(url, text="what is this?"):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def vis(tmp_path_factory):
    root = tmp_path_factory.mktemp("vis")
    src, _, out = build(root)
    (root / "pic.png").write_bytes(PNG)
    eng = waste.load(out, dtype="float32")
    want = eng.chat(ask(DATA_URL), max_tokens=6, temperature=0)
    assert len(want.reasoning_content + want.content) > 3      # the GLM template opens <think>: reasoning
    return {"root": root, "out": out, "eng": eng, "want": want}


@pytest.fixture(scope="module")
def images_site(vis):
    """A local HTTP server with the picture at /pic.png (and nothing else)."""
    root = vis["root"]

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **k):
            super().__init__(*a, directory=str(root), **k)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def said(m):
    """(reasoning, content) of a reply: a ChatCompletion or the openai client's message."""
    return (getattr(m, "reasoning_content", None) or "", m.content or "")


def cli(*args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "waste", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_server_takes_image_parts(vis, images_site):
    srv = ProcessServer(vis["out"], "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        for url in (DATA_URL, images_site + "/pic.png"):
            r = client.chat.completions.create(model="glm5v", messages=ask(url), max_tokens=6, temperature=0)
            assert said(r.choices[0].message) == said(vis["want"])
            assert r.usage.prompt_tokens == vis["want"].usage["prompt_tokens"]
        chunks = client.chat.completions.create(model="glm5v", messages=ask(DATA_URL), max_tokens=6, temperature=0,
                                                stream=True)
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert ("".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
                "".join(d.content or "" for d in deltas)) == said(vis["want"])
        bad = [ask("data:image/png;base64," + base64.b64encode(b"not a picture").decode()),
               ask(images_site + "/missing.png"),
               ask("data:image/png;base64," + base64.b64encode(PNG[:300]).decode())]
        for messages in bad:
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="glm5v", messages=messages, max_tokens=2)
            err = e.value.body
            assert err["param"] == "messages" and "messages[0].content[0]" in err["message"], err
    finally:
        srv.stop()


def test_server_refuses_image_urls_with_the_flag(vis, images_site):
    srv = ProcessServer(vis["out"], "--dtype", "float32", "--no-image-urls")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="glm5v", messages=ask(images_site + "/pic.png"), max_tokens=2)
        assert e.value.body["param"] == "messages" and "--no-image-urls" in e.value.body["message"]
        r = client.chat.completions.create(model="glm5v", messages=ask(DATA_URL), max_tokens=6, temperature=0)
        assert said(r.choices[0].message) == said(vis["want"])
    finally:
        srv.stop()


def test_run_with_an_image(vis):
    want = vis["eng"].chat([{"role": "user", "content": [{"type": "image", "image": PNG},
                                                         {"type": "text", "text": "what is this?"}]}],
                           max_tokens=6, temperature=0)
    p = cli("run", vis["out"], "--image", vis["root"] / "pic.png", "what is this?", "-n", 6, "--temperature", 0,
            "--dtype", "float32")
    assert p.returncode == 0, p.stderr
    assert p.stdout == want.reasoning_content + want.content + "\n" and "experts" in p.stderr
    for path, words in ((vis["root"] / "nope.png", "no such file"), (vis["root"], "is a directory")):
        p = cli("run", vis["out"], "--image", path, "hi", "-n", 2)
        assert p.returncode != 0 and f"waste: error: {path}" in p.stderr and words in p.stderr
        assert "Traceback" not in p.stderr
    (vis["root"] / "text.png").write_text("hello")
    p = cli("run", vis["out"], "--image", vis["root"] / "text.png", "hi", "-n", 2)
    assert p.returncode != 0 and "not an image" in p.stderr and "Traceback" not in p.stderr


def test_chat_image_command(vis):
    from waste.chat_cli import Session

    out, err = io.StringIO(), io.StringIO()
    args = Namespace(system=None, tools=None, n=6, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None,
                     stop=[], no_thinking=False, reasoning_effort=None, hide_reasoning=False)
    s = Session(vis["eng"], args, out, err)
    s.command(f"/image {vis['root'] / 'nope.png'}")
    assert "no such file" in err.getvalue() and not s.images
    s.command(f"/image {vis['root'] / 'pic.png'}")
    assert "image attached (120x90)" in err.getvalue()
    s.turn("what is this?")
    assert s.history[0]["content"][0]["type"] == "image" and not s.images
    assert s.history[1].get("reasoning_content") == vis["want"].reasoning_content
    assert (s.history[1]["content"] or "") == vis["want"].content


def test_info_and_plan_count_the_tower(vis):
    p = cli("info", vis["out"], "--json")
    v = json.loads(p.stdout)["vision"]
    m = json.loads((vis["out"] / "manifest.json").read_text())["vision"]
    assert v["runs"] and v["params"] == m["params"] and v["bytes"] == m["bytes"]
    assert "runs on image parts" in cli("info", vis["out"]).stdout
    plan = json.loads(cli("plan", vis["out"], "--json", "--dtype", "float32").stdout)
    # tower weights + activations of the largest image (24 tokens x 4 patches) in float32
    acts = 24 * 4 * (4 * 32 + 3 * 48)
    assert plan["vision_bytes"] == (m["params"] + acts) * 4
    assert plan["floor_bytes"] == sum(plan[k] for k in ("trunk_bytes", "state_bytes", "scratch_bytes",
                                                         "baseline_bytes", "vision_bytes"))
    assert "vision tower" in cli("plan", vis["out"]).stdout


def test_hub_plan_reserves_the_tower_as_the_container_plan_does(vis, tmp_path, monkeypatch, capsys):
    """`waste plan ORG/NAME` from the Hub's metadata counts the tower the same as `waste plan` on the container."""
    import huggingface_hub.constants as hc
    from hub_server import HubServer

    from waste.cli import main

    monkeypatch.setenv("WASTE_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hc, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with HubServer() as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        h.add("org/glm5v", vis["root"] / "src")
        assert main(["plan", "org/glm5v", "--json", "--dtype", "float32", "--experts", "bf16", "--trunk", "bf16"]) == 0
    hub_plan = json.loads(capsys.readouterr().out)
    local = json.loads(cli("plan", vis["out"], "--json", "--dtype", "float32").stdout)
    assert hub_plan["vision_bytes"] == local["vision_bytes"] > 0
