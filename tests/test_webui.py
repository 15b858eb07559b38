"""The web playground in a real browser: headless Chromium (the system's, driven by Playwright) against a live
`llmserve serve` subprocess on the default model, with an API key and a price table as a user would start it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from tests.server_fixtures import RunningServer, ServerProcess

API_KEY = "playground-test-key"
MODEL = "SmolLM2-135M-Instruct.Q4_1"


def _chromium() -> str | None:
    for name in (os.environ.get("LLMSERVE_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
CHROMIUM = _chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine: install the Debian package "
                                "`chromium` (scripts/setup.sh does when it runs as root) or set LLMSERVE_CHROMIUM")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pricing = tmp_path_factory.mktemp("webui") / "pricing.json"
    pricing.write_text(json.dumps({"models": {MODEL: {"input": 0.1, "cached_input": 0.05, "output": 0.4}}}))
    server = ServerProcess("--api-key", API_KEY, "--pricing", str(pricing), "--dtype", "float32", "--kv-cache-memory",
                          "256MiB", "--max-num-seqs", "8").wait_ready(timeout=120)
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    """A fresh browser profile with the page open and the API key given once, by keyboard, in the page's dialog."""
    # bypass_csp: the test drives the page with evaluated script, which the page's policy forbids; it also means that
    # the script-injection test checks the page's own escaping, not the policy behind it
    context = browser.new_context(viewport={"width": 1280, "height": 860}, bypass_csp=True)
    page = context.new_page()
    page_errors = []
    page.on("pageerror", lambda e: page_errors.append(str(e)))
    page.goto(server + "/")
    page.wait_for_selector("#api-key-dialog[open]")
    page.keyboard.type(API_KEY)
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelector('#model').value !== ''")
    yield page
    context.close()
    assert not page_errors, page_errors


