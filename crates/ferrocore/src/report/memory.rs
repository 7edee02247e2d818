//! Buffer lifetimes and the memory they add up to, read off the compiled graph's host steps:
//! when each buffer gets storage (allocated, reused from a dead one, or returned by a library
//! call), when it is freed, and the most bytes the module holds at once. Times are the launches
//! and calls, numbered from 0; the caller's inputs are live from the start.

use super::esc;
use crate::artifact::{BufferOrigin, CompiledGraph, Output, Step};
use crate::graph::DType;
use crate::loop_ir::storage_numel;
use std::collections::{HashMap, HashSet};
use std::fmt::Write;

/// One buffer's life: `[start, end]` in steps (`end`: the last step it is live in; None while
/// the module returns it).
#[derive(Clone, Debug, PartialEq)]
pub struct Lifetime {
    pub buf: u32,
    pub bytes: i64,
    pub start: usize,
    pub end: Option<usize>,
    /// The dead buffer whose storage it took.
    pub reuses: Option<u32>,
}

pub struct Lifetimes {
    pub buffers: Vec<Lifetime>,
    /// Steps (launches and calls) in the plan.
    pub steps: usize,
    /// The most bytes the module's own buffers hold at once (the inputs not counted).
    pub peak: i64,
    /// The step the peak is first reached at.
    pub peak_step: usize,
    pub inputs: i64,
}

fn storage_bytes(g: &CompiledGraph, b: u32) -> i64 {
    let l = &g.buffers[b as usize];
    let itemsize = DType::parse(&l.dtype).map_or(1, |d| d.itemsize() as i64);
    storage_numel(&l.size, &l.stride, l.offset) * itemsize
}

/// The buffers with storage so far, and which of them are still open.
struct Walk<'g> {
    g: &'g CompiledGraph,
    buffers: Vec<Lifetime>,
    open: HashMap<u32, usize>,
}

impl Walk<'_> {
    fn begin(&mut self, buf: u32, step: usize, reuses: Option<u32>) -> i64 {
        let bytes = storage_bytes(self.g, buf);
        self.open.insert(buf, self.buffers.len());
        self.buffers.push(Lifetime { buf, bytes, start: step, end: None, reuses });
        bytes
    }
    /// Ends `buf`'s life after `step`; its bytes.
    fn end(&mut self, buf: u32, step: usize) -> i64 {
        match self.open.remove(&buf) {
            Some(i) => {
                self.buffers[i].end = Some(step);
                self.buffers[i].bytes
            }
            None => 0,
        }
    }
}

/// Walks the host steps once.
pub fn lifetimes(g: &CompiledGraph) -> Lifetimes {
    let mut w = Walk { g, buffers: Vec::new(), open: HashMap::new() };
    let (mut live, mut peak, mut peak_step, mut step) = (0i64, 0i64, 0usize, 0usize);
    let inputs: Vec<u32> = g.inputs.iter().map(|i| i.buf).collect();
    let input_bytes: i64 = inputs.iter().map(|b| w.begin(*b, 0, None)).sum();
    // a call's results the module never binds die at once (ATen's allocation, not the plan's)
    let mut kept: HashSet<u32> = g.steps.iter().filter_map(|s| if let Step::Free { buf } = s { Some(*buf) } else { None }).collect();
    kept.extend(g.outputs.iter().filter_map(|o| match o {
        Output::Buffer { buf } | Output::View { buf, .. } => Some(*buf),
        Output::None => None,
    }));
    for s in &g.steps {
        match s {
            Step::Alloc { buf } => live += w.begin(*buf, step, None),
            Step::Reuse { buf, from } => {
                w.end(*from, step.saturating_sub(1));
                w.begin(*buf, step, Some(*from));
            }
            Step::Launch { .. } => step += 1,
            Step::Call { call } => {
                for b in &g.library_calls[*call].outputs {
                    if matches!(g.buffers[*b as usize].source, BufferOrigin::LibraryCall { .. }) && kept.contains(b) {
                        live += w.begin(*b, step, None);
                    }
                }
                step += 1;
            }
            Step::Free { buf } => {
                let bytes = w.end(*buf, step.saturating_sub(1));
                if !inputs.contains(buf) {
                    live -= bytes;
                }
            }
        }
        // allocations come before a step, frees after it: the step's own high point
        if matches!(s, Step::Launch { .. } | Step::Call { .. }) && live > peak {
            (peak, peak_step) = (live, step - 1);
        }
    }
    if live > peak {
        (peak, peak_step) = (live, step.saturating_sub(1));
    }
    Lifetimes { buffers: w.buffers, steps: step, peak, peak_step, inputs: input_bytes }
}

pub fn bytes_text(b: i64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

/// The buffers table, each with a bar over the steps it is live in.
pub fn section(h: &mut String, g: &CompiledGraph, m: &Lifetimes) {
    let _ = writeln!(
        h,
        "<section id=\"memory\"><h2>Buffers and lifetimes</h2>\n<p>Peak: {} held by the module's own buffers at step {} of {} (inputs: {}, live from the start).</p>",
        bytes_text(m.peak),
        m.peak_step,
        m.steps,
        bytes_text(m.inputs)
    );
    let _ = writeln!(h, "<table><tr><th>buffer</th><th>layout</th><th>bytes</th><th>steps</th><th>lifetime</th></tr>");
    let span = m.steps.max(1) as f64;
    for l in &m.buffers {
        let b = &g.buffers[l.buf as usize];
        let end = l.end.unwrap_or(m.steps.saturating_sub(1));
        let (left, width) = (l.start as f64 / span * 100.0, ((end + 1).saturating_sub(l.start)).max(1) as f64 / span * 100.0);
        let steps = match l.end {
            Some(e) => format!("{}..{e}", l.start),
            None => format!("{}.. (returned)", l.start),
        };
        let reuse = l.reuses.map_or(String::new(), |f| format!(" (storage of {})", esc(&g.buffers[f as usize].name)));
        let _ = writeln!(
            h,
            "<tr><td><code>{}</code>{reuse}</td><td><code>{}{:?}</code></td><td class=\"num\">{}</td><td>{steps}</td><td><div class=\"life\"><div style=\"left:{left:.1}%;width:{width:.1}%\"></div></div></td></tr>",
            esc(&b.name),
            b.dtype,
            b.size,
            bytes_text(l.bytes)
        );
    }
    let _ = writeln!(h, "</table></section>");
}
