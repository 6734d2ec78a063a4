"""response_format (json_schema, json_object) in the HTTP server: answers valid under the schema (jsonschema as
the oracle), output cut by max_tokens flagged (finish_reason "length", grammar_incomplete) and not valid, bad
formats a 400 naming response_format. Runs the server subprocess of test_serve_server.py."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import jsonschema
import pytest

pytest.importorskip("aiohttp")

from tests.test_serve_server import server  # noqa: E402,F401 (fixtures)

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["x", "yz"]}},
    "required": ["ok", "tag"],
    "additionalProperties": False,
}


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def test_response_format_json_schema(server):  # noqa: F811
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    complete = 0
    for seed in range(6):
        status, out = post(
            server + "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "answer"}], "response_format": fmt, "max_tokens": 48,
             "temperature": 1.0, "seed": seed},
        )  # fmt: skip
        assert status == 200, out
        choice = out["choices"][0]
        text = choice["message"]["content"]
        if choice.get("grammar_incomplete"):
            assert choice["finish_reason"] == "length" and not valid(text), choice
        else:
            assert valid(text), choice
            complete += 1
    assert complete >= 1
    status, out = post(server + "/v1/completions", {"prompt": "x", "response_format": fmt, "max_tokens": 2})
    choice = out["choices"][0]
    assert status == 200 and choice["finish_reason"] == "length" and choice["grammar_incomplete"] is True
    assert not valid(choice["text"])


def test_response_format_json_object_and_errors(server):  # noqa: F811
    status, out = post(
        server + "/v1/completions",
        {"prompt": "x", "response_format": {"type": "json_object"}, "max_tokens": 48, "temperature": 0},
    )
    choice = out["choices"][0]
    assert status == 200
    if not choice.get("grammar_incomplete"):
        assert isinstance(json.loads(choice["text"]), dict)
    else:
        assert choice["finish_reason"] == "length"
    for bad, message in [
        ({"type": "yaml"}, "not supported"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}, "cannot compile"),
    ]:
        status, out = post(server + "/v1/completions", {"prompt": "x", "response_format": bad})
        assert status == 400 and out["error"]["param"] == "response_format", out
        assert message in out["error"]["message"]


def test_streamed_cut_output_is_flagged(server):  # noqa: F811
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}  # needs > 2 tokens
    body = {"prompt": "x", "response_format": fmt, "max_tokens": 2, "stream": True, "seed": 0}
    req = urllib.request.Request(
        server + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["grammar_incomplete"] is True
    assert all("grammar_incomplete" not in c for c in chunks[:-1])
    assert "".join(c["text"] for c in chunks).startswith("{")
