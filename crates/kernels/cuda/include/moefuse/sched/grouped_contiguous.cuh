// Tile order for M-grouped GEMMs over the contiguous grouped layout (shared by every arch):
// group e owns rows [start_e, end_e) of A and D and the weights W_e; its tiles are
// (m-block, n-block) pairs over those rows. Tiles are numbered group by group, so
// consecutive tile numbers share a group, and within a group in bands of `band` m-blocks
// (all n-blocks of a band before the next band), so the tiles running at once touch a
// bounded set of A rows and W_e columns. CTA c of a persistent grid of G takes tiles
// c, c + G, c + 2G, ... Empty groups own no tiles. With `interleave`, walk position t takes
// tile t / 2 when t is even and tile T - 1 - t / 2 when odd (T tiles in all): the list's
// front and back meet in the middle, so the tiles running at once mix early and late
// groups. NOTES: when routing puts the large groups first (sorted, Zipf-like), the small
// groups at the end each read all of their W_e for one or two m-blocks; run back to back
// they would ask HBM for up to ~3x the bytes per wave of a balanced run.
//
// With a cluster of C CTAs along M (which share each W_e tile through TMA multicast) the
// walk is over cluster tiles: a group's m-blocks are counted in units of C, and CTA rank r
// of the cluster takes m-block unit * C + r. When a group's m-block count is not a
// multiple of C, the last unit's extra CTAs get a tile with no rows: they still load (their
// part of the multicast) but store nothing.
//
// The per-group table (row ranges, prefix sums of m-blocks) is built once per CTA in
// shared memory from the device offsets by one warp, so the walk needs no global loads
// and no host synchronisation.
#pragma once

#include <cstdint>

#include "moefuse/common/group_layout.cuh"

namespace moefuse::sched {

// Shared-memory table of at most kMaxGroups groups.
template <int kMaxGroups>
struct ContiguousGroupTable {
  int32_t row_start[kMaxGroups];
  int32_t row_end[kMaxGroups];
  int32_t m_units_end[kMaxGroups];  // inclusive prefix sum of ceil(ceil(rows_e / TileM) / ClusterM)
  int32_t total_m_units;
  int32_t groups;
};

// One output tile: rows [row0, row0 + rows) of group `group` (0 <= rows <= TileM; the A
// rows past them belong to the next group or lie past the end and are loaded but never
// stored), columns [n_block * TileN, ...).
struct GroupTile {
  int group;
  int row0;
  int rows;
  int n_block;
};

template <int TileM, int ClusterM, int kMaxGroups>
struct ContiguousGroupScheduler {
  static constexpr int kUnitRows = TileM * ClusterM;
  using Table = ContiguousGroupTable<kMaxGroups>;

  // Fills `table` from the prefix-sum offsets. Called by all 32 lanes of one warp; the
  // caller synchronises the block before any thread walks the table.
  CUTE_DEVICE static void build(Table& table, const int32_t* offsets, int groups, int total_rows) {
    const int lane = threadIdx.x % 32;
    const int per_lane = (groups + 31) / 32;
    const int begin = min(lane * per_lane, groups);
    const int end = min(begin + per_lane, groups);
    int sum = 0;
    for (int e = begin; e < end; ++e) {
      GroupRows r = group_rows(offsets, e, total_rows);
      table.row_start[e] = r.start;
      table.row_end[e] = r.end;
      sum += (r.rows() + kUnitRows - 1) / kUnitRows;
      table.m_units_end[e] = sum;
    }
    int inclusive = sum;
    for (int d = 1; d < 32; d <<= 1) {
      int v = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += v;
    }
    const int before = inclusive - sum;
    for (int e = begin; e < end; ++e) table.m_units_end[e] += before;
    if (lane == 31) {
      table.total_m_units = inclusive;
      table.groups = groups;
    }
  }

  // A walker over this CTA's tiles. `band` m-block units per band (>= 1); `n_fast` walks a
  // band's n-blocks first (rows of A reused), else its units first (W_e columns reused);
  // `interleave` alternates the tile list's front and back (above).
  // `first`/`stride`: this cluster's index and the number of clusters; `rank`: this CTA's
  // rank along M in its cluster.
  CUTE_DEVICE ContiguousGroupScheduler(const Table& table, int n_blocks, int band, bool n_fast, bool interleave,
                                       int first, int stride, int rank)
      : table_(table),
        n_blocks_(n_blocks),
        band_(band),
        n_fast_(n_fast),
        interleave_(interleave),
        tile_(first),
        stride_(stride),
        rank_(rank),
        total_(table.total_m_units * n_blocks) {}

  // The next tile of this CTA, or false when it has none left.
  CUTE_DEVICE bool next(GroupTile& out) {
    if (tile_ >= total_) return false;
    const int tile = interleave_ ? ((tile_ & 1) ? total_ - 1 - (tile_ >> 1) : (tile_ >> 1)) : tile_;
    if (interleave_) {
      // Not monotone: the first group whose tiles end past `tile` (binary search).
      int lo = 0, hi = table_.groups - 1;
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (tile < table_.m_units_end[mid] * n_blocks_) hi = mid; else lo = mid + 1;
      }
      group_ = lo;
    } else {
      while (tile >= table_.m_units_end[group_] * n_blocks_) ++group_;
    }
    const int first_unit = group_ == 0 ? 0 : table_.m_units_end[group_ - 1];
    const int m_units = table_.m_units_end[group_] - first_unit;
    const int local = tile - first_unit * n_blocks_;
    const int band_tiles = band_ * n_blocks_;
    const int b = local / band_tiles;
    const int r = local - b * band_tiles;
    const int len = min(band_, m_units - b * band_);
    int m_unit, n_block;
    if (n_fast_) {
      n_block = r % n_blocks_;
      m_unit = b * band_ + r / n_blocks_;
    } else {
      m_unit = b * band_ + r % len;
      n_block = r / len;
    }
    out.group = group_;
    out.row0 = table_.row_start[group_] + (m_unit * ClusterM + rank_) * TileM;
    out.rows = max(0, min(TileM, table_.row_end[group_] - out.row0));
    out.n_block = n_block;
    tile_ += stride_;
    return true;
  }

 private:
  const Table& table_;
  int n_blocks_;
  int band_;
  bool n_fast_;
  bool interleave_;
  int tile_;
  int stride_;
  int rank_;
  int total_;
  int group_ = 0;
};

}  // namespace moefuse::sched
