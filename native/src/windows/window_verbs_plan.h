// The device-free parts of windows over verbs RMA (window_verbs.h): the key a rank publishes
// for its window, the work-request ids that tell an RMA completion from the channel's own,
// the cutting of a put or get into staging chunks, and the accounting of chunks in flight.
// Built everywhere and checked by native/tests/window_verbs_plan_test.cc on machines without
// an RDMA device or rdma-core's headers (as verbs_wire.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace comm::verbs {

// ---- the key (exchanged at the window's creation through the store: untrusted bytes) ----------
// What a peer needs to RDMA WRITE / READ this rank's window: its address, its size and the
// rkey of its registration. A window of 0 bytes is not registered: rkey 0, nothing reaches it.
struct RmaKey {
  uint64_t addr = 0;
  uint64_t size = 0;
  uint32_t rkey = 0;
};
constexpr size_t kRmaKeyBytes = 4 + 8 + 8 + 4;  // magic, addr, size, rkey (network byte order)

std::string encode_rma_key(const RmaKey& k);
// False (with *why set) unless `data` is a key of this version whose range does not wrap.
bool decode_rma_key(const std::string& data, RmaKey* out, std::string* why);
// Whether [offset, offset + len) lies inside the window the key describes (no overflow).
bool rma_fits(const RmaKey& k, uint64_t offset, uint64_t len);

// ---- work-request ids ----------------------------------------------------------------------------
// RMA work requests share the p2p stream's queue pair with the channel's own (whose ids are
// small numbers): bit 63 marks them, bits 32-62 name the window, bits 0-31 its staging chunk.
constexpr uint64_t kRmaWrTag = uint64_t{1} << 63;
constexpr uint32_t kMaxRmaWindowId = (1u << 31) - 1;
uint64_t rma_wr_id(uint32_t window, uint32_t chunk);  // throws std::invalid_argument past kMaxRmaWindowId
inline bool is_rma_wr(uint64_t wr_id) { return (wr_id & kRmaWrTag) != 0; }
inline uint32_t rma_wr_window(uint64_t wr_id) { return static_cast<uint32_t>((wr_id & ~kRmaWrTag) >> 32); }
inline uint32_t rma_wr_chunk(uint64_t wr_id) { return static_cast<uint32_t>(wr_id); }

// ---- chunks ------------------------------------------------------------------------------------
// A put or get of `len` bytes moves in ceil(len / chunk_bytes) work requests, piece i covering
// [i * chunk_bytes, min(len, (i + 1) * chunk_bytes)) of it; 0 bytes are no piece.
struct Piece {
  uint64_t at;   // offset inside the transfer
  uint32_t len;  // 1..chunk_bytes
};
uint64_t piece_count(uint64_t len, uint32_t chunk_bytes);
Piece piece(uint64_t len, uint32_t chunk_bytes, uint64_t i);  // throws std::out_of_range past the last

// ---- staging chunks in flight ----------------------------------------------------------------
// A window stages every put (the source is copied in: the engine does not track the user's
// memory past the call, verbs.cc says why) and every get (the READ lands there, then is
// copied out) in `chunks` registered chunks. A chunk is busy from its post until its
// completion, which RC delivers in posting order per queue pair; a READ's completion hands
// back its destination for the copy. A failed completion (or a queue pair that closed with
// work in flight) is kept per peer for the next flush to report.
enum class RmaOp : uint8_t { WRITE, READ };

struct RmaChunk {
  int peer = -1;
  RmaOp op = RmaOp::WRITE;
  char* dst = nullptr;  // READ: where its bytes go once it completed; null: nowhere (abandoned)
  uint32_t len = 0;
};

class RmaTracker {
 public:
  RmaTracker(uint32_t chunks, int peers);  // throws std::invalid_argument for 0 chunks or peers
  uint32_t chunks() const { return static_cast<uint32_t>(slots_.size()); }
  bool has_free() const { return !free_.empty(); }
  // A free chunk for `c` (has_free() first; throws std::logic_error otherwise).
  uint32_t take(const RmaChunk& c);
  // The completion of chunk `i` on the queue pair to `peer`: false when it is not in flight
  // to that peer (a stray id: the caller treats it as corruption). *done gets its record; the
  // chunk is free again (copy a READ out before staging anything else in it).
  bool finish(uint32_t i, int peer, RmaChunk* done);
  // A post that failed: the chunk goes back as if it had never been taken.
  void untake(uint32_t i);
  uint32_t in_flight(int peer) const;  // peer -1: all peers
  uint32_t reads_in_flight(int peer) const;
  // A flush gave up (timeout, Ctrl-C): the READs to `peer` (-1: all) still in flight copy
  // nowhere when they complete, since their destinations may be gone by then.
  void abandon(int peer);
  // The queue pair to `peer` is gone with work in flight: its chunks are free (no completion
  // will come) and `why` is kept for the next flush.
  void lost(int peer, const std::string& why);
  void failed(int peer, const std::string& why);  // keeps the first reason
  // The first failure to `peer` (-1: any) not yet reported, cleared by reading it ("" if none).
  std::string take_error(int peer, int* which);
  bool has_error(int peer) const;

 private:
  struct Slot {
    bool busy = false;
    RmaChunk c;
  };
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_;  // chunk indices, the next one taken last
  std::vector<uint32_t> busy_, reads_;  // per peer
  std::vector<std::string> errors_;     // per peer, "" none
};

}  // namespace comm::verbs
