//! Allocation benchmark: carve against raw bumpalo, preallocated buffers (the write
//! floor), `Vec` on the default allocator, mimalloc and jemalloc, in one process with
//! the variants interleaved after warm-up.
//!
//! Workloads:
//! - `small`: 64 f32 arrays of 256 B … 64 KiB per iteration, one element touched;
//! - `training`: the 19 arrays of an MLP 784-1024-1024-10 forward + backward pass at
//!   batch 128 (≈ 12 MB), every byte written once.
//!
//! `cold_first_iter_ns` and `cold_first_iter_faults` (carve and bumpalo) are the first
//! iteration of a fresh arena, measured in fresh child processes (median of 9) so that
//! no earlier run has faulted the memory in. `fresh_pages` is the cost of the page
//! faults alone: one anonymous mapping of 4 KiB pages made ahead of time (not timed),
//! and the iteration's arrays laid out in it with the same touches. An allocator that
//! hands out fresh 4 KiB pages cannot beat it; one that uses huge pages can, where
//! the iteration touches most of each huge page (the training step).
//!
//! `std` runs in a fresh child process of its own (warm-up, then the same rounds):
//! glibc adapts its mmap and trim thresholds to what the process freed before, and in
//! the shared process the other variants' frees raise them so far that the heap is
//! never trimmed, which a loop allocating with `Vec` alone does not see. The shared
//! process's figure is reported too, as `std_shared_heap`.
//!
//! Extra variants: `carve_view` (carve's ndarray-view API), `carve_engine` (the
//! engine's fast path alone) and `carve_planned` (a member of a plan group replaying its
//! plan: every allocation in a window of the planned arena; issue 13's goal is ≤ 1.3×
//! bumpalo per allocation on `small`).
//!
//! Run: `cargo run --release --example alloc_compare -- [--json] [--rounds N]` (from the
//! repository root or `benches/`; `--help` for the flags).

use std::alloc::{GlobalAlloc, Layout};
use std::collections::BTreeMap;
use std::hint::black_box;
use std::mem::MaybeUninit;
use std::process::Command;
use std::time::Instant;

use carve::{Workspace, WorkspaceConfig};
use clap::Parser;

mod workloads;

// ---------------------------------------------------------------------------------
// Command line.

/// Allocation benchmark: carve against bumpalo, preallocated buffers, `Vec` on glibc's
/// malloc, mimalloc and jemalloc, on a small-array workload and a 12 MB training step.
/// Prints a table per workload (and with --json one JSON line at the end); see
/// benches/README.md.
#[derive(Parser, Debug)]
#[command(name = "alloc_compare")]
struct Args {
    /// Print one JSON object with every figure as the last line.
    #[arg(long)]
    json: bool,
    /// Measured rounds per variant (interleaved; the median round is reported).
    #[arg(long, value_name = "N", default_value_t = 30, value_parser = parse_rounds, allow_negative_numbers = true)]
    rounds: usize,
    /// Internal: one cold first iteration in this fresh process (VARIANT WORKLOAD).
    #[arg(long, num_args = 2, value_names = ["VARIANT", "WORKLOAD"], hide = true, conflicts_with = "std_child")]
    cold_child: Option<Vec<String>>,
    /// Internal: the `std` variant alone in this fresh process (WORKLOAD ROUNDS PER_ROUND).
    #[arg(long, num_args = 3, value_names = ["WORKLOAD", "ROUNDS", "PER_ROUND"], hide = true)]
    std_child: Option<Vec<String>>,
    /// Internal: `carve_planned` against `bumpalo` in this fresh process (WORKLOAD ROUNDS
    /// PER_ROUND).
    #[arg(long, num_args = 3, value_names = ["WORKLOAD", "ROUNDS", "PER_ROUND"], hide = true)]
    planned_child: Option<Vec<String>>,
}

fn parse_rounds(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".to_string()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("'{s}' is not a positive integer ({e})")),
    }
}

/// A usage error: one line on stderr, exit code 2 (as clap's own errors).
fn usage_error(message: &str) -> ! {
    eprintln!("alloc_compare: error: {message} (see --help)");
    std::process::exit(2);
}

