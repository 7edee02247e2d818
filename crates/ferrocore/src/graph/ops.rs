//! The closed set of ATen overloads ferrocore knows by name. Anything else imports as
//! `Target::Unknown` and is run through ATen by the wrapper (a logged fallback).

macro_rules! aten_ops {
    ($($variant:ident => $name:literal, $min:literal..=$max:literal;)*) => {
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
        pub enum AtenOp { $($variant),* }

        impl AtenOp {
            pub fn parse(name: &str) -> Option<AtenOp> {
                match name { $($name => Some(AtenOp::$variant),)* _ => None }
            }
            pub fn name(self) -> &'static str {
                match self { $(AtenOp::$variant => $name),* }
            }
            /// Accepted number of positional arguments (kwargs fill the rest).
            pub fn arity(self) -> (usize, usize) {
                match self { $(AtenOp::$variant => ($min, $max)),* }
            }
        }
    };
}

aten_ops! {
    // unary pointwise
    Abs => "aten.abs.default", 1..=1;
    Neg => "aten.neg.default", 1..=1;
    Exp => "aten.exp.default", 1..=1;
    Exp2 => "aten.exp2.default", 1..=1;
    Expm1 => "aten.expm1.default", 1..=1;
    Log => "aten.log.default", 1..=1;
    Log2 => "aten.log2.default", 1..=1;
    Log10 => "aten.log10.default", 1..=1;
    Log1p => "aten.log1p.default", 1..=1;
    Sqrt => "aten.sqrt.default", 1..=1;
    Rsqrt => "aten.rsqrt.default", 1..=1;
    Sin => "aten.sin.default", 1..=1;
    Cos => "aten.cos.default", 1..=1;
    Tan => "aten.tan.default", 1..=1;
    Asin => "aten.asin.default", 1..=1;
    Acos => "aten.acos.default", 1..=1;
    Atan => "aten.atan.default", 1..=1;
    Sinh => "aten.sinh.default", 1..=1;
    Cosh => "aten.cosh.default", 1..=1;
    Tanh => "aten.tanh.default", 1..=1;
    Asinh => "aten.asinh.default", 1..=1;
    Acosh => "aten.acosh.default", 1..=1;
    Atanh => "aten.atanh.default", 1..=1;
    Sigmoid => "aten.sigmoid.default", 1..=1;
    Relu => "aten.relu.default", 1..=1;
    Erf => "aten.erf.default", 1..=1;
    Erfc => "aten.erfc.default", 1..=1;
    Lgamma => "aten.lgamma.default", 1..=1;
    Conj => "aten._conj.default", 1..=1;
    ConjPhysical => "aten._conj_physical.default", 1..=1;
    ViewAsReal => "aten.view_as_real.default", 1..=1;
    SpecialErfcx => "aten.special_erfcx.default", 1..=1;
    Floor => "aten.floor.default", 1..=1;
    Ceil => "aten.ceil.default", 1..=1;
    Round => "aten.round.default", 1..=1;
    Trunc => "aten.trunc.default", 1..=1;
    Sign => "aten.sign.default", 1..=1;
    Reciprocal => "aten.reciprocal.default", 1..=1;
    BitwiseNot => "aten.bitwise_not.default", 1..=1;
    LogicalNot => "aten.logical_not.default", 1..=1;
    IsNan => "aten.isnan.default", 1..=1;
    IsInf => "aten.isinf.default", 1..=1;
    Gelu => "aten.gelu.default", 1..=1;
    Silu => "aten.silu.default", 1..=1;
    // binary pointwise
    AddTensor => "aten.add.Tensor", 2..=2;
    AddScalar => "aten.add.Scalar", 2..=2;
    SubTensor => "aten.sub.Tensor", 2..=2;
    SubScalar => "aten.sub.Scalar", 2..=2;
    RsubScalar => "aten.rsub.Scalar", 2..=2;
    MulTensor => "aten.mul.Tensor", 2..=2;
    MulScalar => "aten.mul.Scalar", 2..=2;
    DivTensor => "aten.div.Tensor", 2..=2;
    DivScalar => "aten.div.Scalar", 2..=2;
    DivTensorMode => "aten.div.Tensor_mode", 2..=3;
    DivScalarMode => "aten.div.Scalar_mode", 2..=3;
    PowTensorTensor => "aten.pow.Tensor_Tensor", 2..=2;
    PowTensorScalar => "aten.pow.Tensor_Scalar", 2..=2;
    PowScalar => "aten.pow.Scalar", 2..=2;
    Maximum => "aten.maximum.default", 2..=2;
    Minimum => "aten.minimum.default", 2..=2;
    FmodTensor => "aten.fmod.Tensor", 2..=2;
    FmodScalar => "aten.fmod.Scalar", 2..=2;
    RemainderTensor => "aten.remainder.Tensor", 2..=2;
    RemainderScalar => "aten.remainder.Scalar", 2..=2;
    Atan2 => "aten.atan2.default", 2..=2;
    EqTensor => "aten.eq.Tensor", 2..=2;
    EqScalar => "aten.eq.Scalar", 2..=2;
    NeTensor => "aten.ne.Tensor", 2..=2;
    NeScalar => "aten.ne.Scalar", 2..=2;
    LtTensor => "aten.lt.Tensor", 2..=2;
    LtScalar => "aten.lt.Scalar", 2..=2;
    LeTensor => "aten.le.Tensor", 2..=2;
    LeScalar => "aten.le.Scalar", 2..=2;
    GtTensor => "aten.gt.Tensor", 2..=2;
    GtScalar => "aten.gt.Scalar", 2..=2;
    GeTensor => "aten.ge.Tensor", 2..=2;
    GeScalar => "aten.ge.Scalar", 2..=2;
    LogicalAnd => "aten.logical_and.default", 2..=2;
    LogicalOr => "aten.logical_or.default", 2..=2;
    LogicalXor => "aten.logical_xor.default", 2..=2;
    BitwiseAndTensor => "aten.bitwise_and.Tensor", 2..=2;
    BitwiseAndScalar => "aten.bitwise_and.Scalar", 2..=2;
    BitwiseOrTensor => "aten.bitwise_or.Tensor", 2..=2;
    BitwiseOrScalar => "aten.bitwise_or.Scalar", 2..=2;
    BitwiseXorTensor => "aten.bitwise_xor.Tensor", 2..=2;
    BitwiseXorScalar => "aten.bitwise_xor.Scalar", 2..=2;
    LshiftTensor => "aten.__lshift__.Tensor", 2..=2;
    LshiftScalar => "aten.__lshift__.Scalar", 2..=2;
    RshiftTensor => "aten.__rshift__.Tensor", 2..=2;
    RshiftScalar => "aten.__rshift__.Scalar", 2..=2;
    BitwiseLeftShift => "aten.bitwise_left_shift.Tensor", 2..=2;
    BitwiseRightShift => "aten.bitwise_right_shift.Tensor", 2..=2;
    // ternary and friends
    WhereSelf => "aten.where.self", 3..=3;
    Fma => "prims.fma.default", 3..=3;
    Clamp => "aten.clamp.default", 1..=3;
    ClampTensor => "aten.clamp.Tensor", 1..=3;
    ClampMin => "aten.clamp_min.default", 2..=2;
    ClampMax => "aten.clamp_max.default", 2..=2;
    Hardtanh => "aten.hardtanh.default", 1..=3;
    // copies and casts
    ToCopy => "aten._to_copy.default", 1..=1;
    Clone => "aten.clone.default", 1..=1;
    Copy => "aten.copy.default", 2..=3;
    CopyInto => "aten.copy_.default", 2..=3;
    LiftFreshCopy => "aten.lift_fresh_copy.default", 1..=1;
    // creation
    Full => "aten.full.default", 2..=2;
    FullLike => "aten.full_like.default", 2..=2;
    ScalarTensor => "aten.scalar_tensor.default", 1..=1;
    ArangeStartStep => "aten.arange.start_step", 2..=3;
    ArangeStart => "aten.arange.start", 2..=2;
    Arange => "aten.arange.default", 1..=1;
    Linspace => "aten.linspace.default", 3..=3;
    LinspaceTensorTensor => "aten.linspace.Tensor_Tensor", 3..=3;
    LinspaceTensorScalar => "aten.linspace.Tensor_Scalar", 3..=3;
    LinspaceScalarTensor => "aten.linspace.Scalar_Tensor", 3..=3;
    Logspace => "aten.logspace.default", 3..=4;
    LogspaceTensorTensor => "aten.logspace.Tensor_Tensor", 3..=4;
    LogspaceTensorScalar => "aten.logspace.Tensor_Scalar", 3..=4;
    LogspaceScalarTensor => "aten.logspace.Scalar_Tensor", 3..=4;
    FillScalar => "aten.fill.Scalar", 2..=2;
    // reductions
    SumDimIntList => "aten.sum.dim_IntList", 1..=3;
    SumDefault => "aten.sum.default", 1..=1;
    MeanDim => "aten.mean.dim", 1..=3;
    MeanDefault => "aten.mean.default", 1..=1;
    Amax => "aten.amax.default", 1..=3;
    Amin => "aten.amin.default", 1..=3;
    VarCorrection => "aten.var.correction", 1..=2;
    VarMeanCorrection => "aten.var_mean.correction", 1..=2;
    ProdDefault => "aten.prod.default", 1..=1;
    ProdDimInt => "aten.prod.dim_int", 2..=3;
    AnyDefault => "aten.any.default", 1..=1;
    AnyDim => "aten.any.dim", 2..=3;
    AnyDims => "aten.any.dims", 1..=3;
    MaxDefault => "aten.max.default", 1..=1;
    MinDefault => "aten.min.default", 1..=1;
    Argmax => "aten.argmax.default", 1..=3;
    Argmin => "aten.argmin.default", 1..=3;
    MaxDim => "aten.max.dim", 2..=3;
    MinDim => "aten.min.dim", 2..=3;
    Softmax => "aten._softmax.default", 3..=3;
    LogSoftmax => "aten._log_softmax.default", 3..=3;
    NativeLayerNorm => "aten.native_layer_norm.default", 5..=5;
    NativeLayerNormBackward => "aten.native_layer_norm_backward.default", 8..=8;
    BatchNormNoTraining => "aten._native_batch_norm_legit_no_training.default", 7..=7;
    BatchNormNoStats => "aten._native_batch_norm_legit.no_stats", 6..=6;
    Trilinear => "aten._trilinear.default", 7..=8;
    NativeGroupNormBackward => "aten.native_group_norm_backward.default", 10..=10;
    BatchNormLegit => "aten._native_batch_norm_legit.default", 8..=8;
    BatchNormFunctional => "aten._native_batch_norm_legit_functional.default", 8..=8;
    NativeGroupNorm => "aten.native_group_norm.default", 8..=8;
    UpsampleNearest2d => "aten.upsample_nearest2d.vec", 2..=3;
    UpsampleBilinear2dVec => "aten.upsample_bilinear2d.vec", 4..=4;
    UpsampleBilinear2d => "aten.upsample_bilinear2d.default", 3..=5;
    GridSampler2d => "aten.grid_sampler_2d.default", 5..=5;
    CudnnGridSampler => "aten.cudnn_grid_sampler.default", 2..=2;
    GridSampler3d => "aten.grid_sampler_3d.default", 5..=5;
    Col2im => "aten.col2im.default", 6..=6;
    AvgPool2d => "aten.avg_pool2d.default", 2..=7;
    MaxPool2dWithIndices => "aten.max_pool2d_with_indices.default", 2..=6;
    AdaptiveAvgPool2d => "aten._adaptive_avg_pool2d.default", 2..=2;
    AvgPool3d => "aten.avg_pool3d.default", 2..=7;
    MaxPool3dWithIndices => "aten.max_pool3d_with_indices.default", 2..=6;
    // max pooling whose argmax is the int8 offset within the window (what a training graph
    // saves), and the conversion of such offsets back to indices within the input plane
    MaxPoolWithOffsets => "prims._low_memory_max_pool_with_offsets.default", 6..=6;
    MaxPoolOffsetsToIndices => "prims._low_memory_max_pool_offsets_to_indices.default", 6..=6;
    AdaptiveAvgPool3d => "aten._adaptive_avg_pool3d.default", 2..=2;
    AdaptiveMaxPool2d => "aten.adaptive_max_pool2d.default", 2..=2;
    AdaptiveMaxPool3d => "aten.adaptive_max_pool3d.default", 2..=2;
    FractionalMaxPool2d => "aten.fractional_max_pool2d.default", 4..=4;
    FractionalMaxPool3d => "aten.fractional_max_pool3d.default", 4..=4;
    AvgPool2dBackward => "aten.avg_pool2d_backward.default", 8..=8;
    AdaptiveAvgPool2dBackward => "aten._adaptive_avg_pool2d_backward.default", 2..=2;
    AdaptiveAvgPool3dBackward => "aten._adaptive_avg_pool3d_backward.default", 2..=2;
    AvgPool3dBackward => "aten.avg_pool3d_backward.default", 8..=8;
    // views
    View => "aten.view.default", 2..=2;
    UnsafeView => "aten._unsafe_view.default", 2..=2;
    Reshape => "aten.reshape.default", 2..=2;
    Permute => "aten.permute.default", 2..=2;
    Expand => "aten.expand.default", 2..=3;
    Unsqueeze => "aten.unsqueeze.default", 2..=2;
    SqueezeDim => "aten.squeeze.dim", 2..=2;
    SqueezeDims => "aten.squeeze.dims", 2..=2;
    Squeeze => "aten.squeeze.default", 1..=1;
    SliceTensor => "aten.slice.Tensor", 1..=5;
    SelectInt => "aten.select.int", 3..=3;
    TransposeInt => "aten.transpose.int", 3..=3;
    T => "aten.t.default", 1..=1;
    Alias => "aten.alias.default", 1..=1;
    Diagonal => "aten.diagonal.default", 1..=4;
    Unfold => "aten.unfold.default", 4..=4;
    SplitWithSizes => "aten.split_with_sizes.default", 2..=3;
    SplitTensor => "aten.split.Tensor", 2..=3;
    Cat => "aten.cat.default", 1..=2;
    AsStridedScatter => "aten.as_strided_scatter.default", 4..=5;
    Histc => "aten.histc.default", 1..=4;
    // extern calls (library kernels through ATen)
    Mm => "aten.mm.default", 2..=2;
    Bmm => "aten.bmm.default", 2..=2;
    Addmm => "aten.addmm.default", 3..=3;
    AddmmActivation => "aten._addmm_activation.default", 3..=6;
    Convolution => "aten.convolution.default", 9..=9;
    ConvolutionBackward => "aten.convolution_backward.default", 11..=11;
    Sort => "aten.sort.default", 1..=3;
    SortStable => "aten.sort.stable", 1..=4;
    Topk => "aten.topk.default", 2..=5;
    Randperm => "aten.randperm.default", 1..=1;
    FftR2c => "aten._fft_r2c.default", 4..=4;
    FftC2r => "aten._fft_c2r.default", 4..=4;
    CdistForward => "aten._cdist_forward.default", 4..=4;
    PdistForward => "aten._pdist_forward.default", 2..=2;
    EmbeddingBag => "aten._embedding_bag.default", 2..=9;
    // LAPACK-backed linear algebra, complex FFTs and binary search: library calls too
    FftC2c => "aten._fft_c2c.default", 4..=4;
    Nonzero => "aten.nonzero.default", 1..=1;
    FlashAttentionCpu => "aten._scaled_dot_product_flash_attention_for_cpu.default", 3..=5;
    FlashAttentionCpuBackward => "aten._scaled_dot_product_flash_attention_for_cpu_backward.default", 8..=8;
    // scaled-dot-product attention on GPUs: flash, memory-efficient, cuDNN and the backend hook
    FlashAttention => "aten._scaled_dot_product_flash_attention.default", 3..=6;
    FlashAttentionBackward => "aten._scaled_dot_product_flash_attention_backward.default", 14..=14;
    EfficientAttention => "aten._scaled_dot_product_efficient_attention.default", 5..=7;
    EfficientAttentionBackward => "aten._scaled_dot_product_efficient_attention_backward.default", 11..=12;
    CudnnAttention => "aten._scaled_dot_product_cudnn_attention.default", 5..=8;
    CudnnAttentionBackward => "aten._scaled_dot_product_cudnn_attention_backward.default", 15..=15;
    FusedAttention => "aten._scaled_dot_product_fused_attention_overrideable.default", 3..=7;
    FusedAttentionBackward => "aten._scaled_dot_product_fused_attention_overrideable_backward.default", 16..=16;
    GroupedMm => "aten._grouped_mm.default", 2..=5;
    TransformerEncoderLayer => "aten._transformer_encoder_layer_fwd.default", 18..=20;
    Searchsorted => "aten.searchsorted.Tensor", 2..=2;
    SearchsortedScalar => "aten.searchsorted.Scalar", 2..=2;
    LinalgSvd => "aten._linalg_svd.default", 1..=3;
    LinalgQr => "aten.linalg_qr.default", 1..=2;
    LinalgSlogdet => "aten._linalg_slogdet.default", 1..=1;
    LinalgDet => "aten._linalg_det.default", 1..=1;
    LinalgEigh => "aten._linalg_eigh.default", 1..=3;
    LinalgEig => "aten.linalg_eig.default", 1..=1;
    LinalgEigvals => "aten._linalg_eigvals.default", 1..=1;
    LinalgCholeskyEx => "aten.linalg_cholesky_ex.default", 1..=1;
    LinalgInvEx => "aten.linalg_inv_ex.default", 1..=1;
    LinalgSolveEx => "aten._linalg_solve_ex.default", 2..=2;
    LinalgLu => "aten.linalg_lu.default", 1..=1;
    LinalgLuFactorEx => "aten.linalg_lu_factor_ex.default", 1..=1;
    LinalgLuSolve => "aten.linalg_lu_solve.default", 3..=3;
    TriangularSolve => "aten.triangular_solve.default", 2..=5;
    LinalgSolveTriangular => "aten.linalg_solve_triangular.default", 2..=2;
    LinalgHouseholderProduct => "aten.linalg_householder_product.default", 2..=2;
    Geqrf => "aten.geqrf.default", 1..=1;
    LinalgPinv => "aten.linalg_pinv.atol_rtol_tensor", 1..=1;
    CholeskySolve => "aten.cholesky_solve.default", 2..=3;
    CholeskyInverse => "aten.cholesky_inverse.default", 1..=2;
    LinalgLdlFactorEx => "aten.linalg_ldl_factor_ex.default", 1..=1;
    LinalgLdlSolve => "aten.linalg_ldl_solve.default", 3..=3;
    Ormqr => "aten.ormqr.default", 3..=5;
    LinalgMatrixExp => "aten.linalg_matrix_exp.default", 1..=1;
    LinalgCheckErrors => "aten._linalg_check_errors.default", 2..=2;
    AssertAsync => "aten._assert_async.default", 1..=1;
    AssertAsyncMsg => "aten._assert_async.msg", 2..=2;
    // pointwise with parameters
    Elu => "aten.elu.default", 1..=4;
    LeakyRelu => "aten.leaky_relu.default", 1..=2;
    // data movement expressible as index maps
    Flip => "aten.flip.default", 2..=2;
    Repeat => "aten.repeat.default", 2..=2;
    AsStrided => "aten.as_strided.default", 3..=4;
    VarDim => "aten.var.dim", 1..=3;
    Cumsum => "aten.cumsum.default", 2..=2;
    // random: counter-based streams seeded from torch's default generator
    Rand => "aten.rand.default", 1..=1;
    Randn => "aten.randn.default", 1..=1;
    RandLike => "aten.rand_like.default", 1..=1;
    RandnLike => "aten.randn_like.default", 1..=1;
    BernoulliP => "aten.bernoulli.p", 1..=2;
    RreluWithNoise => "aten.rrelu_with_noise_functional.default", 2..=6;
    NativeDropout => "aten.native_dropout.default", 3..=3;
    Cumprod => "aten.cumprod.default", 2..=2;
    // indexing: gathers through indices computed at run time
    Embedding => "aten.embedding.default", 2..=5;
    IndexSelect => "aten.index_select.default", 3..=3;
    Gather => "aten.gather.default", 3..=4;
    IndexTensor => "aten.index.Tensor", 2..=2;
    ConstantPadNd => "aten.constant_pad_nd.default", 2..=3;
    ReflectionPad1d => "aten.reflection_pad1d.default", 2..=2;
    ReflectionPad2d => "aten.reflection_pad2d.default", 2..=2;
    ReflectionPad3d => "aten.reflection_pad3d.default", 2..=2;
    ReplicationPad2d => "aten.replication_pad2d.default", 2..=2;
    ReplicationPad3d => "aten.replication_pad3d.default", 2..=2;
    SelectScatter => "aten.select_scatter.default", 4..=4;
    SliceScatter => "aten.slice_scatter.default", 2..=6;
    // scatters: indirect stores into a copy of the destination
    ScatterSrc => "aten.scatter.src", 4..=4;
    ScatterValue => "aten.scatter.value", 4..=4;
    ScatterReduce => "aten.scatter.reduce", 4..=5;
    ScatterValueReduce => "aten.scatter.value_reduce", 4..=5;
    ScatterAdd => "aten.scatter_add.default", 4..=4;
    ScatterReduceTwo => "aten.scatter_reduce.two", 5..=6;
    IndexPut => "aten.index_put.default", 3..=4;
    MaskedScatter => "aten.masked_scatter.default", 3..=3;
    NonzeroStatic => "aten.nonzero_static.default", 1..=1;
    MaxPool2dWithIndicesBackward => "aten.max_pool2d_with_indices_backward.default", 8..=8;
    MaxPool3dWithIndicesBackward => "aten.max_pool3d_with_indices_backward.default", 8..=8;
    EmbeddingDenseBackward => "aten.embedding_dense_backward.default", 5..=5;
    EmptyMemoryFormat => "aten.empty.memory_format", 1..=1;
    EmptyStrided => "aten.empty_strided.default", 2..=2;
    EmptyPermuted => "aten.empty_permuted.default", 2..=2;
}
