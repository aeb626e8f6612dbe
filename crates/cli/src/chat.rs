//! `tessera chat`: a multi-turn conversation that keeps its KV cache between
//! turns, interactive (line editing, history) or scripted (`--script`, JSON
//! Lines), with per-turn cache statistics on stderr.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use tessera_engine::{ChatSession, Completion, Engine, EngineConfig, SamplingParams, TurnOptions};

use crate::{load_model, print_stats, KvArgs, ModelArg};

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArg,
    #[arg(long)]
    system: Option<String>,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// 0 means greedy.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Recompute the whole history every turn (for comparison).
    #[arg(long)]
    no_prefix_cache: bool,
    /// Keep the prefix cache here: restored at start, written at exit;
    /// between, full blocks evicted from the pool go to its disk tier
    /// (`blocks/`) and come back when a prompt continues past the pool.
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// The disk tier's size limit (its oldest blocks go first); 0 keeps
    /// only the file written at exit.
    #[arg(long, default_value = "4GiB", value_parser = crate::parse_size)]
    cache_dir_size: usize,
    /// JSON Lines: {"system": TEXT}, {"user": TEXT} or {"cmd": "/stats"}.
    #[arg(long)]
    script: Option<PathBuf>,
    /// One JSON object per assistant turn on stdout.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    kv: KvArgs,
}

struct Chat {
    session: ChatSession,
    opts: TurnOptions,
    json: bool,
    turn: usize,
}

enum Flow {
    Continue,
    Exit,
}

impl Chat {
    fn say(&mut self, user: &str) -> Result<()> {
        let json = self.json;
        let mut out = std::io::stdout().lock();
        let done: Completion = self.session.send(user, &self.opts, &mut |ev| {
            if !json {
                let _ = out.write_all(ev.text.as_bytes());
                let _ = out.flush();
            }
        })?;
        drop(out);
        self.turn += 1;
        if json {
            let u = done.usage;
            let t = done.timings;
            let v = serde_json::json!({
                "turn": self.turn,
                "text": done.text,
                "prompt_tokens": u.prompt_tokens,
                "cached_tokens": u.cached_tokens,
                "new_tokens": u.prompt_tokens - u.cached_tokens,
                "completion_tokens": u.completion_tokens,
                "ttft_ms": t.ttft_ms,
                "prefill_tok_s": t.prefill_tok_s,
                "decode_tok_s": t.decode_tok_s,
            });
            println!("{v}");
        } else {
            println!();
        }
        print_stats(&done);
        Ok(())
    }

    fn command(&mut self, line: &str) -> Result<Flow> {
        let (cmd, arg) = line
            .split_once(' ')
            .map(|(c, a)| (c, a.trim()))
            .unwrap_or((line, ""));
        match cmd {
            "/exit" | "/quit" => return Ok(Flow::Exit),
            "/clear" => {
                self.session.clear();
                eprintln!("(history cleared)");
            }
            "/system" if !arg.is_empty() => {
                self.session.set_system(arg);
                eprintln!("(new system prompt; history cleared)");
            }
            "/save" if !arg.is_empty() => {
                self.session
                    .save(Path::new(arg))
                    .with_context(|| format!("saving the session to {arg}"))?;
                eprintln!(
                    "(saved {} messages, {} tokens to {arg})",
                    self.session.messages().len(),
                    self.session.token_ids().len()
                );
            }
            "/load" if !arg.is_empty() => {
                let engine = self.session.engine().clone();
                self.session = engine.load_session(Path::new(arg))?;
                eprintln!(
                    "(loaded {} messages, {} tokens from {arg}; the next turn reuses them)",
                    self.session.messages().len(),
                    self.session.token_ids().len()
                );
            }
            "/stats" => {
                let s = self.session.engine().stats();
                let k = s.kv;
                eprintln!(
                    "requests: {} | prompt tokens: {} | cached: {} ({:.1}%) | blocks: {} used, {} cached, {} free of {} | evicted: {} | preempted: {} | copy-on-write: {} | shifts: {}",
                    s.requests,
                    s.prompt_tokens,
                    s.cached_tokens,
                    100.0 * s.hit_ratio(),
                    k.used_blocks,
                    k.cached_blocks,
                    k.free_blocks,
                    k.num_blocks,
                    k.evicted_blocks,
                    s.preemptions,
                    k.cow_copies,
                    k.shifts
                );
                if let Some(t) = s.disk_tier {
                    eprintln!(
                        "disk tier: {} blocks ({:.1} MiB) | written: {} | read back: {} | prompt tokens from disk: {}",
                        t.blocks,
                        t.bytes as f64 / (1 << 20) as f64,
                        t.written,
                        t.read,
                        s.disk_cached_tokens
                    );
                }
            }
            other => bail!(
                "unknown command {other:?} (try /clear, /system TEXT, /save FILE, /load FILE, /stats, /exit)"
            ),
        }
        Ok(Flow::Continue)
    }

