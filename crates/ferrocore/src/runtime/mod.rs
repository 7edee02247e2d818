//! Compile, cache and locate native kernels. A translation unit is compiled once by the system
//! C++ compiler into a shared library stored under a key that hashes the source, the compiler and
//! its flags. The cache directory's trust rules (ownership, modes, HMAC manifests) are `cache`;
//! size limits are `evict`. A library is compiled from a private temporary source into a private
//! temporary name, then installed with its manifest, and handed to the loader as an open file of
//! the verified bytes: two processes compiling the same source cannot corrupt each other, and
//! nothing unverified is ever loaded. Loading (dlopen) happens in the Python runtime.

pub mod cache;
pub mod cuda;
pub mod evict;

pub use cache::{default_cache_dir, Cache};
use sha2::{Digest, Sha256};
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

// -fno-math-errno lets math calls vectorize (libmvec) and sqrt inline; NaN/inf semantics stay IEEE.
// -ffp-contract=off: `a * b - c` rounds the product as eager does (g++ fuses it into an FMA by
// default under -march=native: var of constant data then gives 1e-17, not 0); explicit
// `std::fma` in the prelude still compiles to the FMA instruction.
pub const CXX_FLAGS: &[&str] = &[
    "-O3",
    "-march=native",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c++17",
    "-fno-math-errno",
    "-fno-finite-math-only",
    "-ffp-contract=off",
];
/// Libraries linked after the source.
pub const CXX_LIBS: &[&str] = &["-lmvec", "-lm"];

#[derive(Debug, Clone)]
pub struct RuntimeError {
    pub message: String,
}

impl fmt::Display for RuntimeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "runtime: {}", self.message)
    }
}
impl std::error::Error for RuntimeError {}

fn rerr(message: String) -> RuntimeError {
    RuntimeError { message }
}

pub fn sha256_hex(data: &[u8]) -> String {
    let d = Sha256::digest(data);
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// A library ready to load: `file` is open on the verified bytes at `path`.
#[derive(Debug)]
pub struct CompiledLibrary {
    pub path: PathBuf,
    pub source_path: PathBuf,
    pub file: fs::File,
    pub cache_hit: bool,
}

/// Writes `data` to `path` atomically (temporary file in the same directory, then rename), with
/// mode 0600. For files outside the cache (debug dumps); cache entries go through `Cache`.
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<(), RuntimeError> {
    let dir = path.parent().ok_or_else(|| rerr(format!("{} has no parent directory", path.display())))?;
    fs::create_dir_all(dir).map_err(|e| rerr(format!("cannot create {}: {e}", dir.display())))?;
    cache::write_private_atomic(path, data)
}

fn unique_suffix() -> String {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("{}-{nanos}-{n}", std::process::id())
}

/// The cache entry names of a translation unit: (library, source).
fn cpp_entry_names(source: &str, cxx: &str) -> (String, String) {
    let mut key_material = String::from(source);
    key_material.push('\0');
    key_material.push_str(cxx);
    for f in CXX_FLAGS.iter().chain(CXX_LIBS) {
        key_material.push('\0');
        key_material.push_str(f);
    }
    let key = sha256_hex(key_material.as_bytes());
    let base = format!("cpp/{}/{key}", &key[..2]);
    (format!("{base}.so"), format!("{base}.cpp"))
}

/// Returns a shared library built from `source`, compiling it only on a cache miss.
pub fn compile_cpp(source: &str, cache_dir: &Path, cxx: &str) -> Result<CompiledLibrary, RuntimeError> {
    let cache = Cache::open(cache_dir)?;
    let (lib_rel, src_rel) = cpp_entry_names(source, cxx);
    let source_path = cache.path(&src_rel)?;
    if let Some(hit) = cache.load(&lib_rel)? {
        return Ok(CompiledLibrary { path: hit.path, source_path, file: hit.file, cache_hit: true });
    }
    // private names: another process, or an eviction, never touches a compile in flight
    let tmp_src = cache.temp_path(&src_rel, ".cpp")?;
    let tmp_lib = cache.temp_path(&lib_rel, ".so")?;
    cache::write_private_atomic(&tmp_src, source.as_bytes())?;
    let out = Command::new(cxx).args(CXX_FLAGS).arg("-o").arg(&tmp_lib).arg(&tmp_src).args(CXX_LIBS).output();
    let cleanup = || {
        let _ = fs::remove_file(&tmp_lib);
        let _ = fs::remove_file(&tmp_src);
    };
    let out = out.map_err(|e| {
        cleanup();
        rerr(format!("cannot run C++ compiler '{cxx}' on {}: {e}", source_path.display()))
    })?;
    if !out.status.success() {
        cleanup();
        let stderr = String::from_utf8_lossy(&out.stderr).replace(&*tmp_src.to_string_lossy(), &source_path.to_string_lossy());
        let tail: Vec<&str> = stderr.lines().take(40).collect();
        let _ = cache.store(&src_rel, source.as_bytes()); // for the user to read the error against
        return Err(rerr(format!("C++ compilation of {} failed:\n{}", source_path.display(), tail.join("\n"))));
    }
    let opened = fs::File::open(&tmp_lib).and_then(|mut f| {
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut f, &mut bytes).map(|_| (f, bytes))
    });
    let (file, bytes) = opened.map_err(|e| {
        cleanup();
        rerr(format!("cannot read {}: {e}", tmp_lib.display()))
    })?;
    let path = cache.install(&tmp_lib, &lib_rel, &bytes).inspect_err(|_| cleanup())?;
    cache.install(&tmp_src, &src_rel, source.as_bytes()).inspect_err(|_| cleanup())?;
    Ok(CompiledLibrary { path, source_path, file, cache_hit: false })
}

#[cfg(test)]
mod tests;
