//! [`StepPool`]: a persistent team of threads for one forward pass.
//!
//! The calling thread is worker 0; `n − 1` pool threads are the others. A
//! forward is one parallel region ([`StepPool::run`]): every worker runs the
//! same closure with its own [`Team`] handle and meets the others at
//! [`Team::barrier`] between phases (a few per layer). Between regions the
//! pool threads spin for a short while (the next decode step usually comes
//! within microseconds) and then park on a condition variable.
//!
//! Work is split statically by worker id, or taken from an atomic counter
//! where each item's arithmetic does not depend on who runs it; either way
//! the results are the same bits for any number of workers.
//!
//! A panic in any worker poisons the region: workers waiting at a barrier
//! unwind too, `run` waits until every worker has left the closure (it
//! borrows the caller's stack) and then resumes the first panic.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle pool thread spins before it parks.
const SPIN: Duration = Duration::from_micros(200);
/// Barrier spins between checks of the clock (and yields after `SPIN`).
const SPIN_CHECK: u32 = 256;

type Job = dyn Fn(&Team) + Sync;

/// A lifetime-erased pointer to the region's closure. `run` keeps the
/// closure alive until every worker has finished with it.
#[derive(Clone, Copy)]
struct JobPtr(*const Job);
// SAFETY: the pointee is `Sync` and outlives every use (see `run`).
unsafe impl Send for JobPtr {}

struct Inner {
    n: usize,
    /// Bumped once per region (and at shutdown).
    epoch: AtomicU64,
    job: Mutex<Option<JobPtr>>,
    /// Pool threads still inside the current region.
    pending: AtomicUsize,
    bar_count: AtomicUsize,
    bar_gen: AtomicUsize,
    poisoned: AtomicBool,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    stop: AtomicBool,
    sleeping: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    done_lock: Mutex<()>,
    done: Condvar,
}

/// Payload of the panic that workers waiting at a barrier raise when
/// another worker panicked (never the one `run` resumes).
struct Poisoned;

/// One worker's view of the region.
pub struct Team<'a> {
    id: usize,
    inner: &'a Inner,
}

