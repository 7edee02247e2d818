//! Minimum s-t cuts of capacitated directed graphs (Dinic's max-flow). `joint` uses one to
//! choose the activations a training graph's forward saves for its backward: each value is an
//! edge whose capacity is what saving it costs, and the cheapest cut between what the forward
//! must compute and what the backward needs is the set to save.

use std::collections::VecDeque;

/// A capacity no cut may take: larger than any sum of finite capacities the caller passes.
pub const INFINITE: i64 = i64::MAX / 4;

struct Network {
    head: Vec<usize>, // per vertex: its first edge, or NONE
    next: Vec<usize>, // per edge: the vertex's next edge
    to: Vec<usize>,
    residual: Vec<i64>, // edge 2k is the k-th caller edge, 2k+1 its reverse
}

const NONE: usize = usize::MAX;

impl Network {
    fn new(vertices: usize, edges: usize) -> Self {
        Network {
            head: vec![NONE; vertices],
            next: Vec::with_capacity(2 * edges),
            to: Vec::with_capacity(2 * edges),
            residual: Vec::with_capacity(2 * edges),
        }
    }

    fn add(&mut self, from: usize, to: usize, capacity: i64) {
        for (a, b, c) in [(from, to, capacity), (to, from, 0)] {
            self.next.push(self.head[a]);
            self.head[a] = self.to.len();
            self.to.push(b);
            self.residual.push(c);
        }
    }

    /// Distances from `source` over edges with residual capacity; None where unreached.
    fn levels(&self, source: usize) -> Vec<Option<u32>> {
        let mut level = vec![None; self.head.len()];
        level[source] = Some(0);
        let mut queue = VecDeque::from([source]);
        while let Some(v) = queue.pop_front() {
            let mut e = self.head[v];
            while e != NONE {
                let w = self.to[e];
                if self.residual[e] > 0 && level[w].is_none() {
                    level[w] = Some(level[v].unwrap() + 1);
                    queue.push_back(w);
                }
                e = self.next[e];
            }
        }
        level
    }

    /// One blocking flow along the level graph (iterative, so deep graphs cannot overflow the stack).
    fn blocking_flow(&mut self, source: usize, sink: usize, level: &[Option<u32>]) -> i64 {
        let mut cursor = self.head.clone();
        let mut total = 0i64;
        loop {
            // a path of edges from source towards sink, advancing each vertex's cursor past dead ends
            let mut path: Vec<usize> = Vec::new();
            let mut v = source;
            while v != sink {
                let mut advanced = false;
                while cursor[v] != NONE {
                    let e = cursor[v];
                    let w = self.to[e];
                    if self.residual[e] > 0 && level[w].is_some() && level[w] == level[v].map(|l| l + 1) {
                        path.push(e);
                        v = w;
                        advanced = true;
                        break;
                    }
                    cursor[v] = self.next[e];
                }
                if !advanced {
                    if v == source {
                        return total;
                    }
                    // v is a dead end: retreat, and skip the edge that led here
                    let e = path.pop().unwrap();
                    v = self.to[e ^ 1];
                    cursor[v] = self.next[cursor[v]];
                }
            }
            let pushed = path.iter().map(|&e| self.residual[e]).min().unwrap_or(0);
            for &e in &path {
                self.residual[e] -= pushed;
                self.residual[e ^ 1] += pushed;
            }
            total = total.saturating_add(pushed);
            if total >= INFINITE {
                return total; // an uncuttable path: the caller reports it
            }
        }
    }
}

/// The source side of a minimum cut: `true` for each vertex still reachable from `source` once
/// the maximum flow is pushed. Edges are (from, to, capacity) with capacities in 0..=INFINITE.
pub fn source_side(vertices: usize, edges: &[(u32, u32, i64)], source: usize, sink: usize) -> Result<Vec<bool>, String> {
    if source >= vertices || sink >= vertices || source == sink {
        return Err(format!("min cut: source {source} and sink {sink} must be distinct vertices of {vertices}"));
    }
    let mut network = Network::new(vertices, edges.len());
    for (i, &(from, to, capacity)) in edges.iter().enumerate() {
        if from as usize >= vertices || to as usize >= vertices || !(0..=INFINITE).contains(&capacity) {
            return Err(format!("min cut: edge {i} ({from} -> {to}, capacity {capacity}) is out of range"));
        }
        network.add(from as usize, to as usize, capacity);
    }
    loop {
        let level = network.levels(source);
        if level[sink].is_none() {
            return Ok(level.iter().map(Option::is_some).collect());
        }
        if network.blocking_flow(source, sink, &level) >= INFINITE {
            return Err("min cut: every cut crosses an edge of infinite capacity".into());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_the_cheapest_edges() {
        // 0 -> 1 -> 3, 0 -> 2 -> 3; the cheap edges are 0->1 (3) and 2->3 (2)
        let edges = [(0, 1, 3), (1, 3, 10), (0, 2, 9), (2, 3, 2)];
        let side = source_side(4, &edges, 0, 3).unwrap();
        assert_eq!(side, vec![true, false, true, false]);
    }

    #[test]
    fn flow_through_a_chain_of_split_vertices() {
        // a value saved where it is smallest: in 1 -> out 1 (8), in 2 -> out 2 (3), in 3 -> out 3 (5)
        let edges = [(0, 1, INFINITE), (1, 2, 8), (2, 3, INFINITE), (3, 4, 3), (4, 5, INFINITE), (5, 6, 5), (6, 7, INFINITE)];
        let side = source_side(8, &edges, 0, 7).unwrap();
        assert_eq!(side, vec![true, true, true, true, false, false, false, false]);
    }

    #[test]
    fn infinite_cut_and_bad_edges_are_errors() {
        assert!(source_side(2, &[(0, 1, INFINITE)], 0, 1).is_err());
        assert!(source_side(2, &[(0, 5, 1)], 0, 1).is_err());
        assert!(source_side(2, &[(0, 1, -1)], 0, 1).is_err());
        assert!(source_side(2, &[], 0, 0).is_err());
    }

    #[test]
    fn unreachable_sink_cuts_nothing() {
        let side = source_side(3, &[(0, 1, 4)], 0, 2).unwrap();
        assert_eq!(side, vec![true, true, false]);
    }
}
