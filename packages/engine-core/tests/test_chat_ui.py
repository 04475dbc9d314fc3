"""The chat page at ``/``: served from package data, self-contained, open while ``/v1/*`` wants the key,
and off with ``--disable-chat-ui``. The page's behaviour in a browser: tests/browser/test_chat_page.py."""

from __future__ import annotations

import argparse
import re
from html.parser import HTMLParser
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from loom.config import LoRAConfig
from loom.config.server import ServerConfig
from loom.entrypoints.openai import build_app

MODEL = "chat-ui-model"
API_KEY = "sk-chat-ui"


def fake_engine_client() -> SimpleNamespace:
    """What building the app reads from an EngineClient; nothing here generates."""
    model_config = SimpleNamespace(model=None, hf_config=None, max_model_len=64, get_vocab_size=lambda: 100)
    return SimpleNamespace(tokenizer=None, config=SimpleNamespace(model_config=model_config, lora_config=LoRAConfig()))


def app_client(**kwargs) -> TestClient:
    return TestClient(build_app(fake_engine_client(), MODEL, endpoint_plugins={}, **kwargs))


def parse_server_flags(argv: list[str]) -> ServerConfig:
    return ServerConfig.from_cli_args(ServerConfig.add_cli_args(argparse.ArgumentParser()).parse_args(argv))


class _References(HTMLParser):
    """Every URL the page would load or link to: src/href/action attributes, CSS url(...) and @import."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.urls += [v for k, v in attrs if k in ("src", "href", "action", "srcset", "poster", "data") and v]

    def handle_data(self, data: str) -> None:
        self.urls += re.findall(r"""url\(\s*['"]?([^'")]+)""", data)
        self.urls += re.findall(r"""@import\s+['"]([^'"]+)""", data)


def test_the_page_is_served_at_root() -> None:
    with app_client() as tc:
        r = tc.get("/")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in r.headers["content-security-policy"]
    for needed in ('id="prompt"', 'id="stop"', 'id="temperature"', 'id="max-tokens"', 'id="api-key"',
                   "v1/chat/completions", "v1/models", "stream_options"):
        assert needed in r.text, needed


def test_the_page_loads_nothing_from_elsewhere() -> None:
    """No CDN: every reference is relative (or a fragment / data: URI), and the script is inline."""
    with app_client() as tc:
        html = tc.get("/").text
    refs = _References()
    refs.feed(html)
    assert "script" in refs.tags and "style" in refs.tags
    external = [u for u in refs.urls if re.match(r"^([a-z][a-z0-9+.-]*:|//)", u, re.I) and not u.startswith("data:")]
    assert external == []
    assert not re.search(r"""<(script|link|img|iframe)\b[^>]*\b(src|href)\s*=""", html, re.I)
    # absolute URLs in the script too: fetch() calls must go to the page's own origin
    assert not re.findall(r"https?://", html)


def test_model_output_is_never_parsed_as_html() -> None:
    with app_client() as tc:
        html = tc.get("/").text
    assert "innerHTML" not in html and "insertAdjacentHTML" not in html and "document.write" not in html


def test_disabled_chat_ui_leaves_root_unrouted() -> None:
    with app_client(chat_ui=False) as tc:
        r = tc.get("/")
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "not_found_error"
        assert tc.get("/v1/models").status_code == 200  # the API is unchanged


def test_the_page_is_open_while_the_api_wants_the_key() -> None:
    with app_client(api_key=API_KEY) as tc:
        assert tc.get("/").status_code == 200
        assert tc.get("/v1/models").status_code == 401
        assert tc.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        models = tc.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert models.status_code == 200
    assert [m["id"] for m in models.json()["data"] if m["parent"] is None] == [MODEL]


def test_the_page_is_not_in_the_openapi_schema() -> None:
    with app_client() as tc:
        assert "/" not in tc.get("/openapi.json").json()["paths"]


@pytest.mark.parametrize(("argv", "enabled"), [([], True), (["--disable-chat-ui"], False)])
def test_the_flag_reaches_the_front_end(argv: list[str], enabled: bool) -> None:
    """``loom serve --disable-chat-ui`` travels to the front end's parser through ``to_argv``."""
    server = parse_server_flags(argv)
    assert server.disable_chat_ui is not enabled
    assert parse_server_flags(server.to_argv()).disable_chat_ui is not enabled
