//! Symbolic index expressions: integer affine sums of atoms (loop variables, floor-division,
//! modulo), kept in a canonical form and simplified as they are built against the known ranges
//! of the loop variables. Depends on nothing else in the crate; all arithmetic is i64 with
//! interval bounds computed in i128 so that index math never silently overflows.

use std::collections::BTreeMap;
use std::fmt;

/// A loop variable; its range `[0, size)` lives in a [`VarRanges`] table indexed by the id.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct Var(pub u32);

/// Sizes of loop variables: `ranges[v] = n` means `v` is in `[0, n)`.
pub type VarRanges = [i64];

#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub enum Atom {
    Var(Var),
    /// floor(e / d), d > 1
    FloorDiv(Box<IndexExpr>, i64),
    /// e mod d (result in [0, d)), d > 1
    Mod(Box<IndexExpr>, i64),
}

/// `constant + Σ coeff·atom`, terms sorted by atom, no zero coefficients.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub struct IndexExpr {
    pub constant: i64,
    pub terms: Vec<(Atom, i64)>,
}

impl IndexExpr {
    pub fn constant(c: i64) -> Self {
        IndexExpr { constant: c, terms: Vec::new() }
    }
    pub fn var(v: Var) -> Self {
        IndexExpr { constant: 0, terms: vec![(Atom::Var(v), 1)] }
    }
    pub fn zero() -> Self {
        Self::constant(0)
    }
    pub fn as_constant(&self) -> Option<i64> {
        if self.terms.is_empty() {
            Some(self.constant)
        } else {
            None
        }
    }
    pub fn is_zero(&self) -> bool {
        self.terms.is_empty() && self.constant == 0
    }

    fn from_map(constant: i64, map: BTreeMap<Atom, i64>) -> Self {
        let terms: Vec<(Atom, i64)> = map.into_iter().filter(|(_, c)| *c != 0).collect();
        let e = IndexExpr { constant, terms };
        e.fold_div_mod_pairs()
    }

    /// `k·d·(x // d) + k·(x mod d)` is `k·x`: folds the pairs that a view-of-a-view leaves behind.
    fn fold_div_mod_pairs(self) -> Self {
        let mut map: BTreeMap<Atom, i64> = self.terms.iter().cloned().collect();
        let mods: Vec<(Atom, i64)> = map.iter().filter(|(a, _)| matches!(a, Atom::Mod(..))).map(|(a, c)| (a.clone(), *c)).collect();
        for (m, k) in mods {
            if let Atom::Mod(inner, d) = &m {
                // the partner of (e mod d) is e // d in canonical form: (x // a) // d is x // (a·d)
                let div = match inner.single_atom() {
                    Some(Atom::FloorDiv(x, a)) if inner.constant == 0 => Atom::FloorDiv(x.clone(), a * d),
                    _ => Atom::FloorDiv(inner.clone(), *d),
                };
                if map.get(&div) == Some(&(k * d)) && map.contains_key(&m) {
                    map.remove(&div);
                    map.remove(&m);
                    let mut rest = IndexExpr { constant: self.constant, terms: map.into_iter().collect() };
                    rest = rest.add(&inner.scale(k));
                    map = rest.terms.iter().cloned().collect();
                    let c = rest.constant;
                    return IndexExpr { constant: c, terms: map.into_iter().filter(|(_, c)| *c != 0).collect() }.fold_div_mod_pairs();
                }
            }
        }
        IndexExpr { constant: self.constant, terms: map.into_iter().collect() }
    }

    pub fn add(&self, other: &IndexExpr) -> IndexExpr {
        let mut map: BTreeMap<Atom, i64> = self.terms.iter().cloned().collect();
        for (a, c) in &other.terms {
            *map.entry(a.clone()).or_insert(0) += c;
        }
        IndexExpr::from_map(self.constant + other.constant, map)
    }
    pub fn sub(&self, other: &IndexExpr) -> IndexExpr {
        self.add(&other.scale(-1))
    }
    pub fn add_const(&self, c: i64) -> IndexExpr {
        let mut e = self.clone();
        e.constant += c;
        e
    }
    pub fn scale(&self, k: i64) -> IndexExpr {
        if k == 0 {
            return IndexExpr::zero();
        }
        IndexExpr { constant: self.constant * k, terms: self.terms.iter().map(|(a, c)| (a.clone(), c * k)).collect() }
    }

    /// The value at the point where variable `v` is `values[v]` (0 past the end).
    pub fn eval(&self, values: &[i64]) -> i128 {
        let mut out = self.constant as i128;
        for (a, c) in &self.terms {
            let x = match a {
                Atom::Var(v) => values.get(v.0 as usize).copied().unwrap_or(0) as i128,
                Atom::FloorDiv(e, d) => e.eval(values).div_euclid(*d as i128),
                Atom::Mod(e, d) => e.eval(values).rem_euclid(*d as i128),
            };
            out += *c as i128 * x;
        }
        out
    }

