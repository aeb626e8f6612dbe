//! The disk tier below the KV pool: full blocks of cached prefixes that
//! eviction frees are written here as they go (`--cache-dir`), and a later
//! request whose prompt continues past what the pool holds gets them read
//! back instead of computed.
//!
//! A block is named by a chain hash over its partition and every token up
//! to its end, as vLLM names blocks:
//!
//! ```text
//! key     = SHA-256("tessera tier key v1", model fingerprint, cache dtype,
//!                   tenant, salt)                      (32 bytes)
//! hash(j) = first 8 bytes of SHA-256("tessera block v1", key,
//!                   hash(j − 1) or 0, tokens of block j)
//! ```
//!
//! Segment files `blocks-NNNNNNNN.tkb` hold the records in the order they
//! were demoted:
//!
//! ```text
//! segment  magic "TSRKB\0\0\0", version u32 LE, hlen u32 LE, header JSON
//!          (geometry, block size), then records
//! record   magic u32 LE, hash u64 LE, parent u64 LE, key [32],
//!          tokens (block size × u32 LE), per layer K then V
//!          ([block size, kv heads, head dim] in the cache dtype),
//!          crc32 u32 LE of the record before it
//! ```
//!
//! A record with magic `TKB1` holds every layer. In a model with
//! sliding-window layers (Gemma 3's local layers), a block whose sliding
//! K/V was already gone when it was demoted is written with magic `TKBG`
//! and only the global layers' rows; such a block serves positions that a
//! request reads only in its global layers (see
//! [`DiskTier::whole`]), and a later demotion of the same block with its
//! sliding K/V writes it again whole.
//!
//! Records are appended with `write`, so a process killed at any moment
//! leaves every record written before it in the page cache and on disk;
//! at start every segment is read back, each record checked (magic, crc,
//! geometry), and a torn last record cut off. When the segments pass the
//! size limit the oldest is deleted. A record is used only when its key
//! and tokens are the request's own: a hash collision, even a crafted
//! one, is a miss, never another partition's K/V.

