"""The chat page of `mlx-tfm server` (server/page_route.py, server/page/): served to browsers at
GET /, with its files' content types and no external URL; its markdown renderer escapes
HTML; and in headless chromium (Debian's, driven by selenium through the system
chromedriver) on stories260K it streams answers, stops one mid-way (the server cancels the
request), and keeps conversations across a reload.

References: the answers and usage of the same requests sent straight to the API (greedy, so
they repeat), the model's config.json for the context length, and hand-written HTML for the
renderer."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait
from starlette.testclient import TestClient

from fixtures.server_process import served
from mlx_tfm.server.app import ServerState, build_app
from mlx_tfm.server.settings import ServerSettings

BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
PAGE_FILES = {"app.js": "text/javascript", "markdown.js": "text/javascript", "style.css": "text/css"}
MAX_TOKENS = 40  # the server's default, which the page takes as its max tokens
SCREENSHOT = Path(__file__).parents[2] / "docs" / "images" / "chat-page.png"
WAIT_S = 60


@pytest.fixture(scope="module")
def server(stories_hf):
    yield from served("--model", str(stories_hf), "--max-tokens", str(MAX_TOKENS), "--log-level", "warning")


@pytest.fixture(scope="module")
def rotating_server(stories_hf):
    """A rotating cache takes any length, so an answer of 100000 tokens is still running when stopped."""
    yield from served("--model", str(stories_hf), "--max-kv-size", "64", "--log-level", "warning")


@pytest.fixture(scope="module")
def browser():
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        pytest.fail("the chat page's browser test needs Debian's chromium: apt-get install -y chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,800"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=chromedriver))
    yield driver
    driver.quit()


def wait_for(driver, condition, what: str):
    return WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(lambda d: condition(d), message=what)


# -- served over HTTP ---------------------------------------------------------------------------


def test_root_is_the_page_for_browsers_and_ollamas_banner_for_others(server):
    page = httpx.get(f"{server.root}/", headers={"Accept": BROWSER_ACCEPT})
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert "<title>mlx-tfm chat</title>" in page.text
    for accept in ("*/*", "application/json", ""):
        banner = httpx.get(f"{server.root}/", headers={"Accept": accept})
        assert banner.text == "Ollama is running" and banner.headers["content-type"].startswith("text/plain")


@pytest.mark.parametrize("name", sorted(PAGE_FILES))
def test_page_files_are_served_with_their_content_types(server, name):
    response = httpx.get(f"{server.root}/page/{name}")
    assert response.status_code == 200
    assert response.headers["content-type"] == f"{PAGE_FILES[name]}; charset=utf-8"
    assert response.text == (Path(__file__).parents[2] / "mlx_tfm" / "server" / "page" / name).read_text()


def test_page_names_no_external_url(server):
    """Works offline: no CDN, no web font, nothing fetched from another host."""
    texts = {name: httpx.get(f"{server.root}/page/{name}").text for name in PAGE_FILES}
    texts["index.html"] = httpx.get(f"{server.root}/", headers={"Accept": BROWSER_ACCEPT}).text
    for name, text in texts.items():
        assert not re.search(r"https?://|(src|href)\s*=\s*[\"']//|@import|url\(", text), name
    # Every script and style the page loads is one of the files served beside it.
    loaded = re.findall(r"(?:src|href)=\"([^\"]+)\"", texts["index.html"])
    assert sorted(loaded) == sorted(f"/page/{name}" for name in PAGE_FILES)


def test_unknown_page_file_is_a_404_naming_it(server):
    response = httpx.get(f"{server.root}/page/secrets.txt")
    assert response.status_code == 404 and "'secrets.txt'" in response.json()["error"]["message"]


def test_props_tell_the_context_length_and_the_defaults(server, rotating_server, stories_hf):
    config = json.loads((stories_hf / "config.json").read_text())
    props = httpx.get(f"{server.url}/props").json()
    assert props == {"model": stories_hf.name, "context_length": config["max_position_embeddings"],
                     "max_kv_size": None, "defaults": {"max_tokens": MAX_TOKENS, "temperature": 0.0, "top_p": 1.0}}
    rotating = httpx.get(f"{rotating_server.url}/props").json()
    assert rotating["context_length"] is None and rotating["max_kv_size"] == 64


def test_api_key_guards_the_api_but_not_the_page_files():
    """The page must load before it can ask for the key; its API calls send it."""
    state = ServerState(ServerSettings(model="unused", api_key="sesame"), loader=lambda settings: None)
    client = TestClient(build_app(state))  # no lifespan: the model is never loaded
    assert client.get("/", headers={"Accept": BROWSER_ACCEPT}).status_code == 200
    assert client.get("/page/app.js").status_code == 200
    assert client.get("/v1/props").status_code == 401 and client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200


# -- the markdown renderer, in the browser ------------------------------------------------------

MARKDOWN_CASES = [
    ("# Title\n\nSome **bold**, *italic* and `code`.",
     "<h1>Title</h1>\n<p>Some <strong>bold</strong>, <em>italic</em> and <code>code</code>.</p>"),
    ("- one\n- two\n\n1. first\n2. second",
     "<ul><li>one</li><li>two</li></ul>\n<ol><li>first</li><li>second</li></ol>"),
    ("```python\nif a < b and c > d:\n    print(\"**no emphasis**\")\n```",
     ('<pre data-language="python"><code>if a &lt; b and c &gt; d:\n'
      '    print(&quot;**no emphasis**&quot;)</code></pre>')),
    ("see [the docs](https://example.org/a?b=1&c=2)",
     '<p>see <a href="https://example.org/a?b=1&amp;c=2" target="_blank" rel="noopener noreferrer">the docs</a></p>'),
    ("```\nstill streaming", "<pre><code>still streaming</code></pre>"),  # an unclosed fence runs to the end
    ("line one\nline two", "<p>line one<br>line two</p>"),
]

INJECTIONS = [
    "<script>window.injected = 1</script>",
    "<img src=x onerror=\"window.injected = 1\">",
    "**<b onmouseover=alert(1)>x</b>** `<i>`",
    "# <iframe src=/>\n- <svg onload=alert(1)>",
    "[click](javascript:window.injected=1) and [x](data:text/html,hi)",
]


@pytest.fixture(scope="module")
def page(server, browser):
    return open_page(browser, server)


def open_page(driver, server):
    """The page, loaded once its model's name shows."""
    driver.get(f"{server.root}/")
    wait_for(driver, lambda d: d.find_element(By.ID, "model-name").text == server_model(server), "the model's name")
    return driver


