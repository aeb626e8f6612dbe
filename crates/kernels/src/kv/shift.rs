//! `shift_kv`: the context shift. Moves slots of K and V, rotating each moved
//! K by a RoPE position delta (V is position-free and moves unchanged).
//!
//! Moves may overlap in any order (a slot both a source and a destination):
//! every source row is read and rotated into scratch first, then all are
//! written, so each move reads the cache as it was before the shift. A
//! destination that appears twice is refused.

use candle_core::{bail, CpuStorage, InplaceOp1, Layout, Result, Tensor};

use crate::simd::elem::{with_cache_mut, KvElem};
use crate::Rotation;

struct MoveSlots<'a> {
    moves: &'a [(u32, u32)],
    rotation: Option<&'a Rotation>,
    n_kv_heads: usize,
    head_dim: usize,
}

/// What a GPU launcher of a move needs: source and destination slots,
/// the rotation tables per row, `(heads, head_dim, style)`.
#[cfg(any(feature = "cuda", all(feature = "metal", target_vendor = "apple")))]
type GpuMoves = (
    Vec<u32>,
    Vec<u32>,
    crate::gpu::RopeTables,
    (usize, usize, crate::RopeStyle),
);

impl MoveSlots<'_> {
    #[cfg(any(feature = "cuda", all(feature = "metal", target_vendor = "apple")))]
    fn gpu_moves(&self) -> GpuMoves {
        use crate::gpu::RopeTables;
        let (src, dst): (Vec<u32>, Vec<u32>) = self.moves.iter().copied().unzip();
        let (tables, style) = match self.rotation {
            Some(r) => (RopeTables::uniform(src.len(), r), r.style),
            None => (RopeTables::none(src.len()), crate::RopeStyle::Neox),
        };
        (src, dst, tables, (self.n_kv_heads, self.head_dim, style))
    }

    fn run<T: KvElem>(&self, cache: &mut [T]) {
        let row = self.n_kv_heads * self.head_dim;
        let units = row / T::PER;
        if self.rotation.is_none() {
            // Unrotated rows move as they are (a quantized row exactly).
            let mut raw = Vec::with_capacity(units * self.moves.len());
            for &(src, _) in self.moves {
                raw.extend_from_slice(&cache[src as usize * units..(src as usize + 1) * units]);
            }
            for (&(_, dst), r) in self.moves.iter().zip(raw.chunks_exact(units)) {
                cache[dst as usize * units..(dst as usize + 1) * units].copy_from_slice(r);
            }
            return;
        }
        let mut scratch = vec![0f32; row * self.moves.len()];
        let (cos, sin) = self.rotation.map(|r| r.cos_sin()).unwrap_or_default();
        // Gather (and rotate) every source first…
        for (&(src, _), buf) in self.moves.iter().zip(scratch.chunks_exact_mut(row)) {
            let src = src as usize * units;
            T::load(&cache[src..src + units], buf);
            if let Some(r) = self.rotation {
                for head in buf.chunks_exact_mut(self.head_dim) {
                    r.apply(head, &cos, &sin);
                }
            }
        }
        // …then scatter, so no move reads what another wrote.
        for (&(_, dst), buf) in self.moves.iter().zip(scratch.chunks_exact(row)) {
            let dst = dst as usize * units;
            T::store(buf, &mut cache[dst..dst + units]);
        }
    }
}

impl InplaceOp1 for MoveSlots<'_> {
    fn name(&self) -> &'static str {
        "shift_kv"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        with_cache_mut!(s, l, |cache| self.run(cache));
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &Layout) -> Result<()> {
        let (src, dst, tables, geometry) = self.gpu_moves();
        crate::gpu::cuda::move_rows(s, l, &src, &dst, &tables, geometry)
    }

    #[cfg(all(feature = "metal", target_vendor = "apple"))]
    fn metal_fwd(&self, s: &mut candle_core::MetalStorage, l: &Layout) -> Result<()> {
        let (src, dst, tables, geometry) = self.gpu_moves();
        crate::gpu::metal::move_rows(s, l, &src, &dst, &tables, geometry)
    }
}

