//! The Python extension module `ferrocore._ferrocore`: JSON in, JSON out. The only crate that
//! knows about Python. No panic crosses into Python: every entry point catches unwinding and
//! raises `FerrocoreError` with the message.

use ferrocore::driver::{compile_graph_observed as drive, Options};
use ferrocore::runtime;
use ferrocore::runtime::cuda;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyTuple};
use serde_json::{json, Map, Value};
use std::os::unix::io::IntoRawFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

create_exception!(_ferrocore, FerrocoreError, PyException);

fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(msg)) => Err(FerrocoreError::new_err(msg)),
        Err(payload) => {
            let msg = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(FerrocoreError::new_err(format!("internal error in {what} (a ferrocore bug): {msg}")))
        }
    }
}

fn parse_options(options_json: &str) -> Result<Options, String> {
    if options_json.trim().is_empty() {
        return Ok(Options::default());
    }
    serde_json::from_str(options_json).map_err(|e| format!("invalid options: {e}"))
}

/// What a compile in flight is doing: `compile_graph` fills it in, a progress line's thread
/// reads it (`snapshot()`: stage, parts done, parts in all).
#[pyclass(frozen)]
#[derive(Default)]
struct CompileProgress {
    inner: Arc<runtime::Progress>,
}

#[pymethods]
impl CompileProgress {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    fn snapshot(&self) -> (String, usize, usize) {
        self.inner.snapshot()
    }
}

/// Compiles an exchange-format graph; returns the CompileResult as JSON. The GIL is released
/// meanwhile (a progress line, Triton's compile workers' threads run).
#[pyfunction]
#[pyo3(signature = (graph_json, options_json, progress=None))]
fn compile_graph(py: Python<'_>, graph_json: &str, options_json: &str, progress: Option<&CompileProgress>) -> PyResult<String> {
    let progress = progress.map(|p| p.inner.clone()).unwrap_or_default();
    let (graph_json, options_json) = (graph_json.to_string(), options_json.to_string());
    py.detach(move || compile_graph_detached(&graph_json, &options_json, &progress))
}

fn compile_graph_detached(graph_json: &str, options_json: &str, progress: &runtime::Progress) -> PyResult<String> {
    guarded("compile_graph", || {
        let options = parse_options(options_json)?;
        let r = drive(graph_json, &options, progress).map_err(|e| e.to_string())?;
        let mut timings = Map::new();
        for (k, v) in &r.timings_ms {
            timings.insert(k.clone(), json!(v));
        }
        let out = json!({
            "module_path": r.module_path,
            "module_source": r.module_source,
            "kernels": r.kernels,
            "externs": r.externs,
            "fallbacks": r.fallbacks,
            "timings_ms": Value::Object(timings),
            "cpp_cache_hit": r.cpp_cache_hit,
            "logs": r.logs,
            "backend": r.backend,
            "graph_fallback": r.graph_fallback,
            "output_strides": r.output_strides,
            "extern_ops": r.extern_ops,
            "cpp_source": r.cpp_source,
            "report_path": r.report_path,
            // as text: the front keeps it as one string and reads it where it needs a fact (a
            // parsed copy of every graph's would be thousands of objects for the collector)
            "artifact": r.artifact.as_ref().map(|a| a.to_json()),
            "artifact_path": r.artifact_path,
        });
        Ok(out.to_string())
    })
}

/// Compiles (or finds in the cache) a C++ translation unit; returns the library path. Like
/// every entry point below that reads files, runs the compiler or calls the driver, it releases
/// the GIL: the backend's other threads (kernel compiles, GEMM timings) and the graph being
/// serialized meanwhile would otherwise stall for the whole call.
#[pyfunction]
fn compile_cpp(py: Python<'_>, source: &str, options_json: &str) -> PyResult<String> {
    py.detach(|| guarded("compile_cpp", || Ok(compiled_library(source, options_json)?.path.to_string_lossy().into_owned())))
}

/// Like `compile_cpp`, plus an open file descriptor of the verified library (the caller loads
/// `/proc/self/fd/N` and closes it: what is loaded is what was verified) and whether it was in
/// the cache.
#[pyfunction]
fn load_cpp(py: Python<'_>, source: &str, options_json: &str) -> PyResult<(String, i32, bool)> {
    py.detach(|| {
        guarded("load_cpp", || {
            let lib = compiled_library(source, options_json)?;
            Ok((lib.path.to_string_lossy().into_owned(), lib.file.into_raw_fd(), lib.cache_hit))
        })
    })
}

fn compiled_library(source: &str, options_json: &str) -> Result<runtime::CompiledLibrary, String> {
    let options = parse_options(options_json)?;
    let jobs = runtime::CppJobs::at_most(options.cpp_jobs);
    runtime::compile_cpp_with(source, &options.cache_dir, &options.cxx, &jobs, &runtime::Progress::default()).map_err(|e| e.to_string())
}