def fresh_page(driver, server):
    """The page with nothing kept from an earlier test (no conversations, the server's defaults)."""
    open_page(driver, server).execute_script("localStorage.clear()")
    return open_page(driver, server)


def server_model(server) -> str:
    return httpx.get(f"{server.url}/models").json()["data"][0]["id"]


@pytest.mark.parametrize("text, html", MARKDOWN_CASES)
def test_renderer_writes_the_markdown_as_html(page, text, html):
    assert page.execute_script("return renderMarkdown(arguments[0])", text) == html


@pytest.mark.parametrize("text", INJECTIONS)
def test_renderer_escapes_html(page, text):
    """Rendered into the page, an answer's markup stays text: no element but the renderer's own,
    no script run, no javascript: or data: link."""
    tags = page.execute_script("""
        const box = document.createElement("div");
        box.innerHTML = renderMarkdown(arguments[0]);
        document.body.append(box);
        const tags = [...box.querySelectorAll("*")].map((e) => e.tagName.toLowerCase());
        const hrefs = [...box.querySelectorAll("a")].map((a) => a.getAttribute("href"));
        box.remove();
        return {tags, hrefs, injected: window.injected ?? null};""", text)
    assert set(tags["tags"]) <= {"p", "h1", "ul", "li", "strong", "em", "code", "br"}, tags
    assert tags["hrefs"] == [] and tags["injected"] is None


# -- chatting in the browser ------------------------------------------------------------------------


def stored_conversations(driver) -> list:
    return driver.execute_script("return JSON.parse(localStorage.getItem('mlx-tfm-chat.conversations')) ?? []")


def bubbles(driver) -> list:
    return driver.find_elements(By.CSS_SELECTOR, "#messages .message")


def send_message(driver, text: str) -> None:
    prompt = driver.find_element(By.ID, "prompt")
    prompt.send_keys(text)
    prompt.send_keys(Keys.ENTER)  # Enter sends


def bubble_states(driver) -> list[str]:
    """Each bubble's state, read at once (the page redraws its bubbles when an answer ends)."""
    script = "return [...document.querySelectorAll('#messages .message')].map((bubble) => bubble.dataset.state)"
    return driver.execute_script(script)


def wait_for_answer(driver, count: int) -> str:
    """The last answer's state once ``count`` bubbles are shown and it finished streaming."""
    wait_for(driver, lambda d: len(states := bubble_states(d)) == count and states[-1] != "streaming",
             f"answer {count // 2}")
    return bubble_states(driver)[-1]


