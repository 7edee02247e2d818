//! Library calls and fallbacks: mm/bmm/addmm run ATen's kernels; any op without a lowering
//! runs its own ATen overload. Both take realized, strided inputs and produce buffers laid out
//! as the node's metadata says. Also `cat`, written slice by slice into one buffer.

use super::*;

impl Ctx<'_> {
    /// Node `n`'s value as a strided tensor for a library call. With `exact`, its strides are
    /// eager's wherever eager's are dense (a copy when ferrocore laid it out otherwise), for calls
    /// whose kernels depend on the layout (grouped GEMMs, attention, custom operators).
    pub(super) fn extern_tensor(&mut self, n: NodeId, exact: bool) -> LResult<ExternArg> {
        let tv = self.realized_node(n, exact)?;
        let want = self.eager_layout(n, &tv);
        if let Some((buf, stride, offset)) = tv.strided() {
            let meta = self.graph.node(n).meta.tensor().filter(|m| m.shape == tv.size);
            if !exact || meta.is_none_or(|m| same_strides(&tv.size, &stride, &m.stride)) {
                let l = &self.prog.buffer(buf).layout;
                if l.size == tv.size && l.stride == stride && l.offset == offset {
                    return Ok(ExternArg::Buffer(buf));
                }
                return Ok(ExternArg::View { buf, size: tv.size.clone(), stride, offset });
            }
        }
        // a non-affine view (e.g. reshape of a transposed buffer), or strides the call must not
        // see: copied out in eager's layout first
        let lazy = TensorValue { src: Src::Lazy { f: loader_of(&tv), reads: 1, ops: 0 }, ..tv };
        let (r, arg) = self.realize_arg(n, &lazy, want)?;
        self.values[n.0 as usize] = Some(Lowered::Tensor(r));
        Ok(arg)
    }

    pub(super) fn extern_arg(&mut self, a: &Arg, exact: bool) -> LResult<ExternArg> {
        Ok(match a {
            Arg::Node(n) => {
                if self.graph.node(*n).meta.tensor().is_none() {
                    return unsupported("non-tensor node argument");
                }
                self.extern_tensor(*n, exact)?
            }
            Arg::List(items) => ExternArg::List(items.iter().map(|i| self.extern_arg(i, exact)).collect::<LResult<_>>()?),
            other => ExternArg::Literal(literal_of(other)),
        })
    }

    /// Emits `callee(args)` with the node's own arguments; its results are new buffers shaped
    /// like the node's metadata.
    fn extern_call(&mut self, callee: String, kind: ExternKind) -> LResult<Lowered> {
        let node = self.graph.node(self.current);
        let NodeKind::Call { args, kwargs, .. } = &node.kind else { return malformed("not a call") };
        let exact = kind.needs_eager_strides();
        let args = args.iter().map(|a| self.extern_arg(a, exact)).collect::<LResult<Vec<_>>>()?;
        let kwargs = kwargs.iter().map(|(k, a)| Ok((k.clone(), self.extern_arg(a, exact)?))).collect::<LResult<Vec<_>>>()?;
        self.push_extern(callee, args, kwargs, &node.meta, kind)
    }

    /// Emits `callee(args, kwargs)` as a step of the program, its results new buffers laid out
    /// as `meta` says.
    pub(super) fn push_extern(
        &mut self,
        callee: String,
        args: Vec<ExternArg>,
        kwargs: Vec<(String, ExternArg)>,
        meta: &Meta,
        kind: ExternKind,
    ) -> LResult<Lowered> {
        let call = self.prog.externs.len();
        let mut outputs = Vec::new();
        let mut make = |cx: &mut Self, t: &TensorMeta, item: Option<usize>| -> TensorValue {
            let layout = Layout { size: t.shape.clone(), stride: t.stride.clone(), offset: 0, dtype: t.dtype, device: t.device };
            let buf = cx.prog.add_buffer(layout.clone(), BufferSource::Extern { call, item });
            outputs.push(buf);
            view_of_layout(buf, &layout)
        };
        let lowered = match meta {
            Meta::Tensor(t) => Lowered::Tensor(make(self, t, None)),
            Meta::Tuple(items) => {
                let mut out = Vec::new();
                for (i, m) in items.iter().enumerate() {
                    out.push(match m {
                        Some(Meta::Tensor(t)) => Some(Lowered::Tensor(make(self, t, Some(i)))),
                        _ => None,
                    });
                }
                Lowered::Tuple(out)
            }
            Meta::None => Lowered::Nothing,
            Meta::Scalar(_) => return malformed("ops returning Python scalars cannot run in the wrapper"),
        };
        let origin = self.node_name();
        let (fallback, reason, capture_hazard) = match kind {
            ExternKind::Library { hazard, .. } => (false, None, hazard.map(str::to_string)),
            ExternKind::Custom => (false, Some("custom operator (torch.library)".to_string()), None),
            ExternKind::Fallback { reason } => {
                let hazard = format!("ATen fallback {callee} of unknown capture safety");
                (true, Some(reason), Some(hazard))
            }
        };
        self.prog.externs.push(ExternCall { callee, args, kwargs, outputs, fallback, origin, reason, capture_hazard });
        self.prog.steps.push(Step::Extern(call));
        Ok(lowered)
    }

    pub(super) fn lower_extern(&mut self, op: AtenOp) -> LResult<Lowered> {
        // GEMMs and convolutions take any strides (cuBLAS transposes, cuDNN picks a layout)
        let any_layout = matches!(
            op,
            AtenOp::Mm | AtenOp::Bmm | AtenOp::Addmm | AtenOp::AddmmActivation | AtenOp::Convolution | AtenOp::ConvolutionBackward
        );
        let kind = ExternKind::Library { hazard: capture_hazard(op), exact_strides: !any_layout };
        self.extern_call(format!("torch.ops.{}", op.name()), kind)
    }

    /// A torch.library custom op: opaque to compilers by its contract (its kernel is the
    /// definition), so it is a library call like `mm`, not a fallback.
    pub(super) fn lower_custom_op(&mut self, name: &str) -> LResult<Lowered> {
        self.extern_call(format!("torch.ops.{name}"), ExternKind::Custom)
    }

    /// Runs the node's own ATen overload inside the wrapper; logged and counted.
    pub(super) fn fallback(&mut self, id: NodeId, reason: String) -> LResult<Lowered> {
        let node = self.graph.node(id);
        let NodeKind::Call { target, .. } = &node.kind else { return malformed("not a call") };
        let name = target.name().to_string();
        // the wrapper calls `torch.ops.<namespace>.<op>.<overload>`: only such names get there
        if !crate::graph::parse::is_op_name(&name) {
            return malformed(format!("cannot fall back on '{name}': {reason}"));
        }
        self.current = id;
        self.fallbacks.push(Fallback { node: node.name.clone(), target: name.clone(), reason: reason.clone() });
        self.extern_call(format!("torch.ops.{name}"), ExternKind::Fallback { reason })
    }

    pub(super) fn lower_cat(&mut self) -> LResult<TensorValue> {
        let out = self.out_meta()?.clone();
        let Some(Arg::List(items)) = self.arg(0, "tensors") else { return malformed("cat takes a list of tensors") };
        let rank = out.shape.len();
        let dim = norm_dim(self.int_arg(1, "dim")?.unwrap_or(0), rank)?;
        // a 4-D concatenation among channels-last convolutions is channels-last too: laid out
        // as eager's NCHW, the next kernel (GroupNorm, SiLU) read it with a stride of H*W per
        // channel while writing NHWC, 3x slower per element (UNet level, one CPU thread), and on
        // the GPU ATen copied it channels-last for the convolution reading it (26 us of 0.63 ms)
        let stride = if self.nhwc_value(&out.shape) {
            channels_last_strides(&out.shape)
        } else if is_dense(&out.shape, &out.stride) {
            out.stride.clone()
        } else {
            contiguous_strides(&out.shape)
        };
        let layout = Layout { size: out.shape.clone(), stride, offset: 0, dtype: out.dtype, device: out.device };
        let buf = self.prog.add_buffer(layout.clone(), BufferSource::Computed);
        let mut offset = 0i64;
        for it in items {
            let Arg::Node(n) = it else { return malformed("cat takes a list of tensors") };
            let tv = self.tensor_of(*n)?;
            // legacy: 1-D empty tensors are skipped whatever the rank
            if tv.size == [0] && rank != 1 {
                continue;
            }
            if tv.size.len() != rank || (0..rank).any(|d| d != dim && tv.size[d] != out.shape[d]) {
                return malformed(format!("cat input of shape {:?} does not fit output {:?} along dim {dim}", tv.size, out.shape));
            }
            let mut body = LoopBody::default();
            {
                let mut bx = Bx { body: &mut body, ranges: tv.size.clone() };
                let vars: Vec<IndexExpr> = (0..rank).map(|i| IndexExpr::var(Var(i as u32))).collect();
                let v = tv.load(&mut bx, &vars);
                let v = bx.body.cast(v, out.dtype);
                let mut oidx = vars.clone();
                oidx[dim] = oidx[dim].add_const(offset);
                bx.body.set_store(layout.index_of(&oidx), v);
            }
            offset += tv.size[dim];
            self.push_node(LoopNode {
                output: buf,
                ranges: tv.size.clone(),
                reduction_ranges: vec![],
                body,
                origins: vec![self.node_name()],
                template: None,
            });
        }
        if offset != out.shape[dim] {
            return malformed(format!("cat inputs sum to {offset} along dim {dim}, metadata says {}", out.shape[dim]));
        }
        Ok(view_of_layout(buf, &layout))
    }
}

