//! The on-disk cache directory: where it is, who may use it, and how entries are written and
//! verified. It owns the trust rules and nothing else (what an entry holds is the caller's).
//!
//! - The directory belongs to the current user and nobody else may write into it: the root and
//!   every directory on the way to an entry are checked at each use (owned by the effective uid,
//!   not group- or world-writable, not a symlink below the root); anything else is an error that
//!   names the directory. Directories are created 0700 and files 0600 whatever the umask.
//! - Every entry has a manifest beside it (`<entry>.hmac`): an HMAC-SHA256 of the entry's
//!   relative path and bytes under a per-user secret key (`secret.key`, 32 random bytes, created
//!   once 0600 by a hard link, so no reader ever sees half a key). The manifest is written after
//!   the entry, both atomically. An entry is used only when its bytes, read from the same open
//!   file, match the manifest: a missing, truncated, edited or planted entry (even one with its
//!   own SHA-256) is a miss and gets rebuilt. A verified read returns the open file with the
//!   bytes, so a caller that maps the file (dlopen) loads the very inode that was verified.

use super::{rerr, RuntimeError};
use sha2::{Digest, Sha256};
use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

const KEY_FILE: &str = "secret.key";
const KEY_LEN: usize = 32;
/// The manifest of entry `x` is `x.hmac`.
pub const MANIFEST_SUFFIX: &str = ".hmac";
const MAC_DOMAIN: &[u8] = b"ferrocore-cache-entry-v1\0";

/// The per-user default: `FERROCORE_CACHE_DIR`, else `$XDG_CACHE_HOME/ferrocore`, else
/// `~/.cache/ferrocore` (the Python front computes the same, `options.default_cache_dir`). Never a
/// directory shared between users; without a home, a per-uid name under the temporary
/// directory, which the ownership check refuses if someone else made it first.
pub fn default_cache_dir() -> PathBuf {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(d) = env("FERROCORE_CACHE_DIR") {
        return d;
    }
    if let Some(d) = env("XDG_CACHE_HOME").filter(|d| d.is_absolute()) {
        return d.join("ferrocore");
    }
    if let Some(h) = env("HOME").filter(|d| d.is_absolute()) {
        return h.join(".cache").join("ferrocore");
    }
    std::env::temp_dir().join(format!("ferrocore-cache-{}", current_uid()))
}

pub fn current_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

const NOT_A_DIRECTORY: &str = "is not a directory";

/// Why a directory may not hold cache entries, or None when it may: owned by `uid`, a real
/// directory, not writable by group or others. Kept apart from `stat` so tests can hand it a
/// foreign owner, which a non-root test cannot create.
pub fn directory_refusal(uid: u32, owner: u32, mode: u32, is_dir: bool) -> Option<String> {
    if !is_dir {
        return Some(NOT_A_DIRECTORY.into());
    }
    if owner != uid {
        return Some(format!("is owned by uid {owner}, not by the current user (uid {uid})"));
    }
    if mode & 0o022 != 0 {
        return Some(format!("is writable by group or others (mode {:o})", mode & 0o7777));
    }
    None
}

/// Creates `dir` (0700) if it is missing and checks it as the cache's own directories are
/// checked: a real directory (a symlink planted in its place is refused, not followed) of the
/// current user that nobody else may write into. For directories written beside the cache
/// (per-graph debug dumps) under a name that is the same in every process.
pub fn private_dir(dir: &Path) -> Result<(), RuntimeError> {
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
        Err(e) => return Err(rerr(format!("cannot create directory {}: {e}", dir.display()))),
    }
    let meta = fs::symlink_metadata(dir).map_err(|e| rerr(format!("cannot stat {}: {e}", dir.display())))?;
    if meta.file_type().is_symlink() {
        return Err(refused(dir, "is a symlink"));
    }
    match directory_refusal(current_uid(), meta.uid(), meta.mode(), meta.is_dir()) {
        Some(why) => Err(refused(dir, &why)),
        None => Ok(()),
    }
}

