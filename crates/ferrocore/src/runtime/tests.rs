//! The cache's promises: hits and rebuilds, nothing unverified loaded, private modes whatever
//! the umask, directories of others refused, a key raced safely, eviction oldest-used first.

use super::cache::{directory_refusal, manifest_of};
use super::evict::evict;
use super::*;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::sync::Mutex;
use std::time::Duration;

// The umask is per process: tests that create directories run one at a time, so the one that
// clears the umask cannot make another test's directory group-writable.
static SERIAL: Mutex<()> = Mutex::new(());

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferrocore-rt-{tag}-{}", unique_suffix()));
    fs::create_dir_all(&d).unwrap();
    fs::set_permissions(&d, fs::Permissions::from_mode(0o700)).unwrap();
    d
}

const SRC: &str = "extern \"C\" int forty_two() { return 42; }\n";

#[test]
fn cache_hit_and_truncated_library_rebuilt() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tmpdir("cache");
    let a = compile_cpp(SRC, &dir, "g++", &Progress::default()).unwrap();
    assert!(!a.cache_hit);
    let b = compile_cpp(SRC, &dir, "g++", &Progress::default()).unwrap();
    assert!(b.cache_hit);
    assert_eq!(a.path, b.path);
    fs::write(&a.path, b"").unwrap();
    let c = compile_cpp(SRC, &dir, "g++", &Progress::default()).unwrap();
    assert!(!c.cache_hit);
    assert!(fs::read(&c.path).unwrap().len() > 100);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn planted_library_with_its_own_checksum_is_rebuilt() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tmpdir("plant");
    let real = compile_cpp(SRC, &dir, "g++", &Progress::default()).unwrap();
    let genuine = fs::read(&real.path).unwrap();
    // another library under the entry's name, with the SHA-256 the old cache checked and a
    // manifest signed with a key of the planter's own
    let other = tmpdir("other");
    let planted = compile_cpp("extern \"C\" int forty_two() { return 7; }\n", &other, "g++", &Progress::default()).unwrap();
    let evil = fs::read(&planted.path).unwrap();
    fs::write(&real.path, &evil).unwrap();
    fs::write(real.path.with_extension("so.sha256"), sha256_hex(&evil)).unwrap();
    fs::copy(manifest_of(&planted.path), manifest_of(&real.path)).unwrap();
    let again = compile_cpp(SRC, &dir, "g++", &Progress::default()).unwrap();
    assert!(!again.cache_hit, "a planted library was taken from the cache");
    assert_ne!(fs::read(&again.path).unwrap(), evil);
    // what the loader maps: the open file
    use std::os::unix::io::AsRawFd;
    let loaded = fs::read(format!("/proc/self/fd/{}", again.file.as_raw_fd())).unwrap();
    assert_eq!(loaded.len(), genuine.len());
    assert_ne!(loaded, evil);
    assert!(compile_cpp(SRC, &dir, "g++", &Progress::default()).unwrap().cache_hit);
    let _ = fs::remove_dir_all(&dir);
    let _ = fs::remove_dir_all(&other);
}

