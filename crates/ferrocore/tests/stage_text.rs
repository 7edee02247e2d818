//! Text in, text out: each `tests/stage_text/<case>.graph.json` (an exchange-format graph) goes
//! through the C++ pipeline's stages as the driver runs them, and each stage's text form is
//! compared with its approved file: `<case>.lowered.txt`, `<case>.after_<pass>.txt` per program
//! pass, `<case>.after_fuse.txt` (the schedule and its decisions) and `<case>.kernels.cpp`.
//! Re-approve with UPDATE_EXPECT=1.

use ferrocore::codegen::cpp::{CppBackend, PRELUDE};
use ferrocore::codegen::KernelBackend;
use ferrocore::graph::parse_graph;
use ferrocore::lowering::lower_graph;
use ferrocore::scheduler::{fuse, program_passes};
use std::path::{Path, PathBuf};

fn case_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/stage_text")
}

/// Each stage's file name and text for one graph, in pipeline order (the driver's
/// `generate_in` and `schedule_in_stages`, less timing and dumps).
fn stage_texts(case: &str, graph_json: &str) -> Vec<(String, String)> {
    let graph = parse_graph(graph_json).unwrap_or_else(|e| panic!("{case}: {e}"));
    let lowered = lower_graph(&graph).unwrap_or_else(|e| panic!("{case}: {e}"));
    let mut program = lowered.program;
    program.verify().unwrap_or_else(|e| panic!("{case}: lowered program: {e}"));
    let mut texts = vec![(format!("{case}.lowered.txt"), program.to_string())];
    let opts = CppBackend.schedule_options();
    let mut decisions = Vec::new();
    for pass in program_passes(&opts) {
        decisions.extend((pass.run)(&mut program, &opts));
        program.verify().unwrap_or_else(|e| panic!("{case}: after {}: {e}", pass.name));
        texts.push((format!("{case}.after_{}.txt", pass.name), program.to_string()));
    }
    let schedule = fuse(program, &opts, decisions).unwrap_or_else(|e| panic!("{case}: {e}"));
    texts.push((format!("{case}.after_fuse.txt"), format!("{}\ndecisions:\n{}\n", schedule.text(), schedule.decision_texts().join("\n"))));
    let source = CppBackend.render(&schedule).unwrap_or_else(|e| panic!("{case}: {e}")).source;
    let kernels = source.split(PRELUDE).nth(1).unwrap_or(&source).to_string();
    texts.push((format!("{case}.kernels.cpp"), kernels));
    texts
}

/// The cases: every `<case>.graph.json` in the folder, sorted.
fn cases(dir: &Path) -> Vec<String> {
    let mut cases: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_suffix(".graph.json").map(str::to_string))
        .collect();
    cases.sort();
    cases
}

#[test]
fn every_stage_matches_its_approved_text() {
    let dir = case_dir();
    let update = std::env::var_os("UPDATE_EXPECT").is_some();
    let cases = cases(&dir);
    assert!(cases.len() >= 5, "cases missing from {}", dir.display());
    let mut differences = Vec::new();
    for case in &cases {
        let graph_json = std::fs::read_to_string(dir.join(format!("{case}.graph.json"))).unwrap();
        let texts = stage_texts(case, &graph_json);
        for (file, actual) in &texts {
            let path = dir.join(file);
            if update {
                std::fs::write(&path, actual).unwrap();
            } else if std::fs::read_to_string(&path).ok().as_deref() != Some(actual.as_str()) {
                differences.push(format!("{file} differs (or is missing); actual:\n{actual}"));
            }
        }
        // a file of a stage that no longer runs would pass unnoticed
        for entry in std::fs::read_dir(&dir).unwrap() {
            let name = entry.unwrap().file_name().to_string_lossy().into_owned();
            let ours = name.strip_prefix(case.as_str()).is_some_and(|rest| rest.starts_with('.'));
            if ours && name != format!("{case}.graph.json") && !texts.iter().any(|(file, _)| *file == name) {
                if update {
                    std::fs::remove_file(dir.join(&name)).unwrap();
                } else {
                    differences.push(format!("{name} belongs to no stage"));
                }
            }
        }
    }
    assert!(differences.is_empty(), "{}\n\nre-approve with UPDATE_EXPECT=1 if intended", differences.join("\n\n"));
}
