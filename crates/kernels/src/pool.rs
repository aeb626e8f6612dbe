//! [`StepPool`]: a persistent team of threads for one forward pass.
//!
//! The calling thread is worker 0; `n − 1` pool threads are the others. A
//! forward is one parallel region ([`StepPool::run`]): every worker of the
//! region's team runs the same closure with its own [`Team`] handle and
//! meets the others at [`Team::barrier`] between phases (a few per layer).
//! Between regions the pool threads spin for a short while (the next decode
//! step usually comes within microseconds) and then park on a condition
//! variable.
//!
//! Work is split statically by worker id, or taken from an atomic counter
//! where each item's arithmetic does not depend on who runs it; either way
//! the results are the same bits for any number of workers.
//!
//! **The team shrinks when the machine is busy.** Every worker of a region
//! meets the others at each barrier, so one worker the OS takes off its
//! core stalls them all (two threads on two cores beside one busy process:
//! decode fell to a fifth of its idle speed). Each worker measures, per
//! region, how long it was off the CPU (the region's wall time to its end
//! less its own thread CPU time); when the largest share of that over at
//! least [`WINDOW`] of regions passes [`LOST`], the next regions run with
//! one worker fewer, and the left-out threads park. After a back-off
//! ([`PROBE`], doubling while probes fail) the team grows by one again to
//! see whether the load has gone, unless the kernel's count of runnable
//! threads says that no core is free for it (`/proc/loadavg`: the load
//! has not gone, and a probe would stall the whole team for a window to
//! learn it; the probe waits another back-off). [`crate::tuning::Tuning::fixed_team`]
//! keeps every worker. (Linux measures thread CPU time; elsewhere the
//! team is fixed.)
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
/// Region time over which the team's lost share is judged. Long enough
/// that the kernel's own workers do not count as load: on an idle 2-core
/// VM, two threads of pure arithmetic lost up to 37% of a 20 ms window
/// (writeback and per-CPU kernel workers taking a core for a few ms; 2.5%
/// of the windows passed 15%, and a 20 ms window shrank a decode's team
/// about once a second), and at most 10.5% of a 100 ms window.
pub const WINDOW: Duration = Duration::from_millis(100);
/// The share of a window's wall time that the worst worker may spend off
/// the CPU before the team shrinks. A busy process beside a two-worker
/// team takes 27–69% of each 20 ms window (mean 55%), and shrinking pays
/// from about `1/n` of a team of `n` on (the region's time, `W/n` plus
/// the time lost, against `W/(n − 1)`), less where the stalls at
/// successive barriers add up.
pub const LOST: f64 = 0.25;
/// The first wait before a shrunk team tries one worker more.
pub const PROBE: Duration = Duration::from_millis(100);
/// The longest wait between probes.
const PROBE_MAX: Duration = Duration::from_secs(4);
/// Bits of [`Inner::gen`] holding the region's team size.
const TEAM_BITS: u32 = 16;

type Job = dyn Fn(&Team) + Sync;

/// A lifetime-erased pointer to the region's closure. `run` keeps the
/// closure alive until every worker has finished with it.
#[derive(Clone, Copy)]
struct JobPtr(*const Job);
// SAFETY: the pointee is `Sync` and outlives every use (see `run`).
unsafe impl Send for JobPtr {}

struct Inner {
    n: usize,
    /// The region counter (bumped once per region and at shutdown) above
    /// [`TEAM_BITS`], the region's team size below: one word, so a worker
    /// reads both at once.
    gen: AtomicU64,
    job: Mutex<Option<JobPtr>>,
    /// Pool threads still inside the current region.
    pending: AtomicUsize,
    bar_count: AtomicUsize,
    bar_gen: AtomicUsize,
    poisoned: AtomicBool,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    stop: AtomicBool,
    /// Parked workers that the last region had (a left-out worker parks
    /// uncounted, and is woken only when the team grows).
    sleeping: AtomicUsize,
    /// The last region's team size.
    last_team: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    done_lock: Mutex<()>,
    done: Condvar,
    /// Since `base`, when the current region started (ns).
    base: Instant,
    region_start: AtomicU64,
    /// The most any worker of the current region was off the CPU (ns).
    lost: AtomicU64,
    adapt: Mutex<Adapt>,
}

