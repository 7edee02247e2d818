//! The pipeline in order, in one place: import -> lowering -> scheduling -> codegen -> wrapper ->
//! native compile (C++ only; Triton compiles at first launch). The kernel backend is chosen here,
//! by device or by `Options::backend`. Each pass has a name used for timings, `FERROCORE_LOGS`
//! channels and debug dumps. Options arrive as one explicit value; there is no global state.

use crate::artifact::{self, CompiledGraph};
use crate::codegen::cpp::CppBackend;
use crate::codegen::triton::TritonBackend;
use crate::codegen::RenderedKernels;
use crate::codegen::{CodegenErrorKind, KernelBackend, KernelLanguage};
use crate::graph::parse_graph;
use crate::graph::Device;
use crate::loop_ir::LoopProgram;
use crate::loop_ir::OutputValue;
use crate::lowering::{lower_graph_with, ConvLayout, GemmTemplate, LowerOptions, PadMm};
use crate::report::{self, ReportInput};
use crate::runtime::{self, Progress};
use crate::scheduler::Schedule;
use crate::scheduler::{fuse, program_passes, ScheduleOptions};
use crate::wrapper::{plan_host, print_module, HostPlan};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct Options {
    pub cache_dir: PathBuf,
    /// Channels to return as logs: graph, ir_pre_fusion, ir_post_fusion, fusion, output_code, fallback.
    pub logs: Vec<String>,
    pub debug_dir: Option<PathBuf>,
    pub cxx: String,
    /// Skip the native compile (for tests of the earlier stages).
    pub skip_native_compile: bool,
    /// Translation units one C++ compile may run at once (0: one per CPU, up to 8).
    pub cpp_jobs: usize,
    /// Which kernel backend renders the fused kernels.
    pub backend: BackendChoice,
    /// How convolution graphs lay out their activations (`auto`, `channels_last`, `contiguous`).
    pub conv_layout: ConvLayout,
    /// Which unaligned 16-bit GEMMs run on padded operands (`measured`, `always`, `never`).
    pub pad_mm: PadMm,
    /// Which GEMMs of a Triton graph are matrix-product kernels with their epilogues fused
    /// (`never`, `measured`: those the graph names, `always`).
    pub gemm_template: GemmTemplate,
    /// Whether compiled modules check their inputs' sizes, strides, dtypes and devices at each
    /// call (`wrapper/checks.rs`); off only for a measured hot path whose callers guarantee them.
    pub check_inputs: bool,
    /// The front's stages before this one (Dynamo, AOT autograd, ...) in ms, for the report.
    pub front_timings_ms: Vec<(String, f64)>,
    /// The GPU's compute capability as major * 10 + minor (90: Hopper), 0 when not known: which
    /// library kernels exist for it (the fused attention call).
    pub cuda_arch: u32,
}

/// The kernel backend: by the graph's device (CUDA tensors -> Triton, CPU -> C++), or forced.
/// Forcing Triton on CPU tensors is for Triton's interpreter (`TRITON_INTERPRET=1`), how tests
/// without a GPU run Triton kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    #[default]
    Auto,
    Cpp,
    Triton,
}

impl BackendChoice {
    pub const ALL: [BackendChoice; 3] = [BackendChoice::Auto, BackendChoice::Cpp, BackendChoice::Triton];
    /// The kernel language for a program whose buffers live on `devices`.
    pub fn resolve<'d>(self, mut devices: impl Iterator<Item = &'d Device>) -> KernelLanguage {
        match self {
            BackendChoice::Cpp => KernelLanguage::Cpp,
            BackendChoice::Triton => KernelLanguage::Triton,
            BackendChoice::Auto => {
                if devices.any(|d| matches!(d, Device::Cuda(_))) {
                    KernelLanguage::Triton
                } else {
                    KernelLanguage::Cpp
                }
            }
        }
    }
}

/// The log channels the compiler writes (`Options::logs`); the front adds channels of its own.
pub const LOG_CHANNELS: &[&str] = &[
    "graph",
    "ir_pre_fusion",
    "ir_post_fusion",
    "fusion",
    "output_code",
    "fallback",
    "layout",
    "padding",
    "attention",
    "causal_mask",
    "gemm_epilogue",
    "gemm_template",
];

