// See plan_mla.h. Each step names the NumPy step of jax_mla/planner.py it mirrors;
// integer arithmetic throughout (int64), so the two agree exactly.
#include "plan_mla.h"

#include <algorithm>
#include <numeric>

#include "jax_mla/plan_layout.h"

namespace jax_mla {
namespace {

constexpr int64_t kInt32Max = 2147483647;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }  // a >= 0, b > 0
int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }  // b > 0, as Python's //

// planner.py's equal parts: the part length of a tile of kv keys cut at about `chunk` keys, aligned
// (the tile then has ceil(kv / part) parts).
int64_t equal_part(int64_t kv, int64_t chunk, int64_t align) {
  const int64_t n = std::max<int64_t>(1, ceil_div(kv, chunk));
  return std::max(ceil_div(ceil_div(kv, n), align) * align, align);
}

// planner.bucket: smallest power of two >= max(n, minimum, 1).
int64_t bucket(int64_t n, int64_t minimum) {
  n = std::max({n, minimum, int64_t{1}});
  int64_t b = 1;
  while (b < n) b <<= 1;
  return b;
}

// planner._as_lengths, after the dtype / rank checks Python keeps: int32 range, then sign.
// NumPy's argmax / argmin name the first extreme.
void check_lengths(const char* name, const int64_t* a, int64_t n) {
  if (n == 0) return;
  const int64_t* mx = std::max_element(a, a + n);
  if (*mx > kInt32Max) {
    throw PlanError(std::string(name) + "[" + std::to_string(mx - a) + "] = " + std::to_string(*mx) +
                    " does not fit int32 (the kernels' lengths)");
  }
  const int64_t* mn = std::min_element(a, a + n);
  if (*mn < 0) {
    throw PlanError(std::string(name) + "[" + std::to_string(mn - a) + "] = " + std::to_string(*mn) +
                    " is negative");
  }
}

struct Tile {  // a query tile: <= q_tile tokens of one request
  int64_t req, qstart, qlen, eoff, kv;
};
using Tiles = std::vector<Tile>;

struct WorkRow {  // one row of the work table (plan_layout.h: WorkCol)
  int32_t col[kWorkCols];
};
static_assert(sizeof(WorkRow) == kWorkCols * sizeof(int32_t), "rows are packed");

// Indices that sort `keys` ascending, ties in index order (np.argsort(kind="stable")): an LSD radix
// sort over the key's bytes, skipping bytes that all keys share (for costs below 2^16 the top two).
// Thousands of units with random costs make a comparison sort's mispredicted branches the planner's
// largest cost; this is a few linear passes.
std::vector<uint32_t> stable_order(const std::vector<uint32_t>& keys) {
  const size_t n = keys.size();
  std::vector<uint32_t> idx(n), tmp(n);
  std::iota(idx.begin(), idx.end(), 0u);
  uint32_t hist[4][256] = {};
  for (uint32_t k : keys) {
    for (int b = 0; b < 4; ++b) ++hist[b][(k >> (8 * b)) & 0xff];
  }
  for (int b = 0; b < 4; ++b) {
    const uint32_t digit0 = n ? (keys[0] >> (8 * b)) & 0xff : 0;
    if (hist[b][digit0] == n) continue;  // one digit for all: the pass would not move anything
    uint32_t pos[256], sum = 0;
    for (int d = 0; d < 256; ++d) {
      pos[d] = sum;
      sum += hist[b][d];
    }
    for (uint32_t i : idx) tmp[pos[(keys[i] >> (8 * b)) & 0xff]++] = i;
    idx.swap(tmp);
  }
  return idx;
}

