#!/usr/bin/env python3
"""Generated GGUFs of a family's exact tensor layout, for speed work and
for checking an architecture against llama.cpp.

No real weights of these sizes or families are reachable, and neither speed
nor an architecture's arithmetic depends on weight values, so this writes a
family's tensor names, shapes and metadata with random weights in f16,
borrowing the default model's tokenizer (SmolLM2's, 49,152 tokens) so that
both engines load it, then quantizes it with llama.cpp's own
`llama-quantize` (built by scripts/build_llama_tools.sh) to each format
asked for.

    python3 scripts/synth_model.py [MODEL ...] [--formats F16,Q4_0,Q4_K_M,...]

MODEL is ARCH-SIZE (`qwen3-0.6b`, `granite-s`, ...) or, for the Llama
family, SIZE alone (`1b`, `3b`). Writes models/synth-<MODEL>-<FORMAT>.gguf
(the f16 source is removed once quantized unless --keep-f16). Does nothing
for files already there.

    python3 scripts/synth_model.py 1b --blocks Q4_0 --tokenizer-json T --out-dir D

`--blocks` writes random quantized blocks directly (Q4_0, Q4_1, Q8_0, or
Q4_K_M's mix: Q4_K, with Q6_K for attn_v, ffn_down and the output), with no
f16 source and no llama-quantize: for speed on a machine that has neither
llama.cpp's tools nor the model file (a lent GPU), where quantizing would
cost minutes and the values do not matter. The tokenizer's fields then come
from a JSON file (gzipped if named .gz) written here by `--dump-tokenizer
FILE`, and the file is
models/synth-<MODEL>-<FORMAT>-blocks.gguf (or in --out-dir).

Three kinds of weights:
- `1b`, `3b` (speed): normal with std 0.02, norms 1, as before;
- `--blocks` (speed, anywhere): uniformly random quantized values with
  scales that give weights of std about 0.02;
- every other model (arithmetic): scaled so that each block changes the
  residual stream as much as a trained one does (projections with std
  1/sqrt(inputs)), norms near 1, and the output head giving logits with a
  spread of about 2.5 (after Granite's logit scale), so that the next-token
  distributions are neither flat nor one-hot and top-1 agreement and KL
  divergence between two engines mean something.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "target/llama-server/llama_cpp_python-0.3.36/vendor/llama.cpp"
QUANTIZE = ROOT / "target/llama-server/build/bin/llama-quantize"
TOKENIZER_FROM = ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"

# (hidden, layers, heads, kv heads, head dim, FFN, RoPE base). Llama 3.2
# 1B and 3B; SmolLM2-135M's geometry (the control of the family checks);
# Qwen3 0.6B; Granite 3 2B's, SmolLM3 3B's, Phi-3 mini's and OLMo 2 1B's
# widths at 8 layers (two of them SmolLM3's NoPE layers), deep enough to carry an
# error, small enough to check in a minute; Phi-3 again with Phi-3.5's LongRoPE. The vocabulary is the borrowed tokenizer's.
SIZES = {
    ("llama", "1b"): dict(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, ffn=8192,
                          theta=500000.0),
    ("llama", "3b"): dict(hidden=3072, layers=28, heads=24, kv_heads=8, head_dim=128, ffn=8192,
                          theta=500000.0),
    ("llama", "135m"): dict(hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, ffn=1536,
                            theta=100000.0),
    ("qwen3", "0.6b"): dict(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, ffn=3072,
                            theta=1000000.0),
    ("granite", "s"): dict(hidden=2048, layers=8, heads=32, kv_heads=8, head_dim=64, ffn=8192,
                           theta=10000000.0),
    ("smollm3", "s"): dict(hidden=2048, layers=8, heads=16, kv_heads=4, head_dim=128, ffn=11008,
                           theta=5000000.0),
    ("phi3", "s"): dict(hidden=3072, layers=8, heads=32, kv_heads=32, head_dim=96, ffn=8192,
                        theta=10000.0),
    ("olmo2", "s"): dict(hidden=2048, layers=8, heads=16, kv_heads=16, head_dim=128, ffn=8192,
                         theta=500000.0),
    # Phi-3.5 mini's LongRoPE on phi3-s's layout: a 128k context extended
    # from an original one of 256 (Phi-3.5's is 4,096: this one is short,
    # so that a check of a few hundred tokens runs past it, and a multiple
    # of the 256 llama.cpp pads a sequence's context to), its factors'
    # shapes (short near 1, long up to 61 at the lowest frequencies) and
    # the converter's attention factor for that extension.
    ("phi3", "long"): dict(hidden=3072, layers=8, heads=32, kv_heads=32, head_dim=96, ffn=8192,
                           theta=10000.0, context=131072, longrope_original=256),
    # Phi-4 mini's layout at 8 layers: 24/8 heads of 128 of which RoPE
    # turns 96, LongRoPE over those (original context 256 as above), the
    # output tied to the embeddings, and its GPT-4o pre-tokenizer (over the
    # borrowed vocabulary: the split is what differs).
    ("phi3", "4mini"): dict(hidden=3072, layers=8, heads=24, kv_heads=8, head_dim=128, ffn=8192,
                            theta=10000.0, context=131072, longrope_original=256, rope_dims=96,
                            tied=True, pre="gpt-4o"),
}
# Granite 3's scales (its 2B: embeddings ×12, block outputs ×0.22, scores
# ×1/64, logits ÷8).
GRANITE = {"embedding_scale": 12.0, "residual_scale": 0.22, "attention.scale": 0.015625,
           "logit_scale": 8.0}
FORMATS = ["Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"]


def parse(model):
    """ARCH-SIZE or a Llama SIZE -> (arch, size)."""
    arch, _, size = model.rpartition("-")
    key = (arch or "llama", size)
    if key not in SIZES:
        known = ", ".join(f"{a}-{s}" if a != "llama" else s for a, s in SIZES)
        sys.exit(f"unknown model {model}: one of {known}")
    return key


def file_stem(arch, size):
    return f"synth-{size}" if arch == "llama" else f"synth-{arch}-{size}"


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


def start(path, arch, size, gguf, toks, file_type):
    """A GGUFWriter for the model with its metadata (tokenizer fields
    `toks`), and the model's tensors as (name, numpy shape)."""
    s = SIZES[(arch, size)]
    h, ffn, heads, kv, hd = s["hidden"], s["ffn"], s["heads"], s["kv_heads"], s["head_dim"]
    vocab = next(len(v) for k, v, _, _ in toks if k == "tokenizer.ggml.tokens")
    w = gguf.GGUFWriter(str(path), arch)
    # (No family name in it: llama.cpp sets special-token attributes by
    # general.name, for "phi3" on tokens the borrowed vocabulary lacks.)
    w.add_string("general.name", f"synthetic {size} model (random weights)")
    w.add_uint32("general.file_type", file_type)
    a = lambda k: f"{arch}.{k}"  # noqa: E731
    w.add_uint32(a("context_length"), s.get("context", 8192))
    if "longrope_original" in s:
        # What llama.cpp's converter writes for LongRoPE (conversion/phi.py).
        orig = s["longrope_original"]
        w.add_uint32(a("rope.scaling.original_context_length"), orig)
        w.add_float32(a("rope.scaling.attn_factor"), longrope_attn_factor(s["context"], orig))
    w.add_uint32(a("embedding_length"), h)
    w.add_uint32(a("block_count"), s["layers"])
    w.add_uint32(a("feed_forward_length"), ffn)
    w.add_uint32(a("attention.head_count"), heads)
    w.add_uint32(a("attention.head_count_kv"), kv)
    w.add_uint32(a("attention.key_length"), hd)
    w.add_uint32(a("attention.value_length"), hd)
    w.add_uint32(a("rope.dimension_count"), s.get("rope_dims", hd))
    w.add_uint32(a("vocab_size"), vocab)
    w.add_float32(a("rope.freq_base"), s["theta"])
    w.add_float32(a("attention.layer_norm_rms_epsilon"), 1e-6 if arch in ("qwen3", "olmo2") else 1e-5)
    if arch == "granite":
        for k, v in GRANITE.items():
            w.add_float32(a(k), v)
    for name, val, vtype, sub in toks:
        if name == "tokenizer.ggml.pre" and "pre" in s:
            val = s["pre"]
        w.add_key_value(name, val, vtype, sub)
    # (numpy shape: rows = outputs, columns = inputs)
    shapes = [("token_embd.weight", (vocab, h))]
    for i in range(s["layers"]):
        b = f"blk.{i}."
        if arch == "phi3":
            # Phi-3's converter: q/k/v in one tensor, gate and up in `ffn_up`.
            proj = [(b + "attn_qkv.weight", ((heads + 2 * kv) * hd, h)),
                    (b + "ffn_up.weight", (2 * ffn, h))]
        else:
            proj = [(b + "attn_q.weight", (heads * hd, h)),
                    (b + "attn_k.weight", (kv * hd, h)),
                    (b + "attn_v.weight", (kv * hd, h)),
                    (b + "ffn_gate.weight", (ffn, h)),
                    (b + "ffn_up.weight", (ffn, h))]
        shapes += [*proj, (b + "attn_output.weight", (h, heads * hd)), (b + "ffn_down.weight", (h, ffn))]
        if arch == "olmo2":
            # OLMo 2: no pre-norms, q/k norms over all heads, post-norms.
            shapes += [(b + "attn_q_norm.weight", (heads * hd,)), (b + "attn_k_norm.weight", (kv * hd,)),
                       (b + "post_attention_norm.weight", (h,)), (b + "post_ffw_norm.weight", (h,))]
        else:
            shapes += [(b + "attn_norm.weight", (h,)), (b + "ffn_norm.weight", (h,))]
        if arch == "qwen3":
            shapes += [(b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,))]
    shapes += [("output_norm.weight", (h,))]
    if not s.get("tied"):
        shapes += [("output.weight", (vocab, h))]
    if "longrope_original" in s:
        rot = s.get("rope_dims", hd) // 2
        shapes += [("rope_factors_long.weight", (rot,)), ("rope_factors_short.weight", (rot,))]
    return w, shapes


