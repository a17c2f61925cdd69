"""The agent gateway's OpenAI protocol layer (rollout/openai_protocol.py, rollout/openai_responses.py): request
checks and normal form, and the real ``openai`` client (and the OpenAI Agents SDK, where installed) reading the
responses, streamed and not, through an httpx MockTransport that answers with this layer's output."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from rollout.openai_protocol import (
    ChatRequest,
    ProtocolError,
    Reply,
    assistant_message,
    chat_completion,
    chat_completion_chunks,
    models_list,
    parse_chat_request,
    sse,
    tool_call_id,
)
from rollout.openai_responses import parse_responses_request, response_events, response_object

USER = {"role": "user", "content": "What is 3+4?"}
CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluate arithmetic.",
                                         "parameters": {"type": "object",
                                                        "properties": {"expression": {"type": "string"}},
                                                        "required": ["expression"]}}}
CALL_REPLY = Reply("Let me compute.", [{"name": "calc", "arguments": {"expression": "3+4"}}], "stop", 12, 9)
TWO_CALLS = Reply("", [{"name": "calc", "arguments": {"expression": "1+1"}},
                       {"name": "calc", "arguments": {"expression": "é*2"}}], "stop", 20, 15)
TEXT_REPLY = Reply("It is 7.", [], "stop", 30, 4)


def _error(call, body) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        call(body)
    assert caught.value.status == 400
    return caught.value


# ------------------------------------------------------------------------------------------------------------
# Chat Completions requests


def test_chat_request_normal_form():
    body = {"model": "policy", "messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}]},
        {"role": "developer", "content": "Answer in digits."},
        USER,
        {"role": "assistant", "content": None, "refusal": None, "audio": None, "tool_calls": [
            {"id": "call_x_0", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "3+4"}'}}]},
        {"role": "tool", "tool_call_id": "call_x_0", "content": "7", "name": "calc"}],
        "tools": [CALC], "tool_choice": "auto", "max_tokens": 50, "max_completion_tokens": 40, "stop": "\n\n",
        "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.7, "top_p": 1,
        "n": 1, "seed": 3, "logprobs": True, "parallel_tool_calls": False, "user": "u", "metadata": {"a": "b"}}
    request = parse_chat_request(body)
    assert request == ChatRequest(
        messages=[{"role": "system", "content": "Be brief.\nUse tools."},
                  {"role": "developer", "content": "Answer in digits."}, USER,
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"id": "call_x_0", "type": "function",
                       "function": {"name": "calc", "arguments": '{"expression": "3+4"}'}}]},
                  {"role": "tool", "content": "7", "tool_call_id": "call_x_0", "name": "calc"}],
        tools=[CALC], tool_choice="auto", max_tokens=40, stop=["\n\n"], stream=True, include_usage=True,
        temperature=0.7, top_p=1.0, model="policy", api="chat")


def test_chat_request_defaults_and_empty_tools():
    request = parse_chat_request({"messages": [USER], "tools": [], "tool_choice": "auto"})
    assert request == ChatRequest(messages=[USER], tools=None, tool_choice="auto", max_tokens=None, stop=[],
                                  stream=False, include_usage=False, temperature=None, top_p=None, model=None)
    named = parse_chat_request({"messages": [USER], "tools": [CALC],
                                "tool_choice": {"type": "function", "function": {"name": "calc"}}})
    assert named.tool_choice == {"type": "function", "function": {"name": "calc"}}


BAD_TOOL = {"type": "function", "function": {"name": "has space"}}


@pytest.mark.parametrize("change, param, code", [
    ({"messages": None}, "messages", None),
    ({"messages": []}, "messages", None),
    ({"messages": {"role": "user", "content": "x"}}, "messages", None),
    ({"messages": ["hi"]}, "messages[0]", None),
    ({"messages": [{"content": "x"}]}, "messages[0].role", None),
    ({"messages": [USER, {"role": "function", "content": "x"}]}, "messages[1].role", None),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", None),
    ({"messages": [{"role": "user"}]}, "messages[0].content", None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type", None),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages[0].content[0].text", None),
    ({"messages": [{"role": "tool", "content": "7"}]}, "messages[0].tool_call_id", None),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f", "arguments": {}}}]}]},
     "messages[0].tool_calls[0].function.arguments", None),
    ({"messages": [{"role": "assistant", "tool_calls": "f()"}]}, "messages[0].tool_calls", None),
    ({"messages": [{"role": "user", "content": "x", "name": 3}]}, "messages[0].name", None),
    ({"n": 2}, "n", "n_not_supported"),
    ({"n": True}, "n", "n_not_supported"),
    ({"stream": "yes"}, "stream", None),
    ({"stream_options": {"include_usage": 1}}, "include_usage", None),
    ({"tools": CALC}, "tools", None),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type", None),
    ({"tools": [{"type": "function"}]}, "tools[0].function", None),
    ({"tools": [BAD_TOOL]}, "tools[0].function.name", None),
    ({"tools": [CALC, CALC]}, "tools[1].function.name", None),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters", None),
    ({"tool_choice": "any"}, "tool_choice", None),
    ({"tool_choice": "required"}, "tool_choice", None),
    ({"tools": [CALC], "tool_choice": {"type": "function", "function": {"name": "search"}}}, "tool_choice", None),
    ({"max_tokens": 0}, "max_tokens", None),
    ({"max_completion_tokens": 1.5}, "max_completion_tokens", None),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", None),
    ({"stop": ["a", 1]}, "stop[1]", None),
    ({"stop": [""]}, "stop[0]", None),
    ({"temperature": 3}, "temperature", None),
    ({"top_p": -0.1}, "top_p", None),
    ({"model": 7}, "model", None),
])
def test_chat_request_errors_name_the_field(change, param, code):
    error = _error(parse_chat_request, {"messages": [USER], **change})
    assert (error.param, error.code) == (param, code)
    assert error.body() == {"error": {"message": error.message, "type": "invalid_request_error",
                                      "param": param, "code": code}}


def test_a_body_that_is_not_an_object():
    assert _error(parse_chat_request, [USER]).param is None
    assert "JSON object" in _error(parse_responses_request, "hi").message


# ------------------------------------------------------------------------------------------------------------
# Responses requests


def test_responses_request_string_input_and_instructions():
    request = parse_responses_request({"model": "policy", "input": "Hi", "instructions": "Be brief.",
                                       "max_output_tokens": 64, "temperature": 1, "store": False,
                                       "include": [], "truncation": "disabled"})
    assert request == ChatRequest(messages=[{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Hi"}],
                                  max_tokens=64, temperature=1.0, model="policy", api="responses")


def test_responses_items_normalize_like_chat_messages():
    calc = {"type": "function", "name": "calc", "description": "Evaluate arithmetic.",
            "parameters": CALC["function"]["parameters"], "strict": True}
    request = parse_responses_request({"input": [
        {"role": "user", "content": "What is 3+4?"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me compute.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "calc",
         "arguments": '{"expression": "3+4"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "7"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_2", "name": "calc", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "0"}]}],
        "tools": [calc], "tool_choice": {"type": "function", "name": "calc"}, "stream": True})
    assert request.messages == [
        USER,
        {"role": "assistant", "content": "Let me compute.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "3+4"}'}}]},
        {"role": "tool", "content": "7", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_2", "type": "function", "function": {"name": "calc", "arguments": "{}"}}]},
        {"role": "tool", "content": "0", "tool_call_id": "call_2"}]
    assert request.tools == [CALC] and request.stream is True
    assert request.tool_choice == {"type": "function", "function": {"name": "calc"}}


@pytest.mark.parametrize("body, param, code", [
    ({}, "input", None),
    ({"input": 3}, "input", None),
    ({"input": [], "instructions": "x"}, "input", None),
    ({"input": ["hi"]}, "input[0]", None),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0].type", None),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}, "input[0].arguments", None),
    ({"input": [{"type": "function_call_output", "output": "7"}]}, "input[0].call_id", None),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", None),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "unsupported_parameter"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "unsupported_parameter"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", None),
    ({"input": "x", "tools": [{"type": "function", "name": ""}]}, "tools[0].name", None),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", None),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", None),
    ({"input": "x", "stream": 1}, "stream", None),
    ({"input": "x", "instructions": ["x"]}, "instructions", None),
])
def test_responses_request_errors_name_the_field(body, param, code):
    error = _error(parse_responses_request, body)
    assert (error.param, error.code) == (param, code)


# ------------------------------------------------------------------------------------------------------------
# output, read by the real openai client


def _client(handler, asynchronous=False):
    transport = httpx.MockTransport(handler)
    if asynchronous:
        return openai.AsyncOpenAI(base_url="http://x/s/abc/v1", api_key="k", max_retries=0,
                                  http_client=httpx.AsyncClient(transport=transport))
    return openai.OpenAI(base_url="http://x/s/abc/v1", api_key="k", max_retries=0,
                         http_client=httpx.Client(transport=transport))


def _answer(payload, stream=False):
    if stream:
        return httpx.Response(200, text=payload, headers={"content-type": "text/event-stream"})
    return httpx.Response(200, json=payload)


class Gateway:
    """A stand-in gateway: parses each request with this layer and answers with the next scripted Reply (request
    ids r1, r2, ... unless one fixed ``request_id`` is given)."""

    def __init__(self, replies, request_id=None):
        self.replies = list(replies)
        self.request_id = request_id
        self.requests: list[ChatRequest] = []
        self.bodies: list[dict] = []

    def __call__(self, http_request: httpx.Request) -> httpx.Response:
        body = json.loads(http_request.content)
        self.bodies.append(body)
        responses = http_request.url.path.endswith("/responses")
        try:
            request = (parse_responses_request if responses else parse_chat_request)(body)
        except ProtocolError as error:
            return httpx.Response(error.status, json=error.body())
        self.requests.append(request)
        reply, rid = self.replies.pop(0), self.request_id or f"r{len(self.requests)}"
        common = dict(request_id=rid, model="policy", created=1700000000)
        if responses and request.stream:
            return _answer(sse(response_events(reply, **common, request=request), api="responses"), True)
        if responses:
            return _answer(response_object(reply, **common, request=request))
        if request.stream:
            chunks = chat_completion_chunks(reply, **common, include_usage=request.include_usage)
            return _answer(sse(chunks, api="chat"), True)
        return _answer(chat_completion(reply, **common))


def test_chat_completion_with_tool_calls_and_the_history_sent_back():
    gateway = Gateway([CALL_REPLY, TEXT_REPLY])
    client = _client(gateway)
    messages = [USER]
    completion = client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me compute."
    call = choice.message.tool_calls[0]
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "call_r1_0", "calc", {"expression": "3+4"})
    assert completion.usage.total_tokens == 21 and completion.id == "chatcmpl-r1"
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "7"}]
    final = client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
    assert final.choices[0].message.content == "It is 7." and final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.tool_calls is None
    sent_back = gateway.requests[1].messages
    assert sent_back[1] == assistant_message(CALL_REPLY, ["call_r1_0"])
    assert sent_back[2] == {"role": "tool", "content": "7", "tool_call_id": "call_r1_0"}


def test_chat_completion_only_tool_calls_has_null_content_and_comes_back_as_empty():
    gateway = Gateway([TWO_CALLS, TEXT_REPLY])
    client = _client(gateway)
    message = client.chat.completions.create(model="policy", messages=[USER], tools=[CALC]).choices[0].message
    assert message.content is None and [c.id for c in message.tool_calls] == ["call_r1_0", "call_r1_1"]
    assert json.loads(message.tool_calls[1].function.arguments) == {"expression": "é*2"}
    client.chat.completions.create(model="policy", messages=[USER, message], tools=[CALC])
    assert gateway.requests[1].messages[1] == assistant_message(TWO_CALLS, ["call_r1_0", "call_r1_1"])
    assert gateway.requests[1].messages[1]["content"] == ""


@pytest.mark.parametrize("dump", [
    lambda message: message.model_dump(),
    lambda message: message.model_dump(exclude_none=True),
    lambda message: message.model_dump(exclude_unset=True)])
@pytest.mark.parametrize("reply", [CALL_REPLY, TWO_CALLS, TEXT_REPLY])
def test_a_dumped_message_sent_back_normalizes_to_the_assistant_message(reply, dump):
    gateway = Gateway([reply, TEXT_REPLY])
    client = _client(gateway)
    message = client.chat.completions.create(model="policy", messages=[USER], tools=[CALC]).choices[0].message
    client.chat.completions.create(model="policy", messages=[USER, dump(message)], tools=[CALC])
    ids = [tool_call_id("r1", k) for k in range(len(reply.tool_calls))]
    assert gateway.requests[1].messages[1] == assistant_message(reply, ids)


@pytest.mark.parametrize("reply", [CALL_REPLY, TWO_CALLS, TEXT_REPLY, Reply("cut", [], "length", 3, 8)])
@pytest.mark.parametrize("include_usage", [True, False])
def test_chat_stream_accumulates_to_the_same_completion(reply, include_usage):
    client = _client(Gateway([reply, reply], request_id="r"))
    kwargs = dict(model="policy", messages=[USER], tools=[CALC])
    whole = client.chat.completions.create(**kwargs)
    options = {"include_usage": True} if include_usage else None
    with client.chat.completions.stream(**kwargs, stream_options=options) as stream:
        for _ in stream:  # get_final_completion() refuses a reply cut by length (LengthFinishReasonError)
            pass
        streamed = stream.current_completion_snapshot
    got, want = streamed.choices[0], whole.choices[0]
    assert got.finish_reason == want.finish_reason
    assert (got.message.content or "") == (want.message.content or "")
    assert [(c.id, c.function.name, c.function.arguments) for c in got.message.tool_calls or []] == [
        (c.id, c.function.name, c.function.arguments) for c in want.message.tool_calls or []]
    assert (streamed.usage.total_tokens if include_usage else streamed.usage) == (
        whole.usage.total_tokens if include_usage else None)


def test_chat_chunks_carry_usage_only_in_the_last_when_asked():
    chunks = chat_completion_chunks(CALL_REPLY, request_id="r", model="m", created=1, include_usage=True)
    assert [chunk["usage"] for chunk in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 21
    plain = chat_completion_chunks(CALL_REPLY, request_id="r", model="m", created=1, include_usage=False)
    assert all("usage" not in chunk for chunk in plain) and len(plain) == len(chunks) - 1
    assert sse(plain, api="chat").endswith("data: [DONE]\n\n")


def test_errors_reach_the_client_as_openai_errors():
    client = _client(Gateway([]))
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="policy", messages=[USER], n=2)
    assert (caught.value.status_code, caught.value.param, caught.value.code) == (400, "n", "n_not_supported")
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="policy", input="x", previous_response_id="resp_0")
    assert caught.value.param == "previous_response_id"


def test_models_list_read_by_the_client():
    client = _client(lambda request: httpx.Response(200, json=models_list("policy")))
    assert [model.id for model in client.models.list()] == ["policy"]


def _response_tools():
    return [{"type": "function", "name": "calc", "description": "Evaluate arithmetic.",
             "parameters": CALC["function"]["parameters"], "strict": False}]


def test_response_object_with_calls_and_its_output_sent_back():
    gateway = Gateway([CALL_REPLY, TEXT_REPLY])
    client = _client(gateway)
    response = client.responses.create(model="policy", input="What is 3+4?", instructions="Be brief.",
                                       tools=_response_tools())
    assert response.status == "completed" and response.output_text == "Let me compute."
    call = response.output[1]
    assert (call.type, call.call_id, call.name, json.loads(call.arguments)) == (
        "function_call", "call_r1_0", "calc", {"expression": "3+4"})
    assert response.usage.total_tokens == 21 and response.tools[0].name == "calc"
    history = [{"role": "user", "content": "What is 3+4?"}, *response.output,
               {"type": "function_call_output", "call_id": call.call_id, "output": "7"}]
    final = client.responses.create(model="policy", input=history, instructions="Be brief.", tools=_response_tools())
    assert final.output_text == "It is 7." and [item.type for item in final.output] == ["message"]
    assert gateway.requests[1].messages == [
        {"role": "system", "content": "Be brief."}, USER, assistant_message(CALL_REPLY, ["call_r1_0"]),
        {"role": "tool", "content": "7", "tool_call_id": "call_r1_0"}]


def test_response_cut_by_length_is_incomplete():
    response = _client(Gateway([Reply("cut", [], "length", 3, 8)])).responses.create(model="policy", input="x")
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("reply", [CALL_REPLY, TWO_CALLS, TEXT_REPLY, Reply("cut", [], "length", 3, 8)])
def test_response_stream_ends_in_the_same_response(reply):
    client = _client(Gateway([reply, reply, reply], request_id="r"))
    whole = client.responses.create(model="policy", input="x", tools=_response_tools())
    events = list(client.responses.create(model="policy", input="x", tools=_response_tools(), stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[-1].type == f"response.{whole.status}"
    assert events[-1].response.model_dump() == whole.model_dump()
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == reply.content
    if reply.finish_reason == "length":
        return  # the client's stream helper wants response.completed, which OpenAI does not send either
    with client.responses.stream(model="policy", input="x", tools=_response_tools()) as stream:
        streamed = stream.get_final_response()
    assert streamed.output_text == whole.output_text
    assert [(item.type, item.id, getattr(item, "arguments", None)) for item in streamed.output] == [
        (item.type, item.id, getattr(item, "arguments", None)) for item in whole.output]


def test_tool_call_ids_are_deterministic():
    assert tool_call_id("abc", 2) == "call_abc_2"
    first = chat_completion(TWO_CALLS, request_id="q", model="m", created=1)
    assert first == chat_completion(TWO_CALLS, request_id="q", model="m", created=1)
    with pytest.raises(ValueError, match="2 tool calls"):
        assistant_message(TWO_CALLS, ["only_one"])
    with pytest.raises(ValueError, match="finish_reason"):
        chat_completion(Reply("x", [], "tool_calls"), request_id="q", model="m", created=1)


# ------------------------------------------------------------------------------------------------------------
# the OpenAI Agents SDK, unmodified


async def _run_streamed(agents, agent, prompt, config):
    result = agents.Runner.run_streamed(agent, prompt, run_config=config)
    async for _ in result.stream_events():
        pass
    return result


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("api", ["responses", "chat"])
def test_openai_agents_sdk_runs_a_tool_then_answers(api, streamed):
    agents = pytest.importorskip("agents")
    calls = []

    @agents.function_tool
    def calc(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        calls.append(expression)
        return str(eval(expression, {"__builtins__": {}}))  # the test's own fixed input, not model output

    gateway = Gateway([CALL_REPLY, TEXT_REPLY])
    client = _client(gateway, asynchronous=True)
    model = (agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel)(
        model="policy", openai_client=client)
    agent = agents.Agent(name="calculator", instructions="Use the calc tool.", model=model, tools=[calc])
    config = agents.RunConfig(tracing_disabled=True)
    if streamed:
        result = asyncio.run(_run_streamed(agents, agent, "What is 3+4?", config))
    else:
        result = agents.Runner.run_sync(agent, "What is 3+4?", run_config=config)
    assert result.final_output == "It is 7." and calls == ["3+4"]
    assert [request.stream for request in gateway.requests] == [streamed, streamed]
    second = gateway.requests[1].messages
    assert second[0] == {"role": "system", "content": "Use the calc tool."} and second[1] == USER
    assert second[2] == assistant_message(CALL_REPLY, ["call_r1_0"])
    assert second[3] == {"role": "tool", "content": "7", "tool_call_id": "call_r1_0"}
    assert gateway.requests[0].tools[0]["function"]["name"] == "calc"
