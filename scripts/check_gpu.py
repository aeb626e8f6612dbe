#!/usr/bin/env python3
"""`just check-gpu`: what a machine without a GPU can check of the GPU kernels.
(`just test-cuda` runs `check_gpu.py test-cuda`: the CUDA tests on a GPU;
`check_gpu.py bundle [DIR]` builds them, and the CUDA `tessera`, for a GPU
machine without Rust: see scripts/cuda_device_run.sh; `check_gpu.py lent
[DIR]` (default target/lent) the whole folder of one lent GPU call, with
llama.cpp's CUDA llama-bench: see scripts/cuda_lent_call.sh.)

1. Every crates/kernels/gpu/*.cu compiled to PTX by nvcc and through ptxas
   for sm_80 and sm_90 (types, registers, spills, shared memory); a spill is
   an error. nvcc comes from the CUDA 13.0 pip wheels, installed when missing
   (pinned to 13.0: newer PTX does not load on CUDA 13.0 drivers).
2. Every crates/kernels/gpu/*.metal checked by `clang++ -fsyntax-only`
   against gpu/shim/metal_stdlib, a stand-in of our own for Metal's header.
3. The kernel-emu tests: the shared kernel source compiled for the CPU and
   run against the CPU slow references; paged_attention.cu, forward.cu and
   paged_attention.metal compiled unchanged for the CPU and run whole, a
   fiber per GPU thread (gpu/emu_cuda.cpp, gpu/emu_metal.cpp), with the
   launchers' own launches; and the entry points and buffer indices the
   Rust side binds checked against the source.
4. The CUDA launchers, the GPU tests and the `tessera` binary with its
   `cuda` feature type-checked against candle's CUDA backend (in
   target/cuda-check), with scripts/nvcc_check.sh as nvcc: a type-check
   reads no kernel, so candle's CUDA files are not compiled for it.
5. The Metal launchers and GPU tests (tessera-kernels and tessera-model with
   their `metal` feature) type-checked with clippy for aarch64-apple-darwin
   against candle's Metal backend (in target/metal; the target's standard
   library installed by rustup when missing). The crates above them pull in
   C code (TLS, tokenizers) that needs Apple's SDK to build, so the engine
   and the binary are not checked for that target.

Not covered here: no GPU executes anything, and Metal's own compiler never
sees the sources.
"""
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from test_binary import lib_test_binaries  # noqa: E402
GPU = os.path.join(ROOT, "crates", "kernels", "gpu")
OUT = os.path.join(ROOT, "target", "gpu")
WHEEL = "cuda-toolkit[nvcc,cccl]==13.0.*"
ARCHS = ["80", "90"]


def find_nvcc():
    if os.environ.get("NVCC"):
        return os.environ["NVCC"]
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations if spec else []) or []:
        cand = os.path.join(base, "cu13", "bin", "nvcc")
        if os.path.exists(cand):
            return cand
    return shutil.which("nvcc")


def run(cmd, **kw):
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, text=True, **kw)


def ensure_nvcc():
    nvcc = find_nvcc()
    if nvcc is None:
        run([sys.executable, "-m", "pip", "install", "--quiet", WHEEL])
        importlib.invalidate_caches()
        nvcc = find_nvcc()
    if nvcc is None:
        sys.exit(f"check-gpu: nvcc not found after installing {WHEEL}")
    return nvcc


def check_cuda():
    nvcc = ensure_nvcc()
    ptxas = os.path.join(os.path.dirname(nvcc), "ptxas")
    os.makedirs(OUT, exist_ok=True)
    sources = sorted(glob.glob(os.path.join(GPU, "*.cu")))
    for src in sources:
        stem = os.path.splitext(os.path.basename(src))[0]
        for arch in ARCHS:
            ptx = os.path.join(OUT, f"{stem}.sm_{arch}.ptx")
            run([nvcc, "-ptx", f"-arch=sm_{arch}", "-O3", "-Werror", "all-warnings", "-o", ptx, src])
            r = run([ptxas, "-v", "--warn-on-spills", "--warning-as-error", f"-arch=sm_{arch}",
                     ptx, "-o", os.devnull], capture_output=True)
            info = r.stdout + r.stderr
            entries = info.count("Compiling entry function")
            regs = [int(l.split("Used ")[1].split(" registers")[0]) for l in info.splitlines()
                    if "Used " in l and " registers" in l]
            print(f"  {stem} sm_{arch}: {entries} entry points, at most {max(regs, default=0)} registers, no spills")
    return len(sources)