def api_answer(server, messages: list) -> dict:
    """The same request sent straight to the API (the page's settings: the server's defaults)."""
    body = {"model": server_model(server), "messages": messages, "temperature": 0, "top_p": 1, "max_tokens": MAX_TOKENS}
    return httpx.post(f"{server.url}/chat/completions", json=body, timeout=60).json()


def test_the_page_streams_answers_and_keeps_conversations(server, browser, stories_hf, tmp_path):
    page = fresh_page(browser, server)
    first, second = "Tell me a story about a cat.", "And then what did the dog do?"
    send_message(page, first)
    state = wait_for_answer(page, 2)
    reference = api_answer(server, [{"role": "user", "content": first}])
    assert state == "length"  # the story is longer than MAX_TOKENS
    assert stored_conversations(page)[0]["messages"][1]["content"] == reference["choices"][0]["message"]["content"]

    send_message(page, second)  # the second turn sends the whole conversation
    wait_for_answer(page, 4)
    history = [{"role": "user", "content": first}, reference["choices"][0]["message"],
               {"role": "user", "content": second}]
    reference = api_answer(server, [{key: m[key] for key in ("role", "content")} for m in history])
    (conversation,) = stored_conversations(page)
    assert conversation["messages"][3]["content"] == reference["choices"][0]["message"]["content"]
    context = json.loads((stories_hf / "config.json").read_text())["max_position_embeddings"]
    assert page.find_element(By.ID, "context-use").text == f"{reference['usage']['total_tokens']} / {context} tokens"

    page.refresh()
    open_page(page, server)
    listed = page.find_elements(By.CSS_SELECTOR, "#conversations li button.open")
    assert [item.text for item in listed] == [first]
    assert bubbles(page) == []  # a reload opens a new chat; the old one is in the list
    listed[0].click()
    assert [bubble.text for bubble in bubbles(page)[::2]] == [first, second]
    save_screenshot(page, tmp_path)

    page.find_element(By.ID, "new-chat").click()
    assert bubbles(page) == [] and len(page.find_elements(By.CSS_SELECTOR, "#conversations li")) == 1


def test_a_refused_request_shows_the_servers_message(server, browser):
    page = fresh_page(browser, server)
    page.find_element(By.ID, "settings").click()
    temperature = page.find_element(By.ID, "temperature")
    temperature.clear()
    temperature.send_keys("-1")
    send_message(page, "Hello?")
    assert wait_for_answer(page, 2) == "error"
    body = {"messages": [{"role": "user", "content": "Hello?"}], "temperature": -1}
    refused = httpx.post(f"{server.url}/chat/completions", json=body).json()["error"]["message"]
    assert bubbles(page)[-1].text == f"the server answered: {refused}"


def save_screenshot(driver, tmp_path: Path) -> None:
    """Into tmp_path always; into docs/images when MLX_TFM_UPDATE_SCREENSHOT=1 (the docs' picture)."""
    assert driver.save_screenshot(str(tmp_path / "chat-page.png"))
    assert (tmp_path / "chat-page.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("MLX_TFM_UPDATE_SCREENSHOT") == "1":
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tmp_path / "chat-page.png", SCREENSHOT)


def cancelled_requests(server) -> float:
    metrics = httpx.get(f"{server.root}/metrics").text
    found = re.search(r'^mlx_tfm_engine_requests_total\{finish_reason="cancelled"\} (\S+)$', metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_stop_ends_the_answer_and_the_server_cancels_it(rotating_server, browser):
    fresh_page(browser, rotating_server)
    browser.find_element(By.ID, "settings").click()
    max_tokens = browser.find_element(By.ID, "max-tokens")
    max_tokens.clear()
    max_tokens.send_keys("100000")
    send_message(browser, "Tell me a long story.")
    wait_for(browser, lambda d: len(bubble_states(d)) == 2 and len(bubbles(d)[-1].text) > 40, "tokens arriving")
    assert bubble_states(browser)[-1] == "streaming"
    browser.find_element(By.ID, "stop").click()

    wait_for(browser, lambda d: bubble_states(d)[-1] == "stopped", "the answer stopped")
    wait_for(browser, lambda d: cancelled_requests(rotating_server) == 1, "the server cancelling the request")
    answer = stored_conversations(browser)[0]["messages"][1]
    assert answer["state"] == "stopped" and 40 < len(answer["content"])
    assert browser.find_element(By.ID, "send").is_displayed() and not browser.find_element(By.ID, "stop").is_displayed()
    time.sleep(0.5)  # nothing more arrives once stopped
    assert stored_conversations(browser)[0]["messages"][1]["content"] == answer["content"]
