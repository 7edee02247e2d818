//! The scheduler: turns the loop program into an ordered list of fused kernels and extern calls.
//! Fusion is greedy in program order: each loop node joins the earlier kernel it shares the
//! most data with, if the joint iteration plan is legal and no dependency would run backwards;
//! otherwise it starts a kernel. Buffers used only inside one kernel are never allocated.
//! Every decision is logged with its reason.

mod complex;
mod concat;
mod decision;
pub use decision::{Decision, KernelId, NewKernelReason, Rejection};
mod inplace;
mod order;
mod plan;
pub mod simplify;
mod split;
mod variance;
mod welford;

pub use complex::{complex_as_real, component_type};
use plan::{Joined, PlanBuilder};
pub use plan::{KernelNode, KernelPlan, LocalRead, LoopGroup};
pub use split::{split_reductions, SplitConfig, GPU_SPLIT};
pub use welford::welford_variances;

use crate::loop_ir::*;
use std::cell::Cell;
use std::collections::HashSet;
use std::fmt::Write as _;

#[derive(Clone, Debug)]
pub struct FusedKernel {
    pub name: String,
    pub plan: KernelPlan,
}

#[derive(Clone, Debug)]
pub enum Item {
    Kernel(FusedKernel),
    Extern(usize),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    /// Allocated by the wrapper (or provided as input / by an extern call).
    Allocated,
    /// Lives only in registers of one kernel.
    Local,
    /// Lives in a scratch row of one kernel: written by one loop group and read back at the
    /// same elements by a later group of the same outer iteration (a softmax's exponentials),
    /// it never reaches memory beyond the row the iteration works on.
    Row,
}

#[derive(Clone, Debug)]
pub struct Schedule {
    pub program: LoopProgram,
    pub items: Vec<Item>,
    pub storage: Vec<Storage>,
    pub decisions: Vec<Decision>,
    /// How many times fusion placed a node into a kernel plan, tried or kept: its work, which
    /// grows with the nodes and their candidates, not with the size of the kernels they join
    /// (tests pin it on wide graphs).
    pub placements: usize,
}

/// How far back a node looks for a kernel to join (bounds compile time on big graphs).
const FUSION_WINDOW: usize = 32;
/// Outputs this small make a node "small". A small node also looks past the window, at the
/// kernels that write what it reads: graph outputs are lowered last, so a batch norm's
/// running-statistics updates and saved statistics would otherwise each run as a kernel of their
/// own at the end of the graph (running it early keeps a small output alive longer, which costs
/// nothing worth counting). A small node that shares no data with any kernel joins the kernel
/// before it when that one is small too: launches, not bytes, are what small kernels cost.
const SMALL_OUTPUT_BYTES: i64 = 256 << 10;
/// The most buffers one kernel may touch: each is a parameter of its function, and the C++
/// wrapper calls kernels through ctypes, which takes at most 1024 arguments (2,000 small
/// outputs side by side once made a kernel of 4,000 that no call could reach).
const MAX_KERNEL_BUFFERS: usize = 512;

/// What a kernel backend asks of the scheduler.
#[derive(Clone, Copy, Debug)]
pub struct ScheduleOptions {
    /// Kernels are named `{prefix}_{poi|red}_fused_{origins}_{index}` after the backend.
    pub prefix: &'static str,
    /// Split reductions with too few outputs to fill the device into two stages (a GPU's).
    pub split: Option<SplitConfig>,
    /// Address complex buffers as pairs of reals (a backend without complex types).
    pub complex_as_real: bool,
    /// Take variances over more than this many elements in one pass (Welford), so that their
    /// two reductions fuse into one loop (a backend whose long rows do not fit its registers).
    pub welford_min_len: Option<i64>,
    /// Keep a buffer that one loop group writes and a later group of the same kernel reads back
    /// at the same elements in a scratch row of at most this many elements (`Storage::Row`; a
    /// backend whose kernels have stack arrays).
    pub row_scratch: Option<i64>,
}

