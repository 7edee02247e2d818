//! Keeping the on-disk cache under a size: entries go oldest-used first (a hit touches the
//! manifest, `Cache::load`), entries no manifest vouches for (an older ferrocore's, a crashed
//! writer's) before any other. It looks only into the areas ferrocore writes
//! (`ENTRY_AREAS`), never follows a symlink and never removes the key.
//!
//! Why removing an entry cannot break another process using it: a loader reads the entry from
//! one open file and maps that same file (dlopen of `/proc/self/fd/N`), so once it has opened
//! the entry an unlink does not touch what it loads; a loader that finds the manifest gone
//! treats the entry as a miss and rebuilds it. A writer compiles into private temporary names,
//! renames the result into place and writes the manifest last, and loads from its own open file:
//! removing its entry in between only costs a later rebuild. Temporary files are removed only
//! when older than `stale_after` (a writer that crashed), so a compile in flight keeps its
//! inputs. Directories are kept (writers create entries in them at any time), except empty ones
//! the current layout never writes into (an older ferrocore's per-entry directories).

use super::cache::{Cache, MANIFEST_SUFFIX};
use super::{rerr, RuntimeError};
use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// What `evict` found and removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Eviction {
    /// Bytes under the directory before eviction (entries, manifests, temporary files).
    pub total_bytes: u64,
    pub removed_entries: usize,
    pub removed_bytes: u64,
}

/// The root's directories that hold entries: every area ferrocore writes (C++ libraries,
/// wrapper modules, compiled graphs, their bytecode, GPU kernel binaries, measurements).
/// `tests/test_cache.py` checks that `evict(0)` leaves nothing of a compile behind.
pub const ENTRY_AREAS: [&str; 8] = ["cpp", "graphs", "compiled", "bytecode", "kernels", "autotune", "pad_mm", "conv_layout"];

/// Depth (below the root) of the deepest directory the current layout writes into.
const LAYOUT_DEPTH: usize = 2;

#[derive(Default)]
struct Entry {
    bytes: u64,
    manifest: Option<PathBuf>,
    file: Option<PathBuf>,
    last_use: Option<SystemTime>,
}

/// Removes entries until the cache holds at most `max_bytes`.
pub fn evict(cache: &Cache, max_bytes: u64, stale_after: Duration) -> Result<Eviction, RuntimeError> {
    let now = SystemTime::now();
    let mut entries: BTreeMap<PathBuf, Entry> = BTreeMap::new();
    let mut dirs = Vec::new();
    let mut report = Eviction::default();
    let uid = super::cache::current_uid();
    let mut visit = |path: &Path, meta: &fs::Metadata, depth: usize| {
        if meta.is_dir() {
            if depth > LAYOUT_DEPTH {
                dirs.push(path.to_path_buf());
            }
            return;
        }
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        report.total_bytes += meta.len();
        let age = meta.modified().ok().and_then(|m| now.duration_since(m).ok()).unwrap_or_default();
        if name.starts_with('.') {
            if age > stale_after && fs::remove_file(path).is_ok() {
                report.removed_bytes += meta.len();
            }
            return;
        }
        let (key, is_manifest) = match name.strip_suffix(MANIFEST_SUFFIX) {
            Some(entry) => (path.with_file_name(entry), true),
            None => (path.to_path_buf(), false),
        };
        let e = entries.entry(key).or_default();
        e.bytes += meta.len();
        if is_manifest {
            e.manifest = Some(path.to_path_buf());
            e.last_use = meta.modified().ok();
        } else {
            e.file = Some(path.to_path_buf());
            if e.manifest.is_none() {
                e.last_use = e.last_use.or(meta.modified().ok());
            }
        }
    };
    // only what ferrocore writes: anything else kept there (a Triton cache, say) is left alone
    for area in ENTRY_AREAS {
        let dir = cache.root().join(area);
        if fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir() && !m.file_type().is_symlink() && m.uid() == uid) {
            walk(&dir, 1, uid, &mut visit)?;
        }
    }
    let mut order: Vec<(PathBuf, Entry)> = entries.into_iter().collect();
    // unvouched entries first (those older than `stale_after`: a writer may be about to sign a
    // fresh one), then least recently used
    let unvouched = |e: &Entry| {
        let old = e.last_use.and_then(|t| now.duration_since(t).ok()).unwrap_or_default() > stale_after;
        (e.manifest.is_none() || e.file.is_none()) && old
    };
    order.sort_by_key(|(_, e)| (!unvouched(e), e.last_use));
    let mut held = report.total_bytes - report.removed_bytes;
    for (_, e) in &order {
        if held <= max_bytes && !unvouched(e) {
            break;
        }
        // the manifest first: from then on no loader takes the entry
        let gone = e.manifest.iter().chain(&e.file).map(|p| fs::remove_file(p).is_ok()).fold(false, |a, b| a | b);
        if gone {
            report.removed_entries += 1;
            report.removed_bytes += e.bytes;
            held = held.saturating_sub(e.bytes);
        }
    }
    dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
    for d in dirs {
        let _ = fs::remove_dir(d); // only empty ones go
    }
    Ok(report)
}

/// Visits everything under `dir` (depth-first, the directory after its contents), never
/// following symlinks nor entering a directory that is not the current user's.
fn walk(dir: &Path, depth: usize, uid: u32, visit: &mut dyn FnMut(&Path, &fs::Metadata, usize)) -> Result<(), RuntimeError> {
    let list = fs::read_dir(dir).map_err(|e| rerr(format!("cannot list {}: {e}", dir.display())))?;
    for item in list.flatten() {
        let path = item.path();
        let Ok(meta) = fs::symlink_metadata(&path) else { continue };
        if meta.file_type().is_symlink() || meta.uid() != uid {
            continue;
        }
        if meta.is_dir() {
            walk(&path, depth + 1, uid, visit)?;
        }
        visit(&path, &meta, depth + 1);
    }
    Ok(())
}
