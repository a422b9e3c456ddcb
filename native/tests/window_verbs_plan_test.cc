// The device-free parts of windows over verbs RMA (window_verbs_plan.h): the key (round trip,
// every malformed form refused), range checks at the edges, work-request ids, the cutting into
// chunks, and the accounting of chunks in flight (completions in order and out of it, stray and
// foreign ids, failures kept for the next flush, abandoned READs, a lost queue pair), plus a
// model-checked random sequence. Built (linking the engine library, which needs no rdma-core
// headers for this part) and run by tests/test_verbs.py; exits non-zero naming the first
// failed check.
#include <cstdio>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "check.h"
#include "windows/window_verbs_plan.h"

using namespace comm::verbs;

static void keys() {
  const RmaKey k{0x00007f0012345000ull, 64ull << 20, 0xdeadbeef};
  const std::string wire = encode_rma_key(k);
  CHECK(wire.size() == kRmaKeyBytes);
  CHECK(static_cast<unsigned char>(wire[4]) == 0x00 && static_cast<unsigned char>(wire[6]) == 0x7f);  // big-endian
  RmaKey back;
  std::string why;
  CHECK(decode_rma_key(wire, &back, &why));
  CHECK(back.addr == k.addr && back.size == k.size && back.rkey == k.rkey);
  // A window of 0 bytes: no registration, rkey 0, nothing fits but 0 bytes at 0.
  CHECK(decode_rma_key(encode_rma_key({0x1000, 0, 0}), &back, &why) && back.size == 0);
  CHECK(rma_fits(back, 0, 0) && !rma_fits(back, 0, 1) && !rma_fits(back, 1, 0));

  CHECK(!decode_rma_key("", &back, &why) && !why.empty());
  CHECK(!decode_rma_key(wire.substr(0, kRmaKeyBytes - 1), &back, &why));  // short
  CHECK(!decode_rma_key(wire + "x", &back, &why));                        // long
  std::string other = wire;
  other[3] = '2';  // another version
  CHECK(!decode_rma_key(other, &back, &why));
  // A range past the end of the address space is refused before any use.
  CHECK(!decode_rma_key(encode_rma_key({~0ull - 10, 11, 1}), &back, &why));
  CHECK(why.find("wraps") != std::string::npos);
  CHECK(decode_rma_key(encode_rma_key({~0ull - 10, 10, 1}), &back, &why));

  // Edges: every byte of the window, nothing past it, no overflow in offset + len.
  const RmaKey w{0x1000, 100, 7};
  CHECK(rma_fits(w, 0, 100) && rma_fits(w, 99, 1) && rma_fits(w, 100, 0));
  CHECK(!rma_fits(w, 0, 101) && !rma_fits(w, 100, 1) && !rma_fits(w, 101, 0));
  CHECK(!rma_fits(w, 1, ~0ull) && !rma_fits(w, ~0ull, 2));
}

static void work_request_ids() {
  for (uint32_t win : {1u, 77u, kMaxRmaWindowId})
    for (uint32_t chunk : {0u, 31u, 0xffffffffu}) {
      const uint64_t id = rma_wr_id(win, chunk);
      CHECK(is_rma_wr(id) && rma_wr_window(id) == win && rma_wr_chunk(id) == chunk);
    }
  // The channel's own ids (WR_DATA 1, WR_CREDIT 2, receives 0) are never taken for RMA.
  for (uint64_t own : {0ull, 1ull, 2ull}) CHECK(!is_rma_wr(own));
  CHECK(throws<std::invalid_argument>([] { rma_wr_id(kMaxRmaWindowId + 1, 0); }));
}

static void pieces() {
  const uint32_t c = 128 << 10;
  CHECK(piece_count(0, c) == 0);
  CHECK(piece_count(1, c) == 1 && piece(1, c, 0).at == 0 && piece(1, c, 0).len == 1);
  CHECK(piece_count(c, c) == 1 && piece(c, c, 0).len == c);
  CHECK(piece_count(c + 1, c) == 2 && piece(c + 1, c, 1).at == c && piece(c + 1, c, 1).len == 1);
  CHECK(throws<std::out_of_range>([&] { piece(c, c, 1); }));
  CHECK(throws<std::out_of_range>([&] { piece(0, c, 0); }));
  // Pieces tile the transfer exactly, for sizes around chunk multiples and a huge one.
  const std::vector<uint64_t> lens = {3, uint64_t{c} - 1, uint64_t{3} * c, uint64_t{3} * c + 7, uint64_t{64} << 20,
                                     (uint64_t{5} << 32) + 9};
  for (uint64_t len : lens) {
    uint64_t at = 0;
    const uint64_t n = piece_count(len, c);
    for (uint64_t i = 0; i < n; i += (n > 1000 ? n / 997 : 1)) {
      const Piece p = piece(len, c, i);
      CHECK(p.at == i * c && p.len >= 1 && p.len <= c);
      if (n <= 1000) {
        CHECK(p.at == at);
        at += p.len;
      }
    }
    const Piece last = piece(len, c, n - 1);
    CHECK(last.at + last.len == len);
    if (n <= 1000) CHECK(at == len);
  }
}