impl ScheduleOptions {
    /// The C++ backend's: whole reductions, complex values as they are.
    /// A softmax over rows of 4096 floats kept its exponentials in a buffer as large as its
    /// input (64 MB at 4096 rows: written, read back, and freshly faulted in at every call):
    /// 94 ms against Inductor's 58 ms, whose kernel keeps one row in a local array. 8192
    /// elements (32 KB of float) stay in L1/L2 and far inside a thread's stack.
    pub const CPP: ScheduleOptions =
        ScheduleOptions { prefix: "cpp", split: None, complex_as_real: false, welford_min_len: None, row_scratch: Some(8192) };
}

/// Schedules for the C++ backend (kernel names `cpp_*`).
pub fn schedule(program: LoopProgram) -> Result<Schedule, SchedulerError> {
    schedule_for(program, &ScheduleOptions::CPP)
}

/// Schedules `program` for a backend; apart from the options' rewrites, the schedule does not
/// depend on the backend.
pub fn schedule_for(mut program: LoopProgram, opts: &ScheduleOptions) -> Result<Schedule, SchedulerError> {
    let mut decisions = Vec::new();
    for pass in program_passes(opts) {
        decisions.extend((pass.run)(&mut program, opts));
    }
    fuse(program, opts, decisions)
}

/// A rewrite of the loop program before fusion. The driver runs each as a stage of its own:
/// timed, its program dumped (`FERROCORE_DEBUG_DIR`: `ir_after_<name>.txt`) and verified (debug
/// builds); it returns its decisions (the `fusion` log).
pub struct ProgramPass {
    pub name: &'static str,
    pub run: fn(&mut LoopProgram, &ScheduleOptions) -> Vec<String>,
}

/// The rewrites before fusion that a backend's options ask for, in the order they run.
pub fn program_passes(opts: &ScheduleOptions) -> Vec<ProgramPass> {
    let mut passes = vec![ProgramPass {
        name: "dead_nodes",
        run: |p, _| simplify::eliminate_dead_nodes(p).into_iter().map(|name| format!("dead: {name} is never read; removed")).collect(),
    }];
    if opts.complex_as_real {
        passes.push(ProgramPass { name: "complex_as_real", run: |p, _| complex_as_real(p) });
    }
    passes.push(ProgramPass { name: "inline_concat", run: |p, _| concat::inline_concat_readers(p) });
    passes.push(ProgramPass { name: "direct_reads", run: |p, _| direct_reads(p) });
    passes.push(ProgramPass {
        name: "simplify_loops",
        run: |p, _| {
            for i in 0..p.nodes.len() {
                p.nodes[i] = simplify::simplify_loops(&p.nodes[i]);
            }
            Vec::new()
        },
    });
    if opts.welford_min_len.is_some() {
        passes.push(ProgramPass { name: "welford", run: |p, o| welford_variances(p, o.welford_min_len.unwrap_or(0), o.split.as_ref()) });
    }
    if opts.split.is_some() {
        passes.push(ProgramPass { name: "split", run: |p, o| o.split.as_ref().map(|c| split_reductions(p, c)).unwrap_or_default() });
    }
    // nodes with no output elements do no work
    passes.push(ProgramPass {
        name: "drop_empty",
        run: |p, _| {
            let empty: Vec<bool> = p.nodes.iter().map(|n| n.ranges.iter().product::<i64>() == 0).collect();
            p.steps.retain(|s| !matches!(s, Step::Node(i) if empty[*i]));
            Vec::new()
        },
    });
    passes
}

/// Gathers at loop positions as plain loads in every node but a template's (whose values have
/// roles: its backend reads the bias's own), `LoopBody::with_direct_reads`.
fn direct_reads(p: &mut LoopProgram) -> Vec<String> {
    let mut out = Vec::new();
    for node in p.nodes.iter_mut().filter(|n| n.template.is_none()) {
        if let Some(body) = node.body.with_direct_reads(&node.var_ranges()) {
            node.body = body;
            out.push(format!(
                "direct reads: {} reads at loop positions are plain loads, their proven index checks gone",
                p.buffers[node.output.0 as usize].name
            ));
        }
    }
    out
}