#[test]
fn edited_truncated_or_unsigned_entries_are_misses() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tmpdir("entries");
    let cache = Cache::open(&dir).unwrap();
    let path = cache.store("graphs/ab/g_1.py", b"def call(args): return args\n").unwrap();
    assert_eq!(cache.load("graphs/ab/g_1.py").unwrap().unwrap().bytes, b"def call(args): return args\n");
    fs::write(&path, b"import os; os.system('planted')\n").unwrap();
    assert!(cache.load("graphs/ab/g_1.py").unwrap().is_none(), "edited");
    cache.store("graphs/ab/g_1.py", b"def call(args): return args\n").unwrap();
    fs::write(&path, b"def call(ar").unwrap();
    assert!(cache.load("graphs/ab/g_1.py").unwrap().is_none(), "truncated");
    // an older ferrocore's entry: no manifest
    fs::write(dir.join("graphs/ab/old.py"), b"x = 1\n").unwrap();
    assert!(cache.load("graphs/ab/old.py").unwrap().is_none(), "unsigned");
    // an entry's manifest does not vouch for another name
    cache.store("graphs/ab/a.py", b"x = 1\n").unwrap();
    fs::copy(manifest_of(&dir.join("graphs/ab/a.py")), manifest_of(&dir.join("graphs/ab/old.py"))).unwrap();
    assert!(cache.load("graphs/ab/old.py").unwrap().is_none(), "renamed manifest");
    assert!(cache.store("../escape.py", b"").is_err() && cache.store("secret.key", b"").is_err());
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn files_are_private_under_umask_000() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: umask has no preconditions; restored below
    let saved = unsafe { libc::umask(0) };
    let dir = std::env::temp_dir().join(format!("ferrocore-rt-umask-{}", unique_suffix()));
    let lib = compile_cpp(SRC, &dir, "g++", &Progress::default());
    unsafe { libc::umask(saved) };
    let lib = lib.unwrap();
    let mode = |p: &Path| fs::symlink_metadata(p).unwrap().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(lib.path.parent().unwrap()), 0o700);
    for f in [&lib.path, &lib.source_path, &manifest_of(&lib.path), &dir.join("secret.key")] {
        assert_eq!(mode(f), 0o600, "{}", f.display());
    }
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn writable_or_foreign_directories_are_refused() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tmpdir("perm");
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o775)).unwrap();
    let e = compile_cpp(SRC, &dir, "g++", &Progress::default()).unwrap_err().to_string();
    assert!(e.contains("refusing to use cache directory") && e.contains("writable by group"), "{e}");
    // a subdirectory made writable (by an older ferrocore under umask 000) is refused too
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
    let lib = compile_cpp(SRC, &dir, "g++", &Progress::default()).unwrap();
    fs::set_permissions(lib.path.parent().unwrap(), fs::Permissions::from_mode(0o777)).unwrap();
    let e = compile_cpp(SRC, &dir, "g++", &Progress::default()).unwrap_err().to_string();
    assert!(e.contains("refusing") && e.contains("mode 777"), "{e}");
    // another owner cannot be made without root: the rule itself
    assert!(directory_refusal(1000, 1001, 0o700, true).unwrap().contains("owned by uid 1001"));
    assert!(directory_refusal(1000, 1000, 0o707, true).is_some());
    assert!(directory_refusal(1000, 1000, 0o755, true).is_none());
    assert!(directory_refusal(1000, 1000, 0o700, false).is_some());
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_key_raced_by_many_openers_is_one_key() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("ferrocore-rt-race-{}", unique_suffix()));
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let dir = dir.clone();
            std::thread::spawn(move || {
                let c = Cache::open(&dir).unwrap();
                c.store(&format!("t/{i}"), format!("{i}").as_bytes()).unwrap();
            })
        })
        .collect();
    handles.into_iter().for_each(|h| h.join().unwrap());
    let c = Cache::open(&dir).unwrap();
    for i in 0..8 {
        assert!(c.load(&format!("t/{i}")).unwrap().is_some(), "entry {i} signed with another key");
    }
    assert!(!fs::read_dir(&dir).unwrap().flatten().any(|e| e.file_name().to_string_lossy().starts_with('.')));
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn eviction_removes_least_recently_used_first() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tmpdir("evict");
    let cache = Cache::open(&dir).unwrap();
    for name in ["a", "b", "c"] {
        cache.store(&format!("graphs/00/{name}.py"), &[b'x'; 1000]).unwrap();
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(cache.load("graphs/00/a.py").unwrap().is_some()); // a is now the most recent
    fs::write(dir.join("graphs/00/.b.py.123.tmp"), b"in flight").unwrap();
    let r = evict(&cache, 2200, Duration::from_secs(3600)).unwrap();
    assert_eq!(r.removed_entries, 1);
    assert!(cache.load("graphs/00/b.py").unwrap().is_none());
    assert!(cache.load("graphs/00/a.py").unwrap().is_some() && cache.load("graphs/00/c.py").unwrap().is_some());
    assert!(dir.join("graphs/00/.b.py.123.tmp").exists(), "a young temporary file is a write in flight");
    fs::create_dir_all(dir.join("triton")).unwrap();
    fs::write(dir.join("triton/kernel.cubin"), b"not ours").unwrap();
    evict(&cache, 0, Duration::ZERO).unwrap();
    assert!(cache.load("graphs/00/a.py").unwrap().is_none() && dir.join("secret.key").exists());
    assert!(dir.join("triton/kernel.cubin").exists(), "only ferrocore's own areas are evicted");
    assert!(!dir.join("graphs/00/.b.py.123.tmp").exists());
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn compiler_failure_names_the_source() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tmpdir("fail");
    let e = compile_cpp("this is not C++", &dir, "g++", &Progress::default()).unwrap_err().to_string();
    assert!(e.contains("failed") && e.contains(".cpp") && !e.contains("/."), "{e}");
    let _ = fs::remove_dir_all(&dir);
}

