//! Unit tests of the scheduler: each pass of `program_passes` run alone on a lowered graph it
//! changes, and fusion (`fuse`): kernel counts, which nodes share a kernel and the decisions.

use super::*;
use crate::graph::build::{f32, int, ints, meta, node, tuple, GraphBuilder};
use crate::graph::{parse_graph, DType};
use crate::lowering::lower_graph;

fn lowered(doc: &str) -> LoopProgram {
    let program = lower_graph(&parse_graph(doc).unwrap()).unwrap().program;
    program.verify().unwrap();
    program
}

/// Every pass on: complex values as reals, Welford variances past 8 elements, GPU splits.
const ALL_PASSES: ScheduleOptions =
    ScheduleOptions { prefix: "test", split: Some(GPU_SPLIT), complex_as_real: true, welford_min_len: Some(8), row_scratch: None };

/// Runs pass `name` of `ALL_PASSES` alone; returns its decisions. The program must verify after it.
fn run_pass(p: &mut LoopProgram, name: &str) -> Vec<String> {
    let passes = program_passes(&ALL_PASSES);
    let pass = passes.iter().find(|pass| pass.name == name).unwrap_or_else(|| panic!("no pass {name}"));
    let decisions = (pass.run)(p, &ALL_PASSES);
    p.verify().unwrap_or_else(|e| panic!("{name} left an invalid program: {e}\n{p}"));
    decisions
}

/// The loop nodes in program order.
fn nodes(p: &LoopProgram) -> Vec<&LoopNode> {
    p.steps
        .iter()
        .filter_map(|s| match s {
            Step::Node(i) => Some(&p.nodes[*i]),
            Step::Extern(_) => None,
        })
        .collect()
}

fn name(p: &LoopProgram, b: BufferId) -> &str {
    &p.buffer(b).name
}

/// The names of the buffers `node` reads, in body order.
fn reads(p: &LoopProgram, node: &LoopNode) -> Vec<String> {
    node.reads().iter().map(|(b, _)| name(p, *b).to_string()).collect()
}

fn has_expr(node: &LoopNode, pred: impl Fn(&Expr) -> bool) -> bool {
    node.body.exprs.iter().any(pred)
}

/// The buffers each kernel writes, in schedule order; an extern call as its callee.
fn kernel_members(s: &Schedule) -> Vec<Vec<String>> {
    let p = &s.program;
    s.items
        .iter()
        .map(|item| match item {
            Item::Kernel(k) => k.plan.nodes.iter().map(|kn| name(p, p.nodes[kn.node].output).to_string()).collect(),
            Item::Extern(e) => vec![p.externs[*e].callee.clone()],
        })
        .collect()
}

/// The C++ backend's passes, then fusion.
fn schedule_cpp(doc: &str) -> Schedule {
    let s = schedule(lowered(doc)).unwrap();
    s.program.verify().unwrap();
    s
}

#[test]
fn program_passes_run_in_order_and_only_where_the_backend_asks() {
    let names = |opts: &ScheduleOptions| program_passes(opts).iter().map(|pass| pass.name).collect::<Vec<_>>();
    assert_eq!(names(&ScheduleOptions::CPP), ["dead_nodes", "inline_concat", "direct_reads", "simplify_loops", "drop_empty"]);
    assert_eq!(
        names(&ALL_PASSES),
        ["dead_nodes", "complex_as_real", "inline_concat", "direct_reads", "simplify_loops", "welford", "split", "drop_empty"]
    );
}

// ----- dead_nodes -----

#[test]
fn dead_nodes_removes_the_unread_indices_of_a_max_pool() {
    // max_pool2d_with_indices lowers values and indices; only the values are returned
    let doc = GraphBuilder::new()
        .input("x", &[1, 2, 4, 4], "float32")
        .call(
            "mp",
            "aten.max_pool2d_with_indices.default",
            &[node("x"), ints(&[2, 2]), ints(&[2, 2])],
            &tuple(&[f32(&[1, 2, 2, 2]), meta(&[1, 2, 2, 2], "int64")]),
        )
        .call("v", "getitem", &[node("mp"), int(0)], &f32(&[1, 2, 2, 2]))
        .output(&["v"]);
    let mut p = lowered(&doc);
    assert_eq!(nodes(&p).len(), 2);
    let decisions = run_pass(&mut p, "dead_nodes");
    assert_eq!(decisions, ["dead: buf2 is never read; removed"]);
    let kept: Vec<&str> = nodes(&p).iter().map(|node| name(&p, node.output)).collect();
    assert_eq!(kept, ["buf1"]);
}

