#!/usr/bin/env python3
"""Structured output through `tessera serve`, driven by the official `openai`
package and checked with the `jsonschema` package.

Starts the server on a free loopback port, then sends N (default 200)
chat requests with `response_format: json_schema`, over the ten schemas of
`data/structured-schemas.json`, and a mix of greedy and sampled settings, eight at a time, and requires
every response to parse and validate against its schema. Then: a streamed
`json_object` request, llama-server's `json_schema` and `grammar` fields, a
regex, and a bad schema, which must come back as a 400 naming the problem.
Exits non-zero on the first failure; prints the count and the server's
per-token figures.

Usage: structured_client.py TESSERA_BINARY MODEL.gguf [N]
"""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loopback import free_port, wait_ready  # noqa: E402

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


def main():
    binary, model = sys.argv[1], sys.argv[2]
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 200
    port = free_port()
    server = subprocess.Popen(
        [binary, "serve", "--model", model, "--port", str(port), "--alias", "smollm2"],
        stderr=subprocess.PIPE, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{base}/health", server, "the server", timeout=120,
                   hint=lambda: f": {server.stderr.read()}")
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
        print("structured output: every check passed")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
