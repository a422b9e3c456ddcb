#include "windows/window_verbs_plan.h"

#include <arpa/inet.h>

#include <cstring>
#include <stdexcept>

namespace comm::verbs {

namespace {

constexpr char kKeyMagic[4] = {'C', 'V', 'R', '1'};

void put_be64(char* at, uint64_t v) {
  const uint32_t hi = htonl(static_cast<uint32_t>(v >> 32)), lo = htonl(static_cast<uint32_t>(v));
  std::memcpy(at, &hi, 4);
  std::memcpy(at + 4, &lo, 4);
}

uint64_t get_be64(const char* at) {
  uint32_t hi, lo;
  std::memcpy(&hi, at, 4);
  std::memcpy(&lo, at + 4, 4);
  return uint64_t{ntohl(hi)} << 32 | ntohl(lo);
}

}  // namespace

std::string encode_rma_key(const RmaKey& k) {
  std::string out(kRmaKeyBytes, '\0');
  std::memcpy(&out[0], kKeyMagic, 4);
  put_be64(&out[4], k.addr);
  put_be64(&out[12], k.size);
  const uint32_t rkey = htonl(k.rkey);
  std::memcpy(&out[20], &rkey, 4);
  return out;
}

bool decode_rma_key(const std::string& data, RmaKey* out, std::string* why) {
  if (data.size() != kRmaKeyBytes || std::memcmp(data.data(), kKeyMagic, 4) != 0) {
    *why = "not a verbs window key of this version (" + std::to_string(data.size()) + " bytes)";
    return false;
  }
  RmaKey k;
  k.addr = get_be64(data.data() + 4);
  k.size = get_be64(data.data() + 12);
  uint32_t rkey;
  std::memcpy(&rkey, data.data() + 20, 4);
  k.rkey = ntohl(rkey);
  if (k.addr + k.size < k.addr) {
    *why = "a window range that wraps around the address space";
    return false;
  }
  *out = k;
  return true;
}

bool rma_fits(const RmaKey& k, uint64_t offset, uint64_t len) { return offset <= k.size && len <= k.size - offset; }

uint64_t rma_wr_id(uint32_t window, uint32_t chunk) {
  if (window > kMaxRmaWindowId) throw std::invalid_argument("window id past the work-request id's field");
  return kRmaWrTag | uint64_t{window} << 32 | chunk;
}

uint64_t piece_count(uint64_t len, uint32_t chunk_bytes) { return len / chunk_bytes + (len % chunk_bytes != 0); }

Piece piece(uint64_t len, uint32_t chunk_bytes, uint64_t i) {
  if (i >= piece_count(len, chunk_bytes)) throw std::out_of_range("no such piece");
  const uint64_t at = i * chunk_bytes;
  const uint64_t left = len - at;
  return {at, static_cast<uint32_t>(left < chunk_bytes ? left : chunk_bytes)};
}

RmaTracker::RmaTracker(uint32_t chunks, int peers) {
  if (chunks == 0 || peers <= 0) throw std::invalid_argument("an RMA tracker needs chunks and peers");
  slots_.resize(chunks);
  for (uint32_t i = chunks; i-- > 0;) free_.push_back(i);  // chunk 0 is taken first
  busy_.assign(peers, 0);
  reads_.assign(peers, 0);
  errors_.assign(peers, "");
}

uint32_t RmaTracker::take(const RmaChunk& c) {
  if (free_.empty()) throw std::logic_error("no free staging chunk");
  if (c.peer < 0 || static_cast<size_t>(c.peer) >= busy_.size()) throw std::invalid_argument("no such peer");
  const uint32_t i = free_.back();
  free_.pop_back();
  slots_[i] = {true, c};
  busy_[c.peer]++;
  if (c.op == RmaOp::READ) reads_[c.peer]++;
  return i;
}

bool RmaTracker::finish(uint32_t i, int peer, RmaChunk* done) {
  if (i >= slots_.size() || !slots_[i].busy || slots_[i].c.peer != peer) return false;
  *done = slots_[i].c;
  untake(i);
  return true;
}

void RmaTracker::untake(uint32_t i) {
  Slot& s = slots_.at(i);
  if (!s.busy) throw std::logic_error("staging chunk is not taken");
  busy_[s.c.peer]--;
  if (s.c.op == RmaOp::READ) reads_[s.c.peer]--;
  s = Slot{};
  free_.push_back(i);
}

uint32_t RmaTracker::in_flight(int peer) const {
  if (peer >= 0) return busy_.at(peer);
  uint32_t n = 0;
  for (uint32_t b : busy_) n += b;
  return n;
}

uint32_t RmaTracker::reads_in_flight(int peer) const { return reads_.at(peer); }

void RmaTracker::abandon(int peer) {
  for (Slot& s : slots_)
    if (s.busy && (peer < 0 || s.c.peer == peer)) s.c.dst = nullptr;
}

void RmaTracker::lost(int peer, const std::string& why) {
  bool any = false;
  for (uint32_t i = 0; i < slots_.size(); i++)
    if (slots_[i].busy && slots_[i].c.peer == peer) untake(i), any = true;
  if (any) failed(peer, why);
}

void RmaTracker::failed(int peer, const std::string& why) {
  if (errors_.at(peer).empty()) errors_[peer] = why;
}

std::string RmaTracker::take_error(int peer, int* which) {
  for (size_t p = 0; p < errors_.size(); p++) {
    if ((peer >= 0 && p != static_cast<size_t>(peer)) || errors_[p].empty()) continue;
    std::string why;
    why.swap(errors_[p]);
    *which = static_cast<int>(p);
    return why;
  }
  return "";
}

bool RmaTracker::has_error(int peer) const {
  for (size_t p = 0; p < errors_.size(); p++)
    if ((peer < 0 || p == static_cast<size_t>(peer)) && !errors_[p].empty()) return true;
  return false;
}

}  // namespace comm::verbs
