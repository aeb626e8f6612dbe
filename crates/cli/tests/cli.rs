//! The `tessera` binary end to end: the real default model (fetched by
//! `just model`), tiny generated models, and bad input of every kind, which
//! must give a clear message and a non-zero exit, never a panic.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use tessera_model::testing::{write_tiny_gguf, write_tiny_model, TinySpec};

fn model() -> String {
    let p =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} is missing: run `just model`", p.display());
    p.to_string_lossy().into_owned()
}

fn tessera(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(args)
        // Errors are for people even where backtraces are on.
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("binary runs");
    if let Some(input) = stdin {
        child.stdin.take().unwrap().write_all(input).unwrap();
    }
    drop(child.stdin.take());
    child.wait_with_output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Fails with a message containing `needle`, a non-zero exit (1; 2 for
/// command-line usage errors), no panic.
fn fails_with(out: &Output, needle: &str) {
    let err = text(&out.stderr);
    assert!(
        matches!(out.status.code(), Some(1 | 2)),
        "exit {:?}, stderr: {err}",
        out.status.code()
    );
    assert!(err.contains(needle), "expected {needle:?} in: {err}");
    assert!(!err.contains("panicked"), "panicked: {err}");
    // One `error: …` line naming the problem, no backtrace.
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(!err.contains("backtrace") && !err.contains(".rs:"), "{err}");
}

fn scratch(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("tessera-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap();
    p
}

#[test]
fn run_chat_answers_paris_and_prints_stats() {
    let m = model();
    let out = tessera(
        &[
            "run",
            "--model",
            &m,
            "--prompt",
            "What is the capital of France?",
            "--chat",
            "--temperature",
            "0",
        ],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("Paris"), "{}", text(&out.stdout));
    let err = text(&out.stderr);
    let lines: Vec<&str> = err.lines().collect();
    let prompt_line = lines
        .iter()
        .find(|l| l.starts_with("prompt: "))
        .expect("prompt stats line");
    assert!(
        prompt_line.contains("tokens | cached: 0 | new: ")
            && prompt_line.contains("tok/s | TTFT: "),
        "{prompt_line}"
    );
    let out_line = lines
        .iter()
        .find(|l| l.starts_with("output: "))
        .expect("output stats line");
    assert!(
        out_line.contains("tokens |") && out_line.contains("tok/s | total: "),
        "{out_line}"
    );
}

#[test]
fn run_json_has_the_documented_shape() {
    let m = model();
    let out = tessera(
        &[
            "run",
            "--model",
            &m,
            "--prompt",
            "Count: one, two,",
            "--max-tokens",
            "5",
            "--temperature",
            "0",
            "--json",
        ],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    assert!(v["text"].is_string());
    assert_eq!(v["tokens"].as_array().unwrap().len(), 5);
    assert_eq!(v["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["usage"]["cached_tokens"], 0);
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 3);
    for k in ["ttft_ms", "prefill_tok_s", "decode_tok_s"] {
        assert!(v["timings"][k].as_f64().unwrap() > 0.0, "{k}");
    }
    // Same seed, same tokens, also when sampling.
    let sample = |seed: &str| {
        let o = tessera(
            &[
                "run",
                "--model",
                &m,
                "--prompt",
                "Once upon a time",
                "--max-tokens",
                "12",
                "--seed",
                seed,
                "--json",
            ],
            None,
        );
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["tokens"].clone()
    };
    assert_eq!(sample("7"), sample("7"));
}

#[test]
fn tokenize_and_detokenize_round_trip() {
    let m = model();
    let s = "Hello <|im_start|> wörld 🦀\n";
    let out = tessera(&["tokenize", "--model", &m], Some(s.as_bytes()));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let ids: Vec<u32> = serde_json::from_slice(&out.stdout).unwrap();
    assert!(!ids.contains(&1), "control token parsed without --special");
    let back = tessera(&["detokenize", "--model", &m], Some(&out.stdout));
    assert_eq!(text(&back.stdout), s);
    let sp = tessera(
        &[
            "tokenize",
            "--model",
            &m,
            "--special",
            "--text",
            "<|im_start|>user",
        ],
        None,
    );
    let ids: Vec<u32> = serde_json::from_slice(&sp.stdout).unwrap();
    assert_eq!(ids[0], 1);
}

#[test]
fn inspect_reports_geometry_and_kv_cost() {
    let out = tessera(&["inspect", "--model", &model()], None);
    assert!(out.status.success());
    let s = text(&out.stdout);
    for needle in [
        "architecture:   llama",
        "layers:         30",
        "9 query, 3 KV, head_dim 64",
        "Q4_1 ×210",
        "23040 B with a f16 cache",
        "12240 B with a q8_0 cache",
        "6480 B with a q4_0 cache",
        "context length: 8192",
        "forward:        CPU forward (",
    ] {
        assert!(s.contains(needle), "{needle:?} missing in:\n{s}");
    }
}

/// `bench --scenario roofline --model`: the decode's weights a step, each
/// part's share and the whole one beside the reads around the bursts.
#[test]
fn roofline_with_a_model_gives_the_decode_share() {
    let out = tessera(
        &[
            "bench",
            "--scenario",
            "roofline",
            "--model",
            &model(),
            "--runs",
            "1",
            "--json",
        ],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    // Every matrix a step reads: 30 layers of q, o (576×576), k, v
    // (192×576), gate, up (1536×576) and down (576×1536) in Q4_1 (20 bytes
    // per 32 values), and the tied head (49,152×576 in Q8_0, 34 bytes).
    let layers = 30 * 576 * (576 + 192 + 192 + 576 + 3 * 1536) / 32 * 20;
    assert_eq!(v["weight_bytes"], layers + 49_152 * 576 / 32 * 34, "{v}");
    assert_eq!(v["bursts"], 16, "{v}");
    let share = v["tessera"].as_f64().unwrap();
    assert!(share.is_finite() && share > 0.0, "{v}");
    let lo = v["read_gb_s_min"].as_f64().unwrap();
    assert!(
        lo > 0.0 && lo <= v["read_gb_s_max"].as_f64().unwrap(),
        "{v}"
    );
    let parts = v["part_shares"].as_object().unwrap();
    let names: Vec<&str> = parts.keys().map(String::as_str).collect();
    assert_eq!(names, ["qkv", "output", "gate_up", "down", "head"], "{v}");
    assert!(parts.values().all(|s| s.as_f64().unwrap() > 0.0), "{v}");
}

#[test]
fn tiny_safetensors_model_runs() {
    let dir = scratch("tiny");
    write_tiny_model(&dir, TinySpec::default()).unwrap();
    let out = tessera(
        &[
            "run",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            "the",
            "--max-tokens",
            "4",
            "--temperature",
            "0",
            "--json",
        ],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["tokens"].as_array().unwrap().len(), 4);
}

#[test]
fn device_flag_picks_the_cpu_and_names_what_a_gpu_needs() {
    let dir = scratch("device");
    write_tiny_model(&dir, TinySpec::default()).unwrap();
    let m = dir.to_str().unwrap();
    let run = |device: &str| {
        tessera(
            &[
                "run",
                "--model",
                m,
                "--prompt",
                "the",
                "--max-tokens",
                "4",
                "--temperature",
                "0",
                "--json",
                "--device",
                device,
            ],
            None,
        )
    };
    let (auto, cpu) = (run("auto"), run("cpu"));
    assert!(cpu.status.success(), "{}", text(&cpu.stderr));
    assert!(auto.status.success(), "{}", text(&auto.stderr));
    let tokens = |o: &Output| {
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["tokens"].clone()
    };
    #[cfg(not(feature = "cuda"))]
    {
        // Without a GPU build, auto is the CPU, and asking for a GPU says
        // what is missing.
        assert_eq!(tokens(&auto), tokens(&cpu));
        fails_with(
            &run("cuda"),
            "no CUDA support; rebuild with `--features cuda`",
        );
        fails_with(&run("cuda:1"), "no CUDA support");
    }
    assert_eq!(tokens(&cpu).as_array().unwrap().len(), 4);
    #[cfg(not(feature = "metal"))]
    fails_with(&run("metal"), "no Metal support");
    fails_with(
        &run("gpu"),
        "is not a device (auto, cpu, cuda, cuda:N, metal)",
    );
}

/// The kernel settings' flags (instruction sets, the reference forward,
/// the fixed team) and the engine's step settings give the same greedy
/// tokens on the real model; a set that does not exist is named.
#[test]
fn tuning_flags_keep_the_tokens() {
    let m = model();
    let run = |flags: &[&str]| {
        let mut args = vec![
            "run",
            "--model",
            &m,
            "--prompt",
            // Longer than 16 tokens, so that the prompt takes AMX's tiles
            // where the CPU has them.
            "Rome, Berlin, Madrid, Vienna and Lisbon are capitals in Europe. The capital of France is",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
            "--json",
        ];
        args.extend(flags);
        let out = tessera(&args, None);
        assert!(out.status.success(), "{flags:?}: {}", text(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["tokens"].clone()
    };
    let want = run(&[]);
    for flags in [
        &["--isa", "portable"][..],
        &["--isa", "avx2", "--no-huge-pages"],
        &["--isa", "avx512"],
        &["--fixed-team"],
        // Prompt chunks of 3 tokens: the logits are the same bits.
        &[
            "--prefill-chunk",
            "3",
            "--max-running",
            "2",
            "--defrag-threshold",
            "0",
        ],
        &["--forward", "reference", "--activations", "f32"],
    ] {
        // The reference forward runs f32 activations: compare like with like.
        let base = if flags.contains(&"reference") {
            run(&["--activations", "f32"])
        } else {
            want.clone()
        };
        assert_eq!(run(flags), base, "{flags:?}");
    }
    fails_with(
        &tessera(&["--isa", "sse", "inspect", "--model", &m], None),
        "expected portable, avx2, avxvnni, avx512 or amx",
    );
}

#[test]
fn bad_input_gives_clear_errors() {
    let dir = scratch("bad");
    // The engine's settings are checked when parsed.
    for (flag, value, says) in [
        (
            "--prefill-chunk",
            "0",
            "expected a whole number of at least 1",
        ),
        (
            "--max-running",
            "0.5",
            "expected a whole number of at least 1",
        ),
        ("--defrag-threshold", "1.5", "expected a number from 0 to 1"),
        (
            "--background-chunk",
            "x",
            "expected a whole number of at least 1",
        ),
    ] {
        fails_with(
            &tessera(
                &["run", "--model", &model(), "--prompt", "x", flag, value],
                None,
            ),
            says,
        );
    }
    fails_with(
        &tessera(
            &[
                "run",
                "--model",
                &model(),
                "--prompt",
                "x",
                "--grp-attn-n",
                "4",
                "--grp-attn-w",
                "10",
            ],
            None,
        ),
        "grp_attn_w (10) must be a positive multiple of grp_attn_n (4)",
    );
    fails_with(
        &tessera(
            &[
                "run",
                "--model",
                &model(),
                "--prompt",
                "x",
                "--cache-dtype",
                "q5_1",
            ],
            None,
        ),
        "is not a cache dtype (f16, bf16, f32, q8_0, q4_0)",
    );
    fails_with(
        &tessera(
            &["run", "--model", "/nonexistent/model.gguf", "--prompt", "x"],
            None,
        ),
        "does not exist",
    );
    let junk = dir.join("junk.gguf");
    std::fs::write(&junk, b"definitely not a model").unwrap();
    fails_with(
        &tessera(&["inspect", "--model", junk.to_str().unwrap()], None),
        "is not a GGUF file",
    );
    // The real model cut to 3 MB.
    let mut head = vec![0u8; 3 << 20];
    std::io::Read::read_exact(&mut std::fs::File::open(model()).unwrap(), &mut head).unwrap();
    let cut = dir.join("cut.gguf");
    std::fs::write(&cut, &head).unwrap();
    fails_with(
        &tessera(
            &["run", "--model", cut.to_str().unwrap(), "--prompt", "x"],
            None,
        ),
        "truncated",
    );
    // A metadata string whose length field is huge: candle refuses it with
    // a backtrace attached, which the message leaves out.
    let mut damaged = head[..1 << 20].to_vec();
    damaged[24..32].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let damaged_path = dir.join("damaged.gguf");
    std::fs::write(&damaged_path, &damaged).unwrap();
    fails_with(
        &tessera(
            &["inspect", "--model", damaged_path.to_str().unwrap()],
            None,
        ),
        "damaged.gguf is a damaged or truncated GGUF file",
    );
    let hf = dir.join("hf");
    write_tiny_model(&hf, TinySpec::default()).unwrap();
    let gpt2 = dir.join("gpt2.gguf");
    write_tiny_gguf(&hf, &gpt2, candle_core_dtype(), "gpt2").unwrap();
    // Running it is refused; inspecting it describes the file and why.
    fails_with(
        &tessera(
            &["run", "--model", gpt2.to_str().unwrap(), "--prompt", "hi"],
            None,
        ),
        "unsupported architecture \"gpt2\"",
    );
    let out = tessera(&["inspect", "--model", gpt2.to_str().unwrap()], None);
    assert!(out.status.success(), "{}", text_of(&out));
    let shown = text(&out.stdout);
    assert!(shown.contains("general.architecture = \"gpt2\""), "{shown}");
    assert!(
        shown.contains("runs here:      no") && shown.contains("unsupported architecture"),
        "{shown}"
    );
    // A family Tessera knows it lacks: the message names the missing part.
    let moe = dir.join("qwen3moe.gguf");
    write_tiny_gguf(&hf, &moe, candle_core_dtype(), "qwen3moe").unwrap();
    fails_with(
        &tessera(
            &["run", "--model", moe.to_str().unwrap(), "--prompt", "hi"],
            None,
        ),
        "it needs mixture-of-experts feed-forward layers",
    );
    // The new families' switches, as inspect shows them.
    for (arch, want) in [
        (
            "granite",
            "block outputs × 0.5, attention scores × 0.3, logits ÷ 2.5",
        ),
        ("smollm3", "no RoPE on every 4th layer (0 of 2)"),
        ("olmo2", "q/k norms true, post-norms true"),
    ] {
        let path = dir.join(format!("{arch}.gguf"));
        write_tiny_gguf(&hf, &path, candle_core_dtype(), arch).unwrap();
        let out = tessera(&["inspect", "--model", path.to_str().unwrap()], None);
        assert!(out.status.success(), "{}", text_of(&out));
        let shown = text(&out.stdout);
        assert!(
            shown.contains(&format!("architecture:   {arch}")) && shown.contains(want),
            "{arch}: {shown}"
        );
    }
    let long = "word ".repeat(50);
    fails_with(
        &tessera(
            &["run", "--model", &model(), "--prompt", &long, "--ctx", "16"],
            None,
        ),
        "but the context holds 16",
    );
    fails_with(
        &tessera(
            &["tokenize", "--model", &model()],
            Some(&[0x66, 0xff, 0xfe]),
        ),
        "not valid UTF-8",
    );
    fails_with(
        &tessera(&["detokenize", "--model", &model()], Some(b"[1, 99999999]")),
        "outside the vocabulary",
    );
    fails_with(
        &tessera(&["detokenize", "--model", &model()], Some(b"not json")),
        "JSON array",
    );
    fails_with(
        &tessera(
            &[
                "run",
                "--model",
                &model(),
                "--prompt",
                "x",
                "--kv-memory",
                "1KiB",
            ],
            None,
        ),
        "holds less than one block of 16 tokens (368640 bytes) (raise --kv-memory)",
    );
    fails_with(
        &tessera(
            &[
                "run",
                "--model",
                &model(),
                "--prompt",
                "x",
                "--kv-memory",
                "12 parsecs",
            ],
            None,
        ),
        "unknown size unit",
    );
}

fn candle_core_dtype() -> candle_core::quantized::GgmlDType {
    candle_core::quantized::GgmlDType::F32
}

/// The JSON objects a `--json` run printed, one per line.
fn json_lines(out: &Output) -> Vec<serde_json::Value> {
    assert!(out.status.success(), "{}", text(&out.stderr));
    text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON object per line"))
        .collect()
}

#[test]
fn chat_script_saves_and_a_new_process_resumes_from_cache() {
    let m = model();
    let dir = scratch("chat-save");
    let session = dir.join("trip.tkv");
    let first = dir.join("first.jsonl");
    std::fs::write(
        &first,
        format!(
            "{}\n{}\n{}\n{}\n",
            serde_json::json!({"system": "You are a concise assistant."}),
            serde_json::json!({"user": "Name a lake in the Alps."}),
            serde_json::json!({"user": "And a mountain hut near it?"}),
            serde_json::json!({"cmd": format!("/save {}", session.display())}),
        ),
    )
    .unwrap();
    let args = |script: &Path| {
        vec![
            "chat".to_string(),
            "--model".into(),
            m.clone(),
            "--temperature".into(),
            "0".into(),
            "--max-tokens".into(),
            "16".into(),
            "--json".into(),
            "--script".into(),
            script.display().to_string(),
        ]
    };
    let a: Vec<String> = args(&first);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let turns = json_lines(&tessera(&a, None));
    assert_eq!(turns.len(), 2);
    for key in [
        "turn",
        "text",
        "prompt_tokens",
        "cached_tokens",
        "new_tokens",
        "completion_tokens",
        "ttft_ms",
        "prefill_tok_s",
        "decode_tok_s",
    ] {
        assert!(turns[1].get(key).is_some(), "missing {key}: {}", turns[1]);
    }
    assert!(turns[1]["cached_tokens"].as_u64().unwrap() > 0);
    assert!(session.exists());

    let second = dir.join("second.jsonl");
    std::fs::write(
        &second,
        format!(
            "{}\n{}\n",
            serde_json::json!({"cmd": format!("/load {}", session.display())}),
            serde_json::json!({"user": "How long is the walk?"}),
        ),
    )
    .unwrap();
    let b: Vec<String> = args(&second);
    let b: Vec<&str> = b.iter().map(String::as_str).collect();
    let resumed = json_lines(&tessera(&b, None));
    let t = &resumed[0];
    let (prompt, cached) = (
        t["prompt_tokens"].as_u64().unwrap(),
        t["cached_tokens"].as_u64().unwrap(),
    );
    assert!(
        cached * 10 >= prompt * 7,
        "the loaded history is served from cache: {cached} of {prompt}"
    );

    // A damaged file is refused with the reason (a script stops there;
    // interactively the conversation goes on).
    std::fs::write(&session, b"TSRKV\0\0\0garbage").unwrap();
    let out = tessera(&b, None);
    fails_with(&out, "truncated");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn run_n_prints_independent_samples() {
    let m = model();
    let out = tessera(
        &[
            "run",
            "--model",
            &m,
            "--prompt",
            "Write one sentence about the sea.",
            "--chat",
            "--n",
            "3",
            "--max-tokens",
            "12",
            "--json",
        ],
        None,
    );
    let samples = json_lines(&out);
    assert_eq!(samples.len(), 3);
    let indices: Vec<u64> = samples
        .iter()
        .map(|s| s["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indices, vec![0, 1, 2]);
    assert!(samples
        .iter()
        .all(|s| s["usage"]["prompt_tokens"] == samples[0]["usage"]["prompt_tokens"]));
}

/// `tessera perplexity` on the shipped text: a sensible value, the same on
/// a second run, the chunk count it was asked for; a text too short for
/// its context and a non-UTF-8 file are refused clearly.
#[test]
fn perplexity_of_the_default_model_on_the_shipped_text() {
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/pride-and-prejudice.txt");
    let text = text.to_string_lossy().into_owned();
    let m = model();
    let args = [
        "perplexity",
        "--model",
        &m,
        "--file",
        &text,
        "--ctx",
        "128",
        "--chunks",
        "3",
        "--json",
    ];
    let runs: Vec<serde_json::Value> = (0..2)
        .map(|_| {
            let out = tessera(&args, None);
            assert!(out.status.success(), "{}", text_of(&out));
            json_lines(&out).pop().unwrap()
        })
        .collect();
    let v = &runs[0];
    assert_eq!(
        (v["chunks"].as_u64(), v["tokens_scored"].as_u64()),
        (Some(3), Some(3 * 63))
    );
    let ppl = v["ppl"].as_f64().unwrap();
    assert!((3.0..100.0).contains(&ppl), "perplexity {ppl}");
    assert_eq!(runs[1]["ppl"], v["ppl"], "deterministic");
    let dir = scratch("ppl");
    // A saved run compared with itself: no divergence, the same top-1
    // everywhere; with int8 activations, a small divergence; another
    // --ctx is refused.
    let base = dir.join("base.tkld").to_string_lossy().into_owned();
    let mut save = args.to_vec();
    save.extend(["--activations", "f32", "--save-logits", &base]);
    assert!(tessera(&save, None).status.success());
    let kl = |extra: &[&str]| {
        let mut a = args.to_vec();
        a.extend(["--kl-divergence", &base]);
        a.extend(extra);
        let out = tessera(&a, None);
        assert!(out.status.success(), "{}", text_of(&out));
        json_lines(&out).pop().unwrap()["kl_divergence"].clone()
    };
    let same = kl(&["--activations", "f32"]);
    assert_eq!(same["same_top1"].as_f64(), Some(1.0), "{same}");
    assert!(same["kl_mean"].as_f64().unwrap() < 1e-9, "{same}");
    let int8 = kl(&["--activations", "int8"]);
    let d = int8["kl_mean"].as_f64().unwrap();
    assert!(d > 1e-6 && d < 0.1, "{int8}");
    let mut other = args.to_vec();
    other[6] = "96";
    other.extend(["--kl-divergence", &base]);
    fails_with(&tessera(&other, None), "was saved with --ctx 128");
    let short = dir.join("short.txt");
    std::fs::write(&short, "Too short to score.").unwrap();
    let s = short.to_string_lossy().into_owned();
    fails_with(
        &tessera(&["perplexity", "--model", &m, "--file", &s], None),
        "needs at least",
    );
    std::fs::write(&short, [0xff, 0xfe, 0x00]).unwrap();
    fails_with(
        &tessera(&["perplexity", "--model", &m, "--file", &s], None),
        "not UTF-8",
    );
}

fn text_of(out: &Output) -> String {
    format!("{}{}", text(&out.stdout), text(&out.stderr))
}

/// Sends one HTTP/1.1 POST on loopback and reads the answer to its end.
fn http_post(addr: &str, path: &str, key: &str, body: &str) -> String {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// `tessera serve` on a free port with `args`, once it says it is ready:
/// the child, its stderr (still being written), its address and the log
/// so far.
fn serve_child(
    args: &[&str],
) -> (
    std::process::Child,
    std::io::BufReader<std::process::ChildStderr>,
    String,
    String,
) {
    use std::io::BufRead;
    let mut child = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["serve", "--port", "0"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let (mut addr, mut log) = (String::new(), String::new());
    loop {
        let mut line = String::new();
        assert!(err.read_line(&mut line).unwrap() > 0, "serve exited: {log}");
        log.push_str(&line);
        if let Some(rest) = line.split("http://").nth(1) {
            addr = rest.split_whitespace().next().unwrap().to_string();
        }
        if line.contains("ready") {
            break;
        }
    }
    (child, err, addr, log)
}

/// [`serve_child`] of model `m` with the keys `k1` and `k2`, the cache
/// directory `cache`, and `extra`.
fn serve_two_keys(
    m: &str,
    cache: &str,
    extra: &[&str],
) -> (
    std::process::Child,
    std::io::BufReader<std::process::ChildStderr>,
    String,
    String,
) {
    let mut args = vec![
        "--model",
        m,
        "--api-key",
        "k1",
        "--api-key",
        "k2",
        "--cache-dir",
        cache,
    ];
    args.extend_from_slice(extra);
    serve_child(&args)
}

/// `tessera serve` with two keys and a cache directory: SIGTERM with a
/// stream that would run forever ends it after `--shutdown-timeout` with
/// an error event, the server exits on its own and writes the prefix cache
/// of both tenants, and a restarted server serves each tenant's prompt
/// from the cache (and only its own).
#[test]
fn serve_stops_after_its_shutdown_timeout_and_keeps_every_tenants_cache() {
    let dir = scratch("shutdown");
    write_tiny_model(&dir.join("m"), TinySpec::default()).unwrap();
    let m = dir.join("m").to_string_lossy().into_owned();
    let cache = dir.join("cache").to_string_lossy().into_owned();
    let start = || serve_two_keys(&m, &cache, &["--shutdown-timeout", "1"]);
    let (mut child, mut err, addr, _) = start();
    let cached = |addr: &str, key: &str, prompt: &str| -> u64 {
        let body = format!(r#"{{"prompt": "{prompt}", "max_tokens": 1}}"#);
        let out = http_post(addr, "/v1/completions", key, &body);
        let json = &out[out.find("\r\n\r\n").unwrap() + 4..];
        let v: serde_json::Value = serde_json::from_str(json).unwrap_or_else(|_| panic!("{out}"));
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    let (p1, p2) = ("the cat sat on the mat and", "a dog ran in the park then");
    assert_eq!(cached(&addr, "k1", p1), 0);
    assert_eq!(cached(&addr, "k2", p2), 0);
    // A stream that would not end: context shifts, no end of generation.
    let a2 = addr.clone();
    let streaming = std::thread::spawn(move || {
        let body = r#"{"prompt": "the", "max_tokens": 100000000, "n_keep": 2, "ignore_eos": true, "stream": true}"#;
        http_post(&a2, "/v1/completions", "k1", body)
    });
    std::thread::sleep(std::time::Duration::from_millis(500));
    let t = std::time::Instant::now();
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = child.wait().unwrap();
    let waited = t.elapsed();
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut err, &mut rest);
    assert!(status.success(), "{status:?}: {rest}");
    assert!(
        rest.contains("shutdown timeout") || rest.contains("ending the requests"),
        "{rest}"
    );
    assert!(rest.contains("prefix cache written"), "{rest}");
    let out = streaming.join().unwrap();
    assert!(
        out.contains("shutting down"),
        "the stream ends with an error event: {}",
        &out[out.len().saturating_sub(400)..]
    );
    assert!(waited < std::time::Duration::from_secs(60), "{waited:?}");
    // The restart restores both tenants' cached prompts, each its own.
    let (mut child, _err, addr, log) = start();
    assert!(log.contains("cached tokens restored"), "{log}");
    assert_eq!(cached(&addr, "k2", p1), 0, "k2 sees nothing of k1's");
    assert!(cached(&addr, "k1", p1) > 0, "k1's prompt after the restart");
    assert!(cached(&addr, "k2", p2) > 0, "k2's prompt after the restart");
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(dir);
}

/// `--chat-template-file` replaces the file's template for `--chat`
/// prompts (here one that renders the user's text alone); a missing file
/// is a clear error.
#[test]
fn chat_template_file_replaces_the_files_template() {
    let m = model();
    let dir = scratch("template");
    let t = dir.join("plain.jinja");
    std::fs::write(&t, "{% for m in messages %}{{ m.content }}{% endfor %}").unwrap();
    let prompt_tokens = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "--model",
            &m,
            "--prompt",
            "Hello there",
            "--chat",
            "--max-tokens",
            "1",
            "--json",
        ];
        args.extend_from_slice(extra);
        let out = tessera(&args, None);
        assert!(out.status.success(), "{}", text(&out.stderr));
        json_lines(&out)[0]["usage"]["prompt_tokens"]
            .as_u64()
            .unwrap()
    };
    let own = prompt_tokens(&[]);
    let plain = prompt_tokens(&["--chat-template-file", t.to_str().unwrap()]);
    // "Hello there" alone, against SmolLM2's system and turn markers.
    assert_eq!(plain, 2, "{own} {plain}");
    assert!(own > 10);
    let missing = dir.join("missing.jinja");
    fails_with(
        &tessera(
            &[
                "run",
                "--model",
                &m,
                "--prompt",
                "hi",
                "--chat-template-file",
                missing.to_str().unwrap(),
            ],
            None,
        ),
        "--chat-template-file",
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// `tessera serve --cache-dir` on a pool too small for its prompts: the
/// blocks eviction frees go to the disk tier as they go, so a server
/// killed outright (SIGKILL: no shutdown, no cache file) restarts with
/// them, and a prompt the pool lost comes back from disk (`cache_disk_n`,
/// the same greedy text), for its own tenant only.
#[test]
fn a_killed_server_restarts_with_its_disk_tier() {
    let dir = scratch("tier-kill");
    write_tiny_model(&dir.join("m"), TinySpec::default()).unwrap();
    let m = dir.join("m").to_string_lossy().into_owned();
    let cache = dir.join("cache").to_string_lossy().into_owned();
    let start = || {
        // 16 blocks of 16 tokens (4 KiB each for this model in f16).
        let (child, _, addr, _) = serve_two_keys(&m, &cache, &["--kv-memory", "64KiB"]);
        (child, addr)
    };
    let ask = |addr: &str, key: &str, prompt: &str| -> serde_json::Value {
        let body = format!(
            r#"{{"prompt": "{prompt}", "max_tokens": 4, "temperature": 0, "ignore_eos": true}}"#
        );
        let out = http_post(addr, "/v1/completions", key, &body);
        serde_json::from_str(&out[out.find("\r\n\r\n").unwrap() + 4..])
            .unwrap_or_else(|_| panic!("{out}"))
    };
    let prompts: Vec<String> = ["cat", "dog", "owl"]
        .iter()
        .map(|w| format!("the {w} sat on the mat and looked at the park ").repeat(4))
        .collect();
    let (mut child, addr) = start();
    let first = ask(&addr, "k1", &prompts[0]);
    for p in &prompts[1..] {
        ask(&addr, "k1", p);
    }
    // The pool lost the first prompt; the tier has it.
    let again = ask(&addr, "k1", &prompts[0]);
    assert!(
        again["timings"]["cache_disk_n"].as_u64().unwrap() > 0,
        "{again}"
    );
    assert_eq!(again["choices"][0]["text"], first["choices"][0]["text"]);
    for p in &prompts[1..] {
        ask(&addr, "k1", p);
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        !dir.join("cache").join("prefix-cache.tkv").exists(),
        "killed: no cache file was written"
    );
    let (mut child, addr) = start();
    let other = ask(&addr, "k2", &prompts[0]);
    assert_eq!(other["timings"]["cache_n"].as_u64(), Some(0), "{other}");
    let back = ask(&addr, "k1", &prompts[0]);
    let t = &back["timings"];
    assert!(t["cache_disk_n"].as_u64().unwrap() > 0, "{back}");
    assert_eq!(t["cache_disk_n"], t["cache_n"], "{back}");
    assert_eq!(back["choices"][0]["text"], first["choices"][0]["text"]);
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(dir);
}
