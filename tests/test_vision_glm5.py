"""GLM-5.3-Flash's vision tower against transformers 5.24.0 (`Glm5NextForConditionalGeneration`, its Pillow image
processor and `Glm5NextProcessor`'s placeholder expansion) on a tiny random release with real-format vision
weights (tests/vision_release.py), in float32: pixel values equal, tower rows within 1e-4 relative L2, the logits
of a prompt with images within the family's tolerance, greedy text identical. Then what a bad image gets."""
import base64
import io
import json
import shutil

import numpy as np
import pytest
import torch
from fixtures import rel_l2
from vision_release import PREPROCESSOR, copy_without_vision, hf_processor, write_release

import waste
from waste.chat import ChatRequestError
from waste.convert.convert import convert
from waste.images.decode import open_image
from waste.images.glm5 import Glm5ImageProcessor

PIL = pytest.importorskip("PIL.Image")


def picture(w, h, mode="RGB", seed=0):
    rng = np.random.RandomState(seed)
    if mode == "L":
        return PIL.fromarray(rng.randint(0, 256, (h, w), dtype=np.uint8), "L")
    a = rng.randint(0, 256, (h, w, 4 if mode == "RGBA" else 3), dtype=np.uint8)
    return PIL.fromarray(a, mode)


def png(img) -> bytes:
    b = io.BytesIO()
    img.save(b, "PNG")
    return b.getvalue()


def data_url(img) -> str:
    return "data:image/png;base64," + base64.b64encode(png(img)).decode()


def ask(text, *imgs):
    return [{"role": "user", "content": [{"type": "text", "text": text}]
             + [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in imgs]}]


# sizes that take every branch of the canvas rule: below the minimum (scaled up), within, above the budget
# (scaled down), extreme aspect ratios; alpha (composited on white) and grayscale
IMAGES = [(150, 100, "RGB"), (20, 9, "L"), (640, 480, "RGBA"), (600, 40, "RGB"), (33, 300, "RGB"), (56, 56, "RGB")]


