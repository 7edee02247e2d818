//! The Python extension module `ferrocore._ferrocore`: JSON in, JSON out. The only crate that
//! knows about Python. No panic crosses into Python: every entry point catches unwinding and
//! raises `FerrocoreError` with the message.

use ferrocore::driver::{compile_graph as drive, Options};
use ferrocore::runtime;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use serde_json::{json, Map, Value};
use std::os::unix::io::IntoRawFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
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

/// Compiles an exchange-format graph; returns the CompileResult as JSON.
#[pyfunction]
fn compile_graph(graph_json: &str, options_json: &str) -> PyResult<String> {
    guarded("compile_graph", || {
        let options = parse_options(options_json)?;
        let r = drive(graph_json, &options).map_err(|e| e.to_string())?;
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
        });
        Ok(out.to_string())
    })
}

/// Compiles (or finds in the cache) a C++ translation unit; returns the library path.
#[pyfunction]
fn compile_cpp(source: &str, options_json: &str) -> PyResult<String> {
    guarded("compile_cpp", || {
        let options = parse_options(options_json)?;
        let lib = runtime::compile_cpp(source, &options.cache_dir, &options.cxx).map_err(|e| e.to_string())?;
        Ok(lib.path.to_string_lossy().into_owned())
    })
}

/// Like `compile_cpp`, plus an open file descriptor of the verified library (the caller loads
/// `/proc/self/fd/N` and closes it): what is loaded is what was verified.
#[pyfunction]
fn load_cpp(source: &str, options_json: &str) -> PyResult<(String, i32)> {
    guarded("load_cpp", || {
        let options = parse_options(options_json)?;
        let lib = runtime::compile_cpp(source, &options.cache_dir, &options.cxx).map_err(|e| e.to_string())?;
        Ok((lib.path.to_string_lossy().into_owned(), lib.file.into_raw_fd()))
    })
}

/// The bytes of cache entry `rel` under `cache_dir` if they match its manifest, else None.
#[pyfunction]
fn cache_read<'py>(py: Python<'py>, cache_dir: &str, rel: &str) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let entry = guarded("cache_read", || {
        let cache = runtime::Cache::open(Path::new(cache_dir)).map_err(|e| e.to_string())?;
        cache.load(rel).map_err(|e| e.to_string())
    })?;
    Ok(entry.map(|e| PyBytes::new(py, &e.bytes)))
}

/// Writes cache entry `rel` under `cache_dir` and its manifest.
#[pyfunction]
fn cache_write(cache_dir: &str, rel: &str, data: &[u8]) -> PyResult<()> {
    guarded("cache_write", || {
        let cache = runtime::Cache::open(Path::new(cache_dir)).map_err(|e| e.to_string())?;
        cache.store(rel, data).map(|_| ()).map_err(|e| e.to_string())
    })
}

/// Evicts least recently used entries until `cache_dir` holds at most `max_bytes`; JSON stats.
#[pyfunction]
fn evict_cache(cache_dir: &str, max_bytes: u64, stale_after_s: f64) -> PyResult<String> {
    guarded("evict_cache", || {
        let cache = runtime::Cache::open(Path::new(cache_dir)).map_err(|e| e.to_string())?;
        let stale = Duration::try_from_secs_f64(stale_after_s).map_err(|e| format!("stale_after_s: {e}"))?;
        let r = runtime::evict::evict(&cache, max_bytes, stale).map_err(|e| e.to_string())?;
        Ok(json!({"total_bytes": r.total_bytes, "removed_entries": r.removed_entries, "removed_bytes": r.removed_bytes})
            .to_string())
    })
}

/// The default cache directory (what `Options::default` uses).
#[pyfunction]
fn default_cache_dir() -> String {
    runtime::default_cache_dir().to_string_lossy().into_owned()
}

#[pymodule]
fn _ferrocore(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("FerrocoreError", m.py().get_type::<FerrocoreError>())?;
    m.add_function(wrap_pyfunction!(compile_graph, m)?)?;
    m.add_function(wrap_pyfunction!(compile_cpp, m)?)?;
    m.add_function(wrap_pyfunction!(load_cpp, m)?)?;
    m.add_function(wrap_pyfunction!(cache_read, m)?)?;
    m.add_function(wrap_pyfunction!(cache_write, m)?)?;
    m.add_function(wrap_pyfunction!(evict_cache, m)?)?;
    m.add_function(wrap_pyfunction!(default_cache_dir, m)?)?;
    Ok(())
}