#[test]
fn dead_nodes_keeps_a_write_into_an_input() {
    let doc = GraphBuilder::new()
        .input("x", &[6], "float32")
        .call("add", "aten.add.Tensor", &[node("x"), int(1)], &f32(&[6]))
        .call("cp", "aten.copy_.default", &[node("x"), node("add")], &f32(&[6]))
        .output(&[]);
    let mut p = lowered(&doc);
    assert_eq!(run_pass(&mut p, "dead_nodes"), Vec::<String>::new());
    assert_eq!(nodes(&p).len(), 1);
}

// ----- complex_as_real -----

#[test]
fn complex_as_real_copies_a_complex_tensor_as_pairs_of_floats() {
    let doc = GraphBuilder::new()
        .input("x", &[2, 3], "complex64")
        .call("c", "aten.clone.default", &[node("x")], &meta(&[2, 3], "complex64"))
        .output(&["c"]);
    let mut p = lowered(&doc);
    let decisions = run_pass(&mut p, "complex_as_real");
    assert_eq!(decisions, ["complex: buf1 moves complex values as pairs of float32"]);
    let node = nodes(&p)[0];
    assert_eq!(node.ranges, [2, 3, 2], "an innermost loop over the two components");
    assert_eq!(node.body.dtypes, [DType::F32]);
    assert_eq!(node.reads()[0].1.to_string(), "6*v0 + 2*v1 + v2");
    assert_eq!(p.buffer(node.output).layout.dtype, DType::C64, "the buffer stays complex for the wrapper");
}

// ----- inline_concat -----