def check_metal():
    clang = shutil.which("clang++")
    if clang is None:
        sys.exit("check-gpu: clang++ not found (apt-get install clang)")
    sources = sorted(glob.glob(os.path.join(GPU, "*.metal")))
    for src in sources:
        run([clang, "-x", "c++", "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
             "-Wno-unknown-attributes", "-I", os.path.join(GPU, "shim"), src])
    return len(sources)


RUNTIME = "cuda-toolkit[nvcc,cccl,cublas,curand,cudart]==13.0.*"


def link_dir(nvcc):
    """A folder of unversioned names for the wheels' versioned libraries
    (libcublas.so -> libcublas.so.13, ...) and for the driver's libcuda,
    which the linker of candle's `cuda` feature asks for by those names."""
    lib = os.path.join(os.path.dirname(os.path.dirname(nvcc)), "lib")
    out = os.path.join(OUT, "lib")
    os.makedirs(out, exist_ok=True)
    for f in glob.glob(os.path.join(lib, "lib*.so.*")):
        name = os.path.basename(f).split(".so")[0] + ".so"
        dst = os.path.join(out, name)
        if not os.path.exists(dst):
            os.symlink(f, dst)
    found = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    dst = os.path.join(out, "libcuda.so")
    for line in found.splitlines():
        if "libcuda.so.1 " in line and "=>" in line:
            if not os.path.exists(dst):
                os.symlink(line.split("=>")[1].strip(), dst)
            break
    if not os.path.exists(dst):
        cuda_stub(dst)
    return [lib, out]


def cuda_stub(dst):
    """Without a driver there is no libcuda to link against: a stub with
    the driver API's names (every function of cudarc's bindings), soname
    libcuda.so.1, so the link succeeds and the real library is found at run
    time on a machine with a GPU."""
    lock = open(os.path.join(ROOT, "Cargo.lock")).read()
    version = lock.split('name = "cudarc"\nversion = "')[1].split('"')[0]
    home = os.environ.get("CARGO_HOME", os.path.expanduser("~/.cargo"))
    bindings = glob.glob(os.path.join(home, "registry", "src", "*", f"cudarc-{version}", "src",
                                      "driver", "sys", "mod.rs"))
    if not bindings:
        sys.exit(f"cudarc {version}'s sources are not in the cargo registry: build once first")
    names = sorted(set(re.findall(r"^pub unsafe fn (cu\w+)", open(bindings[0]).read(), re.M)))
    src = dst[:-len(".so")] + "_stub.c"
    with open(src, "w") as f:
        f.writelines(f"int {n}(void) {{ return 999; }}\n" for n in names)
    run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", dst, src])


def runtime_env(**extra):
    """The environment for linking and running candle's `cuda` feature: the
    CUDA libraries from the pip wheels (installed when missing), nvcc (for
    our kernels and candle's) on PATH, unversioned names and libcuda (the
    driver's, or a stub) in target/gpu/lib."""
    nvcc = ensure_nvcc()
    if not glob.glob(os.path.join(os.path.dirname(os.path.dirname(nvcc)), "lib", "libcublas.so*")):
        run([sys.executable, "-m", "pip", "install", "--quiet", RUNTIME])
    env = cuda_env(nvcc, CARGO_TARGET_DIR=os.path.join(ROOT, "target", "cuda"), **extra)
    if os.path.isabs(nvcc):
        dirs = os.pathsep.join(link_dir(nvcc))
        for var in ("LIBRARY_PATH", "LD_LIBRARY_PATH"):
            env[var] = dirs + os.pathsep + env.get(var, "")
    return env


