//! Code generation: the backend interface and what every backend shares. A backend turns the
//! schedule's fused kernels into one source unit plus, per kernel, a launch description (entry
//! point, buffer arguments in order, and how it is launched: a host call for C++, a grid with a
//! block configuration for Triton); the wrapper then launches them. Backends never import each
//! other: what they share lives here.

pub mod attention;
pub mod cpp;
pub mod literal;
pub mod product;
pub mod triton;
pub mod writer;

use crate::loop_ir::{BufferId, Expr, Template};
use crate::scheduler::{FusedKernel, LocalRead, Schedule, Storage};
use std::collections::{HashMap, HashSet};
use std::fmt;

/// The language of a rendered source unit; the wrapper loads each differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KernelLanguage {
    /// One C++ translation unit of `extern "C"` functions, compiled to a shared library.
    #[default]
    Cpp,
    /// Python source of `@triton.jit` functions, defined inside the wrapper module.
    Triton,
}

impl KernelLanguage {
    pub fn name(self) -> &'static str {
        match self {
            KernelLanguage::Cpp => "cpp",
            KernelLanguage::Triton => "triton",
        }
    }
}

/// How a kernel is started.
#[derive(Clone, Debug, PartialEq)]
pub enum LaunchShape {
    /// A host function over all `numel` iterations (C++: OpenMP threads inside).
    Host,
    /// A 1-D grid of `grid` programs, each covering `xblock` rows of the flattened outer loop;
    /// `xblock` is the kernel's `XBLOCK` constexpr. A matrix-product kernel's programs cover a
    /// `tile` of its outputs instead (its constexprs; `xblock` is then 0).
    Grid { grid: i64, xblock: i64, num_warps: u32, num_stages: u32, tile: Option<Tile> },
}

/// A matrix-product kernel's tile: its `BLOCK_M`, `BLOCK_N` and `BLOCK_K` constexprs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tile {
    pub m: i64,
    pub n: i64,
    pub k: i64,
}

/// A kernel's entry point, the buffers it takes (in parameter order) and how it is launched.
#[derive(Clone, Debug)]
pub struct KernelLaunch {
    pub name: String,
    pub args: Vec<BufferId>,
    /// The kernel reports out-of-range gather indices: C++ through its return value, Triton
    /// through an int32 flag buffer passed after `args`.
    pub checks_indices: bool,
    /// Iterations of the kernel's work (flattened outer loop times the largest inner space).
    pub numel: i64,
    pub shape: LaunchShape,
    /// Per parameter (buffers, then the error flag if any), its Triton signature type
    /// (`*fp32`, `*i1`, ...); empty for C++.
    pub signature: Vec<(String, String)>,
    /// Configurations an autotuner may time instead of the heuristic one (which comes first),
    /// each valid for the kernel's text; empty for C++.
    pub candidates: Vec<TuneConfig>,
    /// Per parameter, the elements its buffer spans (in the signature's element type): what an
    /// autotuner allocates to time the kernel on.
    pub arg_numel: Vec<i64>,
    /// Where its definition lies in `RenderedKernels::source` (byte range; a Triton launch of a
    /// kernel defined once for several launches points at that one definition).
    pub text: std::ops::Range<usize>,
}

/// One launch configuration of a Triton kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TuneConfig {
    pub grid: i64,
    pub xblock: i64,
    pub num_warps: u32,
    pub num_stages: u32,
    pub tile: Option<Tile>,
}