/// The team size in a [`Inner::gen`] word.
fn team_of(gen: u64) -> usize {
    (gen & ((1 << TEAM_BITS) - 1)) as usize
}

impl Inner {
    /// Starts the next region (or shutdown) with `team` workers. Only the
    /// caller of `run` (or `drop`) writes the word.
    fn next_gen(&self, team: usize) {
        let g = self.gen.load(Ordering::Relaxed) >> TEAM_BITS;
        self.gen
            .store(((g + 1) << TEAM_BITS) | team as u64, Ordering::SeqCst);
    }

    fn now_ns(&self) -> u64 {
        self.base.elapsed().as_nanos() as u64
    }

    /// Records how long this worker was off the CPU in the region, given
    /// its thread CPU time at its start.
    fn account(&self, cpu0: Option<u64>) {
        let (Some(c0), Some(c1)) = (cpu0, thread_cpu_ns()) else {
            return;
        };
        let wall = self
            .now_ns()
            .saturating_sub(self.region_start.load(Ordering::Relaxed));
        self.lost.fetch_max(
            wall.saturating_sub(c1.saturating_sub(c0)),
            Ordering::Relaxed,
        );
    }
}

/// The team size's controller (see the module docs).
#[derive(Debug)]
struct Adapt {
    fixed: bool,
    team: usize,
    wall: u64,
    lost: u64,
    next_probe: Option<Instant>,
    backoff: Duration,
    grown_at: Option<Instant>,
    shrinks: u64,
}

impl Adapt {
    fn new(n: usize, fixed: bool) -> Adapt {
        Adapt {
            fixed,
            team: n,
            wall: 0,
            lost: 0,
            next_probe: None,
            backoff: PROBE,
            grown_at: None,
            shrinks: 0,
        }
    }

    /// Takes in one region's wall time and its worst worker's time off the
    /// CPU; returns the next region's team size. `free` says, when a probe
    /// is due, how many cores no other thread wants (`None`: unknown).
    fn after(
        &mut self,
        n: usize,
        wall: u64,
        lost: u64,
        now: Instant,
        free: impl FnOnce(usize) -> Option<usize>,
    ) -> usize {
        if self.fixed || n == 1 {
            return self.team;
        }
        self.wall += wall;
        self.lost += lost;
        if self.wall >= WINDOW.as_nanos() as u64 {
            let share = self.lost as f64 / self.wall as f64;
            self.wall = 0;
            self.lost = 0;
            if share > LOST && self.team > 1 {
                // A probe that failed soon after it grew the team waits
                // twice as long before the next.
                let failed = self
                    .grown_at
                    .is_some_and(|g| now - g < Duration::from_secs(1));
                self.backoff = if failed {
                    (self.backoff * 2).min(PROBE_MAX)
                } else {
                    PROBE
                };
                self.team -= 1;
                self.shrinks += 1;
                self.grown_at = None;
                self.next_probe = Some(now + self.backoff);
                return self.team;
            }
        }
        if self.team < n && self.next_probe.is_some_and(|p| now >= p) {
            if free(self.team) == Some(0) {
                self.next_probe = Some(now + self.backoff);
                return self.team;
            }
            self.team += 1;
            self.grown_at = Some(now);
            self.wall = 0;
            self.lost = 0;
            self.next_probe = (self.team < n).then(|| now + self.backoff);
        }
        self.team
    }
}

/// Cores that no thread wants beside a team of `team` running workers:
/// the online cores less the kernel's runnable threads (the fourth field
/// of `/proc/loadavg`, which counts this team's), or `None` where the OS
/// does not say. A container sees the whole host's counts and cores, so
/// the answer there is the host's; the team's own time off the CPU still
/// decides whether it shrinks.
fn free_cores(team: usize) -> Option<usize> {
    #[cfg(target_os = "linux")]
    {
        let text = std::fs::read_to_string("/proc/loadavg").ok()?;
        let field = text.split_whitespace().nth(3)?;
        let running: usize = field.split('/').next()?.parse().ok()?;
        // SAFETY: sysconf has no preconditions.
        let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
        let online = usize::try_from(online).ok().filter(|&c| c > 0)?;
        let others = running.saturating_sub(team);
        Some(online.saturating_sub(others + team))
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = team;
        None
    }
}

