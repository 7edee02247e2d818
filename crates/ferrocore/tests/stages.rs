//! Stage tests: exchange-format graph in, each stage's text form out, compared with golden files
//! under tests/golden (re-approve with UPDATE_EXPECT=1). Kernel-count tests pin fusion rules.

use ferrocore::codegen::cpp::CppBackend;
use ferrocore::codegen::triton::TritonBackend;
use ferrocore::codegen::{CodegenErrorKind, KernelBackend, KernelLanguage, LaunchShape};
use ferrocore::driver::{compile_graph, BackendChoice, Options};
use ferrocore::graph::build::{boolean, int, ints, meta, node, strided_meta, GraphBuilder};
use ferrocore::graph::parse_graph;
use ferrocore::lowering::{lower_graph, lower_graph_with, ConvLayout, GemmTemplate, LowerOptions};
use ferrocore::scheduler::{schedule, schedule_for, Decision, Item, KernelId, ScheduleOptions};

/// Triton's kernel names without its reduction splits (for tests of the plain kernels).
const TRITON_WHOLE: ScheduleOptions =
    ScheduleOptions { prefix: "triton", split: None, complex_as_real: true, welford_min_len: None, row_scratch: None };
use std::path::PathBuf;

/// The arguments of a reduction of `src` over `dim` (sum.dim_IntList, amax).
fn over(src: &str, dim: i64, keepdim: bool) -> String {
    let keep = if keepdim { r#",{"bool":true}"# } else { "" };
    format!(r#"{},{{"list":[{{"int":{dim}}}]}}{keep}"#, node(src))
}

fn check(golden: &str, actual: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(golden);
    if std::env::var("UPDATE_EXPECT").is_ok() {
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected =
        std::fs::read_to_string(&path).unwrap_or_else(|_| panic!("missing golden file {}; run with UPDATE_EXPECT=1", path.display()));
    assert_eq!(expected, actual, "stage output differs from {golden}; re-approve with UPDATE_EXPECT=1 if intended");
}

/// Lowered IR, fused schedule and generated C++ of one graph.
fn stages(doc: &str) -> (String, String, String, usize) {
    let g = parse_graph(doc).unwrap();
    let lowered = lower_graph(&g).unwrap();
    lowered.program.verify().unwrap();
    let pre = lowered.program.to_string();
    let s = schedule(lowered.program).unwrap();
    s.program.verify().unwrap();
    let post = s.text();
    let src = CppBackend.render(&s).unwrap().source;
    let kernels = src.split(ferrocore::codegen::cpp::PRELUDE).nth(1).unwrap_or("").to_string();
    (pre, post, kernels, s.kernel_count())
}

#[test]
fn relu_add_sum_is_one_kernel() {
    let doc = GraphBuilder::new()
        .input("x", &[8, 32], "float32")
        .call("relu", "aten.relu.default", &node("x"), &meta(&[8, 32], "float32"))
        .call("add", "aten.add.Tensor", &format!(r#"{},{{"int":1}}"#, node("relu")), &meta(&[8, 32], "float32"))
        .call("sum_1", "aten.sum.dim_IntList", &over("add", -1, false), &meta(&[8], "float32"))
        .output(&["sum_1"]);
    let (pre, post, src, k) = stages(&doc);
    assert_eq!(k, 1);
    check("relu_add_sum.txt", &format!("{pre}\n{post}\n{src}"));
}

#[test]
fn column_reductions_vectorize_across_a_tile_of_columns() {
    // sum and max over the outer dim of [2000, 40]: the lanes take consecutive columns (40 is
    // not a multiple of the tile: the last tile is partial); 2000 rows add in chunks of 256
    let doc = GraphBuilder::new()
        .input("x", &[2000, 40], "float32")
        .call("sum_1", "aten.sum.dim_IntList", &over("x", 0, false), &meta(&[40], "float32"))
        .call("amax", "aten.amax.default", &over("x", 0, false), &meta(&[40], "float32"))
        .call("add", "aten.add.Tensor", &format!("{},{}", node("sum_1"), node("amax")), &meta(&[40], "float32"))
        .output(&["add"]);
    let (_, post, src, k) = stages(&doc);
    assert_eq!(k, 1, "{post}");
    assert!(src.contains("x0t += 16LL") && src.contains("for (int64_t x0j = 0; x0j < x0n; ++x0j)"), "{src}");
    check("column_reductions.txt", &src);
}

#[test]
fn softmax_is_one_kernel_storing_its_exponentials_once() {
    let doc = GraphBuilder::new()
        .input("x", &[16, 64], "float32")
        .call("sm", "aten._softmax.default", &format!(r#"{},{{"int":-1}},{{"bool":false}}"#, node("x")), &meta(&[16, 64], "float32"))
        .output(&["sm"]);
    let (pre, post, src, k) = stages(&doc);
    assert!(k <= 2, "softmax took {k} kernels");
    assert!(post.contains("(local)"), "max and sum must stay in registers:\n{post}");
    assert_eq!(src.matches("ferro_expf(").count(), 1, "one exp per element:\n{src}");
    assert!(post.contains("(row)") && src.contains("float row0[64];"), "the exponentials stay in a scratch row:\n{post}");
    check("softmax.txt", &format!("{pre}\n{post}\n{src}"));
}

#[test]
fn layer_norm_is_at_most_two_kernels() {
    let doc = GraphBuilder::new()
        .input("x", &[4, 8, 32], "float32")
        .input("w", &[32], "float32")
        .input("b", &[32], "float32")
        .call(
            "ln",
            "aten.native_layer_norm.default",
            &format!(r#"{},{{"list":[{{"int":32}}]}},{},{},{{"float":1e-5}}"#, node("x"), node("w"), node("b")),
            &format!(r#"{{"tuple":[{},{},{}]}}"#, meta(&[4, 8, 32], "float32"), meta(&[4, 8, 1], "float32"), meta(&[4, 8, 1], "float32")),
        )
        .call("y", "getitem", &format!(r#"{},{{"int":0}}"#, node("ln")), &meta(&[4, 8, 32], "float32"))
        .output(&["y"]);
    let (_, post, _, k) = stages(&doc);
    assert!(k <= 2, "layer_norm took {k} kernels:\n{post}");
}

#[test]
fn views_of_views_fold_to_affine_indices() {
    // x[4, 6] -> t() -> reshape [24] -> view [6, 4] -> exp: reads x at 6*(j) + i without div/mod
    let doc = GraphBuilder::new()
        .input("x", &[4, 6], "float32")
        .call(
            "t",
            "aten.t.default",
            &node("x"),
            r#"{"tensor":{"shape":[6,4],"stride":[1,6],"storage_offset":0,"dtype":"float32","device":"cpu"}}"#,
        )
        .call("perm", "aten.permute.default", &format!(r#"{},{{"list":[{{"int":1}},{{"int":0}}]}}"#, node("t")), &meta(&[4, 6], "float32"))
        .call(
            "v",
            "aten.view.default",
            &format!(r#"{},{{"list":[{{"int":2}},{{"int":2}},{{"int":6}}]}}"#, node("perm")),
            &meta(&[2, 2, 6], "float32"),
        )
        .call("e", "aten.exp.default", &node("v"), &meta(&[2, 2, 6], "float32"))
        .output(&["e"]);
    let (pre, _, _, k) = stages(&doc);
    assert_eq!(k, 1);
    assert!(!pre.contains("//") && !pre.contains('%'), "index not simplified:\n{pre}");
    check("views.txt", &pre);
}

#[test]
fn int64_index_math_does_not_overflow() {
    let doc = GraphBuilder::new()
        .call("a", "aten.arange.start_step", r#"{"int":0},{"int":11}"#, &meta(&[11], "int64"))
        .call("m", "aten.mul.Tensor", &format!(r#"{},{{"int":1000000000}}"#, node("a")), &meta(&[11], "int64"))
        .output(&["m"]);
    let (_, _, src, _) = stages(&doc);
    assert!(src.contains("int64_t tmp") && src.contains("1000000000LL"), "{src}");
    assert!(!src.contains("int32_t"), "{src}");
}

#[test]
fn unknown_op_falls_back_to_aten_in_the_wrapper() {
    let doc = GraphBuilder::new()
        .input("x", &[4, 4], "float32")
        .call(
            "c",
            "aten.cummax.default",
            &format!(r#"{},{{"int":0}}"#, node("x")),
            &format!(r#"{{"tuple":[{},{}]}}"#, meta(&[4, 4], "float32"), meta(&[4, 4], "int64")),
        )
        .call("v", "getitem", &format!(r#"{},{{"int":0}}"#, node("c")), &meta(&[4, 4], "float32"))
        .call("r", "aten.relu.default", &node("v"), &meta(&[4, 4], "float32"))
        .output(&["r"]);
    let dir = std::env::temp_dir().join(format!("ferrocore-stage-test-{}", std::process::id()));
    let opts = Options { cache_dir: dir.clone(), skip_native_compile: true, ..Options::default() };
    let r = compile_graph(&doc, &opts).unwrap();
    assert_eq!(r.fallbacks.len(), 1);
    assert_eq!(r.fallbacks[0].target, "aten.cummax.default");
    assert!(r.module_source.contains("torch.ops.aten.cummax.default(x, 0)"), "{}", r.module_source);
    assert_eq!(r.kernels, 1);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn inconsistent_shapes_are_errors_naming_the_node() {
    let doc = GraphBuilder::new()
        .input("x", &[4, 4], "float32")
        .input("y", &[3, 4], "float32")
        .call("bad_add", "aten.add.Tensor", &format!("{},{}", node("x"), node("y")), &meta(&[4, 4], "float32"))
        .output(&["bad_add"]);
    let opts = Options { skip_native_compile: true, ..Options::default() };
    let e = compile_graph(&doc, &opts).unwrap_err().to_string();
    assert!(e.contains("bad_add") && e.contains("broadcast"), "{e}");
}

#[test]
fn horizontal_fusion_shares_one_pass_over_the_input() {
    // sum and amax of the same rows: one kernel, one loop group with two accumulators
    let doc = GraphBuilder::new()
        .input("x", &[32, 128], "float32")
        .call("s", "aten.sum.dim_IntList", &over("x", 1, false), &meta(&[32], "float32"))
        .call("m", "aten.amax.default", &over("x", 1, false), &meta(&[32], "float32"))
        .output(&["s", "m"]);
    let (_, post, _, k) = stages(&doc);
    assert_eq!(k, 1, "{post}");
    assert_eq!(post.matches("group").count(), 1, "{post}");
}

#[test]
fn small_results_lowered_last_join_the_kernel_that_computes_what_they_read() {
    // a batch norm's running-mean update is a graph output, lowered after everything else; here
    // 40 kernels of other work come between it and the mean it reads (past the fusion window)
    let mut g = GraphBuilder::new().input("x", &[64, 256], "float32");
    for i in 0..40 {
        g = g.input(&format!("y{i}"), &[512, 512], "float32");
    }
    g = g.call("m", "aten.mean.dim", &over("x", 0, false), &meta(&[256], "float32"));
    let mut outs = vec!["m".to_string()];
    for i in 0..40 {
        g = g.call(&format!("z{i}"), "aten.neg.default", &node(&format!("y{i}")), &meta(&[512, 512], "float32"));
        outs.push(format!("z{i}"));
    }
    g = g.call("u", "aten.mul.Tensor", &format!(r#"{},{{"float":0.1}}"#, node("m")), &meta(&[256], "float32"));
    outs.push("u".into());
    let doc = g.output(&outs.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    let (_, post, _, k) = stages(&doc);
    assert_eq!(k, 41, "{post}");
    // the mean's kernel: its reduction, then the update in a loop group of its own
    assert!(post.starts_with("  kernel cpp_red_fused_m_u_0: outer=256\n    group 0: reduce [64]"), "{post}");
}

/// t = x - rowmax(x) feeds a GEMM (a large temporary); y = 2x, returned, is lowered after it.
fn gemm_then_large_output() -> String {
    GraphBuilder::new()
        .input("x", &[512, 512], "float32")
        .input("w", &[512, 512], "float32")
        .call("m", "aten.amax.default", &over("x", 1, true), &meta(&[512, 1], "float32"))
        .call("t", "aten.sub.Tensor", &format!("{},{}", node("x"), node("m")), &meta(&[512, 512], "float32"))
        .call("g", "aten.mm.default", &format!("{},{}", node("t"), node("w")), &meta(&[512, 512], "float32"))
        .call("y", "aten.mul.Tensor", &format!(r#"{},{{"float":2.0}}"#, node("x")), &meta(&[512, 512], "float32"))
        .output(&["g", "y"])
}

#[test]
fn a_large_output_lowered_last_keeps_apart_from_a_large_temporary() {
    // t = x - rowmax(x) feeds a GEMM (a large temporary); y = 2x is returned: fused with t, both
    // would be live at once, so y gets a kernel of its own after the GEMM
    let doc = gemm_then_large_output();
    let (_, post, _, k) = stages(&doc);
    assert_eq!(k, 2, "{post}");
    let last = post.rsplit("  kernel ").next().unwrap();
    assert_eq!(last.matches("buf").count(), 1, "y alone in the last kernel:\n{post}");
}

#[test]
fn fusion_decisions_name_kernels_as_the_generated_code_does() {
    // the GEMM is a slot of the schedule but no kernel: a decision about the kernel after it
    // must name that kernel, not the slot's number
    let doc = gemm_then_large_output();
    let s = schedule(lower_graph(&parse_graph(&doc).unwrap()).unwrap().program).unwrap();
    let names: Vec<&str> = s.items.iter().filter_map(|it| if let Item::Kernel(k) = it { Some(k.name.as_str()) } else { None }).collect();
    assert_eq!(names.len(), 2, "{:?}", s.decision_texts());
    assert!(s.decision_texts().iter().all(|d| !d.contains('#')), "{:?}", s.decision_texts());
    let refused = s.decision_texts().into_iter().find(|d| d.starts_with("no fusion: ")).expect("a refused fusion");
    assert!(refused.contains(&format!("into kernel {}", names[0])), "{refused}");
    assert!(s.decision_texts().iter().any(|d| d.starts_with(&format!("new kernel {}: ", names[1]))), "{:?}", s.decision_texts());
    // the records themselves: kernels by their position among the kernels, not the slots
    let refused = s.decisions.iter().find_map(|d| if let Decision::NoFusion { kernel, .. } = d { Some(*kernel) } else { None });
    assert_eq!(refused, Some(KernelId(0)));
    assert!(s.decisions.iter().any(|d| matches!(d, Decision::NewKernel { kernel: KernelId(1), .. })), "{:?}", s.decisions);
}

/// The `href="#..."` targets of an HTML page that no element's `id` names.
fn dangling_links(html: &str) -> Vec<String> {
    let ids: std::collections::HashSet<&str> = html.split("id=\"").skip(1).filter_map(|s| s.split('"').next()).collect();
    html.split("href=\"#").skip(1).filter_map(|s| s.split('"').next()).filter(|t| !ids.contains(t)).map(String::from).collect()
}

#[test]
fn compile_report_links_graph_nodes_and_kernels_both_ways() {
    // (float64: a small float32 GEMM on the CPU is a matrix-product kernel, not a library call)
    let doc = GraphBuilder::new()
        .input("x", &[64, 64], "float64")
        .input("w", &[64, 64], "float64")
        .call("m", "aten.amax.default", &over("x", 1, true), &meta(&[64, 1], "float64"))
        .call("t", "aten.sub.Tensor", &format!("{},{}", node("x"), node("m")), &meta(&[64, 64], "float64"))
        .call("g", "aten.mm.default", &format!("{},{}", node("t"), node("w")), &meta(&[64, 64], "float64"))
        .call("y", "aten.relu.default", &node("g"), &meta(&[64, 64], "float64"))
        .output(&["y"])
        .replacen(r#""nodes":["#, r#""sources":{"t":"File \"m.py\", line 3, in f: x - m </pre><script>alert(1)</script>"},"nodes":["#, 1);
    let dir = std::env::temp_dir().join(format!("ferrocore-report-{}", std::process::id()));
    let opts =
        Options { cache_dir: dir.join("cache"), debug_dir: Some(dir.join("debug")), skip_native_compile: true, ..Options::default() };
    let r = compile_graph(&doc, &opts).unwrap();
    let html = std::fs::read_to_string(r.report_path.as_deref().expect("a report beside the dumps")).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(html.starts_with("<!DOCTYPE html>") && html.trim_end().ends_with("</html>"));
    assert!(!html.contains("<script") && html.contains("&lt;/pre&gt;&lt;script&gt;alert(1)"), "graph text is escaped");
    assert_eq!(dangling_links(&html), Vec::<String>::new());
    let kernels: Vec<&str> = html.split("<h3>kernel ").skip(1).filter_map(|s| s.split('<').next()).collect();
    assert_eq!(kernels.len(), r.kernels, "{kernels:?}");
    let row = |node: &str| {
        html.split("<tr id=\"node-")
            .find(|r| r.contains(&format!("<code>{node}</code>")))
            .unwrap()
            .split("</tr>")
            .next()
            .unwrap()
            .to_string()
    };
    // graph -> kernel: the row of `t` links to the kernel that computes it; kernel -> graph back
    let t_kernel = kernels.iter().find(|k| row("t").contains(&format!("href=\"#kernel-{k}\""))).expect("t's kernel");
    let section = html.split(&format!("id=\"kernel-{t_kernel}\"")).nth(1).unwrap().split("</div>").next().unwrap();
    assert!(section.contains(">t</a>") && section.contains("line 3, in f"), "{section}");
    assert!(row("g").contains("href=\"#call-"), "the GEMM is a library call: {}", row("g"));
    assert!(html.contains("<section id=\"runtime\">") && html.contains(ferrocore::report::RUNTIME_START));
}

#[test]
fn small_kernels_that_share_nothing_share_a_launch() {
    // two counters bumped by one (a batch norm's num_batches_tracked): one kernel; two large
    // independent results stay apart (nothing to gain but a launch, and the tiles may differ)
    let doc = GraphBuilder::new()
        .input("a", &[], "int64")
        .input("b", &[], "int64")
        .input("x", &[512, 512], "float32")
        .input("y", &[512, 512], "float32")
        .call("a1", "aten.add.Tensor", &format!(r#"{},{{"int":1}}"#, node("a")), &meta(&[], "int64"))
        .call("b1", "aten.add.Tensor", &format!(r#"{},{{"int":1}}"#, node("b")), &meta(&[], "int64"))
        .call("x1", "aten.neg.default", &node("x"), &meta(&[512, 512], "float32"))
        .call("y1", "aten.neg.default", &node("y"), &meta(&[512, 512], "float32"))
        .output(&["a1", "b1", "x1", "y1"]);
    let (_, post, _, k) = stages(&doc);
    assert_eq!(k, 3, "{post}");
}

#[test]
fn wrapper_embeds_the_exact_kernel_source() {
    // the embedded string is the runtime cache key: one byte of difference recompiles
    let doc = GraphBuilder::new()
        .input("x", &[8, 8], "float32")
        .call("e", "aten.exp.default", &node("x"), &meta(&[8, 8], "float32"))
        .output(&["e"]);
    let g = parse_graph(&doc).unwrap();
    let k = CppBackend.render(&schedule(lower_graph(&g).unwrap().program).unwrap()).unwrap();
    let (_, module) = wrapper_module(&doc);
    assert!(module.contains(&format!("KERNEL_SOURCE = r'''{}'''", k.source)));
}

#[test]
fn scatter_add_is_a_copy_then_an_atomic_scatter_kernel() {
    // out = x.scatter_add(0, idx, src): the copy of x, then a scatter node that stores at an
    // address computed from idx, in a kernel of its own, after the copy, with atomic adds
    let doc = GraphBuilder::new()
        .input("x", &[10, 4], "float32")
        .input("idx", &[6, 4], "int64")
        .input("src", &[6, 4], "float32")
        .call(
            "s",
            "aten.scatter_add.default",
            &format!(r#"{},{{"int":0}},{},{}"#, node("x"), node("idx"), node("src")),
            &meta(&[10, 4], "float32"),
        )
        .call("r", "aten.relu.default", &node("s"), &meta(&[10, 4], "float32"))
        .output(&["r"]);
    let (pre, post, src, k) = stages(&doc);
    assert_eq!(k, 3, "copy, scatter, relu:\n{post}");
    assert!(pre.contains(", sum)"), "the scatter combines with a sum:\n{pre}");
    assert!(src.contains("#pragma omp atomic"), "{src}");
    check("scatter_add.txt", &format!("{pre}\n{post}\n{src}"));
}

/// Lowered, scheduled for Triton and rendered by the Triton backend: the kernels without the prelude.
/// `doc` scheduled as for a GPU (reduction splits and one-pass variances on).
fn gpu_schedule(doc: &str) -> ferrocore::scheduler::Schedule {
    let g = parse_graph(doc).unwrap();
    let s = schedule_for(lower_graph(&g).unwrap().program, &(TritonBackend { cpu_tensors: true }).schedule_options()).unwrap();
    s.program.verify().unwrap();
    s
}

/// The Triton kernels of a schedule, without the prelude.
fn triton_source(s: &ferrocore::scheduler::Schedule) -> String {
    let src = TritonBackend { cpu_tensors: true }.render(s).unwrap().source;
    src.split(ferrocore::codegen::triton::PRELUDE).nth(1).unwrap_or("").to_string()
}

fn triton_kernels(doc: &str) -> (String, Vec<ferrocore::codegen::KernelLaunch>) {
    let g = parse_graph(doc).unwrap();
    let lowered = lower_graph_with(&g, &LowerOptions { kernels: KernelLanguage::Triton, ..Default::default() }).unwrap();
    let s = schedule_for(lowered.program, &TRITON_WHOLE).unwrap();
    let k = TritonBackend { cpu_tensors: true }.render(&s).unwrap();
    let src = k.source.split(ferrocore::codegen::triton::PRELUDE).nth(1).unwrap_or("").to_string();
    (src, k.launches)
}

#[test]
fn triton_source_of_fused_pointwise_and_reduction_kernels() {
    // relu + add + sum over rows (persistent), then a looped reduction over 10000 columns
    let doc = GraphBuilder::new()
        .input("x", &[8, 32], "float32")
        .input("y", &[4, 10000], "float16")
        .call("relu", "aten.relu.default", &node("x"), &meta(&[8, 32], "float32"))
        .call("add", "aten.add.Tensor", &format!(r#"{},{{"int":1}}"#, node("relu")), &meta(&[8, 32], "float32"))
        .call("sum_1", "aten.sum.dim_IntList", &over("add", -1, false), &meta(&[8], "float32"))
        .call("amax", "aten.amax.default", &over("y", 1, false), &meta(&[4], "float16"))
        .call("mul", "aten.mul.Tensor", &format!("{},{}", node("add"), node("add")), &meta(&[8, 32], "float32"))
        .output(&["sum_1", "amax", "mul"]);
    let (src, launches) = triton_kernels(&doc);
    let names: Vec<&str> = launches.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["triton_red_fused_relu_add_sum_mul_0", "triton_red_fused_amax_1"], "{src}");
    assert!(src.contains("for r0offset in range(0, 10000, 1024):"), "{src}");
    check("triton_kernels.txt", &src);
}

#[test]
fn triton_matrix_product_template_computes_its_epilogue_on_its_tile() {
    // a bfloat16 linear layer over a transposed weight, its bias and GELU: one kernel whose
    // programs take 128 x 128 tiles of the [300, 200] result, k in steps of 64 (96 = 64 + 32:
    // the masked branch), then the epilogue on `x0`, the tile's flat indices
    let doc = GraphBuilder::new()
        .input("x", &[300, 96], "bfloat16")
        .input("w", &[200, 96], "bfloat16")
        .input("b", &[200], "bfloat16")
        .call("t", "aten.t.default", &node("w"), &meta(&[96, 200], "bfloat16"))
        .call("addmm", "aten.addmm.default", &format!("{},{},{}", node("b"), node("x"), node("t")), &meta(&[300, 200], "bfloat16"))
        .call("gelu", "aten.gelu.default", &node("addmm"), &meta(&[300, 200], "bfloat16"))
        .output(&["gelu"]);
    let g = parse_graph(&doc).unwrap();
    let options = LowerOptions { kernels: KernelLanguage::Triton, gemm_template: GemmTemplate::Always, ..Default::default() };
    let lowered = lower_graph_with(&g, &options).unwrap();
    let s = schedule_for(lowered.program, &(TritonBackend { cpu_tensors: true }).schedule_options()).unwrap();
    let k = TritonBackend { cpu_tensors: true }.render(&s).unwrap();
    let names: Vec<&str> = k.launches.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["triton_mm_fused_addmm_gelu_0"]);
    let LaunchShape::Grid { grid, tile: Some(tile), .. } = &k.launches[0].shape else { panic!("{:?}", k.launches[0].shape) };
    assert_eq!((*grid, tile.m, tile.n, tile.k), (6, 128, 128, 64));
    assert!(k.launches[0].candidates.len() > 4 && k.launches[0].candidates.iter().all(|c| c.tile.is_some()));
    let src = k.source.split(ferrocore::codegen::triton::PRELUDE).nth(1).unwrap_or("").to_string();
    check("triton_gemm_template.txt", &src);
}

#[test]
fn triton_convolution_template_reads_each_tap_of_its_input() {
    // a bfloat16 3x3 convolution (padding 1) of a channels-last 2x96x10x9 input to 40 channels,
    // its bias and ReLU: the weight copied with its channels innermost, then one kernel whose
    // rows are the 180 output pixels and columns the 40 channels; each step of its k loop reads
    // one tap's 64 channels (96 = 64 + 32: the masked branch), zero outside the input
    let out = strided_meta(&[2, 40, 10, 9], Some(&[3600, 1, 360, 40]), "bfloat16");
    let doc = GraphBuilder::new()
        .input_meta("x", &strided_meta(&[2, 96, 10, 9], Some(&[8640, 1, 864, 96]), "bfloat16"))
        .input("w", &[40, 96, 3, 3], "bfloat16")
        .input("b", &[40], "bfloat16")
        .call(
            "conv",
            "aten.convolution.default",
            &[node("x"), node("w"), node("b"), ints(&[1, 1]), ints(&[1, 1]), ints(&[1, 1]), boolean(false), ints(&[0, 0]), int(1)]
                .join(","),
            &out,
        )
        .call("relu", "aten.relu.default", &node("conv"), &out)
        .output(&["relu"]);
    let g = parse_graph(&doc).unwrap();
    let options = LowerOptions {
        kernels: KernelLanguage::Triton,
        gemm_template: GemmTemplate::Always,
        conv_layout: ConvLayout::ChannelsLast,
        ..Default::default()
    };
    let lowered = lower_graph_with(&g, &options).unwrap();
    let s = schedule_for(lowered.program, &(TritonBackend { cpu_tensors: true }).schedule_options()).unwrap();
    let k = TritonBackend { cpu_tensors: true }.render(&s).unwrap();
    let names: Vec<&str> = k.launches.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["triton_poi_fused_w_0", "triton_conv_fused_conv_relu_1"]);
    let src = k.source.split(ferrocore::codegen::triton::PRELUDE).nth(1).unwrap_or("").to_string();
    check("triton_conv_template.txt", &src);
}

#[test]
fn cpp_matrix_product_computes_its_epilogue_on_its_tile() {
    // a float32 linear layer under the C++ rule's size (70 x 300 x 96 multiply-adds), its bias
    // and GELU: one kernel over 64 x 256 tiles (four, the last ones partial, split across
    // threads), each tile's product from `ferro::gemm_f32`, then the epilogue at (row `x0`,
    // column `x1`): the bias read at `x1`
    let doc = GraphBuilder::new()
        .input("x", &[70, 96], "float32")
        .input("w", &[300, 96], "float32")
        .input("b", &[300], "float32")
        .call("t", "aten.t.default", &node("w"), &meta(&[96, 300], "float32"))
        .call("addmm", "aten.addmm.default", &format!("{},{},{}", node("b"), node("x"), node("t")), &meta(&[70, 300], "float32"))
        .call("gelu", "aten.gelu.default", &node("addmm"), &meta(&[70, 300], "float32"))
        .output(&["gelu"]);
    let g = parse_graph(&doc).unwrap();
    let s = schedule(lower_graph(&g).unwrap().program).unwrap();
    let k = CppBackend.render(&s).unwrap();
    let names: Vec<&str> = k.launches.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["cpp_mm_fused_addmm_gelu_0"]);
    assert!(k.source.contains("ferro::gemm_f32"), "the matrix-product helpers are in the source's prelude");
    let src = k.source.split(ferrocore::runtime::CPP_UNIT_MARK).nth(1).unwrap_or("").to_string();
    check("cpp_gemm_template.txt", &src);
}

#[test]
fn cpp_attention_computes_its_bias_per_key() {
    // ferrocore's attention call on the CPU (float32) with a causal ALiBi bias built from
    // positions, and its log-sum-exp: one C++ kernel over the 2 x 64 query rows, each walking
    // keys 0 to its own (the band the bias proves), the bias computed per key at (row `x0`,
    // head `x2`, key `x3`), the online softmax's running maximum and sum in float32
    let f32 = |shape: &[i64]| meta(shape, "float32");
    let doc = GraphBuilder::new()
        .input("q", &[1, 2, 64, 16], "float32")
        .input("k", &[1, 2, 64, 16], "float32")
        .input("v", &[1, 2, 64, 16], "float32")
        .call("pos", "aten.arange.start_step", r#"{"int":0},{"int":64}"#, &meta(&[64], "int64"))
        .call("i", "aten.unsqueeze.default", &format!(r#"{},{{"int":1}}"#, node("pos")), &meta(&[64, 1], "int64"))
        .call("j", "aten.unsqueeze.default", &format!(r#"{},{{"int":0}}"#, node("pos")), &meta(&[1, 64], "int64"))
        .call("dist", "aten.sub.Tensor", &format!("{},{}", node("j"), node("i")), &meta(&[64, 64], "int64"))
        .call("alibi", "aten.mul.Tensor", &format!(r#"{},{{"float":0.125}}"#, node("dist")), &f32(&[64, 64]))
        .call("seen", "aten.ge.Tensor", &format!("{},{}", node("i"), node("j")), &meta(&[64, 64], "bool"))
        .call("closed", "aten.scalar_tensor.default", r#"{"float":"-inf"}"#, &f32(&[]))
        .call("bias2", "aten.where.self", &format!("{},{},{}", node("seen"), node("alibi"), node("closed")), &f32(&[64, 64]))
        .call("bias", "aten.view.default", &format!(r#"{},{}"#, node("bias2"), ints(&[1, 1, 64, 64])), &f32(&[1, 1, 64, 64]))
        .call(
            "attn",
            "aten._scaled_dot_product_fused_attention_overrideable.default",
            &format!(r#"{},{},{},{}"#, node("q"), node("k"), node("v"), node("bias")),
            &format!(r#"{{"tuple":[{},{}]}}"#, f32(&[1, 2, 64, 16]), f32(&[1, 2, 64])),
        )
        .call("out", "getitem", &format!(r#"{},{{"int":0}}"#, node("attn")), &f32(&[1, 2, 64, 16]))
        .call("lse", "getitem", &format!(r#"{},{{"int":1}}"#, node("attn")), &f32(&[1, 2, 64]))
        .output(&["out", "lse"]);
    let g = parse_graph(&doc).unwrap();
    let s = schedule(lower_graph(&g).unwrap().program).unwrap();
    let k = CppBackend.render(&s).unwrap();
    let names: Vec<&str> = k.launches.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names.len(), 1, "{names:?}");
    assert!(names[0].starts_with("cpp_attn_"), "{names:?}");
    let src = k.source.split(ferrocore::runtime::CPP_UNIT_MARK).nth(1).unwrap_or("").to_string();
    check("cpp_attention.txt", &src);
}

#[test]
fn triton_blocks_writing_64_bit_values_stay_under_4096_elements() {
    // Triton 3.6 stores wrong 64-bit values from blocks of 4096+ elements under a partial mask:
    // rows of 3000 int64 values loop in steps of 1024, float32 rows stay persistent (one block)
    let rows = |dt: &str| {
        GraphBuilder::new()
            .input("x", &[4, 3000], dt)
            .call("s", "aten.sum.dim_IntList", &over("x", -1, false), &meta(&[4], dt))
            .call("m", "aten.mul.Tensor", &format!(r#"{},{{"int":2}}"#, node("x")), &meta(&[4, 3000], dt))
            .output(&["s", "m"])
    };
    let (wide, _) = triton_kernels(&rows("int64"));
    assert!(wide.contains("for r0offset in range(0, 3000, 1024):"), "{wide}");
    let (narrow, _) = triton_kernels(&rows("float32"));
    assert!(narrow.contains("tl.arange(0, 4096)") && !narrow.contains("r0offset"), "{narrow}");
}

#[test]
fn triton_kernels_of_one_text_share_a_definition_only_with_one_signature() {
    // two scatter_adds of one shape: their copies (and atomic scatters) have one text; the
    // float32 ones share a definition, the float64 one needs its own (a binary per signature)
    let scatter = |g: GraphBuilder, name: &str, x: &str, src: &str, dt: &str| {
        g.call(name, "aten.scatter_add.default", &format!(r#"{},{{"int":0}},{},{}"#, node(x), node("idx"), node(src)), &meta(&[10, 4], dt))
    };
    let g = GraphBuilder::new()
        .input("x", &[10, 4], "float32")
        .input("y", &[10, 4], "float32")
        .input("z", &[10, 4], "float64")
        .input("idx", &[6, 4], "int64")
        .input("src", &[6, 4], "float32")
        .input("src64", &[6, 4], "float64");
    let g = scatter(scatter(scatter(g, "a", "x", "src", "float32"), "b", "y", "src", "float32"), "c", "z", "src64", "float64");
    let (src, launches) = triton_kernels(&g.output(&["a", "b", "c"]));
    let copies: Vec<&ferrocore::codegen::KernelLaunch> = launches.iter().filter(|l| l.signature.len() == 2).collect();
    assert_eq!(copies.len(), 3, "{src}");
    assert_eq!(copies[0].name, copies[1].name, "the float32 copies share one definition:\n{src}");
    assert_ne!(copies[0].name, copies[2].name, "the float64 copy has its own:\n{src}");
    for l in &launches {
        assert!(src.contains(&format!("def {}(", l.name)), "{} is defined:\n{src}", l.name);
    }
}

#[test]
fn a_scatter_triton_cannot_combine_runs_in_aten_and_the_rest_compiles() {
    // an int8 scatter_add has no atomic form in Triton: that node is ATen's, the relu a kernel
    let cuda = |shape: &[i64], dt: &str| meta(shape, dt).replace(r#""device":"cpu""#, r#""device":"cuda:0""#);
    let doc = GraphBuilder::new()
        .input("x", &[10, 4], "int8")
        .input("idx", &[6, 4], "int64")
        .input("src", &[6, 4], "int8")
        .call(
            "s",
            "aten.scatter_add.default",
            &format!(r#"{},{{"int":0}},{},{}"#, node("x"), node("idx"), node("src")),
            &meta(&[10, 4], "int8"),
        )
        .call("r", "aten.relu.default", &node("s"), &meta(&[10, 4], "int8"))
        .output(&["r"])
        .replace(&meta(&[10, 4], "int8"), &cuda(&[10, 4], "int8"))
        .replace(&meta(&[6, 4], "int64"), &cuda(&[6, 4], "int64"))
        .replace(&meta(&[6, 4], "int8"), &cuda(&[6, 4], "int8"));
    let dir = std::env::temp_dir().join(format!("ferrocore-stage-scatter-{}", std::process::id()));
    let opts = Options { cache_dir: dir.clone(), skip_native_compile: true, ..Options::default() };
    let r = compile_graph(&doc, &opts).unwrap();
    assert_eq!(r.backend, "triton");
    assert!(r.graph_fallback.is_none(), "{:?}", r.graph_fallback);
    assert!(r.fallbacks.iter().any(|f| f.node == "s" && f.reason.contains("int8")), "{:?}", r.fallbacks);
    assert!(r.module_source.contains("torch.ops.aten.scatter_add.default("), "{}", r.module_source);
    assert!(r.module_source.contains("launch_triton_poi_fused_r_0"), "{}", r.module_source);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn cuda_graphs_get_triton_kernels_and_cpu_graphs_cpp() {
    let doc = GraphBuilder::new()
        .input("x", &[8, 8], "float32")
        .call("e", "aten.exp.default", &node("x"), &meta(&[8, 8], "float32"))
        .output(&["e"]);
    let dir = std::env::temp_dir().join(format!("ferrocore-stage-backend-{}", std::process::id()));
    let opts = Options { cache_dir: dir.clone(), skip_native_compile: true, ..Options::default() };
    let cpu = compile_graph(&doc, &opts).unwrap();
    assert_eq!(cpu.backend, "cpp");
    assert!(cpu.module_source.contains("cpp_poi_fused_e_0(x.data_ptr(), buf1.data_ptr())"), "{}", cpu.module_source);
    let cuda_doc = doc.replace(r#""device":"cpu""#, r#""device":"cuda:0""#);
    let cuda = compile_graph(&cuda_doc, &opts).unwrap();
    assert_eq!(cuda.backend, "triton");
    assert!(cuda.module_source.contains("buf1 = empty_strided_cuda((8, 8), (8, 1), torch.float32)"), "{}", cuda.module_source);
    assert!(cuda.module_source.contains("with torch.cuda.device(0):"), "{}", cuda.module_source);
    assert!(
        cuda.module_source.contains("launch_triton_poi_fused_e_0 = TritonLaunch(triton_poi_fused_e_0, 1, {'XBLOCK': 64}, 1, 1)"),
        "{}",
        cuda.module_source
    );
    assert!(cuda.module_source.contains("\n    launch_triton_poi_fused_e_0(x, buf1)"), "{}", cuda.module_source);
    // forced: Triton kernels for CPU tensors (run under TRITON_INTERPRET=1)
    let forced = compile_graph(&doc, &Options { backend: BackendChoice::Triton, ..opts.clone() }).unwrap();
    assert_eq!(forced.backend, "triton");
    assert!(forced.module_source.contains("@ferro_jit"));
    // a graph with tensors on both devices launches no CPU kernel through Triton: its CPU
    // results are ATen's
    let cuda = |shape: &[i64]| meta(shape, "float32").replace(r#""device":"cpu""#, r#""device":"cuda:0""#);
    let mixed = GraphBuilder::new()
        .input("x", &[8], "float32")
        .call("e", "aten.exp.default", &node("x"), &meta(&[8], "float32"))
        .output(&["e"])
        .replace(r#""nodes":["#, &format!(r#""nodes":[{{"name":"y","kind":"placeholder","meta":{}}},{{"name":"ey","kind":"call_function","target":"aten.exp.default","args":[{}],"kwargs":{{}},"meta":{}}},"#, cuda(&[8]), node("y"), cuda(&[8])))
        .replace(r#"{"node":"e"}"#, r#"{"node":"e"},{"node":"ey"}"#);
    let r = compile_graph(&mixed, &opts).unwrap();
    assert_eq!(r.backend, "triton");
    assert!(r.graph_fallback.is_none(), "{:?}", r.graph_fallback);
    assert!(r.fallbacks.iter().any(|f| f.node == "e" && f.reason.contains("cpu result")), "{:?}", r.fallbacks);
    assert!(r.module_source.contains("launch_triton_poi_fused_ey_0"), "{}", r.module_source);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn what_triton_cannot_render_codegen_refuses_and_lowering_leaves_to_aten() {
    // an int8 scatter-add: no atomic add of 8-bit integers, and no compare-and-swap form
    let doc = GraphBuilder::new()
        .input("x", &[10], "int8")
        .input("idx", &[6], "int64")
        .input("src", &[6], "int8")
        .call(
            "s",
            "aten.scatter_add.default",
            &format!(r#"{},{{"int":0}},{},{}"#, node("x"), node("idx"), node("src")),
            &meta(&[10], "int8"),
        )
        .output(&["s"]);
    let g = parse_graph(&doc).unwrap();
    let s = schedule_for(lower_graph(&g).unwrap().program, &TRITON_WHOLE).unwrap();
    let e = TritonBackend { cpu_tensors: true }.render(&s).unwrap_err();
    assert_eq!(e.kind, CodegenErrorKind::Unsupported, "{e}");
    assert!(e.to_string().contains("scatter of int8"), "{e}");
    let opts = Options { backend: BackendChoice::Triton, skip_native_compile: true, ..Options::default() };
    let r = compile_graph(&doc, &opts).unwrap();
    assert!(r.graph_fallback.is_none(), "{:?}", r.graph_fallback);
    assert!(r.fallbacks.iter().any(|f| f.node == "s" && f.reason.contains("int8")), "{:?}", r.fallbacks);
    // the C++ backend renders it
    assert!(compile_graph(&doc, &Options { skip_native_compile: true, ..Options::default() }).unwrap().graph_fallback.is_none());
}

#[test]
fn triton_moves_complex_values_as_pairs_of_reals() {
    // a transposed complex64 copy and a complex conversion of a real tensor: components stored
    // at 2i + p (p the innermost variable), the kernels given the buffers' real views
    let doc = GraphBuilder::new()
        .input("x", &[4, 8], "complex64")
        .input("r", &[4, 8], "float32")
        .call(
            "t",
            "aten.permute.default",
            &format!(r#"{},{{"list":[{{"int":1}},{{"int":0}}]}}"#, node("x")),
            &meta(&[8, 4], "complex64").replace("[4,1]", "[1,8]"),
        )
        .call("c", "aten.clone.default", &node("t").to_string(), &meta(&[8, 4], "complex64"))
        .call("z", "aten._to_copy.default", &node("r"), &meta(&[4, 8], "complex128"))
        .output(&["c", "z"]);
    let g = parse_graph(&doc).unwrap();
    let s = schedule_for(lower_graph(&g).unwrap().program, &TRITON_WHOLE).unwrap();
    assert_eq!(s.decision_texts().iter().filter(|d| d.starts_with("complex:")).count(), 2, "{:?}", s.decision_texts());
    let k = TritonBackend { cpu_tensors: true }.render(&s).unwrap();
    let src = k.source.split(ferrocore::codegen::triton::PRELUDE).nth(1).unwrap_or("").to_string();
    let opts = Options { backend: BackendChoice::Triton, skip_native_compile: true, ..Options::default() };
    let r = compile_graph(&doc, &opts).unwrap();
    assert!(r.graph_fallback.is_none(), "{:?}", r.graph_fallback);
    assert!(r.module_source.contains("torch.view_as_real(x)"), "{}", r.module_source);
    check("triton_complex.txt", &src);
}

#[test]
fn triton_softmax_loads_its_row_once() {
    // persistent groups over the same row share their loads: one read of x per program
    let doc = GraphBuilder::new()
        .input("x", &[16, 64], "bfloat16")
        .call("sm", "aten._softmax.default", &format!(r#"{},{{"int":-1}},{{"bool":false}}"#, node("x")), &meta(&[16, 64], "bfloat16"))
        .output(&["sm"]);
    let (src, launches) = triton_kernels(&doc);
    assert_eq!(launches.len(), 1, "{src}");
    assert_eq!(src.matches("tl.load(").count(), 1, "{src}");
    check("triton_softmax.txt", &src);
}

#[test]
fn triton_index_math_is_int64_only_past_int32() {
    let small = GraphBuilder::new()
        .input("x", &[4, 1024], "float32")
        .call("m", "aten.mul.Tensor", &format!(r#"{},{{"int":2}}"#, node("x")), &meta(&[4, 1024], "float32"))
        .call("s", "aten.sum.dim_IntList", &over("x", 0, false), &meta(&[1024], "float32"))
        .output(&["m", "s"]);
    let (src, _) = triton_kernels(&small);
    assert!(!src.contains("tl.int64"), "{src}");
    // 2**32 elements: the flat index and the row offsets pass int32
    let big = GraphBuilder::new()
        .input("x", &[4, 1 << 30], "float32")
        .call("m", "aten.mul.Tensor", &format!(r#"{},{{"int":2}}"#, node("x")), &meta(&[4, 1 << 30], "float32"))
        .call("s", "aten.sum.dim_IntList", &over("x", 0, false), &meta(&[1 << 30], "float32"))
        .output(&["m", "s"]);
    let (src, launches) = triton_kernels(&big);
    for l in &launches {
        let body = src.split(&format!("def {}(", l.name)).nth(1).unwrap_or("");
        let body = body.split("@ferro_jit").next().unwrap_or("");
        assert!(body.contains("xoffset = tl.program_id(0).to(tl.int64) * XBLOCK"), "{}: {body}", l.name);
    }
    assert!(src.contains("[None, :].to(tl.int64)"), "reduction indices must be int64 too:\n{src}");
}

#[test]
fn narrow_reductions_split_in_two_stages_for_the_gpu() {
    // a mean of 1M elements into one output, and a column sum of 3 outputs over 1M rows
    let doc = GraphBuilder::new()
        .input("x", &[1024, 1024], "float32")
        .input("y", &[1000000, 3], "float16")
        .call("mean", "aten.mean.default", &node("x"), &meta(&[], "float32"))
        .call("sum_1", "aten.sum.dim_IntList", &over("y", 0, false), &meta(&[3], "float16"))
        .output(&["mean", "sum_1"]);
    let g = parse_graph(&doc).unwrap();
    let s = gpu_schedule(&doc);
    let decisions: Vec<String> = s.decision_texts().into_iter().filter(|d| d.starts_with("split")).collect();
    assert_eq!(decisions.len(), 2, "{:?}", s.decision_texts());
    assert_eq!(s.kernel_count(), 4, "{}", s.text());
    let src = triton_source(&s);
    // no split without a GPU's split config (the C++ backend's rows are whole)
    let whole = schedule_for(lower_graph(&g).unwrap().program, &TRITON_WHOLE).unwrap();
    assert_eq!(whole.kernel_count(), 2);
    check(
        "triton_split_reductions.txt",
        &format!("{}\n{}\n{src}", decisions.iter().map(|d| d.as_str()).collect::<Vec<_>>().join("\n"), s.text()),
    );
}

#[test]
fn small_pooling_windows_are_unrolled_pointwise() {
    // 3x3 max pool with indices: one pointwise kernel, nine loads per output, no window loop
    let args = format!(
        r#"{},{{"list":[{{"int":3}},{{"int":3}}]}},{{"list":[{{"int":2}},{{"int":2}}]}},{{"list":[{{"int":1}},{{"int":1}}]}}"#,
        node("x")
    );
    let out = format!(r#"{{"tuple":[{},{}]}}"#, meta(&[2, 4, 8, 8], "float32"), meta(&[2, 4, 8, 8], "int64"));
    let doc = GraphBuilder::new()
        .input("x", &[2, 4, 16, 16], "float32")
        .call("p", "aten.max_pool2d_with_indices.default", &args, &out)
        .call("v", "getitem", &format!(r#"{},{{"int":0}}"#, node("p")), &meta(&[2, 4, 8, 8], "float32"))
        .call("i", "getitem", &format!(r#"{},{{"int":1}}"#, node("p")), &meta(&[2, 4, 8, 8], "int64"))
        .output(&["v", "i"]);
    let (src, launches) = triton_kernels(&doc);
    assert_eq!(launches.len(), 1, "{src}");
    assert!(launches[0].name.starts_with("triton_poi_"), "{src}");
    assert_eq!(src.matches("tl.load(").count(), 9, "{src}");
}

#[test]
fn split_column_sums_read_along_the_columns() {
    // a bias gradient's shape: 64 columns summed over 262144 rows; the first stage's outputs
    // [S, 64] flatten into x0, whose loads are contiguous along x0 in runs of 64 columns
    let doc = GraphBuilder::new()
        .input("y", &[262144, 64], "bfloat16")
        .call("s", "aten.sum.dim_IntList", &over("y", 0, false), &meta(&[64], "bfloat16"))
        .output(&["s"]);
    let s = gpu_schedule(&doc);
    assert!(s.decision_texts().iter().any(|d| d.starts_with("split:") && d.contains("outer dim")), "{:?}", s.decision_texts());
    let src = triton_source(&s);
    let first = src.split("@ferro_jit").find(|k| k.contains("range(0, ")).unwrap_or_else(|| panic!("no looped first stage:\n{src}"));
    // 1024 chunks of 256 rows, each read by column tiles of XBLOCK outputs by 64 rows (128 bytes
    // of bfloat16 a row), the rows looped: lanes read along the columns
    assert!(first.contains("reduction over [256] (looped)"), "{first}");
    assert!(first.contains("tl.full([XBLOCK, 64]"), "{first}");
    let launches = TritonBackend { cpu_tensors: true }.render(&s).unwrap().launches;
    let shapes: Vec<_> = launches.iter().map(|l| &l.shape).collect();
    assert!(shapes.iter().any(|s| matches!(s, LaunchShape::Grid { grid: 1024, xblock: 64, .. })), "{shapes:?}");
}

#[test]
fn column_sums_of_a_few_thousand_outputs_are_split_to_fill_the_gpu() {
    // 4096 float32 outputs are 128 programs of 32 columns: too few to keep an H200's memory busy
    // (0.65 of copy bandwidth unsplit); four chunks of 4096 rows give 512 programs
    let doc = GraphBuilder::new()
        .input("x", &[16384, 4096], "float32")
        .call("s", "aten.sum.dim_IntList", &over("x", 0, false), &meta(&[4096], "float32"))
        .output(&["s"]);
    let s = gpu_schedule(&doc);
    let split =
        s.decision_texts().into_iter().find(|d| d.starts_with("split:")).unwrap_or_else(|| panic!("not split: {:?}", s.decision_texts()));
    assert!(split.contains("outer dim") && split.contains(": 4 partial reductions each"), "{split}");
    // 16384 outputs are 512 tiles of 32 already
    let doc = GraphBuilder::new()
        .input("x", &[16384, 16384], "float32")
        .call("s", "aten.sum.dim_IntList", &over("x", 0, false), &meta(&[16384], "float32"))
        .output(&["s"]);
    assert!(!gpu_schedule(&doc).decision_texts().iter().any(|d| d.starts_with("split:")));
    // bfloat16 tiles hold as many bytes in twice the outputs, and twice as many are wanted
    let doc = GraphBuilder::new()
        .input("x", &[16384, 16384], "bfloat16")
        .call("s", "aten.sum.dim_IntList", &over("x", 0, false), &meta(&[16384], "bfloat16"))
        .output(&["s"]);
    let s = gpu_schedule(&doc);
    assert!(
        s.decision_texts().iter().any(|d| d.starts_with("split:") && d.contains(": 4 partial reductions each")),
        "{:?}",
        s.decision_texts()
    );
}

#[test]
fn long_variances_take_one_pass_for_the_gpu() {
    // var over rows of 10000: two reduction loops over x become one (mean + Welford M2); 1024
    // rows run as enough looped programs to stay whole
    let doc = GraphBuilder::new()
        .input("x", &[1024, 10000], "float32")
        .call("v", "aten.var.correction", &over("x", 1, false), &meta(&[1024], "float32"))
        .output(&["v"]);
    let g = parse_graph(&doc).unwrap();
    let opts = (TritonBackend { cpu_tensors: true }).schedule_options();
    let lower = || lower_graph_with(&g, &LowerOptions { kernels: KernelLanguage::Triton, ..Default::default() }).unwrap().program;
    let s = schedule_for(lower(), &opts).unwrap();
    s.program.verify().unwrap();
    assert!(s.decision_texts().iter().any(|d| d.starts_with("welford:")), "{:?}", s.decision_texts());
    assert_eq!(s.kernel_count(), 1, "{}", s.text());
    let text = s.text();
    assert!(!text.contains("group 1"), "mean and M2 share one loop group:\n{text}");
    // without the option, the second pass reads the mean: two loop groups over x
    let two = schedule_for(lower(), &TRITON_WHOLE).unwrap();
    assert!(two.text().contains("group 1"), "{}", two.text());
    // the C++ backend never schedules a Welford reduction
    assert!(schedule(lower_graph(&g).unwrap().program).unwrap().decision_texts().iter().all(|d| !d.starts_with("welford:")));
}

#[test]
fn a_large_pointwise_result_stays_out_of_a_kernel_of_few_programs() {
    // a scalar sum and a relu of the same 65536 elements: one program would loop over all of
    // the relu's elements in the sum's kernel; beside a row sum (256 programs) it joins
    let doc = GraphBuilder::new()
        .input("y", &[256, 256], "float32")
        .call("s", "aten.sum.default", &node("y"), &meta(&[], "float32"))
        .call("r", "aten.relu.default", &node("y"), &meta(&[256, 256], "float32"))
        .output(&["s", "r"]);
    let s = schedule(lower_graph(&parse_graph(&doc).unwrap()).unwrap().program).unwrap();
    assert_eq!(s.kernel_count(), 2, "{}", s.text());
    assert!(
        s.decision_texts().iter().any(|d| d.contains("would loop over 65536 elements in each of the kernel's 1 programs")),
        "{:?}",
        s.decision_texts()
    );
    let rows = GraphBuilder::new()
        .input("y", &[256, 256], "float32")
        .call("s", "aten.sum.dim_IntList", &over("y", 1, false), &meta(&[256], "float32"))
        .call("r", "aten.relu.default", &node("y"), &meta(&[256, 256], "float32"))
        .output(&["s", "r"]);
    let s = schedule(lower_graph(&parse_graph(&rows).unwrap()).unwrap().program).unwrap();
    assert_eq!(s.kernel_count(), 1, "{}", s.text());
    // 128 rows of 32768: a looped reduction runs four rows a program, 32 programs; a GroupNorm
    // backward's input gradient in such a kernel ran at a fraction of the GPU's bandwidth
    let long_rows = GraphBuilder::new()
        .input("y", &[128, 32768], "float32")
        .call("s", "aten.sum.dim_IntList", &over("y", 1, false), &meta(&[128], "float32"))
        .call("r", "aten.relu.default", &node("y"), &meta(&[128, 32768], "float32"))
        .output(&["s", "r"]);
    let s = schedule(lower_graph(&parse_graph(&long_rows).unwrap()).unwrap().program).unwrap();
    assert_eq!(s.kernel_count(), 2, "{}", s.text());
    assert!(
        s.decision_texts().iter().any(|d| d.contains("would loop over 32768 elements in each of the kernel's 32 programs")),
        "{:?}",
        s.decision_texts()
    );
}

#[test]
fn a_returned_value_of_a_temporary_is_computed_with_it() {
    // r = relu(x) feeds a GEMM and a returned bf16 copy (a saved activation): the copy, lowered
    // last, joins relu's kernel (which also writes q, another GEMM's operand, smaller than r), so
    // the float32 temporary dies at the GEMM, not at the end
    let doc = GraphBuilder::new()
        .input("x", &[512, 512], "float32")
        .input("w", &[512, 64], "float32")
        .input("wb", &[512, 64], "bfloat16")
        .call("r", "aten.relu.default", &node("x"), &meta(&[512, 512], "float32"))
        .call("q", "aten._to_copy.default", &node("x"), &meta(&[512, 512], "bfloat16"))
        .call("g", "aten.mm.default", &format!("{},{}", node("r"), node("w")), &meta(&[512, 64], "float32"))
        .call("f", "aten.mm.default", &format!("{},{}", node("q"), node("wb")), &meta(&[512, 64], "bfloat16"))
        .call("h", "aten._to_copy.default", &node("r"), &meta(&[512, 512], "bfloat16"))
        .output(&["g", "f", "h"]);
    let (s, module) = wrapper_module(&doc);
    assert_eq!(s.kernel_count(), 1, "{}", s.text());
    let launch = module.find("(x.data_ptr()").unwrap_or(usize::MAX);
    let mm = module.find("torch.mm(").unwrap_or(0);
    assert!(launch < mm, "the copy runs before the GEMM:\n{module}");
}

#[test]
fn a_gemm_read_only_later_runs_after_the_last_reader_of_its_operands() {
    // (float64: a small float32 GEMM on the CPU is a matrix-product kernel, not a library call)
    // a weight gradient g.T @ h, read only by the last step, runs after the kernel that also
    // reads g (g stays alive until then anyway): its result is not live across that kernel
    let doc = GraphBuilder::new()
        .input("g", &[64, 100], "float64")
        .input("h", &[64, 32], "float64")
        .input("w", &[100, 32], "float64")
        .call(
            "gt",
            "aten.permute.default",
            &format!(r#"{},{{"list":[{{"int":1}},{{"int":0}}]}}"#, node("g")),
            &meta(&[100, 64], "float64").replace("[64,1]", "[1,100]"),
        )
        .call("dw", "aten.mm.default", &format!("{},{}", node("gt"), node("h")), &meta(&[100, 32], "float64"))
        .call("k", "aten.relu.default", &node("g"), &meta(&[64, 100], "float64"))
        .call("dx", "aten.mm.default", &format!("{},{}", node("k"), node("w")), &meta(&[64, 32], "float64"))
        .call("dw2", "aten.mul.Tensor", &format!(r#"{},{{"float":2.0}}"#, node("dw")), &meta(&[100, 32], "float64"))
        .output(&["dx", "dw2"]);
    let (s, module) = wrapper_module(&doc);
    assert!(s.decision_texts().iter().any(|d| d.starts_with("order: ") && d.contains("runs 1 steps later")), "{:?}", s.decision_texts());
    let relu = module.find("(g.data_ptr()").unwrap_or(usize::MAX);
    let dw = module.find("torch.mm(reinterpret(g").or_else(|| module.find("torch.mm(g")).unwrap_or(0);
    assert!(relu < dw, "relu(g) runs before the weight gradient:\n{module}");
    // an input gradient g @ relu(w) stays before the weight gradient that also reads g: relu(w),
    // larger than its result, would otherwise live longer
    let stay = GraphBuilder::new()
        .input("g", &[64, 100], "float64")
        .input("h", &[64, 32], "float64")
        .input("w", &[100, 32], "float64")
        .call("k", "aten.relu.default", &node("w"), &meta(&[100, 32], "float64"))
        .call("dx", "aten.mm.default", &format!("{},{}", node("g"), node("k")), &meta(&[64, 32], "float64"))
        .call(
            "gt",
            "aten.permute.default",
            &format!(r#"{},{{"list":[{{"int":1}},{{"int":0}}]}}"#, node("g")),
            &meta(&[100, 64], "float64").replace("[64,1]", "[1,100]"),
        )
        .call("dw", "aten.mm.default", &format!("{},{}", node("gt"), node("h")), &meta(&[100, 32], "float64"))
        .call("dx2", "aten.mul.Tensor", &format!(r#"{},{{"float":2.0}}"#, node("dx")), &meta(&[64, 32], "float64"))
        .call("dw2", "aten.mul.Tensor", &format!(r#"{},{{"float":2.0}}"#, node("dw")), &meta(&[100, 32], "float64"))
        .output(&["dx2", "dw2"]);
    let (s, _) = wrapper_module(&stay);
    assert!(!s.decision_texts().iter().any(|d| d.starts_with("order: ")), "{:?}", s.decision_texts());
}

/// The schedule and wrapper module of a graph (C++ kernels) lowered with `opts`.
fn wrapper_module_with(doc: &str, opts: &ferrocore::lowering::LowerOptions) -> (ferrocore::scheduler::Schedule, String) {
    let g = parse_graph(doc).unwrap();
    let s = schedule(ferrocore::lowering::lower_graph_with(&g, opts).unwrap().program).unwrap();
    let k = CppBackend.render(&s).unwrap();
    let plan = ferrocore::wrapper::plan_host(&s, &k);
    let module = ferrocore::wrapper::render_module(&s, &k, &plan, "g");
    (s, module)
}

fn wrapper_module(doc: &str) -> (ferrocore::scheduler::Schedule, String) {
    wrapper_module_with(doc, &Default::default())
}

#[test]
fn a_pointwise_result_takes_the_storage_of_the_buffer_it_consumes() {
    // c = cumsum(x); r = relu(c): c dies in the relu, read element for element
    let doc = GraphBuilder::new()
        .input("x", &[16, 8], "float32")
        .call("c", "aten.cumsum.default", &format!(r#"{},{{"int":0}}"#, node("x")), &meta(&[16, 8], "float32"))
        .call("r", "aten.relu.default", &node("c"), &meta(&[16, 8], "float32"))
        .output(&["r"]);
    let (s, module) = wrapper_module(&doc);
    assert!(s.decision_texts().iter().any(|d| d.starts_with("in place:")), "{:?}", s.decision_texts());
    assert_eq!(module.matches("= empty_strided").count(), 1, "one allocation for both:\n{module}");
    // the input is dropped after its last reader and the argument list is cleared
    assert!(module.contains("args.clear()") && module.contains("del x"), "{module}");
}

#[test]
fn no_in_place_result_over_a_transposed_read_a_returned_buffer_or_an_input() {
    fn cumsum(g: GraphBuilder) -> GraphBuilder {
        g.input("x", &[16, 16], "float32").call(
            "c",
            "aten.cumsum.default",
            &format!(r#"{},{{"int":0}}"#, node("x")),
            &meta(&[16, 16], "float32"),
        )
    }
    // read transposed: element (i, j) of the result needs element (j, i) of c
    let transposed = cumsum(GraphBuilder::new())
        .call(
            "t",
            "aten.permute.default",
            &format!(r#"{},{{"list":[{{"int":1}},{{"int":0}}]}}"#, node("c")),
            r#"{"tensor":{"shape":[16,16],"stride":[1,16],"storage_offset":0,"dtype":"float32","device":"cpu"}}"#,
        )
        .call("r", "aten.add.Tensor", &format!(r#"{},{}"#, node("t"), node("x")), &meta(&[16, 16], "float32"))
        .output(&["r"]);
    // c is returned as well
    let returned = cumsum(GraphBuilder::new()).call("r", "aten.relu.default", &node("c"), &meta(&[16, 16], "float32")).output(&["c", "r"]);
    // an input's storage belongs to the caller
    let input = GraphBuilder::new()
        .input("x", &[16, 16], "float32")
        .call("r", "aten.relu.default", &node("x"), &meta(&[16, 16], "float32"))
        .output(&["r"]);
    for doc in [transposed, returned, input] {
        let (s, _) = wrapper_module(&doc);
        assert!(s.decision_texts().iter().all(|d| !d.starts_with("in place:")), "{:?}", s.decision_texts());
    }
}

#[test]
fn a_scatter_of_one_element_per_row_is_a_pointwise_select() {
    // zeros.scatter(1, idx, -1.0) * g: no buffer for the scattered tensor, one kernel
    let doc = GraphBuilder::new()
        .input("z", &[8, 50], "float32")
        .input("idx", &[8, 1], "int64")
        .input("g", &[8, 1], "float32")
        .call(
            "s",
            "aten.scatter.value",
            &format!(r#"{},{{"int":1}},{},{{"float":-1.0}}"#, node("z"), node("idx")),
            &meta(&[8, 50], "float32"),
        )
        .call("m", "aten.mul.Tensor", &format!("{},{}", node("s"), node("g")), &meta(&[8, 50], "float32"))
        .output(&["m"]);
    let (pre, post, src, k) = stages(&doc);
    assert_eq!(k, 1, "{post}");
    assert!(pre.contains("check_index") && pre.contains("eq("), "{pre}");
    assert!(src.contains("ferro_err"), "an index out of range still raises:\n{src}");
}

#[test]
fn a_gathered_and_returned_value_is_one_buffer() {
    // a log-softmax both gathered (the loss) and returned (saved for the backward)
    let doc = GraphBuilder::new()
        .input("x", &[4, 100], "float32")
        .input("idx", &[4, 1], "int64")
        .call("ls", "aten._log_softmax.default", &format!(r#"{},{{"int":1}},{{"bool":false}}"#, node("x")), &meta(&[4, 100], "float32"))
        .call("g", "aten.gather.default", &format!(r#"{},{{"int":1}},{}"#, node("ls"), node("idx")), &meta(&[4, 1], "float32"))
        .output(&["g", "ls"]);
    let (_, module) = wrapper_module(&doc);
    let big = module.lines().filter(|l| l.contains("empty_strided_cpu((4, 100)")).count();
    assert_eq!(big, 1, "{module}");
}

#[test]
fn a_value_only_gathered_is_computed_at_the_gathered_positions() {
    // a loss's log-softmax over a [64, 4, 100] view of the logits, read by gather alone: the
    // row statistics are reductions, the log-softmax itself no buffer; one position per row
    let doc = GraphBuilder::new()
        .input("x", &[4, 16, 100], "float32")
        .input("idx", &[64, 1], "int64")
        .call("v", "aten.view.default", &format!(r#"{},{{"list":[{{"int":64}},{{"int":100}}]}}"#, node("x")), &meta(&[64, 100], "float32"))
        .call("m", "aten.amax.default", &over("v", 1, true), &meta(&[64, 1], "float32"))
        .call("s", "aten.sub.Tensor", &format!("{},{}", node("v"), node("m")), &meta(&[64, 100], "float32"))
        .call("g", "aten.gather.default", &format!(r#"{},{{"int":1}},{}"#, node("s"), node("idx")), &meta(&[64, 1], "float32"))
        .output(&["g"]);
    let (_, module) = wrapper_module(&doc);
    assert!(!module.contains("empty_strided_cpu((64, 100)"), "{module}");
    let (pre, _, _, _) = stages(&doc);
    let indirect = pre.lines().any(|l| l.contains("= load(x, ") && l.contains("*t"));
    assert!(indirect, "the logits read at the gathered column:\n{pre}");
}

#[test]
fn a_value_read_through_a_view_by_a_library_call_and_returned_is_computed_once() {
    // attention probabilities: bmm(view(p), v) and p saved for the backward
    let doc = GraphBuilder::new()
        .input("s", &[2, 4, 8, 8], "float32")
        .input("v", &[8, 8, 16], "float32")
        .call("m", "aten.amax.default", &over("s", -1, true), &meta(&[2, 4, 8, 1], "float32"))
        .call("d", "aten.sub.Tensor", &format!("{},{}", node("s"), node("m")), &meta(&[2, 4, 8, 8], "float32"))
        .call("e", "aten.exp.default", &node("d"), &meta(&[2, 4, 8, 8], "float32"))
        .call("z", "aten.sum.dim_IntList", &over("e", -1, true), &meta(&[2, 4, 8, 1], "float32"))
        .call("p", "aten.div.Tensor", &format!("{},{}", node("e"), node("z")), &meta(&[2, 4, 8, 8], "float32"))
        .call(
            "pv",
            "aten.view.default",
            &format!(r#"{},{{"list":[{{"int":8}},{{"int":8}},{{"int":8}}]}}"#, node("p")),
            &meta(&[8, 8, 8], "float32"),
        )
        .call("o", "aten.bmm.default", &format!("{},{}", node("pv"), node("v")), &meta(&[8, 8, 16], "float32"))
        .output(&["o", "p"]);
    let (_, module) = wrapper_module(&doc);
    let probabilities =
        module.lines().filter(|l| l.contains("empty_strided_cpu((2, 4, 8, 8)") || l.contains("empty_strided_cpu((8, 8, 8)")).count();
    assert_eq!(probabilities, 1, "{module}");
}

/// The wrapper module of a graph lowered with every unaligned 16-bit GEMM padded.
fn padded_module(doc: &str) -> String {
    use ferrocore::lowering::PadMm;
    wrapper_module_with(doc, &LowerOptions { pad_mm: PadMm::Always, ..Default::default() }).1
}

#[test]
fn a_gradient_read_by_two_padded_gemms_is_padded_once() {
    // g @ w and g.T @ h (a linear layer's input and weight gradients) with 100 columns
    let t = |shape: &[i64], stride: &[i64]| {
        format!(r#"{{"tensor":{{"shape":{shape:?},"stride":{stride:?},"storage_offset":0,"dtype":"bfloat16","device":"cpu"}}}}"#)
    };
    for computed in [false, true] {
        let mut g =
            GraphBuilder::new().input("x", &[64, 100], "bfloat16").input("w", &[100, 64], "bfloat16").input("h", &[64, 32], "bfloat16");
        let grad = if computed {
            g = g.call("g", "aten.mul.Tensor", &format!(r#"{},{{"float":2.0}}"#, node("x")), &meta(&[64, 100], "bfloat16"));
            "g"
        } else {
            "x"
        };
        let doc = g
            .call(
                "gt",
                "aten.permute.default",
                &format!(r#"{},{{"list":[{{"int":1}},{{"int":0}}]}}"#, node(grad)),
                &t(&[100, 64], &[1, 100]),
            )
            .call("dx", "aten.mm.default", &format!("{},{}", node(grad), node("w")), &meta(&[64, 64], "bfloat16"))
            .call("dw", "aten.mm.default", &format!("{},{}", node("gt"), node("h")), &meta(&[100, 32], "bfloat16"))
            .output(&["dx", "dw"]);
        let module = padded_module(&doc);
        // the gradient's padded copies, row-major or column-major (w's is (104, 64), (64, 1))
        let copies = module
            .lines()
            .filter(|l| l.contains("empty_strided_cpu((64, 104), (104, 1)") || l.contains("empty_strided_cpu((104, 64), (1, 104)"))
            .count();
        assert_eq!(copies, 1, "computed: {computed}\n{module}");
        assert!(!module.contains("empty_strided_cpu((64, 100)"), "no unpadded copy of the gradient:\n{module}");
    }
}

#[test]
fn a_split_variance_reads_its_input_once() {
    // a batch norm's statistics: 64 columns over 4096 rows, split over the rows; each chunk
    // takes its Welford M2 and its sum in one pass, the combine adds them up by Chan's formula
    let doc = GraphBuilder::new()
        .input("x", &[4096, 64], "float32")
        .call("v", "aten.var.correction", &over("x", 0, false), &meta(&[64], "float32"))
        .output(&["v"])
        .replace(r#""device":"cpu""#, r#""device":"cuda:0""#);
    let s = gpu_schedule(&doc);
    assert!(s.decision_texts().iter().any(|d| d.starts_with("split:") && d.contains("Welford M2")), "{:?}", s.decision_texts());
    let src = triton_source(&s);
    // one kernel reads x: the chunks' M2s and the mean's and the variance's chunk sums together
    let over_x: Vec<&str> = src.split("@ferro_jit").filter(|k| k.contains("in_ptr0 + (") && k.contains("for r0offset in range(")).collect();
    assert_eq!(over_x.len(), 1, "{src}");
    assert!(over_x[0].contains("ferro_welford"), "{}", over_x[0]);
}

#[test]
fn a_kernel_whose_result_a_later_step_reads_runs_just_before_that_step() {
    // a backward recomputes a value (x's row sums) at its start for a step at its end: the value
    // is computed just before that step, not held across the two GEMMs in between (x lives until
    // the last GEMM anyway)
    let doc = GraphBuilder::new()
        .input("x", &[256, 256], "float32")
        .input("g", &[256, 256], "float32")
        .input("w", &[256, 256], "float32")
        .call(
            "r",
            "aten.sum.dim_IntList",
            &format!(r#"{},{{"list":[{{"int":1}}]}},{{"bool":true}}"#, node("x")),
            &meta(&[256, 1], "float32"),
        )
        .call("d", "aten.mm.default", &format!("{},{}", node("g"), node("w")), &meta(&[256, 256], "float32"))
        .call("e", "aten.mm.default", &format!("{},{}", node("d"), node("w")), &meta(&[256, 256], "float32"))
        .call("y", "aten.mm.default", &format!("{},{}", node("e"), node("r")), &meta(&[256, 1], "float32"))
        .call("u", "aten.mm.default", &format!("{},{}", node("x"), node("w")), &meta(&[256, 256], "float32"))
        .output(&["y", "u"]);
    let (s, module) = wrapper_module(&doc);
    assert!(
        s.decision_texts()
            .iter()
            .any(|d| d.starts_with("order: ") && d.contains("(a kernel) runs 2 steps later, just before the first step that reads it")),
        "{:?}\n{module}",
        s.decision_texts()
    );
    let widen = module.find("(x.data_ptr()").unwrap_or(0);
    let e = module.find("torch.mm(").unwrap_or(usize::MAX);
    assert!(e < widen, "the GEMMs in between run before the widening kernel:\n{module}");
}

#[test]
fn a_kernel_of_a_returned_gradient_runs_after_the_last_reader_of_its_operands() {
    // (float64: a small float32 GEMM on the CPU is a matrix-product kernel, not a library call)
    // a bias gradient summed from g, returned and read by nothing else, runs after the weight
    // gradient's GEMM that also reads g: its result is not live across the GEMM
    let doc = GraphBuilder::new()
        .input("g", &[64, 100], "float64")
        .input("h", &[64, 32], "float64")
        .call("db", "aten.sum.dim_IntList", &format!(r#"{},{{"list":[{{"int":0}}]}}"#, node("g")), &meta(&[100], "float64"))
        .call(
            "gt",
            "aten.permute.default",
            &format!(r#"{},{{"list":[{{"int":1}},{{"int":0}}]}}"#, node("g")),
            &meta(&[100, 64], "float64").replace("[64,1]", "[1,100]"),
        )
        .call("dw", "aten.mm.default", &format!("{},{}", node("gt"), node("h")), &meta(&[100, 32], "float64"))
        .output(&["db", "dw"]);
    let (s, module) = wrapper_module(&doc);
    assert!(
        s.decision_texts().iter().any(|d| d.starts_with("order: ") && d.contains("(a kernel) runs 1 steps later")),
        "{:?}",
        s.decision_texts()
    );
    let sum = module.find("(g.data_ptr()").unwrap_or(0);
    let dw = module.find("torch.mm(").unwrap_or(usize::MAX);
    assert!(dw < sum, "the weight gradient runs before the bias gradient's kernel:\n{module}");
}

/// A graph of `n` float32 inputs `x{i}` of `size` elements each, the calls `make(i)` adds, and the
/// outputs it names.
fn wide_graph(n: usize, size: i64, calls: impl Fn(GraphBuilder, usize) -> GraphBuilder, outputs: &[String]) -> String {
    let mut g = GraphBuilder::new();
    for i in 0..n {
        g = g.input(&format!("x{i}"), &[size], "float32");
    }
    for i in 0..n {
        g = calls(g, i);
    }
    let names: Vec<&str> = outputs.iter().map(String::as_str).collect();
    g.output(&names)
}

/// Fusion's work on wide graphs grows with the nodes, not with the size of the kernels they join:
/// each join used to plan the whole kernel again (10,000 small outputs side by side in one
/// kernel: 50 million node placements, minutes), and the passes after fusion scanned every later
/// step per step. The time these take is measured by `bench/wide_graphs.py`.
#[test]
fn wide_graphs_schedule_with_work_linear_in_their_width() {
    const N: usize = 10_000;
    let schedule_of = |doc: &str| schedule(lower_graph(&parse_graph(doc).unwrap()).unwrap().program).unwrap();
    // 10,000 small results side by side, each node placed about once, in kernels of at most 512
    // buffers (256 nodes reading one and writing one)
    let outs: Vec<String> = (0..N).map(|i| format!("y{i}")).collect();
    let doc = wide_graph(
        N,
        4,
        |g, i| g.call(&format!("y{i}"), "aten.mul.Tensor", &format!(r#"{},{{"int":2}}"#, node(&format!("x{i}"))), &meta(&[4], "float32")),
        &outs,
    );
    let s = schedule_of(&doc);
    assert_eq!(s.kernel_count(), N.div_ceil(256));
    assert!(s.placements <= 2 * N, "{} placements for {N} nodes", s.placements);
    // 10,000 large results (a kernel each, each may sink past the others: pass `order`)
    let doc = wide_graph(
        N,
        70_000,
        |g, i| {
            g.call(&format!("y{i}"), "aten.mul.Tensor", &format!(r#"{},{{"int":2}}"#, node(&format!("x{i}"))), &meta(&[70_000], "float32"))
        },
        &outs,
    );
    let s = schedule_of(&doc);
    assert_eq!(s.kernel_count(), N);
    assert!(s.placements <= 2 * N, "{} placements for {N} nodes", s.placements);
    // a 10,000-way cat (a copy kernel per piece, each a writer of one buffer: pass `in place`)
    // and its relu, computed by the pieces' kernels (pass `concat`)
    let args: Vec<String> = (0..N).map(|i| node(&format!("x{i}"))).collect();
    let cat = |g: GraphBuilder, i: usize| {
        if i + 1 < N {
            g
        } else {
            g.call("cat", "aten.cat.default", &format!(r#"{{"list":[{}]}}"#, args.join(",")), &meta(&[4 * N as i64], "float32")).call(
                "relu",
                "aten.relu.default",
                &node("cat"),
                &meta(&[4 * N as i64], "float32"),
            )
        }
    };
    let s = schedule_of(&wide_graph(N, 4, cat, &["cat".to_string(), "relu".to_string()]));
    assert_eq!(s.kernel_count(), N + 1);
    let s = schedule_of(&wide_graph(N, 4, cat, &["relu".to_string()]));
    assert_eq!(s.kernel_count(), N);
    assert!(
        s.decision_texts().iter().any(|d| d.starts_with("cat read in place:") && d.contains("computed by the 10000 writers")),
        "{:?}",
        &s.decision_texts()[..4]
    );
    assert!(s.placements <= 2 * N, "{} placements for {N} nodes", s.placements);
}

#[test]
fn each_scheduler_pass_is_a_timed_and_dumped_stage() {
    let doc = GraphBuilder::new()
        .input("x", &[8, 32], "float32")
        .call("s", "aten._softmax.default", &format!(r#"{},{{"int":1}},{{"bool":false}}"#, node("x")), &meta(&[8, 32], "float32"))
        .output(&["s"]);
    let dir = std::env::temp_dir().join(format!("ferrocore-pass-stages-{}", std::process::id()));
    let opts =
        Options { cache_dir: dir.join("cache"), debug_dir: Some(dir.join("debug")), skip_native_compile: true, ..Options::default() };
    let r = compile_graph(&doc, &opts).unwrap();
    let passes: Vec<&str> =
        ferrocore::scheduler::program_passes(&ferrocore::scheduler::ScheduleOptions::CPP).iter().map(|p| p.name).collect();
    assert!(passes.len() >= 4, "{passes:?}");
    // in the order they run, between lowering and fusion
    let stages: Vec<&str> = r.timings_ms.iter().map(|(s, _)| s.as_str()).collect();
    let at = |s: &str| stages.iter().position(|t| *t == s).unwrap_or_else(|| panic!("no stage {s} in {stages:?}"));
    let order: Vec<usize> = std::iter::once("lowering").chain(passes.iter().copied()).chain(["scheduling"]).map(at).collect();
    assert!(order.windows(2).all(|w| w[0] < w[1]), "{stages:?}");
    let dump = std::fs::read_dir(dir.join("debug")).unwrap().next().unwrap().unwrap().path();
    for p in &passes {
        let text = std::fs::read_to_string(dump.join(format!("ir_after_{p}.txt"))).unwrap_or_else(|_| panic!("no dump after {p}"));
        assert!(text.contains("buf"), "{p}: {text}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