/// The workload named on a child's command line.
fn workload(name: &str) -> Workload {
    match name {
        "small" => small(),
        "training" => training(),
        _ => usage_error(&format!("unknown workload '{name}' (small, training)")),
    }
}

/// A count on a child's command line.
fn count(what: &str, value: &str) -> usize {
    parse_rounds(value).unwrap_or_else(|e| usage_error(&format!("{what}: {e}")))
}

// ---------------------------------------------------------------------------------
// Counting the default allocator's calls on this thread: carve's counting allocator
// (`carve::alloc_check`), which counts `alloc`, `alloc_zeroed` and `realloc` per thread.

#[global_allocator]
static GLOBAL: carve::alloc_check::CountingAllocator = carve::alloc_check::CountingAllocator::system();

/// Heap allocation calls of the calling thread so far.
fn heap_allocs() -> u64 {
    carve::alloc_check::thread_counts().allocations
}

fn minor_faults() -> u64 {
    // SAFETY: getrusage writes into the struct we pass; zeroed is a valid rusage.
    unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_THREAD, &mut usage);
        usage.ru_minflt as u64
    }
}

// ---------------------------------------------------------------------------------
// Workloads.

#[derive(Clone, Copy, PartialEq)]
enum Touch {
    One,
    All,
}

struct Workload {
    name: &'static str,
    /// Array shapes (rows, cols) of f32.
    shapes: Vec<(usize, usize)>,
    touch: Touch,
}

fn small() -> Workload {
    let shapes = workloads::small_sizes().into_iter().map(|n| (1, n)).collect();
    Workload { name: "small", shapes, touch: Touch::One }
}

fn training() -> Workload {
    Workload { name: "training", shapes: workloads::training_shapes(), touch: Touch::All }
}

#[inline(always)]
fn touch(slice: &mut [MaybeUninit<f32>], how: Touch) {
    match how {
        Touch::One => slice[0] = MaybeUninit::new(1.0),
        Touch::All => slice.fill(MaybeUninit::new(1.0)),
    }
    black_box(slice.as_ptr());
}

// ---------------------------------------------------------------------------------
// Variants.

trait Variant {
    fn name(&self) -> &'static str;
    /// One iteration; returns the heap allocations it made outside the global allocator.
    fn iteration(&mut self, w: &Workload) -> u64;
}

/// carve through its slice API: the same thing raw bumpalo hands out.
struct Carve(Workspace);
impl Variant for Carve {
    fn name(&self) -> &'static str {
        "carve"
    }
    fn iteration(&mut self, w: &Workload) -> u64 {
        let scope = self.0.enter().expect("enter");
        carve_arrays(&scope, w);
        0
    }
}

/// The arrays of one iteration from `scope`: one function for `carve` and
/// `carve_planned`, so that both run the same machine code for it (where a loop lands
/// moves its time by several nanoseconds on this machine, as much as the plan's
/// bookkeeping), and their difference is what the plan adds.
#[inline(never)]
fn carve_arrays(scope: &carve::Scope<'_>, w: &Workload) {
    for &(r, c) in &w.shapes {
        touch(scope.slice_uninit::<f32>(r * c).expect("allocation"), w.touch);
    }
}

/// carve planned (`WorkspaceMode::Planned`'s machinery): one member of a plan group,
/// each iteration started and finished on the group, so that after the recorded first
/// iteration every allocation comes from a window of the planned arena, which is
/// reserved at `carve`'s initial size (16 MB, so that both serve from huge pages). The
/// slice API as `carve`; the iteration's start and finish are counted in its time.
struct CarvePlanned(carve::workspace_core::planned::PlanGroup, std::rc::Rc<Workspace>);
impl Variant for CarvePlanned {
    fn name(&self) -> &'static str {
        "carve_planned"
    }
    fn iteration(&mut self, w: &Workload) -> u64 {
        self.0.start_iteration(0).expect("start");
        {
            let scope = self.1.enter().expect("enter");
            carve_arrays(&scope, w);
        }
        let on_plan = self.0.finish_iteration().expect("finish");
        // The first iteration is recorded; every later one replays the plan.
        assert!(on_plan || self.0.stats().recorded_iterations == 1 && self.0.stats().planned_iterations == 0);
        0
    }
}

