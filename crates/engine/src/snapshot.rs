//! K/V snapshots on disk: saved chat sessions and the `--cache-dir` prefix
//! cache.
//!
//! ```text
//! magic    8 bytes  "TSRKV\0\0\0"
//! version  u32 LE   FORMAT_VERSION
//! hlen     u32 LE   length of the header
//! header   JSON     kind, model fingerprint, architecture, cache dtype,
//!                   geometry (layers, KV heads, head dim, each layer's
//!                   sliding window), entry lengths, where each entry's
//!                   sliding-window K/V begins, and for a session its
//!                   messages
//! entries  for each entry: token ids (u32 LE), then per layer K then V
//!          ([rows, kv_heads, head_dim] in the cache dtype, LE): every
//!          token's in a global layer, the tail's (tokens from
//!          `sliding_from` on) in a sliding-window layer
//! crc32    u32 LE   of everything before it
//! ```
//!
//! Version 2 added the sliding-window tails; files of version 1 are
//! refused with a message saying so.
//!
//! Loading checks each part and names what is wrong; nothing reaches the
//! engine until the whole file is validated.

use std::path::Path;

use serde::{Deserialize, Serialize};
use tessera_model::Model;

use crate::types::CacheDType;
use crate::{EngineError, Result};

const MAGIC: &[u8; 8] = b"TSRKV\0\0\0";
pub const FORMAT_VERSION: u32 = 2;
/// The prefix cache's file inside `--cache-dir`.
pub const CACHE_FILE: &str = "prefix-cache.tkv";

/// One layer's K and V rows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerBytes {
    pub k: Vec<u8>,
    pub v: Vec<u8>,
}

/// Token ids and their K/V: every one's in global layers, those from
/// `sliding_from` on in sliding-window layers (what a request resuming at
/// the end reads there).
#[derive(Debug, Clone, PartialEq)]
pub struct KvSnapshot {
    pub tokens: Vec<u32>,
    pub layers: Vec<LayerBytes>,
    pub sliding_from: usize,
}

/// What must match between the file and the engine loading it (all but
/// `model`, the file name of the model, which names it in messages).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Geometry {
    #[serde(default)]
    pub model: String,
    pub fingerprint: u64,
    pub arch: String,
    pub cache_dtype: String,
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Each layer's sliding window (0: global); empty when none has one.
    #[serde(default)]
    pub windows: Vec<usize>,
}

impl Geometry {
    pub fn of(model: &Model, dtype: CacheDType) -> Geometry {
        let c = model.config();
        Geometry {
            model: model
                .path
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
            fingerprint: model.fingerprint,
            arch: format!("{:?}", c.arch).to_lowercase(),
            cache_dtype: dtype.name().to_string(),
            n_layers: c.n_layers,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            windows: if c.has_sliding_layers() {
                (0..c.n_layers)
                    .map(|l| c.layer_window(l).unwrap_or(0))
                    .collect()
            } else {
                Vec::new()
            },
        }
    }

    /// Whether layer `l` stores only the sliding tail.
    fn sliding(&self, l: usize) -> bool {
        self.windows.get(l).is_some_and(|&w| w > 0)
    }

    /// Bytes of one token's K (or V) in one layer; `None` for a dtype this
    /// build does not know.
    fn row_bytes(&self) -> Option<usize> {
        let dtype = CacheDType::parse(&self.cache_dtype)?;
        if dtype.is_quantized() && !self.head_dim.is_multiple_of(32) {
            return None;
        }
        self.n_kv_heads.checked_mul(dtype.bytes_for(self.head_dim))
    }