use std::collections::{HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::snapshot::{Geometry, LayerBytes};
use crate::types::TierStats;
use crate::{EngineError, Result};

const MAGIC: &[u8; 8] = b"TSRKB\0\0\0";
const VERSION: u32 = 1;
const RECORD_MAGIC: u32 = u32::from_le_bytes(*b"TKB1");
/// A record of the global layers only (a model with sliding-window layers).
const GLOBAL_MAGIC: u32 = u32::from_le_bytes(*b"TKBG");
/// The tier's folder inside `--cache-dir`.
pub const TIER_DIR: &str = "blocks";
/// Largest segment file; the limit deletes whole segments, oldest first,
/// so a segment is at most an eighth of the limit.
const SEGMENT_BYTES: u64 = 64 << 20;

/// A partition's key in the tier (see the module docs).
pub type TierKey = [u8; 32];

/// The key of the partition `(tenant, salt)` for a model and cache dtype.
pub fn tier_key(
    fingerprint: u64,
    dtype: &str,
    tenant: Option<&str>,
    salt: Option<&str>,
) -> TierKey {
    let mut h = Sha256::new();
    h.update(b"tessera tier key v1");
    h.update(fingerprint.to_le_bytes());
    h.update((dtype.len() as u64).to_le_bytes());
    h.update(dtype.as_bytes());
    for part in [tenant, salt] {
        match part {
            None => h.update([0]),
            Some(s) => {
                h.update([1]);
                h.update((s.len() as u64).to_le_bytes());
                h.update(s.as_bytes());
            }
        }
    }
    h.finalize().into()
}

/// The hash of a block whose tokens are `tokens`, after the block hashed
/// `parent` (0 for the first).
pub fn block_hash(key: &TierKey, parent: u64, tokens: &[u32]) -> u64 {
    let mut h = Sha256::new();
    h.update(b"tessera block v1");
    h.update(key);
    h.update(parent.to_le_bytes());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    u64::from_le_bytes(h.finalize()[..8].try_into().expect("8 bytes"))
}

/// The chain hashes of the full blocks of `tokens`.
pub fn chain(key: &TierKey, tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut parent = 0;
    tokens
        .chunks_exact(block_size)
        .map(|b| {
            parent = block_hash(key, parent, b);
            parent
        })
        .collect()
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Header {
    geometry: Geometry,
    block_size: usize,
}

#[derive(Debug, Clone, Copy)]
struct Loc {
    seg: u64,
    offset: u64,
    /// Every layer's rows (not the global layers' only).
    whole: bool,
}

/// A block the tier holds: where its record is, and its parent (0: none)
/// and tokens, for its KV events.
#[derive(Debug)]
struct Held {
    loc: Loc,
    parent: u64,
    tokens: Box<[u32]>,
}

/// Where a record's tokens start (after its magic, hash, parent and key).
const AT_TOKENS: usize = 4 + 8 + 8 + 32;

#[derive(Debug)]
struct Segment {
    id: u64,
    bytes: u64,
    hashes: Vec<u64>,
}

/// A change of what the tier holds, for KV events (`medium` `"DISK"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TierChange {
    /// Block `hash` (following `parent`, 0 for none) holding `tokens`.
    Stored {
        hash: u64,
        parent: u64,
        tokens: Box<[u32]>,
    },
    /// Block `hash` left the tier (its size limit, or a bad record).
    Removed(u64),
}

/// One block read back: every layer's K and V rows (empty in the
/// sliding-window layers of a record without them).
pub struct TierBlock {
    pub layers: Vec<LayerBytes>,
    /// The record holds every layer's rows.
    pub whole: bool,
}

pub struct DiskTier {
    dir: PathBuf,
    limit: u64,
    header: Vec<u8>,
    block_size: usize,
    /// Per layer: a sliding-window layer.
    sliding: Vec<bool>,
    /// Bytes of one layer's K (or V) rows of a block.
    rows_bytes: usize,
    index: HashMap<u64, Held>,
    /// What the index gained and lost since [`DiskTier::take_changes`]
    /// (kept only while [`DiskTier::set_announce`] is on).
    changes: Vec<TierChange>,
    announce: bool,
    segments: VecDeque<Segment>,
    /// The segment appended to, and its file.
    current: Option<(u64, File)>,
    /// The next segment's number: past every segment file in the folder,
    /// another model's included (never written over).
    next_id: u64,
    stats: TierStats,
}

fn io(path: &Path, what: &str, e: std::io::Error) -> EngineError {
    EngineError::Snapshot {
        path: path.to_path_buf(),
        reason: format!("{what}: {e}"),
    }
}

impl DiskTier {
    /// Opens (creating if missing) the tier in `dir`, reading back every
    /// segment of this geometry; segments of another model or cache dtype
    /// are left alone (and not counted in the limit).
    pub fn open(
        dir: &Path,
        geometry: &Geometry,
        block_size: usize,
        row_bytes: usize,
        limit: u64,
    ) -> Result<DiskTier> {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, "cannot create", e))?;
        let header = serde_json::to_vec(&Header {
            geometry: Geometry {
                model: String::new(),
                ..geometry.clone()
            },
            block_size,
        })
        .map_err(|e| EngineError::Invalid(e.to_string()))?;
        let mut head = Vec::new();
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&VERSION.to_le_bytes());
        head.extend_from_slice(&(header.len() as u32).to_le_bytes());
        head.extend_from_slice(&header);
        let mut tier = DiskTier {
            dir: dir.to_path_buf(),
            limit,
            header: head,
            block_size,
            sliding: (0..geometry.n_layers)
                .map(|l| geometry.windows.get(l).is_some_and(|&w| w > 0))
                .collect(),
            rows_bytes: block_size * row_bytes,
            index: HashMap::new(),
            changes: Vec::new(),
            announce: false,
            segments: VecDeque::new(),
            current: None,
            next_id: 0,
            stats: TierStats::default(),
        };
        let mut ids: Vec<u64> = std::fs::read_dir(dir)
            .map_err(|e| io(dir, "cannot list", e))?
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                name.strip_prefix("blocks-")?
                    .strip_suffix(".tkb")?
                    .parse()
                    .ok()
            })
            .collect();
        ids.sort_unstable();
        tier.next_id = ids.last().map_or(0, |&i| i + 1);
        for id in ids {
            tier.load_segment(id)?;
        }
        tier.enforce_limit();
        Ok(tier)
    }

    fn path(&self, id: u64) -> PathBuf {
        self.dir.join(format!("blocks-{id:08}.tkb"))
    }

    /// Bytes of one record, `whole` or of the global layers only.
    fn record_bytes(&self, whole: bool) -> usize {
        let layers = self.sliding.iter().filter(|&&s| whole || !s).count();
        4 + 8 + 8 + 32 + 4 * self.block_size + 2 * layers * self.rows_bytes + 4
    }

    /// Whether a record of `whole`ness may take the place of `held`: a
    /// whole record replaces one of the global layers only, never the
    /// other way.
    fn replaces(held: Option<&Held>, whole: bool) -> bool {
        held.is_none_or(|h| whole && !h.loc.whole)
    }

    /// The tokens of record `r`.
    fn record_tokens(&self, r: &[u8]) -> Vec<u32> {
        r[AT_TOKENS..AT_TOKENS + 4 * self.block_size]
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect()
    }

    /// Reads segment `id` back into the index; a segment of another
    /// geometry is skipped, a torn or corrupted tail cut off.
    fn load_segment(&mut self, id: u64) -> Result<()> {
        let path = self.path(id);
        let mut data = Vec::new();
        File::open(&path)
            .and_then(|mut f| f.read_to_end(&mut data))
            .map_err(|e| io(&path, "cannot read", e))?;
        if !data.starts_with(&self.header) {
            tracing::warn!(
                "{}: a segment of another model, cache dtype or block size; left alone",
                path.display()
            );
            return Ok(());
        }
        let mut at = self.header.len();
        let mut seg = Segment {
            id,
            bytes: 0,
            hashes: Vec::new(),
        };
        let has_sliding = self.sliding.contains(&true);
        while at + 4 <= data.len() {
            let whole = match u32::from_le_bytes(data[at..at + 4].try_into().expect("4 bytes")) {
                RECORD_MAGIC => true,
                GLOBAL_MAGIC if has_sliding => false,
                _ => break,
            };
            let rec = self.record_bytes(whole);
            if at + rec > data.len() {
                break;
            }
            let r = &data[at..at + rec];
            let stored = u32::from_le_bytes(r[rec - 4..].try_into().expect("4 bytes"));
            if crc32fast::hash(&r[..rec - 4]) != stored {
                break;
            }
            let hash = u64::from_le_bytes(r[4..12].try_into().expect("8 bytes"));
            if Self::replaces(self.index.get(&hash), whole) {
                let held = Held {
                    loc: Loc {
                        seg: id,
                        offset: at as u64,
                        whole,
                    },
                    parent: u64::from_le_bytes(r[12..20].try_into().expect("8 bytes")),
                    tokens: self.record_tokens(r).into(),
                };
                self.index.insert(hash, held);
            }
            seg.hashes.push(hash);
            at += rec;
        }
        if at < data.len() {
            // What a kill mid-write (or a bad disk) left: cut at the last
            // whole record.
            self.stats.bad_at_start += 1;
            tracing::warn!(
                "{}: {} bytes after the last whole record cut off",
                path.display(),
                data.len() - at
            );
            OpenOptions::new()
                .write(true)
                .open(&path)
                .and_then(|f| f.set_len(at as u64))
                .map_err(|e| io(&path, "cannot truncate", e))?;
        }
        seg.bytes = at as u64;
        self.stats.blocks += seg.hashes.len();
        self.stats.bytes += seg.bytes;
        self.segments.push_back(seg);
        Ok(())
    }

    pub fn stats(&self) -> TierStats {
        TierStats {
            blocks: self.index.len(),
            ..self.stats
        }
    }

    pub fn contains(&self, hash: u64) -> bool {
        self.index.contains_key(&hash)
    }

    /// Whether the tier holds block `hash` with every layer's rows (in a
    /// model without sliding-window layers, whether it holds it at all).
    pub fn whole(&self, hash: u64) -> bool {
        self.index.get(&hash).is_some_and(|h| h.loc.whole)
    }

    /// Appends one block (`layers`: each layer's K and V rows of the
    /// block; in a model with sliding-window layers, those layers' may all
    /// be empty). A block already held is not written again, unless it
    /// is held without the sliding layers and comes with them now.
    pub fn put(
        &mut self,
        hash: u64,
        parent: u64,
        key: &TierKey,
        tokens: &[u32],
        layers: &[LayerBytes],
    ) -> Result<()> {
        let rows = |l: &LayerBytes, n: usize| l.k.len() == n && l.v.len() == n;
        let whole = layers.iter().all(|l| rows(l, self.rows_bytes));
        let global = layers
            .iter()
            .zip(&self.sliding)
            .all(|(l, &s)| rows(l, if s { 0 } else { self.rows_bytes }));
        if tokens.len() != self.block_size
            || layers.len() != self.sliding.len()
            || !(whole || (global && self.sliding.contains(&true)))
        {
            return Err(EngineError::Step(
                "a demoted block of the wrong size".into(),
            ));
        }
        if !Self::replaces(self.index.get(&hash), whole) {
            return Ok(());
        }
        let mut rec = Vec::with_capacity(self.record_bytes(whole));
        let magic = if whole { RECORD_MAGIC } else { GLOBAL_MAGIC };
        rec.extend_from_slice(&magic.to_le_bytes());
        rec.extend_from_slice(&hash.to_le_bytes());
        rec.extend_from_slice(&parent.to_le_bytes());
        rec.extend_from_slice(key);
        rec.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
        for l in layers {
            rec.extend_from_slice(&l.k);
            rec.extend_from_slice(&l.v);
        }
        let crc = crc32fast::hash(&rec);
        rec.extend_from_slice(&crc.to_le_bytes());
        let most = (self.limit / 8).clamp(1, SEGMENT_BYTES);
        let full = self.segments.back().is_none_or(|s| {
            s.bytes + rec.len() as u64 > most.max(self.header.len() as u64 + rec.len() as u64)
        });
        if self.current.is_none() || full {
            let id = self.next_id;
            self.next_id += 1;
            let path = self.path(id);
            let mut f = OpenOptions::new()
                .create_new(true)
                .write(true)
                .open(&path)
                .map_err(|e| io(&path, "cannot create", e))?;
            f.write_all(&self.header)
                .map_err(|e| io(&path, "cannot write", e))?;
            self.segments.push_back(Segment {
                id,
                bytes: self.header.len() as u64,
                hashes: Vec::new(),
            });
            self.stats.bytes += self.header.len() as u64;
            self.current = Some((id, f));
        }
        let path = self.path(self.current.as_ref().expect("opened above").0);
        let (id, f) = self.current.as_mut().expect("opened above");
        let seg = self.segments.back_mut().expect("the current one");
        if let Err(e) = f.write_all(&rec) {
            // A short write leaves a torn record: cut it off and stop
            // appending to this segment.
            let _ = f.set_len(seg.bytes);
            self.current = None;
            return Err(io(&path, "cannot write", e));
        }
        let held = Held {
            loc: Loc {
                seg: *id,
                offset: seg.bytes,
                whole,
            },
            parent,
            tokens: tokens.into(),
        };
        // A block made whole again is not news.
        if self.index.insert(hash, held).is_none() && self.announce {
            self.changes.push(TierChange::Stored {
                hash,
                parent,
                tokens: tokens.into(),
            });
        }
        seg.hashes.push(hash);
        seg.bytes += rec.len() as u64;
        self.stats.bytes += rec.len() as u64;
        self.stats.written += 1;
        self.enforce_limit();
        Ok(())
    }

    /// Drops block `hash` from the index (announced when on).
    fn forget(&mut self, hash: u64) {
        if self.index.remove(&hash).is_some() && self.announce {
            self.changes.push(TierChange::Removed(hash));
        }
    }

    /// Whether the index's changes are kept for [`DiskTier::take_changes`]
    /// (an engine publishing KV events turns it on).
    pub fn set_announce(&mut self, on: bool) {
        self.announce = on;
        if !on {
            self.changes.clear();
        }
    }

    /// What the index gained and lost since the last call, in order.
    pub fn take_changes(&mut self) -> Vec<TierChange> {
        std::mem::take(&mut self.changes)
    }

    /// Every block held, as `Stored` changes, each after its parent when
    /// the tier holds that too (those whose parent it lacks first: theirs
    /// may be in the pool): what a consumer starting from nothing, or
    /// after `AllBlocksCleared`, needs to know of the tier.
    pub fn held(&self) -> Vec<TierChange> {
        let mut children: HashMap<u64, Vec<u64>> = HashMap::new();
        let mut next: Vec<u64> = Vec::new();
        for (&h, held) in &self.index {
            let parent = held.parent;
            if parent != 0 && self.index.contains_key(&parent) {
                children.entry(parent).or_default().push(h);
            } else {
                next.push(h);
            }
        }
        next.sort_unstable();
        let mut out = Vec::with_capacity(self.index.len());
        while let Some(h) = next.pop() {
            let held = &self.index[&h];
            out.push(TierChange::Stored {
                hash: h,
                parent: held.parent,
                tokens: held.tokens.clone(),
            });
            if let Some(mut c) = children.remove(&h) {
                c.sort_unstable();
                next.extend(c);
            }
        }
        out
    }

    /// Deletes the oldest segments while the tier is over its limit.
    fn enforce_limit(&mut self) {
        while self.stats.bytes > self.limit && !self.segments.is_empty() {
            let current = self.current.as_ref().map(|c| c.0);
            let seg = self.segments.pop_front().expect("not empty");
            if current == Some(seg.id) {
                self.current = None;
            }
            for &h in &seg.hashes {
                if self
                    .index
                    .get(&h)
                    .is_some_and(|held| held.loc.seg == seg.id)
                {
                    self.forget(h);
                    self.stats.dropped += 1;
                }
            }
            self.stats.bytes -= seg.bytes;
            let path = self.path(seg.id);
            if let Err(e) = std::fs::remove_file(&path) {
                tracing::warn!("{}: cannot delete: {e}", path.display());
            }
        }
    }

    /// The block named `hash`, if the tier holds it for `key` with exactly
    /// `tokens` (anything else, a bad record included, is a miss).
    pub fn get(&mut self, hash: u64, key: &TierKey, tokens: &[u32]) -> Option<TierBlock> {
        let loc = self.index.get(&hash)?.loc;
        let path = self.path(loc.seg);
        let rec = self.record_bytes(loc.whole);
        let mut r = vec![0u8; rec];
        let read = File::open(&path).and_then(|mut f| {
            f.seek(SeekFrom::Start(loc.offset))?;
            f.read_exact(&mut r)
        });
        let stored = u32::from_le_bytes(r[rec - 4..].try_into().expect("4 bytes"));
        if read.is_err() || crc32fast::hash(&r[..rec - 4]) != stored {
            tracing::warn!(
                "{}: a bad record at {}; dropped",
                path.display(),
                loc.offset
            );
            self.forget(hash);
            return None;
        }
        if &r[20..52] != key || self.record_tokens(&r) != tokens {
            return None;
        }
        let mut at = AT_TOKENS + 4 * self.block_size;
        let n = self.rows_bytes;
        let layers = self
            .sliding
            .iter()
            .map(|&s| {
                if s && !loc.whole {
                    return LayerBytes::default();
                }
                let l = LayerBytes {
                    k: r[at..at + n].to_vec(),
                    v: r[at + n..at + 2 * n].to_vec(),
                };
                at += 2 * n;
                l
            })
            .collect();
        self.stats.read += 1;
        Some(TierBlock {
            layers,
            whole: loc.whole,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh folder under the system's temporary one.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tessera-tier-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    fn geometry() -> Geometry {
        Geometry {
            model: "m.gguf".into(),
            fingerprint: 42,
            arch: "llama".into(),
            cache_dtype: "f16".into(),
            n_layers: 2,
            n_kv_heads: 1,
            head_dim: 4,
            windows: Vec::new(),
        }
    }

    fn layers(fill: u8) -> Vec<LayerBytes> {
        // 4 tokens × 1 head × 4 dims × 2 bytes.
        (0..2)
            .map(|l| LayerBytes {
                k: vec![fill + l; 32],
                v: vec![fill + l + 10; 32],
            })
            .collect()
    }

    #[test]
    fn blocks_come_back_after_a_restart_and_a_torn_tail_is_cut() {
        let dir = scratch("restart");
        let key = tier_key(42, "f16", None, None);
        let toks: Vec<u32> = (0..12).collect();
        let hs = chain(&key, &toks, 4);
        {
            let mut t = DiskTier::open(dir.as_path(), &geometry(), 4, 8, 1 << 20).unwrap();
            for (j, &h) in hs.iter().enumerate() {
                let parent = if j == 0 { 0 } else { hs[j - 1] };
                t.put(h, parent, &key, &toks[4 * j..4 * j + 4], &layers(j as u8))
                    .unwrap();
            }
            assert_eq!(t.stats().blocks, 3);
        }
        // A kill in the middle of a fourth record.
        let seg = dir.as_path().join("blocks-00000000.tkb");
        let mut f = OpenOptions::new().append(true).open(&seg).unwrap();
        f.write_all(&RECORD_MAGIC.to_le_bytes()).unwrap();
        f.write_all(&[7; 40]).unwrap();
        drop(f);
        let mut t = DiskTier::open(dir.as_path(), &geometry(), 4, 8, 1 << 20).unwrap();
        assert_eq!((t.stats().blocks, t.stats().bad_at_start), (3, 1));
        let b = t.get(hs[1], &key, &toks[4..8]).unwrap();
        assert_eq!(b.layers, layers(1));
        // Another partition's key, or other tokens under the same hash: a miss.
        let other = tier_key(42, "f16", Some("t"), None);
        assert!(t.get(hs[1], &other, &toks[4..8]).is_none());
        assert!(t.get(hs[1], &key, &toks[0..4]).is_none());
        // Appending after the cut works, and the segment reads back whole.
        let h = block_hash(&key, hs[2], &[9, 9, 9, 9]);
        t.put(h, hs[2], &key, &[9, 9, 9, 9], &layers(5)).unwrap();
        drop(t);
        let mut t = DiskTier::open(dir.as_path(), &geometry(), 4, 8, 1 << 20).unwrap();
        assert_eq!((t.stats().blocks, t.stats().bad_at_start), (4, 0));
        assert!(t.get(h, &key, &[9, 9, 9, 9]).is_some());
        // Another geometry's tier in the same folder is not read, and its
        // own segments are written beside it, never over it.
        let g = Geometry {
            fingerprint: 43,
            ..geometry()
        };
        let mut other = DiskTier::open(dir.as_path(), &g, 4, 8, 1 << 20).unwrap();
        assert_eq!(other.stats().blocks, 0);
        let k2 = tier_key(43, "f16", None, None);
        let h2 = block_hash(&k2, 0, &[1, 2, 3, 4]);
        other.put(h2, 0, &k2, &[1, 2, 3, 4], &layers(3)).unwrap();
        drop(other);
        let mut t = DiskTier::open(dir.as_path(), &geometry(), 4, 8, 1 << 20).unwrap();
        assert_eq!(t.stats().blocks, 4);
        assert!(t.get(h, &key, &[9, 9, 9, 9]).is_some());
        drop(t);
        // Kept when an assertion failed, for a look; removed when passed.
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// With a sliding-window layer, a block demoted without its sliding
    /// rows is kept for its global layers; demoted again with them, it is
    /// written again whole, and the whole record wins after a restart.
    #[test]
    fn a_block_without_its_sliding_rows_is_kept_and_made_whole_later() {
        let dir = scratch("sliding");
        let g = Geometry {
            windows: vec![8, 0],
            ..geometry()
        };
        let key = tier_key(42, "f16", None, None);
        let toks: Vec<u32> = (0..8).collect();
        let hs = chain(&key, &toks, 4);
        let global = |fill| {
            let mut l = layers(fill);
            l[0] = LayerBytes::default();
            l
        };
        let mut t = DiskTier::open(dir.as_path(), &g, 4, 8, 1 << 20).unwrap();
        // Not a block of either shape: refused.
        let mut bad = layers(1);
        bad[1] = LayerBytes::default();
        assert!(t.put(hs[0], 0, &key, &toks[..4], &bad).is_err());
        t.put(hs[0], 0, &key, &toks[..4], &global(1)).unwrap();
        t.put(hs[1], hs[0], &key, &toks[4..], &layers(2)).unwrap();
        assert!(t.contains(hs[0]) && !t.whole(hs[0]) && t.whole(hs[1]));
        assert_eq!(t.get(hs[0], &key, &toks[..4]).unwrap().layers, global(1));
        // Global-only again: no new record; whole: written again.
        let written = t.stats().written;
        t.put(hs[1], hs[0], &key, &toks[4..], &global(3)).unwrap();
        assert_eq!(t.stats().written, written);
        t.put(hs[0], 0, &key, &toks[..4], &layers(1)).unwrap();
        assert_eq!(t.stats().written, written + 1);
        assert!(t.whole(hs[0]));
        drop(t);
        let mut t = DiskTier::open(dir.as_path(), &g, 4, 8, 1 << 20).unwrap();
        assert_eq!((t.stats().blocks, t.stats().bad_at_start), (2, 0));
        assert!(t.whole(hs[0]) && t.whole(hs[1]));
        assert_eq!(t.get(hs[0], &key, &toks[..4]).unwrap().layers, layers(1));
        assert_eq!(t.get(hs[1], &key, &toks[4..]).unwrap().layers, layers(2));
        drop(t);
        // A model without sliding-window layers takes only whole blocks.
        let dir2 = scratch("global");
        let mut t = DiskTier::open(dir2.as_path(), &geometry(), 4, 8, 1 << 20).unwrap();
        assert!(t.put(hs[0], 0, &key, &toks[..4], &global(1)).is_err());
        drop(t);
        for d in [dir, dir2] {
            std::fs::remove_dir_all(d).unwrap();
        }
    }

    /// A tier in a fresh folder named `name`, with a limit of about three
    /// records (every put past it starts a segment over), and its key.
    fn three_record_tier(name: &str) -> (PathBuf, TierKey, DiskTier) {
        let dir = scratch(name);
        let key = tier_key(42, "f16", None, None);
        let mut t = DiskTier::open(dir.as_path(), &geometry(), 4, 8, 1 << 20).unwrap();
        let rec = t.record_bytes(true) as u64;
        t.limit = 3 * rec + t.header.len() as u64;
        (dir, key, t)
    }

    /// With announcing on, every block the index gains and loses is a
    /// change, in order (a block made whole again is not news), and after
    /// a restart `held` lists every block, each after its parent.
    #[test]
    fn changes_are_announced_in_order_and_held_lists_parents_first() {
        let (dir, key, mut t) = three_record_tier("announce");
        t.set_announce(true);
        let chain_of = |n: u32| {
            let mut parent = 0;
            (0..n)
                .map(|j| {
                    let toks = [j; 4];
                    let h = block_hash(&key, parent, &toks);
                    let out = (h, parent, toks);
                    parent = h;
                    out
                })
                .collect::<Vec<_>>()
        };
        let blocks = chain_of(5);
        // Written leaves first, as eviction frees them.
        for &(h, parent, toks) in blocks.iter().rev() {
            t.put(h, parent, &key, &toks, &layers(1)).unwrap();
            t.put(h, parent, &key, &toks, &layers(1)).unwrap();
        }
        let changes = t.take_changes();
        let stored: Vec<u64> = changes
            .iter()
            .filter_map(|c| match c {
                TierChange::Stored { hash, .. } => Some(*hash),
                TierChange::Removed(_) => None,
            })
            .collect();
        let removed: Vec<u64> = changes
            .iter()
            .filter_map(|c| match c {
                TierChange::Removed(h) => Some(*h),
                TierChange::Stored { .. } => None,
            })
            .collect();
        let rev: Vec<u64> = blocks.iter().rev().map(|b| b.0).collect();
        assert_eq!(stored, rev, "each new block once, as written");
        // The limit dropped the first segments' blocks, announced.
        assert!(!removed.is_empty());
        assert!(removed.iter().all(|h| !t.contains(*h)));
        assert_eq!(stored.len() - removed.len(), t.stats().blocks);
        assert!(t.take_changes().is_empty());
        drop(t);
        let t = DiskTier::open(dir.as_path(), &geometry(), 4, 8, 1 << 20).unwrap();
        let held = t.held();
        assert_eq!(held.len(), t.stats().blocks);
        let mut seen = std::collections::HashSet::new();
        for c in &held {
            let TierChange::Stored {
                hash,
                parent,
                tokens,
            } = c
            else {
                panic!("held lists stored blocks: {c:?}");
            };
            let b = blocks
                .iter()
                .find(|b| b.0 == *hash)
                .expect("a written block");
            assert_eq!((*parent, &tokens[..]), (b.1, &b.2[..]));
            assert!(
                !t.contains(*parent) || seen.contains(parent),
                "parent first"
            );
            seen.insert(*hash);
        }
        drop(t);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_size_limit_drops_the_oldest_segments() {
        let (dir, key, mut t) = three_record_tier("limit");
        let mut parent = 0;
        let mut hashes = Vec::new();
        for j in 0..10u32 {
            let toks = [j; 4];
            let h = block_hash(&key, parent, &toks);
            t.put(h, parent, &key, &toks, &layers(1)).unwrap();
            hashes.push((h, toks));
            parent = h;
            assert!(t.stats().bytes <= t.limit);
        }
        assert!(t.stats().dropped > 0);
        let (h, toks) = hashes[9];
        assert!(t.get(h, &key, &toks).is_some());
        let (h, toks) = hashes[0];
        assert!(t.get(h, &key, &toks).is_none());
        drop(t);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