/// Fusion of a rewritten program into kernels, then their order, each buffer's storage and the
/// in-place reuse of dying buffers (stage `scheduling`); `decisions`: the earlier passes'.
pub fn fuse(program: LoopProgram, opts: &ScheduleOptions, rewrites: Vec<String>) -> Result<Schedule, SchedulerError> {
    let prefix = opts.prefix;
    let mut decisions: Vec<Decision> = rewrites.into_iter().map(Decision::Rewrite).collect();

    // Which item (by position in `slots`) produces each buffer.
    let mut producer: Vec<SlotList> = vec![SlotList::default(); program.buffers.len()];
    // and which items read each graph input (a write into an input waits for all of them)
    let mut input_readers: Vec<SlotList> = vec![SlotList::default(); program.buffers.len()];
    // and which kernels read each buffer (where a graph output may join far back)
    let mut readers: Vec<SlotList> = vec![SlotList::default(); program.buffers.len()];
    let is_input = |b: BufferId| matches!(program.buffer(b).source, BufferSource::Input(_));
    let returned = returned_buffers(&program);
    let placed = Cell::new(0);
    let mut slots: Vec<Slot> = Vec::new();
    for step in program.steps.clone() {
        match step {
            Step::Extern(e) => {
                for b in &program.externs[e].outputs {
                    producer[b.0 as usize].add(slots.len());
                }
                for b in program.externs[e].input_buffers() {
                    if is_input(b) {
                        input_readers[b.0 as usize].add(slots.len());
                    }
                    readers[b.0 as usize].add(slots.len());
                }
                slots.push(Slot::Extern(e));
            }
            Step::Node(n) => {
                let node = &program.nodes[n];
                let out_name = program.buffer(node.output).name.clone();
                if let Some((head, _)) = node.attention_result() {
                    // (written by the head's kernel, as its template computes it)
                    let si = producer[head.0 as usize].latest.filter(|&si| matches!(slots[si], Slot::Kernel(_)));
                    let Some(si) = si else {
                        return Err(SchedulerError { message: format!("{out_name}: no kernel computes {}", program.buffer(head).name) });
                    };
                    if let Slot::Kernel(k) = &mut slots[si] {
                        let with = member_names(&program, &k.members);
                        decisions.push(Decision::Fuse {
                            buffer: out_name,
                            kernel: KernelId(si),
                            with,
                            shared_bytes: output_bytes(&program, n),
                        });
                        k.attach(&program, &returned, n);
                    }
                    producer[node.output.0 as usize].add(si);
                    continue;
                }
                if node.is_scatter() {
                    decisions.push(Decision::Scatter { buffer: out_name.clone() });
                }
                let near = Neighbours { producer: &producer, input_readers: &input_readers, readers: &readers, placed: &placed };
                let (best, rejected) = choose_kernel(&program, &slots, &near, &returned, n, &mut decisions);
                let slot = best.as_ref().map_or(slots.len(), |c| c.slot);
                for (b, _) in node.reads() {
                    if is_input(b) {
                        input_readers[b.0 as usize].add(slot);
                    }
                    readers[b.0 as usize].add(slot);
                }
                match best {
                    Some(Choice { slot: si, score, joined }) => {
                        if let Slot::Kernel(k) = &mut slots[si] {
                            let with = member_names(&program, &k.members);
                            decisions.push(Decision::Fuse { buffer: out_name, kernel: KernelId(si), with, shared_bytes: score });
                            k.add(&program, &returned, n, joined);
                        }
                        producer[node.output.0 as usize].add(si);
                    }
                    None => match PlanBuilder::build(&program, &[n], &placed) {
                        Ok(plan) => {
                            let reason = if node.is_matrix_product() {
                                NewKernelReason::MatrixProduct
                            } else if node.attention().is_some() {
                                NewKernelReason::Attention
                            } else if rejected {
                                NewKernelReason::EveryFusionRejected
                            } else {
                                NewKernelReason::SharesNothing
                            };
                            decisions.push(Decision::NewKernel { buffer: out_name.clone(), kernel: KernelId(slots.len()), reason });
                            producer[node.output.0 as usize].add(slots.len());
                            slots.push(Slot::Kernel(Box::new(KernelSlot::new(&program, &returned, n, plan))));
                        }
                        Err(why) => return Err(SchedulerError { message: format!("{out_name} cannot be planned as a kernel: {why}") }),
                    },
                }
            }
        }
    }

    let mut items = Vec::new();
    let mut kernel_index = 0;
    // each slot's position among the kernels (fusion decided about slots)
    let mut kernel_of_slot = Vec::new();
    for slot in slots {
        kernel_of_slot.push(kernel_index);
        match slot {
            Slot::Extern(e) => items.push(Item::Extern(e)),
            Slot::Kernel(k) => {
                let plan = k.plan.into_plan();
                let name = kernel_name(&program, &k.members, &plan, prefix, kernel_index);
                kernel_index += 1;
                items.push(Item::Kernel(FusedKernel { name, plan }));
            }
        }
    }
    let mut decisions: Vec<Decision> = decisions.into_iter().map(|d| d.renumbered(|KernelId(si)| KernelId(kernel_of_slot[si]))).collect();
    decisions.extend(order::sink_steps(&program, &mut items).into_iter().map(Decision::Placement));
    let storage = plan_storage(&program, &items, opts.row_scratch, &mut decisions);
    let mut schedule = Schedule { program, items, storage, decisions, placements: placed.get() };
    let reused = inplace::reuse_dying_buffers(&mut schedule);
    schedule.decisions.extend(reused.into_iter().map(Decision::Placement));
    Ok(schedule)
}

