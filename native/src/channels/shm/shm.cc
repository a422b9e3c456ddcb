#include "channels/shm/shm.h"

#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>

#include "channels/shm/memfd.h"

namespace comm {

namespace {
// A word in private memory that peers read with process_vm_readv to prove CMA works.
const uint64_t kProbeValue = 0x636d612d70726f62ull;
volatile uint64_t probe_word = kProbeValue;

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }
constexpr size_t kSegHeaderBytes = 256;
constexpr size_t kSlotStride = kSlotHeaderBytes + kSlotBytes;

// Segments up to this size (up to 63 local ranks) are allocated and mapped in full at set-up:
// left to fault in, a ring's first pass is several times slower, which benchmarks and short
// jobs see as the library's speed (see native/TUNING.md, "Shared memory in place at set-up").
// Larger segments fault in as used.
constexpr size_t kPopulateMaxBytes = 40 << 20;

// Within kPopulateMaxBytes a segment is allocated at creation (so a host short of shared
// memory fails there, clearly, not with SIGBUS at some later page fault) and mapped with its
// page tables filled in, by its creator and by every peer.
bool whole_now(size_t bytes) { return bytes <= kPopulateMaxBytes; }

// Every local rank computes the same size from the same count (attach checks the segment's).
size_t coll_ring_bytes(size_t local_ranks) {
  const size_t peers = local_ranks > 1 ? local_ranks - 1 : 1;
  if (peers * kCollRingBytes <= kCollRingBudget) return kCollRingBytes;
  return std::max(kCollRingMin, kCollRingBudget / peers / 4096 * 4096);
}
}  // namespace

ShmDomain::ShmDomain(int rank, std::vector<int> local_ranks)
    : rank_(rank), ranks_(std::move(local_ranks)), coll_ring_(coll_ring_bytes(ranks_.size())),
      bases_(ranks_.size(), nullptr) {
  me_ = local_index(rank);
}

ShmDomain::~ShmDomain() {
  for (char* b : bases_)
    if (b) munmap(b, segment_bytes());
  if (fd_ >= 0) close(fd_);
}

size_t ShmDomain::peer_ring_stride() const { return 2 * kRingHeaderBytes + coll_ring_ + kP2PRingBytes; }

size_t ShmDomain::segment_bytes() const {
  return round_up(kSegHeaderBytes + 2 * kSlotStride + ranks_.size() * peer_ring_stride(), 4096);
}

int ShmDomain::local_index(int global_rank) const {
  auto it = std::find(ranks_.begin(), ranks_.end(), global_rank);
  return it == ranks_.end() ? -1 : static_cast<int>(it - ranks_.begin());
}

int ShmDomain::create() {
  const size_t bytes = segment_bytes();
  MemfdOptions o;
  o.reserve = o.populate = whole_now(bytes);
  const Memfd m = create_memfd("comm-shm", bytes, o, "allocating " + std::to_string(bytes >> 20) + " MiB of shared memory");
  fd_ = m.fd;
  bases_[me_] = m.base;
  SegHeader* h = seg(me_);  // fresh pages are zero: atomics start at 0
  h->pid = static_cast<uint64_t>(getpid());
  h->probe_addr = reinterpret_cast<uint64_t>(&probe_word);
  return fd_;
}

void ShmDomain::attach(int global_rank, int pid, int fd) {
  int local = local_index(global_rank);
  if (local < 0 || local == me_) return;
  // SYSTEM on a size mismatch: every rank computes the size from the same local rank count,
  // so only a bug or a descriptor the peer reused can cause it.
  PeerMemfd peer{global_rank, pid, fd, "shared memory", segment_bytes()};
  peer.populate = whole_now(peer.bytes);
  bases_[local] = map_peer_memfd(peer).base;
}

Slot* ShmDomain::slot(int local, uint64_t round) const {
  return reinterpret_cast<Slot*>(bases_[local] + kSegHeaderBytes + (round & 1) * kSlotStride);
}

RingCtl* ShmDomain::ring(int owner, int from, Stream s) const {
  size_t off = kSegHeaderBytes + 2 * kSlotStride + static_cast<size_t>(from) * peer_ring_stride();
  if (s == Stream::P2P) off += kRingHeaderBytes + coll_ring_;
  return reinterpret_cast<RingCtl*>(bases_[owner] + off);
}

