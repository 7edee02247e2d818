//! Text form of the loop IR (used by `ir_pre_fusion` / `ir_post_fusion` dumps and golden tests).

use super::*;
use std::fmt::{self, Write};

struct BodyPrinter<'a> {
    program: &'a LoopProgram,
    out: String,
    next: usize,
    output: BufferId,
}

impl BodyPrinter<'_> {
    fn line(&mut self, dtype: DType, rhs: String) -> String {
        let name = format!("t{}", self.next);
        self.next += 1;
        let _ = writeln!(self.out, "    {name}: {dtype} = {rhs}");
        name
    }
}

impl OpsHandler for BodyPrinter<'_> {
    type V = String;
    fn load(&mut self, buf: BufferId, index: &IndexExpr, dtype: DType) -> String {
        let name = self.program.buffer(buf).name.clone();
        self.line(dtype, format!("load({name}, {index})"))
    }
    fn constant(&mut self, value: Scalar, dtype: DType) -> String {
        let v = match value {
            Scalar::Int(i) => i.to_string(),
            Scalar::Float(f) => format!("{f:?}"),
            Scalar::Bool(b) => b.to_string(),
        };
        self.line(dtype, format!("constant({v})"))
    }
    fn index_expr(&mut self, e: &IndexExpr, dtype: DType) -> String {
        self.line(dtype, format!("index_expr({e})"))
    }
    fn unary(&mut self, op: UnaryOp, x: &String, _in_dtype: DType, dtype: DType) -> String {
        self.line(dtype, format!("{}({x})", format!("{op:?}").to_lowercase()))
    }
    fn binary(&mut self, op: BinaryOp, a: &String, b: &String, _o: DType, dtype: DType) -> String {
        self.line(dtype, format!("{}({a}, {b})", format!("{op:?}").to_lowercase()))
    }
    fn where_(&mut self, c: &String, a: &String, b: &String, dtype: DType) -> String {
        self.line(dtype, format!("where({c}, {a}, {b})"))
    }
    fn cast(&mut self, x: &String, _from: DType, to: DType) -> String {
        self.line(to, format!("cast({x}, {to})"))
    }
    fn reduce(&mut self, op: ReduceOp, x: &String, dtype: DType, _id: ValueId) -> String {
        self.line(dtype, format!("reduce_{}({x})", format!("{op:?}").to_lowercase()))
    }
    fn random(&mut self, normal: bool, seed: &String, offset: &String) -> String {
        let f = if normal { "randn" } else { "rand" };
        self.line(DType::F32, format!("{f}({seed}, {offset})"))
    }
    fn scan(&mut self, op: ReduceOp, x: &String, dtype: DType) -> String {
        self.line(dtype, format!("scan_{}({x})", format!("{op:?}").to_lowercase()))
    }
    fn load_indirect(&mut self, buf: BufferId, index: &IndexExpr, terms: &[(String, i64)], dtype: DType) -> String {
        let name = self.program.buffer(buf).name.clone();
        let t: Vec<String> = terms.iter().map(|(v, c)| format!(" + {c}*{v}")).collect();
        self.line(dtype, format!("load({name}, {index}{})", t.join("")))
    }
    fn check_index(&mut self, value: &String, size: i64, wrap: bool) -> String {
        let w = if wrap { ", wrap" } else { "" };
        self.line(DType::I64, format!("check_index({value}, {size}{w})"))
    }
    fn arg_reduce(&mut self, op: ReduceOp, value: &String, index: &String, _vd: DType) -> String {
        self.line(DType::I64, format!("reduce_{}({value}, {index})", format!("{op:?}").to_lowercase()))
    }
    fn store(&mut self, index: &IndexExpr, terms: &[(String, i64)], mode: StoreMode, value: &String, _dtype: DType) {
        let name = self.program.buffer(self.output).name.clone();
        let t: String = terms.iter().map(|(v, c)| format!(" + {c}*{v}")).collect();
        let how = match mode {
            StoreMode::Set => String::new(),
            StoreMode::Combine(op) => format!(", {}", format!("{op:?}").to_lowercase()),
        };
        let _ = writeln!(self.out, "    store({name}, {index}{t}, {value}{how})");
    }
}

