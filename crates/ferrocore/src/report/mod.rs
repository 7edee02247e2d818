//! The compile report: one self-contained HTML file per compiled graph (no scripts, no outside
//! links), written beside the stage dumps. It shows the graph, the kernels and library calls in
//! launch order, which graph nodes each one computes (links both ways), why each fusion was made
//! or refused, the buffers' lifetimes and the peak they make, and compile time by stage. Runtime
//! by kernel is filled in later by the module's own benchmark (`python MODULE --report FILE`,
//! `ferrocore.runtime`), between the `RUNTIME_*` marks.
//!
//! Every text from the graph (names, string arguments, source lines) is escaped; anchors are
//! built from indices and kernel names, which are identifiers.

mod memory;

use crate::artifact::{CompiledGraph, Launch, Step};
use crate::graph::{fmt_meta, names::printable, Arg, Graph, NodeKind};
use crate::scheduler::{KernelId, Schedule};
use std::collections::HashMap;
use std::fmt::Write;

pub use memory::{lifetimes, Lifetime};

/// Where the module's benchmark writes its runtime table (the text between the marks).
pub const RUNTIME_START: &str = "<!-- ferrocore:runtime -->";
pub const RUNTIME_END: &str = "<!-- /ferrocore:runtime -->";

/// What a report is made of: the graph, the compiled graph (its kernels, host steps, buffers),
/// the schedule that explains it (why each fusion was made or refused), and where the module was
/// written.
pub struct ReportInput<'a> {
    pub graph: &'a Graph,
    pub compiled: &'a CompiledGraph,
    pub schedule: &'a Schedule,
    /// Stage name -> milliseconds: the front's stages (Dynamo, AOT autograd, ...), then Rust's.
    pub timings: &'a [(String, f64)],
    pub module_path: &'a str,
    pub backend: &'a str,
}

/// Text for HTML content or a quoted attribute; hidden characters (controls, bidi) shown as
/// escapes, line breaks kept (for `<pre>`).
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let shown: Vec<String> = s.split('\n').map(printable).collect();
    for c in shown.join("\n").chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            _ => out.push(c),
        }
    }
    out
}

/// Where a graph node's value is computed: kernels (by launch name) and library calls (by index).
#[derive(Default)]
struct ComputedIn<'c> {
    kernels: Vec<&'c str>,
    calls: Vec<usize>,
}

fn computed_in(c: &CompiledGraph) -> HashMap<&str, ComputedIn<'_>> {
    let mut map: HashMap<&str, ComputedIn> = HashMap::new();
    for k in &c.kernels {
        for o in &k.origins {
            map.entry(o.as_str()).or_default().kernels.push(&k.launch_name);
        }
    }
    for (e, call) in c.library_calls.iter().enumerate() {
        map.entry(call.origin.as_str()).or_default().calls.push(e);
    }
    map
}

fn kernel_link(name: &str) -> String {
    format!("<a href=\"#kernel-{name}\">{name}</a>")
}

fn call_link(c: &CompiledGraph, e: usize) -> String {
    format!("<a href=\"#call-{e}\">{}</a>", esc(&c.library_calls[e].callee))
}

fn node_link(g: &Graph, index: usize) -> String {
    format!("<a href=\"#node-{index}\">{}</a>", esc(&g.nodes[index].name))
}

/// The report for one compiled graph.
pub fn render(r: &ReportInput) -> String {
    let mut h = String::new();
    let name = esc(&r.graph.name);
    let _ = write!(h, "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n<title>ferrocore: {name}</title>\n<style>{STYLE}</style></head>\n<body>\n");
    let _ = writeln!(h, "<h1>ferrocore compile report: {name}</h1>");
    let memory = lifetimes(r.compiled);
    summary(&mut h, r, &memory);
    let _ = writeln!(h, "<nav><a href=\"#time\">compile time</a> <a href=\"#graph\">graph</a> <a href=\"#kernels\">kernels and library calls</a> <a href=\"#fusion\">fusion decisions</a> <a href=\"#memory\">buffers</a> <a href=\"#runtime\">runtime</a></nav>");
    compile_time(&mut h, r.timings);
    graph_table(&mut h, r);
    steps(&mut h, r);
    fusion(&mut h, r.schedule, r.compiled);
    memory::section(&mut h, r.compiled, &memory);
    let _ = writeln!(h, "<section id=\"runtime\"><h2>Runtime</h2>\n{RUNTIME_START}");
    let _ = writeln!(
        h,
        "<p class=\"note\">Not measured yet. <code>python {} --report REPORT</code> runs the module's benchmark and fills in this section.</p>",
        esc(r.module_path)
    );
    let _ = writeln!(h, "{RUNTIME_END}\n</section>\n</body></html>");
    h
}

