//! The host plan of a compiled graph — allocate, launch, call externs, free or reuse, return —
//! and (`python.rs`) the compiled graph's printing as a readable Python module (`call(args)`
//! plus a `__main__` that times itself), like Inductor's output code. It does not generate
//! kernels; it launches them.

pub use crate::codegen::literal::py_str;
use crate::codegen::RenderedKernels;
use crate::loop_ir::*;
use crate::scheduler::{Item, Schedule, Storage};
use std::collections::HashMap;

mod checks;
pub mod names;
pub mod python;

pub use python::print_module;

/// One step of the host plan.
#[derive(Clone, Debug, PartialEq)]
pub enum HostStep {
    Alloc(BufferId),
    /// Reuse the storage of a freed buffer with the same layout.
    Reuse {
        buf: BufferId,
        from: BufferId,
    },
    Launch(usize),
    Extern(usize),
    Free(BufferId),
}

#[derive(Clone, Debug)]
pub struct HostPlan {
    pub steps: Vec<HostStep>,
}

/// Orders allocations, launches and frees; frees each temporary after its last use and
/// reuses freed storage of an identical layout for later allocations.
pub fn plan_host(s: &Schedule, kernels: &RenderedKernels) -> HostPlan {
    let p = &s.program;
    let used = used_buffers(s, kernels);
    let mut uses: Vec<Vec<BufferId>> = Vec::new();
    let mut defs: Vec<Vec<BufferId>> = Vec::new();
    let mut launch = 0;
    let mut item_launch = Vec::new();
    for it in &s.items {
        match it {
            Item::Kernel(k) => {
                let args = &kernels.launches[launch].args;
                let outs: Vec<BufferId> = k
                    .plan
                    .nodes
                    .iter()
                    .map(|kn| p.nodes[kn.node].output)
                    .filter(|b| s.storage[b.0 as usize] == Storage::Allocated)
                    .collect();
                uses.push(args.clone());
                defs.push(outs);
                item_launch.push(Some(launch));
                launch += 1;
            }
            Item::Extern(e) => {
                uses.push(p.externs[*e].input_buffers());
                // results nothing reads are never bound (ATen may leave them undefined)
                defs.push(p.externs[*e].outputs.iter().copied().filter(|b| used[b.0 as usize]).collect());
                item_launch.push(None);
            }
        }
    }
    let mut extern_arg = vec![false; p.buffers.len()];
    for x in &p.externs {
        for b in x.input_buffers() {
            extern_arg[b.0 as usize] = true;
        }
    }
    // returned buffers live past the call; inputs are dropped after their last use like
    // temporaries (the caller handed over its list: a backward frees saved activations early)
    let mut pinned = vec![false; p.buffers.len()];
    for o in &p.outputs {
        if let OutputValue::Buffer(b) | OutputValue::View { buf: b, .. } = o {
            pinned[b.0 as usize] = true;
        }
    }
    let mut last_use: HashMap<BufferId, usize> = HashMap::new();
    for (i, u) in uses.iter().enumerate() {
        for b in u.iter().chain(&defs[i]) {
            last_use.insert(*b, i);
        }
    }
    let mut steps = Vec::new();
    for b in &p.inputs {
        if !pinned[b.0 as usize] && !last_use.contains_key(b) {
            steps.push(HostStep::Free(*b));
        }
    }
    let mut allocated = vec![false; p.buffers.len()];
    // the caller's inputs exist already, also where a kernel writes into one (`copy_`)
    for b in &p.inputs {
        allocated[b.0 as usize] = true;
    }
    // outputs no kernel writes (no elements, e.g. a size-0 dim) still need storage
    let defined: std::collections::HashSet<BufferId> = defs.iter().flatten().copied().collect();
    for o in &p.outputs {
        if let OutputValue::Buffer(b) | OutputValue::View { buf: b, .. } = o {
            if p.buffer(*b).source == BufferSource::Computed && !defined.contains(b) && !allocated[b.0 as usize] {
                allocated[b.0 as usize] = true;
                steps.push(HostStep::Alloc(*b));
            }
        }
    }
    // freed temporaries and the position of their Free step (dropped if the storage is reused)
    let mut free_pool: Vec<(BufferId, usize)> = Vec::new();
    for (i, it) in s.items.iter().enumerate() {
        // buffers no kernel writes (no elements) but that this item reads still need storage
        for b in &uses[i] {
            if p.buffer(*b).source == BufferSource::Computed && !defined.contains(b) && !allocated[b.0 as usize] {
                allocated[b.0 as usize] = true;
                steps.push(HostStep::Alloc(*b));
            }
        }
        // a library call's results exist once it returns (a kernel may write into one in place)
        if let Item::Extern(e) = it {
            for b in &p.externs[*e].outputs {
                allocated[b.0 as usize] = true;
            }
        }
        if let Item::Kernel(_) = it {
            for b in &defs[i] {
                if !allocated[b.0 as usize] {
                    allocated[b.0 as usize] = true;
                    let l = &p.buffer(*b).layout;
                    let reusable = if pinned[b.0 as usize] { None } else { free_pool.iter().position(|(f, _)| p.buffer(*f).layout == *l) };
                    match reusable {
                        Some(pos) => {
                            let (from, free_step) = free_pool.remove(pos);
                            steps[free_step] = HostStep::Reuse { buf: *b, from };
                        }
                        None => steps.push(HostStep::Alloc(*b)),
                    }
                }
            }
        }
        match (it, item_launch[i]) {
            (Item::Kernel(_), Some(l)) => steps.push(HostStep::Launch(l)),
            (Item::Extern(e), _) => steps.push(HostStep::Extern(*e)),
            _ => {}
        }
        let mut dying: Vec<BufferId> =
            uses[i].iter().chain(&defs[i]).copied().filter(|b| last_use.get(b) == Some(&i) && !pinned[b.0 as usize]).collect();
        dying.sort();
        dying.dedup();
        for b in dying {
            // an extern call may return a view of its argument: such storage is never reused
            if p.buffer(b).source == BufferSource::Computed && !extern_arg[b.0 as usize] {
                free_pool.push((b, steps.len()));
            }
            steps.push(HostStep::Free(b));
        }
    }
    HostPlan { steps }
}

