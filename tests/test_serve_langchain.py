"""LangChain's ChatOpenAI against pagedcli serve (a server on a free loopback port with the built-in
model, whose free text is Shakespeare, never JSON): with_structured_output returns a validated
object, through a JSON schema (method="json_schema") and through a tool call (method=
"function_calling"); bind_tools gives an AIMessage whose tool_calls LangChain parsed (tool_choice
"required" and a named tool), streamed too, and a ToolMessage with the call's result gets an
answer. The chat template (tests/assets/chat/tools_template.jinja) has Hermes's shape."""

from __future__ import annotations

import pytest

from conftest import ASSETS
from serve_fixtures import served

pydantic = pytest.importorskip("pydantic")
langchain_openai = pytest.importorskip("langchain_openai")

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

QUESTION = "ROMEO: what says the sky over Verona?"


class Line(pydantic.BaseModel):
    """A line of the play: who speaks it, and in which act."""

    speaker: str = pydantic.Field(max_length=12)
    act: int = pydantic.Field(ge=1, le=5)


class City(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)  # (bounded: the built-in model's strings run long)


@tool(args_schema=City)
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny, and the lark sings"


@tool
def get_time() -> str:
    """The time of day."""
    return "the third hour"


@pytest.fixture(scope="module")
def server():
    with served(batch=4, template=ASSETS / "chat" / "tools_template.jinja") as s:
        yield s


def chat(server, **kw) -> langchain_openai.ChatOpenAI:
    return langchain_openai.ChatOpenAI(model="demo", base_url=server.url + "/v1", api_key="none", max_retries=0,
                                       **{"max_tokens": 60, "temperature": 0.7, "seed": 2} | kw)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_the_object(server, method):
    line = chat(server).with_structured_output(Line, method=method).invoke(QUESTION)
    assert isinstance(line, Line) and len(line.speaker) <= 12 and 1 <= line.act <= 5
    server.settle()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", "get_weather"])
def test_bind_tools_gives_parsed_tool_calls_and_takes_the_tool_message(server, tool_choice, stream):
    llm = chat(server, max_tokens=80).bind_tools([get_weather, get_time], tool_choice=tool_choice)
    if stream:
        message = None
        for piece in llm.stream(QUESTION):
            message = piece if message is None else message + piece
    else:
        message = llm.invoke(QUESTION)
    assert isinstance(message, AIMessage) and len(message.tool_calls) == 1 and not message.invalid_tool_calls
    call = message.tool_calls[0]
    assert call["id"].startswith("call_") and call["name"] in ("get_weather", "get_time")
    if tool_choice == "get_weather":
        assert call["name"] == "get_weather" and set(call["args"]) == {"city"}
    assert message.response_metadata["finish_reason"] == "tool_calls"
    result = {"get_weather": get_weather, "get_time": get_time}[call["name"]].invoke(call["args"])
    history = [HumanMessage(QUESTION), message, ToolMessage(result, tool_call_id=call["id"])]
    answer = chat(server, max_tokens=16, temperature=0).bind_tools([get_weather, get_time]).invoke(history)
    assert isinstance(answer, AIMessage) and (answer.content or answer.tool_calls)
    server.settle()
