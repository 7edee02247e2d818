//! Element types and devices as the graph names them, with PyTorch's type-promotion rules.

use std::fmt;

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub enum DType {
    Bool,
    U8,
    I8,
    I16,
    I32,
    I64,
    F16,
    BF16,
    F32,
    F64,
    /// Known to torch, not compiled by ferrocore: nodes touching these fall back to ATen, and
    /// library calls pass them along (attention's uint64 RNG state).
    U16,
    U32,
    U64,
    /// complex32 (chalf): two float16 halves; moved as complex64 values, rounded on store.
    C32,
    C64,
    C128,
    Float8(Float8Kind),
}

/// The float8 formats torch names (each is its own dtype: converting between them is not free).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub enum Float8Kind {
    E4M3Fn,
    E5M2,
    E4M3FnUz,
    E5M2FnUz,
    E8M0Fnu,
}

impl Float8Kind {
    const ALL: [(Float8Kind, &'static str); 5] = [
        (Float8Kind::E4M3Fn, "float8_e4m3fn"),
        (Float8Kind::E5M2, "float8_e5m2"),
        (Float8Kind::E4M3FnUz, "float8_e4m3fnuz"),
        (Float8Kind::E5M2FnUz, "float8_e5m2fnuz"),
        (Float8Kind::E8M0Fnu, "float8_e8m0fnu"),
    ];
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, PartialOrd, Ord)]
pub enum Category {
    Bool,
    Int,
    Float,
    Complex,
}

impl DType {
    /// Every dtype the exchange format names (the front refuses a graph with any other).
    pub fn all() -> Vec<DType> {
        use DType::*;
        let plain = [Bool, U8, I8, I16, I32, I64, F16, BF16, F32, F64, U16, U32, U64, C32, C64, C128];
        plain.into_iter().chain(Float8Kind::ALL.iter().map(|(k, _)| Float8(*k))).collect()
    }

    pub fn parse(s: &str) -> Option<DType> {
        Some(match s {
            "bool" => DType::Bool,
            "uint8" => DType::U8,
            "uint16" => DType::U16,
            "uint32" => DType::U32,
            "uint64" => DType::U64,
            "int8" => DType::I8,
            "int16" => DType::I16,
            "int32" => DType::I32,
            "int64" => DType::I64,
            "float16" => DType::F16,
            "bfloat16" => DType::BF16,
            "float32" => DType::F32,
            "float64" => DType::F64,
            "complex32" => DType::C32,
            "complex64" => DType::C64,
            "complex128" => DType::C128,
            s => match Float8Kind::ALL.iter().find(|(_, n)| *n == s) {
                Some((k, _)) => DType::Float8(*k),
                None => return None,
            },
        })
    }
    pub fn torch_name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "uint8",
            DType::U16 => "uint16",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::C32 => "complex32",
            DType::C64 => "complex64",
            DType::C128 => "complex128",
            DType::Float8(k) => Float8Kind::ALL.iter().find(|(x, _)| *x == k).map_or("float8_e4m3fn", |(_, n)| n),
        }
    }
    pub fn category(self) -> Category {
        match self {
            DType::Bool => Category::Bool,
            DType::U8 | DType::I8 | DType::I16 | DType::I32 | DType::I64 | DType::U16 | DType::U32 | DType::U64 => Category::Int,
            DType::F16 | DType::BF16 | DType::F32 | DType::F64 | DType::Float8(_) => Category::Float,
            DType::C32 | DType::C64 | DType::C128 => Category::Complex,
        }
    }
    pub fn is_float(self) -> bool {
        self.category() == Category::Float
    }
    pub fn is_integral(self) -> bool {
        matches!(self.category(), Category::Int | Category::Bool)
    }
    /// Whether generated kernels can load, compute and store this type.
    pub fn is_compilable(self) -> bool {
        !matches!(self, DType::C32 | DType::C64 | DType::C128 | DType::Float8(_) | DType::U16 | DType::U32 | DType::U64)
    }
    /// Whether generated kernels can move this type (load, store, convert, conjugate) without
    /// computing on it: complex values in copies, views, pads and concatenations.
    pub fn is_movable(self) -> bool {
        self.is_compilable() || self.is_complex()
    }
    pub fn is_complex(self) -> bool {
        self.category() == Category::Complex
    }
    pub fn itemsize(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 | DType::Float8(_) => 1,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 | DType::C32 => 4,
            DType::I64 | DType::U64 | DType::F64 | DType::C64 => 8,
            DType::C128 => 16,
        }
    }
    /// Smallest and largest value of an integer type (bool: 0 and 1).
    pub fn int_range(self) -> (i64, i64) {
        match self {
            DType::Bool => (0, 1),
            DType::U8 => (0, u8::MAX as i64),
            DType::I8 => (i8::MIN as i64, i8::MAX as i64),
            DType::I16 => (i16::MIN as i64, i16::MAX as i64),
            DType::I32 => (i32::MIN as i64, i32::MAX as i64),
            DType::U16 => (0, u16::MAX as i64),
            DType::U32 => (0, u32::MAX as i64),
            _ => (i64::MIN, i64::MAX),
        }
    }
    /// The type arithmetic happens in: half types compute in float32.
    pub fn compute(self) -> DType {
        match self {
            DType::F16 | DType::BF16 => DType::F32,
            DType::C32 => DType::C64,
            d => d,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.torch_name())
    }
}