impl Team<'_> {
    /// This worker's index, `0..threads()`; 0 is the calling thread.
    pub fn id(&self) -> usize {
        self.id
    }

    pub fn threads(&self) -> usize {
        self.inner.n
    }

    /// `[start, end)` of this worker's share of `units` work units, in
    /// order: the first `units % n` workers take one more.
    pub fn share(&self, units: usize) -> (usize, usize) {
        split(units, self.inner.n, self.id)
    }

    /// Waits until every worker has reached this barrier. Writes made
    /// before it are visible to every worker after it.
    pub fn barrier(&self) {
        let inner = self.inner;
        if inner.n == 1 {
            return;
        }
        let gen = inner.bar_gen.load(Ordering::Acquire);
        if inner.bar_count.fetch_add(1, Ordering::AcqRel) + 1 == inner.n {
            inner.bar_count.store(0, Ordering::Relaxed);
            inner.bar_gen.fetch_add(1, Ordering::AcqRel);
            return;
        }
        let start = Instant::now();
        let mut spins = 0u32;
        while inner.bar_gen.load(Ordering::Acquire) == gen {
            if inner.poisoned.load(Ordering::Acquire) {
                std::panic::panic_any(Poisoned);
            }
            spins += 1;
            if spins.is_multiple_of(SPIN_CHECK) && start.elapsed() > SPIN {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

/// `[start, end)` of part `i` of `units` split into `n` near-equal parts.
pub fn split(units: usize, n: usize, i: usize) -> (usize, usize) {
    let (base, extra) = (units / n, units % n);
    let start = i * base + i.min(extra);
    (start, start + base + usize::from(i < extra))
}

/// A persistent team of `n` workers (the caller and `n − 1` threads).
pub struct StepPool {
    inner: Arc<Inner>,
    handles: Vec<JoinHandle<()>>,
}

impl StepPool {
    /// A pool of `n` workers (at least 1).
    pub fn new(n: usize) -> StepPool {
        let n = n.max(1);
        let inner = Arc::new(Inner {
            n,
            epoch: AtomicU64::new(0),
            job: Mutex::new(None),
            pending: AtomicUsize::new(0),
            bar_count: AtomicUsize::new(0),
            bar_gen: AtomicUsize::new(0),
            poisoned: AtomicBool::new(false),
            panic: Mutex::new(None),
            stop: AtomicBool::new(false),
            sleeping: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            done_lock: Mutex::new(()),
            done: Condvar::new(),
        });
        let handles = (1..n)
            .map(|id| {
                let inner = inner.clone();
                std::thread::Builder::new()
                    .name(format!("tessera-step-{id}"))
                    .spawn(move || worker(&inner, id))
                    .expect("spawning a step-pool thread")
            })
            .collect();
        StepPool { inner, handles }
    }

    pub fn threads(&self) -> usize {
        self.inner.n
    }

    /// Runs `f` on every worker (the caller is worker 0) and returns when
    /// all have finished. A panic in any worker is resumed here, after all
    /// have left `f`.
    pub fn run(&self, f: &(dyn Fn(&Team) + Sync)) {
        let inner = &*self.inner;
        if inner.n > 1 {
            // SAFETY: only the lifetime is erased; the pointer is dropped
            // from `job` and every worker has finished calling it (pending
            // reaches 0) before this function returns or unwinds.
            let ptr: *const Job =
                unsafe { std::mem::transmute(f as *const (dyn Fn(&Team) + Sync)) };
            *inner.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(JobPtr(ptr));
            inner.pending.store(inner.n - 1, Ordering::SeqCst);
            inner.epoch.fetch_add(1, Ordering::SeqCst);
            if inner.sleeping.load(Ordering::SeqCst) > 0 {
                let _g = inner.lock.lock().unwrap_or_else(|e| e.into_inner());
                inner.wake.notify_all();
            }
        }
        let team = Team { id: 0, inner };
        let mine = catch_unwind(AssertUnwindSafe(|| f(&team)));
        if let Err(p) = mine {
            record_panic(inner, p);
        }
        if inner.n > 1 {
            wait_done(inner);
            *inner.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
        if inner.poisoned.swap(false, Ordering::AcqRel) {
            inner.bar_count.store(0, Ordering::Relaxed);
            let p = inner.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
            resume_unwind(p.unwrap_or_else(|| Box::new("a step-pool worker panicked")));
        }
    }
}

fn record_panic(inner: &Inner, p: Box<dyn Any + Send>) {
    if !p.is::<Poisoned>() {
        let mut slot = inner.panic.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            *slot = Some(p);
        }
    }
    inner.poisoned.store(true, Ordering::Release);
}

fn wait_done(inner: &Inner) {
    let start = Instant::now();
    while inner.pending.load(Ordering::Acquire) != 0 {
        if start.elapsed() > SPIN {
            let g = inner.done_lock.lock().unwrap_or_else(|e| e.into_inner());
            if inner.pending.load(Ordering::Acquire) != 0 {
                let _g = inner
                    .done
                    .wait_timeout(g, Duration::from_millis(1))
                    .unwrap_or_else(|e| e.into_inner());
            }
        } else {
            std::hint::spin_loop();
        }
    }
}

fn worker(inner: &Inner, id: usize) {
    let mut seen = 0u64;
    loop {
        // Spin, then park, until the epoch moves.
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if inner.epoch.load(Ordering::Acquire) != seen {
                break;
            }
            spins += 1;
            if spins.is_multiple_of(SPIN_CHECK) && start.elapsed() > SPIN {
                let g = inner.lock.lock().unwrap_or_else(|e| e.into_inner());
                inner.sleeping.fetch_add(1, Ordering::SeqCst);
                let mut g = g;
                while inner.epoch.load(Ordering::SeqCst) == seen {
                    g = inner.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                inner.sleeping.fetch_sub(1, Ordering::SeqCst);
                break;
            }
            std::hint::spin_loop();
        }
        seen = inner.epoch.load(Ordering::Acquire);
        if inner.stop.load(Ordering::Acquire) {
            return;
        }
        let job = *inner.job.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(JobPtr(ptr)) = job {
            let team = Team { id, inner };
            // SAFETY: `run` keeps the closure alive until `pending` is 0.
            let f = unsafe { &*ptr };
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(&team))) {
                record_panic(inner, p);
            }
        }
        if inner.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _g = inner.done_lock.lock().unwrap_or_else(|e| e.into_inner());
            inner.done.notify_all();
        }
    }
}

