//! The replay corpus (docs/replay.md): every graph the model benchmark sent the compiler,
//! captured by `bench/replay_capture.py` (CPU graphs at tiny size, CUDA graphs at full size),
//! compiled again here without a GPU and compared with the approved text of its kernels and host
//! plan. A change to the generated code fails this test with the list of changed kernels;
//! `UPDATE_EXPECT=1` approves it (printing the same list, for the commit message).

use ferrocore::artifact::CompiledGraph;
use ferrocore::codegen::literal::py_source_str;
use ferrocore::codegen::{LaunchShape, RenderedKernels};
use ferrocore::driver::{generate, Generated, Generation, Options};
use flate2::read::GzDecoder;
use flate2::write::GzEncoder;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

fn corpus() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/replay")
}

fn read_gz(path: &Path) -> String {
    let mut text = String::new();
    GzDecoder::new(std::fs::File::open(path).unwrap()).read_to_string(&mut text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text
}

fn write_gz(path: &Path, text: &str) {
    // level 9 and no name or time in the header: the same text always gives the same bytes
    let mut enc = GzEncoder::new(Vec::new(), flate2::Compression::best());
    enc.write_all(text.as_bytes()).unwrap();
    std::fs::write(path, enc.finish().unwrap()).unwrap();
}

/// The text the corpus approves for one graph: each kernel (its launch, then its definition),
/// then the host module with the kernel source taken out, then the compiled graph as it is
/// serialized (its unit's source taken out: the kernels above are that text). The compiled
/// graph must also read back as the same value.
fn replay_text(g: &Generated) -> String {
    let k: &RenderedKernels = &g.kernels;
    let mut out = String::new();
    let mut defined: BTreeMap<(usize, usize), &str> = BTreeMap::new();
    for l in &k.launches {
        let args: Vec<String> = l.args.iter().map(|b| format!("buf{}", b.0)).collect();
        let shape = match &l.shape {
            LaunchShape::Host => "host".to_string(),
            LaunchShape::Grid { grid, xblock, num_warps, num_stages, tile: None } => {
                format!("grid {grid} xblock {xblock} warps {num_warps} stages {num_stages}")
            }
            LaunchShape::Grid { grid, num_warps, num_stages, tile: Some(t), .. } => {
                format!("grid {grid} tile {}x{}x{} warps {num_warps} stages {num_stages}", t.m, t.n, t.k)
            }
        };
        let _ = writeln!(
            out,
            "==== kernel {} ({}) numel {} {shape}{}",
            l.name,
            args.join(", "),
            l.numel,
            if l.checks_indices { " checks indices" } else { "" }
        );
        match defined.get(&(l.text.start, l.text.end)) {
            Some(first) => {
                let _ = writeln!(out, "(defined by {first})");
            }
            None => {
                defined.insert((l.text.start, l.text.end), &l.name);
                out.push_str(&k.source[l.text.clone()]);
                if !out.ends_with('\n') {
                    out.push('\n');
                }
            }
        }
    }
    let host = g.module.replacen(&py_source_str(&k.source), "KERNEL_SOURCE_TEXT", 1).replacen(&k.source, "KERNEL_SOURCE_TEXT\n", 1);
    let _ = write!(out, "==== host\n{host}");
    let json = serde_json::to_string(&g.artifact).unwrap();
    let read_back: CompiledGraph = serde_json::from_str(&json).unwrap();
    assert!(read_back == g.artifact, "graph {}: the compiled graph does not read back as itself", g.artifact.name);
    let mut value = g.artifact.clone();
    if let Some(unit) = &mut value.unit {
        unit.source = "KERNEL_SOURCE_TEXT".into();
    }
    let _ = writeln!(out, "==== compiled graph\n{}", serde_json::to_string_pretty(&value).unwrap());
    out
}

/// The names of the sections (`==== kernel NAME`, `==== host`) whose text differs.
fn changed_sections(before: &str, after: &str) -> Vec<String> {
    let sections = |t: &str| -> BTreeMap<String, String> {
        let mut m = BTreeMap::new();
        for part in t.split("==== ").filter(|p| !p.is_empty()) {
            let head = part.lines().next().unwrap_or("");
            let name = head.split(" (").next().unwrap_or(head).to_string();
            m.insert(name, part.to_string());
        }
        m
    };
    let (b, a) = (sections(before), sections(after));
    let mut names: Vec<String> = Vec::new();
    for (name, text) in &a {
        match b.get(name) {
            None => names.push(format!("{name} (new)")),
            Some(old) if old != text => names.push(name.clone()),
            _ => {}
        }
    }
    names.extend(b.keys().filter(|n| !a.contains_key(*n)).map(|n| format!("{n} (gone)")));
    names
}

#[test]
fn replay_corpus_generates_the_approved_code() {
    let update = std::env::var("UPDATE_EXPECT").is_ok();
    let scratch = std::env::temp_dir().join(format!("ferrocore-replay-{}", std::process::id()));
    // the corpus's CUDA graphs were captured on Hopper (H100/H200)
    let options = Options { cache_dir: scratch.clone(), skip_native_compile: true, cuda_arch: 90, ..Options::default() };
    let mut report = String::new();
    let (mut graphs, mut kernels, mut changed) = (0, 0, 0);
    for device in ["cpu", "cuda"] {
        let dir = corpus().join(device);
        let Ok(entries) = std::fs::read_dir(dir.join("graphs")) else { continue };
        let mut files: Vec<PathBuf> = entries.map(|e| e.unwrap().path()).collect();
        files.sort();
        std::fs::create_dir_all(dir.join("expected")).unwrap();
        for file in files {
            let stem = file.file_name().unwrap().to_string_lossy().trim_end_matches(".json.gz").to_string();
            let graph = read_gz(&file);
            let actual = match generate(&graph, &options).unwrap_or_else(|e| panic!("{stem}: {e}")) {
                Generation::Code(g) => {
                    kernels += g.kernels.launches.len();
                    replay_text(&g)
                }
                Generation::Eager { reason, .. } => format!("==== eager\n{reason}\n"),
            };
            graphs += 1;
            let expected_path = dir.join("expected").join(format!("{stem}.txt.gz"));
            let expected = if expected_path.exists() { read_gz(&expected_path) } else { Default::default() };
            if expected != actual {
                changed += 1;
                let _ = writeln!(report, "{device}/{stem}: {}", changed_sections(&expected, &actual).join(", "));
                if update {
                    write_gz(&expected_path, &actual);
                } else {
                    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("replay").join(device);
                    std::fs::create_dir_all(&out).unwrap();
                    std::fs::write(out.join(format!("{stem}.expected.txt")), &expected).unwrap();
                    std::fs::write(out.join(format!("{stem}.actual.txt")), &actual).unwrap();
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    eprintln!("replay: {graphs} graphs, {kernels} kernels, {changed} graphs changed\n{report}");
    assert!(graphs > 0, "the replay corpus is empty");
    assert!(update || changed == 0, "generated code changed (texts under target/tmp/replay); approve with UPDATE_EXPECT=1:\n{report}");
}
