# Tessera task runner. Each recipe is one obvious command.

default:
    @just --list

# Fetch the default model (SmolLM2-135M-Instruct Q4_1) into models/ if missing.
model name="":
    python3 scripts/fetch_model.py {{name}}

# Run every test of the workspace (fetches the default model first).
test: model
    cargo test --workspace

# Criterion benches of the KV bookkeeping; prints a Markdown table at the end.
bench:
    cargo bench --bench kv
    python3 scripts/criterion_table.py

# Lints as CI would want them.
lint:
    cargo fmt --all -- --check
    cargo clippy --workspace --all-targets -- -D warnings
