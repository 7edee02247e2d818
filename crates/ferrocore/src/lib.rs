//! ferrocore: a deep-learning compiler core. The modules follow the pipeline, top to bottom;
//! each depends only on the ones above it (see ARCHITECTURE.md).
pub mod symbolic;
pub mod graph;
pub mod loop_ir;
pub mod lowering;
pub mod scheduler;
pub mod codegen;
pub mod wrapper;
pub mod runtime;
pub mod report;
pub mod driver;
pub mod min_cut;
