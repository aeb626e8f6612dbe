#!/usr/bin/env python3
"""Generated Llama-family GGUFs at real sizes, for speed work.

Speed does not depend on weight values, and no real weights of these sizes
are reachable, so this writes the exact tensor layout of a Llama 3.2-class
model with random weights (normal, std 0.02; norms 1) in f16, borrowing the
default model's tokenizer (SmolLM2's, 49,152 tokens) so that both engines
load it, then quantizes it with llama.cpp's own `llama-quantize` (built by
scripts/build_llama_tools.sh) to each format asked for.

    python3 scripts/synth_model.py [1b|3b ...] [--formats Q4_0,Q4_K_M,...]

Writes models/synth-<size>-<FORMAT>.gguf (the f16 source is removed once
quantized unless --keep-f16). Does nothing for files already there.
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "target/llama-server/llama_cpp_python-0.3.36/vendor/llama.cpp"
QUANTIZE = ROOT / "target/llama-server/build/bin/llama-quantize"
TOKENIZER_FROM = ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"

# Llama 3.2 1B and 3B (hidden, layers, heads, kv heads, FFN), head size 64
# and 128 as theirs; the vocabulary is the borrowed tokenizer's.
SIZES = {
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
    "3b": dict(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192),
}
FORMATS = ["Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"]


def tokenizer_fields(gguf):
    r = gguf.GGUFReader(TOKENIZER_FROM)
    out = []
    for name, f in r.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            out.append((name, f.contents(), vtype, f.types[1]))
        else:
            out.append((name, f.contents(), vtype, None))
    return out


def write_f16(path, size, gguf, np):
    s = SIZES[size]
    h, ffn, heads, kv = s["hidden"], s["ffn"], s["heads"], s["kv_heads"]
    hd = h // heads
    toks = tokenizer_fields(gguf)
    vocab = next(len(v) for k, v, _, _ in toks if k == "tokenizer.ggml.tokens")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", f"synthetic Llama {size} (random weights)")
    w.add_uint32("general.file_type", 1)  # MOSTLY_F16
    w.add_uint32("llama.context_length", 8192)
    w.add_uint32("llama.embedding_length", h)
    w.add_uint32("llama.block_count", s["layers"])
    w.add_uint32("llama.feed_forward_length", ffn)
    w.add_uint32("llama.attention.head_count", heads)
    w.add_uint32("llama.attention.head_count_kv", kv)
    w.add_uint32("llama.rope.dimension_count", hd)
    w.add_uint32("llama.vocab_size", vocab)
    w.add_float32("llama.rope.freq_base", 500000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for name, val, vtype, sub in toks:
        w.add_key_value(name, val, vtype, sub)
    # (numpy shape: rows = outputs, columns = inputs)
    shapes = [("token_embd.weight", (vocab, h))]
    for i in range(s["layers"]):
        b = f"blk.{i}."
        shapes += [
            (b + "attn_norm.weight", (h,)),
            (b + "attn_q.weight", (heads * hd, h)),
            (b + "attn_k.weight", (kv * hd, h)),
            (b + "attn_v.weight", (kv * hd, h)),
            (b + "attn_output.weight", (h, heads * hd)),
            (b + "ffn_norm.weight", (h,)),
            (b + "ffn_gate.weight", (ffn, h)),
            (b + "ffn_up.weight", (ffn, h)),
            (b + "ffn_down.weight", (h, ffn)),
        ]
    shapes += [("output_norm.weight", (h,)), ("output.weight", (vocab, h))]
    for name, shape in shapes:
        dt = np.float32 if len(shape) == 1 else np.float16
        n = int(np.prod(shape))
        w.add_tensor_info(name, shape, np.dtype(dt), n * np.dtype(dt).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, shape in shapes:
        if len(shape) == 1:
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
        else:
            t = rng.standard_normal(shape, dtype=np.float32)
            t *= 0.02
            w.write_tensor_data(t.astype(np.float16))
    w.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sizes", nargs="*", help="1b, 3b (default 1b)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--keep-f16", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(LLAMA / "gguf-py"))
    try:
        import numpy as np
        import gguf
    except ImportError as e:
        sys.exit(f"{e}: run scripts/build_llama_tools.sh (the llama.cpp tree) and pip install numpy")
    if not QUANTIZE.exists():
        sys.exit(f"{QUANTIZE} missing: run scripts/build_llama_tools.sh")
    if not TOKENIZER_FROM.exists():
        sys.exit(f"{TOKENIZER_FROM} missing: run `just model`")
    formats = [f for f in args.formats.split(",") if f]
    for size in args.sizes:
        if size not in SIZES:
            sys.exit(f"unknown size {size}: one of {', '.join(SIZES)}")
    for size in args.sizes or ["1b"]:
        outs = {f: ROOT / f"models/synth-{size}-{f}.gguf" for f in formats}
        todo = [f for f, p in outs.items() if not p.exists()]
        if not todo:
            continue
        src = ROOT / f"models/synth-{size}-F16.gguf"
        if not src.exists():
            print(f"writing {src} (random weights)", flush=True)
            tmp = src.with_suffix(".tmp")
            write_f16(tmp, size, gguf, np)
            os.replace(tmp, src)
        for f in todo:
            print(f"quantizing {outs[f].name}", flush=True)
            tmp = outs[f].with_suffix(".tmp")
            q = subprocess.run([str(QUANTIZE), str(src), str(tmp), f, str(os.cpu_count() or 1)],
                               capture_output=True, text=True)
            if q.returncode != 0:
                sys.exit(f"llama-quantize failed:\n{q.stdout}{q.stderr}")
            os.replace(tmp, outs[f])
        if not args.keep_f16:
            src.unlink()


if __name__ == "__main__":
    main()
