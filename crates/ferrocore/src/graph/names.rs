//! What the importer accepts as a name: the graph's name, node names, kwarg keys, layout and
//! memory-format names. Every one of them may reach generated source or a file path later, so
//! each is checked here against a strict rule; anything else is an `ImportError` naming the node.
//! The renderers still never paste graph text: they map names (`loop_ir::input_buffer_name`,
//! `wrapper::names`) and write literals through `codegen::literal`.

use super::{schema, Arg, Graph, ImportError, NodeKind, Target};

/// The longest accepted name: FX names of deeply nested parameters run to a few hundred chars.
pub const MAX_NAME_LEN: usize = 1024;
/// The longest accepted graph name (it becomes part of file names).
pub const MAX_GRAPH_NAME_LEN: usize = 128;

/// torch's layouts (`str(torch.layout)` without `torch.`).
pub const LAYOUTS: [&str; 8] = ["strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn", "jagged"];
/// torch's memory formats.
pub const MEMORY_FORMATS: [&str; 4] = ["contiguous_format", "channels_last", "channels_last_3d", "preserve_format"];

/// An ASCII identifier, `[A-Za-z_][A-Za-z0-9_]*`: valid in Python, C++ and Triton alike (which
/// of them is a keyword there is the renderer's concern).
pub fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_') && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Python's keywords and soft keywords (3.8 through 3.13).
pub fn is_python_keyword(s: &str) -> bool {
    const KEYWORDS: [&str; 39] = [
        "False", "None", "True", "and", "as", "assert", "async", "await", "break", "class", "continue", "def", "del", "elif", "else",
        "except", "finally", "for", "from", "global", "if", "import", "in", "is", "lambda", "nonlocal", "not", "or", "pass", "raise",
        "return", "try", "while", "with", "yield", "match", "case", "type", "_",
    ];
    KEYWORDS.contains(&s)
}

fn err(node: Option<&str>, message: String) -> ImportError {
    ImportError { node: node.map(str::to_string), message }
}

/// Shows a rejected name in an error message: cut short (`ImportError` escapes it).
fn shown(s: &str) -> String {
    let cut: String = s.chars().take(80).collect();
    let more = if cut.len() < s.len() { "..." } else { "" };
    format!("{cut}{more}")
}

/// Text with control, format (bidi, zero-width, BOM) and separator characters written as
/// `\u{..}` escapes: what an error message may quote from the graph.
pub fn printable(s: &str) -> String {
    let hidden = |c: char| {
        c.is_control()
            || matches!(c, '\u{ad}' | '\u{200b}'..='\u{200f}' | '\u{2028}'..='\u{202e}' | '\u{2060}'..='\u{206f}' | '\u{feff}' | '\u{fff9}'..='\u{fffb}')
    };
    s.chars().map(|c| if hidden(c) { c.escape_unicode().to_string() } else { c.to_string() }).collect()
}

fn check_name(what: &str, s: &str, max: usize, node: Option<&str>) -> Result<(), ImportError> {
    if is_identifier(s) && s.len() <= max {
        return Ok(());
    }
    Err(err(node, format!("{what} '{}' is not an identifier ([A-Za-z_][A-Za-z0-9_]*, at most {max} characters)", shown(s))))
}

/// Checks every name of an imported graph (see the module comment).
pub fn check_names(g: &Graph) -> Result<(), ImportError> {
    check_name("graph name", &g.name, MAX_GRAPH_NAME_LEN, None)?;
    for n in &g.nodes {
        // an error about a bad name must not repeat it as the node's name
        check_name("node name", &n.name, MAX_NAME_LEN, None)?;
        let here = Some(n.name.as_str());
        let NodeKind::Call { target, args, kwargs } = &n.kind else { continue };
        for (key, value) in kwargs {
            check_name("kwarg key", key, MAX_NAME_LEN, here)?;
            if let Target::Aten(op) = target {
                let names = schema::arg_names(*op);
                if !names.contains(&key.as_str()) {
                    return Err(err(here, format!("{} has no argument '{key}' (its arguments: {})", op.name(), names.join(", "))));
                }
            }
            check_arg(value, here)?;
        }
        args.iter().try_for_each(|a| check_arg(a, here))?;
    }
    g.outputs.iter().try_for_each(|a| check_arg(a, None))
}

/// Layout and memory-format names are torch attribute names: only torch's own are accepted.
fn check_arg(a: &Arg, node: Option<&str>) -> Result<(), ImportError> {
    match a {
        Arg::Layout(l) if !LAYOUTS.contains(&l.as_str()) => Err(err(node, format!("unknown layout '{}'", shown(l)))),
        Arg::MemoryFormat(m) if !MEMORY_FORMATS.contains(&m.as_str()) => Err(err(node, format!("unknown memory format '{}'", shown(m)))),
        Arg::List(items) => items.iter().try_for_each(|i| check_arg(i, node)),
        _ => Ok(()),
    }
}
