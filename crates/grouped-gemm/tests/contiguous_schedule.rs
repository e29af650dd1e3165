//! CPU model of the contiguous grouped kernel's tile order
//! (`kernels/include/moefuse/sched/grouped_contiguous.cuh`), line for line, checked
//! exhaustively on random group layouts: every (group, m-block, n-block) of every group is
//! stored by exactly one CTA, empty groups get no tiles, a tile never reaches past its
//! group's rows, and cluster partners walk the same group and n-block, in both walks
//! (group-major, and its front and back interleaved).

#![forbid(unsafe_code)]

use moefuse_testkit::Rng;

struct Table {
    row_start: Vec<i32>,
    row_end: Vec<i32>,
    m_units_end: Vec<i32>,
    total_m_units: i32,
}

fn build(ends: &[i32], total_rows: i32, tile_m: i32, cluster_m: i32) -> Table {
    let clamp = |v: i32| v.clamp(0, total_rows);
    let (mut row_start, mut row_end, mut m_units_end) = (vec![], vec![], vec![]);
    let mut sum = 0;
    for e in 0..ends.len() {
        let end = clamp(ends[e]);
        let start = if e == 0 { 0 } else { clamp(ends[e - 1]) }.min(end);
        row_start.push(start);
        row_end.push(end);
        let unit = tile_m * cluster_m;
        sum += (end - start + unit - 1) / unit;
        m_units_end.push(sum);
    }
    Table {
        row_start,
        row_end,
        m_units_end,
        total_m_units: sum,
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Tile {
    group: usize,
    row0: i32,
    rows: i32,
    n_block: i32,
}

/// Every tile CTA `rank` of cluster `first` walks, as the device walker does.
#[allow(clippy::too_many_arguments)]
fn walk(
    t: &Table,
    tile_m: i32,
    cluster_m: i32,
    n_blocks: i32,
    band: i32,
    n_fast: bool,
    interleave: bool,
    first: i32,
    stride: i32,
    rank: i32,
) -> Vec<Tile> {
    let total = t.total_m_units * n_blocks;
    let (mut pos, mut group, mut out) = (first, 0usize, vec![]);
    while pos < total {
        let tile = if !interleave {
            pos
        } else if pos % 2 == 1 {
            total - 1 - pos / 2
        } else {
            pos / 2
        };
        if interleave {
            // The device's binary search: the first group whose tiles end past `tile`.
            let (mut lo, mut hi) = (0usize, t.m_units_end.len() - 1);
            while lo < hi {
                let mid = (lo + hi) / 2;
                if tile < t.m_units_end[mid] * n_blocks {
                    hi = mid;
                } else {
                    lo = mid + 1;
                }
            }
            group = lo;
        } else {
            while tile >= t.m_units_end[group] * n_blocks {
                group += 1;
            }
        }
        let first_unit = if group == 0 {
            0
        } else {
            t.m_units_end[group - 1]
        };
        let m_units = t.m_units_end[group] - first_unit;
        let local = tile - first_unit * n_blocks;
        let band_tiles = band * n_blocks;
        let b = local / band_tiles;
        let r = local - b * band_tiles;
        let len = band.min(m_units - b * band);
        let (m_unit, n_block) = if n_fast {
            (b * band + r / n_blocks, r % n_blocks)
        } else {
            (b * band + r % len, r / len)
        };
        let row0 = t.row_start[group] + (m_unit * cluster_m + rank) * tile_m;
        let rows = (t.row_end[group] - row0).clamp(0, tile_m);
        out.push(Tile {
            group,
            row0,
            rows,
            n_block,
        });
        pos += stride;
    }
    out
}

#[test]
fn every_tile_of_every_group_is_stored_exactly_once() {
    let mut rng = Rng::new(0x5eed_c0de);
    let tile_m = 128;
    for case in 0..400 {
        let groups = 1 + rng.below(if case % 4 == 0 { 300 } else { 20 });
        let sizes: Vec<i32> = (0..groups)
            .map(|_| match rng.below(4) {
                0 => 0,
                1 => rng.below(64) as i32,
                2 => rng.below(600) as i32,
                _ => 128 * (1 + rng.below(4)) as i32,
            })
            .collect();
        let ends: Vec<i32> = sizes
            .iter()
            .scan(0, |acc, s| {
                *acc += s;
                Some(*acc)
            })
            .collect();
        let total_rows = *ends.last().unwrap() + rng.below(50) as i32;
        let n_blocks = 1 + rng.below(7) as i32;
        let cluster_m = 1 + case % 2;
        let band = 1 << rng.below(6);
        let n_fast = rng.below(2) == 1;
        let interleave = rng.below(2) == 1;
        let clusters = 1 + rng.below(70) as i32;
        let table = build(&ends, total_rows, tile_m, cluster_m);
        // stored[(row, n_block)] counts the CTAs that store that row of that column block.
        let mut stored = std::collections::HashMap::<(i32, i32), u32>::new();
        for c in 0..clusters {
            let per_rank: Vec<Vec<Tile>> = (0..cluster_m)
                .map(|r| {
                    walk(
                        &table, tile_m, cluster_m, n_blocks, band, n_fast, interleave, c, clusters,
                        r,
                    )
                })
                .collect();
            for r in 1..cluster_m as usize {
                assert_eq!(per_rank[r].len(), per_rank[0].len(), "case {case}");
                for (a, b) in per_rank[0].iter().zip(&per_rank[r]) {
                    assert_eq!((a.group, a.n_block), (b.group, b.n_block), "case {case}");
                }
            }
            for t in per_rank.iter().flatten() {
                assert!(
                    sizes[t.group] > 0,
                    "case {case}: empty group {} got a tile",
                    t.group
                );
                assert!(t.n_block < n_blocks);
                assert!(
                    t.rows == 0 || t.row0 + t.rows <= ends[t.group],
                    "case {case}: {t:?} reaches past its group"
                );
                for row in t.row0..t.row0 + t.rows {
                    *stored.entry((row, t.n_block)).or_default() += 1;
                }
            }
        }
        let routed = *ends.last().unwrap();
        for row in 0..routed {
            for n in 0..n_blocks {
                assert_eq!(
                    stored.get(&(row, n)).copied().unwrap_or(0),
                    1,
                    "case {case}: row {row} n-block {n}"
                );
            }
        }
        assert_eq!(stored.len() as i32, routed * n_blocks, "case {case}");
    }
}
