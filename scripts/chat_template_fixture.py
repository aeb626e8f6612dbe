#!/usr/bin/env python3
"""Regenerates tests/fixtures/chat_templates.json: the chat templates of
the families Tessera runs (as their GGUF files carry them, from the
llama.cpp tree's models/templates, vendored by llama-cpp-python 0.3.36 and
unpacked by scripts/build_llama_tools.sh) rendered over fixed
conversations by Python's jinja2 the way Hugging Face's
`apply_chat_template` renders them (a sandboxed environment with
trim_blocks, lstrip_blocks and loop controls, `raise_exception`). The test
`chat_templates_render_as_hugging_face_does` renders the same with
Tessera's template engine and compares. The last conversation offers a
tool and carries a call and its result (OpenAI's shapes, `arguments` as an
object, as templates read them).

Without the llama.cpp tree, each family's template source is read back
from the fixture itself (the conversations can change; the templates
cannot).
"""

import json
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "target/llama-server/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates"
# (fixture name, template file, bos, eos)
FAMILIES = [
    ("qwen3", "Qwen-Qwen3-0.6B.jinja", "", "<|im_end|>"),
    ("smollm3", "HuggingFaceTB-SmolLM3-3B.jinja", "", "<|im_end|>"),
    ("granite", "ibm-granite-granite-3.3-2B-Instruct.jinja", "", "<|end_of_text|>"),
    ("phi3", "microsoft-Phi-3.5-mini-instruct.jinja", "<s>", "<|endoftext|>"),
]
CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name a river."},
     {"role": "assistant", "content": "The Danube."},
     {"role": "user", "content": "How long is it?\n\nIn km."}],
    [{"role": "system", "content": "Answer in French."},
     {"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Use the tools."},
     {"role": "user", "content": "Weather in Oslo?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}}]},
     {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temperature\": -3}"},
     {"role": "user", "content": "And in Rome?"}],
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}]


def raise_exception(msg):
    raise jinja2.exceptions.TemplateError(msg)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Hugging Face's own `tojson` (transformers' chat template utilities):
    # keys in their order, no HTML escaping, Python's separators.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def main():
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = tojson
    path = ROOT / "tests/fixtures/chat_templates.json"
    kept = {f["family"]: f["source"] for f in json.loads(path.read_text())} if path.exists() else {}
    out = []
    for name, file, bos, eos in FAMILIES:
        source = (TEMPLATES / file).read_text() if (TEMPLATES / file).exists() else kept[name]
        t = env.from_string(source)
        cases = []
        for messages in CONVERSATIONS:
            tools = TOOLS if any("tool_calls" in m for m in messages) else None
            for gen in (True, False):
                extra = {"tools": tools} if tools else {}
                text = t.render(messages=messages, add_generation_prompt=gen, bos_token=bos, eos_token=eos,
                                **extra)
                cases.append({"messages": messages, "add_generation_prompt": gen, "text": text, **extra})
        out.append({"family": name, "from": f"llama.cpp models/templates/{file}", "bos": bos, "eos": eos,
                    "source": source, "cases": cases})
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