/// This thread's CPU time (ns), where the OS measures it.
fn thread_cpu_ns() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: a valid clock id and a valid out-pointer.
        let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        (r == 0).then(|| ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// Payload of the panic that workers waiting at a barrier raise when
/// another worker panicked (never the one `run` resumes).
struct Poisoned;

/// One worker's view of the region.
pub struct Team<'a> {
    id: usize,
    /// Workers in this region.
    n: usize,
    inner: &'a Inner,
}

impl Team<'_> {
    /// This worker's index, `0..threads()`; 0 is the calling thread.
    pub fn id(&self) -> usize {
        self.id
    }

    /// Workers in this region (at most the pool's, fewer while the
    /// machine is busy).
    pub fn threads(&self) -> usize {
        self.n
    }

    /// `[start, end)` of this worker's share of `units` work units, in
    /// order: the first `units % n` workers take one more.
    pub fn share(&self, units: usize) -> (usize, usize) {
        split(units, self.n, self.id)
    }

    /// Waits until every worker has reached this barrier. Writes made
    /// before it are visible to every worker after it.
    pub fn barrier(&self) {
        let inner = self.inner;
        if self.n == 1 {
            return;
        }
        let gen = inner.bar_gen.load(Ordering::Acquire);
        if inner.bar_count.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
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

/// What [`StepPool::stats`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    /// Workers of the pool.
    pub threads: usize,
    /// Workers the next region will use.
    pub team: usize,
    /// Times the team has shrunk since the pool started.
    pub shrinks: u64,
}

impl StepPool {
    /// A pool of `n` workers (at least 1; at most 65,535).
    pub fn new(n: usize) -> StepPool {
        StepPool::with_policy(n, crate::tuning::get().fixed_team)
    }