/// An open, checked cache directory with its key.
pub struct Cache {
    root: PathBuf,
    key: [u8; KEY_LEN],
    uid: u32,
}

/// An entry whose bytes matched its manifest; `file` is open on the verified inode.
pub struct VerifiedEntry {
    pub path: PathBuf,
    pub file: File,
    pub bytes: Vec<u8>,
}

impl Cache {
    /// Creates the directory (0700) if needed, checks it and reads (or creates) the key.
    pub fn open(root: &Path) -> Result<Cache, RuntimeError> {
        let uid = current_uid();
        if let Some(parent) = root.parent() {
            fs::create_dir_all(parent).map_err(|e| rerr(format!("cannot create {}: {e}", parent.display())))?;
        }
        match fs::DirBuilder::new().mode(0o700).create(root) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(rerr(format!("cannot create cache directory {}: {e}", root.display()))),
        }
        // the root itself may be a symlink the user chose; what it names is checked
        let meta = fs::metadata(root).map_err(|e| rerr(format!("cannot stat cache directory {}: {e}", root.display())))?;
        if let Some(why) = directory_refusal(uid, meta.uid(), meta.mode(), meta.is_dir()) {
            return Err(refused(root, &why));
        }
        let key = read_or_create_key(root, uid)?;
        Ok(Cache { root: root.to_path_buf(), key, uid })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The absolute path of entry `rel` (checked: relative, plain names).
    pub fn path(&self, rel: &str) -> Result<PathBuf, RuntimeError> {
        check_rel(rel)?;
        Ok(self.root.join(rel))
    }

    /// Creates (0700) and checks every directory between the root and entry `rel`; returns the
    /// entry's directory. With `create` false a missing directory is Ok(None).
    fn entry_dir(&self, rel: &str, create: bool) -> Result<Option<PathBuf>, RuntimeError> {
        check_rel(rel)?;
        let mut dir = self.root.clone();
        let parts: Vec<&str> = rel.split('/').collect();
        for part in &parts[..parts.len() - 1] {
            dir.push(part);
            if create {
                match fs::DirBuilder::new().mode(0o700).create(&dir) {
                    Ok(()) => {}
                    Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
                    Err(e) => return Err(rerr(format!("cannot create cache directory {}: {e}", dir.display()))),
                }
            }
            let meta = match fs::symlink_metadata(&dir) {
                Ok(m) => m,
                Err(e) if e.kind() == ErrorKind::NotFound && !create => return Ok(None),
                Err(e) => return Err(rerr(format!("cannot stat cache directory {}: {e}", dir.display()))),
            };
            if let Some(why) = directory_refusal(self.uid, meta.uid(), meta.mode(), meta.file_type().is_dir()) {
                return Err(refused(&dir, &why));
            }
        }
        Ok(Some(dir))
    }

    fn mac_hex(&self, rel: &str, bytes: &[u8]) -> String {
        let mut msg = Vec::with_capacity(MAC_DOMAIN.len() + rel.len() + 1 + bytes.len());
        msg.extend_from_slice(MAC_DOMAIN);
        msg.extend_from_slice(rel.as_bytes());
        msg.push(0);
        msg.extend_from_slice(bytes);
        hex(&hmac_sha256(&self.key, &msg))
    }

    /// The entry's bytes and open file when it matches its manifest; None for a miss (missing,
    /// truncated, edited, planted, foreign-owned). Marks a hit as used (the manifest's mtime),
    /// which is what eviction orders by.
    pub fn load(&self, rel: &str) -> Result<Option<VerifiedEntry>, RuntimeError> {
        if self.entry_dir(rel, false)?.is_none() {
            return Ok(None);
        }
        let path = self.root.join(rel);
        let Some((file, bytes)) = self.read_owned(&path) else { return Ok(None) };
        let manifest_path = manifest_of(&path);
        let Some((manifest, expected)) = self.read_owned(&manifest_path) else { return Ok(None) };
        if bytes.is_empty() || !constant_time_eq(self.mac_hex(rel, &bytes).as_bytes(), expected.trim_ascii()) {
            return Ok(None);
        }
        // SAFETY: a valid open descriptor; a null `times` means "now" (allowed to the owner).
        unsafe { libc::futimens(manifest.as_raw_fd(), std::ptr::null()) };
        Ok(Some(VerifiedEntry { path, file, bytes }))
    }