#[derive(Debug, Clone)]
pub struct SchedulerError {
    pub message: String,
}

impl std::fmt::Display for SchedulerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "scheduler: {}", self.message)
    }
}
impl std::error::Error for SchedulerError {}

/// A kernel or an extern call, in schedule order, while fusion is still deciding.
enum Slot {
    Kernel(Box<KernelSlot>),
    Extern(usize),
}

/// A kernel while fusion grows it, with what deciding whether a node joins it asks, kept up to
/// date as nodes join: every question costs time in the joining node, not in the kernel's size.
struct KernelSlot {
    /// Its nodes, in order.
    members: Vec<usize>,
    plan: PlanBuilder,
    /// The buffers its nodes read or write.
    touched: HashSet<BufferId>,
    /// Whether a node scatters (then nothing joins it).
    scatter: bool,
    /// Whether every node's output is small and none scatters.
    all_small: bool,
    /// Σ over its nodes writing a large temporary of that temporary's bytes.
    large_temp_bytes: i64,
}

impl KernelSlot {
    fn new(p: &LoopProgram, returned: &[bool], n: usize, plan: PlanBuilder) -> KernelSlot {
        let mut k = KernelSlot { members: Vec::new(), plan, touched: HashSet::new(), scatter: false, all_small: true, large_temp_bytes: 0 };
        k.note(p, returned, n);
        k
    }

    fn add(&mut self, p: &LoopProgram, returned: &[bool], n: usize, joined: Joined) {
        self.plan.apply(p, joined);
        self.note(p, returned, n);
    }

    /// Adds a further result of the kernel's template (`Template::AttentionResult`).
    fn attach(&mut self, p: &LoopProgram, returned: &[bool], n: usize) {
        self.plan.attach(p, n);
        self.note(p, returned, n);
    }

    fn note(&mut self, p: &LoopProgram, returned: &[bool], n: usize) {
        let node = &p.nodes[n];
        self.members.push(n);
        self.touched.insert(node.output);
        self.touched.extend(node.reads().into_iter().map(|(b, _)| b));
        self.scatter |= node.is_scatter();
        self.all_small &= !node.is_scatter() && output_bytes(p, n) <= SMALL_OUTPUT_BYTES;
        if !returned[node.output.0 as usize] && output_bytes(p, n) > SMALL_OUTPUT_BYTES {
            self.large_temp_bytes += output_bytes(p, n);
        }
    }
}

/// The slots that write (or read) one buffer, and the latest of them. A slot is listed again
/// only after another one (a buffer many nodes of one kernel read lists that kernel once).
#[derive(Clone, Debug, Default)]
struct SlotList {
    slots: Vec<usize>,
    latest: Option<usize>,
}

impl SlotList {
    fn add(&mut self, slot: usize) {
        if self.slots.last() != Some(&slot) {
            self.slots.push(slot);
        }
        self.latest = self.latest.max(Some(slot));
    }
}