/// What kind of ATen call an extern is, which decides how it is counted and whether a CUDA graph
/// may record it.
pub(super) enum ExternKind {
    /// A library call on purpose (docs/externs.md), with what keeps it out of CUDA graphs and
    /// whether its kernels need eager's strides.
    Library { hazard: Option<&'static str>, exact_strides: bool },
    /// A torch.library operator: opaque to compilers by contract; recorded in CUDA graphs like
    /// any GPU kernel, as Inductor does.
    Custom,
    /// An op without a lowering.
    Fallback { reason: String },
}

impl ExternKind {
    /// Whether the call's tensor arguments must have eager's strides.
    fn needs_eager_strides(&self) -> bool {
        match self {
            ExternKind::Library { exact_strides, .. } => *exact_strides,
            ExternKind::Custom | ExternKind::Fallback { .. } => true,
        }
    }
}

/// Why a library call must not be recorded in a CUDA graph: it reads device data on the host
/// (a result size, an error code) or may run on the host. Every other library call launches
/// device work only and replays correctly.
pub(super) fn capture_hazard(op: AtenOp) -> Option<&'static str> {
    use AtenOp::*;
    match op {
        Nonzero => Some("nonzero reads its result size on the host"),
        LinalgCheckErrors => Some("_linalg_check_errors reads LAPACK's error codes on the host"),
        Randperm => Some("randperm may draw the permutation on the host"),
        LinalgSvd
        | LinalgQr
        | LinalgSlogdet
        | LinalgDet
        | LinalgEigh
        | LinalgEig
        | LinalgEigvals
        | LinalgCholeskyEx
        | LinalgInvEx
        | LinalgSolveEx
        | LinalgLu
        | LinalgLuFactorEx
        | LinalgLuSolve
        | TriangularSolve
        | LinalgSolveTriangular
        | LinalgHouseholderProduct
        | Geqrf
        | LinalgPinv
        | CholeskySolve
        | CholeskyInverse
        | LinalgLdlFactorEx
        | LinalgLdlSolve
        | Ormqr
        | LinalgMatrixExp => Some("a cuSOLVER/MAGMA factorization may synchronize with the host"),
        _ => None,
    }
}

fn loader_of(tv: &TensorValue) -> LoadFn {
    let t = tv.clone();
    Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| t.load(bx, idx))
}

/// A constant argument as the wrapper will write it (lists are `ExternArg::List`s).
fn literal_of(a: &Arg) -> Literal {
    match a {
        Arg::None | Arg::Node(_) | Arg::List(_) => Literal::None,
        Arg::Int(i) => Literal::Int(*i),
        Arg::Float(f) => Literal::Float(*f),
        Arg::Bool(b) => Literal::Bool(*b),
        Arg::Str(s) => Literal::Str(s.clone()),
        Arg::DType(d) => Literal::DType(*d),
        Arg::Device(d) => Literal::Device(*d),
        Arg::Layout(l) => Literal::Layout(l.clone()),
        Arg::MemoryFormat(m) => Literal::MemoryFormat(m.clone()),
    }
}

/// Ops outside torch's own namespaces (`aten`, `prims`, `prim`) are custom ops registered
/// through torch.library: user or library kernels that compilers call, never trace into.
pub(super) fn is_custom_op(name: &str) -> bool {
    let namespace = name.split('.').next().unwrap_or("");
    !matches!(namespace, "aten" | "prims" | "prim")
}