/// What the front needs to know of the compiler's options, as JSON: each option's default, the
/// values of those that are a choice, and the compiler's log channels. The front holds none of
/// these itself (it adds the options only it reads).
pub fn option_schema() -> String {
    let d = Options::default();
    serde_json::json!({
        "defaults": {
            "cxx": d.cxx,
            "skip_native_compile": d.skip_native_compile,
            "cpp_jobs": d.cpp_jobs,
            "backend": d.backend,
            "conv_layout": d.conv_layout,
            "pad_mm": d.pad_mm,
            "gemm_template": d.gemm_template,
            "check_inputs": d.check_inputs,
        },
        "choices": {
            "backend": BackendChoice::ALL,
            "conv_layout": ConvLayout::ALL,
            "pad_mm": PadMm::ALL,
            "gemm_template": GemmTemplate::ALL,
        },
        "log_channels": LOG_CHANNELS,
    })
    .to_string()
}

impl Default for Options {
    fn default() -> Self {
        Options {
            cache_dir: runtime::default_cache_dir(),
            logs: Vec::new(),
            debug_dir: None,
            cxx: "g++".into(),
            skip_native_compile: false,
            cpp_jobs: 0,
            backend: BackendChoice::Auto,
            conv_layout: ConvLayout::Auto,
            pad_mm: PadMm::Measured,
            gemm_template: GemmTemplate::Cached,
            check_inputs: true,
            front_timings_ms: Vec::new(),
            cuda_arch: 0,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct FallbackRecord {
    pub node: String,
    pub target: String,
    pub reason: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct LogRecord {
    pub channel: String,
    pub text: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct CompileResult {
    pub module_path: String,
    pub module_source: String,
    pub kernels: usize,
    pub externs: usize,
    pub fallbacks: Vec<FallbackRecord>,
    /// Stage name -> milliseconds, in pipeline order.
    pub timings_ms: Vec<(String, f64)>,
    pub cpp_cache_hit: bool,
    pub logs: Vec<LogRecord>,
    /// The kernel backend used ("cpp" or "triton").
    pub backend: String,
    /// Set when the backend cannot render the graph yet: no module was written and the caller
    /// runs the graph eagerly (a logged, counted graph fallback).
    pub graph_fallback: Option<String>,
    /// The strides each output is returned with (None: not a tensor); they differ from the
    /// metadata's only for free-layout outputs.
    pub output_strides: Vec<Option<Vec<i64>>>,
    /// The callee of every library call, in program order.
    pub extern_ops: Vec<String>,
    /// The C++ translation unit, when the options left its compile to the caller
    /// (`skip_native_compile`): the front compiles it on a thread while the next graph compiles.
    pub cpp_source: Option<String>,
    /// The compile report (`report`), written where the stage dumps go.
    pub report_path: Option<String>,
    /// The compiled graph (docs/compiled_graph.md); None for a graph that runs eagerly.
    pub artifact: Option<CompiledGraph>,
    /// Where the cache holds it, serialized (beside the module).
    pub artifact_path: String,
}

#[derive(Debug, Clone)]
pub struct CompileError {
    pub stage: &'static str,
    pub message: String,
}

impl fmt::Display for CompileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // messages quote graph text (a string argument): no control or bidi character gets out raw
        f.write_str(&crate::graph::names::printable(&self.message))
    }
}
impl std::error::Error for CompileError {}

struct Stages<'o> {
    options: &'o Options,
    progress: &'o Progress,
    timings: Vec<(String, f64)>,
    logs: Vec<LogRecord>,
    dump_dir: Option<PathBuf>,
}

impl Stages<'_> {
    fn time<T>(&mut self, name: &str, f: impl FnOnce() -> T) -> T {
        self.progress.stage(name, 0);
        let t = Instant::now();
        let r = f();
        self.timings.push((name.to_string(), t.elapsed().as_secs_f64() * 1e3));
        r
    }
    fn wants(&self, channel: &str) -> bool {
        self.options.logs.iter().any(|c| c == channel || c == "all") || self.dump_dir.is_some()
    }
    /// Writes `name`.txt where the stage dumps go (no log channel: a pass's program).
    fn dump(&self, name: &str, text: impl FnOnce() -> String) {
        if let Some(d) = &self.dump_dir {
            let _ = runtime::write_atomic(&d.join(format!("{name}.txt")), text().as_bytes());
        }
    }
    fn emit(&mut self, channel: &str, text: impl FnOnce() -> String) {
        debug_assert!(LOG_CHANNELS.contains(&channel), "log channel {channel} is not in LOG_CHANNELS");
        if !self.wants(channel) {
            return;
        }
        let text = text();
        if let Some(d) = &self.dump_dir {
            let _ = runtime::write_atomic(&d.join(format!("{channel}.txt")), text.as_bytes());
        }
        if self.options.logs.iter().any(|c| c == channel || c == "all") {
            self.logs.push(LogRecord { channel: channel.to_string(), text });
        }
    }
}

impl Stages<'_> {
    /// The result of a graph that runs eagerly (logged on `fallback`), with why.
    fn eager(self, graph: &str, backend: &str, fallbacks: Vec<FallbackRecord>, reason: String) -> CompileResult {
        let mut st = self;
        st.emit("fallback", || format!("graph {graph} runs eagerly: {reason}\n"));
        CompileResult {
            module_path: String::new(),
            module_source: String::new(),
            kernels: 0,
            externs: 0,
            fallbacks,
            timings_ms: st.timings,
            cpp_cache_hit: false,
            logs: st.logs,
            backend: backend.to_string(),
            graph_fallback: Some(reason),
            output_strides: Vec::new(),
            extern_ops: Vec::new(),
            cpp_source: None,
            report_path: None,
            artifact: None,
            artifact_path: String::new(),
        }
    }
}

