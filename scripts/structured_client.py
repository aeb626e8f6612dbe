#!/usr/bin/env python3
"""Structured output and tool calls through `tessera serve`, driven by the official `openai`
package and checked with the `jsonschema` package.

Starts the server on a free loopback port, then sends N (default 200)
chat requests with `response_format: json_schema`, over the ten schemas of
`data/structured-schemas.json`, and a mix of greedy and sampled settings, eight at a time, and requires
every response to parse and validate against its schema. Then: a streamed
`json_object` request, llama-server's `json_schema` and `grammar` fields, a
regex, and a bad schema, which must come back as a 400 naming the problem.
Then OpenAI's tool-calling flow (call, execute, answer), streamed and not;
`tool_choice: required` and a named function at several temperatures and
seeds, every call parsing and validating against its function's schema;
`auto` with a bias towards the opening marker (calls that parse once
opened); and bad `tools`/`tool_choice` refused. Exits non-zero on the first failure; prints the count and the server's
per-token figures.

Usage: structured_client.py TESSERA_BINARY MODEL.gguf [N]
"""

import json
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loopback import tessera_serve  # noqa: E402

# Ten schemas (nested objects, enums, bounded numbers, arrays, booleans,
# nulls, anyOf, patterns) with a prompt each; `tessera bench --scenario
# structured` reads the same file.
SCHEMAS = [(s["name"], s["prompt"], s["schema"]) for s in json.loads(
    (Path(__file__).resolve().parent.parent / "data" / "structured-schemas.json").read_text())]


def ask(client, i):
    name, prompt, schema = SCHEMAS[i % len(SCHEMAS)]
    sampling = {"temperature": 0} if i % 4 == 0 else {"temperature": 0.9, "seed": i}
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": prompt + " Answer in JSON."}],
        max_tokens=400,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
        **sampling)
    text = r.choices[0].message.content
    reason = r.choices[0].finish_reason
    try:
        value = json.loads(text)
        jsonschema.validate(value, schema)
        return (True, name, reason, text)
    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
        return (False, name, reason, f"{text!r}: {e}")


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city", "strict": True,
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 32},
            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The current time in a time zone", "strict": True,
        "parameters": {"type": "object", "properties": {
            "timezone": {"type": "string", "maxLength": 40}}, "required": ["timezone"]}}},
]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def checked_calls(calls):
    """Every call names a tool and its arguments validate; returns them."""
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id, call
        schema = dict(SCHEMA_OF[call.function.name], additionalProperties=False)
        jsonschema.validate(json.loads(call.function.arguments), schema)
    return calls


def run_tool(call):
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        return json.dumps({"city": args["city"], "temperature": 18, "unit": args["unit"], "sky": "clear"})
    return json.dumps({"timezone": args["timezone"], "time": "14:05"})