#[test]
fn inline_concat_computes_the_only_reader_of_a_cat_in_its_writers() {
    let doc = GraphBuilder::new()
        .input("x", &[2, 3], "float32")
        .input("y", &[2, 5], "float32")
        .call("c", "aten.cat.default", &[format!(r#"{{"list":[{},{}]}}"#, node("x"), node("y")), int(1)], &f32(&[2, 8]))
        .call("relu", "aten.relu.default", &[node("c")], &f32(&[2, 8]))
        .output(&["relu"]);
    let mut p = lowered(&doc);
    assert_eq!(nodes(&p).len(), 3);
    let decisions = run_pass(&mut p, "inline_concat");
    assert_eq!(decisions, ["cat read in place: buf3 is computed by the 2 writers of buf2 (its only reader); buf2 is not stored"]);
    let ns = nodes(&p);
    assert_eq!(ns.len(), 2);
    for (node, (input, store)) in ns.iter().zip([("x", "8*v0 + v1"), ("y", "8*v0 + v1 + 3")]) {
        assert_eq!(name(&p, node.output), "buf3");
        assert_eq!(reads(&p, node), [input]);
        assert!(has_expr(node, |e| matches!(e, Expr::Unary(UnaryOp::Relu, _))));
        assert_eq!(node.body.store.as_ref().unwrap().index.to_string(), store);
        assert_eq!(node.origins, ["c", "relu"]);
    }
}

// ----- simplify_loops -----

#[test]
fn simplify_loops_merges_contiguous_dims_and_drops_size_one_dims() {
    let doc = GraphBuilder::new()
        .input("x", &[1, 3, 1, 4], "float32")
        .call("neg", "aten.neg.default", &[node("x")], &f32(&[1, 3, 1, 4]))
        .output(&["neg"]);
    let mut p = lowered(&doc);
    assert_eq!(nodes(&p)[0].ranges, [1, 1, 3, 4]);
    assert!(run_pass(&mut p, "simplify_loops").is_empty());
    let node = nodes(&p)[0];
    assert_eq!(node.ranges, [12]);
    assert_eq!(node.reads()[0].1.to_string(), "v0");
    assert_eq!(node.body.store.as_ref().unwrap().index.to_string(), "v0");
}

#[test]
fn simplify_loops_keeps_dims_a_transposed_read_walks_apart() {
    // out[i, j] = x[j, i]: neither dim is contiguous for both the load and the store
    let doc = GraphBuilder::new()
        .input("x", &[4, 6], "float32")
        .call(
            "t",
            "aten.t.default",
            &[node("x")],
            r#"{"tensor":{"shape":[6,4],"stride":[1,6],"storage_offset":0,"dtype":"float32","device":"cpu"}}"#,
        )
        .call("c", "aten.clone.default", &[node("t")], &f32(&[6, 4]))
        .output(&["c"]);
    let mut p = lowered(&doc);
    run_pass(&mut p, "simplify_loops");
    let node = nodes(&p)[0];
    assert_eq!(node.ranges, [6, 4]);
    assert_eq!(node.reads()[0].1.to_string(), "v0 + 6*v1");
}

// ----- welford -----

fn variance_only_graph() -> String {
    GraphBuilder::new()
        .input("x", &[4, 64], "float32")
        .call_kw("vm", "aten.var_mean.correction", &[node("x"), ints(&[1])], r#""correction":{"int":1}"#, &tuple(&[f32(&[4]), f32(&[4])]))
        .call("v", "getitem", &[node("vm"), int(0)], &f32(&[4]))
        .output(&["v"])
}

#[test]
fn welford_takes_a_variance_in_one_pass_that_no_longer_reads_the_mean() {
    let mut p = lowered(&variance_only_graph());
    let var = nodes(&p)[1];
    assert_eq!(reads(&p, var), ["x", "buf1"]);
    let decisions = run_pass(&mut p, "welford");
    assert_eq!(decisions, ["welford: buf2 takes its variance in one pass over 64 elements (no longer reads buf1)"]);
    let var = nodes(&p)[1];
    assert_eq!(reads(&p, var), ["x", "x"], "the row and its first element (the shift)");
    assert_eq!(var.reads()[1].1.to_string(), "64*v0");
    assert!(has_expr(var, |e| matches!(e, Expr::Reduce(ReduceOp::WelfordM2, _))));
    assert!(has_expr(var, |e| *e == Expr::Constant(Scalar::Float(63.0))), "Bessel's correction is kept");
    // the mean is now dead, but dead_nodes ran before welford (see the schedule test below)
    assert_eq!(run_pass(&mut p, "dead_nodes"), ["dead: buf1 is never read; removed"]);
}

#[test]
fn a_mean_that_welford_leaves_unread_is_still_computed_by_the_schedule() {
    // pins today's order of passes: dead_nodes before welford keeps the dead mean (in registers)
    let s = schedule_for(lowered(&variance_only_graph()), &ALL_PASSES).unwrap();
    assert_eq!(kernel_members(&s), [["buf1", "buf2"]]);
    assert_eq!(s.storage[1], Storage::Local);
}

#[test]
fn welford_leaves_short_rows_as_two_passes() {
    let doc = GraphBuilder::new()
        .input("x", &[4, 8], "float32")
        .call_kw("vm", "aten.var_mean.correction", &[node("x"), ints(&[1])], r#""correction":{"int":1}"#, &tuple(&[f32(&[4]), f32(&[4])]))
        .call("v", "getitem", &[node("vm"), int(0)], &f32(&[4]))
        .output(&["v"]);
    let mut p = lowered(&doc);
    assert!(run_pass(&mut p, "welford").is_empty(), "8 elements are not more than welford_min_len");
}

// ----- split -----

#[test]
fn split_reduces_a_long_narrow_sum_in_two_stages() {
    let doc = GraphBuilder::new()
        .input("x", &[2, 65536], "float32")
        .call("s", "aten.sum.dim_IntList", &[node("x"), ints(&[1])], &f32(&[2]))
        .output(&["s"]);
    let mut p = lowered(&doc);
    let decisions = run_pass(&mut p, "split");
    assert_eq!(decisions, ["split: buf1 reduces 65536 elements into 2 rows: 32 partial reductions each (buf2), then a combine"]);
    let ns = nodes(&p);
    assert_eq!(ns.len(), 2);
    let (first, second) = (ns[0], ns[1]);
    assert_eq!(
        (name(&p, first.output), first.ranges.as_slice(), first.reduction_ranges.as_slice()),
        ("buf2", [2, 32].as_slice(), [2048].as_slice())
    );
    assert_eq!(first.reads()[0].1.to_string(), "65536*v0 + 2048*v1 + v2");
    assert_eq!(p.buffer(first.output).layout.dtype, DType::F64, "float32 partials accumulate in float64");
    assert_eq!(
        (name(&p, second.output), second.ranges.as_slice(), second.reduction_ranges.as_slice()),
        ("buf1", [2].as_slice(), [32].as_slice())
    );
    assert_eq!(reads(&p, second), ["buf2"]);
    assert_eq!(p.outputs, [OutputValue::Buffer(second.output)], "the graph still returns the original buffer");
}

#[test]
fn split_leaves_reductions_with_enough_rows_whole() {
    let doc = GraphBuilder::new()
        .input("x", &[512, 8192], "float32")
        .call("s", "aten.sum.dim_IntList", &[node("x"), ints(&[1])], &f32(&[512]))
        .output(&["s"]);
    let mut p = lowered(&doc);
    assert!(run_pass(&mut p, "split").is_empty());
    assert_eq!(nodes(&p).len(), 1);
}

#[test]
fn split_counts_the_programs_of_looped_rows() {
    // 256 rows of 32768 run as 64 looped programs of four rows: split into 1024 chunks; 1024
    // such rows (256 programs) stay whole
    let doc = GraphBuilder::new()
        .input("x", &[256, 32768], "bfloat16")
        .call("s", "aten.sum.dim_IntList", &[node("x"), ints(&[1])], &meta(&[256], "bfloat16"))
        .output(&["s"]);
    let mut p = lowered(&doc);
    let decisions = run_pass(&mut p, "split");
    assert_eq!(decisions, ["split: buf1 reduces 32768 elements into 256 rows: 4 partial reductions each (buf3), then a combine"]);
    let doc = GraphBuilder::new()
        .input("x", &[1024, 32768], "bfloat16")
        .call("s", "aten.sum.dim_IntList", &[node("x"), ints(&[1])], &meta(&[1024], "bfloat16"))
        .output(&["s"]);
    let mut p = lowered(&doc);
    assert!(run_pass(&mut p, "split").is_empty());
}

// ----- drop_empty -----

#[test]
fn drop_empty_removes_nodes_without_elements_but_keeps_their_buffers() {
    let doc =
        GraphBuilder::new().input("x", &[0, 4], "float32").call("neg", "aten.neg.default", &[node("x")], &f32(&[0, 4])).output(&["neg"]);
    let mut p = lowered(&doc);
    assert_eq!(nodes(&p).len(), 1);
    run_pass(&mut p, "drop_empty");
    assert!(p.steps.is_empty());
    let OutputValue::Buffer(out) = p.outputs[0] else { panic!("{p}") };
    assert_eq!(p.buffer(out).layout.size, [0, 4], "the wrapper still allocates the empty result");
    let s = fuse(p, &ScheduleOptions::CPP, Vec::new()).unwrap();
    assert_eq!(s.kernel_count(), 0);
}

// ----- fuse -----

#[test]
fn fuse_puts_two_reductions_of_one_pointwise_value_in_one_kernel() {
    // exp(x + y) stays inline in both reductions, which share their reads of x and y
    let doc = GraphBuilder::new()
        .input("x", &[8, 32], "float32")
        .input("y", &[8, 32], "float32")
        .call("add", "aten.add.Tensor", &[node("x"), node("y")], &f32(&[8, 32]))
        .call("e", "aten.exp.default", &[node("add")], &f32(&[8, 32]))
        .call("s", "aten.sum.dim_IntList", &[node("e"), ints(&[1])], &f32(&[8]))
        .call("m", "aten.amax.default", &[node("e"), ints(&[1])], &f32(&[8]))
        .output(&["s", "m"]);
    let s = schedule_cpp(&doc);
    assert_eq!(s.kernel_count(), 1, "{}", s.text());
    assert_eq!(kernel_members(&s), [["buf2", "buf3"]]);
    let Item::Kernel(k) = &s.items[0] else { panic!() };
    assert_eq!(k.name, "cpp_red_fused_add_e_s_m_0");
    assert_eq!(k.plan.outer, 8);
    assert!(k.plan.groups.iter().all(|g| g.reduction), "{}", s.text());
    assert_eq!(
        s.decision_texts(),
        [
            "new kernel cpp_red_fused_add_e_s_m_0: buf2 (shares no data with an earlier kernel)",
            "fuse: buf3 into kernel cpp_red_fused_add_e_s_m_0 with buf2 (shares 2048 bytes)"
        ]
    );
}

#[test]
fn fuse_keeps_large_unrelated_nodes_in_kernels_of_their_own() {
    let doc = GraphBuilder::new()
        .input("x", &[512, 512], "float32")
        .input("y", &[512, 512], "float32")
        .call("a", "aten.neg.default", &[node("x")], &f32(&[512, 512]))
        .call("b", "aten.neg.default", &[node("y")], &f32(&[512, 512]))
        .output(&["a", "b"]);
    let s = schedule_cpp(&doc);
    assert_eq!(kernel_members(&s), [["buf2"], ["buf3"]]);
    assert_eq!(
        s.decision_texts(),
        [
            "new kernel cpp_poi_fused_a_0: buf2 (shares no data with an earlier kernel)",
            "new kernel cpp_poi_fused_b_1: buf3 (shares no data with an earlier kernel)"
        ]
    );
}

#[test]
fn fuse_puts_small_unrelated_nodes_side_by_side_in_one_launch() {
    let doc = GraphBuilder::new()
        .input("x", &[8, 8], "float32")
        .input("y", &[8, 8], "float32")
        .call("a", "aten.neg.default", &[node("x")], &f32(&[8, 8]))
        .call("b", "aten.neg.default", &[node("y")], &f32(&[8, 8]))
        .output(&["a", "b"]);
    let s = schedule_cpp(&doc);
    assert_eq!(kernel_members(&s), [["buf2", "buf3"]]);
    assert_eq!(s.decision_texts()[1], "fuse: buf3 into kernel cpp_poi_fused_a_b_0 with buf2 (small kernels side by side: one launch)");
}

#[test]
fn fuse_does_not_fuse_across_a_library_call() {
    // (float64: a small float32 GEMM on the CPU is a matrix-product kernel)
    let f64 = |shape: &[i64]| meta(shape, "float64");
    let doc = GraphBuilder::new()
        .input("a", &[16, 16], "float64")
        .input("b", &[16, 16], "float64")
        .call("r", "aten.relu.default", &[node("a")], &f64(&[16, 16]))
        .call("mm", "aten.mm.default", &[node("r"), node("b")], &f64(&[16, 16]))
        .call("e", "aten.exp.default", &[node("mm")], &f64(&[16, 16]))
        .output(&["e"]);
    let s = schedule_cpp(&doc);
    assert_eq!(kernel_members(&s), [vec!["buf2"], vec!["torch.ops.aten.mm.default"], vec!["buf3"]]);
    // the exp (buf4) writes into the GEMM's result, which nothing reads after it
    assert_eq!(
        s.decision_texts().last().map(String::as_str),
        Some("in place: buf4 is written into buf3 (its last reader, element for element)")
    );
}

#[test]
fn fuse_takes_only_pointwise_readers_into_a_matrix_product() {
    // a GEMM as a contraction node (Triton's template): the relu and residual add over its
    // result join its kernel, the relu before it is computed in it (its prologue, in the
    // product's body: no buffer of its own); a row sum over its result does not join it
    let template = |outputs: &[&str]| {
        let doc = GraphBuilder::new()
            .input("a", &[16, 24], "float32")
            .input("b", &[24, 32], "float32")
            .input("r", &[16, 32], "float32")
            .call("pre", "aten.relu.default", &[node("a")], &f32(&[16, 24]))
            .call("mm", "aten.mm.default", &[node("pre"), node("b")], &f32(&[16, 32]))
            .call("e", "aten.relu.default", &[node("mm")], &f32(&[16, 32]))
            .call("add", "aten.add.Tensor", &[node("e"), node("r")], &f32(&[16, 32]))
            .call("s", "aten.sum.dim_IntList", &[node("mm"), ints(&[1])], &f32(&[16]))
            .call("u", "aten.unsqueeze.default", &[node("mm"), int(2)], &f32(&[16, 32, 1]))
            .call("wide", "aten.expand.default", &[node("u"), ints(&[16, 32, 4])], &f32(&[16, 32, 4]))
            .call("w2", "aten.mul.Tensor", &[node("wide"), node("wide")], &f32(&[16, 32, 4]))
            .output(outputs);
        let options = crate::lowering::LowerOptions {
            kernels: crate::codegen::KernelLanguage::Triton,
            gemm_template: crate::lowering::GemmTemplate::Always,
            ..Default::default()
        };
        let program = crate::lowering::lower_graph_with(&parse_graph(&doc).unwrap(), &options).unwrap().program;
        assert_eq!(program.nodes.iter().filter(|n| n.is_matrix_product()).count(), 1);
        fuse(program, &ScheduleOptions::CPP, Vec::new()).unwrap()
    };
    let s = template(&["add"]);
    assert_eq!(kernel_members(&s), [vec!["buf3", "buf4"]], "{:#?}", s.decision_texts());
    let texts = s.decision_texts();
    assert!(texts.iter().any(|t| t.contains("buf3 (a matrix product heads its own kernel")), "{texts:#?}");
    assert_eq!(s.storage[3], Storage::Local, "the product lives in registers only");
    let product = s.program.nodes.iter().find(|n| n.is_matrix_product()).unwrap();
    assert!(product.body.exprs.iter().any(|e| matches!(e, Expr::Unary(UnaryOp::Relu, _))), "the prologue is in the product's body");
    let s = template(&["s"]);
    assert_eq!(kernel_members(&s), [vec!["buf3"], vec!["buf4"]], "{:#?}", s.decision_texts());
    let texts = s.decision_texts();
    assert!(
        texts.iter().any(|t| t.contains("no fusion: buf4 into kernel cpp_mm_fused_pre_mm_0: reduction buf4 has 16 outputs")),
        "{texts:#?}"
    );
    // a pointwise node looping over more than the product's outputs
    let s = template(&["w2"]);
    assert_eq!(kernel_members(&s), [vec!["buf3"], vec!["buf4"]], "{:#?}", s.decision_texts());
    let texts = s.decision_texts();
    let why = "no fusion: buf4 into kernel cpp_mm_fused_pre_mm_0: only pointwise nodes over a matrix product's outputs join its kernel; buf4 loops over [4]";
    assert!(texts.iter().any(|t| t == why), "{texts:#?}");
}

#[test]
fn fuse_gives_a_scatter_a_kernel_of_its_own() {
    let doc = GraphBuilder::new()
        .input("x", &[10, 4], "float32")
        .input("idx", &[6, 4], "int64")
        .input("src", &[6, 4], "float32")
        .call("s", "aten.scatter_add.default", &[node("x"), int(0), node("idx"), node("src")], &f32(&[10, 4]))
        .call("r", "aten.relu.default", &[node("s")], &f32(&[10, 4]))
        .output(&["r"]);
    let s = schedule_cpp(&doc);
    // the copy, the scatter into it, and the relu, written in place into the dying buf3
    assert_eq!(kernel_members(&s), [["buf3"], ["buf3"], ["buf3"]]);
    assert!(
        s.decision_texts().contains(&"scatter: buf3 updates its buffer at computed indices; a kernel of its own".to_string()),
        "{:#?}",
        s.decision_texts()
    );
}

#[test]
fn fuse_keeps_the_two_stages_of_a_split_reduction_apart() {
    let doc = GraphBuilder::new()
        .input("x", &[2, 65536], "float32")
        .call("s", "aten.sum.dim_IntList", &[node("x"), ints(&[1])], &f32(&[2]))
        .output(&["s"]);
    let s = schedule_for(lowered(&doc), &ALL_PASSES).unwrap();
    assert_eq!(kernel_members(&s), [["buf2"], ["buf1"]]);
    assert!(
        s.decision_texts().contains(
            &"no fusion: buf1 into kernel test_red_fused_s_0: reduction buf1 has 2 outputs, the kernel's outer size is 64".to_string()
        ),
        "{:#?}",
        s.decision_texts()
    );
}
