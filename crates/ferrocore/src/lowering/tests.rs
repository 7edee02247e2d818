//! Unit tests of the lowering, one group per op family (the files of this module): each builds a
//! tiny exchange-format graph, lowers it, verifies the loop program and checks what it became.

use super::*;
use crate::graph::build::{boolean, f32, float, int, ints, meta, node, strided_meta, tuple, GraphBuilder};
use crate::graph::parse_graph;
use crate::loop_ir::NodeKind;

fn lower_with(doc: &str, options: &LowerOptions) -> LoweringResult {
    let graph = parse_graph(doc).unwrap();
    let lowered = lower_graph_with(&graph, options).unwrap();
    lowered.program.verify().unwrap();
    lowered
}

fn lower(doc: &str) -> LoopProgram {
    let lowered = lower_with(doc, &LowerOptions::default());
    assert!(lowered.fallbacks.is_empty(), "unexpected fallbacks: {:?}", lowered.fallbacks);
    lowered.program
}

fn lower_error(doc: &str) -> LowerError {
    let graph = parse_graph(doc).unwrap();
    match lower_graph(&graph) {
        Ok(l) => panic!("lowered a malformed graph:\n{}", l.program),
        Err(e) => e,
    }
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

fn kinds(p: &LoopProgram) -> Vec<NodeKind> {
    nodes(p).iter().map(|n| n.kind()).collect()
}

/// The library calls in program order.
fn externs(p: &LoopProgram) -> Vec<&ExternCall> {
    p.steps
        .iter()
        .filter_map(|s| match s {
            Step::Extern(i) => Some(&p.externs[*i]),
            Step::Node(_) => None,
        })
        .collect()
}

fn output_layout(p: &LoopProgram, i: usize) -> &Layout {
    match &p.outputs[i] {
        OutputValue::Buffer(b) => &p.buffer(*b).layout,
        other => panic!("output {i} is not a buffer: {other:?}"),
    }
}

fn has_expr(node: &LoopNode, pred: impl Fn(&Expr) -> bool) -> bool {
    node.body.exprs.iter().any(pred)
}

/// The text of every load index of `node`, in body order.
fn load_indices(p: &LoopProgram, node: &LoopNode) -> Vec<String> {
    node.body
        .exprs
        .iter()
        .filter_map(|e| match e {
            Expr::Load { buf, index } | Expr::LoadIndirect { buf, index, .. } => Some(format!("{}[{index}]", p.buffer(*buf).name)),
            _ => None,
        })
        .collect()
}

// ----- pointwise -----

#[test]
fn pointwise_chain_is_one_node_reading_the_broadcast_operand_along_its_last_dim() {
    let doc = GraphBuilder::new()
        .input("x", &[4, 8], "float32")
        .input("y", &[8], "float32")
        .call("add", "aten.add.Tensor", &[node("x"), node("y")], &f32(&[4, 8]))
        .call("relu", "aten.relu.default", &[node("add")], &f32(&[4, 8]))
        .output(&["relu"]);
    let p = lower(&doc);
    assert_eq!(
        p.to_string(),
        "inputs: x: float32[4, 8]/[8, 1], y: float32[8]/[1]
  buf2: Pointwise ranges=[4, 8] -> float32[4, 8]/[8, 1]  # add, relu
    t0: float32 = load(x, 8*v0 + v1)
    t1: float32 = load(y, v1)
    t2: float32 = add(t0, t1)
    t3: float32 = relu(t2)
    store(buf2, 8*v0 + v1, t3)
return (buf2)
"
    );
}

#[test]
fn integer_tensor_times_float_scalar_casts_before_multiplying() {
    let doc =
        GraphBuilder::new().input("i", &[6], "int64").call("mul", "aten.mul.Tensor", &[node("i"), float(0.5)], &f32(&[6])).output(&["mul"]);
    let p = lower(&doc);
    let body = &nodes(&p)[0].body;
    assert_eq!(body.dtypes, [DType::I64, DType::F32, DType::F32, DType::F32]);
    assert!(matches!(body.exprs[2], Expr::Cast(ValueId(0))), "{p}");
    assert!(matches!(body.exprs[3], Expr::Binary(BinaryOp::Mul, ValueId(2), ValueId(1))), "{p}");
    assert_eq!(output_layout(&p, 0).dtype, DType::F32);
}

#[test]
fn a_comparison_read_by_where_stays_inline_as_a_bool() {
    let doc = GraphBuilder::new()
        .input("x", &[5], "float32")
        .input("y", &[5], "float32")
        .call("gt", "aten.gt.Tensor", &[node("x"), node("y")], &meta(&[5], "bool"))
        .call("w", "aten.where.self", &[node("gt"), node("x"), node("y")], &f32(&[5]))
        .output(&["w"]);
    let p = lower(&doc);
    assert_eq!(kinds(&p), [NodeKind::Pointwise], "the comparison is not stored:\n{p}");
    let node = nodes(&p)[0];
    assert_eq!(node.origins, ["gt", "w"]);
    assert_eq!(node.body.exprs[2], Expr::Binary(BinaryOp::Gt, ValueId(0), ValueId(1)));
    assert_eq!(node.body.dtypes[2], DType::Bool);
    assert_eq!(node.body.exprs[3], Expr::Where(ValueId(2), ValueId(0), ValueId(1)));
}

// ----- reduction -----

#[test]
fn sum_over_the_last_dim_is_one_reduction_node() {
    let doc = GraphBuilder::new()
        .input("x", &[8, 32], "float32")
        .call("s", "aten.sum.dim_IntList", &[node("x"), ints(&[-1])], &f32(&[8]))
        .output(&["s"]);
    let p = lower(&doc);
    assert_eq!(
        p.to_string(),
        "inputs: x: float32[8, 32]/[32, 1]
  buf1: Reduction ranges=[8] reduce=[32] -> float32[8]/[1]  # s
    t0: float32 = load(x, 32*v0 + v1)
    t1: float32 = reduce_sum(t0)
    store(buf1, v0, t1)
return (buf1)
"
    );
}

#[test]
fn softmax_is_max_exp_sum_and_a_scaling_epilogue() {
    let doc = GraphBuilder::new()
        .input("x", &[4, 16], "float32")
        .call("sm", "aten._softmax.default", &[node("x"), int(-1), boolean(false)], &f32(&[4, 16]))
        .output(&["sm"]);
    let p = lower(&doc);
    assert_eq!(kinds(&p), [NodeKind::Reduction, NodeKind::Pointwise, NodeKind::Reduction, NodeKind::Pointwise], "{p}");
    let ns = nodes(&p);
    assert!(has_expr(ns[0], |e| matches!(e, Expr::Reduce(ReduceOp::Max, _))), "{p}");
    assert!(has_expr(ns[1], |e| matches!(e, Expr::Unary(UnaryOp::Exp, _))), "{p}");
    assert!(has_expr(ns[2], |e| matches!(e, Expr::Reduce(ReduceOp::Sum, _))), "{p}");
    assert_eq!(ns[0].ranges, [4]);
    assert_eq!(ns[0].reduction_ranges, [16]);
    // the sum reads the stored exponentials, the epilogue the sum and the exponentials
    assert_eq!(load_indices(&p, ns[2]), ["buf2[16*v0 + v1]"]);
    assert_eq!(load_indices(&p, ns[3]), ["buf3[v0]", "buf2[16*v0 + v1]"]);
}

#[test]
fn var_mean_is_a_mean_then_a_variance_reading_it() {
    let doc = GraphBuilder::new()
        .input("x", &[4, 16], "float32")
        .call_kw("vm", "aten.var_mean.correction", &[node("x"), ints(&[1])], r#""correction":{"int":0}"#, &tuple(&[f32(&[4]), f32(&[4])]))
        .call("v", "getitem", &[node("vm"), int(0)], &f32(&[4]))
        .call("m", "getitem", &[node("vm"), int(1)], &f32(&[4]))
        .output(&["v", "m"]);
    let p = lower(&doc);
    assert_eq!(kinds(&p), [NodeKind::Reduction, NodeKind::Reduction]);
    let (mean, var) = (nodes(&p)[0], nodes(&p)[1]);
    assert_eq!(load_indices(&p, var), ["x[16*v0 + v1]", "buf1[v0]"]);
    // correction 0: both divide by 16
    for node in [mean, var] {
        assert!(has_expr(node, |e| *e == Expr::Constant(Scalar::Float(0.0625))), "{p}");
    }
    assert_eq!(p.outputs, [OutputValue::Buffer(var.output), OutputValue::Buffer(mean.output)]);
}

#[test]
fn argmax_is_an_int64_reduction_over_the_reduction_index() {
    let doc = GraphBuilder::new()
        .input("x", &[4, 16], "float32")
        .call("am", "aten.argmax.default", &[node("x"), int(1)], &meta(&[4], "int64"))
        .output(&["am"]);
    let p = lower(&doc);
    let node = nodes(&p)[0];
    assert_eq!(node.kind(), NodeKind::Reduction);
    assert_eq!(node.body.exprs[1], Expr::Index(IndexExpr::var(Var(1))));
    assert_eq!(node.body.exprs[2], Expr::ArgReduce(ReduceOp::ArgMax, ValueId(0), ValueId(1)));
    assert_eq!(output_layout(&p, 0).dtype, DType::I64);
}

#[test]
fn cumsum_is_a_scan_storing_every_step() {
    let doc = GraphBuilder::new()
        .input("x", &[3, 10], "float32")
        .call("c", "aten.cumsum.default", &[node("x"), int(1)], &f32(&[3, 10]))
        .output(&["c"]);
    let p = lower(&doc);
    let node = nodes(&p)[0];
    assert_eq!(node.kind(), NodeKind::Scan);
    assert_eq!((node.ranges.as_slice(), node.reduction_ranges.as_slice()), ([3].as_slice(), [10].as_slice()));
    assert_eq!(node.body.store.as_ref().map(|s| s.index.to_string()), Some("10*v0 + v1".into()));
}

// ----- views -----

#[test]
fn a_returned_transpose_of_an_input_is_a_view_without_a_node() {
    let doc = GraphBuilder::new()
        .input("x", &[4, 6], "float32")
        .call("t", "aten.t.default", &[node("x")], &strided_meta(&[6, 4], Some(&[1, 6]), "float32"))
        .output(&["t"]);
    let p = lower(&doc);
    assert!(p.steps.is_empty(), "{p}");
    assert_eq!(p.outputs, [OutputValue::View { buf: p.inputs[0], size: vec![6, 4], stride: vec![1, 6], offset: 0 }]);
}

#[test]
fn permute_then_clone_reads_the_base_at_permuted_strides() {
    let doc = GraphBuilder::new()
        .input("x", &[2, 3, 4], "float32")
        .call("p", "aten.permute.default", &[node("x"), ints(&[2, 0, 1])], &strided_meta(&[4, 2, 3], Some(&[1, 12, 4]), "float32"))
        .call("c", "aten.clone.default", &[node("p")], &f32(&[4, 2, 3]))
        .output(&["c"]);
    let p = lower(&doc);
    let node = nodes(&p)[0];
    assert_eq!(load_indices(&p, node), ["x[v0 + 12*v1 + 4*v2]"]);
    assert_eq!(output_layout(&p, 0).stride, [6, 3, 1]);
}

#[test]
fn slice_unsqueeze_and_expand_fold_into_one_affine_load() {
    // x[2:8:2] broadcast over a new leading dim of 2
    let doc = GraphBuilder::new()
        .input("x", &[8, 5], "float32")
        .call("s", "aten.slice.Tensor", &[node("x"), int(0), int(2), int(8), int(2)], &strided_meta(&[3, 5], Some(&[10, 1]), "float32"))
        .call("u", "aten.unsqueeze.default", &[node("s"), int(0)], &strided_meta(&[1, 3, 5], Some(&[15, 10, 1]), "float32"))
        .call("e", "aten.expand.default", &[node("u"), ints(&[2, 3, 5])], &strided_meta(&[2, 3, 5], Some(&[0, 10, 1]), "float32"))
        .call("neg", "aten.neg.default", &[node("e")], &f32(&[2, 3, 5]))
        .output(&["neg"]);
    let p = lower(&doc);
    let node = nodes(&p)[0];
    assert_eq!(node.ranges, [2, 3, 5]);
    assert_eq!(load_indices(&p, node), ["x[10*v1 + v2 + 10]"]);
}

// ----- indexing -----

#[test]
fn embedding_is_a_checked_indirect_load() {
    let doc = GraphBuilder::new()
        .input("w", &[10, 4], "float32")
        .input("ids", &[3], "int64")
        .call("e", "aten.embedding.default", &[node("w"), node("ids")], &f32(&[3, 4]))
        .output(&["e"]);
    let p = lower(&doc);
    assert_eq!(
        p.to_string(),
        "inputs: w: float32[10, 4]/[4, 1], ids: int64[3]/[1]
  buf2: Pointwise ranges=[3, 4] -> float32[3, 4]/[4, 1]  # e
    t0: int64 = load(ids, v0)
    t1: int64 = check_index(t0, 10)
    t2: float32 = load(w, v1 + 4*t1)
    store(buf2, 4*v0 + v1, t2)
return (buf2)
"
    );
}

#[test]
fn constant_pad_clamps_its_read_and_masks_the_border() {
    let doc = GraphBuilder::new()
        .input("x", &[3, 4], "float32")
        .call("pad", "aten.constant_pad_nd.default", &[node("x"), ints(&[1, 2]), float(0.0)], &f32(&[3, 7]))
        .output(&["pad"]);
    let p = lower(&doc);
    let node = nodes(&p)[0];
    assert_eq!(node.ranges, [3, 7]);
    assert_eq!(node.body.exprs[0], Expr::Index(IndexExpr::var(Var(1)).add_const(-1)), "the column shifted by the left pad");
    assert_eq!(load_indices(&p, node), ["x[4*v0]"], "the column is a clamped term:\n{p}");
    assert!(has_expr(node, |e| matches!(e, Expr::Where(..))), "{p}");
}

// ----- scatter -----

#[test]
fn scatter_add_copies_then_combines_into_the_same_buffer() {
    let doc = GraphBuilder::new()
        .input("x", &[10, 4], "float32")
        .input("idx", &[6, 4], "int64")
        .input("src", &[6, 4], "float32")
        .call("s", "aten.scatter_add.default", &[node("x"), int(0), node("idx"), node("src")], &f32(&[10, 4]))
        .output(&["s"]);
    let p = lower(&doc);
    let ns = nodes(&p);
    assert_eq!(ns.len(), 2);
    assert_eq!(ns[0].output, ns[1].output, "the scatter updates the copy");
    assert!(!ns[0].is_scatter() && ns[1].is_scatter());
    assert_eq!(ns[0].ranges, [10, 4]);
    assert_eq!(ns[1].ranges, [6, 4]);
    let store = ns[1].body.store.as_ref().unwrap();
    assert_eq!(store.mode, StoreMode::Combine(ReduceOp::Sum));
    assert_eq!(store.index, IndexExpr::var(Var(1)));
    assert_eq!(store.terms.len(), 1);
    assert_eq!(store.terms[0].1, 4, "the row index scales by the row stride");
    assert_eq!(ns[1].body.expr(store.terms[0].0), &Expr::CheckIndex { value: ValueId(0), size: 10, wrap: false });
}

#[test]
fn index_put_with_accumulate_is_a_summing_scatter_wrapping_negative_indices() {
    let doc = GraphBuilder::new()
        .input("x", &[8], "float32")
        .input("idx", &[3], "int64")
        .input("v", &[3], "float32")
        .call(
            "ip",
            "aten.index_put.default",
            &[node("x"), format!(r#"{{"list":[{}]}}"#, node("idx")), node("v"), boolean(true)],
            &f32(&[8]),
        )
        .output(&["ip"]);
    let p = lower(&doc);
    let ns = nodes(&p);
    assert_eq!(ns.len(), 2);
    let store = ns[1].body.store.as_ref().unwrap();
    assert_eq!(store.mode, StoreMode::Combine(ReduceOp::Sum));
    assert_eq!(ns[1].body.expr(store.terms[0].0), &Expr::CheckIndex { value: ValueId(0), size: 8, wrap: true });
}

// ----- pooling -----

#[test]
fn small_max_pool_is_unrolled_pointwise_with_its_indices() {
    let doc = GraphBuilder::new()
        .input("x", &[1, 2, 4, 4], "float32")
        .call(
            "mp",
            "aten.max_pool2d_with_indices.default",
            &[node("x"), ints(&[2, 2]), ints(&[2, 2])],
            &tuple(&[f32(&[1, 2, 2, 2]), meta(&[1, 2, 2, 2], "int64")]),
        )
        .call("v", "getitem", &[node("mp"), int(0)], &f32(&[1, 2, 2, 2]))
        .call("i", "getitem", &[node("mp"), int(1)], &meta(&[1, 2, 2, 2], "int64"))
        .output(&["v", "i"]);
    let p = lower(&doc);
    assert_eq!(kinds(&p), [NodeKind::Pointwise, NodeKind::Pointwise], "a 2x2 window is unrolled:\n{p}");
    for node in nodes(&p) {
        assert_eq!(node.ranges, [1, 2, 2, 2]);
        let taps = load_indices(&p, node);
        assert_eq!(taps.len(), 4, "one load per tap:\n{p}");
        assert!(taps.iter().all(|t| t.starts_with("x[32*v0 + 16*v1")), "{taps:?}");
    }
    assert_eq!(output_layout(&p, 0).dtype, DType::F32);
    assert_eq!(output_layout(&p, 1).dtype, DType::I64);
}

#[test]
fn large_avg_pool_window_is_a_reduction_over_the_window() {
    let doc = GraphBuilder::new()
        .input("x", &[1, 1, 12, 12], "float32")
        .call("ap", "aten.avg_pool2d.default", &[node("x"), ints(&[6, 6]), ints(&[6, 6])], &f32(&[1, 1, 2, 2]))
        .output(&["ap"]);
    let p = lower(&doc);
    let node = nodes(&p)[0];
    assert_eq!(node.kind(), NodeKind::Reduction);
    assert_eq!(node.ranges, [1, 1, 2, 2]);
    assert_eq!(node.reduction_ranges, [6, 6], "36 taps are past the unrolling limit");
    assert!(has_expr(node, |e| matches!(e, Expr::Reduce(ReduceOp::Sum, _))));
    assert!(has_expr(node, |e| matches!(e, Expr::Binary(BinaryOp::TrueDiv, ..))), "divided by the window's size:\n{p}");
}

// ----- sampling -----

#[test]
fn bilinear_upsampling_reads_four_clamped_taps() {
    let doc = GraphBuilder::new()
        .input("x", &[1, 1, 2, 2], "float32")
        .call("up", "aten.upsample_bilinear2d.vec", &[node("x"), ints(&[4, 4]), boolean(false), "null".into()], &f32(&[1, 1, 4, 4]))
        .output(&["up"]);
    let p = lower(&doc);
    let node = nodes(&p)[0];
    assert_eq!(node.kind(), NodeKind::Pointwise);
    assert_eq!(node.ranges, [1, 1, 4, 4]);
    let loads = node.body.exprs.iter().filter(|e| matches!(e, Expr::LoadIndirect { .. })).count();
    assert_eq!(loads, 4, "{p}");
    // each tap's row and column are clamped into the 2x2 input
    let clamps = node.body.exprs.iter().filter(|e| matches!(e, Expr::Binary(BinaryOp::Minimum, ..))).count();
    assert!(clamps >= 4, "{p}");
    assert!(!node.checks_indices(), "computed positions need no user-index check");
}

// ----- creation -----

#[test]
fn arange_and_full_read_no_buffer() {
    let doc = GraphBuilder::new()
        .call("a", "aten.arange.start_step", &[int(2), int(12), int(3)], &meta(&[4], "int64"))
        .call_kw("f", "aten.full.default", &[ints(&[4]), float(1.5)], r#""dtype":{"dtype":"float32"}"#, &f32(&[4]))
        .call("add", "aten.add.Tensor", &[node("a"), node("f")], &f32(&[4]))
        .output(&["add"]);
    let p = lower(&doc);
    assert_eq!(
        p.to_string(),
        "inputs: 
  buf0: Pointwise ranges=[4] -> float32[4]/[1]  # a, f, add
    t0: int64 = index_expr(v0)
    t1: int64 = constant(3)
    t2: int64 = constant(2)
    t3: int64 = mul(t0, t1)
    t4: int64 = add(t3, t2)
    t5: float32 = constant(1.5)
    t6: float32 = cast(t4, float32)
    t7: float32 = add(t6, t5)
    store(buf0, v0, t7)
return (buf0)
"
    );
}

// ----- random -----

#[test]
fn rand_draws_its_seed_in_the_wrapper_and_philox_in_the_kernel() {
    let doc =
        GraphBuilder::new().call_kw("r", "aten.rand.default", &[ints(&[16])], r#""dtype":{"dtype":"float32"}"#, &f32(&[16])).output(&["r"]);
    let p = lower(&doc);
    let calls = externs(&p);
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].callee, "torch.randint");
    assert!(!calls[0].fallback);
    assert_eq!(p.buffer(calls[0].outputs[0]).layout.dtype, DType::I64);
    let node = nodes(&p)[0];
    assert_eq!(load_indices(&p, node), [format!("{}[0]", p.buffer(calls[0].outputs[0]).name)], "every element reads the one seed");
    assert!(has_expr(node, |e| matches!(e, Expr::Random { normal: false, .. })), "{p}");
}

// ----- matmul and externs -----

#[test]
fn a_small_float32_gemm_on_the_cpu_is_a_matrix_product_node() {
    // the C++ rule: at most CPU_TEMPLATE_FMAS multiply-adds and CPU_TEMPLATE_K terms; a larger
    // GEMM, a longer sum and a float64 one stay library calls
    let gemm = |m: i64, k: i64, n: i64, dtype: &str| {
        let doc = GraphBuilder::new()
            .input("a", &[m, k], dtype)
            .input("b", &[k, n], dtype)
            .call("mm", "aten.mm.default", &[node("a"), node("b")], &meta(&[m, n], dtype))
            .output(&["mm"]);
        let p = lower(&doc);
        (nodes(&p).iter().any(|n| n.is_matrix_product()), externs(&p).len())
    };
    assert_eq!(gemm(64, 64, 256, "float32"), (true, 0));
    assert_eq!(gemm(128, 128, 128, "float32"), (true, 0), "2^21 multiply-adds: at the bound");
    assert_eq!(gemm(128, 128, 129, "float32"), (false, 1));
    assert_eq!(gemm(1, 8192, 8, "float32"), (false, 1), "a sum of more than 4096 terms");
    assert_eq!(gemm(64, 64, 256, "float64"), (false, 1));
}

#[test]
fn mm_is_a_library_call_and_its_epilogue_a_loop_node() {
    // (float64: a small float32 GEMM on the CPU is a matrix-product node, below)
    let doc = GraphBuilder::new()
        .input("a", &[4, 8], "float64")
        .input("b", &[8, 3], "float64")
        .call("mm", "aten.mm.default", &[node("a"), node("b")], &meta(&[4, 3], "float64"))
        .call("relu", "aten.relu.default", &[node("mm")], &meta(&[4, 3], "float64"))
        .output(&["relu"]);
    let p = lower(&doc);
    assert_eq!(
        p.to_string(),
        "inputs: a: float64[4, 8]/[8, 1], b: float64[8, 3]/[3, 1]
  buf2 = extern torch.ops.aten.mm.default(a, b)  # mm
  buf3: Pointwise ranges=[4, 3] -> float64[4, 3]/[3, 1]  # relu
    t0: float64 = load(buf2, 3*v0 + v1)
    t1: float64 = relu(t0)
    store(buf3, 3*v0 + v1, t1)
return (buf3)
"
    );
    let mm = externs(&p)[0];
    assert_eq!(p.buffer(mm.outputs[0]).source, BufferSource::Extern { call: 0, item: None });
    assert_eq!(p.buffer(mm.outputs[0]).layout.stride, [3, 1]);
}

#[test]
fn sort_is_a_library_call_with_two_outputs() {
    let doc = GraphBuilder::new()
        .input("x", &[4, 8], "float32")
        .call("s", "aten.sort.default", &[node("x"), int(-1)], &tuple(&[f32(&[4, 8]), meta(&[4, 8], "int64")]))
        .call("v", "getitem", &[node("s"), int(0)], &f32(&[4, 8]))
        .call("i", "getitem", &[node("s"), int(1)], &meta(&[4, 8], "int64"))
        .output(&["v", "i"]);
    let p = lower(&doc);
    assert!(nodes(&p).is_empty(), "{p}");
    let sort = externs(&p)[0];
    assert_eq!(sort.callee, "torch.ops.aten.sort.default");
    assert_eq!(sort.outputs.len(), 2);
    let dtypes: Vec<DType> = sort.outputs.iter().map(|b| p.buffer(*b).layout.dtype).collect();
    assert_eq!(dtypes, [DType::F32, DType::I64]);
    assert_eq!(p.outputs, [OutputValue::Buffer(sort.outputs[0]), OutputValue::Buffer(sort.outputs[1])]);
}

#[test]
fn cat_writes_each_piece_at_its_offset_in_one_buffer() {
    let doc = GraphBuilder::new()
        .input("x", &[2, 3], "float32")
        .input("y", &[2, 5], "float32")
        .call("c", "aten.cat.default", &[format!(r#"{{"list":[{},{}]}}"#, node("x"), node("y")), int(1)], &f32(&[2, 8]))
        .output(&["c"]);
    let p = lower(&doc);
    let ns = nodes(&p);
    assert_eq!(ns.len(), 2);
    assert_eq!(ns[0].output, ns[1].output);
    assert_eq!((ns[0].ranges.as_slice(), ns[1].ranges.as_slice()), ([2, 3].as_slice(), [2, 5].as_slice()));
    let stores: Vec<String> = ns.iter().map(|n| n.body.store.as_ref().unwrap().index.to_string()).collect();
    assert_eq!(stores, ["8*v0 + v1", "8*v0 + v1 + 3"]);
    assert!(externs(&p).is_empty(), "cat is not a library call");
}

#[test]
fn an_op_without_lowering_falls_back_to_its_aten_overload() {
    let doc = GraphBuilder::new()
        .input("x", &[4], "float32")
        .call("sp", "prims.sinh.default", &[node("x")], &f32(&[4]))
        .call("neg", "aten.neg.default", &[node("sp")], &f32(&[4]))
        .output(&["neg"]);
    let lowered = lower_with(&doc, &LowerOptions::default());
    assert_eq!(lowered.fallbacks.len(), 1);
    assert_eq!((lowered.fallbacks[0].node.as_str(), lowered.fallbacks[0].target.as_str()), ("sp", "prims.sinh.default"));
    let p = &lowered.program;
    let call = externs(p)[0];
    assert!(call.fallback);
    assert_eq!(call.callee, "torch.ops.prims.sinh.default");
    assert_eq!(load_indices(p, nodes(p)[0]), ["buf1[v0]"], "the fallback's result is read from its buffer");
}

// ----- mutation -----

#[test]
fn copy_into_an_input_stores_into_the_input_after_everything_else() {
    let doc = GraphBuilder::new()
        .input("x", &[6], "float32")
        .call("add", "aten.add.Tensor", &[node("x"), int(1)], &f32(&[6]))
        .call("mul", "aten.mul.Tensor", &[node("x"), int(2)], &f32(&[6]))
        .call("cp", "aten.copy_.default", &[node("x"), node("add")], &f32(&[6]))
        .output(&["mul"]);
    let p = lower(&doc);
    let ns = nodes(&p);
    assert_eq!(ns.len(), 2);
    assert_eq!(ns[1].output, p.inputs[0], "the write goes into the input's memory");
    assert_eq!(ns[1].origins, ["add", "cp"]);
    assert_eq!(load_indices(&p, ns[0]), ["x[v0]"], "the output reads the input's old contents first");
}

// ----- layout -----

fn conv_graph(input: &[i64], weight: &[i64], out: &[i64], pad: i64, groups: i64) -> String {
    GraphBuilder::new()
        .input("x", input, "float32")
        .input("w", weight, "float32")
        .call(
            "conv",
            "aten.convolution.default",
            &[
                node("x"),
                node("w"),
                "null".into(),
                ints(&[1, 1]),
                ints(&[pad, pad]),
                ints(&[1, 1]),
                boolean(false),
                ints(&[0, 0]),
                int(groups),
            ],
            &f32(out),
        )
        .call("relu", "aten.relu.default", &[node("conv")], &f32(out))
        .output(&["relu"])
}

#[test]
fn channels_last_layout_hands_the_convolution_nhwc_operands() {
    let doc = conv_graph(&[2, 8, 16, 16], &[16, 8, 3, 3], &[2, 16, 16, 16], 1, 1);
    let lowered = lower_with(&doc, &LowerOptions { conv_layout: ConvLayout::ChannelsLast, ..LowerOptions::default() });
    let p = &lowered.program;
    let conv = externs(p)[0];
    assert_eq!(conv.callee, "torch.ops.aten.convolution.default");
    let strides: Vec<Vec<i64>> = conv.input_buffers().iter().map(|b| p.buffer(*b).layout.stride.clone()).collect();
    assert_eq!(strides, [vec![2048, 1, 128, 8], vec![72, 1, 24, 8]], "input and weight copied channels-last:\n{p}");
    assert_eq!(p.buffer(conv.outputs[0]).layout.stride, [4096, 1, 256, 16]);
    // the graph output keeps eager's layout
    assert_eq!(output_layout(p, 0).stride, [4096, 256, 16, 1]);
}

#[test]
fn channels_last_layout_leaves_values_of_other_4d_shapes_contiguous() {
    // conv -> permute to [N, H, W, C] -> gelu (ConvNeXt's MLP): the gelu's [2, 16, 16, 8] value
    // is no convolution's activation shape, so its buffer keeps the contiguous layout its view needs
    let doc = GraphBuilder::new()
        .input("x", &[2, 8, 16, 16], "float32")
        .input("w", &[8, 8, 3, 3], "float32")
        .call(
            "conv",
            "aten.convolution.default",
            &[node("x"), node("w"), "null".into(), ints(&[1, 1]), ints(&[1, 1]), ints(&[1, 1]), boolean(false), ints(&[0, 0]), int(1)],
            &f32(&[2, 8, 16, 16]),
        )
        .call(
            "nhwc",
            "aten.permute.default",
            &[node("conv"), ints(&[0, 2, 3, 1])],
            &strided_meta(&[2, 16, 16, 8], Some(&[2048, 16, 1, 256]), "float32"),
        )
        .call("g", "aten.gelu.default", &[node("nhwc")], &f32(&[2, 16, 16, 8]))
        .call("flat", "aten.view.default", &[node("g"), ints(&[512, 8])], &f32(&[512, 8]))
        .output(&["flat", "g"]);
    // g leaves as a saved activation, in the layout ferrocore chooses
    let doc = format!("{},\"free_layout_outputs\":[1]}}", doc.trim_end().strip_suffix('}').unwrap());
    let lowered = lower_with(&doc, &LowerOptions { conv_layout: ConvLayout::ChannelsLast, ..LowerOptions::default() });
    let p = &lowered.program;
    assert_eq!(output_layout(p, 1).stride, [2048, 128, 8, 1], "contiguous [N, H, W, C]:\n{p}");
    assert_eq!(p.buffer(externs(p)[0].outputs[0]).layout.stride, [2048, 1, 128, 8], "the convolution's result NHWC");
}

#[test]
fn contiguous_layout_passes_the_convolution_its_inputs_as_they_are() {
    let doc = conv_graph(&[2, 8, 16, 16], &[16, 8, 3, 3], &[2, 16, 16, 16], 1, 1);
    let lowered = lower_with(&doc, &LowerOptions { conv_layout: ConvLayout::Contiguous, ..LowerOptions::default() });
    let p = &lowered.program;
    assert_eq!(externs(p)[0].input_buffers(), p.inputs, "{p}");
    assert_eq!(kinds(p), [NodeKind::Pointwise], "only the relu:\n{p}");
}

fn conv_backward_graph(mask: [bool; 3], grad_bias: &str) -> String {
    let items = [f32(&[2, 8, 16, 16]), f32(&[16, 8, 3, 3]), grad_bias.to_string()];
    GraphBuilder::new()
        .input("g", &[2, 16, 16, 16], "float32")
        .input("x", &[2, 8, 16, 16], "float32")
        .input("w", &[16, 8, 3, 3], "float32")
        .call(
            "bw",
            "aten.convolution_backward.default",
            &[
                node("g"),
                node("x"),
                node("w"),
                ints(&[16]),
                ints(&[1, 1]),
                ints(&[1, 1]),
                ints(&[1, 1]),
                boolean(false),
                ints(&[0, 0]),
                int(1),
                format!(r#"{{"list":[{}]}}"#, mask.map(boolean).join(",")),
            ],
            &tuple(&items),
        )
        .call("gb", "getitem", &[node("bw"), int(2)], grad_bias)
        .output(&["gb"])
        .replace(r#""device":"cpu""#, r#""device":"cuda:0""#)
}

#[test]
fn gpu_convolution_backward_sums_the_bias_gradient_itself() {
    let doc = conv_backward_graph([true, true, true], &f32(&[16]));
    let lowered = lower_with(&doc, &LowerOptions { kernels: KernelLanguage::Triton, ..LowerOptions::default() });
    let p = &lowered.program;
    let call = p.extern_text(0);
    assert!(call.contains("[True, True, False]"), "the library computes grad_input and grad_weight only: {call}");
    // (beside the channels-last copies of the call's activations)
    let sums: Vec<&LoopNode> = nodes(p).into_iter().filter(|n| n.kind() == NodeKind::Reduction).collect();
    assert_eq!(sums.len(), 1, "the bias gradient, a sum over batch and space:\n{p}");
    assert_eq!((sums[0].ranges.as_slice(), sums[0].reduction_ranges.as_slice()), ([16].as_slice(), [2, 16, 16].as_slice()));
    // only the bias gradient asked for: no library call
    let doc = conv_backward_graph([false, false, true], &f32(&[16]));
    let lowered = lower_with(&doc, &LowerOptions { kernels: KernelLanguage::Triton, ..LowerOptions::default() });
    assert!(externs(&lowered.program).is_empty(), "{}", lowered.program);
}

#[test]
fn channels_last_gpu_group_norm_reduces_channels_side_by_side() {
    // conv -> group norm (4 groups of 4 channels over 32x24 = 768 pixels), channels-last, Triton
    let doc = GraphBuilder::new()
        .input("x", &[2, 8, 32, 24], "float32")
        .input("w", &[16, 8, 3, 3], "float32")
        .call(
            "conv",
            "aten.convolution.default",
            &[node("x"), node("w"), "null".into(), ints(&[1, 1]), ints(&[1, 1]), ints(&[1, 1]), boolean(false), ints(&[0, 0]), int(1)],
            &f32(&[2, 16, 32, 24]),
        )
        .call(
            "gn",
            "aten.native_group_norm.default",
            &[node("conv"), "null".into(), "null".into(), int(2), int(16), int(768), int(4), float(1e-5)],
            &tuple(&[f32(&[2, 16, 32, 24]), f32(&[2, 4]), f32(&[2, 4])]),
        )
        .call("y", "getitem", &[node("gn"), int(0)], &f32(&[2, 16, 32, 24]))
        .output(&["y"]);
    let options = LowerOptions { kernels: KernelLanguage::Triton, conv_layout: ConvLayout::ChannelsLast, ..LowerOptions::default() };
    let p = &lower_with(&doc, &options).program;
    let sums: Vec<&LoopNode> = nodes(p).into_iter().filter(|n| n.kind() == NodeKind::Reduction).collect();
    let shapes: Vec<(&[i64], &[i64])> = sums.iter().map(|n| (n.ranges.as_slice(), n.reduction_ranges.as_slice())).collect();
    // per (sample, chunk, channel): three chunks of 256 pixels, the channels the rows, innermost;
    // then per (sample, group) over the chunks and the group's channels
    assert_eq!(shapes, [(&[2, 3, 16][..], &[256][..]), (&[2, 3, 16], &[256]), (&[2, 4], &[3, 4]), (&[2, 4], &[3, 4])], "{p}");
}

#[test]
fn a_gpu_convolution_asked_for_as_a_template_is_an_implicit_gemm_node() {
    // relu(conv(x, w, b)) at stride 2, padding 1, channels-last, Triton: with gemm_template =
    // always one convolution node over [n, oh, ow, o] by [kh, kw, c], the weight copied with its
    // channels innermost; by default (nothing measured) the library call
    let doc = GraphBuilder::new()
        .input("x", &[2, 8, 32, 24], "float32")
        .input("w", &[16, 8, 3, 3], "float32")
        .input("b", &[16], "float32")
        .call(
            "conv",
            "aten.convolution.default",
            &[node("x"), node("w"), node("b"), ints(&[2, 2]), ints(&[1, 1]), ints(&[1, 1]), boolean(false), ints(&[0, 0]), int(1)],
            &f32(&[2, 16, 16, 12]),
        )
        .call("y", "aten.relu.default", &[node("conv")], &f32(&[2, 16, 16, 12]))
        .output(&["y"]);
    let lowered = |gemm_template| {
        let options = LowerOptions {
            kernels: KernelLanguage::Triton,
            conv_layout: ConvLayout::ChannelsLast,
            gemm_template,
            ..LowerOptions::default()
        };
        lower_with(&doc, &options).program
    };
    let p = lowered(GemmTemplate::Always);
    assert!(externs(&p).is_empty(), "{p}");
    let conv: Vec<&LoopNode> = nodes(&p).into_iter().filter(|n| n.convolution().is_some()).collect();
    assert_eq!(conv.len(), 1, "{p}");
    assert_eq!((conv[0].ranges.as_slice(), conv[0].reduction_ranges.as_slice()), (&[2, 16, 12, 16][..], &[3, 3, 8][..]));
    let g = conv[0].convolution().unwrap();
    assert_eq!((g.input_hw, g.stride, g.padding, g.dilation), ([32, 24], [2, 2], [1, 1], [1, 1]));
    assert_eq!(p.buffer(conv[0].output).layout.stride, [3072, 1, 192, 16], "channels-last, stored in the node's loop order");
    let p = lowered(GemmTemplate::Cached);
    assert!(nodes(&p).iter().all(|n| n.convolution().is_none()));
    assert_eq!(externs(&p).len(), 1);
}

#[test]
fn nearest_upsampling_computes_its_source_at_the_read_positions() {
    // (x + 1) upsampled x2 by `index` with `(arange(8) * 0.5).to(int64)` positions, as torch's
    // decomposition writes it: one pointwise node reading x at (h // 2, w // 2), nothing checked
    let pos = |b: GraphBuilder, n: &str| {
        b.call_kw(&format!("ar{n}"), "aten.arange.start_step", &[int(0), int(8)], r#""dtype":{"dtype":"float32"}"#, &f32(&[8]))
            .call(&format!("half{n}"), "aten.mul.Tensor", &[node(&format!("ar{n}")), float(0.5)], &f32(&[8]))
            .call_kw(
                &format!("i{n}"),
                "aten._to_copy.default",
                &[node(&format!("half{n}"))],
                r#""dtype":{"dtype":"int64"}"#,
                &meta(&[8], "int64"),
            )
    };
    let b = GraphBuilder::new().input("x", &[1, 2, 4, 4], "float32").call(
        "y",
        "aten.add.Tensor",
        &[node("x"), float(1.0)],
        &f32(&[1, 2, 4, 4]),
    );
    let b = pos(pos(b, "h"), "w").call("col", "aten.unsqueeze.default", &[node("ih"), int(-1)], &meta(&[8, 1], "int64"));
    let doc = b
        .call(
            "up",
            "aten.index.Tensor",
            &[node("y"), r#"{"list":[null,null,{"node":"col"},{"node":"iw"}]}"#.to_string()],
            &f32(&[1, 2, 8, 8]),
        )
        .output(&["up"]);
    let p = lower(&doc);
    assert_eq!(kinds(&p), [NodeKind::Pointwise], "{p}");
    let text = format!("{p}");
    assert!(!text.contains("check") && !text.contains("indirect"), "{text}");
}

// ----- cpu_conv -----

#[test]
fn small_pointwise_cpu_convolution_is_a_batched_gemm() {
    let doc = conv_graph(&[2, 8, 4, 4], &[16, 8, 1, 1], &[2, 16, 4, 4], 0, 1);
    let lowered = lower_with(&doc, &LowerOptions::default());
    let p = &lowered.program;
    assert_eq!(
        p.extern_text(0),
        "  buf2 = extern torch.ops.aten.bmm.default(reinterpret(w, [2, 16, 8], [0, 8, 1], 0), \
         reinterpret(x, [2, 8, 16], [128, 16, 1], 0))  # conv\n"
    );
    assert_eq!(kinds(p), [NodeKind::Pointwise]);
}

#[test]
fn small_depthwise_cpu_convolution_is_a_generated_kernel() {
    let doc = conv_graph(&[1, 4, 6, 6], &[4, 1, 3, 3], &[1, 4, 6, 6], 1, 4);
    let lowered = lower_with(&doc, &LowerOptions::default());
    let p = &lowered.program;
    assert!(externs(p).is_empty(), "no library call:\n{p}");
    // padded input, weight copy, the unrolled 3x3 window, the relu
    let ns = nodes(p);
    assert_eq!(ns.len(), 4, "{p}");
    assert_eq!(ns[0].ranges, [1, 8, 8, 4], "the input zero-padded by 1 on each side, channels innermost");
    let window = ns[2];
    assert_eq!(window.origins, ["conv"]);
    let taps = load_indices(p, window);
    assert_eq!(taps.len(), 18, "a load of input and weight per tap:\n{p}");
    assert_eq!(taps[16], "buf2[256*v0 + 32*v1 + 4*v2 + v3 + 72]", "the last tap is two rows and two columns on");
    assert_eq!(p.buffer(window.output).layout.stride, [144, 1, 24, 4]);
}

// ----- malformed input -----

#[test]
fn a_target_that_is_no_operator_name_is_an_import_error_naming_the_node() {
    let doc = GraphBuilder::new().input("x", &[4], "float32").call("weird", "not_an_op", &[node("x")], &f32(&[4])).output(&["weird"]);
    let e = parse_graph(&doc).unwrap_err().to_string();
    assert_eq!(e, "graph import: node 'weird': target 'not_an_op' is not an operator name (namespace.op.overload)");
}

#[test]
fn inconsistent_broadcast_shapes_are_a_malformed_error_naming_the_node() {
    let doc = GraphBuilder::new()
        .input("x", &[4, 4], "float32")
        .input("y", &[3, 4], "float32")
        .call("bad_add", "aten.add.Tensor", &[node("x"), node("y")], &f32(&[4, 4]))
        .output(&["bad_add"]);
    let e = lower_error(&doc);
    assert_eq!((e.node.as_str(), e.target.as_str(), &e.kind), ("bad_add", "aten.add.Tensor", &LowerErrorKind::Malformed));
    assert_eq!(e.to_string(), "lowering: node 'bad_add' (aten.add.Tensor): shapes [[4, 4], [3, 4]] do not broadcast");
}

#[test]
fn a_view_to_a_size_of_different_numel_is_a_malformed_error_naming_the_node() {
    let doc = GraphBuilder::new()
        .input("x", &[4, 4], "float32")
        .call("bad_view", "aten.view.default", &[node("x"), ints(&[5, 3])], &f32(&[5, 3]))
        .output(&["bad_view"]);
    let e = lower_error(&doc);
    assert_eq!((e.node.as_str(), &e.kind), ("bad_view", &LowerErrorKind::Malformed));
    assert_eq!(e.message, "cannot view [4, 4] as [5, 3]");
}