/// Buffers something reads: a kernel, an extern call or the graph's outputs.
fn used_buffers(s: &Schedule, kernels: &RenderedKernels) -> Vec<bool> {
    let mut used = read_by_steps(s, kernels);
    for o in &s.program.outputs {
        if let OutputValue::Buffer(b) | OutputValue::View { buf: b, .. } = o {
            used[b.0 as usize] = true;
        }
    }
    used
}

/// Buffers a kernel or an extern call reads (or writes in place).
pub(crate) fn read_by_steps(s: &Schedule, kernels: &RenderedKernels) -> Vec<bool> {
    let p = &s.program;
    let mut used = vec![false; p.buffers.len()];
    for l in &kernels.launches {
        for b in &l.args {
            used[b.0 as usize] = true;
        }
    }
    for x in &p.externs {
        for b in x.input_buffers() {
            used[b.0 as usize] = true;
        }
    }
    used
}

/// Renders the plan as a Python module whose `call` checks its inputs.
pub fn render_module(s: &Schedule, kernels: &RenderedKernels, plan: &HostPlan, graph_name: &str) -> String {
    render_module_with(s, kernels, plan, graph_name, true)
}

/// Renders the plan as a Python module (the compiled graph's printing, `python.rs`);
/// `check_inputs`: whether `call` checks its inputs' sizes, strides, dtypes and devices.
pub fn render_module_with(s: &Schedule, kernels: &RenderedKernels, plan: &HostPlan, graph_name: &str, check_inputs: bool) -> String {
    python::print_module(&crate::artifact::build(s, kernels, plan, graph_name, check_inputs))
}
