// Which algorithm runs each collective. One table row per (algorithm, kind).
#include <algorithm>
#include <cstring>

#include "algorithms/algorithms.h"

namespace comm {

namespace {

bool anywhere(const Comm&, const Coll&) { return true; }

struct Row {
  const char* name;
  OpKind kind;
  AlgorithmFn run;
  bool (*fits)(const Comm&, const Coll&);
};

// "twolevel" rows come first in their kind: across hosts they win whenever they fit.
constexpr Row kTable[] = {
    {"twolevel", OpKind::ALL_REDUCE, twolevel_all_reduce, twolevel_fits},
    {"twolevel", OpKind::REDUCE_SCATTER, twolevel_reduce_scatter, twolevel_shards_fit},
    {"twolevel", OpKind::ALL_GATHER, twolevel_all_gather, twolevel_shards_fit},
    {"twolevel", OpKind::BROADCAST, twolevel_broadcast, twolevel_fits},
    {"twolevel", OpKind::REDUCE, twolevel_reduce, twolevel_fits},
    {"twolevel", OpKind::BARRIER, twolevel_barrier, twolevel_fits},
    {"twolevel", OpKind::ALL_TO_ALL, twolevel_all_to_all, twolevel_a2a_fits},
    {"direct", OpKind::ALL_REDUCE, direct_collective, direct_fits},
    {"tuned", OpKind::ALL_REDUCE, local_all_reduce, cma_fits},
    {"cma", OpKind::ALL_REDUCE, cma_all_reduce, cma_fits},
    {"rd", OpKind::ALL_REDUCE, rd_all_reduce, anywhere},
    {"ring", OpKind::ALL_REDUCE, ring_all_reduce, anywhere},
    {"tree", OpKind::ALL_REDUCE, tree_all_reduce, anywhere},
    {"direct", OpKind::REDUCE_SCATTER, direct_collective, direct_fits},
    {"cma", OpKind::REDUCE_SCATTER, cma_reduce_scatter, cma_fits},
    {"ring", OpKind::REDUCE_SCATTER, ring_reduce_scatter, anywhere},
    {"direct", OpKind::ALL_GATHER, direct_collective, direct_fits},
    {"cma", OpKind::ALL_GATHER, cma_all_gather, cma_fits},
    {"ring", OpKind::ALL_GATHER, ring_all_gather, anywhere},
    {"direct", OpKind::BROADCAST, direct_collective, direct_fits},
    {"cma", OpKind::BROADCAST, cma_broadcast, cma_fits},
    {"tree", OpKind::BROADCAST, tree_broadcast, anywhere},
    {"direct", OpKind::REDUCE, direct_collective, direct_fits},
    {"tree", OpKind::REDUCE, tree_reduce, anywhere},
    {"direct", OpKind::GATHER, direct_collective, direct_fits},
    {"linear", OpKind::GATHER, linear_gather, anywhere},
    {"linear", OpKind::SCATTER, linear_scatter, anywhere},
    {"direct", OpKind::ALL_TO_ALL, direct_all_to_all, all_local},
    {"cma", OpKind::ALL_TO_ALL, cma_all_to_all, cma_fits},
    {"pairwise", OpKind::ALL_TO_ALL, pairwise_all_to_all, anywhere},
    {"direct", OpKind::ALL_GATHER_V, direct_all_gather_v, direct_v_fits},
    {"cma", OpKind::ALL_GATHER_V, cma_all_gather_v, cma_fits},
    {"ring", OpKind::ALL_GATHER_V, ring_all_gather_v, anywhere},
    {"direct", OpKind::REDUCE_SCATTER_V, direct_reduce_scatter_v, direct_v_fits},
    {"cma", OpKind::REDUCE_SCATTER_V, cma_reduce_scatter_v, cma_fits},
    {"ring", OpKind::REDUCE_SCATTER_V, ring_reduce_scatter_v, anywhere},
    {"direct", OpKind::BARRIER, direct_collective, direct_fits},
    {"dissemination", OpKind::BARRIER, dissemination_barrier, anywhere},
};

// Recursive doubling sends the whole buffer log2(n) times: only worth it while latency,
// not bandwidth, dominates (see native/TUNING.md, "all_reduce on one host").
constexpr size_t kRdMaxBytes = 64 << 10;
// Where the single-copy path (cma) takes over from the ring over shared-memory channels, in
// the units of measure() below. A gather's ring is nothing but copies, which slow down to a
// quarter where the ranks' cores do not share caches while cma's reads do not: cma is the
// choice that is never slow. all_reduce's ring hides its copy behind the reduction, so
// between rd's sizes and 8 MiB the faster of the two is measured ("tuned", local_tuner.h).
// broadcast and all_to_all keep 8 MiB. Evidence: native/TUNING.md, "all_reduce on one host"
// and "Gathers, reduce_scatter and the rest on one host".
size_t cma_min_bytes(OpKind kind) {
  switch (kind) {
    case OpKind::ALL_REDUCE: return kRdMaxBytes + 1;   // tuned: ring or cma, from where rd stops
    case OpKind::REDUCE_SCATTER:
    case OpKind::REDUCE_SCATTER_V:
    case OpKind::ALL_GATHER:
    case OpKind::ALL_GATHER_V: return 0;  // wherever the direct path does not take it
    default: return 8 << 20;
  }
}

const Row* find(const char* name, const Comm& c, const Coll& op) {
  for (const Row& row : kTable)
    if (row.kind == op.kind && std::strcmp(row.name, name) == 0 && row.fits(c, op)) return &row;
  return nullptr;
}

// COMM_ALGO=flat: the automatic choice without the two-level rows (the topology ignored).
constexpr const char* kFlat = "flat";

// The size the thresholds below compare: one rank's payload of the direct path (all_gather:
// its block; reduce_scatter: its whole input). A v-collective's counts are alike on every
// rank, so is this: its mean block, or its whole input.
size_t measure(const Comm& c, const Coll& op) {
  if (op.kind == OpKind::ALL_GATHER_V || op.kind == OpKind::REDUCE_SCATTER_V) {
    size_t total = 0;
    for (uint64_t k : *op.recv_counts) total += k;
    return (op.kind == OpKind::ALL_GATHER_V ? total / c.size : total) * op.elem;
  }
  return (op.kind == OpKind::REDUCE_SCATTER ? c.size : 1) * op.count * op.elem;
}

const Row& automatic(const Comm& c, const Coll& op) {
  const size_t bytes = measure(c, op);
  const Row* row = nullptr;
  if (c.opt.algo != kFlat) row = find("twolevel", c, op);
  if (!row && bytes <= c.opt.direct_max_bytes) row = find("direct", c, op);
  if (!row && bytes >= cma_min_bytes(op.kind)) {
    const bool tuned = op.kind == OpKind::ALL_REDUCE && bytes < LocalTuner::kMaxBytes;
    row = find(tuned ? "tuned" : "cma", c, op);
  }
  if (!row && op.kind == OpKind::ALL_REDUCE && bytes <= kRdMaxBytes) row = find("rd", c, op);
  if (!row) {
    // The remaining rows of each kind are in order of preference and always fit.
    for (const Row& r : kTable)
      if (r.kind == op.kind && r.fits == anywhere && std::strcmp(r.name, "rd") != 0) return r;
  }
  return *row;
}

}  // namespace

Algorithm choose_algorithm(const Comm& c, const Coll& op) {
  const Row* row = c.opt.algo.empty() || c.opt.algo == kFlat ? nullptr : find(c.opt.algo.c_str(), c, op);
  if (!row) row = &automatic(c, op);
  return {row->name, row->run};
}

std::vector<std::string> algorithm_names() {
  std::vector<std::string> names{kFlat};
  for (const Row& row : kTable)
    if (std::find(names.begin(), names.end(), row.name) == names.end()) names.emplace_back(row.name);
  return names;
}

}  // namespace comm