def test_cuda():
    """The `cuda` feature's tests with TESSERA_REQUIRE_GPU=1."""
    env = runtime_env(TESSERA_REQUIRE_GPU="1")
    run(["cargo", "test", "-p", "tessera-kernels", "--features", "cuda", "--", "gpu::"],
        cwd=ROOT, env=env)
    # The real model on the GPU against the CPU reference.
    run(["cargo", "test", "-p", "tessera-model", "--features", "cuda", "--lib", "--",
         "gpu_forward", "--nocapture"], cwd=ROOT, env=env)


def bundle(dest, xz_level="-6"):
    """For a machine with a GPU but no Rust toolchain: the `cuda` feature's
    kernel tests, the model crate's tests and the `tessera` binary (release
    profile; CUDA_COMPUTE_CAP 80 unless set: PTX that the driver compiles
    for newer GPUs), stripped and xz-compressed, in `dest`, with root.txt (where the model
    tests look for models/), commit.txt, scripts/cuda_device_run.sh,
    which runs them there, and scripts/synth_model.py (models it generates
    there). Builds on a machine without a GPU (libcuda is
    then the stub of `cuda_stub`)."""
    env = runtime_env(CUDA_COMPUTE_CAP=os.environ.get("CUDA_COMPUTE_CAP", "80"))
    tests = ["--release", "-p", "tessera-kernels", "-p", "tessera-model",
             "--features", "tessera-kernels/cuda,tessera-model/cuda"]
    # Built in view first (the JSON run below prints nothing while it builds).
    run(["cargo", "test", *tests, "--no-run"], cwd=ROOT, env=env)
    exes = lib_test_binaries(tests, cwd=ROOT, env=env)
    # With candle's baseline: the GPU table puts candle's quantized_llama
    # beside Tessera on the same GPU.
    run(["cargo", "build", "--release", "-p", "tessera", "--features", "cuda,candle-baseline"],
        cwd=ROOT, env=env)
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    for src, name in [(exes["tessera_kernels"], "kernel-tests"), (exes["tessera_model"], "model-tests"),
                      (os.path.join(env["CARGO_TARGET_DIR"], "release", "tessera"), "tessera")]:
        out = os.path.join(dest, name)
        run(["strip", "-o", out, src])
        # The binaries carry candle's PTX as text: xz makes the three about
        # 26 MB instead of 186, under what a lent machine takes in one go
        # (cuda_device_run.sh unpacks them).
        run(["xz", "-T0", xz_level, out])
    with open(os.path.join(dest, "root.txt"), "w") as f:
        f.write(ROOT + "\n")
    # The commit the binaries were built from (-dirty: with uncommitted changes).
    with open(os.path.join(dest, "commit.txt"), "w") as f:
        f.write(run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=ROOT,
                    capture_output=True).stdout)
    # The run script, and the generator of the models it benchmarks where
    # no model file travels (SYNTH=...).
    for script in ("cuda_device_run.sh", "synth_model.py"):
        shutil.copy(os.path.join(ROOT, "scripts", script), dest)
    print(f"bundle: {dest}")


LENT_BYTES = 64 * 1024 * 1024


