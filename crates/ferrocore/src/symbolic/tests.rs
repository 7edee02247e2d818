use super::*;

fn v(i: u32) -> IndexExpr {
    IndexExpr::var(Var(i))
}

#[test]
fn affine_terms_combine_and_cancel() {
    let e = v(0).scale(3).add(&v(1)).add(&v(0).scale(-3)).add_const(5);
    assert_eq!(e.to_string(), "v1 + 5");
    assert!(v(2).sub(&v(2)).is_zero());
}

#[test]
fn floordiv_and_mod_of_contiguous_split_simplify() {
    // (i0*12 + i1) // 4 with i1 < 12 -> 3*i0 + i1 // 4 ; % 4 -> i1 % 4
    let r = [10, 12];
    let flat = v(0).scale(12).add(&v(1));
    assert_eq!(flat.floordiv(4, &r).to_string(), "3*v0 + (v1 // 4)");
    assert_eq!(flat.modulo(4, &r).to_string(), "(v1 % 4)");
    // (i0*12 + i1) // 12 -> i0 ; % 12 -> i1
    assert_eq!(flat.floordiv(12, &r).to_string(), "v0");
    assert_eq!(flat.modulo(12, &r).to_string(), "v1");
}

#[test]
fn view_of_view_folds_back() {
    // view [N,12] -> [N,4,3] -> [N,12]: 12*a + 3*(j//3) + j%3 == 12*a + j
    let r = [5, 12];
    let j = v(1);
    let e = v(0).scale(12).add(&j.floordiv(3, &r).scale(3)).add(&j.modulo(3, &r));
    assert_eq!(e.to_string(), "12*v0 + v1");
}

#[test]
fn nested_division_merges_and_ranges_bound() {
    let r = [1000];
    let e = v(0).floordiv(4, &r).floordiv(5, &r);
    assert_eq!(e.to_string(), "(v0 // 20)");
    let (lo, hi) = e.bounds(&r);
    assert_eq!((lo, hi), (0, 49));
    // mod of mod with a divisor that divides
    assert_eq!(v(0).modulo(12, &r).modulo(4, &r).to_string(), "(v0 % 4)");
    // a remainder smaller than a common factor drops out: (4*v0 + 2) // 8 -> v0 // 2
    assert_eq!(v(0).scale(4).add_const(2).floordiv(8, &r).to_string(), "(v0 // 2)");
    assert_eq!(v(0).scale(4).add_const(2).modulo(8, &r).to_string(), "4*(v0 % 2) + 2");
    // (4*v0 + 6) // 8 -> (v0 + 1) // 2
    assert_eq!(v(0).scale(4).add_const(6).floordiv(8, &r).to_string(), "((v0 + 1) // 2)");
}

#[test]
fn small_range_division_is_zero() {
    let r = [4, 7];
    assert_eq!(v(0).floordiv(4, &r).to_string(), "0");
    assert_eq!(v(1).modulo(7, &r).to_string(), "v1");
    assert_eq!(IndexExpr::constant(-7).floordiv(2, &r).to_string(), "-4");
    assert_eq!(IndexExpr::constant(-7).modulo(2, &r).to_string(), "1");
}

#[test]
fn substitution_resimplifies() {
    // v0 -> 4*v1 + v2 (v2 < 4): v0 // 4 -> v1, v0 % 4 -> v2
    let r = [100, 25, 4];
    let e = v(0).floordiv(4, &r).scale(10).add(&v(0).modulo(4, &r));
    let subst = vec![Some(v(1).scale(4).add(&v(2)))];
    assert_eq!(e.substitute(&subst, &r).to_string(), "10*v1 + v2");
}

#[test]
fn affine_coeff() {
    let r = [8, 8];
    let e = v(0).scale(8).add(&v(1).floordiv(2, &r));
    assert_eq!(e.affine_coeff(Var(0)), Some(8));
    assert_eq!(e.affine_coeff(Var(1)), None);
}

#[test]
fn bounds_use_wide_arithmetic() {
    let r = [11];
    let e = v(0).scale(1_000_000_000);
    assert_eq!(e.bounds(&r), (0, 10_000_000_000));
}

#[test]
fn small_remainders_fold_into_coarser_divisions() {
    // (64*x0 + x1) // 32768 with x1 < 64 -> x0 // 512 ; mod -> 64*(x0 % 512) + x1
    let r = [2048, 64];
    let e = v(0).scale(64).add(&v(1));
    assert_eq!(e.floordiv(32768, &r).to_string(), "(v0 // 512)");
    assert_eq!(e.modulo(32768, &r).to_string(), "v1 + 64*(v0 % 512)");
}

#[test]
fn nested_div_mod_split_folds_back_to_the_flat_index() {
    // merging [4,128,256] into one var k: 32768*(k//32768) + 256*((k//256)%128) + k%256 == k
    let r = [131072];
    let k = v(0);
    let e = k.floordiv(32768, &r).scale(32768).add(&k.floordiv(256, &r).modulo(128, &r).scale(256)).add(&k.modulo(256, &r));
    assert_eq!(e.to_string(), "v0");
}

#[test]
fn eval_floors_and_wraps_like_the_generated_code() {
    // a split reduction's flattened outer index: 16384*(x // 64) + x % 64, then a negative offset
    let r = [4096];
    let e = v(0).floordiv(64, &r).scale(16384).add(&v(0).modulo(64, &r)).add_const(-3);
    assert_eq!(e.eval(&[0]), -3);
    assert_eq!(e.eval(&[63]), 60);
    assert_eq!(e.eval(&[64]), 16381);
    assert_eq!(IndexExpr::constant(7).eval(&[]), 7);
}