#[derive(Clone, Debug)]
pub struct RenderedKernels {
    pub language: KernelLanguage,
    pub source: String,
    /// One entry per `Item::Kernel` of the schedule, in order.
    pub launches: Vec<KernelLaunch>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CodegenErrorKind {
    /// The backend cannot render this yet: the driver runs the whole graph eagerly (a logged,
    /// counted graph fallback), never a wrong answer.
    Unsupported,
    /// A bug: an inconsistency between the schedule and the backend.
    Internal,
}

#[derive(Debug, Clone)]
pub struct CodegenError {
    pub kind: CodegenErrorKind,
    pub kernel: String,
    pub message: String,
}

impl CodegenError {
    pub fn internal(kernel: &str, message: impl Into<String>) -> CodegenError {
        CodegenError { kind: CodegenErrorKind::Internal, kernel: kernel.to_string(), message: message.into() }
    }
    pub fn unsupported(kernel: &str, message: impl Into<String>) -> CodegenError {
        CodegenError { kind: CodegenErrorKind::Unsupported, kernel: kernel.to_string(), message: message.into() }
    }
}

impl fmt::Display for CodegenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            CodegenErrorKind::Unsupported => {
                write!(f, "codegen: kernel '{}' is not supported by this backend: {}", self.kernel, self.message)
            }
            CodegenErrorKind::Internal => write!(f, "codegen: kernel '{}': {}", self.kernel, self.message),
        }
    }
}
impl std::error::Error for CodegenError {}

/// One interface for kernel backends: C++ and Triton today.
pub trait KernelBackend {
    fn name(&self) -> &'static str;
    fn render(&self, schedule: &Schedule) -> Result<RenderedKernels, CodegenError>;
    /// What the scheduler should do for this backend: kernel names, whether to split narrow
    /// reductions in two stages (a GPU's many programs; a CPU's few threads take whole rows),
    /// whether complex buffers are addressed as pairs of reals, from which row length variances
    /// take one pass.
    fn schedule_options(&self) -> crate::scheduler::ScheduleOptions;
}

/// A kernel's buffer parameters: buffers read from memory first (in first-read order), then
/// buffers written (allocated outputs, in node order). A buffer both written and read by the
/// kernel is passed once, as written. Reads served from registers (per-row scalars, forwarded
/// values) or from a kernel's scratch row (`Storage::Row`) take no parameter.
pub fn kernel_buffers(s: &Schedule, k: &FusedKernel) -> (Vec<BufferId>, Vec<BufferId>) {
    let p = &s.program;
    let plan = &k.plan;
    // sets beside the ordered lists: a kernel of thousands of nodes (a graph's thousands of small
    // outputs) lists its buffers in time linear in its size
    let mut written: Vec<BufferId> = Vec::new();
    let mut written_set: HashSet<BufferId> = HashSet::new();
    for kn in &plan.nodes {
        let b = p.nodes[kn.node].output;
        if s.storage[b.0 as usize] == Storage::Allocated && written_set.insert(b) {
            written.push(b);
        }
    }
    let local_kinds: HashMap<(usize, BufferId), LocalRead> = plan.local_reads.iter().rev().map(|(r, b, k)| ((*r, *b), *k)).collect();
    let mut read: Vec<BufferId> = Vec::new();
    let mut read_set: HashSet<BufferId> = HashSet::new();
    for (pos, kn) in plan.nodes.iter().enumerate() {
        for e in &kn.body.exprs {
            if let Expr::Load { buf, .. } | Expr::LoadIndirect { buf, .. } = e {
                let direct = matches!(e, Expr::Load { .. });
                let from_memory = !direct || !matches!(local_kinds.get(&(pos, *buf)), Some(LocalRead::Scalar | LocalRead::Forwarded));
                let in_row = s.storage[buf.0 as usize] == Storage::Row;
                if from_memory && !in_row && !written_set.contains(buf) && read_set.insert(*buf) {
                    read.push(*buf);
                }
            }
        }
    }
    (read, written)
}

/// Iterations of a kernel's work: the outer loop times its largest inner loop space.
pub fn kernel_numel(k: &FusedKernel) -> i64 {
    let n = k.plan.outer;
    k.plan.groups.iter().map(|g| n * g.inner.iter().product::<i64>()).max().unwrap_or(n)
}

/// The smallest power of two >= n (1 for n <= 1).
pub fn next_power_of_two(n: i64) -> i64 {
    let mut p = 1i64;
    while p < n {
        p *= 2;
    }
    p
}