fn marked_source(kernels: usize) -> String {
    let mut s = String::from("static inline int base() { return 40; }\n");
    for i in 0..kernels {
        s.push('\n');
        s.push_str(CPP_UNIT_MARK);
        s.push_str(&format!("extern \"C\" int k{i}() {{\n  return base() + {i};\n}}\n"));
    }
    s
}

#[test]
fn unit_plan_balances_kernels_and_keeps_their_lines() {
    let src = marked_source(5);
    assert_eq!(plan_cpp_units(&src, 8, 1 << 20, "k.cpp").len(), 1, "too little text to split");
    assert_eq!(plan_cpp_units(&src, 1, 1, "k.cpp")[0].text, src);
    let units = plan_cpp_units(&src, 2, 1, "k.cpp");
    assert_eq!(units.iter().map(|u| u.kernels).collect::<Vec<_>>(), vec![2, 3]);
    for u in &units {
        assert!(u.text.starts_with("static inline int base()"), "every unit has the prelude");
    }
    // each `#line` names the line of the whole source where its kernel begins
    let lines: Vec<&str> = src.lines().collect();
    for u in &units {
        for d in u.text.lines().filter(|l| l.starts_with("#line ")) {
            let n: usize = d.split(' ').nth(1).unwrap().parse().unwrap();
            let after = u.text.split(d).nth(1).unwrap().lines().nth(1).unwrap();
            assert_eq!(lines[n - 1], after, "{d}");
        }
    }
    assert_eq!(plan_cpp_units(&src, 8, 1, "k.cpp").len(), 5, "at most one unit per kernel");
}

#[test]
fn units_compile_in_parallel_into_one_library() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tmpdir("units");
    let src = marked_source(4);
    let progress = Progress::default();
    let lib = compile_cpp_with(&src, &dir, "g++", &CppJobs { jobs: 3, min_unit_bytes: 1 }, &progress).unwrap();
    assert!(!lib.cache_hit);
    assert_eq!(progress.snapshot(), ("C++ compile of 4 kernels in 3 units".to_string(), 3, 3), "units of 1, 1 and 2 kernels");
    let path = std::ffi::CString::new(lib.path.to_string_lossy().as_bytes()).unwrap();
    // SAFETY: a library built above from the test's own source; symbols have the declared type.
    unsafe {
        let h = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        assert!(!h.is_null());
        for i in 0..4 {
            let name = std::ffi::CString::new(format!("k{i}")).unwrap();
            let f = libc::dlsym(h, name.as_ptr());
            assert!(!f.is_null(), "k{i} missing");
            let f: extern "C" fn() -> i32 = std::mem::transmute(f);
            assert_eq!(f(), 40 + i);
        }
    }
    // the key is the source's, however it was cut; no unit files are left behind
    assert!(compile_cpp_with(&src, &dir, "g++", &CppJobs { jobs: 1, min_unit_bytes: 1 }, &Progress::default()).unwrap().cache_hit);
    let leftovers: Vec<_> = walk(&dir).into_iter().filter(|p| p.to_string_lossy().contains(".unit")).collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_failing_unit_names_the_whole_source_and_its_line() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tmpdir("unitfail");
    let mut src = marked_source(3);
    src.push('\n');
    src.push_str(CPP_UNIT_MARK);
    src.push_str("extern \"C\" int broken() {\n  return nope;\n}\n");
    let bad_line = src.lines().position(|l| l.contains("nope")).unwrap() + 1;
    let e = compile_cpp_with(&src, &dir, "g++", &CppJobs { jobs: 2, min_unit_bytes: 1 }, &Progress::default()).unwrap_err().to_string();
    assert!(e.contains(&format!(".cpp:{bad_line}:")) && !e.contains(".unit"), "{e}");
    let _ = fs::remove_dir_all(&dir);
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}