    /// As [`StepPool::new`], the team fixed at `n` when `fixed`.
    pub fn with_policy(n: usize, fixed: bool) -> StepPool {
        let n = n.clamp(1, (1 << TEAM_BITS) - 1);
        let inner = Arc::new(Inner {
            n,
            gen: AtomicU64::new(n as u64),
            job: Mutex::new(None),
            pending: AtomicUsize::new(0),
            bar_count: AtomicUsize::new(0),
            bar_gen: AtomicUsize::new(0),
            poisoned: AtomicBool::new(false),
            panic: Mutex::new(None),
            stop: AtomicBool::new(false),
            sleeping: AtomicUsize::new(0),
            last_team: AtomicUsize::new(n),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            done_lock: Mutex::new(()),
            done: Condvar::new(),
            base: Instant::now(),
            region_start: AtomicU64::new(0),
            lost: AtomicU64::new(0),
            adapt: Mutex::new(Adapt::new(n, fixed || thread_cpu_ns().is_none())),
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

    /// Workers of the pool (the most any region uses).
    pub fn threads(&self) -> usize {
        self.inner.n
    }

    pub fn stats(&self) -> PoolStats {
        let a = self.inner.adapt.lock().unwrap_or_else(|e| e.into_inner());
        PoolStats {
            threads: self.inner.n,
            team: a.team,
            shrinks: a.shrinks,
        }
    }

    /// Runs `f` on every worker of this region's team (the caller is
    /// worker 0) and returns when all have finished. A panic in any worker
    /// is resumed here, after all have left `f`.
    pub fn run(&self, f: &(dyn Fn(&Team) + Sync)) {
        let inner = &*self.inner;
        let team = inner.adapt.lock().unwrap_or_else(|e| e.into_inner()).team;
        let cpu0 = thread_cpu_ns();
        let t0 = inner.now_ns();
        inner.region_start.store(t0, Ordering::Relaxed);
        inner.lost.store(0, Ordering::Relaxed);
        if team > 1 {
            // SAFETY: only the lifetime is erased; the pointer is dropped
            // from `job` and every worker has finished calling it (pending
            // reaches 0) before this function returns or unwinds.
            let ptr: *const Job =
                unsafe { std::mem::transmute(f as *const (dyn Fn(&Team) + Sync)) };
            *inner.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(JobPtr(ptr));
            inner.pending.store(team - 1, Ordering::SeqCst);
            inner.next_gen(team);
            let grew = team > inner.last_team.swap(team, Ordering::Relaxed);
            if grew || inner.sleeping.load(Ordering::SeqCst) > 0 {
                let _g = inner.lock.lock().unwrap_or_else(|e| e.into_inner());
                inner.wake.notify_all();
            }
        } else {
            inner.last_team.store(1, Ordering::Relaxed);
        }
        let me = Team {
            id: 0,
            n: team,
            inner,
        };
        let mine = catch_unwind(AssertUnwindSafe(|| f(&me)));
        if let Err(p) = mine {
            record_panic(inner, p);
        }
        inner.account(cpu0);
        if team > 1 {
            wait_done(inner);
            *inner.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
        let poisoned = inner.poisoned.swap(false, Ordering::AcqRel);
        if !poisoned {
            // (A panicking region's unwinding says nothing of the load.)
            let wall = inner.now_ns().saturating_sub(t0);
            let lost = inner.lost.load(Ordering::Relaxed);
            inner.adapt.lock().unwrap_or_else(|e| e.into_inner()).after(
                inner.n,
                wall,
                lost,
                Instant::now(),
                free_cores,
            );
        }
        if poisoned {
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
    // The word as `with_policy` set it (not a load: the first region may
    // have started before this thread did).
    let mut seen = inner.n as u64;
    // Whether the last region had this worker: if not, it parks at once
    // rather than spin on a core the team gave up.
    let mut spin = true;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        let g = loop {
            let g = inner.gen.load(Ordering::Acquire);
            if g != seen {
                break g;
            }
            spins += 1;
            if !spin || (spins.is_multiple_of(SPIN_CHECK) && start.elapsed() > SPIN) {
                let mut lock = inner.lock.lock().unwrap_or_else(|e| e.into_inner());
                if spin {
                    inner.sleeping.fetch_add(1, Ordering::SeqCst);
                }
                while inner.gen.load(Ordering::SeqCst) == seen {
                    lock = inner.wake.wait(lock).unwrap_or_else(|e| e.into_inner());
                }
                if spin {
                    inner.sleeping.fetch_sub(1, Ordering::SeqCst);
                }
                continue;
            }
            std::hint::spin_loop();
        };
        seen = g;
        if inner.stop.load(Ordering::Acquire) {
            return;
        }
        let team = team_of(g);
        // Not in this region's team: `pending` does not count this
        // worker, and the region may already be over.
        spin = id < team;
        if !spin {
            continue;
        }
        let cpu0 = thread_cpu_ns();
        let job = *inner.job.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(JobPtr(ptr)) = job {
            let me = Team { id, n: team, inner };
            // SAFETY: `run` keeps the closure alive until `pending` is 0.
            let f = unsafe { &*ptr };
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(&me))) {
                record_panic(inner, p);
            }
        }
        inner.account(cpu0);
        if inner.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _g = inner.done_lock.lock().unwrap_or_else(|e| e.into_inner());
            inner.done.notify_all();
        }
    }
}

impl Drop for StepPool {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Release);
        self.inner.next_gen(self.inner.n);
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
            // Fixed: every worker of the pool runs every region.
            let pool = StepPool::with_policy(n, true);
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
        let pool = StepPool::with_policy(3, true);
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

    fn adapt(n: usize) -> Adapt {
        Adapt::new(n, false)
    }

    /// A window of regions of 1 ms each, the worst worker off the CPU for
    /// `lost` of every millisecond; the team size after it.
    fn window(a: &mut Adapt, n: usize, lost: f64, now: Instant) -> usize {
        let ms = WINDOW.as_millis() as u64;
        let mut team = a.team;
        for i in 0..ms {
            team = a.after(
                n,
                1_000_000,
                (lost * 1e6) as u64,
                now + Duration::from_millis(i),
                |_| None,
            );
        }
        team
    }

    #[test]
    fn the_team_shrinks_under_load_and_probes_back_with_a_growing_backoff() {
        let t0 = Instant::now();
        let mut a = adapt(4);
        // Idle: 2% lost keeps every worker.
        assert_eq!(window(&mut a, 4, 0.02, t0), 4);
        // Busy: one worker fewer per window while the loss lasts.
        assert_eq!(window(&mut a, 4, 0.4, t0), 3);
        assert_eq!(window(&mut a, 4, 0.4, t0), 2);
        assert_eq!(a.shrinks, 2);
        // Nothing changes before the probe is due ...
        let t1 = t0 + PROBE / 2;
        assert_eq!(window(&mut a, 4, 0.0, t1), 2);
        // ... then one worker more; it fails at once, so the next probe
        // waits twice as long.
        let t2 = t0 + PROBE + WINDOW;
        assert_eq!(a.after(4, 1, 0, t2, |_| None), 3);
        assert_eq!(window(&mut a, 4, 0.4, t2), 2);
        assert_eq!(a.backoff, PROBE * 2);
        assert_eq!(a.after(4, 1, 0, t2 + PROBE, |_| None), 2, "not yet");
        let t3 = t2 + PROBE * 2 + WINDOW;
        assert_eq!(a.after(4, 1, 0, t3, |_| None), 3);
        // The load has gone: the team stays, and grows again later.
        assert_eq!(window(&mut a, 4, 0.01, t3), 3);
        assert_eq!(a.after(4, 1, 0, t3 + PROBE * 3, |_| None), 4);
        assert_eq!(window(&mut a, 4, 0.01, t3 + PROBE * 3), 4);
        // Never below one worker, and a fixed team never moves.
        let mut b = adapt(2);
        for _ in 0..5 {
            window(&mut b, 2, 0.9, t0);
        }
        assert_eq!(b.team, 1);
        let mut c = Adapt::new(2, true);
        assert_eq!(window(&mut c, 2, 0.9, t0), 2);
    }

    #[test]
    fn a_probe_waits_while_no_core_is_free() {
        let t0 = Instant::now();
        let mut a = adapt(2);
        assert_eq!(window(&mut a, 2, 0.4, t0), 1);
        // Due, but the other threads want every core: no probe, and the
        // next is a back-off later (the back-off itself unchanged).
        let due = t0 + PROBE + WINDOW;
        assert_eq!(a.after(2, 1, 0, due, |team| Some(team - 1)), 1);
        assert_eq!(a.next_probe, Some(due + PROBE));
        assert_eq!(a.backoff, PROBE);
        assert_eq!(a.after(2, 1, 0, due + PROBE / 2, |_| Some(1)), 1, "not yet");
        // A core is free: the probe runs.
        assert_eq!(a.after(2, 1, 0, due + PROBE, |_| Some(1)), 2);
        // Where the OS does not say, probes run as before.
        let mut b = adapt(2);
        window(&mut b, 2, 0.4, t0);
        assert_eq!(b.after(2, 1, 0, due, |_| None), 2);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn free_cores_reads_the_kernels_counts() {
        // This test's own thread is running, so at most every core but
        // one is free.
        let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) } as usize;
        let free = free_cores(1).expect("Linux has /proc/loadavg");
        assert!(free < online, "{free} of {online}");
    }