/// A kernel's structure without its name and its buffers' identities: the loop plan, each node's
/// body over buffers numbered by first use, and what the code reads of each buffer (dtype, size,
/// where it is stored). Kernels of equal structure render to the same text but for their names.
pub fn kernel_structure(s: &Schedule, k: &FusedKernel) -> String {
    let p = &s.program;
    let mut numbered: HashMap<BufferId, usize> = HashMap::new();
    let mut number = |b: BufferId| {
        let next = numbered.len();
        *numbered.entry(b).or_insert(next)
    };
    let mut text = format!("outer {}\n", k.plan.outer);
    for g in &k.plan.groups {
        text.push_str(&format!("group {:?} {} {:?}\n", g.inner, g.reduction, g.nodes));
    }
    let mut order = Vec::new();
    for kn in &k.plan.nodes {
        let node = &p.nodes[kn.node];
        let out = number(node.output);
        order.push(node.output);
        let exprs: Vec<Expr> = kn
            .body
            .exprs
            .iter()
            .map(|e| match e {
                Expr::Load { buf, index } => Expr::Load { buf: BufferId(number(*buf) as u32), index: index.clone() },
                Expr::LoadIndirect { buf, index, terms } => {
                    Expr::LoadIndirect { buf: BufferId(number(*buf) as u32), index: index.clone(), terms: terms.clone() }
                }
                other => other.clone(),
            })
            .collect();
        for e in &kn.body.exprs {
            if let Expr::Load { buf, .. } | Expr::LoadIndirect { buf, .. } = e {
                order.push(*buf);
            }
        }
        text.push_str(&format!(
            "node group {} out {out} {:?} {:?} checks {} ranges {:?}\n  {exprs:?}\n  {:?}\n  {:?}\n",
            kn.group,
            node.kind(),
            // (a template's parameters: an attention's scale, pass and results)
            node.template.as_ref().map(|t| match t {
                Template::AttentionResult { result, .. } => format!("{result:?}"),
                t => format!("{t:?}"),
            }),
            node.checks_indices(),
            kn.ranges,
            kn.body.dtypes,
            kn.body.store
        ));
    }
    for (r, b, kind) in &k.plan.local_reads {
        text.push_str(&format!("local {r} {} {kind:?}\n", number(*b)));
    }
    let mut seen = HashSet::new();
    for b in order.into_iter().filter(|b| seen.insert(*b)) {
        let l = &p.buffer(b).layout;
        text.push_str(&format!("buffer {:?} {} {} {:?}\n", l.dtype, l.numel(), l.storage_numel(), s.storage[b.0 as usize]));
    }
    text
}

/// A source's kernel definitions, each written once: kernels of the same structure (the same
/// layer repeated through a model, the same normalization after every convolution) share the
/// first one's definition, so the compiler (g++, Triton) builds each body once and the backend
/// writes it once.
#[derive(Default)]
pub struct Definitions {
    /// (the kernel's structure, the launch's signature) -> (that kernel's name, its span in the
    /// source)
    by_structure: HashMap<DefinitionKey, (String, std::ops::Range<usize>)>,
}

type DefinitionKey = (String, Vec<(String, String)>);

impl Definitions {
    /// Points `launch` at the definition of a kernel of the same structure as `k` and the same
    /// signature, or appends the text `write` renders after `separator` to `source` as a new
    /// one. A Triton kernel's text names no types: one binary serves one signature, so a copy of
    /// uint8 values and one of floats must not share a name (and its binary).
    pub fn define(
        &mut self,
        source: &mut String,
        separator: &str,
        structure: String,
        launch: &mut KernelLaunch,
        write: impl FnOnce() -> Result<String, CodegenError>,
    ) -> Result<(), CodegenError> {
        let key = (structure, launch.signature.clone());
        if let Some((first, span)) = self.by_structure.get(&key) {
            if cfg!(debug_assertions) {
                // the structure must decide the text: a kernel it pairs wrongly would run another's code
                let own = write()?.replacen(&launch.name, "", 1);
                assert_eq!(
                    own,
                    source[span.clone()].replacen(first.as_str(), "", 1),
                    "kernels {first} and {} share a structure",
                    launch.name
                );
            }
            launch.name = first.clone();
            launch.text = span.clone();
            return Ok(());
        }
        let text = write()?;
        source.push_str(separator);
        launch.text = source.len()..source.len() + text.len();
        source.push_str(&text);
        self.by_structure.insert(key, (launch.name.clone(), launch.text.clone()));
        Ok(())
    }
}
