#!/usr/bin/env python3
"""A larger model that agrees with a smaller one: the target of draft-model
speed measurements, where no real pair of one tokenizer is reachable.

No two real models of different sizes sharing a tokenizer are reachable
here, and a draft model's speed-up depends on how often the draft guesses
the model's next token, which random weights never do. This writes a
model that computes what a model of several times the size computes and
still mostly agrees with the small one: the small model's own layers, in
order, each followed by EXTRA generated layers of the same shapes, whose
output projections (`attn_output`, `ffn_down`) are random with standard
deviation STD. With STD 0 the generated layers add exact zeros to the
residual stream (the small model's function at the larger one's cost, an
upper bound on agreement); larger STD perturbs the model's predictions
away from the draft's, lowering agreement. Every tensor is quantized as
the small model's are (its types, by gguf's own quantizer), so each engine
reads as many bytes per layer as for the real ones.

    python3 scripts/grow_model.py SRC.gguf OUT.gguf --extra 7 --std 0.002

Both engines load the file (llama.cpp as any Llama-family GGUF).
"""

import argparse
import sys

import numpy as np

try:
    import gguf
except ImportError:
    sys.exit("pip install gguf")


def fields(reader):
    """Every key/value of the file but the tensor bookkeeping."""
    out = []
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        out.append((name, f.contents(), vtype, sub))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--extra", type=int, default=7, help="generated layers after each layer")
    ap.add_argument("--std", type=float, default=0.0,
                    help="std of the generated layers' output projections")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    r = gguf.GGUFReader(args.src)
    arch = r.fields["general.architecture"].contents()
    n = r.fields[f"{arch}.block_count"].contents()
    grown = n * (1 + args.extra)
    w = gguf.GGUFWriter(args.out, arch)
    for name, val, vtype, sub in fields(r):
        if name == "general.architecture":
            continue
        if name == f"{arch}.block_count":
            val = grown
        if name == "general.name":
            val = f"{val} grown to {grown} layers (generated, std {args.std})"
        w.add_key_value(name, val, vtype, sub)
    layers = {}
    rest = []
    for t in r.tensors:
        if t.name.startswith("blk."):
            i, tail = t.name[4:].split(".", 1)
            layers.setdefault(int(i), []).append((tail, t))
        else:
            rest.append(t)

    def copy(name, t):
        w.add_tensor(name, np.array(t.data), raw_shape=np.array(t.data).shape,
                     raw_dtype=t.tensor_type)

    def generated(name, tail, t):
        shape = tuple(int(x) for x in reversed(t.shape))  # numpy: rows, columns
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, np.ones(shape, dtype=np.float32))
            return
        inputs = shape[-1]
        std = args.std if tail.startswith(("attn_output", "ffn_down")) else inputs ** -0.5
        x = (rng.standard_normal(shape) * std).astype(np.float32)
        q = gguf.quants.quantize(x, t.tensor_type)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=t.tensor_type)

    for t in rest:
        copy(t.name, t)
    at = 0
    for i in range(n):
        for tail, t in layers[i]:
            copy(f"blk.{at}.{tail}", t)
        at += 1
        for _ in range(args.extra):
            for tail, t in layers[i]:
                generated(f"blk.{at}.{tail}", tail, t)
            at += 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{args.out}: {grown} layers ({n} of {args.src}, {args.extra} generated after each)")


if __name__ == "__main__":
    main()
