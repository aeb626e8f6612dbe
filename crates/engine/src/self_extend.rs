//! SelfExtend (grouped attention): a RoPE model reads past its trained
//! context by dividing the positions of distant tokens by a group size,
//! while the last `w` tokens keep exact relative positions. This is
//! llama.cpp's `--grp-attn-n N --grp-attn-w W` with its arithmetic (its
//! completion loop over `ga_i`): before each forward of a sequence,
//!
//! ```text
//! while n_past >= ga_i + w:
//!     ib = n·ga_i / w;  bd = (w/n)·(n − 1);  dd = w/n − ib·bd − w
//!     positions in [ga_i, n_past)                  += ib·bd
//!     positions in [ga_i + ib·bd, ga_i + ib·bd + w) /= n
//!     positions in [ga_i + ib·bd + w, n_past + ib·bd) += dd
//!     n_past −= bd;  ga_i += w/n
//! ```
//!
//! and new tokens take positions `n_past, n_past + 1, …`. Tokens keep their
//! place in the sequence (their row of the block table, by which attention
//! is causal); only their RoPE positions change, and the cached keys of
//! tokens whose position moved are rotated in place by the difference
//! (`tessera_kernels::rotate_k`).
//!
//! Keys rotated for one sequence's map are meaningless to another, so a
//! request with SelfExtend neither reads the prefix cache nor adds to it.

use std::ops::Range;

/// llama.cpp's `--grp-attn-n` (group size) and `--grp-attn-w` (window).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SelfExtend {
    pub n: usize,
    pub w: usize,
}

impl SelfExtend {
    /// `None` for `n == 1` (off, as in llama.cpp); an error for values
    /// llama.cpp refuses.
    pub fn new(n: usize, w: usize) -> Result<Option<SelfExtend>, String> {
        if n == 1 {
            return Ok(None);
        }
        if n == 0 {
            return Err("grp_attn_n must be at least 1 (1 turns SelfExtend off)".into());
        }
        if w == 0 || !w.is_multiple_of(n) {
            return Err(format!(
                "grp_attn_w ({w}) must be a positive multiple of grp_attn_n ({n})"
            ));
        }
        Ok(Some(SelfExtend { n, w }))
    }

    /// Whether the engine can run this setting: llama.cpp's checks, and
    /// no sliding-window layers (their pool's keys are not re-rotated).
    pub(crate) fn check(self, sliding_layers: bool) -> Result<(), String> {
        SelfExtend::new(self.n, self.w)?;
        if sliding_layers {
            return Err(self.refusal("a model with sliding-window layers"));
        }
        Ok(())
    }

    /// The message refusing this setting together with `what`.
    pub(crate) fn refusal(self, what: &str) -> String {
        format!(
            "SelfExtend (grp_attn_n {}, grp_attn_w {}) does not work with {what}",
            self.n, self.w
        )
    }
}

/// One sequence's RoPE positions under SelfExtend.
#[derive(Debug, Clone)]
pub(crate) struct PositionMap {
    ga: SelfExtend,
    ga_i: i64,
    n_past: i64,
    pos: Vec<i64>,
}

impl PositionMap {
    pub(crate) fn new(ga: SelfExtend) -> PositionMap {
        PositionMap {
            ga,
            ga_i: 0,
            n_past: 0,
            pos: Vec::new(),
        }
    }

    pub(crate) fn settings(&self) -> SelfExtend {
        self.ga
    }

    pub(crate) fn len(&self) -> usize {
        self.pos.len()
    }

    /// Keeps the first `len` tokens (a step undone): their positions stay
    /// as their keys were rotated, and the next token follows the last.
    pub(crate) fn truncate(&mut self, len: usize) {
        self.pos.truncate(len);
        self.n_past = self.pos.last().map_or(0, |p| p + 1);
    }

    /// Indices of the tokens whose positions lie in `[p0, p1)`. Positions
    /// never decrease along the sequence (each step moves a suffix up, or
    /// divides a range that starts at or above every earlier position), so
    /// the tokens form one run.
    fn range(&self, p0: i64, p1: i64) -> Range<usize> {
        let a = self.pos.partition_point(|&p| p < p0);
        let b = self.pos.partition_point(|&p| p < p1);
        a..b.max(a)
    }

    /// llama.cpp's loop before a forward of this sequence; returns every
    /// cached token whose position moved, with its delta.
    pub(crate) fn compress(&mut self) -> Vec<(usize, i64)> {
        let (n, w) = (self.ga.n as i64, self.ga.w as i64);
        let mut before: Option<Vec<i64>> = None;
        while self.n_past >= self.ga_i + w {
            before.get_or_insert_with(|| self.pos.clone());
            let ib = (n * self.ga_i) / w;
            let bd = (w / n) * (n - 1);
            let dd = (w / n) - ib * bd - w;
            let (ga_i, n_past) = (self.ga_i, self.n_past);
            for i in self.range(ga_i, n_past) {
                self.pos[i] += ib * bd;
            }
            for i in self.range(ga_i + ib * bd, ga_i + ib * bd + w) {
                self.pos[i] /= n;
            }
            for i in self.range(ga_i + ib * bd + w, n_past + ib * bd) {
                self.pos[i] += dd;
            }
            self.n_past -= bd;
            self.ga_i += w / n;
        }
        match before {
            None => Vec::new(),
            Some(old) => old
                .iter()
                .zip(&self.pos)
                .enumerate()
                .filter(|(_, (a, b))| a != b)
                .map(|(i, (a, b))| (i, b - a))
                .collect(),
        }
    }