/// The names of a kernel's outputs for the decision log, the first few of a wide kernel.
fn member_names(p: &LoopProgram, members: &[usize]) -> String {
    const SHOWN: usize = 8;
    let mut s = String::new();
    for (i, m) in members.iter().take(SHOWN).enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        s.push_str(&p.buffer(p.nodes[*m].output).name);
    }
    if members.len() > SHOWN {
        let _ = write!(s, " and {} more", members.len() - SHOWN);
    }
    s
}

/// The kernel a node joins: its slot, the bytes it shares with it, and the joint plan.
struct Choice {
    slot: usize,
    score: i64,
    joined: Joined,
}

/// Per buffer: whether the graph returns it.
pub(super) fn returned_buffers(p: &LoopProgram) -> Vec<bool> {
    let mut returned = vec![false; p.buffers.len()];
    for o in &p.outputs {
        if let OutputValue::Buffer(b) | OutputValue::View { buf: b, .. } = o {
            returned[b.0 as usize] = true;
        }
    }
    returned
}

fn buffer_bytes(p: &LoopProgram, b: BufferId) -> i64 {
    let l = &p.buffer(b).layout;
    l.numel() * l.dtype.itemsize() as i64
}

fn output_bytes(p: &LoopProgram, node: usize) -> i64 {
    buffer_bytes(p, p.nodes[node].output)
}

/// Per buffer, the slots that write it, the slots that read it if it is a graph input, and the
/// slots that read it.
struct Neighbours<'a> {
    producer: &'a [SlotList],
    input_readers: &'a [SlotList],
    readers: &'a [SlotList],
    /// Nodes placed into kernel plans so far.
    placed: &'a Cell<usize>,
}

