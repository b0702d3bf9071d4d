"""`batchspec serve` as the official openai client and OpenAI's wire format expect it: usage in streams (one final
chunk, only when asked), lists of prompts on /v1/completions, assistant messages with null content, one clear error
for non-text content parts and for numbers too long to read, and a string `code` in every error body.

Servers are test_server's: uvicorn in a thread on loopback, tiny random models.
"""

from __future__ import annotations

import http.client
import json

import openai
import pytest
from test_server import (CHAT, MODEL, PROMPTS, C, LiveServer, _chat, _completion, ar_engine, client,  # noqa: F401
                         malformed_requests, server, slow_server, tiny_target, wait_until)

from batchspec import SamplingParams


def sse_events(server: LiveServer, path: str, body: dict) -> list[dict | str]:
    """The events of a streamed response, raw: JSON objects, and '[DONE]'."""
    status, data = server.request("POST", path, {**body, "stream": True})
    assert status == 200, data
    events = [line.removeprefix("data: ") for line in data.decode().splitlines() if line.startswith("data: ")]
    return [event if event == "[DONE]" else json.loads(event) for event in events]


# --- usage in streams ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [C, CHAT])
def test_stream_usage_is_one_last_chunk_and_only_when_asked(server, path):
    """OpenAI: no usage without stream_options.include_usage; with it, `"usage": null` on every chunk but one last
    chunk with empty choices and the whole usage (before the fix: usage on the finishing chunk as well)."""
    body = json.loads(_chat(max_tokens=8) if path == CHAT else _completion(max_tokens=8))
    plain = sse_events(server, path, body)
    assert plain[-1] == "[DONE]" and all("usage" not in event for event in plain[:-1])
    events = sse_events(server, path, {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    *chunks, last = events[:-1]
    assert all("usage" in chunk and chunk["usage"] is None and chunk["choices"] for chunk in chunks)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] >= 1
    assert last["usage"]["spec"]["policy"] == "tetris" and last["usage"]["spec"]["target_steps"] >= 1
    status, whole = server.request("POST", path, body)
    usage = json.loads(whole)["usage"]
    assert {k: last["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == \
           {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def test_client_summing_stream_usage_counts_each_token_once(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Count."}], max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs).usage
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    with_usage = [c.usage for c in chunks if c.usage is not None]
    assert len(with_usage) == 1
    assert sum(u.completion_tokens for u in with_usage) == whole.completion_tokens
    assert sum(u.total_tokens for u in with_usage) == whole.total_tokens


# --- lists of prompts ------------------------------------------------------------------------------------------------


def test_a_list_of_prompts_gets_a_choice_each(client, ar_engine, tiny_target):
    """Strings or token-id lists, one choice per prompt in order, usage summed (before the fix: 422)."""
    expected = ar_engine.generate(PROMPTS, SamplingParams(max_tokens=10))
    for prompt in (PROMPTS, [tiny_target.tokenizer.encode(p) for p in PROMPTS]):
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
        assert [c.index for c in response.choices] == list(range(len(PROMPTS)))
        assert [c.text for c in response.choices] == [r.text for r in expected]
        assert [c.finish_reason for c in response.choices] == [r.finish_reason for r in expected]
        assert response.usage.completion_tokens == sum(len(r.token_ids) for r in expected)
        assert response.usage.prompt_tokens == sum(r.num_prompt_tokens for r in expected)
        spec = response.model_dump()["usage"]["spec"]
        assert spec["target_steps"] >= len(PROMPTS) and spec["verified_tokens"] <= spec["drafted_tokens"]


def test_a_list_of_prompts_streams_each_choice_with_its_index(client, ar_engine):
    expected = ar_engine.generate(PROMPTS, SamplingParams(max_tokens=10))
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    texts, finishes = [""] * len(PROMPTS), [[] for _ in PROMPTS]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finishes[choice.index].append(choice.finish_reason)
    assert texts == [r.text for r in expected]
    assert finishes == [[r.finish_reason] for r in expected]
    assert chunks[-1].choices == [] and [c for c in chunks if c.usage is not None] == [chunks[-1]]
    assert chunks[-1].usage.completion_tokens == sum(len(r.token_ids) for r in expected)


def test_prompt_lists_out_of_bounds(server):
    capacity = server.app.state.engine_loop.capacity  # its batch plus its queue
    too_many = json.loads(server.request("POST", C, _completion(prompt=["a"] * (capacity + 1)))[1])["error"]
    assert too_many["code"] == "too_many_prompts" and f"at most {capacity}" in too_many["message"]
    status, data = server.request("POST", C, _completion(prompt=["fine", ""]))
    error = json.loads(data)["error"]
    assert status == 400 and error["param"] == "prompt[1]" and error["message"].startswith("prompt[1]: ")


