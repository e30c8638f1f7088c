"""The web pages as the app serves them (a scripted engine): without a key, under a policy that loads nothing
from elsewhere, turned off by `web: false`; and the bundle in the package is the one the sources in web/ build."""

from __future__ import annotations

import hashlib
import json
import pathlib
import re

import httpx
from conftest import live_server, server_config
from fakes import ScriptedEngine

from strata.web import BUILD_INFO, STATIC, sources_fingerprint

WEB_SOURCES = pathlib.Path(__file__).parents[2] / "web"


def test_the_bundle_is_built_from_the_sources_in_the_repository():
    info = json.loads(BUILD_INFO.read_text())
    assert info["sources"] == sources_fingerprint(WEB_SOURCES), (
        "web/ changed since the bundle was built: run ./scripts/build-web.sh and commit src/strata/web/static")
    built = sorted(path.relative_to(STATIC).as_posix() for path in STATIC.rglob("*")
                   if path.is_file() and path != BUILD_INFO)
    assert built == sorted(info["files"])
    for name, digest in info["files"].items():
        assert hashlib.sha256((STATIC / name).read_bytes()).hexdigest() == digest, f"{name} was changed by hand"


def test_pages_load_without_the_key_and_the_api_still_needs_it(tokenizer):
    with live_server(server_config(api_key="s3cret"), ScriptedEngine(tokenizer), tokenizer) as server:
        for path in ("/", "/monitor"):
            page = httpx.get(server.url + path)
            assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
            policy = page.headers["content-security-policy"]
            assert "default-src 'self'" in policy and "connect-src 'self'" in policy
            assert "form-action 'none'" in policy  # a form in a model's answer cannot post the key elsewhere
        scripts = re.findall(r'src="(/assets/[^"]+\.js)"', page.text)
        assert scripts
        for script in scripts:
            asset = httpx.get(server.url + script)
            assert asset.status_code == 200 and "javascript" in asset.headers["content-type"]
            assert "immutable" in asset.headers["cache-control"]
        assert httpx.get(server.url + "/assets/nothing.js").status_code == 404
        assert httpx.get(server.url + "/v1/status/stream").status_code == 401
        assert httpx.get(server.url + "/v1/models").status_code == 401


def test_web_false_turns_the_pages_off(tokenizer):
    with live_server(server_config(web=False, api_key="s3cret"), ScriptedEngine(tokenizer), tokenizer) as server:
        assert httpx.get(server.url + "/").status_code == 401  # no page: the API's rules
        headers = {"authorization": "Bearer s3cret"}
        assert httpx.get(server.url + "/", headers=headers).status_code == 404
        assert httpx.get(server.url + "/monitor", headers=headers).status_code == 404
        assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 200