/// The earlier kernel node `n` joins, if any: the one it shares the most data with among the
/// last `FUSION_WINDOW` slots and (for a small or returned output) the kernels writing or
/// reading what it reads; else, for a small node, the kernel just before it when that one is
/// small too. Also says whether some fusion was tried and rejected (each rejection is logged).
fn choose_kernel(
    p: &LoopProgram,
    slots: &[Slot],
    near: &Neighbours,
    returned: &[bool],
    n: usize,
    decisions: &mut Vec<Decision>,
) -> (Option<Choice>, bool) {
    let node = &p.nodes[n];
    if node.is_scatter() || node.template.is_some() {
        // a scatter updates a buffer filled by earlier writers: it runs after all of them,
        // alone, and nothing joins its kernel; a template heads its kernel
        return (None, false);
    }
    let reads: Vec<BufferId> = node.reads().into_iter().map(|(b, _)| b).collect();
    // earliest slot this node may run in: after every producer of what it reads
    let producer = near.producer;
    let mut earliest = reads.iter().filter_map(|b| producer[b.0 as usize].latest).max().unwrap_or(0);
    // a write into a graph input runs after every other kernel that reads the input, and after
    // earlier writes of it; it may join the last kernel reading the input where those reads are
    // of the elements it overwrites (`PlanBuilder::place` checks)
    let out = node.output.0 as usize;
    let mut with_readers = None;
    if let Some(last) = near.input_readers[out].latest.max(producer[out].latest) {
        if near.input_readers[out].latest == Some(last) && producer[out].latest.is_none_or(|w| w < last) && earliest <= last {
            with_readers = Some(last);
        }
        earliest = earliest.max(last + 1);
    }
    let small = output_bytes(p, n) <= SMALL_OUTPUT_BYTES;
    let is_returned = returned[node.output.0 as usize];
    let lo = slots.len().saturating_sub(FUSION_WINDOW);
    let mut candidates: Vec<usize> = (lo..slots.len()).collect();
    // graph outputs are lowered last: a saved activation computed at the end of a forward from
    // a temporary kept that temporary alive through the whole forward (MobileNetV3's float32
    // batch-norm outputs, 67 MB of peak); in the kernel that writes the temporary it need not
    if let Some(si) = with_readers.filter(|&si| si < lo) {
        candidates.insert(0, si);
    }
    if small || is_returned {
        let far = reads.iter().flat_map(|b| producer[b.0 as usize].slots.iter().chain(&near.readers[b.0 as usize].slots).copied());
        candidates.extend(far.filter(|&si| si < lo));
        candidates.sort_unstable();
        candidates.dedup();
    }
    // a large graph output lowered last would, in a kernel that also writes a large temporary,
    // be live together with it; in a kernel of its own it runs once the temporary has died
    // (GPT-style logits saved for the backward beside the log-softmax the loss reads), unless
    // joining frees more: the large temporaries it reads die with their other readers instead of
    // living until the output's kernel
    let keep_apart = is_returned && !small;
    let read_set: HashSet<BufferId> = if keep_apart { reads.iter().copied().collect() } else { HashSet::new() };
    let freed: i64 = read_set
        .iter()
        .filter(|b| !returned[b.0 as usize] && !matches!(p.buffer(**b).source, BufferSource::Input(_)))
        .map(|b| buffer_bytes(p, *b))
        .filter(|&bytes| bytes > SMALL_OUTPUT_BYTES)
        .sum();
    // bytes of the kernel's large temporaries the output does not read
    let beside = |k: &KernelSlot| -> i64 {
        let read_here: i64 = read_set
            .iter()
            .filter(|b| !returned[b.0 as usize] && buffer_bytes(p, **b) > SMALL_OUTPUT_BYTES)
            .map(|b| k.plan.writer_count(*b) as i64 * buffer_bytes(p, *b))
            .sum();
        k.large_temp_bytes - read_here
    };
    let mut best: Option<Choice> = None;
    let mut rejected = false;
    let new_buffers = {
        let mut fresh: HashSet<BufferId> = reads.iter().copied().collect();
        fresh.insert(node.output);
        fresh
    };
    let mut try_join = |si: usize, k: &KernelSlot, score: i64, decisions: &mut Vec<Decision>| -> Option<Joined> {
        let joined = if k.touched.len() + new_buffers.iter().filter(|b| !k.touched.contains(b)).count() > MAX_KERNEL_BUFFERS {
            Err(Rejection::TooManyBuffers(MAX_KERNEL_BUFFERS))
        } else {
            k.plan.join(p, &k.members, n, near.placed).map_err(Rejection::Plan)
        };
        match joined {
            Ok(joined) => Some(joined),
            Err(reason) => {
                rejected = true;
                let buffer = p.buffer(node.output).name.clone();
                decisions.push(Decision::NoFusion { buffer, kernel: KernelId(si), side_by_side: score == 0, reason });
                None
            }
        }
    };
    for si in candidates {
        let Slot::Kernel(k) = &slots[si] else { continue };
        if (si < earliest && Some(si) != with_readers) || k.scatter {
            continue;
        }
        let score = shared_bytes(p, &k.touched, &reads);
        if score == 0 || best.as_ref().is_some_and(|b| b.score >= score) {
            continue;
        }
        let apart = keep_apart && {
            let b = beside(k);
            b > 0 && freed <= b
        };
        if apart {
            let buffer = p.buffer(node.output).name.clone();
            decisions.push(Decision::NoFusion { buffer, kernel: KernelId(si), side_by_side: false, reason: Rejection::PeakMemory });
            continue;
        }
        if let Some(joined) = try_join(si, k, score, decisions) {
            best = Some(Choice { slot: si, score, joined });
        }
    }
    // small kernels that share nothing still share a launch
    if best.is_none() && small {
        if let Some(Slot::Kernel(k)) = slots.last() {
            let si = slots.len() - 1;
            // (one that shares data was tried above)
            if si >= earliest && k.all_small && shared_bytes(p, &k.touched, &reads) == 0 {
                if let Some(joined) = try_join(si, k, 0, decisions) {
                    best = Some(Choice { slot: si, score: 0, joined });
                }
            }
        }
    }
    (best, rejected)
}

/// Bytes of buffers the node reads that the kernel (`touched`: what it reads or writes) also
/// reads or writes.
fn shared_bytes(p: &LoopProgram, touched: &HashSet<BufferId>, reads: &[BufferId]) -> i64 {
    let mut seen = HashSet::new();
    reads
        .iter()
        .filter(|b| touched.contains(b) && seen.insert(**b))
        .map(|b| {
            let l = &p.buffer(*b).layout;
            l.numel().max(1) * l.dtype.itemsize() as i64
        })
        .sum()
}