static void tracker_basics() {
  CHECK(throws<std::invalid_argument>([] { RmaTracker(0, 2); }));
  CHECK(throws<std::invalid_argument>([] { RmaTracker(4, 0); }));
  RmaTracker t(3, 2);
  char buf[8];
  const uint32_t a = t.take({1, RmaOp::WRITE, nullptr, 10});
  const uint32_t b = t.take({1, RmaOp::READ, buf, 8});
  const uint32_t c = t.take({0, RmaOp::READ, buf + 1, 1});
  CHECK(a != b && b != c && a != c && !t.has_free());
  CHECK(throws<std::logic_error>([&] { t.take({0, RmaOp::WRITE, nullptr, 1}); }));
  CHECK(throws<std::invalid_argument>([] { RmaTracker(1, 2).take({2, RmaOp::WRITE, nullptr, 1}); }));
  CHECK(t.in_flight(1) == 2 && t.in_flight(0) == 1 && t.in_flight(-1) == 3);
  CHECK(t.reads_in_flight(1) == 1 && t.reads_in_flight(0) == 1);

  RmaChunk done;
  CHECK(!t.finish(a, 0, &done));   // chunk a is in flight to rank 1, not 0: a stray completion
  CHECK(!t.finish(99, 1, &done));  // no such chunk
  CHECK(t.in_flight(-1) == 3);     // neither freed anything
  CHECK(t.finish(a, 1, &done) && done.op == RmaOp::WRITE && done.len == 10);
  CHECK(!t.finish(a, 1, &done));   // twice: the second is stray
  CHECK(t.has_free() && t.in_flight(1) == 1);
  CHECK(t.finish(b, 1, &done) && done.op == RmaOp::READ && done.dst == buf && done.len == 8);
  CHECK(t.reads_in_flight(1) == 0);

  // A post that failed gives its chunk back.
  const uint32_t d = t.take({1, RmaOp::READ, buf, 2});
  t.untake(d);
  CHECK(t.in_flight(1) == 0 && t.reads_in_flight(1) == 0);
  CHECK(throws<std::logic_error>([&] { t.untake(d); }));

  // A flush that gave up: the READ still in flight copies nowhere.
  t.abandon(0);
  CHECK(t.finish(c, 0, &done) && done.dst == nullptr && done.len == 1);
  CHECK(t.in_flight(-1) == 0);
}

static void tracker_failures() {
  RmaTracker t(4, 3);
  char buf[4];
  t.take({2, RmaOp::WRITE, nullptr, 1});
  t.take({2, RmaOp::READ, buf, 1});
  const uint32_t keep = t.take({1, RmaOp::WRITE, nullptr, 1});
  CHECK(!t.has_error(-1));
  int which = -1;
  CHECK(t.take_error(-1, &which).empty());
  t.failed(1, "remote access error");
  t.failed(1, "work request flushed error");  // the first reason stays
  CHECK(t.has_error(1) && t.has_error(-1) && !t.has_error(2));
  CHECK(t.take_error(2, &which).empty());
  CHECK(t.take_error(-1, &which) == "remote access error" && which == 1);
  CHECK(!t.has_error(-1));  // reported once
  // The queue pair to rank 2 went with two chunks in flight: they are free, a flush fails.
  t.lost(2, "connection closed");
  CHECK(t.in_flight(2) == 0 && t.reads_in_flight(2) == 0 && t.in_flight(1) == 1);
  CHECK(t.take_error(2, &which) == "connection closed" && which == 2);
  t.lost(0, "nothing was in flight");  // no work lost, no error
  CHECK(!t.has_error(0));
  RmaChunk done;
  CHECK(t.finish(keep, 1, &done));
  CHECK(t.in_flight(-1) == 0);
}

// Random takes and completions (in posting order per peer, as RC delivers them, with the
// peers interleaved arbitrarily) against a plain model: counts, freedom, READ destinations.
static void tracker_model() {
  std::mt19937 rng(36);
  const int peers = 4;
  const uint32_t chunks = 8;
  RmaTracker t(chunks, peers);
  std::vector<std::vector<std::pair<uint32_t, RmaChunk>>> fifo(peers);  // per peer, posting order
  std::vector<char> sink(64);
  uint32_t model_busy = 0;
  for (int step = 0; step < 20000; step++) {
    const int p = static_cast<int>(rng() % peers);
    if (rng() % 2 && t.has_free()) {
      const RmaOp op = rng() % 2 ? RmaOp::READ : RmaOp::WRITE;
      const RmaChunk c{p, op, op == RmaOp::READ ? &sink[rng() % 64] : nullptr, 1 + static_cast<uint32_t>(rng() % 1000)};
      const uint32_t k = t.take(c);
      CHECK(k < chunks);
      for (auto& f : fifo)
        for (auto& [used, _] : f) CHECK(used != k);  // never a chunk still in flight
      fifo[p].push_back({k, c});
      model_busy++;
    } else if (!fifo[p].empty()) {
      auto [k, c] = fifo[p].front();
      fifo[p].erase(fifo[p].begin());
      RmaChunk done;
      CHECK(t.finish(k, p, &done));
      CHECK(done.peer == p && done.op == c.op && done.dst == c.dst && done.len == c.len);
      model_busy--;
    }
    uint32_t reads = 0;
    for (const auto& [_, c] : fifo[p]) reads += c.op == RmaOp::READ;
    CHECK(t.in_flight(p) == fifo[p].size() && t.reads_in_flight(p) == reads);
    CHECK(t.in_flight(-1) == model_busy && t.has_free() == (model_busy < chunks));
  }
}

int main() {
  keys();
  work_request_ids();
  pieces();
  tracker_basics();
  tracker_failures();
  tracker_model();
  std::printf("window_verbs_plan: all checks passed\n");
  return 0;
}