def test_a_full_queue_refuses_the_whole_list_and_aborts_what_was_queued(tiny_target):
    live = slow_server(tiny_target, step_s=0.05)  # one slot, a queue of one
    try:
        conn, response = live.open_stream({"model": MODEL, "prompt": "hi", "max_tokens": 250, "ignore_eos": True})
        assert response.readline().startswith(b"data: ")  # holds the slot
        status, data = live.request("POST", C, _completion(prompt=["a", "b"], max_tokens=2))
        assert status == 429 and json.loads(data)["error"]["code"] == "queue_full"
        # "a" took the queue's place and was aborted: the place is free again.
        assert wait_until(lambda: live.metric('batchspec_requests_finished_total{reason="abort"}') == 1)
        queued = live.open_stream({"model": MODEL, "prompt": "c", "max_tokens": 2})
        assert queued[1].status == 200
        for conn, response in ((conn, response), queued):
            response.close()
            conn.close()
        assert wait_until(lambda: live.metric('batchspec_requests_finished_total{reason="abort"}') == 3)
    finally:
        live.stop()


# --- messages --------------------------------------------------------------------------------------------------------


def test_assistant_messages_may_have_null_content(client, ar_engine, server):
    """What clients replay (before the fix: 422); user and system messages still need content."""
    history = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": None},
               {"role": "user", "content": "Name a colour."}]
    empty = [{**m, "content": m["content"] or ""} for m in history]
    reference = ar_engine.generate([empty], SamplingParams(max_tokens=8))[0]
    answer = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    assert answer.choices[0].message.content == reference.text
    missing = [history[0], {"role": "assistant"}, history[2]]
    assert client.chat.completions.create(model=MODEL, messages=missing, max_tokens=8, temperature=0) \
        .choices[0].message.content == reference.text
    for role in ("user", "system"):
        status, data = server.request("POST", CHAT, _chat(messages=[{"role": role, "content": None}]))
        error = json.loads(data)["error"]
        assert status == 422 and error["param"] == "messages[0].content" and "null" in error["message"], data


def test_a_non_text_part_gets_one_clear_error(server, client):
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]
    status, data = server.request("POST", CHAT, _chat(messages=[{"role": "user", "content": content}]))
    error = json.loads(data)["error"]
    assert status == 400, data
    assert error["message"] == ("messages[0].content[1]: unsupported content part type 'image_url'; "
                                "this server takes text parts only")
    assert error["param"] == "messages[0].content[1]" and error["code"] == "unsupported_content"
    with pytest.raises(openai.BadRequestError, match="text parts only"):
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}])


# --- errors ----------------------------------------------------------------------------------------------------------


def test_a_number_too_long_to_read_is_not_called_invalid_json(server):
    """Python refuses int strings over 4,300 digits; the body is valid JSON (before the fix: "not JSON")."""
    for body in (b'{"model": "tiny", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",
                 b'{"model": "tiny", "prompt": [1' + b"0" * 5000 + b"]}"):
        status, data = server.request("POST", C, body)
        error = json.loads(data)["error"]
        assert status == 400 and error["code"] == "number_too_long" and "4300 digits" in error["message"], data


def test_every_error_body_has_a_string_code(server):
    """Clients branch on `code` (before the fix: null for empty prompts, token ids out of range, union errors...)."""
    cases = malformed_requests() + [
        ("POST", C, _completion(prompt=["a", "b"], n=2), 422),
        ("POST", CHAT, _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400),
        ("POST", C, b'{"model": "tiny", "prompt": "x", "seed": 1' + b"0" * 5000 + b"}", 400)]
    for method, path, body, expected in cases:
        status, data = server.request(method, path, body)
        error = json.loads(data)["error"]
        label = f"{method} {path} {body[:80]!r}: {data[:200]!r}"
        assert status == expected, label
        assert isinstance(error["code"], str) and error["code"], label


def test_a_bad_content_length_gets_json(server):
    """h11 refuses it before the app runs; `serving.http_server` answers in JSON, not uvicorn's plain text."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", C)
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", "12abc")
    conn.endheaders()
    response = conn.getresponse()
    body = response.read()
    conn.close()
    assert response.status == 400 and response.getheader("content-type") == "application/json", body
    assert isinstance(json.loads(body)["error"]["code"], str)