fn summary(h: &mut String, r: &ReportInput, memory: &memory::Lifetimes) {
    let kernels = r.compiled.kernels.len();
    let calls = r.compiled.library_calls.iter().filter(|c| !c.fallback).count();
    let fallbacks = r.compiled.library_calls.iter().filter(|c| c.fallback).count();
    let total: f64 = r.timings.iter().map(|(_, ms)| ms).sum();
    let _ = writeln!(
        h,
        "<p class=\"summary\">{} graph nodes; {kernels} kernels ({} backend); {calls} library calls; {fallbacks} ATen fallbacks; peak {} allocated by the module beside {} of inputs; compile stages {total:.1} ms.</p>",
        r.graph.nodes.len(),
        esc(r.backend),
        memory::bytes_text(memory.peak),
        memory::bytes_text(memory.inputs),
    );
    let _ = writeln!(h, "<p>Module: <code>{}</code></p>", esc(r.module_path));
}

fn compile_time(h: &mut String, timings: &[(String, f64)]) {
    let total: f64 = timings.iter().map(|(_, ms)| ms).sum::<f64>().max(1e-9);
    let _ = writeln!(h, "<section id=\"time\"><h2>Compile time by stage</h2>\n<table><tr><th>stage</th><th>ms</th><th>share</th></tr>");
    for (stage, ms) in timings {
        let pct = ms / total * 100.0;
        let _ = writeln!(
            h,
            "<tr><td>{}</td><td class=\"num\">{ms:.2}</td><td><div class=\"bar\" style=\"width:{pct:.1}%\"></div> {pct:.1}%</td></tr>",
            esc(stage)
        );
    }
    let _ = writeln!(
        h,
        "</table>\n<p class=\"note\">Kernel compiles the front runs after this page is written (Triton's, a C++ unit compiled on a thread) and loading the module are in <code>ferrocore.metrics</code>.</p></section>"
    );
}

fn arg_html(g: &Graph, a: &Arg) -> String {
    match a {
        Arg::Node(n) => node_link(g, n.0 as usize),
        Arg::List(items) => format!("[{}]", items.iter().map(|i| arg_html(g, i)).collect::<Vec<_>>().join(", ")),
        other => esc(&crate::graph::fmt_arg(g, other)),
    }
}

fn graph_table(h: &mut String, r: &ReportInput) {
    let g = r.graph;
    let computed = computed_in(r.compiled);
    let _ = writeln!(
        h,
        "<section id=\"graph\"><h2>Graph</h2>\n<table><tr><th>node</th><th>value</th><th>op</th><th>computed in</th><th>source</th></tr>"
    );
    for (i, n) in g.nodes.iter().enumerate() {
        let op = match &n.kind {
            NodeKind::Placeholder => "input".to_string(),
            NodeKind::Call { target, args, kwargs } => {
                let mut parts: Vec<String> = args.iter().map(|a| arg_html(g, a)).collect();
                parts.extend(kwargs.iter().map(|(k, v)| format!("{}={}", esc(k), arg_html(g, v))));
                format!("{}({})", esc(target.name()), parts.join(", "))
            }
        };
        let place = match computed.get(n.name.as_str()) {
            Some(c) => c
                .kernels
                .iter()
                .map(|k| kernel_link(k))
                .chain(c.calls.iter().map(|e| call_link(r.compiled, *e)))
                .collect::<Vec<_>>()
                .join(" "),
            None if matches!(n.kind, NodeKind::Placeholder) => String::new(),
            None => "<span class=\"note\">no code (a view, or folded into its users' indexing)</span>".into(),
        };
        let source = g.sources.get(&n.name).map_or(String::new(), |s| esc(s));
        let _ = writeln!(
            h,
            "<tr id=\"node-{i}\"><td><code>{}</code></td><td><code>{}</code></td><td><code>{op}</code></td><td>{place}</td><td class=\"src\">{source}</td></tr>",
            esc(&n.name),
            esc(&fmt_meta(&n.meta))
        );
    }
    let _ = writeln!(h, "</table></section>");
}

/// Graph node names (as links) and their source lines, for a kernel or a call.
fn origins_html(h: &mut String, g: &Graph, index: &HashMap<&str, usize>, c: &CompiledGraph, origins: &[&str]) {
    let links: Vec<String> = origins.iter().map(|o| index.get(o).map_or_else(|| esc(o), |i| node_link(g, *i))).collect();
    let _ = writeln!(h, "<p>Graph nodes: {}</p>", links.join(", "));
    let mut shown: Vec<&str> = Vec::new();
    for line in origins.iter().filter_map(|o| c.sources.get(*o)) {
        if !shown.contains(&line.as_str()) {
            shown.push(line);
        }
    }
    if !shown.is_empty() {
        let _ = writeln!(h, "<pre class=\"src\">{}</pre>", shown.iter().map(|l| esc(l)).collect::<Vec<_>>().join("\n"));
    }
}