fn carve_planned() -> CarvePlanned {
    let group = carve::workspace_core::planned::PlanGroup::new("BENCH_PLANNED");
    let config = WorkspaceConfig::builder()
        .learning(carve::LearningPolicy::None)
        .spill(carve::SpillPolicy::External)
        .build()
        .expect("valid configuration");
    let member = group.workspace("BENCH_PLANNED_MEMBER", &config).expect("workspace");
    // The arena `carve` has (its initial size), so that both serve from huge pages.
    group.reserve(16 << 20).expect("arena");
    CarvePlanned(group, member)
}

/// carve's engine fast path alone (what device backends build on): the floor under
/// the safe APIs above.
struct CarveEngine(Workspace);
impl Variant for CarveEngine {
    fn name(&self) -> &'static str {
        "carve_engine"
    }
    fn iteration(&mut self, w: &Workload) -> u64 {
        let scope = self.0.enter().expect("enter");
        for &(r, c) in &w.shapes {
            let (base, offset) = self.0.engine().try_alloc_fast(r * c * 4, 4).expect("the arena is large enough");
            // SAFETY: the engine reserved `r * c * 4` bytes at `offset` in the arena
            // block at `base` for this cycle, aligned to at least 16.
            let slice =
                unsafe { std::slice::from_raw_parts_mut(base.as_ptr().add(offset).cast::<MaybeUninit<f32>>(), r * c) };
            touch(slice, w.touch);
        }
        drop(scope);
        0
    }
}

/// carve through its ndarray view API (shape, strides and the view's lifetime).
struct CarveView(Workspace);
impl Variant for CarveView {
    fn name(&self) -> &'static str {
        "carve_view"
    }
    fn iteration(&mut self, w: &Workload) -> u64 {
        let scope = self.0.enter().expect("enter");
        for &shape in &w.shapes {
            let mut view = scope.uninit::<f32, _>(shape).expect("allocation");
            touch(view.as_slice_mut().expect("contiguous"), w.touch);
        }
        0
    }
}

struct Bumpalo(bumpalo::Bump);
impl Variant for Bumpalo {
    fn name(&self) -> &'static str {
        "bumpalo"
    }
    fn iteration(&mut self, w: &Workload) -> u64 {
        self.0.reset();
        for &(r, c) in &w.shapes {
            let layout = Layout::array::<f32>(r * c).expect("layout");
            let ptr = self.0.alloc_layout(layout).cast::<MaybeUninit<f32>>();
            // SAFETY: bumpalo returned `r * c` f32 slots, ours until the next reset.
            let slice = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), r * c) };
            touch(slice, w.touch);
        }
        0
    }
}

/// The 4 KiB page-fault cost of a first iteration: an anonymous mapping made before the
/// iteration, large enough for all its arrays at 64-byte alignment, carved in order.
/// The iteration costs only the faults of its first touches.
struct FreshPages(memmap2::MmapMut);
impl FreshPages {
    fn new(w: &Workload) -> FreshPages {
        let bytes: usize = w.shapes.iter().map(|&(r, c)| (r * c * 4).next_multiple_of(64)).sum();
        FreshPages(memmap2::MmapMut::map_anon(bytes).expect("anonymous mapping"))
    }
}
impl Variant for FreshPages {
    fn name(&self) -> &'static str {
        "fresh_pages"
    }
    fn iteration(&mut self, w: &Workload) -> u64 {
        let mut rest: &mut [u8] = &mut self.0;
        for &(r, c) in &w.shapes {
            let (array, tail) = std::mem::take(&mut rest).split_at_mut((r * c * 4).next_multiple_of(64));
            let floats: &mut [f32] = bytemuck::cast_slice_mut(&mut array[..r * c * 4]);
            match w.touch {
                Touch::One => floats[0] = 1.0,
                Touch::All => floats.fill(1.0),
            }
            black_box(floats.as_ptr());
            rest = tail;
        }
        0
    }
}

