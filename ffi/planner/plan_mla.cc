// See plan_mla.h. Each step names the NumPy step of jax_mla/planner.py it mirrors;
// integer arithmetic throughout (int64), so the two agree exactly.
#include "plan_mla.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <utility>

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

// planner._pack_groups_at: groups of tiles packed as one onto `slots` workers of `span` each (a unit
// costs its keys + ovh), class by class (groups of g tiles; widest first) on lanes of g neighbouring
// workers; a narrower class goes on where the wider left off. Units come out class by class, a lane's in
// order; returns whether each class's last lane held within the span, and sets the makespan.
struct PackUnit {
  int64_t tile, start, len, t0, worker, part;  // t0: start on its worker; part: the tile's unit index
};
struct PackClass {
  int64_t g;
  std::vector<int64_t> kv, first;  // its groups' last tiles' keys and first tiles, in order
};
struct Lanes {
  int64_t first, workers, load;  // neighbouring workers of one load
};
bool pack_groups_at(const std::vector<PackClass>& classes, int64_t slots, int64_t span, int64_t ovh,
                    int64_t align, int64_t min_piece, std::vector<PackUnit>& units, int64_t& makespan) {
  units.clear();
  makespan = 0;
  std::vector<Lanes> segs{{0, slots, 0}}, lanes, rest, next;  // segs: the workers still open, in order
  std::vector<int64_t> loads(slots, 0);
  bool fits = true;
  for (const PackClass& c : classes) {
    const int64_t g = c.g;
    lanes.clear();
    rest.clear();
    for (const Lanes& x : segs) {
      for (int64_t k = 0; k < x.workers / g; ++k) lanes.push_back({x.first + k * g, g, x.load});
      if (x.workers % g) rest.push_back({x.first + x.workers - x.workers % g, x.workers % g, x.load});
    }
    if (lanes.empty()) return false;
    size_t li = 0;
    const size_t end = lanes.size() - 1;
    int64_t used = lanes[0].load;
    for (size_t k = 0; k < c.kv.size(); ++k) {
      const int64_t kv = c.kv[k];
      int64_t s = 0, j = 0;
      for (;;) {
        const int64_t r = kv - s;
        int64_t take = r;
        if (used + r + ovh > span && li != end) {
          // As much as fits, leaving at least min_piece of the tile for the next lane (floor division
          // as Python's //: the room may be negative); an empty lane takes the tile whole when it
          // cannot be cut (-1: nothing here, next lane).
          const int64_t piece = std::min(floor_div(span - used - ovh, align), floor_div(r - min_piece, align)) * align;
          take = piece >= min_piece ? piece : used == 0 ? r : -1;
        }
        if (take >= 0) {
          for (int64_t i = 0; i < g; ++i) units.push_back({c.first[k] + i, s, take, used, lanes[li].first + i, j});
          s += take;
          ++j;
          used += take + ovh;
        }
        if (s == kv) break;
        lanes[li].load = used;
        used = lanes[++li].load;
      }
    }
    lanes[li].load = used;
    for (size_t k = 0; k <= li; ++k) std::fill_n(loads.begin() + lanes[k].first, g, lanes[k].load);
    fits = fits && lanes[end].load <= span;
    // The open workers in order (the lanes from the one it stopped in, and those too few for a lane),
    // neighbours of one load as one.
    next.assign(lanes.begin() + li, lanes.end());
    next.insert(next.end(), rest.begin(), rest.end());
    std::sort(next.begin(), next.end(), [](const Lanes& a, const Lanes& b) { return a.first < b.first; });
    segs.clear();
    for (const Lanes& x : next) {
      if (!segs.empty() && segs.back().first + segs.back().workers == x.first && segs.back().load == x.load) {
        segs.back().workers += x.workers;
      } else {
        segs.push_back(x);
      }
    }
  }
  makespan = *std::max_element(loads.begin(), loads.end());
  return fits;
}