/// FX node names (by their op, `view_4` -> `view`) that only move or relabel data: a kernel is
/// named after what it computes, and after these only when it computes nothing else.
const MOVING_WORDS: &[&str] =
    &["view", "reshape", "permute", "expand", "t", "transpose", "unsqueeze", "squeeze", "slice", "select", "alias", "clone", "unsafe_view"];

/// The graph nodes a kernel computes: its member loop nodes' origins in order, once each (its
/// name, and the module's provenance comments).
pub fn kernel_origins(p: &LoopProgram, members: impl IntoIterator<Item = usize>) -> Vec<&str> {
    let mut origins: Vec<&str> = Vec::new();
    for m in members {
        for o in &p.nodes[m].origins {
            if !origins.contains(&o.as_str()) {
                origins.push(o);
            }
        }
    }
    origins
}

fn kernel_name(p: &LoopProgram, members: &[usize], plan: &KernelPlan, prefix: &str, index: usize) -> String {
    const WORDS: usize = 6;
    let mut words: Vec<String> = Vec::new();
    for o in kernel_origins(p, members.iter().copied()) {
        // FX names like `add_3` -> `add`
        let base = o.trim_end_matches(|c: char| c.is_ascii_digit()).trim_end_matches('_').trim_start_matches('_');
        let base: String = base.chars().take(32).map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
        if !base.is_empty() && !words.contains(&base) {
            words.push(base);
        }
    }
    if words.iter().any(|w| !MOVING_WORDS.contains(&w.as_str())) {
        words.retain(|w| !MOVING_WORDS.contains(&w.as_str()));
    }
    words.truncate(WORDS);
    let kind = match plan.groups.first() {
        _ if members.first().is_some_and(|&n| p.nodes[n].convolution().is_some()) => "conv",
        _ if members.first().is_some_and(|&n| p.nodes[n].is_matrix_product()) => "mm",
        _ if members.first().is_some_and(|&n| p.nodes[n].attention().is_some()) => "attn",
        _ if plan.groups.iter().any(|g| g.reduction) => "red",
        _ => "poi",
    };
    format!("{prefix}_{kind}_fused_{}_{index}", words.join("_"))
}

fn plan_storage(p: &LoopProgram, items: &[Item], row_scratch: Option<i64>, decisions: &mut Vec<Decision>) -> Vec<Storage> {
    let mut storage = vec![Storage::Allocated; p.buffers.len()];
    let returned = returned_buffers(p);
    // reads of each buffer from outside the kernel that writes it, and the local-read kinds
    let mut outside: HashSet<BufferId> = HashSet::new();
    let mut stored_reads: HashSet<BufferId> = HashSet::new();
    let mut writer_kernel: Vec<Option<usize>> = vec![None; p.buffers.len()];
    for (ki, it) in items.iter().enumerate() {
        if let Item::Kernel(k) = it {
            for kn in &k.plan.nodes {
                writer_kernel[p.nodes[kn.node].output.0 as usize] = Some(ki);
            }
        }
    }
    for (ki, it) in items.iter().enumerate() {
        match it {
            Item::Extern(e) => {
                outside.extend(p.externs[*e].input_buffers());
            }
            Item::Kernel(k) => {
                for kn in &k.plan.nodes {
                    for (b, _) in p.nodes[kn.node].reads() {
                        if writer_kernel[b.0 as usize] != Some(ki) {
                            outside.insert(b);
                        }
                    }
                }
                for (_, b, kind) in &k.plan.local_reads {
                    if *kind == LocalRead::Stored {
                        stored_reads.insert(*b);
                    }
                }
            }
        }
    }
    // a scattered buffer is updated in place by a later kernel: it must exist in memory
    let scattered: HashSet<BufferId> = p.nodes.iter().filter(|n| n.is_scatter()).map(|n| n.output).collect();
    for (i, b) in p.buffers.iter().enumerate() {
        let id = BufferId(i as u32);
        let scattered = scattered.contains(&id);
        if b.source == BufferSource::Computed
            && !scattered
            && writer_kernel[i].is_some()
            && !returned[i]
            && !outside.contains(&id)
            && !stored_reads.contains(&id)
        {
            storage[i] = Storage::Local;
            decisions.push(Decision::Placement(format!("local: {} lives in registers of its kernel; not allocated", b.name)));
        } else if b.source == BufferSource::Computed && !scattered && !returned[i] && !outside.contains(&id) {
            let row = writer_kernel[i].and_then(|ki| match &items[ki] {
                Item::Kernel(k) => scratch_row(p, k, id, row_scratch?),
                Item::Extern(_) => None,
            });
            if let Some(n) = row {
                storage[i] = Storage::Row;
                decisions.push(Decision::Placement(format!(
                    "row: {} lives in a scratch row of {n} elements in its kernel; not allocated",
                    b.name
                )));
            }
        }
    }
    storage
}

