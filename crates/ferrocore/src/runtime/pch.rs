//! The C++ prelude as a precompiled header. Parsing the prelude (<cmath> above all) is ~0.15 s of
//! every compile; loading it precompiled ~0.05 s. A precompiled header is an entry of the cache
//! like a library (signed, verified before use), keyed on the prelude, the compiler and its
//! flags, and built once per user under a lock: the backend starts building it while AOT
//! autograd traces the first graph, so that a cold start does not wait for it either.
//!
//! The compiler reads the header by path, not from a verified open file as the loader does a
//! library; it is verified just before each compile, in a directory only its owner may write
//! (`cache`). Should it be unusable after all (evicted in between, another compiler), the
//! compiler either ignores it and reads the header text beside it, or fails, and the compile is
//! retried with the prelude inline (`compile_cpp`).

use super::cache::Cache;
use super::{rerr, sha256_hex, RuntimeError, CXX_FLAGS};
use std::fs::{self, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Flags of a compile to an object or a header: the library's, less linking.
pub fn compile_flags() -> Vec<&'static str> {
    CXX_FLAGS.iter().copied().filter(|f| *f != "-shared").collect()
}

fn entry_names(prelude: &str, cxx: &str) -> (String, String, String) {
    let mut key_material = format!("precompiled prelude\0{prelude}\0{cxx}");
    for f in CXX_FLAGS {
        key_material.push('\0');
        key_material.push_str(f);
    }
    let key = sha256_hex(key_material.as_bytes());
    let base = format!("cpp/{}/{key}", &key[..2]);
    (format!("{base}.h"), format!("{base}.h.gch"), format!("{base}.lock"))
}

/// The header to `-include` (its precompiled form verified beside it) if the cache holds one.
/// A compile does not build it (0.5 s, three compiles' worth of parsing): `prepare` does, on the
/// side, and a compile that finds it still missing parses the prelude itself.
pub fn precompiled_prelude(cache: &Cache, prelude: &str, cxx: &str) -> Result<Option<PathBuf>, RuntimeError> {
    let (header_rel, gch_rel, _) = entry_names(prelude, cxx);
    verified(cache, &header_rel, &gch_rel)
}

/// Builds the precompiled prelude unless the cache holds it; one builder per user at a time
/// (a lock beside the entry), the others wait and then find it built. True when one is ready.
pub fn prepare(cache_dir: &Path, prelude: &str, cxx: &str) -> Result<bool, RuntimeError> {
    let cache = Cache::open(cache_dir)?;
    let (header_rel, gch_rel, lock_rel) = entry_names(prelude, cxx);
    if verified(&cache, &header_rel, &gch_rel)?.is_some() {
        return Ok(true);
    }
    let lock_path = cache.prepared_path(&lock_rel)?;
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&lock_path)
        .map_err(|e| rerr(format!("cannot open {}: {e}", lock_path.display())))?;
    // SAFETY: flock on a descriptor this function owns; released when `lock` is closed.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(rerr(format!("cannot lock {}", lock_path.display())));
    }
    if verified(&cache, &header_rel, &gch_rel)?.is_some() {
        return Ok(true);
    }
    build(&cache, prelude, cxx, &header_rel, &gch_rel)
}

fn verified(cache: &Cache, header_rel: &str, gch_rel: &str) -> Result<Option<PathBuf>, RuntimeError> {
    let Some(header) = cache.load(header_rel)? else { return Ok(None) };
    Ok(cache.load(gch_rel)?.map(|_| header.path))
}

fn build(cache: &Cache, prelude: &str, cxx: &str, header_rel: &str, gch_rel: &str) -> Result<bool, RuntimeError> {
    let tmp_header = cache.temp_path(header_rel, ".h")?;
    let tmp_gch = cache.temp_path(gch_rel, ".gch")?;
    let cleanup = || {
        let _ = fs::remove_file(&tmp_header);
        let _ = fs::remove_file(&tmp_gch);
    };
    super::cache::write_private_atomic(&tmp_header, prelude.as_bytes())?;
    let mut cmd = Command::new(cxx);
    cmd.args(compile_flags()).args(["-x", "c++-header", "-o"]).arg(&tmp_gch).arg(&tmp_header);
    let ran = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().and_then(|child| {
        // the lowest priority: on a busy machine the graph's own compile (which parses the
        // prelude itself meanwhile) gets the CPUs first. Set after the spawn, not in a pre-exec
        // hook, which would fork this (large) process instead of spawning.
        // SAFETY: setpriority on the pid of a child this function owns.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, child.id(), 19) };
        child.wait_with_output()
    });
    let gch = match ran {
        Ok(out) if out.status.success() => fs::read(&tmp_gch).ok().filter(|b| !b.is_empty()),
        _ => None,
    };
    let Some(gch) = gch else {
        cleanup();
        return Ok(false);
    };
    // the header first: a reader that finds it without its precompiled form waits on the lock
    cache.install(&tmp_header, header_rel, prelude.as_bytes()).inspect_err(|_| cleanup())?;
    cache.install(&tmp_gch, gch_rel, &gch).inspect_err(|_| cleanup())?;
    Ok(true)
}