    fn script(&mut self, path: &PathBuf) -> Result<()> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let at = || format!("{}:{}", path.display(), i + 1);
            let v: serde_json::Value = serde_json::from_str(line).with_context(at)?;
            let field = |k: &str| v.get(k).and_then(|x| x.as_str());
            if let Some(s) = field("system") {
                self.session.set_system(s);
            } else if let Some(u) = field("user") {
                if !self.json {
                    println!("> {u}");
                }
                self.say(u).with_context(at)?;
            } else if let Some(c) = field("cmd") {
                if let Flow::Exit = self.command(c).with_context(at)? {
                    break;
                }
            } else {
                bail!(
                    "{}: expected {{\"system\": …}}, {{\"user\": …}} or {{\"cmd\": …}}",
                    at()
                );
            }
        }
        Ok(())
    }

    fn interactive(&mut self) -> Result<()> {
        let mut rl = rustyline::DefaultEditor::new()?;
        eprintln!("tessera chat — /clear, /system TEXT, /save FILE, /load FILE, /stats, /exit");
        loop {
            let line = match rl.readline("> ") {
                Ok(l) => l,
                Err(
                    rustyline::error::ReadlineError::Interrupted
                    | rustyline::error::ReadlineError::Eof,
                ) => break,
                Err(e) => return Err(e.into()),
            };
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let _ = rl.add_history_entry(line);
            if line.starts_with('/') {
                match self.command(line) {
                    Ok(Flow::Exit) => break,
                    Ok(Flow::Continue) => {}
                    Err(e) => eprintln!("error: {e:#}"),
                }
                continue;
            }
            // A failed turn is reported and the conversation goes on.
            if let Err(e) = self.say(line) {
                eprintln!("error: {e:#}");
            }
        }
        Ok(())
    }
}

pub fn chat(args: ChatArgs) -> Result<()> {
    let model = load_model(&args.model.model)?;
    let cfg = EngineConfig {
        cache_dir: args.cache_dir.clone(),
        cache_dir_bytes: args.cache_dir_size as u64,
        ..args.kv.config(!args.no_prefix_cache)
    };
    let engine = Engine::from_model(model, cfg).with_context(|| match &args.cache_dir {
        Some(d) => format!(
            "starting the engine (if {} is damaged, remove it)",
            d.join(tessera_engine::CACHE_FILE).display()
        ),
        None => "starting the engine".to_string(),
    })?;
    let session = engine.chat(args.system.as_deref());
    let opts = TurnOptions {
        sampling: SamplingParams {
            temperature: args.temperature,
            seed: args.seed,
            ..SamplingParams::default()
        },
        max_tokens: args.max_tokens,
        ..TurnOptions::default()
    };
    let mut chat = Chat {
        session,
        opts,
        json: args.json,
        turn: 0,
    };
    match &args.script {
        Some(path) => chat.script(path),
        None => chat.interactive(),
    }
}