struct Prealloc(Vec<Vec<MaybeUninit<f32>>>);
impl Variant for Prealloc {
    fn name(&self) -> &'static str {
        "prealloc"
    }
    fn iteration(&mut self, w: &Workload) -> u64 {
        for buffer in &mut self.0 {
            touch(buffer, w.touch);
        }
        0
    }
}

/// `Vec` on the default allocator. Every array of an iteration stays alive until the
/// iteration ends, as activations kept for backprop do; the holder is reused.
struct Std(&'static str, Vec<Vec<f32>>);
impl Variant for Std {
    fn name(&self) -> &'static str {
        self.0
    }
    fn iteration(&mut self, w: &Workload) -> u64 {
        for &(r, c) in &w.shapes {
            let mut v = Vec::<f32>::with_capacity(r * c);
            touch(&mut v.spare_capacity_mut()[..r * c], w.touch);
            self.1.push(v);
        }
        self.1.clear();
        0
    }
}

/// An allocator called directly (not installed as the global allocator); as with
/// `Std`, all arrays of an iteration live until it ends.
struct Direct<A: GlobalAlloc>(&'static str, A, Vec<(*mut u8, Layout)>);
impl<A: GlobalAlloc> Variant for Direct<A> {
    fn name(&self) -> &'static str {
        self.0
    }
    fn iteration(&mut self, w: &Workload) -> u64 {
        for &(r, c) in &w.shapes {
            let layout = Layout::array::<f32>(r * c).expect("layout");
            // SAFETY: non-zero layout; the block is written, then freed below with the
            // same layout.
            unsafe {
                let ptr = self.1.alloc(layout);
                assert!(!ptr.is_null(), "out of memory");
                touch(std::slice::from_raw_parts_mut(ptr.cast::<MaybeUninit<f32>>(), r * c), w.touch);
                self.2.push((ptr, layout));
            }
        }
        for (ptr, layout) in self.2.drain(..) {
            // SAFETY: allocated above by the same allocator with this layout.
            unsafe { self.1.dealloc(ptr, layout) };
        }
        w.shapes.len() as u64
    }
}

fn variants(w: &Workload) -> Vec<Box<dyn Variant>> {
    vec![
        Box::new(Carve(Workspace::new("BENCH", WorkspaceConfig::default()).expect("workspace"))),
        Box::new(CarveEngine(
            Workspace::new(
                "BENCH_ENGINE",
                WorkspaceConfig::builder()
                    .learning(carve::LearningPolicy::None)
                    .initial_size(16 << 20)
                    .build()
                    .expect("valid configuration"),
            )
            .expect("workspace"),
        )),
        Box::new(CarveView(Workspace::new("BENCH_VIEW", WorkspaceConfig::default()).expect("workspace"))),
        Box::new(carve_planned()),
        Box::new(Bumpalo(bumpalo::Bump::new())),
        Box::new(Prealloc(w.shapes.iter().map(|&(r, c)| vec![MaybeUninit::uninit(); r * c]).collect())),
        Box::new(Std("std_shared_heap", Vec::with_capacity(w.shapes.len()))),
        Box::new(Direct("mimalloc", mimalloc::MiMalloc, Vec::with_capacity(w.shapes.len()))),
        Box::new(Direct("jemalloc", tikv_jemallocator::Jemalloc, Vec::with_capacity(w.shapes.len()))),
    ]
}

// ---------------------------------------------------------------------------------
// Measurement.

#[derive(Default, Clone)]
struct Totals {
    iterations: u64,
    /// Nanoseconds per iteration of each round; the median is reported, which is
    /// robust against rounds disturbed by other work on the machine.
    round_ns: Vec<f64>,
    faults: f64,
    heap_allocs: f64,
    /// First iteration in a fresh process: (nanoseconds, minor faults).
    cold: Option<(f64, f64)>,
}

fn measure(w: &Workload, rounds: usize, per_round: usize) -> BTreeMap<&'static str, Totals> {
    measure_variants(w, variants(w), rounds, per_round)
}

