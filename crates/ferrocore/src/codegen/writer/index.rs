//! The one index printer: an index expression in a dialect's integer syntax. Division and
//! modulo truncate in both C++ and Triton, so `/` and `%` are used only where the operand is
//! provably non-negative, the dialect's floor helpers otherwise.

use crate::symbolic::{Atom, IndexExpr, Var};

/// How a dialect writes integer index arithmetic.
pub struct IndexSyntax {
    /// What follows an integer literal (`LL`: C++'s 64-bit literals).
    pub int_suffix: &'static str,
    /// Truncating division and modulo, used where the operand is never negative.
    pub div: &'static str,
    pub rem: &'static str,
    /// Whether a dividend is parenthesized before `div` and `rem`.
    pub paren_dividend: bool,
    /// The prelude's floor-semantics helpers, used otherwise.
    pub floor_div_helper: &'static str,
    pub mod_helper: &'static str,
}

impl IndexSyntax {
    fn int(&self, v: i64) -> String {
        format!("{v}{}", self.int_suffix)
    }

    /// `inner op d` (`op` a division or modulo by a positive constant).
    fn divide(&self, inner: &str, d: i64, nonneg: bool, op: &str, helper: &str) -> String {
        let d = self.int(d);
        match (nonneg, self.paren_dividend) {
            (false, _) => format!("{helper}({inner}, {d})"),
            (true, true) => format!("(({inner}) {op} {d})"),
            (true, false) => format!("({inner} {op} {d})"),
        }
    }
}

/// Prints index expressions over loop variables named by `var_name`, whose ranges bound them.
pub struct IndexPrinter<'a> {
    pub syntax: &'a IndexSyntax,
    pub var_name: &'a dyn Fn(Var) -> String,
    pub ranges: &'a [i64],
}

impl IndexPrinter<'_> {
    pub fn expr(&self, e: &IndexExpr) -> String {
        let mut parts: Vec<String> = Vec::new();
        for (a, c) in &e.terms {
            let atom = match a {
                Atom::Var(v) => (self.var_name)(*v),
                Atom::FloorDiv(inner, d) => {
                    let nonneg = inner.bounds(self.ranges).0 >= 0;
                    self.syntax.divide(&self.expr(inner), *d, nonneg, self.syntax.div, self.syntax.floor_div_helper)
                }
                Atom::Mod(inner, d) => {
                    let nonneg = inner.bounds(self.ranges).0 >= 0;
                    self.syntax.divide(&self.expr(inner), *d, nonneg, self.syntax.rem, self.syntax.mod_helper)
                }
            };
            parts.push(match *c {
                1 => atom,
                -1 => format!("-{atom}"),
                c => format!("{}*{atom}", self.syntax.int(c)),
            });
        }
        if e.constant != 0 || parts.is_empty() {
            parts.push(self.syntax.int(e.constant));
        }
        let s = parts.join(" + ").replace("+ -", "- ");
        if parts.len() > 1 {
            format!("({s})")
        } else {
            s
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const C_LIKE: IndexSyntax =
        IndexSyntax { int_suffix: "LL", div: "/", rem: "%", paren_dividend: true, floor_div_helper: "floordiv", mod_helper: "mod" };
    const PY_LIKE: IndexSyntax =
        IndexSyntax { int_suffix: "", div: "//", rem: "%", paren_dividend: false, floor_div_helper: "floordiv", mod_helper: "mod" };

    fn print(syntax: &IndexSyntax, e: &IndexExpr, ranges: &[i64]) -> String {
        let names = |v: Var| format!("x{}", v.0);
        IndexPrinter { syntax, var_name: &names, ranges }.expr(e)
    }

    fn v(i: u32) -> IndexExpr {
        IndexExpr::var(Var(i))
    }

    #[test]
    fn operators_where_the_dividend_is_never_negative_helpers_elsewhere() {
        let r = [8, 8];
        let e = v(0).scale(8).add(&v(1).floordiv(2, &r));
        assert_eq!(print(&C_LIKE, &e, &r), "(8LL*x0 + ((x1) / 2LL))");
        assert_eq!(print(&PY_LIKE, &e, &r), "(8*x0 + (x1 // 2))");
        // x1 - 4 may be negative: floor semantics need the helper
        let shifted = v(1).add(&IndexExpr::constant(-4));
        let m = IndexExpr { constant: 0, terms: vec![(Atom::Mod(Box::new(shifted), 3), 1)] };
        assert_eq!(print(&C_LIKE, &m, &r), "mod((x1 - 4LL), 3LL)");
        assert_eq!(print(&PY_LIKE, &m, &r), "mod((x1 - 4), 3)");
    }

    #[test]
    fn signs_and_constants() {
        let neg = IndexExpr::constant(7).sub(&v(0));
        assert_eq!(print(&C_LIKE, &neg, &[8]), "(-x0 + 7LL)");
        assert_eq!(print(&PY_LIKE, &neg, &[8]), "(-x0 + 7)");
        assert_eq!(print(&PY_LIKE, &IndexExpr::constant(0), &[]), "0");
        assert_eq!(print(&C_LIKE, &v(0).scale(-3), &[8]), "-3LL*x0");
    }
}
