"""Images in the chat session (``/image PATH``, chat/images.py) on a tiny random LLaVA (and
an LFM2-VL, whose tower takes patch grids): answers equal greedy decoding of the whole
rendered conversation from scratch, bound to its images' features (generation/images.py's
ImageBoundModel, or ``generate``); a follow-up question
feeds only its new tokens and never runs the tower again; /undo and asking again give
the same answer; a bad path or a non-image is one line and the session goes on. Qwen2.5-VL's
images (M-RoPE positions) against ``generate`` over the whole conversation."""

import subprocess
import sys

import mlx.core as mx
import pytest
from fixtures.qwen_vision_models import qwen_vl_folder
from fixtures.vision_images import two_images
from fixtures.vision_serving import llava_folder

from mlx_tfm import load
from mlx_tfm.chat.commands import run_command
from mlx_tfm.chat.conversation import ChatSession, Settings
from mlx_tfm.engine.images import joined, read_images
from mlx_tfm.errors import UserError
from mlx_tfm.generation.images import ImageBoundModel
from mlx_tfm.generation.sampling import make_sampler
from mlx_tfm.generation.stream import generate, stream_generate
from mlx_tfm.model.vision_tower import VisionTower


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return llava_folder(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def llava(folder):
    return load(folder)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pictures")
    paths = []
    for i, image in enumerate(two_images()):
        image.save(folder / f"{i}.png")
        paths.append(str(folder / f"{i}.png"))
    (folder / "notes.png").write_text("not a picture")
    return paths, str(folder / "notes.png")


@pytest.fixture
def tower_calls(monkeypatch):
    calls = []
    original = VisionTower.__call__

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(VisionTower, "__call__", counted)
    return calls


def session_of(llava) -> ChatSession:
    model, processor = llava
    return ChatSession(model, processor, Settings(max_tokens=6), on_notice=lambda text: None)


def reference(llava, turns: list[tuple[str, list[str], str | None]]) -> str:
    """The last answer, from scratch: (user text, image paths, answer) turns rendered with
    the placeholders before the text, expanded and decoded greedily over the features."""
    model, processor = llava
    messages, paths = [], []
    for text, images, answer in turns:
        messages.append({"role": "user", "content": processor.placeholder * len(images) + text})
        paths += images
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not paths:
        ids = processor.encode(text, add_special_tokens=False)
        bound = model
    else:
        inputs = joined([read_images(processor, [p]) for p in paths])
        ids = processor.encode(inputs.expand(processor, text), add_special_tokens=False)
        bound = ImageBoundModel(model, model.encode_images(mx.array(inputs.pixel_values)), ids)
    return "".join(r.text for r in stream_generate(bound, processor, mx.array(ids), max_tokens=6,
                                                   sampler=make_sampler(temp=0.0)))


def ask(session: ChatSession, text: str) -> str:
    return "".join(session.answer(text))


def test_an_image_and_a_follow_up_question(llava, pictures, tower_calls):
    paths, _ = pictures
    expected_first = reference(llava, [("describe this", [paths[0]], None)])
    tower_calls.clear()
    session = session_of(llava)
    assert "1 image(s)" in run_command(session, f"/image {paths[0]}")
    first = ask(session, "describe this")
    assert first == expected_first and len(tower_calls) == 1
    second = ask(session, "and that")
    assert len(tower_calls) == 1  # the image's tokens were in the cache: no tower, no features
    fed, total = session.last_stats.new_prompt_tokens, len(session.cache.tokens)
    assert fed < 20 < total  # the 16 image tokens and the first exchange were not fed again
    assert second == reference(llava, [("describe this", [paths[0]], first), ("and that", [], None)])


def test_two_images_undo_and_ask_again(llava, pictures):
    paths, _ = pictures
    session = session_of(llava)
    run_command(session, f"/image {paths[0]}")
    run_command(session, f"/image {paths[1]}")
    first = ask(session, "describe this and that")
    assert first == reference(llava, [("describe this and that", paths, None)])
    follow_up = ask(session, "and this")
    assert run_command(session, "/undo") == "Dropped the last exchange."
    assert ask(session, "and this") == follow_up
    run_command(session, "/undo")
    run_command(session, "/undo")
    run_command(session, f"/image {paths[1]}")
    assert ask(session, "describe that") == reference(llava, [("describe that", [paths[1]], None)])


def test_bad_images_are_one_line_and_the_session_goes_on(llava, pictures, stories_hf):
    paths, not_an_image = pictures
    session = session_of(llava)
    for argument, words in [(f"/image {paths[0]}.missing", "no image file"), (f"/image {not_an_image}", "is not an image"),
                            ("/image", "usage: /image FILE")]:
        with pytest.raises(UserError, match=words) as error:
            run_command(session, argument)
        assert "\n" not in str(error.value)
    assert session.images.pending == []
    assert ask(session, "describe this") == reference(llava, [("describe this", [], None)])
    model, processor = llava
    drafted = ChatSession(model, processor, Settings(max_tokens=4), on_notice=lambda text: None, draft_model=model)
    with pytest.raises(UserError, match="cannot be used with a draft model"):
        run_command(drafted, f"/image {paths[0]}")
    text_model, tokenizer = load(stories_hf)
    text_session = ChatSession(text_model, tokenizer, Settings(max_tokens=4), on_notice=lambda text: None)
    with pytest.raises(UserError, match="reads text only"):
        run_command(text_session, f"/image {paths[0]}")


def test_a_qwen_image_and_a_follow_up_question(pictures, tmp_path):
    """Qwen's images (here Qwen2.5-VL's) turn by M-RoPE positions: each answer is
    ``generate`` over the whole conversation with its image, and the follow-up feeds only
    its new tokens, its positions still rope_delta behind the count."""
    model, processor = load(qwen_vl_folder("qwen2_5_vl", tmp_path)[0])
    paths, _ = pictures
    session = ChatSession(model, processor, Settings(max_tokens=6), on_notice=lambda text: None)
    assert "1 image(s)" in run_command(session, f"/image {paths[0]}")
    first = ask(session, "describe this")
    messages = [processor.image_message("describe this", 1)]

    def from_scratch() -> str:
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return generate(model, processor, text, images=[paths[0]], max_tokens=6)

    assert first == from_scratch()
    second = ask(session, "and that")
    keys = session.cache.tokens  # the image's tokens recorded by its key (negative)
    after_image = max(i for i, key in enumerate(keys) if key < 0) + 1
    assert session.last_stats.new_prompt_tokens <= len(keys) - after_image  # the image was not fed again
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "and that"}]
    assert second == from_scratch()


