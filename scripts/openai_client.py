#!/usr/bin/env python3
"""`tessera serve` driven by the official `openai` Python package.

Starts the server on a free loopback port with the default model, waits for
/health, then checks streamed chat (role first, deltas, finish reason, usage
last), non-streamed chat against the streamed text, completions with text
and token-id prompts, exact cached tokens on a second turn, log-probabilities
(chat and completions, streamed or not), penalties, logit bias and
cache_prompt=false, speculative decoding asked for per request (the same
text, its kept drafts in the usage), and the client's own error type for a bad model name. Exits non-zero on the first failure.

Usage: openai_client.py TESSERA_BINARY MODEL.gguf
"""

import json
import sys
import urllib.request
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loopback import tessera_serve  # noqa: E402


def main():
    binary, model = sys.argv[1], sys.argv[2]
    with tessera_serve(binary, model, "--api-key", "sk-test", "--alias", "smollm2") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-test", max_retries=0)
        assert [m.id for m in client.models.list()] == ["smollm2"]

        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chunks = list(client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=24, temperature=0,
            stream=True, stream_options={"include_usage": True},
        ))
        assert chunks[0].choices[0].delta.role == "assistant", chunks[0]
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert reasons and reasons[-1] in ("stop", "length"), reasons
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0, chunks[-1]

        r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == streamed, (r.choices[0].message.content, streamed)
        u = r.usage
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
        # The same prompt again: all of it but what must be recomputed
        # comes from the prefix cache, and the count says so.
        assert u.prompt_tokens_details.cached_tokens > 0, u

        turn2 = messages + [{"role": "assistant", "content": streamed},
                            {"role": "user", "content": "And of Italy?"}]
        r2 = client.chat.completions.create(model="smollm2", messages=turn2, max_tokens=16, temperature=0)
        assert r2.usage.prompt_tokens_details.cached_tokens >= u.prompt_tokens - 1, r2.usage

        c = client.completions.create(model="smollm2", prompt="The sky is", max_tokens=12, temperature=0)
        assert c.choices[0].text and c.usage.completion_tokens > 0
        tokens = json.loads(urllib.request.urlopen(urllib.request.Request(
            f"{base}/tokenize", data=json.dumps({"content": "The sky is", "add_special": True}).encode(),
            headers={"Content-Type": "application/json", "Authorization": "Bearer sk-test"},
        )).read())["tokens"]
        c2 = client.completions.create(model="smollm2", prompt=tokens, max_tokens=12, temperature=0)
        assert c2.choices[0].text == c.choices[0].text, (c2.choices[0].text, c.choices[0].text)
        streamed_c = "".join(x.choices[0].text for x in client.completions.create(
            model="smollm2", prompt="The sky is", max_tokens=12, temperature=0, stream=True) if x.choices)
        assert streamed_c == c.choices[0].text

        # Log-probabilities as the client parses them: one entry per token,
        # the chosen token the most likely one (greedy), bytes that rebuild
        # the text; streamed entries equal the non-streamed ones.
        lp = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12,
                                            temperature=0, logprobs=True, top_logprobs=3)
        content = lp.choices[0].logprobs.content
        assert len(content) == lp.usage.completion_tokens, (len(content), lp.usage)
        assert all(e.top_logprobs[0].token == e.token and e.logprob <= 0 for e in content)
        assert bytes(b for e in content for b in e.bytes).decode() == lp.choices[0].message.content
        streamed_lp = [e for ch in client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=12, temperature=0, logprobs=True,
            top_logprobs=3, stream=True) if ch.choices and ch.choices[0].logprobs
            for e in ch.choices[0].logprobs.content]
        assert [(e.token, e.logprob) for e in streamed_lp] == [(e.token, e.logprob) for e in content]
        cl = client.completions.create(model="smollm2", prompt="The sky is", max_tokens=8,
                                       temperature=0, logprobs=2)
        assert "".join(cl.choices[0].logprobs.tokens) == cl.choices[0].text
        assert len(cl.choices[0].logprobs.top_logprobs[0]) == 2
        # Penalties and bias go through; cache_prompt=false computes all.
        client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8,
                                       presence_penalty=0.5, frequency_penalty=0.5,
                                       logit_bias={"28": -100})
        fresh = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=4,
                                               temperature=0, extra_body={"cache_prompt": False})
        assert fresh.usage.prompt_tokens_details.cached_tokens == 0, fresh.usage

        # Speculative decoding asked for by one request (llama-server's
        # field): the same greedy text, its drafts counted in the usage.
        quote = [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the "
                                             "lazy dog, and the quick brown fox jumps again."}]
        plain = client.chat.completions.create(model="smollm2", messages=quote, max_tokens=40, temperature=0)
        spec = client.chat.completions.create(model="smollm2", messages=quote, max_tokens=40, temperature=0,
                                              extra_body={"speculative.n_max": 8})
        assert spec.choices[0].message.content == plain.choices[0].message.content
        d = spec.usage.completion_tokens_details
        assert d.accepted_prediction_tokens > 0, spec.usage
        assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0, plain.usage

        try:
            client.chat.completions.create(model="gpt-9", messages=messages, max_tokens=4)
            sys.exit("an unknown model was accepted")
        except openai.NotFoundError:
            pass
        try:
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
            sys.exit("a wrong API key was accepted")
        except openai.AuthenticationError:
            pass
        print(f"openai client: streamed and non-streamed chat, completions, logprobs, usage and errors OK "
              f"(reply: {streamed!r})")


if __name__ == "__main__":
    main()