/// [`measure`] of the variants `vs`.
fn measure_variants(
    w: &Workload,
    mut vs: Vec<Box<dyn Variant>>,
    rounds: usize,
    per_round: usize,
) -> BTreeMap<&'static str, Totals> {
    // Everything the harness needs is allocated before the first iteration: a small
    // allocation made between iterations would land in the free top of glibc's heap and
    // pin it, so `std` would see a heap that is never trimmed, which a plain training
    // loop does not (see benches/README.md).
    let mut totals: BTreeMap<&'static str, Totals> =
        vs.iter().map(|v| (v.name(), Totals { round_ns: Vec::with_capacity(rounds), ..Totals::default() })).collect();
    for v in &mut vs {
        for _ in 0..per_round.max(5) {
            v.iteration(w); // warm-up: learning, chunk growth, allocator caches
        }
    }
    for _ in 0..rounds {
        // Alternate the order so that no variant always follows the same neighbour.
        vs.reverse();
        for v in &mut vs {
            let faults = minor_faults();
            let allocs = heap_allocs();
            let start = Instant::now();
            let mut direct = 0;
            for _ in 0..per_round {
                direct += v.iteration(w);
            }
            let time = start.elapsed();
            let faults = minor_faults() - faults;
            let allocs = heap_allocs() - allocs + direct;
            let t = totals.get_mut(v.name()).expect("every variant has totals");
            t.round_ns.push(time.as_nanos() as f64 / per_round as f64);
            t.faults += faults as f64;
            t.heap_allocs += allocs as f64;
            t.iterations += per_round as u64;
        }
    }
    totals
}

/// Runs in a fresh child process: one first iteration on a fresh arena, printed as
/// "nanoseconds faults".
fn cold_child(variant: &str, workload_name: &str) {
    let w = workload(workload_name);
    let mut v: Box<dyn Variant> = match variant {
        "carve" => Box::new(Carve(Workspace::new("COLD", WorkspaceConfig::default()).expect("workspace"))),
        "fresh_pages" => Box::new(FreshPages::new(&w)),
        "bumpalo" => Box::new(Bumpalo(bumpalo::Bump::new())),
        _ => usage_error(&format!("unknown cold variant '{variant}' (carve, bumpalo, fresh_pages)")),
    };
    let faults = minor_faults();
    let start = Instant::now();
    v.iteration(&w);
    let ns = start.elapsed().as_nanos();
    println!("{ns} {}", minor_faults() - faults);
}

/// Runs in a fresh child process: the `std` variant alone, warm-up then `rounds`
/// rounds, printed as "median-ns-per-iteration faults-per-iteration allocs-per-iteration".
///
/// glibc's malloc adapts its mmap and trim thresholds to what the process has freed
/// before, so in the shared process `std` sees a heap shaped by the other variants
/// (bumpalo releasing its smaller chunks raises both thresholds above the training
/// step's footprint, and the heap is never trimmed). A program whose loop allocates
/// with `Vec` alone is measured here.
fn std_child(workload_name: &str, rounds: usize, per_round: usize) {
    let w = workload(workload_name);
    let mut v = Std("std", Vec::with_capacity(w.shapes.len()));
    let mut round_ns = Vec::with_capacity(rounds);
    for _ in 0..per_round.max(5) {
        v.iteration(&w);
    }
    let (faults, allocs) = (minor_faults(), heap_allocs());
    for _ in 0..rounds {
        let start = Instant::now();
        for _ in 0..per_round {
            v.iteration(&w);
        }
        round_ns.push(start.elapsed().as_nanos() as f64 / per_round as f64);
    }
    let n = (rounds * per_round) as f64;
    let (faults, allocs) = ((minor_faults() - faults) as f64 / n, (heap_allocs() - allocs) as f64 / n);
    round_ns.sort_by(f64::total_cmp);
    println!("{} {faults} {allocs}", round_ns[round_ns.len() / 2]);
}

