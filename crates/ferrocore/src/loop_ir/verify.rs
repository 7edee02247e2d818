//! The loop-IR verifier: checks the invariants later stages rely on. Run between stages in debug
//! builds and by the stage tests.

use super::*;
use crate::graph::DType;
use crate::symbolic::Var;

fn check_index(e: &IndexExpr, nvars: usize, what: &str) -> Result<(), String> {
    let mut vs: Vec<Var> = Vec::new();
    e.vars(&mut vs);
    match vs.iter().find(|v| v.0 as usize >= nvars) {
        Some(v) => Err(format!("{what} uses v{} but the node has {nvars} loop variables", v.0)),
        None => Ok(()),
    }
}

impl LoopProgram {
    /// Every expression refers to earlier ids, binary operands share a dtype, indices use only
    /// the node's variables, loads and stores name existing buffers, every node stores once.
    pub fn verify(&self) -> Result<(), String> {
        for (ni, n) in self.nodes.iter().enumerate() {
            let here = |m: String| format!("node {ni} ({}): {m}", self.buffers.get(n.output.0 as usize).map_or("?", |b| b.name.as_str()));
            if n.output.0 as usize >= self.buffers.len() {
                return Err(here("output buffer does not exist".into()));
            }
            let nvars = n.ranges.len() + n.reduction_ranges.len();
            let b = &n.body;
            if b.exprs.len() != b.dtypes.len() {
                return Err(here("expression and dtype tables differ in length".into()));
            }
            for (i, e) in b.exprs.iter().enumerate() {
                let before = |v: &ValueId| (v.0 as usize) < i;
                let ok = match e {
                    Expr::Load { buf, index } => {
                        if buf.0 as usize >= self.buffers.len() {
                            return Err(here(format!("t{i} loads a buffer that does not exist")));
                        }
                        check_index(index, nvars, &format!("t{i}")).map_err(here)?;
                        true
                    }
                    Expr::Index(ix) => {
                        check_index(ix, nvars, &format!("t{i}")).map_err(here)?;
                        true
                    }
                    Expr::Constant(_) => true,
                    Expr::Unary(_, x) | Expr::Cast(x) | Expr::Reduce(_, x) | Expr::Scan(_, x) => before(x),
                    Expr::Binary(_, a, c) => {
                        if before(a) && before(c) && b.dtype(*a) != b.dtype(*c) {
                            return Err(here(format!("t{i}: binary operands have dtypes {} and {}", b.dtype(*a), b.dtype(*c))));
                        }
                        before(a) && before(c)
                    }
                    Expr::Where(c, x, y) => before(c) && before(x) && before(y),
                    Expr::ArgReduce(_, x, ix) => before(x) && before(ix),
                    Expr::LoadIndirect { buf, index, terms } => {
                        if buf.0 as usize >= self.buffers.len() {
                            return Err(here(format!("t{i} loads a buffer that does not exist")));
                        }
                        check_index(index, nvars, &format!("t{i}")).map_err(here)?;
                        terms.iter().all(|(v, _)| before(v) && b.dtype(*v) == DType::I64)
                    }
                    Expr::CheckIndex { value, size, .. } => before(value) && *size > 0,
                    Expr::Random { seed, offset, .. } => before(seed) && before(offset),
                };
                if !ok {
                    return Err(here(format!("t{i} refers to a later expression")));
                }
            }
            if n.kind() != NodeKind::Pointwise && n.reduction_ranges.is_empty() {
                return Err(here("a reduction without reduction loops".into()));
            }
            if n.kind() == NodeKind::Scan && n.reduction_ranges.len() != 1 {
                return Err(here("a scan runs along exactly one variable".into()));
            }
            let st = b.store.as_ref().ok_or_else(|| here("no store".into()))?;
            if st.value.0 as usize >= b.exprs.len() {
                return Err(here("store of an undefined value".into()));
            }
            // a scan stores at every step of its scan variable
            let store_vars = if n.kind() == NodeKind::Scan { nvars } else { n.ranges.len() };
            check_index(&st.index, store_vars, "store").map_err(here)?;
        }
        for s in &self.steps {
            match s {
                Step::Node(i) if *i >= self.nodes.len() => return Err(format!("step names node {i}, which does not exist")),
                Step::Extern(i) if *i >= self.externs.len() => return Err(format!("step names extern {i}, which does not exist")),
                _ => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{DType, Device};

    #[test]
    fn rejects_out_of_range_variables_and_mixed_operands() {
        let mut p = LoopProgram::default();
        let b = p.add_buffer(Layout::contiguous(&[4], DType::F32, Device::Cpu), BufferSource::Computed);
        let mut body = LoopBody::default();
        let x = body.load(b, IndexExpr::var(Var(3)), DType::F32);
        body.set_store(IndexExpr::var(Var(0)), x);
        p.nodes.push(LoopNode { output: b, ranges: vec![4], reduction_ranges: vec![], body, origins: vec![], template: None });
        assert!(p.verify().unwrap_err().contains("uses v3"));

        let mut body = LoopBody::default();
        let x = body.load(b, IndexExpr::var(Var(0)), DType::F32);
        let one = body.constant(Scalar::Int(1), DType::I64);
        body.exprs.push(Expr::Binary(BinaryOp::Add, x, one)); // bypasses the builder's casts
        body.dtypes.push(DType::F32);
        body.set_store(IndexExpr::var(Var(0)), ValueId(2));
        p.nodes[0].body = body;
        assert!(p.verify().unwrap_err().contains("binary operands"));
    }
}
