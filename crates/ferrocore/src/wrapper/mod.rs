//! The host plan of a compiled graph — allocate, launch, call externs, free or reuse, return —
//! and its rendering as a readable Python module (`call(args)` plus a `__main__` that times
//! itself), like Inductor's output code. It does not generate kernels; it launches them.

pub use crate::codegen::literal::py_str;
use crate::codegen::literal::{py_bool, py_comment, py_float, py_int, py_source_str};
use crate::codegen::{KernelLanguage, LaunchShape, RenderedKernels};
use crate::graph::DType;
use crate::loop_ir::*;
use crate::scheduler::{kernel_origins, Item, Schedule, Storage};
use std::collections::HashMap;
use std::fmt::Write;

mod checks;

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

fn py_tuple(v: &[i64]) -> String {
    match v.len() {
        1 => format!("({},)", v[0]),
        _ => format!("({})", v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")),
    }
}

fn dtype_py(d: DType) -> String {
    format!("torch.{}", d.torch_name())
}

fn view_py(p: &LoopProgram, buf: BufferId, size: &[i64], stride: &[i64], offset: i64) -> String {
    let name = &p.buffer(buf).name;
    format!("reinterpret({name}, {}, {}, {offset})", py_tuple(size), py_tuple(stride))
}

fn extern_arg_py(p: &LoopProgram, a: &ExternArg) -> String {
    match a {
        ExternArg::Buffer(b) => p.buffer(*b).name.clone(),
        // a view the buffer already is: the tensor itself (no as_strided call per launch)
        ExternArg::View { buf, size, stride, offset }
            if *offset == 0 && p.buffer(*buf).layout.size == *size && p.buffer(*buf).layout.stride == *stride =>
        {
            p.buffer(*buf).name.clone()
        }
        ExternArg::View { buf, size, stride, offset } => view_py(p, *buf, size, stride, *offset),
        ExternArg::Literal(l) => literal_py(l),
        ExternArg::List(items) => format!("[{}]", items.iter().map(|i| extern_arg_py(p, i)).collect::<Vec<_>>().join(", ")),
    }
}

/// A constant argument as Python source.
fn literal_py(l: &Literal) -> String {
    // torch's layouts and memory formats are attributes of `torch` (the importer accepts only those)
    let torch_attr = |name: &str| {
        if crate::graph::names::is_identifier(name) {
            format!("torch.{name}")
        } else {
            format!("getattr(torch, {})", py_str(name))
        }
    };
    match l {
        Literal::None => "None".into(),
        Literal::Int(i) => py_int(*i),
        Literal::Float(f) => py_float(*f),
        Literal::Bool(b) => py_bool(*b),
        Literal::Str(s) => py_str(s),
        Literal::DType(d) => dtype_py(*d),
        Literal::Device(d) => format!("torch.device({})", py_str(&d.to_string())),
        Literal::Layout(name) | Literal::MemoryFormat(name) => torch_attr(name),
        Literal::Shape(s) => py_tuple(s),
    }
}

/// `key=value` of a call, or `**{'key': value}` where the key is no Python identifier (an ATen
/// argument named like a keyword, `from`).
fn kwarg_py(key: &str, value: String) -> String {
    if crate::graph::names::is_identifier(key) && !crate::graph::names::is_python_keyword(key) {
        format!("{key}={value}")
    } else {
        format!("**{{{}: {value}}}", py_str(key))
    }
}

/// The Python callable a library call is rendered as: torch's own binding where it takes the
/// overload's arguments unchanged (half the host time of `torch.ops.aten.*` dispatch per call).
fn callee_py(callee: &str) -> &str {
    match callee {
        "torch.ops.aten.mm.default" => "torch.mm",
        "torch.ops.aten.bmm.default" => "torch.bmm",
        "torch.ops.aten.addmm.default" => "torch.addmm",
        "torch.ops.aten.convolution.default" => "torch.convolution",
        other => other,
    }
}

/// Renders the plan as a Python module whose `call` checks its inputs.
pub fn render_module(s: &Schedule, kernels: &RenderedKernels, plan: &HostPlan, graph_name: &str) -> String {
    render_module_with(s, kernels, plan, graph_name, true)
}

/// Each launch's graph nodes (`scheduler::kernel_origins`), in launch order: by position, not by
/// name (kernels that differ only in name launch under one name, `codegen::Definitions`).
fn origins_by_launch(s: &Schedule) -> Vec<Vec<&str>> {
    let kernels = s.items.iter().filter_map(|it| if let Item::Kernel(k) = it { Some(k) } else { None });
    kernels.map(|k| kernel_origins(&s.program, k.plan.nodes.iter().map(|kn| kn.node))).collect()
}

/// The comment before a launch or library call: the graph nodes it computes, then the model
/// source lines they came from (once each). Both are graph text, escaped onto one line each.
fn provenance_comment(p: &LoopProgram, origins: &[&str]) -> String {
    if origins.is_empty() {
        return String::new();
    }
    let mut c = format!("    # graph nodes: {}\n", py_comment(&origins.join(", ")));
    let mut shown: Vec<&str> = Vec::new();
    for line in origins.iter().filter_map(|o| p.sources.get(*o)) {
        if !shown.contains(&line.as_str()) {
            shown.push(line);
            let _ = writeln!(c, "    # {}", py_comment(line));
        }
    }
    c
}

/// Renders the plan as a Python module; `check_inputs`: whether `call` checks its inputs'
/// sizes, strides, dtypes and devices (`checks.rs`).
pub fn render_module_with(s: &Schedule, kernels: &RenderedKernels, plan: &HostPlan, graph_name: &str, check_inputs: bool) -> String {
    let p = &s.program;
    let used = used_buffers(s, kernels);
    let mut m = String::new();
    let fallbacks = p.externs.iter().filter(|e| e.fallback).count();
    let _ = writeln!(m, "# ferrocore output code for graph {}", py_str(graph_name));
    let _ =
        writeln!(m, "# kernels: {}, extern calls: {}, ATen fallbacks: {fallbacks}", kernels.launches.len(), p.externs.len() - fallbacks);
    m.push_str("# Edit a kernel below and run this file to recompile and time it.\n");
    match kernels.language {
        KernelLanguage::Cpp => {
            m.push_str("import torch\nfrom ferrocore.runtime import load_kernels, host_kernel, owned_storage, reinterpret, restride\n\n");
            if !kernels.launches.is_empty() {
                // the string must equal the compiled source byte for byte: it is the cache key
                let _ = writeln!(m, "KERNEL_SOURCE = {}", py_source_str(&kernels.source));
                m.push_str("\n_lib = load_kernels(KERNEL_SOURCE)\n");
                // declared pointer arguments: a call passes `data_ptr()` ints, no ctypes objects
                let mut bound = std::collections::HashSet::new();
                for l in kernels.launches.iter().filter(|l| bound.insert(l.name.as_str())) {
                    let _ = writeln!(m, "{0} = host_kernel(_lib, {1}, {2})", l.name, py_str(&l.name), l.args.len());
                }
            }
        }
        KernelLanguage::Triton => {
            // the kernels are defined here: Triton compiles them at their first launch
            m.push_str("import torch\nfrom ferrocore.runtime import GpuIndexCheck, TritonLaunch, empty_strided_cuda, owned_storage, reinterpret, restride\n\n");
            if !kernels.launches.is_empty() {
                let nl = if kernels.source.ends_with('\n') { "" } else { "\n" };
                let _ = write!(m, "{}{nl}", kernels.source);
            }
            // each kernel's launcher: precompile_triton binds the compiled binary to it (the
            // compiled graph lists the kernels, signatures and configurations), so a launch
            // skips Triton's per-call argument inspection
            let mut listed = std::collections::HashSet::new();
            m.push_str("\n\n");
            for l in kernels.launches.iter().filter(|l| listed.insert(l.name.clone())) {
                if let LaunchShape::Grid { grid, xblock, num_warps, num_stages } = &l.shape {
                    let _ =
                        writeln!(m, "launch_{0} = TritonLaunch({0}, {grid}, {{'XBLOCK': {xblock}}}, {num_warps}, {num_stages})", l.name);
                }
            }
        }
    }
    // Triton kernels raise a shared int32 flag on an out-of-range gather index. On the host
    // (the interpreter) it is read after the launches; on a GPU, by a later call without waiting
    // (`GpuIndexCheck`). A CUDA graph records the call with a flag of its own (`index_flag`).
    let flag_device = kernels
        .launches
        .iter()
        .filter(|l| l.checks_indices && matches!(l.shape, LaunchShape::Grid { .. }))
        .find_map(|l| l.args.first().map(|b| p.buffer(*b).layout.device));
    let gpu_flag = matches!(flag_device, Some(crate::graph::Device::Cuda(_)));
    if let Some(d) = flag_device {
        if gpu_flag {
            let _ = writeln!(m, "\n_INDEX_CHECK = GpuIndexCheck({})", py_str(&d.to_string()));
        }
    }
    // Triton launches on the current device: run CUDA graphs under their device
    let cuda = p.buffers.iter().find_map(|b| match b.layout.device {
        crate::graph::Device::Cuda(i) => Some(i),
        crate::graph::Device::Cpu => None,
    });
    // a CUDA graph's capture passes `held`: references to donated inputs' storages that its
    // recordings hold (`runtime.owned_storage` discounts them where no result that outlives the
    // call takes the storage: it would keep the recording from replaying)
    let donated = p.donated_writes.iter().any(|w| !w.escapes);
    m.push_str(&checks::render_input_specs(p, &read_by_steps(s, kernels), check_inputs));
    let mut params = String::from("args");
    let mut inner = String::from("args");
    if flag_device.is_some() {
        params.push_str(", index_flag=None");
        inner.push_str(", index_flag");
    }
    if donated {
        params.push_str(", held=None");
        inner.push_str(", held");
    }
    match (kernels.language, cuda) {
        (KernelLanguage::Triton, Some(i)) if !kernels.launches.is_empty() => {
            let _ = write!(
                m,
                "\n\ndef call({params}):\n    with torch.cuda.device({i}):\n        return _call({inner})\n\n\ndef _call({inner}):\n"
            );
        }
        _ => {
            let _ = write!(m, "\n\ndef call({params}):\n");
        }
    }
    let names: Vec<String> = p.inputs.iter().map(|b| p.buffer(*b).name.clone()).collect();
    m.push_str(&checks::render_input_count_check(p, check_inputs));
    match names.len() {
        0 => {}
        1 => {
            let _ = writeln!(m, "    {}, = args", names[0]);
        }
        _ => {
            let _ = writeln!(m, "    {} = args", names.join(", "));
        }
    }
    if !names.is_empty() {
        // the list would keep every input alive until the call returns
        m.push_str("    args.clear()\n");
    }
    m.push_str(&checks::render_input_checks(p, &read_by_steps(s, kernels), check_inputs));
    // donated inputs that results are written over: a private copy where a view shares the
    // storage or it is too short
    for w in &p.donated_writes {
        let held = if w.escapes { "" } else { ", held" };
        let _ = writeln!(m, "    {0} = owned_storage({0}, {1}{held})", p.buffer(w.buffer).name, w.extent);
    }
    match flag_device {
        Some(_) if gpu_flag => m.push_str("    _index_error = _INDEX_CHECK.begin() if index_flag is None else index_flag\n"),
        Some(d) => {
            let _ = writeln!(
                m,
                "    _index_error = torch.zeros((1,), dtype=torch.int32, device={}) if index_flag is None else index_flag",
                py_str(&d.to_string())
            );
        }
        None => {}
    }
    let kernel_origins = origins_by_launch(s);
    for step in &plan.steps {
        match step {
            HostStep::Alloc(b) => {
                let l = &p.buffer(*b).layout;
                let (name, size, stride, dtype) = (&p.buffer(*b).name, py_tuple(&l.size), py_tuple(&l.stride), dtype_py(l.dtype));
                if matches!(l.device, crate::graph::Device::Cuda(_)) && kernels.language == KernelLanguage::Triton {
                    // on the current device (the call runs under it): torch's allocator, no argument parsing
                    let _ = writeln!(m, "    {name} = empty_strided_cuda({size}, {stride}, {dtype})");
                } else {
                    let _ = writeln!(
                        m,
                        "    {name} = torch.empty_strided({size}, {stride}, dtype={dtype}, device={})",
                        py_str(&l.device.to_string())
                    );
                }
            }
            HostStep::Reuse { buf, from } => {
                let (b, f) = (&p.buffer(*buf).name, &p.buffer(*from).name);
                let _ = writeln!(m, "    {b} = {f}; del {f}  # reuse");
            }
            HostStep::Launch(l) => {
                let k = &kernels.launches[*l];
                m.push_str(&provenance_comment(p, kernel_origins.get(*l).map(Vec::as_slice).unwrap_or(&[])));
                match &k.shape {
                    LaunchShape::Host => {
                        let args: Vec<String> = k.args.iter().map(|b| format!("{}.data_ptr()", p.buffer(*b).name)).collect();
                        if k.checks_indices {
                            let _ = writeln!(m, "    if {}({}):", k.name, args.join(", "));
                            let _ = writeln!(m, "        raise IndexError('index out of range in {}')", k.name);
                        } else {
                            let _ = writeln!(m, "    {}({})", k.name, args.join(", "));
                        }
                    }
                    LaunchShape::Grid { .. } => {
                        // grid and config live in the kernel's launcher
                        // complex buffers: kernels address their components (pairs of reals)
                        let arg = |b: &BufferId| {
                            let name = &p.buffer(*b).name;
                            if p.buffer(*b).layout.dtype.is_complex() {
                                format!("torch.view_as_real({name})")
                            } else {
                                name.clone()
                            }
                        };
                        let mut args: Vec<String> = k.args.iter().map(arg).collect();
                        if k.checks_indices {
                            args.push("_index_error".into());
                        }
                        // buffers this module allocates are aligned: no per-launch address check
                        let allocated = k.args.iter().all(|b| p.buffer(*b).source == BufferSource::Computed);
                        let how = if allocated { ".aligned" } else { "" };
                        let _ = writeln!(m, "    launch_{}{how}({})", k.name, args.join(", "));
                    }
                }
            }
            HostStep::Extern(e) => {
                let x = &p.externs[*e];
                m.push_str(&provenance_comment(p, &[x.origin.as_str()]));
                let mut args: Vec<String> = x.args.iter().map(|a| extern_arg_py(p, a)).collect();
                args.extend(x.kwargs.iter().map(|(k, v)| kwarg_py(k, extern_arg_py(p, v))));
                let note = match &x.reason {
                    Some(r) => format!("  # fallback: {}", py_comment(r)),
                    None => String::new(),
                };
                let call = format!("{}({})", callee_py(&x.callee), args.join(", "));
                // extern results read by kernels or returned must have the layout compiled against
                let restride = |b: &BufferId, value: &str| -> String {
                    let l = &p.buffer(*b).layout;
                    format!("restride({value}, {}, {}, {})", py_tuple(&l.size), py_tuple(&l.stride), dtype_py(l.dtype))
                };
                let single = x.outputs.len() == 1 && matches!(p.buffer(x.outputs[0]).source, BufferSource::Extern { item: None, .. });
                if single {
                    let b = x.outputs[0];
                    let _ = writeln!(m, "    {} = {}{note}", p.buffer(b).name, restride(&b, &call));
                } else {
                    let _ = writeln!(m, "    _r = {call}{note}");
                    for b in x.outputs.iter().filter(|b| used[b.0 as usize]) {
                        if let BufferSource::Extern { item: Some(i), .. } = p.buffer(*b).source {
                            let _ = writeln!(m, "    {} = {}", p.buffer(*b).name, restride(b, &format!("_r[{i}]")));
                        }
                    }
                    // the tuple would keep every result alive until the next call
                    m.push_str("    del _r\n");
                }
            }
            HostStep::Free(b) => {
                let _ = writeln!(m, "    del {}", p.buffer(*b).name);
            }
        }
    }
    let outs: Vec<String> = p
        .outputs
        .iter()
        .map(|o| match o {
            OutputValue::Buffer(b) => p.buffer(*b).name.clone(),
            OutputValue::View { buf, size, stride, offset } => view_py(p, *buf, size, stride, *offset),
            OutputValue::None => "None".into(),
        })
        .collect();
    if gpu_flag {
        m.push_str("    if index_flag is None:\n        _INDEX_CHECK.end()\n");
    } else if flag_device.is_some() {
        m.push_str("    if index_flag is None and _index_error.item():\n        raise IndexError('index out of range in a gather of this graph')\n");
    }
    let _ = writeln!(m, "    return ({}{})", outs.join(", "), if outs.len() == 1 { "," } else { "" });
    // self-timing entry point
    m.push_str("\n\ndef make_inputs():\n    return [\n");
    for b in &p.inputs {
        let l = &p.buffer(*b).layout;
        let gen = if l.dtype.is_float() {
            format!("torch.randn({}, dtype={})", py_tuple(&[l.storage_numel().max(1)]), dtype_py(l.dtype))
        } else if l.dtype == DType::Bool {
            format!("torch.randint(0, 2, {}).bool()", py_tuple(&[l.storage_numel().max(1)]))
        } else {
            format!("torch.randint(0, 8, {}, dtype={})", py_tuple(&[l.storage_numel().max(1)]), dtype_py(l.dtype))
        };
        let gen = match l.device {
            crate::graph::Device::Cpu => gen,
            d => format!("{gen}.to({})", py_str(&d.to_string())),
        };
        let _ = writeln!(m, "        {gen}.as_strided({}, {}),", py_tuple(&l.size), py_tuple(&l.stride));
    }
    m.push_str("    ]\n\n\ndef benchmark_compiled_module(reps=100, report=None):\n    from ferrocore.runtime import benchmark\n");
    m.push_str("    return benchmark(call, make_inputs(), reps, report=report, module=globals())\n\n\n");
    m.push_str(
        "if __name__ == '__main__':\n    from ferrocore.runtime import benchmark_main\n    benchmark_main(benchmark_compiled_module)\n",
    );
    m
}
