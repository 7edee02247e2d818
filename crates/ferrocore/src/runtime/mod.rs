//! Compile, cache and locate native kernels. A graph's C++ source is compiled once by the system
//! C++ compiler (a large one as parallel units) into a
//! shared library stored under a key that hashes the source, the compiler and its flags. The cache directory's trust rules (ownership, modes, HMAC manifests) are `cache`;
//! size limits are `evict`. A library is compiled from a private temporary source into a private
//! temporary name, then installed with its manifest, and handed to the loader as an open file of
//! the verified bytes: two processes compiling the same source cannot corrupt each other, and
//! nothing unverified is ever loaded. Loading (dlopen) happens in the Python runtime.

pub mod cache;
pub mod cuda;
pub mod evict;
pub mod progress;

pub use cache::{default_cache_dir, Cache};
pub use progress::Progress;
use sha2::{Digest, Sha256};
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

// -fno-math-errno lets math calls vectorize (libmvec) and sqrt inline; NaN/inf semantics stay IEEE.
// -fno-trapping-math lets g++ if-convert a select between float values (`x > 0 ? x : 0.1f * x`,
// the range checks in `ferro_expf`) into a blend: with trapping math it keeps the branch, and the
// loop does not vectorize. Kernels never enable floating-point exceptions, so no result changes.
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
    "-fno-trapping-math",
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

/// Marks where a C++ source may be cut into translation units compiled in parallel: the text
/// before the first mark (the prelude) is repeated in every unit; each marked piece (one
/// kernel, self-contained) goes to exactly one unit.
pub const CPP_UNIT_MARK: &str = "// ferrocore: unit boundary\n";

/// Kernel text per unit below which another unit costs more than it saves: each unit costs a
/// compiler process and the prelude (~0.05 s together), what about 8 KiB of vectorized kernels
/// take to optimize.
const MIN_UNIT_BYTES: usize = 8 * 1024;
const MAX_UNITS: usize = 8;

/// How many units a compile may use: the CPUs this process may run on, at most `MAX_UNITS`.
pub fn cpp_unit_jobs() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(MAX_UNITS)
}

/// One translation unit: the prelude, then kernels, each after a `#line` that points the
/// compiler's messages at the line of the whole source (as stored in the cache) where it begins.
#[derive(Debug, Clone, PartialEq)]
pub struct CppUnit {
    pub text: String,
    pub kernels: usize,
}

/// Cuts `source` at `CPP_UNIT_MARK`s into at most `jobs` units of about equal kernel text, each
/// at least `min_bytes` of it (the whole source when it cannot be cut). `shown_as` is the name
/// `#line` gives the source.
pub fn plan_cpp_units(source: &str, jobs: usize, min_bytes: usize, shown_as: &str) -> Vec<CppUnit> {
    let mut pieces = source.split(CPP_UNIT_MARK);
    let prelude = pieces.next().unwrap_or("");
    let kernels: Vec<&str> = pieces.collect();
    let kernel_bytes: usize = kernels.iter().map(|k| k.len()).sum();
    let units = jobs.min(kernel_bytes / min_bytes.max(1)).min(kernels.len()).max(1);
    if units == 1 {
        return vec![CppUnit { text: source.to_string(), kernels: kernels.len() }];
    }
    // line where each piece starts in `source`: after the prelude, its mark, and earlier pieces
    let mut line = 1 + prelude.matches('\n').count();
    let target = kernel_bytes.div_ceil(units);
    let mut out: Vec<CppUnit> = Vec::new();
    let mut filled = 0; // kernel bytes in the last unit
    for k in kernels {
        line += 1; // the mark's own line
        if out.is_empty() || (filled + k.len() > target && out.len() < units) {
            out.push(CppUnit { text: prelude.to_string(), kernels: 0 });
            filled = 0;
        }
        let unit = out.last_mut().expect("a unit was opened above");
        let _ = std::fmt::Write::write_fmt(&mut unit.text, format_args!("#line {line} \"{shown_as}\"\n{k}"));
        unit.kernels += 1;
        filled += k.len();
        line += k.matches('\n').count();
    }
    out
}

