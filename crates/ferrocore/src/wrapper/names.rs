//! The wrapper module's names: what it calls the graph's buffers. An input keeps the loop IR's
//! name (the graph's) unless the module takes that name for itself: its imports and helpers,
//! Python's keywords and the builtins it calls, and the prefixes of the names it makes
//! (kernels `cpp_*` and `triton_*`, launchers `launch_*`, private names `_*`); such an input
//! is `arg{i}` (a name the loop IR never gives: `loop_ir::input_buffer_name`).

use crate::graph::names::is_python_keyword;
use crate::loop_ir::{Buffer, BufferSource};

/// The module's name for buffer `b`.
pub fn module_name(b: &Buffer) -> String {
    match b.source {
        BufferSource::Input(i) if !free_for_inputs(&b.name) => format!("arg{i}"),
        _ => b.name.clone(),
    }
}

fn free_for_inputs(name: &str) -> bool {
    !name.starts_with('_')
        && !GENERATED_PREFIXES.iter().any(|p| name.starts_with(p))
        && !is_python_keyword(name)
        && !RESERVED.contains(&name)
}

/// Prefixes of the names the module makes: kernels, launchers.
const GENERATED_PREFIXES: &[&str] = &["cpp_", "triton_", "launch_"];

/// Names the module takes for itself, and Python's builtins (which it calls: `float('nan')`,
/// `IndexError`).
const RESERVED: &[&str] = &[
    // the wrapper module's own names
    "torch",
    "triton",
    "tl",
    "math",
    "ferrocore",
    "call",
    "args",
    "index_flag",
    "held",
    "reinterpret",
    "restride",
    "load_kernels",
    "host_kernel",
    "owned_storage",
    "empty_strided_cuda",
    "empty_strided_cpu",
    "GpuIndexCheck",
    "TritonLaunch",
    "KERNEL_SOURCE",
    "TRITON_KERNELS",
    "TRITON_LAUNCHERS",
    "CUDAGRAPH_UNSAFE",
    "INDEX_FLAG",
    "DONATED_WRITES",
    "make_inputs",
    "benchmark_compiled_module",
    "benchmark",
    "reps",
    "libdevice",
    "x0",
    "xindex",
    "xmask",
    "xoffset",
    "yoffset",
    "pid",
    "rindex",
    "rmask",
    "XBLOCK",
    "RBLOCK",
    // Python builtins
    "abs",
    "aiter",
    "all",
    "anext",
    "any",
    "ascii",
    "bin",
    "bool",
    "breakpoint",
    "bytearray",
    "bytes",
    "callable",
    "chr",
    "classmethod",
    "compile",
    "complex",
    "copyright",
    "credits",
    "delattr",
    "dict",
    "dir",
    "divmod",
    "enumerate",
    "eval",
    "exec",
    "exit",
    "filter",
    "float",
    "format",
    "frozenset",
    "getattr",
    "globals",
    "hasattr",
    "hash",
    "help",
    "hex",
    "id",
    "input",
    "int",
    "isinstance",
    "issubclass",
    "iter",
    "len",
    "license",
    "list",
    "locals",
    "map",
    "max",
    "memoryview",
    "min",
    "next",
    "object",
    "oct",
    "open",
    "ord",
    "pow",
    "print",
    "property",
    "quit",
    "range",
    "repr",
    "reversed",
    "round",
    "set",
    "setattr",
    "slice",
    "sorted",
    "staticmethod",
    "str",
    "sum",
    "super",
    "tuple",
    "vars",
    "zip",
    "ArithmeticError",
    "AssertionError",
    "AttributeError",
    "BaseException",
    "Exception",
    "IndexError",
    "KeyError",
    "LookupError",
    "MemoryError",
    "NameError",
    "NotImplemented",
    "NotImplementedError",
    "OSError",
    "OverflowError",
    "RuntimeError",
    "StopIteration",
    "SyntaxError",
    "SystemExit",
    "TypeError",
    "ValueError",
    "ZeroDivisionError",
    "Ellipsis",
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loop_ir::{input_buffer_name, Layout};

    fn input(i: usize, graph_name: &str) -> Buffer {
        let layout = Layout::contiguous(&[2], crate::graph::DType::F32, crate::graph::Device::Cpu);
        Buffer { name: input_buffer_name(i, graph_name), layout, source: BufferSource::Input(i) }
    }

    #[test]
    fn inputs_keep_their_graph_names_unless_the_module_or_the_ir_takes_them() {
        assert_eq!(module_name(&input(0, "primals_1")), "primals_1");
        // the module's own names, keywords, builtins and its prefixes
        for (i, taken) in ["torch", "lambda", "float", "cpp_red_fused_0", "launch_x", "_lib"].iter().enumerate() {
            assert_eq!(module_name(&input(i, taken)), format!("arg{i}"), "{taken}");
        }
        // the IR's own names and what is no identifier never reach the module
        assert_eq!(module_name(&input(3, "buf7")), "arg3");
        assert_eq!(module_name(&input(4, "x.y")), "arg4");
        assert_eq!(input_buffer_name(5, "lambda"), "lambda", "the IR keeps a Python keyword: only the module cannot");
    }
}