/// Everything generated for one graph, in memory: the imported graph, its schedule, the rendered
/// kernels, the host plan and the wrapper module that prints it.
pub struct Generated {
    pub graph: crate::graph::Graph,
    pub schedule: Schedule,
    pub kernels: RenderedKernels,
    pub plan: HostPlan,
    pub module: String,
    pub language: KernelLanguage,
    /// The compiled graph as one value: what the front, the cache and the report read.
    pub artifact: CompiledGraph,
}

/// What generation made of a graph: code, or the reason it runs eagerly (a backend that cannot
/// render it, an index the bounds check cannot bound).
pub enum Generation {
    Code(Box<Generated>),
    Eager { graph: String, language: KernelLanguage, reason: String },
}

/// Compiles one exchange-format graph into a wrapper module on disk.
pub fn compile_graph(graph_json: &str, options: &Options) -> Result<CompileResult, CompileError> {
    compile_graph_observed(graph_json, options, &Progress::default())
}

/// Generates the code of one graph in memory (no native compile, nothing written): what the
/// replay corpus compares and `compile_graph` builds on.
pub fn generate(graph_json: &str, options: &Options) -> Result<Generation, CompileError> {
    let progress = Progress::default();
    let mut st = Stages { options, progress: &progress, timings: Vec::new(), logs: Vec::new(), dump_dir: None };
    generate_in(&mut st, graph_json).map(|(generation, _)| generation)
}

