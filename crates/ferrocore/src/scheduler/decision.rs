//! The scheduler's decisions as records: fusion's are typed (which buffer, which kernel, why,
//! the numbers), so that the log, the compile report and tests read them without parsing text;
//! what the rewrites and the later steps (order, storage, in place) decided is their own words.

use std::fmt::Write;

/// A kernel of the schedule: its position among the schedule's kernels (`Schedule::kernels`).
/// While fusion is deciding, the position of its slot among kernels and library calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelId(pub usize);

/// Why a node did not join a kernel.
#[derive(Clone, Debug, PartialEq)]
pub enum Rejection {
    /// The kernel would take more buffers than a kernel may (`MAX_KERNEL_BUFFERS`).
    TooManyBuffers(usize),
    /// The kernel's plan cannot take the node (its loops, its order of reads and writes).
    Plan(String),
    /// A large graph output would live beside a large temporary of the kernel.
    PeakMemory,
}

/// Why a node starts a kernel of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NewKernelReason {
    SharesNothing,
    EveryFusionRejected,
    /// A matrix product (`Template::MatrixProduct`, `Template::Convolution`) heads a kernel of its own: its template tiles
    /// the kernel by its outputs.
    MatrixProduct,
    /// A fused attention (`Template::Attention`) is a kernel of its own.
    Attention,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// A rewrite before fusion, in its own words (`scheduler::program_passes`).
    Rewrite(String),
    /// A scatter updates its buffer at computed indices: a kernel of its own.
    Scatter { buffer: String },
    /// `buffer` joins `kernel`, whose members are `with`, sharing `shared_bytes` with it (0: small
    /// kernels side by side, for one launch).
    Fuse { buffer: String, kernel: KernelId, with: String, shared_bytes: i64 },
    /// `buffer` does not join `kernel`; `side_by_side`: it shares no data with it.
    NoFusion { buffer: String, kernel: KernelId, side_by_side: bool, reason: Rejection },
    /// `buffer` starts `kernel`.
    NewKernel { buffer: String, kernel: KernelId, reason: NewKernelReason },
    /// A step after fusion (order, storage, in place), in its own words.
    Placement(String),
}

impl Decision {
    /// The kernel the decision is about, if it is a fusion decision.
    pub fn kernel(&self) -> Option<KernelId> {
        match self {
            Decision::Fuse { kernel, .. } | Decision::NoFusion { kernel, .. } | Decision::NewKernel { kernel, .. } => Some(*kernel),
            Decision::Rewrite(_) | Decision::Scatter { .. } | Decision::Placement(_) => None,
        }
    }

    /// The same decision about the kernel `renumber` maps its kernel to.
    pub fn renumbered(mut self, renumber: impl Fn(KernelId) -> KernelId) -> Decision {
        if let Decision::Fuse { kernel, .. } | Decision::NoFusion { kernel, .. } | Decision::NewKernel { kernel, .. } = &mut self {
            *kernel = renumber(*kernel);
        }
        self
    }

    /// The decision as one line, its kernel written by `kernel` (its name, a link).
    pub fn describe(&self, kernel: &dyn Fn(KernelId) -> String) -> String {
        let mut s = String::new();
        let _ = match self {
            Decision::Rewrite(text) | Decision::Placement(text) => write!(s, "{text}"),
            Decision::Scatter { buffer } => write!(s, "scatter: {buffer} updates its buffer at computed indices; a kernel of its own"),
            Decision::Fuse { buffer, kernel: k, with, shared_bytes: 0 } => {
                write!(s, "fuse: {buffer} into kernel {} with {with} (small kernels side by side: one launch)", kernel(*k))
            }
            Decision::Fuse { buffer, kernel: k, with, shared_bytes } => {
                write!(s, "fuse: {buffer} into kernel {} with {with} (shares {shared_bytes} bytes)", kernel(*k))
            }
            Decision::NoFusion { buffer, kernel: k, side_by_side, reason } => {
                let how = if *side_by_side { " (side by side)" } else { "" };
                let why = match reason {
                    Rejection::TooManyBuffers(n) => format!("the kernel would take more than {n} buffers"),
                    Rejection::Plan(why) => why.clone(),
                    Rejection::PeakMemory => "a large output beside a large temporary (peak memory)".into(),
                };
                write!(s, "no fusion: {buffer} into kernel {}{how}: {why}", kernel(*k))
            }
            Decision::NewKernel { buffer, kernel: k, reason } => {
                let why = match reason {
                    NewKernelReason::SharesNothing => "shares no data with an earlier kernel",
                    NewKernelReason::EveryFusionRejected => "every fusion was rejected",
                    NewKernelReason::MatrixProduct => "a matrix product heads its own kernel; pointwise readers may join it",
                    NewKernelReason::Attention => "a fused attention is a kernel of its own",
                };
                write!(s, "new kernel {}: {buffer} ({why})", kernel(*k))
            }
        };
        s
    }
}
