//! The checks a wrapper module runs on its inputs before any kernel reads them: kernels are
//! compiled for one size, stride, dtype and device per input, and read out of bounds (or the
//! wrong bytes) given anything else. Sizes and strides go through torch's C++
//! `assert_size_stride_grouped` (one call for all inputs, as Inductor's wrappers do), dtypes
//! and devices through one tuple comparison each; a failure is explained by
//! `runtime.input_mismatch`. `Options::check_inputs` turns these off. Views that `as_strided`
//! takes of an input's storage are always checked (`runtime.check_storage_view`): eager raises
//! for one that reaches outside the storage, and only the call knows the storage's size.
//! This file prints Python text from the compiled graph; it decides nothing about the plan.

use super::python::{name, py_tuple};
use crate::artifact::CompiledGraph;
use crate::codegen::literal::py_str;
use std::fmt::Write;

/// The helpers the input checks call and the module-level constants they compare against
/// (rendered before `call`).
pub fn input_specs(g: &CompiledGraph) -> String {
    let check_inputs = g.check_inputs;
    let checked = check_inputs && !checked_inputs(g).is_empty();
    let mut helpers = Vec::new();
    if check_inputs && !g.inputs.is_empty() {
        helpers.push("check_input_count");
    }
    if checked {
        helpers.push("assert_size_stride_grouped");
    }
    if !g.input_storage_views.is_empty() {
        helpers.push("check_storage_view");
    }
    if checked {
        helpers.push("input_mismatch");
    }
    let mut m = String::new();
    if helpers.is_empty() {
        return m;
    }
    let _ = writeln!(m, "\nfrom ferrocore.runtime.wrapper import {}", helpers.join(", "));
    if !checked {
        return m;
    }
    m.push_str("# the inputs this module was compiled for: (name, size, stride, dtype, device)\nINPUTS = (\n");
    for b in checked_inputs(g) {
        let buf = &g.buffers[b as usize];
        let _ = writeln!(
            m,
            "    ({}, {}, {}, torch.{}, '{}'),",
            py_str(&buf.name),
            py_tuple(&buf.size),
            py_tuple(&buf.stride),
            buf.dtype,
            buf.device
        );
    }
    m.push_str(")\n_INPUT_SIZES = tuple(i[1] for i in INPUTS)\n_INPUT_STRIDES = tuple(i[2] for i in INPUTS)\n");
    m.push_str("_INPUT_DTYPES = tuple(i[3] for i in INPUTS)\n");
    m.push_str("_INPUT_DEVICES = tuple(torch.device(i[4]) for i in INPUTS)\n");
    m
}

/// The inputs a kernel or library call reads, in order: one only returned (an effect token,
/// which AOT autograd passes as None) or not used at all is never read out of bounds.
fn checked_inputs(g: &CompiledGraph) -> Vec<u32> {
    g.inputs.iter().filter(|i| i.read).map(|i| i.buf).collect()
}

/// The line of `call` (before its inputs are unpacked into their names) that checks how many
/// came: a wrong count is an `InputMismatch`, not Python's unpacking error.
pub fn input_count_check(g: &CompiledGraph) -> String {
    if !g.check_inputs || g.inputs.is_empty() {
        return String::new();
    }
    let n = g.inputs.len();
    format!("    if len(args) != {n}:\n        check_input_count(args, {n})\n")
}

/// Lines of `call` (after the inputs are unpacked into their names) that check them.
pub fn input_checks(g: &CompiledGraph) -> String {
    let mut m = String::new();
    let names: Vec<&str> = checked_inputs(g).into_iter().map(|b| name(g, b)).collect();
    if g.check_inputs && !names.is_empty() {
        let tuple = |parts: Vec<String>| if parts.len() == 1 { format!("({},)", parts[0]) } else { format!("({})", parts.join(", ")) };
        let inputs = tuple(names.iter().map(|n| n.to_string()).collect());
        let dtypes = tuple(names.iter().map(|n| format!("{n}.dtype")).collect());
        let devices = tuple(names.iter().map(|n| format!("{n}.device")).collect());
        let _ = write!(
            m,
            "    try:\n        assert_size_stride_grouped({inputs}, _INPUT_SIZES, _INPUT_STRIDES, 'input')\n        \
             _inputs_match = {dtypes} == _INPUT_DTYPES and {devices} == _INPUT_DEVICES\n    \
             except Exception:\n        _inputs_match = False\n    \
             if not _inputs_match:\n        raise input_mismatch(INPUTS, {inputs})\n"
        );
    }
    for v in &g.input_storage_views {
        let storage_offset = v.storage_offset.map_or("None".to_string(), |o| o.to_string());
        let _ = writeln!(
            m,
            "    check_storage_view({}, {}, {}, {}, {storage_offset})",
            name(g, v.input),
            py_tuple(&v.size),
            py_tuple(&v.stride),
            v.offset
        );
    }
    m
}