/// The stages from import to the wrapper module, timed and dumped through `st`; with the
/// lowering's per-node ATen fallbacks.
fn generate_in(st: &mut Stages, graph_json: &str) -> Result<(Generation, Vec<FallbackRecord>), CompileError> {
    let options = st.options;
    let graph = st.time("import", || parse_graph(graph_json)).map_err(|e| CompileError { stage: "import", message: e.to_string() })?;
    if let Some(d) = &options.debug_dir {
        let key = runtime::sha256_hex(graph_json.as_bytes());
        let dir = d.join(format!("{}_{}", file_component(&graph.name), &key[..10]));
        // the name is the same in every process: a symlink or foreign directory planted there
        // is refused, never written through (the front checks the folder itself, as the cache)
        let refused = |message: String| CompileError { stage: "debug_dir", message };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(d)
            .map_err(|e| refused(format!("cannot create {}: {e}", d.display())))?;
        runtime::cache::private_dir(&dir).map_err(|e| refused(e.to_string()))?;
        // the graph as it arrived: the input of a stage test or of the replay corpus
        let _ = runtime::write_atomic(&dir.join("graph.json"), graph_json.as_bytes());
        st.dump_dir = Some(dir);
    }
    st.emit("graph", || graph.to_string());
    let mut graph = graph;
    for pass in crate::rewrite::GRAPH_PASSES {
        // a pass that fails leaves the graph as it was: it only ever makes a faster equal graph
        let before = graph.clone();
        let pass_options = crate::rewrite::PassOptions {
            cuda_arch: options.cuda_arch,
            gemm_templates: options.gemm_template == GemmTemplate::Always,
            triton_kernels: options.backend.resolve(graph.devices().iter()) == KernelLanguage::Triton,
            ..Default::default()
        };
        let run = std::panic::AssertUnwindSafe(|| (pass.run)(graph, &pass_options));
        let (rewritten, decisions) = match st.time(pass.name, || std::panic::catch_unwind(run)) {
            Ok(result) => result,
            Err(_) => (before, vec![format!("{}: the pass failed (a ferrocore bug); the graph is left as it was", pass.name)]),
        };
        graph = rewritten;
        if !decisions.is_empty() {
            st.emit(pass.name, || decisions.join("\n") + "\n");
        }
        st.dump(&format!("graph_after_{}", pass.name), || graph.to_string());
    }
    // the backend first: lowering writes reductions and scatters for the language it is told
    let language = options.backend.resolve(graph.devices().iter());
    let lower_options =
        LowerOptions { conv_layout: options.conv_layout, pad_mm: options.pad_mm, gemm_template: options.gemm_template, kernels: language };
    let lowered = st
        .time("lowering", || lower_graph_with(&graph, &lower_options))
        .map_err(|e| CompileError { stage: "lowering", message: e.to_string() })?;
    for channel in ["layout", "padding", "gemm_template"] {
        let text: Vec<&str> = lowered.decisions.iter().filter(|(c, _)| *c == channel).map(|(_, d)| d.as_str()).collect();
        if !text.is_empty() {
            st.emit(channel, || text.join("\n") + "\n");
        }
    }
    if cfg!(debug_assertions) {
        lowered.program.verify().map_err(|m| CompileError { stage: "lowering", message: format!("loop IR verifier: {m}") })?;
    }
    st.emit("ir_pre_fusion", || lowered.program.to_string());
    let fallbacks: Vec<FallbackRecord> = lowered
        .fallbacks
        .iter()
        .map(|f| FallbackRecord { node: f.node.clone(), target: f.target.clone(), reason: f.reason.clone() })
        .collect();
    if !fallbacks.is_empty() {
        st.emit("fallback", || fallbacks.iter().map(|f| format!("{} ({}) runs through ATen: {}\n", f.node, f.target, f.reason)).collect());
    }
    let triton = TritonBackend { cpu_tensors: options.backend == BackendChoice::Triton };
    let backend: &dyn KernelBackend = match language {
        KernelLanguage::Cpp => &CppBackend,
        KernelLanguage::Triton => &triton,
    };
    let eager = |reason: String| Ok((Generation::Eager { graph: graph.name.clone(), language, reason }, fallbacks.clone()));
    // whatever the metadata says, no kernel addresses memory outside a buffer: a proven escape
    // is malformed metadata (an error naming the node); an index the check cannot bound runs
    // the graph eagerly rather than risk it
    if let Err(e) = st.time("bounds", || lowered.program.check_bounds()) {
        if e.proven {
            return Err(CompileError { stage: "bounds", message: format!("node '{}': {}", e.node, e.why) });
        }
        return eager(format!("node '{}' {}", e.node, e.why));
    }
    let sched = schedule_in_stages(st, lowered.program, &backend.schedule_options())?;
    st.emit("fusion", || sched.decision_texts().join("\n") + "\n");
    st.emit("ir_post_fusion", || sched.text());
    let kernels = match st.time("codegen", || backend.render(&sched)) {
        Ok(k) => k,
        Err(e) if e.kind == CodegenErrorKind::Unsupported => return eager(e.to_string()),
        Err(e) => return Err(CompileError { stage: "codegen", message: e.to_string() }),
    };
    let (plan, module, artifact) = st.time("wrapper", || {
        let plan = plan_host(&sched, &kernels);
        let artifact = artifact::build(&sched, &kernels, &plan, &graph.name, options.check_inputs);
        // the module is the compiled graph's printing: it reads nothing else
        let module = print_module(&artifact);
        (plan, module, artifact)
    });
    st.emit("output_code", || module.clone());
    Ok((Generation::Code(Box::new(Generated { graph, schedule: sched, kernels, plan, module, language, artifact })), fallbacks))
}

/// The scheduler's rewrites, each a stage of its own (timed, dumped, verified in debug builds),
/// then fusion (stage `scheduling`).
fn schedule_in_stages(st: &mut Stages, mut program: LoopProgram, opts: &ScheduleOptions) -> Result<Schedule, CompileError> {
    let mut decisions = Vec::new();
    for pass in program_passes(opts) {
        decisions.extend(st.time(pass.name, || (pass.run)(&mut program, opts)));
        if cfg!(debug_assertions) {
            program.verify().map_err(|m| CompileError { stage: pass.name, message: format!("loop IR verifier: {m}") })?;
        }
        st.dump(&format!("ir_after_{}", pass.name), || program.to_string());
    }
    st.time("scheduling", || fuse(program, opts, decisions)).map_err(|e| CompileError { stage: "scheduling", message: e.to_string() })
}