def test_image_in_the_repl(folder, llava, pictures):
    """`mlx-tfm chat` with piped input: bad /image lines are one bracketed line each and
    the chat goes on; the answer about the attached image is the session's."""
    paths, not_an_image = pictures
    expected = reference(llava, [("describe this", [paths[0]], None)])
    lines = [f"/image {paths[0]}.missing", f"/image {not_an_image}", f"/image {paths[0]}", "describe this"]
    result = subprocess.run([sys.executable, "-m", "mlx_tfm", "chat", "--model", str(folder), "--max-tokens", "6"],
                            input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    assert out[0] == f"[no image file at {paths[0]}.missing]"
    assert out[1].startswith(f"[{not_an_image} is not an image") and out[1].endswith("]")
    assert out[2].startswith(f"Attached {paths[0]}")
    assert expected.strip() and expected in result.stdout


def test_save_and_load_keep_the_images(llava, pictures, tmp_path):
    """/save names each image by its path; /load reads them again, so the next answer is
    that of the conversation with its images (from scratch)."""
    paths, _ = pictures
    session = session_of(llava)
    run_command(session, f"/image {paths[1]}")
    first = ask(session, "describe this")
    run_command(session, f"/save {tmp_path / 'chat.json'}")
    saved = (tmp_path / "chat.json").read_text()
    assert paths[1] in saved
    loaded = session_of(llava)
    run_command(loaded, f"/load {tmp_path / 'chat.json'}")
    assert ask(loaded, "and that") == reference(llava, [("describe this", [paths[1]], first), ("and that", [], None)])
    (tmp_path / "gone.json").write_text(saved.replace(paths[1], paths[1] + ".gone"))
    with pytest.raises(UserError, match="no image file"):
        run_command(loaded, f"/load {tmp_path / 'gone.json'}")
    assert len(loaded.conversation.turns) == 4 and ask(loaded, "and this")  # the conversation it had goes on


def test_lfm2_vl_images_and_a_follow_up(tmp_path):
    """LFM2-VL (its tower takes each view's patch grid): the answers about a tiled image
    and after a follow-up are ``generate``'s over the whole rendered conversation."""
    from fixtures.lfm2_vl_processors import lfm2_vl_folder

    from mlx_tfm.generation.stream import generate

    model, processor = load(lfm2_vl_folder(tmp_path / "lfm2_vl"))
    image = two_images()[0]  # 2x3 tiles and a thumbnail
    image.save(tmp_path / "0.png")

    def expected(messages):
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return generate(model, processor, text, images=[image], max_tokens=6, sampler=make_sampler(temp=0.0))

    session = ChatSession(model, processor, Settings(max_tokens=6), on_notice=lambda text: None)
    run_command(session, f"/image {tmp_path / '0.png'}")
    first = ask(session, "describe this")
    turns = [{"role": "user", "content": processor.placeholder + "describe this"}]
    assert first == expected(turns) and first.strip()
    second = ask(session, "and that")
    assert second == expected([*turns, {"role": "assistant", "content": first}, {"role": "user", "content": "and that"}])


def test_llava_next_images_and_a_follow_up(tmp_path):
    """LLaVA-NeXT (each image's views packed by its size): the answers about the two test
    images (different grids) and after a follow-up are ``generate``'s over the whole
    rendered conversation."""
    from mlx_tfm.generation.stream import generate

    model, processor = load(llava_folder(tmp_path / "llava_next", "llava_next"))
    for i, image in enumerate(two_images()):
        image.save(tmp_path / f"{i}.png")

    def expected(messages):
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return generate(model, processor, text, images=two_images(), max_tokens=6, sampler=make_sampler(temp=0.0))

    session = ChatSession(model, processor, Settings(max_tokens=6), on_notice=lambda text: None)
    run_command(session, f"/image {tmp_path / '0.png'}")
    run_command(session, f"/image {tmp_path / '1.png'}")
    first = ask(session, "describe this")
    turns = [{"role": "user", "content": processor.placeholder * 2 + "describe this"}]
    assert first == expected(turns) and first.strip()
    second = ask(session, "and that")
    assert second == expected([*turns, {"role": "assistant", "content": first}, {"role": "user", "content": "and that"}])