pub(crate) fn check(
    k_cache: &Tensor,
    v_cache: &Tensor,
    moves: &[(u32, u32)],
    rotation: &Rotation,
) -> Result<(usize, usize)> {
    let (nb, bs, kvh, hd) = crate::cache_geometry(k_cache)?;
    if k_cache.shape() != v_cache.shape() || !v_cache.is_contiguous() {
        bail!(
            "shift_kv: K {:?} and V {:?} caches differ",
            k_cache.shape(),
            v_cache.shape()
        )
    }
    if rotation.inv_freq.len() * 2 != hd {
        bail!(
            "shift_kv: {} inverse frequencies for head_dim {hd}",
            rotation.inv_freq.len()
        )
    }
    if let Some(m) = moves
        .iter()
        .find(|m| m.0 as usize >= nb * bs || m.1 as usize >= nb * bs)
    {
        bail!(
            "shift_kv: move {m:?} outside the cache of {} slots",
            nb * bs
        )
    }
    let mut seen = std::collections::HashSet::with_capacity(moves.len());
    if let Some(m) = moves.iter().find(|m| !seen.insert(m.1)) {
        bail!("shift_kv: destination {} appears twice ({m:?})", m.1)
    }
    Ok((kvh, hd))
}

/// Carries out slot `moves` on both caches, rotating moved K by `rotation`.
pub fn shift_kv(
    k_cache: &Tensor,
    v_cache: &Tensor,
    moves: &[(u32, u32)],
    rotation: &Rotation,
) -> Result<()> {
    let (n_kv_heads, head_dim) = check(k_cache, v_cache, moves, rotation)?;
    if moves.is_empty() {
        return Ok(());
    }
    let op = |rotation| MoveSlots {
        moves,
        rotation,
        n_kv_heads,
        head_dim,
    };
    k_cache.inplace_op1(&op(Some(rotation)))?;
    v_cache.inplace_op1(&op(None))
}

/// Reference for [`shift_kv`] in plain candle ops: gathers every moved row,
/// rotates K with explicit cos/sin arithmetic, and returns new `(K, V)`.
pub fn shift_kv_slow(
    k_cache: &Tensor,
    v_cache: &Tensor,
    moves: &[(u32, u32)],
    rotation: &Rotation,
) -> Result<(Tensor, Tensor)> {
    let (kvh, hd) = check(k_cache, v_cache, moves, rotation)?;
    let t = crate::KvType::of(k_cache)?;
    if t.is_quantized() {
        // What the kernel does row by row: moved K rows dequantized, shifted
        // and quantized again; V rows and the rest as they are.
        let kf = crate::dequantize_cache(k_cache)?;
        let (k, _) = shift_kv_slow(&kf, &kf, moves, rotation)?;
        let (nb, bs, _, _) = crate::cache_geometry(k_cache)?;
        let n = nb * bs;
        let dst: Vec<u32> = moves.iter().map(|m| m.1).collect();
        let dev = k_cache.device();
        let moved_k = crate::quantize_cache(&k, t)?
            .reshape((n, ()))?
            .index_select(&Tensor::new(dst, dev)?, 0)?;
        let src = Tensor::new(moves.iter().map(|m| m.0).collect::<Vec<_>>(), dev)?;
        let moved_v = v_cache.reshape((n, ()))?.index_select(&src, 0)?;
        let mut pick: Vec<u32> = (0..n as u32).collect();
        for (i, m) in moves.iter().enumerate() {
            pick[m.1 as usize] = (n + i) as u32;
        }
        let pick = Tensor::new(pick, dev)?;
        let splice = |c: &Tensor, rows: &Tensor| -> Result<Tensor> {
            Tensor::cat(&[&c.reshape((n, ()))?, rows], 0)?
                .index_select(&pick, 0)?
                .reshape(c.shape())
        };
        return Ok((splice(k_cache, &moved_k)?, splice(v_cache, &moved_v)?));
    }
    let (nb, bs, _, _) = k_cache.dims4()?;
    let n = nb * bs;
    let dev = k_cache.device();
    let src = Tensor::new(moves.iter().map(|m| m.0).collect::<Vec<_>>(), dev)?;
    let mut pick: Vec<u32> = (0..n as u32).collect();
    for (i, m) in moves.iter().enumerate() {
        pick[m.1 as usize] = (n + i) as u32;
    }
    let pick = Tensor::new(pick, dev)?;
    let (cos, sin) = rotation.cos_sin();
    let half = hd / 2;
    let cos = Tensor::new(cos, dev)?;
    let sin = Tensor::new(sin, dev)?;
    let rows = k_cache
        .to_dtype(candle_core::DType::F32)?
        .reshape((n, kvh, hd))?
        .index_select(&src, 0)?;
    // Split into the rotated pairs (x0, x1), each [m, kvh, half].
    let (x0, x1) = match rotation.style {
        crate::RopeStyle::Neox => (rows.narrow(2, 0, half)?, rows.narrow(2, half, half)?),
        crate::RopeStyle::Interleaved => {
            let r = rows.reshape((moves.len(), kvh, half, 2))?;
            (
                r.narrow(3, 0, 1)?.squeeze(3)?,
                r.narrow(3, 1, 1)?.squeeze(3)?,
            )
        }
    };
    let y0 = (x0.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
    let y1 = (x0.broadcast_mul(&sin)? + x1.broadcast_mul(&cos)?)?;
    let rotated = match rotation.style {
        crate::RopeStyle::Neox => Tensor::cat(&[&y0, &y1], 2)?,
        crate::RopeStyle::Interleaved => {
            Tensor::stack(&[&y0, &y1], 3)?.reshape((moves.len(), kvh, hd))?
        }
    };
    let gather = |cache: &Tensor, moved: Tensor| -> Result<Tensor> {
        let flat = cache.reshape((n, kvh, hd))?;
        Tensor::cat(&[&flat, &moved.to_dtype(cache.dtype())?], 0)?
            .index_select(&pick, 0)?
            .reshape(cache.shape())
    };
    let v_rows = v_cache.reshape((n, kvh, hd))?.index_select(&src, 0)?;
    Ok((gather(k_cache, rotated)?, gather(v_cache, v_rows)?))
}

/// Rotates K rows in place, each by its own position delta.
struct RotateSlots<'a> {
    slots: &'a [u32],
    deltas: &'a [i64],
    rotation: &'a Rotation,
    n_kv_heads: usize,
    head_dim: usize,
}

