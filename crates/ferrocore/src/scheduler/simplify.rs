//! Loop simplification before fusion: size-1 dims are dropped and adjacent dims merged when every
//! index of the body walks them contiguously (coefficient of the outer dim = coefficient of the
//! inner dim × its size). Also dead-node elimination.

use crate::loop_ir::*;
use crate::symbolic::{IndexExpr, Var};

/// Returns the node with merged/dropped dims. Output and reduction dims merge separately.
pub fn simplify_loops(node: &LoopNode) -> LoopNode {
    if node.template.is_some() {
        return node.clone(); // its template needs the roles of its variables
    }
    let nr = node.ranges.len();
    let sizes = node.var_ranges();
    // groups[k] = list of original vars merged into new var k, outermost first
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut group_is_red: Vec<bool> = Vec::new();
    let indices = node.body.indices();
    if sizes.contains(&0) {
        return node.clone(); // an empty loop: nothing to simplify
    }
    for (v, &size) in sizes.iter().enumerate() {
        if size == 1 {
            continue;
        }
        let red = v >= nr;
        if let Some(last) = groups.last() {
            let prev = *last.last().unwrap_or(&v);
            let same_kind = *group_is_red.last().unwrap_or(&false) == red;
            if same_kind && prev + 1 == v && mergeable(&indices, prev, v, size) {
                if let Some(g) = groups.last_mut() {
                    g.push(v);
                }
                continue;
            }
        }
        groups.push(vec![v]);
        group_is_red.push(red);
    }
    let mut new_ranges: Vec<i64> = groups.iter().map(|g| g.iter().map(|&v| sizes[v]).product()).collect();
    // a reduction keeps one (size-1) reduction loop even when all its reduced dims had size 1
    let keep_unit_reduction = node.kind() != NodeKind::Pointwise && !group_is_red.iter().any(|r| *r);
    // old var -> expression in new vars
    let mut subst: Vec<Option<IndexExpr>> = vec![Some(IndexExpr::zero()); sizes.len()];
    for (k, g) in groups.iter().enumerate() {
        let mut inner = 1i64;
        for &v in g.iter().rev() {
            let nv = IndexExpr::var(Var(k as u32));
            subst[v] = Some(nv.floordiv(inner, &new_ranges).modulo(sizes[v], &new_ranges));
            inner *= sizes[v];
        }
    }
    let body = node.body.rewrite_indices(&|e: &IndexExpr| e.substitute(&subst, &new_ranges));
    let n_out = group_is_red.iter().filter(|r| !**r).count();
    if keep_unit_reduction {
        new_ranges.push(1);
    }
    LoopNode {
        output: node.output,
        ranges: new_ranges[..n_out].to_vec(),
        reduction_ranges: new_ranges[n_out..].to_vec(),
        body,
        origins: node.origins.clone(),
        template: None,
    }
}

fn mergeable(indices: &[&IndexExpr], outer: usize, inner: usize, inner_size: i64) -> bool {
    indices.iter().all(|e| match (e.affine_coeff(Var(outer as u32)), e.affine_coeff(Var(inner as u32))) {
        (Some(a), Some(b)) => a == b * inner_size,
        _ => false,
    })
}

/// Removes loop nodes whose buffers nobody reads and that are not outputs; repeats until stable.
/// Returns the names of removed buffers.
pub fn eliminate_dead_nodes(p: &mut LoopProgram) -> Vec<String> {
    let mut removed = Vec::new();
    loop {
        let mut used = vec![false; p.buffers.len()];
        // the caller sees what is written into its inputs (`copy_`)
        for b in &p.inputs {
            used[b.0 as usize] = true;
        }
        for o in &p.outputs {
            match o {
                OutputValue::Buffer(b) | OutputValue::View { buf: b, .. } => used[b.0 as usize] = true,
                OutputValue::None => {}
            }
        }
        for s in &p.steps {
            match s {
                Step::Node(i) => {
                    for (b, _) in p.nodes[*i].reads() {
                        used[b.0 as usize] = true;
                    }
                }
                Step::Extern(i) => {
                    for b in p.externs[*i].input_buffers() {
                        used[b.0 as usize] = true;
                    }
                }
            }
        }
        let before = p.steps.len();
        let mut kept = Vec::new();
        for s in &p.steps {
            let live = match s {
                Step::Node(i) => used[p.nodes[*i].output.0 as usize],
                // a call without results (an error check) is there for its effect
                Step::Extern(i) => p.externs[*i].outputs.is_empty() || p.externs[*i].outputs.iter().any(|b| used[b.0 as usize]),
            };
            if live {
                kept.push(*s);
            } else {
                match s {
                    Step::Node(i) => removed.push(p.buffer(p.nodes[*i].output).name.clone()),
                    Step::Extern(i) => removed.push(p.externs[*i].origin.clone()),
                }
            }
        }
        p.steps = kept;
        if p.steps.len() == before {
            return removed;
        }
    }
}
