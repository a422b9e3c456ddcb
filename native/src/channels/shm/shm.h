// Shared memory between the ranks of one host. Each rank creates one segment holding its
// inbound rings (one per local peer and stream), two publication slots for the direct
// algorithms, and a futex doorbell; every local rank maps every other rank's segment.
#pragma once

#include <atomic>
#include <string>
#include <vector>

#include "channels/channel.h"

namespace comm {

constexpr size_t kSlotBytes = 256 << 10;      // direct-path publication slot (per rank, x2)
// Ring-buffer of collective traffic per peer. Several chunks (COMM_CHUNK_BYTES) deep, so a
// sender is not held to its receiver's pace chunk by chunk. Beyond 8 local peers the rings
// share kCollRingBudget instead (never below kCollRingMin, two chunks deep), so a rank's
// segment grows with its local peers by about 0.6 MiB each, not 2: 16 ranks per host would
// otherwise map 16 x 36 MiB each. See native/TUNING.md, "Shared-memory rings".
constexpr size_t kCollRingBytes = 2 << 20;
constexpr size_t kCollRingBudget = 16 << 20;
constexpr size_t kCollRingMin = 512 << 10;
constexpr size_t kP2PRingBytes = 128 << 10;   // ring-buffer of send/recv traffic per peer

struct alignas(64) SegHeader {
  std::atomic<uint32_t> doorbell;  // futex word: bumped to wake the owner
  std::atomic<uint32_t> sleeping;  // how many of the owner's threads are (about to be) asleep
  uint64_t pid;
  uint64_t probe_addr;             // address of a known word in the owner's private memory
  alignas(64) std::atomic<uint64_t> round;  // last direct-path round the owner reached
};

// Per-round publication of a direct algorithm: the op's signature plus, for the
// single-copy (CMA) path, the addresses of the owner's user buffers.
struct alignas(64) Slot {
  WireHeader hdr;
  uint64_t send_addr;
  uint64_t recv_addr;
  uint32_t choice;  // local rank 0's: which algorithm this op runs (local_all_reduce)
};
constexpr size_t kSlotHeaderBytes = 128;
static_assert(sizeof(Slot) <= kSlotHeaderBytes, "slot header layout");

struct alignas(64) RingCtl {
  std::atomic<uint64_t> head;               // bytes ever written (producer)
  alignas(64) std::atomic<uint64_t> tail;   // bytes ever read (consumer)
};
constexpr size_t kRingHeaderBytes = 128;

class ShmDomain {
 public:
  // local_ranks: the sorted global ranks on this host, including `rank`.
  ShmDomain(int rank, std::vector<int> local_ranks);
  ~ShmDomain();
  ShmDomain(const ShmDomain&) = delete;
  ShmDomain& operator=(const ShmDomain&) = delete;

  // The segment is anonymous (memfd): no name exists that could outlive the job, whatever
  // way its ranks end. Peers map it through /proc/<pid>/fd/<fd> of the creator, which
  // holds the descriptor until the domain is destroyed. Returns that descriptor.
  int create();
  void attach(int global_rank, int pid, int fd);

  int local_size() const { return static_cast<int>(ranks_.size()); }
  int me() const { return me_; }
  int global(int local) const { return ranks_[local]; }
  int local_index(int global_rank) const;  // -1 if not on this host

  SegHeader* seg(int local) const { return reinterpret_cast<SegHeader*>(bases_[local]); }
  Slot* slot(int local, uint64_t round) const;
  char* slot_data(int local, uint64_t round) const {
    return reinterpret_cast<char*>(slot(local, round)) + kSlotHeaderBytes;
  }
  RingCtl* ring(int owner, int from, Stream s) const;
  char* ring_data(int owner, int from, Stream s) const {
    return reinterpret_cast<char*>(ring(owner, from, s)) + kRingHeaderBytes;
  }
  size_t ring_capacity(Stream s) const { return s == Stream::COLL ? coll_ring_ : kP2PRingBytes; }

  // Wake local rank `local` if it sleeps on its doorbell (call after publishing data).
  void wake(int local) const;
  void wake_all_peers() const;
  // Sleep on this rank's doorbell unless ready() holds; returns after a wake or timeout_ms.
  template <class Ready>
  void sleep(Ready ready, int timeout_ms) const {
    SegHeader* h = seg(me_);
    uint32_t bell = h->doorbell.load(std::memory_order_acquire);
    // A count, not a flag: the collective thread and the p2p driver may both sleep here.
    h->sleeping.fetch_add(1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (!ready()) futex_wait(&h->doorbell, bell, timeout_ms);
    h->sleeping.fetch_sub(1, std::memory_order_relaxed);
  }
  void interrupt() const;  // wake this rank's own sleeper (abort)

  // Whether process_vm_readv can read local peer `local`'s memory (single-copy path).
  bool probe_cma(int local) const;

 private:
  static void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int timeout_ms);
  size_t segment_bytes() const;
  size_t peer_ring_stride() const;
  int rank_;
  std::vector<int> ranks_;
  size_t coll_ring_;  // bytes of each collective ring: kCollRingBytes, less with many local ranks
  int me_ = -1;
  std::vector<char*> bases_;
  int fd_ = -1;  // this rank's segment
};

// Byte-stream channel to one local peer through the SPSC rings of the two segments.
class ShmChannel final : public Channel {
 public:
  ShmChannel(const ShmDomain& shm, int peer_global, Stream s);
  bool progress(Transfer& t) override;
  bool ready(const Transfer& t) const override;
  const std::vector<int>& sockets() const override { return no_sockets_; }

 private:
  bool push(Transfer& t);
  bool pull(Transfer& t);
  const ShmDomain& shm_;
  int peer_local_;
  RingCtl* out_;
  char* out_data_;
  RingCtl* in_;
  char* in_data_;
  size_t cap_;
  const std::vector<int> no_sockets_;
};

}  // namespace comm