    /// Inclusive bounds of the expression given variable ranges.
    pub fn bounds(&self, ranges: &VarRanges) -> (i128, i128) {
        let mut lo = self.constant as i128;
        let mut hi = lo;
        for (a, c) in &self.terms {
            let (alo, ahi) = a.bounds(ranges);
            let c = *c as i128;
            if c >= 0 {
                lo += c * alo;
                hi += c * ahi;
            } else {
                lo += c * ahi;
                hi += c * alo;
            }
        }
        (lo, hi)
    }

    /// floor(self / d) for d >= 1, simplified.
    pub fn floordiv(&self, d: i64, ranges: &VarRanges) -> IndexExpr {
        assert!(d >= 1, "floordiv by non-positive divisor");
        if d == 1 {
            return self.clone();
        }
        if let Some(c) = self.as_constant() {
            return IndexExpr::constant(c.div_euclid(d));
        }
        // Split off the multiple-of-d part exactly: floor((d·q + r)/d) = q + floor(r/d).
        let mut q = IndexExpr::constant(self.constant.div_euclid(d));
        let mut r = IndexExpr::constant(self.constant.rem_euclid(d));
        for (a, c) in &self.terms {
            if c % d == 0 {
                q.terms.push((a.clone(), c / d));
            } else {
                r.terms.push((a.clone(), *c));
            }
        }
        let (lo, hi) = r.bounds(ranges);
        if lo >= 0 && hi < d as i128 {
            return q;
        }
        // A common factor of r's coefficients and d cancels.
        let g = r.terms.iter().fold(gcd(r.constant.abs(), d), |g, (_, c)| gcd(g, c.abs()));
        let (r, d) = if g > 1 { (r.exact_div(g), d / g) } else { (r, d) };
        if d == 1 {
            return q.add(&r);
        }
        let (lo, hi) = r.bounds(ranges);
        if lo >= 0 && hi < d as i128 {
            return q;
        }
        // g·B + s with 0 <= s < g and g | d: floor((g·B + s) / d) = floor(B / (d/g))
        if let Some((big, g)) = r.split_small_part(d, ranges) {
            return q.add(&big.floordiv(d / g, ranges));
        }
        // (x // a) // b = x // (a·b)
        let atom = match r.single_atom() {
            Some(Atom::FloorDiv(inner, d1)) if r.constant == 0 => Atom::FloorDiv(inner.clone(), d1 * d),
            _ => Atom::FloorDiv(Box::new(r), d),
        };
        q.add(&IndexExpr { constant: 0, terms: vec![(atom, 1)] })
    }

    /// self mod d (floor semantics, result in [0, d)) for d >= 1, simplified.
    pub fn modulo(&self, d: i64, ranges: &VarRanges) -> IndexExpr {
        assert!(d >= 1, "modulo by non-positive divisor");
        if d == 1 {
            return IndexExpr::zero();
        }
        let mut r = IndexExpr::constant(self.constant.rem_euclid(d));
        for (a, c) in &self.terms {
            if c % d != 0 {
                r.terms.push((a.clone(), *c));
            }
        }
        if let Some(c) = r.as_constant() {
            return IndexExpr::constant(c.rem_euclid(d));
        }
        let (lo, hi) = r.bounds(ranges);
        if lo >= 0 && hi < d as i128 {
            return r;
        }
        // g·B + s with 0 <= s < g and g | d: (g·B + s) mod d = g·(B mod (d/g)) + s
        if let Some((big, g)) = r.split_small_part(d, ranges) {
            let small = r.sub(&big.scale(g));
            return big.modulo(d / g, ranges).scale(g).add(&small);
        }
        let g = r.terms.iter().fold(gcd(r.constant.abs(), d), |g, (_, c)| gcd(g, c.abs()));
        if g > 1 {
            // (g·a) mod (g·b) = g·(a mod b)
            return r.exact_div(g).modulo(d / g, ranges).scale(g);
        }
        let atom = match r.single_atom() {
            // (x mod (k·d)) mod d = x mod d
            Some(Atom::Mod(inner, d2)) if r.constant == 0 && d2 % d == 0 => Atom::Mod(inner.clone(), d),
            _ => Atom::Mod(Box::new(r), d),
        };
        IndexExpr { constant: 0, terms: vec![(atom, 1)] }
    }

    /// Finds g > 1 dividing `d` such that self = g·B + s with s in [0, g): returns (B, g),
    /// trying the largest g first.
    fn split_small_part(&self, d: i64, ranges: &VarRanges) -> Option<(IndexExpr, i64)> {
        let mut cands: Vec<i64> = self.terms.iter().map(|(_, c)| gcd(c.abs(), d)).filter(|&g| g > 1 && g < d).collect();
        cands.sort_unstable_by(|a, b| b.cmp(a));
        cands.dedup();
        for g in cands {
            let mut big = IndexExpr::constant(self.constant.div_euclid(g));
            let mut small = IndexExpr::constant(self.constant.rem_euclid(g));
            for (a, c) in &self.terms {
                if c % g == 0 {
                    big.terms.push((a.clone(), c / g));
                } else {
                    small.terms.push((a.clone(), *c));
                }
            }
            if big.terms.is_empty() {
                continue;
            }
            let (lo, hi) = small.bounds(ranges);
            if lo >= 0 && hi < g as i128 {
                return Some((big, g));
            }
        }
        None
    }

