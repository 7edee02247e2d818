//! The compiled graph as one value (docs/compiled_graph.md): its kernel unit (source, each
//! kernel's span and launch), its buffers, the host plan's steps (allocations, reuses, launches,
//! library calls, frees), its inputs and their checks, its outputs, and what a runtime must know
//! about running it (donated writes, the index-check flag, what keeps it out of a CUDA graph).
//! Built from the schedule, the rendered kernels and the host plan; serialized as versioned
//! JSON. Nothing in it is Python: the wrapper module is one printing of it, and the front reads
//! the facts it needs from it, never from the module's text.

use crate::codegen::{KernelLanguage, LaunchShape, RenderedKernels};
use crate::loop_ir::{BufferId, BufferSource, ExternArg, Literal, LoopProgram, OutputValue};
use crate::scheduler::{kernel_origins, Item, Schedule};
use crate::wrapper::{HostPlan, HostStep};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The format's name and version: a reader refuses any other (bumped on every incompatible
/// change; docs/compiled_graph.md lists them).
pub const FORMAT: &str = "ferrocore.compiled_graph";
pub const VERSION: u32 = 3;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompiledGraph {
    pub format: String,
    pub version: u32,
    pub name: String,
    pub language: Language,
    /// The kernels' source unit; None when the graph has no kernel.
    pub unit: Option<KernelUnit>,
    /// One per launch, in launch order (kernels of one structure share a definition).
    pub kernels: Vec<Kernel>,
    /// Every buffer of the program, by id (`buf` fields index it).
    pub buffers: Vec<Buffer>,
    /// The graph's inputs in call order.
    pub inputs: Vec<Input>,
    /// Views the program takes of an input's storage (`as_strided`), checked at every call.
    pub input_storage_views: Vec<StorageView>,
    /// Whether the call checks its inputs' sizes, strides, dtypes and devices.
    pub check_inputs: bool,
    pub steps: Vec<Step>,
    pub library_calls: Vec<LibraryCall>,
    pub outputs: Vec<Output>,
    /// Donated inputs whose storage results are written over.
    pub donated_writes: Vec<DonatedWrite>,
    /// Set when kernels report out-of-range gather indices through a flag buffer on `device`.
    pub index_check: Option<IndexCheck>,
    /// Why the call must not be recorded in a CUDA graph (library calls that synchronize or
    /// whose capture safety is unknown); empty when recording is safe.
    pub cuda_graph_hazards: Vec<String>,
    /// The model's source line of each graph node a kernel or library call names (provenance).
    pub sources: BTreeMap<String, String>,
}

/// The language of the kernel unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Language {
    /// One C++ translation unit of `extern "C"` functions, compiled to a shared library.
    Cpp,
    /// `@triton.jit` functions, compiled per kernel at first launch or ahead of it.
    Triton,
}

