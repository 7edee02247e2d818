//! The compiled graph printed as a Python module, like Inductor's output code: `call(args)` runs
//! the host plan (allocations, launches, library calls, frees, in the graph's order), and a
//! `__main__` times it. Everything printed comes from the `CompiledGraph`; this file decides
//! nothing about the plan. Graph text (names, strings, source lines) goes through the literal
//! writers, never pasted.

use super::checks;
use crate::artifact::{Arg, BufferOrigin, CompiledGraph, Kernel, Language, LibraryCall, Output, Step};
use crate::codegen::literal::{py_bool, py_comment, py_float, py_int, py_source_str, py_str};
use crate::graph::{DType, Device};
use crate::loop_ir::storage_numel;
use std::fmt::Write;

/// The module printing `g`.
pub fn print_module(g: &CompiledGraph) -> String {
    let mut m = header(g);
    m.push_str(&kernel_bindings(g));
    let index_device = g.index_check.as_ref().map(|c| Device::parse(&c.device).expect("a device the artifact wrote"));
    let gpu_flag = matches!(index_device, Some(Device::Cuda(_)));
    if let (Some(d), true) = (index_device, gpu_flag) {
        let _ = writeln!(m, "\n_INDEX_CHECK = GpuIndexCheck({})", py_str(&d.to_string()));
    }
    let donated = g.donated_writes.iter().any(|w| !w.escapes);
    m.push_str(&checks::input_specs(g));
    m.push_str(&call_head(g, index_device.is_some(), donated));
    m.push_str(&checks::input_checks(g));
    // donated inputs that results are written over: a private copy where a view shares the
    // storage or it is too short
    for w in &g.donated_writes {
        let held = if w.escapes { "" } else { ", held" };
        let _ = writeln!(m, "    {0} = owned_storage({0}, {1}{held})", name(g, w.buf), w.extent);
    }
    match index_device {
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
    let used = used_buffers(g);
    for step in &g.steps {
        m.push_str(&step_py(g, step, &used));
    }
    let outs: Vec<String> = g
        .outputs
        .iter()
        .map(|o| match o {
            Output::Buffer { buf } => name(g, *buf).to_string(),
            Output::View { buf, size, stride, offset } => view_py(g, *buf, size, stride, *offset),
            Output::None => "None".into(),
        })
        .collect();
    if gpu_flag {
        m.push_str("    if index_flag is None:\n        _INDEX_CHECK.end()\n");
    } else if index_device.is_some() {
        m.push_str("    if index_flag is None and _index_error.item():\n        raise IndexError('index out of range in a gather of this graph')\n");
    }
    let _ = writeln!(m, "    return ({}{})", outs.join(", "), if outs.len() == 1 { "," } else { "" });
    m.push_str(&self_timing(g));
    m
}

/// The comment lines, the imports and the kernels (the C++ source, loaded; the Triton functions,
/// defined inline).
fn header(g: &CompiledGraph) -> String {
    let mut m = String::new();
    let fallbacks = g.library_calls.iter().filter(|c| c.fallback).count();
    let _ = writeln!(m, "# ferrocore output code for graph {}", py_str(&g.name));
    let _ = writeln!(m, "# kernels: {}, extern calls: {}, ATen fallbacks: {fallbacks}", g.kernels.len(), g.library_calls.len() - fallbacks);
    m.push_str("# Edit a kernel below and run this file to recompile and time it.\n");
    match g.language {
        Language::Cpp => {
            m.push_str("import torch\nfrom ferrocore.runtime.cpp_library import host_kernel, load_kernels\n");
            m.push_str("from ferrocore.runtime.wrapper import empty_strided_cpu, owned_storage, reinterpret, restride\n\n");
        }
        Language::Triton => {
            m.push_str("import torch\nfrom ferrocore.runtime.triton_launch import TritonLaunch\n");
            m.push_str(
                "from ferrocore.runtime.wrapper import GpuIndexCheck, empty_strided_cpu, empty_strided_cuda, owned_storage, reinterpret, restride\n\n",
            );
        }
    }
    m
}

/// How the module reaches each kernel: C++ functions of the loaded library, or Triton functions
/// defined here (Triton compiles them at their first launch) with a launcher each, to which
/// precompile_triton binds the compiled binary, so a launch skips Triton's per-call argument
/// inspection.
fn kernel_bindings(g: &CompiledGraph) -> String {
    let mut m = String::new();
    let (Some(unit), false) = (&g.unit, g.kernels.is_empty()) else {
        if g.language == Language::Triton {
            m.push_str("\n\n");
        }
        return m;
    };
    let mut bound = std::collections::HashSet::new();
    match g.language {
        Language::Cpp => {
            // the string must equal the compiled source byte for byte: it is the cache key
            let _ = writeln!(m, "KERNEL_SOURCE = {}", py_source_str(&unit.source));
            // the options of the compile that loads the module (its cache, its compiler), else
            // the environment's (the module run on its own)
            m.push_str("\n_lib = load_kernels(KERNEL_SOURCE, globals().get(\"__ferrocore_options__\"))\n");
            // declared pointer arguments: a call passes `data_ptr()` ints, no ctypes objects
            for k in g.kernels.iter().filter(|k| bound.insert(k.name.as_str())) {
                let _ = writeln!(m, "{0} = host_kernel(_lib, {1}, {2})", k.name, py_str(&k.name), k.args.len());
            }
        }
        Language::Triton => {
            let nl = if unit.source.ends_with('\n') { "" } else { "\n" };
            let _ = write!(m, "{}{nl}\n\n", unit.source);
            for k in g.kernels.iter().filter(|k| bound.insert(k.name.as_str())) {
                if let crate::artifact::Launch::Grid { config: c, .. } = &k.launch {
                    let constexprs = match c.tile {
                        Some([bm, bn, bk]) => format!("{{'BLOCK_M': {bm}, 'BLOCK_N': {bn}, 'BLOCK_K': {bk}}}"),
                        None => format!("{{'XBLOCK': {}}}", c.xblock),
                    };
                    let _ = writeln!(
                        m,
                        "launch_{0} = TritonLaunch({0}, {1}, {constexprs}, {2}, {3})",
                        k.name, c.grid, c.num_warps, c.num_stages
                    );
                }
            }
        }
    }
    m
}

/// `def call(...)` up to the unpacked inputs: Triton launches run under the graph's device.
fn call_head(g: &CompiledGraph, index_flag: bool, donated: bool) -> String {
    let mut m = String::new();
    let mut params = String::from("args");
    let mut inner = String::from("args");
    if index_flag {
        params.push_str(", index_flag=None");
        inner.push_str(", index_flag");
    }
    if donated {
        params.push_str(", held=None");
        inner.push_str(", held");
    }
    let cuda = g.buffers.iter().find_map(|b| match Device::parse(&b.device) {
        Some(Device::Cuda(i)) => Some(i),
        _ => None,
    });
    match (g.language, cuda) {
        (Language::Triton, Some(i)) if !g.kernels.is_empty() => {
            let _ = write!(
                m,
                "\n\ndef call({params}):\n    with torch.cuda.device({i}):\n        return _call({inner})\n\n\ndef _call({inner}):\n"
            );
        }
        _ => {
            let _ = write!(m, "\n\ndef call({params}):\n");
        }
    }
    let names: Vec<&str> = g.inputs.iter().map(|i| name(g, i.buf)).collect();
    m.push_str(&checks::input_count_check(g));
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
    m
}

/// One step of the host plan as lines of `call`.
fn step_py(g: &CompiledGraph, step: &Step, used: &[bool]) -> String {
    let mut m = String::new();
    match step {
        Step::Alloc { buf } => {
            let b = &g.buffers[*buf as usize];
            let (size, stride, dtype) = (py_tuple(&b.size), py_tuple(&b.stride), dtype_py(&b.dtype));
            if b.device.starts_with("cuda") && g.language == Language::Triton {
                // on the current device (the call runs under it): torch's allocator, no argument parsing
                let _ = writeln!(m, "    {} = empty_strided_cuda({size}, {stride}, {dtype})", b.name);
            } else if b.device == "cpu" {
                // torch's allocator without the argument parser (a third of the host time)
                let _ = writeln!(m, "    {} = empty_strided_cpu({size}, {stride}, {dtype})", b.name);
            } else {
                let _ = writeln!(m, "    {} = torch.empty_strided({size}, {stride}, dtype={dtype}, device={})", b.name, py_str(&b.device));
            }
        }
        Step::Reuse { buf, from } => {
            let (b, f) = (name(g, *buf), name(g, *from));
            let _ = writeln!(m, "    {b} = {f}; del {f}  # reuse");
        }
        Step::Launch { kernel } => {
            let k = &g.kernels[*kernel];
            m.push_str(&provenance_comment(g, &k.origins));
            m.push_str(&launch_py(g, k));
        }
        Step::Call { call } => {
            let x = &g.library_calls[*call];
            m.push_str(&provenance_comment(g, std::slice::from_ref(&x.origin)));
            m.push_str(&library_call_py(g, x, used));
        }
        Step::Free { buf } => {
            let _ = writeln!(m, "    del {}", name(g, *buf));
        }
    }
    m
}

fn launch_py(g: &CompiledGraph, k: &Kernel) -> String {
    let mut m = String::new();
    match &k.launch {
        crate::artifact::Launch::Host => {
            let args: Vec<String> = k.args.iter().map(|b| format!("{}.data_ptr()", name(g, *b))).collect();
            if k.checks_indices {
                let _ = writeln!(m, "    if {}({}):", k.name, args.join(", "));
                let _ = writeln!(m, "        raise IndexError('index out of range in {}')", k.name);
            } else {
                let _ = writeln!(m, "    {}({})", k.name, args.join(", "));
            }
        }
        crate::artifact::Launch::Grid { .. } => {
            // grid and config live in the kernel's launcher; complex buffers: kernels address
            // their components (pairs of reals)
            let arg = |b: &u32| {
                let buf = &g.buffers[*b as usize];
                if dtype_of(&buf.dtype).is_complex() {
                    format!("torch.view_as_real({})", buf.name)
                } else {
                    buf.name.clone()
                }
            };
            let mut args: Vec<String> = k.args.iter().map(arg).collect();
            if k.checks_indices {
                args.push("_index_error".into());
            }
            // buffers this module allocates are aligned: no per-launch address check
            let allocated = k.args.iter().all(|b| g.buffers[*b as usize].source == BufferOrigin::Computed);
            let how = if allocated { ".aligned" } else { "" };
            let _ = writeln!(m, "    launch_{}{how}({})", k.name, args.join(", "));
        }
    }
    m
}

fn library_call_py(g: &CompiledGraph, x: &LibraryCall, used: &[bool]) -> String {
    let mut m = String::new();
    let mut args: Vec<String> = x.args.iter().map(|a| arg_py(g, a)).collect();
    args.extend(x.kwargs.iter().map(|(k, v)| kwarg_py(k, arg_py(g, v))));
    let note = match &x.reason {
        Some(r) => format!("  # fallback: {}", py_comment(r)),
        None => String::new(),
    };
    let call = format!("{}({})", callee_py(&x.callee), args.join(", "));
    // library results read by kernels or returned must have the layout compiled against
    let restride = |b: u32, value: &str| -> String {
        let buf = &g.buffers[b as usize];
        format!("restride({value}, {}, {}, {})", py_tuple(&buf.size), py_tuple(&buf.stride), dtype_py(&buf.dtype))
    };
    let single = x.outputs.len() == 1 && matches!(g.buffers[x.outputs[0] as usize].source, BufferOrigin::LibraryCall { item: None, .. });
    if single {
        let b = x.outputs[0];
        let _ = writeln!(m, "    {} = {}{note}", name(g, b), restride(b, &call));
    } else {
        let _ = writeln!(m, "    _r = {call}{note}");
        for b in x.outputs.iter().filter(|b| used[**b as usize]) {
            if let BufferOrigin::LibraryCall { item: Some(i), .. } = g.buffers[*b as usize].source {
                let _ = writeln!(m, "    {} = {}", name(g, *b), restride(*b, &format!("_r[{i}]")));
            }
        }
        // the tuple would keep every result alive until the next call
        m.push_str("    del _r\n");
    }
    m
}

/// `make_inputs` and the `__main__` that times the module.
fn self_timing(g: &CompiledGraph) -> String {
    let mut m = String::from("\n\ndef make_inputs():\n    return [\n");
    for i in &g.inputs {
        let b = &g.buffers[i.buf as usize];
        let dtype = dtype_of(&b.dtype);
        let storage = storage_numel(&b.size, &b.stride, b.offset).max(1);
        let gen = if dtype.is_float() {
            format!("torch.randn({}, dtype={})", py_tuple(&[storage]), dtype_py(&b.dtype))
        } else if dtype == DType::Bool {
            format!("torch.randint(0, 2, {}).bool()", py_tuple(&[storage]))
        } else {
            format!("torch.randint(0, 8, {}, dtype={})", py_tuple(&[storage]), dtype_py(&b.dtype))
        };
        let gen = if b.device == "cpu" { gen } else { format!("{gen}.to({})", py_str(&b.device)) };
        let _ = writeln!(m, "        {gen}.as_strided({}, {}),", py_tuple(&b.size), py_tuple(&b.stride));
    }
    m.push_str("    ]\n\n\ndef benchmark_compiled_module(reps=100, report=None):\n    from ferrocore.runtime.report import benchmark\n");
    m.push_str("    return benchmark(call, make_inputs(), reps, report=report, module=globals())\n\n\n");
    m.push_str(
        "if __name__ == '__main__':\n    from ferrocore.runtime.report import benchmark_main\n    benchmark_main(benchmark_compiled_module)\n",
    );
    m
}

/// Buffers something reads: a kernel, a library call or the graph's outputs (results nothing
/// reads are never bound: ATen may leave them undefined).
fn used_buffers(g: &CompiledGraph) -> Vec<bool> {
    let mut used = vec![false; g.buffers.len()];
    for k in &g.kernels {
        for b in &k.args {
            used[*b as usize] = true;
        }
    }
    fn walk(a: &Arg, used: &mut [bool]) {
        match a {
            Arg::Buffer(b) | Arg::View { buf: b, .. } => used[*b as usize] = true,
            Arg::List(items) => items.iter().for_each(|i| walk(i, used)),
            _ => {}
        }
    }
    for x in &g.library_calls {
        x.args.iter().chain(x.kwargs.iter().map(|(_, a)| a)).for_each(|a| walk(a, &mut used));
    }
    for o in &g.outputs {
        if let Output::Buffer { buf } | Output::View { buf, .. } = o {
            used[*buf as usize] = true;
        }
    }
    used
}

/// The comment before a launch or library call: the graph nodes it computes, then the model
/// source lines they came from (once each). Both are graph text, escaped onto one line each.
fn provenance_comment(g: &CompiledGraph, origins: &[String]) -> String {
    if origins.is_empty() {
        return String::new();
    }
    let mut c = format!("    # graph nodes: {}\n", py_comment(&origins.join(", ")));
    let mut shown: Vec<&str> = Vec::new();
    for line in origins.iter().filter_map(|o| g.sources.get(o)) {
        if !shown.contains(&line.as_str()) {
            shown.push(line);
            let _ = writeln!(c, "    # {}", py_comment(line));
        }
    }
    c
}

pub(super) fn name(g: &CompiledGraph, buf: u32) -> &str {
    &g.buffers[buf as usize].name
}

fn dtype_of(name: &str) -> DType {
    DType::parse(name).expect("a dtype the artifact wrote")
}

pub(super) fn py_tuple(v: &[i64]) -> String {
    match v.len() {
        1 => format!("({},)", v[0]),
        _ => format!("({})", v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")),
    }
}

pub(super) fn dtype_py(name: &str) -> String {
    format!("torch.{}", dtype_of(name).torch_name())
}

fn view_py(g: &CompiledGraph, buf: u32, size: &[i64], stride: &[i64], offset: i64) -> String {
    format!("reinterpret({}, {}, {}, {offset})", name(g, buf), py_tuple(size), py_tuple(stride))
}

fn arg_py(g: &CompiledGraph, a: &Arg) -> String {
    // torch's layouts and memory formats are attributes of `torch` (the importer accepts only those)
    let torch_attr = |name: &str| {
        if crate::graph::names::is_identifier(name) {
            format!("torch.{name}")
        } else {
            format!("getattr(torch, {})", py_str(name))
        }
    };
    match a {
        Arg::Buffer(b) => name(g, *b).to_string(),
        // a view the buffer already is: the tensor itself (no as_strided call per launch)
        Arg::View { buf, size, stride, offset }
            if *offset == 0 && g.buffers[*buf as usize].size == *size && g.buffers[*buf as usize].stride == *stride =>
        {
            name(g, *buf).to_string()
        }
        Arg::View { buf, size, stride, offset } => view_py(g, *buf, size, stride, *offset),
        Arg::List(items) => format!("[{}]", items.iter().map(|i| arg_py(g, i)).collect::<Vec<_>>().join(", ")),
        Arg::None => "None".into(),
        Arg::Int(i) => py_int(*i),
        Arg::Float(f) => py_float(*f),
        Arg::Bool(b) => py_bool(*b),
        Arg::Str(s) => py_str(s),
        Arg::DType(d) => dtype_py(d),
        Arg::Device(d) => format!("torch.device({})", py_str(d)),
        Arg::Layout(name) | Arg::MemoryFormat(name) => torch_attr(name),
        Arg::Shape(s) => py_tuple(s),
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

/// The Python callable a library call is printed as: torch's own binding where it takes the
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