/// The elements of the scratch row that can hold `buf` in kernel `k` (`Storage::Row`): one node
/// of the kernel writes it, the kernel's other nodes read it only back at the elements this
/// outer iteration wrote (`LocalRead::Stored` or forwarded), and its loop group's row holds at
/// most `limit` elements.
fn scratch_row(p: &LoopProgram, k: &FusedKernel, buf: BufferId, limit: i64) -> Option<i64> {
    let plan = &k.plan;
    let writers: Vec<&plan::KernelNode> = plan.nodes.iter().filter(|kn| p.nodes[kn.node].output == buf).collect();
    let [writer] = writers[..] else { return None };
    if p.nodes[writer.node].kind() != NodeKind::Pointwise {
        return None;
    }
    let row: i64 = plan.groups[writer.group].inner.iter().product();
    let reads_back = |pos: usize| plan.local_reads.iter().any(|(r, b, kind)| *r == pos && *b == buf && *kind != LocalRead::Scalar);
    for (pos, kn) in plan.nodes.iter().enumerate() {
        for e in &kn.body.exprs {
            match e {
                Expr::Load { buf: b, .. } if *b == buf && !reads_back(pos) => return None,
                Expr::LoadIndirect { buf: b, .. } if *b == buf => return None,
                _ => {}
            }
        }
    }
    (row <= limit).then_some(row)
}

impl Schedule {
    pub fn kernel_count(&self) -> usize {
        self.items.iter().filter(|i| matches!(i, Item::Kernel(_))).count()
    }

    /// Text form: kernels with their loop groups and nodes, and extern calls, in order.
    /// The kernels' names, by `KernelId`.
    pub fn kernel_names(&self) -> Vec<&str> {
        self.items.iter().filter_map(|it| if let Item::Kernel(k) = it { Some(k.name.as_str()) } else { None }).collect()
    }

    /// Each decision as one line (the `fusion` log), kernels by name.
    pub fn decision_texts(&self) -> Vec<String> {
        let names = self.kernel_names();
        let name = |k: KernelId| names.get(k.0).map_or_else(|| format!("#{}", k.0), |n| n.to_string());
        self.decisions.iter().map(|d| d.describe(&name)).collect()
    }

    pub fn text(&self) -> String {
        let p = &self.program;
        let mut s = String::new();
        for it in &self.items {
            match it {
                Item::Extern(e) => s.push_str(&p.extern_text(*e)),
                Item::Kernel(k) => {
                    s.push_str(&format!("  kernel {}: outer={}\n", k.name, k.plan.outer));
                    for (gi, g) in k.plan.groups.iter().enumerate() {
                        let names: Vec<String> = g
                            .nodes
                            .iter()
                            .map(|&pos| {
                                let b = p.nodes[k.plan.nodes[pos].node].output;
                                let tag = match self.storage[b.0 as usize] {
                                    Storage::Local => " (local)",
                                    Storage::Row => " (row)",
                                    Storage::Allocated => "",
                                };
                                format!("{}{tag}", p.buffer(b).name)
                            })
                            .collect();
                        let kind = if g.reduction { "reduce" } else { "loop" };
                        s.push_str(&format!("    group {gi}: {kind} {:?}: {}\n", g.inner, names.join(", ")));
                    }
                }
            }
        }
        s
    }
}

#[cfg(test)]
mod tests;