/// A byte range of `KernelUnit::source`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    pub start: usize,
    pub end: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KernelUnit {
    pub source: String,
    /// What every kernel of the unit shares (helpers, includes), before the first definition.
    pub prelude: Span,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Kernel {
    /// The function it launches (launches of one structure share one definition and its name).
    pub name: String,
    /// This launch's own kernel name: the one the logs and the fusion decisions give it.
    pub launch_name: String,
    /// Its definition in the unit (shared by the launches of one body).
    pub definition: Span,
    /// Buffer ids in parameter order.
    pub args: Vec<u32>,
    /// Iterations of its work.
    pub numel: i64,
    /// Whether it reports out-of-range gather indices (C++: its return value; Triton: the
    /// index-check flag passed after `args`).
    pub checks_indices: bool,
    pub launch: Launch,
    /// Per parameter, its Triton signature type; empty for C++.
    pub signature: Vec<(String, String)>,
    /// Per parameter, the elements its buffer spans (what an autotuner allocates).
    pub arg_numel: Vec<i64>,
    /// The graph nodes it computes.
    pub origins: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Launch {
    /// A host function over all iterations.
    Host,
    /// A 1-D grid; `candidates` are configurations an autotuner may time, the heuristic one first.
    Grid { config: GridConfig, candidates: Vec<GridConfig> },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GridConfig {
    pub grid: i64,
    pub xblock: i64,
    pub num_warps: u32,
    pub num_stages: u32,
    /// A matrix-product kernel's `[BLOCK_M, BLOCK_N, BLOCK_K]` (its constexprs instead of
    /// `XBLOCK`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tile: Option<[i64; 3]>,
}

impl GridConfig {
    fn of(c: &crate::codegen::TuneConfig) -> GridConfig {
        GridConfig {
            grid: c.grid,
            xblock: c.xblock,
            num_warps: c.num_warps,
            num_stages: c.num_stages,
            tile: c.tile.map(|t| [t.m, t.n, t.k]),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Buffer {
    pub name: String,
    pub size: Vec<i64>,
    pub stride: Vec<i64>,
    pub offset: i64,
    /// torch's name (`float32`, `bfloat16`, ...).
    pub dtype: String,
    /// `cpu` or `cuda:N`.
    pub device: String,
    pub source: BufferOrigin,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum BufferOrigin {
    Input {
        index: usize,
    },
    Computed,
    /// Returned by library call `call` (element `item` of a tuple result).
    LibraryCall {
        call: usize,
        item: Option<usize>,
    },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Input {
    pub buf: u32,
    /// Whether a kernel or library call reads it (only those are checked: an input only
    /// returned, or not used at all, is never read out of bounds).
    pub read: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StorageView {
    pub input: u32,
    pub size: Vec<i64>,
    pub stride: Vec<i64>,
    pub offset: i64,
    pub storage_offset: Option<i64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "step", rename_all = "snake_case")]
pub enum Step {
    Alloc {
        buf: u32,
    },
    /// Takes over the storage of `from`, freed, of the same layout.
    Reuse {
        buf: u32,
        from: u32,
    },
    Launch {
        kernel: usize,
    },
    Call {
        call: usize,
    },
    Free {
        buf: u32,
    },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LibraryCall {
    /// The ATen overload, `torch.ops.aten.mm.default`.
    pub callee: String,
    pub args: Vec<Arg>,
    pub kwargs: Vec<(String, Arg)>,
    pub outputs: Vec<u32>,
    /// Whether it is an op the compiler could not lower (not a deliberate library call).
    pub fallback: bool,
    /// Why it runs through ATen (fallbacks).
    pub reason: Option<String>,
    pub origin: String,
    pub cuda_graph_hazard: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "value", rename_all = "snake_case")]
pub enum Arg {
    Buffer(u32),
    View { buf: u32, size: Vec<i64>, stride: Vec<i64>, offset: i64 },
    List(Vec<Arg>),
    None,
    Int(i64),
    Float(#[serde(with = "float_text")] f64),
    Bool(bool),
    Str(String),
    DType(String),
    Device(String),
    Layout(String),
    MemoryFormat(String),
    Shape(Vec<i64>),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Output {
    Buffer { buf: u32 },
    View { buf: u32, size: Vec<i64>, stride: Vec<i64>, offset: i64 },
    None,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DonatedWrite {
    pub buf: u32,
    /// Elements its storage must hold from its data pointer.
    pub extent: i64,
    /// Whether a buffer that may outlive the call ends up in its storage.
    pub escapes: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IndexCheck {
    pub device: String,
}

impl CompiledGraph {
    /// The text of kernel `i`'s definition.
    pub fn kernel_text(&self, i: usize) -> &str {
        let (unit, k) = (self.unit.as_ref().expect("a graph with kernels has a unit"), &self.kernels[i]);
        &unit.source[k.definition.start..k.definition.end]
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a compiled graph serializes")
    }

    /// Reads a serialized graph, refusing another format or version.
    pub fn from_json(text: &str) -> Result<CompiledGraph, String> {
        let g: CompiledGraph = serde_json::from_str(text).map_err(|e| format!("not a compiled graph: {e}"))?;
        if g.format != FORMAT || g.version != VERSION {
            return Err(format!("compiled graph format {} version {}; this build reads {FORMAT} version {VERSION}", g.format, g.version));
        }
        Ok(g)
    }
}

/// The compiled graph of a schedule, its rendered kernels and its host plan.
pub fn build(s: &Schedule, kernels: &RenderedKernels, plan: &HostPlan, name: &str, check_inputs: bool) -> CompiledGraph {
    let p = &s.program;
    let read = crate::wrapper::read_by_steps(s, kernels);
    let kernels_entries = kernel_entries(s, kernels);
    let named = kernels_entries.iter().flat_map(|k| &k.origins).chain(p.externs.iter().map(|x| &x.origin));
    let sources = named.filter_map(|o| p.sources.get(o).map(|line| (o.clone(), line.clone()))).collect();
    CompiledGraph {
        format: FORMAT.to_string(),
        version: VERSION,
        name: name.to_string(),
        language: match kernels.language {
            KernelLanguage::Cpp => Language::Cpp,
            KernelLanguage::Triton => Language::Triton,
        },
        unit: unit(kernels),
        kernels: kernels_entries,
        buffers: p.buffers.iter().map(buffer).collect(),
        inputs: p.inputs.iter().map(|b| Input { buf: b.0, read: read[b.0 as usize] }).collect(),
        input_storage_views: p
            .input_storage_views
            .iter()
            .map(|v| StorageView {
                input: v.input.0,
                size: v.size.clone(),
                stride: v.stride.clone(),
                offset: v.offset,
                storage_offset: v.storage_offset,
            })
            .collect(),
        check_inputs,
        steps: plan.steps.iter().map(step).collect(),
        library_calls: p.externs.iter().map(library_call).collect(),
        outputs: p.outputs.iter().map(output).collect(),
        donated_writes: p.donated_writes.iter().map(|w| DonatedWrite { buf: w.buffer.0, extent: w.extent, escapes: w.escapes }).collect(),
        index_check: index_check(p, kernels),
        cuda_graph_hazards: hazards(p),
        sources,
    }
}

fn unit(kernels: &RenderedKernels) -> Option<KernelUnit> {
    let first = kernels.launches.iter().map(|l| l.text.start).min()?;
    Some(KernelUnit { source: kernels.source.clone(), prelude: Span { start: 0, end: first } })
}

fn kernel_entries(s: &Schedule, kernels: &RenderedKernels) -> Vec<Kernel> {
    let fused = s.items.iter().filter_map(|it| if let Item::Kernel(k) = it { Some(k) } else { None });
    let named = fused.map(|k| (k.name.clone(), kernel_origins(&s.program, k.plan.nodes.iter().map(|kn| kn.node))));
    kernels
        .launches
        .iter()
        .zip(named)
        .map(|(l, (launch_name, origins))| Kernel {
            name: l.name.clone(),
            launch_name,
            definition: Span { start: l.text.start, end: l.text.end },
            args: l.args.iter().map(|b| b.0).collect(),
            numel: l.numel,
            checks_indices: l.checks_indices,
            launch: match &l.shape {
                LaunchShape::Host => Launch::Host,
                LaunchShape::Grid { grid, xblock, num_warps, num_stages, tile } => Launch::Grid {
                    config: GridConfig::of(&crate::codegen::TuneConfig {
                        grid: *grid,
                        xblock: *xblock,
                        num_warps: *num_warps,
                        num_stages: *num_stages,
                        tile: *tile,
                    }),
                    candidates: l.candidates.iter().map(GridConfig::of).collect(),
                },
            },
            signature: l.signature.clone(),
            arg_numel: l.arg_numel.clone(),
            origins: origins.into_iter().map(str::to_string).collect(),
        })
        .collect()
}

fn buffer(b: &crate::loop_ir::Buffer) -> Buffer {
    let l = &b.layout;
    Buffer {
        name: crate::wrapper::names::module_name(b),
        size: l.size.clone(),
        stride: l.stride.clone(),
        offset: l.offset,
        dtype: l.dtype.torch_name().to_string(),
        device: l.device.to_string(),
        source: match b.source {
            BufferSource::Input(index) => BufferOrigin::Input { index },
            BufferSource::Computed => BufferOrigin::Computed,
            BufferSource::Extern { call, item } => BufferOrigin::LibraryCall { call, item },
        },
    }
}

fn step(s: &HostStep) -> Step {
    match s {
        HostStep::Alloc(b) => Step::Alloc { buf: b.0 },
        HostStep::Reuse { buf, from } => Step::Reuse { buf: buf.0, from: from.0 },
        HostStep::Launch(k) => Step::Launch { kernel: *k },
        HostStep::Extern(c) => Step::Call { call: *c },
        HostStep::Free(b) => Step::Free { buf: b.0 },
    }
}

fn library_call(x: &crate::loop_ir::ExternCall) -> LibraryCall {
    LibraryCall {
        callee: x.callee.clone(),
        args: x.args.iter().map(arg).collect(),
        kwargs: x.kwargs.iter().map(|(k, v)| (k.clone(), arg(v))).collect(),
        outputs: x.outputs.iter().map(|b| b.0).collect(),
        fallback: x.fallback,
        reason: x.reason.clone(),
        origin: x.origin.clone(),
        cuda_graph_hazard: x.capture_hazard.clone(),
    }
}

fn arg(a: &ExternArg) -> Arg {
    match a {
        ExternArg::Buffer(b) => Arg::Buffer(b.0),
        ExternArg::View { buf, size, stride, offset } => {
            Arg::View { buf: buf.0, size: size.clone(), stride: stride.clone(), offset: *offset }
        }
        ExternArg::List(items) => Arg::List(items.iter().map(arg).collect()),
        ExternArg::Literal(l) => match l {
            Literal::None => Arg::None,
            Literal::Int(i) => Arg::Int(*i),
            Literal::Float(f) => Arg::Float(*f),
            Literal::Bool(b) => Arg::Bool(*b),
            Literal::Str(s) => Arg::Str(s.clone()),
            Literal::DType(d) => Arg::DType(d.torch_name().to_string()),
            Literal::Device(d) => Arg::Device(d.to_string()),
            Literal::Layout(s) => Arg::Layout(s.clone()),
            Literal::MemoryFormat(s) => Arg::MemoryFormat(s.clone()),
            Literal::Shape(s) => Arg::Shape(s.clone()),
        },
    }
}

fn output(o: &OutputValue) -> Output {
    match o {
        OutputValue::Buffer(b) => Output::Buffer { buf: b.0 },
        OutputValue::View { buf, size, stride, offset } => {
            Output::View { buf: buf.0, size: size.clone(), stride: stride.clone(), offset: *offset }
        }
        OutputValue::None => Output::None,
    }
}

/// Where kernels report out-of-range gather indices through a flag buffer (Triton launches;
/// a C++ kernel returns its report instead).
fn index_check(p: &LoopProgram, kernels: &RenderedKernels) -> Option<IndexCheck> {
    kernels
        .launches
        .iter()
        .filter(|l| l.checks_indices && matches!(l.shape, LaunchShape::Grid { .. }))
        .find_map(|l| l.args.first().map(|b: &BufferId| IndexCheck { device: p.buffer(*b).layout.device.to_string() }))
}

fn hazards(p: &LoopProgram) -> Vec<String> {
    let mut hazards: Vec<String> = Vec::new();
    for h in p.externs.iter().filter_map(|x| x.capture_hazard.as_ref()) {
        if !hazards.contains(h) {
            hazards.push(h.clone());
        }
    }
    hazards
}

/// A float as a JSON number, or as `"inf"`, `"-inf"` or `"nan"` where JSON has no number for it
/// (a `masked_fill` with -inf is a library call's argument).
mod float_text {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        match *v {
            v if v.is_finite() => s.serialize_f64(v),
            v if v.is_nan() => s.serialize_str("nan"),
            v if v > 0.0 => s.serialize_str("inf"),
            _ => s.serialize_str("-inf"),
        }
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum NumberOrText {
        Number(f64),
        Text(String),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        match NumberOrText::deserialize(d)? {
            NumberOrText::Number(v) => Ok(v),
            NumberOrText::Text(t) => match t.as_str() {
                "inf" => Ok(f64::INFINITY),
                "-inf" => Ok(f64::NEG_INFINITY),
                "nan" => Ok(f64::NAN),
                other => Err(serde::de::Error::custom(format!("not a float: {other:?}"))),
            },
        }
    }
}

#[cfg(test)]
mod tests;
