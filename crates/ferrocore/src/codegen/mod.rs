//! Code generation: the backend interface and what every backend shares. A backend turns the
//! schedule's fused kernels into one source unit plus, per kernel, the buffers it takes in order;
//! the wrapper then launches them. Backends never import each other.

pub mod cpp;

use crate::loop_ir::BufferId;
use crate::scheduler::Schedule;
use std::fmt;

/// A kernel's entry point and the buffers it takes, in parameter order.
#[derive(Clone, Debug)]
pub struct KernelLaunch {
    pub name: String,
    pub args: Vec<BufferId>,
    /// The kernel reports out-of-range gather indices through its return value.
    pub checks_indices: bool,
}

#[derive(Clone, Debug)]
pub struct RenderedKernels {
    /// Language of the source, e.g. "cpp".
    pub language: &'static str,
    pub source: String,
    /// One entry per `Item::Kernel` of the schedule, in order.
    pub launches: Vec<KernelLaunch>,
}

#[derive(Debug, Clone)]
pub struct CodegenError {
    pub kernel: String,
    pub message: String,
}

impl fmt::Display for CodegenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "codegen: kernel '{}': {}", self.kernel, self.message)
    }
}
impl std::error::Error for CodegenError {}

/// One interface for kernel backends; C++ today, Triton next.
pub trait KernelBackend {
    fn name(&self) -> &'static str;
    fn render(&self, schedule: &Schedule) -> Result<RenderedKernels, CodegenError>;
}
