//! `gemm_epilogue`: a linear layer's activation computed in the GEMM's epilogue. On the GPU,
//! `relu(addmm(bias, a, b))` and `gelu(addmm(bias, a, b), approximate="tanh")` in half
//! precision become one `_addmm_activation` call: cuBLASLt adds the bias and applies the
//! activation to the float32 accumulator before it writes the result, so the activation's
//! read and write of the whole product (and its launch) go away. Inductor keeps them apart.
//!
//! What it keeps: ReLU commutes with rounding, so its result is eager's bit for bit; tanh-GELU
//! is applied before the rounding to half precision instead of after it (at most one rounding
//! step apart). torch runs the plain addmm and the activation in place where cuBLASLt cannot
//! take the operands (a strided bias, a size-1 dim), so every input stays valid. Float32 keeps
//! its addmm: cuBLAS picked slower kernels for the bias form there (`lowering/matmul.rs`).

use super::*;

/// The activation `node` applies to its first input, when the epilogue has it: `use_gelu`.
fn activation(g: &Graph, node: NodeId) -> Option<bool> {
    match call(g, node)? {
        (AtenOp::Relu, _, _) => Some(false),
        (AtenOp::Gelu, _, _) => match g.node(node).arg(1, "approximate") {
            Some(Arg::Str(a)) if a == "tanh" => Some(true),
            _ => None,
        },
        _ => None,
    }
}

/// Why `addmm` cannot take the activation into its epilogue, or None when it can.
fn refusal(g: &Graph, addmm: NodeId, uses: &[usize]) -> Option<String> {
    let node = g.node(addmm);
    let out = node.meta.tensor()?;
    if !matches!(out.device, Device::Cuda(_)) {
        return Some("not on a GPU".into());
    }
    if !matches!(out.dtype, DType::F16 | DType::BF16) {
        return Some(format!("{} (half precision only)", out.dtype));
    }
    if uses[addmm.0 as usize] != 1 {
        return Some(format!("{} is read elsewhere", node.name));
    }
    let unit = |a: Option<&Arg>| matches!(a, None | Some(Arg::Int(1))) || matches!(a, Some(Arg::Float(x)) if *x == 1.0);
    if !unit(node.arg(3, "beta")) || !unit(node.arg(4, "alpha")) {
        return Some("scaled addmm".into());
    }
    let bias = match node.arg(0, "self") {
        Some(Arg::Node(b)) => g.node(*b).meta.tensor()?,
        _ => return Some("no bias tensor".into()),
    };
    if bias.shape.len() != 1 || bias.shape.last() != out.shape.last() || bias.dtype != out.dtype {
        return Some(format!("bias shaped {:?} for a product shaped {:?}", bias.shape, out.shape));
    }
    None
}

/// The graph with each half-precision `addmm` followed only by ReLU or tanh-GELU on the GPU run
/// as one `_addmm_activation`; a line per activation of an addmm saying which.
pub fn fuse_gemm_epilogues(g: Graph, options: &PassOptions) -> (Graph, Vec<String>) {
    let uses = g.use_counts();
    let mut edit = GraphEdit::new(&g);
    let mut decisions = Vec::new();
    for id in g.ids() {
        let Some(use_gelu) = activation(&g, id) else { continue };
        let Some(Arg::Node(addmm)) = g.node(id).arg(0, "self") else { continue };
        let addmm = *addmm;
        let Some((AtenOp::Addmm, args, _)) = call(&g, addmm) else { continue };
        let name = &g.node(id).name;
        if options.gemm_templates || g.template_matmuls.contains_key(&g.node(addmm).name) {
            decisions.push(format!("{name}: kept apart from {}: the GEMM is a matrix-product template", g.node(addmm).name));
            continue;
        }
        if let Some(why) = refusal(&g, addmm, &uses) {
            decisions.push(format!("{name}: kept apart from {}: {why}", g.node(addmm).name));
            continue;
        }
        let first = edit.mark();
        let new = Node {
            name: format!("{}_{}", g.node(addmm).name, if use_gelu { "gelu" } else { "relu" }),
            kind: NodeKind::Call {
                target: Target::Aten(AtenOp::AddmmActivation),
                // (beta, alpha and use_gelu are keyword-only)
                args: vec![args[0].clone(), args[1].clone(), args[2].clone()],
                kwargs: vec![("use_gelu".into(), Arg::Bool(use_gelu))],
            },
            meta: g.node(id).meta.clone(),
        };
        let by = edit.push(&g, id, new);
        edit.replace(id, first, by, [addmm]);
        decisions.push(format!("{name}: in the epilogue of {} (_addmm_activation, use_gelu={use_gelu})", g.node(addmm).name));
    }
    edit.finish(g, decisions)
}

#[cfg(test)]
mod tests;