// planner._pack_groups: groups of tiles (sizes: each group's tile count, a group's tiles consecutive)
// packed as one at the smallest span (bisected) up to `most` where every class fits; false if even
// `most` does not. Sets the makespan.
bool pack_groups(const Tiles& t, const std::vector<int64_t>& sizes, int64_t slots, int64_t ovh, int64_t align,
                 int64_t min_piece, int64_t most, std::vector<PackUnit>& units, int64_t& span) {
  std::vector<int64_t> widths = sizes;
  std::sort(widths.begin(), widths.end(), std::greater<int64_t>());
  widths.erase(std::unique(widths.begin(), widths.end()), widths.end());
  std::vector<PackClass> classes(widths.size());
  int64_t need = 0, total = 0;  // sum g * (keys + least units' overheads), sum g * (keys + ovh)
  for (size_t k = 0, f = 0; k < sizes.size(); f += sizes[k], ++k) {
    const int64_t g = sizes[k], kv = t[f + g - 1].kv;
    PackClass& c = classes[std::find(widths.begin(), widths.end(), g) - widths.begin()];
    c.g = g;
    c.kv.push_back(kv);
    c.first.push_back((int64_t)f);
    need += g * (kv + std::max<int64_t>(1, ceil_div(kv, most - ovh)) * ovh);  // units each within `most`
    total += g * (kv + ovh);
  }
  const int64_t usable = slots - slots % widths.back();  // the narrowest class's lanes
  if (usable < 1 || need > usable * most) return false;
  int64_t lo = ceil_div(total, usable), hi = most, makespan = 0;
  if (lo > hi || !pack_groups_at(classes, slots, hi, ovh, align, min_piece, units, makespan)) return false;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (pack_groups_at(classes, slots, mid, ovh, align, min_piece, units, makespan)) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  pack_groups_at(classes, slots, hi, ovh, align, min_piece, units, span);
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
  std::vector<int64_t> req_tiles;  // each request's tile count (requests with queries)
  int64_t most_tiles = 0;
  for (int64_t r = 0; r < R; ++r) {
    if (qo[r] > 0) {
      req_tiles.push_back(ceil_div(qo[r], q_tile));
      most_tiles = std::max(most_tiles, req_tiles.back());
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
    // A request's tiles packed as one where some request has several of few tokens (planner.py: lanes of
    // its class's width), else, or where that does not pack well, the tiles one by one.
    std::vector<std::vector<int64_t>> tries;
    if (most - ovh >= align) {
      if (most_tiles > 1 && (most_tiles - 1) * q_tile < in.min_chunk) tries.push_back(req_tiles);
      tries.emplace_back(n_t, 1);
    }
    for (const std::vector<int64_t>& sizes : tries) {
      int64_t span_b = 0;
      if (!pack_groups(t, sizes, slots, ovh, align, in.min_chunk, most, packed, span_b)) continue;
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
      if (take_pack) break;
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
    // planner.py: the longest-first units' workers. Where the CUDA kernel walks (WalksUnits, plan_layout.h:
    // a multiple of 64 heads, kWalkFromRows plan rows a worker), each unit to the least loaded slot (ties:
    // the lowest); elsewhere dealt back and forth (round k forwards when k is even, backwards when odd).
    const int64_t g = std::max<int64_t>(slots, 1);
    if (WalksUnits(H, n_work, g)) {
      // A min-heap of (load, slot), its top replaced and sifted down (Python's heapreplace); the slots make
      // every key distinct, so the least is the same whichever heap holds them.
      using Load = std::pair<int64_t, int64_t>;
      std::vector<Load> loads(g);
      for (int64_t k = 0; k < g; ++k) loads[k] = {0, k};  // ascending: a heap already
      for (int64_t u = 0; u < n_units; ++u) {
        work[u].col[kWorkWorker] = (int32_t)loads[0].second;
        const int64_t cost = kInt32Max - (int64_t)order[sorted[u]];  // the unit's cost, as ranked
        const Load x{loads[0].first + cost + in.unit_overhead, loads[0].second};
        int64_t i = 0;
        for (int64_t c = 1; c < g; c = 2 * i + 1) {
          if (c + 1 < g && loads[c + 1] < loads[c]) ++c;
          if (!(loads[c] < x)) break;
          loads[i] = loads[c];
          i = c;
        }
        loads[i] = x;
      }
    } else {
      for (int64_t u = 0; u < n_units; ++u) {
        const int64_t k = u / g, j = u % g;
        work[u].col[kWorkWorker] = (int32_t)(k % 2 == 0 ? j : g - 1 - j);
      }
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