/// torch.promote_types for two tensor dtypes.
pub fn promote_types(a: DType, b: DType) -> DType {
    use DType::*;
    if a == b {
        return a;
    }
    let (ca, cb) = (a.category(), b.category());
    if ca != cb {
        return if ca > cb { a } else { b };
    }
    match ca {
        Category::Bool => Bool,
        Category::Int => {
            // uint8 with a signed int type promotes to the next signed type that holds both.
            let rank = |d: DType| match d {
                I8 => 1,
                I16 => 2,
                I32 => 3,
                I64 => 4,
                _ => 0,
            };
            if a == U8 || b == U8 {
                let other = if a == U8 { b } else { a };
                return if other == I8 { I16 } else { other };
            }
            if rank(a) >= rank(b) {
                a
            } else {
                b
            }
        }
        Category::Float => {
            if (a == F16 && b == BF16) || (a == BF16 && b == F16) {
                return F32;
            }
            let rank = |d: DType| match d {
                Float8(_) => 0,
                F16 | BF16 => 1,
                F32 => 2,
                _ => 3,
            };
            if rank(a) >= rank(b) {
                a
            } else {
                b
            }
        }
        Category::Complex => {
            if a == C128 || b == C128 {
                C128
            } else if a == C32 && b == C32 {
                C32
            } else {
                C64
            }
        }
    }
}

/// An operand of an elementwise op for result-type computation: a tensor (dimensioned or 0-d)
/// or a Python scalar, with PyTorch's priority dimensioned > 0-d > scalar within a category.
#[derive(Clone, Copy, Debug)]
pub enum Operand {
    Tensor { dtype: DType, zero_dim: bool },
    Scalar(Category),
}

/// torch's elementwise result type (`torch.result_type` over the operands).
pub fn result_type(ops: &[Operand]) -> DType {
    let mut dim: Option<DType> = None;
    let mut zero: Option<DType> = None;
    let mut scalar: Option<Category> = None;
    for op in ops {
        match *op {
            Operand::Tensor { dtype, zero_dim: false } => dim = Some(dim.map_or(dtype, |d| promote_types(d, dtype))),
            Operand::Tensor { dtype, zero_dim: true } => zero = Some(zero.map_or(dtype, |d| promote_types(d, dtype))),
            Operand::Scalar(c) => scalar = Some(scalar.map_or(c, |s| s.max(c))),
        }
    }
    let default_of = |c: Category| match c {
        Category::Bool => DType::Bool,
        Category::Int => DType::I64,
        Category::Float => DType::F32,
        Category::Complex => DType::C64,
    };
    let mut result = match (dim, zero) {
        (Some(d), Some(z)) => {
            if z.category() > d.category() {
                promote_types_cat(d, z)
            } else {
                d
            }
        }
        (Some(d), None) => d,
        (None, Some(z)) => z,
        (None, None) => return default_of(scalar.unwrap_or(Category::Int)),
    };
    if let Some(c) = scalar {
        if c > result.category() {
            result = default_of(c);
        }
    }
    result
}

// A higher-category 0-d tensor lifts the result to its own dtype (e.g. int tensor + 0-d float).
fn promote_types_cat(_dim: DType, zero: DType) -> DType {
    zero
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Device {
    Cpu,
    Cuda(u32),
}

impl Device {
    pub fn parse(s: &str) -> Option<Device> {
        if s == "cpu" {
            return Some(Device::Cpu);
        }
        if s == "cuda" {
            return Some(Device::Cuda(0));
        }
        s.strip_prefix("cuda:").and_then(|i| i.parse().ok()).map(Device::Cuda)
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}