/// The bytes of cache entry `rel` under `cache_dir` if they match its manifest, else None.
#[pyfunction]
fn cache_read<'py>(py: Python<'py>, cache_dir: &str, rel: &str) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let entry = py.detach(|| {
        guarded("cache_read", || {
            let cache = runtime::Cache::open(Path::new(cache_dir)).map_err(|e| e.to_string())?;
            cache.load(rel).map_err(|e| e.to_string())
        })
    })?;
    Ok(entry.map(|e| PyBytes::new(py, &e.bytes)))
}

/// Writes cache entry `rel` under `cache_dir` and its manifest.
#[pyfunction]
fn cache_write(py: Python<'_>, cache_dir: &str, rel: &str, data: &[u8]) -> PyResult<()> {
    py.detach(|| {
        guarded("cache_write", || {
            let cache = runtime::Cache::open(Path::new(cache_dir)).map_err(|e| e.to_string())?;
            cache.store(rel, data).map(|_| ()).map_err(|e| e.to_string())
        })
    })
}

/// Evicts least recently used entries until `cache_dir` holds at most `max_bytes`; JSON stats.
#[pyfunction]
fn evict_cache(py: Python<'_>, cache_dir: &str, max_bytes: u64, stale_after_s: f64) -> PyResult<String> {
    py.detach(|| {
        guarded("evict_cache", || {
            let cache = runtime::Cache::open(Path::new(cache_dir)).map_err(|e| e.to_string())?;
            let stale = Duration::try_from_secs_f64(stale_after_s).map_err(|e| format!("stale_after_s: {e}"))?;
            let r = runtime::evict::evict(&cache, max_bytes, stale).map_err(|e| e.to_string())?;
            Ok(json!({"total_bytes": r.total_bytes, "removed_entries": r.removed_entries, "removed_bytes": r.removed_bytes}).to_string())
        })
    })
}

/// The compiler's options for the front: defaults, choices, log channels (JSON).
#[pyfunction]
fn option_schema() -> String {
    ferrocore::driver::option_schema()
}

/// torch's names of the dtypes a graph may hold (`float32`, `bfloat16`, ...): what the front
/// serializes, the exchange format's table.
#[pyfunction]
fn dtype_names() -> Vec<&'static str> {
    ferrocore::graph::DType::all().into_iter().map(|d| d.torch_name()).collect()
}

/// The default cache directory (what `Options::default` uses).
#[pyfunction]
fn default_cache_dir() -> String {
    runtime::default_cache_dir().to_string_lossy().into_owned()
}

/// The CUDA driver, opened at run time: loads cubins as `CudaKernel`s.
#[pyclass(frozen)]
struct CudaDriver {
    driver: Arc<cuda::Driver>,
}

#[pymethods]
impl CudaDriver {
    #[new]
    fn new() -> PyResult<Self> {
        guarded("CudaDriver", || cuda::Driver::open().map(|driver| CudaDriver { driver }).map_err(|e| e.to_string()))
    }

    /// Loads kernel `name` of `cubin` on `device`; `trailing_nulls` null pointers follow the
    /// buffers at each launch (a Triton kernel's scratch parameters).
    #[allow(clippy::too_many_arguments)] // the Python method's parameters, one per launch fact
    fn load(
        &self,
        py: Python<'_>,
        cubin: &[u8],
        name: &str,
        device: i32,
        num_warps: u32,
        shared: u32,
        trailing_nulls: u32,
    ) -> PyResult<CudaKernel> {
        py.detach(|| {
            guarded("CudaDriver.load", || {
                let config = cuda::LaunchConfig { num_warps, shared, trailing_nulls };
                cuda::Kernel::load(&self.driver, cubin, name, device, config).map(|kernel| CudaKernel { kernel }).map_err(|e| e.to_string())
            })
        })
    }
}

/// A loaded GPU kernel whose parameters are buffers.
#[pyclass(frozen)]
struct CudaKernel {
    kernel: cuda::Kernel,
}

#[pymethods]
impl CudaKernel {
    /// Launches `grid` blocks on `stream` with the tensors' (or integer addresses') memory as
    /// the buffers. Returns False, launching nothing, when an address is not 16-byte aligned:
    /// the binary was compiled for aligned buffers.
    #[pyo3(signature = (grid, stream, *args))]
    fn launch(&self, grid: u32, stream: u64, args: &Bound<'_, PyTuple>) -> PyResult<bool> {
        let py = args.py();
        let mut pointers = Vec::with_capacity(args.len());
        for a in args.iter() {
            // (not `extract` on anything: a one-element integer tensor converts to its value)
            let p: u64 = if a.is_instance_of::<PyInt>() { a.extract()? } else { a.call_method0(intern!(py, "data_ptr"))?.extract()? };
            if !p.is_multiple_of(16) {
                return Ok(false);
            }
            pointers.push(p);
        }
        guarded("CudaKernel.launch", || self.kernel.launch(grid, stream, &pointers).map_err(|e| e.to_string()))?;
        Ok(true)
    }
}

/// The parameter count of kernel `name`'s entry in PTX text (None when absent).
#[pyfunction]
fn ptx_param_count(ptx: &str, name: &str) -> Option<usize> {
    cuda::ptx_param_count(ptx, name)
}

