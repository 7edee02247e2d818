//! Where a kernel's values are computed and the text of each place: every dialect names values
//! the same way (`tmpN`, `accN`, ...) and places each after its operands.

use crate::graph::DType;
use crate::symbolic::IndexExpr;
use std::collections::HashMap;

/// Where a value is computed: once per kernel call before every loop (it reads no loop variable
/// and only buffers the kernel does not write; a dialect without such a place uses `Pre`), before
/// the group's loops (it depends on `x0` at most), inside them, or after them (it depends on a
/// reduction result).
#[derive(Clone, Copy, PartialEq, Eq, Debug, PartialOrd, Ord)]
pub enum Section {
    Kernel,
    Pre,
    Inner,
    Post,
}

/// The code of one place of a loop group.
#[derive(Default, Debug)]
pub struct SectionText {
    pub kernel: String,
    pub pre: String,
    pub inner: String,
    pub post: String,
}

impl SectionText {
    pub fn at(&mut self, section: Section) -> &mut String {
        match section {
            Section::Kernel => &mut self.kernel,
            Section::Pre => &mut self.pre,
            Section::Inner => &mut self.inner,
            Section::Post => &mut self.post,
        }
    }

    /// Appends `other`'s code to each place.
    pub fn append(&mut self, other: &SectionText) {
        self.kernel.push_str(&other.kernel);
        self.pre.push_str(&other.pre);
        self.inner.push_str(&other.inner);
        self.post.push_str(&other.post);
    }
}

/// A dialect's statement binding a value: `(name, dtype, expression)` -> one line, newline
/// included.
pub type Assign = fn(&str, DType, &str) -> String;

/// Expressions already computed in a loop group: text -> (value, section).
pub type Computed = HashMap<String, (String, Section)>;

/// The values one node body emits: their names, their places and the code of each place.
pub struct Values<'a> {
    tmp: &'a mut usize,
    sections: HashMap<String, Section>,
    /// Expressions computed earlier in the group, reused rather than computed again (a dialect
    /// whose compiler does not do this itself passes it).
    computed: Option<&'a mut Computed>,
    assign: Assign,
    /// Whether the dialect has a `Section::Kernel` place.
    kernel_section: bool,
    /// The node's loop ranges (what bounds its index expressions).
    pub ranges: &'a [i64],
    /// The variables fixed before the inner loop (a bit per variable; variable 0 by default):
    /// a value reading no other is computed before it.
    pub outer_vars: u64,
    pub text: SectionText,
    /// Why this body cannot be rendered (the first reason).
    pub unsupported: Option<String>,
}

impl<'a> Values<'a> {
    pub fn new(tmp: &'a mut usize, assign: Assign, kernel_section: bool, computed: Option<&'a mut Computed>, ranges: &'a [i64]) -> Self {
        Values {
            tmp,
            sections: HashMap::new(),
            computed,
            assign,
            kernel_section,
            ranges,
            outer_vars: 1,
            text: SectionText::default(),
            unsupported: None,
        }
    }

    /// The earliest place a value can be computed.
    pub fn first(&self) -> Section {
        if self.kernel_section {
            Section::Kernel
        } else {
            Section::Pre
        }
    }

    /// The section of a value this body returned (names it did not make were computed before
    /// this group: scalar locals of earlier groups).
    pub fn section_of(&self, name: &str) -> Section {
        self.sections.get(name).copied().unwrap_or(Section::Pre)
    }

    /// Records where `name` is available.
    pub fn place(&mut self, name: &str, section: Section) {
        self.sections.insert(name.to_string(), section);
    }

    /// Inner when the index uses an inner loop variable, the first place when it uses none,
    /// else computable before the group's loops.
    pub fn index_section(&self, e: &IndexExpr) -> Section {
        let mut vs = Vec::new();
        e.vars(&mut vs);
        if vs.iter().any(|v| v.0 >= 64 || self.outer_vars & (1 << v.0) == 0) {
            Section::Inner
        } else if vs.is_empty() {
            self.first()
        } else {
            Section::Pre
        }
    }

    /// A new name `<prefix>N` (one counter per kernel).
    pub fn fresh(&mut self, prefix: &str) -> String {
        let n = format!("{prefix}{}", *self.tmp);
        *self.tmp += 1;
        n
    }

    /// Appends `code` (whole lines) to `section`.
    pub fn push(&mut self, section: Section, code: &str) {
        self.text.at(section).push_str(code);
    }

    /// Binds `expr` to a new value in the latest of `at_least` and the operands' sections, or
    /// returns the value of the same expression computed earlier in the group.
    pub fn emit_in(&mut self, at_least: Section, dtype: DType, expr: String, operands: &[&String]) -> String {
        if let Some((name, section)) = self.computed.as_ref().and_then(|c| c.get(&expr)).cloned() {
            self.place(&name, section);
            return name;
        }
        let section = operands.iter().map(|o| self.section_of(o)).fold(at_least, Section::max);
        let name = self.fresh("tmp");
        let line = (self.assign)(&name, dtype, &expr);
        self.push(section, &line);
        self.place(&name, section);
        if let Some(c) = self.computed.as_mut() {
            c.insert(expr, (name.clone(), section));
        }
        name
    }

    /// `emit_in` from the first place.
    pub fn emit(&mut self, dtype: DType, expr: String, operands: &[&String]) -> String {
        self.emit_in(self.first(), dtype, expr, operands)
    }

    /// Whether `key` was computed (or recorded) earlier in the group.
    pub fn was_computed(&self, key: &str) -> bool {
        self.computed.as_ref().is_some_and(|c| c.contains_key(key))
    }

    /// Records `key` as computed, as `name` in `section`.
    pub fn record(&mut self, key: String, name: String, section: Section) {
        if let Some(c) = self.computed.as_mut() {
            c.insert(key, (name, section));
        }
    }

    /// Notes that the body cannot be rendered; the value stands for nothing.
    pub fn unsupported(&mut self, why: String) -> String {
        if self.unsupported.is_none() {
            self.unsupported = Some(why);
        }
        "None".into()
    }
}
