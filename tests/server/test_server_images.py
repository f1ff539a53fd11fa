"""Images through `mlx-tfm server` (server/images.py, the engine's image rows) on a tiny
random LLaVA (and an LFM2-VL, whose tower takes patch grids): OpenAI's image_url parts,
Ollama's images, against the one-sequence path in this process (generation/images.py's
ImageBoundModel over the same ids, or ``generate``); the prefix cache keyed by the image's
content; every bad image a one-line 400. Qwen3-VL's and Qwen3.5's images (M-RoPE) against
``generate`` with them. Every JSON answer is checked against OpenAI's spec
(fixtures/openai_spec.py)."""

from __future__ import annotations

import base64
import threading

import httpx
import mlx.core as mx
import pytest
from fixtures.openai_spec import spec_checking_http_client
from fixtures.qwen_vision_models import qwen_vl_folder
from fixtures.server_process import served
from fixtures.vision_serving import llava_folder, png_bomb, png_bytes

from mlx_tfm import load
from mlx_tfm.engine.images import read_images
from mlx_tfm.generation.images import ImageBoundModel, image_prompt_text
from mlx_tfm.generation.sampling import make_sampler
from mlx_tfm.generation.stream import generate, stream_generate

QUESTION = "describe this picture"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return llava_folder(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def server(folder):
    yield from served("--model", str(folder), "--max-tokens", "6", "--log-level", "warning")


@pytest.fixture(scope="module")
def http():
    return spec_checking_http_client()


@pytest.fixture(scope="module")
def llava(folder):
    return load(folder)


def data_url(index: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(index)).decode()


def image_message(*indices: int, text: str = QUESTION) -> dict:
    return {"role": "user", "content": [*({"type": "image_url", "image_url": {"url": data_url(i)}} for i in indices),
                                        {"type": "text", "text": text}]}


def expected_text(llava, messages: list[dict], indices: list[int], max_tokens: int = 6) -> str:
    """The answer in this process: the template's text with one placeholder per image,
    its image tokens written out, greedy decoding bound to the images' features."""
    model, processor = llava
    rendered = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                 processor.placeholder * sum(p["type"] == "image_url" for p in m["content"]) +
                 "\n".join(p["text"] for p in m["content"] if p["type"] == "text")} for m in messages]
    text = processor.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
    images = read_images(processor, [png_bytes(i) for i in indices])
    ids = processor.encode(images.expand(processor, text), add_special_tokens=False)
    bound = ImageBoundModel(model, images.encode(model), ids)
    return "".join(r.text for r in stream_generate(bound, processor, mx.array(ids), max_tokens=max_tokens,
                                                   sampler=make_sampler(temp=0.0)))


def chat(http, server, messages, **fields) -> httpx.Response:
    return http.post(f"{server.url}/chat/completions", json={"messages": messages, "max_tokens": 6, **fields})


def test_an_image_url_part_answers_as_generate_does(http, server, llava):
    messages = [image_message(0)]
    body = chat(http, server, messages).json()
    assert body["choices"][0]["message"]["content"] == expected_text(llava, messages, [0])
    two = [image_message(0, 1)]
    assert chat(http, server, two).json()["choices"][0]["message"]["content"] == expected_text(llava, two, [0, 1])