def lent(dest):
    """The folder one call of a lent GPU carries (`scripts/cuda_lent_call.sh`
    runs it there): `dest`/bundle (this commit's bundle; the kernel tests
    left out when the folder would not fit beside llama-bench),
    `dest`/synth (llama.cpp's gguf-py without its tests and scripts, and
    SmolLM2's tokenizer for the generated models), `dest`/llama-bench.xz
    (scripts/build_llama_cuda.sh's, built when missing: about 45 minutes
    on 2 cores) and the call script. Says what travels against the 64 MiB
    a call takes (the folder and the repository's tracked files)."""
    src = os.path.join(ROOT, "target", "llama-server", "llama_cpp_python-0.3.36", "vendor",
                       "llama.cpp", "gguf-py")
    if not os.path.isdir(src):
        run(["bash", os.path.join(ROOT, "scripts", "build_llama_tools.sh")], cwd=ROOT)
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(os.path.join(dest, "synth"))
    bundle(os.path.join(dest, "bundle"), "-9e")
    shutil.copytree(src, os.path.join(dest, "synth", "gguf-py"),
                    ignore=shutil.ignore_patterns("tests", "scripts", "examples", "__pycache__"))
    run([sys.executable, os.path.join(ROOT, "scripts", "synth_model.py"), "--dump-tokenizer",
         os.path.join(dest, "synth", "tok.json.gz")], cwd=ROOT)
    bench = os.path.join(ROOT, "target", "llama-cuda", "build", "bin", "llama-bench")
    if not os.path.exists(bench):
        run(["bash", os.path.join(ROOT, "scripts", "build_llama_cuda.sh")], cwd=ROOT)
    stripped = os.path.join(dest, "llama-bench")
    run(["strip", "-o", stripped, bench])
    run(["xz", "-T0", "-9e", stripped])
    shutil.copy(os.path.join(ROOT, "scripts", "cuda_lent_call.sh"), dest)

    def size(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)

    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             text=True).stdout.split("\0")
    tree = sum(os.path.getsize(os.path.join(ROOT, f)) for f in tracked
               if f and os.path.isfile(os.path.join(ROOT, f)))
    if size(dest) + tree > LENT_BYTES:
        os.remove(os.path.join(dest, "bundle", "kernel-tests.xz"))
        print("lent: the kernel tests left out (the folder would pass 64 MiB with them)")
    total = size(dest) + tree
    print(f"lent: {dest} ({size(dest) / 2**20:.1f} MiB) and the tracked tree "
          f"({tree / 2**20:.1f} MiB): {total / 2**20:.1f} MiB of the 64 a call takes")
    if total > LENT_BYTES:
        sys.exit("lent: over what one call takes")


def cuda_env(nvcc, **extra):
    """The environment for builds with candle's `cuda` feature: nvcc on
    PATH, CUDA_ROOT beside it."""
    env = dict(os.environ, **extra)
    if os.path.isabs(nvcc):
        bindir = os.path.dirname(nvcc)
        env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
        env.setdefault("CUDA_ROOT", os.path.dirname(bindir))
    return env


def features(cargo_tree_args):
    """Each package's feature sets in a `cargo tree` resolution."""
    out = run(["cargo", "tree", *cargo_tree_args, "-e", "normal,build,dev", "--prefix", "none",
               "-f", "{p} [{f}]"], cwd=ROOT, capture_output=True).stdout
    sets = {}
    for line in out.splitlines():
        if "[" not in line:
            continue
        pkg = line.split(" [")[0].split(" (")[0]
        sets.setdefault(pkg, set()).add(line[line.index("[") + 1:line.rindex("]")])
    return sets


def check_feature_pins():
    """The kernel-emu build resolves features over tessera-kernels alone;
    where a dependency's features differ from the workspace's, that
    dependency and everything above it (candle included) is compiled again
    (4 min 35 s on two cores instead of 1 min 52 s after a clean workspace
    test build, 2026-12-07). crates/kernels/Cargo.toml pins
    the workspace's features; this fails, naming the difference, when a
    dependency change has made them drift."""
    ws = features(["--workspace"])
    emu = features(["-p", "tessera-kernels", "--features", "kernel-emu"])
    drift = [f"  {p}: the workspace has [{' | '.join(sorted(ws[p]))}], "
             f"tessera-kernels alone [{' | '.join(sorted(f))}]"
             for p, f in sorted(emu.items())
             if p in ws and f != ws[p] and not p.startswith("tessera-kernels ")]
    if drift:
        sys.exit("check-gpu: the kernel-emu build would compile these dependencies again; pin the "
                 "workspace's features in crates/kernels/Cargo.toml's dev- (or, for proc-macro "
                 "dependencies, build-) dependencies:\n" + "\n".join(drift))