impl LoopProgram {
    pub fn node_text(&self, i: usize) -> String {
        let n = &self.nodes[i];
        let b = self.buffer(n.output);
        let mut p = BodyPrinter { program: self, out: String::new(), next: 0, output: n.output };
        n.body.visit(&mut p);
        let kind = match n.kind() {
            NodeKind::Pointwise => "Pointwise",
            NodeKind::Reduction => "Reduction",
            NodeKind::Scan => "Scan",
        };
        let red = if n.reduction_ranges.is_empty() { String::new() } else { format!(" reduce={:?}", n.reduction_ranges) };
        format!(
            "  {}: {kind} ranges={:?}{red} -> {}{:?}/{:?}  # {}\n{}",
            b.name,
            n.ranges,
            b.layout.dtype,
            b.layout.size,
            b.layout.stride,
            n.origins.join(", "),
            p.out
        )
    }

    fn fmt_extern_arg(&self, a: &ExternArg) -> String {
        match a {
            ExternArg::Buffer(b) => self.buffer(*b).name.clone(),
            ExternArg::View { buf, size, stride, offset } => {
                format!("reinterpret({}, {size:?}, {stride:?}, {offset})", self.buffer(*buf).name)
            }
            ExternArg::Literal(l) => l.to_string(),
            ExternArg::List(items) => format!("[{}]", items.iter().map(|i| self.fmt_extern_arg(i)).collect::<Vec<_>>().join(", ")),
        }
    }

    pub fn extern_text(&self, i: usize) -> String {
        let e = &self.externs[i];
        let outs: Vec<&str> = e.outputs.iter().map(|b| self.buffer(*b).name.as_str()).collect();
        let mut args: Vec<String> = e.args.iter().map(|a| self.fmt_extern_arg(a)).collect();
        args.extend(e.kwargs.iter().map(|(k, v)| format!("{k}={}", self.fmt_extern_arg(v))));
        let kind = if e.fallback { "fallback" } else { "extern" };
        format!("  {} = {kind} {}({})  # {}\n", outs.join(", "), e.callee, args.join(", "), e.origin)
    }
}

impl fmt::Display for LoopProgram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ins: Vec<String> = self
            .inputs
            .iter()
            .map(|b| {
                let l = &self.buffer(*b).layout;
                format!("{}: {}{:?}/{:?}", self.buffer(*b).name, l.dtype, l.size, l.stride)
            })
            .collect();
        writeln!(f, "inputs: {}", ins.join(", "))?;
        for s in &self.steps {
            match s {
                Step::Node(i) => f.write_str(&self.node_text(*i))?,
                Step::Extern(i) => f.write_str(&self.extern_text(*i))?,
            }
        }
        let outs: Vec<String> = self
            .outputs
            .iter()
            .map(|o| match o {
                OutputValue::Buffer(b) => self.buffer(*b).name.clone(),
                OutputValue::View { buf, size, stride, offset } => {
                    format!("reinterpret({}, {size:?}, {stride:?}, {offset})", self.buffer(*buf).name)
                }
                OutputValue::None => "None".into(),
            })
            .collect();
        writeln!(f, "return ({})", outs.join(", "))
    }
}

/// The IR text of a constant (the wrapper writes its own Python through `codegen::literal`).
impl fmt::Display for Literal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Literal::None => f.write_str("None"),
            Literal::Int(i) => write!(f, "{i}"),
            Literal::Float(x) if x.is_nan() => f.write_str("float('nan')"),
            Literal::Float(x) if x.is_infinite() => f.write_str(if *x > 0.0 { "float('inf')" } else { "float('-inf')" }),
            Literal::Float(x) => write!(f, "{x:?}"),
            Literal::Bool(b) => f.write_str(if *b { "True" } else { "False" }),
            Literal::Str(s) => write!(f, "{s:?}"),
            Literal::DType(d) => write!(f, "torch.{d}"),
            Literal::Device(d) => write!(f, "torch.device('{d}')"),
            Literal::Layout(l) => write!(f, "torch.{l}"),
            Literal::MemoryFormat(m) => write!(f, "torch.{m}"),
            Literal::Shape(s) if s.len() == 1 => write!(f, "({},)", s[0]),
            Literal::Shape(s) => write!(f, "({})", s.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")),
        }
    }
}