/// `path` as a C string literal's contents for `#line`; a name the literal cannot carry plainly
/// is replaced by the file name the cache gives every source.
fn line_directive_name(path: &Path) -> String {
    let s = path.to_string_lossy();
    if s.chars().all(|c| !c.is_control() && c != '"' && c != '\\') {
        s.into_owned()
    } else {
        "kernels.cpp".to_string()
    }
}

/// Returns a shared library built from `source`, compiling it only on a cache miss. A large
/// marked source is cut into units (`plan_cpp_units`) compiled by parallel compiler processes,
/// then linked; the cache key is the whole source's, however it was built.
pub fn compile_cpp(source: &str, cache_dir: &Path, cxx: &str, progress: &Progress) -> Result<CompiledLibrary, RuntimeError> {
    compile_cpp_with(source, cache_dir, cxx, &CppJobs::at_most(0), progress)
}

/// How a source may be cut into units: at most `jobs`, of at least `min_unit_bytes` of kernels.
#[derive(Debug, Clone, Copy)]
pub struct CppJobs {
    pub jobs: usize,
    pub min_unit_bytes: usize,
}

impl CppJobs {
    /// At most `jobs` units (0: as many as `cpp_unit_jobs`): a compile that runs beside another
    /// takes its share of the CPUs, since each extra unit costs a compiler process, the
    /// parse of the prelude and a link.
    pub fn at_most(jobs: usize) -> CppJobs {
        let jobs = if jobs == 0 { cpp_unit_jobs() } else { jobs.min(MAX_UNITS) };
        CppJobs { jobs, min_unit_bytes: MIN_UNIT_BYTES }
    }
}

/// `compile_cpp` under the unit policy `split`.
pub fn compile_cpp_with(
    source: &str,
    cache_dir: &Path,
    cxx: &str,
    split: &CppJobs,
    progress: &Progress,
) -> Result<CompiledLibrary, RuntimeError> {
    let (jobs, min_unit_bytes) = (split.jobs, split.min_unit_bytes);
    let cache = Cache::open(cache_dir)?;
    let (lib_rel, src_rel) = cpp_entry_names(source, cxx);
    let source_path = cache.path(&src_rel)?;
    if let Some(hit) = cache.load(&lib_rel)? {
        return Ok(CompiledLibrary { path: hit.path, source_path, file: hit.file, cache_hit: true });
    }
    // private names: another process, or an eviction, never touches a compile in flight
    let tmp_src = cache.temp_path(&src_rel, ".cpp")?;
    let tmp_lib = cache.temp_path(&lib_rel, ".so")?;
    let build = Build { cache: &cache, cxx, src_rel: &src_rel, lib_rel: &lib_rel, source_path: &source_path, tmp_lib: &tmp_lib, progress };
    let mut temps = vec![tmp_src.clone(), tmp_lib.clone()];
    let cleanup = |temps: &[PathBuf]| {
        for t in temps {
            let _ = fs::remove_file(t);
        }
    };
    let shown_as = line_directive_name(&source_path);
    let built = cache::write_private_atomic(&tmp_src, source.as_bytes()).and_then(|_| {
        let units = plan_cpp_units(source, jobs, min_unit_bytes, &shown_as);
        build.units(&units, &mut temps)
    });
    if let Err(e) = built {
        cleanup(&temps);
        let _ = cache.store(&src_rel, source.as_bytes()); // for the user to read the error against
        return Err(e);
    }
    let opened = fs::File::open(&tmp_lib).and_then(|mut f| {
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut f, &mut bytes).map(|_| (f, bytes))
    });
    let (file, bytes) = opened.map_err(|e| {
        cleanup(&temps);
        rerr(format!("cannot read {}: {e}", tmp_lib.display()))
    })?;
    let path = cache.install(&tmp_lib, &lib_rel, &bytes).inspect_err(|_| cleanup(&temps))?;
    cache.install(&tmp_src, &src_rel, source.as_bytes()).inspect_err(|_| cleanup(&temps))?;
    cleanup(&temps[2..]);
    Ok(CompiledLibrary { path, source_path, file, cache_hit: false })
}