/// Runs in a fresh child process: `carve_planned` and `bumpalo` interleaved as in
/// [`measure`], printed as their median nanoseconds per iteration.
///
/// The planned variant's cost per iteration differs from one process to the next by
/// more than the others' (by up to a third on the 2-core machine of benches/README.md,
/// with no cause found in its code: where the process's memory lies is the suspect), so
/// its ratio is taken in several processes.
fn planned_child(workload_name: &str, rounds: usize, per_round: usize) {
    let w = workload(workload_name);
    let vs: Vec<Box<dyn Variant>> = vec![Box::new(carve_planned()), Box::new(Bumpalo(bumpalo::Bump::new()))];
    let totals = measure_variants(&w, vs, rounds, per_round);
    let median = |name: &str| {
        let mut rounds = totals[name].round_ns.clone();
        rounds.sort_by(f64::total_cmp);
        rounds[rounds.len() / 2]
    };
    println!("{} {}", median("carve_planned"), median("bumpalo"));
}

/// `carve_planned / bumpalo` per iteration in each of `processes` fresh processes.
fn planned_ratios(workload: &str, rounds: usize, per_round: usize, processes: usize) -> Vec<f64> {
    (0..processes)
        .map(|_| {
            let f = child(&["--planned-child", workload, &rounds.to_string(), &per_round.to_string()], 2);
            f[0] / f[1]
        })
        .collect()
}

/// The `std` variant measured by [`std_child`]: (ns per iteration, faults, allocations).
fn std_isolated(workload: &str, rounds: usize, per_round: usize) -> (f64, f64, f64) {
    let f = child(&["--std-child", workload, &rounds.to_string(), &per_round.to_string()], 3);
    (f[0], f[1], f[2])
}