@pytest.fixture(scope="module")
def rel(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5v")
    src, hf = write_release(root / "src")
    out = convert(src, root / "glm5v.waste", experts="bf16", trunk="bf16", progress=False)
    return {"root": root, "src": src, "hf": hf, "out": out, "eng": waste.load(out, dtype="float32"),
            "proc": hf_processor(src)}


@pytest.mark.parametrize("w,h,mode", IMAGES)
def test_pixel_values_equal_the_release_processor(rel, w, h, mode):
    img = picture(w, h, mode)
    ref = rel["proc"].image_processor([img], return_tensors="pt")
    ours, grid = Glm5ImageProcessor.from_config(PREPROCESSOR)(open_image(png(img)))
    assert [1, *grid] == ref["image_grid_thw"][0].tolist()
    assert torch.equal(ours, ref["pixel_values"])


def test_tower_matches_transformers(rel):
    imgs = [picture(150, 100), picture(600, 40, seed=1)]      # two images of different grids: attention stays inside
    ref = rel["proc"].image_processor(imgs, return_tensors="pt")
    with torch.no_grad():
        want = rel["hf"].model.get_image_features(ref["pixel_values"], ref["image_grid_thw"]).pooler_output
    proc = Glm5ImageProcessor.from_config(PREPROCESSOR)
    done = [proc(open_image(png(i))) for i in imgs]
    got = rel["eng"].vision.tower()(torch.cat([p for p, _ in done]), [g for _, g in done])
    err = rel_l2(got, torch.cat(want))
    print(f"glm5 tower rel L2 {err:.2e}")
    assert got.shape == torch.cat(want).shape and err < 1e-4


def test_bf16_tower_rounds_like_transformers_bf16(rel):
    """In bfloat16 (--dtype auto above 2 GiB) the tower's distance from the float32 rows is transformers' own."""
    import copy

    ref = rel["proc"].image_processor([picture(150, 100)], return_tensors="pt")
    with torch.no_grad():
        f32 = rel["hf"].model.visual(ref["pixel_values"], grid_thw=ref["image_grid_thw"]).pooler_output
        theirs = copy.deepcopy(rel["hf"].model.visual).to(torch.bfloat16)(
            ref["pixel_values"].to(torch.bfloat16), grid_thw=ref["image_grid_thw"]).pooler_output
    ours = waste.load(rel["out"], dtype="bfloat16").vision.tower()(ref["pixel_values"],
                                                                     [tuple(ref["image_grid_thw"][0, 1:].tolist())])
    a, b = rel_l2(ours.float(), f32), rel_l2(theirs.float(), f32)
    print(f"glm5 tower bf16: ours {a:.2e}, transformers {b:.2e}")
    assert ours.dtype == torch.bfloat16 and a < 2 * b


def _hf_inputs(rel, c, imgs):
    return rel["proc"](images=imgs, text=[c.rendered.text], return_tensors="pt")


def test_prompt_logits_and_greedy_text_match_transformers(rel):
    eng, imgs = rel["eng"], [picture(150, 100), picture(20, 9, "L", seed=2)]
    c = eng.chat(ask("what is in these?", *imgs), max_tokens=1, stream=True)
    hf_in = _hf_inputs(rel, c, imgs)
    assert c.prompt_ids == hf_in["input_ids"][0].tolist()      # the placeholder expansion, token for token
    rows = c.generation.decoding.images
    ids = torch.tensor(c.prompt_ids)
    with torch.no_grad():
        ref = rel["hf"](input_ids=hf_in["input_ids"], pixel_values=hf_in["pixel_values"],
                        image_grid_thw=hf_in["image_grid_thw"]).logits[0]
    got = eng.model.step([(ids, eng.model.new_state(), 0, rows)], last_only=False)[0]
    err = rel_l2(got, ref)
    # against the oracle run in float64: on an Intel host waste's float32 logits came out 2.21e-5 from transformers'
    # float32 ones, over the text family's 2e-5, while 1.31e-5 from its float64 run (its own float32: 1.57e-5)
    with torch.no_grad():
        exact = rel["hf"].double()(input_ids=hf_in["input_ids"], pixel_values=hf_in["pixel_values"].double(),
                                   image_grid_thw=hf_in["image_grid_thw"]).logits[0]
    rel["hf"].float()
    mine = rel_l2(got.double(), exact)
    print(f"glm5 logits with images rel L2 {err:.2e} from transformers' float32, {mine:.2e} from its float64 "
          f"(its float32 {rel_l2(ref.double(), exact):.2e})")
    assert mine < 2e-5                   # the text family's bound (test_oracle_glm5)
    # the image rows matter: without them the logits are another model's
    plain = eng.model.step([(ids, eng.model.new_state(), 0)], last_only=False)[0]
    assert rel_l2(plain, ref) > 100 * err
    with torch.no_grad():
        want = rel["hf"].generate(**{k: hf_in[k] for k in ("input_ids", "pixel_values", "image_grid_thw")},
                                  max_new_tokens=24, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(ids):].tolist()
    toks = greedy_with_images(eng, ids, rows, 24)
    print("greedy", toks)
    assert toks == want and len(set(want)) > 3


def greedy_with_images(eng, ids, rows, n: int) -> list[int]:
    """n greedy tokens after a prefill of ids with the image rows spliced in, one decode step each."""
    state, toks = eng.model.new_state(), []
    logits = eng.model.step([(ids, state, 0, rows)])[0][-1]
    for t in range(n):
        toks.append(int(logits.argmax()))
        logits = eng.model.step([(torch.tensor(toks[-1:]), state, len(ids) + t)])[0][-1]
    return toks


def test_split_prefill_places_each_row_once(rel):
    eng, img = rel["eng"], picture(150, 100)
    c = eng.chat(ask("look", img), max_tokens=1, stream=True)
    ids, rows = torch.tensor(c.prompt_ids), c.generation.decoding.images
    whole = eng.model.step([(ids, eng.model.new_state(), 0, rows)], last_only=False)[0]
    st, cut = eng.model.new_state(), 9        # the cut falls inside the image's placeholders
    parts = [eng.model.step([(ids[:cut], st, 0, rows)], last_only=False)[0],
             eng.model.step([(ids[cut:], st, cut, rows)], last_only=False)[0]]
    assert rel_l2(torch.cat(parts), whole) < 1e-5


def test_engine_chat_with_an_image_generates(rel):
    c = rel["eng"].chat(ask("describe", picture(56, 56)), max_tokens=6, temperature=0)
    d = rel["eng"].chat([{"role": "user", "content": [{"type": "text", "text": "describe"},
                                                      {"type": "image", "image": png(picture(56, 56))}]}],
                        max_tokens=6, temperature=0)
    assert c.usage == d.usage and c.content == d.content and c.usage["completion_tokens"] >= 1


def _huge_png() -> bytes:
    b = io.BytesIO()
    PIL.new("1", (10000, 10000)).save(b, "PNG")        # 100 megapixels, a few kilobytes
    return b.getvalue()


@pytest.mark.parametrize("data,words", [
    (b"this is text, not a picture", "not an image"),
    (png(picture(150, 100))[:400], "cannot be decoded"),
    ("huge", "megapixels"),
])
def test_bad_images_get_one_clear_error(rel, data, words):
    data = _huge_png() if data == "huge" else data
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}
    with pytest.raises(ChatRequestError) as e:
        rel["eng"].chat([{"role": "user", "content": [{"type": "text", "text": "x"}, part]}], max_tokens=2)
    assert e.value.param == "messages" and words in str(e.value) and "messages[0].content[1]" in str(e.value)


@pytest.mark.parametrize("url,words", [("data:image/png;base64,@@@", "base64"), ("file:///etc/passwd", "data: URL"),
                                       ("data:image/png,abc", "base64")])
def test_bad_image_urls_are_refused(rel, url, words):
    with pytest.raises(ChatRequestError) as e:
        rel["eng"].chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
    assert e.value.param == "messages" and words in str(e.value)


def test_a_model_without_a_tower_refuses_images_by_field(rel):
    eng = waste.load(copy_without_vision(rel["out"], rel["root"] / "novision.waste"), dtype="float32")
    with pytest.raises(ChatRequestError) as e:
        eng.chat(ask("x", picture(56, 56)))
    assert e.value.param == "messages" and "no vision tower" in str(e.value)
    assert eng.chat([{"role": "user", "content": "hi"}], max_tokens=2).usage["prompt_tokens"] > 0


def test_a_template_that_writes_images_as_text_is_refused(rel):
    """The untouched GLM-5.3-Flash template tells the model it cannot see images: refused, not run blind."""
    from vision_release import TEMPLATE

    dst = rel["root"] / "textonly-template.waste"
    shutil.copytree(rel["out"], dst)
    (dst / "chat_template.jinja").write_text((TEMPLATE.parent / "GLM-5.3-Flash.jinja").read_text())
    m = json.loads((dst / "manifest.json").read_text())
    m.pop("files", None)
    (dst / "manifest.json").write_text(json.dumps(m))
    eng = waste.load(dst, dtype="float32", verify=False)
    with pytest.raises(ChatRequestError) as e:
        eng.chat(ask("x", picture(56, 56)))
    assert "placed 0 image placeholders for 1 images" in str(e.value)