/// What building one library needs to know; its temporaries are pushed onto the caller's list.
struct Build<'a> {
    cache: &'a Cache,
    cxx: &'a str,
    src_rel: &'a str,
    lib_rel: &'a str,
    source_path: &'a Path,
    tmp_lib: &'a Path,
    progress: &'a Progress,
}

impl Build<'_> {
    /// Compiles the units into `tmp_lib`: one unit in one compiler run, several to object files
    /// all at once, then linked.
    fn units(&self, units: &[CppUnit], temps: &mut Vec<PathBuf>) -> Result<(), RuntimeError> {
        let kernels: usize = units.iter().map(|u| u.kernels).sum();
        self.progress.stage(&format!("C++ compile of {kernels} kernels in {} units", units.len()), units.len());
        let mut files = Vec::new();
        for (i, u) in units.iter().enumerate() {
            let src = self.cache.temp_path(self.src_rel, &format!(".unit{i}.cpp"))?;
            let obj = self.cache.temp_path(self.lib_rel, &format!(".unit{i}.o"))?;
            temps.push(src.clone());
            temps.push(obj.clone());
            cache::write_private_atomic(&src, u.text.as_bytes())?;
            files.push((src, obj));
        }
        if let [(src, _)] = &files[..] {
            let r = self.run(src, |c| c.args(CXX_FLAGS).arg("-o").arg(self.tmp_lib).arg(src).args(CXX_LIBS));
            self.progress.advance();
            return r;
        }
        // the library's flags, less linking
        let flags: Vec<&str> = CXX_FLAGS.iter().copied().filter(|f| *f != "-shared").collect();
        let flags = &flags;
        let results: Vec<Result<(), RuntimeError>> = std::thread::scope(|s| {
            let handles: Vec<_> = files
                .iter()
                .map(|(src, obj)| {
                    s.spawn(move || {
                        let r = self.run(src, |c| c.args(flags).arg("-c").arg("-o").arg(obj).arg(src));
                        self.progress.advance();
                        r
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(rerr("a compiler thread panicked".into())))).collect()
        });
        results.into_iter().collect::<Result<Vec<()>, _>>()?;
        let objects: Vec<&PathBuf> = files.iter().map(|(_, o)| o).collect();
        self.run(self.tmp_lib, |c| c.args(["-shared", "-fopenmp", "-o"]).arg(self.tmp_lib).args(&objects).args(CXX_LIBS))
    }

    /// Runs the compiler as `args` sets it up; a failure's message names the source as stored
    /// in the cache where the compiler named the private temporary `shown`.
    fn run(&self, shown: &Path, args: impl FnOnce(&mut Command) -> &mut Command) -> Result<(), RuntimeError> {
        let (cxx, source_path) = (self.cxx, self.source_path);
        let mut cmd = Command::new(cxx);
        let out = args(&mut cmd).output().map_err(|e| {
            let hint = if e.kind() == std::io::ErrorKind::NotFound {
                " (no such program: install g++, or set CXX or the `cxx` option to a C++ compiler)"
            } else {
                ""
            };
            rerr(format!("cannot run C++ compiler '{cxx}' on {}: {e}{hint}", source_path.display()))
        })?;
        if out.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&out.stderr).replace(&*shown.to_string_lossy(), &source_path.to_string_lossy());
        let tail: Vec<&str> = stderr.lines().take(40).collect();
        Err(rerr(format!("C++ compilation of {} failed:\n{}", source_path.display(), tail.join("\n"))))
    }
}

#[cfg(test)]
mod tests;