def test_an_image_row_alone_and_beside_text_rows(http, server):
    messages = [image_message(1)]
    alone = chat(http, server, messages).json()["choices"][0]["message"]["content"]
    answers = {}

    def ask(name, body):
        answers[name] = chat(httpx.Client(timeout=60), server, body).json()["choices"][0]["message"]["content"]

    threads = [threading.Thread(target=ask, args=(f"text{i}", [{"role": "user", "content": "describe that"}]))
               for i in range(3)] + [threading.Thread(target=ask, args=("image", messages))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers["image"] == alone and len({answers[f"text{i}"] for i in range(3)}) == 1


def test_a_second_turn_about_the_same_image_hits_the_prefix_cache(http, server, llava):
    first = [image_message(0, text="describe that picture")]
    answer = chat(http, server, first).json()
    turn = [*first, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": "and this"}]
    second = chat(http, server, turn).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= answer["usage"]["prompt_tokens"] - 1
    assert second["choices"][0]["message"]["content"] == expected_text(llava, turn, [0])
    other = chat(http, server, [image_message(2, text="describe that picture")]).json()  # an image never sent
    _, processor = llava
    text = processor.apply_chat_template([{"role": "user", "content": processor.placeholder}], tokenize=False)
    before_image = len(processor.encode(text.split(processor.placeholder)[0], add_special_tokens=False))
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] <= before_image


def test_ollama_images_on_chat_and_generate(server, llava, folder):
    image = base64.b64encode(png_bytes(0)).decode()
    body = httpx.post(f"{server.root}/api/chat", timeout=60, json={
        "model": folder.name, "stream": False, "options": {"num_predict": 6, "temperature": 0},
        "messages": [{"role": "user", "content": QUESTION, "images": [image]}]})
    assert body.status_code == 200, body.text
    assert body.json()["message"]["content"] == expected_text(llava, [image_message(0)], [0])
    generated = httpx.post(f"{server.root}/api/generate", timeout=60, json={
        "model": folder.name, "stream": False, "prompt": QUESTION, "images": [image], "options": {"num_predict": 6}})
    assert generated.json()["response"] == expected_text(llava, [image_message(0)], [0])


def one_line_400(response: httpx.Response, words: str, param: str | None = None) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and "\n" not in error["message"], error
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    return error


def part(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": url}}]}]


def b64(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.mark.parametrize("url, words", [
    (b64(b"hello, not a picture"), "is not an image"),
    (b64(png_bytes(0)[:200]), "truncated"),
    (b64(png_bomb()), "decompression bomb"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("https://example.com/cat.png", "does not fetch image URLs"),
    ("file:///etc/hostname", "--allow-local-images"),
], ids=["not-an-image", "truncated", "bomb", "bad-base64", "https", "file"])
def test_bad_images_are_one_line_400s(http, server, url, words):
    one_line_400(chat(http, server, part(url)), words, param="messages.0.content.1.image_url" +
                 (".url" if words in ("not valid base64", "does not fetch image URLs", "--allow-local-images") else ""))


def test_an_input_audio_part_is_a_400_naming_it(http, server):
    """No model here reads audio (Gemma 4's audio tower is not loaded): OpenAI's input_audio
    part is refused by name, not as a text part of the wrong type."""
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, audio]}]
    one_line_400(chat(http, server, messages), "content part 1 is input_audio: audio input is not supported",
                 param="messages.0")


def test_too_many_image_tokens_for_the_context(http, server):
    response = chat(http, server, [image_message(*[0] * 30, text="describe " * 700)])
    assert one_line_400(response, "context")["code"] == "context_length_exceeded"


def test_an_image_part_to_embeddings_is_a_400(http, server):
    response = http.post(f"{server.url}/embeddings", json={"input": [{"type": "image_url", "image_url": {
        "url": data_url(0)}}]})
    one_line_400(response, "needs an encoder model")  # this server's model is a decoder
    from mlx_tfm.server.embeddings import EmbeddingsRequest
    from mlx_tfm.server.errors import APIError
    from mlx_tfm.server.protocol import parse_body

    with pytest.raises(APIError) as error:  # what an encoder's server answers
        parse_body(b'{"input": [{"type": "image_url", "image_url": {"url": "data:,"}}]}', EmbeddingsRequest)
    assert error.value.status == 400 and error.value.param == "input"
    assert "content parts (images) are not supported" in error.value.message


def test_local_images_behind_the_flag(folder, tmp_path, llava):
    (tmp_path / "a.png").write_bytes(png_bytes(0))
    for process in served("--model", str(folder), "--max-tokens", "6", "--allow-local-images", "--log-level", "warning"):
        body = chat(spec_checking_http_client(), process, part(f"file://{tmp_path / 'a.png'}")).json()
        messages = [{"role": "user", "content": [{"type": "image_url"}, {"type": "text", "text": QUESTION}]}]
        assert body["choices"][0]["message"]["content"] == expected_text(llava, messages, [0])
        one_line_400(chat(spec_checking_http_client(), process, part(f"file://{tmp_path / 'none.png'}")),
                     "no image file")


def test_an_image_for_a_text_only_model(stories_hf):
    for process in served("--model", str(stories_hf), "--max-tokens", "4", "--log-level", "warning"):
        one_line_400(chat(spec_checking_http_client(), process, part(data_url(0))), "reads text only",
                     param="messages.0.content.1.type")


@pytest.mark.parametrize("style", ["qwen3_vl", "qwen3_5"])
def test_qwen_images_answer_as_generate_does_alone_beside_other_rows_and_from_the_cache(style, tmp_path):
    """Qwen's images (M-RoPE positions, each row its own rope_delta): an image answers as
    ``generate`` with it, also while text rows and an image of another size run beside
    it; asking again reuses the cached prompt, image included, and answers the same."""
    folder = qwen_vl_folder(style, tmp_path)[0]
    model, processor = load(folder)
    text = image_prompt_text(model, processor, QUESTION, 1)
    expected = [generate(model, processor, text, images=[png_bytes(i)], max_tokens=6) for i in (0, 1)]
    http = spec_checking_http_client()
    for process in served("--model", str(folder), "--max-tokens", "6", "--log-level", "warning"):
        first = chat(http, process, [image_message(0)]).json()
        assert first["choices"][0]["message"]["content"] == expected[0]
        answers = {}

        def ask(name, messages):
            answers[name] = chat(httpx.Client(timeout=120), process, messages).json()["choices"][0]["message"]["content"]

        threads = [threading.Thread(target=ask, args=(f"text{i}", [{"role": "user", "content": "describe that"}]))
                   for i in range(2)] + [threading.Thread(target=ask, args=("image1", [image_message(1)]))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert answers["image1"] == expected[1] and answers["text0"] == answers["text1"]
        again = chat(http, process, [image_message(0)]).json()
        assert again["choices"][0]["message"]["content"] == expected[0]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == first["usage"]["prompt_tokens"] - 1


def test_responses_input_image_and_a_follow_up(http, server, llava):
    messages = [image_message(0)]
    body = http.post(f"{server.url}/responses", json={"max_output_tokens": 6, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(0)}, {"type": "input_text", "text": QUESTION}]}]})
    assert body.status_code == 200, body.text
    answer = body.json()["output"][-1]["content"][0]["text"]
    assert answer == expected_text(llava, messages, [0])
    follow = http.post(f"{server.url}/responses", json={"max_output_tokens": 6, "input": "and that",
                                                        "previous_response_id": body.json()["id"]}).json()
    turn = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "and that"}]
    assert follow["output"][-1]["content"][0]["text"] == expected_text(llava, turn, [0])
    assert follow["usage"]["input_tokens_details"]["cached_tokens"] >= body.json()["usage"]["input_tokens"] - 1
    missing = http.post(f"{server.url}/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-1"}]}]})
    one_line_400(missing, "file_id", param="input.0.content.0.image_url")


