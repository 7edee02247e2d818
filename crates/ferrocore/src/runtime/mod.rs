//! Compile, cache and locate native kernels. A translation unit is compiled once by the system
//! C++ compiler into a shared library stored under a key that hashes the source, the compiler and
//! its flags. Entries are written to temporary names and renamed into place, with a checksum
//! beside them: a truncated or corrupt entry is detected and rebuilt, and two processes compiling
//! the same source cannot corrupt each other. Loading (dlopen) happens in the wrapper.

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

#[derive(Debug, Clone)]
pub struct CompiledLibrary {
    pub path: PathBuf,
    pub source_path: PathBuf,
    pub cache_hit: bool,
}

/// Writes `data` to `path` atomically (temporary file in the same directory, then rename).
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<(), RuntimeError> {
    let dir = path.parent().ok_or_else(|| rerr(format!("{} has no parent directory", path.display())))?;
    fs::create_dir_all(dir).map_err(|e| rerr(format!("cannot create {}: {e}", dir.display())))?;
    let tmp = dir.join(format!(".{}.{}.tmp", path.file_name().and_then(|n| n.to_str()).unwrap_or("f"), unique_suffix()));
    fs::write(&tmp, data).map_err(|e| rerr(format!("cannot write {}: {e}", tmp.display())))?;
    fs::rename(&tmp, path).map_err(|e| rerr(format!("cannot rename {} to {}: {e}", tmp.display(), path.display())))
}

fn unique_suffix() -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("{}-{nanos}", std::process::id())
}

fn entry_valid(lib: &Path, sum: &Path) -> bool {
    match (fs::read(lib), fs::read_to_string(sum)) {
        (Ok(bytes), Ok(expected)) => !bytes.is_empty() && sha256_hex(&bytes) == expected.trim(),
        _ => false,
    }
}

/// Returns a shared library built from `source`, compiling it only on a cache miss.
pub fn compile_cpp(source: &str, cache_dir: &Path, cxx: &str) -> Result<CompiledLibrary, RuntimeError> {
    let mut key_material = String::from(source);
    key_material.push('\0');
    key_material.push_str(cxx);
    for f in CXX_FLAGS.iter().chain(CXX_LIBS) {
        key_material.push('\0');
        key_material.push_str(f);
    }
    let key = sha256_hex(key_material.as_bytes());
    let dir = cache_dir.join("cpp").join(&key[..2]).join(&key);
    let lib = dir.join("kernels.so");
    let sum = dir.join("kernels.so.sha256");
    let src = dir.join("kernels.cpp");
    if entry_valid(&lib, &sum) {
        return Ok(CompiledLibrary { path: lib, source_path: src, cache_hit: true });
    }
    fs::create_dir_all(&dir).map_err(|e| rerr(format!("cannot create cache directory {}: {e}", dir.display())))?;
    write_atomic(&src, source.as_bytes())?;
    let tmp_lib = dir.join(format!(".kernels.{}.so", unique_suffix()));
    let out = Command::new(cxx)
        .args(CXX_FLAGS)
        .arg("-o")
        .arg(&tmp_lib)
        .arg(&src)
        .args(CXX_LIBS)
        .output()
        .map_err(|e| rerr(format!("cannot run C++ compiler '{cxx}' on {}: {e}", src.display())))?;
    if !out.status.success() {
        let _ = fs::remove_file(&tmp_lib);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().take(40).collect();
        return Err(rerr(format!("C++ compilation of {} failed:\n{}", src.display(), tail.join("\n"))));
    }
    let bytes = fs::read(&tmp_lib).map_err(|e| rerr(format!("cannot read {}: {e}", tmp_lib.display())))?;
    fs::rename(&tmp_lib, &lib).map_err(|e| rerr(format!("cannot install {}: {e}", lib.display())))?;
    write_atomic(&sum, sha256_hex(&bytes).as_bytes())?;
    Ok(CompiledLibrary { path: lib, source_path: src, cache_hit: false })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ferrocore-rt-{tag}-{}", unique_suffix()));
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn cache_hit_and_corruption_rebuild() {
        let dir = tmpdir("cache");
        let src = "extern \"C\" int forty_two() { return 42; }\n";
        let a = compile_cpp(src, &dir, "g++").unwrap();
        assert!(!a.cache_hit);
        let b = compile_cpp(src, &dir, "g++").unwrap();
        assert!(b.cache_hit);
        assert_eq!(a.path, b.path);
        // truncate the library: detected and rebuilt
        fs::write(&a.path, b"").unwrap();
        let c = compile_cpp(src, &dir, "g++").unwrap();
        assert!(!c.cache_hit);
        assert!(fs::read(&c.path).unwrap().len() > 100);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn compiler_failure_names_the_source() {
        let dir = tmpdir("fail");
        let e = compile_cpp("this is not C++", &dir, "g++").unwrap_err().to_string();
        assert!(e.contains("kernels.cpp") && e.contains("failed"), "{e}");
        let _ = fs::remove_dir_all(&dir);
    }
}