/// The kernels and library calls in the order the module runs them.
fn steps(h: &mut String, r: &ReportInput) {
    let g = r.graph;
    let index: HashMap<&str, usize> = g.nodes.iter().enumerate().map(|(i, n)| (n.name.as_str(), i)).collect();
    let _ = writeln!(h, "<section id=\"kernels\"><h2>Kernels and library calls, in launch order</h2>");
    for step in &r.compiled.steps {
        match step {
            Step::Launch { kernel } => launch_html(h, r, &index, *kernel),
            Step::Call { call } => {
                let c = &r.compiled.library_calls[*call];
                let kind = if c.fallback { "ATen fallback" } else { "library call" };
                let _ = writeln!(h, "<div class=\"step\" id=\"call-{call}\"><h3>{kind} {}</h3>", esc(&c.callee));
                origins_html(h, g, &index, r.compiled, &[c.origin.as_str()]);
                if let Some(reason) = &c.reason {
                    let _ = writeln!(h, "<p>Why: {}</p>", esc(reason));
                }
                // the call as the loop program writes it (buffers by name, arguments in full)
                let _ = writeln!(h, "<pre>{}</pre></div>", esc(r.schedule.program.extern_text(*call).trim()));
            }
            _ => {}
        }
    }
    let _ = writeln!(h, "</section>");
}

/// Launch `l` of the compiled graph: its name, how it is launched, the graph nodes it computes,
/// why it was fused so, and its code.
fn launch_html(h: &mut String, r: &ReportInput, index: &HashMap<&str, usize>, l: usize) {
    let k = &r.compiled.kernels[l];
    let name = k.launch_name.as_str();
    let shape = match &k.launch {
        Launch::Host => format!("host function over {} iterations", k.numel),
        Launch::Grid { config: c, .. } => match c.tile {
            Some([m, n, k]) => format!("grid {} of {m}x{n} tiles (k steps of {k}), {} warps, {} stages", c.grid, c.num_warps, c.num_stages),
            None => format!("grid {} x XBLOCK {}, {} warps, {} stages", c.grid, c.xblock, c.num_warps, c.num_stages),
        },
    };
    let _ = writeln!(h, "<div class=\"step\" id=\"kernel-{name}\"><h3>kernel {name}</h3>\n<p class=\"note\">{shape}</p>");
    if k.name != name {
        // (kernels of one structure are defined once: `codegen::Definitions`)
        let _ = writeln!(h, "<p class=\"note\">Launched as {}: the same code.</p>", kernel_link(&k.name));
    }
    let origins: Vec<&str> = k.origins.iter().map(String::as_str).collect();
    origins_html(h, r.graph, index, r.compiled, &origins);
    let why: Vec<String> = r
        .schedule
        .decisions
        .iter()
        // launch l is the schedule's kernel l (`KernelId`)
        .filter(|d| d.kernel() == Some(KernelId(l)))
        .map(|d| format!("<li>{}</li>", esc(&d.describe(&|_| name.to_string()))))
        .collect();
    if !why.is_empty() {
        let _ = writeln!(h, "<ul class=\"why\">{}</ul>", why.concat());
    }
    let text = r.compiled.unit.as_ref().and_then(|u| u.source.get(k.definition.start..k.definition.end)).unwrap_or("");
    let _ = writeln!(h, "<details><summary>code</summary><pre>{}</pre></details></div>", esc(text));
}

/// Where `name` stands in `text` as a whole word: not inside a longer identifier, nor an
/// anchor's `kernel-NAME`.
fn whole_words<'t>(text: &'t str, name: &'t str) -> impl Iterator<Item = usize> + 't {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    text.match_indices(name).map(|(at, _)| at).filter(move |&at| {
        !text[..at].chars().next_back().is_some_and(|c| word(c) || c == '-') && !text[at + name.len()..].chars().next().is_some_and(word)
    })
}

/// Every decision, in the order the scheduler made them, kernel names linked.
fn fusion(h: &mut String, s: &Schedule, c: &CompiledGraph) {
    let names: Vec<&str> = c.kernels.iter().map(|k| k.launch_name.as_str()).collect();
    let _ = writeln!(h, "<section id=\"fusion\"><h2>Fusion decisions</h2>\n<ol>");
    for d in &s.decisions {
        // a kernel name is an identifier: escaping leaves it as it is, and its link is written whole
        let name = |k: KernelId| names.get(k.0).map_or_else(|| format!("#{}", k.0), |n| n.to_string());
        let mut text = esc(&d.describe(&name));
        if let Some(k) = d.kernel().and_then(|k| names.get(k.0)) {
            text = link_word(&text, k);
        }
        let _ = writeln!(h, "<li>{text}</li>");
    }
    let _ = writeln!(h, "</ol></section>");
}

/// `text` with each whole-word `name` made a link to its kernel.
fn link_word(text: &str, name: &str) -> String {
    let mut out = String::new();
    let mut done = 0;
    for at in whole_words(text, name) {
        out.push_str(&text[done..at]);
        out.push_str(&kernel_link(name));
        done = at + name.len();
    }
    out.push_str(&text[done..]);
    out
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}\
table{border-collapse:collapse;font-size:0.9em}td,th{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}\
.num{text-align:right}.bar{display:inline-block;height:0.8em;background:#4a7}\
.life{position:relative;width:300px;height:0.8em;background:#eee}.life div{position:absolute;top:0;height:100%;background:#47a}\
.step{border-left:3px solid #47a;padding-left:0.8em;margin:1em 0}.note{color:#666}\
.src{color:#555;font-size:0.85em}pre{background:#f6f6f6;padding:0.5em;overflow-x:auto}\
:target{background:#ffd}nav a{margin-right:1em}";