/// The forward values a joint training graph saves for its backward (`ferrocore::joint`), as
/// positions in its node list: `joint_json` a `JointGraph`.
#[pyfunction]
fn joint_saved_values(py: Python<'_>, joint_json: &str) -> PyResult<Vec<usize>> {
    py.detach(|| {
        guarded("joint_saved_values", || {
            let joint: ferrocore::joint::JointGraph = serde_json::from_str(joint_json).map_err(|e| format!("invalid joint graph: {e}"))?;
            ferrocore::joint::saved_values(&joint).map_err(|e| e.to_string())
        })
    })
}

/// What the attention mask `graph_json` returns (its one output) is to `queries` x `keys`
/// scores (`rewrite::causal::mask_kind`): ("open" | "causal", "") or ("kept", why not).
#[pyfunction]
fn attention_mask_kind(py: Python<'_>, graph_json: &str, queries: i64, keys: i64) -> PyResult<(String, String)> {
    py.detach(|| {
        guarded("attention_mask_kind", || {
            let g = ferrocore::graph::parse_graph(graph_json).map_err(|e| e.to_string())?;
            Ok(match ferrocore::rewrite::causal::mask_kind(&g, [queries, keys]) {
                Ok(ferrocore::rewrite::causal::MaskKind::Open) => ("open".into(), String::new()),
                Ok(ferrocore::rewrite::causal::MaskKind::Causal) => ("causal".into(), String::new()),
                Err(why) => ("kept".into(), why),
            })
        })
    })
}

/// A fused attention's ops as JSON, and the name of the one that gives the result.
type TracedReplacement = Option<(String, String)>;

/// The ops that compute the value `graph_json` returns (its one output) with a fused attention
/// call, when it is written-out attention (`rewrite::traced::attention_in_trace`): a JSON list of
/// exchange-format nodes and the name of the one whose value is the output, or None; and the
/// attention pass's lines.
#[pyfunction]
fn attention_in_trace(py: Python<'_>, graph_json: &str, cuda_arch: u32, backend: &str) -> PyResult<(TracedReplacement, Vec<String>)> {
    py.detach(|| {
        guarded("attention_in_trace", || {
            let g = ferrocore::graph::parse_graph(graph_json).map_err(|e| e.to_string())?;
            let choice: ferrocore::driver::BackendChoice =
                serde_json::from_value(serde_json::Value::String(backend.to_string())).map_err(|e| format!("backend {backend:?}: {e}"))?;
            let triton = choice.resolve(g.devices().iter()) == ferrocore::codegen::KernelLanguage::Triton;
            let (replacement, decisions) = ferrocore::rewrite::traced::attention_in_trace(g, cuda_arch, triton);
            let replacement = replacement.map(|r| (serde_json::Value::Array(r.nodes).to_string(), r.output));
            Ok((replacement, decisions))
        })
    })
}

/// Whether the compiler runs a forward 2-D CPU convolution as a GEMM or a generated kernel
/// instead of oneDNN (`lowering::cpu_conv_runs_compiled`): input (n, c, h, w), weight
/// (o, c / groups, kh, kw).
#[pyfunction]
fn cpu_conv_runs_compiled(
    input: [i64; 4],
    weight: [i64; 4],
    stride: [i64; 2],
    padding: [i64; 2],
    dilation: [i64; 2],
    groups: i64,
) -> PyResult<bool> {
    guarded("cpu_conv_runs_compiled", || {
        if stride.contains(&0) {
            return Err(format!("cpu_conv_runs_compiled: stride {stride:?} has a zero"));
        }
        Ok(ferrocore::lowering::cpu_conv_runs_compiled(input, weight, stride, padding, dilation, groups))
    })
}

#[pymodule]
fn _ferrocore(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // the constants the front needs, from the one place each is defined
    m.add("GEMM_ALIGN", ferrocore::lowering::GEMM_ALIGN)?;
    m.add("FerrocoreError", m.py().get_type::<FerrocoreError>())?;
    m.add_function(wrap_pyfunction!(compile_graph, m)?)?;
    m.add_function(wrap_pyfunction!(compile_cpp, m)?)?;
    m.add_class::<CompileProgress>()?;
    m.add_function(wrap_pyfunction!(load_cpp, m)?)?;
    m.add_function(wrap_pyfunction!(cache_read, m)?)?;
    m.add_function(wrap_pyfunction!(cache_write, m)?)?;
    m.add_function(wrap_pyfunction!(evict_cache, m)?)?;
    m.add_function(wrap_pyfunction!(default_cache_dir, m)?)?;
    m.add_function(wrap_pyfunction!(option_schema, m)?)?;
    m.add_function(wrap_pyfunction!(dtype_names, m)?)?;
    m.add_function(wrap_pyfunction!(ptx_param_count, m)?)?;
    m.add_function(wrap_pyfunction!(joint_saved_values, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_conv_runs_compiled, m)?)?;
    m.add_function(wrap_pyfunction!(attention_mask_kind, m)?)?;
    m.add_function(wrap_pyfunction!(attention_in_trace, m)?)?;
    m.add_class::<CudaDriver>()?;
    m.add_class::<CudaKernel>()?;
    Ok(())
}
