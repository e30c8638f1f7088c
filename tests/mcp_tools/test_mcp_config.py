"""The `mcp_servers` and `mcp` config keys: accepted shapes, and every bad one named."""

from __future__ import annotations

import pytest

from strata.cli.serve import _flag_value
from strata.config import ConfigError, config_from_dict


def test_stdio_and_http_servers():
    config = config_from_dict({"mcp": {"max_rounds": 2, "request_urls": True},
                               "mcp_servers": {
                                   "files": {"command": "files-mcp", "args": [], "env": {"ROOT": "/srv"}, "cwd": "/"},
                                   "web": {"url": "https://example.com/mcp", "headers": {"Authorization": "Bearer t"},
                                           "timeout": 5}}})
    assert config.mcp_servers["files"].env == {"ROOT": "/srv"} and config.mcp_servers["files"].args == []
    assert config.mcp_servers["web"].timeout == 5.0 and config.mcp.max_rounds == 2


@pytest.mark.parametrize(("data", "message"), [
    ({"mcp_servers": []}, '"mcp_servers" must be an object'),
    ({"mcp_servers": {"a b": {"command": "x"}}}, '"mcp_servers.a b" must be named'),
    ({"mcp_servers": {"a": {}}}, '"mcp_servers.a" needs exactly one of "command"'),
    ({"mcp_servers": {"a": {"command": "x", "url": "http://h/mcp"}}}, '"mcp_servers.a" needs exactly one'),
    ({"mcp_servers": {"a": {"url": "ftp://h"}}}, '"mcp_servers.a.url" must be an http'),
    ({"mcp_servers": {"a": {"url": "http://h/mcp", "args": ["x"]}}}, '"mcp_servers.a.args" is for stdio'),
    ({"mcp_servers": {"a": {"command": "x", "headers": {"A": "b"}}}}, '"mcp_servers.a.headers" is for "url"'),
    ({"mcp_servers": {"a": {"command": "x", "env": {"A": 1}}}}, '"mcp_servers.a.env" must be an object of strings'),
    ({"mcp_servers": {"a": {"command": "x", "timeout": 0}}}, '"mcp_servers.a.timeout" must be positive'),
    ({"mcp_servers": {"a": {"command": "x", "typo": 1}}}, 'unknown key "mcp_servers.a.typo"'),
    ({"mcp": {"max_rounds": -1}}, '"mcp.max_rounds" must be at least 0'),
    ({"mcp": {"call_timeout": 0}}, '"mcp.call_timeout" must be positive'),
    ({"mcp": {"max_servers": 0}}, '"mcp.max_servers" must be at least 1'),
    ({"mcp": {"max_tools": 0}}, '"mcp.max_tools" must be at least 1'),
    ({"mcp": {"max_schema_bytes": 0}}, '"mcp.max_schema_bytes" must be at least 1'),
    ({"mcp": {"max_result_bytes": -1}}, '"mcp.max_result_bytes" must be at least 1'),
])
def test_bad_keys_and_values_are_named(data, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        config_from_dict(data)


def test_the_flag_takes_json():
    from strata.config import flag_names

    hint = dict(flag_names())["mcp_servers"]
    assert _flag_value("mcp_servers", hint, '{"a": {"command": "x"}}') == {"a": {"command": "x"}}