    /// Appends `k` tokens; returns their RoPE positions.
    pub(crate) fn append(&mut self, k: usize) -> Vec<u32> {
        let first = self.n_past;
        self.pos.extend(first..first + k as i64);
        self.n_past += k as i64;
        (first..first + k as i64).map(|p| p as u32).collect()
    }

    #[cfg(test)]
    pub(crate) fn positions(&self) -> &[i64] {
        &self.pos
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's KV cells and its completion loop, written out as there:
    /// `seq_add` and `seq_div` visit every cell and test its position.
    struct Cells {
        pos: Vec<i64>,
    }

    impl Cells {
        fn seq_add(&mut self, p0: i64, p1: i64, delta: i64) {
            if p0 == p1 || delta == 0 {
                return;
            }
            for p in &mut self.pos {
                if *p >= p0 && *p < p1 {
                    *p += delta;
                }
            }
        }
        fn seq_div(&mut self, p0: i64, p1: i64, d: i64) {
            if p0 == p1 || d == 1 {
                return;
            }
            for p in &mut self.pos {
                if *p >= p0 && *p < p1 {
                    *p /= d;
                }
            }
        }
    }

    /// Feeds `chunks` (token counts) through llama.cpp's loop.
    fn reference(n: i64, w: i64, chunks: &[usize]) -> Vec<i64> {
        let mut c = Cells { pos: Vec::new() };
        let (mut n_past, mut ga_i) = (0i64, 0i64);
        for &k in chunks {
            while n_past >= ga_i + w {
                let ib = (n * ga_i) / w;
                let bd = (w / n) * (n - 1);
                let dd = (w / n) - ib * bd - w;
                c.seq_add(ga_i, n_past, ib * bd);
                c.seq_div(ga_i + ib * bd, ga_i + ib * bd + w, n);
                c.seq_add(ga_i + ib * bd + w, n_past + ib * bd, dd);
                n_past -= bd;
                ga_i += w / n;
            }
            for _ in 0..k {
                c.pos.push(n_past);
                n_past += 1;
            }
        }
        c.pos
    }

    #[test]
    fn positions_follow_llama_cpp_for_several_settings_and_chunkings() {
        for (n, w) in [(2, 8), (4, 16), (4, 512), (8, 64), (16, 1024), (3, 9)] {
            for (len, chunk) in [(100, 1), (700, 7), (3000, 512), (5000, 1), (2500, 333)] {
                let ga = SelfExtend::new(n, w).unwrap().unwrap();
                let mut chunks = Vec::new();
                let mut left = len;
                // A prompt in chunks, then decode one token at a time.
                let mut first = true;
                while left > 0 {
                    let k = if first { chunk.min(left) } else { 1 };
                    chunks.push(k);
                    left -= k;
                    first = first && left > len / 2;
                }
                let want = reference(n as i64, w as i64, &chunks);
                let mut m = PositionMap::new(ga);
                let mut shadow: Vec<i64> = Vec::new();
                for &k in &chunks {
                    for (i, d) in m.compress() {
                        shadow[i] += d;
                    }
                    let new = m.append(k);
                    shadow.extend(new.iter().map(|&p| p as i64));
                    assert_eq!(m.positions(), &shadow[..], "deltas rebuild the map");
                }
                assert_eq!(
                    m.positions(),
                    &want[..],
                    "n={n} w={w} len={len} chunk={chunk}"
                );
                // The newest tokens keep exact distances; nothing passes the
                // next position.
                assert!(want.windows(2).all(|p| p[0] <= p[1]));
                assert_eq!(*want.last().unwrap() + 1, m.n_past);
            }
        }
    }

    #[test]
    fn settings_are_checked_as_llama_cpp_does() {
        assert_eq!(SelfExtend::new(1, 0), Ok(None));
        assert!(SelfExtend::new(0, 8).is_err());
        assert!(SelfExtend::new(4, 10).is_err());
        assert!(SelfExtend::new(4, 0).is_err());
        assert_eq!(
            SelfExtend::new(4, 512),
            Ok(Some(SelfExtend { n: 4, w: 512 }))
        );
    }

    #[test]
    fn truncation_keeps_positions_and_continues_after_the_last() {
        let mut m = PositionMap::new(SelfExtend { n: 2, w: 8 });
        m.append(30);
        m.compress();
        m.append(5);
        let kept = m.positions()[..20].to_vec();
        m.truncate(20);
        assert_eq!(m.positions(), &kept[..]);
        let next = m.append(1);
        assert_eq!(next[0] as i64, kept[19] + 1);
    }
}