/// `compile_graph`, telling `progress` which stage it is in (for a progress line).
pub fn compile_graph_observed(graph_json: &str, options: &Options, progress: &Progress) -> Result<CompileResult, CompileError> {
    let mut st = Stages { options, progress, timings: Vec::new(), logs: Vec::new(), dump_dir: None };
    let (generation, fallbacks) = generate_in(&mut st, graph_json)?;
    let g = match generation {
        Generation::Code(g) => g,
        Generation::Eager { graph, language, reason } => return Ok(st.eager(&graph, language.name(), fallbacks, reason)),
    };
    let Generated { graph, schedule: sched, kernels, plan: _, module, language, artifact } = *g;
    let mut cache_hit = false;
    let native = !kernels.launches.is_empty() && language == KernelLanguage::Cpp;
    let cpp_source = (native && options.skip_native_compile).then(|| kernels.source.clone());
    if native && !options.skip_native_compile {
        let lib = st
            .time("cpp_compile", || {
                runtime::compile_cpp_with(
                    &kernels.source,
                    &options.cache_dir,
                    &options.cxx,
                    &runtime::CppJobs::at_most(options.cpp_jobs),
                    progress,
                )
            })
            .map_err(|e| CompileError { stage: "cpp_compile", message: e.to_string() })?;
        cache_hit = lib.cache_hit;
    }
    let module_path = store_text(&options.cache_dir, &graph.name, "py", &module)
        .map_err(|e| CompileError { stage: "wrapper", message: e.to_string() })?;
    let artifact_path = store_text(&options.cache_dir, &graph.name, "graph.json", &artifact.to_json())
        .map_err(|e| CompileError { stage: "wrapper", message: e.to_string() })?;
    if let Some(d) = &st.dump_dir {
        let _ = runtime::write_atomic(&d.join("output_code.py"), module.as_bytes());
        let file = match language {
            KernelLanguage::Cpp => "kernels.cpp",
            KernelLanguage::Triton => "kernels_triton.py",
        };
        let _ = runtime::write_atomic(&d.join(file), kernels.source.as_bytes());
    }
    let backend_name = language.name();
    let report_path = st.dump_dir.as_ref().and_then(|d| {
        let timings: Vec<(String, f64)> = options.front_timings_ms.iter().chain(&st.timings).cloned().collect();
        let module_path = module_path.to_string_lossy();
        let input = ReportInput {
            graph: &graph,
            compiled: &artifact,
            schedule: &sched,
            timings: &timings,
            module_path: &module_path,
            backend: backend_name,
        };
        let path = d.join("report.html");
        runtime::write_atomic(&path, report::render(&input).as_bytes()).ok().map(|_| path.to_string_lossy().into_owned())
    });
    let externs = sched.program.externs.iter().filter(|e| !e.fallback).count();
    let p = &sched.program;
    let output_strides = p
        .outputs
        .iter()
        .map(|o| match o {
            OutputValue::Buffer(b) => Some(p.buffer(*b).layout.stride.clone()),
            OutputValue::View { stride, .. } => Some(stride.clone()),
            OutputValue::None => None,
        })
        .collect();
    let extern_ops = p.externs.iter().filter(|e| !e.fallback).map(|e| e.callee.clone()).collect();
    Ok(CompileResult {
        module_path: module_path.to_string_lossy().into_owned(),
        module_source: module,
        kernels: kernels.launches.len(),
        externs,
        fallbacks,
        timings_ms: st.timings,
        cpp_cache_hit: cache_hit,
        logs: st.logs,
        backend: backend_name.to_string(),
        graph_fallback: None,
        output_strides,
        extern_ops,
        cpp_source,
        report_path,
        artifact: Some(artifact),
        artifact_path: artifact_path.to_string_lossy().into_owned(),
    })
}

/// A graph name as one safe component of a file name (the importer accepts only identifiers;
/// this holds whatever it is given): ASCII letters, digits and `_` (no `/`, `.`, NUL), at most
/// 64 characters, never empty.
fn file_component(name: &str) -> String {
    let s: String = name.chars().take(64).map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' }).collect();
    if s.is_empty() {
        "graph".into()
    } else {
        s
    }
}

/// Writes the wrapper module (`ext` py) or the serialized compiled graph (`graph.json`) into the
/// cache unless a verified copy is there already (a copy that is missing, truncated, edited or
/// planted is replaced). The front runs what the CompileResult carries, never the files: they
/// are for tracebacks, for running by hand and for tools.
fn store_text(cache_dir: &std::path::Path, graph_name: &str, ext: &str, text: &str) -> Result<PathBuf, runtime::RuntimeError> {
    let cache = runtime::Cache::open(cache_dir)?;
    let key = runtime::sha256_hex(text.as_bytes());
    let rel = format!("graphs/{}/{}_{}.{ext}", &key[..2], file_component(graph_name), &key[..16]);
    match cache.load(&rel)? {
        Some(entry) if entry.bytes == text.as_bytes() => Ok(entry.path),
        _ => cache.store(&rel, text.as_bytes()),
    }
}