    fn exact_div(&self, g: i64) -> IndexExpr {
        IndexExpr { constant: self.constant / g, terms: self.terms.iter().map(|(a, c)| (a.clone(), c / g)).collect() }
    }

    fn single_atom(&self) -> Option<&Atom> {
        match self.terms.as_slice() {
            [(a, 1)] => Some(a),
            _ => None,
        }
    }

    /// Coefficient of `v` when `v` appears only as a top-level affine term; None if `v` also
    /// appears inside a floor-division or modulo.
    pub fn affine_coeff(&self, v: Var) -> Option<i64> {
        let mut coeff = 0;
        for (a, c) in &self.terms {
            match a {
                Atom::Var(w) if *w == v => coeff = *c,
                Atom::Var(_) => {}
                Atom::FloorDiv(e, _) | Atom::Mod(e, _) => {
                    if e.uses(v) {
                        return None;
                    }
                }
            }
        }
        Some(coeff)
    }

    /// Whether the expression uses a variable numbered `first` or above (e.g. a reduction's).
    pub fn uses_vars_from(&self, first: usize) -> bool {
        let mut vs = Vec::new();
        self.vars(&mut vs);
        vs.iter().any(|v| v.0 as usize >= first)
    }

    pub fn uses(&self, v: Var) -> bool {
        self.terms.iter().any(|(a, _)| a.uses(v))
    }

    pub fn vars(&self, out: &mut Vec<Var>) {
        for (a, _) in &self.terms {
            match a {
                Atom::Var(v) => {
                    if !out.contains(v) {
                        out.push(*v)
                    }
                }
                Atom::FloorDiv(e, _) | Atom::Mod(e, _) => e.vars(out),
            }
        }
    }

    /// Replace variables by expressions (`subst[v]` for v < subst.len()), re-simplifying
    /// against `ranges`, the ranges of the variables the replacements use.
    pub fn substitute(&self, subst: &[Option<IndexExpr>], ranges: &VarRanges) -> IndexExpr {
        let mut out = IndexExpr::constant(self.constant);
        for (a, c) in &self.terms {
            let e = match a {
                Atom::Var(v) => match subst.get(v.0 as usize).and_then(|s| s.as_ref()) {
                    Some(e) => e.clone(),
                    None => IndexExpr::var(*v),
                },
                Atom::FloorDiv(e, d) => e.substitute(subst, ranges).floordiv(*d, ranges),
                Atom::Mod(e, d) => e.substitute(subst, ranges).modulo(*d, ranges),
            };
            out = out.add(&e.scale(*c));
        }
        out
    }
}

impl Atom {
    pub fn bounds(&self, ranges: &VarRanges) -> (i128, i128) {
        match self {
            Atom::Var(v) => {
                let n = ranges.get(v.0 as usize).copied().unwrap_or(i64::MAX) as i128;
                (0, (n - 1).max(0))
            }
            Atom::FloorDiv(e, d) => {
                let (lo, hi) = e.bounds(ranges);
                (lo.div_euclid(*d as i128), hi.div_euclid(*d as i128))
            }
            Atom::Mod(e, d) => {
                let (lo, hi) = e.bounds(ranges);
                if lo >= 0 && hi < *d as i128 {
                    (lo, hi)
                } else {
                    (0, *d as i128 - 1)
                }
            }
        }
    }
    fn uses(&self, v: Var) -> bool {
        match self {
            Atom::Var(w) => *w == v,
            Atom::FloorDiv(e, _) | Atom::Mod(e, _) => e.uses(v),
        }
    }
}

pub fn gcd(a: i64, b: i64) -> i64 {
    let (mut a, mut b) = (a.abs(), b.abs());
    while b != 0 {
        let t = a % b;
        a = b;
        b = t;
    }
    a
}

impl IndexExpr {
    fn grouped(&self) -> String {
        let parts = self.terms.len() + usize::from(self.constant != 0);
        if parts > 1 {
            format!("({self})")
        } else {
            self.to_string()
        }
    }
}

impl fmt::Display for IndexExpr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for (a, c) in &self.terms {
            let atom = match a {
                Atom::Var(v) => format!("v{}", v.0),
                Atom::FloorDiv(e, d) => format!("({} // {d})", e.grouped()),
                Atom::Mod(e, d) => format!("({} % {d})", e.grouped()),
            };
            let (sign, mag) = if *c < 0 { ("-", -*c) } else { ("+", *c) };
            if first {
                if sign == "-" {
                    write!(f, "-")?;
                }
            } else {
                write!(f, " {sign} ")?;
            }
            if mag == 1 {
                write!(f, "{atom}")?;
            } else {
                write!(f, "{mag}*{atom}")?;
            }
            first = false;
        }
        if first {
            write!(f, "{}", self.constant)
        } else if self.constant > 0 {
            write!(f, " + {}", self.constant)
        } else if self.constant < 0 {
            write!(f, " - {}", -self.constant)
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests;