def longrope_attn_factor(context, original):
    """The converter's `sqrt(1 + ln(scale) / ln(original))`."""
    import math
    scale = context / original
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0


def longrope_factors(name, n, np):
    """LongRoPE divisors shaped as Phi-3.5 mini's: the short ones from 1 to
    1.9, the long ones from 1 to 61, both growing toward the low
    frequencies (the last pairs)."""
    x = np.arange(n, dtype=np.float32) / n
    if "long" in name:
        return (1.0 + 60.0 * x ** 3).astype(np.float32)
    return (1.0 + 0.9 * x ** 2).astype(np.float32)


def write_f16(path, arch, size, gguf, np):
    speed = size in ("1b", "3b")
    w, shapes = start(path, arch, size, gguf, tokenizer_fields(gguf), 1)  # MOSTLY_F16
    for name, shape in shapes:
        dt = np.float32 if len(shape) == 1 else np.float16
        n = int(np.prod(shape))
        w.add_tensor_info(name, shape, np.dtype(dt), n * np.dtype(dt).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    logit_scale = GRANITE["logit_scale"] if arch == "granite" else 1.0
    for name, shape in shapes:
        if name.startswith("rope_factors_"):
            w.write_tensor_data(longrope_factors(name, shape[0], np))
            continue
        if len(shape) == 1:
            t = np.ones(shape, dtype=np.float32)
            if not speed:
                t += 0.1 * rng.standard_normal(shape, dtype=np.float32)
            w.write_tensor_data(t)
            continue
        t = rng.standard_normal(shape, dtype=np.float32)
        if speed:
            std = 0.02
        elif name == "token_embd.weight" and SIZES[(arch, size)].get("tied"):
            # Also the output head: the spread of logits an untied head gets.
            std = 2.5 * logit_scale / np.sqrt(shape[1])
        elif name == "token_embd.weight":
            std = 1.0
        elif name == "output.weight":
            std = 2.5 * logit_scale / np.sqrt(shape[1])
        else:
            std = 1.0 / np.sqrt(shape[1])
        t *= std
        w.write_tensor_data(t.astype(np.float16))
    w.close()


# --blocks: bytes per block, values per block, and the offsets of the f16
# scale fields with the value each gets (weights of std about 0.02).
BLOCKS = {
    "Q4_0": (18, 32, [(0, 0.0043)]),
    "Q4_1": (20, 32, [(0, 0.0043), (2, -0.032)]),
    "Q8_0": (34, 32, [(0, 0.00027)]),
    "Q4_K": (144, 256, [(0, 1.4e-4), (2, 1.0e-3)]),
    "Q6_K": (210, 256, [(208, 1.5e-5)]),
}
# GGML's file types of the --blocks formats.
FILE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q4_K_M": 15}


def block_type(fmt, name):
    """The block format of tensor `name` in a --blocks file of `fmt`."""
    if fmt != "Q4_K_M":
        return fmt
    if name == "output.weight" or name.endswith(("attn_v.weight", "ffn_down.weight")):
        return "Q6_K"
    return "Q4_K"


def write_blocks(path, arch, size, fmt, toks, gguf, np):
    w, shapes = start(path, arch, size, gguf, toks, FILE_TYPES[fmt])
    rng = np.random.default_rng(0)
    for name, shape in shapes:
        if name.startswith("rope_factors_"):
            w.add_tensor(name, longrope_factors(name, shape[0], np))
            continue
        if len(shape) == 1:
            w.add_tensor(name, np.ones(shape, dtype=np.float32))
            continue
        kind = block_type(fmt, name)
        nbytes, nvals, scales = BLOCKS[kind]
        rows, cols = shape
        if cols % nvals:
            sys.exit(f"{name}: rows of {cols} values do not fill {kind} blocks of {nvals}")
        blocks = rng.integers(0, 256, size=(rows, cols // nvals, nbytes), dtype=np.uint8)
        for off, value in scales:
            blocks[:, :, off:off + 2] = np.array([value], dtype=np.float16).view(np.uint8)
        w.add_tensor(name, blocks.reshape(rows, -1), raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def json_file(path, mode):
    """`path` opened as text, through gzip when it is named .gz."""
    import gzip
    return gzip.open(path, mode + "t") if str(path).endswith(".gz") else open(path, mode)


def dump_tokenizer(path, gguf):
    fields = [[name, val, int(vtype), None if sub is None else int(sub)]
              for name, val, vtype, sub in tokenizer_fields(gguf)]
    with json_file(path, "w") as f:
        json.dump(fields, f)


def load_tokenizer(path, gguf):
    with json_file(path, "r") as f:
        return [(name, val, gguf.GGUFValueType(vtype), None if sub is None else gguf.GGUFValueType(sub))
                for name, val, vtype, sub in json.load(f)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", help="ARCH-SIZE or a Llama SIZE (default 1b)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--keep-f16", action="store_true")
    ap.add_argument("--blocks", metavar="FORMAT", choices=sorted(FILE_TYPES),
                    help="random quantized blocks written directly (see above)")
    ap.add_argument("--tokenizer-json", metavar="FILE", help="--blocks: the tokenizer's fields")
    ap.add_argument("--dump-tokenizer", metavar="FILE",
                    help="write the default model's tokenizer fields for --tokenizer-json")
    ap.add_argument("--out-dir", metavar="DIR", default=str(ROOT / "models"),
                    help="--blocks: where the files go (default models/)")
    ap.add_argument("--gguf-py", metavar="DIR", default=str(LLAMA / "gguf-py"),
                    help="llama.cpp's gguf-py (default: the tree build_llama_tools.sh unpacks)")
    args = ap.parse_args()
    sys.path.insert(0, args.gguf_py)
    try:
        import numpy as np
        import gguf
    except ImportError as e:
        sys.exit(f"{e}: run scripts/build_llama_tools.sh (the llama.cpp tree) and pip install numpy")
    if args.dump_tokenizer:
        return dump_tokenizer(args.dump_tokenizer, gguf)
    models = [parse(m) for m in args.models or ["1b"]]
    if args.blocks:
        if not args.tokenizer_json:
            sys.exit("--blocks needs --tokenizer-json (written by --dump-tokenizer)")
        toks = load_tokenizer(args.tokenizer_json, gguf)
        for arch, size in models:
            out = Path(args.out_dir) / f"{file_stem(arch, size)}-{args.blocks}-blocks.gguf"
            if out.exists():
                continue
            print(f"writing {out} (random {args.blocks} blocks)", flush=True)
            tmp = out.with_suffix(".tmp")
            write_blocks(tmp, arch, size, args.blocks, toks, gguf, np)
            os.replace(tmp, out)
        return
    if not QUANTIZE.exists():
        sys.exit(f"{QUANTIZE} missing: run scripts/build_llama_tools.sh")
    if not TOKENIZER_FROM.exists():
        sys.exit(f"{TOKENIZER_FROM} missing: run `just model`")
    formats = [f for f in args.formats.split(",") if f]
    for arch, size in models:
        stem = file_stem(arch, size)
        outs = {f: ROOT / f"models/{stem}-{f}.gguf" for f in formats}
        todo = [f for f, p in outs.items() if not p.exists()]
        if not todo:
            continue
        src = ROOT / f"models/{stem}-F16.gguf"
        if not src.exists():
            print(f"writing {src} (random weights)", flush=True)
            tmp = src.with_suffix(".tmp")
            write_f16(tmp, arch, size, gguf, np)
            os.replace(tmp, src)
        for f in todo:
            if f == "F16":
                continue  # the source itself, kept below
            print(f"quantizing {outs[f].name}", flush=True)
            tmp = outs[f].with_suffix(".tmp")
            q = subprocess.run([str(QUANTIZE), str(src), str(tmp), f, str(os.cpu_count() or 1)],
                               capture_output=True, text=True)
            if q.returncode != 0:
                sys.exit(f"llama-quantize failed:\n{q.stdout}{q.stderr}")
            os.replace(tmp, outs[f])
        if not args.keep_f16 and "F16" not in formats:
            src.unlink()


if __name__ == "__main__":
    main()