def tool_calls(client):
    question = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    # Call, execute, answer: the official client's flow, not streamed.
    r = client.chat.completions.create(model="smollm2", messages=question, tools=TOOLS,
                                       tool_choice="required", max_tokens=200, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = checked_calls(choice.message.tool_calls)
    history = question + [choice.message.model_dump(exclude_none=True)]
    for call in calls:
        history.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    answer = client.chat.completions.create(model="smollm2", messages=history, tools=TOOLS,
                                            tool_choice="none", max_tokens=60, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls, answer

    # The same, streamed: tool-call deltas assemble into calls.
    parts, reason = {}, None
    for chunk in client.chat.completions.create(model="smollm2", messages=question, tools=TOOLS,
                                                tool_choice="required", max_tokens=200, temperature=0,
                                                stream=True):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        for tc in d.tool_calls or []:
            p = parts.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            p["id"] = tc.id or p["id"]
            p["name"] += tc.function.name or ""
            p["arguments"] += tc.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    assert reason == "tool_calls", reason
    streamed = [parts[i] for i in sorted(parts)]
    assert [(p["name"], json.loads(p["arguments"])) for p in streamed] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in calls], (streamed, calls)
    history = question + [{"role": "assistant", "tool_calls": [
        {"id": p["id"], "type": "function", "function": {"name": p["name"], "arguments": p["arguments"]}}
        for p in streamed]}]
    for p in streamed:
        history.append({"role": "tool", "tool_call_id": p["id"], "content": run_tool(
            type("Call", (), {"function": type("F", (), p)})())})
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2", messages=history, tools=TOOLS, max_tokens=60, temperature=0, stream=True)
        if c.choices)
    assert text, "no streamed answer after the tool results"

    # `required` and a named function always give calls that parse and
    # validate, greedy and sampled.
    prompts = ["What time is it in Tokyo?", "Is it raining in London?", "Tell me a joke.",
               "Weather and time in Berlin, please."]
    for i in range(24):
        named = i % 3 == 2
        choice_ = {"type": "function", "function": {"name": "get_time"}} if named else "required"
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": prompts[i % len(prompts)]}],
            tools=TOOLS, tool_choice=choice_, max_tokens=200, temperature=0 if i % 4 == 0 else 1.0,
            seed=i, parallel_tool_calls=i % 2 == 0)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        calls = checked_calls(c.message.tool_calls)
        if named:
            assert all(x.function.name == "get_time" for x in calls), calls
        if i % 2 == 1:
            assert len(calls) == 1, calls

    # `auto`: a call, once the answer opens one, is held to the syntax. The
    # 135M model answers in prose under `auto`; a bias towards the opening
    # marker's tokens stands for a model that calls. Streamed and not.
    base = str(client.base_url).removesuffix("/v1/")
    req = urllib.request.Request(f"{base}/tokenize", data=json.dumps(
        {"content": "<tool_call>", "parse_special": True}).encode(),
        headers={"Content-Type": "application/json"})
    opener = json.loads(urllib.request.urlopen(req).read())["tokens"]
    bias = {str(t): 12 for t in opener}
    for i in range(4):
        r = client.chat.completions.create(model="smollm2", messages=question, tools=TOOLS,
                                           max_tokens=600, temperature=1.0, seed=i, logit_bias=bias)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        checked_calls(c.message.tool_calls)
    parts, reason = {}, None
    for chunk in client.chat.completions.create(model="smollm2", messages=question, tools=TOOLS,
                                                max_tokens=600, temperature=1.0, seed=9,
                                                logit_bias=bias, stream=True):
        if chunk.choices:
            for tc in chunk.choices[0].delta.tool_calls or []:
                p = parts.setdefault(tc.index, {"name": "", "arguments": ""})
                p["name"] += tc.function.name or ""
                p["arguments"] += tc.function.arguments or ""
            reason = chunk.choices[0].finish_reason or reason
    assert reason == "tool_calls" and parts, (reason, parts)
    for p in parts.values():
        json.loads(p["arguments"])

    # Bad tools and choices: 400s naming the field.
    for kwargs, needle in [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
        ({"tool_choice": "required"}, "tools"),
    ]:
        try:
            client.chat.completions.create(model="smollm2", messages=question, max_tokens=8, **kwargs)
            raise AssertionError(f"{kwargs} was served")
        except openai.BadRequestError as e:
            assert needle in str(e), e


def main():
    binary, model = sys.argv[1], sys.argv[2]
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 200
    with tessera_serve(binary, model, "--alias", "smollm2") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: ask(client, i), range(count)))
        bad = [r for r in results if not r[0]]
        for ok, name, reason, text in bad[:5]:
            print(f"FAILED {name} ({reason}): {text}", file=sys.stderr)
        print(f"{count - len(bad)} of {count} responses parse and validate against their schemas")
        assert not bad, f"{len(bad)} of {count} responses fail their schema"

        # Streamed json_object: the deltas join into one JSON object.
        chunks = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Describe a cat in JSON."}],
            max_tokens=300, temperature=0, stream=True, response_format={"type": "json_object"})
        deltas = [c for c in chunks if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in deltas)
        if deltas[-1].choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text

        # llama-server's fields and a regex, through the client's extra body.
        def extra(body, content="Is the sea salty?"):
            return client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": content}],
                max_tokens=64, temperature=0, extra_body=body).choices[0].message.content
        v = json.loads(extra({"json_schema": SCHEMAS[4][2]}))
        jsonschema.validate(v, SCHEMAS[4][2])
        assert extra({"grammar": 'root ::= ("yes" | "no") "."'}) in ("yes.", "no.")
        assert extra({"regex": "(yes|no), [a-z ]{1,30}\\."}, "Answer yes or no, then why.")[-1] == "."

        # A bad schema is a 400 that names the problem; nothing runs.
        try:
            client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}})
            raise AssertionError("a bad schema was served")
        except openai.BadRequestError as e:
            assert "strnig" in str(e), e
        try:
            extra({"grammar": "root ::= undefined-rule"})
            raise AssertionError("a bad grammar was served")
        except openai.BadRequestError as e:
            assert "undefined_rule" in str(e), e
        try:
            extra({"grammar": 'root ::= "a"', "regex": "a"})
            raise AssertionError("two constraints were served")
        except openai.BadRequestError as e:
            assert "one constraint" in str(e), e
        metrics = urllib.request.urlopen(f"{base}/metrics").read().decode()
        masks = [float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("tessera:structured_output_masks_total")]
        assert masks and masks[0] > 0, "no structured-output masks counted in /metrics"
        print("structured output: every check passed")
        tool_calls(client)
        print("tool calls: every check passed")


if __name__ == "__main__":
    main()