def test_anthropic_image_blocks(server, llava, folder):
    image = base64.b64encode(png_bytes(0)).decode()
    body = httpx.post(f"{server.root}/v1/messages", timeout=60, json={
        "model": folder.name, "max_tokens": 6, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": image}},
            {"type": "text", "text": QUESTION}]}]})
    assert body.status_code == 200, body.text
    assert body.json()["content"][0]["text"] == expected_text(llava, [image_message(0)], [0])
    counted = httpx.post(f"{server.root}/v1/messages/count_tokens", timeout=60, json={
        "model": folder.name, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": image}},
            {"type": "text", "text": QUESTION}]}]}).json()
    assert counted["input_tokens"] == body.json()["usage"]["input_tokens"]


def test_responses_input_items_list_the_image(http, server):
    body = http.post(f"{server.url}/responses", json={"max_output_tokens": 2, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(1)}, {"type": "input_text", "text": QUESTION}]}]}).json()
    items = http.get(f"{server.url}/responses/{body['id']}/input_items").json()["data"]
    assert [part["type"] for part in items[0]["content"]] == ["input_image", "input_text"]
    assert items[0]["content"][0]["image_url"] == data_url(1)


def test_lfm2_vl_image_url_parts_answer_as_generate_does(tmp_path):
    """LFM2-VL (its views' patch grids beside the patches, fixtures/lfm2_vl_processors.py):
    a tiled image and a one-view image as image_url parts give, at temperature 0, the text
    ``generate`` gives alone for the same rendered prompt."""
    import io

    from fixtures.lfm2_vl_processors import lfm2_vl_folder
    from fixtures.vision_images import drawn_image, two_images

    from mlx_tfm.generation.stream import generate

    folder = lfm2_vl_folder(tmp_path / "lfm2_vl")
    images = [two_images()[0], drawn_image(30, 20, seed=3)]
    urls = []
    for image in images:
        out = io.BytesIO()
        image.save(out, format="PNG")
        urls.append("data:image/png;base64," + base64.b64encode(out.getvalue()).decode())
    messages = [{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                             {"type": "text", "text": QUESTION}]}]
    model, processor = load(folder)
    text = processor.apply_chat_template([{"role": "user", "content": processor.placeholder * 2 + QUESTION}],
                                         add_generation_prompt=True, tokenize=False)
    expected = generate(model, processor, text, images=images, max_tokens=6, sampler=make_sampler(temp=0.0))
    for process in served("--model", str(folder), "--max-tokens", "6", "--log-level", "warning"):
        body = chat(spec_checking_http_client(), process, messages, temperature=0).json()
        assert body["choices"][0]["message"]["content"] == expected and expected.strip()
        assert body["usage"]["prompt_tokens"] == len(processor.prepare(text, images)[0])


def test_llava_next_image_url_parts_answer_as_generate_does(tmp_path):
    """LLaVA-NeXT (its views packed by each image's size, image_sizes beside the pixels):
    the two test images as image_url parts give, at temperature 0, the text ``generate``
    gives alone for the same rendered prompt."""
    from fixtures.vision_images import two_images

    from mlx_tfm.generation.stream import generate

    folder = llava_folder(tmp_path / "llava_next", "llava_next")
    messages = [image_message(0, 1)]
    model, processor = load(folder)
    text = processor.apply_chat_template([{"role": "user", "content": processor.placeholder * 2 + QUESTION}],
                                         add_generation_prompt=True, tokenize=False)
    expected = generate(model, processor, text, images=two_images(), max_tokens=6, sampler=make_sampler(temp=0.0))
    for process in served("--model", str(folder), "--max-tokens", "6", "--log-level", "warning"):
        body = chat(spec_checking_http_client(), process, messages, temperature=0).json()
        assert body["choices"][0]["message"]["content"] == expected and expected.strip()
        assert body["usage"]["prompt_tokens"] == len(processor.prepare(text, two_images())[0])
