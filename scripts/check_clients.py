"""scripts/check-clients' runs: LangChain and litellm against `kvshard serve` (see that script).
Each case prints OK or FAIL, what the client returned (tool calls' names and arguments, the parsed
object) and whether it validates against the schema it was asked for. The model is tiny (135M): the
tool_choice "required" / named and json_schema cases are held to the schema by kvshard's grammar;
tool_choice "auto" is printed for information (the model may answer in text)."""
import argparse
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "integration"))
from kvshard_server import Server  # noqa: E402

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import

WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
PERSON_SCHEMA = {
    "title": "Person", "description": "A person.", "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"], "additionalProperties": False,
}

RESULTS = []


def case(title):
    def wrap(fn):
        def run(*args):
            print(f"== {title}")
            try:
                detail = fn(*args)
                RESULTS.append((title, True))
                print(f"   OK   {detail}")
            except Exception as e:  # noqa: BLE001 - every failure is reported, then the next case
                RESULTS.append((title, False))
                print(f"   FAIL {type(e).__name__}: {e}")
                traceback.print_exc(limit=3, file=sys.stdout)
        return run
    return wrap


def check_args(arguments, schema):
    import jsonschema
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, schema)
    return args


@case("LangChain ChatOpenAI.bind_tools([get_weather], tool_choice='get_weather').invoke")
def langchain_bind_tools_named(llm):
    msg = llm.bind_tools([{"type": "function", "function": WEATHER}],
                         tool_choice="get_weather").invoke("What is the weather in Paris?")
    if not msg.tool_calls:
        raise AssertionError(f"no tool_calls; content {msg.content!r}; invalid "
                             f"{msg.invalid_tool_calls!r}")
    call = msg.tool_calls[0]
    assert call["name"] == "get_weather", call
    check_args(call["args"], WEATHER["parameters"])
    return f"tool_calls[0]: {call['name']}({json.dumps(call['args'])}), schema valid"


@case("LangChain ChatOpenAI.bind_tools([get_weather]).invoke (tool_choice auto)")
def langchain_bind_tools_auto(llm):
    msg = llm.bind_tools([{"type": "function", "function": WEATHER}]).invoke(
        "What is the weather in Paris?")
    if msg.tool_calls:
        c = msg.tool_calls[0]
        return f"tool_calls[0]: {c['name']}({json.dumps(c['args'])})"
    return f"answered in text: {msg.content[:80]!r}"


@case("LangChain with_structured_output(Person, method='function_calling')")
def langchain_structured_function_calling(llm):
    import pydantic

    class Person(pydantic.BaseModel):
        """A person."""
        name: str = pydantic.Field(max_length=20)
        age: int = pydantic.Field(ge=0, le=150)

    out = llm.with_structured_output(Person, method="function_calling", include_raw=True).invoke(
        "Alice is 30 years old. Who is she?")
    if out["parsing_error"] is not None or not isinstance(out["parsed"], Person):
        raise AssertionError(f"not parsed: {out['parsing_error']!r}; raw {out['raw']!r}")
    return f"Person{out['parsed'].model_dump()} (pydantic-validated)"


@case("LangChain with_structured_output(Pet, method='function_calling') (no number bounds)")
def langchain_structured_function_calling_unbounded(llm):
    import pydantic

    class Pet(pydantic.BaseModel):
        """A pet."""
        name: str = pydantic.Field(max_length=20)
        age: int
        species: str = pydantic.Field(json_schema_extra={"enum": ["cat", "dog", "bird"]})

    out = llm.with_structured_output(Pet, method="function_calling", include_raw=True).invoke(
        "Tom is a 3 year old cat. Describe him.")
    if out["parsing_error"] is not None or not isinstance(out["parsed"], Pet):
        raise AssertionError(f"not parsed: {out['parsing_error']!r}; raw {out['raw']!r}")
    return f"Pet{out['parsed'].model_dump()} (pydantic-validated)"


def structured_json_schema(llm, schema, prompt):
    out = llm.with_structured_output(schema, method="json_schema", strict=True,
                                     include_raw=True).invoke(prompt)
    if out["parsing_error"] is not None or out["parsed"] is None:
        raise AssertionError(f"not parsed: {out['parsing_error']!r}; raw {out['raw']!r}")
    check_args(out["parsed"], schema)
    return f"{json.dumps(out['parsed'])}, schema valid"


@case("LangChain with_structured_output(schema, method='json_schema')")
def langchain_structured_json_schema(llm):
    return structured_json_schema(llm, PERSON_SCHEMA, "Bob is 41. Describe him.")


@case("LangChain with_structured_output(schema, method='json_schema') (no number bounds)")
def langchain_structured_json_schema_unbounded(llm):
    schema = json.loads(json.dumps(PERSON_SCHEMA))
    del schema["properties"]["age"]["minimum"], schema["properties"]["age"]["maximum"]
    return structured_json_schema(llm, schema, "Bob is 41. Describe him.")


def litellm_call(server, tool_choice):
    import litellm
    r = litellm.completion(model="openai/" + server.model, api_base=server.url + "/v1",
                           api_key="none", temperature=0, max_tokens=64, timeout=600,
                           messages=[{"role": "user", "content": "Weather in Oslo?"}],
                           tools=[{"type": "function", "function": WEATHER}],
                           tool_choice=tool_choice)
    return r.choices[0]


@case("litellm completion(model='openai/...', tools=[get_weather], tool_choice='required')")
def litellm_tools_required(server):
    choice = litellm_call(server, "required")
    calls = choice.message.tool_calls
    if not calls:
        raise AssertionError(f"no tool_calls; content {choice.message.content!r}")
    args = check_args(calls[0].function.arguments, WEATHER["parameters"])
    return (f"finish_reason {choice.finish_reason}; tool_calls[0]: {calls[0].function.name}"
            f"({json.dumps(args)}), schema valid")


@case("litellm completion(model='openai/...', tools=[get_weather]) (tool_choice auto)")
def litellm_tools_auto(server):
    choice = litellm_call(server, "auto")
    calls = choice.message.tool_calls
    if calls:
        return f"tool_calls[0]: {calls[0].function.name}({calls[0].function.arguments})"
    return f"answered in text: {(choice.message.content or '')[:80]!r}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvshard", required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    import langchain_openai
    import litellm
    from importlib.metadata import version
    print(f"langchain-openai {version('langchain-openai')}, langchain-core "
          f"{version('langchain-core')}, openai {version('openai')}, litellm {version('litellm')}")
    del langchain_openai, litellm
    server = Server(args.kvshard, args.model, [])
    print(f"kvshard serve {os.path.basename(args.model)} on {server.url} (model id {server.model})")
    try:
        from langchain_openai import ChatOpenAI
        llm = ChatOpenAI(model=server.model, base_url=server.url + "/v1", api_key="none",
                         temperature=0, max_tokens=64, max_retries=0, timeout=600)
        langchain_bind_tools_named(llm)
        langchain_bind_tools_auto(llm)
        langchain_structured_function_calling(llm)
        langchain_structured_function_calling_unbounded(llm)
        langchain_structured_json_schema(llm)
        langchain_structured_json_schema_unbounded(llm)
        litellm_tools_required(server)
        litellm_tools_auto(server)
    finally:
        server.stop()
    failed = [t for t, ok in RESULTS if not ok]
    print(f"\n{len(RESULTS) - len(failed)} of {len(RESULTS)} client calls succeeded")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