impl RotateSlots<'_> {
    /// The rows that move (nonzero delta), their tables and geometry.
    #[cfg(any(feature = "cuda", all(feature = "metal", target_vendor = "apple")))]
    fn gpu_rows(
        &self,
    ) -> (
        Vec<u32>,
        crate::gpu::RopeTables,
        (usize, usize, crate::RopeStyle),
    ) {
        let (slots, deltas) = crate::gpu::moved_rows(self.slots, self.deltas);
        let tables = crate::gpu::RopeTables::per_delta(&deltas, self.rotation);
        (
            slots,
            tables,
            (self.n_kv_heads, self.head_dim, self.rotation.style),
        )
    }

    fn run<T: KvElem>(&self, cache: &mut [T]) {
        let row = self.n_kv_heads * self.head_dim;
        let units = row / T::PER;
        let mut buf = vec![0f32; row];
        let mut tables: std::collections::HashMap<i64, (Vec<f32>, Vec<f32>)> =
            std::collections::HashMap::new();
        for (&slot, &delta) in self.slots.iter().zip(self.deltas) {
            if delta == 0 {
                continue;
            }
            let r = Rotation {
                delta,
                ..self.rotation.clone()
            };
            let (cos, sin) = tables.entry(delta).or_insert_with(|| r.cos_sin());
            let at = slot as usize * units;
            T::load(&cache[at..at + units], &mut buf);
            for head in buf.chunks_exact_mut(self.head_dim) {
                r.apply(head, cos, sin);
            }
            T::store(&buf, &mut cache[at..at + units]);
        }
    }
}

impl InplaceOp1 for RotateSlots<'_> {
    fn name(&self) -> &'static str {
        "rotate_k"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        with_cache_mut!(s, l, |cache| self.run(cache));
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &Layout) -> Result<()> {
        let (slots, tables, geometry) = self.gpu_rows();
        crate::gpu::cuda::move_rows(s, l, &slots, &slots, &tables, geometry)
    }

    #[cfg(all(feature = "metal", target_vendor = "apple"))]
    fn metal_fwd(&self, s: &mut candle_core::MetalStorage, l: &Layout) -> Result<()> {
        let (slots, tables, geometry) = self.gpu_rows();
        crate::gpu::metal::move_rows(s, l, &slots, &slots, &tables, geometry)
    }
}

pub(crate) fn check_rotate(
    k_cache: &Tensor,
    slots: &[u32],
    deltas: &[i64],
    rotation: &Rotation,
) -> Result<(usize, usize)> {
    let (kvh, hd) = check(k_cache, k_cache, &[], rotation)?;
    let n = k_cache.dim(0)? * k_cache.dim(1)?;
    if slots.len() != deltas.len() {
        bail!(
            "rotate_k: {} slots and {} deltas",
            slots.len(),
            deltas.len()
        )
    }
    if let Some(s) = slots.iter().find(|&&s| s as usize >= n) {
        bail!("rotate_k: slot {s} outside the cache of {n} slots")
    }
    let mut seen = std::collections::HashSet::with_capacity(slots.len());
    if let Some(s) = slots.iter().find(|s| !seen.insert(**s)) {
        bail!("rotate_k: slot {s} appears twice")
    }
    Ok((kvh, hd))
}

