"""Kimi K3's MoonViT against mlx-vlm 0.7.10's `kimi_k3` (its tower, projector, image processor and processor, on
Linux CPU through mlx 0.32.4) on a tiny random K3 release with real-format vision weights (tests/k3_release.py,
loaded by mlx-vlm's own loader), in float32: pixel values equal, tower rows within 1e-4 relative L2, the prompt's
image markup token for token, the logits of a prompt with images within the family's tolerance, greedy text
identical. Then the user surfaces (image_url parts on a real server, `waste run --image`, `/image` in `waste chat`,
`waste info`, `waste plan`) and what a bad image gets, as tests/test_vision_glm5.py and test_vision_surfaces.py do
for GLM-5.3-Flash."""
import base64
import io
import json
import shutil

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core", reason='the K3 oracle is not installed: pip install "mlx[cpu]==0.32.4"')
mlx_vlm_k3 = pytest.importorskip("mlx_vlm.models.kimi_k3", reason="mlx-vlm 0.7.10 (the K3 vision oracle) is not "
                                 "installed: pip install --no-deps mlx-vlm==0.7.10 (scripts/test.sh)")
PIL = pytest.importorskip("PIL.Image")

from fixtures import rel_l2  # noqa: E402
from k3_release import VISION, train_ranks, write_k3_tokenizer, write_release  # noqa: E402
from test_chat_kimi_k3 import CORPUS, TEMPLATE  # noqa: E402
from test_vision_glm5 import _huge_png, ask, greedy_with_images, png  # noqa: E402

import waste  # noqa: E402
from waste.chat import ChatRequestError  # noqa: E402
from waste.convert.convert import convert  # noqa: E402
from waste.errors import WasteError  # noqa: E402
from waste.images.decode import open_image  # noqa: E402
from waste.images.kimi_k3 import KimiK3ImageProcessor  # noqa: E402

CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
# the release's media_proc_cfg with small limits, so that ordinary images are scaled down (the release: 65536
# patches, 512 on a side)
MEDIA = {"patch_size": 14, "in_patch_limit": 96, "patch_limit_on_one_side": 14, "merge_kernel_size": [2, 2],
         "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
# processor settings the pixel test also takes: transparency filled after the resize on a chessboard, or on gray
# before it; the defaults (no image is scaled)
OTHER_MEDIA = [{"in_patch_limit": 400, "patch_limit_on_one_side": 30, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
                "transparent_bg_config": {"pattern": "chessboard", "chessboard_square_size": 8},
                "transparent_bg_fill_stage": "after_resize"},
               {"transparent_bg_config": {"pattern": "gray"}}]


def picture(w, h, mode="RGB", seed=0):
    rng = np.random.RandomState(seed)
    if mode == "L":
        return PIL.fromarray(rng.randint(0, 256, (h, w), dtype=np.uint8), "L")
    img = PIL.fromarray(rng.randint(0, 256, (h, w, 4 if mode in ("RGBA", "P") else 3), dtype=np.uint8),
                        "RGBA" if mode in ("RGBA", "P") else "RGB")
    if mode == "P":           # a palette with one transparent entry
        img = img.convert("RGB").quantize(16)
        img.info["transparency"] = 3
    return img


@pytest.fixture(scope="module")
def rel(tmp_path_factory):
    from mlx_vlm.models.kimi_k3.processing_kimi_k3 import KimiK3Processor
    from mlx_vlm.utils import load_model

    root = tmp_path_factory.mktemp("k3v")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)     # a tiny model on a busy 2-core box is many times slower with two (LEARNED.md §3c)
    ranks = train_ranks(CORPUS + TEMPLATE.read_text(), 400)
    n = len(ranks)
    src = write_release(root / "src", "bf16", vocab_size=n + 256, bos_token_id=n, eos_token_id=n + 2,
                        media_placeholder_token_id=n + 21)
    write_k3_tokenizer(src, ranks)
    shutil.copy(TEMPLATE, src / "chat_template.jinja")
    (src / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": MEDIA}))
    out = convert(src, root / "k3v.waste", experts="bf16", trunk="bf16", progress=False)
    model = load_model(src)                    # mlx-vlm's own loader: the release's names, as released
    model.set_dtype(mx.float32)
    eng = waste.load(out, dtype="float32")
    yield {"root": root, "src": src, "out": out, "eng": eng, "mlx": model,
           "proc": KimiK3Processor.from_pretrained(str(src))}
    eng.close()
    torch.set_num_threads(threads)


def mlx_pixels(proc, imgs):
    ref = proc(imgs)
    pv = torch.from_numpy(np.array(ref["pixel_values"]))
    return pv.reshape(pv.shape[0], -1), [tuple(g[1:]) for g in np.array(ref["grid_thws"]).tolist()], ref


IMAGES = [(150, 100, "RGB"), (20, 9, "L"), (640, 480, "RGBA"), (600, 40, "RGB"), (33, 300, "P"), (56, 56, "RGB")]


@pytest.mark.parametrize("media", [MEDIA, *OTHER_MEDIA], ids=["release", "chessboard-after", "gray-defaults"])
@pytest.mark.parametrize("w,h,mode", IMAGES)
def test_pixel_values_equal_the_release_processor(w, h, mode, media):
    from mlx_vlm.models.kimi_k3.processing_kimi_k3 import KimiK3ImageProcessor as Theirs

    img = picture(w, h, mode)
    want, grids, _ = mlx_pixels(Theirs(**media), [img])
    ours, grid = KimiK3ImageProcessor.from_config({"media_proc_cfg": media})(open_image(png(img), composite=False))
    assert [grid] == grids and torch.equal(ours, want)


def test_tower_matches_mlx_vlm(rel):
    imgs = [picture(150, 100), picture(600, 40, seed=1)]      # two grids, both unlike the 8x8 position table
    pv, grids, _ = mlx_pixels(rel["proc"].image_processor, imgs)
    m = rel["mlx"]
    want = torch.from_numpy(np.array(m.mm_projector(m.vision_tower(
        mx.array(pv.reshape(-1, 3, 14, 14).numpy()).transpose(0, 2, 3, 1), grid_thws=[[1, *g] for g in grids]))))
    got = rel["eng"].vision.tower()(pv, grids)
    err = rel_l2(got, want)
    print(f"kimi_k3 tower rel L2 {err:.2e}")
    assert got.shape == want.shape == (sum(h * w for h, w in grids) // 4, 80) and err < 1e-4
    assert len(rel["eng"].vision.tower().w) == len(VISION)


def test_bf16_tower_rounds_like_mlx_vlm_bf16(rel):
    """In bfloat16 (--dtype auto above 2 GiB) the tower's distance from the float32 rows is mlx-vlm's own."""
    from mlx_vlm.utils import load_model

    pv, grids, _ = mlx_pixels(rel["proc"].image_processor, [picture(150, 100)])
    x = mx.array(pv.reshape(-1, 3, 14, 14).numpy()).transpose(0, 2, 3, 1)
    g = [[1, *grids[0]]]
    m = rel["mlx"]
    f32 = torch.from_numpy(np.array(m.mm_projector(m.vision_tower(x, grid_thws=g))))
    half = load_model(rel["src"])
    half.set_dtype(mx.bfloat16)
    theirs = torch.from_numpy(np.array(half.mm_projector(half.vision_tower(x.astype(mx.bfloat16), grid_thws=g))
                                       .astype(mx.float32)))
    eng = waste.load(rel["out"], dtype="bfloat16")
    try:
        ours = eng.vision.tower()(pv, grids)
    finally:
        eng.close()
    a, b = rel_l2(ours.float(), f32), rel_l2(theirs, f32)
    print(f"kimi_k3 tower bf16: ours {a:.2e}, mlx-vlm {b:.2e}")
    assert ours.dtype == torch.bfloat16 and 0 < a < 2 * b


def mlx_inputs(rel, c, imgs):
    mi = rel["proc"](images=imgs, text=[c.rendered.text])
    return mi, np.array(mi["input_ids"])[0].tolist()


def test_prompt_logits_and_greedy_text_match_mlx_vlm(rel):
    eng, m, imgs = rel["eng"], rel["mlx"], [picture(150, 100), picture(20, 9, "L", seed=2)]
    c = eng.chat(ask("what is in these?", *imgs), max_tokens=1, stream=True)
    mi, want_ids = mlx_inputs(rel, c, imgs)
    assert c.prompt_ids == want_ids          # <|media_begin|>image WxH<|media_content|> pads <|media_end|>
    tok = eng.tokenizer
    assert "image 150x100" in tok.decode(c.prompt_ids) and "image 20x9" in tok.decode(c.prompt_ids)
    rows = c.generation.decoding.images
    pads = [i for i, t in enumerate(c.prompt_ids) if t == tok.token_to_id("<|media_pad|>")]
    assert rows.at.tolist() == pads and len(pads) == rows.rows.shape[0]
    ids = torch.tensor(c.prompt_ids)
    x = mx.array([want_ids])
    kw = {"grid_thws": mi["grid_thws"], "image_token_id": mi["image_token_id"]}
    ref = torch.from_numpy(np.array(m(x, mi["pixel_values"], **kw).logits))[0]
    got = eng.model.step([(ids, eng.model.new_state(), 0, rows)], last_only=False)[0]
    err = rel_l2(got, ref)
    print(f"kimi_k3 logits with images rel L2 {err:.2e}")
    assert err < 1e-4                    # the text family's bound (test_oracle_kimi_k3)
    plain = eng.model.step([(ids, eng.model.new_state(), 0)], last_only=False)[0]
    assert rel_l2(plain, ref) > 100 * err           # the image rows are what the agreement rests on
    # greedy through each side's own caches: a prefill with the image rows, then one token per step
    cache = m.make_cache()
    emb = m.get_input_embeddings(x, mi["pixel_values"], **kw).inputs_embeds
    logits, want = m.language_model(x, cache=cache, inputs_embeds=emb).logits, []
    for _ in range(24):
        want.append(int(mx.argmax(logits[0, -1]).item()))
        logits = m.language_model(mx.array([[want[-1]]]), cache=cache).logits
    toks = greedy_with_images(eng, ids, rows, 24)
    print("greedy", toks)
    assert toks == want and len(set(want)) > 3


def test_split_prefill_places_each_row_once(rel):
    eng = rel["eng"]
    c = eng.chat(ask("look", picture(150, 100)), max_tokens=1, stream=True)
    ids, rows = torch.tensor(c.prompt_ids), c.generation.decoding.images
    whole = eng.model.step([(ids, eng.model.new_state(), 0, rows)], last_only=False)[0]
    st, cut = eng.model.new_state(), int(rows.at[5])        # the cut falls inside the image's pads
    parts = [eng.model.step([(ids[:cut], st, 0, rows)], last_only=False)[0],
             eng.model.step([(ids[cut:], st, cut, rows)], last_only=False)[0]]
    # not bit-identical (torch's matmuls block T rows differently); measured 5.5e-6, and 1.0e-5 once RMS norm became
    # the numba row kernel (its float32 sum in another order): about Kimi-Linear's split bound (test_oracle.SPLIT)
    assert rel_l2(torch.cat(parts), whole) < 2e-5


def test_engine_chat_with_image_bytes_equals_a_data_url(rel):
    img = picture(640, 480, "RGBA", seed=4)
    c = rel["eng"].chat(ask("describe", img), max_tokens=6, temperature=0)
    d = rel["eng"].chat([{"role": "user", "content": [{"type": "text", "text": "describe"},
                                                      {"type": "image", "image": png(img)}]}],
                        max_tokens=6, temperature=0)
    assert c.usage == d.usage and (c.reasoning_content, c.content) == (d.reasoning_content, d.content)
    assert c.usage["completion_tokens"] >= 1


@pytest.mark.parametrize("data,words", [(b"this is text, not a picture", "not an image"),
                                        ("truncated", "cannot be decoded"), ("huge", "megapixels")])
def test_bad_images_get_one_clear_error(rel, data, words):
    data = {"huge": _huge_png, "truncated": lambda: png(picture(150, 100))[:400]}.get(data, lambda: data)()
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}
    with pytest.raises(ChatRequestError) as e:
        rel["eng"].chat([{"role": "user", "content": [{"type": "text", "text": "x"}, part]}], max_tokens=2)
    assert e.value.param == "messages" and words in str(e.value) and "messages[0].content[1]" in str(e.value)


def test_a_tokenizer_without_the_media_markers_is_refused(rel):
    """A tokenizer missing `<|media_pad|>` cannot place the rows: one error naming it, not a blind run."""
    from waste.chat import normalise_messages
    from waste.vision import Vision

    class Missing:
        def __init__(self, tok):
            self.tok = tok

        def token_to_id(self, t):
            return None if t == "<|media_pad|>" else self.tok.token_to_id(t)

    eng = rel["eng"]
    ids = eng.chat_format().render(normalise_messages(ask("x", picture(56, 56)), [])).ids
    img = open_image(png(picture(56, 56)), composite=False)
    assert len(Vision(eng.container, eng.tokenizer, torch.float32).expand(ids, [img])[0]) > len(ids)
    with pytest.raises(WasteError, match=r"no <\|media_pad\|> token"):
        Vision(eng.container, Missing(eng.tokenizer), torch.float32).expand(ids, [img])


# -- where users meet it -------------------------------------------------------------------------------------

def test_server_takes_image_parts(rel):
    import openai
    from serve_util import ProcessServer

    img = picture(120, 90, seed=5)
    want = rel["eng"].chat(ask("what is this?", img), max_tokens=6, temperature=0)
    srv = ProcessServer(rel["out"], "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        r = client.chat.completions.create(model="k3v", messages=ask("what is this?", img), max_tokens=6,
                                           temperature=0)
        msg = r.choices[0].message
        assert ((getattr(msg, "reasoning_content", None) or ""), msg.content or "") == \
            (want.reasoning_content or "", want.content or "")
        assert r.usage.prompt_tokens == want.usage["prompt_tokens"]
        bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(b"not a picture").decode()}}]}]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="k3v", messages=bad, max_tokens=2)
        assert e.value.body["param"] == "messages" and "messages[0].content[0]" in e.value.body["message"]
    finally:
        srv.stop()