// planner._pack_at: the tiles in order onto `slots` workers of `span` each (a unit costs its keys +
// ovh). Units come out in worker order; loads[w] is worker w's total.
struct PackUnit {
  int64_t tile, start, len, t0, worker, part;  // t0: start on its worker; part: the tile's unit index
};
void pack_at(const Tiles& t, int64_t slots, int64_t span, int64_t ovh, int64_t align, int64_t min_piece,
             std::vector<PackUnit>& units, std::vector<int64_t>& loads) {
  units.clear();
  loads.assign(slots, 0);
  int64_t w = 0, used = 0;
  for (int64_t i = 0; i < (int64_t)t.size(); ++i) {
    const int64_t kv = t[i].kv;
    int64_t s = 0;
    for (;;) {
      const int64_t r = kv - s;
      int64_t take = r;
      if (used + r + ovh > span && w < slots - 1) {
        // As much as fits, leaving at least min_piece of the tile for the next worker (floor division
        // as Python's //: the room may be negative); an empty worker takes the tile whole when it
        // cannot be cut (-1: nothing here, next worker).
        const int64_t piece = std::min(floor_div(span - used - ovh, align), floor_div(r - min_piece, align)) * align;
        take = piece >= min_piece ? piece : used == 0 ? r : -1;
      }
      if (take >= 0) {
        const int64_t part = !units.empty() && units.back().tile == i ? units.back().part + 1 : 0;
        units.push_back({i, s, take, used, w, part});
        s += take;
        used += take + ovh;
      }
      if (s == kv) break;  // the tile is placed; the next one starts on this worker
      loads[w] = used;
      ++w;
      used = 0;
    }
  }
  loads[w] = used;
}

// planner._pack: pack_at at the smallest span (bisected) up to `most` that leaves the last worker no
// more than the span; false if even `most` does not. Sets the makespan (the largest load).
bool pack(const Tiles& t, int64_t slots, int64_t ovh, int64_t align, int64_t min_piece, int64_t most,
          std::vector<PackUnit>& units, int64_t& span) {
  int64_t kv_sum = 0;
  for (const Tile& x : t) kv_sum += x.kv;
  int64_t lo = ceil_div(kv_sum + (int64_t)t.size() * ovh, slots), hi = most;
  std::vector<int64_t> loads;
  if (lo > hi) return false;
  pack_at(t, slots, hi, ovh, align, min_piece, units, loads);
  if (loads.back() > hi) return false;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    pack_at(t, slots, mid, ovh, align, min_piece, units, loads);
    if (loads.back() <= mid) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  pack_at(t, slots, hi, ovh, align, min_piece, units, loads);
  span = *std::max_element(loads.begin(), loads.end());
  return true;
}

}  // namespace