    /// Equal in everything that decides whether the K/V fits.
    fn matches(&self, other: &Geometry) -> bool {
        Geometry {
            model: String::new(),
            ..self.clone()
        } == Geometry {
            model: String::new(),
            ..other.clone()
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Header {
    kind: String,
    geometry: Geometry,
    /// Tokens per entry.
    entries: Vec<usize>,
    /// Per entry, the first token of its sliding-window tail.
    #[serde(default)]
    sliding_from: Vec<usize>,
    #[serde(default)]
    meta: serde_json::Value,
}

fn bad(path: &Path, reason: impl Into<String>) -> EngineError {
    EngineError::Snapshot {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Writes `snaps` to `path` (through a temporary file, renamed at the end).
pub fn write_file(
    path: &Path,
    kind: &str,
    geometry: &Geometry,
    snaps: &[KvSnapshot],
    meta: serde_json::Value,
) -> Result<()> {
    let header = serde_json::to_vec(&Header {
        kind: kind.to_string(),
        geometry: geometry.clone(),
        entries: snaps.iter().map(|s| s.tokens.len()).collect(),
        sliding_from: snaps.iter().map(|s| s.sliding_from).collect(),
        meta,
    })
    .map_err(|e| bad(path, e.to_string()))?;
    let mut buf = Vec::new();
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    buf.extend_from_slice(&(header.len() as u32).to_le_bytes());
    buf.extend_from_slice(&header);
    for s in snaps {
        buf.extend(s.tokens.iter().flat_map(|t| t.to_le_bytes()));
        for l in &s.layers {
            buf.extend_from_slice(&l.k);
            buf.extend_from_slice(&l.v);
        }
    }
    let crc = crc32fast::hash(&buf);
    buf.extend_from_slice(&crc.to_le_bytes());
    write_atomic(path, &buf).map_err(|e| bad(path, format!("cannot write: {e}")))
}

/// Replaces `path` with `bytes` so that a crash, a kill or a full disk at
/// any moment leaves either the old file or the new one whole: the bytes go
/// to a temporary file beside it, are flushed to the disk, and the file is
/// renamed over the old one (then the directory is flushed too). On an
/// error the temporary file is removed and the old file is untouched.
/// Every write has a temporary file of its own (the process id and a
/// counter), so writers of one name in one process never share one: the
/// last rename wins, and the file is always one of the writes whole.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .map_or_else(Default::default, |n| n.to_string_lossy());
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.{}.{n}.tmp", std::process::id()));
    let written = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
        return written;
    }
    // The rename itself is durable once the directory is flushed; where a
    // directory cannot be opened for that, the rename has still happened.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    remove_stale_temporaries(dir, &name);
    Ok(())
}

/// Removes the temporary files of writers of `name` that died mid-write
/// (their process is gone). Linux only: elsewhere a writer's liveness
/// cannot be told, and the files stay.
fn remove_stale_temporaries(dir: &Path, name: &str) {
    remove_temporaries(dir, Some(name), false);
}

/// Removes what writers that died mid-write (killed, or the machine
/// stopped) left in `dir`: [`write_atomic`]'s temporary files of processes
/// that are gone. Called at start, before this process writes anything
/// there, so its own process id counts as gone too (a restarted container
/// often gets the same one). Returns the files removed. Linux only (a
/// writer's liveness is read from /proc).
pub fn clean_temporaries(dir: &Path) -> usize {
    remove_temporaries(dir, None, true)
}

fn remove_temporaries(dir: &Path, name: Option<&str>, own_too: bool) -> usize {
    if !Path::new("/proc/self").exists() {
        return 0;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = temporary_pid(&file, name) else {
            continue;
        };
        let own = pid == std::process::id();
        let gone = !own && !Path::new(&format!("/proc/{pid}")).exists();
        if (gone || (own && own_too)) && std::fs::remove_file(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// The writer's process id of a temporary file name of [`write_atomic`]
/// (`.{name}.{pid}.{n}.tmp`, or `.{name}.{pid}.tmp` of older builds), of
/// `name`'s writes when given. The files written end in a non-numeric
/// extension (`.tkv`, `.bin`), so the digits at the end are the writer's.
fn temporary_pid(file: &str, name: Option<&str>) -> Option<u32> {
    let rest = file.strip_prefix('.')?.strip_suffix(".tmp")?;
    let rest = match name {
        Some(n) => rest.strip_prefix(n)?,
        None => rest,
    };
    let mut parts = rest.rsplit('.');
    let last = parts.next()?.parse::<u64>().ok()?;
    match parts.next().map(str::parse::<u32>) {
        Some(Ok(pid)) => Some(pid),
        _ => u32::try_from(last).ok(),
    }
}

/// Reads and validates a file written by [`write_file`] against the
/// engine's `geometry`; returns its kind's entries and metadata.
pub fn read_file(
    path: &Path,
    kind: &str,
    geometry: &Geometry,
) -> Result<(Vec<KvSnapshot>, serde_json::Value)> {
    let data = std::fs::read(path).map_err(|e| bad(path, format!("cannot read: {e}")))?;
    let fixed = MAGIC.len() + 8;
    if data.len() < MAGIC.len() || &data[..MAGIC.len()] != MAGIC {
        return Err(bad(path, "not a Tessera K/V file (wrong magic bytes)"));
    }
    if data.len() < fixed + 4 {
        return Err(bad(path, format!("truncated: only {} bytes", data.len())));
    }
    let version = u32::from_le_bytes(data[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        let hint = if version < FORMAT_VERSION {
            " (an older Tessera wrote it; save it again with this one)"
        } else {
            ""
        };
        return Err(bad(
            path,
            format!("format version {version}; this build reads version {FORMAT_VERSION}{hint}"),
        ));
    }
    let hlen = u32::from_le_bytes(data[12..16].try_into().expect("4 bytes")) as usize;
    if data.len() < fixed + hlen + 4 {
        return Err(bad(
            path,
            format!(
                "truncated: {} bytes, the header alone needs {}",
                data.len(),
                fixed + hlen + 4
            ),
        ));
    }
    let header: Header = serde_json::from_slice(&data[fixed..fixed + hlen])
        .map_err(|e| bad(path, format!("corrupted header: {e}")))?;
    let row = header.geometry.row_bytes().ok_or_else(|| {
        bad(
            path,
            format!(
                "corrupted header: unknown cache dtype {:?}",
                header.geometry.cache_dtype
            ),
        )
    })?;
    let g = &header.geometry;
    if header.sliding_from.len() != header.entries.len()
        || header
            .sliding_from
            .iter()
            .zip(&header.entries)
            .any(|(&f, &n)| f > n)
        || g.windows.len() > g.n_layers
    {
        return Err(bad(
            path,
            "corrupted header: sliding tails do not fit their entries",
        ));
    }
    let huge = || bad(path, "corrupted header: sizes overflow");
    // Rows per layer of an entry of `n` tokens with its tail from `from`.
    let rows = |l: usize, n: usize, from: usize| if g.sliding(l) { n - from } else { n };
    let entry_bytes = |n: usize, from: usize| -> Option<usize> {
        (0..g.n_layers).try_fold(n.checked_mul(4)?, |acc, l| {
            acc.checked_add(rows(l, n, from).checked_mul(row)?.checked_mul(2)?)
        })
    };
    let body = header
        .entries
        .iter()
        .zip(&header.sliding_from)
        .try_fold(0usize, |acc, (&n, &f)| acc.checked_add(entry_bytes(n, f)?));
    let expected = body
        .and_then(|b| b.checked_add(fixed + hlen + 4))
        .ok_or_else(huge)?;
    if data.len() < expected {
        return Err(bad(
            path,
            format!("truncated: {} bytes of {expected}", data.len()),
        ));
    }
    if data.len() > expected {
        return Err(bad(
            path,
            format!(
                "corrupted: {} bytes where the header says {expected}",
                data.len()
            ),
        ));
    }
    let stored = u32::from_le_bytes(data[expected - 4..].try_into().expect("4 bytes"));
    if crc32fast::hash(&data[..expected - 4]) != stored {
        return Err(bad(path, "checksum mismatch: the file is corrupted"));
    }
    if header.kind != kind {
        return Err(bad(path, format!("holds a {}, not a {kind}", header.kind)));
    }
    if g.fingerprint != geometry.fingerprint {
        let name = |g: &Geometry| {
            if g.model.is_empty() {
                "a model".to_string()
            } else {
                g.model.clone()
            }
        };
        return Err(bad(
            path,
            format!(
                "saved with another model: {} (fingerprint {:016x}, {} with {} layers); this engine runs {} (fingerprint {:016x}, {} with {} layers)",
                name(g), g.fingerprint, g.arch, g.n_layers, name(geometry), geometry.fingerprint, geometry.arch, geometry.n_layers
            ),
        ));
    }
    if !g.matches(geometry) {
        return Err(bad(
            path,
            format!(
                "saved with cache dtype {} and geometry {}x{}x{}; this engine uses {} and {}x{}x{}",
                g.cache_dtype,
                g.n_layers,
                g.n_kv_heads,
                g.head_dim,
                geometry.cache_dtype,
                geometry.n_layers,
                geometry.n_kv_heads,
                geometry.head_dim
            ),
        ));
    }
    let mut at = fixed + hlen;
    let mut take = |n: usize| {
        let s = &data[at..at + n];
        at += n;
        s
    };
    let snaps = header
        .entries
        .iter()
        .zip(&header.sliding_from)
        .map(|(&n, &from)| {
            let tokens = take(4 * n)
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect();
            let layers = (0..g.n_layers)
                .map(|l| LayerBytes {
                    k: take(rows(l, n, from) * row).to_vec(),
                    v: take(rows(l, n, from) * row).to_vec(),
                })
                .collect();
            KvSnapshot {
                tokens,
                layers,
                sliding_from: from,
            }
        })
        .collect();
    Ok((snaps, header.meta))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temporary_names_tell_their_writer() {
        assert_eq!(temporary_pid(".a.tkv.123.7.tmp", None), Some(123));
        assert_eq!(temporary_pid(".a.tkv.123.7.tmp", Some("a.tkv")), Some(123));
        assert_eq!(temporary_pid(".a.tkv.123.tmp", None), Some(123));
        assert_eq!(temporary_pid(".9.tkv.55.0.tmp", Some("9.tkv")), Some(55));
        assert_eq!(temporary_pid(".a.tkv.123.7.tmp", Some("b.tkv")), None);
        assert_eq!(temporary_pid("a.tkv", None), None);
        assert_eq!(temporary_pid(".a.tkv.x.tmp", None), None);
    }

    /// Concurrent writers of one name each use a temporary file of their
    /// own: every write succeeds, the file is one of them whole, and no
    /// temporary file is left; one left by a writer that died is removed
    /// at start.
    #[test]
    fn concurrent_writers_of_one_name_never_break_it() {
        let dir = std::env::temp_dir().join(format!("tessera-atomic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.tkv");
        std::thread::scope(|s| {
            for i in 0..12u8 {
                let path = &path;
                s.spawn(move || write_atomic(path, &vec![i; 100_000 + i as usize]).unwrap());
            }
        });
        let got = std::fs::read(&path).unwrap();
        let i = got[0];
        assert_eq!(got, vec![i; 100_000 + i as usize]);
        let stale = dir.join(format!(".s.tkv.{}.3.tmp", std::process::id()));
        std::fs::write(&stale, b"partial").unwrap();
        let others: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(others.len(), 2, "{others:?}");
        if Path::new("/proc/self").exists() {
            assert_eq!(clean_temporaries(&dir), 1);
            assert!(!stale.exists());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