def metric(base: str, name: str, **labels) -> float:
    """A metric's value from the server's /metrics, summed over series whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(base + "/metrics").text.splitlines():
        m = re.match(r"^([\w:]+)(?:\{(.*)\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def set_params(page, **values) -> None:
    for name, value in values.items():
        page.fill(f"#settings-form [name={name}]", str(value))


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.keyboard.press("Enter")


def last_answer(page, timeout: float = 120_000):
    """Waits for the last answer to finish; returns its element."""
    page.wait_for_selector("#messages li.message.assistant:last-child:not(.pending)", timeout=timeout)
    return page.locator("#messages li.message.assistant").last


def test_page_is_served_with_a_content_security_policy(server):
    r = httpx.get(server + "/")
    assert r.status_code == 200 and "<title>llmserve playground</title>" in r.text
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    for asset in ("/webui/app.js", "/webui/markdown.js", "/webui/style.css"):
        assert httpx.get(server + asset).status_code == 200
    assert httpx.get(server + "/webui/../../server/app.py").status_code == 404


def test_no_webui_flag_turns_the_page_off(default_files):
    srv = RunningServer(default_files, {}, {"webui": False})
    try:
        r = httpx.get(srv.base_url + "/")
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
        assert httpx.get(srv.base_url + "/webui/app.js").status_code == 404
        assert httpx.get(srv.base_url + "/v1/models").status_code == 200  # the API is still there
    finally:
        srv.stop()
    out = subprocess.run([sys.executable, "-m", "llmserve", "serve", "--help"], capture_output=True, text=True)
    assert "--no-webui" in out.stdout


def test_chat_streams_with_live_figures(page, server):
    set_params(page, temperature=0, max_tokens=48)
    # text shows while the answer is still being generated, then the answer finishes. Seen by an observer of every
    # change to the messages: polling the page (once per frame) can miss a short answer's whole stream on a loaded
    # machine, and then the answer is no longer pending.
    page.evaluate("""() => {
        window.sawLiveText = false;
        new MutationObserver(() => {
            const m = document.querySelector('#messages li.message.assistant.pending .content');
            if (m && m.textContent.trim().length > 0) window.sawLiveText = true;
        }).observe(document.querySelector('#messages'), {subtree: true, childList: true, characterData: true,
                                                         attributes: true});
    }""")
    send(page, "Tell me about the moon in three sentences.")
    answer = last_answer(page)
    assert page.evaluate("window.sawLiveText")
    assert len(answer.locator(".content").inner_text().strip()) > 10
    stats = {s.get_attribute("data-stat"): s.inner_text() for s in answer.locator(".stats span").all()}
    assert re.fullmatch(r"TTFT \d+ ms", stats["ttft"])
    assert re.fullmatch(r"\d+\.\d tok/s", stats["tps"])
    assert re.fullmatch(r"in \d+", stats["in"]) and re.fullmatch(r"cached \d+", stats["cached"])
    out = int(stats["out"].split()[1])
    assert 1 <= out <= 48
    assert stats["finish"] in ("finish_reason stop", "finish_reason length")
    assert stats["cost"].startswith("$")  # the server has a price table
    # the load panel reads /metrics
    page.wait_for_function("document.querySelector('[data-metric=running]').textContent !== '–'")
    assert page.inner_text("[data-metric=kv]").endswith("%")


def test_stop_aborts_the_request_on_the_server(page, server):
    aborted_before = metric(server, "llmserve:request_success_total", finished_reason="abort")
    set_params(page, temperature=0.8, seed=1, max_tokens=4000)
    page.fill("#settings-form [name=stop]", "")
    send(page, "Write a very long story about a dragon who learns to cook. Use many chapters.")
    page.wait_for_function("""() => { const m = document.querySelector('#messages li.message.assistant.pending .content');
                                      return m && m.textContent.trim().length > 0; }""", timeout=60_000)
    assert page.is_visible("#stop")
    page.keyboard.press("Escape")  # the keyboard's stop; the button does the same
    answer = last_answer(page, timeout=10_000)
    assert answer.locator("[data-stat=finish]").inner_text() == "finish_reason stopped"
    deadline = time.time() + 30  # the server notices the closed connection at its next write; a loaded CI box is slow
    while time.time() < deadline:
        if metric(server, "llmserve:request_success_total", finished_reason="abort") == aborted_before + 1:
            break
        time.sleep(0.1)
    ended = {r: metric(server, "llmserve:request_success_total", finished_reason=r) for r in ("abort", "stop", "length")}
    assert ended["abort"] == aborted_before + 1, f"request endings on the server: {ended}"
    assert metric(server, "llmserve:num_requests_running") == 0
    assert metric(server, "llmserve:kv_cache_usage_perc") == 0  # its KV blocks were freed
    assert page.is_visible("#send") and not page.is_visible("#stop")


def test_parameters_reach_the_server(page):
    set_params(page, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.1, frequency_penalty=0.2,
               repetition_penalty=1.1, seed=123, max_tokens=3)
    page.fill("#settings-form [name=stop]", "\n\nEND\nSTOP")
    page.fill("#system", "You answer in French.")
    with page.expect_request("**/v1/chat/completions") as request:
        send(page, "Say hello.")
    body = request.value.post_data_json
    assert body["messages"][0] == {"role": "system", "content": "You answer in French."}
    assert body["messages"][-1] == {"role": "user", "content": "Say hello."}
    assert {k: body[k] for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                                 "repetition_penalty", "seed", "max_tokens")} == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "presence_penalty": 0.1, "frequency_penalty": 0.2,
        "repetition_penalty": 1.1, "seed": 123, "max_tokens": 3}
    assert body["stop"] == ["END", "STOP"] and body["stream"] is True and body["model"] == MODEL
    answer = last_answer(page)
    assert answer.locator("[data-stat=out]").inner_text() == "out 3"
    assert answer.locator("[data-stat=finish]").inner_text() == "finish_reason length"
    # settings are kept across a reload
    page.reload()
    page.wait_for_selector("#messages li.message.assistant")
    assert page.input_value("#settings-form [name=top_k]") == "40"
    assert page.input_value("#system") == "You answer in French."


@pytest.mark.parametrize("field,value", [("top_p", "1.5"), ("temperature", "warm"), ("max_tokens", "0")])
def test_bad_parameter_shows_the_servers_error(page, server, field, value):
    set_params(page, **{field: value})
    send(page, "Hi")
    answer = last_answer(page, timeout=20_000)
    shown = answer.locator(".error").inner_text()
    # the same request sent directly: the page shows the server's own message
    direct = httpx.post(server + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                              field: float(value) if re.fullmatch(r"[\d.]+", value) else value})
    assert direct.status_code == 400
    error = direct.json()["error"]
    assert shown.startswith(error["message"])
    assert f"(param: {error['param']})" in shown


def test_conversation_survives_reload_and_turns_can_be_edited_and_regenerated(page):
    set_params(page, temperature=0, max_tokens=6)
    send(page, "What is the capital of France?")
    first = last_answer(page).locator(".content").inner_text()
    page.reload()
    page.wait_for_selector("#messages li.message.assistant")
    assert page.locator("#messages li.message.user .content").inner_text() == "What is the capital of France?"
    assert page.locator("#messages li.message.assistant .content").inner_text() == first
    assert page.locator("#chat-list li.current").inner_text().startswith("What is the capital of France?")

    # regenerate: greedy, so the same text again, and still one answer
    page.get_by_role("button", name="Regenerate this answer").click()
    assert last_answer(page).locator(".content").inner_text() == first
    assert page.locator("#messages li.message").count() == 2

    # edit the question: the old answer goes, a new one comes
    page.get_by_role("button", name="Edit this message").click()
    editor = page.get_by_role("textbox", name="Edit message")
    editor.fill("What is the capital of Italy?")
    editor.press("Enter")
    page.wait_for_selector("#messages li.message.assistant.pending", timeout=10_000)
    last_answer(page)
    assert page.locator("#messages li.message").count() == 2
    assert page.locator("#messages li.message.user .content").inner_text() == "What is the capital of Italy?"

    # export to JSON
    with page.expect_download() as download:
        page.click("#export-chat")
    exported = json.loads(open(download.value.path()).read())
    assert [m["role"] for m in exported["messages"]] == ["user", "assistant"]
    assert exported["messages"][0]["content"] == "What is the capital of Italy?"

    # a new chat, and the old one is still listed
    page.click("#new-chat")
    assert page.locator("#messages li").count() == 0
    assert page.locator("#chat-list li").count() == 2


HOSTILE = "<img src=x onerror=window.__pwned=1><script>window.__pwned=2</script>"


def test_model_output_with_markup_stays_inert(page):
    # a real model answer that carries markup: the JSON-schema box forces it
    page.fill("#json-schema", json.dumps({"const": HOSTILE}))
    set_params(page, max_tokens=80)
    send(page, "Say something.")
    answer = last_answer(page)
    assert answer.locator(".content").inner_text() == json.dumps(HOSTILE)
    assert answer.locator(".content script, .content img").count() == 0
    assert page.evaluate("window.__pwned") is None

    # and the markdown renderer on hand-made hostile text, in the same page
    payloads = [
        "<script>window.__pwned=3</script>",
        "**bold <img src=x onerror=window.__pwned=4>**",
        "[click](javascript:window.__pwned=5) and [ok](https://example.com)",
        "```html\n<script>window.__pwned=6</script>\n```",
        "| a | b |\n|---|---|\n| <svg onload=window.__pwned=7> | `<b>` |",
        "> <iframe src=javascript:window.__pwned=8>",
        "- <a href=\"javascript:1\" onclick=\"window.__pwned=9\">x</a>",
    ]
    result = page.evaluate("""(payloads) => payloads.map((text) => {
        const box = document.createElement('div');
        box.append(window.renderMarkdown(text));
        document.body.append(box);
        const tags = [...box.querySelectorAll('*')].map((e) => e.tagName.toLowerCase());
        const attrs = [...box.querySelectorAll('*')].flatMap((e) => [...e.attributes].map((a) => a.name + '=' + a.value));
        const text_ = box.textContent;
        box.remove();
        return {tags, attrs, text: text_};
    })""", payloads)
    allowed = {"p", "strong", "em", "del", "code", "pre", "a", "br", "ul", "ol", "li", "blockquote", "table", "thead", "tbody",
               "tr", "th", "td", "div", "span", "button", "h3", "h4", "h5", "h6", "hr"}
    for payload, r in zip(payloads, result):
        assert set(r["tags"]) <= allowed, (payload, r["tags"])
        for attr in r["attrs"]:
            name, _, value = attr.partition("=")
            assert not name.startswith("on") and "javascript:" not in value.lower(), (payload, attr)
    assert "<script>" in result[0]["text"] and "onerror" in result[1]["text"]
    assert 'href=https://example.com/' in result[2]["attrs"]
    page.wait_for_timeout(200)
    assert page.evaluate("window.__pwned") is None


def test_tool_calls_are_shown_as_tool_calls(page):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                              "required": ["city"]}}}]
    page.fill("#tools", json.dumps(tools))
    page.select_option("#settings-form [name=tool_choice]", "required")
    set_params(page, temperature=0, max_tokens=60)
    send(page, "What is the weather in Paris?")
    answer = last_answer(page)
    call = answer.locator(".tool-call")
    assert call.count() == 1
    assert call.locator(".tool-name").inner_text() == "get_weather"
    assert "city" in json.loads(call.locator("pre").inner_text())
    assert answer.locator("[data-stat=finish]").inner_text() == "finish_reason tool_calls"


def test_bad_json_in_a_box_is_reported_before_sending(page):
    page.fill("#json-schema", "{not json")
    send(page, "Hi")
    assert "JSON schema box: not valid JSON" in page.inner_text("#composer-error")
    assert page.locator("#messages li.message").count() == 0
    assert page.input_value("#prompt") == "Hi"  # kept, to send again once the box is fixed


def test_narrow_screen_uses_drawers(page):
    page.set_viewport_size({"width": 390, "height": 800})
    assert not page.is_visible("#settings")
    page.click("#toggle-settings")
    assert page.is_visible("#settings") and page.get_attribute("#toggle-settings", "aria-expanded") == "true"
    page.click("#toggle-chats")
    assert page.is_visible("#chats") and not page.is_visible("#settings")


def test_markdown_in_answers_is_rendered(page):
    text = ("### Title\n\nSome **bold**, *italic*, `code` and a [link](https://example.com/a).\n\n"
            "1. one\n2. two\n   - nested\n\n"
            "```python\nprint('<b>hi</b>')\n```\n\n> quoted\n\n| x | y |\n|---|---|\n| 1 | 2 |\n\n---\nsnake_case_name stays")
    html = page.evaluate("""(text) => { const box = document.createElement('div'); box.append(window.renderMarkdown(text));
                                        return box.innerHTML; }""", text)
    for fragment in ("<h5>Title</h5>", "<strong>bold</strong>", "<em>italic</em>", "<code>code</code>",
                     '<a href="https://example.com/a" rel="noopener noreferrer nofollow" target="_blank">link</a>',
                     "<ol><li>one</li><li>two<ul><li>nested</li></ul></li></ol>",
                     '<code data-lang="python">print(\'&lt;b&gt;hi&lt;/b&gt;\')</code>', "<blockquote><p>quoted</p></blockquote>",
                     "<th>x</th>", "<td>2</td>", "<hr>", "snake_case_name stays"):
        assert fragment in html, (fragment, html)


def test_every_control_has_a_name_for_keyboard_and_screen_reader_users(page):
    unnamed = page.evaluate("""() => [...document.querySelectorAll('button, input, select, textarea')]
        .filter((e) => e.offsetParent !== null || e.closest('dialog'))
        .filter((e) => !(e.labels && e.labels.length) && !e.getAttribute('aria-label') && !e.textContent.trim())
        .map((e) => e.outerHTML)""")
    assert unnamed == []
    # Tab from the message box reaches the send button
    page.focus("#prompt")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "send"


def test_playground_through_the_gateway(browser, server, tmp_path):
    """`llmserve gateway` serves the same page: its models, a streamed answer through it, and its backends' panel."""
    config = tmp_path / "gateway.yaml"
    config.write_text(f"backends:\n  local: {{url: {server}/v1, model: {MODEL}, api_key_env: WEBUI_TEST_BACKEND_KEY}}\n"
                      "models:\n  chat: {targets: [local]}\n")
    gateway = ServerProcess("--config", str(config), command="gateway",
                            env=dict(os.environ, WEBUI_TEST_BACKEND_KEY=API_KEY))
    try:
        gateway.wait_ready(timeout=60)
        context = browser.new_context(bypass_csp=True)
        page = context.new_page()
        page.goto(gateway.url + "/")
        page.wait_for_function("() => document.querySelector('#model').value === 'chat'")
        set_params(page, temperature=0, max_tokens=5)
        send(page, "Hello!")
        answer = last_answer(page)
        assert answer.locator(".content").inner_text().strip()
        assert answer.locator("[data-stat=out]").inner_text() == "out 5"
        page.wait_for_function("() => document.querySelector('[data-metric=backends]').textContent === '1/1'")
        assert not page.is_visible("[data-metric=kv]")
        context.close()
    finally:
        gateway.stop()
