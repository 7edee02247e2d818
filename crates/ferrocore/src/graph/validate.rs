//! Tensor metadata that no real tensor can have is rejected at import, naming the node: sizes,
//! strides and storage offsets are checked here so that every later stage may compute element
//! counts and offsets in i64 (generated index arithmetic is int64) without overflow. It checks
//! each tensor's metadata alone; what needs an op's semantics (a view's size argument, a dtype
//! rule) is checked by that op's lowering.

use super::*;

/// The largest storage, in bytes, a tensor may span (numel, every stride and the furthest element
/// it reaches, times its element size). 2^62 leaves index arithmetic room to add two such
/// offsets in int64; no machine has that much memory.
pub const MAX_TENSOR_BYTES: i128 = 1 << 62;

/// Checks every tensor metadata of the graph's nodes (tuple elements included).
pub(super) fn check_metadata(g: &Graph) -> Result<(), ImportError> {
    for n in &g.nodes {
        check_meta(&n.meta).map_err(|message| ImportError { node: Some(n.name.clone()), message })?;
    }
    Ok(())
}

fn check_meta(m: &Meta) -> Result<(), String> {
    match m {
        Meta::Tensor(t) => check_tensor(t),
        Meta::Tuple(items) => items.iter().flatten().try_for_each(check_meta),
        Meta::Scalar(_) | Meta::None => Ok(()),
    }
}

/// Sizes, strides and the storage offset are non-negative (torch creates no negative strides
/// or offsets: `as_strided` refuses them); a tensor with elements spans at most
/// `MAX_TENSOR_BYTES`: its element count, each stride, and its furthest element
/// `offset + Σ (size - 1)·stride`. A tensor without elements may have any strides, as in torch.
pub fn check_tensor(t: &TensorMeta) -> Result<(), String> {
    let what = || format!("shape {:?}, stride {:?}, storage offset {}", t.shape, t.stride, t.storage_offset);
    if t.shape.len() != t.stride.len() {
        return Err(format!("{}: shape and stride differ in rank", what()));
    }
    if t.shape.iter().any(|&s| s < 0) {
        return Err(format!("{}: negative size", what()));
    }
    if t.stride.iter().any(|&s| s < 0) {
        return Err(format!("{}: negative stride", what()));
    }
    if t.storage_offset < 0 {
        return Err(format!("{}: negative storage offset", what()));
    }
    let item = t.dtype.itemsize() as i128;
    let limit = MAX_TENSOR_BYTES / item.max(1);
    // the product of the sizes other than 0 (so that no later product of sizes overflows)
    let mut count: i128 = 1;
    for &s in t.shape.iter().filter(|&&s| s != 0) {
        count *= s as i128;
        if count > limit {
            return Err(format!("{}: more than 2^62 bytes of {} elements", what(), t.dtype));
        }
    }
    if t.shape.contains(&0) {
        return Ok(()); // no element is ever addressed
    }
    let mut furthest = t.storage_offset as i128;
    for (&size, &stride) in t.shape.iter().zip(&t.stride) {
        if stride as i128 > limit {
            return Err(format!("{}: a stride past 2^62 bytes of {} elements", what(), t.dtype));
        }
        furthest += (size as i128 - 1) * stride as i128;
        if furthest >= limit {
            return Err(format!("{}: elements past 2^62 bytes of {} storage", what(), t.dtype));
        }
    }
    Ok(())
}
