//! Cache memory on huge pages. A decode step deep in a context reads every
//! cached row of every layer, tens of megabytes spread over the whole
//! pool: on 4 KiB pages most blocks cost a TLB miss and a page walk, and
//! the rows arrive at a fraction of the memory's bandwidth. On 2 MiB pages
//! the whole pool fits in the TLB.

/// Bytes of a huge page (x86-64 and the usual aarch64 kernels).
#[cfg(target_os = "linux")]
const HUGE: usize = 2 << 20;

/// Asks the kernel to back the 2 MiB-aligned part of `v` with huge pages.
/// A hint only (nothing changes without transparent huge pages, or off
/// Linux); it works on pages not yet touched, so give it before the first
/// write.
pub fn advise_huge_pages<T>(v: &[T]) {
    #[cfg(target_os = "linux")]
    {
        let start = v.as_ptr() as usize;
        let end = start + std::mem::size_of_val(v);
        let (a, b) = (start.next_multiple_of(HUGE), end / HUGE * HUGE);
        if b > a {
            // SAFETY: the range lies inside `v`'s allocation; MADV_HUGEPAGE
            // changes no contents.
            unsafe { libc::madvise(a as *mut libc::c_void, b - a, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = v;
}

/// `n` zeros on fresh pages advised huge before their first touch
/// (`vec![0; n]` takes zeroed pages from the system without writing them).
pub fn zeroed_huge<T: Zero>(n: usize) -> Vec<T> {
    let v = T::zeros(n);
    advise_huge_pages(&v);
    v
}

/// Element types whose zero vector comes from zeroed memory.
pub trait Zero: Sized {
    fn zeros(n: usize) -> Vec<Self>;
}

macro_rules! zero_prim {
    ($($t:ty),*) => {$(
        impl Zero for $t {
            fn zeros(n: usize) -> Vec<$t> {
                vec![0; n]
            }
        }
    )*};
}
zero_prim!(u8, u16);

impl Zero for f32 {
    fn zeros(n: usize) -> Vec<f32> {
        vec![0.0; n]
    }
}

/// The 16-bit floats, from a zeroed `u16` vector (same size, alignment
/// and zero bits).
macro_rules! zero_half {
    ($($t:ty),*) => {$(
        impl Zero for $t {
            fn zeros(n: usize) -> Vec<$t> {
                let mut v = std::mem::ManuallyDrop::new(vec![0u16; n]);
                // SAFETY: the type is a transparent u16 (same layout, the
                // same allocation's layout), and zero bits are its zero.
                unsafe { Vec::from_raw_parts(v.as_mut_ptr() as *mut $t, v.len(), v.capacity()) }
            }
        }
    )*};
}
zero_half!(half::f16, half::bf16);

/// `n` bytes of varied values on huge pages, to time reads of.
pub fn read_buffer(n: usize) -> Vec<u8> {
    let mut data = zeroed_huge::<u8>(n);
    for (i, b) in data.iter_mut().enumerate() {
        *b = i as u8;
    }
    data
}

/// Seconds to read all of `d` ([`read_all`]) split among `threads`
/// threads, each its own cache-line-aligned part: the memory's read
/// bandwidth, the roofline of a decode (`tessera bench --scenario
/// roofline`, `examples/tile_stream.rs`).
pub fn timed_read(d: &[u8], threads: usize) -> f64 {
    let part = d
        .len()
        .div_ceil(threads.max(1))
        .next_multiple_of(64)
        .max(64);
    let t = std::time::Instant::now();
    std::thread::scope(|s| {
        for c in d.chunks(part) {
            s.spawn(move || std::hint::black_box(read_all(c)));
        }
    });
    t.elapsed().as_secs_f64()
}

/// A sum over every byte's 64-bit words (so that no load is skipped),
/// with independent accumulators: the loads, not the adds, set the pace.
fn read_all(d: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present.
        return unsafe { read_all_avx2(d) };
    }
    let mut acc = [0u64; 8];
    for ch in d.chunks_exact(64) {
        for (a, w) in acc.iter_mut().zip(ch.chunks_exact(8)) {
            *a = a.wrapping_add(u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
    }
    acc.iter().fold(0, |a, &b| a.wrapping_add(b))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn read_all_avx2(d: &[u8]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_si256(); 4];
    for ch in d.chunks_exact(128) {
        for (j, a) in acc.iter_mut().enumerate() {
            let v = _mm256_loadu_si256(ch.as_ptr().add(32 * j) as *const __m256i);
            *a = _mm256_add_epi64(*a, v);
        }
    }
    let mut out = [0u64; 4];
    let s = _mm256_add_epi64(
        _mm256_add_epi64(acc[0], acc[1]),
        _mm256_add_epi64(acc[2], acc[3]),
    );
    _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, s);
    out.iter().fold(0, |a, &b| a.wrapping_add(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_zeros_are_zeros_of_every_type() {
        let n = (3 << 20) + 17;
        assert!(zeroed_huge::<u8>(n).iter().all(|&x| x == 0));
        assert!(zeroed_huge::<f32>(n).iter().all(|&x| x.to_bits() == 0));
        let h = zeroed_huge::<half::f16>(n);
        assert_eq!(h.len(), n);
        assert!(h.iter().all(|x| x.to_bits() == 0));
        assert!(zeroed_huge::<half::bf16>(5)
            .iter()
            .all(|x| x.to_bits() == 0));
        // Advising a slice that holds no whole huge page does nothing.
        advise_huge_pages(&[1u8; 100]);
    }
}