    // (Only where the OS measures thread CPU time; elsewhere the team is
    // fixed.)
    #[cfg(target_os = "linux")]
    #[test]
    fn more_workers_than_cores_shrink_the_team_and_results_stay_the_same() {
        // Each worker spins a fixed amount of CPU work per region; with
        // four times as many workers as cores (at least 8), they are off
        // the CPU most of the time, and the team must shrink.
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        let n = (4 * cores).max(8);
        let pool = StepPool::with_policy(n, false);
        let mut sums = Vec::new();
        for _ in 0..400 {
            let total = AtomicU64::new(0);
            pool.run(&|t: &Team| {
                let (a, b) = t.share(4096);
                let mut acc = 0u64;
                for u in a..b {
                    for k in 0..200u64 {
                        acc = acc.wrapping_add(std::hint::black_box(u as u64 * k));
                    }
                }
                t.barrier();
                total.fetch_add(acc, Ordering::Relaxed);
            });
            sums.push(total.load(Ordering::Relaxed));
            if pool.stats().shrinks > 0 && sums.len() > 50 {
                break;
            }
        }
        assert!(
            sums.windows(2).all(|w| w[0] == w[1]),
            "results differ between team sizes"
        );
        let st = pool.stats();
        assert!(st.shrinks > 0, "{st:?}");
        // A pool whose team is fixed keeps every worker.
        let fixed = StepPool::with_policy(n, true);
        for _ in 0..50 {
            fixed.run(&|t: &Team| t.barrier());
        }
        assert_eq!(fixed.stats().team, n);
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