    /// Opens a file without following a symlink and reads it whole, if it is a regular file of
    /// ours that nobody else may write.
    fn read_owned(&self, path: &Path) -> Option<(File, Vec<u8>)> {
        let mut file = OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path).ok()?;
        let meta = file.metadata().ok()?;
        if !meta.is_file() || meta.uid() != self.uid || meta.mode() & 0o022 != 0 {
            return None;
        }
        let mut bytes = Vec::with_capacity(meta.len() as usize);
        file.read_to_end(&mut bytes).ok()?;
        Some((file, bytes))
    }

    /// Writes entry `rel` (0600, atomically), then its manifest.
    pub fn store(&self, rel: &str, data: &[u8]) -> Result<PathBuf, RuntimeError> {
        self.entry_dir(rel, true)?;
        let path = self.root.join(rel);
        write_private_atomic(&path, data)?;
        write_private_atomic(&manifest_of(&path), self.mac_hex(rel, data).as_bytes())?;
        Ok(path)
    }

    /// Installs `tmp` (a file this process wrote under the entry's directory, whose bytes are
    /// `data`) as entry `rel`, then writes the manifest.
    pub fn install(&self, tmp: &Path, rel: &str, data: &[u8]) -> Result<PathBuf, RuntimeError> {
        self.entry_dir(rel, true)?;
        let path = self.root.join(rel);
        fs::set_permissions(tmp, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .map_err(|e| rerr(format!("cannot set the mode of {}: {e}", tmp.display())))?;
        fs::rename(tmp, &path).map_err(|e| rerr(format!("cannot install {}: {e}", path.display())))?;
        write_private_atomic(&manifest_of(&path), self.mac_hex(rel, data).as_bytes())?;
        Ok(path)
    }

    /// The path of entry `rel`, its directories created and checked: for a file beside the
    /// entries that is not one (a lock).
    pub fn prepared_path(&self, rel: &str) -> Result<PathBuf, RuntimeError> {
        self.entry_dir(rel, true)?;
        Ok(self.root.join(rel))
    }

    /// A fresh private name in the directory of entry `rel` (created and checked), for a file
    /// to be written and then `install`ed.
    pub fn temp_path(&self, rel: &str, suffix: &str) -> Result<PathBuf, RuntimeError> {
        let dir = self.entry_dir(rel, true)?.unwrap_or_else(|| self.root.clone());
        let name = rel.rsplit('/').next().unwrap_or("entry");
        Ok(dir.join(format!(".{name}.{}{suffix}", super::unique_suffix())))
    }
}

pub fn manifest_of(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(MANIFEST_SUFFIX);
    PathBuf::from(s)
}

fn refused(dir: &Path, why: &str) -> RuntimeError {
    if why == NOT_A_DIRECTORY {
        // nothing to do with other users: a file (or device) where the directory should be
        return rerr(format!(
            "cannot use cache directory {}: it exists and {why}. Move it away, or set FERROCORE_CACHE_DIR to a directory",
            dir.display()
        ));
    }
    rerr(format!(
        "refusing to use cache directory {}: it {why}; another user could plant code that ferrocore would load. \
         Make it yours and private (chmod 700), or set FERROCORE_CACHE_DIR to a directory of your own",
        dir.display()
    ))
}