Plan plan_mla(const PlanRequest& in) {
  const int64_t R = in.num_requests;
  const int64_t* qo = in.qo_lens;
  const int64_t* kv = in.kv_lens;
  check_lengths("qo_lens", qo, R);
  check_lengths("kv_lens", kv, R);
  for (int64_t i = 0; i < R; ++i) {
    if (qo[i] > kv[i]) {
      throw PlanError("qo_lens[" + std::to_string(i) + "] = " + std::to_string(qo[i]) + " exceeds kv_lens[" +
                      std::to_string(i) + "] = " + std::to_string(kv[i]) + " (kv lengths include the new tokens)");
    }
  }
  if (in.max_pages_per_request >= 0) {
    const int64_t cap = in.max_pages_per_request * in.page_size;
    for (int64_t i = 0; i < R; ++i) {
      if (kv[i] > cap) {
        throw PlanError("kv_lens[" + std::to_string(i) + "] = " + std::to_string(kv[i]) +
                        " exceeds the page table's capacity " + std::to_string(in.max_pages_per_request) +
                        " pages x " + std::to_string(in.page_size) + " = " + std::to_string(cap) + " tokens");
      }
    }
  }
  std::vector<int64_t> qo_end(R);
  int64_t total_q = 0;
  for (int64_t i = 0; i < R; ++i) qo_end[i] = total_q += qo[i];  // each < 2^31: no overflow
  if (total_q > kInt32Max) {
    throw PlanError("sum(qo_lens) = " + std::to_string(total_q) + " query tokens does not fit int32");
  }
  const int64_t num_tokens = in.num_tokens < 0 ? total_q : in.num_tokens;
  if (num_tokens > kInt32Max) {
    throw PlanError("num_tokens=" + std::to_string(num_tokens) + " must be an int that fits int32");
  }
  if (num_tokens < total_q) {
    throw PlanError("num_tokens=" + std::to_string(num_tokens) + " is less than sum(qo_lens)=" +
                    std::to_string(total_q));
  }

  Plan plan;
  const int64_t H = in.num_heads;
  const int64_t q_tile = QTile(H);
  const int64_t head_blocks = HeadBlocks(H);
  const int64_t max_q = R ? *std::max_element(qo, qo + R) : 0;

  // ---- query tiles: ceil(qo / q_tile) per request, tokens from the end backwards.
  Tiles t;
  t.reserve(max_q <= q_tile ? R : R + total_q / q_tile);
  int64_t group = -1;  // tiles a request has, where every request with queries has that many; else 1
  for (int64_t r = 0; r < R; ++r) {
    if (qo[r] > 0) {
      const int64_t n = ceil_div(qo[r], q_tile);
      group = group < 0 || group == n ? n : 1;
    }
    for (int64_t off = 0; off < qo[r]; off += q_tile) {
      const int64_t qlen = std::min(q_tile, qo[r] - off), eoff = qo[r] - off;
      // keys the tile's last token sees: causal, aligned to the end
      t.push_back({r, qo_end[r] - qo[r] + off, qlen, eoff, kv[r] - (eoff - qlen)});
    }
  }
  const int64_t n_t = (int64_t)t.size();

  // ---- split sizes (planner.py: "split sizes").
  const int64_t slots = static_cast<int64_t>(static_cast<double>(in.num_workers) * in.units_per_worker) / head_blocks;
  int64_t max_kv = 0, kv_sum = 0;
  for (const Tile& x : t) {
    max_kv = std::max(max_kv, x.kv);
    kv_sum += x.kv;
  }
  const int64_t align = in.chunk_align;
  int64_t chunk = 0;
  if (slots > n_t && max_kv > in.min_chunk) {
    int64_t c = ceil_div(kv_sum + n_t * in.unit_overhead, slots);
    c = ceil_div(std::max(c, in.min_chunk), align) * align;
    int64_t units = 0;
    for (int it = 0; it < 16; ++it) {
      units = 0;
      for (const Tile& x : t) units += std::max<int64_t>(1, ceil_div(x.kv, c));
      if (units <= slots || c >= max_kv) break;
      c = ceil_div(std::max(c + align, ceil_div(c * units, slots)), align) * align;
    }
    if (c < max_kv && units <= slots) chunk = c;
  }

  // ---- buckets (planner.py: bounds from the tile count and the target only).
  const int64_t max_qlen = n_t ? std::min(max_q, q_tile) : 1;
  const int64_t n_work = bucket(std::max(n_t, slots), in.min_work_units);
  const int64_t n_merge = bucket(slots > n_t ? std::min(n_t, slots - 1) : 0, in.min_work_units);
  const int64_t n_partial = bucket(slots > n_t ? max_qlen * slots : 0, in.min_partial_rows);
  plan.work.resize(n_work * kWorkCols);
  plan.merge.assign(n_merge * kMergeCols, 0);

  // ---- a ragged batch: pack the keys onto the workers (planner.py: "a ragged batch").
  std::vector<PackUnit> packed;
  bool take_pack = false;
  std::vector<int64_t> pack_splits;  // units per tile of the packed plan
  if (slots > n_t && max_kv > in.min_chunk) {
    const int64_t ovh = in.unit_overhead;
    int64_t longest_a = 0;
    for (const Tile& x : t) {
      if (chunk == 0) {
        longest_a = std::max(longest_a, x.kv);
      } else {
        longest_a = std::max(longest_a, std::min(x.kv, equal_part(x.kv, chunk, align)));
      }
    }
    // The longest span worth packing for; at that span a tile of kv keys is at least
    // ceil(kv / (most - ovh)) units, each with its overhead, which all workers must hold.
    const int64_t most = (32 * (longest_a + ovh) - 1) / 33;
    // A request's tiles packed as one where each request has `group` > 1 of them (planner.py): its last
    // tile, which sees the most keys, cut onto slots / group workers.
    if (!(group > 1 && (group - 1) * q_tile < in.min_chunk && slots / group > n_t / group)) group = 1;
    Tiles last_tiles;  // (group 1: the tiles themselves, not copied)
    int64_t last_sum = kv_sum;
    if (group > 1) {
      last_sum = 0;
      for (int64_t i = group - 1; i < n_t; i += group) {
        last_tiles.push_back(t[i]);
        last_sum += t[i].kv;
      }
    }
    const Tiles& pack_tiles = group > 1 ? last_tiles : t;
    const int64_t pack_slots = slots / group;
    int64_t least_units = 0;
    if (most - ovh >= align) {
      for (const Tile& x : pack_tiles) least_units += std::max<int64_t>(1, ceil_div(x.kv, most - ovh));
    }
    int64_t span_b = 0;
    std::vector<PackUnit> group_units;
    if (most - ovh >= align && last_sum + least_units * ovh <= pack_slots * most &&
        pack(pack_tiles, pack_slots, ovh, align, in.min_chunk, most, group_units, span_b)) {
      // Each of a group's units once for each of its tiles, side by side: tile i on worker w * group + i.
      if (group == 1) packed.swap(group_units);
      for (const PackUnit& u : group_units) {
        for (int64_t i = 0; i < group; ++i) {
          packed.push_back({u.tile * group + i, u.start, u.len, u.t0, u.worker * group + i, u.part});
        }
      }
      pack_splits.assign(n_t, 0);
      for (const PackUnit& u : packed) ++pack_splits[u.tile];
      int64_t n_split_tiles = 0, split_rows = 0;
      for (int64_t i = 0; i < n_t; ++i) {
        if (pack_splits[i] > 1) {
          ++n_split_tiles;
          split_rows += pack_splits[i] * t[i].qlen;
        }
      }
      take_pack = 33 * span_b < 32 * (longest_a + ovh) && (int64_t)packed.size() <= n_work &&
                  n_split_tiles <= n_merge && split_rows <= n_partial;
    }
  }

  // ---- units, each with its sort key: the longest-first order, or the packed plan's start on its worker.
  std::vector<WorkRow> units;
  // Sort keys: INT32_MAX - cost (ascending keys = descending costs). Where a request has at most one key
  // block (align) of query tokens, a tile's last unit is ranked by the keys its request's last token sees
  // there (its own + those its mask hides), so that the request's tiles tie and stay neighbours
  // (planner.py: "Longest first").
  auto hidden = [&](const Tile& x) { return qo[x.req] <= align ? x.eoff - x.qlen : 0; };
  std::vector<uint32_t> order;
  units.reserve(chunk == 0 && !take_pack ? n_t : n_work);
  order.reserve(units.capacity());
  // (kWorkWorker: the packed plan's worker here; the others' after the sort, below.)
  auto add_unit = [&](const Tile& x, int64_t kv_start, int64_t kv_end, int64_t partial, int64_t c) {
    order.push_back((uint32_t)(kInt32Max - c));
    units.push_back({{(int32_t)x.req, (int32_t)x.qstart, (int32_t)x.qlen, (int32_t)x.eoff, (int32_t)kv_start,
                      (int32_t)kv_end, (int32_t)partial, 0}});
  };
  if (take_pack) {
    int64_t part_base = 0, n_merges = 0;
    std::vector<int64_t> tile_base(n_t, -1);
    for (int64_t i = 0; i < n_t; ++i) {
      if (pack_splits[i] < 2) continue;
      const Tile& x = t[i];
      tile_base[i] = part_base;
      int32_t* m = plan.merge.data() + n_merges++ * kMergeCols;
      m[kMergeQStart] = (int32_t)x.qstart;
      m[kMergeQLen] = (int32_t)x.qlen;
      m[kMergePartialRow] = (int32_t)part_base;
      m[kMergeNumSplits] = (int32_t)pack_splits[i];
      part_base += pack_splits[i] * x.qlen;
    }
    for (const PackUnit& u : packed) {
      const int64_t j = u.part;
      const Tile& x = t[u.tile];
      const bool last = j == pack_splits[u.tile] - 1;
      units.push_back({{(int32_t)x.req, (int32_t)x.qstart, (int32_t)x.qlen, (int32_t)x.eoff, (int32_t)u.start,
                        (int32_t)(last ? kKvEndOpen : u.start + u.len),
                        (int32_t)(tile_base[u.tile] >= 0 ? tile_base[u.tile] + j * x.qlen : -1),
                        (int32_t)u.worker}});
      // By start on the worker; ties keep the worker order the units were made in (a stable sort).
      order.push_back((uint32_t)std::min(u.t0, kInt32Max));
    }
  } else if (chunk == 0) {
    for (const Tile& x : t) add_unit(x, 0, kKvEndOpen, -1, x.kv + hidden(x));
  } else {
    int64_t part_base = 0, n_merges = 0;
    for (const Tile& x : t) {
      const int64_t tile_chunk = equal_part(x.kv, chunk, align);
      const int64_t n_split = std::max<int64_t>(1, ceil_div(x.kv, tile_chunk));
      for (int64_t j = 0; j < n_split; ++j) {
        const int64_t kv_start = j * tile_chunk;
        const bool last = j == n_split - 1;
        add_unit(x, kv_start, last ? kKvEndOpen : kv_start + tile_chunk, n_split > 1 ? part_base + j * x.qlen : -1,
                 last ? x.kv - kv_start + hidden(x) : tile_chunk);
      }
      if (n_split > 1) {
        if (n_merges >= n_merge) throw std::logic_error("jax_mla planner: merge bucket overflow");
        int32_t* m = plan.merge.data() + n_merges++ * kMergeCols;
        m[kMergeQStart] = (int32_t)x.qstart;
        m[kMergeQLen] = (int32_t)x.qlen;
        m[kMergePartialRow] = (int32_t)part_base;
        m[kMergeNumSplits] = (int32_t)n_split;
        part_base += n_split * x.qlen;
      }
    }
    if (part_base > n_partial) throw std::logic_error("jax_mla planner: partial-row bucket overflow");
  }
  const int64_t n_units = (int64_t)units.size();
  if (n_units > n_work) throw std::logic_error("jax_mla planner: work bucket overflow");
  const std::vector<uint32_t> sorted = stable_order(order);
  WorkRow* work = reinterpret_cast<WorkRow*>(plan.work.data());
  for (int64_t u = 0; u < n_units; ++u) work[u] = units[sorted[u]];
  if (!take_pack) {
    // planner.py: the longest-first units dealt to the slots back and forth (round k forwards when k is
    // even, backwards when odd).
    const int64_t g = std::max<int64_t>(slots, 1);
    for (int64_t u = 0; u < n_units; ++u) {
      const int64_t k = u / g, j = u % g;
      work[u].col[kWorkWorker] = (int32_t)(k % 2 == 0 ? j : g - 1 - j);
    }
  }
  std::fill(work + n_units, work + n_work, WorkRow{});

  // ---- tokens: (request, offset from the end of its query block); padding (-1, 0).
  plan.tokens.resize(num_tokens * 2);
  int32_t* tok = plan.tokens.data();
  for (int64_t r = 0, g = 0; r < R; ++r) {
    for (int64_t i = 0; i < qo[r]; ++i, ++g) {
      tok[2 * g] = (int32_t)r;
      tok[2 * g + 1] = (int32_t)(qo_end[r] - g);
    }
  }
  for (int64_t g = total_q; g < num_tokens; ++g) {
    tok[2 * g] = -1;
    tok[2 * g + 1] = 0;
  }

  plan.num_work = n_work;
  plan.num_merge = n_merge;
  plan.num_tokens = num_tokens;
  plan.q_tile = q_tile;
  plan.num_partial_rows = n_partial;
  return plan;
}

}  // namespace jax_mla