/// Runs this program again with `args` and returns the `n` numbers it prints; a child
/// that fails or prints something else ends this process with its message.
fn child(args: &[&str], n: usize) -> Vec<f64> {
    let fail = |why: String| -> ! {
        eprintln!("alloc_compare: error: the child process `{}` {why}", args.join(" "));
        std::process::exit(1);
    };
    let exe = std::env::current_exe().unwrap_or_else(|e| fail(format!("cannot be started: {e}")));
    let out = Command::new(exe).args(args).output().unwrap_or_else(|e| fail(format!("cannot be started: {e}")));
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        fail(format!("failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim()));
    }
    let numbers: Vec<f64> = stdout.split_whitespace().filter_map(|f| f.parse().ok()).collect();
    if numbers.len() != n {
        fail(format!("printed '{}', not {n} numbers", stdout.trim()));
    }
    numbers
}

/// Median first-iteration time and faults over `samples` fresh processes.
fn cold(variant: &str, workload: &str, samples: usize) -> (f64, f64) {
    let mut runs: Vec<(f64, f64)> = (0..samples)
        .map(|_| {
            let f = child(&["--cold-child", variant, workload], 2);
            (f[0], f[1])
        })
        .collect();
    runs.sort_by(|a, b| a.0.total_cmp(&b.0));
    runs[runs.len() / 2]
}

/// Processes the planned variant's ratio is taken in.
const PLANNED_PROCESSES: usize = 7;

fn main() {
    let args = match Args::try_parse() {
        Ok(args) => args,
        // --help and --version print and exit 0, as clap does.
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => {
            // clap's message is several lines (context, usage, a tip); its first line says
            // what is wrong.
            let text = e.to_string();
            let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("invalid arguments");
            usage_error(first.trim().trim_start_matches("error: "));
        }
    };
    if let Some(child) = &args.cold_child {
        cold_child(&child[0], &child[1]);
        return;
    }
    if let Some(child) = &args.std_child {
        std_child(&child[0], count("--std-child ROUNDS", &child[1]), count("--std-child PER_ROUND", &child[2]));
        return;
    }
    if let Some(child) = &args.planned_child {
        planned_child(
            &child[0],
            count("--planned-child ROUNDS", &child[1]),
            count("--planned-child PER_ROUND", &child[2]),
        );
        return;
    }
    let (json, rounds) = (args.json, args.rounds);

    let mut report = serde_json::Map::new();
    for (w, per_round) in [(small(), 2000), (training(), 20)] {
        let mut totals = measure(&w, rounds, per_round);
        for name in ["carve", "bumpalo"] {
            totals.get_mut(name).expect("variant").cold = Some(cold(name, w.name, 9));
        }
        let floor = cold("fresh_pages", w.name, 9);
        let (ns, faults, allocs) = std_isolated(w.name, rounds, per_round);
        totals.insert("std", Totals { iterations: 1, round_ns: vec![ns], faults, heap_allocs: allocs, cold: None });
        let arrays = w.shapes.len() as f64;
        println!("\nworkload {} ({} arrays per iteration)", w.name, w.shapes.len());
        println!(
            "{:<14} {:>12} {:>12} {:>14} {:>12} {:>14}",
            "variant", "ns/iter", "ns/alloc", "faults/iter", "allocs/iter", "cold first iteration (ns)"
        );
        let mut entry = serde_json::Map::new();
        for name in [
            "carve",
            "carve_engine",
            "carve_view",
            "carve_planned",
            "bumpalo",
            "prealloc",
            "std",
            "std_shared_heap",
            "mimalloc",
            "jemalloc",
        ] {
            let t = &totals[name];
            let n = t.iterations as f64;
            let mut rounds = t.round_ns.clone();
            rounds.sort_by(f64::total_cmp);
            let ns_per_iter = rounds[rounds.len() / 2];
            let mut obj = serde_json::json!({
                "ns_per_iter": ns_per_iter,
                "ns_per_alloc": ns_per_iter / arrays,
                "minor_faults_per_iter": t.faults / n,
                "heap_allocs_per_iter": t.heap_allocs / n,
            });
            if let Some((ns, faults)) = t.cold {
                obj["cold_first_iter_ns"] = serde_json::json!(ns);
                obj["cold_first_iter_faults"] = serde_json::json!(faults);
            }
            println!(
                "{:<14} {:>12.0} {:>12.2} {:>14.2} {:>12.2} {:>14}",
                name,
                ns_per_iter,
                ns_per_iter / arrays,
                t.faults / n,
                t.heap_allocs / n,
                t.cold.map_or("-".to_string(), |(ns, faults)| format!("{ns:.0} ({faults:.0} faults)"))
            );
            entry.insert(name.to_string(), obj);
        }
        println!("{:<14} {:>68}", "fresh_pages", format!("{:.0} ({:.0} faults)", floor.0, floor.1));
        entry.insert(
            "fresh_pages".into(),
            serde_json::json!({"cold_first_iter_ns": floor.0, "cold_first_iter_faults": floor.1}),
        );
        // The planned variant's ratio over several processes (see `planned_child`).
        let mut ratios = planned_ratios(w.name, rounds, per_round, PLANNED_PROCESSES);
        ratios.sort_by(f64::total_cmp);
        let planned_median = ratios[ratios.len() / 2];
        println!(
            "carve_planned/bumpalo per iteration in {PLANNED_PROCESSES} processes: median {planned_median:.2} (from {:.2} to {:.2})",
            ratios[0],
            ratios[ratios.len() - 1]
        );
        entry.insert(
            "carve_planned_processes".into(),
            serde_json::json!({"ratios_to_bumpalo": ratios, "median_ratio_to_bumpalo": planned_median}),
        );
        let get = |v: &str, k: &str| entry[v][k].as_f64().unwrap_or(f64::NAN);
        let best_malloc =
            ["std", "mimalloc", "jemalloc"].iter().map(|v| get(v, "ns_per_alloc")).fold(f64::INFINITY, f64::min);
        println!(
            "ratios: carve/bumpalo per alloc {:.2}, carve_planned/bumpalo {:.2}, best malloc/carve {:.1}, carve/prealloc {:.3}, std/carve {:.1}, cold carve/bumpalo {:.2}",
            get("carve", "ns_per_alloc") / get("bumpalo", "ns_per_alloc"),
            get("carve_planned", "ns_per_alloc") / get("bumpalo", "ns_per_alloc"),
            best_malloc / get("carve", "ns_per_alloc"),
            get("carve", "ns_per_iter") / get("prealloc", "ns_per_iter"),
            get("std", "ns_per_iter") / get("carve", "ns_per_iter"),
            get("carve", "cold_first_iter_ns") / get("bumpalo", "cold_first_iter_ns"),
        );
        report.insert(w.name.to_string(), serde_json::Value::Object(entry));
    }
    if json {
        println!("{}", serde_json::Value::Object(report));
    }
}