impl Drop for StepPool {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Release);
        self.inner.epoch.fetch_add(1, Ordering::SeqCst);
        {
            let _g = self.inner.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.inner.wake.notify_all();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// A buffer that the workers of a region write in disjoint parts, with
/// barriers between the phases that write and those that read.
#[derive(Clone, Copy)]
pub struct Shared<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: access goes through the unsafe methods below, whose callers
// promise disjoint writes separated from reads by barriers.
unsafe impl<T: Send> Send for Shared<T> {}
unsafe impl<T: Send> Sync for Shared<T> {}

impl<T> Shared<T> {
    pub fn new(v: &mut [T]) -> Shared<T> {
        Shared {
            ptr: v.as_mut_ptr(),
            len: v.len(),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// # Safety
    /// No other worker writes `start..end` until the next barrier, and no
    /// other worker reads it before then.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn part(&self, start: usize, end: usize) -> &mut [T] {
        assert!(start <= end && end <= self.len, "Shared::part out of range");
        std::slice::from_raw_parts_mut(self.ptr.add(start), end - start)
    }

    /// # Safety
    /// No worker writes the buffer until the next barrier.
    pub unsafe fn all(&self) -> &[T] {
        std::slice::from_raw_parts(self.ptr, self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_worker_runs_and_barriers_order_phases() {
        for n in [1, 2, 3, 5] {
            let pool = StepPool::new(n);
            let mut buf = vec![0usize; n * 4];
            let sh = Shared::new(&mut buf);
            for round in 0..50 {
                pool.run(&|t: &Team| {
                    // Phase 1: each writes its own slot.
                    unsafe { sh.part(t.id(), t.id() + 1)[0] = round + t.id() };
                    t.barrier();
                    // Phase 2: each reads all slots of phase 1.
                    let sum: usize = unsafe { sh.all()[..t.threads()].iter().sum() };
                    t.barrier();
                    unsafe { sh.part(n + t.id(), n + t.id() + 1)[0] = sum };
                });
                let want: usize = (0..n).map(|i| round + i).sum();
                assert!(buf[n..2 * n].iter().all(|&s| s == want), "n={n}");
            }
        }
    }

    #[test]
    fn a_panicking_worker_fails_the_region_and_the_pool_goes_on() {
        let pool = StepPool::new(3);
        for victim in 0..3 {
            let r = catch_unwind(AssertUnwindSafe(|| {
                pool.run(&|t: &Team| {
                    t.barrier();
                    if t.id() == victim {
                        panic!("boom {victim}");
                    }
                    t.barrier();
                    t.barrier();
                })
            }));
            let p = r.expect_err("the region must panic");
            assert_eq!(
                p.downcast_ref::<String>().map(String::as_str),
                Some(&*format!("boom {victim}"))
            );
            // The pool still works.
            let hits = AtomicUsize::new(0);
            pool.run(&|t: &Team| {
                hits.fetch_add(1, Ordering::Relaxed);
                t.barrier();
            });
            assert_eq!(hits.load(Ordering::Relaxed), 3);
        }
    }

    #[test]
    fn parked_workers_wake_up() {
        let pool = StepPool::new(2);
        let hits = AtomicUsize::new(0);
        for _ in 0..3 {
            std::thread::sleep(Duration::from_millis(5));
            pool.run(&|_t: &Team| {
                hits.fetch_add(1, Ordering::Relaxed);
            });
        }
        assert_eq!(hits.load(Ordering::Relaxed), 6);
    }

    #[test]
    fn split_covers_every_unit_once() {
        for units in 0..40 {
            for n in 1..7 {
                let mut next = 0;
                for i in 0..n {
                    let (a, b) = split(units, n, i);
                    assert_eq!(a, next);
                    next = b;
                }
                assert_eq!(next, units);
            }
        }
    }
}
