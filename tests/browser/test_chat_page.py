"""The chat page at ``/`` in a real headless Chromium (Debian's ``chromium`` and ``chromium-driver``,
driven by selenium) against real ``loom serve`` process trees (``nox -s browser``).

The default model answers a question streamed token by token, with its figures, over two turns
(the second request carries the whole conversation), a long answer is stopped, and a serve that
went away is reported; on a serve with ``--api-key`` a wrong key and a 400 show the server's own
messages in the page, the right key works and is remembered. Screenshots go to
``$LOOM_BROWSER_ARTIFACTS`` (default ``browser-artifacts/`` at the repo root); their paths are printed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait
from serve_utils import Serve, serving

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("LOOM_BROWSER_ARTIFACTS") or ROOT / "browser-artifacts")
API_KEY = "sk-browser-5d41"
STATS = re.compile(r"^(\d+) tokens? · (\d+\.\d) tok/s · TTFT (\d+) ms$")
# Records what the page sends and every text its last answer shows, as it changes.
RECORDER = """
window.recorded = {bodies: [], texts: []};
const realFetch = window.fetch;
window.fetch = (url, init) => {
  if (init && init.body) window.recorded.bodies.push(JSON.parse(init.body));
  return realFetch(url, init);
};
new MutationObserver(() => {
  const texts = document.querySelectorAll(".msg.assistant .text");
  if (texts.length) window.recorded.texts.push(texts[texts.length - 1].textContent);
}).observe(document.getElementById("log"), {childList: true, subtree: true, characterData: true});
"""


# the serves inherit this environment: every installed plugin, the detected platform, no key
pytestmark = pytest.mark.usefixtures("every_installed_plugin_no_key")


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_path is None:  # in the matrix a missing dependency fails, never skips
        pytest.fail("Debian's chromium and chromium-driver are needed: bash scripts/install-browser.sh (as root)")
    options = Options()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1000,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(driver_path))  # paths given: no driver download
    yield driver
    driver.quit()


def wait(driver: WebDriver, condition: Callable[[WebDriver], Any], timeout: float = 60, what: str = "") -> Any:
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition, what)


def screenshot(driver: WebDriver, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    driver.save_screenshot(str(path))
    print(f"screenshot: {path}")
    return path


@contextlib.contextmanager
def screenshot_on_failure(driver: WebDriver, name: str) -> Iterator[None]:
    try:
        yield
    except BaseException:
        screenshot(driver, f"failed-{name}.png")
        raise


def set_field(driver: WebDriver, field: str, value: str) -> None:
    """Type a value and leave the field, so that its change event fires."""
    element = driver.find_element(By.ID, field)
    element.clear()
    element.send_keys(value, Keys.TAB)


def ask(driver: WebDriver, text: str) -> None:
    driver.find_element(By.ID, "prompt").send_keys(text, Keys.ENTER)


def answers(driver: WebDriver) -> list[Any]:
    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")


def finished(driver: WebDriver, count: int, timeout: float = 90) -> Any:
    """The ``count``-th answer, once it ended (a figures line, an error or a note under it)."""
    return wait(driver, lambda d: len(answers(d)) >= count and answers(d)[count - 1].find_elements(
        By.CSS_SELECTOR, ".stats, .error, .note") and answers(d)[count - 1], timeout, f"answer {count} to end")


def line(answer: Any, kind: str) -> str:
    found = answer.find_elements(By.CSS_SELECTOR, f".{kind}")
    assert found, f"no .{kind} under the answer: {answer.text!r}"
    return found[0].text


def base_model(serve: Serve, key: str | None = None) -> str:
    request = urllib.request.Request(serve.url + "/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=10) as r:
        return next(m["id"] for m in json.load(r)["data"] if m["parent"] is None)


def error_message(serve: Serve, body: dict[str, Any], key: str) -> str:
    """The ``error.message`` the server answers ``body`` with."""
    request = urllib.request.Request(serve.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=10)
    except urllib.error.HTTPError as e:
        return json.load(e)["error"]["message"]
    raise AssertionError(f"{body} was accepted")


def test_default_model_answers_streamed_over_turns(browser: WebDriver, tmp_path: Path) -> None:
    with screenshot_on_failure(browser, "default-model"):
        with serving(["--dtype", "float32"], tmp_path) as serve:  # fp32: greedy "Paris" holds on every CPU
            browser.get(serve.url + "/")
            model = base_model(serve)
            wait(browser, lambda d: d.find_element(By.ID, "model").text == model, 30, f"the model name {model!r}")
            browser.execute_script(RECORDER)
            set_field(browser, "temperature", "0")
            set_field(browser, "max-tokens", "24")

            ask(browser, "What is the capital of France?")
            first = finished(browser, 1)
            text = first.find_element(By.CSS_SELECTOR, ".text").text
            assert "Paris" in text, text
            figures = STATS.match(line(first, "stats"))
            assert figures, line(first, "stats")
            tokens, rate, ttft = int(figures[1]), float(figures[2]), int(figures[3])
            assert 1 < tokens <= 24 and rate > 0 and ttft > 0, figures[0]
            shown = [t for t in dict.fromkeys(browser.execute_script("return window.recorded.texts")) if t]
            assert len(shown) >= 3, f"the answer was not streamed: {shown}"  # one text per chunk, growing
            assert all(text.startswith(t.rstrip()) for t in shown), shown
            screenshot(browser, "chat-page.png")

            ask(browser, "Thank you!")
            finished(browser, 2)
            second = browser.execute_script("return window.recorded.bodies")[-1]
            assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
            assert second["messages"][1]["content"].strip() == text
            assert second["model"] == model and second["temperature"] == 0 and second["max_tokens"] == 24
            assert second["stream"] is True and second["stream_options"] == {"include_usage": True}

            set_field(browser, "max-tokens", "400")
            ask(browser, "Write a long story about a dragon who learns to read.")
            wait(browser, lambda d: len(answers(d)) == 3 and answers(d)[2].find_element(By.CSS_SELECTOR, ".text").text,
                 60, "the story's first token")
            browser.find_element(By.ID, "stop").click()
            assert line(finished(browser, 3, timeout=10), "note") == "stopped"
            assert browser.find_element(By.ID, "send").is_enabled()
            assert not browser.find_element(By.ID, "stop").is_enabled()

        ask(browser, "Are you still there?")  # the serve has stopped
        assert "cannot reach the server" in line(finished(browser, 4, timeout=30), "error")
        screenshot(browser, "chat-page-server-gone.png")


def test_api_key_and_errors_show_in_the_page(browser: WebDriver, tiny_llama: Path, tmp_path: Path) -> None:
    with screenshot_on_failure(browser, "api-key"):
        args = [str(tiny_llama), "--max-model-len", "256", "--api-key", API_KEY]
        with serving(args, tmp_path) as serve:
            unauthorized = "HTTP 401 Unauthorized: Incorrect or missing API key"
            browser.get(serve.url + "/")  # a new origin: no key remembered
            wait(browser, lambda d: unauthorized in d.find_element(By.ID, "status").text, 30, "the 401 for /v1/models")

            set_field(browser, "api-key", "sk-wrong")
            ask(browser, "Hello")
            assert line(finished(browser, 1, timeout=30), "error").startswith(unauthorized)
            assert "failed" in browser.find_element(By.CSS_SELECTOR, ".msg.user").get_attribute("class")
            screenshot(browser, "chat-page-wrong-key.png")

            set_field(browser, "api-key", API_KEY)
            model = base_model(serve, API_KEY)
            wait(browser, lambda d: d.find_element(By.ID, "model").text == model, 30, "the model name with the key")
            assert browser.find_element(By.ID, "status").text == ""

            set_field(browser, "max-tokens", "100000")  # over max_model_len: a 400 with its message
            ask(browser, "Hello")
            message = error_message(serve, {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 100000},
                                    API_KEY)
            assert line(finished(browser, 2, timeout=30), "error") == f"HTTP 400 Bad Request: {message}"

            set_field(browser, "max-tokens", "4")
            ask(browser, "Hello")
            assert STATS.match(line(finished(browser, 3, timeout=30), "stats"))

            browser.refresh()  # the key is remembered (localStorage)
            wait(browser, lambda d: d.find_element(By.ID, "model").text == model, 30, "the model name after a reload")
            assert browser.find_element(By.ID, "api-key").get_attribute("value") == API_KEY