def check_launchers():
    """The CUDA launchers and GPU tests type-checked against
    candle's `cuda` feature, in target/cuda-check; no GPU needed, and no
    kernel compiled (scripts/nvcc_check.sh stands in for nvcc's compiles).
    CUDA_COMPUTE_CAP is set since there is no GPU to ask."""
    nvcc = ensure_nvcc()
    # nvcc_check.sh writes empty kernels where candle's build script would
    # compile its CUDA files (a type-check reads none; ours went through the
    # real nvcc and ptxas above), in a target folder of its own so that no
    # build that runs ever holds them.
    env = cuda_env(nvcc, CUDA_COMPUTE_CAP=os.environ.get("CUDA_COMPUTE_CAP", "80"),
                   CARGO_TARGET_DIR=os.path.join(ROOT, "target", "cuda-check"),
                   NVCC=os.path.join(ROOT, "scripts", "nvcc_check.sh"),
                   TESSERA_REAL_NVCC=os.path.abspath(nvcc) if os.path.isabs(nvcc) else shutil.which(nvcc) or nvcc)
    # The kernels' and the model's tests, and the model, engine and CLI with
    # `--device cuda` (candle-nn's CUDA ops too), in one invocation: one
    # per package resolves features apart and checks most of the
    # dependencies again (three took 18 minutes in a CI run; one, 11 cold
    # on a 2-core host about as fast).
    run(["cargo", "check", "-p", "tessera", "-p", "tessera-kernels", "-p", "tessera-model",
         "--features", "tessera/cuda,tessera-kernels/cuda,tessera-model/cuda", "--bins",
         "--tests"], cwd=ROOT, env=env)


APPLE = "aarch64-apple-darwin"


def check_metal_launchers():
    """The `metal` feature's Rust code (launchers, GPU tests) through clippy
    for an Apple target: no Mac needed, nothing is linked."""
    installed = subprocess.run(["rustup", "target", "list", "--installed"], cwd=ROOT,
                               capture_output=True, text=True).stdout.split()
    if APPLE not in installed:
        run(["rustup", "target", "add", APPLE], cwd=ROOT)
    env = dict(os.environ, CARGO_TARGET_DIR=os.path.join(ROOT, "target", "metal"))
    run(["cargo", "clippy", "--target", APPLE, "-p", "tessera-kernels", "-p", "tessera-model",
         "--features", "tessera-kernels/metal,tessera-model/metal", "--tests", "--",
         "-D", "warnings"], cwd=ROOT, env=env)


def test_metal():
    """The `metal` feature's tests with TESSERA_REQUIRE_GPU=1, on a Mac."""
    env = dict(os.environ, TESSERA_REQUIRE_GPU="1")
    run(["cargo", "test", "-p", "tessera-kernels", "--features", "metal", "--", "gpu::"],
        cwd=ROOT, env=env)
    run(["cargo", "test", "-p", "tessera-model", "--features", "metal", "--lib", "--",
         "gpu_forward", "--nocapture"], cwd=ROOT, env=env)


def main():
    if sys.argv[1:] == ["test-cuda"]:
        return test_cuda()
    if sys.argv[1:] == ["test-metal"]:
        return test_metal()
    if sys.argv[1:2] == ["bundle"]:
        return bundle(os.path.abspath(sys.argv[2] if len(sys.argv) > 2
                                      else os.path.join(ROOT, "target", "cuda-bundle")))
    if sys.argv[1:2] == ["lent"]:
        return lent(os.path.abspath(sys.argv[2] if len(sys.argv) > 2
                                    else os.path.join(ROOT, "target", "lent")))
    n_cu = check_cuda()
    n_metal = check_metal()
    check_feature_pins()
    run(["cargo", "test", "-p", "tessera-kernels", "--features", "kernel-emu", "--", "gpu::"], cwd=ROOT)
    check_launchers()
    check_metal_launchers()
    print(f"check-gpu: {n_cu} CUDA sources through ptxas for sm_{' and sm_'.join(ARCHS)}, "
          f"{n_metal} Metal sources through clang -fsyntax-only, kernel-emu tests passed, "
          "CUDA and Metal launchers type-checked")


if __name__ == "__main__":
    main()