void ShmDomain::futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int timeout_ms) {
  timespec ts{timeout_ms / 1000, (timeout_ms % 1000) * 1000000L};
  // Not FUTEX_PRIVATE: the word lives in memory shared between processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void ShmDomain::wake(int local) const {
  SegHeader* h = seg(local);
  // Pairs with the fence in sleep(): either we see `sleeping`, or the sleeper sees our data.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (h->sleeping.load(std::memory_order_relaxed)) {
    h->doorbell.fetch_add(1, std::memory_order_release);
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&h->doorbell), FUTEX_WAKE, INT_MAX, nullptr,
            nullptr, 0);
  }
}

void ShmDomain::wake_all_peers() const {
  for (int i = 0; i < local_size(); i++)
    if (i != me_) wake(i);
}

void ShmDomain::interrupt() const {
  SegHeader* h = seg(me_);
  h->doorbell.fetch_add(1, std::memory_order_release);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&h->doorbell), FUTEX_WAKE, INT_MAX, nullptr,
          nullptr, 0);
}

bool ShmDomain::probe_cma(int local) const {
  const SegHeader* h = seg(local);
  uint64_t value = 0;
  return read_process(static_cast<int>(h->pid), h->probe_addr, &value, sizeof value) && value == kProbeValue;
}

ShmChannel::ShmChannel(const ShmDomain& shm, int peer_global, Stream s)
    : Channel(peer_global), shm_(shm), peer_local_(shm.local_index(peer_global)),
      out_(shm.ring(peer_local_, shm.me(), s)), out_data_(shm.ring_data(peer_local_, shm.me(), s)),
      in_(shm.ring(shm.me(), peer_local_, s)), in_data_(shm.ring_data(shm.me(), peer_local_, s)),
      cap_(shm.ring_capacity(s)) {}

bool ShmChannel::progress(Transfer& t) { return t.is_send ? push(t) : pull(t); }

bool ShmChannel::ready(const Transfer& t) const {
  if (t.is_send)
    return out_->head.load(std::memory_order_relaxed) - out_->tail.load(std::memory_order_acquire) < cap_;
  return in_->head.load(std::memory_order_acquire) != in_->tail.load(std::memory_order_relaxed);
}

// Header and payload go into the ring together and are published with one store.
bool ShmChannel::push(Transfer& t) {
  const uint64_t head = out_->head.load(std::memory_order_relaxed);
  const uint64_t tail = out_->tail.load(std::memory_order_acquire);
  size_t space = cap_ - static_cast<size_t>(head - tail);
  size_t pos = head;
  auto put = [&](const char* src, size_t n) {
    size_t off = pos % cap_, first = std::min(n, cap_ - off);
    std::memcpy(out_data_ + off, src, first);
    std::memcpy(out_data_, src + first, n - first);
    pos += n;
    space -= n;
  };
  if (t.with_header && t.hdr_done < sizeof(WireHeader)) {
    size_t n = std::min(space, sizeof(WireHeader) - t.hdr_done);
    put(reinterpret_cast<const char*>(&t.hdr) + t.hdr_done, n);
    t.hdr_done += n;
  }
  if (t.header_complete() && t.done < t.len && space > 0) {
    size_t n = std::min(space, t.len - t.done);
    put(t.buf + t.done, n);
    t.done += n;
  }
  if (pos == head) return false;
  out_->head.store(pos, std::memory_order_release);
  shm_.wake(peer_local_);
  return true;
}

bool ShmChannel::pull(Transfer& t) {
  const uint64_t tail = in_->tail.load(std::memory_order_relaxed);
  const uint64_t head = in_->head.load(std::memory_order_acquire);
  size_t avail = static_cast<size_t>(head - tail);
  if (avail == 0) return false;
  size_t pos = tail;
  auto get = [&](char* dst, size_t n) {
    size_t off = pos % cap_, first = std::min(n, cap_ - off);
    std::memcpy(dst, in_data_ + off, first);
    std::memcpy(dst + first, in_data_, n - first);
    pos += n;
    avail -= n;
  };
  if (t.with_header && t.hdr_done < sizeof(WireHeader)) {
    size_t n = std::min(avail, sizeof(WireHeader) - t.hdr_done);
    get(reinterpret_cast<char*>(&t.got) + t.hdr_done, n);
    t.hdr_done += n;
    if (t.hdr_done == sizeof(WireHeader)) accept_header(t, peer_);
  }
  if (t.header_complete() && t.done < t.len && avail > 0) {
    size_t n = std::min(avail, t.len - t.done);
    if (t.drain) {
      pos += n;
      avail -= n;
    } else {
      get(t.buf + t.done, n);
    }
    t.done += n;
  }
  if (pos == tail) return false;
  in_->tail.store(pos, std::memory_order_release);
  shm_.wake(peer_local_);  // the producer may be waiting for space
  return true;
}

}  // namespace comm