/// Rotates the K rows of `slots` in place, row `i` by `deltas[i]` positions
/// (`rotation.delta` is ignored): the cached keys of a position map that
/// changed (SelfExtend's add and divide). Each row is rotated once, so a
/// slot may appear only once.
pub fn rotate_k(
    k_cache: &Tensor,
    slots: &[u32],
    deltas: &[i64],
    rotation: &Rotation,
) -> Result<()> {
    let (n_kv_heads, head_dim) = check_rotate(k_cache, slots, deltas, rotation)?;
    if slots.is_empty() {
        return Ok(());
    }
    k_cache.inplace_op1(&RotateSlots {
        slots,
        deltas,
        rotation,
        n_kv_heads,
        head_dim,
    })
}

/// Reference for [`rotate_k`]: the slots of each delta as in-place moves of
/// [`shift_kv_slow`], one delta after another; a new K tensor.
pub fn rotate_k_slow(
    k_cache: &Tensor,
    slots: &[u32],
    deltas: &[i64],
    rotation: &Rotation,
) -> Result<Tensor> {
    check_rotate(k_cache, slots, deltas, rotation)?;
    let mut k = k_cache.copy()?;
    let mut seen: Vec<i64> = deltas.to_vec();
    seen.sort_unstable();
    seen.dedup();
    for d in seen.into_iter().filter(|&d| d != 0) {
        let moves: Vec<(u32, u32)> = slots
            .iter()
            .zip(deltas)
            .filter(|(_, &x)| x == d)
            .map(|(&s, _)| (s, s))
            .collect();
        let r = Rotation {
            delta: d,
            ..rotation.clone()
        };
        k = shift_kv_slow(&k, &k, &moves, &r)?.0;
    }
    Ok(k)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::seeded_cache;
    use crate::testing::{max_abs_diff, seeded};
    use crate::RopeStyle;
    use crate::{dequantize_cache, KvType};
    use candle_core::DType;

    #[test]
    fn matches_reference_for_both_rope_styles() -> Result<()> {
        // Positions 6..10 move down by 4 (a plan_shift of keep 2, discard 4).
        let moves: Vec<(u32, u32)> = (6..10).map(|p| (p, p - 4)).collect();
        let inv_freq: Vec<f32> = (0..32)
            .map(|i| 10000f32.powf(-(2 * i) as f32 / 64.0))
            .collect();
        for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
            for dtype in KvType::ALL {
                let rot = Rotation {
                    style,
                    inv_freq: inv_freq.clone(),
                    delta: -4,
                };
                let k = seeded_cache(&[3, 4, 2, 64], 11, dtype)?;
                let v = seeded_cache(&[3, 4, 2, 64], 12, dtype)?;
                let (wk, wv) = shift_kv_slow(&k, &v, &moves, &rot)?;
                shift_kv(&k, &v, &moves, &rot)?;
                // Rotations that differ in the last bit may round to the
                // neighbouring step of the cache type.
                let tol = match dtype {
                    KvType::F32 => 1e-6,
                    KvType::Q8_0 => 1.0 / 127.0 + 1e-3,
                    KvType::Q4_0 => 1.0 / 8.0 + 1e-3,
                    _ => 1e-2,
                };
                let (dk, dwk) = (dequantize_cache(&k)?, dequantize_cache(&wk)?);
                assert!(max_abs_diff(&dk, &dwk)? <= tol, "{style:?} {dtype:?}");
                // V moves unchanged, whatever its type.
                assert_eq!(max_abs_diff(&v, &wv)?, 0.0);
            }
        }
        Ok(())
    }

    /// Sources that are also destinations, in any order (ascending, as a
    /// context shift plans them, and reversed or shuffled, where writing in
    /// place would read moved rows): each move reads the cache as it was.
    #[test]
    fn overlapping_moves_in_any_order_match_the_reference() -> Result<()> {
        let inv_freq: Vec<f32> = (0..4)
            .map(|i| 10000f32.powf(-(2 * i) as f32 / 8.0))
            .collect();
        // keep 2, discard 3: positions 5..16 move to 2..13.
        let down: Vec<(u32, u32)> = (5..16).map(|p| (p, p - 3)).collect();
        let mut reversed = down.clone();
        reversed.reverse();
        let mut shuffled = down.clone();
        shuffled.swap(0, 7);
        shuffled.swap(3, 10);
        // A rotation of slots 0..6 by one.
        let cycle: Vec<(u32, u32)> = (0..6).map(|p| (p, (p + 1) % 6)).collect();
        for moves in [down, reversed, shuffled, cycle] {
            for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
                let rot = Rotation {
                    style,
                    inv_freq: inv_freq.clone(),
                    delta: -3,
                };
                let k = seeded(&[4, 4, 2, 8], 21, DType::F32)?;
                let v = seeded(&[4, 4, 2, 8], 22, DType::F32)?;
                let (wk, wv) = shift_kv_slow(&k, &v, &moves, &rot)?;
                shift_kv(&k, &v, &moves, &rot)?;
                assert!(max_abs_diff(&k, &wk)? <= 1e-6, "{style:?} {moves:?}");
                assert_eq!(max_abs_diff(&v, &wv)?, 0.0, "{moves:?}");
            }
        }
        let k = seeded(&[4, 4, 2, 8], 1, DType::F32)?;
        let rot = Rotation {
            style: RopeStyle::Neox,
            inv_freq,
            delta: 1,
        };
        let err = shift_kv(&k, &k.copy()?, &[(1, 3), (2, 3)], &rot).unwrap_err();
        assert!(
            err.to_string().contains("destination 3 appears twice"),
            "{err}"
        );
        Ok(())
    }

    /// Per-slot deltas (several rows per delta, zeros, any order) against
    /// the reference, for every cache type; rotating by a then by b equals
    /// one rotation by a + b.
    #[test]
    fn rotate_k_matches_reference_and_composes() -> Result<()> {
        let inv_freq: Vec<f32> = (0..32)
            .map(|i| 10000f32.powf(-(2 * i) as f32 / 64.0))
            .collect();
        let slots: Vec<u32> = vec![9, 0, 3, 15, 4, 11, 7];
        let deltas: Vec<i64> = vec![-5, 12, -5, 0, -300, 12, 4095];
        for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
            let rot = Rotation {
                style,
                inv_freq: inv_freq.clone(),
                delta: 0,
            };
            for t in KvType::ALL {
                let k = seeded_cache(&[4, 4, 2, 64], 31, t)?;
                let want = rotate_k_slow(&k, &slots, &deltas, &rot)?;
                rotate_k(&k, &slots, &deltas, &rot)?;
                let tol = match t {
                    KvType::F32 => 1e-6,
                    KvType::Q8_0 => 1.0 / 127.0 + 1e-3,
                    KvType::Q4_0 => 1.0 / 8.0 + 1e-3,
                    _ => 1e-2,
                };
                let d = max_abs_diff(&dequantize_cache(&k)?, &dequantize_cache(&want)?)?;
                assert!(d <= tol, "{style:?} {t}: {d}");
            }
            let k = seeded(&[4, 4, 2, 64], 32, DType::F32)?;
            let once = rotate_k_slow(&k, &[1, 2], &[7, -40], &rot)?;
            rotate_k(&k, &[1, 2], &[3, -16], &rot)?;
            rotate_k(&k, &[2, 1], &[-24, 4], &rot)?;
            assert!(max_abs_diff(&k, &once)? < 1e-5);
        }
        let k = seeded(&[4, 4, 2, 64], 1, DType::F32)?;
        let rot = Rotation {
            style: RopeStyle::Neox,
            inv_freq,
            delta: 0,
        };
        assert!(rotate_k(&k, &[1, 1], &[2, 3], &rot).is_err());
        assert!(rotate_k(&k, &[16], &[2], &rot).is_err());
        assert!(rotate_k(&k, &[1], &[2, 3], &rot).is_err());
        Ok(())
    }

    #[test]
    fn rotation_by_delta_equals_rope_at_the_new_position() {
        // R(p - d) x == R(-d) R(p) x, for a single head.
        let inv_freq: Vec<f32> = (0..4)
            .map(|i| 10000f32.powf(-(2 * i) as f32 / 8.0))
            .collect();
        let x: Vec<f32> = (0..8).map(|i| (i as f32 * 0.37).sin()).collect();
        for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
            let rot = |delta| Rotation {
                style,
                inv_freq: inv_freq.clone(),
                delta,
            };
            let apply = |r: &Rotation, v: &mut Vec<f32>| {
                let (c, s) = r.cos_sin();
                r.apply(v, &c, &s);
            };
            let mut at_p = x.clone();
            apply(&rot(37), &mut at_p);
            apply(&rot(-12), &mut at_p);
            let mut direct = x.clone();
            apply(&rot(25), &mut direct);
            for (a, b) in at_p.iter().zip(&direct) {
                assert!((a - b).abs() < 1e-5, "{style:?}: {a} vs {b}");
            }
        }
    }
}