/// Entry names are relative paths of plain names: no `..`, no hidden files, no odd characters.
fn check_rel(rel: &str) -> Result<(), RuntimeError> {
    let ok = !rel.is_empty()
        && rel
            .split('/')
            .all(|p| !p.is_empty() && !p.starts_with('.') && p.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c)))
        && !rel.ends_with(MANIFEST_SUFFIX)
        && rel != KEY_FILE;
    if ok {
        Ok(())
    } else {
        Err(rerr(format!("invalid cache entry name {rel:?}")))
    }
}

/// Writes a new file with mode 0600 (the umask can only narrow it) and renames it into place.
pub fn write_private_atomic(path: &Path, data: &[u8]) -> Result<(), RuntimeError> {
    let dir = path.parent().ok_or_else(|| rerr(format!("{} has no parent directory", path.display())))?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("f");
    let tmp = dir.join(format!(".{name}.{}.tmp", super::unique_suffix()));
    let write = || -> std::io::Result<()> {
        // no fsync: an entry a crash leaves short fails verification and is rebuilt
        OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?.write_all(data)
    };
    if let Err(e) = write() {
        let _ = fs::remove_file(&tmp);
        return Err(rerr(format!("cannot write {}: {e}", tmp.display())));
    }
    fs::rename(&tmp, path).map_err(|e| {
        let _ = fs::remove_file(&tmp);
        rerr(format!("cannot rename {} to {}: {e}", tmp.display(), path.display()))
    })
}

/// The key, created on first use: written whole under a private name, then hard-linked to its
/// name, which fails if another process linked its key first (then that one is read). A key
/// file that is not ours and private, or of the wrong size, is an error: entries signed with
/// it cannot be trusted.
fn read_or_create_key(root: &Path, uid: u32) -> Result<[u8; KEY_LEN], RuntimeError> {
    let path = root.join(KEY_FILE);
    if fs::symlink_metadata(&path).is_err() {
        let mut key = [0u8; KEY_LEN];
        File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut key))
            .map_err(|e| rerr(format!("cannot read random bytes for the cache key: {e}")))?;
        let tmp = root.join(format!(".{KEY_FILE}.{}.tmp", super::unique_suffix()));
        let written = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut f| f.write_all(&key).and_then(|_| f.sync_all()));
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(rerr(format!("cannot write the cache key {}: {e}", tmp.display())));
        }
        let linked = fs::hard_link(&tmp, &path);
        let _ = fs::remove_file(&tmp);
        match linked {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(rerr(format!("cannot create the cache key {}: {e}", path.display()))),
        }
    }
    let bad = |why: String| {
        rerr(format!(
            "cache key {} {why}; entries signed with it cannot be trusted: remove the cache directory {}",
            path.display(),
            root.display()
        ))
    };
    let mut file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&path)
        .map_err(|e| bad(format!("cannot be opened ({e})")))?;
    let meta = file.metadata().map_err(|e| bad(format!("cannot be read ({e})")))?;
    if !meta.is_file() || meta.uid() != uid || meta.mode() & 0o077 != 0 {
        return Err(bad(format!("is not a private file of the current user (uid {}, mode {:o})", meta.uid(), meta.mode() & 0o7777)));
    }
    let mut key = [0u8; KEY_LEN];
    let mut rest = Vec::new();
    file.read_exact(&mut key).and_then(|_| file.read_to_end(&mut rest)).map_err(|e| bad(format!("is not {KEY_LEN} bytes ({e})")))?;
    if !rest.is_empty() {
        return Err(bad(format!("is not {KEY_LEN} bytes")));
    }
    Ok(key)
}

/// HMAC-SHA256 (RFC 2104) with a key no longer than a block.
pub fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    const BLOCK: usize = 64;
    let mut k = [0u8; BLOCK];
    if key.len() > BLOCK {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let pad = |byte: u8| k.map(|b| b ^ byte);
    let inner = Sha256::new().chain_update(pad(0x36)).chain_update(msg).finalize();
    Sha256::new().chain_update(pad(0x5c)).chain_update(inner).finalize().into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
