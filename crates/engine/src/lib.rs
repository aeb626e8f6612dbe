//! tessera-engine: the library API.
//!
//! **What this crate must not know:** command-line parsing and terminal I/O.
//! It owns the K/V tensors, applies the plans of tessera-kv through
//! tessera-kernels, runs tessera-model, samples, and reports usage and
//! timings.
//!
//! ```text
//! Engine (handle, any thread) ──commands──▶ worker thread (worker.rs)
//!   generate(req) → RequestStream           Scheduler::schedule (tessera-sched)
//!   ◀── Token … Done events ──────────────  ops: copy_blocks / shift_kv
//!                                           forward over every running sequence
//!                                           sample, stop rules, finish → prefix tree
//! ```

//!
//! Modules, each with one job and no cycles between them:
//!
//! ```text
//! types     plain data: config, requests, completions, stats, fault hook
//! snapshot  the session / cache file format (bytes only)
//! runner    the K/V tensors and the model: ops, forward, rows, resize
//! request   one sample: sampling, stream decoding, stop strings, usage
//! worker    the loop: commands, schedule, run, abort, sample, finish
//! chat      ChatSession (token-id splicing across turns)
//! engine    the handle: every `impl Engine`
//! ```

mod chat;
mod draft;
mod engine;
mod error;
mod events;
mod grammar;
mod pythonic;
mod request;
mod runner;
mod sampler;
mod self_extend;
mod snapshot;
mod source;
mod spec;
mod stream;
mod tier;
mod tools;
mod types;
mod worker;

pub use chat::{ChatSession, TurnOptions};
pub use engine::{check_stops, Engine, SessionSaved};
pub use error::{EngineError, Result};
pub use events::{KvEvent, KvEventBatch, KvEventSink};
pub use grammar::{gbnf_to_lark, Constraint};
pub use request::{MAX_STOP_BYTES, MAX_STOP_STRINGS};
pub use sampler::{argmax_and_norm, Sampler, SamplingParams, SplitMix64, TokenLogprob};
pub use self_extend::SelfExtend;
pub use snapshot::{
    clean_temporaries, Geometry, KvSnapshot, LayerBytes, CACHE_FILE, FORMAT_VERSION,
};
pub use source::ModelSource;
pub use spec::NgramSpec;
pub use stream::{Canceller, Event, EventStream, RequestStream, MAX_BACKLOG};
pub use tessera_model::{Activations, IsaCap, Tuning};
pub use tessera_model::{DeviceSpec, Message, Model};
pub use tools::{
    ToolCall, ToolChoice, ToolFormat, ToolSpec, ToolStream, ToolSyntax, MAX_PARALLEL_CALLS,
};
pub use types::{
    CacheDType, Completion, ContextShift, DraftModelConfig, EngineConfig, EngineStats, Fault,
    FaultHook, FaultSite, FinishReason, GenerateRequest, Partition, Prompt, TierStats, Timings,
    TokenEvent, Usage, DEFAULT_CACHE_DIR_BYTES,
};
pub use worker::INJECTED_PANIC;

#[cfg(test)]
mod layout {
    use std::collections::{BTreeMap, BTreeSet};

    /// The modules' `crate::` references (tests aside) form no cycle: each
    /// module can be read knowing only those below it.
    #[test]
    fn modules_import_each_other_without_cycles() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let modules: BTreeSet<String> = std::fs::read_dir(&src)
            .unwrap()
            .filter_map(|e| {
                let p = e.unwrap().path();
                (p.extension()? == "rs").then(|| p.file_stem()?.to_str().map(String::from))?
            })
            .filter(|m| m != "lib")
            .collect();
        let mut uses: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for m in &modules {
            let text = std::fs::read_to_string(src.join(format!("{m}.rs"))).unwrap();
            // The code before its unit tests.
            let code = text.split("#[cfg(test)]").next().unwrap();
            let deps = code
                .split("crate::")
                .skip(1)
                .filter_map(|rest| {
                    let name: String = rest
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    (modules.contains(&name) && &name != m).then_some(name)
                })
                .collect();
            uses.insert(m.clone(), deps);
        }
        // Depth-first search; a module met again while on the path is a
        // cycle.
        fn visit(
            m: &str,
            uses: &BTreeMap<String, BTreeSet<String>>,
            path: &mut Vec<String>,
            done: &mut BTreeSet<String>,
        ) {
            if done.contains(m) {
                return;
            }
            if let Some(i) = path.iter().position(|p| p == m) {
                panic!("module cycle: {} → {m}", path[i..].join(" → "));
            }
            path.push(m.to_string());
            for d in &uses[m] {
                visit(d, uses, path, done);
            }
            path.pop();
            done.insert(m.to_string());
        }
        let mut done = BTreeSet::new();
        for m in &modules {
            visit(m, &uses, &mut Vec::new(), &mut done);
        }
        assert!(uses["chat"].contains("engine"), "the check reads imports");
    }
}