def test_run_with_an_image_and_the_chat_command(rel, capsys):
    from waste.chat_cli import Session
    from waste.cli import build_parser, main

    img = png(picture(120, 90, seed=5))
    (rel["root"] / "pic.png").write_bytes(img)
    want = rel["eng"].chat([{"role": "user", "content": [{"type": "image", "image": img},
                                                         {"type": "text", "text": "what is this?"}]}],
                           max_tokens=6, temperature=0)
    try:        # in-process: the CLI's own code path without another interpreter's start-up (test_vision_surfaces.py
                # runs GLM's through a subprocess)
        assert main(["run", str(rel["out"]), "--image", str(rel["root"] / "pic.png"), "what is this?", "-n", "6",
                     "--temperature", "0", "--dtype", "float32", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(1)
    assert capsys.readouterr().out == (want.reasoning_content or "") + (want.content or "") + "\n"
    (rel["root"] / "text.png").write_text("hello")
    assert main(["run", str(rel["out"]), "--image", str(rel["root"] / "text.png"), "hi", "-n", "2"]) == 1
    assert "not an image" in capsys.readouterr().err
    out, err = io.StringIO(), io.StringIO()
    s = Session(rel["eng"], build_parser().parse_args(["chat", str(rel["out"]), "-n", "6", "--temperature", "0"]),
                out, err)
    s.command(f"/image {rel['root'] / 'pic.png'}")
    assert "image attached (120x90)" in err.getvalue()
    s.turn("what is this?")
    assert s.history[0]["content"][0]["type"] == "image" and not s.images
    assert s.history[1].get("reasoning_content") == want.reasoning_content
    assert (s.history[1]["content"] or "") == (want.content or "")


def test_info_and_plan_count_the_tower(rel, capsys):
    from k3_release import VISION_CONFIG

    from waste.cli import main

    def out(*args):
        assert main([*map(str, args)]) == 0
        return capsys.readouterr().out

    v = json.loads(out("info", rel["out"], "--json"))["vision"]
    m = json.loads((rel["out"] / "manifest.json").read_text())["vision"]
    assert v["runs"] and v["params"] == m["params"] == sum(int(np.prod(s)) for s in VISION.values())
    assert "runs on image parts" in out("info", rel["out"])
    assert "vision tower" in out("plan", rel["out"])
    plan = json.loads(out("plan", rel["out"], "--json", "--dtype", "float32"))
    # weights + activations of the largest image: 96 patches + a padding row and column of 2x2 blocks on a 14-patch
    # side, each 3 x hidden + 6 x qkv_hidden + 2 x intermediate values, in float32
    c = VISION_CONFIG
    patches = 96 + 4 * (14 + 2)
    acts = patches * (3 * c["vt_hidden_size"] + 6 * c["qkv_hidden_size"] + 2 * c["vt_intermediate_size"])
    assert plan["vision_bytes"] == (m["params"] + acts) * 4
    assert plan["floor_bytes"] == sum(plan[k] for k in ("trunk_bytes", "state_bytes", "scratch_bytes",
                                                         "baseline_bytes", "vision_bytes"))
    # the bound holds: no image the processor accepts makes more patches
    proc = KimiK3ImageProcessor.from_config({"media_proc_cfg": MEDIA})
    sizes = [(w, h) for w in range(1, 700, 13) for h in range(1, 700, 17)]
    assert max(np.prod(proc.grid(h, w)) for w, h in sizes) <= patches
