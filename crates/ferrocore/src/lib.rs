//! ferrocore: a deep-learning compiler core. The modules follow the pipeline, top to bottom;
//! each depends only on the ones above it (see ARCHITECTURE.md).
pub mod artifact;
pub mod codegen;
pub mod driver;
pub mod graph;
pub mod joint;
pub mod loop_ir;
pub mod lowering;
pub mod min_cut;
pub mod report;
pub mod rewrite;
pub mod runtime;
pub mod scheduler;
pub mod symbolic;
pub mod wrapper;
